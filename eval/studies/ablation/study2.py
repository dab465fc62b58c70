"""The second edition of the normalization study (docs/study.md): its numbers per trial and per variant.

A variant is a trainer --config file (scripts/sweep_configs/study2_variants/NAME.yaml), swept as the `config`
parameter; its name is the file's stem. The computations, each small enough to check by hand:

- best loss: per variant, the lowest over the learning rates of the mean final val loss of the finished seeds;
- learning-rate sensitivity (Wortsman et al. 2023, with the unigram loss as the cap): the mean over the variant's
  rates of min(loss, cap) minus the best loss, where a rate's loss is the mean over its seeds of min(seed loss, cap)
  and a seed that diverged or failed counts as the cap. Wortsman et al. cap at the loss at initialization; the
  unigram cap is stricter: a run stuck on the unigram plateau counts as a full failure;
- plateau escape step: the first evaluation step whose val loss is at least `margin` nats below the unigram loss;
- stability: the largest attention logit and output logit RMS / max over the diagnostic steps, the residual RMS per
  layer at the last diagnostic step, loss and gradient-norm spikes by trainer.diagnostics.spike_steps' rule over
  every optimizer step, and the step a non-finite loss or gradient stopped the run;
- wall clock: the cumulative logged step time (eval time excluded) at each evaluation step, or the step times the
  separate interleaved benchmark measured (eval/benchmarks/bench_norm_variants.py) times the step.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eval.studies.ablation.load import SEED_KEY, Trial
from trainer.diagnostics import PREFIX, metric_matrix, spike_steps
from trainer.run_dir import METRICS_FILE, read_metrics, record_number, recorded_config

VARIANT_KEY = "config"            # the sweep parameter naming a variant file
BASELINE_VARIANT = "pre_rmsnorm"  # the variant every speed is relative to
POST_LN_VARIANT = "post_ln"       # the variant whose plateau escapes get their own table
LR_KEY, WARMUP_KEY, INIT_KEY = "learning_rate", "warmup_steps", "init_depth_scaling"
ESCAPE_MARGIN = 0.25              # nats below the unigram loss that count as off the plateau


def variant_name(params: dict[str, Any]) -> str:
    """The variant file's stem, or (without one) the parameters other than the rate and the seed."""
    if VARIANT_KEY in params:
        return Path(str(params[VARIANT_KEY])).stem
    rest = {k: v for k, v in params.items() if k not in (LR_KEY, SEED_KEY)}
    return ", ".join(f"{k}={v}" for k, v in sorted(rest.items())) or "all trials"


def run_value(trial: Trial, key: str) -> Any:
    """A trainer argument of a trial: its sweep parameter when swept or fixed there, else its train_config.yaml."""
    if key in trial.params:
        return trial.params[key]
    return None if trial.run_dir is None else recorded_config(trial.run_dir).get(key)


# --------------------------------------------------------------------------------------------- learning rates
def capped_mean(losses: list[float | None], cap: float) -> float:
    """The mean over seeds of min(loss, cap); a seed without a finite loss (diverged, failed) counts as the cap."""
    return statistics.fmean(min(v, cap) if v is not None and math.isfinite(v) else cap for v in losses)


def best_rate(by_rate: dict[float, list[float | None]]) -> tuple[float, float] | None:
    """(rate, loss) with the lowest mean final loss over the seeds that finished; None when none finished."""
    means = {lr: statistics.fmean(f) for lr, seeds in by_rate.items()
             if (f := [v for v in seeds if v is not None and math.isfinite(v)])}
    if not means:
        return None
    lr = min(means, key=means.get)
    return lr, means[lr]


def lr_sensitivity(by_rate: dict[float, list[float | None]], cap: float, best_loss: float | None = None) -> float:
    """Mean over the rates of the capped loss minus the best (uncapped, never above the cap) loss; `best_loss`: the
    best when the caller chose it (the chosen rate's mean over its seeds), else the lowest mean over the rates."""
    if best_loss is None:
        best = best_rate(by_rate)
        if best is None:
            return 0.0  # every rate failed: all at the cap, and the best is the cap too
        best_loss = best[1]
    return statistics.fmean(capped_mean(seeds, cap) for seeds in by_rate.values()) - min(best_loss, cap)


def losses_by_rate(trials: list[Trial]) -> dict[str, dict[float, list[float | None]]]:
    """variant -> learning rate -> final loss per seed (None: diverged or failed); trials not run are left out."""
    table: dict[str, dict[float, list[float | None]]] = {}
    for trial in trials:
        if trial.status not in ("finished", "diverged", "failed"):
            continue
        lr = run_value(trial, LR_KEY)
        if lr is None:
            continue
        table.setdefault(variant_name(trial.params), {}).setdefault(float(lr), []).append(trial.final_val_loss)
    return {v: dict(sorted(rates.items())) for v, rates in table.items()}


