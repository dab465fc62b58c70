"""A trainer script's command line (trainer/train_*.py): the run of trainer/core.py's `Trainer` on the script's
flags, and how it ends: 0 once the run is done, each failure one line on stderr with its own exit code (a diverged
run, a Ctrl-C with where the run can go on from, a bad input, an allocation that failed
(trainer/memory.py), a process that stopped answering)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from dataset.atomic_io import first_line
from trainer.arg_fields import TrainArgs
from trainer.cli import INTERRUPTED_LINE, done_on_ctrl_c, print_interrupted
from trainer.core import Trainer
from trainer.distributed import collective_timed_out, shutdown
from trainer.memory import out_of_memory_line
from trainer.run_dir import (CHECKPOINT_DIR, EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_PEER_LOST,
                             list_checkpoints, report_error)
from trainer.run_summary import RunSummary, TrainingDiverged


def _resume_hint(args: TrainArgs) -> str:
    """Where an interrupted run can go on from: its newest complete checkpoint, if it has one."""
    checkpoints = list_checkpoints(args.resolved_out_dir() / CHECKPOINT_DIR)
    if not checkpoints:
        return f"no checkpoint was saved yet (every --save_interval {args.save_interval} steps)"
    return f"its newest checkpoint is {checkpoints[-1]}: run the same command with --resume auto to go on from it"


def _finished_line(out_dir: Path) -> str:
    return f"{INTERRUPTED_LINE} after the run had finished; its results are saved in {out_dir}"


def command_line(task: str) -> int:
    """A trainer script's command (trainer/train_*.py, under trainer.cli's run_main): main(task) on sys.argv, 0 once
    the run is done; its failures and Ctrl-C end through SystemExit with their own codes, except a Ctrl-C once the
    run's results are written: the run is finished, so one line says so and the exit code is 0 (done_on_ctrl_c)."""
    main(task, on_results_written=lambda out_dir: done_on_ctrl_c(_finished_line(out_dir)))
    return 0


def main(task: str, argv: list[str] | None = None,
         on_results_written: Callable[[Path], None] | None = None) -> RunSummary:
    """Entry point of the thin trainer scripts; `on_results_written`: the Trainer's."""
    from trainer.args import parse_args
    args = parse_args(task, argv)
    try:
        return Trainer(args, on_results_written).run()
    except TrainingDiverged as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(EXIT_DIVERGED) from None
    except KeyboardInterrupt:  # Ctrl-C: no traceback, but where the run can go on from
        print_interrupted(_resume_hint(args))
        raise SystemExit(EXIT_INTERRUPTED) from None
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(report_error(error)) from None
    except (MemoryError, RuntimeError) as error:
        memory = out_of_memory_line(error, args)  # what the run was doing, what it asked, what to lower
        if memory is not None:  # the run's files stay as they were: its checkpoints are where it can go on from
            raise SystemExit(report_error(memory)) from None
        if not collective_timed_out(error):
            raise
        rank = os.environ.get("RANK", "0")
        print(f"error: rank {rank} stopped: another process did not answer in time (--dist_timeout; "
              f"--dist_init_timeout until the first step is done): a node died or the network failed "
              f"({first_line(error)}); resume with --resume auto when every node is back", file=sys.stderr)
        raise SystemExit(EXIT_PEER_LOST) from None
    finally:
        shutdown()
