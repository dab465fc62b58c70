"""Tiny training runs for the trainer tests: their data, their flags, and how to run the trainer in this process
or as several processes (the README's launch commands)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from safetensors.torch import load_file

from trainer.distributed import free_port
from trainer.run_dir import read_metrics
from tests.paths import REPO

# Tiny tensors gain nothing from a second thread, and a pinned count keeps a tiny run's last bits and start-up
# independent of the machine's load (`auto` looks up to a second at a busy machine; test_threads.py tests it).
ONE_THREAD = ("--threads", "1")
TINY = ["--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads",
        "2", "--max_seq_len", "32", "--dtype", "float32", "--norm_impl", "eager", "--log_interval", "2",
        "--eval_interval", "4", "--eval_batches", "0", "--warmup_steps", "2", "--learning_rate", "3e-3",
        "--compile", "off", "--optimizer", "adamw", *ONE_THREAD]
STEPS = 8
MUON_FLAGS = ("--optimizer", "muon", "--muon_lr", "0.02", "--lr_schedule", "wsd", "--decay_fraction", "0.5")
SFT_STEPS = 6
WORDS = ("the quick brown fox jumps over a lazy dog while birds sing in tall green trees near the river and "
         "children play").split()


def _not_json(name: str) -> None:
    raise AssertionError(f"{name} is not JSON: jq and JavaScript's JSON.parse refuse it")


def strict_json_files(folder: Path) -> dict[Path, list]:
    """Every .json and .jsonl file under `folder` -> its values (one per line of a .jsonl), read as a strict reader
    (jq, JSON.parse) reads them: a NaN or an infinity in any of them fails the test, naming it."""
    files = {}
    for path in sorted(folder.rglob("*.json")) + sorted(folder.rglob("*.jsonl")):
        try:
            lines = path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]
            files[path] = [json.loads(line, parse_constant=_not_json) for line in lines if line.strip()]
        except AssertionError as error:
            raise AssertionError(f"{path}: {error}") from None
    return files


def write_jsonl(path: Path, rows: list[dict | str]) -> Path:
    """Rows are dicts (dumped as JSON) or raw strings (written verbatim, for malformed lines)."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n"
                            for row in rows), encoding="utf-8")
    return path


# The reward files of the GRPO and PPO runs: a letter count (a reward that moves), and one that breaks the
# reward contract on its third call (one value short).
LETTER_REWARD = """
def letter_e(prompts, completions, answer, **columns):
    assert len(prompts) == len(completions) == len(answer)
    return [completion.count("e") / 10 for completion in completions]
"""
BROKEN_REWARD = """
calls = 0

def short_by_one(prompts, completions, **columns):
    global calls
    calls += 1
    return [0.0] * (len(completions) - (1 if calls == 3 else 0))
"""


def write_prompt_data(root: Path) -> Path:
    """prompts.jsonl (prompts in each accepted format, with an answer column) and two reward files for the GRPO
    and PPO runs: letters.py (letter_e, a reward that moves) and broken.py (short_by_one, which returns one value
    too few on its third call)."""
    rows = [{"prompt": f"What is {i} + 2?", "answer": str(i + 2)} for i in range(12)]
    rows += [{"messages": [{"role": "user", "content": f"Say {i} twice."}], "answer": f"{i} {i}"} for i in range(2)]
    rows += [{"conversations": [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": ""}],
              "answer": "7"}]
    write_jsonl(root / "prompts.jsonl", rows)
    (root / "letters.py").write_text(LETTER_REWARD)
    (root / "broken.py").write_text(BROKEN_REWARD)
    return root


# A reward that counts a word the tiny model of pretrain_word_model writes about once in 16 tokens.
# --tools runs (GRPO's and PPO's): a tiny model memorized to ask the calculator for 2 + 3 and to answer with its result
TOOL_QUESTION = "What is 2 + 3?"
TOOL_CALL = {"name": "calculator", "arguments": {"expression": "2 + 3"}}


def tool_run_argv(model: Path, data: Path, out_dir: Path, generations: int, *extra: str) -> list[str]:
    """A 2-step GRPO or PPO --tools run on write_tool_run_inputs' model and data, `generations` per prompt, saving
    every step (its step-1 checkpoint is what a resume test starts from)."""
    return ["--data_path", str(data), "--val_data_path", str(data), "--from_weight", str(model), "--out_dir",
            str(out_dir), "--max_steps", "2", "--batch_size", "2", "--num_generations", str(generations),
            "--max_completion_length", "64", "--save_interval", "1", "--eval_interval", "100", "--eval_batches", "1",
            "--log_interval", "1", "--learning_rate", "1e-3", "--warmup_steps", "1", "--max_seq_len", "160", "--dtype",
            "float32", "--norm_impl", "eager", "--compile", "off", "--tools", "wiki,calculator,convert_units",
            "--max_tool_rounds", "2", "--reward", "tool_use", "--temperature", "1.0", *ONE_THREAD, *extra]


def write_tool_run_inputs(root: Path, tokenizer) -> tuple[Path, Path]:
    """Under `root`: the memorized model, and prompt data (tools.jsonl) of the tool question (with the tool_use
    reward's columns) and of another question it was not taught."""
    from dataset.tools import tool_schemas
    from tests.memorized_model import memorized_model, supervised_row

    asked = [{"role": "system", "content": "", "tools": tool_schemas()}, {"role": "user", "content": TOOL_QUESTION}]
    call = {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]}
    rows = [supervised_row(tokenizer, asked + [call]),
            supervised_row(tokenizer, asked + [call, {"role": "tool", "content": "5"},
                                               {"role": "assistant", "content": "2 + 3 = 5."}])]
    model = memorized_model(tokenizer, rows, root / "model", positions=512)
    other = [asked[0], {"role": "user", "content": "What is 4 + 4?"}]
    write_jsonl(root / "tools.jsonl", [
        {"prompt": prompt, "tool": "calculator", "arguments": {"expression": expression}, "result": result,
         "fact": result} for prompt, expression, result in ((asked, "2 + 3", "5"), (other, "4 + 4", "8"))] * 2)
    return model, root / "tools.jsonl"


