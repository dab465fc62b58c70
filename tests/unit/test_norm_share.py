"""eval/studies/norm_share.py: every norm module is marked, both ways, and the profiled time inside the norms is a
real, positive part of the step; a model without norms is refused."""

from __future__ import annotations

import argparse

import pytest
import torch

from eval.studies.norm_share import Variant, build, mark_norms, profiled_steps
from model import MiniNormConfig, MiniNormForCausalLM

TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, norm_impl="eager")


@pytest.mark.parametrize("placement, norms", [("pre", 2 * 2 + 1), ("sandwich", 4 * 2 + 1)])
def test_every_norm_is_marked_and_its_time_is_part_of_the_step(placement, norms):
    torch.manual_seed(0)
    model = MiniNormForCausalLM(MiniNormConfig(**TINY, norm_placement=placement)).train()
    assert mark_norms(model) == norms  # the blocks' norms and the final norm
    variant = Variant("rmsnorm", model, torch.optim.AdamW(model.parameters()), torch.float32, [], [])
    batches = iter([torch.randint(0, 64, (2, 16)) for _ in range(2)])
    forward, backward, step = profiled_steps(variant, batches, 2)
    assert forward > 0 and backward > 0 and forward + backward < step


def test_a_model_without_norms_is_refused():
    args = argparse.Namespace(prms_p=0.0625)
    with pytest.raises(ValueError, match="no norm modules"):
        build("none", "pre", args)


@pytest.mark.parametrize("flag", ["--rounds", "--steps", "--profile_steps", "--warmup"])
def test_huge_counts_are_one_line_before_the_models(monkeypatch, capsys, flag):
    """--rounds 10**30 (or as many steps of a kind per round) ran until killed: each count is at most MAX_COUNT,
    refused by argparse naming the flag and the bound, before any variant is built."""
    from eval.studies import norm_share

    monkeypatch.setattr(norm_share, "build", lambda *args: pytest.fail("a variant was built"))
    with pytest.raises(SystemExit) as exit_info:
        norm_share.main(["--norms", "rmsnorm", flag, str(10**30)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag}: {10**30} is not an integer in " in err and f" .. {norm_share.MAX_COUNT}" in err, err


@pytest.mark.parametrize("flag", ["--seq_len", "--batch_size"])
def test_huge_sizes_are_one_line(capsys, flag):
    """A --seq_len or --batch_size of 10**30 was torch.randint's 'Overflow when unpacking long long' traceback (with
    the C++ frames): now bounded by the model's size bound (model/config.py's MAX_SIZE), refused naming the flag."""
    from eval.studies.norm_share import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--norms", "rmsnorm", flag, str(10**30)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag}: " in err and "2147483647" in err and "Traceback" not in err, err
