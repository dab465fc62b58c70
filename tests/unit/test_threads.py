"""The CPU thread policy (trainer/threads.py): other processes' load measured from /proc, the thread count it
implies, the pins that override it, OpenMP's bounded spin, and a run's count kept across a resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import trainer.threads as threads
from tests.fake_cgroups import fake_cgroups
from tests.paths import REPO
from tests.training_runs import pretrain_argv, run_in_process
from trainer.run_dir import CHECKPOINT_DIR, STATE_FILE
from trainer.threads import (CpuSample, ThreadPolicy, bound_openmp_waits, others_load, parse_threads,
                             read_cpu_sample, threads_for)


@pytest.fixture(autouse=True)
def _restore_thread_count():
    count = torch.get_num_threads()
    yield
    torch.set_num_threads(count)


FOUR_CORES_ALLOWED = ("use 'auto' or a number of threads in 1 .. 4 (the cores this process may use: its CPU "
                      "affinity, capped by its control group's CPU quota)")


def test_threads_flag_takes_auto_or_a_count_up_to_the_usable_cores(monkeypatch):
    """At most one thread per core this process may use: --threads 4096 under an 8 GB address-space limit aborted
    inside libgomp (exit 134, "Thread creation failed", no line of ours), and threads past the cores only wait for
    each other. The bound is usable_cores' (affinity and cgroup quota: tested below)."""
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    assert parse_threads("auto") == "auto"
    assert parse_threads("3") == 3
    assert parse_threads("4") == 4
    for bad in ("0", "-2", "two", "", "5", "4096", "99999999999"):  # torch's set_num_threads overflowed on the last
        with pytest.raises(ValueError) as refused:
            parse_threads(bad)
        assert str(refused.value) == f"--threads={bad!r} is not allowed; {FOUR_CORES_ALLOWED}"


