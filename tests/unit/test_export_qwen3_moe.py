"""scripts/convert_to_llama.py --target qwen3_moe: a MiniNorm mixture-of-experts model with Qwen3's switches is a
stock transformers Qwen3MoeForCausalLM with our logits; what Qwen3-MoE cannot express is refused in one line
naming the switch."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

from model.config import MiniNormConfig
from model.model import MiniNormForCausalLM
from scripts.convert_to_llama import convert_to_llama, main
from trainer.export import save_model_dir


def moe_dir(tokenizer, folder, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny MoE model directory with every weight perturbed (norm gains too) and the router's logits spread
    (it starts near zero, where a rounding difference could change an expert choice), saved in `dtype`."""
    torch.manual_seed(seed)
    fields = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, norm_impl="eager", rope_theta=5e4,
                  qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = MiniNormForCausalLM(MiniNormConfig(**{**fields, **overrides}))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.add_((1.0 if name.endswith("mlp.gate.weight") else 0.1) * torch.randn_like(parameter))
    save_model_dir(model.to(dtype).eval(), tokenizer, folder)
    return folder


@pytest.mark.parametrize(("top_k", "renormalise", "tied"), [(1, True, True), (2, False, False), (3, True, True)],
                         ids=["top1-renormalised", "top2-untied", "top3"])
def test_qwen3_moe_export_has_our_logits(tokenizer, tmp_path, top_k: int, renormalise: bool, tied: bool) -> None:
    source = moe_dir(tokenizer, tmp_path / "moe", num_experts_per_tok=top_k, norm_topk_prob=renormalise,
                     tie_word_embeddings=tied, router_z_loss_coef=0.01)
    out = convert_to_llama(source, tmp_path / "qwen3_moe", target="qwen3_moe")
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs) is Qwen3MoeForCausalLM
    ours = MiniNormForCausalLM.from_pretrained(source).eval()
    ids = torch.randint(0, len(tokenizer), (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        mine, ref = ours(ids), theirs(ids, output_router_logits=True)
    torch.testing.assert_close(ref.logits, mine.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(ref.router_logits[1], mine.router_logits[1], atol=1e-5, rtol=0)
    # Every expert was routed to in the check, so a misplaced expert's weights would show.
    chosen = torch.cat(mine.router_logits).topk(top_k, dim=-1).indices.unique()
    assert chosen.tolist() == [0, 1, 2, 3]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (4, top_k, 48)
    assert (config["norm_topk_prob"], config["decoder_sparse_step"], config["mlp_only_layers"]) == (renormalise, 1, [])
    assert config["tie_word_embeddings"] is tied and config["rope_theta"] == 5e4
    with safe_open(out / "model.safetensors", "pt") as weights:  # Qwen3-MoE's published layout: one key per expert
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in weights.keys()


def test_greedy_generation_of_the_export_is_ours(tokenizer, tmp_path) -> None:
    """transformers' generate on the export (its own KV cache) continues a prompt as ours does."""
    source = moe_dir(tokenizer, tmp_path / "moe", seed=3, num_experts_per_tok=1, norm_topk_prob=True)
    theirs = AutoModelForCausalLM.from_pretrained(convert_to_llama(source, tmp_path / "out", target="qwen3_moe"))
    ours = MiniNormForCausalLM.from_pretrained(source).eval()
    prompt = torch.tensor([tokenizer("<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n")["input_ids"]])
    settings = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(theirs.eval().generate(prompt, **settings), ours.generate(prompt, **settings))


@pytest.mark.parametrize(("target", "overrides", "switch", "hint"), [
    ("qwen3_moe", dict(num_experts=0), "num_experts=0", "--target qwen3"),
    ("qwen3", dict(), "num_experts=4", "--target qwen3_moe"),
    ("llama", dict(qk_norm=False), "num_experts=4", "not a mixture of experts"),
    ("qwen3_moe", dict(qk_norm=False), "qk_norm=False", "queries and keys"),
    ("qwen3_moe", dict(qk_norm_scope="full"), "qk_norm_scope='full'", "each head"),
    ("qwen3_moe", dict(norm_type="dyt"), "norm_type='dyt'", "RMSNorm"),
    ("qwen3_moe", dict(norm_placement="peri"), "norm_placement='sandwich'", "pre-LN"),
    ("qwen3_moe", dict(norm_affine=False), "norm_affine=False", "gain"),
])
def test_each_switch_qwen3_moe_cannot_express_is_named(tokenizer, tmp_path, capsys, target, overrides, switch,
                                                       hint) -> None:
    source = moe_dir(tokenizer, tmp_path / "model", **overrides)
    capsys.readouterr()  # the progress bar of writing the model
    assert main(["--model_path", str(source), "--out_dir", str(tmp_path / "out"), "--target", target]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and switch in error and hint in error, error
    assert {"qwen3_moe": "Qwen3-MoE", "qwen3": "Qwen3", "llama": "Llama"}[target] in error
    assert not (tmp_path / "out").exists()


def test_an_expert_width_transformers_grouped_mm_cannot_run_is_one_line(tokenizer, tmp_path, capsys) -> None:
    """moe_intermediate_size=81 (a randomized parity sweep's failing config) exports correctly, but stock
    transformers' default experts (grouped_mm) cannot run it: its rows are not a multiple of 16 bytes. The
    verification's crash was a RuntimeError traceback; it is one line naming the width and the way out, and
    nothing is written. --no_verify writes it, and transformers' eager experts give our logits."""
    source = moe_dir(tokenizer, tmp_path / "moe", moe_intermediate_size=81)
    capsys.readouterr()
    assert main(["--model_path", str(source), "--out_dir", str(tmp_path / "out"), "--target", "qwen3_moe"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    assert "strides should be multiple of 16 bytes" in error and "moe_intermediate_size=81" in error, error
    assert "experts_implementation='eager'" in error and "nothing written" in error, error
    assert not (tmp_path / "out").exists()
    out = convert_to_llama(source, tmp_path / "out", verify=False, target="qwen3_moe")
    theirs = AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager").eval()
    ours = MiniNormForCausalLM.from_pretrained(source, norm_impl="eager").eval()
    ids = torch.randint(0, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, atol=1e-5, rtol=0)


def test_a_bf16_expert_width_grouped_mm_runs_only_in_fp32_is_one_line(tokenizer, tmp_path, capsys) -> None:
    """moe_intermediate_size=84 is 16 bytes of fp32 values but not of bf16 ones: the fp32 logits check of a bf16
    model ran, and the export was written, yet stock transformers loads it in its own bf16 (dtype="auto"), where its
    grouped_mm experts cannot run it. The check now also runs the export as loaded: one line naming the width,
    nothing written. The same width in fp32 exports, and transformers runs it as loaded."""
    source = moe_dir(tokenizer, tmp_path / "bf16", moe_intermediate_size=84, dtype=torch.bfloat16)
    capsys.readouterr()
    assert main(["--model_path", str(source), "--out_dir", str(tmp_path / "out"), "--target", "qwen3_moe"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    assert "strides should be multiple of 16 bytes" in error and "moe_intermediate_size=84" in error, error
    assert "nothing written" in error and not (tmp_path / "out").exists()
    out = convert_to_llama(moe_dir(tokenizer, tmp_path / "fp32", moe_intermediate_size=84), tmp_path / "out32",
                           target="qwen3_moe")
    with torch.no_grad():
        AutoModelForCausalLM.from_pretrained(out).eval()(torch.arange(8).unsqueeze(0))
