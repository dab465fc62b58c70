"""How the trainer meets Accelerate's process setups: one process, DDP, FSDP2 and DeepSpeed, on CPUs or GPUs.

The one owner of the facts that differ between them: how the Accelerator is built (FSDP2 on CPU processes too),
whether the weights are sharded (then validation, the final save and the sample must involve every process), how
to get the whole model back in one place, whether the update is applied inside `backward` (DeepSpeed), and how a
multi-process run ends without an abort at interpreter exit.
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType

MIXED_PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "no"}


def _fsdp_requested() -> bool:
    # `accelerate launch` with an FSDP config sets this in every process it starts.
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def make_accelerator(dtype: str, accumulation_steps: int, use_wandb: bool) -> Accelerator:
    """The run's Accelerator. On a machine without CUDA the processes join over gloo (cpu=True): otherwise several
    launched CPU processes would each run an independent job instead of one data-parallel job.

    Accelerate 1.15 turns an FSDP config into FSDP only for accelerator devices, and so would run an FSDP config
    on CPU processes as plain DDP. torch's `fully_shard` (FSDP2) itself runs on CPU tensors over gloo, so the
    process group is declared a multi-device one before the Accelerator reads it: the CPU processes then take
    exactly the FSDP2 code path (sharding, sharded checkpoints, full-state gathering) that GPUs take."""
    if dtype == "float16" and not torch.cuda.is_available():
        raise ValueError("--dtype float16 needs a CUDA device; use --dtype bfloat16 (or float32) on CPU")
    cpu = not torch.cuda.is_available()
    if cpu and _fsdp_requested():
        state = PartialState(cpu=True)
        if state.distributed_type == DistributedType.MULTI_CPU:
            PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    return Accelerator(cpu=cpu, mixed_precision=MIXED_PRECISION[dtype],
                       gradient_accumulation_steps=accumulation_steps,
                       step_scheduler_with_optimizer=False,  # the trainer steps it once per optimizer step
                       log_with="wandb" if use_wandb else None)


def weights_are_sharded(accelerator: Accelerator) -> bool:
    """True when no process holds the whole model (FSDP, DeepSpeed ZeRO-3): every forward pass is then a
    collective that all processes must make together."""
    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.state.deepspeed_plugin.zero_stage == 3
    return False


def update_inside_backward(accelerator: Accelerator) -> bool:
    """DeepSpeed's engine applies the optimizer update inside `backward` of the last micro-batch, before the
    trainer sees the gradient norm: a non-finite gradient cannot be stopped before it is applied."""
    return accelerator.distributed_type == DistributedType.DEEPSPEED


def check_optimizer_supported(accelerator: Accelerator, optimizer: str) -> None:
    """Refuse, in one line, an optimizer the process setup cannot run. Muon orthogonalizes each 2-D weight
    matrix's update as a whole; DeepSpeed's ZeRO optimizer wrapper flattens the parameters into 1-D partitions."""
    if optimizer == "muon" and accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise ValueError("--optimizer muon does not run under DeepSpeed: ZeRO flattens the parameters into 1-D "
                         "partitions and Muon needs each weight matrix whole; use DDP or FSDP2, or --optimizer adamw")


def full_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective (every process calls it): the whole model's weights, complete on the main process (other
    processes may get an empty dict under FSDP)."""
    return accelerator.get_state_dict(model)


def shutdown() -> None:
    """End the process group explicitly (no barrier: after an error the other processes may be gone). Left to
    interpreter exit, gloo's threads still running make the C++ runtime abort ("terminate called without an
    active exception") after the work is done."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
