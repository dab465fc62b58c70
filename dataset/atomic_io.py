"""The project's one atomic-write helper. Standard library only, so importing it costs nothing (the trainer,
the metrics log and the sweep runner all use it without pulling in HF ``datasets``)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path


def _current_umask() -> int:
    """The process umask. Linux reports it in /proc without changing it; elsewhere it can only be read by setting
    it, which briefly leaves other threads creating files with umask 0, so that is the fallback."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _regular_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0o666 less the umask (read per call, as it may change)."""
    return 0o666 & ~_current_umask()


def atomic_write_lines(path: str | Path, lines: Iterable[str]) -> None:
    """Write via a unique temp file, fsync, then ``os.replace``: readers (or a second rank writing the same file)
    see the old content or the new, never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            # mkstemp creates the file 0600; give it the mode a plain open() would, so others can still read it.
            os.fchmod(f.fileno(), _regular_file_mode())
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (see ``atomic_write_lines``)."""
    atomic_write_lines(path, [text])
