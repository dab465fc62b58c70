"""DPO preference training of a chat model (defaults: out/sft -> out/dpo on the embedded demonstration pairs).

    python trainer/train_dpo.py --help
    python trainer/train_dpo.py --data_path dpo.jsonl --beta 0.15
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
    run_main(partial(command_line, "dpo"))
