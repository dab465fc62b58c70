"""A sweep folder as scripts/sweep.py writes it, read into trials (their final numbers, validation curves and
gradient profiles) and grouped into variants: a variant is one setting of the swept parameters, its seeds
averaged."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.diagnostics import metric_matrix
from trainer.run_dir import METRICS_FILE, final_metric, note_on_stderr, read_metrics, read_summary, record_number
from trainer.sweep_dir import (RESULT_SUMMARY_KEYS, SWEEP_STATE_FILE, read_results, read_state, swept_names,
                               trial_dir_name)

SEED_KEY = "seed"


@dataclass
class Trial:
    trial_id: str
    params: dict[str, Any]
    status: str                                  # finished | diverged | failed | not run (yet)
    summary: dict[str, Any] = field(default_factory=dict)
    val_curve: list[tuple[int, float]] = field(default_factory=list)
    grad_profile: list[float] = field(default_factory=list)  # grad_norm per block at the last diagnostics step
    run_dir: Path | None = None
    # the steps whose val loss in metrics.jsonl is NaN or infinite (a hand edit: the trainer writes one as null),
    # left out of val_curve and so of the variant's mean curve
    non_finite_val_steps: list[int] = field(default_factory=list)

    @property
    def final_val_loss(self) -> float | None:
        """The finished trial's final validation loss; None where its summary holds no finite number there (a
        damaged or hand-edited summary: a NaN would make its variant's mean NaN, and failed the stdev)."""
        return final_metric(self.summary, "val_loss") if self.status == "finished" else None

    @property
    def grad_in_out(self) -> float | None:
        """Gradient norm of the first block over the last block's, at the last diagnostics step."""
        if len(self.grad_profile) < 2 or not self.grad_profile[-1]:
            return None
        return self.grad_profile[0] / self.grad_profile[-1]


@dataclass
class Variant:
    params: dict[str, Any]                       # swept parameters without the seed
    trials: list[Trial] = field(default_factory=list)

    def finished(self) -> list[Trial]:
        return [t for t in self.trials if t.final_val_loss is not None]

    def count(self, status: str) -> int:
        return sum(t.status == status for t in self.trials)

    def loss_stats(self) -> tuple[float, float]:
        """Mean and sample standard deviation (n-1) of the finished seeds' final val loss."""
        losses = [t.final_val_loss for t in self.finished()]
        if not losses:
            return math.nan, math.nan
        return statistics.fmean(losses), statistics.stdev(losses) if len(losses) > 1 else math.nan

    def median_of(self, key: str) -> float:
        values = [t.summary[key] for t in self.finished() if isinstance(t.summary.get(key), (int, float))]
        return statistics.median(values) if values else math.nan

    def grad_in_out(self) -> float:
        """Geometric mean over the finished seeds of the first/last block gradient-norm ratio."""
        ratios = [t.grad_in_out for t in self.finished() if t.grad_in_out]
        return math.exp(statistics.fmean(math.log(r) for r in ratios)) if ratios else math.nan

    def mean_grad_profile(self) -> list[float]:
        """Geometric mean per block over the finished seeds of the last diagnostics step's gradient norms."""
        profiles = [t.grad_profile for t in self.finished() if t.grad_profile and all(g > 0 for g in t.grad_profile)]
        if not profiles or len({len(p) for p in profiles}) > 1:
            return []
        return [math.exp(statistics.fmean(math.log(p[i]) for p in profiles)) for i in range(len(profiles[0]))]

    def mean_curve(self) -> list[tuple[int, float]]:
        """Mean val loss per step over the finished seeds, at the steps all of them logged (a step whose loss is
        NaN or infinite in one seed's file, left out of its curve, is left out of the mean)."""
        curves = [dict(t.val_curve) for t in self.finished() if t.val_curve]
        if not curves:
            return []
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        return [(s, statistics.fmean(c[s] for c in curves)) for s in steps]


