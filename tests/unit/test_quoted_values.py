"""Error lines that quote a value a user gave (a flag, a field of a data, YAML, JSON or state file, what a user's
reward function returned) quote it through dataset/shown_value.py: on one line and cut at MAX_SHOWN characters.
Each site here quoted by its own repr (!r) or whole, so a value of 10,000 characters made an error of 10,000, and
one printed whole with a newline split the one line. (The flag types' refusals: tests/unit/test_cli.py; that no
flag type or cut of a quote is written elsewhere again: tests/unit/test_layout.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dataset.shown_value import MAX_SHOWN

LONG = "x" * 10_000
BOUND = 300  # the message's own words and a quote or two cut at MAX_SHOWN (60) characters


def _one_short_line(error: BaseException, words: str, also: str = "") -> str:
    """The error's message, checked: one line, holding `words`, no longer than BOUND (plus `also`, a path it
    names)."""
    message = str(error)
    assert "\n" not in message and words in message, message[:500]
    assert len(message) <= BOUND + len(also), message[:500]
    return message


def _cut(text: str) -> str:
    """`text`'s repr as dataset/shown_value.py cuts it, written out: the first 57 characters, then "..."."""
    quoted = repr(text)
    return quoted if len(quoted) <= MAX_SHOWN else quoted[:MAX_SHOWN - 3] + "..."


@pytest.mark.parametrize("text", [LONG, "q_proj,\n" + LONG, "q_proj,a\nb"])
def test_a_lora_targets_refusal_is_one_short_line(text):
    from model.lora import parse_targets

    with pytest.raises(ValueError) as refused:
        parse_targets(text)
    message = _one_short_line(refused.value, " is not a projection of the model; choose from ")
    assert message.startswith(f"--lora_targets={_cut(text)}: ")


@pytest.mark.parametrize("spec, words", [
    (LONG, "expected path/to/file.py:function or a built-in"),
    ("a\n" + LONG + ".py:f", "File name too long"),  # was OSError's traceback
    # was RuntimeError's traceback; left as typed, as a shell leaves it (trainer/run_dir.py, _expand)
    ("~no-such-user-h63/reward.py:f", ": no file {repo}/~no-such-user-h63/reward.py"),
    ("{tmp}/missing.py:" + "f" * 10_000, ": no file {tmp}/missing.py"),  # the file named whole, as paths are
    ("{user}:" + "f" * 10_000 + "\nx", " defines no function 'fff"),
])
def test_a_reward_spec_refusal_is_one_short_line(spec, words, tmp_path):
    from trainer.rewards import load_reward

    user = tmp_path / "reward.py"
    user.write_text("def f(prompts, completions, **columns):\n    return [0.0] * len(completions)\n")
    from trainer.run_dir import REPO_ROOT

    spec, words = spec.format(tmp=tmp_path, user=user), words.format(tmp=tmp_path, repo=REPO_ROOT)
    with pytest.raises(ValueError) as refused:
        load_reward(spec)
    message = _one_short_line(refused.value, words, also=2 * str(user))
    assert message.startswith(f"--reward {_cut(spec)}: ")


@pytest.mark.parametrize("returned", [LONG, [1.0] * 10_000, "a\nb"])
def test_a_reward_functions_value_that_is_no_number_is_one_short_line(returned):
    from trainer.rewards import Reward, RewardError, score

    reward = Reward("mine", lambda prompts, completions, **columns: [returned, 1.0], 1.0)
    with pytest.raises(RewardError) as refused:
        score([reward], ["p", "q"], ["a", "b"], {})
    assert _one_short_line(refused.value, " for completion 0, not a number or None") == (
        f"reward mine: returned {_cut(returned)} for completion 0, not a number or None")


