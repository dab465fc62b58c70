"""The sweep: one run over its folder, proposing trials (wandb's engine), starting them `workers` at a time and
recording each outcome. Only the main thread proposes and records, so the state and the results have one writer;
worker threads only wait on the trials' subprocesses. run_sweep is the whole of it for a caller."""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

from dataset.atomic_io import check_folder_path, check_not_a_folder, make_dirs, path_overlap
from scripts.sweep_runner.command import build_command, trainer_of, trial_id
from scripts.sweep_runner.config import agent_only_settings, load_sweep_config, parse_only, sweep_name
from scripts.sweep_runner.engine import propose_next
from scripts.sweep_runner.errors import SweepConfigError, SweepWriteError
from scripts.sweep_runner.recording import bring_back_records, cannot_write, load_state, metric_value, writing
from scripts.sweep_runner.trial import TrialOutcome, default_wandb_mode, run_trial, running_trials
from trainer.run_dir import EXIT_ERROR, SUMMARY_FILE, note_on_stderr, resolve_path
from trainer.sweep_dir import (DONE_STATUSES, RESULT_SUMMARY_KEYS, RESULTS_FILE, SWEEP_TRIAL_VARIABLE, TRIALS_DIR,
                               append_result, default_sweep_dir, done_records, restorable_records, save_records,
                               swept_names, sweep_dir_lock, trial_dir_name, write_state)

MAX_REDRAWS = 100  # proposals of one trial index that are all trials already: the search space is used up


class _Attempt(NamedTuple):
    """A trial this run started: its entry in the state, its number as printed, and when it started."""
    trial: dict[str, Any]
    index: int
    started: float

    def label(self) -> str:
        return _label(self.index, self.trial)


def _label(index: int, trial: dict[str, Any]) -> str:
    """A trial as the runner's lines name it: its number and its id."""
    return f"[{index}] {trial['trial_id']}"


