"""The documents stay true to the tree: the README is a short front door whose test command is CI's, every link
and every command path in README.md and docs/ exists, every flag they name is a flag of the command that takes it,
and every design document the code cites is in the repo."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import itertools
import re
import shlex
from collections.abc import Container, Iterator
from pathlib import Path

import pytest
from tests.paths import REPO
from trainer.run_dir import TRAINER_SCRIPTS

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SOURCE_DIRS = ("model", "dataset", "trainer", "scripts", "eval", "tests")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    in_code, anchors = False, set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (match := re.match(r"#{1,6} (.*)", line)):
            anchors.add(_slug(match.group(1)))
    return anchors


def test_readme_is_a_short_front_door_and_ci_runs_its_test_command() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    install, test = commands[0], commands[1]  # the two set-up commands come first
    assert "pip install -r requirements.txt" in install and install.endswith("python trainer/train_pretrain.py")
    assert "pip install -r requirements-dev.txt" in test and test.endswith("python -m pytest")
    assert test in (REPO / ".ci" / "run").read_text()


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_links_resolve(document: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", document.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+://", target):
            continue
        file_part, _, anchor = target.partition("#")
        path = (document.parent / file_part).resolve() if file_part else document
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target}: no such heading")
    assert broken == []


def test_documented_outputs_go_under_out_or_into_a_committed_folder() -> None:
    # One rule for generated files, in the documents and the tools' usage lines: under out/ (ignored by git), or into
    # a results folder the repo commits (eval/studies/results/...); a new top-level folder (plots/ once) is neither.
    stray = []
    for document in [*DOCUMENTS, *sorted((REPO / "eval").rglob("*.py")), *sorted((REPO / "scripts").rglob("*.py"))]:
        text = document.read_text(encoding="utf-8")
        flag = r"--(?:out|outfile|out_dir|output_dir|save_dir|sweep_dir)[ =]"
        for path in re.findall(flag + r"([A-Za-z_][\w.-]*/[\w./-]*)", text):
            if not path.startswith("out/") and path.split("/")[0] not in SOURCE_DIRS:
                stray.append(f"{document.relative_to(REPO)}: {path}")
    assert stray == []


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_documented_commands_name_files_that_exist(document: Path) -> None:
    text = document.read_text(encoding="utf-8")
    paths = set(re.findall(r"python3? ([\w/.-]+\.py)\b", text))
    paths |= set(re.findall(r"--config_file ([\w/.-]+\.yaml)", text))
    paths |= set(re.findall(r"\b(scripts/sweep_configs/[\w.-]+\.yaml)", text))
    assert paths or document.name == "architecture.md", "no command found: is the pattern still right?"
    assert sorted(p for p in paths if not (REPO / p).is_file()) == []


def test_design_documents_the_code_cites_are_in_the_repo() -> None:
    names = {path.name for path in REPO.rglob("*.md") if ".venv" not in path.parts}
    missing = []
    for top in SOURCE_DIRS:
        for path in sorted((REPO / top).rglob("*.py")):
            for cited in re.findall(r"[\w/.-]*\b[\w-]+\.md\b", path.read_text(encoding="utf-8")):
                if "/" in cited and not (REPO / cited.split("/")[0]).is_dir() and ".." not in cited:
                    continue  # a placeholder such as DIR/report.md, not a document of ours
                found = (REPO / cited).is_file() if "/" in cited else cited in names
                if not found:
                    missing.append(f"{path.relative_to(REPO)}: {cited}")
    assert missing == []


# The flags the documents give to programs that are not ours (launchers, pip, pytest, the harness, llama.cpp, ...).
OTHER_PROGRAMS_FLAGS = {
    "accelerate launch": {"--config_file", "--num_processes", "--num_machines", "--machine_rank", "--main_process_ip",
                          "--cpu"},
    "torchrun": {"--standalone", "--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port",
                 "--rdzv_conf"},
    "pip": {"--no-deps", "--no-binary"},
    "pytest": {"--durations", "--hypothesis-seed"},
    "lm_eval": {"--model", "--model_args", "--tasks", "--include_path", "--apply_chat_template", "--device",
                "--batch_size", "--log_samples", "--output_path"},
    "cmake, llama.cpp": {"--build", "--target", "--ids", "--log-disable", "--jinja", "--temp"},
    "ncu": {"--set"},
    "a placeholder (`--key=value`)": {"--key"},
    "eval/bench_model.py, since removed (the command a table was measured with)": {"--skip_models"},
}
# A repo command in a document: its path, then what follows it on the line (a command split with \ is one line), up
# to a comment, a pipe, a command separator, the end of the code span or the closing parenthesis of prose.
COMMAND = re.compile(r"(?<![\w/.-])((?:eval|scripts|trainer|dataset|model)/[\w/.-]+\.py)((?:[ =][^\s`|;&#)]+)*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _stop_at_parse(parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
    raise _Parsed(parser)


def _command_files() -> list[str]:
    """Every command line of the repo: the trainers and each file that builds a ToolParser and runs it from main."""
    files = set(TRAINER_SCRIPTS.values())
    for top in ("model", "dataset", "trainer", "scripts", "eval"):
        for path in (REPO / top).rglob("*.py"):
            source = path.read_text(encoding="utf-8")
            if "ToolParser(" in source and re.search(r"^def main\(argv", source, re.M):
                files.add(str(path.relative_to(REPO)))
    return sorted(files)


@pytest.fixture(scope="module")
def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's parser, as its main builds it: main runs up to the parse, which stops it."""
    from trainer.args import parse_args
    tasks = {script: task for task, script in TRAINER_SCRIPTS.items()}
    parsers = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", _stop_at_parse)
        patch.setattr(argparse.ArgumentParser, "parse_known_args", _stop_at_parse)
        for script in _command_files():
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    if script in tasks:
                        parse_args(tasks[script], [])
                    else:
                        importlib.import_module(script.removesuffix(".py").replace("/", ".")).main([])
            except _Parsed as parsed:
                parsers[script] = parsed.parser
            else:
                raise AssertionError(f"{script}: main returned without parsing its command line")
    return parsers


