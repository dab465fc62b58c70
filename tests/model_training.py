"""A model-level check shared by the model tests: a model fits a small batch with plain AdamW."""

from __future__ import annotations

import math

import torch


def assert_fits_batch(model: torch.nn.Module, ids: torch.Tensor, steps: int = 25, ratio: float = 0.5) -> None:
    """`steps` AdamW steps (lr 1e-2) on `ids` as inputs and labels: every parameter gets a gradient on the first
    step, every loss is finite, and the last is below `ratio` times the first."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for step in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        if step == 0:  # every parameter (every norm gain, DyT's alpha) takes part in the forward pass
            unused = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
            assert not unused
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < ratio * losses[0], losses
