"""A run's optimizer and learning-rate schedule as its flags ask for them: the trainer's flags (TrainArgs) mapped
onto trainer/optim.py's build_optimizer and trainer/schedule.py's build_scheduler. Its own module, not theirs:
trainer/arg_fields.py imports those two modules for the flags' choices (OptimizerName, LRSchedule), so neither can
import TrainArgs back without an import cycle; nor core.py's, so that the tools that build the trainer's optimizer
(eval/benchmarks/bench_train.py, the norm lab) need not import the training core."""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.arg_fields import TrainArgs
from trainer.optim import build_optimizer
from trainer.schedule import build_scheduler


def make_optimizer(model: torch.nn.Module, args: TrainArgs, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer the flags ask for (trainer/optim.py builds it). An fp32 run on a CPU orthogonalizes Muon's
    updates in fp32: `--dtype auto` picks fp32 exactly where the CPU's bf16 products are emulated."""
    return build_optimizer(model, args.learning_rate, args.weight_decay, args.optimizer, muon_lr=args.muon_lr,
                           muon_weight_decay=args.muon_weight_decay, muon_momentum=args.muon_momentum,
                           muon_adjust_lr=args.muon_adjust_lr,
                           orthogonalize_in_fp32=device.type == "cpu" and args.dtype == "float32")


def make_scheduler(optimizer: torch.optim.Optimizer, args: TrainArgs,
                   total_steps: int | Callable[[], int]) -> torch.optim.lr_scheduler.LRScheduler:
    """The flags' schedule over `total_steps` optimizer steps (trainer/schedule.py)."""
    return build_scheduler(optimizer, args.warmup_steps, total_steps, args.min_lr_ratio, args.lr_schedule,
                           args.decay_fraction)
