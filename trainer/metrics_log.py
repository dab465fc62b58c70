"""The run's metrics file (trainer.run_dir.METRICS_FILE), written by the main process only. On resume, records past
the checkpoint's step are dropped so the file continues the same curve instead of repeating steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dataset.atomic_io import atomic_write_text
from dataset.json_text import strict_json
from trainer.run_dir import METRICS_FILE, append_jsonl, read_metrics


class MetricsLog:
    def __init__(self, out_dir: Path, enabled: bool) -> None:
        self.path = out_dir / METRICS_FILE
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """Keep only the records up to `step` (used when resuming from a checkpoint at `step`)."""
        if not self.enabled or not self.path.exists():
            return
        kept = [record for record in read_metrics(self.path) if record["step"] <= step]
        atomic_write_text(self.path, "".join(strict_json(record) + "\n" for record in kept))

    def reset(self) -> None:
        if self.enabled and self.path.exists():
            self.path.unlink()

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            append_jsonl(self.path, record)  # a value that is not finite is written as null (strict_json)
