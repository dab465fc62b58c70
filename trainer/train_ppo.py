"""Proximal policy optimisation of a chat model with a critic and reward functions (default: out/sft -> out/ppo;
trainer/ppo.py has the objective and the critic, trainer/rl_losses.py the losses, trainer/rewards.py the rewards).

    python trainer/train_ppo.py --help
    python trainer/train_ppo.py --data_path math.jsonl --reward math_answer --ppo_epochs 4
    python trainer/train_ppo.py --data_path rlaif.jsonl --reward my_rewards.py:brevity --beta 0.02
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from the repo root or from trainer/

from trainer.cli import begin_command  # noqa: E402

begin_command(__name__)  # a Ctrl-C while the imports below load: one line, exit 130; OpenMP's spin bounded first

from functools import partial  # noqa: E402

from trainer.cli import run_main  # noqa: E402
from trainer.command import command_line  # noqa: E402

if __name__ == "__main__":
    run_main(partial(command_line, "ppo"))