# --------------------------------------------------------------------------------------------- plateau escape
def escape_step(curve: list[tuple[int, float]], unigram: float, margin: float = ESCAPE_MARGIN) -> int | None:
    """The first evaluation step whose val loss is at least `margin` below the unigram loss; None: never."""
    return next((step for step, loss in curve if loss <= unigram - margin), None)


# --------------------------------------------------------------------------------------------- stability
@dataclass
class Stability:
    attn_logit_max: float = math.nan      # largest attention logit, any layer, any diagnostic step
    logits_rms_max: float = math.nan      # largest output-logit RMS over the diagnostic steps
    logits_max: float = math.nan          # largest output logit over the diagnostic steps
    resid_rms: list[float] = field(default_factory=list)  # residual RMS per layer at the last diagnostic step
    loss_spikes: list[int] = field(default_factory=list)
    grad_spikes: list[int] = field(default_factory=list)
    nonfinite_step: int | None = None     # the step a non-finite loss or gradient stopped the run

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


LOGITS_RMS_KEY, LOGITS_MAX_KEY = f"{PREFIX}/logits_rms", f"{PREFIX}/logits_max"


def _finite_max(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else math.nan


def stability(records: list[dict[str, Any]], status: str = "finished", stopped_at: int | None = None) -> Stability:
    """The stability numbers of one run from its metrics.jsonl records (see the module docstring)."""
    train = [r for r in records if r.get("split") == "train"]
    diag = [r for r in records if r.get("split") == "diag"]
    out = Stability()
    steps = [record_number(r, "step", int) for r in train]
    out.loss_spikes = spike_steps(steps, [record_number(r, "loss") for r in train])
    grads = [(record_number(r, "step", int), record_number(r, "grad_norm")) for r in train
             if r.get("grad_norm") is not None]
    out.grad_spikes = spike_steps([s for s, _ in grads], [g for _, g in grads])
    _, logits = metric_matrix(diag, "attn_logit_max")
    if logits.size:
        out.attn_logit_max = _finite_max([float(v) for v in logits.ravel()])
    out.logits_rms_max = _finite_max([record_number(r, LOGITS_RMS_KEY) for r in diag if LOGITS_RMS_KEY in r])
    out.logits_max = _finite_max([record_number(r, LOGITS_MAX_KEY) for r in diag if LOGITS_MAX_KEY in r])
    _, resid = metric_matrix(diag, "resid_rms")
    if resid.size:
        out.resid_rms = [float(v) for v in resid[:, -1]]
    if status == "diverged":
        out.nonfinite_step = stopped_at
    return out


# --------------------------------------------------------------------------------------------- time
def wall_clock_curve(records: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(seconds, val loss) at each evaluation: the sum of the logged step times of the steps up to it. A NaN or
    infinite val loss is no point (a gap, as in the trial's val_curve: load.py), its steps' time still spent."""
    times = {record_number(r, "step", int): record_number(r, "step_time_s") for r in records
             if r.get("split") == "train" and r.get("step_time_s") is not None}
    curve, spent, done = [], 0.0, 0
    for r in sorted((r for r in records if r.get("split") == "val"), key=lambda r: r["step"]):
        for step in sorted(s for s in times if done < s <= record_number(r, "step", int)):
            spent += times[step]
        done = record_number(r, "step", int)
        if math.isfinite(loss := record_number(r, "val_loss")):
            curve.append((spent, loss))
    return curve


def relative_step_times(step_times: dict[str, float], baseline: str = BASELINE_VARIANT) -> dict[str, float]:
    """Each variant's step time over the baseline's (above 1: slower); empty without a baseline time."""
    base = step_times.get(baseline)
    if not base or not math.isfinite(base):
        return {}
    return {name: t / base for name, t in step_times.items() if math.isfinite(t)}


def read_bench_step_times(path: str | Path) -> dict[str, float]:
    """variant -> median step time (s) from the interleaved benchmark's JSON."""
    data = json.loads(Path(path).read_text())
    try:
        # null: a median that was not finite (strict_json writes it so)
        return {name: math.nan if row["median_step_s"] is None else float(row["median_step_s"])
                for name, row in data["variants"].items()}
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: not the JSON of eval/benchmarks/bench_norm_variants.py "
                         f"(expected variants.NAME.median_step_s)") from None


def trial_metrics(trial: Trial) -> list[dict[str, Any]]:
    path = trial.run_dir / METRICS_FILE if trial.run_dir is not None else None
    return read_metrics(path) if path is not None and path.is_file() else []
