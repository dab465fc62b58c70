"""The inference tools' shared flag for running past the trained length (eval/chat.py, eval/evaluate.py,
scripts/serve.py). Kept free of torch so that --help stays fast; model/rope.py's extend_context applies it."""

from __future__ import annotations

import argparse


def add_rope_scaling_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rope_scaling_factor", type=float, default=None,
                        help="extend the context this many times at inference with YaRN (rope_scaling yarn whose "
                             "original length is the model's max_position_embeddings); MiniNorm models only")
