"""LoRA fine-tuning (trainer/train_lora.py) on the training core, on tiny models: only the adapters train, the
output is a standard PEFT adapter, the merged model equals the adapter model (and W + (alpha / r) B A by hand),
resume continues exactly, and chat, evaluate and the server run base + adapter: their answers are PEFT's own
greedy decoding of the adapter model, and differ from the base model's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState

from tests.paths import REPO
from tests.training_runs import finetune_argv, refused_run, run_in_process, train_losses, write_jsonl
from trainer.args import parse_args
from trainer.core import Trainer
from trainer.run_dir import MERGED_DIR

LORA_REPLY = "An adapter speaks here now."
QUESTION = "Who are you?"
RANK, ALPHA = 8, 16.0


@pytest.fixture(scope="module")
def lora_run(tiny_models, tmp_path_factory) -> Path:
    """A LoRA adapter (with --merge) trained to make the tiny SFT model, which answers every question with
    tiny_models.reply, answer LORA_REPLY instead. (Its frozen, over-trained embeddings and norms keep the adapter
    from learning the new reply outright in a few steps; it changes the answers, which is what the tests need.)"""
    root = tmp_path_factory.mktemp("lora")
    questions = [json.loads(line)["conversations"][0]["content"] for line in tiny_models.sft_data.open()]
    data = write_jsonl(root / "lora.jsonl", [{"conversations": [{"role": "user", "content": q},
                                                                {"role": "assistant", "content": LORA_REPLY}]}
                                             for q in questions])
    out_dir = root / "out"
    run_in_process("lora", ["--data_path", str(data), "--val_data_path", str(data), "--from_weight",
                            str(tiny_models.sft), "--out_dir", str(out_dir), "--max_steps", "30", "--batch_size", "5",
                            "--learning_rate", "1e-2", "--warmup_steps", "0", "--max_seq_len", "64", "--dtype",
                            "float32", "--compile", "off", "--lora_rank", str(RANK), "--lora_alpha", str(ALPHA),
                            "--merge"])
    return out_dir


@pytest.fixture(scope="module")
def adapter_answer(lora_run, tiny_models) -> str:
    """PEFT's own model (base + adapter, not merged) decoding greedily, on the template's ids: what every tool
    given --lora must answer to QUESTION."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dataset.tokenization import load_tokenizer

    tokenizer = load_tokenizer(tiny_models.sft)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_models.sft), lora_run).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=True,
                                        add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    assert answer and answer != tiny_models.reply  # the adapter changes the answer
    return answer


def _trainer(task: str, argv: list[str]) -> Trainer:
    AcceleratorState._reset_state(reset_partial_state=True)
    return Trainer(parse_args(task, argv))


def test_only_the_adapters_train_and_the_output_is_a_peft_adapter(train_data, tiny_models, tmp_path, capsys):
    from peft import AutoPeftModelForCausalLM

    out_dir = tmp_path / "lora"
    trainer = _trainer("lora", finetune_argv("lora", train_data, tiny_models.sft, out_dir, "--lora_rank", "4",
                                             "--lora_targets", "q_proj,v_proj,down_proj", "--learning_rate", "1e-2"))
    base = {name: value.clone() for name, value in trainer.base_model.state_dict().items() if "lora_" not in name}
    try:
        trainer.run()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    after = trainer.base_model.state_dict()
    assert all(torch.equal(after[name], value) for name, value in base.items())  # bit for bit
    adapters = {name: value for name, value in after.items() if "lora_" in name}
    assert adapters and any(value.abs().sum() > 0 for name, value in adapters.items() if "lora_B" in name)
    # The count printed is the adapters' size, worked out from the base model's projection shapes: r x (in + out).
    original = torch.nn.Module()
    original.model = type(trainer.base_model).from_pretrained(tiny_models.sft)
    expected = sum(4 * (module.in_features + module.out_features) for name, module in original.named_modules()
                   if name.rsplit(".", 1)[-1] in ("q_proj", "v_proj", "down_proj"))
    total = sum(p.numel() for p in original.parameters()) + expected
    printed = capsys.readouterr().out
    assert f"trainable parameters: {expected:,} of {total:,}" in printed
    assert sorted(p.name for p in out_dir.iterdir() if p.name.startswith("adapter_")) == [
        "adapter_config.json", "adapter_model.safetensors"]
    # PEFT's own auto class loads it, base model included (its path is recorded in the adapter).
    loaded = AutoPeftModelForCausalLM.from_pretrained(out_dir)
    assert json.loads((out_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        tiny_models.sft)
    ids = torch.tensor([[1, 200, 300, 400, 2]])
    trainer.unwrapped.eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, trainer.unwrapped(input_ids=ids).logits, atol=1e-6)


