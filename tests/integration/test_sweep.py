"""The serverless sweep runner: YAML validity, trial expansion, diverged/failed bookkeeping, resume, and one
real two-trial grid sweep of a tiny model with wandb offline."""

from __future__ import annotations

import datetime
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from scripts import sweep as sweep_mod
from scripts.sweep_runner import runner as runner_mod
from scripts.sweep_runner.command import build_command, trainer_of, trial_id
from scripts.sweep_runner.config import load_sweep_config, validate_sweep_config
from scripts.sweep_runner.engine import propose_next
from scripts.sweep_runner.errors import SweepConfigError
from scripts.sweep_runner.recording import metric_value
from scripts.sweep_runner.runner import run_sweep
from scripts.sweep_runner.trial import default_wandb_mode
from trainer.args import parse_args
from trainer.run_dir import read_metrics
from trainer.sweep_dir import read_results, swept_names
from tests.paths import REPO
from tests.training_runs import strict_json_files

SWEEP_YAMLS = sorted((REPO / "scripts" / "sweep_configs").glob("*.yaml"))
TEXTS = ["The history of the city begins with a small fishing village on the river.",
         "Water is a chemical compound of hydrogen and oxygen. It covers most of the Earth.",
         "A tiny language model learns to continue text one token at a time.",
         "Normalization keeps the activations of a deep network at a sane scale."]


def _expand(config: dict, limit: int) -> list[dict]:
    trials: list[dict] = []
    while len(trials) < limit:
        params = propose_next(config, trials, seed=0)
        if params is None:
            break
        trials.append({"trial_id": trial_id(params, swept_names(config)), "params": params,
                       "status": "finished", "metric": None})
    return trials


# ----------------------------------------------------------------------------- the committed YAML files
@pytest.mark.parametrize("path", SWEEP_YAMLS, ids=[p.name for p in SWEEP_YAMLS])
def test_committed_yamls_are_valid_wandb_sweep_configs(path, monkeypatch):
    import sweeps

    config = load_sweep_config(path)
    sweeps.SweepConfig(config)  # wandb's own schema (raises on an invalid config)
    assert sweeps.schema_violations_from_proposed_config(config) == []
    assert config["metric"] == {"name": "val_loss", "goal": "minimize"}
    assert (REPO / config["program"]).is_file()
    assert "${args}" in config["command"] and "--use_wandb" in config["command"]
    # Every proposed trial's flags (as wandb agent passes them, with its sweep id set) parse in the trainer, values
    # included: a flag the trial does not use (recipe_cpu's --muon_lr beside --optimizer adamw) is noted, not refused.
    monkeypatch.setenv("WANDB_SWEEP_ID", "sweep0")
    trials = _expand(config, limit=64 if config["method"] == "grid" else 3)
    assert trials
    for trial in trials:
        command = build_command(config, trial["params"], [])
        flags = command[command.index(str(REPO / config["program"])) + 1:]
        args = parse_args("pretrain", flags)
        assert args.use_wandb
        assert args.seed == trial["params"].get("seed", args.seed)


def test_paper_cpu_covers_the_study():
    config = load_sweep_config(REPO / "scripts" / "sweep_configs" / "paper_cpu.yaml")
    trials = _expand(config, limit=1000)
    params = [t["params"] for t in trials]
    assert {p["norm_type"] for p in params} == {"rmsnorm", "layernorm", "prmsnorm", "none"}
    assert {p["norm_placement"] for p in params} == {"pre", "post"}
    assert {p["prms_p"] for p in params} == {0.0625}
    assert len({p["warmup_steps"] for p in params}) == 2 and 0 in {p["warmup_steps"] for p in params}
    variants = {(p["norm_type"], p["norm_placement"], p["warmup_steps"]) for p in params}
    assert all(sum((p["norm_type"], p["norm_placement"], p["warmup_steps"]) == v for p in params) >= 3
               for v in variants)
    assert len({t["trial_id"] for t in trials}) == len(trials)  # ids are unique ...
    # ... and stable: another interpreter, with another str-hash seed, names the same trials the same way (a resumed
    # sweep finds its finished trials by these names).
    script = ("import sys, json; sys.path.insert(0, sys.argv[1]); from scripts.sweep_runner.command import trial_id; "
              "from trainer.sweep_dir import swept_names; from scripts.sweep_runner.config import load_sweep_config; "
              "config = load_sweep_config(sys.argv[2]); "
              "print(json.dumps([trial_id(p, swept_names(config)) for p in json.loads(sys.stdin.read())]))")
    other = subprocess.run([sys.executable, "-c", script, str(REPO), str(REPO / "scripts" / "sweep_configs" /
                                                                         "paper_cpu.yaml")],
                           input=json.dumps(params), capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert other.returncode == 0, other.stderr
    assert json.loads(other.stdout) == [t["trial_id"] for t in trials]


# ----------------------------------------------------------------------------- validation and proposals
@pytest.mark.parametrize("change, field", [
    ({"method": "grdi"}, "method"),
    ({"metric": {"name": "val_loss", "goal": "minimise"}}, "metric.goal"),
    ({"parameters": {"lr": 3}}, "parameters.lr"),
    ({"parameters": {}}, "parameters"),
    ({"method": "random"}, "run_cap"),
    ({"command": "python train.py"}, "command"),
    ({"command": ["${env}", "${interpreter}", "${program}", "${args_json}"]}, "command"),  # no flags: refused
])
def test_bad_sweep_config_names_the_field(change, field):
    config = {"method": "grid", "metric": {"name": "val_loss", "goal": "minimize"},
              "parameters": {"norm_type": {"values": ["rmsnorm", "layernorm"]}}, **change}
    with pytest.raises(SweepConfigError, match=rf"bad\.yaml: {field}:"):
        validate_sweep_config(config, "bad.yaml")


def test_schema_violation_from_wandb_engine_is_reported():
    config = {"method": "grid", "parameters": {"learning_rate": {"min": 0.1, "max": 0.01}}}
    with pytest.raises(SweepConfigError, match="learning_rate: min 0.1 is not less than max 0.01"):
        validate_sweep_config(config, "bad.yaml")


def test_grid_spec_the_engine_refuses_is_a_config_error(tmp_path, capsys):
    # {min, max} passes wandb's schema but its grid engine refuses it at the first proposal.
    config = {"method": "grid", "parameters": {"learning_rate": {"min": 0.1, "max": 1.0}}}
    with pytest.raises(SweepConfigError, match=r"bad\.yaml: parameters: .*learning_rate is a disallowed type"):
        validate_sweep_config(config, "bad.yaml")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "learning_rate" in err
    assert not (tmp_path / "s").exists()


def test_cli_rejects_a_bad_yaml_with_one_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("method: grdi\nparameters:\n  seed: {values: [0, 1]}\n")
    assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "method" in err and "grdi" in err
    assert not (tmp_path / "s").exists()


def test_grid_order_follows_wandb_and_stops():
    config = validate_sweep_config({"method": "grid", "parameters": {
        "norm_type": {"values": ["rmsnorm", "layernorm"]}, "seed": {"values": [0, 1]}, "max_steps": {"value": 3}}})
    params = [t["params"] for t in _expand(config, limit=10)]
    assert params == [{"max_steps": 3, "norm_type": n, "seed": s}
                      for n in ("rmsnorm", "layernorm") for s in (0, 1)]


def test_bayes_proposals_use_history_and_are_reproducible():
    config = validate_sweep_config({
        "method": "bayes", "run_cap": 6, "metric": {"name": "val_loss", "goal": "minimize"},
        "parameters": {"learning_rate": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-2},
                       "norm_type": {"values": ["rmsnorm", "layernorm"]}}})
    history = []
    for i, params in enumerate(({"learning_rate": 1e-3, "norm_type": "rmsnorm"},
                                {"learning_rate": 5e-3, "norm_type": "layernorm"},
                                {"learning_rate": 2e-4, "norm_type": "rmsnorm"})):
        history.append({"trial_id": f"t{i}", "params": params, "status": "finished", "metric": 5.0 + i})
    history.append({"trial_id": "div", "params": {"learning_rate": 9e-3, "norm_type": "layernorm"},
                    "status": "diverged", "metric": None})
    first = propose_next(config, history, seed=7)
    assert first == propose_next(config, history, seed=7)
    assert 1e-4 <= first["learning_rate"] <= 1e-2 and first["norm_type"] in ("rmsnorm", "layernorm")
    assert isinstance(first["learning_rate"], float)  # plain Python, not numpy scalars
    history += [dict(history[0], trial_id="x"), dict(history[0], trial_id="y")]
    assert propose_next(config, history, seed=7) is None  # run_cap reached


def test_proposals_leave_the_callers_global_generators_as_they_were(tmp_path):
    """wandb's engine draws from numpy's and Python's global generators; a caller's (a training loop calling
    run_sweep, say) are seeded for each proposal and then put back, not left reseeded."""
    import random

    import numpy as np

    def seed_globals() -> None:
        random.seed(1234)
        np.random.seed(1234)

    def draws() -> tuple[float, float]:
        return random.random(), float(np.random.random())

    seed_globals()
    expected = draws()
    seed_globals()
    trials = run_sweep(_fake_sweep(tmp_path, {"seed": {"values": [1, 2, 3]}}, method="random"), tmp_path / "sweep",
                       wandb_mode="disabled", dry_run=True, seed=5)  # validation and random proposals
    assert len(trials) == 2 and draws() == expected
    config = validate_sweep_config({  # bayes: numpy's generator, with a history to fit
        "method": "bayes", "run_cap": 9, "metric": {"name": "val_loss", "goal": "minimize"},
        "parameters": {"learning_rate": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-2}}})
    history = [{"trial_id": f"t{i}", "params": {"learning_rate": lr}, "status": "finished", "metric": 5.0 + i}
               for i, lr in enumerate((1e-3, 5e-3, 2e-4))]
    seed_globals()
    proposed = propose_next(config, history, seed=7)
    assert draws() == expected
    assert propose_next(config, history, seed=7) == proposed  # still seeded: the same proposal again


def test_agent_style_flags_parse_in_the_trainer():
    config = {"program": "trainer/train_pretrain.py",
              "command": ["${env}", "${interpreter}", "${program}", "--use_wandb", "${args}"]}
    command = build_command(config, {"norm_type": "prmsnorm", "prms_p": 0.125, "qk_norm": False,
                                     "warmup_steps": 0, "learning_rate": 0.003}, ["--out_dir=/tmp/x"])
    assert command[1] == sys.executable and command[-1] == "--out_dir=/tmp/x"
    assert "--qk_norm=false" in command
    args = parse_args("pretrain", command[3:])
    assert (args.model["norm_type"], args.model["prms_p"], args.model["qk_norm"]) == ("prmsnorm", 0.125, False)
    assert (args.warmup_steps, args.learning_rate, args.use_wandb) == (0, 0.003, True)


def test_the_program_a_trial_runs_is_the_trainer_its_checks_name(monkeypatch):
    """`program` is read as the trainers read a path (`$VARS` and `~` expanded): the trainer whose flags and metrics
    the runner checks (trainer_of) is the one the trial's command runs."""
    monkeypatch.setenv("MININORM_HOME", str(REPO))
    config = {"program": "$MININORM_HOME/trainer/train_pretrain.py",
              "command": ["${env}", "${interpreter}", "${program}", "${args}"]}
    assert trainer_of(config) == "pretrain"
    assert build_command(config, {}, [])[2] == str(REPO / "trainer" / "train_pretrain.py")


