"""--time_budget_s: the run's length is fixed from the pace of its first timed steps, the learning-rate schedule
ends where the budget does, and a resumed run keeps the length and the time spent."""

from __future__ import annotations

import itertools
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
    assert budget.length_after(7, [*times, 1.0], 0.0) is None  # decided once


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
    expected = [3e-3 * lr_multiplier(step, 6, 11, 0.1) for step in range(1, 12)]
    assert [r["lr"] for r in records] == pytest.approx(expected)
    assert records[-1]["lr"] == pytest.approx(3e-4)


def test_budget_run_resumed_keeps_its_length_and_reproduces_the_run(train_data, tmp_path, steady_clock):
    steady_clock()
    reference = tmp_path / "reference"
    run_in_process("pretrain", pretrain_argv(train_data, reference, "--batch_size", "4", "--time_budget_s", "5.5"))
    # Resumed from step 9 on a machine four times slower: the length fixed at step 6 holds.
    steady_clock(tick=2.0)
    resumed = tmp_path / "resumed"
    run_in_process("pretrain", pretrain_argv(train_data, resumed, "--batch_size", "4", "--time_budget_s", "5.5",
                                             "--resume", str(reference / "checkpoints" / "step_00000009")))
    assert [r["step"] for r in read_metrics(resumed, "train")] == [10, 11]
    ours, theirs = load_file(resumed / "model.safetensors"), load_file(reference / "model.safetensors")
    assert all(torch.equal(ours[name], tensor) for name, tensor in theirs.items())


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