def test_merged_model_equals_the_adapter_model_and_the_formula(lora_run, tiny_models):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(lora_run / MERGED_DIR).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_models.sft), lora_run).eval()
    ids = torch.tensor([[1, 872, 19, 1010, 2, 201, 1, 77, 88, 99, 5]])
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5)
    # One projection by hand in fp64: W' = W + (alpha / r) B A.
    base = load_file(tiny_models.sft / "model.safetensors")
    adapter = load_file(lora_run / "adapter_model.safetensors")
    key = "model.layers.1.self_attn.q_proj"
    a, b = (adapter[f"base_model.model.{key}.lora_{x}.weight"].double() for x in "AB")
    expected = base[f"{key}.weight"].double() + ALPHA / RANK * b @ a
    assert b.abs().sum() > 0
    assert torch.allclose(merged.state_dict()[f"{key}.weight"].double(), expected, atol=1e-6)


def test_chat_with_lora_answers_with_the_adapter(lora_run, tiny_models, adapter_answer, capsys):
    from eval.chat import main

    # --no_tools: the tiny models never saw the tools prompt (chat offers the built-in tools by default).
    greedy = ["--prompt", QUESTION, "--temperature", "0", "--no_stream", "--max_new_tokens", "40", "--no_tools"]
    assert main(["--lora", str(lora_run), *greedy]) == 0  # base model read from the adapter
    assert capsys.readouterr().out.strip() == adapter_answer
    assert main(["--model_path", str(tiny_models.sft), *greedy]) == 0
    assert capsys.readouterr().out.strip() == tiny_models.reply
    assert main(["--model_path", str(lora_run / MERGED_DIR), *greedy]) == 0
    assert capsys.readouterr().out.strip() == adapter_answer


def test_evaluate_with_lora_equals_the_merged_model(lora_run, tiny_models):
    from eval.evaluate import evaluate_model_dir

    data = [str(tiny_models.sft_data)]
    with_lora = evaluate_model_dir(None, data, max_seq_len=64, device="cpu", lora=lora_run)
    merged = evaluate_model_dir(lora_run / MERGED_DIR, data, max_seq_len=64, device="cpu")
    base = evaluate_model_dir(tiny_models.sft, data, max_seq_len=64, device="cpu")
    assert with_lora["lora"] == str(lora_run) and with_lora["model_path"] == str(tiny_models.sft)
    loss = with_lora["results"]["sft"]["loss"]
    assert loss == pytest.approx(merged["results"]["sft"]["loss"], rel=1e-5)
    assert loss > base["results"]["sft"]["loss"] + 1  # the adapter moved away from the data's reply


def test_serve_with_lora_answers_with_the_adapter(lora_run, tiny_models, adapter_answer, threaded_server,
                                                  monkeypatch):
    import httpx
    import uvicorn

    from scripts.serve import main

    apps = []
    with monkeypatch.context() as patch:  # until threaded_server runs the app under uvicorn itself
        patch.setattr(uvicorn.Server, "run", lambda server, sockets: (apps.append(server.config.app),
                                                                      sockets[0].close()))
        assert main(["--lora", str(lora_run), "--model_path", str(tiny_models.sft), "--port", "0"]) == 0
    with threaded_server(apps[0]) as server:
        models = httpx.get(f"{server.url}/v1/models").json()
        answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 40}).json()
    assert models["data"][0]["id"] == lora_run.name
    assert answer["choices"][0]["message"]["content"].strip() == adapter_answer