@pytest.fixture(scope="module")
def command_flags(command_parsers: dict[str, argparse.ArgumentParser]) -> dict[str, set[str]]:
    return {script: set(parser._option_string_actions) for script, parser in command_parsers.items()}


def test_every_help_shows_each_flags_default(command_parsers: dict[str, argparse.ArgumentParser]) -> None:
    """--help is the flags' reference: a flag with a default shows it (a default of None says in its help what
    unset means: test_layout checks every flag has help)."""
    hidden = []
    for script, parser in command_parsers.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or action.default in (None, argparse.SUPPRESS):
                continue
            if "%(default)" not in formatter._get_help_string(action):
                hidden.append(f"{script} {(action.option_strings or [action.dest])[0]}")
    assert hidden == []


def test_every_help_shows_a_default_once_as_a_user_types_it(
        command_parsers: dict[str, argparse.ArgumentParser]) -> None:
    """DefaultsHelpFormatter appends "(default: X)" to a flag whose default is not None: a help text that also says
    its default showed it twice, the two copies free to disagree (--cache_dir's "dataset/cache/" beside this
    clone's absolute path, --weight_dtype's "the activations' dtype" beside "same"). A flag's own words say what
    its value means; one whose default is a path of the machine takes None and says what unset means."""
    machine = [str(REPO), *([str(Path.home())] if Path.home() != Path("/") else [])]
    twice, machine_paths = [], []
    for script, parser in command_parsers.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.help in (None, argparse.SUPPRESS):
                continue
            flag = f"{script} {(action.option_strings or [action.dest])[0]}"
            appended = "%(default)" in formatter._get_help_string(action) and "%(default)" not in action.help
            if appended and re.search(r"\bdefault\s*:", action.help, re.IGNORECASE):
                twice.append(flag)
            if any(path in formatter._expand_help(action) for path in machine):
                machine_paths.append(flag)
    assert twice == [], twice
    assert machine_paths == [], machine_paths


def _prose_and_commands(document: Path) -> str:
    """The document's text with each command split over lines joined, and link targets (anchors) left out."""
    return re.sub(r"\]\([^)\s]*\)", "]", document.read_text(encoding="utf-8").replace("\\\n", " "))


