"""Pretraining with copy rows (--copy_rows, trainer/objectives.py) end to end: it logs the copy loss beside the loss,
a resumed run reproduces the uninterrupted one bit for bit (the rows and the weight schedule are functions of the
step), and two processes take the steps of one process with two micro-batches (the rows follow the global batch).
SFT takes the same rows, and may give a model trained without smeared keys its smeared keys."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file

from model.model import MiniNormForCausalLM
from tests.training_runs import (assert_same_logged_metrics, assert_same_model, finetune_argv, launch_two_processes,
                                 pretrain_argv, run_in_process, sft_argv, train_losses)
from trainer.arg_fields import COPY_ROWS_TO_LEARN
from trainer.args import check_args
from trainer.run_dir import read_metrics

# The weight drops from 1.0 to 0.5 after step 4, so a run resumed at step 3 crosses the switch; the rows have cue pairs.
COPY = ("--copy_rows", "2", "--copy_steps", "4", "--copy_weight", "1.0", "--copy_weight_after", "0.5",
        "--copy_cue_pairs", "4", "--smeared_keys", "true", "--batch_size", "4")


class _Collect(logging.Handler):
    """The log records' texts (transformers' loggers do not propagate to the root logger pytest watches)."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(record.getMessage())


@pytest.fixture(scope="module")
def copying(train_data, tmp_path_factory):
    """One process, two micro-batches of 4 rows a step."""
    out_dir = tmp_path_factory.mktemp("copy") / "run"
    run_in_process("pretrain", pretrain_argv(train_data, out_dir, *COPY, "--accumulation_steps", "2"))
    return out_dir


def test_a_run_with_copy_rows_logs_the_copy_loss(copying):
    train = read_metrics(copying, "train")
    assert len(train) == 8 and all(record["copy_loss"] > 0 for record in train)
    # the copy rows' loss is added to the language modeling one: the logged loss is lm_loss + weight x copy_loss
    assert all(record["loss"] > record["copy_loss"] for record in train if record["step"] <= 4)
    for record in train:
        weight = 1.0 if record["step"] <= 4 else 0.5
        assert record["loss"] == pytest.approx(record["lm_loss"] + weight * record["copy_loss"], rel=1e-5)
    config = (copying / "train_config.yaml").read_text()
    assert "copy_rows: 2" in config and "copy_cue_pairs: 4" in config and "smeared_keys: true" in config


def test_a_resumed_run_with_copy_rows_reproduces_it_bit_for_bit(copying, train_data, tmp_path):
    resumed = tmp_path / "resumed"
    run_in_process("pretrain", pretrain_argv(train_data, resumed, *COPY, "--accumulation_steps", "2", "--resume",
                                             str(copying / "checkpoints" / "step_00000003")))
    assert train_losses(resumed) == [loss for record, loss in zip(read_metrics(copying, "train"),
                                                                    train_losses(copying)) if record["step"] > 3]
    ours, theirs = load_file(resumed / "model.safetensors"), load_file(copying / "model.safetensors")
    assert all(torch.equal(ours[name], tensor) for name, tensor in theirs.items())


