"""--time_budget_s: the run's length is planned from the pace of its first timed steps and re-planned as the pace
changes, the learning-rate schedule ends where the budget does, and a resumed run keeps the length and the time
spent. Every clock here is simulated: the slowdowns are injected, nothing is timed."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import trainer.core
from tests.training_runs import pretrain_argv, run_in_process
from trainer.budget import CALIBRATION_STEPS, TimeBudget
from trainer.run_dir import read_metrics
from trainer.schedule import lr_multiplier


def test_length_is_the_steps_done_plus_what_fits_at_the_median_pace():
    budget = TimeBudget(30.0, max_steps=1000)
    times = [10.0]  # the first step compiles: paid from the budget, left out of the pace
    assert budget.length_after(1, times, 0.0) is None
    for step in range(2, 2 + CALIBRATION_STEPS):
        times.append(1.0 if step != 3 else 4.0)  # one slow step: the median ignores it
        length = budget.length_after(step, times, 0.0)
        assert (length is None) == (step < 1 + CALIBRATION_STEPS)
    # 6 steps took 18 s; 12 s left at 1 s/step.
    assert length == 6 + 12
    assert budget.length_after(7, [*times, 1.0], 0.0) == 7 + 11  # re-planned after every step


def _simulated_run(budget_s: float, pace: Callable[[int], float], max_steps: int = 10_000) -> tuple[int, float]:
    """Run the budget's plan against injected step times (`pace(step)` for the step-th step, 1-based): the steps
    the run takes and the training time they add up to."""
    budget = TimeBudget(budget_s, max_steps=max_steps)
    length, times = max_steps, []
    while len(times) < length:
        times.append(pace(len(times) + 1))
        planned = budget.length_after(len(times), times, 0.0)
        length = length if planned is None else planned
    return len(times), sum(times)


@pytest.mark.parametrize("before, after", [(0.5, 1.5), (1.5, 0.5)], ids=["slows down", "speeds up"])
def test_a_pace_that_changes_mid_run_still_ends_the_run_at_the_budget(before, after):
    # The first step compiles (4 s); the pace changes at step 40 of a 100 s budget (another process starts, or
    # stops). A length fixed once from the first steps ran 254 s ("slows down") or 74 s ("speeds up");
    # re-planned, the run ends within one step of the budget, on the near side of it.
    steps, spent = _simulated_run(100.0, lambda step: 4.0 if step == 1 else before if step < 40 else after)
    assert 100.0 - after < spent <= 100.0


def test_length_is_capped_by_the_data_and_stops_at_once_when_the_budget_is_spent():
    assert TimeBudget(100.0, max_steps=9).length_after(6, [1.0] * 6, 0.0) == 9
    # A first step longer than the budget (or time spent before a resume) ends the run where it is.
    assert TimeBudget(5.0, max_steps=100).length_after(1, [7.0], 0.0) == 1
    assert TimeBudget(5.0, max_steps=100).length_after(3, [1.0, 1.0], 4.0) == 3


@pytest.fixture
def steady_clock(monkeypatch):
    """The trainer's clock advancing `tick` s per reading: every optimizer step (timed by two consecutive
    readings) takes 0.5 s by default."""
    def install(tick: float = 0.5):
        counter = itertools.count()
        monkeypatch.setattr(trainer.core, "time", SimpleNamespace(perf_counter=lambda: next(counter) * tick))
    return install


def test_budget_run_takes_the_steps_that_fit_and_its_schedule_ends_at_the_budget(train_data, tmp_path, steady_clock):
    steady_clock()
    out_dir = tmp_path / "budget"
    # 0.5 s a step, 5.5 s: 6 calibration steps take 3 s, 5 more fit; --max_steps 8 does not apply. Warmup spans
    # the calibration steps, so the whole schedule is the fixed length's (before it, cosine decay would follow the
    # provisional length).
    run_in_process("pretrain", pretrain_argv(train_data, out_dir, "--batch_size", "4", "--time_budget_s", "5.5",
                                             "--warmup_steps", "6", "--min_lr_ratio", "0.1"))
    records = read_metrics(out_dir, "train")
    assert [r["step"] for r in records] == list(range(1, 12))
    assert sum(r["step_time_s"] for r in records) == pytest.approx(5.5)
    # Each record holds the lr of the next step; the whole schedule is the one of an 11-step run, floor at the end.
    expected = [3e-3 * lr_multiplier(step, 6, 11, 0.1, "cosine", 0.2) for step in range(1, 12)]
    assert [r["lr"] for r in records] == pytest.approx(expected)
    assert records[-1]["lr"] == pytest.approx(3e-4)


def test_budget_run_that_slows_down_mid_run_re_plans_and_its_schedule_still_ends_at_the_budget(
        train_data, tmp_path, monkeypatch):
    # Every clock reading advances 0.25 s until reading 24 (twelve steps), then 0.5 s: the machine became twice as
    # slow after the first plan. From step 15 on, the plans see the new pace and shorten the run to the budget.
    readings = itertools.count()

    def clock() -> float:
        index = next(readings)
        return 0.25 * min(index, 24) + 0.5 * max(0, index - 24)

    monkeypatch.setattr(trainer.core, "time", SimpleNamespace(perf_counter=clock))
    out_dir = tmp_path / "slowing"
    run_in_process("pretrain", pretrain_argv(train_data, out_dir, "--batch_size", "2", "--time_budget_s", "7",
                                             "--warmup_steps", "6", "--min_lr_ratio", "0.1", "--epochs", "5"))
    records = read_metrics(out_dir, "train")
    times = [r["step_time_s"] for r in records]
    assert times[0] == pytest.approx(0.25) and times[-1] == pytest.approx(0.5)
    assert 7 - 0.5 < sum(times) <= 7 + 1e-9
    assert records[-1]["lr"] == pytest.approx(3e-4)  # the schedule reached its floor at the budget's end


def test_budget_run_resumed_at_the_same_pace_reproduces_the_run_and_a_slower_one_stops_at_the_budget(
        train_data, tmp_path, steady_clock):
    steady_clock()
    reference = tmp_path / "reference"
    run_in_process("pretrain", pretrain_argv(train_data, reference, "--batch_size", "4", "--time_budget_s", "5.5"))
    checkpoint = str(reference / "checkpoints" / "step_00000009")
    # Resumed from step 9 (4.5 s spent) at the same pace: the planned length holds, the weights are the same bits.
    steady_clock()
    resumed = tmp_path / "resumed"
    run_in_process("pretrain", pretrain_argv(train_data, resumed, "--batch_size", "4", "--time_budget_s", "5.5",
                                             "--resume", checkpoint))
    assert [r["step"] for r in read_metrics(resumed, "train")] == [10, 11]
    ours, theirs = load_file(resumed / "model.safetensors"), load_file(reference / "model.safetensors")
    assert all(torch.equal(ours[name], tensor) for name, tensor in theirs.items())
    # On a machine four times slower the first step spends the budget (6.5 s of 5.5): the run stops there.
    steady_clock(tick=2.0)
    slower = tmp_path / "slower"
    run_in_process("pretrain", pretrain_argv(train_data, slower, "--batch_size", "4", "--time_budget_s", "5.5",
                                             "--resume", checkpoint))
    assert [r["step"] for r in read_metrics(slower, "train")] == [10]


def test_resumed_before_the_length_was_fixed_it_counts_the_time_already_spent(train_data, tmp_path, steady_clock):
    steady_clock()
    first = tmp_path / "run"
    # Checkpoint at step 3 (1.5 s spent), before the length is fixed; the first session runs on to the end.
    run_in_process("pretrain", pretrain_argv(train_data, first, "--batch_size", "4", "--time_budget_s", "5.5",
                                             "--keep_checkpoints", "5"))
    steady_clock()
    resumed = tmp_path / "resumed"
    run_in_process("pretrain", pretrain_argv(train_data, resumed, "--batch_size", "4", "--time_budget_s", "5.5",
                                             "--resume", str(first / "checkpoints" / "step_00000003")))
    # 1.5 s before, then 6 timed steps (3 s) in this session: 1 s left, 2 more steps.
    assert [r["step"] for r in read_metrics(resumed, "train")] == list(range(4, 12))
