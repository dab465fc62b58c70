"""Writing a converted model directory (an export to Llama / Qwen3, an import from them) safely: the output
folder is checked before anything is loaded, the result is built under a temporary name beside it and renamed
into place only when complete, and only an empty folder or an earlier result of the same tool is replaced.

A tool knows its own earlier results by a marker file it writes into each (EXPORT_MARKER, IMPORT_MARKER), never by
what the folder looks like: a transformers checkpoint downloaded from elsewhere has the same config.json as an
export, and its other files (a model card, notes, extra shards) are not ours to delete."""

from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

from safetensors import SafetensorError

from dataset.atomic_io import check_folder_path, first_line, give_open_modes, path_overlap
from dataset.json_text import strict_json

# The marker files: JSON recording where the result came from (the source, the measured logit difference, ...).
EXPORT_MARKER = "exported_from.json"  # scripts/convert_to_llama.py
IMPORT_MARKER = "imported_from.json"  # scripts/import_checkpoint.py


def is_marked(folder: Path, marker: str, recorded: Mapping[str, Any] | None = None) -> bool:
    """Whether `folder` holds the JSON object `marker` with every item of `recorded` (say, the same target)."""
    try:
        content = json.loads((folder / marker).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(content, dict) and all(content.get(k) == v for k, v in (recorded or {}).items())


def check_out_dir(source: Path, out_dir: Path, marker: str, what: str, recorded: Mapping[str, Any] | None = None
                  ) -> None:
    """Refuse an --out_dir whose replacement would delete the source model or a folder this tool did not write.
    A non-empty folder is replaced only when it holds `marker` recording `recorded` (is_marked); `what` names such
    a folder ("a previous Llama export"). The paths are compared resolved (dataset.atomic_io.path_overlap, as a
    trainer's --out_dir is), so a symlink or a spelling like a/x/../pretrain does not slip through.
    """
    if path_overlap(out_dir, source):
        raise ValueError(f"--out_dir {out_dir} overlaps the model at {source}; choose a folder outside it")
    check_folder_path(out_dir, "--out_dir")
    if not out_dir.exists():
        return
    if any(out_dir.iterdir()) and not is_marked(out_dir, marker, recorded):
        records = "".join(f", {key}={value}" for key, value in (recorded or {}).items())
        raise ValueError(f"--out_dir {out_dir} is neither empty nor {what} (known by its {marker}{records}); not "
                         f"replacing it: choose another folder, or delete it yourself")


def _install(staging: Path, out_dir: Path) -> None:
    """Rename the finished directory into place, replacing (after check_out_dir) what was there."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
    staging.rename(out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def earlier_source(folder: Path, marker: str) -> str | None:
    """The source an earlier result of this tool in `folder` records (its `marker`), which a new one replaces."""
    try:
        content = json.loads((folder / marker).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    source = content.get("source") if isinstance(content, dict) else None
    return source if isinstance(source, str) else None


@contextmanager
def staged_dir(out_dir: Path, marker: str, provenance: dict[str, Any]) -> Iterator[Path]:
    """A temporary folder beside `out_dir` to write into; when the block ends without an error, `provenance` (which
    the block may still fill in) is written to `marker` in it and it is renamed to `out_dir`; removed otherwise."""
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp", dir=out_dir.parent))
    except OSError as error:
        raise ValueError(f"cannot write {out_dir}: {error.strerror} ({error.filename})") from None
    staging.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
    try:
        yield staging
        (staging / marker).write_text(strict_json(provenance, indent=2) + "\n")
        give_open_modes(staging)
        _install(staging, out_dir)
    except (OSError, SafetensorError) as error:  # a full disk, a quota: one line, and nothing half-written stays
        raise ValueError(f"writing {out_dir} failed: {first_line(error)}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