@pytest.mark.parametrize("path", SWEEP_YAMLS, ids=lambda p: p.stem)
def test_each_trial_gets_its_own_run_dir_under_both_runners(path, monkeypatch):
    """The trainer knows nothing of sweeps: the YAML names the trial's run directory. Under `wandb agent` (which
    passes command items verbatim and sets WANDB_SWEEP_ID / WANDB_RUN_ID) it is out/sweeps/<sweep>/<run>; the
    serverless runner's own --out_dir comes last and wins."""
    from trainer.run_dir import REPO_ROOT
    config = load_sweep_config(path)
    params = propose_next(config, [], seed=0)
    monkeypatch.setenv("WANDB_SWEEP_ID", "abc123")
    monkeypatch.setenv("WANDB_RUN_ID", "run7")
    agent = build_command(config, params, [])
    assert parse_args("pretrain", agent[3:]).resolved_out_dir() == REPO_ROOT / "out/sweeps/abc123/run7"
    serverless = build_command(config, params, ["--out_dir=/tmp/sweep/trials/t1"])
    assert parse_args("pretrain", serverless[3:]).resolved_out_dir() == Path("/tmp/sweep/trials/t1")


HIDE_INSTALLED_SWEEPS = textwrap.dedent("""
    import importlib.machinery, sys
    class HideInstalled:  # as if `pip install --no-deps sweeps` had not been run
        def find_spec(self, name, path=None, target=None):
            if name != "sweeps":
                return None
            entries = [entry for entry in sys.path if "-packages" not in entry]
            spec = importlib.machinery.PathFinder.find_spec(name, entries)
            if spec is None:
                raise ModuleNotFoundError("No module named 'sweeps'", name=name)
            return spec
    sys.meta_path.insert(0, HideInstalled())
""")


@pytest.mark.parametrize("cwd", ["repo", "scripts"])
def test_without_the_sweep_engine_the_runner_names_the_install_command(cwd, tmp_path):
    """After `pip install -r requirements.txt` alone the engine is missing: one line naming the install command,
    whatever shadows the name `sweeps` next to the script (a folder of YAMLs once did)."""
    (tmp_path / "sitecustomize.py").write_text(HIDE_INSTALLED_SWEEPS)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    script = REPO / "scripts" / "sweep.py"
    run = subprocess.run([sys.executable, str(script), str(REPO / "scripts" / "sweep_configs" / "smoke.yaml"),
                          "--dry_run"], cwd=REPO if cwd == "repo" else script.parent, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install --no-deps sweeps==0.3.0" in lines[0], run.stderr


def test_a_sweep_file_named_from_the_repo_root_is_found_from_any_directory(tmp_path):
    """`cd /tmp && python REPO/scripts/sweep.py scripts/sweep_configs/smoke.yaml`: relative paths are the repo
    root's, as everywhere (it said "no such file")."""
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "sweep.py"), "scripts/sweep_configs/smoke.yaml",
                          "--sweep_dir", str(tmp_path / "sweep"), "--dry_run"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "[dry run] 2 trials to run; nothing was run or written" in run.stdout


def test_default_wandb_mode_is_offline_without_a_key(monkeypatch, tmp_path):
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))
    assert default_wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert default_wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert default_wandb_mode() == "disabled"


# ----------------------------------------------------------------------------- bookkeeping with a fake trainer
FAKE_TRAINER = textwrap.dedent("""
    import argparse, json, pathlib, sys
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir"); parser.add_argument("--mode"); parser.add_argument("--seed", type=int)
    args, _ = parser.parse_known_args()
    out = pathlib.Path(args.out_dir); out.mkdir(parents=True, exist_ok=True)
    with open(out / "attempts.txt", "a") as f:
        f.write("x")
    if args.mode == "crash":
        print("Traceback: boom", file=sys.stderr); sys.exit(1)
    if args.mode == "silent":  # fails printing nothing (as a trial the OOM killer ends)
        sys.exit(1)
    if args.mode == "meet":  # finishes only once another trial has started beside it
        import os, time
        meeting = pathlib.Path(os.environ["MEET_DIR"]); (meeting / out.name).touch()
        waited = 0
        while len(list(meeting.iterdir())) < 2:
            if waited > 600:
                print("nobody came", file=sys.stderr); sys.exit(1)
            time.sleep(0.1); waited += 1
    if args.mode == "stdin":  # reads its input to the end: a trial's stdin must be empty, not the runner's
        sys.stdin.read()
    if args.mode == "hold":  # runs until the test lets it end
        import os, time
        (out / "pid.txt").write_text(str(os.getpid()))
        for _ in range(6000):
            if pathlib.Path(os.environ["HOLD_FILE"]).exists():
                break
            time.sleep(0.1)
    status = "diverged" if args.mode == "diverge" else "finished"
    summary = {"status": status, "steps": 4, "final_val": {} if status == "diverged" else {"loss": 1.5 + args.seed},
               "median_step_time_s": 0.01, "tokens_per_s": 100.0}
    if status == "diverged":  # as the trainer writes a run that timed no step: not finite, so null (strict JSON)
        summary["median_step_time_s"] = summary["tokens_per_s"] = None
    (out / "run_summary.json").write_text(json.dumps(summary))
    (out / "metrics.jsonl").write_text(json.dumps({"step": 4, "split": "val", "val_loss": 1.5 + args.seed}) + "\\n")
    sys.exit(3 if status == "diverged" else 0)
""")


def test_diverged_is_recorded_not_crashed_and_failures_retry(tmp_path):
    (tmp_path / "fake_train.py").write_text(FAKE_TRAINER)
    path = tmp_path / "fake.yaml"
    path.write_text(yaml.safe_dump({
        "name": "fake", "program": str(tmp_path / "fake_train.py"), "method": "grid",
        "command": ["${interpreter}", "${program}", "${args}"],
        "metric": {"name": "val_loss", "goal": "minimize"},
        "parameters": {"mode": {"values": ["ok", "diverge", "crash"]}, "seed": {"value": 1}}}))
    sweep_dir = tmp_path / "sweep"
    trials = run_sweep(path, sweep_dir, wandb_mode="disabled")
    assert [t["status"] for t in trials] == ["finished", "diverged", "failed"]
    records = {r["params"]["mode"]: r for r in read_results(sweep_dir)}
    assert records["ok"]["metric"] == 2.5 and records["ok"]["status"] == "finished"
    assert records["diverge"]["returncode"] == 3 and records["diverge"]["metric"] is None
    assert records["diverge"]["median_step_time_s"] is None
    assert strict_json_files(sweep_dir)  # the state and the results: strict JSON
    assert records["crash"]["returncode"] == 1 and "boom" in records["crash"]["error"]
    command = (sweep_dir / records["ok"]["trial_dir"] / "train.log").read_text()
    assert "--use_wandb=false" in command and "--wandb_group" not in command  # no wandb run to name
    assert "note:" not in command  # no unused flag from the runner
    # Restarted: finished and diverged trials are skipped, the crashed one is retried.
    run_sweep(path, sweep_dir, wandb_mode="disabled")
    attempts = {mode: (sweep_dir / r["trial_dir"] / "attempts.txt").read_text() for mode, r in records.items()}
    assert attempts == {"ok": "x", "diverge": "x", "crash": "xx"}
    # A different config in the same folder is refused instead of mixing results.
    changed = yaml.safe_load(path.read_text())
    changed["parameters"]["seed"] = {"value": 2}
    path.write_text(yaml.safe_dump(changed))
    with pytest.raises(SweepConfigError, match="different config"):
        run_sweep(path, sweep_dir, wandb_mode="disabled")


def test_a_failed_trial_says_whether_its_error_is_a_message_or_its_output(tmp_path, capsys):
    """A failed trial's error is its own output (this attempt's): a trial that printed nothing is said to have,
    rather than shown the log's last line, its command line, as its error; one line of output is shown as the
    log's, not as a message."""
    path = _fake_sweep(tmp_path, {"mode": {"values": ["silent", "crash"]}, "seed": {"value": 1}})
    sweep_dir = tmp_path / "sweep"
    for attempt in (1, 2):  # the retry's log holds the first attempt's output too
        capsys.readouterr()
        run_sweep(path, sweep_dir, wandb_mode="disabled")
        err = capsys.readouterr().err
        records = {r["params"]["mode"]: r for r in read_results(sweep_dir)[-2:]}
        silent = f"it printed nothing (its command is in {sweep_dir / records['silent']['trial_dir'] / 'train.log'})"
        assert records["silent"]["error"] == silent
        assert f"  trial [1] {records['silent']['trial_id']} failed (exit 1): {silent}\n" in err, err
        assert records["crash"]["error"] == "Traceback: boom"
        assert f"  trial [2] {records['crash']['trial_id']} failed (exit 1); last line of its log: Traceback: boom\n" \
            in err, err
        assert "fake_train.py" not in err  # no command line shown as an error


def test_workers_run_trials_side_by_side_and_record_each_once(tmp_path, monkeypatch):
    """--workers 2: each "meet" trial waits until another has started, so a runner that ran them one at a time
    would see them fail; the state and results still hold every trial once, and a restart has nothing to do."""
    (tmp_path / "fake_train.py").write_text(FAKE_TRAINER)
    (tmp_path / "meeting").mkdir()
    monkeypatch.setenv("MEET_DIR", str(tmp_path / "meeting"))
    path = tmp_path / "fake.yaml"
    path.write_text(yaml.safe_dump({
        "name": "fake", "program": str(tmp_path / "fake_train.py"), "method": "grid",
        "command": ["${interpreter}", "${program}", "${args}"], "metric": {"name": "val_loss", "goal": "minimize"},
        "parameters": {"mode": {"value": "meet"}, "seed": {"values": [1, 2, 3]}}}))
    sweep_dir = tmp_path / "sweep"
    trials = run_sweep(path, sweep_dir, wandb_mode="disabled", workers=2)
    assert [(t["params"]["seed"], t["status"], t["metric"]) for t in trials] == [
        (1, "finished", 2.5), (2, "finished", 3.5), (3, "finished", 4.5)]
    records = read_results(sweep_dir)
    assert sorted(r["params"]["seed"] for r in records) == [1, 2, 3] and len({r["trial_dir"] for r in records}) == 3
    assert json.loads((sweep_dir / "sweep_state.json").read_text())["trials"] == trials
    assert run_sweep(path, sweep_dir, wandb_mode="disabled", workers=2) == trials and len(read_results(sweep_dir)) == 3
    assert all((sweep_dir / r["trial_dir"] / "attempts.txt").read_text() == "x" for r in records)


def _fake_sweep(tmp_path: Path, parameters: dict, method: str = "grid") -> Path:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "fake_train.py").write_text(FAKE_TRAINER)
    path = tmp_path / "fake.yaml"
    path.write_text(yaml.safe_dump({
        "name": "fake", "program": str(tmp_path / "fake_train.py"), "method": method,
        "command": ["${interpreter}", "${program}", "${args}"], "metric": {"name": "val_loss", "goal": "minimize"},
        "parameters": parameters, **({"run_cap": 2} if method == "random" else {})}))
    return path


def test_a_random_search_runs_each_trial_once_and_ends_when_none_is_left(tmp_path, capsys):
    """Three seeds, run_cap 6: the engine proposed a trial again and again, each a second state entry of the same
    trial that used a run_cap slot and ran nothing (the dry run listed seed 3 three times). It is asked again; with
    no trial left the sweep ends and says why."""
    path = _fake_sweep(tmp_path, {"mode": {"value": "ok"}, "seed": {"values": [1, 2, 3]}}, method="random")
    path.write_text(path.read_text().replace("run_cap: 2", "run_cap: 6"))
    trials = run_sweep(path, tmp_path / "sweep", wandb_mode="disabled")
    assert sorted(t["params"]["seed"] for t in trials) == [1, 2, 3]
    assert [r["status"] for r in read_results(tmp_path / "sweep")] == ["finished"] * 3
    assert "its search proposed only trials it has, 100 times; it ends with 3 of run_cap 6" in capsys.readouterr().out


