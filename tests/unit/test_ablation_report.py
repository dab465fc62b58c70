"""eval/studies/ablation_report.py on a sweep folder laid out as scripts/sweep.py writes it (trials with their own
run_summary.json and metrics.jsonl): the numbers in the table are the trials' logged numbers, diverged seeds are
counted and kept out of the mean, and the plots are written. (test_sweep.py checks the same against a real sweep.)"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from eval.studies.ablation.load import group_variants, load_sweep
from eval.studies.ablation.report import write_report
from eval.studies.ablation_report import main
from tests.training_runs import strict_json_files

CONFIG = {"name": "synthetic", "method": "grid", "metric": {"name": "val_loss", "goal": "minimize"},
          "parameters": {"norm_type": {"values": ["rmsnorm", "prmsnorm", "none"]},
                         "norm_placement": {"values": ["pre", "post"]},
                         "warmup_steps": {"values": [0, 10]}, "seed": {"values": [0, 1, 2]},
                         "prms_p": {"value": 0.0625}, "max_steps": {"value": 20}}}


def _final_loss(norm: str, placement: str, warmup: int, seed: int) -> float:
    return 5.0 + 0.1 * ["rmsnorm", "prmsnorm", "none"].index(norm) + 0.3 * (placement == "post") \
        - 0.05 * bool(warmup) + 0.01 * seed * (seed + 1)


def _make_sweep(root: Path) -> tuple[Path, dict[str, dict]]:
    """A finished 36-trial sweep; 'none' + post + no warmup diverges for seeds 0 and 1."""
    sweep_dir = root / "sweep"
    trials, records, expected = [], [], {}
    for placement in ("pre", "post"):
        for norm in ("rmsnorm", "prmsnorm", "none"):
            for seed in (0, 1, 2):
                for warmup in (0, 10):
                    params = {"max_steps": 20, "norm_placement": placement, "norm_type": norm, "prms_p": 0.0625,
                              "seed": seed, "warmup_steps": warmup}
                    trial_id = f"{norm}-{placement}-{warmup}-{seed}"
                    trial_dir = sweep_dir / "trials" / trial_id
                    trial_dir.mkdir(parents=True)
                    diverged = norm == "none" and placement == "post" and warmup == 0 and seed < 2
                    final = _final_loss(norm, placement, warmup, seed)
                    lines = [{"step": s, "split": "train", "loss": final + 1, "lr": 1e-3, "grad_norm": 1.0,
                              "tokens_seen": s * 64, "step_time_s": 0.1} for s in (1, 2)]
                    if diverged:
                        summary = {"status": "diverged", "steps": 7, "final_val": {}, "median_step_time_s": None}
                        lines.append({"step": 5, "split": "val", "val_loss": 9.0, "val_ppl": 1e4, "val_bpb": 4.0})
                    else:
                        step_time = 0.1 + 0.001 * seed + 0.01 * (norm == "none")
                        summary = {"status": "finished", "steps": 20, "final_val": {"loss": final},
                                   "median_step_time_s": step_time, "tokens_per_s": 640 / step_time}
                        lines += [{"step": s, "split": "val", "val_loss": v, "val_ppl": math.exp(v), "val_bpb": 2.0}
                                  for s, v in ((10, final + 0.5), (20, final))]
                        lines.append({"step": 20, "split": "diag", "rms/layer0": 1.0})
                    summary.update(machine="CPU A" if seed == 0 else "CPU B", code="abc1234")
                    (trial_dir / "run_summary.json").write_text(json.dumps(summary))
                    (trial_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
                    status = summary["status"]
                    trials.append({"trial_id": trial_id, "params": params, "status": status, "metric": None})
                    records.append({"trial_id": trial_id, "params": params, "status": status,
                                    "trial_dir": f"trials/{trial_id}"})
                    expected[trial_id] = summary
    (sweep_dir / "sweep_state.json").write_text(json.dumps({"name": "synthetic", "config": CONFIG,
                                                            "trials": trials}))
    (sweep_dir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return sweep_dir, expected


def _make_prms_p_sweep(root: Path) -> Path:
    """A finished sweep like scripts/sweep_configs/prms_p.yaml: p and the seed swept, norm_type fixed (a `value:`)."""
    sweep_dir = root / "prms_p_sweep"
    config = {"name": "prms_p", "method": "grid", "metric": {"name": "val_loss", "goal": "minimize"},
              "parameters": {"prms_p": {"values": [0.0625, 0.25, 1.0]}, "seed": {"values": [0, 1]},
                             "norm_type": {"value": "prmsnorm"}}}
    trials = []
    for p in (0.0625, 0.25, 1.0):
        for seed in (0, 1):
            trial_id = f"p{p}-{seed}"
            trial_dir = sweep_dir / "trials" / trial_id
            trial_dir.mkdir(parents=True)
            final = 5.0 + p + 0.01 * seed
            summary = {"status": "finished", "final_val": {"loss": final}}
            (trial_dir / "run_summary.json").write_text(json.dumps(summary))
            trials.append({"trial_id": trial_id, "params": {"norm_type": "prmsnorm", "prms_p": p, "seed": seed},
                           "status": "finished", "metric": final})
    (sweep_dir / "sweep_state.json").write_text(json.dumps({"name": "prms_p", "config": config, "trials": trials}))
    (sweep_dir / "results.jsonl").write_text("".join(
        json.dumps({"trial_id": t["trial_id"], "params": t["params"], "status": "finished",
                    "trial_dir": f"trials/{t['trial_id']}"}) + "\n" for t in trials))
    return sweep_dir


def test_prms_p_plot_when_norm_type_is_fixed(tmp_path):
    path = write_report(_make_prms_p_sweep(tmp_path))
    data = json.loads((path.parent / "report.json").read_text())
    assert [row["params"] for row in data["variants"]] == [{"prms_p": p} for p in (0.0625, 0.25, 1.0)]
    assert "prms_p.png" in data["plots"]
    assert (path.parent / "prms_p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    sweep_dir, expected = _make_sweep(root)
    path = write_report(sweep_dir)
    return path, strict_json_files(path.parent)[path.parent / "report.json"][0], expected


def test_table_numbers_are_the_trials_numbers(report):
    path, data, expected = report
    markdown = path.read_text()
    assert len(data["variants"]) == 12  # 3 norms x 2 placements x 2 warmups; seeds are averaged
    for row in data["variants"]:
        p = row["params"]
        assert set(p) == {"norm_type", "norm_placement", "warmup_steps"}
        ids = [f"{p['norm_type']}-{p['norm_placement']}-{p['warmup_steps']}-{s}" for s in (0, 1, 2)]
        finished = [expected[i] for i in ids if expected[i]["status"] == "finished"]
        losses = [s["final_val"]["loss"] for s in finished]
        assert row["finished"] == len(finished) and row["diverged"] == 3 - len(finished)
        assert row["val_loss_per_seed"] == {str(s): (expected[i]["final_val"].get("loss")
                                                     if expected[i]["status"] == "finished" else None)
                                            for s, i in enumerate(ids)}
        assert row["val_loss_mean"] == pytest.approx(statistics.fmean(losses), abs=0)
        if len(losses) > 1:
            assert row["val_loss_std"] == pytest.approx(statistics.stdev(losses), abs=0)
            assert f"{statistics.fmean(losses):.4f} ± {statistics.stdev(losses):.4f}" in markdown
        else:
            assert row["val_loss_std"] is None  # one seed has no spread: NaN, null in the strict JSON
        assert row["median_step_time_s"] == statistics.median(s["median_step_time_s"] for s in finished)
        assert row["tokens_per_s"] == statistics.median(s["tokens_per_s"] for s in finished)
        assert f"| {p['norm_type']} | {p['norm_placement']} | {p['warmup_steps']} |" in markdown


def test_machines_and_code_of_the_trials_are_named(report):
    """A study spanning sessions spans machines: the report says which ran how many trials (diverged ones too)."""
    path, data, _ = report
    assert ("Machines: CPU A: 12 trials; CPU B: 24 trials. Code: 1 version (`git describe`: `abc1234`)."
            in path.read_text())
    assert {(t["machine"], t["code"]) for t in data["trials"]} == {("CPU A", "abc1234"), ("CPU B", "abc1234")}


def test_diverged_seeds_are_counted_not_averaged(report):
    path, data, _ = report
    row = next(r for r in data["variants"]
               if r["params"] == {"norm_type": "none", "norm_placement": "post", "warmup_steps": 0})
    assert (row["finished"], row["diverged"]) == (1, 2)
    assert row["val_loss_mean"] == _final_loss("none", "post", 0, 2)  # 9.0 of the diverged curves is ignored
    assert data["counts"] == {"finished": 34, "diverged": 2, "failed": 0, "not run": 0}
    line = next(row for row in path.read_text().splitlines() if row.startswith("| none | post | 0 |"))
    assert "| 1/3 | 2 |" in line


def test_plots_are_written_and_linked(report):
    path, data, _ = report
    assert sorted(data["plots"]) == ["pre_post_warmup.png", "prms_p.png", "val_curves.png"]
    for name in data["plots"]:
        assert (path.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in path.read_text()


def test_cli(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "sweep_state.json" in capsys.readouterr().err


def test_a_file_where_a_folder_goes_is_one_line_and_writes_nothing(two_parts, tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    assert main([str(a_file)]) == 2  # as SWEEP_DIR: its report/ folder was made first, a NotADirectoryError
    assert capsys.readouterr().err == (f"error: {a_file}: no sweep_state.json; run `python scripts/sweep.py "
                                       "FILE.yaml` first\n")
    norms = two_parts[0].parent.parent / "norms"
    with pytest.raises(SystemExit) as stopped:  # refused as the flags are parsed (trainer/cli.py output_folder)
        main([str(norms), "--out", str(a_file)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == f"error: argument --out: {a_file} is a file, not a folder"
    assert not (norms / "report").exists()  # the sweep folder gets no report/ of its own either


# --------------------------------------------------------------------------- several parts, lr x warmup, gradients
def _write_sweep(root: Path, name: str, swept: dict[str, list], fixed: dict, loss, grads=None) -> Path:
    """A finished grid sweep folder: every combination of `swept`, final loss `loss(params)`, and (when `grads` is
    given) diagnostics records: every block's gradient norm 1 at step 5, `grads(params)` at step 10."""
    import itertools
    sweep_dir = root / name
    config = {"name": name, "method": "grid", "metric": {"name": "val_loss", "goal": "minimize"},
              "parameters": {**{k: {"values": v} for k, v in swept.items()},
                             **{k: {"value": v} for k, v in fixed.items()}}}
    trials = []
    for values in itertools.product(*swept.values()):
        params = {**fixed, **dict(zip(swept, values))}
        trial_id = "_".join(f"{k}-{v}" for k, v in zip(swept, values))
        trial_dir = sweep_dir / "trials" / trial_id
        trial_dir.mkdir(parents=True)
        final = loss(params)
        lines = [{"step": s, "split": "val", "val_loss": final + 1.0 / s} for s in (5, 10)]
        if grads is not None:
            lines += [{"step": s, "split": "diag", **{f"diag/grad_norm/layer_{i:02d}": g if s == 10 else 1.0
                                                      for i, g in enumerate(grads(params))}} for s in (5, 10)]
        (trial_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        (trial_dir / "run_summary.json").write_text(json.dumps({"status": "finished", "final_val": {"loss": final}}))
        trials.append({"trial_id": trial_id, "params": params, "status": "finished", "metric": final})
    (sweep_dir / "sweep_state.json").write_text(json.dumps({"name": name, "config": config, "trials": trials}))
    (sweep_dir / "results.jsonl").write_text("".join(
        json.dumps({"trial_id": t["trial_id"], "params": t["params"], "status": "finished",
                    "trial_dir": f"trials/{t['trial_id']}"}) + "\n" for t in trials))
    return sweep_dir


def _study_loss(p: dict) -> float:
    return (5.0 + 0.1 * (p["norm_type"] == "layernorm") + (1.0 if p["norm_placement"] == "post" else 0.0)
            * (1 + 100 * p["learning_rate"] * (p["warmup_steps"] == 0)) + 0.01 * p["seed"])


def _study_grads(p: dict) -> list[float]:
    decay = 10.0 if p["norm_placement"] == "post" else 1.5  # per block, toward the input
    return [decay ** -(3 - i) * (1 + p["seed"]) for i in range(4)]


@pytest.fixture(scope="module")
def two_parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("parts")
    fixed = {"max_steps": 10}
    norms = _write_sweep(root, "norms", {"norm_type": ["rmsnorm", "layernorm"], "norm_placement": ["pre", "post"],
                                         "seed": [0, 1]},
                         {**fixed, "learning_rate": 0.003, "warmup_steps": 8}, _study_loss, _study_grads)
    warmup = _write_sweep(root, "warmup", {"norm_placement": ["post", "pre"], "learning_rate": [0.001, 0.003, 0.01],
                                           "warmup_steps": [0, 8], "seed": [0, 1]},
                          {**fixed, "norm_type": "layernorm"}, _study_loss, _study_grads)
    path = write_report([norms, warmup], root / "report")
    return path, json.loads((path.parent / "report.json").read_text())


def test_several_parts_get_a_section_each_and_prefixed_plots(two_parts):
    path, data = two_parts
    markdown = path.read_text()
    assert data["sweeps"] == ["norms", "warmup"]
    assert markdown.index("## Part `norms`") < markdown.index("## Part `warmup`")
    assert data["counts"]["finished"] == 8 + 24
    parts = [row["part"] for row in data["variants"]]
    assert parts == ["norms"] * 4 + ["warmup"] * 12
    assert {"norms_val_curves.png", "norms_grad_profile.png", "warmup_val_curves.png", "warmup_lr_warmup.png",
            "warmup_grad_profile.png"} <= set(data["plots"])
    for name in data["plots"]:
        assert (path.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in markdown
    # The bars need pre/post x warmup with nothing else varying: not drawn for the learning-rate grid.
    assert "warmup_pre_post_warmup.png" not in data["plots"]
    row = next(r for r in data["variants"] if r["part"] == "warmup" and r["params"] ==
               {"norm_placement": "post", "learning_rate": 0.01, "warmup_steps": 0})
    expected = [_study_loss({"norm_type": "layernorm", "norm_placement": "post", "learning_rate": 0.01,
                             "warmup_steps": 0, "seed": s}) for s in (0, 1)]
    assert row["val_loss_mean"] == pytest.approx(statistics.fmean(expected), abs=1e-12)
    assert row["val_loss_std"] == pytest.approx(statistics.stdev(expected), abs=1e-12)


def test_trials_run_in_two_parts_are_checked_for_equal_losses(two_parts):
    path, data = two_parts
    # layernorm x {pre, post} x lr 0.003 x warmup 8 x 2 seeds are in both grids.
    assert len(data["duplicates"]) == 4
    assert {d["params"]["norm_placement"] for d in data["duplicates"]} == {"pre", "post"}
    assert all(d["parts"] == ["norms", "warmup"] and d["abs_diff"] == 0 for d in data["duplicates"])
    assert "4 trials ran in two parts with identical parameters" in path.read_text()


def test_changed_duplicate_is_reported(tmp_path):
    fixed = {"learning_rate": 0.003, "warmup_steps": 8, "norm_placement": "pre"}
    first = _write_sweep(tmp_path, "a", {"norm_type": ["rmsnorm"], "seed": [0]}, fixed, lambda p: 5.0)
    second = _write_sweep(tmp_path, "b", {"norm_type": ["rmsnorm"], "seed": [0]}, fixed, lambda p: 5.25)
    path = write_report([first, second], tmp_path / "report")
    data = json.loads((path.parent / "report.json").read_text())
    assert [d["abs_diff"] for d in data["duplicates"]] == [0.25]
    assert "differ by at most 0.25" in path.read_text() and "**no**" in path.read_text()


def test_gradient_ratio_is_first_over_last_block_at_the_last_diagnostics_step(two_parts):
    path, data = two_parts
    for row in data["variants"]:
        # Per seed: (decay^-3 * (1 + seed)) / (1 + seed) = decay^-3 at step 10 (step 5's flat profile is older).
        decay = 10.0 if row["params"]["norm_placement"] == "post" else 1.5
        assert row["grad_in_out"] == pytest.approx(decay ** -3, rel=1e-12)
    line = next(r for r in path.read_text().splitlines() if r.startswith("| layernorm | post |"))
    assert "| 0.001 |" in line  # 10^-3 printed with 2 significant digits


def test_same_sweep_name_twice_is_an_error(two_parts, tmp_path):
    path, _ = two_parts
    norms = path.parent.parent / "norms"
    assert main([str(norms), str(norms), "--out", str(tmp_path)]) == 2


def _damage(sweep_dir: Path, damage: str) -> None:
    trial = sweep_dir / "trials" / "norm_type-rmsnorm_seed-0"
    results, metrics, summary = sweep_dir / "results.jsonl", trial / "metrics.jsonl", trial / "run_summary.json"
    if damage == "results line without status":
        results.write_text(results.read_text() + json.dumps({"trial_id": trial.name}) + "\n")  # the last one wins
    elif damage == "trial_dir not a path":
        lines = results.read_text().splitlines()
        results.write_text("\n".join([json.dumps({**json.loads(lines[0]), "trial_dir": 5}), *lines[1:]]) + "\n")
    elif damage == "val line without val_loss":
        metrics.write_text(metrics.read_text() + json.dumps({"step": 11, "split": "val"}) + "\n")
    elif damage == "val_loss not a number":
        metrics.write_text(metrics.read_text() + json.dumps({"step": 11, "split": "val", "val_loss": "abc"}) + "\n")
    elif damage in ("val loss NaN", "val loss Infinity"):  # a hand edit: the trainer writes one as null
        lines = metrics.read_text().splitlines(keepends=True)
        metrics.write_text(lines[0] + '{"step": 10, "split": "val", "val_loss": %s}\n' % damage.split()[-1])
    elif damage in ("val step repeated", "val step decreasing"):
        step = 10 if damage.endswith("repeated") else 7
        metrics.write_text(metrics.read_text() + json.dumps({"step": step, "split": "val", "val_loss": 3.0}) + "\n")
    elif damage == "final_val not a mapping":
        summary.write_text(json.dumps({"status": "finished", "final_val": "x"}))
    elif damage in ("final loss NaN", "final loss Infinity"):  # a hand edit: no save writes either (strict_json)
        summary.write_text('{"status": "finished", "final_val": {"loss": %s}}' % damage.split()[-1])
    elif damage == "metrics a directory":
        metrics.unlink()
        metrics.mkdir()
    elif damage == "metrics not UTF-8":
        metrics.write_bytes(b"\xff" + metrics.read_bytes())
    elif damage == "summary a directory":
        summary.unlink()
        summary.mkdir()
    elif damage == "summary not UTF-8":
        summary.write_bytes(b'{"status": "finished", "note": "\xff"}')
    elif damage == "summary machine and code not text":
        summary.write_text(json.dumps({**json.loads(summary.read_text()), "machine": ["a"], "code": {"b": 1}}))
    elif damage == "val_loss true":
        metrics.write_text(metrics.read_text() + json.dumps({"step": 11, "split": "val", "val_loss": True}) + "\n")
    elif damage in ("state config not a mapping", "state parameters a list"):
        state_file = sweep_dir / "sweep_state.json"
        state = json.loads(state_file.read_text())
        if damage == "state config not a mapping":
            state["config"] = "x"
        else:
            state["config"]["parameters"] = ["norm_type"]
        state_file.write_text(json.dumps(state))


@pytest.mark.parametrize("damage", ["results line without status", "trial_dir not a path", "val line without val_loss",
                                    "val_loss not a number", "final_val not a mapping", "final loss NaN",
                                    "final loss Infinity", "summary a directory", "summary not UTF-8",
                                    "metrics a directory", "metrics not UTF-8", "val loss NaN", "val loss Infinity",
                                    "val step repeated", "val step decreasing", "summary machine and code not text",
                                    "val_loss true", "state config not a mapping", "state parameters a list"])
def test_a_damaged_sweep_file_is_skipped_or_one_line(tmp_path, capsys, damage):
    """A results.jsonl line without a status is skipped (docs/sweeps.md), as is a val line without val_loss; a
    metrics.jsonl that cannot be read (a directory, not UTF-8) is one line naming it; a run_summary.json that cannot
    be read (a directory, not UTF-8) or holds no final loss leaves that trial without one, and the report names it
    left out of the means (a NaN or Infinity loss failed the stdev with a traceback); a trial_dir that is not a path
    means the trial's own folder; a val_loss that is not a number is one line naming FILE:LINE. A NaN or Infinity
    val loss in metrics.jsonl is left out of the mean curve and the trial named (it made the mean NaN or infinite);
    a val step repeated or going back is one line naming FILE:LINE (the last of the two was taken in silence). A
    val_loss of true is no number (it was read as a loss of 1); a machine or code that is not text is not recorded
    (a list was a TypeError traceback); a sweep_state.json whose config or its parameters are not mappings is one
    line naming the file and field (an AttributeError traceback). Never a traceback."""
    sweep_dir = _write_sweep(tmp_path, "s", {"norm_type": ["rmsnorm", "layernorm"], "seed": [0, 1]},
                             {"learning_rate": 0.003, "warmup_steps": 8, "norm_placement": "pre"}, lambda p: 5.0)
    _damage(sweep_dir, damage)
    code = main([str(sweep_dir), "--out", str(tmp_path / "report")])
    err = capsys.readouterr().err
    if damage in ("val_loss not a number", "val_loss true"):
        metrics = sweep_dir / "trials" / "norm_type-rmsnorm_seed-0" / "metrics.jsonl"
        shown = "'abc'" if damage.endswith("number") else "True"
        assert (code, err) == (2, f"error: {metrics}:3: val_loss is {shown}, expected a number\n")
        return
    if damage.startswith("state "):
        field, got = (("config", "the sweep's YAML config (a mapping), got 'x'") if damage.endswith("mapping") else
                      ("config.parameters", "a mapping of parameter name to spec, got ['norm_type']"))
        assert (code, err) == (2, f"error: {sweep_dir / 'sweep_state.json'}: {field}: expected {got}\n")
        return
    if damage.startswith("val step "):
        metrics = sweep_dir / "trials" / "norm_type-rmsnorm_seed-0" / "metrics.jsonl"
        assert (code, err) == (2, f"error: {metrics}:3: the 'val' record of step {10 if 'repeated' in damage else 7} "
                                  f"{'repeats' if 'repeated' in damage else 'comes after'} step 10 ({metrics}:2); a "
                                  f"run appends each split's steps in increasing order: remove the repeated or "
                                  f"out-of-order line\n")
        return
    if damage.startswith("metrics "):  # the file named, where it was the path twice or no file at all
        metrics = sweep_dir / "trials" / "norm_type-rmsnorm_seed-0" / "metrics.jsonl"
        why = ("is a directory, not a jsonl file" if damage.endswith("directory")
               else "not valid UTF-8 (byte 0xff at offset 0)")
        assert (code, err) == (2, f"error: {metrics}: {why}\n")
        return
    assert (code, err) == (0, "")
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    finished = {tuple(sorted(v["params"].items())): v["finished"] for v in data["variants"]}
    damaged = damage in ("final_val not a mapping", "final loss NaN", "final loss Infinity", "summary a directory",
                         "summary not UTF-8")
    assert finished == {(("norm_type", "rmsnorm"),): 1 if damaged else 2, (("norm_type", "layernorm"),): 2}
    left_out = ("Left out of the means: 1 finished trial(s) whose run_summary.json holds no finite final val loss: "
                "`norm_type-rmsnorm_seed-0`.")
    assert (left_out in (tmp_path / "report" / "report.md").read_text()) == damaged
    curve_note = ("Left out of the mean curves: the NaN or infinite val losses in metrics.jsonl of 1 finished "
                  "trial(s): `norm_type-rmsnorm_seed-0` (steps 10).")
    assert (curve_note in (tmp_path / "report" / "report.md").read_text()) == damage.startswith("val loss ")
    if damage == "summary machine and code not text":  # no trial recorded either (the others hold none)
        assert "Machines: not recorded: 4 trials.\n" in (tmp_path / "report" / "report.md").read_text()
    config, trials = load_sweep(sweep_dir)
    curves = {v.params["norm_type"]: v.mean_curve() for v in group_variants(config, trials)}
    # the damaged seed's step 10 is left out: the mean is taken at the steps every finished seed logged
    assert [step for step, _ in curves["rmsnorm"]] == ([5] if damage.startswith("val loss ") else [5, 10])
    assert all(math.isfinite(loss) for curve in curves.values() for _, loss in curve)


def test_lines_damaged_before_the_last_are_skipped_with_one_note_line_per_file(tmp_path, capsys):
    """A results.jsonl or metrics.jsonl line torn or damaged in the middle of the file (a kill's torn line that a
    later append ended, a hand edit) was skipped without a word; now one note line on stderr per file says how many
    of its lines, and which, were skipped; the report is the same. A torn last line (a writer may be writing it)
    stays silent, and so does a last line that is no trial's result (docs/sweeps.md)."""
    sweep_dir = _write_sweep(tmp_path, "s", {"norm_type": ["rmsnorm", "layernorm"], "seed": [0, 1]},
                             {"learning_rate": 0.003, "warmup_steps": 8, "norm_placement": "pre"}, lambda p: 5.0)
    assert main([str(sweep_dir), "--out", str(tmp_path / "whole")]) == 0
    assert capsys.readouterr().err == ""
    results, metrics = sweep_dir / "results.jsonl", sweep_dir / "trials" / "norm_type-rmsnorm_seed-0" / "metrics.jsonl"
    lines = results.read_text().splitlines(keepends=True)
    results.write_text("".join([lines[0], '{"trial_id": "norm_type-layernorm_seed-0", "sta\n', lines[1],
                                '{"trial_id": "norm_type-rmsnorm_seed-1"}\n', *lines[2:],
                                '{"trial_id": "x", "status": "fini']))  # the last line torn: no note
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join([lines[0], "NaN\n", *lines[1:], '{"step": 20, "spl']))
    assert main([str(sweep_dir), "--out", str(tmp_path / "damaged")]) == 0
    assert capsys.readouterr().err == (
        f"note: {results}: 2 lines skipped, torn, damaged or no trial's result (lines 2, 4); the rest is read\n"
        f"note: {metrics}: 1 line skipped, torn or damaged (line 2); the rest is read\n")
    whole, damaged = (json.loads((tmp_path / name / "report.json").read_text()) for name in ("whole", "damaged"))
    assert damaged["variants"] == whole["variants"]


def test_a_folder_inside_the_repo_is_named_from_the_repo_root(tmp_path, monkeypatch):
    """The committed report names its sweep folders as the repo's files name them (`out/sweeps/NAME`), not as the
    absolute path of the clone that wrote it; a folder outside the repo keeps its absolute path."""
    import trainer.run_dir
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    monkeypatch.setattr(trainer.run_dir, "REPO_ROOT", repo)
    inside = _write_sweep(repo / "out" / "sweeps", "norms", {"norm_type": ["rmsnorm", "layernorm"]},
                          {"seed": 0}, lambda p: 5.0)
    outside = _write_sweep(elsewhere, "warmup", {"norm_type": ["rmsnorm", "layernorm"]}, {"seed": 1}, lambda p: 5.0)
    text = write_report([inside, outside], tmp_path / "report").read_text()
    assert "; folder `out/sweeps/norms`." in text
    assert f"; folder `{outside}`." in text


def test_a_relative_out_from_another_directory_is_written_under_the_repo_root(tmp_path, monkeypatch, capsys):
    """`cd /tmp && ablation_report.py SWEEP --out rel`: --out is relative to the repo root, as every output
    (trainer/cli.py output_folder); the report was written in the current directory."""
    import trainer.run_dir
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setattr(trainer.run_dir, "REPO_ROOT", repo)
    sweep = _write_sweep(tmp_path / "sweeps", "norms", {"norm_type": ["rmsnorm", "layernorm"]}, {"seed": 0},
                         lambda p: 5.0)
    monkeypatch.chdir(elsewhere)
    assert main([str(sweep), "--out", "rel"]) == 0
    assert "norms" in (repo / "rel" / "report.md").read_text()
    assert not (elsewhere / "rel").exists()


@pytest.mark.parametrize("recorded, named", [
    ("task: pretrain\nmax_seq_len: x\n", "key 'max_seq_len': expected an integer, got 'x'"),
    ("task: 5\n", "key 'task': 5 is not one of pretrain"),
])
def test_unigram_with_a_damaged_trial_config_is_one_line_naming_the_file_and_key(tmp_path, capsys, recorded, named):
    """--unigram rebuilds a trial's data from its train_config.yaml: a hand-edited max_seq_len 'x' reached the data
    as a TypeError traceback ('<' not supported between 'str' and 'int'); each value is read as its flag's now."""
    sweep_dir = _write_sweep(tmp_path, "s", {"norm_type": ["rmsnorm", "layernorm"]}, {"learning_rate": 0.003},
                             lambda p: 5.0)
    for trial in (sweep_dir / "trials").iterdir():
        (trial / "train_config.yaml").write_text(recorded)
    assert main([str(sweep_dir), "--out", str(tmp_path / "report"), "--unigram"]) == 2
    err = capsys.readouterr().err
    config = sweep_dir / "trials" / "norm_type-rmsnorm" / "train_config.yaml"
    assert err.startswith(f"error: {config}: {named}") and err.count("\n") == 1, err
    assert err.endswith("; --unigram rebuilds a trial's data from it\n"), err
