"""What a saved model directory's generation_config.json holds: where generation stops, and no length limit.

A length saved there is not a fallback but an override: transformers lets a saved `max_new_tokens` win over the
`max_length` a caller passes, so a client's own limit (lm-evaluation-harness's `max_gen_toks`, a pipeline's
`max_length`) would be ignored. Each client sets its own length instead (eval/chat.py: `--max_new_tokens`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from transformers import GenerationConfig
from transformers.utils import logging as hf_logging

from dataset.atomic_io import first_line
from dataset.json_text import json_file_value
from dataset.shown_value import shown_value
from trainer.sampling_ranges import LARGEST_FACTOR, SMALLEST_DIVISOR

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
    """A JSON number that is a finite float: not a bool, NaN or an infinity (Python's json reads both), nor an
    integer past a float's range (float() of it is an OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _number_within(low: float, high: float, above_low: bool = False) -> Callable[[object], bool]:
    return lambda value: value is None or (_is_number(value) and (low < value if above_low else low <= value)
                                           and value <= high)


def _integer_from(low: int) -> Callable[[object], bool]:
    return lambda value: value is None or (_is_token_id(value) and value >= low)


# The sampling, beam and length fields a generation_config.json may hold, each with what transformers' generate
# accepts where it applies the setting (its logits processors' checks: TemperatureLogitsWarper, TopPLogitsWarper,
# TopKLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper, RepetitionPenaltyLogitsProcessor,
# NoRepeatNGramLogitsProcessor, MinNewTokensLengthLogitsProcessor; do_sample is "expected a boolean"). GenerationConfig
# keeps any value (validate() checks none of these), and an export copied it as it was, to fail at the first generate
# that applies it: "hot", -1, a repetition_penalty of 0, a num_beams of 0 (ZeroDivisionError), a
# no_repeat_ngram_size of 2.0 (the processors take integers only; a min_new_tokens of 2.0 stays in the directory
# itself, which transformers' clients read, as the export drops it); a max_new_tokens of "x" was
# GenerationConfig's own TypeError ('<=' not supported). A top_p or typical_p above 1 generate skips as "off": out of
# the range transformers documents, it is refused as the mistake it is. A temperature or repetition penalty of
# 1e-300 was generate's "probability tensor contains either `inf`, `nan`" at the first sampled token: both are held
# to the bounds eval/chat.py's flags and the server's requests take (trainer/sampling_ranges.py).
# An integer where a float goes (a temperature of 2) is that float: FLOAT_FIELDS. null is transformers' unset for each
# number (do_sample has no unset: null is not a boolean); 0 is off for top_k and no_repeat_ngram_size, 1 for typical_p.
GENERATION_FIELD_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "do_sample": (lambda value: isinstance(value, bool), "true or false"),
    "max_new_tokens": (_integer_from(1), "null or an integer > 0"),
    "min_new_tokens": (_integer_from(0), "null or an integer >= 0"),
    "temperature": (_number_within(SMALLEST_DIVISOR, math.inf),
                    f"null or a number >= {SMALLEST_DIVISOR:g} (a smaller one overflows the logits)"),
    "top_p": (_number_within(0, 1), "null or a number in [0, 1]"),
    "top_k": (_integer_from(0), "null or an integer >= 0 (0: no top-k)"),
    "min_p": (_number_within(0, 1), "null or a number in [0, 1]"),
    "typical_p": (_number_within(0, 1, above_low=True), "null or a number in (0, 1] (1: off)"),
    "repetition_penalty": (_number_within(SMALLEST_DIVISOR, LARGEST_FACTOR),
                           f"null or a number in [{SMALLEST_DIVISOR:g}, {LARGEST_FACTOR:g}] (1: off)"),
    "num_beams": (_integer_from(1), "null or an integer >= 1"),
    "no_repeat_ngram_size": (_integer_from(0), "null or an integer >= 0 (0: off)"),
}
# The fields whose logits processor takes a float only (`has to be a strictly positive float, but is 2`, for a
# temperature or repetition_penalty of 2): an integer there is read as that float, as JSON, GenerationConfig and
# every other reader of the file read it, so that an export writes 2.0 and transformers' generate runs.
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty")
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def floats_where_floats_go(config: GenerationConfig) -> GenerationConfig:
    """`config` with each FLOAT_FIELDS integer as its float (in place; returned for chaining)."""
    for name in FLOAT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(config, name, float(value))
    return config