def test_records_dir_outlives_the_sweep_folder(tmp_path, capsys):
    """What a new machine sees: the sweep folder is gone, the committed records folder is there; the same command
    brings the done trials back (the report reads them as before) and runs only the rest."""
    from eval.studies.ablation.load import load_sweep

    path = _fake_sweep(tmp_path, {"mode": {"values": ["ok", "diverge", "crash"]}, "seed": {"values": [1, 2]}})
    sweep_dir, records = tmp_path / "sweep", tmp_path / "records"
    run_sweep(path, sweep_dir, wandb_mode="disabled", records_dir=records, only=["seed=1"])
    done = {r["trial_id"]: r for r in read_results(sweep_dir) if r["status"] != "failed"}
    assert sorted(r["params"]["mode"] for r in done.values()) == ["diverge", "ok"]
    for tid, record in done.items():  # each done trial's summary and config as they are, its metrics gzipped
        kept = records / record["trial_dir"]
        ran = sweep_dir / record["trial_dir"]
        assert (kept / "run_summary.json").read_bytes() == (ran / "run_summary.json").read_bytes()
        assert gzip.decompress((kept / "metrics.jsonl.gz").read_bytes()) == (ran / "metrics.jsonl").read_bytes()
        assert not (kept / "attempts.txt").exists() and not (kept / "train.log").exists()
    assert read_results(records) == read_results(sweep_dir)
    failed = next(r for r in read_results(records) if r["status"] == "failed")
    assert not (records / failed["trial_dir"]).exists()  # a failed trial is retried, not kept

    # A new machine: no sweep folder. Only the failed trial and the seed-2 ones run; the done ones come back.
    shutil.rmtree(sweep_dir)
    capsys.readouterr()
    run_sweep(path, sweep_dir, wandb_mode="disabled", records_dir=records, dry_run=True)  # lists what would run
    listed = capsys.readouterr().out
    assert f"[dry run] 4 trials to run, 2 done in {records}" in listed and listed.count("[dry run] mode-") == 4
    assert not sweep_dir.exists()
    trials = run_sweep(path, sweep_dir, wandb_mode="disabled", records_dir=records)
    assert sorted((t["params"]["mode"], t["params"]["seed"], t["status"]) for t in trials) == [
        ("crash", 1, "failed"), ("crash", 2, "failed"), ("diverge", 1, "diverged"), ("diverge", 2, "diverged"),
        ("ok", 1, "finished"), ("ok", 2, "finished")]
    for tid, record in done.items():
        assert not (sweep_dir / record["trial_dir"] / "attempts.txt").exists()  # brought back, not rerun
        assert read_metrics(sweep_dir / record["trial_dir"]) == [
            {"step": 4, "split": "val", "val_loss": 1.5 + record["params"]["seed"]}]
    assert sum(r["trial_id"] in done for r in read_results(sweep_dir)) == 2  # each once
    _, loaded = load_sweep(sweep_dir)
    assert {(t.params["mode"], t.params["seed"]): t.final_val_loss for t in loaded if t.status == "finished"} == {
        ("ok", 1): 2.5, ("ok", 2): 3.5}
    # Restarted again, over both folders: nothing to do, nothing doubled.
    before = read_results(sweep_dir)
    run_sweep(path, sweep_dir, wandb_mode="disabled", records_dir=records, only=["mode=ok,diverge"])
    assert read_results(sweep_dir) == before == read_results(records)

    # Records of another sweep are refused, naming the flag, before anything is copied.
    other = _fake_sweep(tmp_path / "other", {"mode": {"values": ["ok"]}, "seed": {"value": 9}})
    with pytest.raises(SweepConfigError, match="records.*different config; use another --records_dir"):
        run_sweep(other, tmp_path / "sweep2", wandb_mode="disabled", records_dir=records)
    assert not (tmp_path / "sweep2" / "results.jsonl").exists()


