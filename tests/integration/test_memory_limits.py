"""A run that cannot fit in the machine's memory fails in one line (trainer/memory.py): an allocation that fails in
a step ends the run with what it was doing, the bytes asked and the trainer's own knobs, exit code 2, its checkpoints
left as they were; a run whose one micro-batch's logits alone are more than all the memory is refused before any
data is loaded. The allocation failures are real ones under an address-space limit (RLIMIT_AS), so nothing here
holds more than a few hundred MB: the failing tensor is never allocated."""

from __future__ import annotations

import hashlib
import os
import re
import resource
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.fake_cgroups import fake_cgroups
from tests.paths import REPO
from tests.training_runs import pretrain_argv, refused_run, run_in_process
from trainer.args import parse_args
from trainer.machine import (cgroup_memory_limit_files, device_memory_bytes, physical_memory_bytes,
                             process_memory_bytes)
from trainer.memory import check_largest_tensor_fits, out_of_memory, out_of_memory_line, working_on

GIB = 2 ** 30
ADDRESS_SPACE = 4 * GIB  # the failing run's RLIMIT_AS: the tiny run's set-up takes about 1.7 GB of it
VOCAB = 2 ** 18  # a vocabulary whose logits grow fast while its embedding stays 32 MB
BIG_BATCH = 96  # 96 rows x 32 tokens x 2**18 x 4 bytes = 3 GiB of logits: within the limit, but not beside the set-up
PAST_THE_LIMIT = 160  # 5 GiB of logits: past the limit, within MemTotal
CPU_REFUSAL = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
               "allocate 140737488355328 bytes. Error code 12 (Cannot allocate memory)")
LOWER_BATCH = "lower --batch_size (a higher --accumulation_steps keeps the effective batch)"


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def _digests(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def test_a_step_that_fails_to_allocate_ends_in_one_line_and_keeps_the_checkpoints(train_data, tmp_path):
    """A resume (from step 2 of a finished 3-step run) at a --batch_size whose logits (3 GiB) the address space holds
    but not beside the set-up: the process ends with exit code 2 and one line naming the step, the allocator's bytes
    (the logits': rows x tokens x vocabulary x 4) and the knobs, no traceback; the checkpoint it resumed from and the
    model are untouched. At logits of 5 GiB, within MemTotal, the limit itself is what refuses the run before the
    data (it read MemTotal only, and the run failed in its step)."""
    logits = BIG_BATCH * 32 * VOCAB * 4
    memory = process_memory_bytes()
    assert memory is not None and memory[0] > PAST_THE_LIMIT * 32 * VOCAB * 4, \
        "the test needs a machine of more than 5 GiB (the estimate refuses)"
    out_dir = tmp_path / "run"
    flags = ("--vocab_size", str(VOCAB), "--max_steps", "3", "--save_interval", "2", "--batch_size", "2")
    run_in_process("pretrain", pretrain_argv(train_data, out_dir, *flags))
    before = _digests(out_dir)
    assert "checkpoints/step_00000002/model.safetensors" in before
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}

    def limited_resume(batch_size: int) -> subprocess.CompletedProcess:
        argv = pretrain_argv(train_data, out_dir, "--vocab_size", str(VOCAB), "--max_steps", "5", "--save_interval",
                             "2", "--batch_size", str(batch_size), "--resume", "auto")
        return subprocess.run([sys.executable, "trainer/train_pretrain.py", *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=600, env=env, preexec_fn=_limit_address_space)

    refused = limited_resume(PAST_THE_LIMIT)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"error: one micro-batch's logits would take 5.0 GiB (--batch_size {PAST_THE_LIMIT} rows x --max_seq_len 32 "
        f"tokens x {VOCAB} vocabulary x 4 bytes, fp32), more than the 4.0 GiB of this process's address-space limit "
        f"(RLIMIT_AS): {LOWER_BATCH} or --max_seq_len"], refused.stderr[-3000:]
    assert _digests(out_dir) == before  # refused before the resume rewrote anything
    run = limited_resume(BIG_BATCH)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last == (f"error: out of memory in step 3's forward and backward (DefaultCPUAllocator: can't allocate "
                    f"memory: you tried to allocate {logits} bytes): {LOWER_BATCH}, --max_seq_len or the model's "
                    f"sizes, or give --gradient_checkpointing"), last
    # what the resume itself rewrites before its first step (train_config.yaml, metrics.jsonl cut back to step 2,
    # run_summary.json: the run is no longer finished) aside, every file is as it was: the checkpoint it goes on from
    # and the last model
    after = _digests(out_dir)
    kept = {name: digest for name, digest in before.items()
            if name not in ("train_config.yaml", "metrics.jsonl", "run_summary.json")}
    assert {name: after.get(name) for name in kept} == kept


