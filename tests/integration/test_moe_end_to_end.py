"""A mixture-of-experts model end to end (issue 30): an MoE pretraining run resumed from a checkpoint reproduces the
uninterrupted run bit for bit (losses, router losses, validation, weights); `eval/chat.py --prompt` answers with an
MoE checkpoint through the KV-cache generation engine; `scripts/serve.py` serves it to the official `openai` client,
plain and streamed. The expected answers are the no-cache greedy argmax, computed here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
import yaml
from safetensors.torch import load_file

from model.config import MiniNormConfig
from model.model import MiniNormForCausalLM, SparseMoE
from tests.conftest import serve_process
from tests.paths import REPO
from tests.training_runs import pretrain_argv, run_in_process, train_losses
from trainer.export import save_model_dir
from trainer.run_dir import CONFIG_FILE, read_metrics

MOE_FLAGS = ("--num_experts", "4", "--num_experts_per_tok", "2", "--moe_intermediate_size", "48", "--norm_topk_prob",
             "true", "--router_aux_loss_coef", "0.01", "--router_z_loss_coef", "0.001", "--qk_norm")
QUESTION = "What is the capital of France?"


def test_an_moe_run_resumed_from_a_checkpoint_reproduces_it_bit_for_bit(train_data, tmp_path) -> None:
    """Dropout on and both router losses in the objective: resumed at step 3, every later loss, load-balancing and
    z-loss, validation and final weight equals the uninterrupted run's exactly."""
    flags = ("--batch_size", "4", "--dropout", "0.1", *MOE_FLAGS)
    uninterrupted = tmp_path / "uninterrupted"
    run_in_process("pretrain", pretrain_argv(train_data, uninterrupted, *flags))
    resumed = tmp_path / "resumed"
    run_in_process("pretrain", pretrain_argv(train_data, resumed, *flags, "--resume",
                                             str(uninterrupted / "checkpoints" / "step_00000003")))
    assert train_losses(resumed) == train_losses(uninterrupted)[3:]
    router = lambda out: [(r["aux_loss"], r["z_loss"]) for r in read_metrics(out, "train")]  # noqa: E731
    assert router(resumed) == router(uninterrupted)[3:] and all(aux > 0 for aux, _ in router(resumed))
    assert read_metrics(resumed, "val") == read_metrics(uninterrupted, "val")
    ours, theirs = load_file(resumed / "model.safetensors"), load_file(uninterrupted / "model.safetensors")
    assert ours.keys() == theirs.keys() and any(".mlp.experts.3." in name for name in ours)
    assert all(torch.equal(ours[name], tensor) for name, tensor in theirs.items())


# ------------------------------------------------------------------------------------ chat and the server
def _trained_moe_sft(tokenizer, sft_data: Path, cache_dir: Path) -> MiniNormForCausalLM:
    """A tiny top-1 MoE model trained, full-batch, until it answers the tiny questions with their one reply."""
    from dataset.sft_dataset import SFTDataset

    torch.manual_seed(0)
    config = MiniNormConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=128, norm_impl="eager", qk_norm=True,
                            num_experts=4, num_experts_per_tok=1, norm_topk_prob=True, moe_intermediate_size=64,
                            router_aux_loss_coef=0.01, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    model = MiniNormForCausalLM(config)
    data = SFTDataset(sft_data, tokenizer, max_seq_len=64, cache_dir=cache_dir)
    batch = data.collate([data[i] for i in range(len(data))])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(80):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.eval()


@pytest.fixture(scope="module")
def moe_sft(tiny_models, tokenizer, tmp_path_factory) -> Path:
    """The MoE model directory, written as the trainer writes an SFT model."""
    folder = tmp_path_factory.mktemp("moe_sft") / "moe"
    model = _trained_moe_sft(tokenizer, tiny_models.sft_data, folder.parent / "cache")
    save_model_dir(model, tokenizer, folder)
    (folder / CONFIG_FILE).write_text(yaml.safe_dump({"task": "sft"}))
    return folder


def no_cache_greedy(model_dir: Path, tokenizer, messages: list[dict], max_new_tokens: int = 40) -> str:
    """The reference answer: the whole sequence re-run for every token (no KV cache), argmax, up to <|im_end|>."""
    model = MiniNormForCausalLM.from_pretrained(model_dir).eval()
    assert all(isinstance(block.mlp, SparseMoE) for block in model.model.layers)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    prompt_length = ids.shape[1]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = model(input_ids=ids).logits[0, -1].argmax()
            if token == tokenizer.eos_token_id:
                break
            ids = torch.cat((ids, token.view(1, 1)), dim=1)
    return tokenizer.decode(ids[0, prompt_length:], skip_special_tokens=True)


def test_chat_prompt_answers_with_an_moe_checkpoint(moe_sft, tiny_models, tokenizer) -> None:
    expected = no_cache_greedy(moe_sft, tokenizer, [{"role": "user", "content": QUESTION}])
    assert expected == tiny_models.reply  # the model learnt its answer, so the check is not on noise
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8"}
    run = subprocess.run([sys.executable, str(REPO / "eval" / "chat.py"), "--model_path", str(moe_sft), "--prompt",
                          QUESTION, "--temperature", "0", "--max_new_tokens", "40", "--no_tools"],
                         capture_output=True, text=True, encoding="utf-8", timeout=300, env=env, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == expected + "\n"
    assert "tokens/s" in run.stderr and "max_new_tokens" not in run.stderr  # it stopped at <|im_end|>


@pytest.fixture(scope="module")
def moe_server(moe_sft):
    """`python scripts/serve.py` serving the MoE model; yields its base URL."""
    yield from serve_process(moe_sft)


def test_the_server_answers_with_an_moe_checkpoint_plain_and_streamed(moe_server, moe_sft, tiny_models,
                                                                     tokenizer) -> None:
    client = openai.OpenAI(base_url=f"{moe_server}/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": QUESTION}]
    expected = no_cache_greedy(moe_sft, tokenizer, messages)
    response = client.chat.completions.create(model="moe", messages=messages, temperature=0.0)
    assert response.choices[0].message.content == expected == tiny_models.reply
    assert response.choices[0].finish_reason == "stop" and response.model == moe_sft.name
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": tiny_models.reply},
               {"role": "user", "content": "你好"}]
    chunks = list(client.chat.completions.create(model="moe", messages=history, temperature=0.0, stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1  # streamed piece by piece
    assert "".join(pieces) == no_cache_greedy(moe_sft, tokenizer, history)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
