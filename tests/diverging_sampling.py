"""A rollout run in which one process's sampling meets NaN logits and the others' does not, for
tests/integration/test_grpo_runs.py. Run as a script (`torchrun ... tests/diverging_sampling.py TASK RANK CALL
<trainer/train_TASK.py flags>`, TASK grpo, ppo or distill) it trains as that trainer does, except that on process
RANK, from its CALL-th sampling on (a step's rollouts and a validation's greedy completions each count one), the
policy's output layer returns NaN logits while it samples: the engine's check of its scores meets them as it meets a
diverged model's, on that process alone."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script by the launcher

import torch  # noqa: E402

import trainer.distillation as distillation  # noqa: E402
import trainer.grpo as grpo  # noqa: E402


def nan_logits_from(call: int) -> Callable:
    """trainer/grpo.py's sample_completions, with the policy's logits NaN from its `call`-th call on (the hook
    is removed after each call: the weights and the training forwards stay as they were)."""
    sample_completions = grpo.sample_completions
    calls = 0

    def sample_with_nan_logits(model: torch.nn.Module, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls < call:
            return sample_completions(model, *args, **kwargs)
        output = getattr(model, "module", model).get_output_embeddings()
        hook = output.register_forward_hook(lambda module, inputs, logits: torch.full_like(logits, float("nan")))
        try:
            return sample_completions(model, *args, **kwargs)
        finally:
            hook.remove()

    return sample_with_nan_logits


if __name__ == "__main__":
    from trainer.cli import run_main
    from trainer.command import command_line

    task, rank, call = sys.argv.pop(1), int(sys.argv.pop(1)), int(sys.argv.pop(1))
    if int(os.environ["RANK"]) == rank:
        grpo.sample_completions = distillation.sample_completions = nan_logits_from(call)
    run_main(lambda: command_line(task))
