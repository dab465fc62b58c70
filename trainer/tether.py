"""Run a command tied to the process that starts it, with whatever the command starts in turn:

    python trainer/tether.py PARENT_PID COMMAND [ARG ...]

The sweep runner starts each trial so. This small supervisor puts the command in a process group of its own and
hands every SIGTERM or SIGINT it gets to that whole group, so a trial that starts its trainer through a shell or a
launcher is stopped whole. On Linux it also asks the kernel for a SIGTERM when its parent dies, even by SIGKILL or
the OOM killer (prctl PR_SET_PDEATHSIG): a runner killed outright leaves no trial training on in a folder that the
next runner uses again. The request is made here, in a process of one thread, not in the runner's preexec_fn, which
is unsafe in a process with threads (the runner's workers); it follows the thread that started this process, a
worker of the runner's pool, which lives until the pool shuts down, after its trials. The exit code is the
command's, or a shell's for a command killed by a signal (128 + N), that cannot be found (127) or run (126).
Run as a file, not with -m, so that no PYTHONSAFEPATH or working folder decides whether it is found.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo's packages importable

from trainer.cli import run_main  # noqa: E402
from trainer.run_dir import EXIT_CANNOT_EXECUTE, EXIT_ERROR, EXIT_NOT_FOUND, exit_code_of  # noqa: E402

PR_SET_PDEATHSIG = 1  # linux/prctl.h
FORWARDED = (signal.SIGTERM, signal.SIGINT)  # what a stop of the runner sends; the trial's group gets it whole


def tie_to_parent(parent_pid: int) -> bool:
    """Ask for SIGTERM when this process's parent dies; False where the system has no such request. A parent that
    died before the request held (this process is then another's child) ends this process at once, as the signal
    would have."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.prctl.restype = ctypes.c_int
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent_pid:
        raise SystemExit(exit_code_of(-signal.SIGTERM))
    return True


class _Group:
    """The command's process group and the signals that came for it, before it existed too."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending: list[int] = []

    def forward(self, signum: int, frame: object = None) -> None:  # noqa: ARG002
        if self.pid is None:
            self.pending.append(signum)
            return
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:  # the whole group has ended
            pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python trainer/tether.py PARENT_PID COMMAND [ARG ...]", file=sys.stderr)
        return EXIT_ERROR
    group = _Group()
    for number in FORWARDED:  # before anything can come: a stop while the command starts still reaches it
        signal.signal(number, group.forward)
    tie_to_parent(int(argv[0]))
    try:
        # a group of its own (this process has one thread: preexec_fn is safe here); Python's ignored SIGPIPE and
        # SIGXFSZ go back to their defaults in the command (restore_signals)
        child = subprocess.Popen(argv[1:], preexec_fn=os.setpgrp)
    except OSError as error:  # a missing or non-executable program: the trial's one line, not a traceback
        print(f"cannot run {argv[1]}: {error.strerror}", file=sys.stderr)
        return EXIT_NOT_FOUND if error.errno == errno.ENOENT else EXIT_CANNOT_EXECUTE
    group.pid = child.pid
    for signum in group.pending:
        group.forward(signum)
    return exit_code_of(child.wait())


if __name__ == "__main__":
    run_main(main)
