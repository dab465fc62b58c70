"""Reading a YAML file a user wrote (a trainer's --config, a sweep): PyYAML's safe loader, less a mapping key given
twice, which PyYAML resolves silently by keeping the last -- a learning rate or a swept parameter written twice
would use one of them without a word; YAML's merge key (``<<: *base``) is not a key given twice. Every failure is a
ValueError of one line naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from dataset.atomic_io import read_text_file, special_file_kind
from dataset.shown_value import shown_text


_MERGE_TAG = "tag:yaml.org,2002:merge"

# The most values (scalars, lists, mappings) a file may hold with its aliases expanded. An alias is one node shared,
# so nine lines of `&b [*a, *a, ...]` build 43 million values in no time; what walks them as a tree later (a sweep's
# schema and flag checks) took a minute, one level more ten. No config or sweep comes near this many.
MAX_VALUES = 100_000
MAX_YAML_CHARS = 16 << 20  # a config or sweep of MAX_VALUES values is a few MB; /dev/zero is endless


class _UniqueKeyLoader(yaml.SafeLoader):
    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()  # id() of the mapping nodes whose keys were checked, as written

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # PyYAML resolves a merge key by writing the merged mapping's pairs into the merging node's own list, and
        # does so to a merged mapping that merges in turn as soon as the first mapping merging it is built, which
        # may come before that mapping itself is built: its keys are checked here, before they are rewritten, or a
        # key overriding one it merges would read as a key given twice.
        self._check_unique_keys(node)
        super().flatten_mapping(node)

    def _check_unique_keys(self, node: yaml.MappingNode) -> None:
        if id(node) in self._checked:
            return
        self._checked.add(id(node))
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:  # `<<: *base` merges another mapping, whose keys a key here overrides
                continue  # (YAML's merge key): the safe loader's flatten_mapping resolves it after this check
            key = self.construct_object(key_node)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: PyYAML refuses it itself
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {json.dumps(key, default=str)} (line {key_node.start_mark.line + 1})")
            seen.add(key)

    def construct_document(self, node: yaml.Node) -> Any:
        self._count_values(node, {}, set())
        return super().construct_document(node)

    def _count_values(self, node: yaml.Node, counted: dict[int, int], open_nodes: set[int]) -> int:
        """How many values `node` holds with its aliases expanded (`counted`: each shared node's count, so a shared
        node is walked once); a ConstructorError at the node past MAX_VALUES, or at an alias inside the value it
        names (`&a [*a]`: a value that holds itself, which every walk of it followed until Python's recursion
        limit -- a RecursionError traceback from a sweep's checks)."""
        key = id(node)
        if key in counted:
            return counted[key]
        if key in open_nodes:
            raise yaml.constructor.ConstructorError(
                None, None, "an alias names a value that holds the alias itself (a value that contains itself)",
                node.start_mark)
        open_nodes.add(key)
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            children = []
        count = 1 + sum(self._count_values(child, counted, open_nodes) for child in children)
        open_nodes.discard(key)
        if count > MAX_VALUES:
            raise yaml.constructor.ConstructorError(
                None, None, f"this value holds more than {MAX_VALUES:,} values once its aliases (*name) are "
                            f"expanded; no config needs so many: write the values out", node.start_mark)
        counted[key] = count
        return count

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        # PyYAML's scalar constructors fail as Python does on a value its patterns let through (2001-02-30 is a
        # date by the pattern; `!!bool x`, `!!timestamp x`, an integer of 5,000 digits): a ValueError with no file
        # or line, or a KeyError or AttributeError traceback. Each becomes an error at the value's line.
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as error:
            kind = node.tag.rsplit(":", 1)[-1]
            # Python's reason helps for a date (day is out of range for month); for a number it repeats the value.
            detail = f" ({error})" if kind == "timestamp" and isinstance(error, ValueError) else ""
            value = str(node.value)
            shown = shown_text(json.dumps(value, ensure_ascii=False))  # the text as written, cut as every quote is
            raise yaml.constructor.ConstructorError(None, None, f"{shown} is not a valid {kind}{detail}",
                                                    node.start_mark) from None


def read_yaml(path: Path, what: str = "a YAML file") -> Any:
    """The value of the YAML file `path` (`what` it should be, for the message when it is a directory); a
    ValueError ``"{path}: {reason}"`` when it cannot be read, is not UTF-8, is not YAML or gives a key twice, or is
    not a regular file: a FIFO (a pipe) is refused before it is opened, where opening one nobody writes to waited
    for ever (a run that never started, without a word), and a device (/dev/zero) is no file either."""
    if (kind := special_file_kind(path)) not in (None, "a folder"):  # a folder: read_text_file's own words
        raise ValueError(f"{path}: is {kind}, not a regular file; {what} must be a regular file (write it to one "
                         f"first)")
    text = read_text_file(path, what, MAX_YAML_CHARS)
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a safe loader)
    except yaml.constructor.ConstructorError as error:
        mark = error.problem_mark  # None where the problem names its line itself (a duplicate key)
        raise ValueError(f"{path}: {error.problem}" + (f" (line {mark.line + 1})" if mark else "")) from None
    except RecursionError:  # PyYAML composes a value by recursion: a few thousand brackets deep exhaust it
        raise ValueError(f"{path}: invalid YAML (nested too deeply)") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: invalid YAML ({error})".replace("\n", " ")) from None
