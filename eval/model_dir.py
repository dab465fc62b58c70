"""Finding and loading a trained model directory for chat, evaluation and export.

Locating a directory and naming the command that creates a missing one imports nothing heavy, so a CLI can
fail with its one-line message before torch loads. The loader works for any causal-LM directory transformers
knows (ours, and the LLaMA directories that scripts/convert_to_llama.py writes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


REPO_ROOT = Path(__file__).resolve().parents[1]
SFT_DIR = "out/sft"
PRETRAIN_DIR = "out/pretrain"
TRAIN_CONFIG_FILE = "train_config.yaml"  # written by trainer/core.py next to the model, with `task:`
CREATE_COMMANDS = {"sft": "python trainer/train_full_sft.py", "pretrain": "python trainer/train_pretrain.py"}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def resolve_path(path: str | Path) -> Path:
    """trainer.args.resolve_path's rule (relative paths start at the repo root), without its import of torch
    (through model.config): a missing model is reported at once."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


def resolve_input_path(path: str | Path) -> Path:
    """An existing input: as typed from the current directory when that exists, else from the repo root like the
    trainers (resolve_path)."""
    typed = Path(path).expanduser()
    return typed.resolve() if typed.exists() else resolve_path(typed)


class ModelNotFound(FileNotFoundError):
    """No model directory where one was expected; the message says which command creates it."""


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any((path / name).is_file() for name in WEIGHT_FILES)


def model_task(path: Path) -> str | None:
    """"sft" or "pretrain": the `task` the trainer recorded in train_config.yaml, else guessed from the
    directory name; None when neither tells."""
    config_file = path / TRAIN_CONFIG_FILE
    if config_file.is_file():
        import yaml

        task = (yaml.safe_load(config_file.read_text()) or {}).get("task")
        if task in CREATE_COMMANDS:
            return task
    name = path.name.lower()
    if "sft" in name or "chat" in name:
        return "sft"
    if "pretrain" in name:
        return "pretrain"
    return None


def _missing(path: Path, task: str) -> ModelNotFound:
    out_flag = "" if path in (resolve_path(SFT_DIR), resolve_path(PRETRAIN_DIR)) else f" --out_dir {path}"
    return ModelNotFound(f"no model at {path}; create it with `{CREATE_COMMANDS[task]}{out_flag}`")


def locate_model(model_path: str | Path | None = None) -> tuple[Path, str | None]:
    """The model directory to use and, when it is not the one asked for, a note saying so.

    No path: the latest SFT model (out/sft), else the pretrained one (out/pretrain). Raises ModelNotFound.
    """
    if model_path is not None:
        path = resolve_input_path(model_path)
        if not is_model_dir(path):
            task = model_task(path) or ("pretrain" if path == resolve_path(PRETRAIN_DIR) else "sft")
            raise _missing(path, task)
        return path, None
    sft, pretrain = resolve_path(SFT_DIR), resolve_path(PRETRAIN_DIR)
    if is_model_dir(sft):
        return sft, None
    if is_model_dir(pretrain):
        return pretrain, (f"no SFT model at {sft} (create it with `{CREATE_COMMANDS['sft']}`); "
                          f"using the pretrained model at {pretrain}")
    raise ModelNotFound(f"no model at {sft} or {pretrain}; create one with `{CREATE_COMMANDS['pretrain']}` "
                        f"and then `{CREATE_COMMANDS['sft']}`")


def pick_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model(path: Path, device: str = "auto", dtype: str = "auto") -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) from a model directory.

    dtype "auto": bfloat16 on CUDA, float32 elsewhere. The saved norm_impl is kept, except that a saved "auto"
    becomes "eager" on CPU: torch.compile's start-up costs more than it saves in a chat.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import model  # noqa: F401  (registers the "mininorm" type with the Auto classes)
    from dataset.tokenization import load_tokenizer

    hf_logging.disable_progress_bar()  # "Loading weights" bars would interleave with chat output
    device = pick_device(device)
    torch_dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32,
                   "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    overrides: dict[str, Any] = {}
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "norm_impl", None) == "auto" and not device.startswith("cuda"):
        overrides["norm_impl"] = "eager"
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **overrides).to(device).eval()
    return loaded, load_tokenizer(path)
