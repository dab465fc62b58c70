"""Datasets and dataloaders for a training run: the default corpus or the user's jsonl, a validation split held out
by document, and a deterministic per-epoch shuffle that Accelerate shards across processes.

The data position of a run is counted in samples of the epoch's order (global, over all processes): Accelerate
hands batch i of the order to process i mod world, so after n optimizer steps exactly the first
n x batch_size x accumulation_steps x processes samples have been trained on, whatever the grouping. A resumed run
starts the order at that sample, so it may use another batch size, accumulation or number of processes.
The loaders own their random generators: creating an iterator never draws from the global generator, whose state
a checkpoint restores for dropout.
"""

from __future__ import annotations

import hashlib
from functools import partial
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from dataset.split_names import DPO, GRPO, LORA, PRETRAIN, SFT, SFT_TOOLS, SplitNames
from trainer.arg_fields import TrainArgs, flags_in_effect, rollout_tools
from trainer.run_dir import ROLLOUT_TASKS, resolve_input_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class EpochShuffleSampler(Sampler[int]):
    """A permutation that depends only on (seed, epoch): every process, and a resumed run, sees the same order.
    `set_position` starts the epoch's order at a given sample (a resumed run)."""

    def __init__(self, length: int, seed: int) -> None:
        self.length, self.seed, self.epoch, self.start = length, seed, 0, 0

    def set_epoch(self, epoch: int) -> None:
        # Accelerate's loader calls this at the start of every pass with its own epoch counter: the same epoch
        # keeps the starting sample, a new one starts at its beginning.
        if epoch != self.epoch:
            self.epoch, self.start = epoch, 0

    def set_position(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.length, generator=generator)[self.start:].tolist())

    def __len__(self) -> int:
        return self.length - self.start


@dataclass
class RunData:
    train: Dataset
    val: Dataset
    collate: Callable | None
    train_sampler: EpochShuffleSampler
    train_loader: DataLoader
    val_loader: DataLoader
    description: str
    train_path: Path
    val_path: Path  # the training file's where the validation split is held out of it


def data_task(args: TrainArgs) -> str:
    """The task whose data a run reads: its own, or a distillation's --distill_data (sft or pretrain)."""
    return args.distill_data if args.task == "distill" else args.task


def dataset_class(task: str) -> type[Dataset]:
    """PretrainDataset (packed text) for "pretrain", DPODataset (preference pairs) for "dpo", PromptDataset (RL
    prompts) for "grpo" and "ppo", SFTDataset (assistant-only loss) for "sft" and "lora"."""
    if task == "pretrain":
        from dataset.pretrain_dataset import PretrainDataset
        return PretrainDataset
    if task == "dpo":
        from dataset.dpo_dataset import DPODataset
        return DPODataset
    if task in ROLLOUT_TASKS:
        from dataset.prompt_dataset import PromptDataset
        return PromptDataset
    from dataset.sft_dataset import SFTDataset
    return SFTDataset


def default_split_names(task: str, sft_data: str | None = None) -> SplitNames:
    """The names of a task's embedded (train, val) files (dataset/split_names.py): `sft_data` "chat" is the SFT
    conversations, "tools" or None the same with the tool-use dialogues (eval/evaluate.py names a run's validation
    split so)."""
    if task == "sft":
        return SFT if sft_data == "chat" else SFT_TOOLS
    return {"pretrain": PRETRAIN, "lora": LORA, "dpo": DPO, **dict.fromkeys(ROLLOUT_TASKS, GRPO)}[task]


def default_data(task: str, quiet: bool = False, sft_data: str | None = None) -> tuple[Path, Path]:
    """(train, val) files of a task's embedded default data (default_split_names), built on first use: the default
    corpus for pretraining and SFT, the LoRA and DPO sets derived from it, and (GRPO, PPO) the arithmetic word
    problems with their held-out problems (dataset/post_training_data.py)."""
    if task in ("pretrain", "sft"):
        from dataset.corpus import ensure_default_corpus
        paths = ensure_default_corpus(quiet=quiet)
    else:
        from dataset.post_training_data import ensure_post_training_data
        paths = ensure_post_training_data()
    train, val = default_split_names(task, sft_data)
    return getattr(paths, train), getattr(paths, val)


