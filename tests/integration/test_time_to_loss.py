"""eval/benchmarks/time_to_loss.py: the time to a target loss from the run's records, the recipe rules, and a tiny
end-to-end run of two recipes on the test data under the trainer's --time_budget_s (a table and results.json with
both)."""

from __future__ import annotations

import json

import pytest
import yaml

from eval.benchmarks.time_to_loss import main, parse_custom_recipes, recipe_flags, time_to_target
from tests.fake_memory import fake_memory
from tests.training_runs import TINY


def test_time_to_target_sums_the_steps_up_to_the_first_validation_below_it():
    train = [{"step": step, "step_time_s": 0.5 * step} for step in range(1, 9)]  # 0.5, 1.0, ... 4.0 s
    val = [{"step": 2, "val_loss": 7.0}, {"step": 4, "val_loss": 6.0}, {"step": 6, "val_loss": 5.4},
           {"step": 8, "val_loss": 5.5}]
    assert time_to_target(train, val, 6.0) == pytest.approx(0.5 + 1.0 + 1.5 + 2.0)  # reached at step 4, inclusive
    assert time_to_target(train, val, 5.45) == pytest.approx(sum(0.5 * s for s in range(1, 7)))
    assert time_to_target(train, val, 5.0) is None


def test_recipes_are_named_flag_sets_that_leave_the_budget_to_the_benchmark():
    assert recipe_flags("baseline", {}) == ()
    assert recipe_flags("wsd", {}) == ("--lr_schedule", "wsd")
    assert "--optimizer" in recipe_flags("previous_default", {})  # the AdamW recipe the default replaced
    custom = parse_custom_recipes(["big=--batch_size 32 --learning_rate 3e-3"])
    assert recipe_flags("big", custom) == ("--batch_size", "32", "--learning_rate", "3e-3")
    with pytest.raises(ValueError, match="unknown recipe 'nope'"):
        recipe_flags("nope", custom)
    with pytest.raises(ValueError, match="--max_steps=9 is set by the benchmark"):
        recipe_flags("long", parse_custom_recipes(["long=--max_steps=9"]))
    with pytest.raises(ValueError, match="--time_budget_s is set by the benchmark"):
        recipe_flags("long", parse_custom_recipes(["long=--time_budget_s 9"]))
    with pytest.raises(ValueError, match="expected NAME=FLAGS"):
        parse_custom_recipes(["--batch_size 32"])


def test_two_recipes_end_to_end(train_data, tmp_path, capsys):
    """Tiny model, a 1.5 s budget: both recipes train on the budget, validate; the table and results.json say so."""
    at = TINY.index("--eval_interval")  # the benchmark sets it
    common = TINY[:at] + TINY[at + 2:] + ["--data_path", str(train_data / "pretrain.jsonl"), "--batch_size", "4"]
    assert main(["--recipes", "baseline,wsd", "--budget_s", "1.5", "--target_loss", "100",
                 "--eval_interval", "2", "--common_flags", " ".join(common), "--out_dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    runs = {run["recipe"]: run for run in results["runs"]}
    assert set(runs) == {"baseline", "wsd"} and all(run["status"] == "finished" for run in runs.values())
    for name, run in runs.items():
        assert run["steps"] >= 1 and run["time_to_target_s"] is not None and run["dtype"] == "float32"
        summary = json.loads((tmp_path / f"{name}_seed0" / "run_summary.json").read_text())
        assert yaml.safe_load((tmp_path / f"{name}_seed0" / "train_config.yaml").read_text())["time_budget_s"] == 1.5
        assert run["val_loss"] == summary["final_val"]["loss"]
    assert yaml.safe_load((tmp_path / "wsd_seed0" / "train_config.yaml").read_text())["lr_schedule"] == "wsd"
    table = capsys.readouterr().out.split("| recipe |")[1]
    assert "| baseline | the defaults |" in table and "| wsd | `--lr_schedule wsd` |" in table


def test_the_trainers_refusal_of_a_recipe_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    """A recipe's trainer that refuses its flags (here its logits past a fake 1 MiB memory) ends the benchmark in the
    trainer's one line, naming the recipe and seed; it was the ValueError's traceback."""
    fake_memory(monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        main(["--recipes", "baseline", "--budget_s", "1", "--out_dir", str(tmp_path / "runs")])
    assert stopped.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("error: recipe baseline, seed 0: one micro-batch's logits would take "), last
    assert "more than the 1.0 MiB of a fake 1 MiB memory" in last