def test_threads_past_the_usable_cores_are_refused_before_the_run_starts(tmp_path):
    """The trainer's refusal, in a process whose address space is limited as a batch job's may be: one line naming
    the flag, the value and the bound, exit 2, where libgomp aborted the run (exit 134) with no line of ours."""
    import resource

    limit = 8_000_000_000

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    run = subprocess.run([sys.executable, "trainer/train_pretrain.py", "--threads", "4096", "--max_steps", "2",
                          "--out_dir", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True,
                         timeout=300, preexec_fn=limited)
    cores = threads.usable_cores()
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.splitlines()[0] == (f"error: --threads='4096' is not allowed; use 'auto' or a number of "
                                          f"threads in 1 .. {cores} (the cores this process may use: its CPU "
                                          f"affinity, capped by its control group's CPU quota)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("length, quoted", [(58, "'" + "t" * 58 + "'"), (59, "'" + "t" * 56 + "...")])
def test_a_quote_of_exactly_max_shown_characters_is_kept_whole(length, quoted):
    """The cut's edge (dataset/shown_value.py): a repr of MAX_SHOWN (60) characters, the quotes and 58 letters, is
    quoted whole; one of 61 keeps its first 57 characters and "..." (60 in all)."""
    from dataset.shown_value import MAX_SHOWN

    assert len(quoted) == MAX_SHOWN
    with pytest.raises(ValueError) as refused:
        parse_threads("t" * length)
    assert str(refused.value).startswith(f"--threads={quoted} is not allowed; ")


def test_a_long_threads_value_is_refused_in_one_short_line(capsys, monkeypatch):
    """--threads quotes a refused value as every flag refusal does (dataset/shown_value.py's flag_refusal: its repr,
    cut at MAX_SHOWN characters), the trainers' check and the tools' argparse flag alike: a 5,000-character value
    made a 5,000-character line."""
    import argparse

    from dataset.shown_value import MAX_SHOWN
    from trainer.threads import add_threads_flag

    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    long = "t" * 5000
    cut = "'" + "t" * (MAX_SHOWN - 4) + "..."  # the repr's quote and 56 characters, then the ellipsis
    with pytest.raises(ValueError) as refused:
        parse_threads(long)
    assert str(refused.value) == f"--threads={cut} is not allowed; {FOUR_CORES_ALLOWED}"
    parser = argparse.ArgumentParser(prog="tool")
    add_threads_flag(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--threads", long])
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == f"tool: error: argument --threads: {cut} is not allowed; {FOUR_CORES_ALLOWED}", last[:300]
    with pytest.raises(SystemExit):  # a short value reads as before: its whole repr
        parser.parse_args(["--threads", "two"])
    assert capsys.readouterr().err.splitlines()[-1] == (f"tool: error: argument --threads: 'two' is not allowed; "
                                                        f"{FOUR_CORES_ALLOWED}")


@pytest.mark.parametrize("groups, files, expected", [
    # v2: the process's own group sets 1.5 cores, the root none ("max")
    ("0::/job.slice/step\n", {"job.slice/step/cpu.max": "150000 100000\n", "cpu.max": "max 100000\n"}, 2),
    # v2: a group above the process's sets the smaller quota, which holds for the groups below it
    ("0::/job.slice/step\n", {"job.slice/cpu.max": "50000 100000\n", "job.slice/step/cpu.max": "300000 100000\n"},
     1),
    # v1: quota over period in the cpu controller's folder (-1: none), the controller named beside cpuacct
    ("3:cpu,cpuacct:/batch/7\n4:memory:/batch/7\n0::/\n",
     {"cpu/batch/7/cpu.cfs_quota_us": "300000\n", "cpu/batch/7/cpu.cfs_period_us": "100000\n",
      "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
    ("1:cpu:/\n0::/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ("0::/a\n", {"a/cpu.max": "garbage\n"}, None),  # a damaged file sets no quota
    ("", {}, None),  # no /proc/self/cgroup, no files
])
def test_the_cpu_quota_is_the_smallest_of_this_processs_group_and_those_above(groups, files, expected, tmp_path,
                                                                              monkeypatch):
    """The CPU quota (cores = quota / period, rounded up) is read from /proc/self/cgroup's group and each group above
    it, cgroup v2's cpu.max and v1's cpu.cfs_quota_us / cpu.cfs_period_us: the root's v2 file alone was read, which
    a batch job's group or a v1 machine (this project's CI hosts among them) never set; usable_cores takes it."""
    self_cgroup, root = fake_cgroups(tmp_path, groups, files)
    found = threads.own_group_files(threads.CGROUP_CPU_FILES, self_cgroup, root)
    assert threads.cgroup_cpu_limit(found) == expected
    monkeypatch.setattr(threads, "own_group_files", lambda hierarchy_files: found)  # what the default reads
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert threads.usable_cores() == (4 if expected is None else expected)


def test_others_load_is_the_busy_time_that_is_not_ours():
    before = CpuSample(busy=1000, total=4000, own=300)
    # 200 ticks elapsed over 2 CPUs (100 each): 150 busy, 50 of them ours: others used 100 ticks = one core.
    after = CpuSample(busy=1150, total=4200, own=350)
    assert others_load(before, after, cores=2) == pytest.approx(1.0)
    assert others_load(before, before, cores=2) == 0.0  # an empty window tells nothing
    # Our own threads spinning do not count as others' load.
    assert others_load(before, CpuSample(busy=1200, total=4200, own=500), cores=2) == 0.0


@pytest.mark.parametrize("cores, others, expected", [
    (2, 0.0, 2), (2, 0.2, 2), (2, 0.3, 1), (2, 1.0, 1), (2, 1.9, 1), (4, 1.0, 3), (4, 1.3, 2), (1, 0.9, 1)])
def test_one_thread_per_core_others_leave_free_at_least_one(cores, others, expected):
    assert threads_for(cores, others) == expected


def test_the_proc_counters_are_read_for_our_cpus_only(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    lines = ["cpu  999 0 999 999 0 0 0 0 0 0"]
    # user nice system idle iowait irq softirq steal: busy = all but idle and iowait; steal counts as busy.
    lines += [f"cpu{cpu} 10 1 5 100 4 1 1 3 0 0" for cpu in cpus]
    lines.append(f"cpu{max(cpus) + 1} 5000 0 0 0 0 0 0 0 0 0")  # a CPU we may not run on
    (tmp_path / "stat").write_text("\n".join(lines) + "\n")
    (tmp_path / "self").mkdir()
    # The command name may hold spaces and parentheses; utime and stime are the 14th and 15th fields.
    (tmp_path / "self" / "stat").write_text("4242 (python (x) y) R 1 2 3 4 5 6 7 8 9 10 70 30 0 0 20 0 4\n")
    sample = read_cpu_sample(tmp_path)
    assert sample == CpuSample(busy=21 * len(cpus), total=125 * len(cpus), own=100)
    assert read_cpu_sample(tmp_path / "missing") is None


def test_a_busy_competitor_takes_a_core_from_the_auto_count():
    cores = threads.usable_cores()
    competitor = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    try:
        time.sleep(0.3)  # let it start
        before = read_cpu_sample()
        time.sleep(1.0)
        after = read_cpu_sample()
    finally:
        competitor.kill()
        competitor.wait()
    others = others_load(before, after, cores)
    assert others >= 0.5  # the loop keeps one core busy (more load from elsewhere only adds to it)
    assert threads_for(cores, others) <= max(1, cores - 1)


def cumulative_samples(others_per_window: list[float], cores: int = 4) -> list[CpuSample]:
    """/proc counters whose successive windows of 100 ticks per CPU show these loads of other processes (in
    cores), beside our own process busy on half a core."""
    samples = [CpuSample(0, 0, 0)]
    for others in others_per_window:
        last = samples[-1]
        samples.append(CpuSample(busy=last.busy + round(100 * others) + 50, total=last.total + 100 * cores,
                                 own=last.own + 50))
    return samples


def policy_over(samples: list[CpuSample], monkeypatch) -> ThreadPolicy:
    """An auto policy on four cores that reads these samples, in order, and no more."""
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(threads, "START_WINDOW_S", 0.0)
    unread = iter(samples)
    policy = ThreadPolicy("auto", environ={}, sample=lambda: next(unread))
    policy.start()
    assert next(unread, None) is None, "the policy stopped before reading every sample"
    return policy


def test_auto_uses_the_measured_load_and_pins_override_it(monkeypatch):
    # Others keep one core of four busy through every window: it is taken for the run.
    policy = policy_over(cumulative_samples([1.0] * threads.START_WINDOWS), monkeypatch)
    assert (policy.threads, torch.get_num_threads()) == (3, 3)
    assert policy.describe().startswith("threads: 3 (auto: 4 usable cores, other processes used 1.0")
    assert ThreadPolicy(2, environ={"OMP_NUM_THREADS": "1"}).describe().startswith("threads: 2 (pinned by --threads")
    assert ThreadPolicy("auto", environ={"OMP_NUM_THREADS": "1"}).threads == 1
    # A count past the usable cores is capped at them (4096 threads aborted inside libgomp under a memory limit),
    # and the line says so.
    capped = ThreadPolicy("auto", environ={"OMP_NUM_THREADS": "4096"})
    assert capped.threads == 4 and capped.describe().startswith(
        "threads: 4 (pinned by OMP_NUM_THREADS=4096, capped at the 4 usable cores;")
    assert ThreadPolicy("auto", environ={"OMP_NUM_THREADS": "4"}).describe().startswith(
        "threads: 4 (pinned by OMP_NUM_THREADS;")
    # Digits of another script are no count for libgomp (it ignores the variable): none here either.
    assert ThreadPolicy("auto", environ={"OMP_NUM_THREADS": "\u0661"}).pinned_by is None


def test_a_burst_at_start_takes_no_core_for_the_run(monkeypatch):
    # Others took two cores in the first window and none in the second: all four, and the look ends there.
    policy = policy_over(cumulative_samples([2.0, 0.1]), monkeypatch)
    assert (policy.threads, policy.others) == (4, pytest.approx(0.1))
    # A load that varies in every window: the quietest window decides.
    policy = policy_over(cumulative_samples([3.0, 1.6, 1.2, 2.5]), monkeypatch)
    assert (policy.threads, policy.others) == (3, pytest.approx(1.2))


def test_auto_uses_what_proc_told_before_it_stopped_telling(monkeypatch):
    # No counters at all: every core.
    assert policy_over([None], monkeypatch).threads == 4
    # The counters vanish after a busy window: that window's load stands.
    assert policy_over(cumulative_samples([2.0]) + [None], monkeypatch).threads == 2


def test_a_resumed_run_keeps_its_checkpoints_count_unless_one_is_pinned():
    policy = ThreadPolicy("auto", environ={})
    policy.keep_runs(1)
    assert (policy.threads, policy.pinned_by, torch.get_num_threads()) == (1, "the resumed run's checkpoint", 1)
    pinned = ThreadPolicy(3, environ={})
    pinned.keep_runs(1)
    assert pinned.threads == 3 and "the run had 1 before: its last bits may differ" in pinned.describe()


def test_openmp_spin_is_bounded_unless_the_user_chose_a_wait_policy():
    environ: dict[str, str] = {}
    bound_openmp_waits(environ)
    assert environ == {"GOMP_SPINCOUNT": str(threads.SPIN_COUNT)}
    for chosen in ({"GOMP_SPINCOUNT": "100000"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        environ = dict(chosen)
        bound_openmp_waits(environ)
        assert environ == chosen


def test_a_checkpoint_records_the_runs_thread_count_and_a_resume_takes_it_back(train_data, tmp_path, monkeypatch,
                                                                             capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    first = tmp_path / "run"
    run_in_process("pretrain", pretrain_argv(train_data, first, "--threads", "1"))
    checkpoint = first / CHECKPOINT_DIR / "step_00000003"
    assert json.loads((checkpoint / STATE_FILE).read_text())["threads"] == 1
    torch.set_num_threads(2)
    capsys.readouterr()
    run_in_process("pretrain", pretrain_argv(train_data, tmp_path / "resumed", "--resume", str(checkpoint),
                                             "--threads", "auto"))
    printed = capsys.readouterr()
    assert "threads: 1 (pinned by the resumed run's checkpoint" in printed.out + printed.err
    assert torch.get_num_threads() == 1
