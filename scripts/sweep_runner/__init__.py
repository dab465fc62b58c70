"""The serverless sweep runner that scripts/sweep.py runs (that file is the command: its flags, signals and exit
codes). One job per module:

    errors.py     the runner's one-line refusals: a bad sweep YAML or flag, a folder that cannot take its writes
    engine.py     wandb's sweep engine (the `sweeps` package): its import, and the next proposal, seeded
    command.py    a trial from its parameters: its id, the program it runs, its command line (wandb agent's macros)
    config.py     reading and checking the sweep YAML (and the --only filter) before anything runs
    trial.py      running one trial: its subprocess tied to the runner, the signals that stop it, its outcome
    recording.py  the state read back and checked, the runner's writes, records brought back, a trial's metric
    runner.py     the sweep: proposing, starting (workers) and recording the trials; run_sweep

The package is not named `sweeps`: that is wandb's engine, imported by name (see the sys.path note in
scripts/sweep.py).
"""
