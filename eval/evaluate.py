"""Validation loss, perplexity and bits per byte of a model directory, plus a quick look at its answers.

    python eval/evaluate.py --model_path out/pretrain                 # both default held-out splits
    python eval/evaluate.py --model_path out/sft --data sft_val my.jsonl --json out/sft/eval.json
    python eval/evaluate.py --lora out/lora --data lora_val                     # out/sft + the adapter

`--data` takes `pretrain_val`, `sft_val` (the default corpus's held-out splits) or jsonl files; a file's kind
comes from its first line: `{"text": ...}` is packed pretraining text, `{"conversations": [...]}` is SFT data
with the loss on assistant tokens only. A file's row is named by its stem (by the path as given where two share
one). The numbers come from trainer.evaluation.evaluate_lm, the same code (and
the same loss function) as the trainer's validation.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from the repo root or from eval/
    # The repo root replaces eval/ on sys.path: this file would otherwise shadow the `evaluate` package.
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import begin_command  # noqa: E402

begin_command(__name__)  # a Ctrl-C while the imports below load: one line, exit 130; OpenMP's spin bounded first

from trainer.threads import add_threads_flag, start_threads  # noqa: E402

import re  # noqa: E402
from collections import Counter  # noqa: E402
from typing import Any, Sequence  # noqa: E402

from dataset.json_text import strict_json  # noqa: E402
from dataset.split_names import LORA, PRETRAIN, SFT, SFT_TOOLS  # noqa: E402
from trainer.cli import (DefaultsHelpFormatter, ToolParser, add_model_source_flags, boolean, int_within,  # noqa: E402
                         output_file, path_arg, run_main)
from trainer.inference_flags import add_rope_scaling_flag, apply_rope_scaling_flag, device_type  # noqa: E402
from trainer.run_dir import (ModelNotFound, check_report_file, is_chat_task, locate_model_and_adapter,  # noqa: E402
                             locate_tool_model, model_task, recorded_config, report_error, resolve_input_path,
                             trained_length)

DEFAULT_SPLITS = (PRETRAIN.val, SFT.val)
CORPUS_SPLITS = DEFAULT_SPLITS + (SFT_TOOLS.val,)  # sft_val with held-out tool-use dialogues
NAMED_SPLITS = CORPUS_SPLITS + (LORA.val,)  # the LoRA default set's held-out conversations
# A quick qualitative check: greedy answers to fixed English and Chinese prompts.
FIXED_PROMPTS = {
    "pretrain": ("The history of", "The capital of France is", "Water is", "中国的首都是"),
    "sft": ("Hi! How are you?", "What is the capital of France?", "Tell me about the moon.", "你好，你是谁？",
            "中国的首都是哪里？"),
}
SAMPLE_TOKENS = 40


def resolve_data_spec(spec: str) -> tuple[str, Path]:
    """(name, jsonl path) of one --data value: a named split or a file."""
    if spec in CORPUS_SPLITS:
        from dataset.corpus import ensure_default_corpus
        return spec, getattr(ensure_default_corpus(quiet=True), spec)
    if spec in NAMED_SPLITS:
        from dataset.post_training_data import ensure_post_training_data
        return spec, getattr(ensure_post_training_data(), spec)
    from dataset.jsonl import check_data_file
    path = resolve_input_path(spec)
    try:
        check_data_file(path)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"--data {spec}: {error} (or use one of {', '.join(NAMED_SPLITS)})") from None
    return path.stem, path


def resolve_data_specs(specs: Sequence[str]) -> list[tuple[str, Path]]:
    """(name, jsonl path) of each --data value, every name its own: the results are keyed by name, so two files of
    one stem (a/val.jsonl, b/val.jsonl) are named as given; one file given twice is refused."""
    resolved = [resolve_data_spec(spec) for spec in specs]
    stems = Counter(name for name, _ in resolved)
    given: dict[Path, str] = {}
    named: list[tuple[str, Path]] = []
    for spec, (name, path) in zip(specs, resolved, strict=True):
        if path.resolve() in given:
            raise ValueError(f"--data {given[path.resolve()]} and {spec} are the same file; give it once")
        given[path.resolve()] = spec
        named.append((spec if stems[name] > 1 else name, path))
    return named


def detect_kind(path: Path) -> str:
    """"pretrain" for {"text"} lines, "sft" for {"conversations"} lines, from the first non-empty line (read as the
    datasets read every line: a bad one is named by file and line)."""
    from dataset.jsonl import JSON_WHITESPACE, BadLine, numbered_lines, parse_line

    with open(path, "rb") as handle:
        for number, line in numbered_lines(handle):
            if not line.strip(JSON_WHITESPACE):
                continue
            try:
                record = parse_line(line)
            except BadLine as error:
                raise ValueError(f"{path}:{number}: {error}") from None
            if isinstance(record, dict) and "conversations" in record:
                return "sft"
            if isinstance(record, dict) and "text" in record:
                return "pretrain"
            raise ValueError(f'{path}:{number}: expected a "text" or a "conversations" field')
    raise ValueError(f"{path}: empty file")


def _eval_loader(dataset, batch_size: int, accelerator):
    """This process's share of `dataset`, batched in order. Sharded by hand like the trainer's validation:
    accelerator.prepare would pad the shards with repeated samples, which would then be counted twice."""
    from torch.utils.data import DataLoader

    from trainer.data import shard_loader

    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=getattr(dataset, "collate", None))
    return shard_loader(loader, accelerator.process_index, accelerator.num_processes)


def default_splits(run_dir: Path) -> tuple[str, str]:
    """pretrain_val and the conversations' split the model's run validated on (an SFT or LoRA run on its embedded
    data: trainer/data.default_split_names, sft_tools_val for the default SFT, lora_val for LoRA), else sft_val:
    what the run's own validation loss is comparable with."""
    from trainer.data import default_split_names

    recorded = recorded_config(run_dir)
    task = recorded.get("task")
    if task in ("sft", "lora") and recorded.get("data_path") is None and recorded.get("val_data_path") is None:
        return PRETRAIN.val, default_split_names(task, recorded.get("sft_data")).val
    return DEFAULT_SPLITS


