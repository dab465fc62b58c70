"""A finished run's artifacts: the Hugging Face model directory (a PEFT adapter directory for LoRA), the merged
model of a LoRA run (`--merge`), and the sample generation that run_summary.json keeps."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml
from accelerate import Accelerator

from dataset.atomic_io import atomic_write_text, give_open_modes
from dataset.chat_format import encode_chatml, encode_text
from dataset.json_text import strict_json
from dataset.tokenization import begin_tokenizer_save, end_tokenizer_save, model_dir_lock
from model.generation_defaults import saved_generation_config
from model.config import MiniNormConfig
from model.model import MiniNormForCausalLM
from trainer.distributed import full_state_dict
from trainer.run_dir import ADAPTER_CONFIG_FILE, CONFIG_FILE, MERGED_DIR, is_chat_task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PRETRAIN_PROMPT, CHAT_PROMPT = "The history of", "What is the capital of France?"
# save_model_dir's staging folder inside the out dir: tempfile.mkdtemp's name, this prefix, 8 characters of its
# alphabet and the writing process's pid and host (".model_k3j9x2ab.4242@node1"; without them: a save of before).
# A save killed before its cleanup leaves one; a later save into the folder removes it once its writer is gone, and
# never the folder of a save that is still writing (two saves at once into one directory).
_STAGING_PREFIX = ".model_"
_STAGING_NAME = re.compile(re.escape(_STAGING_PREFIX) + r"[a-z0-9_]{8}(?:\.(?P<pid>[1-9][0-9]*)@(?P<host>[^/]+))?")


def save_model_dir(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> None:
    """Write a plain HF model directory (a PEFT adapter directory for a PEFT model); each file is moved into place
    whole, and the tokenizer files jointly: the folder's TOKENIZER_MARKER says a save is under way before the first
    is moved in and records them all after the last (dataset/tokenization.py), so that a kill between two leaves
    no mix of two tokenizers that a load would take for one. The moves hold the folder (model_dir_lock): another
    save into it at the same time waits for them, and is refused in one line if they last over a minute."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    base.generation_config = saved_generation_config(tokenizer.eos_token_id, tokenizer.pad_token_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(out_dir)
    staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, suffix=f".{os.getpid()}@{socket.gethostname()}",
                                    dir=out_dir))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        if (staging / ADAPTER_CONFIG_FILE).is_file():
            _sort_adapter_modules(staging / ADAPTER_CONFIG_FILE)
        before = {item.name for item in staging.iterdir()}
        tokenizer.save_pretrained(staging)
        tokenizer_files = sorted({item.name for item in staging.iterdir()} - before)
        give_open_modes(staging)
        with model_dir_lock(out_dir):  # one save's moves at a time: two at once would leave a mix of both
            begin_tokenizer_save(out_dir, tokenizer_files)
            for item in staging.iterdir():
                os.replace(item, out_dir / item.name)
            end_tokenizer_save(out_dir, tokenizer_files)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_stale_staging(out_dir: Path) -> None:
    """Remove the staging folders an earlier save_model_dir left in ``out_dir`` when it was killed (a copy of the
    whole model each); only folders named as this module names them are touched, and only those whose writer is
    gone: another save into the folder may be staging its files right now."""
    for item in out_dir.iterdir():
        name = _STAGING_NAME.fullmatch(item.name)
        if name and item.is_dir() and not item.is_symlink() and _writer_gone(name["pid"], name["host"]):
            shutil.rmtree(item, ignore_errors=True)


def _writer_gone(pid: str | None, host: str | None) -> bool:
    """Whether the process that named a staging folder (its pid and host; None: a save from before they were
    recorded, taken as gone) has ended. Another machine's process cannot be asked, nor can one whose pid a new
    process took since: their folders are kept (a leftover, never a save cut short)."""
    if pid is None:
        return True
    if host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)  # signal 0: only whether the process exists
    except (ProcessLookupError, OverflowError):  # no such process; a pid no process can have
        return True
    except PermissionError:  # another user's process
        return False
    return False


# The module lists PEFT's LoraConfig holds as sets and writes in the set's order, which the hash seed decides.
_SET_VALUED = ("target_modules", "exclude_modules")


