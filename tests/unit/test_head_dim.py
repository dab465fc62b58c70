"""Heads wider than hidden_size / num_attention_heads (config.head_dim, as Qwen3's released models have: hidden 1024,
16 heads of 128): a transformers Llama or Qwen3 of that shape imports with its logits and gradients, its KV-cached
generation equals the full forward, it exports back to the same architecture with head_dim in config.json (a
mixture of experts to Qwen3-MoE too), llama.cpp reads the GGUF file's key and value lengths, and pretraining's
--head_dim trains and resumes such a model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

from model.generation import GenerationEngine, GenerationSettings
from model.llama_compat import to_llama_key
from model.loading import load_dir_tokenizer
from model.model import MiniNormForCausalLM
from scripts.convert_to_gguf import convert_to_gguf
from scripts.convert_to_llama import convert_to_llama
from scripts.import_checkpoint import import_checkpoint
from tests.llama_cpp_reference import llama_cpp_logits
from tests.training_runs import pretrain_argv, refused_run, run_in_process, train_losses
from tests.unit.test_export_qwen3_moe import moe_dir
from tests.unit.test_interop import hf_model, save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

# hidden 64 and 4 heads would be heads of 16: these are 32 wide, the attention 128 wide against a stream of 64.
WIDE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
CLASSES = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def imported(request, tmp_path_factory):
    """(kind, transformers' model, its checkpoint folder, the MiniNorm import of it)."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"wide_{kind}")
    theirs = hf_model(kind, tied=kind == "qwen3", **WIDE)
    assert theirs.model.layers[0].self_attn.q_proj.weight.shape == (128, 64)
    source = save_checkpoint(theirs, root / "hf")
    out, diff = import_checkpoint(source, root / "imported")
    assert diff is not None and diff <= 1e-5
    return kind, theirs, source, out


def _ours(folder) -> MiniNormForCausalLM:
    return MiniNormForCausalLM.from_pretrained(folder, norm_impl="eager").eval()


def _ids(length: int, seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 6400, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_the_import_keeps_the_head_width_and_the_logits(imported) -> None:
    kind, theirs, _, out = imported
    ours = _ours(out)
    assert json.loads((out / "config.json").read_text())["head_dim"] == 32
    attention = ours.model.layers[1].self_attn
    assert attention.q_proj.weight.shape == (128, 64) and attention.o_proj.weight.shape == (64, 128)
    assert attention.k_proj.weight.shape == (64, 64) and ours.config.qk_norm is (kind == "qwen3")
    ids = _ids(40, 1)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


def test_the_imports_gradients_equal_transformers(imported) -> None:
    """One loss backward through each model: every weight's gradient (q/k/v/o included, 128-wide) agrees."""
    _, theirs, source, out = imported
    ours = _ours(out)
    reference = CLASSES[imported[0]].from_pretrained(source).eval()  # a fresh copy: the fixture's stays unused
    ids = _ids(24, 2)
    ours(input_ids=ids, labels=ids).loss.backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    theirs_grads = {name: p.grad for name, p in reference.named_parameters()}
    checked = 0
    for name, parameter in ours.named_parameters():
        torch.testing.assert_close(parameter.grad, theirs_grads[to_llama_key(name)], atol=1e-5, rtol=1e-4,
                                   msg=name)
        checked += "self_attn" in name
    assert checked >= 8


def test_cached_generation_equals_the_full_forward(imported) -> None:
    """A KV-cached continuation, transformers-style greedy generate() and the server's static decode step (its own
    cache, sized by head_dim) each give what a cache-free forward gives."""
    _, theirs, _, out = imported
    ours = _ours(out)
    ids = _ids(40, 3)
    with torch.no_grad():
        full = ours(ids).logits
        prefix = ours(ids[:, :30], use_cache=True)
        torch.testing.assert_close(ours(ids[:, 30:], past_key_values=prefix.past_key_values).logits, full[:, 30:],
                                   atol=1e-5, rtol=0)
        prompt = _ids(8, 4, batch=1)
        generated = ours.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                  do_sample=False, pad_token_id=0, eos_token_id=None)
        sequence = generated[0].tolist()
        assert len(sequence) == 20
        by_forward = ours(generated[:, :-1]).logits[0, 7:].argmax(-1).tolist()
        assert sequence[8:] == by_forward
        assert theirs.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                               do_sample=False, pad_token_id=0, eos_token_id=None)[0].tolist() == sequence
    engine = GenerationEngine(ours, load_dir_tokenizer(out), max_batch=1, eos_token_ids=[-1], decode="static")
    static = engine.generate(prompt[0].tolist(), GenerationSettings(max_new_tokens=12, temperature=0.0))
    assert static.token_ids == sequence[8:]


def test_the_export_back_has_head_dim_and_the_logits(imported, tmp_path) -> None:
    kind, theirs, _, out = imported
    exported = convert_to_llama(out, tmp_path / "export", target=kind)
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == kind and config["head_dim"] == 32 and config["hidden_size"] == 64
    again = AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(again) is CLASSES[kind]
    ids = _ids(32, 5)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


def test_llama_cpp_reads_the_head_width_from_the_gguf_file(imported, tmp_path) -> None:
    """key_length and value_length are 32, not embedding_length / head_count = 16: llama.cpp computes our logits."""
    kind, _, _, out = imported
    path = convert_to_gguf(out, tmp_path / "wide.gguf", "f32")
    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    assert arch == kind
    lengths = {key: reader.fields[f"{arch}.{key}"].contents() for key in
               ("embedding_length", "attention.head_count", "attention.key_length", "attention.value_length",
                "rope.dimension_count")}
    assert lengths == {"embedding_length": 64, "attention.head_count": 4, "attention.key_length": 32,
                       "attention.value_length": 32, "rope.dimension_count": 32}
    ids = _ids(30, 6, batch=1)[0].tolist()
    ours = _ours(out)
    with torch.no_grad():
        expected = ours(torch.tensor([ids])).logits[0].numpy()
    got = llama_cpp_logits(path, ids, n_ctx=64)
    assert np.abs(got - expected).max() < 1e-4