def _documented_commands(document: Path, scripts: Container[str]) -> Iterator[tuple[str, str]]:
    """(script, the rest of its line) for each command of one of `scripts` the document shows."""
    for line in _prose_and_commands(document).splitlines():
        for match in COMMAND.finditer(line):
            script, rest = match.groups()
            if script in scripts:
                yield script, rest


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_flag_a_document_names_exists(document: Path, command_flags: dict[str, set[str]]) -> None:
    known = set().union(*command_flags.values(), *OTHER_PROGRAMS_FLAGS.values())
    named = set(FLAG.findall(_prose_and_commands(document)))
    assert sorted(named - known) == []


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_documented_commands_pass_only_their_own_flags(document: Path, command_flags: dict[str, set[str]]) -> None:
    wrong = []
    for script, rest in _documented_commands(document, command_flags):
        rest = re.sub(r"\"[^\"]*\"|'[^']*'", "", rest)  # a quoted value may hold another command's flags
        wrong += [f"{script} {flag}" for flag in FLAG.findall(rest) if flag not in command_flags[script]]
    assert wrong == []


# A value a document writes in a user's stead: a placeholder in capitals (N, DIR, KEY), a shell variable, an elided one.
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*|.*[$<>]|.*\.\.\..*")


def _flag_values(parser: argparse.ArgumentParser, rest: str) -> list[tuple[str, list[str]]]:
    """Each flag of `rest` (a documented command's text after its path) that takes a value, with its values as a
    shell passes them: the one after it (or after its `=`), or every word up to the next flag for a list."""
    try:
        words = shlex.split(rest)
    except ValueError:  # an unclosed quote: the command runs on past the line
        return []
    given = []
    for at, word in enumerate(words):
        flag, equals, value = word.partition("=")
        action = parser._option_string_actions.get(flag)
        if action is None or action.nargs == 0 or not flag.startswith("--"):
            continue
        if equals:
            given.append((flag, [value]))
            continue
        values = list(itertools.takewhile(lambda w: not w.startswith("--"), words[at + 1:]))
        values = values if action.nargs in ("+", "*") else values[:1]
        if values:  # none: the value is in the prose after the code span
            given.append((flag, values))
    return given


def _trainer_refusal(task: str, words: list[str]) -> str | None:
    """What the trainer's own reading of its command line (trainer/args.py parse_args: the flags' types, then every
    check made before the data is read) says of `words`; None when it takes them."""
    from trainer.args import parse_args
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            parse_args(task, words)
    except SystemExit:
        return said.getvalue().strip().splitlines()[0]
    return None


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_documented_commands_give_each_flag_a_value_it_takes(
        document: Path, command_parsers: dict[str, argparse.ArgumentParser]) -> None:
    """A documented command's values are read as the user's would be: a trainer's whole command line by the
    trainer's parse_args (its choices and bounds are checked there), any other tool's values by their flags' types
    and choices. A choice renamed or a bound narrowed fails here, not in a reader's terminal."""
    tasks = {script: task for task, script in TRAINER_SCRIPTS.items()}
    refused = []
    for script, rest in _documented_commands(document, command_parsers):
        parser = command_parsers[script]
        given = _flag_values(parser, rest)
        if script in tasks:
            words = shlex.split(rest) if given else []
            if (not words or not words[0].startswith("--") or {"-h", "--help", "--config"} & set(words)
                    or any(PLACEHOLDER.fullmatch(word) for word in words)
                    or words[-1] in parser._option_string_actions
                    and parser._option_string_actions[words[-1]].nargs not in (0, "?", "*")):
                continue  # prose, help, a file of the user's, a placeholder, or a value the prose goes on with
            said = _trainer_refusal(tasks[script], words)
            refused += [f"{script} {rest.strip()}: {said}"] if said else []
            continue
        for flag, values in given:
            if any(PLACEHOLDER.fullmatch(value) for value in values):
                continue
            action = parser._option_string_actions[flag]
            try:
                parser._get_values(action, values if action.nargs in ("+", "*") else values[:1])
            except argparse.ArgumentError as error:
                refused.append(f"{script} {flag} {' '.join(values)}: {error.message}")
    assert refused == []


def test_the_command_check_reads_a_command_as_a_user_types_it(command_flags: dict[str, set[str]]) -> None:
    line = ("python eval/chat.py --temperature 0 --no_such_flag 1  # --not_this, a comment\n"
            "`python scripts/serve.py --port 1 | head` --nor_this")
    found = [(script, FLAG.findall(rest)) for script, rest in COMMAND.findall(line)]
    assert found == [("eval/chat.py", ["--temperature", "--no_such_flag"]), ("scripts/serve.py", ["--port"])]
    assert {"eval/chat.py", "scripts/serve.py", "trainer/train_pretrain.py"} <= command_flags.keys()
    assert "--temperature" in command_flags["eval/chat.py"] and "--preset" in command_flags["trainer/train_pretrain.py"]


