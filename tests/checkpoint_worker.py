"""One process of the two that tests/integration/test_checkpoint_processes.py starts over gloo on CPU: it probes
--out_dir as a run does, trains a small model one step and saves it with trainer/checkpoint.py, then resumes it as a
run does (agree_on_start checks the digests its writer recorded, load_checkpoint loads). Then process 1 changes one
byte of its copy's random_states_1.pkl (size kept) and both resume again, as a new run in that --out_dir would: in
the same launch, which costs more than the whole check. It writes `result_RANK.json` in its working directory: its
rank, what each resume resumed and the note, or the one-line error it stopped with (a file per process: two
processes printing at once share torchrun's stdout, and their lines can interleave).
Process 1 starts its part of the save late on purpose: a writer that hashed its copy before every process had written
its part would hash an incomplete copy."""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script by the launcher

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

from trainer.checkpoint import CHECKPOINT_DIR, agree_on_start, load_checkpoint, save_checkpoint  # noqa: E402
from trainer.distributed import make_accelerator, shutdown  # noqa: E402
from trainer.storage_probe import probe_storage  # noqa: E402

LATE_WRITER_S = 2.0  # how late process 1 starts writing its part of the save
# Under the test's 120 s limit per launch: a process still running then prints every thread's stack to its stderr,
# which the test shows, before the limit kills it.
STACKS_AFTER_S = 90
STATE = {"step": 1, "epoch": 0, "samples_done_in_epoch": 8, "tokens_seen": 64, "total_steps": 2, "processes": 2,
         "run_id": "0123456789ab", "wandb_run_id": None, "train_time_s": 0.1, "budget_fixed": False, "threads": 1,
         "config": {"seed": 0}, "data": {"path": "/d/train.jsonl", "train_samples": 16, "tokens": 128},
         "files": None}


def save_and_resume(args: argparse.Namespace) -> dict:
    accelerator = make_accelerator("float32", 1, use_wandb=False, timeout_s=120)
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    shared = probe_storage(accelerator, args.out_dir, node_local_allowed=True)
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    if rank == 1:
        save_state = accelerator.save_state

        def late_save_state(*given, **named):
            time.sleep(LATE_WRITER_S)
            return save_state(*given, **named)

        accelerator.save_state = late_save_state
    save_checkpoint(accelerator, args.out_dir / CHECKPOINT_DIR, 1, STATE, keep=2, shared_storage=shared)
    result = {"rank": rank, "shared": shared, **resume(accelerator, args.out_dir, shared)}
    if rank == 1:  # its own copy's file: on shared storage the one both read, else node 1's
        damaged = args.out_dir / CHECKPOINT_DIR / "step_00000001" / "random_states_1.pkl"
        data = bytearray(damaged.read_bytes())
        data[-1] ^= 1
        damaged.write_bytes(bytes(data))
    accelerator.wait_for_everyone()
    result["damaged"] = resume(accelerator, args.out_dir, shared)
    return result


def resume(accelerator: Accelerator, out_dir: Path, shared: bool) -> dict:
    """What a run with --resume auto in `out_dir` resumed (and its note), or the one-line error it stopped with."""
    try:
        start = agree_on_start(accelerator, "auto", out_dir, None, shared_storage=shared)
        load_checkpoint(accelerator, start.resume.path, "auto")
        result = {"resumed": str(start.resume.path), "note": start.resume.note}
    except (ValueError, OSError) as error:
        result = {"error": str(error)}
    accelerator.wait_for_everyone()
    return result


def main() -> None:
    faulthandler.dump_traceback_later(STACKS_AFTER_S, exit=False)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out_dir", type=Path, required=True, help="this process's run directory")
    result = save_and_resume(parser.parse_args())
    Path(f"result_{result['rank']}.json").write_text(json.dumps(result))
    shutdown()  # as the trainer ends: the model (and its DDP reducer) gone first, then the process group


if __name__ == "__main__":
    main()
