"""GRPO's advantages as each process ends up with them, recorded for tests/integration/test_grpo_runs.py.
`recording_finish_rollouts(folder)` is GroupRelativePolicy.finish_rollouts followed by a record: for each call (one
optimizer step's rollouts), one line of folder/advantages_<rank>.jsonl, [[tokens, advantage], ...] for every
completion of that process's micro-batches (its prompt and completion tokens, padding left out, to find it in another
run), and one line of folder/completion_tokens_<rank>.jsonl, the number of completion tokens of those micro-batches.
Run as a script (`torchrun ... tests/grpo_advantages.py FOLDER <trainer/train_grpo.py flags>`) it trains as
trainer/train_grpo.py does with that record on."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script by the launcher

from trainer.grpo import GroupRelativePolicy  # noqa: E402

AdvantageRows = list[tuple[tuple[int, ...], float]]


def recording_finish_rollouts(folder: Path) -> Callable:
    finish_rollouts = GroupRelativePolicy.finish_rollouts

    def finish_and_record(self, batches, accelerator) -> None:
        finish_rollouts(self, batches, accelerator)
        rows = [[ids[mask.bool()].tolist(), float(advantage)] for batch in batches
                for ids, mask, advantage in zip(batch["input_ids"], batch["attention_mask"], batch["advantages"])]
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"advantages_{accelerator.process_index}.jsonl", "a") as record:
            record.write(json.dumps(rows) + "\n")
        with open(folder / f"completion_tokens_{accelerator.process_index}.jsonl", "a") as record:
            record.write(json.dumps(sum(int(batch["completion_mask"].sum()) for batch in batches)) + "\n")

    return finish_and_record


def advantages_by_step(folder: Path) -> list[AdvantageRows]:
    """Every process's record joined, step by step: (tokens, advantage) of each completion, in token order."""
    processes = [[json.loads(line) for line in file.read_text().splitlines()]
                 for file in sorted(folder.glob("advantages_*.jsonl"))]
    assert processes and len({len(steps) for steps in processes}) == 1, f"{folder}: one record per step per process"
    return [sorted((tuple(ids), advantage) for steps in processes for ids, advantage in steps[step])
            for step in range(len(processes[0]))]


def completion_tokens_by_step(folder: Path) -> list[list[int]]:
    """Step by step, each process's completion tokens (in the order of the processes' ranks)."""
    processes = [[json.loads(line) for line in file.read_text().splitlines()]
                 for file in sorted(folder.glob("completion_tokens_*.jsonl"))]
    assert processes and len({len(steps) for steps in processes}) == 1, f"{folder}: one record per step per process"
    return [list(tokens) for tokens in zip(*processes)]


if __name__ == "__main__":
    from trainer.cli import run_main
    from trainer.command import command_line

    GroupRelativePolicy.finish_rollouts = recording_finish_rollouts(Path(sys.argv.pop(1)))
    run_main(lambda: command_line("grpo"))