@pytest.mark.parametrize("broken", ["lfs pointer", "cut short"])
def test_a_records_metrics_file_that_is_not_gzip_is_one_line_and_nothing_is_restored(tmp_path, capsys, broken):
    """A metrics.jsonl.gz that is a git-LFS pointer (a clone without LFS) or cut short: the sweep names the file in
    one line (exit 2), not a BadGzipFile/EOFError traceback, and no trial is brought back half."""
    path = _fake_sweep(tmp_path, {"mode": {"values": ["ok"]}, "seed": {"values": [1, 2]}})
    sweep_dir, records = tmp_path / "sweep", tmp_path / "records"
    run_sweep(path, sweep_dir, wandb_mode="disabled", records_dir=records)
    shutil.rmtree(sweep_dir)
    gz = sorted(records.glob("trials/*/metrics.jsonl.gz"))[-1]
    gz.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n" if broken == "lfs pointer"
                   else gz.read_bytes()[:-8])
    capsys.readouterr()
    assert sweep_mod.main([str(path), "--sweep_dir", str(sweep_dir), "--records_dir", str(records),
                           "--wandb_mode", "disabled"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{gz}: not a readable gzip file" in err
    assert not (sweep_dir / "results.jsonl").exists() and not any((sweep_dir / "trials").iterdir())


def test_a_records_done_trial_without_its_summary_is_one_line_and_runs_again_once_its_line_is_removed(tmp_path,
                                                                                                      capsys):
    """A records folder whose finished trial lost its run_summary.json (a partial copy or commit): the trial was
    brought back as done without it, without a word (the report then had no final loss for it, and it never ran
    again). Now one line names the file and the way on (exit 2), nothing is brought back; with the trial's line
    removed from the records' results.jsonl, the same command runs it again and brings the other back."""
    path = _fake_sweep(tmp_path, {"mode": {"values": ["ok"]}, "seed": {"values": [1, 2]}})
    sweep_dir, records = tmp_path / "sweep", tmp_path / "records"
    run_sweep(path, sweep_dir, wandb_mode="disabled", records_dir=records)
    shutil.rmtree(sweep_dir)
    summary = sorted(records.glob("trials/*/run_summary.json"))[-1]
    summary.unlink()
    capsys.readouterr()
    command = [str(path), "--sweep_dir", str(sweep_dir), "--records_dir", str(records), "--wandb_mode", "disabled"]
    refusal = (f"error: --records_dir: {summary} is missing; nothing was brought back: restore the records' files "
               f"(git checkout, git lfs pull, or a copy from the machine that ran the trial), or remove the "
               f"trial's lines from {records / 'results.jsonl'} to run it again\n")
    # The dry run refuses what the real run refuses (it listed the damaged trial as "done in" the records).
    assert sweep_mod.main([*command, "--dry_run"]) == 2
    assert capsys.readouterr().err == refusal and not sweep_dir.exists()
    assert sweep_mod.main(command) == 2
    assert capsys.readouterr().err == refusal
    assert not (sweep_dir / "results.jsonl").exists() and not any((sweep_dir / "trials").iterdir())
    results = records / "results.jsonl"
    results.write_text("".join(line for line in results.read_text().splitlines(keepends=True)
                               if summary.parent.name not in line))
    assert sweep_mod.main([*command, "--dry_run"]) == 0
    assert f"[dry run] 1 trials to run, 1 done in {records}" in capsys.readouterr().out
    assert sweep_mod.main(command) == 0
    assert "1 done trials brought back" in capsys.readouterr().out
    assert summary.is_file()  # it ran again, and its records are whole
    assert sorted(r["status"] for r in read_results(records)) == ["finished", "finished"]


@pytest.mark.parametrize("name", ["run_summary.json", "train_config.yaml", "metrics.jsonl"])
def test_a_folder_where_a_restored_trials_file_goes_is_one_line_and_nothing_is_restored(tmp_path, capsys, name):
    """A sweep folder whose trial holds a folder where the records' run_summary.json (train_config.yaml,
    metrics.jsonl) goes back: the copy ended the sweep in an IsADirectoryError traceback, the trials before it
    brought back."""
    path = _fake_sweep(tmp_path, {"mode": {"values": ["ok"]}, "seed": {"values": [1, 2]}})
    sweep_dir, records = tmp_path / "sweep", tmp_path / "records"
    run_sweep(path, sweep_dir, wandb_mode="disabled", records_dir=records)
    (records / "trials" / trial_id({"mode": "ok", "seed": 2}, ["mode", "seed"]) / "train_config.yaml").write_text(
        "task: pretrain\n")  # the fake trainer writes none
    shutil.rmtree(sweep_dir)
    folder = sweep_dir / "trials" / trial_id({"mode": "ok", "seed": 2}, ["mode", "seed"]) / name
    folder.mkdir(parents=True)
    capsys.readouterr()
    assert sweep_mod.main([str(path), "--sweep_dir", str(sweep_dir), "--records_dir", str(records),
                           "--wandb_mode", "disabled"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {folder} is a folder, not a file\n", err
    assert not (sweep_dir / "results.jsonl").exists() and [p.name for p in (sweep_dir / "trials").iterdir()] == [
        folder.parent.name] and [p.name for p in folder.parent.iterdir()] == [name]


def test_max_trials_0_only_brings_the_records_back(tmp_path, capsys):
    """As the docs say (sweeps.md, study.md): `--max_trials 0` on a fresh clone restores the done trials for the
    report and runs none."""
    path = _fake_sweep(tmp_path, {"mode": {"values": ["ok", "diverge"]}, "seed": {"values": [1, 2]}})
    sweep_dir, records = tmp_path / "sweep", tmp_path / "records"
    run_sweep(path, sweep_dir, wandb_mode="disabled", records_dir=records, only=["seed=1"])
    shutil.rmtree(sweep_dir)
    capsys.readouterr()
    assert sweep_mod.main([str(path), "--sweep_dir", str(sweep_dir), "--records_dir", str(records),
                           "--wandb_mode", "disabled", "--max_trials", "0"]) == 0, capsys.readouterr().err
    assert "2 done trials brought back" in capsys.readouterr().out
    assert read_results(sweep_dir) == read_results(records)
    assert sorted(r["params"]["seed"] for r in read_results(sweep_dir)) == [1, 1]  # no seed-2 trial ran
    assert not any((sweep_dir / r["trial_dir"] / "attempts.txt").exists() for r in read_results(sweep_dir))


def test_a_sweep_killed_before_its_first_state_write_runs_with_a_records_dir(tmp_path, capsys):
    """A sweep folder with no state yet (a new one, or a runner killed before it wrote the state: its trials folder
    made, nothing else) is a new sweep: its records are saved once there is a state, not refused for lacking one
    (save_records refuses a folder that holds no sweep)."""
    path = _fake_sweep(tmp_path, {"mode": {"value": "ok"}, "seed": {"values": [1, 2]}})
    sweep_dir, records = tmp_path / "sweep", tmp_path / "records"
    (sweep_dir / "trials").mkdir(parents=True)
    command = [str(path), "--sweep_dir", str(sweep_dir), "--records_dir", str(records), "--wandb_mode", "disabled"]
    assert sweep_mod.main([*command, "--max_trials", "0"]) == 0, capsys.readouterr().err
    assert not (sweep_dir / "sweep_state.json").exists()  # nothing ran: nothing to save
    assert sweep_mod.main([*command, "--max_trials", "1"]) == 0, capsys.readouterr().err
    assert [r["status"] for r in read_results(records)] == ["finished"] and (records / "sweep_state.json").is_file()


@pytest.mark.parametrize("spelling", ["same", "symlink"])
def test_a_records_dir_that_is_the_sweep_folder_is_refused(tmp_path, spelling):
    """Also through a symlink: the folders are compared resolved (dataset.atomic_io.path_overlap), not as spelt."""
    path = _fake_sweep(tmp_path, {"seed": {"values": [1]}})
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    records = {"same": sweep_dir, "symlink": tmp_path / "link"}[spelling]
    if spelling == "symlink":
        records.symlink_to(sweep_dir)
    with pytest.raises(SweepConfigError, match="--records_dir must differ from the sweep folder"):
        run_sweep(path, sweep_dir, wandb_mode="disabled", records_dir=records)
    assert list(sweep_dir.iterdir()) == []


def test_only_runs_part_of_a_grid_and_leaves_the_rest_proposed(tmp_path, capsys):
    path = _fake_sweep(tmp_path, {"mode": {"values": ["ok", "diverge"]}, "seed": {"values": [1, 2, 3]}})
    sweep_dir = tmp_path / "sweep"
    trials = run_sweep(path, sweep_dir, wandb_mode="disabled", only=["seed=3,2", "mode=ok"])
    ran = sorted((r["params"]["mode"], r["params"]["seed"]) for r in read_results(sweep_dir))
    assert ran == [("ok", 2), ("ok", 3)]
    assert len(trials) == 6 and sum(t["status"] == "pending" for t in trials) == 4  # the rest: proposed, waiting
    trials = run_sweep(path, sweep_dir, wandb_mode="disabled")
    assert sorted((t["params"]["mode"], t["params"]["seed"]) for t in trials) == sorted(
        (m, s) for m in ("ok", "diverge") for s in (1, 2, 3))
    assert all(t["status"] in ("finished", "diverged") for t in trials) and len(read_results(sweep_dir)) == 6
    # Bad filters: one line naming the flag and the allowed values.
    for only, message in ((["seed=7"], "--only seed=7: not in the grid; allowed: 1, 2, 3"),
                          (["bogus=1"], "NAME one of mode, seed"), (["seed"], "expected NAME=VALUE")):
        with pytest.raises(SweepConfigError, match=re.escape(message)):
            run_sweep(path, tmp_path / "unused", wandb_mode="disabled", only=only)
    random_path = _fake_sweep(tmp_path / "r", {"seed": {"values": [1, 2]}}, method="random")
    with pytest.raises(SweepConfigError, match="--only needs a grid sweep"):
        run_sweep(random_path, tmp_path / "unused", wandb_mode="disabled", only=["seed=1"])
    assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "unused"), "--only", "seed=0.5"]) == 2
    assert "allowed: 1, 2, 3" in capsys.readouterr().err
    assert not (tmp_path / "unused").exists()


# ----------------------------------------------------------------------------- a real sweep, end to end
def _tiny_sweep(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"text": TEXTS[i % 4] * 2}) + "\n" for i in range(24)))
    (data / "val.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    config = yaml.safe_load((REPO / "scripts" / "sweep_configs" / "smoke.yaml").read_text())
    config["name"] = "tiny"
    config["parameters"].update({"data_path": {"value": str(data / "train.jsonl")},
                                 "val_data_path": {"value": str(data / "val.jsonl")},
                                 "max_steps": {"value": 3}, "eval_interval": {"value": 2}})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _run_cli(config: Path, sweep_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    env.pop("WANDB_API_KEY", None)
    return subprocess.run([sys.executable, str(REPO / "scripts" / "sweep.py"), str(config),
                           "--sweep_dir", str(sweep_dir), *extra], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def _run_main(monkeypatch, capsys, config: Path, sweep_dir: Path, *extra: str) -> tuple[int, str]:
    """scripts/sweep.py's main in this process, in _run_cli's environment: its exit code and its stdout (the trials
    it starts are processes all the same; the command line itself is _first_trial_done's)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.chdir(REPO)
    capsys.readouterr()
    code = sweep_mod.main([str(config), "--sweep_dir", str(sweep_dir), *extra])
    return code, capsys.readouterr().out


@pytest.fixture(scope="module")
def _first_trial_done(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess, Path]:
    """The tiny sweep's runner "killed" after its first trial (--max_trials 1 stops it between trials), run once for
    the tests that go on from there: the config, its sweep folder, that run, and a copy of the folder as it left it."""
    root = tmp_path_factory.mktemp("first_trial")
    config, sweep_dir = _tiny_sweep(root), root / "sweep"
    first = _run_cli(config, sweep_dir, "--max_trials", "1")
    shutil.copytree(sweep_dir, root / "after_first_trial", symlinks=True)
    return config, sweep_dir, first, root / "after_first_trial"


@pytest.fixture
def first_trial_done(_first_trial_done) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """_first_trial_done's sweep folder put back, in its own place (the trials' flags name it), as the first trial
    left it: each test changes it its own way."""
    config, sweep_dir, first, as_left = _first_trial_done
    shutil.rmtree(sweep_dir)
    shutil.copytree(as_left, sweep_dir, symlinks=True)
    return config, sweep_dir, first


def test_two_trial_grid_runs_serverless_resumes_and_reports(first_trial_done, tmp_path, monkeypatch, capsys):
    from eval.studies.ablation.report import write_report
    from trainer.run_dir import read_metrics

    config, sweep_dir, first = first_trial_done  # "killed" after the first trial
    assert first.returncode == 0, first.stdout + first.stderr
    (record,) = read_results(sweep_dir)
    assert record["status"] == "finished" and record["wandb_mode"] == "offline"
    first_dir = sweep_dir / record["trial_dir"]
    assert list(first_dir.glob("wandb/offline-run-*")), "no offline wandb run directory"
    log = (first_dir / "train.log").read_text()
    assert f"--wandb_run_name={record['trial_id']}" in log and "note:" not in log  # its wandb run named, no note
    stamp = ((first_dir / "run_summary.json").stat().st_mtime_ns, (first_dir / "metrics.jsonl").read_bytes())
    with open(sweep_dir / "results.jsonl", "a") as handle:  # a kill in the middle of a write
        handle.write('{"trial_id": "torn')

    code, said = _run_main(monkeypatch, capsys, config, sweep_dir)
    assert code == 0, said
    assert "1 trials already done" in said and record["trial_id"] not in said
    records = read_results(sweep_dir)
    assert [r["status"] for r in records] == ["finished", "finished"]
    assert [r["params"]["norm_type"] for r in records] == ["rmsnorm", "layernorm"]
    assert ((first_dir / "run_summary.json").stat().st_mtime_ns, (first_dir / "metrics.jsonl").read_bytes()) == stamp
    assert list((sweep_dir / records[1]["trial_dir"]).glob("wandb/offline-run-*"))
    assert yaml.safe_load((sweep_dir / records[1]["trial_dir"] / "train_config.yaml").read_text())[
        "norm_type"] == "layernorm"

    assert [t["status"] for t in run_sweep(config, sweep_dir)] == ["finished", "finished"]  # nothing left to do
    assert len(read_results(sweep_dir)) == 2

    # The report's numbers are the trials' logged numbers.
    report = write_report(sweep_dir, tmp_path / "report")
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    markdown = report.read_text()
    for rec, row in zip(records, data["variants"]):
        trial_dir = sweep_dir / rec["trial_dir"]
        summary = json.loads((trial_dir / "run_summary.json").read_text())
        logged = read_metrics(trial_dir / "metrics.jsonl", "val")[-1]["val_loss"]
        assert row["params"] == {"norm_type": rec["params"]["norm_type"]}
        assert row["val_loss_mean"] == summary["final_val"]["loss"] == logged == rec["metric"]
        assert row["median_step_time_s"] == summary["median_step_time_s"]
        assert row["tokens_per_s"] == summary["tokens_per_s"]
        assert f"{summary['final_val']['loss']:.4f}" in markdown
        assert f"{summary['median_step_time_s'] * 1000:.1f}" in markdown
    assert (tmp_path / "report" / "val_curves.png").read_bytes()[:4] == b"\x89PNG"

    # --unigram: the baseline of the trials' own data (their data files, tokenizer and max_seq_len 32).
    from torch.utils.data import DataLoader

    from dataset.pretrain_dataset import PretrainDataset
    from dataset.tokenization import load_tokenizer
    from trainer.evaluation import unigram_eval
    tokenizer = load_tokenizer()
    data_dir = config.parent / "data"  # the trials' data, beside their config
    train, val = (PretrainDataset(data_dir / f"{split}.jsonl", tokenizer, 32) for split in ("train", "val"))
    expected = unigram_eval(DataLoader(train, batch_size=5), DataLoader(val, batch_size=3), len(tokenizer))
    report = write_report(sweep_dir, tmp_path / "report_unigram", unigram=True)
    data = json.loads((tmp_path / "report_unigram" / "report.json").read_text())
    assert data["unigram"]["tiny"]["loss"] == pytest.approx(expected.loss, rel=1e-12)
    assert data["unigram"]["tiny"]["tokens"] == expected.tokens and data["unigram"]["tiny"]["max_seq_len"] == 32
    for row in data["variants"]:
        assert row["vs_unigram"] == pytest.approx(row["val_loss_mean"] - expected.loss, abs=1e-12)
    assert f"Unigram baseline: **{expected.loss:.4f}** nats" in report.read_text()


def test_a_trial_that_finished_just_before_its_runner_was_killed_is_not_trained_again(first_trial_done, monkeypatch,
                                                                                     capsys):
    """The runner killed after its trial wrote run_summary.json (the trainer then still saves, samples and closes
    wandb, about a second) but before the runner recorded it: the folder holds the finished run, the results file
    and the state do not. The rerun's trainer (`--resume auto`, the same flags) finds that run finished and returns
    it as it is; the runner deleted its summary first, so the trial was trained again from scratch."""
    config, sweep_dir, first = first_trial_done
    assert first.returncode == 0, first.stdout + first.stderr
    (record,) = read_results(sweep_dir)
    trial_dir = sweep_dir / record["trial_dir"]
    # the kill: nothing recorded yet, the trial still running in the state
    (sweep_dir / "results.jsonl").write_text("")
    state = json.loads((sweep_dir / "sweep_state.json").read_text())
    state["trials"][0].update(status="running", metric=None)
    (sweep_dir / "sweep_state.json").write_text(json.dumps(state))
    stamp = {name: (trial_dir / name).read_bytes() for name in ("run_summary.json", "metrics.jsonl",
                                                                "model.safetensors")}

    code, said = _run_main(monkeypatch, capsys, config, sweep_dir, "--max_trials", "1")
    assert code == 0, said
    (again,) = read_results(sweep_dir)
    assert again["trial_id"] == record["trial_id"] and again["status"] == "finished"
    assert again["metric"] == record["metric"] and again["final_val"] == record["final_val"]
    assert {name: (trial_dir / name).read_bytes() for name in stamp} == stamp  # not trained again
    assert "nothing left to train" in (trial_dir / "train.log").read_text()


# ----------------------------------------------------------------------------- hostile YAMLs and damaged sweep folders
@pytest.mark.parametrize("text, field", [
    ("parameters:\n  1: {values: [1, 2]}\n", "parameters: parameter names must be strings, got 1"),
    ("parameters:\n  seed: {values: [1, .nan]}\n", "parameters.seed.values[1]: nan is not a finite number"),
    ("parameters:\n  lr: {min: 0.0, max: .inf}\n", "parameters.lr.max: inf is not a finite number"),
    ("parameters:\n  seed: {value: .nan}\n", "parameters.seed.value: nan is not a finite number"),
    ("parameters:\n  seed: {values: [1]}\n  seed: {values: [2]}\n", 'duplicate key "seed"'),
    ("parameters:\n  seed: {values: [1, 2001-02-30]}\n",  # a ValueError naming neither file nor line
     '"2001-02-30" is not a valid timestamp (day is out of range for month) (line 4)'),
    ("parameters:\n  seed: {values: [!!bool maybe]}\n", '"maybe" is not a valid bool (line 4)'),  # a KeyError
    ("name: ../escape\nparameters:\n  seed: {values: [1]}\n", "name: '../escape' is not a folder name"),
    ("name: a/b\nparameters:\n  seed: {values: [1]}\n", "name: 'a/b' is not a folder name"),
    # wandb's schema said only "invalid hyperparameter configuration: seed"
    ("parameters:\n  seed: {values: []}\n", "parameters.seed.values: expected a non-empty list of values, got []"),
    ("parameters:\n  seed: {values: 5}\n", "parameters.seed.values: expected a non-empty list of values, got 5"),
    ("parameters:\n  seed: {valeus: [1, 2]}\n", "parameters.seed.valeus: not a key of a parameter spec; allowed: "
                                                 "value, values, distribution, probabilities, min, max, mu, sigma"),
    ("parameters:\n  seed: {value: 1, values: [1, 2]}\n",
     "parameters.seed: {'value': 1, 'values': [1, 2]} is not a parameter spec wandb accepts; expected {value: X}, "
     "{values: [X, ...]} or a distribution"),
    # a long value is quoted as every refusal quotes one (dataset/shown_value.py): its repr cut at 57 characters and
    # "..." added, where it was printed whole
    ("parameters:\n  seed: {values: " + "x" * 300 + "}\n",
     "parameters.seed.values: expected a non-empty list of values, got '" + "x" * 56 + "..."),
    ("parameters:\n  seed: {value: 1, values: [" + ", ".join(map(str, range(100))) + "]}\n",
     # 24 characters before the list, 3 per number to "9, ", then "10,"
     "parameters.seed: {'value': 1, 'values': [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,... is not a parameter spec wandb "
     "accepts"),
])
def test_hostile_sweep_yaml_is_one_line_naming_the_field(tmp_path, capsys, text, field):
    path = tmp_path / "bad.yaml"
    # a program that would fail at once, were a trial ever started
    path.write_text(f"method: grid\nprogram: {tmp_path / 'never_run.py'}\n" + text)
    assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(path) in err and field in err, err
    assert not (tmp_path / "s").exists()


def test_a_sweep_yaml_may_merge_one_spec_into_another(tmp_path):
    """YAML's merge key (`<<: *base`) gives one parameter spec another's keys, a key of its own overriding the merged
    one; the duplicate-key check once read `<<` as a key and refused every merge ("could not determine a constructor
    for the tag 'tag:yaml.org,2002:merge'"). A key given twice beside a merge is still refused."""
    path = tmp_path / "merge.yaml"
    path.write_text(f"method: grid\nprogram: {REPO / 'trainer' / 'train_pretrain.py'}\nparameters:\n"
                    "  learning_rate: &rate {values: [0.001, 0.01]}\n"
                    "  muon_lr:\n    <<: *rate\n    values: [0.02]\n"
                    "  weight_decay:\n    <<: *rate\n")
    parameters = load_sweep_config(path)["parameters"]
    assert parameters["muon_lr"] == {"values": [0.02]}
    assert parameters["weight_decay"] == parameters["learning_rate"] == {"values": [0.001, 0.01]}
    path.write_text(path.read_text() + "    values: [0.1]\n    values: [0.2]\n")
    with pytest.raises(SweepConfigError, match=re.escape(f'{path}: duplicate key "values" (line 11)')):
        load_sweep_config(path)


@pytest.mark.parametrize("parameters, message", [
    ("".join(f"  p{i}: {{values: [0, 1, 2, 3, 4]}}\n" for i in range(6)) + "  seed: {value: 1}\n",
     "a grid of 15625 trials (p0: 5 x p1: 5 x p2: 5 x p3: 5 x p4: 5 x p5: 5 values)"),
    ("  seed: {distribution: int_uniform, min: 0, max: 19999}\n", "a grid of 20000 trials (seed: 20000 values)"),
    ("  lr: {distribution: q_uniform, min: 0, max: 1, q: 0.00005}\n", "a grid of 20000 trials (lr: 20000 values)"),
])
def test_a_grid_too_large_to_list_is_one_line_before_anything_runs(tmp_path, capsys, parameters, message):
    """wandb's grid engine lists every point of the grid at each proposal (an int_uniform range as a list of its
    integers): a huge grid (`seed: {min: 0, max: 4294967295}`) ran out of memory with a MemoryError traceback, or
    took the machine's memory first; it is refused, naming its size and parameters, before anything is proposed."""
    path = tmp_path / "huge.yaml"
    path.write_text(f"method: grid\nprogram: {tmp_path / 'never_run.py'}\nparameters:\n" + parameters)
    assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "s"), "--dry_run", "--max_trials", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{path}: parameters: {message}" in err and "at most 10000" in err, err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("values, message", [
    ("[rmsnorm, layernorm, rmsnorm]", "parameters.norm_type.values[2]: 'rmsnorm' is values[0] again"),
    ("[[1, 2], [1, 2]]", "parameters.norm_type.values[1]: [1, 2] is values[0] again"),
    # equal numbers are one value to the flag that reads them ("1" and "1.0"): json.dumps wrote them apart
    ("[1, 1.0]", "parameters.norm_type.values[1]: 1.0 is values[0] again"),
    ("[2, [1, 2.0], [1.0, 2]]", "parameters.norm_type.values[2]: [1.0, 2] is values[1] again"),
])
def test_a_grid_value_listed_twice_is_one_line_before_anything_runs(tmp_path, capsys, values, message):
    """A grid runs one trial per distinct value: [rmsnorm, layernorm, rmsnorm] ran two trials without a word (the
    third value, a typo for another, was lost). Random search may weight a value by listing it twice: not refused."""
    path = tmp_path / "twice.yaml"
    path.write_text(f"method: grid\nprogram: {tmp_path / 'never_run.py'}\nparameters:\n"
                    f"  norm_type: {{values: {values}}}\n")
    (tmp_path / "never_run.py").write_text("")  # another program's: its flags are not checked
    assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "s"), "--dry_run"]) == 2
    assert capsys.readouterr().err == f"error: {path}: {message}; a grid runs each value once: list each value once\n"
    assert not (tmp_path / "s").exists()
    path.write_text(path.read_text().replace("method: grid", "method: random\nrun_cap: 2"))
    assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "s"), "--dry_run"]) == 0, capsys.readouterr().err


