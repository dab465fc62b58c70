"""trainer/checkpoint.py's digests under two real processes (gloo on CPU; each runs tests/checkpoint_worker.py): the
writer records every file's size and sha256 once every process has written its part, and a resume checks them
before it loads anything. Both layouts of --out_dir: one directory both processes see (torchrun --nproc_per_node 2:
the main process writes trainer_state.json and hashes every process's files), and one directory per machine (two
single-process nodes of torchrun --nnodes 2 on loopback: each node's process writes and hashes its own copy, its own
RNG state in it). Process 1 writes its part late, so a writer that hashed before every part was in place would
record an incomplete copy. One launch per layout: the worker saves, resumes, damages the checkpoint and resumes again
(a launch of two processes costs more than everything they check)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.paths import REPO
from tests.training_runs import launcher, node_launcher
from trainer.distributed import free_port

WORKER = str(REPO / "tests" / "checkpoint_worker.py")
LIMIT_S = 120  # `timeout` for each launch: a hang fails the test instead of the suite
NOT_THE_SAVED_FILE = "has another sha256 than trainer_state.json records: not the file this checkpoint saved"


def run_workers(layout: str, out_dir: Path, logs: Path) -> list[dict]:
    """Both processes of one launch; each one's result file, by rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "GLOO_SOCKET_IFNAME": "lo"}
    if layout == "shared":
        commands = [[*launcher("torchrun"), WORKER, "--out_dir", str(out_dir)]]
    else:
        port = free_port()
        commands = [[*node_launcher("torchrun", node, "127.0.0.1", port), WORKER, "--out_dir",
                     str(out_dir / f"node{node}")] for node in (0, 1)]
    logs.mkdir(parents=True, exist_ok=True)
    processes = []
    for index, command in enumerate(commands):
        with open(logs / f"{index}.out", "w") as out, open(logs / f"{index}.err", "w") as err:
            processes.append(subprocess.Popen(["timeout", "-k", "10", str(LIMIT_S), *command], stdout=out,
                                              stderr=err, env=env, cwd=logs))
    for process in processes:
        process.wait(timeout=LIMIT_S + 30)
    # Each launcher's exit code and the end of its stderr: one node's failure shows in its own log, and the other
    # node's launcher then reports only that its peer went away.
    report = "\n".join(f"launcher {index} exited {process.returncode}; its stderr ends:\n"
                       f"{(logs / f'{index}.err').read_text()[-3000:]}" for index, process in enumerate(processes))
    results = [json.loads(path.read_text()) for path in sorted(logs.glob("result_*.json"))]
    assert sorted(result["rank"] for result in results) == [0, 1], report
    assert all(process.returncode == 0 for process in processes), report
    return sorted(results, key=lambda result: result["rank"])


def copies(layout: str, out_dir: Path) -> list[Path]:
    """The checkpoint's copies: one both processes read, or one per machine (node i's holds rank i's RNG state)."""
    root = [out_dir] if layout == "shared" else [out_dir / "node0", out_dir / "node1"]
    return [folder / "checkpoints" / "step_00000001" for folder in root]


def hashed_here(checkpoint: Path) -> dict[str, dict]:
    """Every file of the copy but trainer_state.json, hashed by the test with hashlib."""
    return {path.relative_to(checkpoint).as_posix(): {"bytes": len(path.read_bytes()),
                                                      "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
            for path in sorted(checkpoint.rglob("*")) if path.is_file() and path.name != "trainer_state.json"}


@pytest.mark.parametrize("layout", ["shared", "per_machine"])
def test_each_writer_records_its_whole_copy_and_a_resume_verifies_it(layout, tmp_path):
    out_dir = tmp_path / "out"
    results = run_workers(layout, out_dir, tmp_path / "logs")
    checkpoints = copies(layout, out_dir)
    # Resumed, verified (an unverified checkpoint resumes with a note saying so). Then process 1 changed one byte of
    # rank 1's RNG state, its size kept: the writer that holds it names it, on both processes.
    damaged = checkpoints[-1] / "random_states_1.pkl"
    writer = 0 if layout == "shared" else 1
    error = (f"--resume auto: rank {writer}: {damaged} {NOT_THE_SAVED_FILE} (replaced, truncated or damaged since); "
             f"there is no earlier checkpoint to resume from: start the run anew (--overwrite)")
    assert results == [{"rank": rank, "shared": layout == "shared", "resumed": str(checkpoints[min(rank, len(
        checkpoints) - 1)]), "note": "", "damaged": {"error": error}} for rank in (0, 1)]

    # The copies as saved (the damaged byte changed back here) are what the writers recorded.
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 1
    damaged.write_bytes(bytes(data))
    rng_states = [{"random_states_0.pkl", "random_states_1.pkl"}] if layout == "shared" else [
        {"random_states_0.pkl"}, {"random_states_1.pkl"}]
    for checkpoint, own in zip(checkpoints, rng_states):
        files = hashed_here(checkpoint)
        assert {"model.safetensors", "optimizer.bin"} | own == set(files)
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        assert state["digests"] == files
