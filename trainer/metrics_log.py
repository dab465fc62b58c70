"""The run's metrics file (trainer.run_dir.METRICS_FILE), written by the main process only. On resume, records past
the checkpoint's step are dropped so the file continues the same curve instead of repeating steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dataset.atomic_io import atomic_write_text
from dataset.json_text import strict_json
from trainer.run_dir import METRICS_FILE, NoteSink, append_jsonl, note_on_stderr, read_metrics


def unreadable_metrics(out_dir: Path) -> str | None:
    """Why the metrics file in `out_dir` cannot be continued by a resume (read_metrics's one line naming FILE:LINE:
    a step that is not one, a directory, not UTF-8), or None (readable, or none there). A resume asks before it
    changes anything in `out_dir`: truncate_after would fail on it after the run's summary and config were
    rewritten."""
    path = out_dir / METRICS_FILE
    if not path.exists() and not path.is_symlink():
        return None
    try:
        read_metrics(path)
    except ValueError as error:
        return str(error)
    return None


class MetricsLog:
    def __init__(self, out_dir: Path, enabled: bool) -> None:
        self.path = out_dir / METRICS_FILE
        self.enabled = enabled

    def truncate_after(self, step: int, ends_there: bool = False, note_skipped: NoteSink = note_on_stderr) -> None:
        """Keep only the records up to `step` (used when resuming from a checkpoint at `step`). A run that `ends_there`
        (resumed with --max_steps at the checkpoint's step) drops that step's val record too: its final evaluation
        logs that step's val record again, and a split's step twice is a damaged file to read_metrics. The file is
        rewritten without the damaged lines before its last (read_metrics skips them): `note_skipped` is told how
        many, in the other readers' words (skipped_lines_note), as they are gone from the file after this."""
        if not self.enabled or not self.path.exists():
            return
        kept = [record for record in read_metrics(self.path, note_skipped=note_skipped) if record["step"] < step
                or record["step"] == step and not (ends_there and record.get("split") == "val")]
        atomic_write_text(self.path, "".join(strict_json(record) + "\n" for record in kept))

    def reset(self) -> None:
        if self.enabled and self.path.exists():
            self.path.unlink()

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            append_jsonl(self.path, record)  # a value that is not finite is written as null (strict_json)
