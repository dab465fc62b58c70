"""CPU threads on a machine shared with other processes: how many intra-op threads a run uses, and how long
OpenMP's idle threads spin before they sleep.

Why: torch's CPU kernels run OpenMP parallel regions (about 1,250 operators per step of the default
pretraining run, most of them small: bf16 casts, Muon's Newton-Schulz products, optimizer updates), and each ends
at a barrier that waits for every thread. When another process keeps one of two cores busy, one of our two
threads is often off its core, and the other spins at the barrier for OpenMP's default spin time (about 300,000
iterations) on the core the first one needs: the step became 4-6x slower (docs/benchmarks.md, "A busy machine").

Two settings, both decided once per process:
- OpenMP's spin, bounded (`bound_openmp_waits`, GOMP_SPINCOUNT=SPIN_COUNT): a waiting thread soon sleeps and
  gives its core back. libgomp reads it when it loads, that is when torch is imported, so every tool that runs a
  model calls this first thing, through trainer/cli.py's begin_command (tests/unit/test_layout.py checks it). A
  value the user set (GOMP_SPINCOUNT or OMP_WAIT_POLICY) is kept.
- The thread count (`ThreadPolicy`, `--threads auto`, the default): the cores this process may use (its CPU
  affinity, a cgroup CPU quota) minus the cores other processes keep busy on them at start, at least one. Others'
  load is measured, not guessed from /proc/loadavg (which counts our own threads): the busy time of our CPUs in
  /proc/stat (time stolen by a hypervisor included) minus this process's own CPU time (/proc/self/stat), over
  windows of START_WINDOW_S; a core counts as taken when others use more than OTHERS_THRESHOLD of it in every one
  of up to START_WINDOWS windows (the quietest window decides; the look ends at the first window that leaves every
  core free). Why the quietest: the count holds for the whole run; on an idle machine one thread made the default
  step 1.5x slower than two, beside a steady competitor two made it only 1.16x slower than one (docs/benchmarks.md,
  "One thread or two"), so a burst at start (a compiler, a test's worker starting) must not take a core for the
  run. A number
  (`--threads 2`, at most the usable cores: more threads only wait for each other, parse_threads) pins the count,
  and so does OMP_NUM_THREADS (torchrun sets 1 for each of its processes; a count past the usable cores is capped
  at them, as torch's own default caps it at the machine's cores).

Exactness: the thread count changes the last bits of a training step (the weight gradients' matrix products
split their sums by thread; tests/integration/test_threads_exact.py shows it), so it is fixed for a whole run:
a checkpoint records it and a resumed run takes it back, which keeps resume bit-exact. Load that comes and goes
during a run is what the bounded spin is for: it changes no result.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from dataset.shown_value import flag_refusal
from trainer.cgroups import V2, own_group_files, read_limit_text
from trainer.number_text import ascii_hint, ascii_int

START_WINDOW_S = 0.25      # one look at others' load, before the work starts
START_WINDOWS = 4          # looks at most (1 s) before a core counts as taken for the run
OTHERS_THRESHOLD = 0.25    # a core counts as taken when other processes use more than this share of it
THREADS_AUTO = "auto"
# More than any machine's cores: --num_proc's bound (trainer/arg_checks.py), a checkpoint's thread count's and every
# benchmark's --threads' (trainer/cli.py's benchmark_threads; a benchmark may time more threads than cores)
MAX_THREADS = 4096
THREADS_KEY = "threads"  # in a checkpoint's state: the run's thread count
# --threads' help: a trainer's (whose resumed run keeps its checkpoint's count), and that of a tool that runs a model
# (chat, evaluation, the server), which resumes nothing.
TOOL_THREADS_HELP = ("CPU threads: auto (one per core that other processes leave free at start; OMP_NUM_THREADS "
                     "pins it if set) or a number that pins it, at most the cores this process may use "
                     "(trainer/threads.py)")
THREADS_HELP = TOOL_THREADS_HELP.replace("pins it if set)", "pins it if set; a resumed run keeps its checkpoint's)")
SPIN_COUNT = 3000          # GOMP_SPINCOUNT: iterations a waiting OpenMP thread spins before it sleeps


def threads_allowed(cores: int) -> str:
    """What --threads takes on a process that may use `cores` cores, in words."""
    return (f"use 'auto' or a number of threads in 1 .. {cores} (the cores this process may use: its CPU affinity, "
            f"capped by its control group's CPU quota)")


def parse_threads(value: str, flag: str | None = "threads") -> str | int:
    """`auto` or a thread count the cores this process may use can run (the --threads flag), at most one thread per
    core (usable_cores). Why the bound: each intra-op thread waits at the barrier of every parallel region for all
    the others, so threads past the cores only wait for each other (the slowdown the module's docstring measures),
    and each reserves a stack: --threads 4096 under an 8 GB address-space limit aborted inside libgomp ("Thread
    creation failed", exit 134, no line of ours). A resumed run on fewer cores keeps its checkpoint's count through
    `auto` (ThreadPolicy.keep_runs). A ValueError naming `flag` (None: unnamed, argparse names it) otherwise."""
    if value == THREADS_AUTO:
        return THREADS_AUTO
    cores = usable_cores()
    try:
        count = ascii_int(value)
    except ValueError:
        count = 0
    if not 1 <= count <= cores:
        raise ValueError(flag_refusal(flag, value, threads_allowed(cores)) + ascii_hint(value))
    return count


# A control group's CPU quota files: cgroup v2's cpu.max ("QUOTA PERIOD" in microseconds, QUOTA "max": none), v1's
# cpu/cpu.cfs_quota_us (-1: none) beside cpu.cfs_period_us in the same folder
CGROUP_CPU_FILES = ((V2, "cpu.max"), ("cpu", "cpu.cfs_quota_us"))


def cgroup_cpu_limit(files: tuple[Path, ...] | None = None) -> int | None:
    """The cores a CPU quota lets this process use (its quota over its period, rounded up), the smallest over its
    control group and the groups above it (`files`, else CGROUP_CPU_FILES there: trainer/cgroups.py); None where
    no group sets one."""
    limits = []
    for path in own_group_files(CGROUP_CPU_FILES) if files is None else files:
        text = read_limit_text(path)
        if text is None:
            continue
        if path.name == "cpu.cfs_quota_us":
            text = f"{text} {read_limit_text(path.with_name('cpu.cfs_period_us'))}"
        try:
            quota, period = (int(field) for field in text.split())
        except ValueError:  # "max 100000" (v2), an absent period, a damaged file: no quota here
            continue
        if quota > 0 and period > 0:
            limits.append(max(1, math.ceil(quota / period)))
    return min(limits, default=None)


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by its control groups' CPU quota (containers, batch
    jobs)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_limit()
    return max(1, cores if quota is None else min(cores, quota))


@dataclass(frozen=True)
class CpuSample:
    """Cumulative clock ticks: busy and total over this process's CPUs, and this process's own CPU time."""

    busy: int
    total: int
    own: int


def read_cpu_sample(proc: Path = Path("/proc")) -> CpuSample | None:
    """The counters now, or None where /proc does not tell them (then the policy keeps its thread count)."""
    cpus = {f"cpu{index}" for index in os.sched_getaffinity(0)} if hasattr(os, "sched_getaffinity") else None
    busy = total = 0
    try:
        for line in (proc / "stat").read_text().splitlines():
            fields = line.split()
            if not fields or not fields[0].startswith("cpu") or fields[0] == "cpu":
                continue
            if cpus is not None and fields[0] not in cpus:
                continue
            # user nice system idle iowait irq softirq steal: idle and iowait are free time, steal is not ours.
            ticks = [int(value) for value in fields[1:9]]
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
        # The fields after the command name (which may hold spaces): utime and stime are the 12th and 13th.
        own_fields = (proc / "self" / "stat").read_text().rsplit(")", 1)[1].split()
        own = int(own_fields[11]) + int(own_fields[12])
    except (OSError, ValueError, IndexError):
        return None
    return CpuSample(busy, total, own) if total else None


def others_load(before: CpuSample, after: CpuSample, cores: int) -> float:
    """Cores' worth of CPU time other processes used between two samples (0 when the window is empty)."""
    elapsed = after.total - before.total
    if elapsed <= 0:
        return 0.0
    others = (after.busy - before.busy) - (after.own - before.own)
    return max(0.0, others / elapsed * cores)


def threads_for(cores: int, others: float) -> int:
    """One thread per core that other processes leave free, at least one."""
    taken = max(0, math.ceil(others - OTHERS_THRESHOLD))
    return max(1, cores - taken)


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    """The --threads flag of a tool that runs the model (chat, evaluation, the server)."""
    parser.add_argument("--threads", default=THREADS_AUTO, type=_threads_flag, help=TOOL_THREADS_HELP)


def _threads_flag(value: str) -> str | int:
    try:
        return parse_threads(value, flag=None)  # unnamed: argparse names it
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def bound_openmp_waits(environ: MutableMapping[str, str] = os.environ) -> None:
    """Bound OpenMP's spin (GOMP_SPINCOUNT=SPIN_COUNT) unless the user chose a wait policy. Call it before torch
    is imported: libgomp reads it when it loads."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)


def openmp_waits(environ: Mapping[str, str] = os.environ) -> str:
    """How OpenMP's waiting threads behave in this process, in words."""
    if "OMP_WAIT_POLICY" in environ:
        return f"OMP_WAIT_POLICY={environ['OMP_WAIT_POLICY']}"
    if "GOMP_SPINCOUNT" in environ:
        return f"OpenMP spins {environ['GOMP_SPINCOUNT']} before it sleeps"
    return "OpenMP's default spin (bound_openmp_waits was not called before torch loaded)"


class ThreadPolicy:
    """The intra-op thread count of this process, decided once: pinned (--threads N, OMP_NUM_THREADS, a resumed
    run's checkpoint) or `auto` (the usable cores others leave free at start)."""

    def __init__(self, setting: str | int = THREADS_AUTO, *, environ: Mapping[str, str] = os.environ,
                 sample: Callable[[], CpuSample | None] = read_cpu_sample, windows: int = START_WINDOWS) -> None:
        self.cores = usable_cores()
        self._sample, self._windows = sample, windows
        self.pinned_by: str | None = None
        self.others = 0.0
        self.note = ""
        omp = environ.get("OMP_NUM_THREADS", "").strip()
        if setting != THREADS_AUTO:
            self.threads, self.pinned_by = int(setting), "--threads"
        elif omp.isascii() and omp.isdigit() and int(omp) > 0:  # as libgomp reads it: '٣' is no count there
            # At most the usable cores, as --threads (parse_threads: more only wait, and 4096 aborted in libgomp);
            # torch's own default caps the variable at the machine's cores too.
            self.threads, self.pinned_by = min(int(omp), self.cores), "OMP_NUM_THREADS"
            if int(omp) > self.cores:
                self.pinned_by += f"={omp}, capped at the {self.cores} usable cores"
        else:
            self.threads = self.cores

    @property
    def auto(self) -> bool:
        return self.pinned_by is None

    def start(self) -> None:
        """Set the thread count (auto: after looking at others' load, see `quietest_load`)."""
        if self.auto:
            others = self.quietest_load()
            if others is not None:
                self.others = others
                self.threads = threads_for(self.cores, others)
        _set_threads(self.threads)

    def quietest_load(self) -> float | None:
        """Others' load in the quietest of up to `windows` (START_WINDOWS) windows of START_WINDOW_S, ending
        early at a window that leaves every core free; None where /proc does not tell."""
        quietest = None
        before = self._sample()
        if before is None:
            return None
        for _ in range(self._windows):
            time.sleep(START_WINDOW_S)
            after = self._sample()
            if after is None:
                return quietest
            load = others_load(before, after, self.cores)
            quietest = load if quietest is None else min(quietest, load)
            if threads_for(self.cores, quietest) == self.cores:
                break
            before = after
        return quietest

    def keep_runs(self, saved: int | None) -> None:
        """A resumed run keeps the thread count its checkpoint recorded (the last bits depend on it), unless one
        was pinned for this session; then say that the bits may differ from an uninterrupted run."""
        if saved is None:
            return
        if self.auto:
            self.threads, self.pinned_by = saved, "the resumed run's checkpoint"
            _set_threads(saved)
        elif saved != self.threads:
            self.note = (f"; the run had {saved} before: its last bits may differ from an uninterrupted run's")

    def describe(self) -> str:
        if self.auto:
            how = f"auto: {self.cores} usable cores, other processes used {self.others:.1f}"
        else:
            how = f"pinned by {self.pinned_by}"
        return f"threads: {self.threads} ({how}; {openmp_waits()}){self.note}"


def start_threads(setting: str | int = THREADS_AUTO) -> str:
    """A tool's thread count, set before it loads its model (chat, evaluation, the server); the line to print."""
    policy = ThreadPolicy(setting)
    policy.start()
    return policy.describe()


def _set_threads(count: int) -> None:
    import torch  # here, not above: bound_openmp_waits must be importable before torch loads

    torch.set_num_threads(count)
