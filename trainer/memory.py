"""A run's memory: the refusal, before any data is loaded, of a run whose one largest tensor is more than all the
memory of its device (`check_largest_tensor_fits`, in the words of `past_memory`, which the benchmarks and studies
ask about their own tensors), and the one line an allocation that fails during the run ends with
(`out_of_memory_line`, which trainer/command.py prints): what the run was doing (`working_on` marks it), what the
allocator said (the bytes it was asked for, where it says them) and the flags of this trainer that shrink it.

The largest tensor a step makes is the logits: one micro-batch's rows x tokens x vocabulary, fp32 (4 bytes; the
loss reads them at fp32 whatever --dtype). A rollout's rows are its prompts x --num_generations completions;
distillation's teacher makes a second tensor of that shape beside the student's. The check only refuses what
certainly cannot fit, that one tensor alone past all the memory: pretraining's packed rows are --max_seq_len tokens
each, but a padded row (SFT, DPO, distillation, a rollout's completion) is as long as its batch's longest, which the
data and the sampling decide, so it counts one token there (a worst case of --max_seq_len would refuse a run of
short conversations that fits). A run near the edge is left to the allocator, whose refusal is the one line too."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from trainer.arg_fields import TrainArgs, task_flags
from trainer.machine import device_memory_bytes
from trainer.run_dir import ROLLOUT_TASKS

FP32_BYTES = 4  # the logits' bytes per value
GIB = 2 ** 30

# The allocators' refusals: the CPU's (a RuntimeError) and CUDA's (torch.OutOfMemoryError, a RuntimeError too)
_ALLOCATOR_REFUSAL = re.compile(r"(DefaultCPUAllocator: (?:can't allocate|not enough) memory[^.]*|CUDA out of memory\."
                                r"(?: Tried to allocate [\d.]+ \w+)?)")
_STAGE = "mininorm_stage"  # the attribute working_on leaves on an allocation failure: what the run was doing
LOADING_DATA = "loading the data"  # the stage (working_on) before the model exists: the step's flags play no part


def out_of_memory(error: BaseException) -> str | None:
    """What an allocation that failed said (None: `error` is no allocation failure), for a one-line refusal: a
    size the flags allow but no memory holds was the allocator's traceback (a model of --hidden_size 2**30). An
    error raised from one (`raise ... from`: the sampling engine's failed request, trainer/grpo.py) is one too."""
    cause, seen = error, set()
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, MemoryError):
            return "MemoryError"
        found = _ALLOCATOR_REFUSAL.search(str(cause))
        if found:
            return found.group(1)
        seen.add(id(cause))
        cause = cause.__cause__
    return None


@contextmanager
def working_on(stage: str) -> Iterator[None]:
    """Mark an allocation failure raised inside with `stage` (what the run was doing, a noun: "step 3's forward and
    backward"), for out_of_memory_line; an inner mark is kept beside it ("step 3's forward and backward (the teacher's
    forward)"). Any other error passes untouched."""
    try:
        yield
    except (MemoryError, RuntimeError) as error:
        if out_of_memory(error) is not None:
            inner = getattr(error, _STAGE, None)
            setattr(error, _STAGE, f"{stage} ({inner})" if inner else stage)
        raise


def shrink_advice(args: TrainArgs, activations: bool = True) -> str:
    """The flags of `args`' trainer that shrink a step's tensors, as a remedy ("lower ..."); `activations`: also
    --gradient_checkpointing (it keeps fewer activations; the logits stay whole), where the run has it off."""
    flags = task_flags(args.task)
    lower = ["--batch_size (a higher --accumulation_steps keeps the effective batch)", "--max_seq_len"]
    if "num_generations" in flags:
        lower += ["--num_generations", "--max_completion_length"]
    if "max_new_tokens" in flags and (args.lmbda > 0 or args.seq_kd):
        lower.append("--max_new_tokens")
    if "copy_rows" in flags and args.copy_rows:
        lower.append("--copy_rows")
    if activations and args.task == "pretrain":  # fine-tuning keeps its model's sizes; they leave the logits alone
        lower.append("the model's sizes")
    remedy = f"lower {', '.join(lower[:-1])} or {lower[-1]}"
    if activations and not args.gradient_checkpointing:
        remedy += ", or give --gradient_checkpointing"
    return remedy


def loading_advice(args: TrainArgs) -> str:
    """What shrinks the memory of loading the data (LOADING_DATA), as a remedy: the jsonl files are read a batch of
    lines at a time into an Arrow cache on disk (dataset/building.py), so what is held is each tokenizing process's
    batch, whose longest lines count whole: fewer --num_proc processes, shorter lines. The step's flags change
    nothing there."""
    remedy = "shorten the longest lines of the data (a line is held whole, with its tokens)"
    if args.num_proc is not None and args.num_proc > 1:
        remedy = f"lower --num_proc (each of its {args.num_proc} processes holds its own batch of lines) or {remedy}"
    return remedy


