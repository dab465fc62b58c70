"""The second edition of the normalization study (docs/study.md): the report's computations against values worked
out by hand (learning-rate sensitivity, best rate, plateau escape, spikes and the other stability numbers, wall
clock, relative speed), the section and the second-seed YAML on a synthetic sweep, and the interleaved step-time
benchmark's pieces (eval/benchmarks/bench_norm_variants.py)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from eval.benchmarks import bench_norm_variants as bench
from dataset.json_text import strict_json
from eval.studies.ablation.load import Part, load_sweep
from eval.studies.ablation.report import write_report
from eval.studies.ablation.study2 import (best_rate, capped_mean, escape_step, losses_by_rate, lr_sensitivity,
                                          read_bench_step_times, relative_step_times, stability, wall_clock_curve)
from eval.studies.ablation.study2_section import _median_step_times, write_seed2_yaml
from tests.paths import REPO
from trainer.run_dir import read_metrics

VARIANTS = "scripts/sweep_configs/study2_variants"


# --------------------------------------------------------------------------- learning-rate sensitivity
def test_capped_mean_counts_missing_seeds_as_the_cap():
    assert capped_mean([5.0, 9.0], cap=7.0) == 6.0           # (5 + 7) / 2
    assert capped_mean([None, 4.0], cap=7.0) == 5.5          # a diverged seed is the cap
    assert capped_mean([math.nan], cap=7.0) == 7.0


def test_lr_sensitivity_by_hand():
    # One seed per rate: capped 5, 4, 7 (diverged), 7 (7.5 above the cap) -> mean 5.75; best 4 -> 1.75.
    assert lr_sensitivity({1e-3: [5.0], 2e-3: [4.0], 4e-3: [None], 8e-3: [7.5]}, cap=7.0) == pytest.approx(1.75)
    # Two seeds: rate 1e-3 -> (5 + 6) / 2 = 5.5; rate 2e-3 -> (4 + 7) / 2 = 5.5; mean 5.5. Best over the finished
    # seeds: 1e-3 -> 5.5, 2e-3 -> 4.0 -> 4.0; sensitivity 1.5.
    assert lr_sensitivity({1e-3: [5.0, 6.0], 2e-3: [4.0, None]}, cap=7.0) == pytest.approx(1.5)
    # A flat variant is insensitive; one that failed everywhere is at the cap everywhere (0 by the definition).
    assert lr_sensitivity({1e-3: [4.0], 1e-2: [4.0]}, cap=7.0) == 0.0
    assert lr_sensitivity({1e-3: [None], 1e-2: [None]}, cap=7.0) == 0.0
    # The best loss itself above the cap: everything is capped (stuck on the plateau at every rate).
    assert lr_sensitivity({1e-3: [7.2], 1e-2: [7.4]}, cap=7.0) == 0.0


def test_best_rate_is_the_lowest_mean_over_finished_seeds():
    assert best_rate({1e-3: [5.0, 5.2], 2e-3: [4.9, None], 4e-3: [5.05]}) == (2e-3, 4.9)
    assert best_rate({1e-3: [None]}) is None


# --------------------------------------------------------------------------- plateau escape, stability, time
def test_escape_step_is_the_first_eval_margin_below_the_unigram_loss():
    curve = [(50, 6.90), (100, 6.70), (150, 6.50), (200, 6.80)]
    assert escape_step(curve, unigram=6.88, margin=0.25) == 150   # 6.50 <= 6.63; 6.70 is not
    assert escape_step(curve, unigram=6.88, margin=0.10) == 100   # 6.70 <= 6.78
    assert escape_step(curve, unigram=6.88, margin=0.50) is None  # never at or below 6.38


def _train(step: int, loss: float, grad: float, seconds: float = 0.1) -> dict:
    return {"step": step, "split": "train", "loss": loss, "grad_norm": grad, "step_time_s": seconds}


def test_stability_numbers_by_hand(tmp_path):
    records = [_train(s, 2.0, 1.0) for s in range(1, 13)]
    records += [_train(13, 3.1, 1.0), _train(14, 2.0, 1.6), _train(15, 2.0, 1.4)]  # 3.1 > 1.5 x 2; 1.6 > 1.5 x 1
    records += [{"step": 5, "split": "diag", "diag/attn_logit_max/layer_00": 3.0, "diag/attn_logit_max/layer_01": 9.5,
                 "diag/logits_rms": 1.5, "diag/logits_max": 12.0,
                 "diag/resid_rms/layer_00": 1.0, "diag/resid_rms/layer_01": 2.0},
                {"step": 10, "split": "diag", "diag/attn_logit_max/layer_00": 7.0, "diag/attn_logit_max/layer_01": 4.0,
                 "diag/logits_rms": 2.5, "diag/logits_max": 11.0,
                 "diag/resid_rms/layer_00": 1.5, "diag/resid_rms/layer_01": 4.0}]
    result = stability(records)
    assert result.loss_spikes == [13]
    assert result.grad_spikes == [14]
    assert result.attn_logit_max == 9.5          # layer 1 at step 5
    assert result.logits_rms_max == 2.5 and result.logits_max == 12.0
    assert result.resid_rms == [1.5, 4.0]        # the last diagnostic step
    assert result.nonfinite_step is None
    assert stability(records + [_train(16, math.nan, math.nan)], "diverged", 16).nonfinite_step == 16
    assert 16 in stability(records + [_train(16, math.nan, math.nan)], "diverged", 16).loss_spikes
    # as metrics.jsonl holds them (strict JSON: null), read back from the file
    diverged = tmp_path / "metrics.jsonl"
    diverged.write_text("".join(strict_json(r) + "\n" for r in records + [_train(16, math.inf, math.nan)]))
    assert 16 in stability(read_metrics(diverged), "diverged", 16).loss_spikes


@pytest.mark.parametrize("record, named", [
    ({"step": 3, "split": "train", "loss": "abc", "grad_norm": 1.0}, "loss is 'abc', expected a number"),
    ({"step": "x", "split": "train", "loss": 2.0, "grad_norm": 1.0},
     "step is 'x', expected an integer >= 0 (the optimizer step)"),
    ({"step": 3, "split": "diag", "diag/logits_max": [1]}, "diag/logits_max is [1], expected a number"),
])
def test_a_value_that_is_not_a_number_is_named_with_its_file_and_line(record, named, tmp_path):
    """--study2 read metrics values bare: a ValueError or TypeError traceback without the file."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in [_train(1, 2.0, 1.0), _train(2, 2.0, 1.0), record]))
    with pytest.raises(ValueError) as error:
        stability(read_metrics(metrics))
    assert str(error.value) == f"{metrics}:3: {named}"


