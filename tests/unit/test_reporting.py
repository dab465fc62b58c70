"""The reporter's log window (trainer/reporting.py): every --log_interval steps the progress bar and wandb get each
of the objective's statistics over the window's steps as the objective declares it (stat_windows: the least of the
steps' shortest completions, the greatest of their longest, a mean defined on only some steps the mean over those,
the others the plain mean), while metrics.jsonl keeps every step's exact values."""

from __future__ import annotations

import math
import statistics
from contextlib import nullcontext
from types import SimpleNamespace

import pytest

from trainer.grpo import GroupRelativePolicy, RolloutSettings
from trainer.ppo import PPOSettings, ProximalPolicy
from trainer.reporting import TrainingReporter
from trainer.rewards import Reward
from trainer.run_dir import read_metrics
from trainer.step import RunPosition, StepResult

NAN = math.nan


class _Tracker:
    """The accelerator of a one-process run whose log records what wandb would get."""

    is_main_process = True

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log(self, values: dict[str, float], step: int) -> None:
        self.logged.append((step, values))


def accuracy(prompts, completions, **columns):  # a reward function: its name is the logged one's
    return [1.0] * len(completions)


def _grpo() -> GroupRelativePolicy:
    settings = RolloutSettings("grpo", 2, max_completion_length=9, temperature=1.0, top_p=1.0, beta=0.0,
                               epsilon_low=0.2, epsilon_high=0.28)
    return GroupRelativePolicy([Reward("accuracy", accuracy)], SimpleNamespace(pad_token_id=0), settings, None,
                               seed=0, process_index=0, autocast=nullcontext)


def _ppo() -> ProximalPolicy:
    settings = PPOSettings(num_generations=2, max_completion_length=9, temperature=1.0, top_p=1.0, beta=0.05,
                           epsilon=0.2, cliprange_value=0.2, vf_coef=0.1, gamma=1.0, lam=0.95, ppo_epochs=1)
    return ProximalPolicy([Reward("accuracy", accuracy)], SimpleNamespace(pad_token_id=0), settings, None, seed=0,
                          process_index=0, autocast=nullcontext)


# Five steps' statistics (the rest 0.5): a window of three (--log_interval 3), where no completion ended at the
# first step and no function scored at the second, then a window of two (the run's last step) where none ended.
STEPS = [
    {"completion_length_min": 2.0, "completion_length_max": 9.0, "truncated_fraction": 1.0,
     "terminated_length": NAN, "terminated_length_min": NAN, "terminated_length_max": NAN,
     "rewards/accuracy": 0.25, "rewards/accuracy_std": NAN, "completion_length": 9.0},
    {"completion_length_min": 4.0, "completion_length_max": 7.0, "truncated_fraction": 0.0,
     "terminated_length": 5.5, "terminated_length_min": 4.0, "terminated_length_max": 7.0,
     "rewards/accuracy": NAN, "rewards/accuracy_std": NAN, "completion_length": 5.5},
    {"completion_length_min": 1.0, "completion_length_max": 8.0, "truncated_fraction": 0.5,
     "terminated_length": 2.0, "terminated_length_min": 1.0, "terminated_length_max": 3.0,
     "rewards/accuracy": 0.75, "rewards/accuracy_std": 0.5, "completion_length": 5.0},
    {"completion_length_min": 9.0, "completion_length_max": 9.0, "truncated_fraction": 1.0,
     "terminated_length": NAN, "terminated_length_min": NAN, "terminated_length_max": NAN,
     "rewards/accuracy": 0.5, "rewards/accuracy_std": 0.125, "completion_length": 9.0},
    {"completion_length_min": 8.0, "completion_length_max": 9.0, "truncated_fraction": 1.0,
     "terminated_length": NAN, "terminated_length_min": NAN, "terminated_length_max": NAN,
     "rewards/accuracy": 1.0, "rewards/accuracy_std": 0.375, "completion_length": 8.5},
]


