"""The command line every tool and trainer shares: a parser whose error is one line, not a page of usage.

argparse answers a bad flag with the whole usage (some fifty lines for a trainer) and the error last; a ToolParser
prints the error first, then one line that points to --help, and exits with the tools' EXIT_ERROR (2, argparse's
own code). --help is unchanged.

The flag types shared by several command lines live here too, so that each range is checked in one place: a seed
(numpy's and torch's range), integers with a lower bound (alone or in a comma-separated list), floats within a
range, a benchmark's thread count, paths that are not empty, an output file that is not a directory, text that is
UTF-8.
"""

from __future__ import annotations

import argparse
import errno
import re
import math
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TextIO

from dataset.atomic_io import cannot_name, file_in_the_way, folder_path_problem, not_a_folder, not_utf8_at
from dataset.shown_value import shown_path, shown_text, shown_value
from trainer.number_text import NUMBER_READERS, ascii_float, ascii_hint, ascii_int
from trainer.run_dir import EXIT_BROKEN_PIPE, EXIT_ERROR, EXIT_INTERRUPTED, resolve_path
from trainer.threads import MAX_THREADS, bound_openmp_waits


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default; a flag whose default is None says in its help text what unset means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


class RawDescriptionDefaultsHelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """DefaultsHelpFormatter that prints the description (a tool's docstring) with its own line breaks."""


NEGATIVE_NUMBER = re.compile(r"^-(\.?\d|inf(inity)?$|nan$)", re.IGNORECASE)  # what ToolParser reads as a value


class ToolParser(argparse.ArgumentParser):
    """argparse.ArgumentParser with a short error: `error: MESSAGE`, then where the flags are listed; its --help
    shows each flag's default (DefaultsHelpFormatter, unless the tool passes another formatter_class)."""

    def __init__(self, *args: Any, formatter_class: type[argparse.HelpFormatter] = DefaultsHelpFormatter,
                 **kwargs: Any) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)
        # Python 3.11's argparse reads only -1 and -0.5 as negative numbers: `--reward_weights 1 -1e-1` or
        # `--beta -inf` was "expected one argument", the value taken for a flag. Any -digit, -.digit, -inf or -nan
        # is a value here (as Python 3.13's argparse reads -digit); no flag of ours starts so.
        self._negative_number_matcher = NEGATIVE_NUMBER
        # A flag of type int or float reads its text with trainer/number_text.py's readers (argparse's registry maps
        # a type to the function that converts: its argument groups share it): ASCII only, where int() took '٣'.
        for kind, reader in NUMBER_READERS.items():
            self.register("type", kind, reader)

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}\n{self.prog}: run with --help for the flags", file=sys.stderr)
        raise SystemExit(EXIT_ERROR)

    # argparse's own refusals quote the value whole, by repr ("invalid float value: '...'" of a type that raised
    # ValueError, such as float or int; "invalid choice: '...'"): a 10,000-character value made a 10,000-character
    # error. These two write the same words with the value quoted by dataset/shown_value.py's shown_value.
    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError as error:
            if not isinstance(error.__context__, (TypeError, ValueError)):  # an ArgumentTypeError: its own words
                raise
            name = getattr(action.type, "__name__", type(action.type).__name__)
            raise argparse.ArgumentError(action, f"invalid {name} value: {shown_value(arg_string)}"
                                                 f"{ascii_hint(arg_string)}") from None

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(repr, action.choices))
            raise argparse.ArgumentError(action, f"invalid choice: {shown_value(value)} (choose from {choices})")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        """argparse's parse_args, with a value no flag takes quoted (each cut by shown_text) in its refusal."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(shown_text(extra) for extra in extras)}")
        return parsed


INTERRUPTED_LINE = "interrupted"  # all that Ctrl-C prints: the user asked for the stop, there is nothing to debug


class LineEndTracker:
    """A text stream (sys.stderr, run_main's) that remembers whether what was written last ended a line ("\n", or
    a progress bar's "\r"), so that a last line can start on a line of its own; everything else is the stream's."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.at_line_start = True

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        if text:
            self.at_line_start = text[-1] in "\r\n"
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def print_interrupted(detail: str = "") -> None:
    """INTERRUPTED_LINE (then `detail`, after "; ") on stderr, on a line of its own: a progress bar the interrupt
    cut off holds its line open (tqdm ends the line only when the bar closes: "...| 0/20000 [00:00<?]interrupted"),
    so the bars still open are closed first; one the interrupt caught inside its own start (drawn, then closed by
    its `with` before it knew it had drawn: it writes nothing) is ended with a newline where stderr (run_main's
    LineEndTracker) says its line is open."""
    tqdm_module = sys.modules.get("tqdm")  # no bar without tqdm loaded
    for bar in list(getattr(getattr(tqdm_module, "tqdm", None), "_instances", ())):
        try:
            bar.close()
        except (OSError, ValueError, AttributeError):  # a bar whose stream is gone: nothing left to end
            pass
    start = "" if getattr(sys.stderr, "at_line_start", True) else "\n"
    print(f"{start}{INTERRUPTED_LINE}; {detail}" if detail else f"{start}{INTERRUPTED_LINE}", file=sys.stderr,
          flush=True)


def _interrupted_while_loading(signum: int, frame: object) -> NoReturn:  # noqa: ARG001
    print(INTERRUPTED_LINE, file=sys.stderr, flush=True)
    raise SystemExit(EXIT_INTERRUPTED)  # ends the import under way too, without a traceback


def quiet_ctrl_c_while_loading(module_name: str) -> None:
    """Called by a command's file before its heavy imports, with its `__name__`: run as the command (`__main__`),
    a Ctrl-C while torch and the rest load (seconds) ends it as run_main would, with INTERRUPTED_LINE and
    EXIT_INTERRUPTED instead of an import's KeyboardInterrupt traceback; run_main hands Ctrl-C back to Python.
    Imported by another module (a test, a tool) it does nothing, and an ignored SIGINT (a shell's background job)
    stays ignored."""
    if module_name == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_while_loading)


