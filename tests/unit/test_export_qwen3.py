"""scripts/convert_to_llama.py --target qwen3: a MiniNorm model with per-head QK-norm is a stock Qwen3ForCausalLM
with our logits; each target's refusal names the switch that prevents it. Also export and import round trips."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

from model.config import MiniNormConfig
from model.model import MiniNormForCausalLM
from scripts.convert_to_llama import convert_to_llama, main
from scripts.import_checkpoint import import_checkpoint
from trainer.export import save_model_dir


def model_dir(tokenizer, folder, seed: int = 0, **overrides):
    """A tiny MiniNorm model directory (as the trainer writes it) with every weight perturbed, norm gains too."""
    torch.manual_seed(seed)
    fields = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, norm_impl="eager", rope_theta=5e4,
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = MiniNormForCausalLM(MiniNormConfig(**{**fields, **overrides}))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    save_model_dir(model.eval(), tokenizer, folder)
    return folder


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_qwen3_export_has_our_logits(tokenizer, tmp_path, tied: bool) -> None:
    source = model_dir(tokenizer, tmp_path / "qk", qk_norm=True, tie_word_embeddings=tied)
    out = convert_to_llama(source, tmp_path / "qwen3", target="qwen3")
    theirs = AutoModelForCausalLM.from_pretrained(out)
    assert type(theirs) is Qwen3ForCausalLM
    ours = MiniNormForCausalLM.from_pretrained(source).eval()
    ids = torch.randint(0, len(tokenizer), (2, 40), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits(theirs, ids), logits(ours, ids), atol=1e-5, rtol=0)
    k_norm = ours.model.layers[1].self_attn.k_norm.weight  # perturbed away from 1: a lost QK-norm would show
    torch.testing.assert_close(theirs.model.layers[1].self_attn.k_norm.weight, k_norm, atol=0, rtol=0)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["tie_word_embeddings"] is tied and config["rope_theta"] == 5e4
    assert AutoTokenizer.from_pretrained(out)("北京")["input_ids"] == tokenizer("北京")["input_ids"]


def test_export_then_import_gives_back_the_model(tokenizer, tmp_path) -> None:
    source = model_dir(tokenizer, tmp_path / "qk", qk_norm=True)
    back, _ = import_checkpoint(convert_to_llama(source, tmp_path / "qwen3", target="qwen3"), tmp_path / "back")
    ids = torch.randint(0, len(tokenizer), (1, 30), generator=torch.Generator().manual_seed(2))
    ours, again = (MiniNormForCausalLM.from_pretrained(p, norm_impl="eager").eval() for p in (source, back))
    assert again.config.qk_norm and again.config.qk_norm_scope == "head"
    torch.testing.assert_close(logits(again, ids), logits(ours, ids), atol=1e-6, rtol=0)


def test_yarn_model_exports_with_its_rope_scaling(tokenizer, tmp_path) -> None:
    """The export verifies the logits at 128 positions against transformers with the same rope_parameters."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    source = model_dir(tokenizer, tmp_path / "yarn", rope_scaling=scaling)
    out = convert_to_llama(source, tmp_path / "llama")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"] == {**scaling, "rope_theta": 5e4}
    assert config["rope_scaling"] == scaling  # for readers that predate rope_parameters
    theirs = AutoModelForCausalLM.from_pretrained(out)
    ours = MiniNormForCausalLM.from_pretrained(source).eval()
    ids = torch.randint(0, len(tokenizer), (1, 128), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(logits(theirs, ids), logits(ours, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("target", "overrides", "switch", "hint"), [
    ("qwen3", dict(), "qk_norm=False", "--target llama"),
    ("llama", dict(qk_norm=True), "qk_norm=True", "--target qwen3"),
    ("qwen3", dict(qk_norm=True, qk_norm_scope="full"), "qk_norm_scope='full'", "each head"),
    ("qwen3", dict(qk_norm=True, norm_type="layernorm"), "norm_type='layernorm'", "RMSNorm"),
    ("qwen3", dict(qk_norm=True, norm_placement="sandwich"), "norm_placement='sandwich'", "pre-LN"),
])
def test_each_target_names_the_switch_that_prevents_it(tokenizer, tmp_path, capsys, target, overrides, switch,
                                                       hint) -> None:
    source = model_dir(tokenizer, tmp_path / "model", **overrides)
    capsys.readouterr()  # the progress bar of writing the model
    assert main(["--model_path", str(source), "--out_dir", str(tmp_path / "out"), "--target", target]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and switch in error and hint in error
    assert ("Qwen3" if target == "qwen3" else "Llama") in error
    assert not (tmp_path / "out").exists()


def test_a_llama_export_is_not_replaced_by_a_qwen3_one(tokenizer, tmp_path, capsys) -> None:
    plain = model_dir(tokenizer, tmp_path / "plain")
    qk = model_dir(tokenizer, tmp_path / "qk", qk_norm=True)
    convert_to_llama(plain, tmp_path / "out", verify=False)
    capsys.readouterr()
    assert main(["--model_path", str(qk), "--out_dir", str(tmp_path / "out"), "--target", "qwen3"]) == 2
    assert "neither empty nor a previous Qwen3 export" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llama"
