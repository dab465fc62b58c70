"""Normalization diagnostics: what each norm does to activations and gradients, gathered during training.

Usage in a training loop (the model is the unwrapped MiniNormForCausalLM):

    diag = NormDiagnostics(model)                # registers nothing
    if step % diag_interval == 0:
        diag.arm()                               # hooks for the NEXT forward/backward only + weight snapshot
    loss = model(...).loss; accelerator.backward(loss)
    if diag.armed:
        stats = diag.after_backward()            # removes the hooks; activation RMS, grad norms (pre-clip)
    clip; optimizer.step()
    stats.update(diag.after_step())              # update-to-weight ratio per layer

With gradient accumulation, arm() before the forward of the LAST micro-step of an optimizer step and call
after_backward() after its backward: activation statistics then come from that one micro-batch, while the
gradient norms read `.grad`, i.e. the gradient accumulated over all micro-steps -- the one clipping sees.
With fp16 loss scaling the gradients are still scaled at that point: pass the scaler's current scale as
`after_backward(loss_scale=...)`; bf16 and fp32 need nothing. Under DDP, activation statistics are this
rank's; gradients are already all-reduced (under FSDP2 the norms of sharded gradients and weights are gathered
into whole-tensor values). resid_grad_rms is the gradient of the loss as backpropagated,
i.e. including any 1/accumulation or loss-scale factor the trainer multiplies the loss by.

When not armed, no hook is registered anywhere: the model runs exactly as without this module.

Keys (flat, wandb-friendly; `XX` is the zero-padded layer index):
    diag/resid_rms/layer_XX            RMS of the residual stream leaving block XX
    diag/resid_grad_rms/layer_XX       RMS of dLoss/d(residual stream) leaving block XX
    diag/{attn_norm,mlp_norm,attn_out_norm,mlp_out_norm}_{in,out}_rms/layer_XX
                                       RMS of each norm's input and output (only the norms the placement has)
    diag/final_norm_{in,out}_rms       the final norm before the LM head (absent where the model has none: post-LN,
                                       DeepNorm, Mix-LN with mix_ln_ratio 1)
    diag/attn_logit_max/layer_XX       the largest attention logit q.k/sqrt(head_dim) (after RoPE and QK-norm,
                                       before the softmax) over the keys each query may attend to (a padded
                                       batch's padding queries included; packed pretraining rows have none)
    diag/logits_rms, diag/logits_max   RMS and largest value of the output logits (the LM head's output)
    diag/grad_norm/layer_XX            L2 norm of the gradient of all of block XX's parameters
    diag/grad_norm_attn/layer_XX       ... of its attention parameters only
    diag/grad_norm_mlp/layer_XX        ... of its MLP parameters only
    diag/grad_norm_global              L2 norm of the whole model's gradient, before clipping
    diag/update_ratio/layer_XX         ||W_after - W_before|| / ||W_before|| over block XX's 2-D weights
    diag/update_ratio_global           the same over all blocks' 2-D weights
RMS is sqrt(mean(t^2)) over every element of the tensor (all tokens and features), computed in fp32.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from trainer.run_dir import CONFIG_FILE, is_count, read_metrics, record_number, record_where, recorded_config

PREFIX = "diag"
NORM_NAMES = ("attn_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm")
_LAYER_KEY = re.compile(rf"^{PREFIX}/(?P<quantity>[^/]+)/layer_(?P<layer>\d+)$")


def rms(t: torch.Tensor) -> torch.Tensor:
    """sqrt(mean(t^2)) over all elements as a 0-d fp32 tensor, without materialising an fp32 copy of t."""
    return torch.linalg.vector_norm(t.detach(), dtype=torch.float32) / math.sqrt(max(t.numel(), 1))


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A norm of a sharded (FSDP2, DTensor) parameter or gradient as the whole tensor's value (a collective: every
    process computes the same statistics in the same order); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


class NormDiagnostics:
    """Per-layer activation, gradient and update statistics of a MiniNormForCausalLM (see module docstring)."""

    def __init__(self, model: nn.Module, prefix: str = PREFIX) -> None:
        self.model = model
        self.prefix = prefix
        self.layers: list[nn.Module] = list(model.model.layers)
        self.width = max(2, len(str(len(self.layers) - 1)))
        final = model.model.norm
        # Post-LN (DeepNorm, all-post Mix-LN) has no final norm: the trunk ends in nn.Identity (NoNorm, the "none"
        # ablation, subclasses it). Every norm type (DyT included) is watched by its forward, whatever it computes.
        self.final_norm: nn.Module | None = None if type(final) is nn.Identity else final
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._patched: list[nn.Module] = []
        self._values: dict[str, torch.Tensor] = {}
        self._snapshot: list[list[tuple[nn.Parameter, torch.Tensor]]] | None = None
        self._forwards = 0
        self.armed = False

    # ----------------------------------------------------------------------------------------------- keys
    def key(self, quantity: str, layer: int | None = None) -> str:
        if layer is None:
            return f"{self.prefix}/{quantity}"
        return f"{self.prefix}/{quantity}/layer_{layer:0{self.width}d}"

    # ------------------------------------------------------------------------------------------- arming
    def arm(self) -> None:
        """Attach hooks for the next forward/backward and snapshot the blocks' 2-D weights."""
        self.disarm()
        self._values = {}
        # Only the armed micro-batch's first forward is observed: an objective that runs the model again on other
        # rows (the copy rows beside pretraining) must not overwrite the statistics of the batch itself.
        self._forwards = 0
        self._handles.append(self.model.model.register_forward_pre_hook(self._count_forward))
        for i, block in enumerate(self.layers):
            self._handles.append(block.register_forward_hook(self._block_hook(i)))
            for name in NORM_NAMES:
                norm = getattr(block, name, None)
                if norm is not None:
                    self._watch_norm(norm, self.key(f"{name}_in_rms", i), self.key(f"{name}_out_rms", i))
        if self.final_norm is not None:
            self._watch_norm(self.final_norm, self.key("final_norm_in_rms"), self.key("final_norm_out_rms"))
        for i, block in enumerate(self.layers):
            block.self_attn.logit_observer = self._logit_observer(self.key("attn_logit_max", i))
            self._patched.append(block.self_attn)
        self._handles.append(self.model.lm_head.register_forward_hook(self._logits_hook))
        with torch.no_grad():
            self._snapshot = [[(p, p.detach().clone()) for p in block.parameters() if p.ndim == 2]
                              for block in self.layers]
        self.armed = True

    def disarm(self) -> None:
        """Remove every hook and patch this object added (idempotent). The weight snapshot is kept."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in self._patched:
            module.__dict__.pop("add_and_norm", None)
            module.__dict__.pop("logit_observer", None)
        self._patched.clear()
        self.armed = False

    def _record(self, key: str, t: torch.Tensor) -> None:
        self._values[key] = rms(t)

    def _count_forward(self, module: nn.Module, args: Any) -> None:
        self._forwards += 1

    def _observing(self) -> bool:
        """Whether the forward running now is the armed micro-batch's first."""
        return self._forwards == 1

    def _logit_observer(self, key: str) -> Callable:
        @torch.no_grad()
        def observe(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> None:
            if not self._observing():
                return
            if k.shape[1] != q.shape[1]:  # grouped-query attention: each key head serves several query heads
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            logits = q.float() @ k.float().transpose(-1, -2) * q.shape[-1] ** -0.5
            if mask is None:  # plain causal: query i (the last q_len of kv_len positions) sees keys up to itself
                q_len, kv_len = logits.shape[-2:]
                mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
            self._values[key] = logits.masked_fill(~mask, float("-inf")).amax()
        return observe

    def _logits_hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if not self._observing():
            return
        self._values[self.key("logits_rms")] = rms(output)
        self._values[self.key("logits_max")] = output.detach().float().amax()

    def _block_hook(self, layer: int) -> Callable:
        resid_key, grad_key = self.key("resid_rms", layer), self.key("resid_grad_rms", layer)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            out = _first_tensor(output)
            if out is None or not self._observing():
                return
            self._record(resid_key, out)
            if out.requires_grad:
                # A tensor hook lives and dies with this forward's graph: nothing to remove afterwards.
                out.register_hook(lambda grad: self._record(grad_key, grad))
        return hook

    def _watch_norm(self, norm: nn.Module, in_key: str, out_key: str) -> None:
        inside_fused = [False]

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if inside_fused[0] or not self._observing():
                return  # add_and_norm's wrapper below records this call
            x, y = _first_tensor(args), _first_tensor(output)
            if x is not None and y is not None:
                self._record(in_key, x)
                self._record(out_key, y)
        self._handles.append(norm.register_forward_hook(hook))

        # Pre-LN runs the MLP's norm through `add_and_norm(x, residual)`, which the fused Triton kernel and
        # NoNorm compute without calling forward(), so no forward hook would fire. An instance attribute
        # shadows the method while armed; disarm() deletes it again.
        method = getattr(type(norm), "add_and_norm", None)
        if method is None:
            return

        def add_and_norm(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            inside_fused[0] = True
            try:
                normed, summed = method(norm, x, residual)
            finally:
                inside_fused[0] = False
            if self._observing():
                self._record(in_key, summed)
                self._record(out_key, normed)
            return normed, summed
        norm.add_and_norm = add_and_norm
        self._patched.append(norm)

    # ------------------------------------------------------------------------------------------ results
    def after_backward(self, loss_scale: float = 1.0) -> dict[str, float]:
        """Remove the hooks; return the activation statistics and the gradient norms (call before clipping).

        `loss_scale`: the fp16 GradScaler's current scale when the gradients are still scaled (the gradient
        norms and resid_grad_rms are divided by it); 1.0 for bf16/fp32 or already-unscaled gradients."""
        self.disarm()
        values: dict[str, torch.Tensor] = dict(self._values)
        self._values = {}
        grad_sq: dict[int, torch.Tensor] = {}
        for p in self.model.parameters():  # unique parameters (tied weights once), like clip_grad_norm_
            if p.grad is not None:
                grad_sq[id(p)] = _whole(torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float32)).square()
        if grad_sq:
            values[self.key("grad_norm_global")] = torch.stack(list(grad_sq.values())).sum().sqrt()
        for i, block in enumerate(self.layers):
            for quantity, module in (("grad_norm", block), ("grad_norm_attn", block.self_attn),
                                     ("grad_norm_mlp", block.mlp)):
                squares = [grad_sq[id(p)] for p in module.parameters() if id(p) in grad_sq]
                if squares:
                    values[self.key(quantity, i)] = torch.stack(squares).sum().sqrt()
        if loss_scale != 1.0:
            for key in values:
                if "/grad_norm" in key or "/resid_grad_rms" in key:
                    values[key] = values[key] / loss_scale
        return _to_floats(values)

    @torch.no_grad()
    def after_step(self) -> dict[str, float]:
        """Update-to-weight ratio per layer against the snapshot taken in arm(); {} when there is none."""
        if self._snapshot is None:
            return {}
        values: dict[str, torch.Tensor] = {}
        total_delta, total_weight = [], []
        for i, pairs in enumerate(self._snapshot):
            if not pairs:
                continue
            delta = torch.stack([_whole(torch.linalg.vector_norm(p - old, dtype=torch.float32)) for p, old in pairs])
            weight = torch.stack([_whole(torch.linalg.vector_norm(old, dtype=torch.float32)) for _, old in pairs])
            delta_sq, weight_sq = delta.square().sum(), weight.square().sum()
            values[self.key("update_ratio", i)] = (delta_sq / weight_sq).sqrt()
            total_delta.append(delta_sq)
            total_weight.append(weight_sq)
        if total_delta:
            values[self.key("update_ratio_global")] = (torch.stack(total_delta).sum()
                                                        / torch.stack(total_weight).sum()).sqrt()
        self._snapshot = None
        return _to_floats(values)


def _to_floats(values: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """One device-to-host transfer for all statistics instead of one sync per number."""
    if not values:
        return {}
    keys = list(values)
    numbers = torch.stack([values[k].float().to(values[keys[0]].device) for k in keys]).cpu().tolist()
    return dict(zip(keys, numbers))


# --------------------------------------------------------------------------- reading metrics files back
def layer_quantities(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """Names of the per-layer quantities present, e.g. ["attn_norm_in_rms", "grad_norm", "resid_rms", ...]."""
    names = set()
    for record in records:
        for key in record:
            match = _LAYER_KEY.match(key)
            if match:
                names.add(match["quantity"])
    return sorted(names)


def recorded_layers(metrics_file: Path) -> int | None:
    """The number of blocks of the model whose run wrote `metrics_file`, as the run's train_config.yaml beside it
    records it (num_hidden_layers); None where it records none."""
    layers = recorded_config(metrics_file.parent).get("num_hidden_layers")
    return layers if is_count(layers, least=1) else None


def metric_matrix(source: str | Path | Iterable[Mapping[str, Any]], quantity: str,
                  num_layers: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(steps, matrix) for one per-layer quantity: matrix[layer, j] is the value at steps[j] (NaN if missing).

    `source` is a metrics jsonl path or its records. Only steps that logged the quantity are kept; a step
    logged twice (say after a resume) keeps its last value. A layer index past the model's blocks (`num_layers`,
    recorded_layers; unknown, the number of layers the records log: every block logs resid_rms, so a run's
    indices are 0 .. L-1) is a ValueError naming its record: the matrix has a row per index up to the largest, and
    one stray `layer_99999999` key would make it gigabytes, a stray `layer_04` of a 4-block model a row of a block
    it does not have.
    """
    records = read_metrics(source) if isinstance(source, (str, Path)) else list(source)
    by_step: dict[int, dict[int, float]] = {}
    present: set[int] = set()  # the layer indices of every per-layer quantity
    last = (-1, "", {})  # this quantity's largest layer index, with its key and record
    for record in records:
        for key, value in record.items():
            match = _LAYER_KEY.match(key)
            if not match:
                continue
            layer = int(match["layer"])
            present.add(layer)
            if match["quantity"] == quantity and value is not None:
                by_step.setdefault(record_number(record, "step", int), {})[layer] = record_number(record, key)
                last = max(last, (layer, key, record), key=lambda item: item[0])
    if not by_step:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 0))
    rows, key, record = last[0] + 1, last[1], last[2]
    if num_layers is not None and rows > num_layers:
        raise ValueError(f"{record_where(record)}: {key}: layer index {rows - 1} is out of range; the run's model "
                         f"has {num_layers} layers (num_hidden_layers in its {CONFIG_FILE}), so 0 .. {num_layers - 1}")
    if num_layers is None and rows > len(present):  # the model's blocks unknown: the indices the records log
        raise ValueError(f"{record_where(record)}: {key}: layer index {rows - 1} is out of range; the records "
                         f"log {len(present)} distinct layer indices, so 0 .. {len(present) - 1}")
    steps = np.array(sorted(by_step), dtype=np.int64)
    matrix = np.full((rows, len(steps)), np.nan)
    for j, step in enumerate(steps):
        for layer, value in by_step[int(step)].items():
            matrix[layer, j] = value
    return steps, matrix


def metric_series(source: str | Path | Iterable[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one scalar key such as "diag/grad_norm_global"."""
    records = read_metrics(source) if isinstance(source, (str, Path)) else list(source)
    by_step = {record_number(r, "step", int): record_number(r, key) for r in records if r.get(key) is not None}
    steps = np.array(sorted(by_step), dtype=np.int64)
    return steps, np.array([by_step[int(s)] for s in steps], dtype=float)


# A spike (loss or gradient norm): a value above SPIKE_FACTOR x the median of the SPIKE_WINDOW values before it, once
# at least SPIKE_MIN_HISTORY of them exist (the median ignores the one-off outliers a mean would chase); a
# non-finite value is always one.
SPIKE_FACTOR = 1.5
SPIKE_WINDOW = 50
SPIKE_MIN_HISTORY = 10


def spike_steps(steps: Sequence[int], values: Sequence[float], factor: float = SPIKE_FACTOR,
                window: int = SPIKE_WINDOW, min_history: int = SPIKE_MIN_HISTORY) -> list[int]:
    """The steps whose value is a spike by the rule above; the history holds only finite values."""
    spikes, history = [], []
    for step, value in zip(steps, values):
        if not math.isfinite(value):
            spikes.append(int(step))
            continue
        recent = history[-window:]
        if len(recent) >= min_history and value > factor * float(np.median(recent)):
            spikes.append(int(step))
        history.append(value)
    return spikes
