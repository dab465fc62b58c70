"""The GPU tools run where they can without a GPU: bench_norm's --check under the Triton interpreter (the same code
that checks the kernels on CUDA, chunked reference included) and the GPU plan's bookkeeping (a stage that fails
does not stop the plan, and every stage leaves its file and a summary line)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO



def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **env})


def test_bench_norm_check_runs_under_the_interpreter() -> None:
    done = _run([sys.executable, "eval/benchmarks/bench_norm.py", "--device", "cpu", "--check", "--m", "33",
                 "--n", "96", "200", "--dtype", "fp32", "--no-big"], TRITON_INTERPRET="1")
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 33 |")]
    assert len(rows) == 2 * 2 * 2 and all(line.endswith("| PASS |") for line in rows)  # n x p x residual
    assert done.stdout.rstrip().endswith("ALL PASS")


def test_bench_norm_gpu_modes_refuse_the_cpu(capsys) -> None:
    """In-process (each subprocess would spend seconds importing torch); the command's own exit 2 is checked
    through the plan's sweep stage below."""
    from eval.benchmarks.bench_norm import main

    for flag in (["--sweep"], ["--profile_once", "512"], ["--profile_host", "512"], ["--check_model"]):
        with pytest.raises(SystemExit) as exited:
            main(["--device", "cpu", *flag])
        assert exited.value.code == 2 and "need a CUDA device" in capsys.readouterr().err, flag


def test_gpu_plan_goes_on_past_a_failed_stage(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    # "sweep" fails here (no CUDA), "nonsense" is no stage; "env" runs last and must still run.
    done = _run(["bash", "eval/benchmarks/gpu_plan.sh", str(out), "sweep", "nonsense", "env"],
                PYTHON=sys.executable, LIMIT_SWEEP="60", LIMIT_ENV="60")
    assert done.returncode == 0, done.stderr
    assert "unknown stage 'nonsense'" in done.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == ["sweep", "env"]
    stage_files = [out / line.rsplit("-> ", 1)[1] for line in summary]  # each line names the stage's own file
    assert summary[0].startswith("sweep: exit 2") and "need a CUDA device" in stage_files[0].read_text()
    assert stage_files[1].name == "env.txt" and stage_files[1].exists()
