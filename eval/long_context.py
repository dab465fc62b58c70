"""Loss per position bucket on documents longer than the trained length, with and without RoPE scaling.

    python eval/long_context.py --model_path out/pretrain                     # plain vs YaRN, 4 x 256 tokens
    python eval/long_context.py --length 2048 --bucket 256 --scalings none,yarn:8@256,linear:8,dynamic:8@256

Every validation document (pretrain_val, or --data) with at least --length + 1 tokens is cut to its first
--length + 1 tokens, tokenized as pretraining tokenizes it; each is scored from position 0 in one forward pass,
and the next-token losses are averaged per bucket of --bucket positions, over all documents (every document adds
the same number of tokens to each bucket). A model trained on rows of L tokens (the longest --max_seq_len its
runs recorded, run_dir.trained_length, as chat, evaluate and serve read it; --trained_length overrides it) has never
attended over longer spans: the buckets past it show what each scaling buys.

--scalings is a comma-separated list of `none` or TYPE:FACTOR[@L] with TYPE yarn, linear or dynamic, as
transformers' rope_scaling defines them (model/rope.py), FACTOR in (1, 1024] and L in 1 .. 2^24: L is yarn's
original_max_position_embeddings and the length past which dynamic scaling starts (default: the model's
max_position_embeddings; --rope_scaling_factor in chat, evaluate and serve takes the run's trained length,
yarn:F@256 for the default pretraining). The default compares plain RoPE with each scaling over L = the trained
length T that marks the buckets (yarn:4@T, dynamic:4@T, linear:4@T: none,yarn:4@256,... for the default
pretraining), and YaRN over max_position_embeddings (yarn:2).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import begin_command  # noqa: E402

begin_command(__name__)  # a Ctrl-C while the imports below load: one line, exit 130; OpenMP's spin bounded first

from trainer.threads import add_threads_flag, start_threads  # noqa: E402

from dataclasses import dataclass  # noqa: E402
from typing import Any, Sequence  # noqa: E402

from dataset.json_text import strict_json  # noqa: E402
from dataset.split_names import DEFAULT_TEXT_DATA  # noqa: E402
from trainer.cli import (RawDescriptionDefaultsHelpFormatter, ToolParser, add_model_source_flags,  # noqa: E402
                         int_within, output_file, path_arg, run_main)
from trainer.run_dir import ModelNotFound, locate_tool_model, report_error  # noqa: E402

ROPE_TYPES = ("yarn", "linear", "dynamic")
# L's upper bound: positions past 2^24 are not whole numbers in the fp32 angles RoPE computes; beyond what any
# model trains on (a 400-digit L was an OverflowError traceback).
MAX_LENGTH = 2 ** 24


@dataclass(frozen=True)
class Scaling:
    label: str
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int


def read_scaling(spec: str) -> tuple[str, float, int | None]:
    """A --scalings item TYPE:FACTOR[@L] checked without the model: (TYPE, FACTOR, L or None: the model's
    max_position_embeddings); ("none", 1.0, None) for `none`. ValueError, one line, names the item, what in it is
    refused (with its value) and the allowed form and ranges, so that a bad item costs no model loading."""
    from model.rope import MAX_FACTOR  # FACTOR's bound, --rope_scaling_factor's too
    from dataset.shown_value import shown_value

    form = (f"use none or TYPE:FACTOR[@L] with TYPE one of {', '.join(ROPE_TYPES)}, FACTOR a number in "
            f"(1, {MAX_FACTOR}] and L an integer in 1 .. {MAX_LENGTH} (e.g. yarn:4@256)")
    if spec == "none":
        return "none", 1.0, None
    rope_type, sep, rest = spec.partition(":")
    factor_text, at, length_text = rest.partition("@")
    if not sep or rope_type not in ROPE_TYPES:
        problem = (f"TYPE {shown_value(rope_type)} is not one of {', '.join(ROPE_TYPES)}" if sep
                   else "it has no TYPE:FACTOR")
        raise ValueError(f"--scalings item {shown_value(spec)} is not allowed: {problem}; {form}")
    try:
        factor = float(factor_text)
    except ValueError:
        raise ValueError(f"--scalings item {shown_value(spec)} is not allowed: FACTOR {shown_value(factor_text)} is "
                         f"not a number; "
                         f"{form}") from None
    if not 1 < factor <= MAX_FACTOR:  # NaN fails every comparison, inf the upper bound: both refused here
        raise ValueError(f"--scalings item {shown_value(spec)} is not allowed: FACTOR {factor:g} is not in "
                         f"(1, {MAX_FACTOR}]; {form}")
    if not at:
        return rope_type, factor, None
    try:
        original = int(length_text)
    except ValueError:
        original = None
    if original is None or not 1 <= original <= MAX_LENGTH:
        raise ValueError(f"--scalings item {shown_value(spec)} is not allowed: L {shown_value(length_text)} is not "
                         f"an integer in "
                         f"1 .. {MAX_LENGTH}; {form}")
    return rope_type, factor, original


def parse_scaling(spec: str, model_length: int) -> Scaling:
    """`none` or TYPE:FACTOR[@L] (read_scaling's checks) -> the rope_scaling dict and max_position_embeddings to
    set, L defaulting to the model's `model_length`."""
    rope_type, factor, original = read_scaling(spec)
    if rope_type == "none":
        return Scaling("none", None, model_length)
    original = model_length if original is None else original
    if rope_type == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        return Scaling(spec, scaling, int(original * factor))
    if rope_type == "dynamic":  # grows the base once a sequence passes max_position_embeddings
        return Scaling(spec, {"rope_type": "dynamic", "factor": factor}, original)
    return Scaling(spec, {"rope_type": "linear", "factor": factor}, int(original * factor))


def default_scalings(trained: int) -> str:
    """--scalings' default for a model trained on rows of `trained` tokens: plain RoPE; YaRN, dynamic NTK and linear
    interpolation over L = `trained`, as --rope_scaling_factor takes L; YaRN over max_position_embeddings."""
    return f"none,yarn:4@{trained},yarn:2,dynamic:4@{trained},linear:4@{trained}"


def long_documents(data_path: Path, tokenizer: Any, length: int, limit: int, data_name: str | None = None
                   ) -> list[list[int]]:
    """The first length + 1 token ids of every document with that many (pretraining's tokenization), at most
    `limit` documents (0: all). A document whose length proves it shorter (text_token_range's most tokens) is not
    tokenized: --length 100000 read a large file to its end, tokenizing every document. None long enough is a
    ValueError naming the file (`data_name`: as --data named it), --length and the longest document's tokens."""
    from dataset.jsonl import iter_records
    from dataset.pretrain_dataset import encode_documents
    from dataset.tokenization import text_token_range

    documents = []
    longest: tuple[int, int, str] | None = None  # (characters, line, text) of the document with the most characters
    for line, record, _ in iter_records(data_path, "text"):
        text = record["text"]
        if longest is None or len(text) > longest[0]:
            longest = (len(text), line, text)
        tokens = text_token_range(tokenizer, text)
        if tokens is not None and tokens[1] <= length:  # cannot hold length + 1 tokens
            continue
        ids = encode_documents(tokenizer, [text])[0]  # as pretraining reads text
        if len(ids) > length:
            documents.append(ids[:length + 1])
            if limit and len(documents) == limit:
                break
    if not documents:
        named = f"--data {data_name or data_path}: no document has more than --length {length} tokens"
        if longest is None:
            raise ValueError(f"{named}: it holds none")
        characters, line, text = longest
        raise ValueError(f"{named}; the longest (line {line}, {characters:,} characters) has "
                         f"{len(encode_documents(tokenizer, [text])[0]):,}")
    return documents


def bucket_losses(model: Any, documents: Sequence[Sequence[int]], bucket: int, batch_size: int) -> list[float]:
    """Mean next-token loss (nats) per bucket of `bucket` positions, over all documents."""
    import torch
    import torch.nn.functional as F

    total = None
    with torch.inference_mode():
        for start in range(0, len(documents), batch_size):
            ids = torch.tensor(documents[start:start + batch_size])
            logits = model(input_ids=ids[:, :-1]).logits.float()
            nats = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").sum(0)
            total = nats if total is None else total + nats
    per_position = total / len(documents)
    return [float(chunk.mean()) for chunk in per_position.split(bucket)]


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description=__doc__, formatter_class=RawDescriptionDefaultsHelpFormatter)
    add_model_source_flags(parser)
    parser.add_argument("--data", type=path_arg, default=DEFAULT_TEXT_DATA,
                        help=f"{DEFAULT_TEXT_DATA} or a jsonl file of {{\"text\": ...}}")
    parser.add_argument("--length", type=int_within(1, MAX_LENGTH), default=1024,
                        help="positions scored per document (at most 2^24, RoPE's whole positions in fp32)")
    parser.add_argument("--bucket", type=int_within(1), default=128, help="positions per bucket")
    parser.add_argument("--trained_length", type=int_within(1), default=None,
                        help="the tokens per training row, which marks the buckets past it (default: the longest "
                             "--max_seq_len the model's runs recorded, else its max_position_embeddings)")
    parser.add_argument("--scalings", default=None,
                        help="comma-separated: none or TYPE:FACTOR[@L] (see the description); default: "
                             "none,yarn:4@T,yarn:2,dynamic:4@T,linear:4@T with T the trained length (--trained_length)")
    parser.add_argument("--max_documents", type=int_within(0), default=0, help="0: every long enough document")
    parser.add_argument("--batch_size", type=int_within(1), default=4, help="documents per forward pass")
    parser.add_argument("--json", type=output_file, default=None, help="also write the table to this JSON file")
    add_threads_flag(parser)
    args = parser.parse_args(argv)
    print(start_threads(args.threads), file=sys.stderr)
    try:
        for item in args.scalings.split(",") if args.scalings is not None else ():
            read_scaling(item.strip())  # a bad item is refused before the model loads
        return report(args)
    except (ModelNotFound, FileNotFoundError, ValueError) as error:
        return report_error(error)


