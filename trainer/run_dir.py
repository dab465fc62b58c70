"""The run directory: the one owner of what a training run writes, where relative paths start, how its jsonl
files are read back, and the exit codes the trainer and the tools share.

A run directory (`--out_dir`; by default out/pretrain or out/sft) holds

    train_config.yaml                   the effective config, with `task:` (one of TASKS) and
                                        `run_id:`, the run's identity, which every checkpoint's state repeats
    metrics.jsonl                       one JSON object per line: {"step": ..., "split": "train"|"val"|"diag", ...}
    run_summary.json                    the outcome: status "finished" or "diverged", final validation, speed
    checkpoints/step_XXXXXXXX/          resumable states, each completed by its trainer_state.json
    config.json, model.safetensors, generation_config.json, tokenizer files: a Hugging Face model directory
                                        (a LoRA run: adapter_config.json, adapter_model.safetensors, a PEFT adapter,
                                        and with --merge the merged model directory in merged/)

One directory holds one run: a trainer refuses to start a new run where one left a finished model or checkpoints
(`previous_run`), unless --overwrite, which first removes that run's files (`clear_previous_run`).

Standard library only (PyYAML on demand), so a command-line tool can name a missing model in one line before
torch loads.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dataset.atomic_io import (check_folder_path, check_output_file, path_overlap, read_text_file,
                               special_file_kind)
from dataset.json_text import strict_json
from dataset.shown_value import shown_value
from dataset.tokenizer_marker import TOKENIZER_MARKER

REPO_ROOT = Path(__file__).resolve().parents[1]

CONFIG_FILE = "train_config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "run_summary.json"
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_PREFIX = "step_"
STATE_FILE = "trainer_state.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
RUN_ID_KEY = "run_id"  # train_config.yaml and every checkpoint's trainer_state.json: the run that wrote them
OVERWRITE_FLAG = "--overwrite"

TASKS = ("pretrain", "sft", "lora", "dpo", "distill", "grpo", "ppo")
ROLLOUT_TASKS = ("grpo", "ppo")  # the tasks that train on completions they sample from the policy
DEFAULT_OUT_DIRS = {"pretrain": "out/pretrain", "sft": "out/sft", "lora": "out/lora", "dpo": "out/dpo",
                    "distill": "out/distill", "grpo": "out/grpo", "ppo": "out/ppo"}
TRAINER_SCRIPTS = {"pretrain": "trainer/train_pretrain.py", "sft": "trainer/train_full_sft.py",
                   "lora": "trainer/train_lora.py", "dpo": "trainer/train_dpo.py",
                   "distill": "trainer/train_distillation.py", "grpo": "trainer/train_grpo.py",
                   "ppo": "trainer/train_ppo.py"}  # each task's trainer, from the repo root
CREATE_COMMANDS = {task: f"python {script}" for task, script in TRAINER_SCRIPTS.items()}
# The model a fine-tuning task starts from when no --from_weight is given (pretraining starts from nothing): for
# distillation, the student's; the task whose model is a distillation's teacher when no --teacher is given.
DEFAULT_FROM_WEIGHT = {"sft": "pretrain", "lora": "sft", "dpo": "sft", "distill": "pretrain", "grpo": "sft",
                       "ppo": "sft"}
DEFAULT_TEACHER = "sft"
ADAPTER_CONFIG_FILE = "adapter_config.json"  # PEFT's name: a LoRA run's output is an adapter, not a model
MERGED_DIR = "merged"                        # train_lora.py --merge: the merged plain model, inside the run
# A finished run's model files (the tokenizer files beside them are the same for every run and stay).
MODEL_FILES = ("config.json", *WEIGHT_FILES, "generation_config.json", ADAPTER_CONFIG_FILE,
               "adapter_model.safetensors", MERGED_DIR)
# What a run writes in its --out_dir and --overwrite removes (the tokenizer files stay: the same for every run).
RUN_FILES = (CHECKPOINT_DIR, METRICS_FILE, SUMMARY_FILE, CONFIG_FILE, *MODEL_FILES)
RUN_FOLDERS = (CHECKPOINT_DIR, MERGED_DIR)  # the folders among them; the rest are files
# The files a model directory's tokenizer and chat template may be read from (transformers' names).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
# The validation metrics as each task's trainer logs them (metrics.jsonl's "val" records, wandb) -> their keys in
# run_summary.json's "final_val". The eval results' logged() read these (trainer/evaluation.py, dpo.py, grpo.py).
VAL_METRICS = {"val_loss": "loss", "val_ppl": "perplexity", "val_bpb": "bits_per_byte"}  # language modeling
DPO_VAL_METRICS = {"val_loss": "loss", "val_reward_accuracy": "reward_accuracy", "val_reward_margin": "reward_margin",
                   "val_chosen_reward": "chosen_reward", "val_rejected_reward": "rejected_reward",
                   "val_nll_loss": "nll_loss"}  # the last only where the loss reads it (--rpo_alpha, sft)
ROLLOUT_VAL_METRICS = {"val_loss": "loss", "val_reward": "reward", "val_completion_length": "completion_length",
                       "val_accuracy": "accuracy"}  # GRPO's and PPO's greedy validation
TASK_VAL_METRICS = {"pretrain": VAL_METRICS, "sft": VAL_METRICS, "lora": VAL_METRICS, "distill": VAL_METRICS,
                    "dpo": DPO_VAL_METRICS, "grpo": ROLLOUT_VAL_METRICS, "ppo": ROLLOUT_VAL_METRICS}
FINAL_PREFIX = "final/"  # wandb: the final validation, and the run's throughput, logged once more at the end
FINAL_RUN_METRICS = ("tokens_per_s",)  # run_summary.json numbers also logged as final/<name>

EXIT_ERROR = 2     # bad input or a missing file: one line on stderr, nothing trained or written
EXIT_DIVERGED = 3  # the loss (or gradient) became NaN/inf; run_summary.json says "diverged"
EXIT_PEER_LOST = 4  # several processes: one waited --dist_timeout for the others (a node died, the network failed)
EXIT_INTERRUPTED = 128 + 2  # Ctrl-C: what a shell reports for a program killed by SIGINT
EXIT_BROKEN_PIPE = 128 + 13  # the reader of a tool's output stopped early: what a shell reports for SIGPIPE
EXIT_CANNOT_EXECUTE = 126  # a command found but not runnable (no permission, not a program): a shell's code
EXIT_NOT_FOUND = 127  # a command that does not exist: a shell's code


def exit_code_of(returncode: int) -> int:
    """A child's exit as a shell reports it: its code, or 128 + N for one killed by signal N (Popen's -N)."""
    return 128 - returncode if returncode < 0 else returncode


def trainer_task(program: str | Path) -> str | None:
    """The task whose trainer `program` is (a path from the repo root, or absolute); None for any other program."""
    path = resolve_path(program).resolve()
    return next((task for task, script in TRAINER_SCRIPTS.items() if (REPO_ROOT / script).resolve() == path), None)


def logged_metrics(task: str) -> dict[str, tuple[str, ...]]:
    """The metric names `task`'s trainer logs whose final value run_summary.json holds (a sweep's metric must be one
    of them) -> where it lies there: ("final_val", key) or (key,)."""
    names: dict[str, tuple[str, ...]] = {name: ("final_val", key) for name, key in TASK_VAL_METRICS[task].items()}
    names.update({FINAL_PREFIX + name: where for name, where in names.items()})
    names.update({FINAL_PREFIX + key: (key,) for key in FINAL_RUN_METRICS})
    return names


# Every metric some task's trainer logs -> where run_summary.json holds its final value (the tasks agree on each).
FINAL_METRIC_PLACES = {name: where for task in TASKS for name, where in logged_metrics(task).items()}


def final_metric(summary: dict[str, Any], name: str) -> float | None:
    """The final value of the logged metric `name` (any task's, FINAL_METRIC_PLACES) in a run_summary.json; None
    where the summary lacks it or it is not a finite number (a NaN would poison a bayes search)."""
    value: Any = summary
    for key in FINAL_METRIC_PLACES.get(name, ()):
        value = value.get(key) if isinstance(value, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def report_error(error: BaseException | str) -> int:
    """The command-line tools' way to fail on bad input: one line on stderr, and EXIT_ERROR to exit with."""
    print(f"error: {error}", file=sys.stderr)
    return EXIT_ERROR


# --------------------------------------------------------------------------- paths
def _expand(path: str | Path) -> Path:
    # ~ and $VARIABLES are expanded as a shell would, also for programs started without one: `wandb agent` passes
    # a sweep YAML's `--out_dir=out/sweeps/$WANDB_SWEEP_ID/$WANDB_RUN_ID` to the trainer verbatim. As a shell, it
    # leaves ~user of no such user as typed (pathlib raised RuntimeError: a traceback from every path flag).
    try:
        path = Path(path).expanduser()
    except RuntimeError:
        path = Path(path)
    return Path(os.path.expandvars(path))


def resolve_path(path: str | Path) -> Path:
    """Relative paths start at the repo root, so `cd trainer && python train_pretrain.py` writes to the same
    out/ as running from the root."""
    path = _expand(path)
    return path if path.is_absolute() else REPO_ROOT / path


def resolve_input_path(path: str | Path) -> Path:
    """An existing input (every flag that names a file or folder to read): as typed from the current directory
    when that exists, else from the repo root, where an error then names it. Made absolute, not resolved through
    symlinks: from the repo root, the very path resolve_path gives (what a run records of its data, and a resume
    compares, stays the same)."""
    typed = _expand(path)
    try:
        here = typed.exists()
    except OSError:  # a name the system will not look up (a component over 255 bytes): its reader says so, once
        here = False
    return typed.absolute() if here else resolve_path(typed)


def recorded_input_path(path: str) -> str:
    """An input flag's value as a run records it, naming the same file from any directory: as typed where it is
    read from the repo root (a committed record's or a sweep config's repo-relative path, an absolute path), else
    (found only from the current directory) the absolute path it is read from, which a resume from elsewhere
    (`--config RUN/train_config.yaml --resume auto` from the repo root) would otherwise look for under the repo
    root."""
    try:
        found = resolve_input_path(path)
        return path if found == resolve_path(path) else str(found)
    except OSError:  # a name too long to look up: its reader says so
        return path


def shown_path(path: str | Path) -> str:
    """`path` as a committed file names it: relative to the repo root when it lies inside (the same on every machine
    and clone), else absolute."""
    resolved = _expand(path).resolve()
    return str(resolved.relative_to(REPO_ROOT) if resolved.is_relative_to(REPO_ROOT) else resolved)


def default_out_dir(task: str) -> Path:
    return resolve_path(DEFAULT_OUT_DIRS[task])


def starting_directory(task: str, from_weight: str | None) -> Path:
    """The model directory a fine-tuning `task` starts from: --from_weight `from_weight`, else its task's default."""
    if from_weight:
        return resolve_input_path(from_weight)
    return resolve_path(DEFAULT_OUT_DIRS[DEFAULT_FROM_WEIGHT[task]])


def create_command(task: str, path: Path) -> str:
    """The command that writes `task`'s model to `path`: its trainer, with --out_dir unless that is its default."""
    return CREATE_COMMANDS[task] + ("" if path == default_out_dir(task) else f" --out_dir {path}")


def finish_command(task: str, run_dir: Path) -> str:
    """The command that goes on with the stopped `task` run in `run_dir` from its newest checkpoint, with its own
    flags (--out_dir: its train_config.yaml records where it was written, which a moved or copied run is no
    longer)."""
    return f"{CREATE_COMMANDS[task]} --config {run_dir / CONFIG_FILE} --out_dir {run_dir} --resume auto"


def is_chat_task(task: str | None) -> bool:
    """Whether a run of `task` makes a chat model (ChatML prompts): every task but pretraining."""
    return task is not None and task != "pretrain"


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoint_step(name: str) -> int | None:
    """The optimizer step of a checkpoint folder's name, None for any other name."""
    if not name.startswith(CHECKPOINT_PREFIX) or not name[len(CHECKPOINT_PREFIX):].isdigit():
        return None
    return int(name[len(CHECKPOINT_PREFIX):])


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root` (a run's CHECKPOINT_DIR), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if checkpoint_step(p.name) is not None and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: checkpoint_step(p.name))


# --------------------------------------------------------------------------- one run per directory
def recorded_config(run_dir: Path) -> dict[str, Any]:
    """The trainer arguments a run recorded in its train_config.yaml; {} where there is none (no run there). A file
    that is no such record is a ValueError naming it: not UTF-8 (its UnicodeDecodeError reached the tools' one line
    without the file), a directory (a `mkdir` in its place: it was a resume's IsADirectoryError traceback where the
    run wrote it), not YAML or not a mapping (a truncated or emptied file, a hand edit: read as no record, a
    `--resume auto` of the finished run trained it again from its checkpoint over its model, and chat took a
    pretrained model for a chat one), each in trainer/yaml_file.py's words. Its fields are each reader's to check."""
    config_file = run_dir / CONFIG_FILE
    if not config_file.exists():  # none (a dangling link too)
        return {}
    from trainer.yaml_file import read_yaml

    config = read_yaml(config_file)
    if not isinstance(config, dict):
        got = "an empty file" if config is None else "a list" if isinstance(config, list) else shown_value(config)
        raise ValueError(f"{config_file}: {got}, expected the run's flags (a mapping of flag names to values, as the "
                         f"trainer writes it); repair it")
    return config


def is_count(value: Any, least: int = 0) -> bool:
    """Whether a value read from a file (JSON, YAML) is an integer >= `least` (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def trained_length(model_dir: Path, adapter: Path | None = None) -> int | None:
    """The longest rows the weights in `model_dir` (with the LoRA `adapter`) trained on, over the runs that made
    them: the run that wrote each (its --max_seq_len; a GRPO/PPO run's prompts plus --max_completion_length) and,
    through each run's recorded --from_weight (or its task's default folder), the runs before it (a DPO run at 256
    from an SFT at 384: 384). None where no run recorded one (an import, a hand-made folder). A recorded length that
    is no length (edited by hand: a string, 0, a fraction, null) is a ValueError naming the file and field: the
    tools would read the model at their default length without a word."""
    longest = 0
    for start in (model_dir, adapter):
        longest = max(longest, _lineage_length(start) if start is not None else 0)
    return longest or None


def _lineage_length(model_dir: Path) -> int:
    longest, seen, folder = 0, set(), model_dir
    while folder is not None and folder.resolve() not in seen:
        seen.add(folder.resolve())
        recorded = recorded_config(folder)
        length = _recorded_length(recorded, "max_seq_len", folder)
        task = recorded.get("task") if recorded.get("task") in TASKS else None  # a hand-edited list: no task
        if length and task in ROLLOUT_TASKS:  # prompt plus completion
            length += _recorded_length(recorded, "max_completion_length", folder)
        longest = max(longest, length)
        source = recorded.get("from_weight") or DEFAULT_OUT_DIRS.get(DEFAULT_FROM_WEIGHT.get(task, ""))
        folder = resolve_path(source) if isinstance(source, str) and source else None
    return longest


def _recorded_length(recorded: dict[str, Any], key: str, folder: Path) -> int:
    """The length flag `key` a run recorded in `folder`'s train_config.yaml, 0 where it recorded none, or a
    ValueError naming the file and field where the value is no length."""
    if key not in recorded:
        return 0
    if not is_count(recorded[key], 1):
        raise ValueError(f"{folder / CONFIG_FILE}: {key} is {shown_value(recorded[key])}, expected an integer >= 1 "
                         f"(the run's --{key}: the tools read the model at the rows it trained on); repair it")
    return recorded[key]


def recorded_run_id(out_dir: Path) -> str | None:
    """The run id train_config.yaml records; None where there is none (no run yet, or a MiniNorm before run ids). One
    that is no id (a hand edit: a list, a number) is a ValueError naming the file: its text read as another run's."""
    run_id = recorded_config(out_dir).get(RUN_ID_KEY)
    if run_id is not None and not isinstance(run_id, str):
        raise ValueError(f"{out_dir / CONFIG_FILE}: {RUN_ID_KEY} is {shown_value(run_id)}, expected the run's id (a "
                         f"string, as every checkpoint's {STATE_FILE} repeats it); repair it")
    return run_id or None


def previous_run(out_dir: Path) -> str | None:
    """What a run left in `out_dir` that a new run would replace or mix with, in words (None: nothing): a finished
    model (run_summary.json, model files) or checkpoints."""
    found = [name for name in (SUMMARY_FILE, *MODEL_FILES) if (out_dir / name).exists()]
    checkpoints = sorted(p.name for p in (out_dir / CHECKPOINT_DIR).glob(f"{CHECKPOINT_PREFIX}*"))
    parts = [f"a finished model ({', '.join(found)})"] if found else []
    if checkpoints:
        parts.append(f"checkpoints ({CHECKPOINT_DIR}/{checkpoints[-1]})")
    return " and ".join(parts) or None


def refuse_previous_run(out_dir: Path, what: str, why: str = "", resuming: bool = False) -> ValueError:
    """The one line that refuses to replace or mix with the run `what` (previous_run's words) in `out_dir`;
    `resuming`: asked by a `--resume auto` that found no checkpoint there to go on from."""
    ways = "" if resuming else "--resume auto to continue it, "
    return ValueError(f"--out_dir {out_dir} already holds a run{why}: {what}"
                      + (", and no checkpoint to go on from" if resuming else "")
                      + f"; pass {OVERWRITE_FLAG} to remove its files and start anew there, {ways}or choose another "
                      f"--out_dir")


def check_out_dir(out_dir: Path, inputs: dict[str, Path], data: dict[str, Path] | None = None) -> None:
    """Refuse, in one line naming the flags, an --out_dir that cannot be a directory (a file, or under one; nor can
    its checkpoints folder be one, nor one of the files a run writes there a folder: --overwrite or not, the run
    never makes one, so it is not the run's to remove) or that is, holds or lies inside one of the run's `inputs`
    (flag -> model directory it reads): the run writes its files there and --overwrite removes a run's model files,
    which would destroy the input (path_overlap: a symlink is seen through); or where one of its `data` files (flag
    -> file) is, or lies inside, one of the files a run writes there (RUN_FILES)."""
    check_folder_path(out_dir, "--out_dir")
    check_folder_path(out_dir / CHECKPOINT_DIR, "--out_dir")  # else the first save fails, after the training to it
    # A folder in the place of one of the run's files (its tokenizer's too, saved with the final model): the run
    # failed where it wrote it, after the training.
    for name in (*RUN_FILES, *TOKENIZER_FILES, TOKENIZER_MARKER):
        if name not in RUN_FOLDERS:
            check_folder_path(out_dir / name, "--out_dir", itself=False)
    _check_checkpoint_places(out_dir / CHECKPOINT_DIR)
    for flag, source in inputs.items():
        if relation := path_overlap(out_dir, source):
            raise ValueError(f"--out_dir {out_dir} {relation} {flag} {source}: the run would write over (with "
                             f"{OVERWRITE_FLAG}: remove) the model it reads; choose an --out_dir apart from the run's "
                             f"inputs")
    for flag, source in (data or {}).items():
        written = next((name for name in RUN_FILES if path_overlap(source, out_dir / name) in ("is", "is inside")),
                       None)
        if written is not None:
            raise ValueError(f"{flag} {source} is the run's own {written} in --out_dir {out_dir}: the run would "
                             f"write over (or remove) the data it reads; move the data or choose another --out_dir")


def _check_checkpoint_places(root: Path) -> None:
    """Refuse, in one line naming it, an entry of a run's checkpoints folder `root` where the run saves a checkpoint
    (a checkpoint's name, or its save's temp folder's) that is no folder of the run's own: a file, or a symlink (to
    `root` itself, a folder above it, anywhere). The save writes a folder there and replaces it (os.replace onto it:
    a NotADirectoryError traceback after the training to that step), and a rotation removes it (through a link,
    the trainer_state.json of the folder it leads to). A link that loops is path_overlap's one line. Other names
    are left alone: the run never reads or writes them."""
    if not root.is_dir():
        return
    for entry in sorted(root.iterdir()):
        if checkpoint_step(entry.name.removeprefix(".tmp_")) is None:
            continue
        relation = path_overlap(entry, root)
        if entry.is_symlink():
            holds = ", a folder that holds it," if relation in ("is", "holds") else ""
            raise ValueError(f"--out_dir {entry} is a symlink to {entry.resolve()}{holds} not a checkpoint folder: "
                             f"the run saves its checkpoints there as folders of its own, and replaces and removes "
                             f"them; remove the link (a checkpoint of another folder is resumed with --resume PATH)")
        if not entry.is_dir():  # a file there: check_folder_path's line
            check_folder_path(entry, "--out_dir")


def model_dir_files(folder: Path) -> list[Path]:
    """The files of a model (or adapter) directory that a tool reads or its run wrote, where they exist: the run's
    files (RUN_FILES), the tokenizer's (TOKENIZER_FILES) and their record (TOKENIZER_MARKER, which every load
    checks) and every *.safetensors (a sharded checkpoint's shards). A report the tool writes (eval/evaluate.py
    --json out/sft/eval.json) may go beside them, never over one."""
    names = [name for name in (*RUN_FILES, *TOKENIZER_FILES, TOKENIZER_MARKER) if not name.endswith(".safetensors")]
    found = [folder / name for name in names if (folder / name).is_file()]
    return found + sorted(p for p in folder.glob("*.safetensors") if p.is_file())


def check_report_file(out: Path, flag: str, model_dir: Path, adapter: Path | None = None,
                      data: Sequence[Path] = (), model_flag: str = "--model_path") -> None:
    """Refuse, before the work, in one line naming both flags, a tool's report file `out` (`flag`: --json) that is
    one of the files it reads (dataset/atomic_io.py check_output_file): the model directory's (`model_flag`), the
    adapter's (--lora) or a --data file."""
    inputs = [(model_flag, path) for path in model_dir_files(model_dir)]
    inputs += [("--lora", path) for path in (model_dir_files(adapter) if adapter is not None else [])]
    inputs += [("--data", path) for path in data]
    check_output_file(out, flag, inputs)


def clear_previous_run(out_dir: Path) -> list[str]:
    """Remove the files of the run in `out_dir` that a new run would mix with (checkpoints, metrics, summary, model,
    config); returns their names."""
    import shutil

    removed = []
    for name in RUN_FILES:
        path = out_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


# --------------------------------------------------------------------------- jsonl
class JsonlRecord(dict):
    """A record read from a jsonl file: a dict that knows its place, `where` (`FILE:LINE`), for an error about one of
    its values."""

    where: str = ""


# A tool's sink for a reader's note line (skipped_lines_note): the reader itself prints nothing.
NoteSink = Callable[[str], None]


def note_on_stderr(note: str) -> None:
    """The command-line tools' NoteSink: the note is one line on stderr, and the tool goes on with the lines it
    could read (a torn line in the middle of a metrics.jsonl or results.jsonl is said, not skipped silently)."""
    print(note, file=sys.stderr, flush=True)


def record_where(record: Mapping[str, Any]) -> str:
    """Where a record is, for an error about it: FILE:LINE for a JsonlRecord, else its step."""
    return getattr(record, "where", "") or f"the record of step {shown_value(record.get('step'))}"


def record_number(record: Mapping[str, Any], key: str, kind: type = float) -> Any:
    """record[key] as a `kind` (float or int), or a ValueError naming where the record is and the key (true and
    false are no numbers). A float's null is NaN: the project writes a value that is not finite (a diverged step's
    loss) as null (strict_json)."""
    if kind is float and key in record and record[key] is None:
        return math.nan
    try:
        if isinstance(record[key], bool):  # float(True) is 1.0: a hand-edited true read as a loss of 1
            raise TypeError
        return kind(record[key])
    except (TypeError, ValueError, OverflowError):  # OverflowError: int() of JSON's Infinity or 1e400
        raise ValueError(f"{record_where(record)}: {key} is {shown_value(record[key])}, expected a number") from None


def read_jsonl(path: str | Path, note_skipped: NoteSink | None = None) -> list[dict[str, Any]]:
    """The JSON objects of a jsonl file, in order, as JsonlRecords (jsonl_lines); `note_skipped` (a tool's, which
    says it on stderr) is given skipped_lines_note's line when a line before the last was skipped. A file that
    cannot be read (none, a directory, not UTF-8) is a ValueError naming it (read_text_file)."""
    records, skipped = jsonl_lines(path)
    if skipped and note_skipped is not None:
        note_skipped(skipped_lines_note(path, skipped))
    return records


def jsonl_lines(path: str | Path, keep: Callable[[dict[str, Any]], bool] | None = None,
                ) -> tuple[list[JsonlRecord], list[int]]:
    """The JSON objects of a jsonl file (those `keep` keeps, if given), in order, as JsonlRecords, and the numbers of
    the lines skipped before its last: a line that is no JSON object (torn by a kill that a later append ended,
    hand-damaged), or one `keep` refuses. Blank lines are skipped, and so is such a last line, without a word: a
    writer may be writing it, or a killed one cut it short (append_jsonl writes each line whole). A
    UnicodeDecodeError's line named no file: a ValueError names it (read_text_file)."""
    records, skipped = [], []
    lines = read_text_file(Path(path), "a jsonl file").splitlines()
    last = max((number for number, line in enumerate(lines, 1) if line.strip()), default=0)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and (keep is None or keep(record)):
            records.append(JsonlRecord(record))
            records[-1].where = f"{path}:{number}"
        elif number != last:
            skipped.append(number)
    return records, skipped


MAX_LINES_NAMED = 5  # the skipped lines a note names by number


def skipped_lines_note(path: str | Path, numbers: Sequence[int], what: str = "torn or damaged") -> str:
    """The one note line a tool prints about the lines of `path` it skipped: their `numbers` (the first
    MAX_LINES_NAMED named), `what` they were."""
    many = "s" if len(numbers) > 1 else ""
    shown = ", ".join(str(number) for number in numbers[:MAX_LINES_NAMED])
    shown += ", ..." if len(numbers) > MAX_LINES_NAMED else ""
    return f"note: {path}: {len(numbers)} line{many} skipped, {what} (line{many} {shown}); the rest is read"


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one record as one line with a single write() on an O_APPEND descriptor, so a reader never sees half a
    record from us. A last line torn by an earlier kill is ended first, so it cannot swallow this record."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (strict_json(record, default=str) + "\n").encode()
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as handle:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                data = b"\n" + data
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_metrics(path: str | Path, split: str | None = None,
                 note_skipped: NoteSink | None = None) -> list[dict[str, Any]]:
    """Records of a metrics file (optionally one split), in order; a run directory means its metrics.jsonl. A
    record whose step is not an optimizer step (an integer >= 0: a hand edit, another tool) is a ValueError naming
    FILE:LINE: a resume's truncation compares the steps, and a report would plot the record at a step it never
    had. So is a record whose step is not past its split's previous one (a line pasted twice, two files joined):
    the trainer appends each split's steps in increasing order, and a curve read by step took the last of two
    silently. Records without a split (made by hand or another tool, as some tests' are) keep any order. A line
    before the last that is no record is skipped, `note_skipped` told (read_jsonl)."""
    path = Path(path)
    if path.is_dir() and path.name != METRICS_FILE:  # a metrics.jsonl that is a directory is named as one
        path = path / METRICS_FILE
    records = [record for record in read_jsonl(path, note_skipped) if "step" in record]
    previous: dict[str, dict[str, Any]] = {}  # per split (its repr), its last record so far
    for record in records:
        if not is_count(record["step"]):
            raise ValueError(f"{record_where(record)}: step is {shown_value(record['step'])}, expected an integer "
                             f">= 0 (the optimizer step)")
        if "split" not in record:  # the trainer gives every record its split: this one's order is no run's
            continue
        kind = record["split"]
        before = previous.get(repr(kind))  # repr: a hand-edited split may be a list
        if before is not None and record["step"] <= before["step"]:
            again = "repeats" if record["step"] == before["step"] else "comes after"
            raise ValueError(f"{record_where(record)}: the {shown_value(kind)} record of step {record['step']} "
                             f"{again} step {before['step']} ({record_where(before)}); a run appends each split's "
                             f"steps in increasing order: remove the repeated or out-of-order line")
        previous[repr(kind)] = record
    return [record for record in records if split is None or record.get("split") == split]


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """A run's run_summary.json; {} when there is none (yet) or it cannot be read (a directory, not UTF-8, not
    JSON)."""
    try:
        summary = json.loads((Path(run_dir) / SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: UnicodeDecodeError and json.JSONDecodeError
        return {}
    return summary if isinstance(summary, dict) else {}


# --------------------------------------------------------------------------- trained model directories
class ModelNotFound(FileNotFoundError):
    """No model directory where one was expected; the message says which command creates it."""


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any((path / name).is_file() for name in WEIGHT_FILES)


def load_input_model(source: Path, flag: str, allowed_missing: set[str] | frozenset[str] = frozenset(),
                     **overrides: Any) -> Any:
    """The MiniNorm model in the directory `flag` names (a run's starting weights, teacher or critic), loaded
    strictly (model.loading.load_strictly): a weight missing from its file (but `allowed_missing`, new on purpose),
    unexpected or of another shape is a one-line error naming the flag, where transformers would start it at
    random and the run would train on."""
    from model.loading import load_strictly
    from model.model import MiniNormForCausalLM
    try:
        return load_strictly(source, MiniNormForCausalLM, allowed_missing=allowed_missing, **overrides)
    except ValueError as error:
        raise ValueError(f"{flag} {error}") from None


def not_a_model_folder(path: Path) -> str | None:
    """The words for a model path that is no folder at all (a file, a FIFO, a device), else None: "create it with
    `... --out_dir /dev/zero`" is no advice for such a path."""
    if not path.exists() or path.is_dir():
        return None
    return f"{path} is {special_file_kind(path) or 'a file'}, not a model folder (config.json and the weights)"


def is_adapter_dir(path: Path) -> bool:
    """A PEFT adapter directory (what trainer/train_lora.py writes): it needs its base model to run."""
    return (path / ADAPTER_CONFIG_FILE).is_file()


def code_version() -> str:
    """The checkout's commit (``git describe --always --dirty``: "-dirty" when tracked files differ from it), or
    "unknown" outside a git checkout."""
    import subprocess

    try:
        described = subprocess.run(["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty", "--abbrev=12"],
                                   capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return described.stdout.strip() if described.returncode == 0 and described.stdout.strip() else "unknown"


def model_task(path: Path) -> str | None:
    """One of TASKS: the `task` the trainer recorded in train_config.yaml, else guessed from the directory name
    ("sft" or "pretrain"); None when neither tells."""
    config = recorded_config(path)
    task = config.get("task")
    if task == "distill" and config.get("distill_data") == "pretrain":
        return "pretrain"  # a student distilled on plain text continues text, as a pretrained model does
    if task in TASKS:
        return task
    name = path.name.lower()
    if "sft" in name or "chat" in name:
        return "sft"
    if "pretrain" in name:
        return "pretrain"
    return None


def _missing(path: Path, task: str) -> ModelNotFound:
    if (words := not_a_model_folder(path)) is not None:
        return ModelNotFound(words)
    if checkpoints := list_checkpoints(path / CHECKPOINT_DIR):  # a run that stopped before it saved its model
        recorded = recorded_config(path).get("task")
        finish = (f"with `{finish_command(recorded, path)}` (its own flags)"
                  if recorded in TASKS
                  else "by running its command again with --resume auto")
        return ModelNotFound(f"no model at {path} yet: its run has not finished (newest checkpoint "
                             f"{checkpoints[-1].name}); if it is no longer training, finish it {finish}")
    if (path / "config.json").is_file():  # "create it" of a folder whose weights are missing sent one retraining
        return ModelNotFound(f"no model at {path}: it holds config.json but no weights ({' or '.join(WEIGHT_FILES)})")
    return ModelNotFound(f"no model at {path}; create it with `{create_command(task, path)}`")


def locate_model(model_path: str | Path | None = None) -> tuple[Path, str | None]:
    """The model directory to use and, when it is not the one asked for, a note saying so.

    No path: the latest SFT model (out/sft), else the pretrained one (out/pretrain). Raises ModelNotFound.
    """
    if model_path is not None:
        path = resolve_input_path(model_path)
        if not is_model_dir(path):
            if is_adapter_dir(path):
                raise ModelNotFound(f"{path} is a LoRA adapter, not a whole model: pass it as --lora {path} (its "
                                    f"base model is read from it, or give --model_path BASE)")
            task = model_task(path) or ("pretrain" if path == default_out_dir("pretrain") else "sft")
            raise _missing(path, task)
        return path, None
    sft, pretrain = default_out_dir("sft"), default_out_dir("pretrain")
    if is_model_dir(sft):
        return sft, None
    if is_model_dir(pretrain):
        return pretrain, (f"no SFT model at {sft} (create it with `{CREATE_COMMANDS['sft']}`); "
                          f"using the pretrained model at {pretrain}")
    raise ModelNotFound(f"no model at {sft} or {pretrain}; create one with `{CREATE_COMMANDS['pretrain']}` "
                        f"and then `{CREATE_COMMANDS['sft']}`")


def locate_model_and_adapter(model_path: str | Path | None, lora_path: str | Path | None
                             ) -> tuple[Path, Path | None, str | None]:
    """(model directory, LoRA adapter directory or None, note) for a tool's --model_path and --lora flags.

    With --lora, the base model is --model_path when given, else the one the adapter records
    (`base_model_name_or_path` in its adapter_config.json). Raises ModelNotFound naming the command that creates
    what is missing."""
    if lora_path is None:
        path, note = locate_model(model_path)
        return path, None, note
    adapter = resolve_input_path(lora_path)
    if not is_adapter_dir(adapter):
        raise ModelNotFound(f"--lora {adapter}: no LoRA adapter there ({ADAPTER_CONFIG_FILE} is missing); create "
                            f"one with `{CREATE_COMMANDS['lora']}`")
    if model_path is not None:
        path, note = locate_model(model_path)
        return path, adapter, note
    from model.adapter_checks import read_adapter_config

    try:
        recorded = read_adapter_config(adapter).get("base_model_name_or_path")
    except ValueError as error:  # not JSON, not an object: named here, not as a missing base model
        raise ModelNotFound(f"--lora {adapter}: {error}") from None
    field = f"--lora {adapter}: base_model_name_or_path in its {ADAPTER_CONFIG_FILE}"
    if recorded is not None and not isinstance(recorded, str):
        raise ModelNotFound(f"{field} is {shown_value(recorded)}, not a path; pass the base model with --model_path")
    if not (recorded or "").strip():
        raise ModelNotFound(f"--lora {adapter}: its {ADAPTER_CONFIG_FILE} names no base model; pass it with "
                            f"--model_path")
    try:  # the base is named with where its name came from: the message alone read as if --model_path gave it
        path, note = locate_model(recorded)
    except ModelNotFound as error:
        raise ModelNotFound(f"{field}: {error}; or pass the base model with --model_path") from None
    return path, adapter, note


def locate_tool_model(args: Any) -> tuple[Path, Path | None]:
    """locate_model_and_adapter for a tool's parsed --model_path and --lora (add_model_source_flags), with its note
    (which model was chosen, and why) printed on stderr. Raises ModelNotFound."""
    path, adapter, note = locate_model_and_adapter(args.model_path, args.lora)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return path, adapter