def _check_generation_fields(file: Path, vocab_size: int | None) -> None:
    """A ValueError naming `file`, the field, its value and what is allowed where a GENERATION_FIELD_RULES field
    breaks its rule, or a TOKEN_ID_FIELDS one is no token id of the model's `vocab_size` (any size when None); a
    file that is no JSON object is left to GenerationConfig, which names what is wrong."""
    fields = json_file_value(file)
    if not isinstance(fields, dict):
        return
    for name, (allowed, words) in GENERATION_FIELD_RULES.items():
        if name in fields and not allowed(fields[name]):
            raise ValueError(f"{file}: {name}={shown_value(fields[name])} is not allowed; it must be {words}")
    # transformers keeps any value in these and every export carries them: generation (model/generation.py) stopped
    # at int(each) ("x" a ValueError traceback at the first message, true at token 1, 2.9 at token 2); an id past
    # the vocabulary never stops a generation, and a pad or bos past it is transformers' embedding IndexError in
    # the first batched generate whose rows end apart (or that starts from no prompt)
    token_id = (f"a token id (an integer in 0 .. {vocab_size - 1}, the model's vocabulary)" if vocab_size
                else "a token id (an integer >= 0)")
    for name in TOKEN_ID_FIELDS:
        value = fields.get(name)
        ids = value if isinstance(value, list) and name == "eos_token_id" else [value]
        if value is not None and not all(_is_token_id(i) and (not vocab_size or i < vocab_size) for i in ids):
            allowed = f"null, {token_id} or a list of them" if name == "eos_token_id" else f"null or {token_id}"
            raise ValueError(f"{file}: {name}={shown_value(value)} is not allowed; it must be {allowed}")


def saved_generation_config(eos_token_id: int, pad_token_id: int | None) -> GenerationConfig:
    """The generation config every model directory is saved with: stop at eos (`<|im_end|>`), no bos."""
    return GenerationConfig(eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None)


def read_generation_config(model_dir: Path, vocab_size: int | None = None) -> GenerationConfig:
    """model_dir's generation_config.json without its length limits and with floats where floats go (a default one
    when the file is absent), for a converted directory; ValueError naming the file when it is not a JSON object
    transformers reads, or a field breaks its rule (its token ids checked against `vocab_size`, when given)."""
    file = model_dir / "generation_config.json"
    if not file.is_file():
        return GenerationConfig()
    _check_generation_fields(file, vocab_size)  # before GenerationConfig: it keeps such a value or fails in its words
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its warning about a flag it ignores would come before our one line
    try:
        config = without_length_limits(GenerationConfig.from_pretrained(model_dir))
    except (OSError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"{file}: not a generation config ({first_line(error)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    return floats_where_floats_go(config)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def savable_generation_config(model_dir: Path, vocab_size: int | None = None) -> GenerationConfig:
    """read_generation_config, refusing in one line naming the file a config that transformers reads but will not
    save (`temperature` without `do_sample`, a value of the wrong kind): a conversion would fail at its very end,
    after loading and converting the weights, with a message of several lines."""
    config = read_generation_config(model_dir, vocab_size)
    try:
        config.validate(strict=True)
    except ValueError as error:
        reasons = [line.strip("- ").strip() for line in str(error).splitlines() if line.startswith("- ")]
        raise ValueError(f"{model_dir / 'generation_config.json'}: {reasons[0] if reasons else first_line(error)} "
                         f"(transformers would not save it with the converted model)") from None
    return config
