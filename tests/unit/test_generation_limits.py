"""Saved and exported model directories leave the answer's length to the client (model/generation_defaults.py):
transformers' own generate() stops exactly where its caller asks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from model.generation_defaults import LENGTH_FIELDS
from scripts.convert_to_llama import convert_to_llama

PROMPT = "The history of the city"


@pytest.fixture(scope="module")
def pinned_export(tiny_models, tmp_path_factory):
    """The Llama export of a directory saved the old way, with a length limit (and a sampling setting) in its
    generation_config.json."""
    root = tmp_path_factory.mktemp("pinned")
    model = shutil.copytree(tiny_models.pretrain, root / "pretrain")
    config = json.loads((model / "generation_config.json").read_text())
    config.update(max_new_tokens=256, max_length=300, min_new_tokens=3, repetition_penalty=1.1)
    (model / "generation_config.json").write_text(json.dumps(config))
    return convert_to_llama(model, root / "llama")


def test_a_saved_directory_pins_no_length(tiny_models, tokenizer) -> None:
    saved = json.loads((tiny_models.pretrain / "generation_config.json").read_text())
    assert not set(LENGTH_FIELDS) & set(saved), saved
    assert saved["eos_token_id"] == tokenizer.eos_token_id == 2  # where chat stops is still saved


def test_the_export_drops_a_saved_length_and_keeps_sampling_settings(pinned_export) -> None:
    exported = json.loads((pinned_export / "generation_config.json").read_text())
    assert not set(LENGTH_FIELDS) & set(exported), exported
    assert exported["repetition_penalty"] == 1.1 and exported["eos_token_id"] == 2


@pytest.mark.parametrize("which", ["saved", "exported"])
def test_generate_stops_where_the_caller_asks(tiny_models, pinned_export, tokenizer, which) -> None:
    path = tiny_models.pretrain if which == "saved" else pinned_export
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    inputs = tokenizer(PROMPT, return_tensors="pt")
    prompt_length = inputs["input_ids"].shape[1]
    with torch.no_grad():
        by_length = model.generate(**inputs, max_length=prompt_length + 12, do_sample=False)
        by_new_tokens = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    # The untrained model never emits <|im_end|> here, so only the caller's limit can end generation.
    assert tokenizer.eos_token_id not in by_length[0, prompt_length:].tolist()
    assert by_length.shape[1] == prompt_length + 12
    assert by_new_tokens.shape[1] == prompt_length + 5
