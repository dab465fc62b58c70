"""The inference tools' shared flags: running past the trained length (eval/chat.py, eval/evaluate.py,
scripts/serve.py), the penalties on repeated tokens (eval/chat.py, eval/tool_eval.py), with the ranges the
server's requests obey as well, the decoding's ranges (temperature, top-p, top-k, the tokens of a turn) and the
device of eval/chat.py and eval/evaluate.py. Kept free of torch so that --help stays fast (a cuda device is checked
with torch, once given); apply_rope_scaling_flag applies the first, model/generation.py's GenerationSettings
the others."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dataset.shown_value import shown_text, shown_value
from trainer.cli import flag_type, float_within, int_within, zero_or_at_least
from trainer.number_text import ascii_float, ascii_hint
from trainer.sampling_ranges import LARGEST_FACTOR, SMALLEST_DIVISOR

# OpenAI's API takes presence and frequency penalties in OPENAI_PENALTY_RANGE, and at most MAX_TOP_LOGPROBS most
# likely tokens per generated one.
OPENAI_PENALTY_RANGE = (-2.0, 2.0)
# OpenAI's API takes a temperature in OPENAI_TEMPERATURE_RANGE (0: greedy here); far past it every token is all but
# equally likely (1e308 divided the logits to zeros: uniform sampling).
OPENAI_TEMPERATURE_RANGE = (0.0, 2.0)
OPENAI_LOGIT_BIAS_RANGE = (-100.0, 100.0)  # a logit_bias value: -100 bans a token, 100 all but forces it
MAX_TOP_LOGPROBS = 20
PENALTY_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty")  # GenerationSettings' names
# Chat's frequency penalty (eval/chat.py's flag, the server's default): greedy and sampled answers of the chat model
# loop until the token budget without it; 0.25 ends nearly all, the tool calls as good (docs/tools.md has the cost).
CHAT_FREQUENCY_PENALTY = 0.25


def rope_scaling_factor(text: str) -> float:
    """--rope_scaling_factor's type: a number in model/rope.py's range (check_scaling_factor), refused as the flag is
    read, before the model loads (a factor of 0.5 or 1e30 cost a whole load first). model/rope.py (torch) is
    imported only once the flag is given, as the model's load would import it: --help stays fast."""
    try:
        value = ascii_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown_value(text)} is not a number{ascii_hint(text)}") from None
    from model.rope import check_scaling_factor

    try:
        return check_scaling_factor(value, flag=None)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_rope_scaling_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rope_scaling_factor", type=flag_type(float, rope_scaling_factor), default=None,
                        help="extend the context this many times (at most 1024) the trained length at inference "
                             "with YaRN (rope_scaling yarn whose original length is the longest rows the model's runs "
                             "trained on, else its max_position_embeddings); MiniNorm models only")


def apply_rope_scaling_flag(model: Any, model_dir: Path, adapter: Path | None, factor: float | None) -> str | None:
    """--rope_scaling_factor on a loaded `model` (model/rope.py's extend_context) over the longest rows its weights
    trained on (run_dir.trained_length of the model directory and of the LoRA `adapter`, if any). Returns what it
    did."""
    from model.rope import extend_context
    from trainer.run_dir import trained_length

    if factor is None:  # nothing to extend: the recorded length is not read (a damaged one refuses no chat)
        return None
    return extend_context(model, factor, trained_length(model_dir, adapter))


# The decoding flags' types (the server's requests take the same ranges, scripts/server/protocol.py): a temperature
# below SMALLEST_DIVISOR overflows as a penalty would, one above OPENAI_TEMPERATURE_RANGE samples all but uniformly;
# ChatSession would quietly write one token for 0 new tokens. A huge top-k is top-k off (transformers' warper takes
# at most the vocabulary), so top-k has no upper bound, as the server's has none.
temperature = zero_or_at_least(SMALLEST_DIVISOR, "greedy", OPENAI_TEMPERATURE_RANGE[1], "OpenAI's range")
TEMPERATURE_HELP = (f"0 means greedy decoding; else {SMALLEST_DIVISOR:g} .. {OPENAI_TEMPERATURE_RANGE[1]:g} "
                    f"(OpenAI's range, the server's too)")
top_p = float_within(0.0, 1.0, above_low=True)
top_k = int_within(0, note="0: off")
max_new_tokens = int_within(1)
DEVICE_FORM = re.compile(r"cuda(:(\d+))?")


def device_type(indexed: bool = True) -> Callable[[str], str]:
    """A --device flag's type: auto, cpu, and (`indexed`) cuda or cuda:N of a CUDA device this machine has; a tool
    that leaves the placement to Accelerate takes auto or cpu only."""
    forms = "auto, cpu, cuda or cuda:N" if indexed else "auto or cpu"

    def parse(text: str) -> str:
        if text in ("auto", "cpu"):
            return text
        form = DEVICE_FORM.fullmatch(text) if indexed else None
        if form is None and not (indexed and text.startswith("cuda:")):
            raise argparse.ArgumentTypeError(f"expected {forms}, got {shown_value(text)}")
        import torch  # only for a cuda device: --help and cpu runs stay fast

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{shown_text(text)} is not a device of this machine: auto or cpu "
                                             "(no CUDA device)")
        if form is None or (form.group(2) is not None and int(form.group(2)) >= count):
            raise argparse.ArgumentTypeError(f"{shown_text(text)} is not a device of this machine: auto, cpu, cuda or "
                                             f"cuda:0 .. cuda:{count - 1}")
        return text
    return parse


def add_penalty_flags(parser: argparse.ArgumentParser, frequency_penalty: float = 0.0) -> None:
    """--repetition_penalty, --presence_penalty, --frequency_penalty: off by default, the last one
    `frequency_penalty` by default; penalty_settings(args)."""
    parser.add_argument("--repetition_penalty", type=float_within(SMALLEST_DIVISOR, LARGEST_FACTOR), default=1.0,
                        help="make every token of the prompt and the answer so far less likely: its logit divided "
                             "by this (multiplied if negative), as transformers' repetition_penalty; 1: off")
    low, high = OPENAI_PENALTY_RANGE
    parser.add_argument("--presence_penalty", type=float_within(low, high), default=0.0,
                        help="subtract this from the logit of every token the answer has already used, once "
                             "(OpenAI's presence_penalty; the prompt is not counted); 0: off")
    parser.add_argument("--frequency_penalty", type=float_within(low, high), default=frequency_penalty,
                        help="subtract this times the number of times the answer has already used the token "
                             "(OpenAI's frequency_penalty; the prompt is not counted); 0: off")


def penalty_settings(args: argparse.Namespace) -> dict[str, float]:
    """The penalty flags as GenerationSettings keyword arguments."""
    return {name: getattr(args, name) for name in PENALTY_FIELDS}
