"""The run's length in optimizer steps: planned at set-up from the data, the global batch, a resumed checkpoint
and --max_steps / --epochs / --time_budget_s, then (under a time budget) re-planned after every step from the pace
(trainer/budget.py's TimeBudget decides how many steps fit; this module asks it and says so)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from accelerate.utils import broadcast_object_list

from model.config import MAX_SIZE
from dataset.shown_value import flag_refusal
from trainer.arg_fields import TrainArgs
from trainer.budget import PACE_WINDOW, TimeBudget
from trainer.checkpoint_state import saved_position


@dataclass
class RunLength:
    global_batch: int          # samples per optimizer step, all processes
    steps_per_epoch: int       # global batches in one pass over the shuffled, sharded training set
    total_steps: int           # the planned length (a time budget may re-plan it)
    budget: TimeBudget | None  # --time_budget_s's plan, None without one


def plan_run_length(args: TrainArgs, train_size: int, world: int, resume_state: dict[str, Any] | None) -> RunLength:
    """The run's length: optimizer steps per epoch (global batches in one pass over the shuffled, sharded
    training set), the planned total and a time budget's plan; refused in one line when one step needs more
    samples than the training set has, or --epochs ask for more steps than MAX_SIZE."""
    global_batch = args.batch_size * args.accumulation_steps * world
    steps_per_epoch = train_size // global_batch
    if steps_per_epoch < 1:
        raise ValueError(f"one optimizer step needs {global_batch} samples, the training set has "
                         f"{train_size}; lower --batch_size or --accumulation_steps")
    total = total_steps(args, resume_state, train_size, global_batch, steps_per_epoch)
    if total > MAX_SIZE and not args.time_budget_s:  # --epochs decided it (--max_steps has its bound at parsing)
        raise ValueError(flag_refusal("epochs", args.epochs,
                                      f"at {steps_per_epoch} optimizer steps per epoch it makes a run of {total} "
                                      f"steps, past the {MAX_SIZE} (MAX_SIZE, model/config.py) any run ends in: lower "
                                      f"--epochs or give --max_steps"))
    budget = None
    if args.time_budget_s:
        budget = TimeBudget(args.time_budget_s, max_steps=total, fixed=bool((resume_state or {}).get("budget_fixed")))
    return RunLength(global_batch, steps_per_epoch, total, budget)


def total_steps(args: TrainArgs, resume_state: dict[str, Any] | None, train_size: int, global_batch: int,
                steps_per_epoch: int) -> int:
    """--max_steps, or the optimizer steps that complete --epochs passes over the data. A run resumed with
    another global batch finishes the same number of epochs: the steps already taken, plus what is left of
    the data at the new batch size. Under --time_budget_s: the length the budget fixed (a resumed run), else
    the data's bound until the budget fixes it (trainer/budget.py)."""
    if args.time_budget_s > 0 and (resume_state or {}).get("budget_fixed"):
        return resume_state["total_steps"]
    if args.max_steps > 0 and not args.time_budget_s:
        return args.max_steps
    if resume_state is None:
        return args.epochs * steps_per_epoch
    epoch, samples_done = saved_position(resume_state)
    left_in_epoch = (train_size - samples_done) // global_batch
    return resume_state["step"] + left_in_epoch + (args.epochs - epoch - 1) * steps_per_epoch


def budget_length_after(budget: TimeBudget, step: int, session_step_times: list[float], spent_before_s: float,
                        world: int) -> int | None:
    """The length the budget plans after `step` (None while it is still calibrating). Collective with several
    processes, after every step (an int: far below a step's cost): all stop where the main one decided."""
    length = budget.length_after(step, session_step_times, spent_before_s)
    if world > 1:
        length = broadcast_object_list([length])[0]
        budget.fixed = length is not None
    return length


def budget_plan_line(budget_s: float, length: int, announced: int | None,
                     session_step_times: list[float]) -> str | None:
    """The line that says a time budget's plan, when it is new or moved by 5% or more from the `announced` one
    (None: nothing to say)."""
    if announced is not None and abs(length - announced) < 0.05 * announced:
        return None
    pace = statistics.median(session_step_times[1:][-PACE_WINDOW:] or session_step_times)
    return (f"--time_budget_s {budget_s:g}: {length} optimizer steps fit (pace {pace:.3f} s/step"
            + (")" if announced is None else ", re-planned)"))