def test_threads_help_speaks_of_resuming_only_in_a_trainer(command_parsers: dict[str, argparse.ArgumentParser]) -> None:
    helps = {script: parser._option_string_actions["--threads"].help for script, parser in command_parsers.items()
             if "--threads" in parser._option_string_actions}
    trainers = set(TRAINER_SCRIPTS.values())
    assert trainers <= helps.keys() and {"eval/chat.py", "scripts/serve.py"} <= helps.keys()
    assert [script for script, text in helps.items() if ("resumed run" in text) != (script in trainers)] == []


def _trials(config: Path) -> str:
    """What docs/sweeps.md's trials column says of a sweep YAML: a grid's size, else its run_cap."""
    import yaml
    sweep = yaml.safe_load(config.read_text(encoding="utf-8"))
    if sweep["method"] != "grid":
        return f"`run_cap: {sweep['run_cap']}`"
    size = 1
    for parameter in sweep["parameters"].values():
        size *= len(parameter.get("values", [None]))
    return str(size)


def test_the_sweeps_table_counts_each_yamls_trials() -> None:
    rows = [line.split(" | ") for line in (REPO / "docs" / "sweeps.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("| `") and line.count(" | ") == 3]
    assert len(rows) >= 20
    wrong = []
    for row in rows:
        files, trials = re.findall(r"`([\w.]+\.yaml)`", row[0]), row[3].rstrip(" |")
        counted = " + ".join(_trials(REPO / "scripts" / "sweep_configs" / name) for name in files)
        if counted != trials:
            wrong.append(f"{', '.join(files)}: {trials}, the YAML {counted}")
    assert wrong == []


# The README's parameter counts of the presets, as it writes them (total; a MoE preset's active count too).
README_PRESET_SIZES = {"cpu-default": ("4.46M",), "cpu-deep": ("4.38M",), "cpu-wide": ("4.26M",),
                       "minimind-26m": ("25.8M",), "minimind-64m": ("56.8M",), "minimind-3-moe": ("198.4M", "63.9M")}


def _millions(count: int, written: str) -> str:
    decimals = len(written.removesuffix("M").partition(".")[2])
    return f"{count / 1e6:.{decimals}f}M"


@pytest.mark.parametrize("preset", README_PRESET_SIZES)
def test_the_readmes_preset_sizes_are_the_models(preset: str) -> None:
    import torch
    from model.config import MiniNormConfig
    from model.model import MiniNormForCausalLM
    config = MiniNormConfig.from_preset(preset)
    with torch.device("meta"):
        weights = dict(MiniNormForCausalLM(config).named_parameters())
    total = sum(weight.numel() for weight in weights.values())
    experts = sum(weight.numel() for name, weight in weights.items() if ".experts." in name)
    counts = [total] if not config.num_experts else \
        [total, total - experts + experts * config.num_experts_per_tok // config.num_experts]
    written = README_PRESET_SIZES[preset]
    assert [_millions(count, text) for count, text in zip(counts, written)] == list(written)
    assert all(text in (REPO / "README.md").read_text(encoding="utf-8") for text in written)


def test_every_trainer_flag_is_documented(command_flags: dict[str, set[str]]) -> None:
    """A trainer's flag is named in training.md or post_training.md; a model field (also a flag) in the README's
    table, architecture.md or training.md."""
    from trainer.arg_fields import MODEL_FIELDS
    def text(*names: str) -> str:
        return "".join((REPO / name).read_text(encoding="utf-8") for name in names)
    flags_text = text("docs/training.md", "docs/post_training.md")
    fields_text = text("README.md", "docs/architecture.md", "docs/training.md")
    missing = set()
    for script in TRAINER_SCRIPTS.values():
        for flag in command_flags[script] - {"-h", "--help"}:
            name = flag.removeprefix("--")
            found = re.search(rf"`{name}`|{flag}(?![\w-])", fields_text) if name in MODEL_FIELDS else \
                re.search(rf"{flag}(?![\w-])", flags_text)
            if not found:
                missing.add(flag)
    assert sorted(missing) == []