def test_wall_clock_curve_sums_the_step_times_up_to_each_evaluation():
    records = [_train(1, 8.0, 1.0, 10.0), _train(2, 7.0, 1.0, 1.0), {"step": 2, "split": "val", "val_loss": 7.5},
               _train(3, 6.0, 1.0, 1.0), _train(4, 5.0, 1.0, 2.0), {"step": 4, "split": "val", "val_loss": 6.0}]
    assert wall_clock_curve(records) == [(11.0, 7.5), (14.0, 6.0)]
    # A NaN val loss is a gap, as in the trial's val_curve (it was a point the plot and the JSON took); the time of
    # its steps is still spent.
    nan_between = [*records[:3], {"step": 3, "split": "val", "val_loss": math.nan}, *records[3:]]
    assert wall_clock_curve(nan_between) == [(11.0, 7.5), (14.0, 6.0)]
    records[-1]["val_loss"] = math.inf
    assert wall_clock_curve(records) == [(11.0, 7.5)]


def test_relative_step_times():
    assert relative_step_times({"pre_rmsnorm": 0.1, "peri_ln": 0.125, "x": math.nan}) == {"pre_rmsnorm": 1.0,
                                                                                           "peri_ln": 1.25}
    assert relative_step_times({"peri_ln": 0.125}) == {}


@pytest.mark.parametrize("missing", [math.nan, None])
def test_median_step_time_counts_only_the_trials_that_timed_a_step(missing):
    # study 2's no_norm: five finished trials, three diverged before a timed step (NaN in summaries written before
    # the writers went strict, null after); the median is the middle of the five, in any order of the rows.
    finished = [0.2241, 0.2178, 0.2118, 0.2253, 0.1918]
    times = finished[:2] + [missing] + finished[2:] + [missing, missing]
    for rotation in range(len(times)):
        rows = [{"variant": "no_norm", "median_step_time_s": t} for t in times[rotation:] + times[:rotation]]
        assert _median_step_times({"no_norm": {}}, rows) == {"no_norm": 0.2178}
    assert math.isnan(_median_step_times({"no_norm": {}}, [{"variant": "no_norm", "median_step_time_s": missing}])[
        "no_norm"])


