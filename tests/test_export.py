"""scripts/convert_to_llama.py: the exported directory is a stock LlamaForCausalLM with our logits."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

from eval.model_dir import load_model, model_task
from scripts.convert_to_llama import convert_to_llama, main


@pytest.fixture(scope="module")
def exported(tiny_models, tmp_path_factory):
    return convert_to_llama(tiny_models.pretrain, tmp_path_factory.mktemp("export") / "llama")


def test_exported_llama_logits_equal_ours(tiny_models, exported) -> None:
    ours, _ = load_model(tiny_models.pretrain)
    llama = AutoModelForCausalLM.from_pretrained(exported)
    assert type(llama) is LlamaForCausalLM
    ids = torch.randint(0, ours.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(llama(ids).logits, ours(ids).logits, atol=1e-5, rtol=0)
    # Tied embeddings stay tied, and the norm gains (perturbed away from 1 in the fixture) arrived.
    assert llama.lm_head.weight.data_ptr() == llama.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(llama.model.layers[1].post_attention_layernorm.weight,
                               ours.model.layers[1].mlp_norm.weight, atol=0, rtol=0)


def test_exported_directory_is_complete(tiny_models, exported, tokenizer) -> None:
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True and config["rope_theta"] == 1e6  # for pre-rope_parameters readers
    assert GenerationConfig.from_pretrained(exported).eos_token_id == tokenizer.eos_token_id == 2
    theirs = AutoTokenizer.from_pretrained(exported)
    messages = [{"role": "user", "content": "Hi 你好"}]
    assert theirs.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert theirs("The history of 北京")["input_ids"] == tokenizer("The history of 北京")["input_ids"]
    assert not [p.name for p in exported.parent.iterdir() if p.name.startswith(".")]  # no temp dir left
    assert model_task(exported) == "pretrain"  # train_config.yaml came along, for eval/chat.py


def test_export_replaces_a_previous_one(tiny_models, tmp_path) -> None:
    out = tmp_path / "llama"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    assert main(["--model_path", str(tiny_models.pretrain), "--out_dir", str(out), "--no_verify"]) == 0
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]


def test_post_ln_model_is_refused_naming_the_switch(tiny_models, tmp_path, capsys) -> None:
    out = tmp_path / "llama"
    assert main(["--model_path", str(tiny_models.post_ln), "--out_dir", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert "norm_placement='post'" in error and "pre-LN" in error
    assert not out.exists()
