"""The run's reporting component: the progress bar, metrics.jsonl and wandb.

The loop hands it every step's result; it decides what is logged when: every step's record goes to metrics.jsonl,
and every `log_interval` steps (and at the last step) the window's mean loss, throughput, MFU and the objective's
statistics go to the progress bar and to wandb, each statistic taken over the window's steps as the objective
declares (`stat_windows`: a minimum's the least, a mean defined on only some steps the mean over those). Only the
main process writes or prints.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from tqdm.auto import tqdm

from trainer.flops import model_flops_utilization
from trainer.metrics_log import MetricsLog
from trainer.objectives import EvalResult, Objective
from trainer.run_dir import FINAL_PREFIX
from trainer.step import RunPosition, StepResult, window_stats


class TrainingReporter:
    def __init__(self, accelerator: Accelerator, objective: Objective, out_dir: Path, *, task: str,
                 log_interval: int, use_wandb: bool, flops_per_token: float, peak_flops: float | None,
                 current_lrs: Callable[[], dict[str, float]]) -> None:
        self.accelerator = accelerator
        self.is_main = accelerator.is_main_process
        self.objective = objective
        self.metrics = MetricsLog(out_dir, enabled=self.is_main)
        self.task = task
        self.log_interval = log_interval
        self.use_wandb = use_wandb
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.current_lrs = current_lrs  # the optimizer's learning rates now (after the step's scheduler update)
        self.progress: tqdm | None = None
        self.window: list[StepResult] = []  # the steps since the last interval log

    def mfu(self, tokens_per_s: float) -> float:
        return model_flops_utilization(tokens_per_s, self.flops_per_token, self.peak_flops)

    def print(self, text: str) -> None:
        if self.is_main:
            tqdm.write(text)

    def log(self, record: dict[str, Any], to_tracker: bool = True) -> None:
        """A metrics.jsonl record (with its step and split), also sent to wandb when `to_tracker`."""
        self.metrics.write(record)
        if to_tracker and self.use_wandb:
            # Keys go to wandb as they are ("val_loss", "diag/..."): a wandb sweep's metric is "val_loss".
            self.accelerator.log({k: v for k, v in record.items() if k not in ("step", "split")},
                                 step=record["step"])

    def start(self, resumed_at: int | None, total_steps: int) -> None:
        """Continue the metrics file of a run resumed at step `resumed_at` (its later records are dropped), or start
        a new one; open the progress bar."""
        if resumed_at is None:
            self.metrics.reset()
        else:
            self.metrics.truncate_after(resumed_at, ends_there=resumed_at >= total_steps)
        self.progress = tqdm(total=total_steps, initial=resumed_at or 0, disable=not self.is_main,
                             dynamic_ncols=True, desc=self.task)

    def set_length(self, total_steps: int) -> None:
        self.progress.total = total_steps
        self.progress.refresh()

    def after_step(self, position: RunPosition, result: StepResult, total_steps: int) -> None:
        step, lrs = position.step, self.current_lrs()
        record = {"step": step, "split": "train", "loss": result.loss, **result.stats, **lrs,
                  "grad_norm": result.grad_norm, "tokens_seen": position.tokens_seen, "step_time_s": result.time_s}
        if result.outcome == "skipped":
            record["skipped"] = True  # fp16 gradient overflow: no update, the scaler lowered its scale
        self.log(record, to_tracker=False)
        if result.diagnostics:
            self.log({"step": step, "split": "diag", **result.diagnostics})
        self.progress.update(1)
        self.window.append(result)
        if step % self.log_interval == 0 or step == total_steps:
            self._log_window(position, result, lrs["lr"])
            self.window = []

    def _log_window(self, position: RunPosition, last: StepResult, lr: float) -> None:
        tokens_per_s = sum(r.tokens for r in self.window) / max(sum(r.time_s for r in self.window), 1e-9)
        mfu = self.mfu(tokens_per_s)
        loss = statistics.fmean(r.loss for r in self.window)
        stats = window_stats(self.window, self.objective.stat_names, self.objective.stat_windows)
        self.progress.set_postfix(loss=f"{loss:.3f}",
                                  **{label: f"{stats[name]:.3f}"
                                     for name, label in self.objective.progress_labels.items()},
                                  lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", mfu=f"{mfu:.1%}")
        if self.use_wandb:
            self.accelerator.log({"train/loss": loss, "train/lr": lr, "train/grad_norm": last.grad_norm,
                                  "train/tokens_per_s": tokens_per_s, "train/mfu": mfu,
                                  "train/tokens_seen": position.tokens_seen,
                                  **{f"train/{name}": value for name, value in stats.items()}},
                                 step=position.step)

    def log_eval(self, step: int, result: EvalResult) -> None:
        self.log({"step": step, "split": "val", **result.logged()})
        self.print(f"step {step}: {result.describe()}")

    def log_final(self, step: int, result: EvalResult, tokens_per_s: float) -> None:
        self.log_eval(step, result)
        if self.use_wandb:
            self.accelerator.log({**{FINAL_PREFIX + name: value for name, value in result.logged().items()},
                                  FINAL_PREFIX + "tokens_per_s": tokens_per_s}, step=step)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
