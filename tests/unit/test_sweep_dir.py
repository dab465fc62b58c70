"""trainer/sweep_dir.py's own logic, pinned where only the sweep runner's integration tests reached it: which
results.jsonl lines and state trials are a sweep's, and how a records folder brings done trials back."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from trainer.sweep_dir import (done_records, is_folder_name, read_results, read_state, restore_records,
                               save_records, swept_names)


def _trial(tid: str, status: str = "pending") -> dict:
    return {"trial_id": tid, "params": {"lr": 0.1}, "status": status, "metric": None}


def _sweep(folder: Path, trials: list[dict], results: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sweep_state.json").write_text(json.dumps({"name": "s", "config": {}, "trials": trials}))
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    for record in results:
        trial = folder / "trials" / record["trial_id"]
        trial.mkdir(parents=True, exist_ok=True)
        (trial / "run_summary.json").write_text(json.dumps({"status": record["status"]}))
        (trial / "metrics.jsonl").write_text(json.dumps({"step": 1, "split": "val"}) + "\n")
        (trial / "model.safetensors").write_bytes(b"weights")
    return folder


def test_folder_names_are_one_plain_component_and_swept_names_vary():
    assert all(map(is_folder_name, ("lr-0.1_seed-0", "a=b", "_x", "0")))
    assert not any(map(is_folder_name, ("..", ".hidden", "a/b", "", None, 3, "a b")))
    assert swept_names({"parameters": {"lr": {"values": [1, 2]}, "wd": {"min": 0, "max": 1},
                                       "seed": {"value": 0}}}) == ["lr", "wd"]


def test_results_are_the_lines_of_trials_and_done_is_finished_or_diverged(tmp_path):
    lines = [{"trial_id": "a", "status": "failed"}, {"trial_id": "a", "status": "finished", "metric": 1.0},
             {"trial_id": "../up", "status": "finished"}, {"trial_id": "b", "status": "running"},
             {"trial_id": "c", "status": "diverged"}, {"status": "finished"}]
    _sweep(tmp_path, [], [])
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"trial_id": "d", "st')
    assert read_results(tmp_path) == [lines[0], lines[1], lines[4]]
    assert done_records(tmp_path) == {"a": lines[1], "c": lines[4]}
    assert read_results(tmp_path / "none") == []


@pytest.mark.parametrize("trial, message", [
    ({"trial_id": "..", "params": {}, "status": "pending"}, "trials[0].trial_id: expected a folder name, got '..'"),
    ({"trial_id": "a", "params": [], "status": "pending"}, "trials[0].params: expected a mapping"),
    ({"trial_id": "a", "params": {}, "status": "done"}, "trials[0].status: expected one of pending, running, "
                                                        "failed, finished, diverged, got 'done'"),
])
def test_a_state_with_a_trial_no_runner_can_use_is_refused_naming_it(tmp_path, trial, message):
    _sweep(tmp_path, [trial], [])
    with pytest.raises(ValueError) as refused:
        read_state(tmp_path)
    assert str(refused.value).startswith(f"{tmp_path / 'sweep_state.json'}: {message}")


def test_records_keep_the_done_trials_and_bring_back_only_what_a_sweep_lacks(tmp_path):
    results = [{"trial_id": "a", "status": "finished", "metric": 1.5}, {"trial_id": "b", "status": "failed"},
               {"trial_id": "c", "status": "diverged", "metric": None}]
    first = _sweep(tmp_path / "first", [_trial("a", "finished"), _trial("b", "failed"), _trial("c", "diverged")],
                   results)
    records = tmp_path / "records"
    save_records(first, records, ["a"])
    assert sorted(p.name for p in (records / "trials").iterdir()) == ["a"]
    save_records(first, records)
    assert sorted(p.name for p in (records / "trials").iterdir()) == ["a", "c"]  # b failed: nothing to keep
    assert sorted(p.name for p in (records / "trials" / "a").iterdir()) == ["metrics.jsonl.gz", "run_summary.json"]
    assert gzip.decompress((records / "trials" / "a" / "metrics.jsonl.gz").read_bytes()) == (
        first / "trials" / "a" / "metrics.jsonl").read_bytes()
    # elsewhere: a sweep that has done c itself and knows a and a new trial d (b joins as the records had it)
    second = _sweep(tmp_path / "second", [_trial("a"), _trial("c", "finished"), _trial("d")],
                    [{"trial_id": "c", "status": "finished", "metric": 2.0}])
    assert restore_records(records, second) == ["a"]
    assert [(r["trial_id"], r["status"]) for r in read_results(second)] == [("c", "finished"), ("a", "finished")]
    state = read_state(second)
    assert [(t["trial_id"], t["status"], t["metric"]) for t in state["trials"]] == [
        ("a", "finished", 1.5), ("c", "finished", None), ("d", "pending", None), ("b", "failed", None)]
    assert (second / "trials" / "a" / "metrics.jsonl").read_bytes() == (first / "trials/a/metrics.jsonl").read_bytes()
    assert restore_records(records, second) == []  # nothing left to bring back
    # a new folder takes the records' state whole, its done trials' statuses included
    third = tmp_path / "third"
    third.mkdir()
    assert sorted(restore_records(records, third)) == ["a", "c"]
    assert [(t["trial_id"], t["status"]) for t in read_state(third)["trials"]] == [
        ("a", "finished"), ("b", "failed"), ("c", "diverged")]


def test_saving_the_records_of_a_folder_that_holds_no_sweep_is_one_line(tmp_path):
    """save_records returned without a word where the folder holds no sweep state (no sweep there, a typo, a state
    deleted): the records folder was asked for and nothing was kept."""
    folder = tmp_path / "not_a_sweep"
    (folder / "trials" / "a").mkdir(parents=True)
    records = tmp_path / "records"
    with pytest.raises(ValueError, match=rf"^{folder}: no sweep there \(sweep_state.json is missing\); nothing to "
                                         rf"save into {records}$"):
        save_records(folder, records)
    assert not records.exists()


@pytest.mark.parametrize(("damage", "by_trainer", "why"), [
    ("summary deleted", False, "run_summary.json is missing"),
    ("summary a directory", False, "run_summary.json is no file"),
    ("summary not JSON", False, "run_summary.json cannot be read as a run summary, where results.jsonl says finished"),
    ("summary says failed", False, "run_summary.json says 'failed', where results.jsonl says finished"),
    ("metrics deleted", True, "metrics.jsonl.gz is missing"),
    ("config deleted", True, "train_config.yaml is missing"),
    ("config not UTF-8", True, "train_config.yaml: not valid UTF-8 (byte 0xff at offset 0)"),
    # read only as text, a list (or a file cut short) came back as the trial's record
    ("config a list", True, "train_config.yaml: a list, expected the run's flags (a mapping of flag names to values, "
                            "as the trainer writes it); repair it"),
])
def test_a_done_trial_whose_record_files_are_damaged_is_refused_and_nothing_is_brought_back(tmp_path, damage,
                                                                                           by_trainer, why):
    """A records folder whose done trial lost its files (a partial copy or commit) or holds unreadable ones: the
    trial was brought back as done without them, its metrics and summary gone from the report and never rerun.
    Now one line names the file and the way on, and the sweep folder is left as it was; once the trial's lines are
    removed from the records' results.jsonl, it is pending (it runs again) and the others come back."""
    results = [{"trial_id": "a", "status": "finished", "metric": 1.5}, {"trial_id": "b", "status": "finished"}]
    first = _sweep(tmp_path / "first", [_trial("a", "finished"), _trial("b", "finished")], results)
    for tid in ("a", "b"):
        (first / "trials" / tid / "train_config.yaml").write_text("task: pretrain\n")
    records = tmp_path / "records"
    save_records(first, records)
    damaged = records / "trials" / "a" / {"summary": "run_summary.json", "metrics": "metrics.jsonl.gz",
                                          "config": "train_config.yaml"}[damage.split()[0]]
    if damage.endswith("deleted"):
        damaged.unlink()
    elif damage == "summary a directory":
        damaged.unlink()
        damaged.mkdir()
    elif damage == "summary says failed":
        damaged.write_text(json.dumps({"status": "failed"}))
    elif damage == "config a list":
        damaged.write_text("- pretrain\n")
    else:
        damaged.write_bytes(b"\xff{" if damage.endswith("UTF-8") else b"{")
    second = tmp_path / "second"
    second.mkdir()
    with pytest.raises(ValueError) as refused:
        restore_records(records, second, by_trainer=by_trainer)
    where = str(records / "trials" / "a") + "/"
    assert str(refused.value) == (
        f"--records_dir: {where}{why}; nothing was brought back: restore the records' files (git checkout, git lfs "
        f"pull, or a copy from the machine that ran the trial), or remove the trial's lines from "
        f"{records / 'results.jsonl'} to run it again")
    assert list(second.iterdir()) == []
    (records / "results.jsonl").write_text("".join(line for line in (records / "results.jsonl").read_text()
                                                   .splitlines(keepends=True) if '"a"' not in line))
    assert restore_records(records, second, by_trainer=by_trainer) == ["b"]
    assert [(t["trial_id"], t["status"]) for t in read_state(second)["trials"]] == [("a", "pending"),
                                                                                   ("b", "finished")]
    assert not (second / "trials" / "a").exists()


def test_other_programs_done_trials_need_only_what_their_outcome_was_read_from(tmp_path):
    """A sweep of another program: a diverged trial (its exit code said so) may have no summary, and no trial
    records train_config.yaml or metrics; none of that is damage. A trainer's trial has them all."""
    results = [{"trial_id": "a", "status": "finished"}, {"trial_id": "c", "status": "diverged"}]
    first = _sweep(tmp_path / "first", [_trial("a", "finished"), _trial("c", "diverged")], results)
    (first / "trials" / "c" / "run_summary.json").unlink()
    (first / "trials" / "a" / "metrics.jsonl").unlink()
    records = tmp_path / "records"
    save_records(first, records)
    assert sorted(restore_records(records, tmp_path / "second")) == ["a", "c"]
    with pytest.raises(ValueError, match=r"trials/a/train_config.yaml is missing.* \(1 more done trials' records"):
        restore_records(records, tmp_path / "third", by_trainer=True)