@pytest.mark.parametrize("key", [LONG, "a\nb" * 5_000])
def test_an_unknown_config_key_is_one_short_line(key, tmp_path):
    from trainer.arg_yaml import load_yaml_config
    from trainer.args import args_from_run_config

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({key: 1}), encoding="utf-8")  # a long key as YAML's explicit "? key"
    with pytest.raises(ValueError) as refused:
        load_yaml_config(config)
    _one_short_line(refused.value, f"unknown key {_cut(key)}; allowed keys are the trainer's flags", str(config))
    with pytest.raises(ValueError) as refused:
        args_from_run_config({key: 1})
    _one_short_line(refused.value, f"run config: unknown key {_cut(key)}; expected the trainer's flags")


@pytest.mark.parametrize("role", [LONG, "a\nb" * 5_000])
def test_a_messages_unknown_role_is_one_short_line(role):
    from dataset.chat_format import normalize_messages

    with pytest.raises(ValueError) as refused:
        normalize_messages([{"role": role, "content": "hi"}])
    _one_short_line(refused.value, f"messages[0].role is {_cut(role)}; a role is one of ")


@pytest.mark.parametrize("value", [LONG, "1\n2" * 5_000])
def test_a_records_value_that_is_no_number_is_one_short_line(value):
    from trainer.run_dir import record_number

    with pytest.raises(ValueError) as refused:
        record_number({"step": value, "loss": value}, "loss")
    assert _one_short_line(refused.value, ", expected a number") == (
        f"the record of step {_cut(value)}: loss is {_cut(value)}, expected a number")


@pytest.mark.parametrize("field", ["trial_id", "status"])
@pytest.mark.parametrize("value", ["../" + LONG, "a\nb" * 5_000])
def test_a_sweep_states_bad_trial_field_is_one_short_line(field, value, tmp_path):
    from trainer.sweep_dir import SWEEP_STATE_FILE, read_state

    trial = {"trial_id": "t0", "params": {}, "status": "pending", field: value}
    (tmp_path / SWEEP_STATE_FILE).write_text(json.dumps({"name": "s", "config": {}, "trials": [trial]}))
    with pytest.raises(ValueError) as refused:
        read_state(tmp_path)
    _one_short_line(refused.value, f"trials[0].{field}: expected ", str(tmp_path))
    assert str(refused.value).endswith(f", got {_cut(value)}")


@pytest.mark.parametrize("name", [LONG, "a\nb" * 5_000])
def test_a_sweep_folder_of_another_sweep_is_one_short_line(name, tmp_path):
    from scripts.sweep_runner.errors import SweepConfigError
    from scripts.sweep_runner.recording import load_state
    from trainer.sweep_dir import SWEEP_STATE_FILE

    (tmp_path / SWEEP_STATE_FILE).write_text(json.dumps({"name": name, "config": {"a": 1}, "trials": []}))
    with pytest.raises(SweepConfigError) as refused:
        load_state(tmp_path, "mine", {"a": 2})
    _one_short_line(refused.value, f"holds sweep {_cut(name)} with a different config", str(tmp_path))


@pytest.mark.parametrize("shard", ["../" + LONG, "a/\nb" * 5_000])
def test_an_import_index_naming_a_shard_outside_the_folder_is_one_short_line(shard, tmp_path):
    from model.interop import NotImportable, _weight_files

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(NotImportable) as refused:
        _weight_files(Path(tmp_path))
    _one_short_line(refused.value, f"names the shard {_cut(shard)}, which is not a file in that folder",
                    str(tmp_path))


@pytest.mark.parametrize("norm_type", [LONG, "a\nb" * 5_000])
def test_an_import_norm_type_refusal_is_one_short_line(norm_type, tmp_path):
    from model.interop import mininorm_config_from

    with pytest.raises(ValueError) as refused:
        mininorm_config_from({}, tmp_path, norm_type=norm_type)
    _one_short_line(refused.value, f"--norm_type {_cut(norm_type)} is not allowed; choose one of ")


