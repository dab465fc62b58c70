"""A run's outcome: `RunSummary` (what run_summary.json records and `Trainer.run` returns), `TrainingDiverged` (a
non-finite loss, gradient or rollout's sampling scores; the last good state saved), the summary written atomically,
its closing 'done:' line, and the summary of the very run `--resume auto` asks for again once it has finished."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from tqdm.auto import tqdm

from dataset.atomic_io import atomic_write_text
from dataset.json_text import strict_json
from trainer.arg_fields import TrainArgs
from trainer.machine import machine_line
from trainer.resume_checks import finished_run_asked_again
from trainer.run_dir import CHECKPOINT_DIR, OVERWRITE_FLAG, SUMMARY_FILE, code_version, list_checkpoints
from trainer.step import NON_FINITE_LOSS


class TrainingDiverged(RuntimeError):
    """The loss (or, without fp16 loss scaling, the gradient) became NaN/inf, or (`cause` NON_FINITE_SAMPLING) the
    logits a rollout samples from did; the last good state was saved."""

    def __init__(self, step: int, checkpoint: Path, cause: str = NON_FINITE_LOSS,
                 multipliers_set: Sequence[str] = ()) -> None:
        # the loss multipliers set away from their defaults (arg_fields.loss_multipliers_set): where to look first
        set_away = (f"; loss multipliers set away from their defaults: {', '.join(multipliers_set)}"
                    if multipliers_set else "")
        super().__init__(f"training diverged at optimizer step {step} ({cause}); "
                         f"the last good state is saved in {checkpoint}{set_away}")
        self.step, self.checkpoint = step, checkpoint


@dataclass
class RunSummary:
    status: str                    # "finished" or "diverged"
    out_dir: str
    steps: int
    tokens_seen: int
    num_params: int
    final_val: dict[str, float] = field(default_factory=dict)
    median_step_time_s: float = float("nan")
    tokens_per_s: float = float("nan")
    mfu: float = float("nan")
    wall_time_s: float = float("nan")
    sample: str = ""
    # Where and with what code the run was made: the CPU (model and bf16/AMX flags) or GPU, torch, threads and date,
    # and the commit. Runs compared across sessions need both: bf16 kernels differ between CPUs, and a change of
    # rounding alone (torch's fused AdamW for its foreach one) moved a 1200-step study trial by 0.01 nats.
    machine: str = field(default_factory=machine_line)
    code: str = field(default_factory=code_version)

    def done_line(self, final_val: str) -> str:
        """The finished run's closing line; `final_val`: its final evaluation described."""
        return (f"done: {self.steps} steps, {self.tokens_seen:,} tokens in {self.wall_time_s:.0f} s; {final_val}; "
                f"median step {self.median_step_time_s * 1000:.0f} ms, {self.tokens_per_s:,.0f} tok/s, "
                f"MFU {self.mfu:.1%}")


def write_run_summary(out_dir: Path, summary: RunSummary) -> None:
    """run_summary.json, strict JSON (a non-finite number is null), written atomically: the last of a run's results
    (the main process writes it)."""
    atomic_write_text(out_dir / SUMMARY_FILE, strict_json(summary.__dict__, indent=2))


def finished_run_summary(accelerator: Accelerator, out_dir: Path, args: TrainArgs) -> RunSummary | None:
    """`--resume auto` asking again for the very run that finished in --out_dir (the same flags): nothing is left
    to train, and its model stays as it is; that run's summary (its line printed), or None. Collective: the main
    process decides (a run on storage of each machine's own keeps its summary on the main one)."""
    is_main = accelerator.is_main_process
    summary = finished_run_asked_again(out_dir, args) if is_main and args.resume == "auto" else {}
    if accelerator.num_processes > 1:
        summary = broadcast_object_list([summary])[0]
    if not summary:
        return None
    if is_main:
        checkpoints = list_checkpoints(out_dir / CHECKPOINT_DIR)
        loss = summary.get("final_val", {}).get("loss")
        tqdm.write(f"--resume auto: {out_dir} holds this run, finished ({summary['steps']} steps"
                   + (f", val loss {loss:.4f}" if isinstance(loss, float) else "") + "): nothing left to train, "
                   "its model stays as it is; "
                   + (f"a larger --max_steps trains it on from {CHECKPOINT_DIR}/{checkpoints[-1].name}, "
                      if checkpoints and not args.time_budget_s else "")
                   + f"{OVERWRITE_FLAG} trains it anew")
    return RunSummary(**{name: summary[name] for name in RunSummary.__dataclass_fields__ if name in summary})