def test_grid_values_of_other_kinds_are_distinct_though_equal_in_python(tmp_path, capsys):
    """true is not 1 and the string "1" is not the number 1 (nor 1.5 1): only equal numbers are one value."""
    path = tmp_path / "kinds.yaml"
    path.write_text(f"method: grid\nprogram: {tmp_path / 'never_run.py'}\nparameters:\n"
                    f"  norm_type: {{values: [true, 1, '1', 1.5, [1], [true]]}}\n")
    (tmp_path / "never_run.py").write_text("")
    assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "s"), "--dry_run"]) == 0, capsys.readouterr().err


def _done_sweep(tmp_path: Path) -> tuple[Path, Path]:
    """A fake grid sweep of two trials with the first one done."""
    path = _fake_sweep(tmp_path, {"seed": {"values": [1, 2]}})
    sweep_dir = tmp_path / "sweep"
    run_sweep(path, sweep_dir, wandb_mode="disabled", max_trials=1)
    return path, sweep_dir


def _damage_state(change):
    def damage(sweep_dir: Path) -> None:
        state = json.loads((sweep_dir / "sweep_state.json").read_text())
        change(state)
        (sweep_dir / "sweep_state.json").write_text(json.dumps(state))
    return damage


def _replace_with_dir(name: str):
    def damage(sweep_dir: Path) -> None:
        (sweep_dir / name).unlink()
        (sweep_dir / name).mkdir()
    return damage


@pytest.mark.parametrize("damage, message", [
    (_damage_state(lambda s: s["trials"].append(1)), "trials[1]: expected a mapping"),
    (_damage_state(lambda s: s["trials"][0].pop("trial_id")), "trials[0].trial_id: expected a folder name"),
    (_damage_state(lambda s: s["trials"][0].update(trial_id=[1])), "trials[0].trial_id: expected a folder name"),
    (_damage_state(lambda s: s["trials"][0].update(trial_id="../../../../escaped", status="pending")),
     "trials[0].trial_id: expected a folder name"),
    (_damage_state(lambda s: s["trials"][0].update(params="x")), "trials[0].params: expected a mapping"),
    (_damage_state(lambda s: s["trials"][0].pop("params")), "trials[0].params: expected a mapping"),
    (_damage_state(lambda s: s["trials"][0].update(status=5)), "trials[0].status: expected one of"),
    (lambda d: (d / "sweep_state.json").write_bytes(b"\xff{}"), "not valid UTF-8 (byte 0xff at offset 0)"),
    (_replace_with_dir("sweep_state.json"), "is a directory"),
    (_replace_with_dir("results.jsonl"), "is a directory"),
    (lambda d: open(d / "results.jsonl", "ab").write(b"\xff\n"), "not valid UTF-8 (byte 0xff at offset "),
])
def test_a_damaged_sweep_folder_is_one_line_naming_the_file(tmp_path, capsys, damage, message):
    path, sweep_dir = _done_sweep(tmp_path)
    damage(sweep_dir)
    capsys.readouterr()
    assert sweep_mod.main([str(path), "--sweep_dir", str(sweep_dir), "--wandb_mode", "disabled"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(sweep_dir) in err and message in err, err
    assert sorted(p.name for p in (sweep_dir / "trials").iterdir()) == ["seed-1_fde21282"]  # nothing else ran
    assert not (tmp_path.parent / "escaped").exists()


def test_a_results_line_that_is_no_result_is_skipped_like_a_torn_one(tmp_path):
    path, sweep_dir = _done_sweep(tmp_path)
    with open(sweep_dir / "results.jsonl", "a") as handle:
        handle.write(json.dumps({"trial_id": [1], "status": "finished"}) + "\n")
    trials = run_sweep(path, sweep_dir, wandb_mode="disabled")
    assert [t["status"] for t in trials] == ["finished", "finished"]
    assert (sweep_dir / "trials" / "seed-1_fde21282" / "attempts.txt").read_text() == "x"  # not run again


def test_results_are_read_once_and_a_torn_last_line_is_skipped(tmp_path, monkeypatch):
    """The runner reads results.jsonl after every trial: one read each time, not a check and then a parse."""
    _, sweep_dir = _done_sweep(tmp_path)
    with open(sweep_dir / "results.jsonl", "a") as handle:
        handle.write('{"trial_id": "seed-2_x", "status": "fini')  # a kill mid-write
    opened: list[Path] = []
    path_open = Path.open

    def counting_open(self: Path, *args, **kwargs):
        opened.append(self)
        return path_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", counting_open)
    assert [r["params"] for r in read_results(sweep_dir)] == [{"seed": 1}]
    assert opened == [sweep_dir / "results.jsonl"]
    assert read_results(tmp_path / "no_sweep") == []
    (tmp_path / "dangling").mkdir()
    (tmp_path / "dangling" / "results.jsonl").symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match="results.jsonl: no such file"):
        read_results(tmp_path / "dangling")


def test_a_results_line_damaged_before_the_last_is_skipped_with_one_note_line(tmp_path, capsys):
    """A torn line that a later append ended (a kill mid-write, then the next result) sits in the middle of
    results.jsonl: the runner skipped it without a word; now one note line on stderr names the file and the line, once
    at the start, and the sweep goes on as before (the done trial stays done, the other runs)."""
    path, sweep_dir = _done_sweep(tmp_path)
    results = sweep_dir / "results.jsonl"
    results.write_text('{"trial_id": "seed-2_x", "status": "fini\n' + results.read_text())
    capsys.readouterr()
    trials = run_sweep(path, sweep_dir, wandb_mode="disabled")
    assert [t["status"] for t in trials] == ["finished", "finished"]
    err = capsys.readouterr().err
    assert err == f"note: {results}: 1 line skipped, torn, damaged or no trial's result (line 1); the rest is read\n"
    assert [r["params"] for r in read_results(sweep_dir)] == [{"seed": 1}, {"seed": 2}]


@pytest.mark.parametrize("blocked", ["sweep", "sweep/trials"])
def test_a_sweep_folder_that_is_a_file_is_one_line(tmp_path, capsys, blocked):
    path = _fake_sweep(tmp_path, {"seed": {"values": [1, 2]}})
    (tmp_path / blocked).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / blocked).write_text("x")
    assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "sweep"), "--wandb_mode", "disabled"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(tmp_path / blocked) in err and "is a file, not a folder" in err, err
    if blocked == "sweep":  # the flag and the file, not "sweep/trials: sweep is a file"
        assert f"--sweep_dir {tmp_path / 'sweep'} is a file, not a folder" in err and "trials" not in err, err


