"""The report's numbers per variant (the rows of report.json) and their markdown table."""

from __future__ import annotations

import math
from typing import Any

from eval.studies.ablation.load import SEED_KEY, Variant, swept_keys


def _fmt(value: float | None, digits: int = 4) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _ratio(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.2g}"


def variant_rows(variants: list[Variant], part: str = "", baseline: float | None = None) -> list[dict[str, Any]]:
    rows = []
    for v in variants:
        mean, std = v.loss_stats()
        rows.append({"part": part, "params": v.params, "seeds": len(v.trials), "finished": len(v.finished()),
                     "diverged": v.count("diverged"), "failed": v.count("failed"),
                     "val_loss_mean": mean, "val_loss_std": std,
                     "vs_unigram": mean - baseline if baseline is not None else math.nan,
                     "val_loss_per_seed": {str(t.params.get(SEED_KEY)): t.final_val_loss for t in v.trials},
                     "grad_in_out": v.grad_in_out(),
                     "median_step_time_s": v.median_of("median_step_time_s"),
                     "tokens_per_s": v.median_of("tokens_per_s")})
    return rows


def markdown_table(config: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    keys = swept_keys(config)
    with_unigram = any(not math.isnan(row["vs_unigram"]) for row in rows)
    with_grads = any(not math.isnan(row["grad_in_out"]) for row in rows)
    header = (keys + ["final val loss (mean ± std)"] + (["vs unigram"] if with_unigram else [])
              + ["finished", "diverged"] + (["grad L0 / L_last"] if with_grads else [])
              + ["step time (ms)", "tokens/s"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        loss = (f"{_fmt(row['val_loss_mean'])} ± {_fmt(row['val_loss_std'])}"
                if not math.isnan(row["val_loss_mean"]) else "–")
        failed = f" (+{row['failed']} failed)" if row["failed"] else ""
        cells = ([str(row["params"][k]) for k in keys] + [loss]
                 + ([f"{row['vs_unigram']:+.2f}" if not math.isnan(row["vs_unigram"]) else "–"] if with_unigram else [])
                 + [f"{row['finished']}/{row['seeds']}", f"{row['diverged']}{failed}"]
                 + ([_ratio(row["grad_in_out"])] if with_grads else [])
                 + [_fmt(row["median_step_time_s"] * 1000, 1), _fmt(row["tokens_per_s"], 0)])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
