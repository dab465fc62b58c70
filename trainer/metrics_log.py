"""The run's metrics file: one JSON object per line (`{"step": ..., "split": "train"|"val"|"diag", ...}`),
written by the main process only. On resume, records past the checkpoint's step are dropped so the file
continues the same curve instead of repeating steps."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dataset.atomic_io import atomic_write_text

METRICS_FILE = "metrics.jsonl"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable
    return value


class MetricsLog:
    def __init__(self, out_dir: Path, enabled: bool) -> None:
        self.path = out_dir / METRICS_FILE
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """Keep only the records up to `step` (used when resuming from a checkpoint at `step`)."""
        if not self.enabled or not self.path.exists():
            return
        kept = [record for record in read_metrics(self.path) if record["step"] <= step]
        atomic_write_text(self.path, "".join(json.dumps(record) + "\n" for record in kept))

    def reset(self) -> None:
        if self.enabled and self.path.exists():
            self.path.unlink()

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({key: _clean(value) for key, value in record.items()}) + "\n")


def read_metrics(path: str | Path, split: str | None = None) -> list[dict[str, Any]]:
    """Records of a metrics file (optionally one split), in order. Blank lines, and a last line cut short by a
    killed run, are skipped."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record and (split is None or record.get("split") == split):
            records.append(record)
    return records