def test_records_dir_that_is_a_file_is_one_line_naming_the_flag(tmp_path, capsys):
    path = _fake_sweep(tmp_path, {"seed": {"values": [1, 2]}})
    (tmp_path / "records").write_text("x")
    assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "sweep"), "--records_dir",
                           str(tmp_path / "records"), "--wandb_mode", "disabled"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--records_dir {tmp_path / 'records'} is a file, not a folder" in err, err
    assert not (tmp_path / "sweep").exists()


def test_a_trials_folder_that_cannot_take_writes_is_one_line_before_any_trial(tmp_path, capsys, monkeypatch):
    """A sweep folder whose trials/ cannot be written in (a read-only mount, another user's folder; root passes every
    permission check, so the refusal is simulated as in test_atomic_io): one line naming it, before any trial is
    proposed, where each trial's mkdir used to end the runner with an OSError traceback."""
    path = _fake_sweep(tmp_path, {"seed": {"values": [1, 2]}})
    sweep_dir = tmp_path / "sweep"
    (sweep_dir / "trials").mkdir(parents=True)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != sweep_dir / "trials" and real_access(p, mode))
    assert sweep_mod.main([str(path), "--sweep_dir", str(sweep_dir), "--wandb_mode", "disabled"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --sweep_dir {sweep_dir / 'trials'}: cannot write in {sweep_dir / 'trials'} (no " \
                  f"permission, or a read-only file system)", err
    assert list((sweep_dir / "trials").iterdir()) == [] and not (sweep_dir / "sweep_state.json").exists()


@pytest.mark.parametrize("full", ["results", "state", "trial folder"])
def test_a_disk_that_fills_during_the_sweep_is_one_line_and_a_rerun_goes_on(tmp_path, capsys, monkeypatch, full):
    """No space left (or the folder turned read-only) while the sweep runs: the runner ends in one line naming the
    file it could not write, not an OSError traceback; what it had recorded stays whole, and the same command goes
    on once the disk has room."""
    import errno

    path = _fake_sweep(tmp_path, {"seed": {"values": [1, 2]}})
    sweep_dir = tmp_path / "sweep"
    run_sweep(path, sweep_dir, wandb_mode="disabled", max_trials=1)
    target = {"results": sweep_dir / "results.jsonl", "state": sweep_dir / "sweep_state.json",
              "trial folder": sweep_dir / "trials" / trial_id({"seed": 2}, ["seed"])}[full]

    patched = {"results": "append_result", "state": "write_state", "trial folder": "make_dirs"}[full]
    real = getattr(runner_mod, patched)

    def no_space(folder, *args):
        if full == "trial folder" and Path(folder) != target:
            return real(folder, *args)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))

    monkeypatch.setattr(runner_mod, patched, no_space)
    capsys.readouterr()
    code = sweep_mod.main([str(path), "--sweep_dir", str(sweep_dir), "--wandb_mode", "disabled"])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    second = f"[2] {trial_id({'seed': 2}, ['seed'])}"
    if full == "trial folder":  # that trial fails in one line; the sweep is recorded whole
        assert code == 1 and f"  trial {second} failed (exit 2): {target}: cannot be written (No space left on " \
                             f"device)" in captured.err, captured.err
    else:
        assert code == 2, captured.err
        assert captured.err.strip() == f"error: trial {second}: {target}: cannot be written (No space left on " \
                                       f"device); the done trials are kept: run the same command again once it " \
                                       f"can be", captured.err
    monkeypatch.undo()  # room again
    trials = run_sweep(path, sweep_dir, wandb_mode="disabled")
    assert [t["status"] for t in trials] == ["finished", "finished"]
    assert [r["params"]["seed"] for r in read_results(sweep_dir) if r["status"] == "finished"] == [1, 2]


def test_a_disk_that_fills_while_workers_run_trials_stops_them_in_one_line(tmp_path, capsys, monkeypatch):
    """--workers 2, and the results file cannot take the second trial's result while a third trial runs: one line
    naming the trial and the file and the trial stopped with it, at once, where the pool's exit waited for the
    running trial to end (unrecorded); the first trial's result stays, and the rerun runs only the others."""
    import errno

    path = _fake_sweep(tmp_path, {"mode": {"values": ["ok", "hold", "fine"]}, "seed": {"value": 1}})
    sweep_dir, hold = tmp_path / "sweep", tmp_path / "hold"
    monkeypatch.setenv("HOLD_FILE", str(hold))
    real_append = runner_mod.append_result

    def no_space_after_one(folder, result):
        if read_results(sweep_dir):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "results.jsonl"))
        real_append(folder, result)

    # A safety net, no timing: a runner that waits for the held trial sees it end after 120 s, and fails below.
    release = threading.Timer(120, hold.touch)
    release.start()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(runner_mod, "append_result", no_space_after_one)
            code = sweep_mod.main([str(path), "--sweep_dir", str(sweep_dir), "--wandb_mode", "disabled",
                                   "--workers", "2"])
    finally:
        release.cancel()
    err = capsys.readouterr().err
    ids = {mode: trial_id({"mode": mode, "seed": 1}, ["mode"]) for mode in ("ok", "hold", "fine")}
    assert code == 2 and err == (
        f"error: trial [3] {ids['fine']}: {sweep_dir / 'results.jsonl'}: cannot be written (No space left on "
        f"device); the done trials are kept: run the same command again once it can be; the trials in flight were "
        f"stopped ([2] {ids['hold']}) and run again then\n"), err
    assert not (sweep_dir / "trials" / ids["hold"] / "run_summary.json").exists()  # stopped, not finished
    assert [r["params"]["mode"] for r in read_results(sweep_dir)] == ["ok"]
    hold.touch()  # room again, and the held trial may end
    trials = run_sweep(path, sweep_dir, wandb_mode="disabled", workers=2)
    assert [t["status"] for t in trials] == ["finished"] * 3
    assert sorted(r["params"]["mode"] for r in read_results(sweep_dir)) == ["fine", "hold", "ok"]
    assert (sweep_dir / "trials" / ids["ok"] / "attempts.txt").read_text() == "x"  # done: not run again


@pytest.mark.parametrize("workers", ["0", "-1", "two"])
def test_workers_below_one_is_a_flag_error(tmp_path, capsys, workers):
    path = _fake_sweep(tmp_path, {"seed": {"values": [1, 2]}})
    with pytest.raises(SystemExit) as exit_info:
        sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "sweep"), "--workers", workers])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"--workers: {workers} is not an integer >= 1" in err, err
    assert not (tmp_path / "sweep").exists()


def test_a_second_runner_on_the_same_sweep_folder_is_refused(tmp_path):
    """Two runners on one folder would both run the first trial, in the same trial folder, and record it twice."""
    path = _fake_sweep(tmp_path, {"mode": {"value": "hold"}, "seed": {"values": [1, 2]}})
    sweep_dir, hold = tmp_path / "sweep", tmp_path / "hold"
    env = dict(os.environ, HOLD_FILE=str(hold))
    command = [sys.executable, str(REPO / "scripts" / "sweep.py"), str(path), "--sweep_dir", str(sweep_dir),
               "--wandb_mode", "disabled"]
    first = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        started = sweep_dir / "trials" / trial_id({"mode": "hold", "seed": 1}, ["seed"]) / "attempts.txt"
        for _ in range(6000):  # the first runner is inside its first trial
            if started.exists() or first.poll() is not None:
                break
            time.sleep(0.05)
        assert started.exists(), first.stdout.read() if first.poll() is not None else "first runner never started"
        second = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        err = second.stderr.strip()
        assert err.count("\n") == 0 and str(sweep_dir) in err and "another sweep runner" in err, err
    finally:
        hold.touch()
        first.wait(timeout=600)
    assert first.returncode == 0
    assert [r["params"]["seed"] for r in read_results(sweep_dir)] == [1, 2]
    assert started.read_text() == "x"


def test_ctrl_c_stops_the_runner_and_its_trials_in_one_line_and_a_rerun_goes_on(tmp_path):
    """SIGINT to the runner alone (as `kill -INT` sends it; a terminal's Ctrl-C reaches the trials too): the trial in
    flight is stopped with it, the exit is 130 with one line, and the same command runs the cut-off trial again."""
    path = _fake_sweep(tmp_path, {"mode": {"value": "hold"}, "seed": {"values": [1, 2]}})
    sweep_dir, hold = tmp_path / "sweep", tmp_path / "hold"
    env = dict(os.environ, HOLD_FILE=str(hold))
    command = [sys.executable, str(REPO / "scripts" / "sweep.py"), str(path), "--sweep_dir", str(sweep_dir),
               "--wandb_mode", "disabled"]
    runner = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = sweep_dir / "trials" / trial_id({"mode": "hold", "seed": 1}, ["seed"])
    for _ in range(6000):  # the runner is inside its first trial
        if (first / "attempts.txt").exists() or runner.poll() is not None:
            break
        time.sleep(0.05)
    runner.send_signal(signal.SIGINT)
    out, err = runner.communicate(timeout=120)
    assert runner.returncode == 130, out + err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "interrupted; the trials in flight were stopped: run the same command again to go on"), err
    hold.touch()  # a trial left running would now finish and write its summary
    time.sleep(2)
    assert not (first / "run_summary.json").exists()
    assert json.loads((sweep_dir / "sweep_state.json").read_text())["trials"][0]["status"] == "running"
    assert subprocess.run(command, cwd=REPO, env=env, capture_output=True, timeout=600).returncode == 0
    assert [r["params"]["seed"] for r in read_results(sweep_dir)] == [1, 2]
    assert (first / "attempts.txt").read_text() == "xx"  # cut off once, run again


