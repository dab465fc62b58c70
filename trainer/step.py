"""What one optimizer step produced, and where the run stands after it.

`Trainer.train_step` (trainer/core.py) returns a `StepResult`; the loop advances a `RunPosition` with it and hands
both to the components that log, evaluate, checkpoint and fix a time budget's length.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

StepOutcome = Literal["applied", "skipped", "diverged"]
# Why a run diverged, as its error line says: the step's loss or gradient, or the logits its rollouts sampled from.
NON_FINITE_LOSS = "non-finite loss or gradient"
POLICY, TEACHER = "policy", "teacher"  # who samples: the model trained, or distillation's frozen teacher (--seq_kd)


def non_finite_sampling(sampler: str = POLICY, validation: bool = False) -> str:
    """The cause of a run whose `sampler`'s sampling scores became NaN or infinite (`validation`: in a validation's
    greedy completions after a step)."""
    return (f"the {sampler}'s sampling scores became NaN or infinite"
            + (" in the validation after it" if validation else ""))


NON_FINITE_SAMPLING = non_finite_sampling()
NON_FINITE_VALIDATION = non_finite_sampling(validation=True)


class SamplingDiverged(RuntimeError):
    """Raised on every process by a step's rollouts (GRPO's, PPO's, distillation's sampled completions), or with
    `validation` by a validation's greedy ones after a step, when a completion's sampling scores became NaN or
    infinite on any process: the model's logits diverged (a learning rate that blew the weights up), which the run
    ends as a diverged run (trainer/core.py). `sampler` names whose logits they were: the policy's, or the teacher's
    of distillation's --seq_kd (frozen, its weights checked finite at load: its forward itself overflowed)."""

    def __init__(self, validation: bool = False, sampler: str = POLICY) -> None:
        super().__init__(non_finite_sampling(sampler, validation))
        self.validation, self.sampler = validation, sampler


def step_outcome(loss: float, grad_norm: float, scaler_skipped: bool | None) -> StepOutcome:
    """What one optimizer step amounted to. `scaler_skipped`: None without an fp16 grad scaler, else whether the
    scaler skipped the update. Under fp16 an inf/NaN gradient is an overflow the scaler handles (it skips the
    update and lowers the scale), so only a non-finite loss is divergence; without a scaler either one is."""
    if not math.isfinite(loss):
        return "diverged"
    if scaler_skipped is None:
        return "applied" if math.isfinite(grad_norm) else "diverged"
    return "skipped" if scaler_skipped else "applied"


@dataclass
class StepResult:
    """One optimizer step over a group of micro-batches, on every process."""

    outcome: StepOutcome
    loss: float                   # the global mean loss over the step's units (tokens, preference pairs)
    grad_norm: float = math.nan   # before clipping; NaN when the backend reports none (DeepSpeed) or it diverged
    tokens: int = 0               # real (unpadded) input tokens over all processes: the throughput count
    stats: dict[str, float] = field(default_factory=dict)        # the objective's statistics (means over units)
    diagnostics: dict[str, float] = field(default_factory=dict)  # norm diagnostics, on armed steps only
    time_s: float = math.nan      # wall time of the step, loading its batches included


def combine_updates(results: list[StepResult]) -> StepResult:
    """One optimizer step that took several updates on one rollout (GRPO's --num_iterations, PPO's --ppo_epochs):
    applied if any update was; the loss, gradient norm and statistics are the updates' means; the diagnostics are
    the last update's. One update is its own result."""
    if len(results) == 1:
        return results[0]
    outcome: StepOutcome = "applied" if any(r.outcome == "applied" for r in results) else "skipped"
    stats = {name: statistics.fmean(r.stats[name] for r in results) for name in results[0].stats}
    return StepResult(outcome, statistics.fmean(r.loss for r in results),
                      statistics.fmean(r.grad_norm for r in results), results[0].tokens, stats,
                      results[-1].diagnostics)


class StatWindow(StrEnum):
    """How a statistic's value over a window of steps (the reporter's every --log_interval steps) is taken from
    the steps' values: what its name says it is. An objective declares it per statistic (`stat_windows`)."""

    MEAN = "mean"                  # the mean of the steps' values (the default)
    DEFINED_MEAN = "defined_mean"  # the mean over the steps where it is defined (not NaN); NaN only if none is
    MIN = "min"                    # the least of the steps' values (a minimum's); steps where it is NaN left out
    MAX = "max"                    # the greatest of the steps' values (a maximum's); steps where it is NaN left out


def window_value(how: StatWindow, values: Sequence[float]) -> float:
    """One statistic's value over a window of steps from each step's value, as `how` says (NaN when a
    DEFINED_MEAN, MIN or MAX has no step where it is defined)."""
    if how is StatWindow.MEAN:
        return statistics.fmean(values)
    defined = [value for value in values if not math.isnan(value)]
    if not defined:
        return math.nan
    if how is StatWindow.MIN:
        return min(defined)
    if how is StatWindow.MAX:
        return max(defined)
    return statistics.fmean(defined)


def window_stats(results: Sequence[StepResult], names: Sequence[str],
                 windows: Mapping[str, StatWindow]) -> dict[str, float]:
    """The statistics `names` over a window of steps, each as `windows` says (one it leaves out: the mean)."""
    return {name: window_value(windows.get(name, StatWindow.MEAN), [result.stats[name] for result in results])
            for name in names}


@dataclass
class RunPosition:
    """Where the run stands: optimizer steps done, the epoch and the global samples of it consumed, tokens seen.
    A checkpoint saves it; resuming restores it."""

    step: int = 0
    epoch: int = 0
    samples_done: int = 0
    tokens_seen: int = 0

    def advance(self, result: StepResult, global_batch: int) -> None:
        self.step += 1
        self.samples_done += global_batch
        self.tokens_seen += result.tokens


@dataclass
class SessionPace:
    """This session's optimizer steps (a resumed run starts a new session): seconds and real tokens of each."""

    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def add(self, result: StepResult) -> None:
        self.times.append(result.time_s)
        self.tokens.append(result.tokens)

    def seconds(self) -> float:
        return sum(self.times)

    def median_step_s(self) -> float:
        return statistics.median(self.times) if self.times else math.nan

    def tokens_per_s(self) -> float:
        """Real tokens per second of training step; the session's first step (compilation, allocator warm-up) is
        left out when there are others."""
        if not self.times:
            return math.nan
        skip = 1 if len(self.times) > 1 else 0
        return sum(self.tokens[skip:]) / sum(self.times[skip:])

