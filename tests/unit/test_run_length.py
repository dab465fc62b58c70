"""trainer/run_length.py's plan of a run's length and trainer/intervals.py's timing of the loop's every-N-steps work,
against the counts written out by hand."""

from __future__ import annotations

import pytest

from trainer.args import parse_args
from trainer.budget import TimeBudget
from trainer.intervals import Intervals
from trainer.run_length import budget_plan_line, plan_run_length


def _args(*flags: str):
    # --max_steps -1: the length --epochs gives, unless the flags give one (a --time_budget_s plans its own)
    length = [] if "--max_steps" in flags or "--time_budget_s" in flags else ["--max_steps", "-1"]
    return parse_args("pretrain", ["--out_dir", "/tmp/unused_run_length", *length, *flags])


def test_epochs_of_a_fresh_run_are_whole_global_batches():
    # 100 samples, batch 4 x accumulation 3 x 2 processes = 24 a step: 4 steps an epoch (4 samples left over).
    length = plan_run_length(_args("--batch_size", "4", "--accumulation_steps", "3", "--epochs", "2"), 100, 2, None)
    assert (length.global_batch, length.steps_per_epoch, length.total_steps, length.budget) == (24, 4, 8, None)


def test_a_run_resumed_at_another_batch_finishes_the_same_epochs():
    # Resumed at step 5 in epoch 0 with 40 of 100 samples done, now 10 a step: 60 left in epoch 0 (6 steps), then
    # one more epoch of 10 steps.
    state = {"step": 5, "epoch": 0, "samples_done_in_epoch": 40, "total_steps": 99}
    length = plan_run_length(_args("--batch_size", "10", "--epochs", "2"), 100, 1, state)
    assert length.total_steps == 5 + 6 + 10


def test_max_steps_wins_and_a_fixed_budget_keeps_the_checkpoints_length():
    assert plan_run_length(_args("--batch_size", "4", "--max_steps", "7"), 100, 1, None).total_steps == 7
    state = {"step": 5, "epoch": 0, "samples_done_in_epoch": 20, "total_steps": 12, "budget_fixed": True}
    length = plan_run_length(_args("--batch_size", "4", "--time_budget_s", "60"), 100, 1, state)
    assert length.total_steps == 12 and length.budget == TimeBudget(60.0, max_steps=12, fixed=True)


def test_a_step_larger_than_the_training_set_is_one_line():
    with pytest.raises(ValueError, match="one optimizer step needs 16 samples, the training set has 10"):
        plan_run_length(_args("--batch_size", "8"), 10, 2, None)


def test_a_plan_is_said_when_new_or_moved_by_five_percent():
    times = [9.0, 1.0, 1.0, 3.0, 1.0, 1.0]  # the first step (compiling) is left out of the pace: median 1.0
    assert budget_plan_line(60.0, 40, None, times) == "--time_budget_s 60: 40 optimizer steps fit (pace 1.000 s/step)"
    assert budget_plan_line(60.0, 39, 40, times) is None  # 2.5% off the announced 40
    assert budget_plan_line(60.0, 38, 40, times).endswith(", re-planned)")  # 5%


def test_diagnostics_evaluations_and_checkpoints_fall_on_their_steps():
    intervals = Intervals(diag_interval=4, eval_interval=3, save_interval=5)
    # diagnosed before a step: the first (0 done), every 4th, and the last of 10
    assert [done for done in range(10) if intervals.diagnoses(done, 10)] == [0, 4, 8, 9]
    # after a step, never on the last (the final evaluation and the model directory are the run's end)
    assert [step for step in range(1, 10) if intervals.evaluates(step, 9)] == [3, 6]
    assert [step for step in range(1, 11) if intervals.checkpoints(step, 10)] == [5]
    never = Intervals(diag_interval=0, eval_interval=0, save_interval=0)
    assert not any(never.diagnoses(s, 10) or never.evaluates(s, 10) or never.checkpoints(s, 10) for s in range(11))


def test_epochs_past_max_size_steps_are_refused_and_the_bound_itself_taken():
    """--epochs x steps per epoch (10 here: 100 samples, 10 a step) past MAX_SIZE steps was a run with no end; a
    run of exactly MAX_SIZE steps is planned, and a time budget (which ends the run itself) takes any --epochs."""
    epochs_at_bound = 2147483640 // 10  # 2,147,483,640 steps: MAX_SIZE is 2,147,483,647
    assert plan_run_length(_args("--batch_size", "10", "--epochs", str(epochs_at_bound)), 100, 1,
                           None).total_steps == 2147483640
    with pytest.raises(ValueError) as error:
        plan_run_length(_args("--batch_size", "10", "--epochs", str(epochs_at_bound + 1)), 107, 1, None)
    assert str(error.value) == ("--epochs=214748365 is not allowed; at 10 optimizer steps per epoch it makes a run of "
                                "2147483650 steps, past the 2147483647 (MAX_SIZE, model/config.py) any run ends in: "
                                "lower --epochs or give --max_steps")
    # MAX_SIZE itself: --epochs 2,147,483,647 of one step each (10 samples, 10 a step, accumulation 1)
    assert plan_run_length(_args("--batch_size", "10", "--accumulation_steps", "1", "--epochs", "2147483647"), 10, 1,
                           None).total_steps == 2147483647
    budget = _args("--batch_size", "10", "--epochs", "2147483647", "--time_budget_s", "60")
    assert plan_run_length(budget, 100, 1, None).budget is not None


def test_intervals_past_the_run_mean_never_but_the_first_and_last_diagnoses():
    """An interval longer than the run (10**30 is taken) means never, as its --help says: no evaluation or
    checkpoint inside the run (the run's end has its own), and diagnostics on the first and last steps only."""
    huge = 10 ** 30
    intervals = Intervals(diag_interval=huge, eval_interval=huge, save_interval=huge)
    assert [done for done in range(10) if intervals.diagnoses(done, 10)] == [0, 9]
    assert not any(intervals.evaluates(s, 10) or intervals.checkpoints(s, 10) for s in range(1, 11))