def test_two_processes_with_copy_rows_train_like_one_process(copying, train_data, tmp_path):
    """torchrun, two processes of one micro-batch each against one process of two: the same data, the same copy
    rows (drawn by global micro-batch index), the same step."""
    out_dir = tmp_path / "two"
    run = launch_two_processes("torchrun", "pretrain", pretrain_argv(train_data, out_dir, *COPY), tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert_same_logged_metrics(out_dir, copying)
    assert_same_model(out_dir, copying)


def test_sft_gives_a_plain_model_smeared_keys_and_trains_with_copy_rows(reference_run, train_data, tmp_path,
                                                                        capsys):
    """The plain reference model fine-tuned with --smeared_keys true and --copy_rows unset (SFT's default): it starts
    as the pretrained model with each key half its own, half the previous position's (logit 0, as a fresh model),
    takes COPY_ROWS_TO_LEARN copy rows, logs the copy loss, and saves a model with smeared keys; a model that has them
    cannot lose them, and no other shape field changes. The new weights are announced as added, not reported as
    missing; a checkpoint missing any other weight is refused."""
    argv = sft_argv(train_data, reference_run, tmp_path / "sft", "--smeared_keys", "true", "--copy_rows", "none",
                    "--copy_steps", "3", "--batch_size", "4")
    capsys.readouterr()
    run_in_process("sft", argv)
    assert "--smeared_keys true: added to the starting weights" in capsys.readouterr().out
    train = read_metrics(tmp_path / "sft", "train")
    assert train and all(record["copy_loss"] > 0 for record in train)
    assert f"copy_rows: {COPY_ROWS_TO_LEARN}\n" in (tmp_path / "sft" / "train_config.yaml").read_text()
    tuned = MiniNormForCausalLM.from_pretrained(tmp_path / "sft")
    assert tuned.config.smeared_keys
    smear = [p for name, p in tuned.named_parameters() if name.endswith("key_smear")]
    assert len(smear) == tuned.config.num_hidden_layers and any(p.abs().max() > 0 for p in smear)  # trained

    from trainer.args import parse_args
    from trainer.run_inputs import build_model, load_run_tokenizer, starting_weights_dir
    args = parse_args("sft", argv)
    reports = _Collect()
    logging.getLogger("transformers").addHandler(reports)
    try:
        start, added_switches = build_model(args, load_run_tokenizer(args), starting_weights_dir(args))
    finally:
        logging.getLogger("transformers").removeHandler(reports)
    assert added_switches == ["smeared_keys"]
    assert not [text for text in reports.texts if "MISSING" in text]  # transformers' load report: quiet about them
    plain = load_file(reference_run / "model.safetensors")
    weights = start.state_dict()
    assert all(torch.equal(weights[name], tensor) for name, tensor in plain.items() if name in weights)
    added = {name for name in set(weights) - set(plain) if name != "lm_head.weight"}  # the head is the tied embedding
    assert added == {f"model.layers.{i}.self_attn.key_smear" for i in range(start.config.num_hidden_layers)}
    assert all(torch.equal(p, torch.zeros_like(p)) for name, p in start.named_parameters()
               if name.endswith("key_smear"))

    broken = tmp_path / "broken"
    shutil.copytree(reference_run, broken)
    save_file({name: tensor for name, tensor in plain.items() if name != "model.norm.weight"},
              broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"^--from_weight cannot load .*broken: .*: missing model\.norm\.weight$"):
        broken_args = parse_args("sft", sft_argv(train_data, broken, tmp_path / "not_run", "--smeared_keys", "true"))
        build_model(broken_args, load_run_tokenizer(args), starting_weights_dir(broken_args))

    with pytest.raises(ValueError, match="--smeared_keys false: .* was trained with it on"):
        run_in_process("sft", sft_argv(train_data, tmp_path / "sft", tmp_path / "back", "--smeared_keys", "false"))
    # refused when the flags are read (trainer/arg_fields.py, refuse_fixed_model_fields), before any model loads
    with pytest.raises(ValueError, match="--qk_norm cannot change when fine-tuning"):
        check_args("sft", sft_argv(train_data, reference_run, tmp_path / "qk", "--qk_norm", "true"))
    # LoRA trains adapters only: a smear it added would stay frozen at half and half.
    with pytest.raises(ValueError, match="--smeared_keys cannot change when fine-tuning"):
        check_args("lora", finetune_argv("lora", train_data, reference_run, tmp_path / "lora", "--smeared_keys",
                                         "true"))


def test_an_sft_that_adds_smeared_keys_resumes_bit_for_bit(reference_run, train_data, tmp_path):
    """The default SFT's shape (smeared keys added, copy rows, the weight switching mid-run) on the tiny model: a
    run resumed from its step-3 checkpoint ends with the uninterrupted run's losses and weights."""
    flags = ("--smeared_keys", "true", "--copy_rows", "2", "--copy_steps", "4", "--copy_weight_after", "0.5",
             "--batch_size", "4", "--save_interval", "3")
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_in_process("sft", sft_argv(train_data, reference_run, whole, *flags))
    run_in_process("sft", sft_argv(train_data, reference_run, resumed, *flags, "--resume",
                                   str(whole / "checkpoints" / "step_00000003")))
    assert train_losses(resumed) == [loss for record, loss in zip(read_metrics(whole, "train"), train_losses(whole))
                                     if record["step"] > 3]
    ours, theirs = load_file(resumed / "model.safetensors"), load_file(whole / "model.safetensors")
    assert set(ours) == set(theirs) and all(torch.equal(ours[name], tensor) for name, tensor in theirs.items())


def test_sft_of_a_model_that_copies_adds_no_copy_rows_unless_asked(copying, train_data, tmp_path, monkeypatch):
    """A model pretrained with smeared keys (and copy rows) copies already: SFT with --copy_rows unset adds no rows
    (the README's chat model), and wandb's run config says so (the resolved number, not the unset flag); --copy_rows N
    still adds N."""
    logged: list[dict] = []
    init_trackers = Accelerator.init_trackers

    def spy(self, project_name, config=None, init_kwargs=None):
        logged.append(dict(config))
        return init_trackers(self, project_name, config=config, init_kwargs=init_kwargs)

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(Accelerator, "init_trackers", spy)
    run_in_process("sft", sft_argv(train_data, copying, tmp_path / "unset", "--smeared_keys", "true", "--copy_rows",
                                   "none", "--batch_size", "4", "--use_wandb"))
    assert "copy_rows: 0\n" in (tmp_path / "unset" / "train_config.yaml").read_text()
    assert [config["copy_rows"] for config in logged] == [0]
    assert all("copy_loss" not in record for record in read_metrics(tmp_path / "unset", "train"))
    run_in_process("sft", sft_argv(train_data, copying, tmp_path / "asked", "--smeared_keys", "true", "--copy_rows",
                                   "2", "--batch_size", "4"))
    assert all(record["copy_loss"] > 0 for record in read_metrics(tmp_path / "asked", "train"))
