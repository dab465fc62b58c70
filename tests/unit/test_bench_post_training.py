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


def test_the_sft_rows_run_no_copy_rows_and_add_no_smeared_keys() -> None:
    # The fresh model has no smeared keys: an SFT run that leaves --smeared_keys unset adds them, and with them
    # copy rows beside every micro-batch, which LoRA and DPO never run; the sft rows would then not be the
    # conversations they are compared on.
    from trainer.arg_fields import resolve_copy_rows
    from trainer.args import parse_args

    files = {"sft": Path("sft.jsonl"), "sft x2": Path("sft_x2.jsonl"), "dpo": Path("dpo.jsonl")}
    sft_runs = [(name, extra) for name, task, _, _, extra in bench_post_training.configurations(files, 4, 8)
                if task == "sft"]
    assert [name for name, _ in sft_runs] == ["sft", "sft x2"]
    for name, extra in sft_runs:
        args = parse_args("sft", ["--from_weight", "model", "--data_path", "sft.jsonl", *extra])
        adds_smeared_keys = args.model.get("smeared_keys", True)  # SFT's default: true
        assert adds_smeared_keys is False, name
        assert resolve_copy_rows(args, ["smeared_keys"] if adds_smeared_keys else []) == 0, name
