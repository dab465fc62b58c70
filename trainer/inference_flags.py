"""The inference tools' shared flags: running past the trained length (eval/chat.py, eval/evaluate.py,
scripts/serve.py) and the penalties on repeated tokens (eval/chat.py, eval/tool_eval.py), with the ranges the
server's requests obey as well. Kept free of torch so that --help stays fast; model/rope.py's extend_context
applies the first, model/generation.py's GenerationSettings the others."""

from __future__ import annotations

import argparse
from collections.abc import Callable

# A temperature or repetition penalty below SMALLEST_DIVISOR (or a penalty above LARGEST_FACTOR) turns float32
# logits into infinities and NaN. OpenAI's API takes presence and frequency penalties in OPENAI_PENALTY_RANGE.
SMALLEST_DIVISOR, LARGEST_FACTOR = 1e-5, 1e5
OPENAI_PENALTY_RANGE = (-2.0, 2.0)
PENALTY_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty")  # GenerationSettings' names
# Chat's frequency penalty (eval/chat.py's flag, the server's default): greedy and sampled answers of the chat model
# loop until the token budget without it; 0.25 ends nearly all, the tool calls as good (docs/tools.md has the cost).
CHAT_FREQUENCY_PENALTY = 0.25


def add_rope_scaling_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rope_scaling_factor", type=float, default=None,
                        help="extend the context this many times at inference with YaRN (rope_scaling yarn whose "
                             "original length is the model's max_position_embeddings); MiniNorm models only")


def _float_within(low: float, high: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not low <= value <= high:  # NaN fails too
            raise argparse.ArgumentTypeError(f"{text} is outside {low:g} .. {high:g}")
        return value
    return parse


def add_penalty_flags(parser: argparse.ArgumentParser, frequency_penalty: float = 0.0) -> None:
    """--repetition_penalty, --presence_penalty, --frequency_penalty: off by default, the last one
    `frequency_penalty` by default; penalty_settings(args)."""
    parser.add_argument("--repetition_penalty", type=_float_within(SMALLEST_DIVISOR, LARGEST_FACTOR), default=1.0,
                        help="make every token of the prompt and the answer so far less likely: its logit divided "
                             "by this (multiplied if negative), as transformers' repetition_penalty; 1: off")
    low, high = OPENAI_PENALTY_RANGE
    parser.add_argument("--presence_penalty", type=_float_within(low, high), default=0.0,
                        help="subtract this from the logit of every token the answer has already used, once "
                             "(OpenAI's presence_penalty; the prompt is not counted); 0: off")
    parser.add_argument("--frequency_penalty", type=_float_within(low, high), default=frequency_penalty,
                        help="subtract this times the number of times the answer has already used the token "
                             "(OpenAI's frequency_penalty; the prompt is not counted); 0: off")


def penalty_settings(args: argparse.Namespace) -> dict[str, float]:
    """The penalty flags as GenerationSettings keyword arguments."""
    return {name: getattr(args, name) for name in PENALTY_FIELDS}