FREQUENT_WORD_REWARD = """
def count_the(prompts, completions, **columns):
    return [completion.lower().split().count("the") / 4 for completion in completions]
"""


def pretrain_word_model(root: Path) -> Path:
    """A tiny model pretrained (60 steps, ~10 s) on write_train_data's 22-word corpus, so that it writes those
    words, "the" among them; with prompts.jsonl (write_prompt_data) and words.py (count_the) beside it for the RL
    trainers' behavioural tests. Returns the model directory."""
    write_train_data(root)
    write_prompt_data(root)
    (root / "words.py").write_text(FREQUENT_WORD_REWARD)
    argv = pretrain_argv(root, root / "pretrained", "--learning_rate", "0.03", "--warmup_steps", "5")
    argv[argv.index("--max_steps") + 1] = "60"
    run_in_process("pretrain", argv)
    return root / "pretrained"


def frequent_word_rewards(task: str, pretrained: Path, out_dir: Path, steps: int, *flags: str) -> list[float]:
    """The per-step training reward of a `task` (grpo, ppo) run into `out_dir` of `steps` steps from `pretrained`
    (pretrain_word_model's; conftest's word_model), rewarded by count_the (fixed seed, float32, eager); `flags` are
    the task's own (batch, group, epochs)."""
    root = pretrained.parent
    run_in_process(task, ["--data_path", str(root / "prompts.jsonl"), "--from_weight", str(pretrained),
                          "--out_dir", str(out_dir), "--max_steps", str(steps), "--max_completion_length", "16",
                          "--learning_rate", "3e-3", "--warmup_steps", "2", "--max_seq_len", "48", "--dtype",
                          "float32", "--norm_impl", "eager", "--compile", "off", "--log_interval", "1",
                          "--save_interval", "100", "--eval_interval", "100", "--eval_batches", "1", "--seed", "0",
                          "--reward", f"{root / 'words.py'}:count_the", *ONE_THREAD, *flags])
    rewards = [record["reward"] for record in read_metrics(out_dir, "train")]
    assert len(rewards) == steps
    return rewards


def write_train_data(root: Path) -> Path:
    """pretrain.jsonl (random word documents); sft.jsonl: conversations whose answers run from one word to
    forty, so micro-batches and processes hold very different numbers of supervised tokens (a per-micro-batch
    mean then differs from the token mean of the whole step); dpo.jsonl: the same conversations as preference
    pairs, the answer chosen over its first word repeated."""
    rng = random.Random(0)
    texts = [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 60)))} for _ in range(240)]
    write_jsonl(root / "pretrain.jsonl", texts)
    chats = []
    for i in range(160):
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.choice((1, 2, 3, 25, 40))))
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        chats.append({"conversations": [{"role": "user", "content": f"{question} {i}?"},
                                        {"role": "assistant", "content": answer}]})
    write_jsonl(root / "sft.jsonl", chats)
    pairs = []
    for chat in chats:
        prompt, answer = chat["conversations"][:1], chat["conversations"][1]["content"]
        pairs.append({"chosen": prompt + [{"role": "assistant", "content": answer}],
                      "rejected": prompt + [{"role": "assistant", "content": " ".join([answer.split()[0]] * 8)}]})
    write_jsonl(root / "dpo.jsonl", pairs)
    return root