def _split_off_validation(dataset: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """Hold out whole documents: packed pretraining rows span documents, so they are split before packing; an
    SFT sample is one conversation, so its samples are split."""
    if hasattr(dataset, "split_documents"):
        return dataset.split_documents(fraction, seed)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    num_val = max(1, round(len(order) * fraction))
    if num_val >= len(order):
        raise ValueError(f"the training data has only {len(order)} samples: too few to hold out a validation "
                         f"split; give --val_data_path")
    return Subset(dataset, sorted(order[num_val:])), Subset(dataset, sorted(order[:num_val]))


def build_run_data(args: TrainArgs, tokenizer: PreTrainedTokenizerBase, quiet: bool = False) -> RunData:
    """Train/val datasets and loaders for `args.task`. With no --data_path the embedded default corpus is built
    on first use (a no-op afterwards) and its held-out split is the validation set."""
    dataset_type = dataset_class(data_task(args))

    if data_task(args) in ROLLOUT_TASKS:  # a row the --reward functions cannot read is a bad line
        from trainer.rewards import column_problems
        options = {"open_thinking": args.open_thinking, "column_check": partial(column_problems, args.reward or []),
                   "tools": rollout_tools(args)}
    elif data_task(args) == "pretrain":
        options = {"control_tokens": args.control_tokens_in_text}
    elif args.task == "distill":  # every step sampling its answers learns none of the data's: an empty one (a
        # prompt-only row, MiniMind's rlaif.jsonl) is the prompt a completion answers, not a bad line
        from trainer.distillation import CompletionSettings
        options = {"empty_answers": CompletionSettings(args.lmbda, args.seq_kd).always_samples}
    else:
        options = {}

    def load(path: Path) -> Dataset:
        return dataset_type(path, tokenizer, args.max_seq_len, num_proc=args.num_proc,
                            skip_bad_lines=args.skip_bad_lines, **options)

    if args.data_path is None:
        # Distillation's SFT data stays the conversations: its student is the plain pretrained model.
        sft_data = flags_in_effect(args.to_dict())["sft_data"] if args.task == "sft" else "chat"
        train_path, val_path = default_data(data_task(args), quiet, sft_data)
        if args.val_data_path is not None:
            val_path = resolve_input_path(args.val_data_path)
    else:
        train_path = resolve_input_path(args.data_path)
        val_path = resolve_input_path(args.val_data_path) if args.val_data_path else None
    train = load(train_path)
    if val_path is not None:
        val, description = load(val_path), f"train {train_path}, val {val_path}"
    else:
        train, val = _split_off_validation(train, args.val_fraction, args.seed)
        description = f"train {train_path} (val: {args.val_fraction:.0%} held out)"
    if len(train) < args.batch_size:
        raise ValueError(f"{train_path}: {len(train)} training samples, fewer than --batch_size={args.batch_size}")
    base = train.dataset if isinstance(train, Subset) else train
    collate = getattr(base, "collate", None)
    sampler = EpochShuffleSampler(len(train), args.seed)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                              drop_last=True, generator=_own_generator(args.seed))
    val_loader = DataLoader(val, batch_size=args.batch_size, shuffle=False, collate_fn=collate,
                            generator=_own_generator(args.seed))
    return RunData(train, val, collate, sampler, train_loader, val_loader, description, train_path,
                   val_path or train_path)


def _own_generator(seed: int) -> torch.Generator:
    # A DataLoader draws its workers' base seed when an iterator is created: from this generator, not the global
    # one. Otherwise a resumed run, which creates its iterator after restoring the global RNG state, would shift
    # every dropout mask after it by one draw.
    return torch.Generator().manual_seed(seed)


def data_identity(data: RunData) -> dict:
    """What a checkpoint remembers of its training data, to refuse a resume on other data: the file, the number of
    training samples and tokens, and a digest of a few samples' token ids (the path may differ; the rest may not)."""
    train = data.train
    count = len(train)
    digest = hashlib.sha256()
    for index in sorted({round(i * (count - 1) / 7) for i in range(8)}):
        sample = train[index]
        for key in sorted(k for k in sample if k.endswith("input_ids")):  # a preference pair's two sides
            digest.update(sample[key].numpy().tobytes())
    return {"path": str(data.train_path), "train_samples": count, "tokens": dataset_stats(train).get("tokens"),
            "digest": digest.hexdigest()[:16]}


def dataset_stats(dataset: Dataset) -> dict:
    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    return dict(getattr(base, "stats", {}))


def supervision_cut_note(stats: dict, max_seq_len: int) -> str | None:
    """The line a run prints when --max_seq_len cut supervised tokens off the samples it kept (an SFT reply that
    loses its end is never learnt to its end, nor to stop there); None when nothing supervised was cut."""
    cut = stats.get("supervised_tokens_cut", 0)
    if not cut:
        return None
    given = stats["supervised_tokens"] + cut
    return (f"note: --max_seq_len {max_seq_len} cuts the supervised end off {stats['supervision_cut']:,} of "
            f"{stats['samples']:,} samples ({cut:,} of their {given:,} supervised tokens, {cut / given:.1%}); a "
            "larger --max_seq_len keeps them")


def control_text_note(stats: dict) -> str | None:
    """The line a run prints when training documents hold the tokenizer's control-token strings read as text (a
    MiniMind pretrain_hq.jsonl given without --control_tokens_in_text trains its turn marks as characters); None
    when none does."""
    held = stats.get("control_token_text", 0)
    if not held:
        return None
    return (f"note: {held:,} of {stats['documents']:,} training documents hold control-token strings (<|im_start|>, "
            f"<|im_end|>, ...), read as text; --control_tokens_in_text true reads them as the tokens, for files "
            f"written that way (MiniMind's pretrain_hq.jsonl)")


class _PaddedWithoutTargets(Dataset):
    """`dataset` followed by `extra` copies of its first sample whose labels (every "labels" field: a preference
    pair has two) are all -100, or, for a sample without labels (an RL prompt), marked `padding`: they add forward
    passes but no target, so they change no loss, token, byte or prompt count."""

    def __init__(self, dataset: Dataset, extra: int) -> None:
        self.dataset, self.extra = dataset, extra

    def __len__(self) -> int:
        return len(self.dataset) + self.extra

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < len(self.dataset):
            return self.dataset[index]
        sample = dict(self.dataset[0])
        labelled = [key for key in sample if key.endswith("labels")]
        for key in labelled:
            sample[key] = torch.full_like(sample[key], -100)
        if not labelled:  # a prompt (GRPO, PPO): its validation skips what is marked
            sample["padding"] = True
        return sample


def shard_loader(loader: DataLoader, rank: int, world: int) -> DataLoader:
    """This process's share (every world-th sample) of an unshuffled loader. The shards are padded to equal
    length with target-free samples, so every process runs the same number of batches (under FSDP each forward
    pass is a collective) and no real sample is counted twice."""
    if world == 1:
        return loader
    padded = _PaddedWithoutTargets(loader.dataset, -len(loader.dataset) % world)
    shard = Subset(padded, range(rank, len(padded), world))
    return DataLoader(shard, batch_size=loader.batch_size, shuffle=False, collate_fn=loader.collate_fn,
                      generator=loader.generator)
