"""LoRA adapters on a MiniNorm model, through PEFT: adding them for training, loading an adapter directory onto its
base model, and merging it into a plain model.

An adapter directory is PEFT's standard one (`adapter_config.json`, `adapter_model.safetensors`), so PEFT and
transformers load it as they load any other; its `base_model_name_or_path` names the model it was trained on.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from dataset.shown_value import flag_refusal, shown_value

# The decoder's linear layers LoRA may adapt (model/model.py): attention and MLP projections. The LM head is tied
# to the embedding, so it is not among them.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
LORA_TARGETS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS


def parse_targets(text: str) -> tuple[str, ...]:
    """A --lora_targets value ("q_proj,v_proj", "all", "attention", "mlp") as module names; ValueError names the
    allowed ones."""
    groups = {"all": LORA_TARGETS, "attention": ATTENTION_PROJECTIONS, "mlp": MLP_PROJECTIONS}
    names: list[str] = []
    for part in (piece.strip() for piece in text.split(",")):
        for name in groups.get(part, (part,)):
            if name not in LORA_TARGETS:
                raise ValueError(f"--lora_targets={shown_value(text)}: {shown_value(name)} is not a projection of the "
                                 f"model; choose from {', '.join(LORA_TARGETS)} (comma-separated), or all, attention, "
                                 "mlp")
            if name not in names:
                names.append(name)
    return tuple(names)


@contextmanager
def _without_peft_deprecation():
    """PEFT itself still reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model (we never
    do); that one FutureWarning is silenced, any other still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def add_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """`model` wrapped by PEFT with fresh LoRA adapters (B = 0: the wrapped model computes what `model` did); only
    the adapters' parameters require gradients."""
    from peft import LoraConfig, get_peft_model

    sides = [min(module.in_features, module.out_features) for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in settings.targets]
    if sides and not 1 <= settings.rank <= min(sides):  # a huge rank was a TypeError traceback from torch.empty
        raise ValueError(flag_refusal("lora_rank", settings.rank,
                                      f"it must be in 1 .. {min(sides)} (the smallest side of the adapted layers: a "
                                      f"larger rank adds parameters, not rank)"))
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.targets), bias="none", task_type="CAUSAL_LM")
    with _without_peft_deprecation():
        return get_peft_model(model, config)


def load_adapter(base_model: nn.Module, adapter_dir: Path, merge: bool) -> Any:
    """Base model + the adapter of `adapter_dir`: a PEFT model, or with `merge` the base model's own class with
    the adapter folded into its weights (no extra work per token). ValueError, one line naming the file and field,
    when the directory is not an adapter this loading supports for `base_model` (model/adapter_checks.py)."""
    from peft import PeftModel

    from model.adapter_checks import check_adapter_dir

    check_adapter_dir(base_model, adapter_dir)  # PEFT reads its config and weights unchecked
    with _without_peft_deprecation():
        peft_model = PeftModel.from_pretrained(base_model, str(adapter_dir))
    return peft_model.merge_and_unload() if merge else peft_model


def merged_model(peft_model: Any) -> nn.Module:
    """A plain model whose weights are W + (alpha / rank) * B @ A, from a PEFT model (left unchanged)."""
    import copy

    return copy.deepcopy(peft_model).merge_and_unload()
