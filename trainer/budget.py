"""Training for a wall-clock budget (`--time_budget_s`): how many optimizer steps fit in it.

The run starts with a provisional length (what the data allows) and, once 1 + CALIBRATION_STEPS steps are done,
fixes its length from their pace: the steps already taken, plus as many more as fit in what is left of the
budget at the median time of the calibration steps (the first step, which compiles and warms the caches, is
paid from the budget but left out of the pace). From then on the learning-rate schedule spans exactly that many
steps, so it ends where the budget does. Training time is the optimizer steps' own time; validation, checkpoints
and start-up are not in it. A checkpoint records the fixed length and the training time spent, so a resumed
run keeps both.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

CALIBRATION_STEPS = 5  # timed steps after the first, whose median sets the pace


@dataclass
class TimeBudget:
    budget_s: float
    max_steps: int          # the most steps the run may take whatever the budget (the data's bound)
    fixed: bool = False     # the length has been decided

    def length_after(self, step: int, session_step_times: list[float], spent_before_s: float) -> int | None:
        """The run's length in optimizer steps, decided once enough steps of this session are timed (None until
        then, and after). `step` is the number of optimizer steps done, `spent_before_s` the training seconds
        of earlier sessions of this run (a resumed run)."""
        if self.fixed:
            return None
        spent = spent_before_s + sum(session_step_times)
        if spent < self.budget_s and len(session_step_times) < 1 + CALIBRATION_STEPS:
            return None
        pace = statistics.median(session_step_times[1:] or session_step_times)
        more = int((self.budget_s - spent) / pace) if spent < self.budget_s else 0
        self.fixed = True
        return min(self.max_steps, step + more)