def test_a_pretraining_run_with_head_dim_trains_and_resumes(train_data, tmp_path, capsys) -> None:
    """--head_dim 16 on a 32-wide model of 4 heads (unset: 8): the run trains heads of 16, a bare `--resume auto`
    continues that model to the uninterrupted run's losses, and a resume asking for other heads is refused."""
    flags = ("--batch_size", "4", "--max_steps", "4", "--head_dim", "16")
    uninterrupted = tmp_path / "uninterrupted"
    run_in_process("pretrain", pretrain_argv(train_data, uninterrupted, *flags))
    losses = train_losses(uninterrupted)
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    assert json.loads((uninterrupted / "config.json").read_text())["head_dim"] == 16
    trained = _ours(uninterrupted)
    assert trained.model.layers[0].self_attn.q_proj.weight.shape == (64, 32)
    interrupted = tmp_path / "interrupted"
    run_in_process("pretrain", pretrain_argv(train_data, interrupted, *flags, "--save_interval", "2"))
    for name in ("run_summary.json", "model.safetensors", "config.json", "generation_config.json"):
        (interrupted / name).unlink()
    checkpoint = next((interrupted / "checkpoints").iterdir())
    error = refused_run("pretrain", pretrain_argv(train_data, tmp_path / "other", "--batch_size", "4", "--max_steps",
                                                  "4", "--head_dim", "8", "--resume", str(checkpoint)), capsys)
    assert "--head_dim was 16 there and is 8 now" in error, error
    run_in_process("pretrain", pretrain_argv(train_data, interrupted, "--batch_size", "4", "--max_steps", "4",
                                             "--resume", "auto"))
    assert json.loads((interrupted / "config.json").read_text())["head_dim"] == 16
    assert train_losses(interrupted) == losses


def test_a_checkpoint_from_before_head_dim_resumes_with_the_heads_it_had(train_data, tmp_path, capsys) -> None:
    """A checkpoint whose trainer_state.json predates head_dim (the key taken out) had heads of hidden / heads (8
    here): a resume with --head_dim 16 is refused in one line naming the change (it failed loading the weights, with
    a state_dict error, after the data had loaded), and one with --head_dim 8, the heads it had, goes on."""
    first = tmp_path / "first"
    run_in_process("pretrain", pretrain_argv(train_data, first, "--batch_size", "4", "--max_steps", "3",
                                             "--save_interval", "2"))
    checkpoint = next((first / "checkpoints").iterdir())
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["config"].pop("head_dim") == 8
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    error = refused_run("pretrain", pretrain_argv(train_data, tmp_path / "wide", "--batch_size", "4", "--max_steps",
                                                  "4", "--head_dim", "16", "--resume", str(checkpoint)), capsys)
    assert "--head_dim was 8 there and is 16 now" in error, error
    resumed = tmp_path / "resumed"
    run_in_process("pretrain", pretrain_argv(train_data, resumed, "--batch_size", "4", "--max_steps", "4",
                                             "--head_dim", "8", "--resume", str(checkpoint)))
    assert json.loads((resumed / "config.json").read_text())["head_dim"] == 8


def test_a_mixture_of_experts_with_wide_heads_exports_to_qwen3_moe(tokenizer, tmp_path) -> None:
    """A MiniNorm MoE model with Qwen3's switches and heads of 32 on a 64-wide stream: a Qwen3MoeForCausalLM with
    head_dim 32 in config.json and our logits."""
    source = moe_dir(tokenizer, tmp_path / "moe", head_dim=32)
    out = convert_to_llama(source, tmp_path / "qwen3_moe", target="qwen3_moe")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["head_dim"] == 32
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs) is Qwen3MoeForCausalLM and theirs.model.layers[0].self_attn.q_proj.weight.shape == (128, 64)
    ours = MiniNormForCausalLM.from_pretrained(source).eval()
    ids = torch.randint(0, len(tokenizer), (2, 32), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tool", ["llama", "gguf"])
def test_a_stream_no_multiple_of_the_heads_is_refused_by_the_llama_exports_in_one_line(tokenizer, tool, tmp_path,
                                                                                     capsys) -> None:
    """hidden_size 62 over 4 heads of 16: MiniNorm trains it, but transformers' LlamaConfig refuses a hidden_size that
    is no multiple of num_attention_heads even with a head_dim of its own (a StrictDataclassClassValidationError
    traceback once the weights had loaded); both exports name it before any weight is read."""
    from model.config import MiniNormConfig
    from scripts import convert_to_gguf as gguf_tool, convert_to_llama as llama_tool
    from trainer.export import save_model_dir

    config = MiniNormConfig(vocab_size=len(tokenizer), hidden_size=62, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=32)
    save_model_dir(MiniNormForCausalLM(config), tokenizer, tmp_path / "model")
    capsys.readouterr()  # the save's progress bar
    out = ["--out_dir", str(tmp_path / "llama")] if tool == "llama" else ["--outfile", str(tmp_path / "m.gguf")]
    main = llama_tool.main if tool == "llama" else gguf_tool.main
    assert main(["--model_path", str(tmp_path / "model"), *out]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    assert "transformers' LLaMA config refuses its shape (The hidden size (62) is not a multiple of the number of " \
           "attention heads (4).)" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
