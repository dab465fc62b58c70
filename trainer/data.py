"""Datasets and dataloaders for a training run: the default corpus or the user's jsonl, a validation split,
and a deterministic per-epoch shuffle that Accelerate shards across processes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from trainer.args import TrainArgs
from trainer.run_dir import resolve_path


class EpochShuffleSampler(Sampler[int]):
    """A permutation that depends only on (seed, epoch): every process, and a resumed run, sees the same order."""

    def __init__(self, length: int, seed: int) -> None:
        self.length, self.seed, self.epoch = length, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.length, generator=generator).tolist())

    def __len__(self) -> int:
        return self.length


@dataclass
class RunData:
    train: Dataset
    val: Dataset
    collate: Callable | None
    train_sampler: EpochShuffleSampler
    train_loader: DataLoader
    val_loader: DataLoader
    description: str


def dataset_class(task: str) -> type[Dataset]:
    """PretrainDataset (packed text) for "pretrain", SFTDataset (assistant-only loss) otherwise."""
    if task == "pretrain":
        from dataset.pretrain_dataset import PretrainDataset
        return PretrainDataset
    from dataset.sft_dataset import SFTDataset
    return SFTDataset


def _split_off_validation(dataset: Dataset, fraction: float, seed: int) -> tuple[Subset, Subset]:
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    num_val = max(1, round(len(order) * fraction))
    if num_val >= len(order):
        raise ValueError(f"the training data has only {len(order)} samples: too few to hold out a validation "
                         f"split; give --val_data_path")
    return Subset(dataset, sorted(order[num_val:])), Subset(dataset, sorted(order[:num_val]))


def build_run_data(args: TrainArgs, tokenizer, quiet: bool = False) -> RunData:
    """Train/val datasets and loaders for `args.task`. With no --data_path the embedded default corpus is built
    on first use (a no-op afterwards) and its held-out split is the validation set."""
    dataset_type = dataset_class(args.task)

    def load(path: Path) -> Dataset:
        return dataset_type(path, tokenizer, args.max_seq_len, num_proc=args.num_proc,
                            skip_bad_lines=args.skip_bad_lines)

    if args.data_path is None:
        from dataset.corpus import ensure_default_corpus
        paths = ensure_default_corpus(quiet=quiet)
        train_path, val_path = ((paths.pretrain_train, paths.pretrain_val) if args.task == "pretrain"
                                else (paths.sft_train, paths.sft_val))
        if args.val_data_path is not None:
            val_path = resolve_path(args.val_data_path)
    else:
        train_path = resolve_path(args.data_path)
        val_path = resolve_path(args.val_data_path) if args.val_data_path else None
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
                              drop_last=True)
    val_loader = DataLoader(val, batch_size=args.batch_size, shuffle=False, collate_fn=collate)
    return RunData(train, val, collate, sampler, train_loader, val_loader, description)


def dataset_stats(dataset: Dataset) -> dict:
    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    return dict(getattr(base, "stats", {}))


def shard_loader(loader: DataLoader, rank: int, world: int) -> DataLoader:
    """This process's share (every world-th sample) of an unshuffled loader, with no padding samples."""
    if world == 1:
        return loader
    shard = Subset(loader.dataset, range(rank, len(loader.dataset), world))
    return DataLoader(shard, batch_size=loader.batch_size, shuffle=False, collate_fn=loader.collate_fn)
