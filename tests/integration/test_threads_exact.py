"""The thread count changes a training step's last bits (the weight gradients' matrix products split their sums by
thread), so a run keeps one count (trainer/threads.py): its checkpoint records it and a resumed run takes it back,
whatever the thread count its new process would pick. Checked on the default model (its real shape, precision,
Muon), where the count does change the bits."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from tests.training_runs import run_in_process
from trainer.run_dir import CHECKPOINT_DIR

# The default model's shape, precision and optimizer; eager norms (no compile time).
DEFAULT_MODEL = ["--max_steps", "4", "--save_interval", "2", "--batch_size", "4", "--max_seq_len", "128",
                 "--norm_impl", "eager", "--eval_interval", "1000", "--eval_batches", "1"]


def _weights(out_dir):
    return load_file(out_dir / "model.safetensors")


def test_a_resumed_run_takes_back_its_thread_count_and_ends_bit_identical(tmp_path, monkeypatch):
    default_run = DEFAULT_MODEL
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    try:
        run_in_process("pretrain", ["--out_dir", str(tmp_path / "whole"), "--threads", "2", *default_run])
        # The same run at one thread ends elsewhere in the last bits: the count matters for this model.
        run_in_process("pretrain", ["--out_dir", str(tmp_path / "one_thread"), "--threads", "1", *default_run])
        # Resumed with --threads auto in a process at one thread: the checkpoint's 2 threads come back.
        torch.set_num_threads(1)
        checkpoint = tmp_path / "whole" / CHECKPOINT_DIR / "step_00000002"
        run_in_process("pretrain", ["--out_dir", str(tmp_path / "resumed"), "--resume", str(checkpoint),
                                    *default_run])
    finally:
        torch.set_num_threads(threads)
    whole, one_thread, resumed = (_weights(tmp_path / name) for name in ("whole", "one_thread", "resumed"))
    assert any(not torch.equal(whole[name], one_thread[name]) for name in whole)
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)
