"""Run a wandb sweep YAML with no wandb server: `python scripts/sweep.py scripts/sweep_configs/FILE.yaml`.

The YAML is wandb's own sweep format, so the same file also runs on a server (`wandb sweep FILE` +
`wandb agent ID`). Here, wandb's own sweep engine (the `sweeps` package, `from sweeps import next_run`) proposes
the trials; each trial runs as a training subprocess built from the YAML's `command` (wandb agent's macros
`${env} ${interpreter} ${program} ${args}` ...), logs to wandb (offline unless logged in; one group per sweep)
and writes its own directory under SWEEP_DIR/trials/. Outcomes go to SWEEP_DIR/results.jsonl, one line per
trial, appended whole.

Checked before anything runs: the YAML (wandb's schema, a first proposal) and, when its program is one of this
repo's trainers, every parameter value (the trainer's own flag checks, trainer/args.py check_args), a swept
parameter its trials do not use (refused where none does, said once where some do) and the metric (one the
trainer logs, trainer/run_dir.py logged_metrics).

Resumable: the proposed trials are kept in SWEEP_DIR/sweep_state.json (written atomically); restarted, the
runner skips trials already recorded as finished or diverged, reruns any trial that was cut off (with
`--resume auto`, so a trial with checkpoints continues from its last one, and `--overwrite`, so one without starts
anew) and retries crashed ones. `--workers N` runs N trials at a time: worker threads only wait on their
subprocesses, the main thread proposes and records every trial, so the state and the results have one writer.
A trial is tied to the runner with whatever it starts (trainer/tether.py, on POSIX systems): Ctrl-C or SIGTERM stops
it with the runner, and so does a runner killed outright (SIGKILL, the OOM killer), so no trial trains on unseen in
a folder that the next run uses.
Exit code 3 from the trainer is a divergence (NaN/inf): recorded as "diverged", not as a crash. Any other
failure is recorded as "failed" (with the tail of its log) and the sweep goes on, unless --stop_on_failure.

`--records_dir DIR` keeps what is worth committing (trainer/sweep_dir.py says what) in DIR, saved after every
trial: on another machine the same command brings the done trials back and runs only the rest. `--only
NAME=VALUE[,VALUE]` (a grid sweep; repeatable) runs just the trials with those values now; the others stay
proposed for a later run without it.

This file is the command (its flags, signals and exit codes); the runner itself is the package
scripts/sweep_runner/ (one module per job: the YAML's checks, a trial's command, running a trial, recording).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path


if __package__ in (None, ""):  # run as a script, from the repo root or from scripts/
    # The repo root replaces scripts/ on sys.path: nothing in scripts/ may shadow an installed package (the
    # folder of sweep YAMLs once shadowed wandb's engine, `sweeps`; the runner's package is scripts/sweep_runner/).
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

from scripts.sweep_runner.runner import run_sweep  # noqa: E402
from scripts.sweep_runner.trial import on_interrupt, on_terminate, running_trials  # noqa: E402
from trainer.cli import ToolParser, int_within, path_arg, print_interrupted, run_main, seed  # noqa: E402
from trainer.run_dir import EXIT_INTERRUPTED, report_error, resolve_input_path  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description="Run a wandb sweep YAML serverless (resumable).")
    parser.add_argument("config", type=path_arg,
                        help="sweep YAML in wandb's format, e.g. scripts/sweep_configs/paper_cpu.yaml")
    parser.add_argument("--sweep_dir", type=path_arg, help="default: out/sweeps/<sweep name>/")
    parser.add_argument("--wandb_mode", choices=("offline", "online", "disabled"),
                        help="default: online if a wandb API key is configured, else offline")
    parser.add_argument("--max_trials", type=int_within(0, note="0: only bring the records back"),
                        help="run at most this many trials now, then stop (resumable); 0 runs none, only brings "
                             "the done trials of --records_dir back")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the random/bayes proposals")
    parser.add_argument("--stop_on_failure", action="store_true", help="stop at the first crashed trial")
    parser.add_argument("--dry_run", action="store_true", help="print the trials' parameters, run nothing")
    parser.add_argument("--workers", type=int_within(1), default=1,
                        help="run this many trials at a time (set OMP_NUM_THREADS so that workers x threads fits "
                             "the cores); a resumed sweep may use another number")
    parser.add_argument("--records_dir", type=path_arg,
                        help="keep the sweep's committable record here (state, results, each done trial's summary, "
                             "config and gzipped metrics), saved after every trial; restored from on a new machine")
    parser.add_argument("--only", action="append", default=[], metavar="NAME=VALUE[,VALUE]",
                        help="grid sweeps: run only the trials with these values of a swept parameter now "
                             "(repeatable: every flag must match); the rest stay proposed for a later run")
    args = parser.parse_args(argv)
    handlers = {signal.SIGTERM: on_terminate, signal.SIGINT: on_interrupt}
    previous = {number: signal.signal(number, handler) for number, handler in handlers.items()}
    try:
        trials = run_sweep(resolve_input_path(args.config), args.sweep_dir, args.wandb_mode, args.max_trials, args.seed,
                           args.stop_on_failure, args.dry_run, args.workers, args.records_dir, args.only)
    except ValueError as error:  # SweepConfigError, or a sweep folder whose state is not readable
        return report_error(error)
    except KeyboardInterrupt:  # Ctrl-C (a terminal sends the trials one too; `kill -INT` only us: on_interrupt)
        print_interrupted("the trials in flight were stopped: run the same command again to go on (done trials are "
                          "kept, a cut-off trial resumes from its newest checkpoint)")
        return EXIT_INTERRUPTED
    finally:  # main() may run inside another program (the tests): its own handlers come back
        for number, handler in previous.items():
            signal.signal(number, handler)
        running_trials.stopping = False
    return 1 if any(t["status"] == "failed" for t in trials) else 0


if __name__ == "__main__":
    run_main(main)
