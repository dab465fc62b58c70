"""The model a server answers with: its weights, tokenizer and id, how prompts are built, and its running
GenerationEngine (model/generation.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dataset.chat_format import check_chatml_tokenizer
from model.chat_session import uses_chat_template
from model.generation import GenerationEngine
from model.loading import load_model
from trainer.inference_flags import apply_rope_scaling_flag
from trainer.run_dir import model_task


@dataclass
class ServedModel:
    model: Any
    tokenizer: Any
    name: str
    use_template: bool
    engine: Any
    max_context: int
    created: int


def load_served_model(path: Path, mode: str = "auto", max_batch: int = 8, name: str | None = None,
                      device: str = "auto", dtype: str = "auto", lora: Path | None = None,
                      rope_scaling_factor: float | None = None) -> ServedModel:
    """The model directory `path` (with the LoRA adapter directory `lora` merged into its weights, when given)
    loaded for serving, its context extended by YaRN when `rope_scaling_factor` is given; its id is `name`, else
    the adapter's or the model's directory name."""
    model, tokenizer = load_model(path, device=device, dtype=dtype, lora=lora)
    apply_rope_scaling_flag(model, path, lora, rope_scaling_factor)  # before the engine reads the context length
    source = lora or path
    use_template = uses_chat_template(mode, model_task(source), tokenizer)
    if use_template:
        check_chatml_tokenizer(tokenizer)
    engine = GenerationEngine(model, tokenizer, max_batch=max_batch)
    return ServedModel(model=model, tokenizer=tokenizer, name=name or source.name, use_template=use_template,
                       engine=engine, max_context=engine.max_context, created=int(source.stat().st_mtime))
