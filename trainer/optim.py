"""The optimizers: AdamW alone, or Muon for the hidden weight matrices with AdamW for the rest.

AdamW decays matrices only: norms' gains and biases, and embeddings, are not decayed. With `--optimizer muon`,
torch's `torch.optim.Muon` updates the 2-D weight matrices inside the decoder blocks (attention and MLP
projections) with the Newton-Schulz-orthogonalized momentum, and AdamW updates everything else: the token
embedding, the LM head (tied to it or not), norms and biases, each side with its own learning rate. Both live in
one optimizer object (`MuonWithAdamW`) whose param groups say which rule updates them, so Accelerate's prepare,
the LR scheduler, gradient clipping and checkpoints (save_state / load_state) see a single ordinary optimizer.

Muon's step is torch's arithmetic (`torch.optim.Muon` holds the groups, defaults and state; `muon_step` updates
them) with one change of schedule: the Newton-Schulz iteration runs once per *shape*, the matrices of that shape
stacked into batched products (`orthogonalize`), instead of once per matrix. torch loops over the matrices (it has
no foreach path for Muon): 15 small products and copies per matrix per step, each a parallel region whose threads
meet at a barrier -- the regions that slow most when another process shares the cores (docs/benchmarks.md, "A busy
machine"). Batched, the cpu-wide model's 14 matrices take 3 iterations instead of 14; the results are the same
products on the same numbers (tests/unit/test_optim.py compares the step with torch's).

torch's Muon orthogonalizes in bf16. On a CPU without AVX512-BF16 or AMX a bf16 matrix product is emulated
(~30-200x slower than fp32), so a run that trains in fp32 on a CPU (what `--dtype auto` picks there) orthogonalizes
in fp32 instead (`orthogonalize_in_fp32`): the same quintic iteration in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Any

import torch
from torch import nn
from torch.optim._muon import _adjust_lr  # Muon's shape factor for the learning rate, as torch's step applies it

ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8


def adamw(params: list[dict[str, Any]] | list[nn.Parameter], lr: float) -> torch.optim.AdamW:
    """torch's AdamW with our betas and eps, fused: one kernel per parameter instead of about ten elementwise
    operations (on the default CPU run 2.5-4x faster for the same update to ~1e-8, and fewer parallel regions)."""
    return torch.optim.AdamW(params, lr=lr, betas=ADAMW_BETAS, eps=ADAMW_EPS, fused=True)


class OptimizerName(StrEnum):
    ADAMW = "adamw"
    MUON = "muon"


class MuonAdjustLR(StrEnum):
    """torch's Muon `adjust_lr_fn`: how the learning rate scales with a matrix's shape (A, B).
    original: lr * sqrt(max(1, A / B)) (Keller Jordan's Muon; lr about 0.02);
    match_rms_adamw: lr * 0.2 * sqrt(max(A, B)) (Moonshot's; the update's RMS matches AdamW's, so AdamW's learning
    rate and weight decay carry over)."""
    ORIGINAL = "original"
    MATCH_RMS_ADAMW = "match_rms_adamw"


def _output_and_embedding_weights(model: nn.Module) -> set[int]:
    """ids of every embedding's weight and of the LM head's weight (the same tensor when they are tied)."""
    ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        ids.add(id(head.weight))
    return ids


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]  # parameters() yields a tied weight once


def decay_groups(model: nn.Module, weight_decay: float, params: list[nn.Parameter] | None = None) -> list[dict]:
    """AdamW's two groups over `params` (default: all trainable ones): matrices decayed, embeddings and 1-D
    tensors not."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in _trainable(model) if params is None else params:
        (decay if param.ndim >= 2 and id(param) not in embeddings else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's parameters, AdamW's parameters). Muon takes the 2-D hidden weight matrices only; the embedding and
    the LM head are 2-D too but map tokens, not hidden features, so they stay with AdamW, as do norms and biases."""
    excluded = _output_and_embedding_weights(model)
    muon, adamw = [], []
    for param in _trainable(model):
        (muon if param.ndim == 2 and id(param) not in excluded else adamw).append(param)
    return muon, adamw


def orthogonalize(matrices: list[torch.Tensor], ns_coefficients: tuple[float, float, float], ns_steps: int,
                  eps: float, dtype: torch.dtype = torch.bfloat16,
                  out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Muon's Newton-Schulz orthogonalization of each matrix, as torch.optim.Muon computes it (in `dtype`: X = M /
    ||M||_F in the wide orientation, then `ns_steps` times X <- a X + (b A + c A^2) X with A = X X^T), the
    matrices of one wide-orientation shape stacked into one batched product per operation. `out_dtype`: the results
    cast to it, one cast per shape (what the parameters' update would do to each matrix on its own)."""
    a, b, c = ns_coefficients
    by_shape: dict[tuple[int, int], list[tuple[int, bool]]] = {}
    for index, matrix in enumerate(matrices):
        tall = matrix.size(0) > matrix.size(1)
        wide_shape = (matrix.size(1), matrix.size(0)) if tall else (matrix.size(0), matrix.size(1))
        by_shape.setdefault(wide_shape, []).append((index, tall))
    out: list[torch.Tensor] = [matrices[0]] * len(matrices)
    for members in by_shape.values():
        x = torch.stack([matrices[i].to(dtype).T if tall else matrices[i].to(dtype) for i, tall in members])
        x = x / torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp(min=eps)
        for _ in range(ns_steps):
            gram = torch.bmm(x, x.mT)
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        if out_dtype is not None:
            x = x.to(out_dtype)
        for (index, tall), result in zip(members, x.unbind(0)):
            out[index] = result.T if tall else result
    return out


@torch.no_grad()
def muon_step(muon: torch.optim.Muon, dtype: torch.dtype = torch.bfloat16) -> None:
    """torch.optim.Muon's step on its own groups and state, orthogonalizing with `orthogonalize` (batched by
    shape, in `dtype`): per matrix, B <- B.lerp(g, 1 - mu); U = g.lerp(B, mu) (Nesterov) or B; W <- W (1 - lr wd);
    W <- W - lr' NS(U), with lr' torch's shape-adjusted rate."""
    for group in muon.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        momentum, lr = group["momentum"], float(group["lr"])
        updates = []
        for param in params:
            state = muon.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
            buffer = state["momentum_buffer"]
            buffer.lerp_(param.grad, 1 - momentum)
            updates.append(param.grad.lerp(buffer, momentum) if group["nesterov"] else buffer)
        dtypes = {param.dtype for param in params}
        orthogonalized = orthogonalize(updates, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype,
                                       out_dtype=dtypes.pop() if len(dtypes) == 1 else None)
        for param, update in zip(params, orthogonalized):
            param.mul_(1 - lr * group["weight_decay"])
            param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer with two update rules: each param group carries `"update": "muon"` or `"adamw"` and its own
    hyperparameters (lr included). `step()` hands each rule's groups to a torch.optim.AdamW or Muon (the latter
    stepped by `muon_step`) that shares this optimizer's state, so the scheduler (which scales every group's lr),
    clipping and state_dict / load_state_dict work on this object as on any torch optimizer."""

    def __init__(self, muon_params: list[nn.Parameter], adamw_groups: list[dict[str, Any]], *, muon_lr: float,
                 muon_weight_decay: float, muon_momentum: float, muon_adjust_lr: str, adamw_lr: float,
                 orthogonalize_in_fp32: bool = False) -> None:
        rules: dict[str, torch.optim.Optimizer] = {  # AdamW's groups first: group 0's lr is --learning_rate's
            "adamw": adamw(adamw_groups, adamw_lr),
            "muon": torch.optim.Muon(muon_params, lr=muon_lr, weight_decay=muon_weight_decay, momentum=muon_momentum,
                                     nesterov=True, adjust_lr_fn=muon_adjust_lr),
        }
        groups = []
        for rule, inner in rules.items():  # each inner optimizer has filled its groups with its defaults
            for group in inner.param_groups:
                group["update"] = rule
                groups.append(group)
        super().__init__(groups, defaults={})
        self._rules = rules
        self.orthogonalize_in_fp32 = orthogonalize_in_fp32

    def _sync_rules(self) -> None:
        # load_state_dict replaces the group dicts and the state: hand the current ones to the inner optimizers.
        for rule, inner in self._rules.items():
            inner.param_groups = [g for g in self.param_groups if g["update"] == rule]
            inner.state = self.state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_rules()
        self._rules["adamw"].step()
        muon_step(self._rules["muon"], torch.float32 if self.orthogonalize_in_fp32 else torch.bfloat16)
        return loss


def scheduled_lrs(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The current peak-scaled learning rates to log: `lr` (AdamW's, group 0) and, with Muon, `muon_lr`."""
    lrs = {"lr": optimizer.param_groups[0]["lr"]}
    muon = next((g for g in optimizer.param_groups if g.get("update") == "muon"), None)
    if muon is not None:
        lrs["muon_lr"] = muon["lr"]
    return lrs