def test_median_step_time_leaves_out_zero_and_infinite_times_and_averages_an_even_middle():
    # a zero or infinite time is no timed step either ("finite only", and zero left out); four finished trials'
    # median is the mean of the middle two, (0.2 + 0.3) / 2, as statistics.median defines it
    rows = [{"variant": "v", "median_step_time_s": t} for t in (0.3, 0.1, 0.0, math.inf, 0.2, 0.4)]
    assert _median_step_times({"v": {}}, rows) == {"v": 0.25}


# --------------------------------------------------------------------------- a synthetic second edition
RATES = [0.001, 0.002, 0.004]
# variant -> rate -> (final loss or None for diverged, val curve); the unigram loss of the data is not needed here:
# the section is given it.
LOSSES = {"pre_rmsnorm": {0.001: 5.0, 0.002: 4.5, 0.004: 4.8},
          "post_ln": {0.001: 5.5, 0.002: 6.95, 0.004: None}}
UNIGRAM = 6.9


def _write_grid(root: Path, name: str = "study2_synth", seeds: tuple[int, ...] = (0,), losses: dict = LOSSES,
                warmups: tuple[int, ...] = (1,)) -> Path:
    """A finished sweep folder: variant files x rates x seeds (x warmups when several: then swept)."""
    sweep_dir = root / name
    config = {"name": name, "method": "grid", "metric": {"name": "val_loss", "goal": "minimize"},
              "parameters": {"config": {"values": [f"{VARIANTS}/{v}.yaml" for v in losses]},
                             "learning_rate": {"values": sorted({lr for r in losses.values() for lr in r})},
                             "seed": {"values": list(seeds)}, "max_steps": {"value": 4},
                             "warmup_steps": {"values": list(warmups)} if len(warmups) > 1 else {"value": warmups[0]}}}
    trials = []
    for variant, by_rate in losses.items():
        for lr, final in by_rate.items():
            for seed, warmup in ((s, w) for s in seeds for w in warmups):
                params = {"config": f"{VARIANTS}/{variant}.yaml", "learning_rate": lr, "seed": seed, "max_steps": 4,
                          "warmup_steps": warmup}
                trial_id = f"{name}_{variant}_{lr}_{seed}_{warmup}"   # unique across parts, as the sweep runner's are
                trial_dir = sweep_dir / "trials" / trial_id
                trial_dir.mkdir(parents=True)
                status = "finished" if final is not None else "diverged"
                lines = [_train(s, 7.0, 1.0, 0.5) for s in (1, 2, 3, 4)]
                if final is not None:
                    lines += [{"step": 2, "split": "val", "val_loss": max(final, 6.8)},
                              {"step": 4, "split": "val", "val_loss": final}]
                    summary = {"status": status, "steps": 4, "final_val": {"loss": final},
                               "median_step_time_s": 0.5 if variant == "pre_rmsnorm" else 0.6}
                else:
                    lines = lines[:2] + [_train(3, math.nan, math.nan)]
                    summary = {"status": status, "steps": 3, "final_val": {}}
                # as the trainer writes them: a diverged step's NaN loss is null
                (trial_dir / "metrics.jsonl").write_text("".join(strict_json(r) + "\n" for r in lines))
                (trial_dir / "run_summary.json").write_text(strict_json(summary))
                trials.append({"trial_id": trial_id, "params": params, "status": status, "metric": final})
    (sweep_dir / "sweep_state.json").write_text(json.dumps({"name": name, "config": config, "trials": trials}))
    (sweep_dir / "results.jsonl").write_text("".join(
        json.dumps({"trial_id": t["trial_id"], "params": t["params"], "status": t["status"],
                    "trial_dir": f"trials/{t['trial_id']}"}) + "\n" for t in trials))
    return sweep_dir


def _rates_in_variant_files(sweep_dir: Path) -> None:
    """Make a synthetic part look like part 2: its sweep declares no learning rate (each rate lives in its variant
    file), so it refines the grid's chosen rates without choosing any."""
    state = json.loads((sweep_dir / "sweep_state.json").read_text())
    del state["config"]["parameters"]["learning_rate"]
    (sweep_dir / "sweep_state.json").write_text(json.dumps(state))


