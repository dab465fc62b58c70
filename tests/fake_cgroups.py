"""A fake cgroup tree for the tests of trainer/cgroups.py's readers (the memory limit, the CPU quota)."""

from __future__ import annotations

from pathlib import Path


def fake_cgroups(tmp_path: Path, groups: str, files: dict[str, str]) -> tuple[Path, Path]:
    """(/proc/self/cgroup's stand-in holding `groups`, absent where empty; the cgroup mount's stand-in holding
    `files`, paths relative to it)."""
    root, self_cgroup = tmp_path / "cgroup", tmp_path / "self_cgroup"
    if groups:
        self_cgroup.write_text(groups)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return self_cgroup, root
