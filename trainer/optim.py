"""AdamW with weight decay on matrices only: norms' gains and biases, and embeddings, are not decayed."""

from __future__ import annotations

import torch
from torch import nn


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():  # parameters() yields a tied weight once
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (decay if param.ndim >= 2 and id(param) not in embeddings else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, learning_rate: float, weight_decay: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(decay_groups(model, weight_decay), lr=learning_rate, betas=(0.9, 0.95), eps=1e-8)