def _process_ended(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie has ended (its new parent may not reap it here)


# A trial's program started by a shell that stays its parent: the trainer is the tether's grandchild.
SHELL_WRAPPER = 'echo "wrapper starts the trainer"\n"$@"\necho "wrapper done"\n'


DEFAULT_SIGNALS = {"SIGHUP": "SIG_DFL", "SIGINT": "SIG_DFL", "SIGQUIT": "SIG_DFL"}


def with_signals(dispositions: dict[str, str]) -> list[str]:
    """A command prefix that sets these signals' dispositions, then execs the rest (an exec keeps SIG_DFL and
    SIG_IGN): no preexec_fn in the test's threaded process."""
    setting = "; ".join(f"signal.signal(signal.{name}, signal.{how})" for name, how in dispositions.items())
    return [sys.executable, "-c", f"import os, signal, sys; {setting}; os.execv(sys.argv[1], sys.argv[1:])"]


def _runner_in_first_trial(path: Path, hold: Path, signals: dict[str, str]) -> tuple[subprocess.Popen, list[str], Path]:
    """The sweep runner of the "hold" sweep at `path` as a terminal's job (its own process group, in the test's
    session), with these signal dispositions, once its first trial runs: the runner, its command (for a rerun) and
    the file where the trial wrote its pid."""
    sweep_dir = path.parent / "sweep"
    command = [sys.executable, str(REPO / "scripts" / "sweep.py"), str(path), "--sweep_dir", str(sweep_dir),
               "--wandb_mode", "disabled"]
    runner = subprocess.Popen([*with_signals(signals), *command], cwd=REPO, env=dict(os.environ, HOLD_FILE=str(hold)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0)
    pid_file = sweep_dir / "trials" / trial_id({"mode": "hold", "seed": 1}, ["seed"]) / "pid.txt"
    for _ in range(6000):
        if (pid_file.exists() and pid_file.read_text()) or runner.poll() is not None:
            break
        time.sleep(0.05)
    return runner, command, pid_file


@contextmanager
def _then_the_sweep_finishes(runner: subprocess.Popen, hold: Path) -> Iterator[None]:
    """After the block, the held trial may end: the runner ends its one-trial sweep with the trial finished (a runner
    that is still there on the way out, the block failed, is killed with its group)."""
    try:
        yield
        hold.touch()
        assert runner.wait(timeout=120) == 0
    finally:
        hold.touch()
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
    sweep_dir = Path(runner.args[runner.args.index("--sweep_dir") + 1])
    assert [r["status"] for r in read_results(sweep_dir)] == ["finished"]


@contextmanager
def _one_held_trial(tmp_path: Path, signals: dict[str, str]) -> Iterator[tuple[subprocess.Popen, int]]:
    """A one-trial fake sweep's runner, started with `signals`' dispositions and held in its trial: yields (the
    runner, the trial's pid); then the trial is released and the sweep must finish (_then_the_sweep_finishes)."""
    path = _fake_sweep(tmp_path, {"mode": {"value": "hold"}, "seed": {"values": [1]}})
    hold = tmp_path / "hold"
    runner, _, pid_file = _runner_in_first_trial(path, hold, signals)
    with _then_the_sweep_finishes(runner, hold):
        yield runner, int(pid_file.read_text())


def test_a_hangup_under_nohup_ends_no_trial(tmp_path):
    """`nohup python scripts/sweep.py ...` (SIGHUP ignored): the terminal's hangup ends neither the runner nor,
    through the tether, its trial."""
    with _one_held_trial(tmp_path, {"SIGHUP": "SIG_IGN"}) as (runner, trial):
        os.killpg(runner.pid, signal.SIGHUP)
        time.sleep(2)  # what a hangup would have ended by now
        assert runner.poll() is None and not _process_ended(trial)


def _process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("through_shell, stop, to_group", [
    (False, signal.SIGKILL, False), (True, signal.SIGKILL, False), (True, signal.SIGTERM, False),
    (True, signal.SIGHUP, True), (True, signal.SIGQUIT, True)])
def test_a_stopped_runner_takes_its_trial_with_it_whole(tmp_path, through_shell, stop, to_group):
    """SIGKILL (or the OOM killer) gives the runner no chance to stop its trials: the tether does (the kernel closes
    the runner's end of the tie); SIGTERM stops them through the runner; a hangup or Ctrl-\\ reaches the terminal's
    foreground group (the runner's and its tethers', not the trials' own groups), and the tether hands it on. Each
    time the trial's whole process group goes, a trainer that a shell started included. A trial left running would
    go on writing in a folder that the rerun uses again."""
    path = _fake_sweep(tmp_path, {"mode": {"value": "hold"}, "seed": {"values": [1, 2]}})
    if through_shell:
        (tmp_path / "wrap.sh").write_text(SHELL_WRAPPER)
        config = yaml.safe_load(path.read_text())
        config["command"] = ["/bin/sh", str(tmp_path / "wrap.sh"), "${interpreter}", "${program}", "${args}"]
        path.write_text(yaml.safe_dump(config))
    sweep_dir, hold = tmp_path / "sweep", tmp_path / "hold"
    # the signals' default actions: a suite run under nohup, or in a script's background, passes them on ignored
    runner, command, pid_file = _runner_in_first_trial(path, hold, DEFAULT_SIGNALS)
    trial = int(pid_file.read_text())
    if to_group:
        os.killpg(runner.pid, stop)
    else:
        runner.send_signal(stop)
    runner.wait(timeout=60)
    try:
        for _ in range(1200):
            if _process_ended(trial):
                break
            time.sleep(0.05)
        assert _process_ended(trial), "the trial trains on after its runner stopped"
    finally:
        hold.touch()  # a trial left running ends now
    assert not (pid_file.parent / "run_summary.json").exists()
    rerun = subprocess.run(command, cwd=REPO, env=dict(os.environ, HOLD_FILE=str(hold)), capture_output=True,
                           timeout=600)
    assert rerun.returncode == 0
    assert [r["params"]["seed"] for r in read_results(sweep_dir)] == [1, 2]


@pytest.mark.skipif(os.name != "posix", reason="job control is POSIX's")
def test_ctrl_z_pauses_the_trial_with_the_runner_and_fg_resumes_both(tmp_path):
    """Ctrl-Z (SIGTSTP to the terminal's foreground group, the runner's) pauses the trial in its own group too, and
    SIGCONT (`fg`) lets the sweep go on to its end."""
    with _one_held_trial(tmp_path, {"SIGTSTP": "SIG_DFL"}) as (runner, trial):
        os.killpg(runner.pid, signal.SIGTSTP)
        for _ in range(1200):
            if _process_state(trial) == "T":
                break
            time.sleep(0.05)
        assert _process_state(trial) == "T", "the trial runs on while its runner is paused"
        os.killpg(runner.pid, signal.SIGCONT)


def test_a_trial_reads_no_input(tmp_path):
    """A trial's stdin is empty: it is not the runner's (a terminal, where a background trial that read it would stop
    and the runner wait for ever; here a pipe the test never closes)."""
    path = _fake_sweep(tmp_path, {"mode": {"value": "stdin"}, "seed": {"values": [1]}})
    command = [sys.executable, str(REPO / "scripts" / "sweep.py"), str(path), "--sweep_dir", str(tmp_path / "sweep"),
               "--wandb_mode", "disabled"]
    runner = subprocess.Popen(command, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        assert runner.wait(timeout=120) == 0
    finally:
        if runner.poll() is None:
            runner.kill()
            for child in Path("/proc").glob("[0-9]*/cmdline"):  # the blocked trial, left by the old runner
                if b"fake_train.py" in child.read_bytes() and str(tmp_path).encode() in child.read_bytes():
                    os.kill(int(child.parent.name), signal.SIGKILL)
    assert [r["status"] for r in read_results(tmp_path / "sweep")] == ["finished"]


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("program, code, reason", [("no_such_program", 127, "No such file or directory"),
                                                    ("not_executable.sh", 126, "Permission denied")])
def test_a_trial_program_that_cannot_run_is_a_failed_trial_not_a_traceback(tmp_path, capsys, program, code, reason,
                                                                           workers):
    """Exit codes as a shell's: 127 for a command that is not there, 126 for one that cannot be run; each trial's
    failure is one line on stderr naming the trial, also among the other trials' lines of --workers 2."""
    path = tmp_path / "missing.yaml"
    path.write_text(yaml.safe_dump({
        "name": "missing", "program": "x.py", "method": "grid", "command": [str(tmp_path / program), "${args}"],
        "parameters": {"seed": {"values": [1, 2]}}}))
    (tmp_path / "x.py").write_text("")
    (tmp_path / "not_executable.sh").write_text("echo hi\n")  # mode 644
    assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "sweep"), "--wandb_mode", "disabled",
                           "--workers", workers]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert sorted(captured.err.splitlines()) == [
        f"  trial [{index}] {trial_id({'seed': index}, ['seed'])} failed (exit {code}); last line of its log: cannot "
        f"run {tmp_path / program}: {reason}" for index in (1, 2)], captured.err
    assert [(r["status"], r["returncode"]) for r in read_results(tmp_path / "sweep")] == [("failed", code)] * 2


def test_a_program_that_does_not_exist_is_one_line_before_anything_runs(tmp_path, capsys):
    """`${program}` that is not there: every trial would fail at once the same way (python's "can't open file"),
    so the YAML is refused in one line naming the field, before the sweep folder exists."""
    path = tmp_path / "missing.yaml"
    path.write_text(yaml.safe_dump({"name": "missing", "program": str(tmp_path / "gone.py"), "method": "grid",
                                    "command": ["${interpreter}", "${program}", "${args}"],
                                    "parameters": {"seed": {"values": [1, 2]}}}))
    assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "sweep"), "--wandb_mode", "disabled"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}: program: {tmp_path / 'gone.py'} does not exist (the script each trial runs; a " \
                  f"relative path is taken from the repo root)\n", err
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("script, code", [("raise SystemExit(3)", 3), ("import os, signal; os.kill(os.getpid(), "
                                                                       "signal.SIGTERM)", 128 + 15)])
def test_the_tether_exits_as_its_command_did(tmp_path, script, code):
    read_end, write_end = os.pipe()
    try:
        result = subprocess.run([sys.executable, str(REPO / "trainer" / "tether.py"), str(read_end), sys.executable,
                                 "-c", script], capture_output=True, text=True, timeout=120, pass_fds=(read_end,))
    finally:
        os.close(read_end)
        os.close(write_end)
    assert result.returncode == code and result.stderr == "", result.stderr


def test_the_tether_stops_its_command_when_the_tie_ends():
    """The tie's writing end closed (its holder ended, here: closed it): the command is stopped as by SIGTERM."""
    read_end, write_end = os.pipe()
    tether = subprocess.Popen([sys.executable, str(REPO / "trainer" / "tether.py"), str(read_end), "sleep", "600"],
                              pass_fds=(read_end,))
    os.close(read_end)
    try:
        time.sleep(1)
        assert tether.poll() is None  # the tie holds: the command runs
        os.close(write_end)
        assert tether.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if tether.poll() is None:
            tether.kill()


# ----------------------------------------------------------------------------- parameters and metric checked up front
def _trainer_yaml(tmp_path: Path, text: str, program: str = "trainer/train_pretrain.py") -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(f"program: {program}\n" + textwrap.dedent(text))
    return path