def report(args: Any) -> int:
    from dataset.atomic_io import atomic_write_text
    from dataset.corpus import resolve_text_data
    from model.loading import load_dir_tokenizer, load_model
    from model.rope import set_rope_scaling
    from dataset.shown_value import shown_value
    from trainer.machine import machine_line
    from trainer.run_dir import check_report_file, resolve_input_path, trained_length

    path, adapter = locate_tool_model(args)
    if args.json:  # before the work: a report written over the model or the data would destroy it
        data = [] if args.data == DEFAULT_TEXT_DATA else [resolve_input_path(args.data)]
        check_report_file(Path(args.json), "--json", path, adapter, data)
    # The documents before the model: a --length no document reaches is said before the model loads.
    tokenizer = load_dir_tokenizer(path)
    data_path = resolve_text_data(args.data)
    documents = long_documents(data_path, tokenizer, args.length, args.max_documents, args.data)
    model, tokenizer = load_model(path, device="cpu", dtype="float32", lora=adapter)
    if model.config.rope_scaling is not None:
        raise ValueError(f"{path} already has rope_scaling={shown_value(model.config.rope_scaling)}; this tool "
                         "compares scalings of a plain-RoPE model")
    model_length = model.config.max_position_embeddings
    # What the model's runs recorded, as --rope_scaling_factor reads it (model/rope.py, extend_context).
    trained = args.trained_length or trained_length(path, adapter) or model_length
    specs = args.scalings if args.scalings is not None else default_scalings(trained)
    scalings = [parse_scaling(item.strip(), model_length) for item in specs.split(",")]
    rows = {}
    for scaling in scalings:
        set_rope_scaling(model, scaling.rope_scaling, scaling.max_position_embeddings)
        rows[scaling.label] = bucket_losses(model, documents, args.bucket, args.batch_size)
    set_rope_scaling(model, None, model_length)
    starts = list(range(0, args.length, args.bucket))
    print(f"model {path} (max_position_embeddings {model_length}), {len(documents)} documents of "
          f"{args.length} scored positions from {data_path.name}; {machine_line()}")
    print(f"mean next-token loss (nats) per position bucket; * = past the trained length {trained}")
    header = ["scaling"] + [f"{start}-{start + args.bucket - 1}{'*' if start >= trained else ''}"
                            for start in starts]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for label, losses in rows.items():
        print(f"| {label} | " + " | ".join(f"{loss:.3f}" for loss in losses) + " |")
    if args.json:
        out = Path(args.json)
        atomic_write_text(out, strict_json({"model_path": str(path), "documents": len(documents),
                                             "length": args.length, "bucket_starts": starts, "losses": rows},
                                            indent=2))
        print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    run_main(main)