def _stub_unigram(monkeypatch) -> None:
    """Every part shares one data key and the unigram loss UNIGRAM (no corpus is rebuilt)."""
    from eval.studies.ablation import report
    monkeypatch.setattr(report, "data_key", lambda run_dir: "same data")
    monkeypatch.setattr(report, "unigram_baseline", lambda run_dir: {
        "loss": UNIGRAM, "bits_per_byte": 2.7, "tokens": 100, "max_seq_len": 8, "data": "synthetic",
        "from_trial": run_dir.name})


def test_losses_by_rate_groups_by_variant_file(tmp_path):
    _, trials = load_sweep(_write_grid(tmp_path))
    assert losses_by_rate(trials) == {"pre_rmsnorm": {0.001: [5.0], 0.002: [4.5], 0.004: [4.8]},
                                      "post_ln": {0.001: [5.5], 0.002: [6.95], 0.004: [None]}}


def test_study2_section_numbers(tmp_path, monkeypatch):
    sweep = _write_grid(tmp_path)
    # A Post-LN part that also sweeps the warmup, at a rate outside the grid and at the grid's 1e-3, where its cell
    # with the grid's warmup (1) and seed 0 is the grid's own training again: the escape table only.
    post = _write_grid(tmp_path, "study2_synth_post", seeds=(0, 1), losses={"post_ln": {0.001: 5.5, 0.008: 6.5}},
                       warmups=(0, 1, 2))
    bench_file = tmp_path / "bench.json"
    bench_file.write_text(json.dumps({"variants": {"pre_rmsnorm": {"median_step_s": 0.2},
                                                   "post_ln": {"median_step_s": 0.3}}}))
    _stub_unigram(monkeypatch)
    path = write_report([sweep, post], tmp_path / "report", unigram=True, study2=True, step_times=bench_file,
                        escape_margin=0.25)
    data = json.loads((path.parent / "report.json").read_text())["study2"]
    rows = {v["variant"]: v for v in data["variants"]}
    # pre_rmsnorm: capped 5.0, 4.5, 4.8 -> mean 4.7667; best 4.5 -> 0.2667.
    assert rows["pre_rmsnorm"]["best_rate"] == 0.002 and rows["pre_rmsnorm"]["best_loss"] == 4.5
    assert rows["pre_rmsnorm"]["lr_sensitivity"] == pytest.approx((5.0 + 4.5 + 4.8) / 3 - 4.5)
    # post_ln: capped 5.5, 6.9 (6.95 above the unigram), 6.9 (diverged) -> mean 6.4333; best 5.5 -> 0.9333.
    assert rows["post_ln"]["lr_sensitivity"] == pytest.approx((5.5 + 6.9 + 6.9) / 3 - 5.5)
    assert rows["post_ln"]["nonfinite_rates"] == [0.004] and rows["post_ln"]["diverged_or_failed"] == 1
    # post_ln's best is the grid's lowest rate: marked, since its optimum may lie below; pre_rmsnorm's is inside.
    assert rows["post_ln"]["best_rate_at_edge"] and not rows["pre_rmsnorm"]["best_rate_at_edge"]
    assert rows["post_ln"]["rates"] == 3 and rows["post_ln"]["trials"] == 3   # the warmup part is not pooled
    assert rows["post_ln"]["step_time_vs_baseline"] == pytest.approx(1.2)         # 0.6 / 0.5, the trials' medians
    assert rows["post_ln"]["bench_step_time_vs_baseline"] == pytest.approx(1.5)   # 0.3 / 0.2, interleaved
    # Escapes: the first eval at or below 6.9 - 0.25 = 6.65; post_ln at 1e-3 curve (2, 6.8), (4, 5.5) -> 4;
    # at 2e-3 never (6.95); at 4e-3 diverged before any evaluation.
    escapes = {(e["learning_rate"], e["warmup_steps"]): e for e in data["post_ln_escapes"]}
    assert escapes[0.002, 1]["escape_steps"] == [None] and escapes[0.002, 1]["escaped"] == 0
    assert escapes[0.004, 1]["runs"] == 1 and escapes[0.004, 1]["escaped"] == 0
    # At 1e-3 with the grid's warmup, seed 0 ran in both parts: it counts once (the grid's), beside the Post-LN
    # part's seed 1.
    assert escapes[0.001, 1]["seeds"] == [0, 1] and escapes[0.001, 1]["escape_steps"] == [4, 4]
    assert escapes[0.001, 1]["runs"] == 2 and escapes[0.001, 1]["escaped"] == 2
    assert escapes[0.001, 1]["final_val_loss"] == [5.5, 5.5]
    # The warmup part at 8e-3: curve (2, 6.8), (4, 6.5) -> step 4, both seeds, per warmup.
    at_8e3 = [e for e in data["post_ln_escapes"] if e["learning_rate"] == 0.008]
    assert [(e["warmup_steps"], e["escaped"], e["runs"], e["escape_steps"]) for e in at_8e3] == [
        (0, 2, 2, [4, 4]), (1, 2, 2, [4, 4]), (2, 2, 2, [4, 4])]
    markdown = path.read_text()
    assert "## Second edition" in markdown and "| post_ln | 5.500 | 6.950 | div |" in markdown
    assert "| post_ln | 3 | 0.001 (edge) | 5.500 (5.500) |" in markdown and "| pre_rmsnorm | 3 | 0.002 | " in markdown
    for plot in ("study2_loss_vs_rate.png", "study2_curves_steps_time.png"):
        assert (path.parent / plot).is_file() and f"]({plot})" in markdown
    # Wall clock from the trial's own logged step times: 0.5 s each, val at steps 2 and 4.
    trial = next(t for t in data["trials"] if t["variant"] == "pre_rmsnorm" and t["learning_rate"] == 0.002)
    assert trial["wall_clock_curve"] == [[1.0, 6.8], [2.0, 4.5]]


