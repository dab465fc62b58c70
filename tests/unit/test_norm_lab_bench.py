"""The norm laboratory's speed table (eval/benchmarks/rmsnorm/lab.py) times the trainer's own step."""

from __future__ import annotations

import pytest
import torch

from eval.benchmarks.rmsnorm import lab
from trainer.run_optimizer import make_optimizer
from trainer.optim import MuonWithAdamW


@pytest.mark.parametrize("resolved", ["float32", "bfloat16"])
def test_the_labs_step_resolves_the_dtype_and_builds_the_trainers_optimizer(monkeypatch, resolved: str) -> None:
    """Where `--dtype auto` means fp32 the trainer orthogonalizes Muon's updates in fp32 (bf16 products are emulated
    there, several times slower); the lab's step must too, or its step times are not the trainer's."""
    monkeypatch.setattr(lab, "resolve_dtype", lambda dtype: resolved)
    run = lab.default_run()
    assert run.dtype == resolved
    variant = lab.build_variant("rmsnorm", run, vocab_size=512)
    trainers = make_optimizer(variant.model, run, torch.device("cpu"))
    assert isinstance(variant.optimizer, MuonWithAdamW) and isinstance(trainers, MuonWithAdamW)
    assert variant.optimizer.orthogonalize_in_fp32 is (resolved == "float32") is trainers.orthogonalize_in_fp32
    assert [group["lr"] for group in variant.optimizer.param_groups] == [g["lr"] for g in trainers.param_groups]