def test_logits_past_all_memory_are_refused_before_the_data(train_data, tmp_path, capsys, monkeypatch):
    """MemTotal made 1 MiB: a pretraining micro-batch of 4 x 32 tokens x 6,400 fp32 logits (3.1 MiB) is refused in
    one line (no tokenizing, nothing written) naming the flags and both sizes; the model's sizes, which leave the
    logits alone, are not offered."""
    import trainer.machine

    monkeypatch.setattr(trainer.machine, "physical_memory_bytes", lambda meminfo: 2 ** 20)
    argv = pretrain_argv(train_data, tmp_path / "run", "--batch_size", "4")
    error = refused_run("pretrain", argv, capsys)
    assert error == ("error: one micro-batch's logits would take 3.1 MiB (--batch_size 4 rows x --max_seq_len 32 "
                     "tokens x 6400 vocabulary x 4 bytes, fp32), more than the 1.0 MiB of this machine's physical "
                     "memory (MemTotal): lower --batch_size (a higher --accumulation_steps keeps the effective "
                     "batch) or --max_seq_len")
    assert not (tmp_path / "run").exists()


def test_a_rollout_group_past_any_machine_is_refused(tiny_models, tmp_path, capsys):
    """GRPO's --num_generations 3000000 (two prompts: 6,000,000 completions of up to 64 + 64 tokens, 18,310.5 GiB of
    logits) sampled until a MemoryError 19 s in; --num_generations 100000 sampled for over ten minutes. No machine
    holds it: refused at once, without the data."""
    argv = ["--from_weight", str(tiny_models.pretrain), "--out_dir", str(tmp_path / "run"), "--batch_size", "2",
            "--max_seq_len", "64", "--max_completion_length", "64", "--num_generations", "3000000",
            "--norm_impl", "eager", "--dtype", "float32", "--threads", "1"]
    error = refused_run("grpo", argv, capsys)
    vocab = 6400
    size = 2 * 3000000 * 1 * vocab * 4 / GIB  # a completion's length is the sampling's: one token is certain
    assert error.startswith(f"error: one micro-batch's logits would take {size:,.1f} GiB (--batch_size 2 prompts x "
                            f"--num_generations 3000000 completions x at least 1 token (padded to the batch's "
                            f"longest) x {vocab} vocabulary x 4 bytes, fp32), more than the "), error
    assert error.endswith(f"GiB of this machine's physical memory (MemTotal): {LOWER_BATCH} or --num_generations"), \
        error
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("task, rows, tokens", [("pretrain", 3, 16), ("sft", 3, 1), ("dpo", 3, 1), ("grpo", 3 * 4, 1),
                                                ("ppo", 3 * 4, 1)])
