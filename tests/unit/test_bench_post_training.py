"""eval/benchmarks/bench_post_training.py: a configuration whose trainer refuses its input ends the benchmark in
that one line, not in a RuntimeError traceback around the trainer's whole stderr."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from eval.benchmarks import bench_post_training

TRAINER_STDERR = ("tokenizing conversations: 100%|##########| 9/9\n"
                  "error: /tmp/x/sft.jsonl: no conversation has a supervised token within max_seq_len=16\n"
                  "train_sft.py: run with --help for the flags\n")


def fake_child(returncode: int, stderr: str, stdout: str = ""):
    def fake_run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(command, returncode, stdout=stdout, stderr=stderr)
    return fake_run


def test_a_refused_configuration_is_the_trainers_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_post_training.subprocess, "run", fake_child(2, TRAINER_STDERR))
    with pytest.raises(SystemExit) as stopped:
        bench_post_training.run("sft", "sft", [], Path("model"))
    assert str(stopped.value.code) == ("error: the sft run: /tmp/x/sft.jsonl: no conversation has a supervised "
                                       "token within max_seq_len=16")


def test_a_crash_still_shows_the_childs_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_post_training.subprocess, "run", fake_child(1, "Traceback ...\nValueError: boom\n"))
    with pytest.raises(RuntimeError, match="dpo failed \\(1\\): Traceback ...\nValueError: boom"):
        bench_post_training.run("dpo", "dpo", [], Path("model"))


def test_a_finished_run_gives_its_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_post_training.subprocess, "run", fake_child(0, "", stdout="done\nPEAK 1048576\n"))
    assert bench_post_training.run("lora", "lora", [], Path("model")) == {"name": "lora", "peak_bytes": 1048576}


def test_an_exit_2_without_an_error_line_still_shows_the_childs_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    # argparse's own usage error exits 2 with 'PROG: error: ...', not a line starting 'error: ': nothing to quote
    usage = "usage: train_sft.py [-h] ...\ntrain_sft.py: error: unrecognized arguments: --bogus\n"
    monkeypatch.setattr(bench_post_training.subprocess, "run", fake_child(2, usage))
    with pytest.raises(RuntimeError, match="sft failed \\(2\\): usage: train_sft.py"):
        bench_post_training.run("sft", "sft", [], Path("model"))
