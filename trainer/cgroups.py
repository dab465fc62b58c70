"""This process's Linux control groups: which limit files hold for it.

A limit set on a control group holds for every group below it, so the files that count are those of the process's
own group and of each group above it, up to the root. The group is the path /proc/self/cgroup names (a batch job's
or a service's, not the root's, whose files often say "no limit"): cgroup v2 names one unified hierarchy
("0::/path"), v1 one line per controller ("4:memory:/path", "3:cpu,cpuacct:/path"). A container with a cgroup
namespace sees "/" and its root files are its own; one without sees a path its mount lacks, whose files are absent
and skipped by the readers, down to the root's.

Two readers use it: trainer/machine.py (the memory limit) and trainer/threads.py (the CPU quota); this module
imports nothing heavy, since threads.py runs before torch is imported."""

from __future__ import annotations

from pathlib import Path

SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
V2 = ""  # the unified hierarchy's name in /proc/self/cgroup (an empty controller list) and its mount under the root


def own_group_files(hierarchy_files: tuple[tuple[str, str], ...], self_cgroup: Path = SELF_CGROUP,
                    root: Path = CGROUP_ROOT) -> tuple[Path, ...]:
    """The paths of each (hierarchy, file name) in `hierarchy_files` for this process's group and each group above
    it, the group's own first: a hierarchy is V2 or a v1 controller ("memory", "cpu"), mounted at root/hierarchy.
    Files that do not exist are listed too (the reader skips them)."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    groups = {hierarchy: "/" for hierarchy, _ in hierarchy_files}  # a hierarchy -> this process's group there
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and not controllers:
            groups[V2] = path
        for controller in controllers.split(","):
            if controller and controller in groups:
                groups[controller] = path
    files = []
    for hierarchy, name in hierarchy_files:
        parts = [part for part in groups[hierarchy].strip().split("/") if part not in ("", ".")]
        if ".." in parts:  # a group outside this namespace's root: its root's files are all that can be read
            parts = []
        files += [root.joinpath(hierarchy, *parts[:depth], name) for depth in range(len(parts), -1, -1)]
    return tuple(files)


def read_limit_text(path: Path) -> str | None:
    """A limit file's text, stripped; None where it is absent or unreadable."""
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