def evaluate_model_dir(model_path: str | Path | None, data_specs: Sequence[str] | None = None,
                       max_seq_len: int | None = None, batch_size: int = 16, max_batches: int = 0, device: str = "auto",
                       with_samples: bool = False, lora: str | Path | None = None,
                       rope_scaling_factor: float | None = None,
                       control_tokens: bool | None = None) -> dict[str, Any]:
    """Loss/perplexity/bits-per-byte of a model directory (with the LoRA adapter `lora` merged in, when given) on
    each dataset (default: default_splits of the run), in rows of `max_seq_len` tokens (default: the longest rows
    the weights trained on, run_dir.trained_length, else pretraining's default --max_seq_len, times
    `rope_scaling_factor` when given), lowered to the model's max_position_embeddings with a one-line note on
    stderr.

    Returns {"model_path", "lora", "task", "max_seq_len", "results": {name: {path, kind, loss, perplexity,
    bits_per_byte, tokens, bytes}}}, plus "samples" ([{prompt, answer}], see sample_answers) when
    with_samples. max_batches=0 evaluates every batch. control_tokens: whether control-token strings in text files
    are read as the control tokens; None: as the run that wrote the model directory read its text.
    """
    import torch
    from accelerate import Accelerator

    from model.loading import load_model
    from trainer.data import dataset_class
    from trainer.evaluation import evaluate_lm, token_byte_lengths

    path, adapter, _ = locate_model_and_adapter(model_path, lora)
    run_dir = adapter or path  # the last run that trained the weights
    datasets = resolve_data_specs(data_specs or default_splits(run_dir))  # a bad or repeated one before the model
    accelerator = Accelerator(cpu=device == "cpu")  # evaluate_lm moves the batches to its device
    model, tokenizer = load_model(path, device=str(accelerator.device), dtype="float32", lora=adapter)
    apply_rope_scaling_flag(model, path, adapter, rope_scaling_factor)
    asked = "asked"
    if max_seq_len is None:  # the rows the weights trained on, times the extension
        # a model whose runs recorded none (an import): pretraining's rows
        from trainer.arg_fields import task_default

        trained = trained_length(path, adapter) or task_default("pretrain", "max_seq_len")
        max_seq_len = int(trained * (rope_scaling_factor or 1))
        asked = "the default"
    positions = model.config.max_position_embeddings
    if max_seq_len > positions:  # longer rows would be scored at positions the model does not have
        print(f"note: max_seq_len {max_seq_len} ({asked}) lowered to {positions}, the model's "
              "max_position_embeddings: longer rows would be scored past its context", file=sys.stderr)
        max_seq_len = positions
    token_bytes = token_byte_lengths(tokenizer)
    results: dict[str, dict[str, Any]] = {}
    if control_tokens is None:  # as the run read its text (trainer --control_tokens_in_text, recorded with it)
        control_tokens = recorded_config(path).get("control_tokens_in_text") is True
    for name, data_path in datasets:
        kind = detect_kind(data_path)
        options = {"control_tokens": control_tokens} if kind == "pretrain" else {}
        loader = _eval_loader(dataset_class(kind)(data_path, tokenizer, max_seq_len, **options), batch_size,
                              accelerator)
        with torch.inference_mode():
            metrics = evaluate_lm(model, loader, accelerator, token_bytes, max_batches)
        results[name] = {"path": str(data_path), "kind": kind, **metrics.as_dict()}
    report = {"model_path": str(path), "lora": str(adapter) if adapter else None, "task": model_task(adapter or path),
              "max_seq_len": max_seq_len, "results": results}
    if with_samples:  # the model already loaded, on the device asked for
        report["samples"] = [{"prompt": prompt, "answer": answer}
                             for prompt, answer in sample_answers(model, tokenizer, report["task"])]
    return report


