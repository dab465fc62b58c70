"""eval/benchmarks/bench_vs_minimind.py end to end on the CPU, against a stand-in for MiniMind's checkout: a
`trainer/train_pretrain.py` that prints MiniMind's progress lines (its published format) and a `model/` folder with
a tokenizer. The real MiniMind ran beside ours on the H200 (docs/benchmarks.md); this checks our side: the flags
MiniMind is given, the time marks read from its log, the real-token count and our trainer's run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from model.config import MiniNormConfig
from tests.paths import REPO
from tests.training_runs import WORDS, write_jsonl

STAND_IN = '''
import argparse, time
p = argparse.ArgumentParser()
for flag in ("--data_path", "--save_dir", "--epochs", "--batch_size", "--max_seq_len", "--hidden_size",
             "--num_hidden_layers", "--accumulation_steps", "--log_interval", "--save_interval", "--dtype", "--device"):
    p.add_argument(flag)
args = p.parse_args()
open("args.json", "w").write(__import__("json").dumps(vars(args)))
print("Trainable Params: 1.500M", flush=True)
for step in range(1, 1000):
    time.sleep(0.01)
    if step % int(args.log_interval) == 0:
        print(f"Epoch:[1/1]({step}/999), loss: {7 - step / 100:.4f}, logits_loss: 0, aux_loss: 0.0000, lr: 0.1, "
              "epoch_time: 0.0min", flush=True)
'''


def test_ours_against_a_minimind_stand_in(tmp_path: Path) -> None:
    checkout = tmp_path / "minimind"
    (checkout / "trainer").mkdir(parents=True)
    (checkout / "trainer" / "train_pretrain.py").write_text(STAND_IN)
    (checkout / "model").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "model" / name, checkout / "model" / name)
    result = tmp_path / "result.json"
    # A small text for both (the embedded corpus, the default, would take our trainer half a minute to tokenize).
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": " ".join(WORDS[i:] + WORDS[:i]) * 3} for i in range(200)])
    done = subprocess.run(
        [sys.executable, "eval/benchmarks/bench_vs_minimind.py", "--minimind_dir", str(checkout),
         "--data_path", str(text),
         "--preset", "cpu-default", "--batch_size", "2", "--seq_len", "64", "--steps", "24", "--warmup", "2",
         "--log_interval", "10", "--minimind_device", "cpu", "--log_dir", str(tmp_path / "logs"),
         "--json", str(result), "--ours_args", "--threads", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    given = json.loads((checkout / "trainer" / "args.json").read_text())
    preset = MiniNormConfig.from_preset("cpu-default")
    assert given["hidden_size"] == str(preset.hidden_size)
    assert given["num_hidden_layers"] == str(preset.num_hidden_layers)
    assert (given["batch_size"], given["max_seq_len"], given["accumulation_steps"]) == ("2", "64", "1")
    assert given["data_path"] == str(text)
    assert f"data: train {text} (val: 1% held out)" in (tmp_path / "logs" / "ours_log.txt").read_text()
    data = json.loads(result.read_text())
    # Time marks at steps 10 and 20 (the first at or after --warmup; the run stops at the first mark >= --steps).
    assert data["minimind"]["last_step"] == 30 and data["minimind"]["params_m"] == 1.5
    assert 2 < data["minimind_tokens_per_sample"] <= 64  # bos + text + eos, truncated to the sequence length
    assert data["minimind"]["tokens_per_s"] > 0 and data["ours"]["tokens_per_s"] > 0
    rows = [line for line in done.stdout.splitlines() if line.startswith("| Mini")]
    assert len(rows) == 2 and rows[0].startswith("| MiniMind") and "1.00x" in rows[0]
    assert (tmp_path / "logs" / "minimind_log.txt").read_text().count("Epoch:[1/1]") == 3
    assert "done:" in (tmp_path / "logs" / "ours_log.txt").read_text()
