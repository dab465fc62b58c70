"""The run's wandb side at set-up (--use_wandb): the login checked before any work, and the wandb run started (or
resumed under the checkpoint's id) once the model's config is resolved. Logging itself is the reporter's
(trainer/reporting.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from trainer.arg_fields import TrainArgs, requested_model_fields

OFFLINE_WANDB_MODES = ("offline", "disabled", "dryrun")  # WANDB_MODE values that need no login


def check_wandb_login(accelerator: Accelerator, out_dir: Path) -> None:
    """Where wandb logs online (WANDB_MODE unset or online) but has no API key and no terminal to ask for one, a
    one-line refusal before any work: wandb.init raised it as a traceback after the data and the model, leaving
    an empty --out_dir. Collective: the main process, the one that logs, decides."""
    problem = ""
    if accelerator.is_main_process and os.environ.get("WANDB_MODE", "online") not in OFFLINE_WANDB_MODES:
        import wandb
        try:
            wandb.login(verify=False)
        except wandb.errors.UsageError:
            problem = (f"--use_wandb: wandb has no API key here and no terminal to ask for one; run `wandb "
                       f"login`, set WANDB_API_KEY, or set WANDB_MODE=offline to log to {out_dir}/wandb")
        except wandb.errors.Error as error:  # a malformed key (AuthenticationError), ...: still one line, and
            # the other processes hear of it (they wait in the broadcast below)
            problem = f"--use_wandb: {str(error).splitlines()[0]}; or set WANDB_MODE=offline"
    if accelerator.num_processes > 1:
        problem = broadcast_object_list([problem])[0]
    if problem:
        raise ValueError(problem)


def start_wandb(accelerator: Accelerator, args: TrainArgs, out_dir: Path,
                resume_state: dict[str, Any] | None) -> str | None:
    """The wandb run (resumed under its id where the checkpoint records one), its config what this run resolved
    (SFT's default model fields included). Returns the run's id (the main process's; the others return the
    checkpoint's, or None), which each checkpoint records."""
    run_id = (resume_state or {}).get("wandb_run_id")
    init = {"name": args.wandb_run_name, "group": args.wandb_group, "dir": str(out_dir),
            "id": run_id, "resume": "allow" if run_id else None}
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
    logged = {**args.to_dict(), "model": requested_model_fields(args)}
    accelerator.init_trackers(args.wandb_project, config=logged, init_kwargs={"wandb": init})
    if accelerator.is_main_process:
        run_id = accelerator.get_tracker("wandb", unwrap=True).id
    return run_id