@pytest.mark.parametrize("text, field, message", [
    ("method: grid\nparameters:\n  learning_rate: {values: [0.001, -1]}\n",
     "parameters.learning_rate.values[1]", "--learning_rate=-1.0 is not allowed; it must be a positive number"),
    ("method: grid\nparameters:\n  norm_type: {values: [rmsnorm, bogus]}\n",
     "parameters.norm_type.values[1]", "invalid choice: 'bogus'"),
    ("method: grid\nparameters:\n  batch_size: {values: [1.5]}\n",
     "parameters.batch_size.values[0]", "invalid int value: '1.5'"),
    ("method: grid\nparameters:\n  seed: {values: [1]}\n  warmup_steps: {value: -3}\n",
     "parameters.warmup_steps.value", "--warmup_steps=-3 is not allowed"),
    ("method: grid\nparameters:\n  bogus_flag: {values: [1, 2]}\n",
     "parameters.bogus_flag.values[0]", "unrecognized arguments: --bogus_flag=1"),
    ("method: random\nrun_cap: 2\nparameters:\n  learning_rate: {min: -1.0, max: 0.1}\n",
     "parameters.learning_rate.min", "it must be a positive number"),
    ("method: random\nrun_cap: 2\nparameters:\n  batch_size: {min: 1.5, max: 4.0}\n",
     "parameters.batch_size.min", "invalid int value"),
    # false equals the first trial's 0 in Python: it was never put to the trainer, and every trial of it failed
    ("method: grid\nparameters:\n  seed: {values: [0, false]}\n",
     "parameters.seed.values[1]", "--seed: false is not an integer"),
])
def test_a_parameter_the_trainer_refuses_is_one_line_before_any_trial(tmp_path, capsys, text, field, message):
    path = _trainer_yaml(tmp_path, text)
    # --dry_run: a check that came only with the trials would let this pass, instead of training
    assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "s"), "--dry_run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{path}: {field}:" in err and message in err, err
    assert "trainer/train_pretrain.py" in err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("spec, field", [
    ({"value": datetime.date(2001, 1, 1)}, "parameters.seed.value"),
    ({"values": [1, b"hello"]}, "parameters.seed.values[1]"),  # !!binary
    ({"min": 1, "max": datetime.date(2001, 1, 1)}, "parameters.seed.max"),
])
def test_a_value_json_cannot_hold_is_one_line_before_anything_is_written(tmp_path, capsys, spec, field):
    """A YAML date or !!binary was a TypeError traceback from json.dumps (or, for another program, a state file
    written with str() in its place, whose folder the next start refused as a different config)."""
    path = _fake_sweep(tmp_path, {"seed": spec, "mode": {"value": "ok"}})
    assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "s"), "--wandb_mode", "disabled"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{field}:" in err and "is not a JSON value" in err, err
    assert not (tmp_path / "s").exists()


def test_a_refused_value_with_a_newline_is_shown_in_one_line(tmp_path, capsys):
    path = _trainer_yaml(tmp_path, 'method: grid\nparameters:\n  seed: {values: ["0\\n1"]}\n')
    assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "s"), "--dry_run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "parameters.seed.values[0]" in err and "refuses '0\\n1'" in err, err


def test_parameters_are_checked_against_the_trainer_the_sweep_runs(tmp_path, capsys):
    # train_dpo.py: beta must be > 0 there, and the copy-row flags are pretraining's, not its own.
    for text, field in (("method: grid\nparameters:\n  beta: {values: [0.1, 0]}\n", "parameters.beta.values[1]"),
                        ("method: grid\nparameters:\n  copy_rows: {value: 2}\n", "parameters.copy_rows.value")):
        path = _trainer_yaml(tmp_path, text, program="trainer/train_dpo.py")
        assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "s"), "--dry_run"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and field in err and "trainer/train_dpo.py" in err, err
    # Any other program is the YAML's own business: its flags are not checked.
    path = _fake_sweep(tmp_path / "fake", {"learning_rate": {"values": [-1]}, "seed": {"value": 1}})
    assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "s"), "--dry_run"]) == 0


@pytest.mark.parametrize("program, name, allowed", [
    ("trainer/train_pretrain.py", "val_los", "val_loss, val_ppl, val_bpb"),
    ("trainer/train_dpo.py", "val_ppl", "val_loss, val_reward_accuracy"),
    ("trainer/train_grpo.py", "reward", "val_loss, val_reward"),
])
def test_a_metric_the_trainer_never_logs_is_one_line_listing_the_allowed(tmp_path, capsys, program, name, allowed):
    path = _trainer_yaml(tmp_path, f"method: bayes\nrun_cap: 2\nmetric: {{name: {name}, goal: minimize}}\n"
                                   f"parameters:\n  learning_rate: {{min: 0.001, max: 0.01}}\n", program=program)
    assert sweep_mod.main([str(path), "--sweep_dir", str(tmp_path / "s"), "--dry_run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{path}: metric.name: {name!r}" in err and program in err, err
    assert f"allowed: {allowed}" in err
    assert not (tmp_path / "s").exists()


def _assert_metric_value_finds_every_logged_name(task: str, out_dir: Path) -> None:
    """Every metric name the task's trainer logs is found in its run_summary.json, with the value it logged last."""
    from trainer.run_dir import logged_metrics, read_summary

    summary, val = read_summary(out_dir), read_metrics(out_dir, "val")[-1]
    names = logged_metrics(task)
    assert {"val_loss", "final/val_loss"} <= set(names)
    for name in names:
        value = metric_value(summary, name)
        key = name.removeprefix("final/")
        assert key in val or key in summary, name
        logged = val.get(key, summary.get(key))
        if logged is None:  # not finite (GRPO's accuracy without answers), so null in strict JSON: no metric
            assert value is None, name
        else:
            assert value == logged and value is not None, name
    metric = {"dpo": "val_reward_accuracy", "grpo": "val_reward"}.get(task, "val_ppl")
    config = {"method": "bayes", "run_cap": 2, "program": f"trainer/train_{task}.py",
              "metric": {"name": metric, "goal": "maximize"},
              "parameters": {"learning_rate": {"min": 0.001, "max": 0.01}}}
    validate_sweep_config(config, "ok.yaml")  # accepted up front


def test_metric_value_finds_every_name_a_pretraining_run_logs(reference_run):
    _assert_metric_value_finds_every_logged_name("pretrain", reference_run)


def test_metric_value_finds_every_name_dpo_and_grpo_runs_log(train_data, reference_run, tmp_path):
    from tests.training_runs import ONE_THREAD, finetune_argv, run_in_process, write_prompt_data

    # --rpo_alpha: DPO logs val_nll_loss only where the loss reads the chosen answers' NLL; here every name is logged
    run_in_process("dpo", finetune_argv("dpo", train_data, reference_run, tmp_path / "dpo", "--max_steps", "2",
                                        "--rpo_alpha", "0.5"))
    _assert_metric_value_finds_every_logged_name("dpo", tmp_path / "dpo")
    (tmp_path / "prompts").mkdir()
    data = write_prompt_data(tmp_path / "prompts")
    run_in_process("grpo", ["--data_path", str(data / "prompts.jsonl"), "--from_weight", str(reference_run),
                            "--out_dir", str(tmp_path / "grpo"), "--max_steps", "1", "--batch_size", "2",
                            "--num_generations", "2", "--max_completion_length", "4", "--eval_batches", "1",
                            "--max_seq_len", "48", "--dtype", "float32", "--norm_impl", "eager", "--compile", "off",
                            "--save_interval", "100", *ONE_THREAD])
    _assert_metric_value_finds_every_logged_name("grpo", tmp_path / "grpo")


# ----------------------------------------------------------------------------- trial folders gone or in the way
def test_a_done_trial_whose_folder_is_gone_keeps_its_result_in_the_report(tmp_path):
    from eval.studies.ablation.load import load_sweep

    path = _fake_sweep(tmp_path, {"seed": {"values": [1, 2]}})
    sweep_dir = tmp_path / "sweep"
    run_sweep(path, sweep_dir, wandb_mode="disabled")
    first = read_results(sweep_dir)[0]
    shutil.rmtree(sweep_dir / first["trial_dir"])
    trials = run_sweep(path, sweep_dir, wandb_mode="disabled")  # results.jsonl is the record: not run again
    assert [t["status"] for t in trials] == ["finished", "finished"] and len(read_results(sweep_dir)) == 2
    assert not (sweep_dir / first["trial_dir"]).exists()
    _, loaded = load_sweep(sweep_dir)
    gone = next(t for t in loaded if t.trial_id == first["trial_id"])
    assert gone.status == "finished" and gone.final_val_loss == 2.5 == first["metric"]
    assert gone.summary["median_step_time_s"] == 0.01 and gone.summary["tokens_per_s"] == 100.0


def test_a_file_in_the_way_of_a_trial_folder_is_one_line(tmp_path, capsys):
    path = _fake_sweep(tmp_path, {"seed": {"values": [1, 2]}})
    sweep_dir = tmp_path / "sweep"
    blocked = sweep_dir / "trials" / trial_id({"seed": 1}, ["seed"])
    blocked.parent.mkdir(parents=True)
    blocked.write_text("x")
    assert sweep_mod.main([str(path), "--sweep_dir", str(sweep_dir), "--wandb_mode", "disabled"]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "Traceback" not in captured.out
    lines = [line for line in captured.err.splitlines() if str(blocked) in line]
    assert len(lines) == 1 and "is a file, not a folder" in lines[0], captured.err
    records = {r["params"]["seed"]: r for r in read_results(sweep_dir)}
    assert records[1]["status"] == "failed" and str(blocked) in records[1]["error"]
    assert records[2]["status"] == "finished"  # the sweep went on


def test_a_folder_in_the_place_of_a_trials_run_summary_is_one_line(tmp_path, capsys):
    """A trial folder whose run_summary.json is a folder (a `mkdir` in its place): the runner, removing the stale
    summary before the trial's new attempt, ended in an IsADirectoryError traceback, the other trials unrun."""
    path = _fake_sweep(tmp_path, {"seed": {"values": [1, 2]}})
    sweep_dir = tmp_path / "sweep"
    folder = sweep_dir / "trials" / trial_id({"seed": 1}, ["seed"]) / "run_summary.json"
    folder.mkdir(parents=True)
    assert sweep_mod.main([str(path), "--sweep_dir", str(sweep_dir), "--wandb_mode", "disabled"]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "Traceback" not in captured.out
    lines = [line for line in captured.err.splitlines() if str(folder) in line]
    assert lines == [f"  trial [1] {folder.parent.name} failed (exit 2): {folder} is a folder, not a file"], \
        captured.err
    records = {r["params"]["seed"]: r for r in read_results(sweep_dir)}
    assert records[1]["status"] == "failed" and records[1]["error"] == f"{folder} is a folder, not a file"
    assert records[2]["status"] == "finished"  # the sweep went on
    assert folder.is_dir() and not (folder.parent / "attempts.txt").exists()  # the trial did not run


def test_settings_only_wandbs_agent_applies_are_named_at_the_start(tmp_path, capsys):
    """early_terminate (Hyperband) and metric.target stop trials or the sweep on wandb's server: this runner ran
    every trial to its end without a word, as if the YAML's early stopping had found nothing to stop."""
    path = _fake_sweep(tmp_path, {"seed": {"values": [1, 2]}})
    config = yaml.safe_load(path.read_text())
    run_sweep(path, tmp_path / "plain", wandb_mode="disabled", dry_run=True)
    assert "note:" not in capsys.readouterr().out
    config["early_terminate"] = {"type": "hyperband", "min_iter": 3}
    config["metric"]["target"] = 4.0
    path.write_text(yaml.safe_dump(config))
    run_sweep(path, tmp_path / "agent", wandb_mode="disabled", dry_run=True)
    assert ("note: early_terminate, metric.target are wandb agent's; this runner does not apply them: every trial "
            "runs to its end") in capsys.readouterr().out
