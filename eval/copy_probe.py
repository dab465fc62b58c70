"""Can a model copy from its context? Its loss on a sequence's first occurrence against its repeat.

    python eval/copy_probe.py --model_path out/pretrain
    python eval/copy_probe.py --model_path out/pretrain --lengths 17,60 --rows 32 --json out/pretrain/copy.json
    python eval/copy_probe.py --model_path out/cue_pairs --cue_pairs 64

Two probes, each a sequence followed by the same sequence again in one row, scored from position 0 in one forward
pass: random token ids (--lengths of them; nothing predicts them but the first occurrence), and the first --text
tokens of validation documents, repeated after a newline. For each, the mean next-token loss (nats) over the
first occurrence's tokens and over the repeat's (its first token excluded: nothing announces the repeat). A model
that copies (an induction head) predicts the repeat almost exactly; one that cannot scores it like the first
occurrence (docs/tools.md, "Where the obstacle is"). The last column is the repeat's first token alone.
With --cue_pairs N, a third probe for each length: the random sequence after the cue of one of the copy rows'
first N cue pairs and its repeat after that cue's partner (dataset/copy_rows.py), so the repeat's first token is
announced to a model pretrained with `--copy_cue_pairs` N or more (docs/tools.md, "Cue pairs").
A length (or --text) whose rows need more positions than the model's max_position_embeddings (a row is scored in
all its tokens but the last: 2L - 1, 2L + 1 with the cue pair) is refused in one line naming the largest that fits,
rather than scored past the model's context.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import begin_command  # noqa: E402

begin_command(__name__)  # a Ctrl-C while the imports below load: one line, exit 130; OpenMP's spin bounded first

from trainer.threads import add_threads_flag, start_threads  # noqa: E402

from typing import Any  # noqa: E402

from dataset.json_text import strict_json  # noqa: E402
from dataset.split_names import DEFAULT_TEXT_DATA  # noqa: E402
from trainer.cli import (ToolParser, add_model_source_flags, int_within, output_file, path_arg, run_main,  # noqa: E402
                         seed)
from trainer.run_dir import ModelNotFound, locate_tool_model, report_error  # noqa: E402


def repeat_losses(model: Any, first: Any, between: Any, before: Any = None) -> tuple[float, float, float]:
    """(mean loss on the first occurrence's tokens 2..L, on the repeat's tokens 2..L, on the repeat's first token)
    of the rows `first` (rows, L), each `before` (rows, B; default none), itself, `between` (rows, S) and itself."""
    import torch
    import torch.nn.functional as F

    rows, length = first.shape
    before = first[:, :0] if before is None else before
    ids = torch.cat([before, first, between, first], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=ids[:, :-1]).logits.float()
    nats = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # nats[:, t] predicts ids[t + 1]
    start = before.shape[1]
    repeat = start + length + between.shape[1]
    return (float(nats[:, start:start + length - 1].mean()), float(nats[:, repeat:repeat + length - 1].mean()),
            float(nats[:, repeat - 1].mean()))


def text_rows(data_path: Path, tokenizer: Any, length: int, count: int) -> list[list[int]]:
    """The first `length` token ids of the first `count` documents that have that many."""
    from dataset.jsonl import iter_records
    from dataset.pretrain_dataset import encode_documents

    rows = []
    for _, record, _ in iter_records(data_path, "text"):
        ids = encode_documents(tokenizer, [record["text"]])[0]  # as pretraining reads text
        if len(ids) >= length:
            rows.append(ids[:length])
            if len(rows) == count:
                break
    return rows


def check_rows_fit(lengths: list[int], cue_pairs: int, text: int, newline_tokens: int, positions: int) -> None:
    """A ValueError naming the flag when a probe's row (a sequence, what comes between, the sequence again; one cue
    token before it with cue pairs) needs more than the model's `positions` (max_position_embeddings): the forward
    pass reads each row but its last token, and positions past the model's context would be scored as if it had
    them."""
    between = 2 if cue_pairs else 0  # the cue before the sequence, its partner between the two
    longest = max(lengths, default=0)
    if 2 * longest + between - 1 > positions:
        raise ValueError(f"--lengths {longest} is not allowed: its rows of {2 * longest + between} tokens need "
                         f"{2 * longest + between - 1} positions and the model has {positions}; the largest length "
                         f"that fits is {(positions + 1 - between) // 2}")
    if text and 2 * text + newline_tokens - 1 > positions:
        raise ValueError(f"--text {text} is not allowed: its rows of {2 * text + newline_tokens} tokens need "
                         f"{2 * text + newline_tokens - 1} positions and the model has {positions}; the largest "
                         f"--text that fits is {(positions + 1 - newline_tokens) // 2}")


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description=__doc__.split("\n")[0])
    add_model_source_flags(parser)
    parser.add_argument("--lengths", default="17,37,60", help="comma-separated lengths of the random sequences")
    parser.add_argument("--text", type=int_within(0, note="0: none"), default=40,
                        help="tokens of each validation document repeated (0: none; else at least 2)")
    parser.add_argument("--rows", type=int_within(1), default=16, help="sequences per probe")
    parser.add_argument("--seed", type=seed, default=1, help="draws the random sequences")
    parser.add_argument("--data", type=path_arg, default=DEFAULT_TEXT_DATA,
                        help=f"{DEFAULT_TEXT_DATA} or a jsonl file of {{\"text\": ...}}")
    parser.add_argument("--cue_pairs", type=int_within(0, note="0: no such probe"), default=0,
                        help="also probe each length after a cue pair, drawn from the copy rows' first N (0: no such "
                        "probe; see --copy_cue_pairs)")
    parser.add_argument("--json", type=output_file, default=None, help="also write the table to this JSON file")
    add_threads_flag(parser)
    args = parser.parse_args(argv)
    print(start_threads(args.threads), file=sys.stderr)
    try:
        return report(args)
    except (ModelNotFound, FileNotFoundError, ValueError) as error:
        return report_error(error)


def report(args: Any) -> int:
    import torch

    from dataset.atomic_io import atomic_write_text
    from dataset.copy_rows import check_cue_pairs, cue_table
    from dataset.corpus import resolve_text_data
    from model.loading import load_model
    from dataset.shown_value import shown_value
    from trainer.machine import machine_line
    from trainer.run_dir import check_report_file, resolve_input_path

    try:
        lengths = [int(item) for item in args.lengths.split(",") if item.strip()]
    except ValueError:
        lengths = []
    # none (an empty --lengths printed a table of no probes and exited 0) or one under 2: the flag alone is named
    if not lengths or any(length < 2 for length in lengths):
        raise ValueError(f"--lengths {shown_value(args.lengths)} is not allowed; give comma-separated integers "
                         f">= 2")
    if args.text == 1:  # --rows and --text's range are their flag types'
        raise ValueError("--text 1 is not allowed; give --text 0 or >= 2")
    path, adapter = locate_tool_model(args)
    if args.json:  # before the work: a report written over the model or the data would destroy it
        data = [] if args.data == DEFAULT_TEXT_DATA else [resolve_input_path(args.data)]
        check_report_file(Path(args.json), "--json", path, adapter, data)
    model, tokenizer = load_model(path, device="cpu", dtype="float32", lora=adapter)
    model.eval()
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    check_rows_fit(lengths, args.cue_pairs, args.text, len(newline), model.config.max_position_embeddings)
    low = max(tokenizer.all_special_ids) + 1
    generator = torch.Generator().manual_seed(args.seed)
    results = {}
    try:
        check_cue_pairs(args.cue_pairs, range(low, model.config.vocab_size))
    except ValueError as error:
        raise ValueError(f"--cue_pairs {args.cue_pairs} is not allowed; {error}") from None
    pairs = cue_table(range(low, model.config.vocab_size))[:args.cue_pairs]
    for length in lengths:
        first = torch.randint(low, model.config.vocab_size, (args.rows, length), generator=generator)
        results[f"random {length}"] = repeat_losses(model, first, first[:, :0])
    for length in lengths if args.cue_pairs else ():
        first = torch.randint(low, model.config.vocab_size, (args.rows, length), generator=generator)
        cue, partner = pairs[torch.randint(0, len(pairs), (args.rows,), generator=generator)].unbind(1)
        results[f"cue pair {length}"] = repeat_losses(model, first, partner[:, None], cue[:, None])
    if args.text:
        data_path = resolve_text_data(args.data)
        rows = text_rows(data_path, tokenizer, args.text, args.rows)
        if not rows:
            raise ValueError(f"--data {args.data}: no document has {args.text} tokens")
        results[f"text {args.text}"] = repeat_losses(model, torch.tensor(rows),
                                                     torch.tensor(newline).expand(len(rows), -1))
    print(f"model {path}; {args.rows} rows per probe; {machine_line()}")
    print("| probe | first occurrence (nats) | repeat (nats) | repeat's first token (nats) |")
    print("|---|---:|---:|---:|")
    for name, (first_loss, repeat_loss, repeat_first) in results.items():
        print(f"| {name} | {first_loss:.2f} | {repeat_loss:.2f} | {repeat_first:.2f} |")
    if args.json:
        out = Path(args.json)
        table = {name: {"first": first_loss, "repeat": repeat_loss, "repeat_first_token": repeat_first}
                 for name, (first_loss, repeat_loss, repeat_first) in results.items()}
        atomic_write_text(out, strict_json({"model_path": str(path), "rows": args.rows, "probes": table}, indent=2))
        print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    run_main(main)
