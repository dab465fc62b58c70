"""Run a command tied to the process that starts it, with whatever the command starts in turn:

    python trainer/tether.py TIE_FD COMMAND [ARG ...]

The sweep runner starts each trial so. This small supervisor puts the command in a process group of its own, with
no stdin, and hands the signals that end a run (SIGTERM, SIGINT, a hangup, Ctrl-\\) to that whole group, so a trial
that starts its trainer through a shell or a launcher is stopped whole; Ctrl-Z pauses it and `fg` resumes it.
TIE_FD is the reading end of a pipe whose writing end only the starting process holds: when that process ends, even
by SIGKILL or the OOM killer, the kernel closes it, and the end of the pipe stops the trial as SIGTERM would. A
runner killed outright so leaves no trial training on in a folder that the next runner uses again, on every POSIX
system (Linux's parent-death signal would also fire when the runner's thread that started this process ends, and
exists nowhere else). On Linux the trial also gets SIGTERM when this process dies (prctl PR_SET_PDEATHSIG, asked in
the trial's preexec_fn while this process still has one thread). The exit code is the command's, or a shell's for
a command killed by a signal (128 + N), that cannot be found (127) or run (126).
Run as a file, not with -m, so that no PYTHONSAFEPATH or working folder decides whether it is found.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo's packages importable

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

from trainer.cli import run_main  # noqa: E402
from trainer.run_dir import EXIT_CANNOT_EXECUTE, EXIT_ERROR, EXIT_NOT_FOUND, exit_code_of  # noqa: E402

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# What ends a trial: a stop of the runner (SIGTERM, SIGINT) and what a terminal sends to its foreground group, the
# runner's, which the trial is no longer in (a hangup, Ctrl-\). The trial's group gets it whole, woken if paused.
ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _parent_death_request() -> Callable[[], bool] | None:
    """A call that asks the kernel for SIGTERM when the calling process's parent dies (True: it held); None where
    the system has no such request. Loaded once, before the fork: the trial's preexec_fn only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0


_die_with_parent = _parent_death_request()


def _start_trial() -> None:
    """The trial's preexec_fn (this process has one thread, so it is safe here): a process group of its own, and
    the trial dies with this process too (a tether killed outright)."""
    os.setpgrp()
    if _die_with_parent is not None:
        _die_with_parent()


class _Group:
    """The trial's process group and the signals that came for it, before it existed too."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending: list[int] = []

    def handle(self, signum: int, frame: object = None) -> None:  # noqa: ARG002
        if self.pid is None:
            self.pending.append(signum)
        elif signum == signal.SIGTSTP:  # Ctrl-Z: the trial pauses with the runner, and goes on with it (SIGCONT)
            self._send(signal.SIGTSTP)
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            self._send(signum)
            if signum != signal.SIGCONT:  # a paused trial could not end
                self._send(signal.SIGCONT)

    def _send(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:  # the whole group has ended
            pass


def _watch_tie(tie_fd: int, group: _Group) -> None:
    """Wait for the end of the tie (nothing is ever written to it): the starting process has ended, and the trial
    ends with it."""
    while os.read(tie_fd, 1):
        pass
    group.handle(signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python trainer/tether.py TIE_FD COMMAND [ARG ...]", file=sys.stderr)
        return EXIT_ERROR
    group = _Group()
    for number in (*ENDING, signal.SIGTSTP, signal.SIGCONT):  # before the trial starts: none is lost meanwhile
        # An ignored one stays ignored, the trial's too (`nohup`: a hangup must not end the trials either); SIGTERM
        # is how the runner stops a trial, so it is always handed on.
        if number == signal.SIGTERM or signal.getsignal(number) != signal.SIG_IGN:
            signal.signal(number, group.handle)
    try:
        # stdin: nothing (a trial that read the terminal from a background group would stop, and the runner wait for
        # ever); Python's ignored SIGPIPE and SIGXFSZ go back to their defaults in the trial (restore_signals); the
        # tie is not the trial's (close_fds)
        child = subprocess.Popen(argv[1:], stdin=subprocess.DEVNULL, preexec_fn=_start_trial)
    except OSError as error:  # a missing or non-executable program: the trial's one line, not a traceback
        print(f"cannot run {argv[1]}: {error.strerror}", file=sys.stderr)
        return EXIT_NOT_FOUND if error.errno == errno.ENOENT else EXIT_CANNOT_EXECUTE
    group.pid = child.pid
    for signum in group.pending:
        group.handle(signum)
    # Watched from now on: the preexec_fn above ran in a process of one thread. A runner that ended meanwhile has
    # closed the tie already, and the trial ends at once. The watcher starts with every signal blocked, so that the
    # kernel hands each to the main thread, the only one where Python runs handlers: one taken by the watcher would
    # wait until the trial ended (the main thread does not wake from its wait for it).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        threading.Thread(target=_watch_tie, args=(int(argv[0]), group), daemon=True).start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    code = child.wait()
    group.pid = None  # its group id may be another's from now on
    return exit_code_of(code)


if __name__ == "__main__":
    run_main(main)
