"""The documents stay true to the tree: the README is a short front door whose test command is CI's, every link
and every command path in README.md and docs/ exists, and every design document the code cites is in the repo."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tests.paths import REPO

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
