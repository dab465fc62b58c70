"""Run a command tied to the process that starts it: on Linux the command gets SIGTERM when that process dies, even
by SIGKILL, so a sweep runner that is killed leaves no trial training on in a folder the next runner will use again.

    python trainer/tether.py PARENT_PID COMMAND [ARG ...]

The kernel's parent-death signal (prctl PR_SET_PDEATHSIG) is asked for here, in a process of one thread that then
becomes the command (execvp keeps the request; the pid stays the same), not in the runner's subprocess preexec_fn,
which is unsafe in a process with threads (the runner's workers). The signal follows the thread that started this
process: the runner's worker thread, which lives until its sweep's pool shuts down, after its trials. Elsewhere
than on Linux the command runs untied. Run as a file, not with -m, so that no PYTHONSAFEPATH or cwd decides whether
it is found.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo's packages importable

from trainer.cli import run_main  # noqa: E402

PR_SET_PDEATHSIG = 1  # linux/prctl.h
EXIT_CANNOT_RUN = 127  # a shell's code for a command it cannot find or run


def tie_to_parent(parent_pid: int) -> bool:
    """Ask for SIGTERM when this process's parent dies; False where the system has no such request. A parent that
    died before the request held (this process is then another's child) ends this process at once, as the signal
    would have."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent_pid:
        raise SystemExit(128 + signal.SIGTERM)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python trainer/tether.py PARENT_PID COMMAND [ARG ...]", file=sys.stderr)
        return 2
    tie_to_parent(int(argv[0]))
    for number in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these, and an exec would keep them ignored
        signal.signal(number, signal.SIG_DFL)
    try:
        os.execvp(argv[1], argv[1:])
    except OSError as error:  # a missing or non-executable program: the trial's one line, not the runner's traceback
        print(f"cannot run {argv[1]}: {error.strerror}", file=sys.stderr)
    return EXIT_CANNOT_RUN


if __name__ == "__main__":
    run_main(main)
