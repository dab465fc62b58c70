"""Our pretraining trainer against MiniMind's own (`trainer/train_pretrain.py` of a checkout of its public
repository, run as it is, never copied) on the same device, the same text and the same model width and depth:
real (unpadded) tokens per second of training, the two runs one after the other in one invocation.

    python eval/benchmarks/bench_vs_minimind.py --minimind_dir ../minimind                  # GPU: minimind-26m
    python eval/benchmarks/bench_vs_minimind.py --minimind_dir ../minimind --preset cpu-default --steps 40 --warmup 10 \
        --batch_size 4 --seq_len 256 --minimind_device cpu

The text is the embedded corpus's pretraining split or --data_path (`{"text": ...}` lines, the format MiniMind reads;
ours splits its validation lines off a --data_path, as its trainer does without --val_data_path). MiniMind pads
every document to --seq_len and masks the padding out of its loss, so its real tokens per step are the batch's
unpadded tokens, counted with its own tokenizer and truncation (bos + text + eos, at most --seq_len); ours packs
documents, so every token is real. Both run --steps optimizer steps of --batch_size sequences of --seq_len tokens
(MiniMind with --accumulation_steps 1: one optimizer step per batch, as ours; its AdamW, our pretraining default,
Muon) in bf16 autocast on CUDA; throughput is
counted over the steps after --warmup (compilation, allocator and loader warm-up left out), from the wall clock
between MiniMind's log lines (every --log_interval steps; the loss's `.item()` there synchronizes the device) and
from our trainer's per-step times (loading the batch included; the loss's `.item()` synchronizes each step).
MiniMind's flags fix width and depth only: its attention heads, key/value heads and MLP width are its defaults, so
the table gives both models' parameter counts."""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import argparse  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from dataset.atomic_io import atomic_write_text, check_output_file, make_dirs  # noqa: E402
from dataset.building import MIN_SEQ_LEN  # noqa: E402
from dataset.corpus import ensure_default_corpus  # noqa: E402
from dataset.json_text import strict_json  # noqa: E402
from dataset.jsonl import iter_records  # noqa: E402
from model.config import MAX_SIZE, MiniNormConfig  # noqa: E402
from trainer.cli import (MAX_COUNT, RawDescriptionDefaultsHelpFormatter, ToolParser, int_within,  # noqa: E402
                         output_file, output_folder, run_main)
from trainer.machine import machine_line  # noqa: E402
from trainer.run_dir import read_metrics, read_summary, resolve_input_path  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
# MiniMind's progress line: "Epoch:[1/1](20/471), loss: 7.1234, ..." (step counts micro-batches).
MINIMIND_LOG = re.compile(r"\((\d+)/(\d+)\), loss: ([0-9.]+)")
MINIMIND_PARAMS = re.compile(r"Trainable Params: ([0-9.]+)M")