def test_the_estimate_refuses_only_past_the_memory(task, rows, tokens, monkeypatch):
    """The logits' bytes written out by hand (rows x tokens x vocabulary x 4; a rollout's rows are prompts x
    completions; a padded row is one certain token, a packed pretraining row --max_seq_len): exactly that much memory
    is enough, a byte less is not."""
    import trainer.machine

    args = parse_args(task, ["--out_dir", "/nonexistent/run", "--batch_size", "3", "--max_seq_len", "16",
                             *(["--num_generations", "4", "--max_completion_length", "8"]
                               if task in ("grpo", "ppo") else [])])
    need = rows * tokens * 100 * 4
    monkeypatch.setattr(trainer.machine, "physical_memory_bytes", lambda meminfo: need)
    check_largest_tensor_fits(args, 100, 512, torch.device("cpu"))
    monkeypatch.setattr(trainer.machine, "physical_memory_bytes", lambda meminfo: need - 1)
    with pytest.raises(ValueError, match=r"^one micro-batch's logits would take") as refused:
        check_largest_tensor_fits(args, 100, 512, torch.device("cpu"))
    if task != "pretrain":  # the flags that make the rows: --num_generations only where there are completions
        rows_remedy = f": {LOWER_BATCH} or --num_generations" if task in ("grpo", "ppo") else f": {LOWER_BATCH}"
        assert str(refused.value).endswith(rows_remedy), str(refused.value)
        return
    # a row is at most the model's positions long (a longer one is the positions' own refusal)
    monkeypatch.setattr(trainer.machine, "physical_memory_bytes", lambda meminfo: rows * 10 * 100 * 4)
    check_largest_tensor_fits(args, 100, 10, torch.device("cpu"))
    monkeypatch.setattr(trainer.machine, "physical_memory_bytes", lambda meminfo: rows * 10 * 100 * 4 - 1)
    with pytest.raises(ValueError, match=r"x the model's max_position_embeddings 10 tokens x 100 vocabulary"):
        check_largest_tensor_fits(args, 100, 10, torch.device("cpu"))
    # rows exactly the model's positions long are --max_seq_len's, the flag the user lowers
    with pytest.raises(ValueError, match=r"x --max_seq_len 16 tokens x 100 vocabulary"):
        check_largest_tensor_fits(args, 100, 16, torch.device("cpu"))


def test_distillation_counts_the_larger_vocabulary(monkeypatch):
    import trainer.machine

    args = parse_args("distill", ["--out_dir", "/nonexistent/run", "--batch_size", "2", "--max_seq_len", "8"])
    padded = 2 * 1 * 100 * 4  # a padded row's 1 token
    monkeypatch.setattr(trainer.machine, "physical_memory_bytes", lambda meminfo: padded)
    check_largest_tensor_fits(args, 50, 512, torch.device("cpu"), teacher_vocab_size=100)
    with pytest.raises(ValueError, match=r"^one micro-batch's logits \(the larger of the student's and the teacher's"
                                         r"\) would take .* x 101 vocabulary"):
        check_largest_tensor_fits(args, 50, 512, torch.device("cpu"), teacher_vocab_size=101)


def test_the_machine_memory_is_memtotal_and_a_gpu_its_total(monkeypatch):
    """MemTotal (kB) is the pages the C library counts; the CPU's is what the process can hold (its limits below); a
    CUDA device's is its total memory, not what is free."""
    assert physical_memory_bytes() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert device_memory_bytes(torch.device("cpu")) == process_memory_bytes()

    class Properties:
        total_memory = 80 * GIB

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    assert device_memory_bytes(torch.device("cuda", 0)) == (80 * GIB, "cuda:0's total memory")


MEMTOTAL = (2 * GIB, "this machine's physical memory (MemTotal)")
NO_V1_LIMIT = str(2 ** 63 - 4096)  # what cgroup v1 writes for no limit


