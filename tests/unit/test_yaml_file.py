"""trainer/yaml_file.py's read_yaml against PyYAML's safe loader: the same values wherever no mapping key is given
twice, YAML's merge keys included, and a key given twice refused with its line."""

from __future__ import annotations

import re

import pytest
import yaml

from trainer.yaml_file import MAX_VALUES, read_yaml

# A mapping that merges and overrides (`variant`), merged in turn by a mapping (`run`) the loader builds first:
# `variant` sits a level deeper, and PyYAML builds a document's mappings level by level.
NESTED_MERGE = ("group:\n  base: &base\n    lr: 1\n    wd: 0\n  variant: &variant\n    <<: *base\n    lr: 2\n"
                "run:\n  <<: *variant\n  seed: 3\n")


@pytest.mark.parametrize("text", [
    NESTED_MERGE,
    "base: &base {lr: 1, wd: 0}\nrun:\n  <<: *base\n  lr: 2\n",
    "a: &a {x: 1}\nb: &b {x: 2, y: 2}\nc:\n  <<: [*a, *b]\n  z: 3\n",  # a list of mappings: the first one's x
])
def test_merge_keys_read_as_the_safe_loader_reads_them(tmp_path, text):
    path = tmp_path / "merge.yaml"
    path.write_text(text)
    assert read_yaml(path) == yaml.safe_load(text)


def test_the_nested_merge_gives_each_mapping_its_own_keys_over_the_merged_ones(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text(NESTED_MERGE)
    assert read_yaml(path) == {"group": {"base": {"lr": 1, "wd": 0}, "variant": {"lr": 2, "wd": 0}},
                               "run": {"lr": 2, "wd": 0, "seed": 3}}


def test_a_key_given_twice_in_a_merged_mapping_is_still_refused_with_its_line(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text(NESTED_MERGE.replace("    lr: 2\n", "    lr: 2\n    lr: 4\n"))
    with pytest.raises(ValueError, match=re.escape(f'{path}: duplicate key "lr" (line 8)')):
        read_yaml(path)


# Nine levels of nine aliases each: 9**9 values in a file of ten lines, which PyYAML builds at once (one shared list
# per level); a sweep's checks, walking it as a tree, ran for minutes.
ALIAS_BOMB = "top: &l0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"l{level}: &l{level} [{', '.join([f'*l{level - 1}'] * 9)}]\n" for level in range(1, 9))


def test_aliases_that_expand_past_the_limit_are_refused_with_the_line(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(ALIAS_BOMB)
    # 9**6 values from the value of line 6 on: the first past MAX_VALUES
    with pytest.raises(ValueError, match=re.escape(f"{path}: this value holds more than {MAX_VALUES:,} values once "
                                                   f"its aliases (*name) are expanded; no config needs so many: "
                                                   f"write the values out (line 6)")):
        read_yaml(path)


def test_aliases_within_the_limit_read_as_the_safe_loader_reads_them(tmp_path):
    path = tmp_path / "aliases.yaml"
    text = "\n".join(ALIAS_BOMB.splitlines()[:5]) + "\n"  # 9**5 = 59,049 values
    path.write_text(text)
    assert read_yaml(path) == yaml.safe_load(text)


def test_a_value_that_holds_itself_is_refused_with_the_line(tmp_path):
    # the safe loader builds it (a list inside itself); a sweep's checks followed it to a RecursionError traceback
    path = tmp_path / "recursive.yaml"
    path.write_text("parameters:\n  seed:\n    values: &x [1, *x]\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}: an alias names a value that holds the alias itself (a "
                                                   f"value that contains itself) (line 3)")):
        read_yaml(path)


def test_a_file_past_the_size_limit_is_refused_unread(tmp_path, monkeypatch):
    """--config /dev/zero read forever (the run killed for memory after half a minute): a YAML file is read up to
    MAX_YAML_CHARS and refused past it, in one line naming the file and the limit."""
    import trainer.yaml_file

    monkeypatch.setattr(trainer.yaml_file, "MAX_YAML_CHARS", 100)
    path = tmp_path / "big.yaml"
    path.write_text("a: " + "x" * 100 + "\n")
    with pytest.raises(ValueError) as refused:
        read_yaml(path)
    assert str(refused.value) == f"{path}: holds more than 100 characters; no YAML file this project reads is so long"
    path.write_text("a: " + "x" * 96)  # 99 characters: read
    assert read_yaml(path) == {"a": "x" * 96}
    monkeypatch.undo()  # an endless device is no file at all: refused before it is read (test_args' FIFO case)
    with pytest.raises(ValueError, match="^/dev/zero: is a device, not a regular file"):
        read_yaml(trainer.yaml_file.Path("/dev/zero"))
