"""What a session says and writes as its loop starts: where it starts (a resumed checkpoint's position, with what
changed since, or a fresh run), train_config.yaml, and the announcement (the machine, the data, the model's size,
the run's length and the effective config). trainer/core.py's `Trainer._start` calls these in that order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from accelerate import Accelerator

from dataset.atomic_io import atomic_write_text
from trainer.arg_fields import TrainArgs
from trainer.checkpoint import ResumePoint
from trainer.checkpoint_state import saved_position
from trainer.data import RunData, control_text_note, dataset_stats, supervision_cut_note
from trainer.distributed import update_inside_backward
from trainer.resume_checks import changed_flags
from trainer.run_dir import CHECKPOINT_DIR, CONFIG_FILE, ROLLOUT_TASKS, RUN_ID_KEY
from trainer.step import RunPosition


def start_position(resume: ResumePoint | None, args: TrainArgs, out_dir: Path, train_size: int,
                   config_dict: dict[str, Any], total_steps: int) -> tuple[RunPosition, list[str]]:
    """Where this session starts, and the lines that say so: the resumed checkpoint's position (its states were
    loaded at set-up), what changed since it, and whether anything is left to train; or a fresh run."""
    if resume is None:
        fresh = [f"--resume auto: no checkpoint in {out_dir / CHECKPOINT_DIR}; starting fresh"]
        return RunPosition(), fresh if args.resume == "auto" else []
    state = resume.state
    epoch, samples_done = saved_position(state)
    position = RunPosition(state["step"], epoch, samples_done, state["tokens_seen"])
    lines = [f"resumed from {resume.path} at optimizer step {position.step} (epoch {epoch}, sample {samples_done} of "
             f"{train_size})" + (f"; {resume.note}" if resume.note else "")]
    if changed := changed_flags(state, config_dict):  # a resume that changes the schedule says so
        lines.append(f"changed since the checkpoint: {changed}; the run goes on with the new values")
    if position.step == total_steps:  # check_resume_length allows it: the run ends at its checkpoint
        lines.append(f"the run's length is the checkpoint's step ({position.step}): nothing left to train; the run "
                     f"ends there, with its final evaluation and model")
    return position, lines


def write_run_config(out_dir: Path, config_dict: dict[str, Any], run_id: str) -> None:
    """train_config.yaml: the effective config with the run's id (the main process writes it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / CONFIG_FILE, yaml.safe_dump({**config_dict, RUN_ID_KEY: run_id}, sort_keys=False))


def _compile_text(args: TrainArgs, compiled: bool) -> str:
    """Whether the model is compiled, and, where the model is not but the run samples completions (GRPO, PPO,
    distillation's --lmbda/--seq_kd), that their decode step is (trainer/grpo.py, rollout_decode)."""
    plain = f"compile {'on' if compiled else 'off'}"
    if compiled or args.task not in (*ROLLOUT_TASKS, "distill"):
        return plain  # (a pretraining run imports no sampling code)
    from trainer.distillation import CompletionSettings
    from trainer.grpo import rollout_decode
    samples = args.task in ROLLOUT_TASKS or CompletionSettings(args.lmbda, args.seq_kd).samples
    return "compile off (the sampling's decode step compiled)" if (
        samples and rollout_decode(args.compile) == "compiled") else plain


def announcement(args: TrainArgs, accelerator: Accelerator, data: RunData, *, compiled: bool, threads_line: str,
                 input_models: dict[str, Path], num_params: int, trainable_params: int, total_steps: int,
                 steps_per_epoch: int, global_batch: int, added_switches: list[str],
                 config_dict: dict[str, Any]) -> str:
    """The run's opening lines: the model's size and the machine it trains on, the threads, the data and its
    statistics, the models it reads, the trainable parameters, the length, the switches added to the starting
    weights, DeepSpeed's update order, and the effective config."""
    stats = dataset_stats(data.train)
    notes = [note for note in (supervision_cut_note(stats, args.max_seq_len), control_text_note(stats)) if note]
    setup = str(accelerator.distributed_type).split(".")[-1]
    lines = [f"MiniNorm {args.task}: {num_params / 1e6:.2f}M parameters on {accelerator.device} "
             f"x{accelerator.num_processes}, {args.dtype}, {setup}, {_compile_text(args, compiled)}, "
             f"optimizer {args.optimizer}" + (", gradient checkpointing" if args.gradient_checkpointing else ""),
             threads_line,
             f"data: {data.description}; {len(data.train)} train / {len(data.val)} val samples"
             + (f"; stats {stats}" if stats else ""),
             *notes,
             # the models the run reads, defaults resolved (its config records a flag left out as null)
             *(["models: " + ", ".join(f"{flag} {path}" for flag, path in input_models.items())]
               if input_models else []),
             f"trainable parameters: {trainable_params:,} of {num_params:,} ({trainable_params / num_params:.2%})",
             f"{total_steps} optimizer steps ({steps_per_epoch} per epoch), global batch "
             f"{global_batch} x {args.max_seq_len} tokens"]
    lines += [f"--{name} true: added to the starting weights (their new weights start as a fresh model's)"
              for name in added_switches]
    if update_inside_backward(accelerator):
        lines.append("note: DeepSpeed applies each update inside backward, before the trainer sees the gradient: "
                     "a non-finite loss still stops the run before its update, but a non-finite gradient under a "
                     "finite loss is caught one update late (resume from the previous --save_interval checkpoint)")
    lines += ["effective config:", yaml.safe_dump(config_dict, sort_keys=False).rstrip()]
    return "\n".join(lines)