@pytest.mark.parametrize("task", ["lora", "dpo"])
def test_resume_continues_the_uninterrupted_run(task, train_data, tiny_models, tmp_path, capsys):
    """A run checkpointed at step 3 and resumed from there gives the uninterrupted run's losses at steps 4-6, bit
    for bit (LoRA with adapter dropout, whose masks come from the restored RNG state)."""
    extra = ["--save_interval", "3", "--learning_rate", "3e-3"] + (["--lora_dropout", "0.1"] if task == "lora" else [])
    whole = tmp_path / "whole"
    run_in_process(task, finetune_argv(task, train_data, tiny_models.sft, whole, *extra))
    resumed = tmp_path / "resumed"
    run_in_process(task, finetune_argv(task, train_data, tiny_models.sft, resumed, *extra, "--resume",
                                       str(whole / "checkpoints" / "step_00000003")))
    out = capsys.readouterr()  # the same command line: nothing changed (DPO's --loss_weights left unset)
    assert "resumed from" in out.out and "changed since the checkpoint" not in out.out + out.err
    assert len(train_losses(whole)) == 6 and train_losses(resumed) == train_losses(whole)[3:]


def test_resume_with_another_adapter_shape_is_refused(train_data, tiny_models, tmp_path, capsys):
    whole = tmp_path / "whole"
    run_in_process("lora", finetune_argv("lora", train_data, tiny_models.sft, whole, "--save_interval", "3"))
    error = refused_run("lora", finetune_argv("lora", train_data, tiny_models.sft, tmp_path / "resumed", "--lora_rank",
                                              "4", "--resume", str(whole / "checkpoints" / "step_00000003")), capsys)
    assert error.startswith("error: --resume step_00000003: --lora_rank was 8 there and is 4 now")


@pytest.mark.parametrize("rank, targets, smallest", [("33", "all", 32), (str(10 ** 30), "all", 32),
                                                     ("65", "q_proj,o_proj", 64)])
def test_a_rank_past_the_adapted_layers_smallest_side_is_refused(rank, targets, smallest, train_data, tiny_models,
                                                                  tmp_path, capsys):
    """A rank above min(in, out) of an adapted layer adds parameters, not rank (k_proj of the tiny model is 64 x 32);
    10**30 was a TypeError traceback from torch.empty (found by fuzzing the flags)."""
    error = refused_run("lora", finetune_argv("lora", train_data, tiny_models.sft, tmp_path / "run", "--lora_rank",
                                              rank, "--lora_targets", targets), capsys, after_progress=True)
    assert error == (f"error: --lora_rank={rank} is not allowed; it must be in 1 .. {smallest} (the smallest side "
                     f"of the adapted layers: a larger rank adds parameters, not rank)")


@pytest.mark.parametrize("targets, smallest", [("all", 32), ("q_proj,o_proj", 64)])
def test_a_rank_of_the_adapted_layers_smallest_side_is_taken(targets, smallest):
    """The bound is inclusive: a rank of min(in, out) is a full-rank update, the most a layer holds, and is made;
    one more is refused (k_proj and v_proj are 64 x 32 here, q_proj and o_proj 64 x 64)."""
    from model.config import MiniNormConfig
    from model.lora import LoraSettings, add_lora, parse_targets
    from model.model import MiniNormForCausalLM

    def model() -> MiniNormForCausalLM:
        return MiniNormForCausalLM(MiniNormConfig(vocab_size=300, hidden_size=64, num_hidden_layers=1,
                                                  num_attention_heads=4, num_key_value_heads=2))

    adapted = add_lora(model(), LoraSettings(rank=smallest, targets=parse_targets(targets)))
    ranks = {p.shape[0] for n, p in adapted.named_parameters() if "lora_A" in n}
    assert ranks == {smallest}
    with pytest.raises(ValueError, match=f"it must be in 1 .. {smallest} "):
        add_lora(model(), LoraSettings(rank=smallest + 1, targets=parse_targets(targets)))


