"""scripts/convert_to_gguf.py on a mixture-of-experts model: a GGUF file with llama.cpp's qwen3moe architecture,
which the pinned llama-cpp-python loads and computes our logits with; what that graph does not compute (routing
weights that are not renormalised) is refused in one line naming the switch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from model.config import MiniNormConfig
from model.model import MiniNormForCausalLM
from scripts.convert_to_gguf import convert_to_gguf, main
from trainer.export import save_model_dir
from tests.llama_cpp_reference import llama_cpp_logits

TEXT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n北京是首都。"


def _moe_dir(tokenizer, folder, **overrides):
    torch.manual_seed(0)
    fields = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, norm_impl="eager", qk_norm=True,
                  num_experts=4, num_experts_per_tok=1, norm_topk_prob=True, moe_intermediate_size=48,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = MiniNormForCausalLM(MiniNormConfig(**{**fields, **overrides}))
    with torch.no_grad():  # gains away from 1; the router's logits spread so that each expert gets tokens
        for name, parameter in model.named_parameters():
            parameter.add_((1.0 if name.endswith("mlp.gate.weight") else 0.1) * torch.randn_like(parameter))
    save_model_dir(model.eval(), tokenizer, folder)
    return folder, model.eval()


def test_the_file_is_llama_cpps_qwen3moe(tokenizer, tmp_path) -> None:
    folder, _ = _moe_dir(tokenizer, tmp_path / "moe", num_experts_per_tok=2)
    reader = GGUFReader(convert_to_gguf(folder, tmp_path / "moe.gguf", "f32"))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == "qwen3moe"
    assert (field("qwen3moe.expert_count"), field("qwen3moe.expert_used_count")) == (4, 2)
    assert field("qwen3moe.expert_feed_forward_length") == 48
    shapes = {tensor.name: tuple(int(n) for n in tensor.shape) for tensor in reader.tensors}  # ggml order
    assert shapes["blk.1.ffn_gate_inp.weight"] == (64, 4)
    assert shapes["blk.1.ffn_gate_exps.weight"] == shapes["blk.1.ffn_up_exps.weight"] == (64, 48, 4)
    assert shapes["blk.1.ffn_down_exps.weight"] == (48, 64, 4)
    assert "blk.0.attn_k_norm.weight" in shapes and not any(".ffn_gate.weight" in name for name in shapes)


@pytest.mark.parametrize("top_k", [1, 2], ids=["top1", "top2"])
def test_llama_cpp_computes_our_logits(tokenizer, tmp_path, top_k: int) -> None:
    folder, ours = _moe_dir(tokenizer, tmp_path / "moe", num_experts_per_tok=top_k)
    path = convert_to_gguf(folder, tmp_path / "moe-f32.gguf", "f32")
    ids = tokenizer(TEXT)["input_ids"]
    with torch.no_grad():
        out = ours(torch.tensor([ids]))
    expected = out.logits[0].numpy()
    # Every expert takes tokens here, so an expert stacked at the wrong index would show.
    assert torch.cat(out.router_logits).topk(top_k, dim=-1).indices.unique().tolist() == [0, 1, 2, 3]
    got = llama_cpp_logits(path, ids)
    assert np.abs(got - expected).max() < 1e-4
    assert (got.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize(("overrides", "switch", "why"), [
    (dict(norm_topk_prob=False), "norm_topk_prob=False", "renormalises the top-k routing weights"),
    (dict(qk_norm=False), "qk_norm=False", "Qwen3-MoE"),
    (dict(norm_placement="post"), "norm_placement='post'", "pre-LN"),
])
def test_what_llama_cpp_cannot_compute_is_refused_naming_the_switch(tokenizer, tmp_path, capsys, overrides, switch,
                                                                    why) -> None:
    folder, _ = _moe_dir(tokenizer, tmp_path / "moe", **overrides)
    capsys.readouterr()
    assert main(["--model_path", str(folder), "--outfile", str(tmp_path / "m.gguf")]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and switch in error and why in error and "GGUF" in error, error
    assert not (tmp_path / "m.gguf").exists()