def test_extra_rates_for_some_variants_move_the_best_rate_not_the_sensitivity(tmp_path, monkeypatch):
    """A part that extends only pre_rmsnorm upward (like study2_lr_top.yaml) pools into the grid: its best rate moves
    there (and is at the edge), but its sensitivity stays a mean over the rates every variant ran, so that the
    variants' sensitivities stay comparable; the per-rate table gets the extra column."""
    sweep = _write_grid(tmp_path)
    top = _write_grid(tmp_path, "study2_synth_top", losses={"pre_rmsnorm": {0.008: 4.0}})
    _stub_unigram(monkeypatch)
    path = write_report([sweep, top], tmp_path / "report", unigram=True, study2=True)
    rows = {v["variant"]: v for v in json.loads((path.parent / "report.json").read_text())["study2"]["variants"]}
    pre = rows["pre_rmsnorm"]
    assert (pre["best_rate"], pre["best_loss"], pre["best_rate_at_edge"]) == (0.008, 4.0, True)
    assert pre["lr_sensitivity"] == pytest.approx((5.0 + 4.5 + 4.8) / 3 - 4.5)   # over 1e-3, 2e-3, 4e-3 only
    assert (pre["shared_rates"], pre["extra_rates"]) == (3, [0.008])
    assert rows["post_ln"]["lr_sensitivity"] == pytest.approx((5.5 + 6.9 + 6.9) / 3 - 5.5)
    markdown = path.read_text()
    assert "| pre_rmsnorm | 3 + 1 | 0.008 (edge) | 4.000 (4.000) |" in markdown
    assert "| post_ln | 3 | 0.001 (edge) |" in markdown and "/3 rates)" not in markdown   # no variant is partial
    assert "| pre_rmsnorm | 5.000 | 4.500 | 4.800 | 4.000 |" in markdown


