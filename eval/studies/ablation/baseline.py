"""The unigram baseline (the loss of a model that knows only the training split's token frequencies) of the data
a trial was scored on, rebuilt from the trial's own train_config.yaml."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.run_dir import CONFIG_FILE, recorded_config

# The trainer arguments that decide the data a trial is scored on, hence its unigram baseline.
DATA_KEYS = ("data_path", "val_data_path", "val_fraction", "tokenizer_path", "max_seq_len")


def _run_args(run_dir: Path):
    """The trainer arguments a trial ran with, from its train_config.yaml."""
    from trainer.arg_yaml import load_yaml_config
    from trainer.args import args_from_run_config

    try:  # each value read as its flag's (a hand-edited max_seq_len 'x' was a TypeError traceback in the data)
        config = recorded_config(run_dir)  # a file that is no run's record: refused there, naming it
        if not config:
            raise FileNotFoundError(f"{run_dir / CONFIG_FILE}: missing or records no flags; --unigram rebuilds a "
                                    f"trial's data from it")
        task = config.get("task") if isinstance(config.get("task"), str) else "pretrain"
        checked = load_yaml_config(run_dir / CONFIG_FILE, task)
    except ValueError as error:
        raise ValueError(f"{str(error).removeprefix('--config ')}; --unigram rebuilds a trial's data from it") from None
    return args_from_run_config({**config, **checked})


def unigram_baseline(run_dir: Path) -> dict[str, Any]:
    """The unigram baseline on the data a trial trained and was scored on, rebuilt from its train_config.yaml."""
    from torch.utils.data import DataLoader

    from trainer.data import build_run_data
    from trainer.evaluation import token_byte_lengths, unigram_eval
    from trainer.run_dir import REPO_ROOT
    from trainer.run_inputs import load_run_tokenizer

    args = _run_args(run_dir)
    tokenizer = load_run_tokenizer(args)  # as the trial's trainer loaded it
    data = build_run_data(args, tokenizer, quiet=True)
    train = DataLoader(data.train, batch_size=256, collate_fn=data.collate)  # every row, in order
    result = unigram_eval(train, data.val_loader, len(tokenizer), token_byte_lengths(tokenizer))
    # Paths inside the checkout relative to it: the committed reports name no machine's folders.
    return {**result.as_dict(), "from_trial": run_dir.name, "max_seq_len": args.max_seq_len,
            "data": data.description.replace(f"{REPO_ROOT}/", "")}


def data_key(run_dir: Path) -> str:
    """What decides a trial's unigram baseline: its data, tokenizer and sequence length (and, when the validation
    split is held out of the training file, the seed that draws it)."""
    args = _run_args(run_dir)
    key = {name: getattr(args, name) for name in DATA_KEYS}
    if args.data_path is not None and args.val_data_path is None:
        key["seed"] = args.seed
    return json.dumps(key, sort_keys=True, default=str)

