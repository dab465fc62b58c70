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


# The sampling, beam, length and logits-processor fields a generation_config.json may hold, each with what transformers'
# generate accepts where it applies the setting (its logits processors' and stopping criteria's checks:
# TemperatureLogitsWarper, TopPLogitsWarper, TopKLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper, TopHLogitsWarper,
# EpsilonLogitsWarper, EtaLogitsWarper, (Encoder)RepetitionPenaltyLogitsProcessor,
# (Encoder)NoRepeatNGramLogitsProcessor, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor,
# ExponentialDecayLengthPenalty, MaxTimeCriteria, beam search's length penalty; do_sample is "expected a boolean"). A
# table of our own, not transformers' validate(): that checks only early_stopping, max_new_tokens, cache_implementation,
# num_return_sequences against the mode, the watermarking ranges and a token both forced and suppressed (its docstring
# leaves the rest to generate's runtime), and those checks stay its own (GenerationConfig's constructor raises them,
# savable_generation_config runs it strictly). GenerationConfig keeps any other value, and an export copied it as it
# was, to fail at the first generate that applies it: "hot", -1, a repetition_penalty of 0, a num_beams of 0
# (ZeroDivisionError), a no_repeat_ngram_size, min_new_tokens or min_length of 2.0 (the processors take integers only; a
# length field stays in the directory itself, which transformers' clients read, as the export drops it), an
# epsilon_cutoff, eta_cutoff or max_time of "x" ('<' not supported), a length_penalty of "x" with beams, a top_h of 2, a
# max_length or prefill_chunk_size of 0; a max_new_tokens or num_return_sequences of "x" was GenerationConfig's own
# TypeError ('<=' not supported, without the field), a watermarking_config of "x" its AttributeError. A top_p or
# typical_p above 1 (an epsilon_cutoff or eta_cutoff outside [0, 1)) generate skips as "off": out of the range
# transformers documents, it is refused as the mistake it is. A temperature or repetition penalty of 1e-300, a
# guidance_scale of 1e308 or NaN, was generate's "probability tensor contains either `inf`, `nan`" at the first sampled
# token: held to the bounds eval/chat.py's flags and the server's requests take (trainer/sampling_ranges.py). An integer
# where a float goes (a temperature of 2) is that float: FLOAT_FIELDS. null is transformers' unset for each (its full
# to_dict() writes null for every unset field); 0 is off for top_k, the n-gram sizes and the cutoffs, 1 for
# typical_p. Token ids: TOKEN_ID_FIELDS.
GENERATION_FIELD_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "do_sample": (lambda value: value is None or isinstance(value, bool), "null, true or false"),
    "max_new_tokens": (_integer_from(1), "null or an integer > 0"),
    "min_new_tokens": (_integer_from(0), "null or an integer >= 0"),
    "max_length": (_integer_from(1), "null or an integer > 0"),
    "min_length": (_integer_from(0), "null or an integer >= 0"),
    "max_time": (_number_within(0, math.inf, above_low=True), "null or a number > 0 (seconds)"),
    "temperature": (_number_within(SMALLEST_DIVISOR, math.inf),
                    f"null or a number >= {SMALLEST_DIVISOR:g} (a smaller one overflows the logits)"),
    "top_p": (_number_within(0, 1), "null or a number in [0, 1]"),
    "top_k": (_integer_from(0), "null or an integer >= 0 (0: no top-k)"),
    "min_p": (_number_within(0, 1), "null or a number in [0, 1]"),
    "typical_p": (_number_within(0, 1, above_low=True), "null or a number in (0, 1] (1: off)"),
    "top_h": (_number_within(0, 1, above_low=True), "null or a number in (0, 1]"),
    "epsilon_cutoff": (lambda value: value is None or (_is_number(value) and 0 <= value < 1),
                       "null or a number in [0, 1) (0: off)"),
    "eta_cutoff": (lambda value: value is None or (_is_number(value) and 0 <= value < 1),
                   "null or a number in [0, 1) (0: off)"),
    "repetition_penalty": (_number_within(SMALLEST_DIVISOR, LARGEST_FACTOR),
                           f"null or a number in [{SMALLEST_DIVISOR:g}, {LARGEST_FACTOR:g}] (1: off)"),
    "encoder_repetition_penalty": (_number_within(SMALLEST_DIVISOR, LARGEST_FACTOR),
                                   f"null or a number in [{SMALLEST_DIVISOR:g}, {LARGEST_FACTOR:g}] (1: off)"),
    "guidance_scale": (_number_within(-LARGEST_FACTOR, LARGEST_FACTOR),
                       f"null or a number in [{-LARGEST_FACTOR:g}, {LARGEST_FACTOR:g}] (1: off)"),
    "num_beams": (_integer_from(1), "null or an integer >= 1"),
    "length_penalty": (_number_within(-math.inf, math.inf), "null or a finite number"),
    "num_return_sequences": (_integer_from(1), "null or an integer >= 1"),
    "no_repeat_ngram_size": (_integer_from(0), "null or an integer >= 0 (0: off)"),
    "encoder_no_repeat_ngram_size": (_integer_from(0), "null or an integer >= 0 (0: off)"),
    "exponential_decay_length_penalty": (
        lambda value: value is None or (isinstance(value, list) and len(value) == 2 and _is_token_id(value[0])
                                        and _is_number(value[1])),
        "null or a pair [start, factor]: an integer >= 0 and a finite number"),
    "prefill_chunk_size": (_integer_from(1), "null or an integer >= 1"),
    "watermarking_config": (lambda value: value is None or isinstance(value, dict),
                            "null or a JSON object (transformers' WatermarkingConfig fields)"),
}
# The fields whose logits processor takes a float only (`has to be a strictly positive float, but is 2`, for a
# temperature or repetition_penalty of 2): an integer there is read as that float, as JSON, GenerationConfig and
# every other reader of the file read it, so that an export writes 2.0 and transformers' generate runs.
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty", "encoder_repetition_penalty")
# The fields that hold token ids, each with its shape: an id, an id or a list of them (forced_eos_token_id's not
# empty: `has to be a list of positive integers, but is tensor([])`), a list of ids, a list of token sequences
# (bad_words_ids), a list of [token sequence, bias] pairs (sequence_bias). transformers keeps any value;
# generate failed on one of the wrong kind ("x": TypeError, [5] for bad_words_ids its ValueError) and on one
# past the vocabulary (forced_eos_token_id 6400 an IndexError, bad_words_ids or sequence_bias its ValueError; an eos
# never stops, a suppressed one suppresses nothing).
TOKEN_ID_FIELDS: dict[str, str] = {
    "bos_token_id": "an id", "eos_token_id": "ids", "pad_token_id": "an id", "decoder_start_token_id": "an id",
    "forced_bos_token_id": "an id", "forced_eos_token_id": "some ids", "suppress_tokens": "a list",
    "begin_suppress_tokens": "a list", "bad_words_ids": "sequences", "sequence_bias": "biases",
}