def _write_limits(tmp_path: Path, memtotal_kib: int, v2: str | None, v1: str | None) -> tuple[Path, tuple[Path, Path]]:
    """A fake /proc/meminfo and the two cgroup files (one left absent where None)."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {memtotal_kib} kB\nMemFree:         1024 kB\n")
    files = (tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes")
    for path, text in zip(files, (v2, v1)):
        path.unlink(missing_ok=True)
        if text is not None:
            path.write_text(text)
    return meminfo, files


@pytest.mark.parametrize("v2, v1, expected", [
    (None, None, MEMTOTAL),
    ("max\n", None, MEMTOTAL),  # v2's no limit
    (None, NO_V1_LIMIT + "\n", MEMTOTAL),
    ("1073741824\n", None, (GIB, "memory.max")),
    ("max\n", f"{GIB // 2}\n", (GIB // 2, "memory.limit_in_bytes")),
    (f"{3 * GIB}\n", f"{GIB}\n", (GIB, "memory.limit_in_bytes")),  # the smaller of the two
    ("not a number\n", "", MEMTOTAL),  # unreadable as a limit: none
    ("0\n", None, MEMTOTAL),  # no group can run on no memory: a 0 says nothing of a limit
])
def test_the_process_memory_is_the_smallest_limit_set(v2, v1, expected, tmp_path):
    """MemTotal beside a cgroup's limit (v2's memory.max, v1's memory.limit_in_bytes), read from files in tmp_path;
    this test process has no address-space limit below them."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    assert soft == resource.RLIM_INFINITY or soft > 2 * GIB, "run the test without a ulimit -v below 2 GiB"
    meminfo, files = _write_limits(tmp_path, 2 * GIB // 1024, v2, v1)
    size, where = expected
    if where.startswith("memory."):
        where = f"this process's cgroup memory limit ({tmp_path / where})"
    assert process_memory_bytes(meminfo, files) == (size, where)


@pytest.mark.parametrize("groups, limits, expected", [
    # v1 (this machine's kind: memory:/process_api/<id>): the root's file says no limit, the job's group's is 1 GiB
    ("4:memory:/job/step\n0::/\n", {"memory/memory.limit_in_bytes": NO_V1_LIMIT,
                                     "memory/job/memory.limit_in_bytes": NO_V1_LIMIT,
                                     "memory/job/step/memory.limit_in_bytes": f"{GIB}\n"},
     (GIB, "memory/job/step/memory.limit_in_bytes")),
    # v2: a group's limit holds the groups below it ("max" there)
    ("0::/system.slice/job.scope\n", {"system.slice/memory.max": f"{GIB // 2}\n",
                                      "system.slice/job.scope/memory.max": "max\n"},
     (GIB // 2, "system.slice/memory.max")),
    # a container without a cgroup namespace: its group's path is not under its mount, whose root is its own group
    ("0::/docker/abc\n", {"memory.max": f"{GIB}\n"}, (GIB, "memory.max")),
    ("0::/../other\n", {"memory.max": f"{GIB}\n", "other/memory.max": "1\n"}, (GIB, "memory.max")),
    ("", {}, MEMTOTAL),  # no /proc/self/cgroup: the root's files, absent here
])
def test_the_cgroup_limit_is_this_processs_groups_or_one_above_it(groups, limits, expected, tmp_path, monkeypatch):
    """The cgroup limit files read are those of /proc/self/cgroup's group and each group above it (v2's memory.max,
    v1's memory/memory.limit_in_bytes), the smallest limit counting: the root's file alone said no limit for a
    process in a limited group (a batch job's), and by default process_memory_bytes reads these files."""
    self_cgroup, root = fake_cgroups(tmp_path, groups, limits)
    meminfo, _ = _write_limits(tmp_path, 2 * GIB // 1024, None, None)
    files = cgroup_memory_limit_files(self_cgroup, root)
    size, where = expected
    if not where.startswith("this machine"):
        where = f"this process's cgroup memory limit ({root / where})"
    assert process_memory_bytes(meminfo, files) == (size, where)
    import trainer.machine

    monkeypatch.setattr(trainer.machine, "cgroup_memory_limit_files", lambda: files)  # what the default reads
    assert process_memory_bytes(meminfo) == (size, where)


def test_an_address_space_limit_counts_where_it_is_the_smallest(tmp_path):
    """A real RLIMIT_AS (4 GiB) in a child process, beside a fake MemTotal of 8 GiB: it is the limit under a cgroup
    limit of 6 GiB; a cgroup limit of 3 GiB is under it."""
    script = ("import sys; from pathlib import Path; from trainer.machine import process_memory_bytes; "
              "print(repr(process_memory_bytes(Path(sys.argv[1]), (Path(sys.argv[2]),))))")
    found = []
    for cgroup in (6, 3):
        meminfo, files = _write_limits(tmp_path, 8 * GIB // 1024, f"{cgroup * GIB}\n", None)
        child = subprocess.run([sys.executable, "-c", script, str(meminfo), str(files[0])], cwd=REPO,
                               capture_output=True, text=True, timeout=300, preexec_fn=_limit_address_space)
        assert child.returncode == 0, child.stderr[-3000:]
        found.append(child.stdout.strip())
    assert found == [repr((ADDRESS_SPACE, "this process's address-space limit (RLIMIT_AS)")),
                     repr((3 * GIB, f"this process's cgroup memory limit ({tmp_path / 'memory.max'})"))]


@pytest.mark.parametrize("task, flags, knobs", [
    ("pretrain", [], ", --max_seq_len or the model's sizes"),
    ("pretrain", ["--copy_rows", "4"], ", --max_seq_len, --copy_rows or the model's sizes"),
    ("sft", ["--copy_rows", "0"], " or --max_seq_len"),
    ("dpo", [], " or --max_seq_len"),
    ("distill", [], " or --max_seq_len"),
    ("distill", ["--lmbda", "0.5"], ", --max_seq_len or --max_new_tokens"),
    ("grpo", [], ", --max_seq_len, --num_generations or --max_completion_length"),
    ("ppo", ["--gradient_checkpointing"], ", --max_seq_len, --num_generations or --max_completion_length"),
])
def test_the_line_names_the_trainers_own_knobs(task, flags, knobs):
    """Every trainer's line named --copy_rows (GRPO, DPO and distillation have none) and none named --num_generations;
    --gradient_checkpointing is offered where it is off."""
    args = parse_args(task, ["--out_dir", "/nonexistent/run", *flags])
    checkpointing = "" if "--gradient_checkpointing" in flags else ", or give --gradient_checkpointing"
    said = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 140737488355328 bytes"
    assert out_of_memory_line(RuntimeError(CPU_REFUSAL), args) == (
        f"out of memory ({said}): {LOWER_BATCH}{knobs}{checkpointing}")


def test_working_on_names_what_the_run_was_doing():
    """The innermost stage is kept beside the outer one; any other error is left untouched."""
    args = parse_args("distill", ["--out_dir", "/nonexistent/run"])
    with pytest.raises(MemoryError) as raised:
        with working_on("step 3's forward and backward"), working_on("the teacher's forward"):
            raise MemoryError()
    assert re.match(r"^out of memory in step 3's forward and backward \(the teacher's forward\) \(MemoryError\): ",
                    out_of_memory_line(raised.value, args))
    with pytest.raises(RuntimeError) as other:
        with working_on("the evaluation"):
            raise RuntimeError("Expected all tensors to be on the same device")
    assert out_of_memory_line(other.value, args) is None and not hasattr(other.value, "mininorm_stage")


def test_the_evaluation_and_the_teachers_forward_are_named_where_they_fail_to_allocate():
    """The marks the trainers leave around what they run (trainer/core.py's evaluate, trainer/distillation.py's
    teacher forward): an allocation failure inside each names it in the line."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from trainer.core import Trainer
    from trainer.distillation import Distillation

    def no_memory(*args, **kwargs):
        raise MemoryError()

    def student(**inputs):
        return SimpleNamespace(logits=torch.zeros(1, 3, 5))

    args = parse_args("distill", ["--out_dir", "/nonexistent/run"])
    trainer = SimpleNamespace(objective=SimpleNamespace(evaluate=no_memory), unwrapped=None, val_loader=None,
                              accelerator=None, token_bytes=None)
    with pytest.raises(MemoryError) as raised:
        Trainer.evaluate(trainer, 0)
    assert out_of_memory_line(raised.value, args).startswith("out of memory in the evaluation (MemoryError): ")
    ids = torch.tensor([[1, 2, 3]])
    distillation = SimpleNamespace(teacher=no_memory, autocast=nullcontext)
    with pytest.raises(MemoryError) as raised:
        Distillation.loss(distillation, student, {"input_ids": ids, "labels": ids}, torch.tensor(2))
    assert out_of_memory_line(raised.value, args).startswith("out of memory in the teacher's forward (MemoryError): ")


def test_an_errors_causes_that_loop_are_read_once_each():
    """out_of_memory reads an error's causes (`raise ... from`) and stops at one it has read: a chain that comes back
    to itself is no allocation failure, or the one it holds, after each error is read once. Each error counts its
    reads and refuses an eleventh, so a reader that went round the loop fails here rather than hanging."""
    class Counted(RuntimeError):
        def __init__(self, text: str) -> None:
            super().__init__(text)
            self.reads = 0

        def __str__(self) -> str:
            self.reads += 1
            assert self.reads <= 10, "the causes were read round their loop"
            return super().__str__()

    first, second = Counted("rollout: sampling a completion failed"), Counted("a step failed")
    first.__cause__, second.__cause__ = second, first
    assert out_of_memory(first) is None
    assert (first.reads, second.reads) == (1, 1)
    allocation = Counted(CPU_REFUSAL)
    first.__cause__, allocation.__cause__ = allocation, first
    said = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 140737488355328 bytes"
    assert out_of_memory(first) == said


@pytest.mark.parametrize("task", ["grpo", "ppo", "distill"])
def test_an_allocation_failure_inside_the_sampling_engine_ends_in_the_one_line(task, tokenizer):
    """A bare MemoryError raised by the model inside the sampling engine (GRPO's and PPO's rollouts, distillation's
    on-policy samples), under train_step's mark: the engine ends the request (it never dies of one), and the rollout
    said only "sampling a completion failed: MemoryError: " in a RuntimeError the run's one line did not know, a
    traceback; it is the one line naming the rollouts now."""
    from types import SimpleNamespace

    from model import MiniNormConfig, MiniNormForCausalLM
    from trainer.core import Trainer
    from trainer.distillation import Distillation
    from trainer.grpo import RolloutObjective

    def no_memory(*args, **kwargs):
        raise MemoryError()

    model = MiniNormForCausalLM(MiniNormConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, norm_impl="eager"))
    model.forward = no_memory  # the prefill's forward asks for more than there is
    common = SimpleNamespace(process_index=0, world=1, seed=0, tokenizer=tokenizer)
    if task == "distill":
        objective = SimpleNamespace(**vars(common), completions=SimpleNamespace(max_new_tokens=4, temperature=1.0,
                                                                                     decode="static"))
        batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "labels": torch.tensor([[-100, -100, 7, 8]])}

        def rollouts(model, batches, step, accelerator):  # Distillation.rollouts, the student sampling
            return [Distillation.sampled(objective, model, batches[0], step, 0)]
    else:
        objective = SimpleNamespace(**vars(common), settings=SimpleNamespace(
            num_generations=2, max_completion_length=4, temperature=1.0, top_p=1.0, tools=(), decode="static"))
        batch = {"prompt_ids": [[5, 6, 7]]}
        objective.sample_rollouts = partial(RolloutObjective.sample_rollouts, objective)  # the plain completions'

        def rollouts(model, batches, step, accelerator):  # RolloutObjective.rollouts, through its sample
            return [RolloutObjective.sample(objective, model, batches[0], step, 0, sampler=model)]

    trainer = SimpleNamespace(objective=SimpleNamespace(rollouts=rollouts), unwrapped=model, accelerator=None)
    with pytest.raises((MemoryError, RuntimeError)) as raised:
        Trainer.train_step(trainer, [batch], step=2)
    args = parse_args(task, ["--out_dir", "/nonexistent/run"])
    line = out_of_memory_line(raised.value, args)
    assert line is not None and line.startswith(
        "out of memory in step 3's rollouts (its sampled completions) (MemoryError): lower --batch_size"), line


def test_an_allocation_failure_while_the_data_is_loaded_names_it(train_data, tmp_path, capsys, monkeypatch):
    """The data tokenized before step 1 (faked to fail to allocate): the one line said "out of memory (MemoryError)",
    no stage, where the set-up and the steps are named; nothing is written. Its remedy is the loading's own (the
    tokenizing processes, the longest lines), not the step's flags (--batch_size there changes nothing)."""
    import trainer.core

    def no_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(trainer.core, "build_run_data", no_memory)
    error = refused_run("pretrain", pretrain_argv(train_data, tmp_path / "run"), capsys)
    assert error == ("error: out of memory in loading the data (MemoryError): shorten the longest lines of the data "
                     "(a line is held whole, with its tokens)"), error
    assert not (tmp_path / "run").exists()
    error = refused_run("pretrain", pretrain_argv(train_data, tmp_path / "run", "--num_proc", "3"), capsys)
    assert error.startswith("error: out of memory in loading the data (MemoryError): lower --num_proc (each of its 3 "
                            "processes holds its own batch of lines) or shorten"), error
