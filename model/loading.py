"""Loading a trained model directory for inference (chat, evaluation, export, the server): ours, or any causal-LM
directory transformers knows, such as the Llama directories scripts/convert_to_llama.py writes, optionally with a
LoRA adapter on top (model/lora.py). Finding the directory, and naming the command that creates a missing one, is
trainer/run_dir.py's job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from dataset.tokenization import load_tokenizer

# Importing any module of the `model` package runs model/__init__.py, which registers the "mininorm" type with
# transformers' Auto classes: AutoModelForCausalLM below loads our directories.


def config_model_type(path: Path) -> str | None:
    """model_type in path/config.json, read as plain JSON (no config class); None when missing or unreadable."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def pick_device(device: str = "auto") -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model(path: Path, device: str = "auto", dtype: str = "auto", lora: Path | None = None) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) from a model directory, with the LoRA adapter directory `lora` merged into
    its weights when given (the adapter's own base model is `path`).

    dtype "auto": bfloat16 on CUDA, float32 elsewhere. The saved norm_impl is kept, except that a saved "auto"
    becomes "eager" on CPU: torch.compile's start-up costs more than it saves in a chat. The adapter is merged in
    fp32, before the cast to `dtype`.
    """
    hf_logging.disable_progress_bar()  # "Loading weights" bars would interleave with chat output
    device = pick_device(device)
    torch_dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32,
                   "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    overrides: dict[str, Any] = {}
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "norm_impl", None) == "auto" and not device.startswith("cuda"):
        overrides["norm_impl"] = "eager"
    if lora is None:
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **overrides)
    else:
        from model.lora import load_adapter

        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **overrides)
        loaded = load_adapter(base, lora, merge=True).to(torch_dtype)
    return loaded.to(device).eval(), load_tokenizer(path)
