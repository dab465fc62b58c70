"""What recording and verifying a checkpoint's file digests costs (trainer/checkpoint_state.py's, which
trainer/checkpoint.py's save records): the median time of `save_checkpoint` as it ships (the writer hashes every
file it wrote, once all are written) against the same save with the hashing stubbed out, interleaved save by save so
that drifting machine load hits both alike, and the median time of the resume's check (`verify_digests`) of one saved
checkpoint; per model shape (a preset).

    python eval/benchmarks/bench_checkpoint.py                                # cpu-wide and minimind-26m, 7 rounds
    python eval/benchmarks/bench_checkpoint.py --presets minimind-26m --rounds 11 --dir /mnt/disk/tmp

The model has its AdamW moments (one optimizer step taken), fp32, on one CPU process, as a pretraining run's
checkpoint holds them. Saves go to a temporary folder under --dir (a disk, not tmpfs, to be honest about writes).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `import model...` work from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

import trainer.checkpoint as checkpoint  # noqa: E402
import trainer.checkpoint_state as checkpoint_state  # noqa: E402
from model.config import PRESETS, MiniNormConfig  # noqa: E402
from model.model import MiniNormForCausalLM  # noqa: E402
from dataset.atomic_io import check_folder_path, make_dirs  # noqa: E402
from dataset.shown_value import shown_value  # noqa: E402
from trainer.cli import MAX_COUNT, ToolParser, int_within, run_main  # noqa: E402
from trainer.machine import machine_line  # noqa: E402

STATE = {"step": 1, "epoch": 0, "samples_done_in_epoch": 8, "tokens_seen": 2048, "config": {}}


def _no_digests(folder: Path, names: list[str]) -> dict[str, dict[str, int | str]]:
    return {name: {"bytes": 0, "sha256": "0" * 64} for name in names}


def measure(preset: str, rounds: int, folder: Path) -> dict[str, float]:
    """Median seconds of a save with digests, of one without, and of verifying one saved checkpoint; its size."""
    torch.manual_seed(0)
    model = MiniNormForCausalLM(MiniNormConfig(**PRESETS[preset]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, model.config.vocab_size, (1, 16)), labels=torch.randint(0, 100, (1, 16))).loss.backward()
    optimizer.step()
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    hashing = checkpoint.file_digests
    times: dict[str, list[float]] = {"with": [], "without": [], "verify": []}
    step = 0
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        root = Path(tmp) / "checkpoints"
        for round_ in range(rounds + 1):  # the first round warms up (file system, allocator), untimed
            for mode in (("with", "without") if round_ % 2 else ("without", "with")):
                checkpoint.file_digests = hashing if mode == "with" else _no_digests
                step += 1
                started = time.perf_counter()
                saved = checkpoint.save_checkpoint(accelerator, root, step, {**STATE, "step": step}, keep=1)
                elapsed = time.perf_counter() - started
                checkpoint.file_digests = hashing
                if mode == "with":
                    digests = checkpoint_state.read_trainer_state(saved)[checkpoint_state.DIGESTS_KEY]
                    started = time.perf_counter()
                    assert checkpoint_state.verify_digests(saved, digests) is None
                    verify = time.perf_counter() - started
                if round_:
                    times[mode].append(elapsed)
                    if mode == "with":
                        times["verify"].append(verify)
        size = sum(entry["bytes"] for entry in digests.values())
    return {**{mode: statistics.median(values) for mode, values in times.items()}, "bytes": size}


def main(argv: list[str] | None = None) -> None:
    parser = ToolParser(description=__doc__)
    parser.add_argument("--presets", default="cpu-wide,minimind-26m",
                        help=f"comma-separated model shapes: {', '.join(PRESETS)}")
    parser.add_argument("--rounds", type=int_within(1, MAX_COUNT), default=7, help="timed saves per mode and preset")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="folder under which the checkpoints are written (and removed)")
    args = parser.parse_args(argv)
    presets = args.presets.split(",")
    for preset in presets:
        if preset not in PRESETS:
            parser.error(f"--presets: {shown_value(preset)} is not allowed; choose from {', '.join(PRESETS)}")
    try:  # a file in the way, no permission: refused now; a folder not there yet is made, as an --out_dir is
        check_folder_path(args.dir, "--dir")
        make_dirs(args.dir)
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(1)
    print(machine_line())
    print("| preset | checkpoint MB | save, digests (s) | save, none (s) | hashing share | verify at resume (s) |")
    print("|---|---|---|---|---|---|")
    for preset in presets:
        result = measure(preset, args.rounds, args.dir)
        share = (result["with"] - result["without"]) / result["without"]
        print(f"| {preset} | {result['bytes'] / 1e6:.1f} | {result['with']:.3f} | {result['without']:.3f} | "
              f"{share:+.0%} | {result['verify']:.3f} |", flush=True)


if __name__ == "__main__":
    run_main(main)
