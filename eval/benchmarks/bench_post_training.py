"""Post-training memory and speed: SFT, LoRA and DPO steps of the same model on the same conversations, side by side.

Each configuration runs the real trainer (trainer/core.py, `--max_steps`, fp32, no compile) in its own process on a
model of `--preset` with fresh weights (memory and step time do not depend on the weights' values), and reports
the process's peak memory -- peak resident set size on CPU, peak allocated CUDA memory on a GPU -- and the median
optimizer-step time. The rows share one data set: the embedded DPO pairs (dataset/post_training_data.py), whose
chosen conversations are the SFT and LoRA data, so

    sft     batch B conversations               lora    the same, base frozen, adapters of --lora_rank
    sft x2  batch 2B: chosen and rejected       dpo     batch B pairs = the 2B rows of `sft x2`, plus the
            (the rows a DPO step runs)                  frozen reference model's forward pass over them

A `load only` row (python, torch, the model loaded and one forward pass) is the floor every run stands on.

    python eval/benchmarks/bench_post_training.py                         # minimind-26m, batch 4, 256 tokens
    python eval/benchmarks/bench_post_training.py --preset cpu-default --steps 6 --batch_size 8
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

from model.config import PRESETS  # noqa: E402
from trainer.cli import MAX_COUNT, ToolParser, int_within, run_main  # noqa: E402
from trainer.run_dir import CONFIG_FILE, REPO_ROOT, SUMMARY_FILE, read_summary  # noqa: E402

# Runs in the child process: the trainer (or just the model, for "load"), then the peak memory as JSON.
CHILD = """
import json, sys, resource
sys.path.insert(0, {repo!r})
import torch
task, argv = {task!r}, {argv!r}
if task == "load":
    from model.loading import load_model
    model, tokenizer = load_model(__import__("pathlib").Path({model!r}), dtype="float32")
    with torch.no_grad():
        model(input_ids=torch.ones(1, 16, dtype=torch.long, device=model.device))
else:
    from trainer.command import main
    main(task, argv)
if torch.cuda.is_available():
    peak = torch.cuda.max_memory_allocated()
else:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("PEAK " + json.dumps(peak))
"""


def fresh_model(root: Path, preset: str) -> Path:
    """A model of `preset` with fresh weights, saved as the trainer saves an SFT model."""
    import yaml

    from dataset.tokenization import load_tokenizer
    from model import MiniNormConfig, MiniNormForCausalLM
    from trainer.export import save_model_dir

    tokenizer = load_tokenizer()
    config = MiniNormConfig.from_preset(preset, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                        eos_token_id=tokenizer.eos_token_id)
    path = root / f"{preset}-fresh"
    save_model_dir(MiniNormForCausalLM(config), tokenizer, path)
    (path / CONFIG_FILE).write_text(yaml.safe_dump({"task": "sft"}))
    return path


def write_data(root: Path, pairs: int) -> dict[str, Path]:
    """The first `pairs` embedded DPO pairs, and their conversations as SFT files (chosen; chosen and rejected)."""
    from dataset.post_training_data import ensure_post_training_data

    lines = ensure_post_training_data().dpo_train.read_text(encoding="utf-8").splitlines()[:pairs]
    records = [json.loads(line) for line in lines]
    files = {"dpo": root / "dpo.jsonl", "sft": root / "sft.jsonl", "sft x2": root / "sft_x2.jsonl"}
    files["dpo"].write_text("\n".join(lines) + "\n", encoding="utf-8")
    files["sft"].write_text("".join(json.dumps({"conversations": r["chosen"]}) + "\n" for r in records))
    files["sft x2"].write_text("".join(json.dumps({"conversations": r[side]}) + "\n"
                                       for r in records for side in ("chosen", "rejected")))
    return files


# SFT gives a model without smeared keys its keys by default, and with them 8 copy rows beside each micro-batch
# (trainer/arg_fields.py, resolve_copy_rows); LoRA and DPO add neither. Off here, so the sft rows are the B (or 2B)
# conversations that the lora and dpo rows run, as the comparison needs.
SFT_AS_LORA_AND_DPO = ["--smeared_keys", "false"]


def configurations(files: dict[str, Path], batch_size: int,
                   lora_rank: int) -> list[tuple[str, str, Path, int, list[str]]]:
    """(row name, trainer task, data file, batch size, extra flags) of each run after `load only`."""
    return [("sft", "sft", files["sft"], batch_size, SFT_AS_LORA_AND_DPO),
            ("sft x2", "sft", files["sft x2"], 2 * batch_size, SFT_AS_LORA_AND_DPO),
            ("lora", "lora", files["sft"], batch_size, ["--lora_rank", str(lora_rank)]),
            ("dpo", "dpo", files["dpo"], batch_size, [])]


def run(name: str, task: str, argv: list[str], model: Path) -> dict:
    code = CHILD.format(repo=str(REPO_ROOT), task=task, argv=argv, model=str(model))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    peaks = [line for line in done.stdout.splitlines() if line.startswith("PEAK ")]
    refusals = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    if done.returncode == 2 and refusals:  # the trainer refused its input (e.g. a --max_seq_len that cuts every answer)
        raise SystemExit(f"error: the {name} run: {refusals[-1].removeprefix('error: ')}")
    if done.returncode != 0 or not peaks:
        raise RuntimeError(f"{name} failed ({done.returncode}): {done.stderr[-3000:]}")
    return {"name": name, "peak_bytes": json.loads(peaks[-1][5:])}


def main(argv: list[str] | None = None) -> None:
    parser = ToolParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="minimind-26m", choices=list(PRESETS),
                        help="model preset (model/config.py)")
    parser.add_argument("--batch_size", type=int_within(1), default=4,
                        help="B: conversations (SFT, LoRA) or pairs (DPO)")
    parser.add_argument("--max_seq_len", type=int_within(1), default=256,
                        help="tokens per conversation (longer ones are cut)")
    parser.add_argument("--steps", type=int_within(1, MAX_COUNT), default=4,
                        help="optimizer steps of each configuration")
    parser.add_argument("--lora_rank", type=int_within(1), default=8, help="rank of the LoRA configuration's adapters")
    args = parser.parse_args(argv)
    import torch

    from trainer.machine import machine_line

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = fresh_model(root, args.preset)
        files = write_data(root, pairs=args.batch_size * args.steps + 8)
        common = ["--from_weight", str(model), "--max_steps", str(args.steps), "--max_seq_len", str(args.max_seq_len),
                  "--dtype", "float32", "--compile", "off", "--eval_interval", "100000", "--save_interval",
                  "100000", "--warmup_steps", "0", "--val_fraction", "0.2", "--eval_batches", "1"]
        rows = [run("load only", "load", [], model)]
        for name, task, data, batch, extra in configurations(files, args.batch_size, args.lora_rank):
            out_dir = root / name.replace(" ", "_")
            row = run(name, task, ["--data_path", str(data), "--out_dir", str(out_dir), "--batch_size", str(batch),
                                   *common, *extra], model)
            median = read_summary(out_dir).get("median_step_time_s")  # null: no step was timed
            row["median_step_s"] = float("nan") if median is None else median
            rows.append(row)
    memory = "peak CUDA memory allocated" if torch.cuda.is_available() else "peak resident memory (RSS)"
    print(f"{args.preset}, B = {args.batch_size}, max_seq_len {args.max_seq_len}, fp32, {args.steps} steps, on "
          f"{machine_line()}; {memory}; step times are medians ({SUMMARY_FILE})")
    floor = rows[0]["peak_bytes"]
    print(f"{'run':<10} {'peak MiB':>9} {'over load':>10} {'vs sft':>7} {'median step s':>14}")
    sft_over = next(r["peak_bytes"] for r in rows if r["name"] == "sft") - floor
    for row in rows:
        over = row["peak_bytes"] - floor
        ratio = f"{over / sft_over:.2f}x" if row["name"] != "load only" and sft_over > 0 else ""
        step = f"{row['median_step_s']:.2f}" if "median_step_s" in row else ""
        print(f"{row['name']:<10} {row['peak_bytes'] / 2**20:>9.0f} {over / 2**20:>10.0f} {ratio:>7} {step:>14}")


if __name__ == "__main__":
    run_main(main)
