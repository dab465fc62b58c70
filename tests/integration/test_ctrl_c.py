"""A real SIGINT (Ctrl-C) to the tools' processes: each ends through trainer/cli.py's run_main with one line,
`interrupted`, and exit code 130 (128 + SIGINT, what a shell reports), never a KeyboardInterrupt traceback; a
trainer whose run has finished (its results written) ends with exit code 0 and one line saying so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.paths import REPO
from trainer.run_dir import EXIT_INTERRUPTED


def start_tool(script: str, *args: str, tmp_path: Path) -> subprocess.Popen:
    """`python <script> args` with pipes; SIGINT is back to its default in the child, so Python turns it into
    KeyboardInterrupt even where the test runner's worker ignores the signal (an ignored SIGINT is inherited)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8",
           "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets")}  # the data's Arrow cache stays in tmp_path
    return subprocess.Popen([sys.executable, script, *args], cwd=REPO, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


class StderrReader:
    """Reads a process's stderr on a thread, so the test can wait for a mark that a progress bar writes without a
    newline."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.chunks: list[bytes] = []
        self.thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self.thread.start()

    def _read(self, process: subprocess.Popen) -> None:
        while chunk := os.read(process.stderr.fileno(), 65536):
            self.chunks.append(chunk)

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", errors="replace")

    def wait_for(self, mark: str, process: subprocess.Popen, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while mark not in self.text():
            assert process.poll() is None, f"ended before {mark!r}: {self.text()}"
            assert time.monotonic() < deadline, f"no {mark!r} in {timeout} s: {self.text()}"
            time.sleep(0.05)


def interrupt(process: subprocess.Popen, stderr: StderrReader) -> tuple[bytes, str]:
    """Send SIGINT and let the process end: its stdout and stderr, once its exit code is checked to be
    EXIT_INTERRUPTED with no traceback."""
    process.send_signal(signal.SIGINT)
    out = process.stdout.read()  # not communicate(): the thread reads stderr
    process.wait(timeout=120)
    stderr.thread.join(timeout=30)
    err = stderr.text()
    assert process.returncode == EXIT_INTERRUPTED, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    return out, err


def test_ctrl_c_while_evaluate_works_ends_it_in_one_line(tiny_models, tmp_path) -> None:
    """SIGINT while evaluate.py tokenizes a file that takes it many seconds more to score."""
    text = "The history of the city begins with a small fishing village on the river. " * 4
    data = tmp_path / "big.jsonl"
    data.write_text("".join(json.dumps({"text": f"{i} {text}"}) + "\n" for i in range(20_000)), encoding="utf-8")
    process = start_tool("eval/evaluate.py", "--model_path", str(tiny_models.pretrain), "--data", str(data),
                         "--no_samples", "--threads", "1", "--max_seq_len", "128", tmp_path=tmp_path)
    stderr = StderrReader(process)
    stderr.wait_for("tokenizing documents", process)  # at work on the data
    out, err = interrupt(process, stderr)
    assert err.splitlines()[-1] == "interrupted", err  # splitlines: a progress bar's \r ends a line too
    assert b"bits/byte" not in out  # stopped at work: no table


def test_ctrl_c_while_chat_waits_for_piped_input_ends_it_in_one_line(tiny_models, tmp_path) -> None:
    """SIGINT after chat answered the first piped line, while it reads the next."""
    process = start_tool("eval/chat.py", "--model_path", str(tiny_models.sft), "--temperature", "0",
                         "--max_new_tokens", "40", "--no_tools", tmp_path=tmp_path)
    stderr = StderrReader(process)
    process.stdin.write(b"Who are you?\n")
    process.stdin.flush()
    assert process.stdout.readline().decode("utf-8") == f"{tiny_models.reply}\n"  # answered; the pipe stays open
    _, err = interrupt(process, stderr)
    assert err.splitlines()[-1] == "interrupted", err


def test_ctrl_c_while_a_trainer_trains_names_its_newest_checkpoint(train_data, tmp_path) -> None:
    """SIGINT once a pretraining run has saved a checkpoint: one line naming it and how to go on, exit code 130."""
    from tests.training_runs import pretrain_argv
    from trainer.run_dir import CHECKPOINT_DIR, STATE_FILE, list_checkpoints

    out_dir = tmp_path / "run"
    process = start_tool("trainer/train_pretrain.py",
                         *pretrain_argv(train_data, out_dir, "--max_steps", "100000", "--save_interval", "2"),
                         tmp_path=tmp_path)
    stderr = StderrReader(process)
    deadline = time.monotonic() + 300
    while not list(out_dir.glob(f"{CHECKPOINT_DIR}/*/{STATE_FILE}")):
        assert process.poll() is None and time.monotonic() < deadline, stderr.text()
        time.sleep(0.05)
    _, err = interrupt(process, stderr)
    newest = list_checkpoints(out_dir / CHECKPOINT_DIR)[-1]
    assert err.splitlines()[-1] == (f"interrupted; its newest checkpoint is {newest}: run the same command with "
                                    "--resume auto to go on from it"), err


# A trainer command held where the test interrupts it, after its results are written: inside the run, in the
# Accelerator's end_training (a tracker's upload would be there), or at the interpreter's exit (an atexit callback);
# "held" on stderr says it waits there for the signal.
HELD_TRAINER = """
import atexit, runpy, signal, sys
sys.path.insert(0, {repo!r})
from trainer.threads import bound_openmp_waits
bound_openmp_waits()
import accelerate

def hold(*args):
    print("held", file=sys.stderr, flush=True)
    signal.pause()

if {where!r} == "end_training":
    end_training = accelerate.Accelerator.end_training
    accelerate.Accelerator.end_training = lambda self: (hold(), end_training(self))
else:
    atexit.register(hold)
sys.argv = ["trainer/train_pretrain.py", *sys.argv[1:]]
runpy.run_path("trainer/train_pretrain.py", run_name="__main__")
"""


@pytest.mark.parametrize("where", ["end_training", "atexit"])
def test_ctrl_c_after_a_trainer_finished_is_no_failure(where, train_data, tmp_path) -> None:
    """SIGINT once a pretraining run has written its model and run_summary.json and printed its summary (while
    its teardown runs): exit code 0 and one line saying the run had finished (was exit 130, or a traceback at the
    interpreter's exit)."""
    from tests.training_runs import pretrain_argv
    from trainer.run_dir import SUMMARY_FILE

    out_dir = tmp_path / "run"
    hook = tmp_path / "held_trainer.py"
    hook.write_text(HELD_TRAINER.format(repo=str(REPO), where=where), encoding="utf-8")
    process = start_tool(str(hook), *pretrain_argv(train_data, out_dir), tmp_path=tmp_path)
    stderr = StderrReader(process)
    stderr.wait_for("held", process)
    process.send_signal(signal.SIGINT)
    out = process.stdout.read().decode("utf-8")
    process.wait(timeout=120)
    stderr.thread.join(timeout=30)
    err = stderr.text()
    assert process.returncode == 0, err
    assert err.splitlines()[-1] == f"interrupted after the run had finished; its results are saved in {out_dir}", err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "done: 8 steps" in out and json.loads((out_dir / SUMMARY_FILE).read_text())["status"] == "finished"


def test_ctrl_c_while_serve_serves_ends_it_in_one_line(tiny_models, tmp_path) -> None:
    """SIGINT to scripts/serve.py once it answers: uvicorn shuts the server down and raises the signal again once
    done, so a KeyboardInterrupt comes out of its run; run_main ends it in one line (was a traceback, exit 1)."""
    from tests.conftest import wait_for_health
    from trainer.distributed import free_port

    port = free_port()
    process = start_tool("scripts/serve.py", "--model_path", str(tiny_models.sft), "--port", str(port),
                         "--threads", "1", tmp_path=tmp_path)
    stderr = StderrReader(process)
    wait_for_health(f"http://127.0.0.1:{port}", timeout=180)
    _, err = interrupt(process, stderr)
    assert err.splitlines()[-1] == "interrupted", err
