"""Two machines, for real: two Linux network namespaces joined by a veth pair, which the test creates (as root, with
addresses of its own, traffic only between them) and removes afterwards, each run one node of a 2-node job started
the README's ways (torchrun --nnodes 2; accelerate launch with multi_node_cpu.yaml), one CPU process per node over
gloo. Checked: one data-parallel job whose final weights equal one process on the same global batch (fp32
tolerance); --resume auto is exact with one shared --out_dir and with one --out_dir per node; a node missing its
part of the checkpoint makes every node refuse in one line naming the rank and the path; a node that drops off the
network ends the job after --dist_timeout instead of hanging. Without root (no namespaces) the two nodes run on
loopback instead, and the test says so in its output. Every command runs under `timeout -k`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.training_runs import REPO, assert_same_model, node_launcher, pretrain_argv, train_losses
from trainer.storage_probe import storage_is_shared
from trainer.distributed import free_port
from trainer.run_dir import EXIT_ERROR, EXIT_PEER_LOST

# A /30 of our own: it exists only inside the two namespaces (each has its own routing table), so it cannot meet
# the host's networks or another run's namespaces.
ADDRESSES = ("10.213.7.1", "10.213.7.2")
JOB_LIMIT_S = 240  # `timeout` for each node's command: a hang fails the test instead of the suite


@dataclass(frozen=True)
class TwoNodes:
    how: str                                   # "network namespaces" or "loopback"
    master_addr: str                           # node 0's address
    interfaces: tuple[str, str]                # each node's GLOO_SOCKET_IFNAME
    namespaces: tuple[str, str] | None = None

    def command(self, node: int, argv: list[str]) -> list[str]:
        inside = ["ip", "netns", "exec", self.namespaces[node]] if self.namespaces else []
        return ["timeout", "-k", "10", str(JOB_LIMIT_S), *inside, *argv]

    def cut(self, node: int, job: list[subprocess.Popen]) -> None:
        """The node drops off the network: its link goes down (namespaces), or it freezes (loopback): either way
        its connections stay open and silent, as when a machine loses power or its network."""
        if self.namespaces:
            _ip("-n", self.namespaces[node], "link", "set", self.interfaces[node], "down")
        else:
            for process in _tree(job[node]):
                process.send_signal(signal.SIGSTOP)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _create_namespaces(tag: str) -> TwoNodes:
    namespaces, links = (f"mn{tag}a", f"mn{tag}b"), (f"mn{tag}va", f"mn{tag}vb")
    for namespace in namespaces:
        _ip("netns", "add", namespace)
        _ip("-n", namespace, "link", "set", "lo", "up")
    _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
    for namespace, link, address in zip(namespaces, links, ADDRESSES):
        _ip("link", "set", link, "netns", namespace)
        _ip("-n", namespace, "addr", "add", f"{address}/30", "dev", link)
        _ip("-n", namespace, "link", "set", link, "up")
    return TwoNodes("network namespaces", ADDRESSES[0], links, namespaces)


def _remove_namespaces(tag: str) -> None:
    """Whatever of ours exists: processes left inside our namespaces, the namespaces (their veth ends go with
    them), a veth pair never moved into them."""
    for namespace in (f"mn{tag}a", f"mn{tag}b"):
        pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
    subprocess.run(["ip", "link", "del", f"mn{tag}va"], capture_output=True)


@pytest.fixture(scope="module")
def two_nodes():
    tag = str(os.getpid())
    try:
        try:
            if os.geteuid() != 0:
                raise PermissionError("not root")
            nodes = _create_namespaces(tag)
        except (OSError, subprocess.SubprocessError) as error:
            reason = error.stderr.strip() if getattr(error, "stderr", None) else str(error)
            nodes = TwoNodes("loopback", "127.0.0.1", ("lo", "lo"))
            message = (f"multi-node tests: no network namespaces ({reason}); the two nodes run on loopback "
                       f"(127.0.0.1) instead")
            print(message, file=sys.stderr)
            warnings.warn(message, stacklevel=1)
        yield nodes
    finally:
        _remove_namespaces(tag)


def _tree(process: subprocess.Popen) -> list[psutil.Process]:
    try:
        root = psutil.Process(process.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@dataclass
class NodeResult:
    returncode: int
    stdout: str
    stderr: str


class Job:
    """Both nodes of one launch, each under `timeout -k`, their output in files; leaving the block kills whatever
    of the job still runs (the workers run in sessions of their own, so the whole process tree is collected)."""

    def __init__(self, nodes: TwoNodes, launcher: str, argvs: tuple[list[str], list[str]], logs: Path) -> None:
        port = free_port()
        script = str(REPO / "trainer" / "train_pretrain.py")
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.processes = []
        for node in (0, 1):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
                   "GLOO_SOCKET_IFNAME": nodes.interfaces[node]}
            command = nodes.command(node, [*node_launcher(launcher, node, nodes.master_addr, port), script,
                                           *argvs[node]])
            with open(logs / f"node{node}.out", "w") as out, open(logs / f"node{node}.err", "w") as err:
                self.processes.append(subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=logs))

    def __enter__(self) -> "Job":
        return self

    def wait(self, node: int) -> NodeResult:
        returncode = self.processes[node].wait(timeout=JOB_LIMIT_S + 30)
        return NodeResult(returncode, (self.logs / f"node{node}.out").read_text(),
                          (self.logs / f"node{node}.err").read_text())

    def finish(self) -> tuple[NodeResult, NodeResult]:
        return self.wait(0), self.wait(1)

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            for member in _tree(process):
                try:
                    member.kill()
                except psutil.NoSuchProcess:
                    pass
            process.wait(timeout=30)


def run_job(nodes: TwoNodes, launcher: str, argvs: tuple[list[str], list[str]], logs: Path
            ) -> tuple[NodeResult, NodeResult]:
    with Job(nodes, launcher, argvs, logs) as job:
        return job.finish()


def assert_one_job_over_two_nodes(results: tuple[NodeResult, NodeResult]) -> None:
    for node, result in enumerate(results):
        assert result.returncode == 0, f"node {node}: {result.stderr[-4000:]}"
        assert "terminate called" not in result.stderr
    # Node 0's main process announces one data-parallel job over both nodes (not two independent jobs).
    assert results[0].stdout.count("MiniNorm ") == 1 and "x2, float32, MULTI_CPU" in results[0].stdout
    assert "MiniNorm " not in results[1].stdout


def stop_after_its_last_checkpoint(out_dir: Path) -> None:
    """The run as if it had been stopped after its last checkpoint: its final files gone (a finished run asked
    again with --resume auto is left as it is)."""
    for name in ("run_summary.json", "model.safetensors", "config.json", "generation_config.json"):
        (out_dir / name).unlink(missing_ok=True)


def same_bits(first: Path, second: Path) -> bool:
    mine, theirs = load_file(first), load_file(second)
    return mine.keys() == theirs.keys() and all(torch.equal(mine[name], theirs[name]) for name in mine)


def test_two_nodes_with_a_shared_out_dir_train_like_one_process_and_resume_exactly(two_nodes, train_data,
                                                                                    reference_run, tmp_path):
    """torchrun trains 8 steps (checkpoints at 3 and 6) in one --out_dir both nodes see; accelerate with
    multi_node_cpu.yaml resumes it at step 6 and ends on the same weights, bit for bit."""
    print(f"nodes: {two_nodes.how}")
    out_dir = tmp_path / "shared"
    argv = pretrain_argv(train_data, out_dir, "--batch_size", "2")
    results = run_job(two_nodes, "torchrun", (argv, argv), tmp_path / "train")
    assert_one_job_over_two_nodes(results)
    assert train_losses(out_dir) == pytest.approx(train_losses(reference_run), rel=1e-5)
    assert_same_model(out_dir, reference_run)
    checkpoint = out_dir / "checkpoints" / "step_00000006"
    assert (checkpoint / "random_states_0.pkl").is_file() and (checkpoint / "random_states_1.pkl").is_file()
    shutil.copy(out_dir / "model.safetensors", tmp_path / "first.safetensors")
    first_losses = train_losses(out_dir)
    stop_after_its_last_checkpoint(out_dir)

    resumed = run_job(two_nodes, "accelerate", (argv + ["--resume", "auto"],) * 2, tmp_path / "resume")
    assert_one_job_over_two_nodes(resumed)
    assert f"resumed from {checkpoint} at optimizer step 6" in resumed[0].stdout
    assert train_losses(out_dir) == first_losses
    assert same_bits(out_dir / "model.safetensors", tmp_path / "first.safetensors")


def test_two_nodes_with_an_out_dir_each_resume_exactly_or_refuse_in_one_line(two_nodes, train_data, reference_run,
                                                                             tmp_path):
    """No shared storage: each node's first process keeps a whole checkpoint in its own --out_dir. A node missing
    its RNG state stops the job on every node in one line naming rank 1 and the path (before: rank 1 silently
    started from its seed, or from step 0); a node missing the newest checkpoint makes both resume the newest one
    both hold, and the result is exact."""
    print(f"nodes: {two_nodes.how}")
    out_dirs = (tmp_path / "node0", tmp_path / "node1")
    argvs = tuple(pretrain_argv(train_data, out_dir, "--batch_size", "2") for out_dir in out_dirs)
    results = run_job(two_nodes, "accelerate", argvs, tmp_path / "train")
    assert_one_job_over_two_nodes(results)
    assert_same_model(out_dirs[0], reference_run)
    first_losses = train_losses(out_dirs[0])
    for node, out_dir in enumerate(out_dirs):
        names = sorted(p.name for p in (out_dir / "checkpoints").iterdir())
        assert names == ["step_00000003", "step_00000006"]  # complete, renamed, no .tmp_ left behind
        for name in names:
            files = {p.name for p in (out_dir / "checkpoints" / name).iterdir()}
            assert {"model.safetensors", "optimizer.bin", "trainer_state.json", f"random_states_{node}.pkl"} <= files
    (tmp_path / "first.safetensors").write_bytes((out_dirs[0] / "model.safetensors").read_bytes())
    stop_after_its_last_checkpoint(out_dirs[0])

    missing = out_dirs[1] / "checkpoints" / "step_00000006" / "random_states_1.pkl"
    missing.unlink()
    refused = run_job(two_nodes, "torchrun", tuple(argv + ["--resume", "auto"] for argv in argvs),
                      tmp_path / "refused")
    line = f"error: --resume auto: rank 1 cannot read {missing};"
    for node, result in enumerate(refused):
        assert result.returncode != 0, f"node {node} did not refuse"
        errors = [text for text in result.stderr.splitlines() if text.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(line), result.stderr[-3000:]
        assert f"exitcode  : {EXIT_ERROR}" in result.stderr  # the worker's own exit code, in torchrun's report
    assert "resumed from" not in refused[0].stdout + refused[1].stdout
    assert not (out_dirs[0] / "model.safetensors").exists()  # nothing trained, nothing written

    shutil.rmtree(missing.parent)  # node 1 lost its newest checkpoint altogether
    resumed = run_job(two_nodes, "torchrun", tuple(argv + ["--resume", "auto"] for argv in argvs),
                      tmp_path / "resume")
    assert_one_job_over_two_nodes(resumed)
    assert "at optimizer step 3" in resumed[0].stdout and "rank 1 does not hold step_00000006" in resumed[0].stdout
    assert train_losses(out_dirs[0]) == first_losses
    assert same_bits(out_dirs[0] / "model.safetensors", tmp_path / "first.safetensors")


def test_a_node_that_drops_off_the_network_ends_the_job_after_dist_timeout(two_nodes, train_data, tmp_path):
    """Node 1 goes silent mid-training (link down): node 0's next collective gives up after --dist_timeout and the
    job ends with the one-line reason, well inside the `timeout` that would otherwise kill it."""
    print(f"nodes: {two_nodes.how}")
    out_dir = tmp_path / "out"
    argv = pretrain_argv(train_data, out_dir, "--batch_size", "2", "--max_steps", "100000", "--dist_timeout", "3")
    with Job(two_nodes, "torchrun", (argv, argv), tmp_path / "logs") as job:
        deadline = time.monotonic() + JOB_LIMIT_S
        while not ((out_dir / "metrics.jsonl").is_file() and (out_dir / "metrics.jsonl").stat().st_size):
            assert time.monotonic() < deadline and job.processes[0].poll() is None, "training never started"
            time.sleep(0.2)
        two_nodes.cut(1, job.processes)
        result = job.wait(0)
    assert result.returncode not in (0, 124, 137), result.stderr[-3000:]  # failed by itself, not killed by timeout
    reason = [text for text in result.stderr.splitlines() if "error: rank 0 stopped" in text]
    assert len(reason) == 1 and "another process did not answer in time" in reason[0], result.stderr[-3000:]
    assert f"exitcode  : {EXIT_PEER_LOST}" in result.stderr


def test_storage_probe_verdicts():
    """(ranks whose probe files a process sees, its local rank, its out_dir) for each process of 4 on 2 machines."""
    shared = [([0, 1, 2, 3], local, "/nfs/run") for local in (0, 1, 0, 1)]
    per_machine = [([0, 1], 0, "/a"), ([0, 1], 1, "/a"), ([2, 3], 0, "/b"), ([2, 3], 1, "/b")]
    assert storage_is_shared(shared, node_local_allowed=False) is True
    assert storage_is_shared(per_machine, node_local_allowed=True) is False
    with pytest.raises(ValueError, match=r"--out_dir /b: rank 2 does not see rank 0's files there, and sharded"):
        storage_is_shared(per_machine, node_local_allowed=False)
    # Every process on a directory of its own: machine 0's second process would have no one writing its model.
    alone = [([0], 0, "/a"), ([1], 1, "/a1"), ([2, 3], 0, "/b"), ([2, 3], 1, "/b")]
    with pytest.raises(ValueError, match=r"--out_dir /a1: rank 1 sees the files of ranks \[1\] of 4 there"):
        storage_is_shared(alone, node_local_allowed=True)
