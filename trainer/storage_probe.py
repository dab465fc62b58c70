"""Where a run's checkpoints live: one --out_dir every process sees (shared storage: the main process writes each
checkpoint), or one per machine (each machine's first process writes a whole copy there). `probe_storage` finds out
which at start-up; trainer/checkpoint.py saves and resumes accordingly."""

from __future__ import annotations

import uuid
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

STORAGE_HELP = "see docs/training.md, 'Several machines'"  # where a message about --out_dir's storage points


def probe_storage(accelerator: Accelerator, out_dir: Path, node_local_allowed: bool) -> bool:
    """Collective. True when every process sees the same `out_dir` (shared storage), False when each machine has
    its own (then each machine's local main process writes a whole checkpoint there). Every process writes a file
    named by a token the main process chose and reports whose files it sees. Raises ValueError when neither holds
    or when a machine-local directory cannot hold a whole checkpoint (`node_local_allowed` False: sharded weights
    or optimizer state, whose parts only the process that holds them writes)."""
    if accelerator.num_processes == 1:
        return True
    token = broadcast_object_list([uuid.uuid4().hex if accelerator.is_main_process else None])[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    world, rank = accelerator.num_processes, accelerator.process_index
    probe = out_dir / f".storage_probe_{token}_{rank}"
    probe.write_text(str(rank))
    accelerator.wait_for_everyone()
    seen = [other for other in range(world) if (out_dir / f".storage_probe_{token}_{other}").is_file()]
    views = gather_object([(seen, accelerator.local_process_index, str(out_dir))])
    accelerator.wait_for_everyone()
    probe.unlink()
    return storage_is_shared(views, node_local_allowed)


def storage_is_shared(views: list[tuple[list[int], int, str]], node_local_allowed: bool) -> bool:
    """The probe's verdict from every process's (ranks whose files it sees, its local rank, its out_dir)."""
    world = len(views)
    if all(len(seen) == world for seen, _, _ in views):
        return True
    for rank, (seen, _, out_dir) in enumerate(views):
        writers = [other for other in seen if views[other][1] == 0]
        if rank not in seen or any(views[other][0] != seen for other in seen) or len(writers) != 1:
            raise ValueError(f"--out_dir {out_dir}: rank {rank} sees the files of ranks {seen} of {world} there; "
                             f"checkpoints need one directory that every process sees, or one per machine that "
                             f"all of that machine's processes see ({STORAGE_HELP})")
    if not node_local_allowed:
        rank = next(rank for rank, (seen, _, _) in enumerate(views) if 0 not in seen)
        raise ValueError(f"--out_dir {views[rank][2]}: rank {rank} does not see rank 0's files there, and sharded "
                         f"checkpoints (FSDP, DeepSpeed) need an --out_dir on storage shared by every machine "
                         f"({STORAGE_HELP})")
    return False