def begin_command(module_name: str) -> None:
    """The start of a command that runs a model, called by its file with its `__name__` right after the sys.path
    line, before any other import: quiet_ctrl_c_while_loading(module_name) first (run as the command, a Ctrl-C
    while the rest loads is one line and EXIT_INTERRUPTED), then trainer/threads.py's bound_openmp_waits (also when the
    file is only imported), which must run before anything imports torch: libgomp reads the wait policy when torch
    loads. A command that runs no model for long calls quiet_ctrl_c_while_loading alone and leaves OpenMP's
    spin as it is (the kernel benchmarks time it so)."""
    quiet_ctrl_c_while_loading(module_name)
    bound_openmp_waits()


def done_on_ctrl_c(line: str) -> None:
    """Called by a command once its work is done and on disk: from then on a Ctrl-C (SIGINT) prints `line` and ends
    the process at once with exit 0, not EXIT_INTERRUPTED -- what is left is teardown (a tracker's upload, the
    process group, the interpreter's exit), which the user asked to skip, and which must not turn finished work
    into a failure. os._exit: no teardown code (an atexit callback, a library's except clause) can meet the
    interrupt and print a traceback. Only in the main thread, and only where Ctrl-C is Python's KeyboardInterrupt
    (an ignored SIGINT stays ignored, another handler stays)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return

    def done(signum: int, frame: object) -> NoReturn:  # noqa: ARG001
        for stream in (sys.stdout, sys.stderr):  # os._exit skips the interpreter's flush: what was printed stays
            try:
                stream.flush()
            except (OSError, ValueError):  # a reader gone, a closed stream: nothing left to keep
                pass
        try:
            os.write(sys.stderr.fileno(), f"{line}\n".encode("utf-8", errors="replace"))
        except (OSError, ValueError):
            pass
        os._exit(0)

    signal.signal(signal.SIGINT, done)


def run_main(main: Callable[[], int | None]) -> NoReturn:
    """Exit with `main()`'s code. Two ways out are owned here, once for every tool: a reader that stopped early
    (`tool | head`) ends the tool quietly with EXIT_BROKEN_PIPE, not a BrokenPipeError traceback (Python ignores
    SIGPIPE, so the write raises); Ctrl-C (KeyboardInterrupt) ends it with INTERRUPTED_LINE on stderr and
    EXIT_INTERRUPTED, not a KeyboardInterrupt traceback."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_loading:  # loaded: Ctrl-C is a KeyboardInterrupt again
        signal.signal(signal.SIGINT, signal.default_int_handler)
    stderr = sys.stderr
    sys.stderr = LineEndTracker(stderr)  # for print_interrupted: whether a bar left its line open
    try:
        _exit_with(main)
    finally:  # the process's own stderr again for what comes after (an in-process caller: a test)
        sys.stderr = stderr