@pytest.mark.parametrize("argv, message", [
    (["--lora_targets", "q_proj,lm_head"], "--lora_targets='q_proj,lm_head': 'lm_head' is not a projection"),
    (["--lora_rank", "0"], "--lora_rank=0 is not allowed"),
    (["--lora_dropout", "1"], "--lora_dropout=1.0 is not allowed"),
])
def test_bad_lora_flags_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args("lora", argv)
    assert message in capsys.readouterr().err


def test_lora_flags_belong_to_the_lora_trainer_only(capsys):
    with pytest.raises(SystemExit):
        parse_args("sft", ["--lora_rank", "4"])
    assert "unrecognized arguments: --lora_rank" in capsys.readouterr().err
    assert "beta" not in parse_args("lora", []).to_dict() and "lora_rank" not in parse_args("dpo", []).to_dict()


def test_adapter_directories_are_named_in_one_line(lora_run, tmp_path, capsys):
    from eval.chat import main

    assert main(["--model_path", str(lora_run), "--prompt", "Hi"]) == 2
    assert re.search(r"is a LoRA adapter, not a whole model: pass it as --lora", capsys.readouterr().err)
    assert main(["--lora", str(tmp_path), "--prompt", "Hi"]) == 2
    assert "no LoRA adapter there (adapter_config.json is missing)" in capsys.readouterr().err


def test_an_adapter_as_a_fine_tuning_runs_starting_model_is_named(lora_run, train_data, tmp_path, capsys):
    """`train_dpo.py --from_weight out/lora` said "no model to start from there; create it with train_full_sft.py"
    of a folder that holds a trained adapter; it names the adapter and its merged model (or how to make one)."""
    argv = finetune_argv("dpo", train_data, lora_run, tmp_path / "dpo")
    assert refused_run("dpo", argv, capsys) == (f"error: --from_weight {lora_run}: a LoRA adapter, not a model (its "
                                                f"weights are the base model's plus the adapter's); start from its "
                                                f"merged model, --from_weight {lora_run / MERGED_DIR}")
    unmerged = tmp_path / "unmerged"
    unmerged.mkdir()
    (unmerged / "adapter_config.json").write_text((lora_run / "adapter_config.json").read_text())
    argv = finetune_argv("dpo", train_data, unmerged, tmp_path / "dpo")
    assert refused_run("dpo", argv, capsys).endswith("merge it first (train_lora.py --merge writes OUT_DIR/merged) "
                                                     "and start from that")


_SAVE_ADAPTER = """
import sys
from pathlib import Path
import torch
from dataset.tokenization import load_tokenizer
from model.config import MiniNormConfig
from model.lora import LoraSettings, add_lora
from model.model import MiniNormForCausalLM
from trainer.export import save_model_dir
torch.manual_seed(0)
config = MiniNormConfig(vocab_size=6400, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=64)
save_model_dir(add_lora(MiniNormForCausalLM(config), LoraSettings()), load_tokenizer(None), Path(sys.argv[1]))
"""


def test_an_adapter_saved_under_another_hash_seed_is_the_same_files(tmp_path):
    """PEFT holds target_modules as a set and wrote adapter_config.json in the set's order, which PYTHONHASHSEED
    decides (seeds 1 and 2 gave two orders of the seven projections): the same adapter, exported twice, differed.
    Every file is the same bytes now, the list sorted, and PEFT reads the adapter back with those targets."""
    saved = {}
    for seed in ("1", "2"):
        out = tmp_path / f"seed{seed}"
        subprocess.run([sys.executable, "-c", _SAVE_ADAPTER, str(out)], cwd=REPO, check=True, timeout=300,
                       env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True)
        saved[seed] = {path.name: path.read_bytes() for path in sorted(out.iterdir())}
    assert saved["1"] == saved["2"] and "adapter_config.json" in saved["1"]
    targets = json.loads(saved["1"]["adapter_config.json"])["target_modules"]
    assert targets == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    from peft import PeftConfig
    assert PeftConfig.from_pretrained(str(tmp_path / "seed1")).target_modules == set(targets)
