"""How the trainer meets Accelerate's process setups: one process, DDP, FSDP2 and DeepSpeed, on CPUs or GPUs.

The one owner of the facts that differ between them: how the Accelerator is built (FSDP2 on CPU processes too),
whether the weights are sharded (then validation, the final save and the sample must involve every process), how
to get the whole model back in one place, whether the update is applied inside `backward` (DeepSpeed), how long a
collective waits for a process that is gone, what the main process prepares first (its refusal raised on every
process), and how a multi-process run ends without an abort at interpreter exit. Plus a free local port, for a
launch's rendezvous (or a local server).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, InitProcessGroupKwargs, broadcast_object_list

T = TypeVar("T")

MIXED_PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "no"}
# The run's process group, held until shutdown(); see there.
_process_group: list[object] = []


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one listens on now. Other jobs on the machine may run their own launches: a
    fixed port (Accelerate's default 29500) could join them into our process group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fsdp_requested() -> bool:
    # `accelerate launch` with an FSDP config sets this in every process it starts.
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def make_accelerator(dtype: str, accumulation_steps: int, use_wandb: bool, timeout_s: int) -> Accelerator:
    """The run's Accelerator. On a machine without CUDA the processes join over gloo (cpu=True): otherwise several
    launched CPU processes would each run an independent job instead of one data-parallel job. A collective waits
    at most `timeout_s` seconds for the other processes (`set_collective_timeout` changes it later).

    Accelerate 1.15 turns an FSDP config into FSDP only for accelerator devices, and so would run an FSDP config
    on CPU processes as plain DDP. torch's `fully_shard` (FSDP2) itself runs on CPU tensors over gloo, so the
    process group is declared a multi-device one before the Accelerator reads it: the CPU processes then take
    exactly the FSDP2 code path (sharding, sharded checkpoints, full-state gathering) that GPUs take."""
    if dtype == "float16" and not torch.cuda.is_available():
        raise ValueError("--dtype float16 needs a CUDA device; use --dtype bfloat16 (or float32) on CPU")
    cpu = not torch.cuda.is_available()
    timeout = timedelta(seconds=timeout_s)
    if cpu and _fsdp_requested():
        state = PartialState(cpu=True, timeout=timeout)
        if state.distributed_type == DistributedType.MULTI_CPU:
            PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    accelerator = Accelerator(cpu=cpu, mixed_precision=MIXED_PRECISION[dtype],
                              gradient_accumulation_steps=accumulation_steps,
                              step_scheduler_with_optimizer=False,  # the trainer steps it once per optimizer step
                              kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)],
                              log_with="wandb" if use_wandb else None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        _process_group[:] = [torch.distributed.group.WORLD]
    return accelerator


def main_process_first(accelerator: Accelerator, build: Callable[[], T]) -> T:
    """`build()` on the main process, then on the others (which read what it prepared: the tokenized data's cache),
    as Accelerate's main_process_first; but a refusal of the main process's (ValueError, FileNotFoundError: bad
    input, the run's one line) is raised on every process, in the same words. Left in main_process_first's barrier,
    the others met a lost peer instead when the main process ended: a gloo traceback (exit 1) beside its line."""
    if accelerator.num_processes == 1:
        return build()
    refusal = None
    if accelerator.is_main_process:
        try:
            built = build()
        except (ValueError, FileNotFoundError) as error:
            refusal = error
    words = broadcast_object_list([None if refusal is None else str(refusal)])[0]  # the barrier, and its news
    if refusal is not None:
        raise refusal
    if words is not None:
        raise ValueError(words)
    return built if accelerator.is_main_process else build()


def set_collective_timeout(timeout_s: int) -> None:
    """From now on a collective (gloo or NCCL) that waits more than `timeout_s` seconds for another process fails
    the job instead of hanging: a node that died or dropped off the network ends the run in bounded time. Set-up
    gets a longer timeout than training, as torchtitan does: the main process prepares the data alone while the
    others wait, and the first step compiles."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # torch has no public setter yet; this one is what init_process_group(timeout=...) sets.
        torch.distributed.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))


def weights_are_sharded(accelerator: Accelerator) -> bool:
    """True when no process holds the whole model (FSDP, DeepSpeed ZeRO-3): every forward pass is then a
    collective that all processes must make together."""
    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.state.deepspeed_plugin.zero_stage == 3
    return False


def state_is_sharded(accelerator: Accelerator) -> bool:
    """True when each process writes only its own part of the model or optimizer state to a checkpoint (FSDP,
    DeepSpeed ZeRO): a whole checkpoint then exists only where every process's part lands, on shared storage."""
    return accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)


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


def materialize_meta_parameters(model: torch.nn.Module) -> None:
    """Give every parameter still on the meta device storage of its own (zeros).

    Under FSDP's memory-efficient loading transformers leaves, on every process but the first, the weights a
    checkpoint lacks (the new ones of a switch the run turns on) on the meta device, uninitialised; Accelerate's
    FSDP2 preparation then broadcasts the first process's values, but finds each optimizer parameter's shard by its
    data pointer, which is 0 for every meta tensor: all of them were updated through one shard (SFT adding smeared
    keys trained layer 0's key weights on the second process through layer 1's)."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                setattr(module, name, torch.nn.Parameter(torch.zeros_like(param, device="cpu"),
                                                         requires_grad=param.requires_grad))


def full_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective (every process calls it): the whole model's weights, complete on the main process (other
    processes may get an empty dict under FSDP)."""
    return accelerator.get_state_dict(model)


def collective_timed_out(error: BaseException) -> bool:
    """Whether an error is a collective giving up on the other processes after its timeout. gloo raises a plain
    RuntimeError for it ("Timed out waiting 5000ms for recv operation"); NCCL's watchdog ends the process itself."""
    return isinstance(error, RuntimeError) and "Timed out" in str(error)


def shutdown() -> None:
    """End the process group explicitly (no barrier: after an error the other processes may be gone). Left to
    interpreter exit, gloo's threads still running make the C++ runtime abort ("terminate called without an
    active exception") after the work is done.

    Called once the trainer is gone. Its DDP reducer holds the process group too, and the reducer's destructor
    keeps the GIL: were it the last holder (Accelerate's end_training destroys the group before the trainer goes),
    gloo's destructor would wait, GIL held, for a worker thread that needs the GIL to free the last collective's
    tensors, and the process would hang after training (seen on a loaded machine, 1 run in ~15). The reference
    held here is dropped last, through the Python object, whose destructor releases the GIL first."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _process_group.clear()
