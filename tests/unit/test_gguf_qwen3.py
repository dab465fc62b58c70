"""scripts/convert_to_gguf.py on a model with per-head QK-norm: a GGUF file with llama.cpp's qwen3 architecture,
which the pinned llama-cpp-python loads and computes our logits with."""

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


def _model_dir(tokenizer, folder, **overrides):
    torch.manual_seed(0)
    config = MiniNormConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=128, norm_impl="eager", qk_norm=True,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **overrides)
    model = MiniNormForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():  # norm gains away from 1, so a lost QK-norm would show
            parameter.add_(0.1 * torch.randn_like(parameter))
    save_model_dir(model.eval(), tokenizer, folder)
    return folder, model.eval()


@pytest.fixture(scope="module")
def qwen3_gguf(tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_gguf")
    folder, model = _model_dir(tokenizer, root / "qk")
    return convert_to_gguf(folder, root / "qk-f32.gguf", "f32"), model


def test_the_file_is_llama_cpps_qwen3(qwen3_gguf) -> None:
    reader = GGUFReader(qwen3_gguf[0])
    assert reader.fields["general.architecture"].contents() == "qwen3"
    names = {tensor.name for tensor in reader.tensors}
    assert {"blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight"} <= names
    assert reader.fields["qwen3.attention.layer_norm_rms_epsilon"].contents() == pytest.approx(1e-6)


def test_llama_cpp_computes_our_logits(qwen3_gguf, tokenizer) -> None:
    path, ours = qwen3_gguf
    ids = tokenizer(TEXT)["input_ids"]
    with torch.no_grad():
        expected = ours(torch.tensor([ids])).logits[0].numpy()
    got = llama_cpp_logits(path, ids)
    assert np.abs(got - expected).max() < 1e-4
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_a_full_scope_qk_norm_is_refused_naming_the_switch(tokenizer, tmp_path, capsys) -> None:
    folder, _ = _model_dir(tokenizer, tmp_path / "full", qk_norm_scope="full")
    capsys.readouterr()
    assert main(["--model_path", str(folder), "--outfile", str(tmp_path / "m.gguf")]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "qk_norm_scope='full'" in error and "Qwen3" in error
    assert not (tmp_path / "m.gguf").exists()