def _exit_with(main: Callable[[], int | None]) -> NoReturn:
    """run_main's ways out (SystemExit always)."""
    try:
        try:
            code = main()
        finally:  # inside the outer try: a buffered answer meets the closed pipe here, also on the way out of a
            # SystemExit (--help, a flag's error), which goes on as it was raised (with its traceback: a trainer's
            # objects, its process group among them, are not torn down before the interpreter's exit)
            sys.stdout.flush()
    except KeyboardInterrupt:
        print_interrupted()
        raise SystemExit(EXIT_INTERRUPTED) from None
    except BrokenPipeError:
        # stdout's buffer still holds what could not be written; the interpreter's own flush at exit would fail
        # again and print a warning, so stdout points at /dev/null from here on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(EXIT_BROKEN_PIPE) from None
    except OSError as error:
        # A path flag's name the system will not look up (a component over 255 bytes): every lookup of it raises, and
        # no tool or trainer checks each of its input paths for it (outputs are: check_folder_path). One line.
        if error.errno != errno.ENAMETOOLONG or error.filename is None:
            raise
        print(f"error: {cannot_name(Path(os.fsdecode(error.filename)), error, folder=False)}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR) from None
    raise SystemExit(code)


SEED_RANGE = (0, 2 ** 32 - 1)  # what numpy's and torch's seeding take


def flag_type(kind: type, function: Callable[[str], object]) -> Callable[[str], object]:
    """`function` marked with the Python type it returns (`kind`), which a --config YAML's checks name
    (trainer/arg_yaml.py)."""
    function.kind = kind  # type: ignore[attr-defined]
    return function


def int_within(low: int, high: int | None = None, note: str = "") -> Callable[[str], int]:
    """An integer flag's type: in low .. high (high None: no upper bound); `note` says what a value means."""
    allowed = f"an integer in {low} .. {high}" if high is not None else f"an integer >= {low}"
    allowed += f" ({note})" if note else ""

    def parse(text: str) -> int:
        try:
            value = ascii_int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown_text(text)} is not {allowed}{ascii_hint(text)}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{shown_text(text)} is not {allowed}")
        return value
    return flag_type(int, parse)


seed = int_within(*SEED_RANGE)  # every --seed

# The most a count flag of a benchmark or study takes (eval/benchmarks, eval/studies: rounds, steps, calls,
# repetitions, warm-up steps, requests): a step of a small model takes about 0.1 s on a CPU, so 1,000 rounds of a
# study's default steps take about an hour and a half; --rounds 10**30 ran until killed.
MAX_COUNT = 1000


def int_list(low: int, high: int | None = None) -> Callable[[str], list[int]]:
    """A comma-separated integer list flag's type (`1,2,4`): each item in low .. high; the error quotes the list."""
    item = int_within(low, high)
    allowed = f"comma-separated integers in {low} .. {high}" if high is not None else \
        f"comma-separated integers >= {low}"

    def parse(text: str) -> list[int]:
        try:
            return [item(part.strip()) for part in text.split(",")]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{shown_value(text)} is not {allowed}") from None
    return flag_type(list, parse)


def float_within(low: float, high: float, above_low: bool = False) -> Callable[[str], float]:
    """A float flag's type: a number in low .. high, ends included (NaN never); `above_low`: low excluded. `high`
    math.inf: any finite number from `low` on (an infinite budget, loss or FLOP/s is no measure: inf is refused)."""
    if math.isinf(high):
        out_of_range = f"is not a finite number {'>' if above_low else '>='} {low:g}"
    else:
        out_of_range = f"is outside ({low:g}, {high:g}]" if above_low else f"is outside {low:g} .. {high:g}"

    def parse(text: str) -> float:
        try:
            value = ascii_float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown_value(text)} is not a number{ascii_hint(text)}") from None
        if not (low < value <= high if above_low else low <= value <= high) or math.isinf(value):  # NaN fails too
            raise argparse.ArgumentTypeError(f"{shown_text(text)} {out_of_range}")
        return value
    return flag_type(float, parse)


def benchmark_threads(zero_means: str = "") -> Callable[[str], int]:
    """The --threads type of every benchmark and study (eval/benchmarks, eval/studies): a thread count in
    1 .. MAX_THREADS (trainer/threads.py), and 0 where `zero_means` says what 0 is. Not bounded by the usable cores,
    as a run's --threads is (trainer/threads.py's parse_threads): a benchmark may time more threads than cores on
    purpose. Past MAX_THREADS, --threads 1000000000 ended inside libgomp ("Out of memory allocating ...")."""
    return int_within(0 if zero_means else 1, MAX_THREADS, zero_means)


