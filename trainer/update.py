"""One optimizer update of a training step: the forward and backward passes over the step's micro-batches, the
loss and gradient checks, the clipped optimizer step and the diagnostics armed on it. trainer/core.py's
`Trainer.train_step` decides how many updates a step takes and when the schedule advances; this module is how one
update is done, the same for every objective."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator

from trainer.objectives import Objective
from trainer.step import StepResult, step_outcome

if TYPE_CHECKING:
    from trainer.diagnostics import NormDiagnostics


def token_counts(objective: Objective, batches: list[dict[str, torch.Tensor]],
                 accelerator: Accelerator) -> tuple[torch.Tensor, int]:
    """(the objective's units -- supervised targets, or preference pairs --, real input tokens) of one optimizer
    step over all processes: the loss's divisor and the step's throughput count (padding is not a token)."""
    supervised = sum(objective.count_items(b) for b in batches)
    real = sum(b["attention_mask"].sum() if "attention_mask" in b else b["input_ids"].numel() for b in batches)
    # One is a tensor on the batches' device, the other may be a Python int: both go to the device first.
    device = accelerator.device
    counts = torch.stack([torch.as_tensor(supervised, device=device), torch.as_tensor(real, device=device)])
    counts = accelerator.reduce(counts, reduction="sum")
    return counts[0], int(counts[1])


@dataclass
class GradientUpdate:
    """What one update works with, as the trainer holds it at the time of the update (a benchmark may swap the
    model and optimizer in after set-up). `diagnostics`: the armed-step diagnostics (trainer/diagnostics.py's
    NormDiagnostics), None without --diag_interval; `compiled`: whether the model was compiled (an armed step runs
    eagerly); `grad_clip`: --grad_clip (0: measured, not clipped)."""
    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    objective: Objective
    diagnostics: NormDiagnostics | None
    compiled: bool
    accumulation_steps: int
    grad_clip: float

    def apply(self, batches: list[dict[str, torch.Tensor]], num_items: torch.Tensor, real_tokens: int,
              arm_diagnostics: bool) -> StepResult:
        """One optimizer update over the step's micro-batches: their gradients, then the optimizer step, unless
        the group's loss diverged."""
        loss, stats = self._accumulate_gradients(batches, num_items, arm_diagnostics)
        if stats is None:
            return StepResult("diverged", loss, tokens=real_tokens)
        return self._optimizer_step(loss, stats, real_tokens, arm_diagnostics)

    def _accumulate_gradients(self, batches: list[dict[str, torch.Tensor]], num_items: torch.Tensor,
                              arm_diagnostics: bool) -> tuple[float, dict[str, float] | None]:
        """Forward and backward over the step's micro-batches: (the group's loss over all processes, the
        objective's statistics as means over the step's units, all processes), or (the loss, None) when it is not
        finite: then the last backward is not run and the gradients are dropped."""
        accelerator, model = self.accelerator, self.model
        # Each micro-batch's loss is its token sum over the whole group's supervised tokens (all processes):
        # after Accelerate's 1/accumulation and DDP's 1/world averaging, the gradient is the exact token mean.
        scale = self.accumulation_steps * accelerator.num_processes
        loss_sum = torch.zeros((), device=accelerator.device)
        stat_sums = torch.zeros(len(self.objective.stat_names), device=accelerator.device)
        # Hooks on a compiled module would make it recompile: the (rare) diagnostics step runs eagerly.
        stance = torch.compiler.set_stance("force_eager") if arm_diagnostics and self.compiled else nullcontext()
        with stance:
            for index, batch in enumerate(batches):
                last = index == len(batches) - 1
                if last and arm_diagnostics:
                    self.diagnostics.arm()
                with accelerator.accumulate(model):
                    micro_loss, micro_stats = self.objective.loss(model, batch, num_items)
                    loss_sum += micro_loss.detach().float()
                    stat_sums += micro_stats.float()
                    if last:
                        # The group's loss is known before its last backward, which DeepSpeed follows with the
                        # update: a non-finite loss stops the run before any update is applied, on every backend.
                        loss = float(accelerator.reduce(loss_sum, reduction="sum"))
                        if not math.isfinite(loss):
                            if arm_diagnostics:
                                self.diagnostics.disarm()
                            self.optimizer.zero_grad(set_to_none=True)
                            return loss, None
                    accelerator.backward(micro_loss * scale)
        stats: dict[str, float] = {}
        if self.objective.stat_names:  # means over the step's units, all processes
            stat_means = (accelerator.reduce(stat_sums, reduction="sum") / num_items).tolist()
            stats = dict(zip(self.objective.stat_names, stat_means))
        return loss, stats

    def _grad_norm(self, max_norm: float) -> float | None:
        norm = self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm)
        return None if norm is None else float(norm)  # None: DeepSpeed did not report one

    def _optimizer_step(self, loss: float, stats: dict[str, float], real_tokens: int,
                        arm_diagnostics: bool) -> StepResult:
        """The update from the accumulated gradients: clipped to --grad_clip (its norm measured), applied unless
        the gradient is not finite (or, under fp16, the scaler skips an overflow), with the armed diagnostics
        read before and after it; the gradients are dropped afterwards."""
        accelerator = self.accelerator
        scaler = accelerator.scaler  # fp16 only
        diagnostics: dict[str, float] = {}
        if arm_diagnostics:  # under fp16 the gradients are still scaled here
            diagnostics = self.diagnostics.after_backward(loss_scale=scaler.get_scale() if scaler is not None else 1.0)
        grad_norm = self._grad_norm(self.grad_clip if self.grad_clip > 0 else float("inf"))
        checked_norm = 0.0 if grad_norm is None else grad_norm
        if scaler is None:
            outcome = step_outcome(loss, checked_norm, scaler_skipped=None)
            if outcome == "applied":
                self.optimizer.step()
        else:
            # Always step: the scaler itself skips an update whose gradients overflowed and lowers its scale.
            self.optimizer.step()
            outcome = step_outcome(loss, checked_norm, scaler_skipped=accelerator.optimizer_step_was_skipped)
        if outcome == "applied" and arm_diagnostics:
            diagnostics.update(self.diagnostics.after_step())
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(outcome, loss, float("nan") if grad_norm is None else grad_norm, real_tokens, stats,
                          diagnostics)