def allocation_failure_line(error: BaseException, remedy: str) -> str | None:
    """The one line work that failed to allocate ends with (None: `error` is no allocation failure): what it was
    doing (working_on's mark, if any), what the allocator said and `remedy` ("lower ..."): "out of memory in STAGE
    (SAID): REMEDY". The trainer's (out_of_memory_line) and a study's."""
    said = out_of_memory(error)
    if said is None:
        return None
    stage = getattr(error, _STAGE, None)
    doing = f" in {stage}" if stage else ""
    return f"out of memory{doing} ({said}): {remedy}"


def out_of_memory_line(error: BaseException, args: TrainArgs) -> str | None:
    """The one line a run that failed to allocate ends with (None: `error` is no allocation failure): what it was
    doing, what the allocator said and what to lower."""
    loading = getattr(error, _STAGE, None) == LOADING_DATA
    return allocation_failure_line(error, loading_advice(args) if loading else shrink_advice(args))


class LargestTensor(NamedTuple):
    """One micro-batch's logits: its rows, their tokens, the vocabulary, and how the flags make them."""

    rows: int
    tokens: int
    vocab_size: int
    described: str

    @property
    def bytes(self) -> int:
        return self.rows * self.tokens * self.vocab_size * FP32_BYTES


def largest_tensor(args: TrainArgs, vocab_size: int, positions: int) -> LargestTensor:
    """The logits one micro-batch certainly makes: pretraining's --batch_size packed rows of --max_seq_len tokens
    (at most the model's `positions`: a longer row is refused by the model's own check, trainer/core.py's
    _base_model, with its own words); a padded batch's --batch_size rows, or a rollout's prompts x --num_generations
    completions, of at least one token each (their length is the batch's longest, which the data decides)."""
    if args.task in ROLLOUT_TASKS:
        rows = args.batch_size * args.num_generations
        described = f"--batch_size {args.batch_size} prompts x --num_generations {args.num_generations} completions"
    else:
        rows, described = args.batch_size, f"--batch_size {args.batch_size} rows"
    if args.task != "pretrain":
        return LargestTensor(rows, 1, vocab_size, f"{described} x at least 1 token (padded to the batch's longest)")
    tokens, length = args.max_seq_len, "--max_seq_len"
    if tokens > positions:
        tokens, length = positions, "the model's max_position_embeddings"
    return LargestTensor(rows, tokens, vocab_size, f"{described} x {length} {tokens} tokens")


def _fewer_rows(args: TrainArgs) -> str:
    """The remedy where only the rows are certain (padded batches): the flags that make them."""
    rows = "--batch_size (a higher --accumulation_steps keeps the effective batch)"
    return f"lower {rows} or --num_generations" if args.task in ROLLOUT_TASKS else f"lower {rows}"


def size_text(count: int) -> str:
    """A byte count in GiB, or in MiB below one GiB (a test's fake memory), for a refusal that names both the bytes a
    tensor takes and the memory there is (also the benchmarks', eval/benchmarks/)."""
    return f"{count / GIB:,.1f} GiB" if count >= GIB else f"{count / 2 ** 20:,.1f} MiB"


def past_memory(needed: int, what: str, device: torch.device, remedy: str, counted: str = "") -> str | None:
    """The one line refusing work whose tensors alone would take `needed` bytes, more than all the memory of `device`
    (trainer/machine.py's device_memory_bytes), before the work starts; None where they may fit, or the memory is
    unknown. `what` names them and the flags that make them ("--m 1024 x --n 256: the 4 float32 tensors of that
    shape"), `counted` how the bytes are counted, if said after them, and `remedy` what to do ("lower --m or --n"):
    "WHAT would take N (COUNTED), more than the M of WHERE: REMEDY". The trainer's logits check and every
    benchmark's and study's memory check say it in these words."""
    memory = device_memory_bytes(device)
    if memory is None or needed <= memory[0]:
        return None
    total, where = memory
    how = f" ({counted})" if counted else ""
    return f"{what} would take {size_text(needed)}{how}, more than the {size_text(total)} of {where}: {remedy}"


def check_largest_tensor_fits(args: TrainArgs, vocab_size: int, positions: int, device: torch.device,
                              teacher_vocab_size: int | None = None) -> None:
    """Refuse (a ValueError, one line: past_memory's) a run whose one micro-batch's logits alone are more than all
    the memory of `device` (trainer/machine.py): it cannot run, and would fail at its first step after the data was
    loaded, or be killed by the kernel. Distillation's teacher makes logits of its own vocabulary beside the
    student's: the larger is the one checked; `positions`: the model's max_position_embeddings. Nothing is refused
    where the memory is unknown."""
    vocab = max(vocab_size, teacher_vocab_size or 0)
    tensor = largest_tensor(args, vocab, positions)
    whose = " (the larger of the student's and the teacher's)" if teacher_vocab_size is not None else ""
    refusal = past_memory(tensor.bytes, f"one micro-batch's logits{whose}", device,
                          _fewer_rows(args) if args.task != "pretrain" else shrink_advice(args, False),
                          f"{tensor.described} x {vocab} vocabulary x {FP32_BYTES} bytes, fp32")
    if refusal is not None:
        raise ValueError(refusal)
