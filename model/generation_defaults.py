"""What a saved model directory's generation_config.json holds: where generation stops, and no length limit.

A length saved there is not a fallback but an override: transformers lets a saved `max_new_tokens` win over the
`max_length` a caller passes, so a client's own limit (lm-evaluation-harness's `max_gen_toks`, a pipeline's
`max_length`) would be ignored. Each client sets its own length instead (eval/chat.py: `--max_new_tokens`).
"""

from __future__ import annotations

from pathlib import Path

from transformers import GenerationConfig

from dataset.atomic_io import first_line

# Generation settings that bound (or stretch) an answer's length or time; none of them is saved with a model.
LENGTH_FIELDS = ("max_length", "max_new_tokens", "min_length", "min_new_tokens", "max_time")


def without_length_limits(config: GenerationConfig) -> GenerationConfig:
    """A copy of `config` with every LENGTH_FIELDS entry back at transformers' default (not written on save)."""
    defaults = GenerationConfig()
    kept = GenerationConfig.from_dict(config.to_dict())
    for name in LENGTH_FIELDS:
        setattr(kept, name, getattr(defaults, name))
    return kept


def saved_generation_config(eos_token_id: int, pad_token_id: int | None) -> GenerationConfig:
    """The generation config every model directory is saved with: stop at eos (`<|im_end|>`), no bos."""
    return GenerationConfig(eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None)


def read_generation_config(model_dir: Path) -> GenerationConfig:
    """model_dir's generation_config.json without its length limits (a default one when the file is absent), for a
    converted directory; ValueError naming the file when it is not a JSON object transformers reads."""
    file = model_dir / "generation_config.json"
    if not file.is_file():
        return GenerationConfig()
    try:
        return without_length_limits(GenerationConfig.from_pretrained(model_dir))
    except (OSError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"{file}: not a generation config ({first_line(error)})") from None