def _ids_in(value: object, shape: str) -> list[object] | None:
    """The token ids `value` holds when it has TOKEN_ID_FIELDS' `shape` (ids still to check), else None."""
    if shape == "an id" or (shape in ("ids", "some ids") and not isinstance(value, list)):
        return [value]
    if shape in ("ids", "some ids", "a list"):
        return value if isinstance(value, list) and (value or shape != "some ids") else None
    if shape == "sequences":
        sequences = value
    else:  # biases: [[ids...], bias] pairs, the one shape JSON can hold (a dict's keys are strings, not sequences)
        if not (isinstance(value, list)
                and all(isinstance(pair, list) and len(pair) == 2 and _is_number(pair[1]) for pair in value)):
            return None
        sequences = [pair[0] for pair in value]
    if not (isinstance(sequences, list) and sequences
            and all(isinstance(sequence, list) and sequence for sequence in sequences)):
        return None
    return [token for sequence in sequences for token in sequence]


def _token_id_words(shape: str, vocab_size: int | None) -> str:
    """What a TOKEN_ID_FIELDS field of `shape` may hold, its ids those of a vocabulary of `vocab_size` (or any)."""
    token_id, token_ids = ((f"a token id (an integer in 0 .. {vocab_size - 1}, the model's vocabulary)",
                            f"token ids (integers in 0 .. {vocab_size - 1}, the model's vocabulary)") if vocab_size
                           else ("a token id (an integer >= 0)", "token ids (integers >= 0)"))
    return {"an id": f"null or {token_id}", "ids": f"null, {token_id} or a list of them",
            "some ids": f"null, {token_id} or a non-empty list of them", "a list": f"null or a list of {token_ids}",
            "sequences": f"null or a non-empty list of non-empty lists of {token_ids}",
            "biases": f"null or a non-empty list of [[{token_ids}], bias] pairs, each bias a finite number"}[shape]


def floats_where_floats_go(config: GenerationConfig) -> GenerationConfig:
    """`config` with each FLOAT_FIELDS integer as its float (in place; returned for chaining)."""
    for name in FLOAT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(config, name, float(value))
    return config


def _check_generation_fields(file: Path, vocab_size: int | None) -> None:
    """A ValueError naming `file`, the field, its value and what is allowed where a GENERATION_FIELD_RULES field
    breaks its rule, or a TOKEN_ID_FIELDS one is not of its shape or holds what is no token id of the model's
    `vocab_size` (any size when None); a file that is no JSON object is left to GenerationConfig, which names what
    is wrong."""
    fields = json_file_value(file)
    if not isinstance(fields, dict):
        return
    for name, (allowed, words) in GENERATION_FIELD_RULES.items():
        if name in fields and not allowed(fields[name]):
            raise ValueError(f"{file}: {name}={shown_value(fields[name])} is not allowed; it must be {words}")
    # transformers keeps any value in these and every export carries them: generation (model/generation.py) stopped
    # at int(each) ("x" a ValueError traceback at the first message, true at token 1, 2.9 at token 2); an id past
    # the vocabulary never stops a generation, and a pad or bos past it is transformers' embedding IndexError in
    # the first batched generate whose rows end apart (or that starts from no prompt); the logits processors' ids:
    # TOKEN_ID_FIELDS
    for name, shape in TOKEN_ID_FIELDS.items():
        value = fields.get(name)
        ids = None if value is None else _ids_in(value, shape)
        if value is not None and (ids is None or
                                  not all(_is_token_id(i) and (not vocab_size or i < vocab_size) for i in ids)):
            raise ValueError(f"{file}: {name}={shown_value(value)} is not allowed; it must be "
                             f"{_token_id_words(shape, vocab_size)}")


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