def pretrain_argv(data_dir: Path, out_dir: Path, *extra: str) -> list[str]:
    # a --time_budget_s plans the length itself: a --max_steps beside it would be refused as unused
    length = [] if "--time_budget_s" in extra else ["--max_steps", str(STEPS)]
    return ["--data_path", str(data_dir / "pretrain.jsonl"), "--out_dir", str(out_dir), *length,
            "--save_interval", "3", *TINY, *extra]


def sft_argv(data_dir: Path, pretrained: Path, out_dir: Path, *extra: str) -> list[str]:
    return ["--data_path", str(data_dir / "sft.jsonl"), "--from_weight", str(pretrained), "--out_dir", str(out_dir),
            "--max_steps", str(SFT_STEPS), "--save_interval", "100", "--max_seq_len", "64", "--dtype", "float32",
            "--norm_impl", "eager", "--eval_interval", "3", "--eval_batches", "0", "--learning_rate", "3e-3",
            "--compile", "off", "--smeared_keys", "false", "--copy_rows", "0", *ONE_THREAD, *extra]


def finetune_argv(task: str, data_dir: Path, start: Path, out_dir: Path, *extra: str) -> list[str]:
    """A tiny LoRA or DPO run from the model directory `start` on sft.jsonl or dpo.jsonl of `data_dir`."""
    data = data_dir / ("dpo.jsonl" if task == "dpo" else "sft.jsonl")
    return ["--data_path", str(data), "--from_weight", str(start), "--out_dir", str(out_dir), "--max_steps", "6",
            "--batch_size", "4", "--save_interval", "100", "--max_seq_len", "64", "--dtype", "float32",
            "--norm_impl", "eager", "--eval_interval", "3", "--eval_batches", "0", "--compile", "off", *ONE_THREAD,
            *extra]


def run_in_process(task: str, argv: list[str]):
    from trainer.args import parse_args
    from trainer.core import Trainer

    AcceleratorState._reset_state(reset_partial_state=True)  # each run builds its own Accelerator
    try:
        return Trainer(parse_args(task, argv)).run()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def record_objective_settings(monkeypatch, objective: type) -> list:
    """The settings each `objective` (GRPO's or PPO's class) a run builds is given, in order: its __init__ wrapped."""
    built = []
    original = objective.__init__

    def record(self, rewards, tokenizer, settings, *args, **kwargs):
        built.append(settings)
        original(self, rewards, tokenizer, settings, *args, **kwargs)

    monkeypatch.setattr(objective, "__init__", record)
    return built


def record_rollout_decodes(monkeypatch) -> list[str]:
    """The decode mode each sampling engine of a run (GRPO's, PPO's and distillation's completions: trainer/grpo.py's
    sample_completions) is asked for, in order; every engine then decodes "static", so that a run asked to compile
    its decode step records the request without paying for the compile."""
    import trainer.grpo as grpo

    asked = []
    engine = grpo.GenerationEngine

    def record(model, tokenizer, max_batch, decode):
        asked.append(decode)
        return engine(model, tokenizer, max_batch=max_batch, decode="static")

    monkeypatch.setattr(grpo, "GenerationEngine", record)
    return asked


def refused_run(task: str, argv: list[str], capsys, after_progress: bool = False) -> str:
    """The one error line of a trainer run that must refuse (exit code 2) before writing anything; `after_progress`:
    the refusal comes after the progress bars of the data or the weights, as their last line."""
    import pytest

    from trainer.command import main

    capsys.readouterr()
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(task, argv)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    if after_progress:
        assert all(not line or line.startswith(("tokenizing ", "Loading weights")) for line in err[:-1]), err
    else:
        assert len(err) == 1, err
    return err[-1]


def train_losses(out_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out_dir / "metrics.jsonl", "train")]


def val_losses(out_dir: Path) -> list[float]:
    return [r["val_loss"] for r in read_metrics(out_dir / "metrics.jsonl", "val")]


