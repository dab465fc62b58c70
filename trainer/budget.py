"""Training for a wall-clock budget (`--time_budget_s`): how many optimizer steps fit in it.

The run starts with a provisional length (what the data allows). Once 1 + CALIBRATION_STEPS steps are done it
plans its length from their pace: the steps already taken, plus as many more as fit in what is left of the
budget at the median time of the calibration steps (the first step, which compiles and warms the caches, is
paid from the budget but left out of the pace). The pace of a shared machine changes (another process starts, or
stops), so the plan is redone after every step from the median of the last PACE_WINDOW steps: a burst of load at
the start no longer shortens the whole run, one near the end no longer carries it past the budget. The
learning-rate schedule reads the planned length at every step, so its decay follows the plan and ends where the
budget does; once the budget is spent the plan is the step the run is at, and it stops: the run ends on the
first step that reaches the budget.

Training time is the optimizer steps' own time; validation, checkpoints and start-up are not in it. A checkpoint
records the planned length and the training time spent, so a resumed run goes on from both (its first plan comes
after its own calibration steps).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

CALIBRATION_STEPS = 5  # timed steps after the first, whose median sets the first plan's pace
PACE_WINDOW = 5        # the latest steps whose median is a later plan's pace: a change shows after three steps


@dataclass
class TimeBudget:
    budget_s: float
    max_steps: int          # the most steps the run may take whatever the budget (the data's bound)
    fixed: bool = False     # a length has been planned (the provisional one is replaced)

    def length_after(self, step: int, session_step_times: list[float], spent_before_s: float) -> int | None:
        """The run's length in optimizer steps, planned after each step (None before the calibration ends while
        budget is left). `step` is the number of optimizer steps done, `session_step_times` the times of this
        session's steps (a resumed run starts a new session), `spent_before_s` the training seconds of earlier
        sessions of this run."""
        done = len(session_step_times)
        spent = spent_before_s + sum(session_step_times)
        if spent >= self.budget_s:
            self.fixed = True
            return min(self.max_steps, step)
        if done < 1 + CALIBRATION_STEPS:
            return None
        timed = session_step_times[1:] or session_step_times
        pace = statistics.median(timed[-PACE_WINDOW:])
        self.fixed = True
        return min(self.max_steps, step + int((self.budget_s - spent) / pace))
