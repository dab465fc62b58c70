"""What a saved model directory's generation_config.json holds: where generation stops, and no length limit.

A length saved there is not a fallback but an override: transformers lets a saved `max_new_tokens` win over the
`max_length` a caller passes, so a client's own limit (lm-evaluation-harness's `max_gen_toks`, a pipeline's
`max_length`) would be ignored. Each client sets its own length instead (eval/chat.py: `--max_new_tokens`).
"""

from __future__ import annotations

import math
from pathlib import Path

from transformers import GenerationConfig
from transformers.utils import logging as hf_logging

from dataset.atomic_io import first_line
from dataset.json_text import json_file_value
from dataset.shown_value import shown_value

# Generation settings that bound (or stretch) an answer's length or time; none of them is saved with a model.
LENGTH_FIELDS = ("max_length", "max_new_tokens", "min_length", "min_new_tokens", "max_time")


def without_length_limits(config: GenerationConfig) -> GenerationConfig:
    """A copy of `config` with every LENGTH_FIELDS entry back at transformers' default (not written on save)."""
    defaults = GenerationConfig()
    kept = GenerationConfig.from_dict(config.to_dict())
    for name in LENGTH_FIELDS:
        setattr(kept, name, getattr(defaults, name))
    return kept


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# The sampling and length fields a generation_config.json may hold, each with what transformers' generate accepts
# (its logits warpers' checks: TemperatureLogitsWarper, TopPLogitsWarper, TopKLogitsWarper; do_sample is "expected a
# boolean"). GenerationConfig keeps any value when do_sample is true ("hot", -1, a top_p of 2) and an export copied
# it as it was, to fail at a sampled generate; a max_new_tokens of "x" was its TypeError ('<=' not supported).
# null is transformers' unset for each number (do_sample has no unset: null is not a boolean).
GENERATION_FIELD_RULES = {
    "do_sample": (lambda value: isinstance(value, bool), "true or false"),
    "max_new_tokens": (lambda value: value is None or (_is_token_id(value) and value > 0), "null or an integer > 0"),
    "temperature": (lambda value: value is None or (_is_number(value) and value > 0), "null or a number > 0"),
    "top_p": (lambda value: value is None or (_is_number(value) and 0 <= value <= 1), "null or a number in [0, 1]"),
    "top_k": (lambda value: value is None or _is_token_id(value), "null or an integer >= 0 (0: no top-k)"),
}


def _check_generation_fields(file: Path) -> None:
    """A ValueError naming `file`, the field, its value and what is allowed where a GENERATION_FIELD_RULES field
    breaks its rule; a file that is no JSON object is left to GenerationConfig, which names what is wrong."""
    fields = json_file_value(file)
    for name, (allowed, words) in GENERATION_FIELD_RULES.items():
        if isinstance(fields, dict) and name in fields and not allowed(fields[name]):
            raise ValueError(f"{file}: {name}={shown_value(fields[name])} is not allowed; it must be {words}")


def saved_generation_config(eos_token_id: int, pad_token_id: int | None) -> GenerationConfig:
    """The generation config every model directory is saved with: stop at eos (`<|im_end|>`), no bos."""
    return GenerationConfig(eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None)


def read_generation_config(model_dir: Path) -> GenerationConfig:
    """model_dir's generation_config.json without its length limits (a default one when the file is absent), for a
    converted directory; ValueError naming the file when it is not a JSON object transformers reads."""
    file = model_dir / "generation_config.json"
    if not file.is_file():
        return GenerationConfig()
    _check_generation_fields(file)  # before GenerationConfig, which keeps such a value or fails in its own words
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its warning about a flag it ignores would come before our one line
    try:
        config = without_length_limits(GenerationConfig.from_pretrained(model_dir))
    except (OSError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"{file}: not a generation config ({first_line(error)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    _check_eos_token_id(config.eos_token_id, file)
    # kept as any value too, and carried into every export (a pad_token_id of another kind fails transformers' own
    # comparison, named above)
    if config.bos_token_id is not None and not _is_token_id(config.bos_token_id):
        raise ValueError(f"{file}: bos_token_id={shown_value(config.bos_token_id)} is not allowed; it must be null or "
                         "a token id (an integer >= 0)")
    return config


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_eos_token_id(value: object, file: Path) -> None:
    """A ValueError naming `file` when its eos_token_id is not null, a token id or a list of them: transformers
    keeps any value, and generation (model/generation.py) stops at int(each) -- "x" was a ValueError traceback at
    the first message, true stopped at token 1, 2.9 at token 2."""
    ids = value if isinstance(value, list) else [value]
    if value is not None and not all(_is_token_id(i) for i in ids):
        raise ValueError(f"{file}: eos_token_id={shown_value(value)} is not allowed; it must be null, a token id (an "
                         f"integer >= 0) or a list of them")


def savable_generation_config(model_dir: Path) -> GenerationConfig:
    """read_generation_config, refusing in one line naming the file a config that transformers reads but will not
    save (`temperature` without `do_sample`, a value of the wrong kind): a conversion would fail at its very end,
    after loading and converting the weights, with a message of several lines."""
    config = read_generation_config(model_dir)
    try:
        config.validate(strict=True)
    except ValueError as error:
        reasons = [line.strip("- ").strip() for line in str(error).splitlines() if line.startswith("- ")]
        raise ValueError(f"{model_dir / 'generation_config.json'}: {reasons[0] if reasons else first_line(error)} "
                         f"(transformers would not save it with the converted model)") from None
    return config