def _run(objective, tmp_path, steps: list[dict[str, float]]) -> tuple[_Tracker, str]:
    """The steps through a reporter logging every 3 steps with wandb on: (what it sent to wandb, the progress bar's
    last postfix)."""
    tracker = _Tracker()
    reporter = TrainingReporter(tracker, objective, tmp_path, task=objective.__class__.__name__, log_interval=3,
                                use_wandb=True, flops_per_token=1.0, peak_flops=None,
                                current_lrs=lambda: {"lr": 1e-3})
    reporter.start(None, len(steps))
    position = RunPosition()
    for values in steps:
        stats = {name: values.get(name, 0.5) for name in objective.stat_names}
        result = StepResult("applied", loss=1.0, grad_norm=1.0, tokens=10, stats=stats, time_s=1.0)
        position.advance(result, global_batch=2)
        reporter.after_step(position, result, len(steps))
    reporter.close()
    return tracker, reporter.progress.postfix


def _window(tracker: _Tracker, step: int) -> dict[str, float]:
    return next(values for at, values in tracker.logged if at == step)


@pytest.mark.parametrize("make", [_grpo, _ppo], ids=["grpo", "ppo"])
def test_each_statistic_of_a_window_is_what_its_name_says(tmp_path, make):
    objective = make()
    tracker, postfix = _run(objective, tmp_path, STEPS)
    first, second = _window(tracker, 3), _window(tracker, 5)
    # the shortest of the window's completions, not the mean of its steps' shortest (7/3); the longest likewise
    assert first["train/completion_length_min"] == 1.0 and first["train/completion_length_max"] == 9.0
    assert first["train/terminated_length_min"] == 1.0 and first["train/terminated_length_max"] == 7.0
    # the ended completions' mean length over the two steps where some ended, not NaN for the first step's none
    assert first["train/terminated_length"] == pytest.approx((5.5 + 2.0) / 2)
    # a function's mean and std over the steps where it scored (its std: where it scored two)
    assert first["train/rewards/accuracy"] == pytest.approx((0.25 + 0.75) / 2)
    assert first["train/rewards/accuracy_std"] == pytest.approx(0.5)
    # the others as before: the plain mean of the steps' values
    assert first["train/truncated_fraction"] == pytest.approx(statistics.fmean([1.0, 0.0, 0.5]))
    assert first["train/completion_length"] == pytest.approx(statistics.fmean([9.0, 5.5, 5.0]))
    # a window where no completion ended: their lengths are undefined (NaN), what defined the first is gone
    assert all(math.isnan(second[f"train/terminated_length{end}"]) for end in ("", "_min", "_max"))
    assert (second["train/completion_length_min"], second["train/completion_length_max"]) == (8.0, 9.0)
    assert second["train/rewards/accuracy_std"] == pytest.approx((0.125 + 0.375) / 2)
    assert "len=8.750" in postfix.split(", ")  # the progress bar's last window: the mean length of its two steps
    # metrics.jsonl keeps each step's exact values (a NaN as null)
    records = read_metrics(tmp_path, split="train")
    assert [record["completion_length_min"] for record in records] == [2.0, 4.0, 1.0, 9.0, 8.0]
    assert [record["terminated_length_min"] for record in records] == [None, 4.0, 1.0, None, None]
    assert [record["rewards/accuracy"] for record in records] == [0.25, None, 0.75, 0.5, 1.0]


def test_the_grpo_reward_is_a_mean_over_the_steps_some_completion_was_scored_also_on_the_progress_bar(tmp_path):
    """GRPO's reward and reward_std are NaN on a step no function scored (or no group had two scored): the window
    takes them over the other steps, and the progress bar shows that mean."""
    objective = _grpo()
    steps = [{**values, "reward": reward, "reward_std": std}
             for values, reward, std in zip(STEPS[:3], (0.25, NAN, 1.0), (NAN, NAN, 0.5))]
    tracker, postfix = _run(objective, tmp_path, steps)
    window = _window(tracker, 3)
    assert window["train/reward"] == pytest.approx(0.625) and window["train/reward_std"] == pytest.approx(0.5)
    assert "reward=0.625" in postfix.split(", ")


def test_the_ppo_explained_variance_is_a_mean_over_the_steps_where_the_returns_varied(tmp_path):
    objective = _ppo()
    steps = [{**values, "explained_variance": explained} for values, explained in zip(STEPS[:3], (0.25, NAN, 0.75))]
    assert _window(_run(objective, tmp_path, steps)[0], 3)["train/explained_variance"] == pytest.approx(0.5)