def zero_or_at_least(smallest: float, zero_means: str, highest: float = math.inf,
                     range_note: str = "") -> Callable[[str], float]:
    """A float flag's type: 0 (which means `zero_means`) or a finite number >= `smallest` (and <= `highest`, where
    given: `range_note` says whose range that is)."""
    allowed = f"a finite number >= {smallest:g}" if math.isinf(highest) else f"a number in {smallest:g} .. {highest:g}"
    allowed += f" ({range_note})" if range_note else ""

    def parse(text: str) -> float:
        try:
            value = ascii_float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown_value(text)} is not a number{ascii_hint(text)}") from None
        if not (value == 0 or (smallest <= value <= highest and math.isfinite(value))):
            raise argparse.ArgumentTypeError(f"{shown_text(text)} is not 0 ({zero_means}) or {allowed}")
        return value
    return flag_type(float, parse)


def boolean(text: str) -> bool:
    """A BOOL flag's type: true/false (1/0, yes/no, on/off)."""
    lowered = str(text).lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {shown_value(text)}")


def utf8_text(text: str) -> str:
    """A text flag's type: argv holds bytes that are not UTF-8 as lone surrogates, which a tokenizer refuses."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise argparse.ArgumentTypeError(not_utf8_at(text, error.start)) from None
    return text


flag_type(str, utf8_text)


def path_arg(text: str) -> str:
    """A path flag's type: an empty value (an unset shell variable) names no file, so it is refused rather than
    taken for the flag's default; so is a text no file name can hold (a lone surrogate that is not a byte of argv)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty value")
    try:  # argv's bytes that are not UTF-8 come as U+DC80..U+DCFF and name the file; another surrogate (a YAML
        os.fsencode(text)  # --config's "\ud800") names none, and failed later as an encoding error naming no flag
    except UnicodeEncodeError as error:
        raise argparse.ArgumentTypeError(not_utf8_at(text, error.start)) from None
    return text


flag_type(str, path_arg)


def add_model_source_flags(parser: argparse.ArgumentParser) -> None:
    """--model_path and --lora, the flags every tool that loads a trained model reads (locate_model_and_adapter)."""
    parser.add_argument("--model_path", type=path_arg, default=None,
                        help="model directory; default: out/sft, else out/pretrain (with --lora: the adapter's base "
                             "model)")
    parser.add_argument("--lora", type=path_arg, default=None,
                        help="a LoRA adapter directory (trainer/train_lora.py), merged into the model's weights at "
                             "load")


def output_file(text: str) -> str:
    """An output file flag's type: the path the tool writes, relative to the repo root as every output is
    (trainer/run_dir.py's resolve_path), returned resolved so that the tool checks and writes that one path (a tool
    that resolved it again from the current directory wrote elsewhere than this check looked). Refused up front
    where it is a directory, or where a file stands in the place of a folder above it (`--json a_file/x.json`: the
    tool's own check said so only once the model was found), not after the work whose results it would hold; so is
    a name the system refuses to look up (a component over 255 bytes), which raised OSError's traceback."""
    path = resolve_path(path_arg(text))
    try:
        is_dir = path.is_dir()
        blocker = file_in_the_way(path.parent)
    except OSError as error:
        raise argparse.ArgumentTypeError(f"{shown_text(text)} cannot name a file ({error.strerror})") from None
    if is_dir:
        raise argparse.ArgumentTypeError(f"{shown_path(text)} is a directory, expected a file")
    if blocker is not None:  # dataset/atomic_io.py's words, as the tools' check_report_file says it
        raise argparse.ArgumentTypeError(shown_path(not_a_folder(path, blocker)))
    return str(path)


flag_type(str, output_file)


def output_folder(text: str) -> str:
    """An output folder flag's type: the folder the tool writes in, relative to the repo root as every output is
    (trainer/run_dir.py's resolve_path; a tool that took it from the current directory wrote elsewhere than
    docs/training.md says), returned resolved so that the tool makes and writes that one folder. Refused up front in
    dataset/atomic_io.py's words (folder_path_problem, the tools' check_folder_path) where it cannot be made or
    written in: it or a folder above it a file, a name the system will not look up, no permission."""
    path = resolve_path(path_arg(text))
    if (problem := folder_path_problem(path)) is not None:
        raise argparse.ArgumentTypeError(shown_path(problem))
    return str(path)


flag_type(str, output_folder)