def test_a_second_seed_refines_the_chosen_rate_but_does_not_move_it(tmp_path, monkeypatch):
    """Part 2 (each variant's best rate again, seed 1; its rate lives in the variant file, not the sweep) pools into
    the grid: the best rate stays the one the grid's seed chose (2e-3) and its loss becomes the mean over both seeds
    (4.5 and 5.3 -> 4.9), even though 4e-3's single seed (4.8) is now lower: re-choosing among means of unequal seed
    counts would favour the rates that ran once."""
    sweep = _write_grid(tmp_path)
    seed2 = _write_grid(tmp_path, "study2_synth_seed2", seeds=(1,), losses={"pre_rmsnorm": {0.002: 5.3},
                                                                            "post_ln": {0.001: 5.7}})
    _rates_in_variant_files(seed2)
    _stub_unigram(monkeypatch)
    path = write_report([sweep, seed2], tmp_path / "report", unigram=True, study2=True)
    rows = {v["variant"]: v for v in json.loads((path.parent / "report.json").read_text())["study2"]["variants"]}
    pre = rows["pre_rmsnorm"]
    assert (pre["best_rate"], pre["best_loss"], pre["best_loss_seeds"]) == (0.002, pytest.approx(4.9), [4.5, 5.3])
    # capped means over the rates: 5.0, 4.9 (two seeds), 4.8 -> 4.9; minus the chosen rate's 4.9 -> 0
    assert pre["lr_sensitivity"] == pytest.approx(0.0, abs=1e-12)
    assert rows["post_ln"]["best_rate"] == 0.001 and rows["post_ln"]["best_loss"] == pytest.approx(5.6)


def test_read_bench_step_times_names_the_expected_layout(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="variants.NAME.median_step_s"):
        read_bench_step_times(bad)
    # a median that was not finite is null in the benchmark's strict JSON: NaN again, not "not the JSON of ..."
    good = tmp_path / "bench.json"
    good.write_text(strict_json({"variants": {"pre_rmsnorm": {"median_step_s": 0.2},
                                              "dyt": {"median_step_s": math.nan}}}))
    times = read_bench_step_times(good)
    assert times["pre_rmsnorm"] == 0.2 and math.isnan(times["dyt"])


def test_write_seed2_yaml_repeats_each_variant_at_its_best_rate(tmp_path):
    from scripts.sweep_runner.config import load_sweep_config
    sweep = _write_grid(tmp_path)
    part = Part(sweep, *load_sweep(sweep))
    path = write_seed2_yaml(part, tmp_path)
    assert path == tmp_path / "study2_synth_seed2.yaml"
    config = load_sweep_config(path)  # a valid sweep (the runner's and wandb's checks)
    assert config["parameters"]["seed"] == {"values": [1]}
    assert "learning_rate" not in config["parameters"]
    files = config["parameters"]["config"]["values"]
    rates = {Path(f).stem: yaml.safe_load(Path(f).read_text())["learning_rate"] for f in files}
    assert rates == {"pre_rmsnorm": 0.002, "post_ln": 0.001}
    variant = yaml.safe_load((REPO / VARIANTS / "post_ln.yaml").read_text())
    generated = yaml.safe_load(Path(files[0] if "post_ln" in files[0] else files[1]).read_text())
    assert generated == {**variant, "learning_rate": 0.001}