class SweepRunner:
    """One run of a sweep over its folder, which the caller holds (sweep_dir_lock) unless it is a dry run.

    Holds the state (read back, and reconciled with the results file), the wandb mode and environment the trials
    run with, the `--only` filter and the trials this run attempted. Only the main thread calls its methods, so the
    state and the results have one writer; worker threads only wait on the trials' subprocesses (run_trial)."""

    def __init__(self, config: dict[str, Any], name: str, sweep_dir: Path, records_dir: Path | None,
                 wandb_mode: str | None, picked: dict[str, list[Any]], seed: int, workers: int,
                 dry_run: bool) -> None:
        self.config, self.name, self.sweep_dir, self.records_dir = config, name, sweep_dir, records_dir
        self.picked, self.seed, self.workers, self.dry_run = picked, seed, workers, dry_run
        self.state = load_state(sweep_dir, name, config)
        # results.jsonl lines before its last that are no result: one note line on stderr (the last may be torn)
        done = done_records(sweep_dir, note_skipped=note_on_stderr)
        for trial in self.state["trials"]:  # the results file is the record; the state may lag a kill behind it
            if (result := done.get(trial["trial_id"])) is not None:
                trial["status"], trial["metric"] = result["status"], result.get("metric")
        self.metric = (config.get("metric") or {}).get("name")
        self.mode = wandb_mode or default_wandb_mode()
        self.env = dict(os.environ, WANDB_MODE=self.mode, WANDB_SILENT="true", PYTHONUNBUFFERED="1",
                        **{SWEEP_TRIAL_VARIABLE: "1"})
        self.env.setdefault("WANDB_DIR", str(sweep_dir))
        self.swept = swept_names(config)
        self.attempted: set[str] = set()  # a trial that fails now is retried on the next start, not in a loop now

    def announce(self) -> None:
        """The sweep's first line: its name, method, folder, wandb mode and how many trials are already done; then a
        note naming the settings of the YAML that only wandb's own agent applies."""
        done = sum(t["status"] in DONE_STATUSES for t in self.state["trials"])
        print(f"sweep {self.name!r} ({self.config['method']}) in {self.sweep_dir}; wandb {self.mode}; "
              f"{done} trials already done" + (f"; {self.workers} at a time" if self.workers > 1 else ""), flush=True)
        unapplied = agent_only_settings(self.config)
        if unapplied:
            print(f"note: {', '.join(unapplied)} {'is' if len(unapplied) == 1 else 'are'} wandb agent's; this runner "
                  f"does not apply {'it' if len(unapplied) == 1 else 'them'}: every trial runs to its end", flush=True)

    def selected(self, params: dict[str, Any]) -> bool:
        """Whether a trial's parameters pass the `--only` filter."""
        return all(params.get(key) in values for key, values in self.picked.items())

    def save(self, trial: str = "") -> None:
        """Write the state file (atomically), for `trial` (its label, when a trial's change is saved); a dry run
        writes nothing."""
        if not self.dry_run:
            with writing(self.sweep_dir, trial):
                write_state(self.sweep_dir, self.state)

    def next_trial(self) -> dict[str, Any] | None:
        """The first trial not done (nor started by this run), else a new proposal; trials in flight count as
        running for the engine, so it never proposes one twice."""
        pending = next((t for t in self.state["trials"] if t["status"] not in DONE_STATUSES
                        and t["trial_id"] not in self.attempted and self.selected(t["params"])), None)
        while pending is None:  # with --only, proposals it leaves out stay in the state, pending, for later
            params = self._new_proposal()
            if params is None:
                return None
            proposal = {"trial_id": trial_id(params, self.swept), "params": params, "status": "pending",
                        "metric": None}
            self.state["trials"].append(proposal)
            self.save(_label(len(self.state["trials"]), proposal))
            if self.selected(params):
                pending = proposal
        return pending

    def _new_proposal(self) -> dict[str, Any] | None:
        """The engine's next parameters that are no trial yet. A random or bayes search over few values proposes a
        trial again (it was a second entry of the same trial: a run_cap slot that ran nothing); it is asked again,
        and a space with no other trial left (MAX_REDRAWS proposals all known) ends the sweep."""
        known = {trial["trial_id"] for trial in self.state["trials"]}
        for redraw in range(MAX_REDRAWS):
            params = propose_next(self.config, self.state["trials"], self.seed, redraw)
            if params is None or trial_id(params, self.swept) not in known:
                return params
        print(f"sweep {self.name!r}: its search proposed only trials it has, {MAX_REDRAWS} times; it ends with "
              f"{len(self.state['trials'])} of run_cap {self.config.get('run_cap')}", flush=True)
        return None

    def list_trials(self, max_trials: int | None) -> list[dict[str, Any]]:
        """The dry run: print the trials a real run would run now, run and write nothing; returns the trials."""
        # done in the records folder: a real run would bring these back (or refuse them, damaged), not run them
        restorable = set() if self.records_dir is None else set(
            restorable_records(self.records_dir, self.sweep_dir, by_trainer=trainer_of(self.config) is not None))
        listed = 0
        while (max_trials is None or listed < max_trials) and (pending := self.next_trial()) is not None:
            pending["status"] = "finished"  # only to move on to the next proposal; nothing is saved
            self.attempted.add(pending["trial_id"])
            if pending["trial_id"] not in restorable:
                listed += 1
                print(f"[dry run] {pending['trial_id']}: {({k: pending['params'][k] for k in self.swept})}")
        restorable_note = f", {len(restorable)} done in {self.records_dir}" if restorable else ""
        print(f"[dry run] {listed} trials to run{restorable_note}; nothing was run or written")
        return self.state["trials"]

    def run_trials(self, max_trials: int | None, stop_on_failure: bool) -> list[dict[str, Any]]:
        """Run the trials, `workers` at a time, until none is left (or max_trials ran, or one failed and
        stop_on_failure); returns the trials of the state with their statuses."""
        # done trials from before the records folder existed; a new sweep (or one killed before its first state
        # write) has no state file yet, and nothing done to save
        if self.records_dir is not None and self.state["trials"]:
            save_records(self.sweep_dir, self.records_dir)
        ran, failed = 0, False
        in_flight: dict[Future, _Attempt] = {}
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            try:
                while True:
                    while (len(in_flight) < self.workers and not (failed and stop_on_failure)
                           and (max_trials is None or ran + len(in_flight) < max_trials)):
                        pending = self.next_trial()
                        if pending is None:
                            break
                        begun = self.start(pending, pool)
                        if begun is None:  # failed before it could start (recorded)
                            ran, failed = ran + 1, True
                            continue
                        attempt, future = begun
                        in_flight[future] = attempt
                    if not in_flight:
                        break
                    for future in wait(in_flight, return_when=FIRST_COMPLETED).done:
                        attempt = in_flight.pop(future)
                        outcome = future.result()
                        self.record(attempt, outcome)
                        ran += 1
                        failed = failed or outcome.status == "failed"
            except SweepWriteError as error:
                if not in_flight:
                    raise
                # The other trials would only end unrecorded (the pool's exit waits for them, hours perhaps) on a
                # disk that cannot take their results either: they stop as a Ctrl-C stops them, and run again on
                # the rerun (from their newest checkpoints); a trial that finished meanwhile is found done then.
                running_trials.stop()
                try:
                    wait(in_flight)
                finally:
                    running_trials.stopping = False
                stopped = ", ".join(attempt.label() for attempt in in_flight.values())
                raise SweepWriteError(f"{error}; the trials in flight were stopped ({stopped}) and run again "
                                      f"then") from None
        if failed and stop_on_failure:
            raise SystemExit(1)
        counts = {s: sum(t["status"] == s for t in self.state["trials"]) for s in ("finished", "diverged", "failed")}
        print(f"sweep {self.name!r}: {len(self.state['trials'])} trials proposed; {counts}; "
              f"results in {self.sweep_dir / RESULTS_FILE}")
        return self.state["trials"]

    def start(self, pending: dict[str, Any], pool: ThreadPoolExecutor) -> tuple[_Attempt, Future] | None:
        """Mark a trial running (saved), make its directory and hand its subprocess to a worker; None when it
        failed before it could start (recorded as failed)."""
        pending["status"] = "running"
        self.attempted.add(pending["trial_id"])
        index = self.state["trials"].index(pending) + 1
        self.save(_label(index, pending))
        trial_dir = self.sweep_dir / trial_dir_name(pending["trial_id"])
        # A rerun trial continues from its checkpoints; one cut off without any starts anew in its directory.
        extra = [f"--out_dir={trial_dir}", "--resume=auto", "--overwrite"]
        if self.mode == "disabled":  # no wandb run to name: its names would be unused flags, a note in every trial
            extra.append("--use_wandb=false")
        else:
            extra += [f"--wandb_run_name={pending['trial_id']}", f"--wandb_group={self.name}"]
            if "project" in self.config:
                extra.append(f"--wandb_project={self.config['project']}")
        print(f"{_label(index, pending)} ...", end=" " if self.workers == 1 else " started\n", flush=True)
        try:
            make_dirs(trial_dir)  # here, not in the worker thread: a file in the way is one line, not a traceback
            check_not_a_folder(trial_dir / SUMMARY_FILE)  # run_trial removes a stale one, and reads the new one
        except (ValueError, OSError) as error:  # OSError: a full disk, a folder turned read-only
            message = cannot_write(error, trial_dir) if isinstance(error, OSError) else str(error)
            self.record(_Attempt(pending, index, time.time()), TrialOutcome("failed", EXIT_ERROR, {}, message))
            return None
        started = time.time()
        future = pool.submit(run_trial, build_command(self.config, pending["params"], extra), trial_dir, self.env,
                             trainer_of(self.config) is not None)
        return _Attempt(pending, index, started), future

    def record(self, attempt: _Attempt, outcome: TrialOutcome) -> None:
        """A trial's outcome: appended to the results file, then the state saved (and the trial's records)."""
        trial = attempt.trial
        value = metric_value(outcome.summary, self.metric) if outcome.status == "finished" else None
        result = {"trial_id": trial["trial_id"], "params": trial["params"], "status": outcome.status,
                  "returncode": outcome.returncode, "metric_name": self.metric, "metric": value,
                  **{key: outcome.summary.get(key, {} if key == "final_val" else None) for key in RESULT_SUMMARY_KEYS},
                  "wall_time_s": round(time.time() - attempt.started, 2),
                  "trial_dir": trial_dir_name(trial["trial_id"]), "wandb_mode": self.mode, "error": outcome.error,
                  "ended_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        with writing(self.sweep_dir, attempt.label()):
            append_result(self.sweep_dir, result)
        trial["status"], trial["metric"] = outcome.status, value
        self.save(attempt.label())
        if self.records_dir is not None:
            with writing(self.records_dir, attempt.label()):
                save_records(self.sweep_dir, self.records_dir, [trial["trial_id"]])
        self.print_outcome(attempt, outcome, value, result["wall_time_s"])

    def print_outcome(self, attempt: _Attempt, outcome: TrialOutcome, value: float | None, wall_time_s: float) -> None:
        """A recorded trial's line (and, when it failed, its error or log tail on stderr)."""
        shown = f"{self.metric}={value:.4f}" if value is not None else outcome.status
        prefix = "" if self.workers == 1 else f"{attempt.label()} "
        print(f"{prefix}{outcome.status} ({shown}, {wall_time_s:.0f} s)", flush=True)
        if outcome.status != "failed":
            return
        # on stderr, which may be read apart from stdout, and with --workers among other trials' lines: named
        failed = f"  trial {attempt.label()} failed (exit {outcome.returncode})"
        if not outcome.log_tail:
            print(f"{failed}: {outcome.error}", file=sys.stderr)
        elif "\n" not in outcome.error:  # output, not a message: said so even when it is one line
            print(f"{failed}; last line of its log: {outcome.error}", file=sys.stderr)
        else:
            print(f"{failed}; log tail:\n{outcome.error}", file=sys.stderr)


def run_sweep(config_path: str | Path, sweep_dir: str | Path | None = None, wandb_mode: str | None = None,
              max_trials: int | None = None, seed: int = 0, stop_on_failure: bool = False,
              dry_run: bool = False, workers: int = 1, records_dir: str | Path | None = None,
              only: list[str] | None = None) -> list[dict[str, Any]]:
    """Run (or resume) a sweep, ``workers`` trials at a time; returns the trials of the state file with their
    statuses. Only this process writes the state and the results (the trials run as its subprocesses), and only
    one runner at a time uses a sweep folder (a second one is refused).
    ``records_dir``: restore done trials from it first, save every trial into it (trainer/sweep_dir.py);
    ``only``: `NAME=VALUE[,VALUE]` filters, the trials run now (the rest stay proposed)."""
    notes: list[str] = []  # said once, when the sweep starts
    config = load_sweep_config(config_path, notes)
    name = sweep_name(config, config_path)
    picked = parse_only(config, only or [])
    sweep_dir = resolve_path(sweep_dir) if sweep_dir else default_sweep_dir(name)
    records_dir = resolve_path(records_dir) if records_dir else None
    if records_dir is not None and path_overlap(records_dir, sweep_dir) == "is":
        raise SweepConfigError(f"--records_dir must differ from the sweep folder {sweep_dir}")
    with ExitStack() as held:  # the sweep folder's lock (none for a dry run), released on every way out
        if not dry_run:
            check_folder_path(sweep_dir, "--sweep_dir")  # a file in the way: one line naming it and the flag
            if records_dir is not None:
                check_folder_path(records_dir, "--records_dir")
            for folder in (sweep_dir / TRIALS_DIR, *([] if records_dir is None else [records_dir])):
                make_dirs(folder)  # a file at trials/: one line naming it
            check_folder_path(sweep_dir / TRIALS_DIR, "--sweep_dir")  # each trial makes its folder in it
            held.enter_context(sweep_dir_lock(sweep_dir))
            if records_dir is not None:
                bring_back_records(sweep_dir, records_dir, name, config)
        runner = SweepRunner(config, name, sweep_dir, records_dir, wandb_mode, picked, seed, workers, dry_run)
        runner.announce()
        for note in notes:
            print(note, flush=True)
        if dry_run:
            return runner.list_trials(max_trials)
        return runner.run_trials(max_trials, stop_on_failure)
