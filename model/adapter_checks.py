"""Checks of a LoRA adapter directory (model/lora.py's load_adapter) before PEFT reads it.

PEFT takes adapter_config.json's values unchecked: a wrong type or an absurd rank was a traceback from deep inside
it or from torch's allocator, an option our loading does not carry out (DoRA's magnitudes, modules_to_save, a
layer selection) loaded as something else without a word, and a damaged adapter_model.safetensors was a
SafetensorError traceback. Here every field is checked against what this base model can take, and every tensor of
the weights file against the names and shapes the config implies, each refusal one line naming the file and field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from peft.utils import CONFIG_NAME
from peft.utils import SAFETENSORS_WEIGHTS_NAME as WEIGHTS_NAME
from torch import nn

from dataset.json_text import JsonTextError, read_json
from dataset.shown_value import shown_value
from model.config import is_number
from model.weight_checks import check_finite, few, safetensors_shapes


# The fields our loading reads and carries out, each checked on its own below. Every other field PEFT's LoraConfig
# has (use_dora, modules_to_save, layers_to_transform, rank_pattern, lora_bias, ...) changes what the adapter
# computes or which weights it holds in ways load_adapter does not support: such a field must keep a value that
# leaves it off.
SUPPORTED_FIELDS = ("peft_type", "r", "lora_alpha", "target_modules", "lora_dropout", "bias", "use_rslora",
                    "init_lora_weights", "fan_in_fan_out", "task_type", "inference_mode", "base_model_name_or_path",
                    "revision", "peft_version", "auto_mapping")
# The starting values PEFT draws before the file's weights replace them; PiSSA, OLoRA, CorDA, LoftQ, ... also
# rewrite the base model's weights while it loads, which a plain adapter file does not undo.
INITIALIZATIONS = (True, False, "gaussian")
OFF_VALUES: tuple[Any, ...] = (None, False, {}, [])


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    """adapter_dir/adapter_config.json as a dict; ValueError naming the file when it cannot be read, is not JSON
    (as dataset/json_text.py reads it: NaN and a duplicate key are not) or not a JSON object."""
    file = adapter_dir / CONFIG_NAME
    try:
        config = read_json(file.read_bytes())
    except OSError as error:
        raise ValueError(f"{file}: cannot be read ({error.strerror or error})") from None
    except JsonTextError as error:
        raise ValueError(error.about(str(file))) from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: holds {shown_value(config)}, not a JSON object (PEFT's LoRA config: peft_type, r, "
                         f"lora_alpha, target_modules, ...)")
    return config


def check_adapter_dir(base_model: nn.Module, adapter_dir: Path) -> None:
    """A ValueError, one line naming the file and field and what is allowed, when the adapter directory is not one
    load_adapter can put on `base_model`: its config (check_adapter_config) or its weights file (missing,
    unreadable, tensors other than the config implies for this model, a NaN or infinite value)."""
    file = adapter_dir / CONFIG_NAME
    config = read_adapter_config(adapter_dir)
    adapted = check_adapter_config(config, base_model, file)
    weights = adapter_dir / WEIGHTS_NAME
    if not weights.is_file():
        raise ValueError(f"{adapter_dir}: no {WEIGHTS_NAME} there (the adapter's weights, which {CONFIG_NAME} "
                         f"describes)")
    found = safetensors_shapes(weights)  # a ValueError naming the file when it is empty, truncated or no safetensors
    rank = config["r"]
    expected = {}
    for name, module in adapted.items():
        expected[f"base_model.model.{name}.lora_A.weight"] = [rank, module.in_features]
        expected[f"base_model.model.{name}.lora_B.weight"] = [module.out_features, rank]
    implied = f"what {file.name}'s r={rank} and target_modules imply for this base model"
    if missing := set(expected) - set(found):
        raise ValueError(f"{weights}: lacks {few(missing, shown=1)}, {implied}")
    if unexpected := set(found) - set(expected):
        raise ValueError(f"{weights}: holds {few(unexpected, shown=1)}, not {implied}")
    for key in sorted(expected):
        if list(found[key]) != expected[key]:
            raise ValueError(f"{weights}: {key} has shape {list(found[key])}; {implied} is {expected[key]}")
    from safetensors.torch import load_file

    check_finite(load_file(weights).items(), str(weights))


def check_adapter_config(config: dict[str, Any], base_model: nn.Module, file: Path) -> dict[str, nn.Linear]:
    """The linear layers of `base_model` (by module name) the LoRA config `config` (read from `file`) adapts; a
    ValueError naming `file` and the field when a field is not one load_adapter supports for this model."""
    def refuse(field: str, allowed: str) -> ValueError:
        value = f"={shown_value(config[field])}" if field in config else ""
        what = "is not allowed" if field in config else "is missing"
        return ValueError(f"{file}: {field}{value} {what}; {allowed}")

    if config.get("peft_type") != "LORA":
        raise refuse("peft_type", "it must be 'LORA' (a LoRA adapter, as trainer/train_lora.py writes)")
    for field in sorted(set(config) - set(SUPPORTED_FIELDS)):
        if not any(_same(config[field], off) for off in OFF_VALUES) and not _is_default(field, config[field]):
            raise refuse(field, "this option is not supported when loading an adapter; it must be null, false or "
                                "empty (left off)")
    if not (is_number(config.get("lora_alpha")) and math.isfinite(config["lora_alpha"])):
        raise refuse("lora_alpha", "it must be a finite number (the adapter's scale is lora_alpha / r, or / sqrt(r) "
                                   "with use_rslora)")
    if "lora_dropout" in config and not (is_number(config["lora_dropout"]) and 0 <= config["lora_dropout"] < 1):
        raise refuse("lora_dropout", "it must be a number in [0, 1)")
    for field, allowed in (("bias", ("none",)), ("fan_in_fan_out", (False,)), ("use_rslora", (False, True)),
                           ("init_lora_weights", INITIALIZATIONS), ("task_type", (None, "CAUSAL_LM")),
                           ("inference_mode", (False, True))):
        if field in config and not any(_same(config[field], value) for value in allowed):
            words = [_json(value) for value in allowed]
            raise refuse(field, f"it must be {', '.join(words[:-1])} or {words[-1]}" if len(words) > 1
                         else f"it must be {words[0]}")
    for field in ("base_model_name_or_path", "revision", "peft_version"):
        if config.get(field) is not None and not isinstance(config[field], str):
            raise refuse(field, "it must be a string or null")
    if config.get("auto_mapping") is not None and not isinstance(config["auto_mapping"], dict):
        raise refuse("auto_mapping", "it must be an object or null")
    adapted = _adapted_layers(config, base_model, refuse)
    sides = min(min(module.in_features, module.out_features) for module in adapted.values())
    rank = config.get("r")
    if not (isinstance(rank, int) and not isinstance(rank, bool) and 1 <= rank <= sides):
        raise refuse("r", f"it must be an integer in 1 .. {sides} (the smallest side of the layers it adapts)")
    return adapted


def _adapted_layers(config: dict[str, Any], base_model: nn.Module, refuse: Callable[[str, str], ValueError]
                    ) -> dict[str, nn.Linear]:
    """The modules target_modules names, matched as PEFT matches them (a list: names or dotted suffixes of module
    names; a string: a regular expression a whole module name matches); each entry must name a linear layer of the
    model other than its output head (tied to the embedding: merging into it would change the embedding too)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = config.get("target_modules")
    head = base_model.get_output_embeddings() if hasattr(base_model, "get_output_embeddings") else None
    layers = {name: module for name, module in base_model.named_modules()
              if isinstance(module, nn.Linear) and module is not head}
    kinds = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in layers}))
    allowed = f"it must be a list of the model's linear layers ({kinds}), or a regular expression matching one"
    if isinstance(targets, str):
        entries: list[Any] = [targets]
        try:
            re.compile(targets)
        except re.error:
            raise refuse("target_modules", allowed) from None
    elif isinstance(targets, list) and targets and all(isinstance(entry, str) for entry in targets):
        entries = [[entry] for entry in targets]
    else:
        raise refuse("target_modules", allowed)
    adapted: dict[str, nn.Linear] = {}
    for entry in entries:
        # The options that change PEFT's matching (exclude_modules, layers_to_transform, ...) are refused above.
        query = SimpleNamespace(target_modules=entry, exclude_modules=None, modules_to_save=None,
                                target_parameters=None, layers_to_transform=None, layers_pattern=None)
        matched = [name for name, _ in base_model.named_modules() if name and check_target_module_exists(query, name)]
        if not matched or any(name not in layers for name in matched):
            other = next((name for name in matched if name not in layers), None)
            why = f"it matches {shown_value(other)}, not one of those" if other else "it matches no module of the model"
            named = entry if isinstance(entry, str) else entry[0]
            raise ValueError(f"{refuse('target_modules', allowed)} ({shown_value(named)}: {why})")
        adapted.update({name: layers[name] for name in matched})
    return adapted


def _same(value: Any, allowed: Any) -> bool:
    """JSON equality: true is not 1, as Python's == would have it."""
    return type(value) is type(allowed) and value == allowed


def _json(value: Any) -> str:
    return {True: "true", False: "false", None: "null"}.get(value, repr(value)) if not isinstance(value, str) \
        else repr(value)


def _is_default(field: str, value: Any) -> bool:
    """Whether `value` is LoraConfig's own default for `field` (megatron_core's module name, qalora_group_size):
    inert while the option it serves is off."""
    import dataclasses

    from peft import LoraConfig

    for spec in dataclasses.fields(LoraConfig):
        if spec.name == field and spec.default is not dataclasses.MISSING:
            return _same(value, spec.default)
    return False
