"""The layering rules, read from the source with `ast`: the library (model/, dataset/, trainer/) never imports a
tool (scripts/, eval/), one tool never imports another tool's module, and no modules import each other in a
cycle (imports inside functions count: a lazy import is still a dependency). A tool is one file of a tool folder,
or one package there (e.g. scripts/server/): the modules of one package may import each other, and one command
may own a package (scripts/serve.py runs scripts/server/); a package that two tools import is shared logic, which
belongs in the library. Plus one owner for the run directory's file names, for the rules every tool shares and for
the flag refusal line and the cut of a quoted value (a flag type's refusal quotes its text through it), a --help
text on every flag, type hints on public functions, and whole files written atomically."""

from __future__ import annotations

import ast
import functools
import re
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.paths import REPO

LIBRARY = ("model", "dataset", "trainer")
TOOLS = ("scripts", "eval")
# The folders whose files (or packages) are tools, each its own; the deepest folder that holds a module decides.
TOOL_FOLDERS = ("scripts", "eval", "eval.benchmarks", "eval.studies")


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the library and the tools under `root`."""
    modules = {}
    for top in LIBRARY + TOOLS:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of our modules (None for outside packages)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(our module it imports, line) for every import statement in the file, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from a import b` imports the module a.b when there is one, else the name b from a.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for target in targets:
            known = _known(target, modules)
            if known is not None and known != name and (known, node.lineno) not in found:
                found.append((known, node.lineno))
    return found


def layer_of(name: str) -> str:
    return "library" if name.split(".")[0] in LIBRARY else "tool"


def tool_of(name: str) -> str:
    """The tool a module belongs to: `eval.studies.report.plots` -> `eval.studies.report`, `scripts.sweep` ->
    itself, a tool folder's own `__init__` -> the folder."""
    folder = max((f for f in TOOL_FOLDERS if name.startswith(f + ".")), key=len, default=None)
    if folder is None:
        return name
    return folder + "." + name[len(folder) + 1:].split(".")[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _package_owners(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Tool package -> the other tools that import it."""
    owners: dict[str, set[str]] = {}
    for name, path in modules.items():
        if layer_of(name) != "tool":
            continue
        for target, _ in imports_of(name, path, modules):
            tool = tool_of(target)
            if (layer_of(target) == "tool" and tool != tool_of(name) and tool in modules
                    and modules[tool].name == "__init__.py"):
                owners.setdefault(tool, set()).add(tool_of(name))
    return owners


def layering_violations(root: Path) -> list[str]:
    """Every broken rule under `root`, one line each, naming the file and line."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    owners = _package_owners(modules)
    problems = []
    for name, path in modules.items():
        where = path.relative_to(root)
        own_packages = {name.rsplit(".", depth)[0] for depth in range(1, name.count(".") + 1)}
        for target, line in imports_of(name, path, modules):
            # Importing a.b.c runs a/__init__ and a/b/__init__ first: those are dependencies too, except the
            # packages holding this very module (already initialised before it runs).
            parents = {target.rsplit(".", depth)[0] for depth in range(1, target.count(".") + 1)}
            graph[name] |= {target} | {p for p in parents if p in modules and p not in own_packages and p != name}
            if layer_of(name) == "library" and layer_of(target) == "tool":
                problems.append(f"{where}:{line}: the library imports the tool {target}")
            elif (layer_of(name) == "tool" and layer_of(target) == "tool" and tool_of(name) != tool_of(target)
                  and len(owners.get(tool_of(target), ())) != 1):
                problems.append(f"{where}:{line}: the tool {name} imports another tool, {target}")
    for component in _cycles(graph):
        problems.append(f"import cycle: {' <-> '.join(component)}")
    return problems


def test_library_below_tools_above_and_no_cycles() -> None:
    assert layering_violations(REPO) == []


def test_the_import_check_catches_each_kind_of_violation(tmp_path) -> None:
    files = {
        "model/__init__.py": "",
        "model/norms.py": "import torch\n\ndef f():\n    from model.kernels import fast\n",
        "model/kernels/__init__.py": "from ..norms import f\n",           # relative import, closing a cycle
        "model/kernels/fast.py": "",
        "trainer/core.py": "from eval.metrics import score\n",              # library -> tool
        "eval/metrics.py": "score = 1\n",
        "eval/report.py": "from scripts import sweep\nfrom trainer import core\n",  # tool -> tool (and library)
        "scripts/sweep.py": "import trainer.core\n",
        "scripts/server/__init__.py": "",
        "scripts/server/app.py": "from scripts.server.protocol import Request\n",  # within one package: fine
        "scripts/server/protocol.py": "Request = dict\n",
        "scripts/serve.py": "from scripts.server.app import Request\n",  # the one command that owns it: fine
        "eval/studies/plots.py": "from eval.studies.report import main\n",  # two tools of one folder
        "eval/studies/report.py": "main = 1\n",
        "eval/studies/tables/__init__.py": "",                            # a package two tools import
        "eval/studies/tables/markdown.py": "",
        "eval/studies/one.py": "from eval.studies.tables import markdown\n",
        "eval/studies/two.py": "from eval.studies.tables.markdown import x\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    problems = layering_violations(tmp_path)
    assert problems == [
        "trainer/core.py:1: the library imports the tool eval.metrics",
        "eval/report.py:1: the tool eval.report imports another tool, scripts.sweep",
        "eval/studies/one.py:1: the tool eval.studies.one imports another tool, eval.studies.tables.markdown",
        "eval/studies/plots.py:1: the tool eval.studies.plots imports another tool, eval.studies.report",
        "eval/studies/two.py:1: the tool eval.studies.two imports another tool, eval.studies.tables.markdown",
        "import cycle: model.kernels <-> model.norms",
    ]


# ------------------------------------------------------------------------------------- one owner per fact
# Cached: each parametrized case below reads every file again (about 400), which took ~40 s of the suite.
@functools.cache
def _string_constants(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}


@functools.cache
def _function_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


@pytest.mark.parametrize(("owner", "names"), [
    ("trainer/run_dir.py", ("run_summary.json", "train_config.yaml", "metrics.jsonl", "trainer_state.json")),
    ("trainer/sweep_dir.py", ("results.jsonl", "sweep_state.json")),
])
def test_file_names_are_spelled_out_by_their_owner_only(owner: str, names: tuple[str, ...]) -> None:
    elsewhere = [f"{path.relative_to(REPO)} spells {name!r}"
                 for path in module_files(REPO).values() if path != REPO / owner
                 for name in names if name in _string_constants(path)]
    assert elsewhere == []
    assert set(names) <= _string_constants(REPO / owner)


@pytest.mark.parametrize(("function", "owner"), [
    ("resolve_path", "trainer/run_dir.py"),        # relative paths start at the repo root
    ("read_jsonl", "trainer/run_dir.py"),          # the torn-line-tolerant reader
    ("read_json", "dataset/json_text.py"),         # the strict reader of JSON held in text
    ("partial_size", "model/rmsnorm_math.py"),     # pRMSNorm's k
    ("causal_lm_loss", "model/model.py"),          # training and validation loss
    ("dpo_loss", "trainer/dpo.py"),                # the preference loss
    ("assistant_labels", "dataset/sft_dataset.py"),  # which tokens SFT, LoRA and DPO learn from
    ("map_jsonl", "dataset/building.py"),          # load -> map -> check of every training dataset
    ("save_model_dir", "trainer/export.py"),       # the model directory every trainer and test writes
    ("model_flops_utilization", "trainer/flops.py"),  # MFU
    ("machine_line", "trainer/machine.py"),        # the machine every benchmark and study names
    ("save_figure", "trainer/figures.py"),         # the tail that saves every study's plots
    ("free_port", "trainer/distributed.py"),       # launchers, servers and tests ask it for a port
    ("write_jsonl", "tests/training_runs.py"),     # the tests' jsonl writer
    ("shown_value", "dataset/shown_value.py"),       # how an error message quotes the value it refuses
    ("flag_refusal", "dataset/shown_value.py"),      # the "--flag=value is not allowed; ..." line
])
def test_shared_rules_are_defined_once(function: str, owner: str) -> None:
    files = [*module_files(REPO).values(), *sorted((REPO / "tests").rglob("*.py"))]
    defined = [str(path.relative_to(REPO)) for path in files if function in _function_names(path)]
    assert defined == [owner]


def _hand_written_refusals(source: str) -> list[str]:
    """The f-strings that write the flag refusal line themselves ("--flag={value} is not allowed"), value unquoted or
    quoted in their own way, rather than through dataset/shown_value.py's flag_refusal: line and quoted expression."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            for before, value, after in zip(node.values, node.values[1:], node.values[2:]):
                if (isinstance(before, ast.Constant) and re.search(r"--\w+=$", before.value)
                        and isinstance(value, ast.FormattedValue) and isinstance(after, ast.Constant)
                        and after.value.startswith(" is not allowed")):
                    found.append(f"line {node.lineno}: {ast.unparse(value)}")
    return found


def test_the_flag_refusal_line_is_written_by_its_owner_only() -> None:
    """dataset/shown_value.py's flag_refusal writes it (the value cut to one short line): a copy quoting the value whole
    made a 5,000-character --threads value a 5,000-character error."""
    found = {str(path.relative_to(REPO)): _hand_written_refusals(path.read_text(encoding="utf-8"))
             for path in module_files(REPO).values()}
    assert {path: lines for path, lines in found.items() if lines} == {}


def test_the_refusal_check_catches_a_hand_written_line() -> None:
    source = ('x = f"--threads={value!r} is not allowed; {allowed}"\n'
              'y = f"--epochs={args.epochs} is not allowed; "  f"lower it"\n'
              'z = f"--lr={shown_value(lr)} is allowed"\n'
              'w = flag_refusal("threads", value, allowed)\n')
    assert _hand_written_refusals(source) == ["line 1: {value!r}", "line 2: {args.epochs}"]


# dataset/shown_value.py's, and trainer/number_text.py's ascii_hint, which quotes none of the value (it says how
# numbers are written)
QUOTERS = ("shown_value", "shown_text", "shown_json", "shown_path", "shown_name", "flag_refusal", "ascii_hint")


def _own_cuts(source: str) -> list[str]:
    """The quotes cut by a rule of their own: `text[:40] + "..."`, or f"{text[:40]}...", rather than by
    dataset/shown_value.py's shown_text (MAX_SHOWN characters)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        pairs = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            pairs = [(node.left, node.right)]
        elif isinstance(node, ast.JoinedStr):
            pairs = [(value.value, after) for value, after in zip(node.values, node.values[1:])
                     if isinstance(value, ast.FormattedValue)]
        for cut, ellipsis in pairs:
            if (isinstance(cut, ast.Subscript) and isinstance(cut.slice, ast.Slice) and cut.slice.upper is not None
                    and isinstance(ellipsis, ast.Constant) and isinstance(ellipsis.value, str)
                    and ellipsis.value.startswith(("...", "…"))):
                found.append((node.lineno, f"line {node.lineno}: {ast.unparse(cut)}"))
    return [line for _, line in sorted(found)]


def test_a_quote_is_cut_by_its_owner_only() -> None:
    """dataset/shown_value.py cuts every quote of a refused value (MAX_SHOWN characters, "..."): a logit_bias key,
    a YAML value, a reward's text and a tokenizer marker's value each had a cut of their own (40 characters, some
    with the length), so the same value was quoted two ways."""
    found = {str(path.relative_to(REPO)): [line.split(": ", 1)[1] for line in
                                           _own_cuts(path.read_text(encoding="utf-8"))]
             for path in module_files(REPO).values()}
    assert {path: lines for path, lines in found.items() if lines} == {"dataset/shown_value.py": [
        "text[:MAX_SHOWN - 3]"]}


def test_the_cut_check_catches_a_cut_of_its_own() -> None:
    source = ('a = json.dumps(key[:40] + "...")\n'
              'b = f"{value[:37]}... ({len(value)} characters)"\n'
              'c = shown_text(value)\n'
              'd = names[:5] + ["and more"]\n')
    assert _own_cuts(source) == ["line 1: key[:40]", "line 2: value[:37]"]


def _own_nodes(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.AST]:
    """The nodes of `function`'s body, less those of the functions (and lambdas) defined in it."""
    nodes, stack = [], list(function.body)
    while stack:
        node = stack.pop()
        nodes.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))
    return nodes


FLAG_REFUSALS = ("ArgumentTypeError", "ArgumentError")  # a flag type's refusal; ToolParser's own (trainer/cli.py)


def _message_of(refusal: ast.Call) -> ast.expr | None:
    """The message a flag refusal is given: ArgumentTypeError(message), ArgumentError(action, message)."""
    name = getattr(refusal.func, "attr", None) or getattr(refusal.func, "id", None)
    given = dict(enumerate(refusal.args)) | {"message": k.value for k in refusal.keywords if k.arg == "message"}
    return given.get(FLAG_REFUSALS.index(name), given.get("message"))


def _message_parts(message: ast.expr, assigned: dict[str, list[ast.expr]], whole: bool = True,
                   seen: frozenset[str] = frozenset()) -> list[tuple[ast.expr, int]]:
    """(expression, conversion) of each value a message puts into its text: an f-string's values, the operands
    of a `+` concatenation that are not literal text, and through a local name the message was built into before
    the raise, the parts of each value it was given. `whole`: the expression is the whole message, where a call
    (not_utf8_at(text, ...), a message written from the value) is its own words unless it is repr."""
    if isinstance(message, ast.JoinedStr):
        return [(value.value, value.conversion) for value in message.values if isinstance(value, ast.FormattedValue)]
    if isinstance(message, ast.BinOp) and isinstance(message.op, ast.Add):
        return _message_parts(message.left, assigned, False, seen) + _message_parts(message.right, assigned, False,
                                                                                      seen)
    if isinstance(message, ast.Name) and message.id in assigned and message.id not in seen:
        return [part for value in assigned[message.id]
                for part in _message_parts(value, assigned, whole, seen | {message.id})]
    if isinstance(message, ast.Constant) or (whole and isinstance(message, ast.Call)
                                             and getattr(message.func, "id", None) != "repr"):
        return []
    return [(message, -1)]


def _raw_flag_quotes(source: str) -> list[str]:
    """The values a flag refusal (a flag type's `raise argparse.ArgumentTypeError(...)`, ToolParser's `raise
    argparse.ArgumentError(action, ...)`) puts into its message unquoted or by repr (!r, repr(), map(repr, ...))
    rather than through a dataset/shown_value.py quoter: any expression of the function's argument (the flag's
    text) or of its local names (what it made of the text), in an f-string, a `+` concatenation, or a message built
    into a local name before the raise (_message_parts)."""
    found = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        nodes = _own_nodes(function)
        arguments = function.args
        given = {a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs}
        given |= {node.id for node in nodes if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
        assigned: dict[str, list[ast.expr]] = {}
        for node in nodes:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None else []
            for target in (target for target in targets if isinstance(target, ast.Name)):
                assigned.setdefault(target.id, []).append(node.value)
        for node in nodes:
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            if (getattr(node.exc.func, "attr", None) or getattr(node.exc.func, "id", None)) not in FLAG_REFUSALS:
                continue
            message = _message_of(node.exc)
            for quoted, conversion in ([] if message is None else _message_parts(message, assigned)):
                if isinstance(quoted, ast.Call) and getattr(quoted.func, "id", None) in QUOTERS and conversion == -1:
                    continue
                names = {name.id for name in ast.walk(quoted) if isinstance(name, ast.Name)}
                if conversion == ord("r") or "repr" in names or names & given:
                    found.append((quoted.lineno, f"line {quoted.lineno}: {ast.unparse(quoted)}"))
    return [line for _, line in sorted(found)]


# Not the user's text, each: what the rule takes for it is the tool's own.
RAW_FLAG_QUOTES_ALLOWED = {
    "trainer/inference_flags.py": ["count - 1"],  # the number of CUDA devices this machine has
    "trainer/cli.py": ["name",      # ToolParser: the flag type's own name (int, float), not the value refused
                       "choices"],  # ToolParser: the flag's allowed values, the tool's, by repr as argparse writes them
}


def test_a_flag_types_refusal_quotes_the_value_through_its_owner() -> None:
    """A flag type's refusal quotes the text it refuses, or what it read from it, through dataset/shown_value.py
    (one line, cut at MAX_SHOWN characters): trainer/cli.py's types quoted it by !r or whole, so a 10,000-character
    value made a 10,000-character error, and a newline split the one line."""
    found = {str(path.relative_to(REPO)): [line.split(": ", 1)[1] for line in
                                           _raw_flag_quotes(path.read_text(encoding="utf-8"))]
             for path in module_files(REPO).values()}
    assert {path: lines for path, lines in found.items() if lines} == RAW_FLAG_QUOTES_ALLOWED


def test_the_flag_quote_check_catches_a_raw_value() -> None:
    source = textwrap.dedent('''\
        def parse(text):
            try:
                value = int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r} is not a number {allowed}") from None
            if value < low:
                raise argparse.ArgumentTypeError(f"{text} is below {low}")
            names = text.split(",")
            raise ArgumentTypeError(f"{', '.join(map(repr, names))}: {shown_value(text)} {shown_text(text)!r}")
        ''')
    assert _raw_flag_quotes(source) == ["line 5: text", "line 7: text", "line 9: ', '.join(map(repr, names))",
                                        "line 9: shown_text(text)"]


def test_the_flag_quote_check_catches_a_message_built_before_the_raise_or_by_concatenation() -> None:
    """The shapes the check once passed over: a message built into a name before the raise, a `+` concatenation,
    and ToolParser's argparse.ArgumentError(action, message); its own words (a call such as not_utf8_at, literal
    text, a quoter) still pass."""
    source = textwrap.dedent('''\
        def parse(text):
            message = f"{text!r} is not a number"
            raise argparse.ArgumentTypeError(message)
        def parse_more(text):
            raise ArgumentTypeError(text + " is not " + repr(allowed) + " nor " + shown_value(text))
        def parse_built(text):
            message = "bad: "
            message += text
            raise ArgumentTypeError(message) from None
        def parse_bare(text):
            raise ArgumentTypeError(text)
        class Parser:
            def _check_value(self, action, value):
                raise argparse.ArgumentError(action, f"invalid choice: {value!r}")
            def _get_value(self, action, arg_string):
                raise ArgumentError(action, message="invalid value: " + arg_string)
        def fine(text, error):
            why = "not valid " + "UTF-8"
            raise ArgumentTypeError(not_utf8_at(text, error.start)) from None
            raise ArgumentTypeError(why)
            raise ArgumentTypeError(f"{shown_text(text)} is " + why)
            raise argparse.ArgumentError(None, "expected " + ALLOWED)
        ''')
    assert _raw_flag_quotes(source) == ["line 2: text", "line 5: repr(allowed)", "line 5: text", "line 8: text",
                                        "line 11: text", "line 14: value", "line 16: arg_string"]

def _parser_constructions(path: Path) -> list[str]:
    """The parser classes a file calls by name: ArgumentParser (argparse's, whatever the import) or ToolParser."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name in ("ArgumentParser", "ToolParser"):
                names.append(name)
    return names


def test_every_command_line_is_parsed_by_the_shared_tool_parser() -> None:
    """A bad flag is one error line (trainer/cli.py's ToolParser), never argparse's page of usage: no tool or
    library module builds an argparse.ArgumentParser of its own."""
    constructions = {str(path.relative_to(REPO)): _parser_constructions(path) for path in module_files(REPO).values()}
    own = [name for name, calls in constructions.items() if "ArgumentParser" in calls and name != "trainer/cli.py"]
    assert own == []
    users = {name for name, calls in constructions.items() if "ToolParser" in calls}
    assert {"trainer/arg_parser.py", "eval/evaluate.py", "scripts/sweep.py", "eval/benchmarks/time_to_loss.py",
            "eval/studies/ablation_report.py"} <= users


def flags_without_help(source: str) -> list[int]:
    """The lines of `add_argument` calls that give no --help text (no help=, or an empty literal one)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            given = {keyword.arg: keyword.value for keyword in node.keywords}
            if None in given:  # **options: the help text is in the mapping
                continue
            text = given.get("help")
            if text is None or (isinstance(text, ast.Constant) and not str(text.value).strip()):
                lines.append(node.lineno)
    return lines


def source_findings(check: Callable[[str], list]) -> dict[str, list]:
    """`check(source)` of every library and tool file, by path, where it finds anything."""
    return {str(path.relative_to(REPO)): found for path in module_files(REPO).values()
            if (found := check(path.read_text(encoding="utf-8")))}


def test_every_flag_says_what_it_does_in_help() -> None:
    assert source_findings(flags_without_help) == {}


def test_the_help_check_catches_a_bare_or_empty_flag() -> None:
    source = textwrap.dedent("""
        parser.add_argument("--a", type=int, help="a count")
        parser.add_argument("--b", type=int)
        group.add_argument("--c", help="")
        parser.add_argument("--d", **spec)
    """)
    assert flags_without_help(source) == [3, 4]


def untyped_public_functions(source: str) -> list[str]:
    """`line name` of each public function or public class's method whose parameters (self and cls aside) or return
    (__init__'s aside) have no type hint."""
    found = []
    for node in ast.parse(source).body:
        functions = [node] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            functions += [item for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for function in functions:
            if function.name.startswith("_") and function.name != "__init__":
                continue
            arguments = [a for a in function.args.posonlyargs + function.args.args + function.args.kwonlyargs
                         if a.arg not in ("self", "cls")]
            if any(a.annotation is None for a in arguments) or \
                    (function.returns is None and function.name != "__init__"):
                found.append(f"{function.lineno} {function.name}")
    return found


def test_public_functions_have_type_hints() -> None:
    assert source_findings(untyped_public_functions) == {}


def test_the_type_hint_check_catches_a_missing_hint() -> None:
    source = textwrap.dedent("""
        def typed(a: int, *, b: str = "") -> int: ...
        def no_return(a: int): ...
        def bare_parameter(a) -> None: ...
        def _private(a): ...
        class Public:
            def __init__(self, a: int): ...
            def method(self, b) -> None: ...
        class _Private:
            def method(self, b): ...
    """)
    assert untyped_public_functions(source) == ["3 no_return", "4 bare_parameter", "8 method"]


# Whole files are written through dataset/atomic_io.py (a kill leaves the old file or the new, never half of one);
# these functions write in place on purpose: into a fresh temp or staging directory that is renamed or dropped
# whole, inside atomic_path's block, or a log streamed as a run goes.
IN_PLACE_WRITERS = {
    ("model/kernels/cuda_build.py", "_ptxas_report"),                  # a temp directory for ptxas
    ("trainer/storage_probe.py", "probe_storage"),                      # a probe file, removed after
    ("trainer/sweep_dir.py", "_write_bytes"),                           # inside atomic_path
    ("scripts/convert_to_llama.py", "_patch_config_json"),              # the staging directory
    ("scripts/convert_to_llama.py", "_tokenizer_files"),                # the staging directory
    ("model/export_dir.py", "staged_dir"),                              # the marker, in the staging directory
    ("scripts/sweep_runner/trial.py", "run_trial"),                     # the trial's streamed log
    ("eval/benchmarks/bench_rollout.py", "engine_module_at"),           # a temp directory
    ("eval/benchmarks/bench_vs_minimind.py", "run_ours"),               # our trainer's streamed log
    ("eval/benchmarks/bench_post_training.py", "fresh_model"),          # a temp directory
    ("eval/benchmarks/bench_post_training.py", "write_data"),           # a temp directory
    ("eval/benchmarks/bench_serve.py", "untrained_default_model"),      # a temp directory
}


def in_place_writes(source: str) -> list[tuple[str, int]]:
    """(enclosing function, line) of each write_text / write_bytes call and each open() for writing."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call):
                name = getattr(child.func, "attr", None) or getattr(child.func, "id", None)
                if name == "open":  # open(path, mode) or path.open(mode)
                    position = 0 if isinstance(child.func, ast.Attribute) else 1
                    mode = next((k.value for k in child.keywords if k.arg == "mode"),
                                child.args[position] if len(child.args) > position else None)
                    if isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax+"):
                        found.append((function, child.lineno))
                elif name in ("write_text", "write_bytes"):
                    found.append((function, child.lineno))
            visit(child, inner)

    visit(ast.parse(source), "<module>")
    return found


def test_whole_files_are_written_atomically() -> None:
    unexpected = {name: kept for name, writes in source_findings(in_place_writes).items()
                  if name != "dataset/atomic_io.py"
                  and (kept := [write for write in writes if (name, write[0]) not in IN_PLACE_WRITERS])}
    assert unexpected == {}


def test_the_atomic_write_check_catches_each_kind_of_write() -> None:
    source = textwrap.dedent("""
        def save(path, text):
            path.write_text(text)
            with open(path, "a") as f:
                f.write(text)
            with path.open(mode="wb") as f:
                pass
            with open(path) as f, path.open("r") as g:
                return f.read()
        blob.write_bytes(b"")
    """)
    assert in_place_writes(source) == [("save", 3), ("save", 4), ("save", 6), ("<module>", 10)]


# The commands that run a model for a while: OpenMP's wait policy must be set before torch loads (trainer/threads.py).
MODEL_RUNNERS = ("trainer/train_pretrain.py", "trainer/train_full_sft.py", "trainer/train_lora.py",
                 "trainer/train_dpo.py", "trainer/train_distillation.py", "trainer/train_grpo.py",
                 "trainer/train_ppo.py", "eval/chat.py", "eval/evaluate.py", "eval/copy_probe.py",
                 "eval/long_context.py", "eval/tool_eval.py", "scripts/serve.py")
BEFORE_TORCH = {"__future__", "sys", "pathlib", "trainer.threads", "trainer.cli"}  # may come before the call


def openmp_waits_problem(source: str) -> str | None:
    """Why the module-level code does not call bound_openmp_waits() before anything that may load torch (trainer.cli's
    begin_command(__name__), which the commands call, calls it)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and \
                getattr(node.value.func, "id", None) in ("bound_openmp_waits", "begin_command"):
            return None
        modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(module not in BEFORE_TORCH for module in modules):
            return f"line {node.lineno} imports {', '.join(modules)} before bound_openmp_waits()"
    return "bound_openmp_waits() is never called at module level"


@pytest.mark.parametrize("tool", MODEL_RUNNERS)
def test_commands_that_run_models_bound_openmp_waits_before_torch_loads(tool: str) -> None:
    assert openmp_waits_problem((REPO / tool).read_text(encoding="utf-8")) is None


def test_what_may_come_before_the_call_loads_no_torch() -> None:
    """trainer.cli comes first in the commands (begin_command, quiet_ctrl_c_while_loading), before torch."""
    import subprocess
    import sys

    check = "import sys, trainer.threads, trainer.cli; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.stdout == "[]\n", result.stderr


def test_the_openmp_waits_check_catches_a_late_call() -> None:
    late = "import sys\nimport torch\nfrom trainer.threads import bound_openmp_waits\nbound_openmp_waits()\n"
    assert openmp_waits_problem(late) == "line 2 imports torch before bound_openmp_waits()"
    assert openmp_waits_problem("import sys\n") == "bound_openmp_waits() is never called at module level"
    begun = "import sys\nfrom trainer.cli import begin_command\nbegin_command(__name__)\nimport torch\n"
    assert openmp_waits_problem(begun) is None
    assert openmp_waits_problem("import numpy\n" + begun) == "line 1 imports numpy before bound_openmp_waits()"


@pytest.mark.parametrize("name", [".venv", "out", "wandb"])
def test_a_virtual_environment_or_output_folder_that_is_a_symlink_is_ignored_too(name: str, tmp_path) -> None:
    """A pattern with a trailing slash matches directories only: a .venv that links to another checkout's was
    committed by `git add -A`, and checking that commit out replaced the real environment with the link."""
    import shutil
    import subprocess
    shutil.copy(REPO / ".gitignore", tmp_path / ".gitignore")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / name).symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    ignored = subprocess.run(["git", "check-ignore", "-q", name], cwd=tmp_path)
    assert ignored.returncode == 0, f"{name} (a symlink) is not ignored by .gitignore"
