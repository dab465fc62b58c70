"""Writing a converted model directory (an export to Llama / Qwen3, an import from them) safely: the output
folder is checked before anything is loaded, the result is built under a temporary name beside it and renamed
into place only when complete, and only an empty folder or an earlier result of the same tool is replaced."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


def check_out_dir(source: Path, out_dir: Path, is_replaceable: Callable[[Path], bool], what: str) -> None:
    """Refuse an --out_dir whose replacement would delete the source model or an unrelated folder. A non-empty
    folder is replaced only when `is_replaceable(out_dir)`; `what` names such a folder ("a previous Llama export").

    Both paths must be resolved (symlinks and `..` gone), or a spelling like a/x/../pretrain slips through.
    """
    if out_dir == source or out_dir in source.parents or source in out_dir.parents:
        raise ValueError(f"--out_dir {out_dir} overlaps the model at {source}; choose a folder outside it")
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ValueError(f"--out_dir {out_dir} is a file; choose a folder")
    if any(out_dir.iterdir()) and not is_replaceable(out_dir):
        raise ValueError(f"--out_dir {out_dir} is neither empty nor {what}; not replacing it")


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


@contextmanager
def staged_dir(out_dir: Path) -> Iterator[Path]:
    """A temporary folder beside `out_dir` to write into; renamed to `out_dir` when the block ends without an
    error, removed otherwise."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
    try:
        yield staging
        _install(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