def minimind_real_tokens_per_sample(minimind_dir: Path, data_path: Path, seq_len: int) -> float:
    """Mean unpadded tokens of one MiniMind pretraining sample: bos + the text truncated to seq_len - 2 + eos."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(minimind_dir / "model"))
    # the trainer's reader (a leading byte order mark read past, a bad line named), not the metrics reader, which
    # skips an unreadable line: the mean must count the lines both trainers train on
    texts = [record["text"] for _, record, _ in iter_records(data_path, "text")]
    ids = tokenizer(texts, add_special_tokens=False, max_length=seq_len - 2, truncation=True)["input_ids"]
    return sum(len(x) + 2 for x in ids) / len(ids)


def run_minimind(minimind_dir: Path, data_path: Path, args: argparse.Namespace, scratch: Path) -> dict:
    """Run MiniMind's pretraining script until it has logged step --steps; time-stamp its progress lines."""
    config = MiniNormConfig.from_preset(args.preset)
    command = [sys.executable, "train_pretrain.py", "--data_path", str(data_path), "--save_dir", str(scratch),
               "--epochs", "1", "--batch_size", str(args.batch_size), "--max_seq_len", str(args.seq_len),
               "--hidden_size", str(config.hidden_size), "--num_hidden_layers", str(config.num_hidden_layers),
               "--accumulation_steps", "1", "--log_interval", str(args.log_interval),
               "--save_interval", str(10**9), "--dtype", "bfloat16"]
    if args.minimind_device:
        command += ["--device", args.minimind_device]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    marks: list[tuple[float, int, float]] = []  # (seconds, step, loss)
    params = float("nan")
    log_lines: list[str] = []
    started = time.perf_counter()
    with subprocess.Popen(command, cwd=minimind_dir / "trainer", env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.perf_counter() - started
            log_lines.append(f"[{now:8.2f} s] {line.rstrip()}")
            if found := MINIMIND_PARAMS.search(line):
                params = float(found.group(1))
            if found := MINIMIND_LOG.search(line):
                marks.append((now, int(found.group(1)), float(found.group(3))))
                if marks[-1][1] >= args.steps:
                    break
        proc.terminate()  # its loader workers end with it
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
    atomic_write_text(args.log_dir / "minimind_log.txt", "\n".join(log_lines) + "\n")
    timed = [mark for mark in marks if mark[1] >= args.warmup]
    if len(timed) < 2:
        raise SystemExit(f"MiniMind's trainer logged {len(marks)} progress lines (need two at or after step "
                         f"{args.warmup}); its output is in {args.log_dir / 'minimind_log.txt'}")
    (t0, s0, _), (t1, s1, loss) = timed[0], timed[-1]
    return {"steps_per_s": (s1 - s0) / (t1 - t0), "last_step": s1, "last_loss": loss, "params_m": params,
            "wall_s": time.perf_counter() - started}


def run_ours(args: argparse.Namespace, scratch: Path) -> dict:
    """Run our pretraining script for --steps optimizer steps; read the per-step times it recorded."""
    out_dir = scratch / "ours"
    data = ["--data_path", str(args.data_path)] if args.data_path else []  # none: the embedded corpus, as MiniMind's
    command = [sys.executable, str(REPO_ROOT / "trainer" / "train_pretrain.py"), "--preset", args.preset,
               "--batch_size", str(args.batch_size), "--max_seq_len", str(args.seq_len),
               "--max_steps", str(args.steps), "--eval_interval", str(10**9), "--save_interval", str(10**9),
               "--out_dir", str(out_dir), *data, *args.ours_args]
    started = time.perf_counter()
    with open(args.log_dir / "ours_log.txt", "w") as log:  # written as it runs: a run cut short leaves its log
        returncode = subprocess.run(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if returncode != 0:
        raise SystemExit(f"our trainer failed (exit {returncode}); its output is in {args.log_dir / 'ours_log.txt'}")
    records = read_metrics(out_dir, "train")
    timed = [r for r in records if r["step"] > args.warmup]
    tokens = timed[-1]["tokens_seen"] - records[len(records) - len(timed) - 1]["tokens_seen"]
    seconds = sum(r["step_time_s"] for r in timed)
    summary = read_summary(out_dir)
    return {"tokens_per_s": tokens / seconds, "steps_per_s": len(timed) / seconds, "last_loss": timed[-1]["loss"],
            "params_m": summary.get("num_params", float("nan")) / 1e6, "wall_s": time.perf_counter() - started}


def build_parser() -> ToolParser:
    parser = ToolParser(description=__doc__, formatter_class=RawDescriptionDefaultsHelpFormatter)
    parser.add_argument("--minimind_dir", type=Path, required=True,
                        help="a checkout of MiniMind's repository (its trainer/, model/ and dataset/ as published)")
    parser.add_argument("--preset", default="minimind-26m", help="our model preset; MiniMind gets its width and depth")
    parser.add_argument("--batch_size", type=int_within(1, MAX_SIZE), default=32,
                        help="sequences per optimizer step, both trainers")
    parser.add_argument("--seq_len", type=int_within(MIN_SEQ_LEN, MAX_SIZE), default=512,
                        help="tokens per sequence, both trainers")
    parser.add_argument("--steps", type=int_within(1, MAX_COUNT), default=200, help="optimizer steps each trainer runs")
    parser.add_argument("--warmup", type=int_within(0, MAX_COUNT), default=20, help="steps left out of the throughput")
    parser.add_argument("--log_interval", type=int_within(1, MAX_COUNT), default=10,
                        help="MiniMind's --log_interval (its time marks)")
    parser.add_argument("--data_path", type=Path, default=None,
                        help="the text both trainers read, {\"text\": ...} jsonl lines (default: the embedded corpus's "
                             "pretraining split)")
    parser.add_argument("--minimind_device", default=None,
                        help="MiniMind's --device (default: its own default, cuda:0 when CUDA is there)")
    parser.add_argument("--ours_args", nargs=argparse.REMAINDER, default=[],
                        help="further flags for our trainer, last on the line (e.g. --ours_args --compile on)")
    parser.add_argument("--log_dir", type=output_folder, default=".",
                        help="where both trainers' logs are written (minimind_log.txt, ours_log.txt); relative to the "
                             "repo root")
    parser.add_argument("--json", type=output_file, default=None, help="also write the results as JSON here")
    return parser


def validate_args(parser: ToolParser, args: argparse.Namespace) -> None:
    """A parser error for too few steps or a missing MiniMind trainer or --data_path; the paths made absolute
    (MiniMind runs in its own trainer/ folder) and --log_dir created."""
    if args.steps < args.warmup + 2 * args.log_interval:
        parser.error("--steps must leave at least two of MiniMind's log lines after --warmup")
    # inputs from here, else from the repo root, as every tool's
    args.minimind_dir = resolve_input_path(args.minimind_dir)
    args.data_path = resolve_input_path(args.data_path) if args.data_path else None
    if not (args.minimind_dir / "trainer" / "train_pretrain.py").is_file():
        parser.error(f"--minimind_dir {args.minimind_dir}: no trainer/train_pretrain.py there")
    args.minimind_dir = args.minimind_dir.resolve()
    if args.data_path:
        if not args.data_path.is_file():
            parser.error(f"--data_path {args.data_path}: no such file")
        args.data_path = args.data_path.resolve()  # MiniMind runs in its own trainer/ folder
    try:  # both trainers run for minutes first: a --json or --log_dir that cannot be written is refused now
        if args.json is not None:
            check_output_file(Path(args.json), "--json", [("--data_path", args.data_path)] if args.data_path else [])
        args.log_dir = Path(args.log_dir)  # under the repo root, checked as parsed (output_folder)
        make_dirs(args.log_dir)
    except ValueError as error:
        parser.error(str(error))


def print_table(args: argparse.Namespace, text: str, per_sample: float, minimind: dict, ours: dict) -> None:
    """The two runs' throughput in one markdown table, under a line naming the machine, the shape and the text."""
    print(f"# Pretraining throughput, ours vs MiniMind's trainer: {machine_line()}\n")
    print(f"{args.preset} width and depth, batch {args.batch_size} x {args.seq_len}, {args.steps} steps each "
          f"(the first {args.warmup} not timed), text: {text}; MiniMind's samples "
          f"hold {per_sample:.0f} real tokens of {args.seq_len} on average\n")
    print("| trainer | parameters | steps/s | real tokens/s | padded tokens/s | vs MiniMind (real tokens/s) | "
          "loss at the last step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| MiniMind `trainer/train_pretrain.py` | {minimind['params_m']:.1f}M | {minimind['steps_per_s']:.2f} | "
          f"{minimind['tokens_per_s']:,.0f} | {minimind['padded_tokens_per_s']:,.0f} | 1.00x | "
          f"{minimind['last_loss']:.3f} |")
    print(f"| MiniNorm `trainer/train_pretrain.py` | {ours['params_m']:.1f}M | {ours['steps_per_s']:.2f} | "
          f"{ours['tokens_per_s']:,.0f} | (packed: all real) | {ours['tokens_per_s'] / minimind['tokens_per_s']:.2f}x "
          f"| {ours['last_loss']:.3f} |")
    print("\n(losses are per token of different tokenizers and data orders: not comparable with each other)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    validate_args(parser, args)
    data_path = args.data_path or ensure_default_corpus(quiet=True).pretrain_train
    text = str(args.data_path) if args.data_path else "the embedded corpus's pretraining split"
    per_sample = minimind_real_tokens_per_sample(args.minimind_dir, data_path, args.seq_len)
    with tempfile.TemporaryDirectory() as scratch:
        minimind = run_minimind(args.minimind_dir, data_path, args, Path(scratch))
        ours = run_ours(args, Path(scratch))
    minimind["tokens_per_s"] = minimind["steps_per_s"] * args.batch_size * per_sample
    minimind["padded_tokens_per_s"] = minimind["steps_per_s"] * args.batch_size * args.seq_len
    print_table(args, text, per_sample, minimind, ours)
    if args.json:
        record = {"machine": machine_line(), "args": {k: str(v) for k, v in vars(args).items()},
                  "minimind_tokens_per_sample": per_sample, "minimind": minimind, "ours": ours}
        atomic_write_text(args.json, strict_json(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    run_main(main)