@pytest.mark.parametrize("value", [LONG, "1\n2"])
def test_a_sweeps_only_value_not_in_the_grid_is_one_short_line(value):
    from scripts.sweep_runner.config import parse_only
    from scripts.sweep_runner.errors import SweepConfigError

    config = {"method": "grid", "parameters": {"seed": {"values": [1, 2, 3]}}}
    with pytest.raises(SweepConfigError) as refused:
        parse_only(config, [f"seed={value}"])
    _one_short_line(refused.value, ": not in the grid; allowed: 1, 2, 3")


@pytest.mark.parametrize("holder, words", [
    ("k" * 150 + "\nsecond line", f"(held by {_cut('k' * 150)}; lock file "),  # the file's first 200 bytes are read
    ("42@node\n" + "h" * 150, f"(pid 42 on host node {'h' * 52}...; lock file "),
    ("9" * 150 + "@node", f"(pid {'9' * 57}... on host node; lock file "),  # a damaged file's digits: cut too
    ("another tool\nits second line", "(held by 'another tool'; lock file "),  # the first line alone
])
def test_a_folder_locks_holder_is_quoted_on_one_short_line(holder, words, tmp_path):
    import fcntl
    import os

    from dataset.atomic_io import folder_lock

    lock = tmp_path / ".lock"
    lock.write_text(holder)
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: the lock below is refused
        with pytest.raises(ValueError) as refused, folder_lock(tmp_path, ".lock", 0.0, "another save into it"):
            pass
    finally:
        os.close(fd)
    _one_short_line(refused.value, words, 2 * str(tmp_path))


def _cut_name(name: str) -> str:
    """A key a user wrote as dataset/shown_value.py's shown_name names a field by it, written out: its control
    characters escaped as repr escapes them (these names hold no quote or backslash), cut as _cut cuts."""
    escaped = repr(name)[1:-1]
    return escaped if len(escaped) <= MAX_SHOWN else escaped[:MAX_SHOWN - 3] + "..."


HOSTILE_NAMES = [LONG, "a\nb" * 5_000, "seed\r\x1b[2J"]  # long; a newline in each of its lines; \r and an escape code


@pytest.mark.parametrize("name", HOSTILE_NAMES)
@pytest.mark.parametrize("where", ["parameter", "spec key", "top-level key"])
def test_a_sweep_yamls_key_in_a_refusal_is_one_short_line(name, where):
    """A sweep YAML's parameter name, a key of a parameter's spec and a top-level key wandb's schema lacks are named
    in the refusal's field (`parameters.<name>.values`), each was printed whole (a 5,000-character prefix, or one
    split over lines; the last by wandb's own message)."""
    from scripts.sweep_runner.config import validate_sweep_config
    from scripts.sweep_runner.errors import SweepConfigError
    from sweeps.config.cfg import validator  # wandb's schema: the top-level keys it allows

    config = {"method": "grid", "program": "never_run.py", "parameters": {"seed": {"values": [1]}}}
    if where == "parameter":
        config["parameters"] = {name: 5}
        words = f"sweep config: parameters.{_cut_name(name)}: expected a mapping such as "
    elif where == "spec key":
        config["parameters"] = {"seed": {"values": [1], name: 2}}
        words = f"sweep config: parameters.seed.{_cut_name(name)}: not a key of a parameter spec; allowed: value, "
    else:
        config[name] = 1
        words = f"sweep config: {_cut_name(name)}: not a key wandb's sweep schema allows here; allowed: "
    with pytest.raises(SweepConfigError) as refused:
        validate_sweep_config(config)
    message = _one_short_line(refused.value, words, also=", ".join(validator.schema["properties"]))
    assert message.startswith(words)


@pytest.mark.parametrize("value", [LONG, "1\n2" * 5_000])
def test_a_sweep_yamls_value_wandbs_schema_refuses_is_one_short_line(value):
    """wandb's schema message quotes the value it refuses by repr, whole: here by shown_value, after its field."""
    from scripts.sweep_runner.config import validate_sweep_config
    from scripts.sweep_runner.errors import SweepConfigError

    config = {"method": "grid", "program": "never_run.py", "parameters": {"seed": {"values": [1]}}, "run_cap": value}
    with pytest.raises(SweepConfigError) as refused:
        validate_sweep_config(config)
    assert _one_short_line(refused.value, " is not of type ") == (
        f"sweep config: run_cap: {_cut(value)} is not of type 'integer'")


