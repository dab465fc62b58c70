"""Running one trial: its subprocess, tied to the runner with whatever it starts (trainer/tether.py), so a signal to
the runner or the runner's death stops it; the wandb mode it logs in; its outcome read from its folder."""

from __future__ import annotations

import netrc
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from trainer.run_dir import EXIT_DIVERGED, EXIT_NOT_FOUND, REPO_ROOT, SUMMARY_FILE, read_summary
from trainer.sweep_dir import TRIAL_LOG

def default_wandb_mode() -> str:
    """online when a wandb API key is configured, else offline (no server needed)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
        if netrc.netrc().authenticators(host):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    return "offline"


TAIL_LINES = 15  # a failed trial's last lines of output, kept as its error
TETHER = REPO_ROOT / "trainer" / "tether.py"  # runs a trial tied to this process


@dataclass
class TrialOutcome:
    status: str              # finished | diverged | failed
    returncode: int
    summary: dict[str, Any]
    error: str = ""          # a failed trial's: one message, or (log_tail) the last lines of its output
    log_tail: bool = False   # error is the trial's own output, not a message of the runner's


class _Trials:
    """The trials' subprocesses in flight (several with --workers), which a signal stops with the runner. A worker
    starts its trial under the lock, so a stop that comes while one starts still reaches it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # a second signal may come while the handler of the first holds it
        self.running: set[subprocess.Popen] = set()
        self.stopping = False

    def start(self, command: list[str], **popen: Any) -> subprocess.Popen:
        with self.lock:
            child = subprocess.Popen(command, **popen)
            self.running.add(child)
            if self.stopping:
                child.terminate()
        return child

    def done(self, child: subprocess.Popen) -> None:
        with self.lock:
            self.running.discard(child)

    def stop(self) -> None:
        """Stop the running trials with us; their directories have no run_summary.json, so a restart reruns them."""
        with self.lock:
            self.stopping = True
            for child in self.running:
                if child.poll() is None:
                    child.terminate()


running_trials = _Trials()


def on_terminate(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001
    """SIGTERM's handler: the trials stop with the runner, which exits 128 + the signal."""
    running_trials.stop()
    raise SystemExit(128 + signum)


def on_interrupt(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001
    """SIGINT's handler: the trials stop, then a KeyboardInterrupt unwinds the runner."""
    # The trials stop here, in the handler: unwinding first would wait in the worker pool's exit for trials that a
    # `kill -INT` of the runner alone leaves running.
    running_trials.stop()
    raise KeyboardInterrupt


@contextmanager
def _tie() -> Iterator[int | None]:
    """The reading end of a pipe for one trial's tether (None where there is no tether: not POSIX). Its writing
    end stays in this process alone (not inherited) until the trial is done, so the kernel closes it when this
    process ends in any way, a SIGKILL too, and the tether then stops the trial."""
    if os.name != "posix":
        yield None
        return
    read_end, write_end = os.pipe()
    try:
        yield read_end
    finally:
        os.close(read_end)
        os.close(write_end)


def run_trial(command: list[str], trial_dir: Path, env: dict[str, str], keep_finished: bool = False
              ) -> TrialOutcome:
    """Run one trial in `trial_dir` (the caller makes it) and read its outcome. `keep_finished`: the program is one
    of this repo's trainers, whose `--resume auto` returns a run that finished there with the same flags as it is
    (a runner killed after its trial finished, before recording it): its summary is kept for it to find."""
    log_path = trial_dir / TRIAL_LOG
    summary_path = trial_dir / SUMMARY_FILE
    if summary_path.exists() and not (keep_finished and read_summary(trial_dir).get("status") == "finished"):
        summary_path.unlink()  # a stale summary must not be read as this attempt's outcome
    with open(log_path, "ab") as log:
        log.write(f"\n$ {shlex.join(command)}\n".encode())
        log.flush()
        # the log holds earlier attempts and this one's command line: its own output starts here
        output_start = os.fstat(log.fileno()).st_size
        with _tie() as tie:  # tied to this process with all it starts (trainer/tether.py; POSIX's process groups)
            tethered = [sys.executable, str(TETHER), str(tie), *command] if tie is not None else command
            try:
                child = running_trials.start(tethered, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      pass_fds=() if tie is None else (tie,))
            except OSError as error:  # untethered (not POSIX): the tether's one line, said here
                return TrialOutcome("failed", EXIT_NOT_FOUND, {}, f"cannot run {command[0]}: {error.strerror}")
            try:
                returncode = child.wait()
            finally:
                running_trials.done(child)
    summary = read_summary(trial_dir)
    if returncode == 0 and summary.get("status") == "finished":
        return TrialOutcome("finished", returncode, summary)
    if returncode == EXIT_DIVERGED or summary.get("status") == "diverged":
        return TrialOutcome("diverged", returncode, summary)
    with open(log_path, "rb") as log:
        log.seek(output_start)
        tail = log.read().decode(errors="replace").strip().splitlines()[-TAIL_LINES:]
    if not tail:  # e.g. killed by the OOM killer; the log's last line is then the command, which is no error
        return TrialOutcome("failed", returncode, summary, f"it printed nothing (its command is in {log_path})")
    return TrialOutcome("failed", returncode, summary, "\n".join(tail), log_tail=True)
