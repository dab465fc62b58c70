"""Checks of saved weights that every loader shares (model/loading.py's model directories, model/interop.py's
imports, model/adapter_checks.py's LoRA adapters): a safetensors file's tensor shapes read from its header, a
refusal of a NaN or infinite weight, and a long list of weight names kept to one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from dataset.atomic_io import first_line


# The weights' dtypes a loader reads, by their safetensors header names. Others are refused: integers are no weights
# (a damaged export), and a float8 tensor holds a quantized checkpoint's values without their scales; an import's
# .float(), and transformers' cast to the model's dtype on load, made them weights, silently wrong.
WEIGHT_DTYPE_NAMES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
WEIGHT_DTYPES = tuple(WEIGHT_DTYPE_NAMES.values())


def wrong_weight_dtype(key: str, dtype: torch.dtype, file: Path) -> str:
    """The words for a weight of a dtype not in WEIGHT_DTYPES (every loader's and the import's)."""
    return f"its weight {key} in {file.name} is {dtype}, not one of {', '.join(map(str, WEIGHT_DTYPES))}"


def check_weight_dtypes(file: Path, where: str) -> None:
    """A ValueError `where: wrong_weight_dtype(...)` for the first tensor of the safetensors file `file` whose dtype
    (read from its header) is not in WEIGHT_DTYPES; only that tensor is read, for its torch dtype's name."""
    with safe_open(str(file), framework="pt") as f:
        for key in f.keys():
            if f.get_slice(key).get_dtype() not in WEIGHT_DTYPE_NAMES:
                raise ValueError(f"{where}: {wrong_weight_dtype(key, f.get_tensor(key).dtype, file)}")


def few(names: Any, shown: int = 3) -> str:
    """'a, b, c and 5 more': a long list of weight names kept to one readable line."""
    names = sorted(names)
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def unreadable_safetensors(file: Path, error: BaseException) -> str:
    """The one line for a safetensors file that does not read (empty, truncated, not safetensors at all)."""
    return f"{file} is not a readable safetensors file ({first_line(error)})"


def layers_held(keys: Any) -> int:
    """How many decoder layers weights named `keys` hold: the distinct N of their "model.layers.N." prefixes."""
    return len({key.split(".")[2] for key in keys if key.startswith("model.layers.") and key.count(".") > 2})


def in_two_shards(key: str, first: Path, second: Path) -> str:
    """The words for a tensor that two shards of one checkpoint hold: which copy a reader takes depends on the order
    it reads them in (the index names one, but the import reads every shard, and a key may differ between them)."""
    return (f"its weight {key} is in two shards, {first.name} and {second.name}; a checkpoint holds each tensor "
            "once")


def safetensors_shapes(file: Path) -> dict[str, list[int]]:
    """Every tensor's shape in the safetensors file `file`, from its header (no tensor is read); ValueError naming
    the file when it cannot be read as one."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return {key: f.get_slice(key).get_shape() for key in f.keys()}
    except (OSError, SafetensorError) as error:
        raise ValueError(unreadable_safetensors(file, error)) from None


def check_finite(tensors: Any, where: str, error: type[ValueError] = ValueError) -> None:
    """An `error` naming the first tensor of `tensors` ((name, tensor) pairs) that holds a NaN or an infinity: such a
    weight makes every logit NaN, so chat, evaluation and a GGUF file would carry it on silently."""
    for name, tensor in tensors:
        # A meta tensor holds no values: under FSDP's memory-efficient loading, a weight the checkpoint lacks is one
        # on every process but the first, which initialises it and broadcasts it.
        if tensor.is_floating_point() and not tensor.is_meta and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise error(f"{where}: its weight {name} holds {bad} NaN or infinite value"
                        f"{'s' if bad != 1 else ''} (of {tensor.numel()}); such a model computes NaN logits")
