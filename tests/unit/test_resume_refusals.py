"""check_resume_compatible (trainer/checkpoint.py) for the post-training flags: a GRPO/PPO checkpoint trained with
--lora cannot be resumed without it (nor one without it with it), and a distillation cannot change its teacher; each
refusal is one line naming the flag with both values."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.args import parse_args
from trainer.checkpoint import check_resume_compatible

CHECKPOINT = Path("/runs/x/checkpoints/step_00000002")


def _state(**config) -> dict:
    return {"config": config}


@pytest.mark.parametrize("task", ["grpo", "ppo"])
def test_a_lora_policy_resumes_only_as_lora(task):
    check_resume_compatible(CHECKPOINT, _state(lora=True, lora_rank=8), parse_args(task, ["--lora"]), {})
    with pytest.raises(ValueError) as refused:
        check_resume_compatible(CHECKPOINT, _state(lora=True, lora_rank=8), parse_args(task, []), {})
    assert str(refused.value) == ("--resume step_00000002: --lora was True there and is False now; the saved "
                                  "adapters have that shape (resume with --lora True, or start a new run)")
    with pytest.raises(ValueError, match="--lora was False there and is True now"):
        check_resume_compatible(CHECKPOINT, _state(lora=False), parse_args(task, ["--lora"]), {})
    with pytest.raises(ValueError, match="--lora_rank was 8 there and is 4 now"):
        check_resume_compatible(CHECKPOINT, _state(lora=True, lora_rank=8),
                                parse_args(task, ["--lora", "--lora_rank", "4"]), {})


def test_a_distillation_keeps_its_teacher(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    args = parse_args("distill", ["--teacher", str(tmp_path / "a")])
    check_resume_compatible(CHECKPOINT, _state(teacher=str(tmp_path / "a")), args, {})
    check_resume_compatible(CHECKPOINT, _state(), args, {})  # a checkpoint that did not record it
    with pytest.raises(ValueError) as refused:
        check_resume_compatible(CHECKPOINT, _state(teacher=str(tmp_path / "b")), args, {})
    assert str(refused.value) == (f"--resume step_00000002: --teacher was {tmp_path / 'b'} there and is "
                                  f"{tmp_path / 'a'} now; a run distils from one teacher (resume with --teacher "
                                  f"{tmp_path / 'b'}, or start a new run)")
