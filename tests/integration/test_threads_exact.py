"""The thread count changes a training step's last bits (the weight gradients' matrix products split their sums by
thread), so a run keeps one count (trainer/threads.py): its checkpoint records it and a resumed run takes it back,
whatever count its own process would pick. Checked on the default model's shape, precision and optimizer."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

import trainer.threads
from tests.training_runs import run_in_process
from trainer.run_dir import CHECKPOINT_DIR

# The default model's shape, precision and optimizer; eager norms (no compile time). The tiny runs' data
# (tests/training_runs.py): the run's final evaluation reads its whole validation split, which for the embedded
# default data was 224 batches of this model, three quarters of the test's time.
DEFAULT_MODEL = ["--max_steps", "4", "--save_interval", "2", "--batch_size", "4", "--max_seq_len", "128",
                 "--norm_impl", "eager", "--eval_interval", "1000", "--eval_batches", "1"]


def test_a_resumed_run_takes_back_its_thread_count_and_ends_bit_identical(train_data, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    data = ["--data_path", str(train_data / "pretrain.jsonl"), "--val_fraction", "0.05"]
    threads = torch.get_num_threads()
    monkeypatch.setattr(trainer.threads, "usable_cores", lambda: 2)  # --threads 2 is allowed on a 1-core machine too
    try:
        run_in_process("pretrain", ["--out_dir", str(tmp_path / "whole"), "--threads", "2", *data, *DEFAULT_MODEL])
        # Resumed with --threads auto in a process whose own pick would be one thread (one usable core).
        monkeypatch.setattr(trainer.threads, "usable_cores", lambda: 1)
        checkpoint = tmp_path / "whole" / CHECKPOINT_DIR / "step_00000002"
        run_in_process("pretrain", ["--out_dir", str(tmp_path / "resumed"), "--resume", str(checkpoint),
                                    *data, *DEFAULT_MODEL])
        resumed_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    assert resumed_threads == 2
    whole, resumed = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "resumed" /
                                                                                   "model.safetensors")
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)
