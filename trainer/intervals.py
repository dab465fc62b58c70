"""When the loop's every-N-steps work falls: the armed diagnostics (--diag_interval), the evaluations
(--eval_interval) and the checkpoints (--save_interval). One place decides each event's timing; the loop in
trainer/core.py asks after (or, for the diagnostics, before) each optimizer step."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.arg_fields import TrainArgs


def due(interval: int, step: int) -> bool:
    """Whether an every-`interval`-steps event (0: never) falls on `step`."""
    return interval > 0 and step % interval == 0


@dataclass(frozen=True)
class Intervals:
    diag_interval: int
    eval_interval: int
    save_interval: int

    @classmethod
    def from_args(cls, args: TrainArgs) -> Intervals:
        return cls(args.diag_interval, args.eval_interval, args.save_interval)

    def diagnoses(self, steps_done: int, total_steps: int) -> bool:
        """Whether the next step is diagnosed: the first step, every --diag_interval after it, and the last (the
        state the run ends in)."""
        return self.diag_interval > 0 and (due(self.diag_interval, steps_done) or steps_done + 1 == total_steps)

    def evaluates(self, step: int, total_steps: int) -> bool:
        """Every --eval_interval steps (the last step has the final evaluation instead)."""
        return due(self.eval_interval, step) and step < total_steps

    def checkpoints(self, step: int, total_steps: int) -> bool:
        """Every --save_interval steps (the last step saves the model directory instead)."""
        return due(self.save_interval, step) and step < total_steps