def assert_same_logged_metrics(ours: Path, reference: Path, rel: float = 1e-4, abs_: float = 1e-6) -> None:
    """Two runs logged the same statistics (every number of metrics.jsonl's train and val records but timings and
    MFU): what a two-process run must show against the one-process run of the same global batch."""
    import pytest

    for split in ("train", "val"):
        mine, theirs = read_metrics(ours, split), read_metrics(reference, split)
        assert len(mine) == len(theirs) >= 2, split
        for got, want in zip(mine, theirs):
            for name, value in want.items():
                if isinstance(value, (int, float)) and not name.endswith("_s") and name != "mfu":  # not timings
                    assert got[name] == pytest.approx(value, rel=rel, abs=abs_), (split, name)


# Two-process RL runs against one process, after a few AdamW steps at lr 1e-3: Adam divides by sqrt(v), so where a
# gradient is near zero, a last-bit difference of the all-reduced sum becomes a visible difference of the update
# (measured on an AMD EPYC: 2.0e-5 in one element of 4096, 1.2% of that element's update; every other below 6e-6).
# 1e-4 is a tenth of one step; a wrong rollout or shard moves most elements by about the learning rate.
ADAM_STEPS_ATOL = 1e-4


def assert_same_model(ours: Path, reference: Path, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """The final weights of two runs equal (default: at fp32 tolerance)."""
    mine, theirs = load_file(ours / "model.safetensors"), load_file(reference / "model.safetensors")
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(mine[name], tensor, rtol=rtol, atol=atol)


def launcher(name: str) -> list[str]:
    """The README's commands for two CPU processes: torchrun, accelerate with DDP, accelerate with FSDP2."""
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    config = {"ddp": "cpu_2proc.yaml", "fsdp": "fsdp_cpu_2proc.yaml"}[name]
    return [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()),
            "--config_file", str(REPO / "trainer" / "accelerate" / config)]


def launch_two_processes(name: str, task: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    script = REPO / "trainer" / {"pretrain": "train_pretrain.py", "sft": "train_full_sft.py", "grpo": "train_grpo.py",
                                 "ppo": "train_ppo.py", "distill": "train_distillation.py",
                                 "dpo": "train_dpo.py"}[task]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([*launcher(name), str(script), *argv], capture_output=True, text=True, timeout=900,
                          env=env, cwd=cwd)


def run_two_nodes(command: list[str], cwd: Path, limit_s: int = 120) -> list[tuple[int, str]]:
    """`command` (a script and its flags) as one job of two single-process torchrun nodes on loopback (gloo), each
    under `timeout -k 10 limit_s` (a hang fails the test, not the suite): each node's exit code and stderr. Each
    node's launcher reports its own process's exit code ("exitcode  : N"), where one torchrun of two processes
    SIGTERMs the second as soon as the first has exited."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "GLOO_SOCKET_IFNAME": "lo"}
    port, nodes = free_port(), []
    for node in (0, 1):
        with open(cwd / f"node{node}.err", "w") as err:
            nodes.append(subprocess.Popen(["timeout", "-k", "10", str(limit_s),
                                           *node_launcher("torchrun", node, "127.0.0.1", port), *command],
                                          stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=cwd))
    for process in nodes:
        process.wait(timeout=limit_s + 30)
    return [(process.returncode, (cwd / f"node{node}.err").read_text()) for node, process in enumerate(nodes)]


def node_launcher(name: str, node_rank: int, master_addr: str, port: int) -> list[str]:
    """The README's commands for one node of a 2-node job, one CPU process per node: torchrun, or accelerate with
    multi_node_cpu.yaml."""
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                "--node_rank", str(node_rank), "--master_addr", master_addr, "--master_port", str(port)]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(REPO / "trainer" / "accelerate" / "multi_node_cpu.yaml"), "--machine_rank", str(node_rank),
            "--main_process_ip", master_addr, "--main_process_port", str(port)]


def pretrain_from_the_command_line(data_dir: Path, out_dir: Path, *flags: str) -> dict:
    """`python trainer/train_pretrain.py` as a user runs it, on the tiny data with these flags: it must finish its
    STEPS steps with finite, falling training losses and finite validation losses. Returns the saved config.json."""
    import math

    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "trainer/train_pretrain.py", *pretrain_argv(data_dir, out_dir, *flags)],
                         cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads((out_dir / "run_summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == STEPS
    losses = train_losses(out_dir)
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    assert all(math.isfinite(loss) for loss in val_losses(out_dir))
    return json.loads((out_dir / "config.json").read_text())