def build_optimizer(model: nn.Module, learning_rate: float, weight_decay: float, optimizer: str, *, muon_lr: float,
                    muon_weight_decay: float, muon_momentum: float, muon_adjust_lr: str,
                    orthogonalize_in_fp32: bool = False) -> torch.optim.Optimizer:
    """The run's optimizer. `learning_rate` and `weight_decay` are AdamW's; the muon_* values are Muon's (no
    defaults here: the trainer's flags own them, trainer/arg_fields.py); `orthogonalize_in_fp32`: Muon's Newton-Schulz
    iteration in fp32 rather than torch's bf16."""
    if OptimizerName(optimizer) is OptimizerName.ADAMW:
        return adamw(decay_groups(model, weight_decay), learning_rate)
    muon_params, adamw_params = muon_split(model)
    if not muon_params:
        raise ValueError("--optimizer muon: the model has no 2-D hidden weight matrices for Muon")
    # AdamW's side keeps its decay rule: an untied LM head is decayed, embeddings, norms and biases are not.
    adamw_groups = [g for g in decay_groups(model, weight_decay, adamw_params) if g["params"]]
    return MuonWithAdamW(muon_params, adamw_groups, muon_lr=muon_lr, muon_weight_decay=muon_weight_decay,
                         muon_momentum=muon_momentum, muon_adjust_lr=MuonAdjustLR(muon_adjust_lr).value,
                         adamw_lr=learning_rate, orthogonalize_in_fp32=orthogonalize_in_fp32)