def test_write_seed2_yaml_names_folders_inside_the_repo_from_its_root(tmp_path, monkeypatch):
    """The committed study2_lr_seed2.yaml and its rate files name the grid and the generated files from the repo
    root, as read through a symlink to the repo too (a clone reached by a link): never this machine's path."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (tmp_path / "link").symlink_to(repo, target_is_directory=True)
    monkeypatch.setattr("trainer.run_dir.REPO_ROOT", repo)
    sweep = _write_grid(tmp_path / "link" / "out" / "sweeps")
    path = write_seed2_yaml(Part(sweep, *load_sweep(sweep)), tmp_path / "link" / "out")
    text = path.read_text()
    assert text.splitlines()[0].endswith(" from out/sweeps/study2_synth (study2_synth):"), text.splitlines()[0]
    assert yaml.safe_load(text)["parameters"]["config"]["values"] == [
        f"out/study2_synth_seed2_rates/{name}.yaml" for name in ("pre_rmsnorm", "post_ln")]
    assert str(tmp_path) not in text


def test_write_seed2_yaml_pools_the_grids_extra_rates(tmp_path):
    """A part that adds a rate to the grid (study2_lr_high.yaml: the rate a fixed `value:`) moves a variant's best
    rate there; another variant keeps its own; an incomplete extra part is refused; a part that sweeps more (the
    Post-LN warmups) is not a grid and is left out."""
    from scripts.sweep_runner.config import load_sweep_config
    grid = _write_grid(tmp_path)
    high = _write_grid(tmp_path, "study2_high", losses={"pre_rmsnorm": {0.008: 4.4}, "post_ln": {0.008: None}})
    state = json.loads((high / "sweep_state.json").read_text())
    state["config"]["parameters"]["learning_rate"] = {"value": 0.008}
    (high / "sweep_state.json").write_text(json.dumps(state))
    warm = _write_grid(tmp_path, "study2_warm", losses={"pre_rmsnorm": {0.001: 1.0}, "post_ln": {0.001: 1.0}},
                       warmups=(0, 1))
    # A second-seed part (its rate lives in the variant file) whose seed is far worse at 8e-3: it must not move the
    # choice (pooled, 8e-3's mean 5.2 would lose to 2e-3's single 4.5).
    seed2 = _write_grid(tmp_path, "study2_seed2", seeds=(1,), losses={"pre_rmsnorm": {0.008: 6.0}})
    _rates_in_variant_files(seed2)
    parts = [Part(d, *load_sweep(d)) for d in (grid, high, warm, seed2)]
    path = write_seed2_yaml(parts[0], tmp_path / "out", parts[1:])
    files = load_sweep_config(path)["parameters"]["config"]["values"]
    rates = {Path(f).stem: yaml.safe_load(Path(f).read_text())["learning_rate"] for f in files}
    assert rates == {"pre_rmsnorm": 0.008, "post_ln": 0.001}
    assert "study2_high" in path.read_text().splitlines()[0]
    for trial in parts[1].trials:
        if "post_ln" in trial.params["config"]:
            trial.status = "not run"
    with pytest.raises(ValueError, match="study2_high: the grid is not complete for post_ln"):
        write_seed2_yaml(parts[0], tmp_path / "out", parts[1:3])


def test_write_seed2_yaml_refuses_an_unfinished_grid(tmp_path):
    sweep = _write_grid(tmp_path)
    part = Part(sweep, *load_sweep(sweep))
    part.trials = [t for t in part.trials if t.params["learning_rate"] != 0.004]
    with pytest.raises(ValueError, match="not complete for post_ln, pre_rmsnorm"):
        write_seed2_yaml(part, tmp_path)


# --------------------------------------------------------------------------- the interleaved benchmark
def test_rotation_puts_every_variant_first_once_per_cycle():
    names = ["a", "b", "c"]
    assert [bench.rotation(names, r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                            ["a", "b", "c"]]


def test_interleaved_order_and_warmup():
    calls: list[str] = []
    clock = {"a": iter(range(100)), "b": iter(range(100, 200))}

    def fn(name):
        def step():
            calls.append(name)
            return float(next(clock[name]))
        return step

    times = bench.interleaved({"a": fn("a"), "b": fn("b")}, rounds=2, steps=2, warmup=1)
    assert calls == ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"]
    assert times == {"a": [2.0, 3.0, 4.0, 5.0], "b": [102.0, 103.0, 104.0, 105.0]}  # warmup round dropped


def test_summarize_medians_and_ratio():
    summary = bench.summarize({"pre_rmsnorm": [0.1, 0.3, 0.2], "dyt": [0.5, 0.4, 0.2, 0.3]})
    assert summary["pre_rmsnorm"] == {"median_step_s": 0.2, "vs_baseline": 1.0, "steps": 3}
    assert summary["dyt"]["median_step_s"] == pytest.approx(0.35)
    assert summary["dyt"]["vs_baseline"] == pytest.approx(1.75)
    assert "| dyt | 350.0 | 1.750 | 4 |" in bench.markdown_table(summary)
    assert math.isnan(bench.summarize({"dyt": [0.1]})["dyt"]["vs_baseline"])


def test_variant_argv_is_the_trial_without_diagnostics():
    from trainer.arg_fields import build_model_config
    from trainer.args import parse_args
    config = yaml.safe_load((REPO / "scripts/sweep_configs/study2_lr.yaml").read_text())
    argv = bench.variant_argv(config, f"{VARIANTS}/olmo2.yaml", "/tmp/unused", compile_mode="off")
    args = parse_args("pretrain", argv)
    rates = config["parameters"]["learning_rate"]["values"]
    assert args.learning_rate == rates[len(rates) // 2]
    assert args.diag_interval == 0 and args.compile == "off"
    model = build_model_config(args)
    assert (model.num_hidden_layers, model.hidden_size) == (12, 64)
    assert (model.norm_placement, model.qk_norm, model.qk_norm_scope) == ("res_post", True, "full")


def test_cli_refuses_study2_options_without_study2_and_a_negative_margin(tmp_path, capsys):
    from eval.studies.ablation_report import main
    sweep = _write_grid(tmp_path)
    with pytest.raises(SystemExit):
        main([str(sweep), "--escape_margin", "0.1"])
    assert "need --study2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(sweep), "--study2", "--escape_margin", "-0.1"])
    assert "error: argument --escape_margin: -0.1 is not a finite number >= 0" in capsys.readouterr().err


def test_benchmark_times_real_trainers_of_two_variants(tmp_path):
    config = yaml.safe_load((REPO / "scripts/sweep_configs/study2_smoke.yaml").read_text())
    payload = bench.run(config, rounds=2, steps=1, warmup=0, compile_mode="off", variants=["post_ln", "pre_rmsnorm"])
    assert list(payload["variants"]) == ["pre_rmsnorm", "post_ln"]   # the sweep's order
    assert all(len(t) == 2 and all(s > 0 for s in t) for t in payload["times_s"].values())
    assert payload["variants"]["pre_rmsnorm"]["vs_baseline"] == 1.0
    import torch._dynamo  # compiled, each variant recompiles the one forward: the limit leaves room for all of them
    assert torch._dynamo.config.recompile_limit >= 4 * 2 + 8
    with pytest.raises(ValueError, match="--variants: nope not in"):
        bench.run(config, 1, 1, 0, "off", variants=["nope"])


def test_a_trials_recorded_arguments_are_read_once_and_bad_files_refused(tmp_path):
    """trainer.run_dir.recorded_config reads train_config.yaml ({} when missing; a ValueError naming the file when it
    is no run's record: not YAML, not a mapping, empty); the unigram baseline needs it and refuses a trial without
    one in one line naming the file."""
    from eval.studies.ablation.baseline import _run_args
    from trainer.run_dir import CONFIG_FILE, recorded_config

    assert recorded_config(tmp_path) == {}
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / CONFIG_FILE}: missing or records no flags"):
        _run_args(tmp_path)
    for text, why in (("[1, 2]", "a list, expected the run's flags"), ("key: [unclosed", "invalid YAML"),
                      ("", "an empty file, expected the run's flags")):
        (tmp_path / CONFIG_FILE).write_text(text)
        with pytest.raises(ValueError, match=rf"^{tmp_path / CONFIG_FILE}: {re.escape(why)}"):
            recorded_config(tmp_path)
        with pytest.raises(ValueError, match=rf"^{tmp_path / CONFIG_FILE}: {re.escape(why)}.*; --unigram rebuilds a "
                                             rf"trial's data from it$"):
            _run_args(tmp_path)
    (tmp_path / CONFIG_FILE).write_text(yaml.safe_dump({"task": "pretrain", "max_seq_len": 64}))
    assert recorded_config(tmp_path) == {"task": "pretrain", "max_seq_len": 64}
    assert _run_args(tmp_path).max_seq_len == 64


@pytest.mark.parametrize(("sweep", "said"), [("missing.yaml", "missing.yaml: no such file"),
                                             ("a_folder", "a_folder: is a directory, not a sweep YAML"),
                                             ("list.yaml", "list.yaml: no `config` parameter (the variant files)")])
def test_a_sweep_that_cannot_be_read_is_one_line_naming_it(sweep, said, tmp_path, capsys):
    """A missing sweep file was 'error: [Errno 2] No such file or directory: ...' (the errno's words), a folder an
    IsADirectoryError traceback and a YAML list an AttributeError's; now one line naming the file, as the sweep
    runner reads one (trainer/yaml_file.py's read_yaml)."""
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "list.yaml").write_text("- config\n")
    assert bench.main([str(tmp_path / sweep), "--out", str(tmp_path / "times.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / said}") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "times.json").exists()


def test_an_unknown_variant_is_refused_with_the_sweeps_names():
    config = {"parameters": {bench.VARIANT_KEY: {"values": ["study2_variants/pre_rmsnorm.yaml",
                                                             "study2_variants/post_layernorm.yaml"]}}}
    with pytest.raises(ValueError) as refused:
        bench.run(config, rounds=1, steps=1, warmup=0, compile_mode=None, variants=["pre_rmsnorm", "nonesuch"])
    assert str(refused.value) == (f"--variants: nonesuch not in the sweep's {bench.VARIANT_KEY} values; "
                                  "allowed: pre_rmsnorm,post_layernorm")