def format_table(report: dict[str, Any]) -> str:
    header = f"{'data':<16} {'kind':<9} {'tokens':>10} {'loss':>8} {'ppl':>10} {'bits/byte':>9}"
    rows = [header, "-" * len(header)]
    for name, r in report["results"].items():
        rows.append(f"{name:<16} {r['kind']:<9} {r['tokens']:>10,} {r['loss']:>8.4f} {r['perplexity']:>10.2f} "
                    f"{r['bits_per_byte']:>9.3f}")
    return "\n".join(rows)


def answer_text(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """The text of generated tokens, with each byte that is not part of valid UTF-8 shown as \\xNN rather than as
    U+FFFD: a byte-level model can emit any byte token, and a small one often emits bytes that form no character
    (the start of a 3-byte Chinese character followed by another one's start, a lone continuation byte). Special
    tokens are left out, as decode(skip_special_tokens=True) leaves them out."""
    from dataset.tokenization import token_bytes

    special = set(tokenizer.all_special_ids)
    data = b"".join(token_bytes(tokenizer, [i for i in token_ids if i not in special]))
    return data.decode("utf-8", errors="backslashreplace")


def invalid_byte_count(answer: str) -> int:
    """How many \\xNN escapes answer_text wrote into `answer`."""
    return len(re.findall(r"\\x[0-9a-f]{2}", answer))


def sample_answers(model: Any, tokenizer: Any, task: str | None, prompts: Sequence[str] | None = None,
                   max_new_tokens: int = SAMPLE_TOKENS) -> list[tuple[str, str]]:
    """Greedy (prompt, answer) pairs from a loaded model; SFT models (and unknown tasks) answer through the chat
    template, pretrained ones continue the text. Bytes of the answer that are not valid UTF-8 are shown as \\xNN
    (answer_text). A prompt the model's context cannot hold is a ValueError naming it."""
    from model.chat_session import ChatSession, MessageTooLong
    from model.generation import GenerationEngine, GenerationSettings
    from dataset.shown_value import shown_value

    chat = task is None or is_chat_task(task)  # a model of unknown origin answers through the template
    settings = GenerationSettings(max_new_tokens=max_new_tokens, temperature=0.0)
    engine = GenerationEngine(model, tokenizer, max_batch=1)
    pairs = []
    for prompt in prompts or FIXED_PROMPTS["sft" if chat else "pretrain"]:
        session = ChatSession(model, tokenizer, use_template=chat, history_turns=0, settings=settings,
                              engine=engine)
        try:
            reply = session.reply(prompt)
        except MessageTooLong as error:
            raise ValueError(f"the sample prompt {shown_value(prompt)} {error}; --no_samples leaves the greedy answers "
                             "out") from None
        pairs.append((prompt, answer_text(tokenizer, reply.token_ids).strip()))
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description=__doc__.split("\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    add_model_source_flags(parser)
    parser.add_argument("--data", type=path_arg, nargs="+", default=None,
                        help=f"{' / '.join(NAMED_SPLITS)} or jsonl files (default: {PRETRAIN.val} and the split of "
                        f"conversations the model's run validated on: {SFT_TOOLS.val} for the default SFT, {LORA.val} "
                        f"for the default LoRA, else {SFT.val})")
    parser.add_argument("--max_seq_len", type=int_within(1), default=None,
                        help="tokens per scored row, at most the model's max_position_embeddings (more is "
                        "lowered to it, with a note on stderr; default: the longest rows its weights trained on, "
                        "else pretraining's default --max_seq_len, times --rope_scaling_factor when given)")
    parser.add_argument("--batch_size", type=int_within(1), default=16, help="rows per forward pass")
    parser.add_argument("--max_batches", type=int_within(0, note="0: all"), default=0, help="per dataset; 0: all")
    parser.add_argument("--json", type=output_file, default=None, help="also write the results to this JSON file")
    parser.add_argument("--no_samples", action="store_true", help="skip the fixed prompts' greedy answers")
    parser.add_argument("--device", type=device_type(indexed=False), default="auto",
                        help="auto (a GPU if there is one, placed by Accelerate) or cpu")
    parser.add_argument("--control_tokens_in_text", type=boolean, nargs="?", const=True, default=None,
                        metavar="BOOL", help="read control-token strings in text files (<|im_start|>, ...) as the "
                        "control tokens (default: as the run that wrote the model read its text: a pretraining or "
                        "distillation run's flag; a fine-tuned model's text is text)")
    add_rope_scaling_flag(parser)
    add_threads_flag(parser)
    args = parser.parse_args(argv)
    print(start_threads(args.threads), file=sys.stderr)
    try:
        path, adapter = locate_tool_model(args)
        if args.json:  # before the work: a report written over the model or the data would destroy it
            data = [resolve_input_path(spec) for spec in args.data or () if spec not in NAMED_SPLITS]
            check_report_file(Path(args.json), "--json", path, adapter, data)
        report = evaluate_model_dir(path, args.data, args.max_seq_len, args.batch_size, args.max_batches,
                                    args.device, with_samples=not args.no_samples, lora=adapter,
                                    rope_scaling_factor=args.rope_scaling_factor,
                                    control_tokens=args.control_tokens_in_text)
    except (ModelNotFound, FileNotFoundError, ValueError) as error:
        return report_error(error)
    adapter = f" + LoRA {report['lora']}" if report["lora"] else ""
    print(f"model {report['model_path']}{adapter} (task: {report['task'] or 'unknown'}), max_seq_len "
          f"{report['max_seq_len']}")
    print(format_table(report))
    if "samples" in report:
        print(f"\ngreedy answers (max {SAMPLE_TOKENS} new tokens):")
        for sample in report["samples"]:
            print(f"  {sample['prompt']} -> {sample['answer']}")
        invalid = sum(invalid_byte_count(sample["answer"]) for sample in report["samples"])
        if invalid:
            print(f"  ({invalid} \\xNN: bytes the model emitted that form no UTF-8 character, shown as they are)")
    if args.json:
        out = Path(args.json)
        from dataset.atomic_io import atomic_write_text
        atomic_write_text(out, strict_json(report, indent=2, ensure_ascii=False))
        print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    run_main(main)