@pytest.mark.parametrize("junk", [LONG, "a\nb" * 5_000])
def test_a_chat_template_that_renders_something_else_is_one_short_line(tokenizer, junk):
    """dataset/chat_format.py's probe rendering of an edited chat_template was quoted whole by repr (a template
    writing 10,000 characters made a 10,000-character error); it is quoted from where it leaves ChatML, cut."""
    import copy

    from dataset.chat_format import check_chatml_tokenizer

    edited = copy.deepcopy(tokenizer)
    edited.chat_template = "<|im_start|>" + junk  # ChatML's first turn goes on "<|im_start|>system\n"
    with pytest.raises(ValueError) as refused:
        check_chatml_tokenizer(edited)
    message = _one_short_line(refused.value, "the tokenizer's chat_template is not MiniNorm's ChatML")
    assert f" it renders {_cut(junk)} at character 12, where ChatML has 'system\\n" in message


@pytest.mark.parametrize("component", ["a" * 300, "a\nb" * 100, "é" * 128])  # over 255 bytes (é is two)
def test_an_out_dir_with_a_name_over_255_bytes_is_one_line_naming_the_flag(component, tmp_path):
    """A folder flag (--out_dir, --sweep_dir, --records_dir) with a component the system will not look up was
    OSError's traceback (File name too long) from dataset/atomic_io.py's check_folder_path; it is the flag's one
    line, the path whole (as paths are named) with its newline escaped."""
    from trainer.run_dir import check_out_dir

    out_dir = tmp_path / "runs" / component / "run"
    with pytest.raises(ValueError) as refused:
        check_out_dir(out_dir, {})
    shown = str(out_dir).replace("\n", "\\n")
    assert _one_short_line(refused.value, " cannot name a folder ", also=shown) == (
        f"--out_dir {shown} cannot name a folder (File name too long)")


def test_an_out_dir_longer_than_a_path_may_be_is_cut(tmp_path):
    from trainer.run_dir import check_out_dir

    out_dir = tmp_path / "/".join(["d" * 200] * 50)  # 10,050 characters: over PATH_MAX, cut as a quote is
    with pytest.raises(ValueError) as refused:
        check_out_dir(out_dir, {})
    assert _one_short_line(refused.value, " cannot name a folder ") == (
        f"--out_dir {str(out_dir)[:MAX_SHOWN - 3]}... cannot name a folder (File name too long)")


def test_a_cache_dir_with_a_name_over_255_bytes_is_one_line_naming_the_flag(tmp_path, capsys):
    """dataset/atomic_io.py's make_dirs (a cache folder) raised OSError's traceback; `python dataset/corpus.py
    --cache_dir` names the flag."""
    from dataset.corpus import main

    cache = tmp_path / ("c" * 300)
    with pytest.raises(SystemExit) as exit_info:
        main(["--cache_dir", str(cache)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        f"error: --cache_dir {cache} cannot name a folder (File name too long)")


def test_a_sweep_name_over_255_characters_is_refused_before_its_folder_is_made():
    """The sweep's folder is out/sweeps/<name>: a 300-character name was OSError's traceback at its mkdir."""
    from scripts.sweep_runner.config import validate_sweep_config
    from scripts.sweep_runner.errors import SweepConfigError

    name = "s" * 300
    config = {"name": name, "method": "grid", "program": __file__, "parameters": {"seed": {"values": [1]}}}
    with pytest.raises(SweepConfigError) as refused:
        validate_sweep_config(config)
    assert _one_short_line(refused.value, " is not a folder name ") == (
        f"sweep config: name: {_cut(name)} is not a folder name (letters, digits, '.', '_', '=', '-'; at most 255 "
        f"characters)")
    config["name"] = "s" * 255
    validate_sweep_config(config)  # the longest the system takes
