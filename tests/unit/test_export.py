"""scripts/convert_to_llama.py: the exported directory is a stock LlamaForCausalLM with our logits."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

from model.loading import load_model
from trainer.run_dir import model_task
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
    ours_rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert theirs.apply_chat_template(messages, tokenize=False) == ours_rendered
    assert theirs("The history of 北京")["input_ids"] == tokenizer("The history of 北京")["input_ids"]
    assert not [p.name for p in exported.parent.iterdir() if p.name.startswith(".")]  # no temp dir left
    assert model_task(exported) == "pretrain"  # train_config.yaml came along, for eval/chat.py


def test_export_replaces_a_previous_one(tiny_models, tmp_path) -> None:
    out = tmp_path / "llama"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "llama"}')  # what an earlier export left
    (out / "stale.txt").write_text("old")
    assert main(["--model_path", str(tiny_models.pretrain), "--out_dir", str(out), "--no_verify"]) == 0
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]


def test_export_fills_an_empty_folder(tiny_models, tmp_path) -> None:
    (tmp_path / "llama").mkdir()
    assert main(["--model_path", str(tiny_models.pretrain), "--out_dir", str(tmp_path / "llama"), "--no_verify"]) == 0
    assert (tmp_path / "llama" / "model.safetensors").is_file()


def test_saved_config_names_the_class_and_the_weights_dtype(exported) -> None:
    # save_pretrained writes both, so the converter does not patch them.
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"


def _copied_model(tiny_models, folder):
    """A private copy of the tiny pretrained model: a broken refusal must not delete the shared fixture."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiny_models.pretrain, folder)
    return folder, sorted(p.name for p in folder.iterdir())


def _refused(capsys, *argv: str) -> str:
    assert main([*argv, "--no_verify"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    return error


def test_parent_of_the_model_is_refused_and_left_alone(tiny_models, tmp_path, capsys) -> None:
    model, files = _copied_model(tiny_models, tmp_path / "out" / "pretrain")
    error = _refused(capsys, "--model_path", str(model), "--out_dir", str(tmp_path / "out"))
    assert "overlaps the model" in error
    assert sorted(p.name for p in model.iterdir()) == files
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["pretrain"]


@pytest.mark.parametrize("out_dir", ["out/x/../pretrain", "out/pretrain/llama"])
def test_the_model_itself_or_a_folder_inside_it_is_refused(tiny_models, tmp_path, capsys, out_dir) -> None:
    model, files = _copied_model(tiny_models, tmp_path / "out" / "pretrain")
    error = _refused(capsys, "--model_path", str(model), "--out_dir", str(tmp_path / out_dir))
    assert "overlaps the model" in error
    assert sorted(p.name for p in model.iterdir()) == files


def test_a_folder_that_is_not_an_export_is_refused_and_left_alone(tiny_models, tmp_path, capsys) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    error = _refused(capsys, "--model_path", str(tiny_models.pretrain), "--out_dir", str(out))
    assert str(out) in error and "neither empty nor a previous Llama export" in error
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no staging folder left


def test_an_export_is_not_converted_again(exported, tmp_path, capsys) -> None:
    error = _refused(capsys, "--model_path", str(exported), "--out_dir", str(tmp_path / "again"))
    assert "is not a MiniNorm model (model_type='llama')" in error
    assert not (tmp_path / "again").exists()


def test_post_ln_model_is_refused_naming_the_switch(tiny_models, tmp_path, capsys) -> None:
    out = tmp_path / "llama"
    assert main(["--model_path", str(tiny_models.post_ln), "--out_dir", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert "norm_placement='post'" in error and "pre-LN" in error
    assert not out.exists()
