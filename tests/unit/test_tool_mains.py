"""One way out for every command line, read from the source with `ast`: each file's `if __name__ == "__main__":`
block hands main to trainer/cli.py's run_main, which owns the exit code, Ctrl-C (one line, exit 130) and a reader
that stopped early (`tool | head`: a quiet exit 141), so a new tool cannot end in a KeyboardInterrupt or
BrokenPipeError traceback. A trainer's runs trainer/command.py's command_line, whose Ctrl-C line names the newest
checkpoint."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tests.paths import REPO
from trainer.run_dir import EXIT_BROKEN_PIPE

FOLDERS = ("scripts", "eval", "dataset", "model", "trainer")  # the tools and the library: any file may be a command


def main_block(tree: ast.Module) -> ast.If | None:
    for node in tree.body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
                and isinstance(node.test.comparators[0], ast.Constant)
                and node.test.comparators[0].value == "__main__"):
            return node
    return None


def _imports(statements: list[ast.stmt], module: str, name: str) -> bool:
    return any(isinstance(node, ast.ImportFrom) and node.module == module and not node.level
               and any(alias.name == name and alias.asname is None for alias in node.names)
               for statement in statements for node in ast.walk(statement))


def _call_of(statement: ast.stmt, name: str) -> ast.Call | None:
    if (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
            and isinstance(statement.value.func, ast.Name) and statement.value.func.id == name):
        return statement.value
    return None


def main_block_problem(source: str) -> str | None:
    """Why the file's command line does not end through run_main (None: it does, or the file is no command). The
    block holds imports and then `run_main(one argument)`, run_main imported from trainer.cli: anything else the
    command does goes in the function it runs (a trainer's: run_main(partial(command_line, "<task>")))."""
    tree = ast.parse(source)
    block = main_block(tree)
    if block is None:
        return None
    *before, last = block.body
    call = _call_of(last, "run_main")
    if call is None or len(call.args) != 1 or call.keywords:
        return f"line {block.lineno}: the block does not end in run_main(main)"
    if any(not isinstance(statement, (ast.Import, ast.ImportFrom)) for statement in before):
        return f"line {block.lineno}: the block does more than import and call run_main"
    if not _imports(tree.body, "trainer.cli", "run_main"):
        return f"line {block.lineno}: run_main is not trainer.cli's"
    return None


def command_files() -> list[Path]:
    return sorted(path for folder in FOLDERS for path in (REPO / folder).rglob("*.py")
                  if main_block(ast.parse(path.read_text(encoding="utf-8"))) is not None)


def test_every_command_line_ends_through_run_main() -> None:
    files = command_files()
    names = {str(path.relative_to(REPO)) for path in files}
    # The scan finds the commands (a wrong folder or test would find none and pass).
    assert {"scripts/serve.py", "eval/chat.py", "eval/studies/grad_at_init.py", "eval/benchmarks/bench_norm.py",
            "dataset/corpus.py", "trainer/train_pretrain.py"} <= names
    problems = {name: problem for path in files
                if (problem := main_block_problem(path.read_text(encoding="utf-8")))
                for name in [str(path.relative_to(REPO))]}
    assert problems == {}


def _module(node: ast.stmt) -> str:
    return node.module or "" if isinstance(node, ast.ImportFrom) else node.names[0].name


def loading_problem(source: str) -> str | None:
    """Why a Ctrl-C while the command's imports load would print a traceback (None: it would not): the file calls
    trainer.cli's quiet_ctrl_c_while_loading(__name__), or begin_command(__name__) which calls it, at module level
    before its first import of a module beyond the standard library (torch, numpy, the project's own) other than
    trainer.cli itself."""
    tree = ast.parse(source)
    for node in tree.body:
        if (call := _call_of(node, "quiet_ctrl_c_while_loading") or _call_of(node, "begin_command")) is not None:
            return None if [ast.unparse(a) for a in call.args] == ["__name__"] else "called without __name__"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            top = _module(node).split(".")[0]
            if top not in sys.stdlib_module_names and _module(node) != "trainer.cli":
                return f"line {node.lineno}: {_module(node)} loads before quiet_ctrl_c_while_loading(__name__)"
    return "quiet_ctrl_c_while_loading(__name__) is not called"


def test_every_command_is_quiet_about_a_ctrl_c_while_it_loads() -> None:
    problems = {str(path.relative_to(REPO)): problem for path in command_files()
                if (problem := loading_problem(path.read_text(encoding="utf-8")))}
    assert problems == {}
    assert loading_problem("import torch\nfrom trainer.cli import quiet_ctrl_c_while_loading\n"
                           "quiet_ctrl_c_while_loading(__name__)\n") == (
        "line 1: torch loads before quiet_ctrl_c_while_loading(__name__)")
    assert loading_problem("from trainer.cli import begin_command\nbegin_command(__name__)\nimport torch\n") is None
    assert loading_problem("from trainer.cli import begin_command\nbegin_command('x')\n") == "called without __name__"


SLOW_IMPORT = """
import sys, time
print("loading", flush=True)
time.sleep(120)
"""
LOADING_COMMAND = """
import sys
sys.path[:0] = [{repo!r}, {here!r}]
from trainer.cli import {start}, run_main
{start}(__name__)
import slow_module
"""


@pytest.mark.parametrize("start", ["quiet_ctrl_c_while_loading", "begin_command"])
@pytest.mark.parametrize("ignored", [False, True])
def test_ctrl_c_while_a_command_loads_is_one_line_and_exit_130(tmp_path, ignored: bool, start: str) -> None:
    """Torch and the rest load for seconds before run_main runs: a Ctrl-C then was a KeyboardInterrupt traceback
    of 50-70 lines through the import machinery. An ignored SIGINT (a shell's background job) stays ignored."""
    import signal
    import time

    (tmp_path / "slow_module.py").write_text(SLOW_IMPORT)
    (tmp_path / "command.py").write_text(LOADING_COMMAND.format(repo=str(REPO), here=str(tmp_path), start=start))
    # The child's SIGINT set either way, not inherited: a test process started in the background (a shell's `&`)
    # has it ignored, and the child with it (the case below that must exit 130 then never did).
    disposition = signal.SIG_IGN if ignored else signal.SIG_DFL
    preexec = lambda: signal.signal(signal.SIGINT, disposition)  # noqa: E731
    child = subprocess.Popen([sys.executable, str(tmp_path / "command.py")], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
    try:
        assert child.stdout.readline() == "loading\n"
        child.send_signal(signal.SIGINT)
        if ignored:
            time.sleep(1)
            assert child.poll() is None  # still loading
            return
        assert child.wait(timeout=60) == 130
        assert child.stderr.read() == "interrupted\n"
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(("source", "problem"), [
    ('from trainer.cli import run_main\nif __name__ == "__main__":\n    run_main(main)\n', None),
    ('if __name__ == "__main__":\n    from trainer.cli import run_main\n\n    run_main(main)\n', None),
    ("def main(): ...\n", None),  # a module, not a command
    ('if __name__ == "__main__":\n    raise SystemExit(main())\n',
     "line 1: the block does not end in run_main(main)"),
    ('import sys\nif __name__ == "__main__":\n    sys.exit(main())\n',
     "line 2: the block does not end in run_main(main)"),
    ('if __name__ == "__main__":\n    main()\n', "line 1: the block does not end in run_main(main)"),
    ('from trainer.cli import run_main\nif __name__ == "__main__":\n    try:\n        main()\n'
     '    except ValueError:\n        pass\n    run_main(main)\n',
     "line 2: the block does more than import and call run_main"),
    ('def run_main(f): f()\nif __name__ == "__main__":\n    run_main(main)\n',
     "line 2: run_main is not trainer.cli's"),
    ('from trainer.command import main\nif __name__ == "__main__":\n    main("pretrain")\n',
     "line 2: the block does not end in run_main(main)"),
])
def test_the_main_block_check_catches_each_other_ending(source: str, problem: str | None) -> None:
    assert main_block_problem(textwrap.dedent(source)) == problem


def user_env() -> dict[str, str]:
    """This environment as a user's shell has it: stdout block-buffered into a pipe (the test runner may set
    PYTHONUNBUFFERED)."""
    return {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}


# The --help tests run tools that parse their flags before importing torch (a fraction of a second each, where
# convert_to_llama.py and norm_share.py import it first: 4-5 CPU-s a launch); run_main is the same for every tool.
@pytest.mark.parametrize("tool", ["scripts/serve.py", "eval/copy_probe.py"])
def test_help_into_head_prints_its_first_line_and_no_traceback(tool: str) -> None:
    command = f"{sys.executable} {tool} --help | head -1; exit ${{PIPESTATUS[0]}}"
    result = subprocess.run(["bash", "-c", command], cwd=REPO, env=user_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode in (0, EXIT_BROKEN_PIPE), result.stderr  # 141: head was gone before the help was written
    assert result.stdout.startswith("usage: ") and result.stdout.count("\n") == 1
    assert result.stderr == ""


@pytest.mark.parametrize("buffered", [True, False])
@pytest.mark.parametrize("argv", [["dataset/tools.py", "--schemas"], ["scripts/serve.py", "--help"]])
def test_a_reader_gone_before_the_output_ends_the_tool_quietly(buffered: bool, argv: list[str]) -> None:
    """A tool's output (a main that returns; --help, which exits through SystemExit) into a pipe whose reader has
    closed: exit 141, nothing on stderr (was a BrokenPipeError traceback unbuffered, 'Exception ignored ...
    BrokenPipeError' and 120 buffered)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: every write fails, no race
    env = user_env() if buffered else {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        result = subprocess.run([sys.executable, *argv], cwd=REPO, env=env,
                                stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    # argparse's help writer ignores a failed write itself: unbuffered, --help has nothing left to fail
    allowed = (EXIT_BROKEN_PIPE, 0) if "--help" in argv and not buffered else (EXIT_BROKEN_PIPE,)
    assert result.returncode in allowed and result.stderr == "", (result.returncode, result.stderr)


@pytest.mark.parametrize("module, argv, flag", [
    ("eval.copy_probe", [], "--json"),
    ("eval.long_context", [], "--json"),
    ("eval.studies.norm_inputs", ["some_model_dir"], "--out"),
])
def test_an_output_file_that_is_a_directory_is_refused_before_any_work(module, argv, flag, tmp_path, capsys) -> None:
    """Each was an IsADirectoryError traceback after all the work (the probe, every model measured)."""
    import importlib

    with pytest.raises(SystemExit) as stopped:
        importlib.import_module(module).main([*argv, flag, str(tmp_path)])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.splitlines()[0]
    assert error == f"error: argument {flag}: {tmp_path} is a directory, expected a file"


@pytest.mark.parametrize("module, argv, flag", [
    ("eval.copy_probe", [], "--json"),
    ("eval.long_context", [], "--json"),
    ("eval.evaluate", [], "--json"),
    ("eval.tool_eval", [], "--json"),
    ("eval.studies.norm_inputs", ["some_model_dir"], "--out"),
])
def test_an_output_file_under_a_file_is_refused_as_the_flags_are_parsed(module, argv, flag, tmp_path, capsys) -> None:
    """`--json a_file/x.json`: each tool's check_report_file said so only once the model was found (a missing model
    said first, the --json after it was made); now the flag's type says it, before anything is looked for."""
    import importlib

    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as stopped:
        importlib.import_module(module).main([*argv, flag, str(tmp_path / "a_file" / "x.json")])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.splitlines()[0]
    assert error == (f"error: argument {flag}: {tmp_path / 'a_file' / 'x.json'}: {tmp_path / 'a_file'} is a file, "
                     f"not a folder")


def test_norm_inputs_on_a_folder_without_a_model_says_so_in_one_line(tmp_path, capsys):
    """A sweep trial brought back from its records keeps its metrics and config, not its weights: norm_inputs.py says
    there is no model there, as chat, copy_probe and long_context do, not transformers' complaint about a
    config.json that does not exist."""
    from eval.studies.norm_inputs import main
    trial = tmp_path / "trial"
    trial.mkdir()
    (trial / "train_config.yaml").write_text("max_seq_len: 128\n")
    (trial / "metrics.jsonl").write_text('{"step": 1, "split": "val", "val_loss": 5.0}\n')
    assert main([str(trial)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: no model at {trial};") and err.count("\n") == 1 and "config.json" not in err


def test_a_relative_report_file_is_written_where_its_flag_was_checked(tiny_models, tmp_path, monkeypatch,
                                                                        capsys) -> None:
    """`cd /tmp && norm_inputs.py MODEL --out rel_table.txt`: the flag's type (trainer/cli.py output_file) checked
    rel_table.txt under the repo root, as every output is relative to it, but the tool checked it against the
    model's files and wrote it in the current directory. Now the flag's value is the path it checked, and the table
    is written there."""
    from eval.studies.norm_inputs import main

    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    repo.mkdir()
    elsewhere.mkdir()
    monkeypatch.setattr("trainer.run_dir.REPO_ROOT", repo)
    monkeypatch.chdir(elsewhere)
    assert main([str(tiny_models.pretrain), "--seq_len", "16", "--batches", "1", "--batch_size", "2",
                 "--out", "rel_table.txt"]) == 0
    assert "| norm |" in (repo / "rel_table.txt").read_text()
    assert not (elsewhere / "rel_table.txt").exists()


REPORT_TOOLS = [("eval.evaluate", ["--device", "cpu"], "--json"), ("eval.tool_eval", [], "--json"),
                ("eval.copy_probe", [], "--json"), ("eval.long_context", [], "--json"),
                ("eval.studies.norm_inputs", [], "--out")]
WITHOUT_DATA = ("eval.tool_eval", "eval.studies.norm_inputs")  # the report tools that take no --data file
REPORT_TARGETS = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_files.json", "hard link",
                  "through a symlinked folder", "the data file"]


@pytest.mark.parametrize("module, argv, flag, target", [
    (module, argv, flag, target) for module, argv, flag in REPORT_TOOLS for target in REPORT_TARGETS
    if target != "the data file" or module not in WITHOUT_DATA])
def test_a_report_file_that_is_one_of_the_tools_inputs_is_refused_before_any_work(module, argv, flag, target,
                                                                                    tiny_models, tmp_path, capsys,
                                                                                    monkeypatch) -> None:
    """`--json M/config.json` (or the weights, the tokenizer, the --data file; by any name) wrote the report over
    the file after the evaluation: the model folder was destroyed, exit 0. Refused in one line naming both flags,
    before the model loads, every input left as it was. tokenizer_files.json (the record of the tokenizer's files)
    was not on the list: a report over it was refused only at the next load of the model."""
    import importlib
    import shutil

    import model.loading

    model_dir = tmp_path / "m"
    shutil.copytree(tiny_models.pretrain, model_dir)
    data = tmp_path / "val.jsonl"
    shutil.copy(tiny_models.pretrain_data, data)
    out, source, given = {"hard link": (tmp_path / "linked.json", model_dir / "config.json", "--model_path"),
                          "through a symlinked folder": (tmp_path / "l" / "config.json", model_dir / "config.json",
                                                         "--model_path"),
                          "the data file": (data, data, "--data")}.get(
        target, (model_dir / target, model_dir / target, "--model_path"))
    if target == "hard link":
        os.link(source, out)
    if target == "through a symlinked folder":
        (tmp_path / "l").symlink_to(model_dir)
    before = {path: path.read_bytes() for path in (*model_dir.iterdir(), data)}

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the output file was checked")

    monkeypatch.setattr(model.loading, "load_model", no_load)
    model_args = [str(model_dir)] if module == "eval.studies.norm_inputs" else ["--model_path", str(model_dir)]
    data_args = ["--data", str(data)] if module not in WITHOUT_DATA else []
    assert importlib.import_module(module).main([*model_args, *argv, *data_args, flag, str(out)]) == 2
    err = capsys.readouterr().err
    given = "the model folder" if given == "--model_path" and module == "eval.studies.norm_inputs" else given
    assert err.endswith(f"error: {flag} {out} is {given}'s {source}"
                        + (" (the same file by another name)" if out != source and target != "through a symlinked "
                           "folder" else "") + f": writing there would destroy a file the tool reads; choose another "
                        f"{flag}\n"), err
    assert {path: path.read_bytes() for path in before} == before