def _sort_adapter_modules(config_file: Path) -> None:
    """Rewrite PEFT's adapter_config.json with its module lists sorted: PEFT writes them in a set's order, which
    changed with PYTHONHASHSEED, so the same adapter gave another file in every process. The rest is as PEFT writes
    it (keys sorted, indent 2)."""
    config = json.loads(config_file.read_text(encoding="utf-8"))
    for key in _SET_VALUED:
        if isinstance(config.get(key), list):
            config[key] = sorted(config[key])
    atomic_write_text(config_file, strict_json(config, indent=2, sort_keys=True))


def whole_model(accelerator: Accelerator, model: torch.nn.Module, unwrapped: torch.nn.Module,
                sharded: bool) -> torch.nn.Module | None:
    """Collective. The trained model as one plain module on the main process (None elsewhere): the model itself,
    or, when its weights are sharded, a copy assembled from every process's shard."""
    if not sharded:
        return unwrapped if accelerator.is_main_process else None
    state_dict = full_state_dict(accelerator, model)
    return _assembled(unwrapped.config, state_dict) if accelerator.is_main_process else None


def _assembled(config: MiniNormConfig, state_dict: dict[str, torch.Tensor]) -> MiniNormForCausalLM:
    """A plain model of `config` holding the tensors of a full state dict themselves (no copy, no initialization)."""
    with torch.device("meta"):
        assembled = MiniNormForCausalLM(config)
    assembled.load_state_dict(state_dict, assign=True)
    assembled.tie_weights()
    return assembled


def whole_model_everywhere(model: torch.nn.Module) -> torch.nn.Module:
    """Collective. A plain copy of a sharded (FSDP2) model, whole on every process, without gradients: what samples
    under sharding. On the sharded model itself every decode step is a collective, though processes' completions
    may end after different numbers of steps, and the engine's inference mode leaves inference tensors in FSDP's
    gathered buffers, which the next training forward refused (a GKD run under FSDP2 failed so)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    whole = _assembled(model.config, {name: tensor.detach() for name, tensor in state_dict.items()})
    return whole.requires_grad_(False)


def sample_text(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, task: str, prompt: str | None,
                seed: int) -> str:
    """A short sampled continuation of `prompt` (default: one for the task), as run_summary.json keeps it."""
    chat = is_chat_task(task)
    prompt = prompt or (CHAT_PROMPT if chat else PRETRAIN_PROMPT)
    # The prompt is text, whatever it contains (a --sample_prompt with "<|im_end|>" in it stays text).
    ids = (encode_chatml(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True).input_ids
           if chat else encode_text(tokenizer, prompt))
    input_ids = torch.tensor([ids], device=next(model.parameters()).device)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    was_training = model.training
    model.eval()  # no dropout while sampling
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        output = model.generate(**inputs, max_new_tokens=48, do_sample=True, temperature=0.7, top_p=0.9,
                                repetition_penalty=1.1)
    model.train(was_training)
    completion = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return f"{prompt} -> {completion.strip()}" if chat else prompt + completion


def save_merged(adapted: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, out_dir: Path,
                run_config: dict) -> Path:
    """OUT_DIR/merged: a plain model directory with the LoRA adapters folded into the weights (and the run's
    config, so tools know it is a chat model)."""
    from model.lora import merged_model

    merged_dir = out_dir / MERGED_DIR
    save_model_dir(merged_model(adapted), tokenizer, merged_dir)
    atomic_write_text(merged_dir / CONFIG_FILE, yaml.safe_dump(run_config, sort_keys=False))
    return merged_dir


def save_final_model(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, out_dir: Path, run_config: dict,
                     lora: bool, merge: bool) -> str:
    """The finished run's model directory in `out_dir` (a PEFT adapter directory when `lora`) and, with `merge`,
    the merged model beside it; returns the line that says where they are."""
    save_model_dir(model, tokenizer, out_dir)
    saved = f"{'LoRA adapter' if lora else 'model'} saved to {out_dir}"
    if lora and merge:
        merged_dir = save_merged(model, tokenizer, out_dir, run_config)
        saved += f"; the merged model to {merged_dir}"
    return saved
