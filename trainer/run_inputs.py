"""What a run starts from, checked before any work: its input paths (the model directories it starts from or scores
with, the data, --out_dir apart from them), its tokenizer, the model it trains before any wrapping (fresh, or the
starting weights with the switches this run turns on) and the effective config it records. trainer/core.py's
Trainer calls these in its set-up; a refusal here is a one-line error naming the flag."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dataset.tokenization import check_same_tokenizer
from model.config import MiniNormConfig
from model.model import MiniNormForCausalLM
from dataset.shown_value import flag_refusal
from trainer.arg_fields import (ADDABLE_MODEL_FIELDS, MODEL_FIELDS, TrainArgs, build_model_config,
                                recorded_input_paths, refuse_fixed_model_fields, requested_model_fields)
from trainer.run_dir import (DEFAULT_FROM_WEIGHT, MERGED_DIR, WEIGHT_FILES, check_out_dir, create_command,
                             is_adapter_dir, is_model_dir, load_input_model, not_a_model_folder, resolve_input_path,
                             starting_directory)


def load_run_tokenizer(args: TrainArgs) -> Any:
    from dataset.tokenization import load_tokenizer
    if not args.tokenizer_path:
        return load_tokenizer(None)
    from model.loading import load_dir_tokenizer
    try:
        return load_dir_tokenizer(resolve_input_path(args.tokenizer_path))
    except ValueError as error:
        raise ValueError(f"--tokenizer_path {resolve_input_path(args.tokenizer_path)}: {error}") from None


def starting_weights_dir(args: TrainArgs) -> Path:
    """The model directory a fine-tuning run starts from: --from_weight, else its task's default."""
    source_task = DEFAULT_FROM_WEIGHT[args.task]
    source = starting_directory(args.task, args.from_weight)
    if is_adapter_dir(source):
        merged = source / MERGED_DIR
        start = (f"start from its merged model, --from_weight {merged}" if is_model_dir(merged)
                 else "merge it first (train_lora.py --merge writes OUT_DIR/merged) and start from that")
        raise ValueError(f"--from_weight {source}: a LoRA adapter, not a model (its weights are the base model's "
                         f"plus the adapter's); {start}")
    if (words := not_a_model_folder(source)) is not None:
        raise FileNotFoundError(f"--from_weight {words}")
    if not is_model_dir(source):
        raise FileNotFoundError(f"--from_weight {source}: no model to start from there (config.json and "
                                f"{' or '.join(WEIGHT_FILES)}); create it with `{create_command(source_task, source)}` "
                                f"(or pass --from_weight DIR)")
    return source


def check_inputs(args: TrainArgs) -> dict[str, Path]:
    """The run's paths, before any work: the model directories it starts from (--from_weight) or scores with
    (--teacher, --reward_model) hold a model whose config.json reads, and --out_dir can be a directory apart from
    them. A bad one is a one-line error naming the flag, before any data is tokenized or anything written. Returns
    those model directories by flag, defaults resolved."""
    from model.loading import load_config
    inputs: dict[str, Path] = {}
    if args.task != "pretrain":
        inputs["--from_weight"] = starting_weights_dir(args)
    if args.task == "distill":
        from trainer.distillation import teacher_model_dir
        inputs["--teacher"] = teacher_model_dir(args.teacher)
    if args.reward_model:
        from trainer.reward_model import reward_model_dir, reward_model_directory
        inputs["--reward_model"] = reward_model_dir(reward_model_directory(args.reward_model))
    for flag, source in inputs.items():
        try:
            load_config(source)
        except ValueError as error:
            raise ValueError(f"{flag} {error}") from None
    data = {f"--{name}": resolve_input_path(getattr(args, name)) for name in ("data_path", "val_data_path")
            if getattr(args, name)}
    check_out_dir(args.resolved_out_dir(), inputs, data)
    return inputs


def check_vocab_size(args: TrainArgs, tokenizer: Any) -> None:
    """A pretraining --vocab_size below the tokenizer's: ids from it on would have no embedding (an IndexError in
    the first forward pass)."""
    asked = args.model.get("vocab_size")
    if args.task == "pretrain" and asked is not None and asked < len(tokenizer):
        raise ValueError(flag_refusal("vocab_size", asked, f"the tokenizer has {len(tokenizer)} tokens, so it must "
                                                           f"be >= {len(tokenizer)} (leave it unset for exactly that)"))


def build_model(args: TrainArgs, tokenizer: Any, source: Path | None) -> tuple[MiniNormForCausalLM, list[str]]:
    """(a fresh model (pretraining) or the starting weights (every fine-tuning run: `source`, the --from_weight
    check_inputs resolved), before any wrapping; the model switches this run turns on, whose new weights the
    starting checkpoint lacks)."""
    if args.task == "pretrain":
        config = build_model_config(args, vocab_size=len(tokenizer))
        config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        return MiniNormForCausalLM(config), []
    assert source is not None, "a fine-tuning run starts from --from_weight"
    check_same_tokenizer(tokenizer, source, "--from_weight")
    addable = ADDABLE_MODEL_FIELDS.get(args.task, ())
    requested = requested_model_fields(args)
    refuse_fixed_model_fields(args)  # refused at parsing already (validate): kept for a TrainArgs built otherwise
    starting = MiniNormConfig.from_pretrained(source)
    for name in addable:
        if name in requested and getattr(starting, name) and not requested[name]:
            raise ValueError(f"--{name} false: {source} was trained with it on; fine-tuning keeps it (leave the "
                             f"flag unset)")
    added = [name for name in addable if requested.get(name) and not getattr(starting, name)]
    # A switch turned on here starts its new weights as a fresh model's do (smeared keys: logit 0, each key half its
    # own, half the previous position's): missing from the checkpoint on purpose. Any other missing weight, or one
    # of another shape, is an error (transformers would start it at random).
    new_weights: set[str] = set()
    if added:
        with torch.device("meta"):
            before = set(MiniNormForCausalLM(starting).state_dict())
            after = MiniNormForCausalLM(MiniNormConfig.from_pretrained(source, **requested)).state_dict()
        new_weights = set(after) - before
    return load_input_model(source, "--from_weight", allowed_missing=new_weights, **requested), added


def effective_config(args: TrainArgs, model: MiniNormForCausalLM) -> dict[str, Any]:
    # its input paths as the same files from any directory: train_config.yaml is the --config that finishes the run
    config = recorded_input_paths({k: v for k, v in args.to_dict().items() if k != "model"})
    config.update({name: getattr(model.config, name) for name in MODEL_FIELDS})
    config["out_dir"] = str(args.resolved_out_dir())
    return config
