"""The norm laboratory's switches (issue 27) train end to end from `python trainer/train_pretrain.py`: two tiny runs
cover every new flag (one: DyT without affine parameters, DeepNorm, LayerNorm Scaling, full-width QK-norm, a DyT
alpha init, the norm diagnostics; the other: Mix-LN with its ratio, parameter-free LayerNorm, no init depth
scaling), each finishing with a falling loss and saving a model that loads back with those switches."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from model.model import MiniNormForCausalLM
from tests.paths import REPO
from tests.training_runs import pretrain_from_the_command_line
from trainer.run_dir import read_metrics

RUNS = {
    "dyt-deepnorm": (["--norm_type", "dyt", "--norm_affine", "false", "--dyt_alpha_init", "0.8", "--norm_placement",
                      "deepnorm", "--norm_depth_scaling", "--qk_norm", "--qk_norm_scope", "full",
                      "--diag_interval", "4"],
                     dict(norm_type="dyt", norm_affine=False, dyt_alpha_init=0.8, norm_placement="deepnorm",
                          norm_depth_scaling=True, qk_norm=True, qk_norm_scope="full")),
    # no init depth scaling here: DeepNorm's beta gain replaces it (a flag that run would not use, refused)
    "mix-layernorm": (["--norm_type", "layernorm", "--norm_affine", "false", "--norm_placement", "mix",
                       "--mix_ln_ratio", "0.5", "--init_depth_scaling", "false"],
                      dict(norm_type="layernorm", norm_affine=False, norm_placement="mix", mix_ln_ratio=0.5,
                           init_depth_scaling=False)),
}


@pytest.mark.parametrize("name", RUNS)
def test_new_switches_train_from_the_command_line(name: str, train_data, tmp_path) -> None:
    flags, expected = RUNS[name]
    out_dir = tmp_path / name
    saved = pretrain_from_the_command_line(train_data, out_dir, *flags)
    assert {key: saved[key] for key in expected} == expected
    model = MiniNormForCausalLM.from_pretrained(out_dir)
    assert all(getattr(model.config, key) == value for key, value in expected.items())
    if name == "dyt-deepnorm":  # the diagnostics ran on the new variant
        metrics = (out_dir / "metrics.jsonl").read_text()
        assert "diag/attn_out_norm_out_rms/layer_00" in metrics and "diag/final_norm" not in metrics
        # the first step, every 4 after it, and the last: the state the run ends in (it was left out)
        assert [record["step"] for record in read_metrics(out_dir, "diag")] == [1, 5, 8]


def test_bench_norm_lab_prints_one_interleaved_table(tmp_path) -> None:
    """`bench_norm.py --lab` with the smallest counts: one row per variant in the order asked, the first the
    reference (ratio 1), the raw per-round medians in --out. (A smoke test: no timing is asserted.)"""
    out = tmp_path / "lab.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "eval/benchmarks/bench_norm.py", "--device", "cpu", "--lab", "--threads",
                          "1", "--rounds", "2", "--norm_repeats", "2", "--lab_steps", "1", "--lab_warmup", "1",
                          "--lab_norms", "rmsnorm", "dyt-free", "layernorm-free", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and not line.startswith("| norm |")]
    assert [row.split(" | ")[0] for row in rows] == ["| rmsnorm", "| dyt-free", "| layernorm-free"]
    assert rows[0].split(" | ")[2] == "1.00" and rows[0].rstrip(" |").endswith("1.000")
    assert "cpu-wide model, batch 8 x 256" in run.stdout and "interleaved rounds" in run.stdout
    saved = json.loads(out.read_text())
    assert [row["norm"] for row in saved["rows"]] == ["rmsnorm", "dyt-free", "layernorm-free"]
    assert all(len(row["norm_ms"]) == len(row["step_ms"]) == 2 for row in saved["rows"])
