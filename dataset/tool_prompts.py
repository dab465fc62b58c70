"""GRPO prompt data of tool questions, for rollouts that call tools (trainer/train_grpo.py --tools --reward tool_use).

    python dataset/tool_prompts.py                 # dataset/cache/tool_prompts_{train,val}.jsonl
    python dataset/tool_prompts.py --out_dir data --wiki 1000 --arithmetic 1000 --conversions 500

Each row is a question of dataset/tool_dialogues.py's dialogues as a prompt, the system turn with every built-in tool
and the user's question, ``{"prompt": [system, user], "tool": ..., "arguments": {...}, "result": ..., "fact": ...}``:
the tool a right reply calls, the arguments of the dialogue's call, what that call returns and the fact its final
answer holds (dataset/tool_scoring.py's ToolQuestion, which the tool_use reward rebuilds from these columns). The
training file holds the train split's questions only, so no held-out entity or problem (tool_dialogues's split:
the corpus's validation articles, the hashed-out problems; eval/tool_eval.py asks those) is trained on; the
validation file, which a run only scores, holds held-out ones.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `import dataset...` work from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

from collections.abc import Sequence  # noqa: E402

from dataset.atomic_io import atomic_write_text, make_dirs  # noqa: E402
from dataset.corpus import DEFAULT_CACHE_DIR  # noqa: E402
from dataset.json_text import strict_json  # noqa: E402
from dataset.tool_dialogues import Split, tool_dialogues  # noqa: E402
from dataset.tool_scoring import ToolQuestion  # noqa: E402

TRAIN_COUNTS = (2000, 2000, 1000)  # (lookups, calculations, conversions) of the training file by default
VAL_COUNTS = (40, 40, 20)  # and of the validation file
TRAIN_SEED = 1  # not the SFT files' seed (dataset/corpus.py's TOOL_DIALOGUES_SEED, 0): other problems than SFT's
FILE_NAMES = {"train": "tool_prompts_train.jsonl", "held_out": "tool_prompts_val.jsonl"}


def tool_prompt_row(dialogue: dict) -> dict:
    """A tool dialogue (system, user, call, tool result, answer) as a prompt row: its first two messages and the
    columns the tool_use reward reads."""
    question = ToolQuestion.from_dialogue(dialogue)
    return {"prompt": dialogue["conversations"][:2], "tool": question.kind, "arguments": question.arguments,
            "result": question.result, "fact": question.fact}


def tool_prompt_rows(split: Split, seed: int, wiki: int, arithmetic: int, conversions: int) -> list[dict]:
    """The prompt rows of `split`'s tool questions (dataset/tool_dialogues.py's, deterministic in its arguments)."""
    return [tool_prompt_row(dialogue) for dialogue in tool_dialogues(split, seed, wiki, arithmetic, conversions)]


def write_tool_prompts(out_dir: Path, seed: int, train_counts: Sequence[int],
                       val_counts: Sequence[int] = VAL_COUNTS) -> dict[str, Path]:
    """Write the training file (the train split) and the validation file (held-out questions) under `out_dir`."""
    out_dir = make_dirs(out_dir)
    paths = {}
    for split, counts in (("train", train_counts), ("held_out", val_counts)):
        rows = tool_prompt_rows(split, seed, *counts)
        paths[split] = out_dir / FILE_NAMES[split]
        atomic_write_text(paths[split], "".join(strict_json(row, ensure_ascii=False) + "\n" for row in rows))
    return paths


def main(argv: list[str] | None = None) -> None:
    from trainer.cli import ToolParser, int_within

    parser = ToolParser(description="Write GRPO prompt files of tool questions (train split; held-out validation).")
    parser.add_argument("--out_dir", type=Path, default=None,
                        help="where the two files are written (unset: the data cache, dataset/cache/)")
    wiki, arithmetic, conversions = TRAIN_COUNTS
    parser.add_argument("--wiki", type=int_within(0), default=wiki, help="'What is X?' questions (wiki) to train on")
    parser.add_argument("--arithmetic", type=int_within(0), default=arithmetic,
                        help="arithmetic questions (calculator) to train on")
    parser.add_argument("--conversions", type=int_within(0), default=conversions,
                        help="unit questions (convert_units) to train on")
    parser.add_argument("--seed", type=int_within(0), default=TRAIN_SEED, help="which questions are drawn")
    args = parser.parse_args(argv)
    counts = (args.wiki, args.arithmetic, args.conversions)
    paths = write_tool_prompts(args.out_dir or DEFAULT_CACHE_DIR, args.seed, counts)
    for split, path in paths.items():
        print(f"{path}: {sum(1 for _ in path.open(encoding='utf-8')):,} prompts ({split})")


if __name__ == "__main__":
    from trainer.cli import run_main  # dataset/ imports trainer/ only inside functions: trainer/ imports dataset/

    run_main(main)