@dataclass
class Part:
    """One sweep of the report: its folder, config, trials and variants, and the unigram baseline of its data."""
    sweep_dir: Path
    config: dict[str, Any]
    trials: list[Trial]
    variants: list[Variant] = field(default_factory=list)
    unigram: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return str(self.config.get("name") or self.sweep_dir.name)

    @property
    def baseline(self) -> float | None:
        return self.unigram["loss"] if self.unigram else None



def load_sweep(sweep_dir: Path) -> tuple[dict[str, Any], list[Trial]]:
    """The sweep's config and its trials, in proposal order; the last results.jsonl record of a trial wins."""
    state = read_state(sweep_dir)
    if state is None:
        raise FileNotFoundError(f"{sweep_dir}: no {SWEEP_STATE_FILE}; run `python scripts/sweep.py FILE.yaml` first")
    records = {record["trial_id"]: record for record in read_results(sweep_dir, note_on_stderr)}
    trials = []
    for entry in state["trials"]:
        record = records.get(entry["trial_id"])
        kept = (record or {}).get("trial_dir")  # the trial's own folder unless its record names one (a path)
        trial_dir = sweep_dir / (kept if isinstance(kept, str) else trial_dir_name(entry["trial_id"]))
        trial = Trial(entry["trial_id"], entry["params"], record["status"] if record else "not run", run_dir=trial_dir)
        trial.summary = read_summary(trial_dir)
        if not trial.summary and record is not None:  # the folder is gone: its numbers live on in results.jsonl
            trial.summary = {"status": record.get("status"),
                             **{key: record[key] for key in RESULT_SUMMARY_KEYS if key in record}}
        if (trial_dir / METRICS_FILE).exists():
            metrics = read_metrics(trial_dir / METRICS_FILE, note_skipped=note_on_stderr)
            curve = [(record_number(r, "step", int), record_number(r, "val_loss")) for r in metrics
                     if r.get("split") == "val" and r.get("val_loss") is not None]
            trial.val_curve = [(step, loss) for step, loss in curve if math.isfinite(loss)]
            trial.non_finite_val_steps = [step for step, loss in curve if not math.isfinite(loss)]
            _, grads = metric_matrix(metrics, "grad_norm")
            if grads.size and not any(math.isnan(g) for g in grads[:, -1]):
                trial.grad_profile = [float(g) for g in grads[:, -1]]
        trials.append(trial)
    return state["config"], trials


def swept_keys(config: dict[str, Any]) -> list[str]:
    """The swept parameters that define a variant: the seeds of one variant are averaged."""
    return [name for name in swept_names(config) if name != SEED_KEY]


def group_variants(config: dict[str, Any], trials: list[Trial]) -> list[Variant]:
    keys = swept_keys(config)
    variants: dict[str, Variant] = {}
    for trial in trials:
        if trial.status == "not run":
            continue
        params = {k: trial.params.get(k) for k in keys}
        variants.setdefault(json.dumps(params, sort_keys=True, default=str), Variant(params)).trials.append(trial)
    return list(variants.values())


def duplicate_trials(parts: list[Part]) -> list[dict[str, Any]]:
    """Finished trials of different parts with identical parameters, with their final losses: deterministic
    training must give them the same numbers."""
    seen: dict[str, tuple[Part, Trial]] = {}
    pairs = []
    for part in parts:
        for trial in part.trials:
            if trial.final_val_loss is None:
                continue
            key = json.dumps(trial.params, sort_keys=True, default=str)
            if key in seen and seen[key][0] is not part:
                other_part, other = seen[key]
                pairs.append({"params": trial.params, "parts": [other_part.name, part.name],
                              "trial_ids": [other.trial_id, trial.trial_id],
                              "final_val_loss": [other.final_val_loss, trial.final_val_loss],
                              "abs_diff": abs(other.final_val_loss - trial.final_val_loss)})
            else:
                seen.setdefault(key, (part, trial))
    return pairs
