"""The command line every tool and trainer shares: a parser whose error is one line, not a page of usage.

argparse answers a bad flag with the whole usage (some fifty lines for a trainer) and the error last; a ToolParser
prints the error first, then one line that points to --help, and exits with the tools' EXIT_ERROR (2, argparse's
own code). --help is unchanged.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from trainer.run_dir import EXIT_ERROR


class ToolParser(argparse.ArgumentParser):
    """argparse.ArgumentParser with a short error: `error: MESSAGE`, then where the flags are listed."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}\n{self.prog}: run with --help for the flags", file=sys.stderr)
        raise SystemExit(EXIT_ERROR)
