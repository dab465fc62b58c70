"""trainer/run_dir.py's own logic, pinned where only the integration tests (real runs) reached it: exit codes, the
final metric a sweep reads, checkpoint names and their order, the jsonl records' places, what a previous run left,
which model a tool loads and the one line that says why none."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from trainer import run_dir
from trainer.run_dir import (ModelNotFound, append_jsonl, check_out_dir, checkpoint_step, clear_previous_run,
                             exit_code_of, final_metric, is_count, list_checkpoints, locate_model,
                             locate_model_and_adapter, model_task, previous_run, read_jsonl, read_metrics,
                             read_summary, record_number, skipped_lines_note)


def _model(folder: Path, config: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    if config is not None:
        (folder / "train_config.yaml").write_text(config)
    return folder


def _checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    folder = root / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True)
    if complete:
        (folder / "trainer_state.json").write_text("{}")
    return folder


def test_a_child_killed_by_a_signal_exits_as_a_shell_reports_it():
    assert [exit_code_of(code) for code in (0, 3, -2, -13, -9)] == [0, 3, 130, 141, 137]


def test_the_final_metric_is_read_where_the_summary_holds_it_and_only_when_finite():
    summary = {"final_val": {"loss": 2.5, "perplexity": float("nan"), "reward_accuracy": True},
               "tokens_per_s": 1200}
    assert final_metric(summary, "val_loss") == final_metric(summary, "final/val_loss") == 2.5
    assert final_metric(summary, "final/tokens_per_s") == 1200
    assert final_metric(summary, "val_ppl") is None  # NaN would poison a bayes search
    assert final_metric(summary, "val_reward_accuracy") is None  # a bool is not a number
    assert final_metric(summary, "val_bpb") is None and final_metric({}, "val_loss") is None
    assert final_metric(summary, "no_such_metric") is None


def test_checkpoints_are_listed_by_step_and_only_when_complete(tmp_path):
    assert checkpoint_step("step_00000120") == 120
    assert [checkpoint_step(name) for name in ("step_", "step_12a", "stepp_1", ".tmp_step_00000001")] == [None] * 4
    assert list_checkpoints(tmp_path / "checkpoints") == []
    for step in (100, 9, 1000):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 2000, complete=False)  # a save or removal cut short
    (tmp_path / "checkpoints" / "notes").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == [
        "step_00000009", "step_00000100", "step_00001000"]
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints" / "step_00000009")] == []


def test_counts_read_from_files_are_integers_not_bools():
    assert is_count(0) and is_count(1, least=1) and not is_count(0, least=1)
    assert not is_count(True) and not is_count(2.0) and not is_count(-1) and not is_count("3")


def test_jsonl_records_know_their_line_and_a_torn_line_is_skipped_then_ended(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "split": "train"}\n\n[1, 2]\n{"step": 2, "split": "val"}\n{"step": 3, "spl')
    notes: list[str] = []
    records = read_jsonl(path, notes.append)
    assert records == [{"step": 1, "split": "train"}, {"step": 2, "split": "val"}]
    assert [r.where for r in records] == [f"{path}:1", f"{path}:4"]
    # the torn last line, which a writer may be writing, is skipped without a note; the line before it that is no
    # record is noted (a blank line is neither)
    assert notes == [f"note: {path}: 1 line skipped, torn or damaged (line 3); the rest is read"]
    append_jsonl(path, {"step": 3, "split": "train"})  # after a writer killed mid-line
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3] and read_jsonl(path)[-1].where == f"{path}:6"
    notes.clear()
    assert len(read_metrics(path, note_skipped=notes.append)) == 3  # the torn line, ended now, is in the middle
    assert notes == [f"note: {path}: 2 lines skipped, torn or damaged (lines 3, 5); the rest is read"]
    assert skipped_lines_note(path, range(1, 8)) == (f"note: {path}: 7 lines skipped, torn or damaged (lines 1, 2, "
                                                     f"3, 4, 5, ...); the rest is read")
    append_jsonl(path, {"split": "diag"})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]  # a run directory: its metrics.jsonl
    assert [r["step"] for r in read_metrics(path, "train")] == [1, 3]
    with pytest.raises(ValueError, match=rf"^{path}:4: split is 'val', expected a number$"):
        record_number(records[1], "split")
    with pytest.raises(ValueError, match=r"^the record of step 7: loss is \[\], expected a number$"):
        record_number({"step": 7, "loss": []}, "loss")
    with pytest.raises(ValueError, match=r"^the record of step 7: loss is True, expected a number$"):
        record_number({"step": 7, "loss": True}, "loss")  # float(True) read a hand-edited true as a loss of 1
    assert math.isnan(record_number({"step": 7, "loss": None}, "loss"))  # strict_json's null for a non-finite float
    with pytest.raises(ValueError, match=r"^the record of step 7: tokens is None, expected a number$"):
        record_number({"step": 7, "tokens": None}, "tokens", int)
    assert record_number({"n": "3"}, "n", int) == 3


@pytest.mark.parametrize("content", ["[1]", "{", b"\xff\xfe", None])
def test_a_summary_that_cannot_be_read_as_an_object_is_none(tmp_path, content):
    if isinstance(content, bytes):
        (tmp_path / "run_summary.json").write_bytes(content)
    elif content is not None:
        (tmp_path / "run_summary.json").write_text(content)
    assert read_summary(tmp_path) == {}


def test_a_previous_run_is_named_by_its_model_files_and_newest_checkpoint_and_cleared_without_the_tokenizer(tmp_path):
    assert previous_run(tmp_path) is None
    for step in (20, 100):
        _checkpoint(tmp_path, step)
    assert previous_run(tmp_path) == "checkpoints (checkpoints/step_00000100)"
    _model(tmp_path)
    (tmp_path / "run_summary.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert previous_run(tmp_path) == ("a finished model (run_summary.json, config.json, model.safetensors) and "
                                      "checkpoints (checkpoints/step_00000100)")
    assert clear_previous_run(tmp_path) == ["checkpoints", "run_summary.json", "config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json"] and previous_run(tmp_path) is None


def test_a_models_task_is_its_recorded_one_else_guessed_from_its_name(tmp_path):
    assert model_task(_model(tmp_path / "a", "task: dpo\n")) == "dpo"
    assert model_task(_model(tmp_path / "b", "task: distill\ndistill_data: pretrain\n")) == "pretrain"
    assert model_task(_model(tmp_path / "c", "task: distill\ndistill_data: sft\n")) == "distill"
    assert model_task(_model(tmp_path / "My-Chat")) == "sft"
    assert model_task(_model(tmp_path / "pretrain-1")) == "pretrain"
    assert model_task(_model(tmp_path / "weights", "task: bogus\n")) is None


def test_a_recorded_config_that_is_not_utf8_is_refused_naming_the_file(tmp_path):
    """eval/chat.py on such a model said "error: 'utf-8' codec can't decode byte 0xff ...", naming no file."""
    folder = _model(tmp_path / "m")
    (folder / "train_config.yaml").write_bytes(b"task: sft\n\xff\n")
    with pytest.raises(ValueError) as refused:
        model_task(folder)
    assert str(refused.value) == f"{folder / 'train_config.yaml'}: not valid UTF-8 (byte 0xff at offset 10)"


@pytest.mark.parametrize("text, why", [
    ("task: [sft\n", "invalid YAML (while parsing a flow sequence"),
    ("- task\n- sft\n", "a list, expected the run's flags (a mapping of flag names to values, as the trainer writes "
                        "it); repair it"),
    ("", "an empty file, expected the run's flags"),  # a file cut to nothing
    ("sft\n", "'sft', expected the run's flags"),
])
def test_a_recorded_config_that_is_no_runs_record_is_refused_naming_the_file(tmp_path, text, why):
    """recorded_config read a train_config.yaml that is not YAML or not a mapping as no record: chat and evaluate
    guessed the task from the folder's name (a pretrained model in a folder named 'weights' got the chat template)
    and `--resume auto` asking again for a finished run trained it again from its checkpoint over its model."""
    from trainer.run_dir import recorded_run_id

    folder = _model(tmp_path / "weights", text)
    for reader in (model_task, recorded_run_id):
        with pytest.raises(ValueError) as refused:
            reader(folder)
        assert str(refused.value).startswith(f"{folder / 'train_config.yaml'}: {why}"), refused.value
        assert "\n" not in str(refused.value)


def test_a_recorded_run_id_that_is_no_id_is_refused_naming_the_file(tmp_path):
    """A run_id edited into a list was read as its text, '[1]': a resume refused the directory's own checkpoint as
    another run's ('... records run [1]: the directory mixes two runs')."""
    from trainer.run_dir import recorded_run_id

    folder = _model(tmp_path / "m", "task: pretrain\nrun_id: [1]\n")
    with pytest.raises(ValueError, match=rf"^{folder / 'train_config.yaml'}: run_id is \[1\], expected the run's id "
                                         rf"\(a string, as every checkpoint's trainer_state.json repeats it\); "
                                         rf"repair it$"):
        recorded_run_id(folder)
    (folder / "train_config.yaml").write_text("task: pretrain\nrun_id: 0a1b2c3d4e5f\n")
    assert recorded_run_id(folder) == "0a1b2c3d4e5f"


def test_a_tool_loads_the_sft_model_else_the_pretrained_one_with_a_note(tmp_path, monkeypatch):
    monkeypatch.setitem(run_dir.DEFAULT_OUT_DIRS, "sft", str(tmp_path / "sft"))
    monkeypatch.setitem(run_dir.DEFAULT_OUT_DIRS, "pretrain", str(tmp_path / "pretrain"))
    with pytest.raises(ModelNotFound, match=rf"^no model at {tmp_path / 'sft'} or {tmp_path / 'pretrain'}; create"):
        locate_model()
    _model(tmp_path / "pretrain")
    path, note = locate_model()
    assert path == tmp_path / "pretrain" and note.startswith(f"no SFT model at {tmp_path / 'sft'} ")
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "model.safetensors").write_bytes(b"")  # weights without their config.json: no model
    assert locate_model()[0] == tmp_path / "pretrain"
    _model(tmp_path / "sft")
    assert locate_model() == (tmp_path / "sft", None)
    assert locate_model(tmp_path / "pretrain") == (tmp_path / "pretrain", None)


def test_a_model_path_that_is_no_model_says_what_it_is_and_how_to_get_one(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_config.yaml").write_text("task: dpo\n")
    for step in (5, 40):
        _checkpoint(run, step)
    with pytest.raises(ModelNotFound, match=r"its run has not finished \(newest checkpoint step_00000040\); if it is "
                                            rf"no longer training, finish it with `python trainer/train_dpo.py "
                                            rf"--config {run / 'train_config.yaml'} --out_dir {run} --resume auto`"):
        locate_model(run)
    (tmp_path / "file").write_text("")
    with pytest.raises(ModelNotFound, match="is a file, not a model folder"):
        locate_model(tmp_path / "file")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(run)}))
    with pytest.raises(ModelNotFound, match=rf"{adapter} is a LoRA adapter, not a whole model: pass it as --lora"):
        locate_model(adapter)
    base = _model(tmp_path / "base")
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
    assert locate_model_and_adapter(None, adapter) == (base, adapter, None)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": ""}))
    with pytest.raises(ModelNotFound, match="names no base model; pass it with --model_path"):
        locate_model_and_adapter(None, adapter)
    assert locate_model_and_adapter(base, adapter) == (base, adapter, None)


def test_a_base_model_the_adapter_names_that_is_no_model_is_named_with_where_it_came_from(tmp_path):
    """--lora alone reads the base from adapter_config.json: a base that is missing (or is the adapter itself) was
    "no model at X; create it with ..." or "X is a LoRA adapter ...: pass it as --lora X", as if --model_path had
    named it; a number or a list was "names no base model". Each names the adapter's file and field now."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    field = f"--lora {adapter}: base_model_name_or_path in its adapter_config.json"

    def refusal(base) -> str:
        (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
        with pytest.raises(ModelNotFound) as refused:
            locate_model_and_adapter(None, adapter)
        return str(refused.value)

    gone = tmp_path / "gone"
    assert refusal(str(gone)) == (f"{field}: no model at {gone}; create it with `python trainer/train_full_sft.py "
                                  f"--out_dir {gone}`; or pass the base model with --model_path")
    assert refusal(str(adapter)).startswith(f"{field}: {adapter} is a LoRA adapter, not a whole model")
    assert refusal(5) == f"{field} is 5, not a path; pass the base model with --model_path"
    assert refusal(["a"]) == f"{field} is ['a'], not a path; pass the base model with --model_path"
    assert refusal("  ").endswith("its adapter_config.json names no base model; pass it with --model_path")


def test_a_starting_model_of_another_architecture_is_refused_in_one_line(tmp_path):
    """--from_weight (and --teacher, the critic) at a transformers Llama directory: MiniNormForCausalLM was built
    on its LlamaConfig and failed with an AttributeError traceback ('LlamaConfig' object has no attribute
    'dropout'); now one line names the flag, the directory and both model types (found by a hostile flag-value
    hunt over the trainers' command lines)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.run_dir import load_input_model

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError) as refused:
        load_input_model(tmp_path / "llama", "--from_weight")
    assert str(refused.value) == (f"--from_weight cannot load {tmp_path / 'llama'}: its config.json's model_type "
                                  f"'llama' is not MiniNormForCausalLM's ('mininorm')")


def test_data_inside_a_file_the_run_writes_is_refused_and_data_beside_them_is_not(tmp_path):
    out = tmp_path / "out"
    check_out_dir(out, {}, {"--data_path": out / "train.jsonl"})  # the user's data kept in the run's folder
    for name in ("metrics.jsonl", "checkpoints/step_00000010/data.jsonl"):
        with pytest.raises(ValueError, match=rf"^--data_path {out / name} is the run's own "
                                             rf"{name.split('/')[0]} in --out_dir {out}: the run would write over"):
            check_out_dir(out, {}, {"--data_path": out / name})
    with pytest.raises(ValueError, match=rf"^--out_dir {out / 'm'} is inside --from_weight {out}: the run"):
        check_out_dir(out / "m", {"--from_weight": out})


@pytest.mark.parametrize("name", ["metrics.jsonl", "checkpoints"])
def test_a_symlink_loop_where_the_run_writes_is_one_line_naming_it(tmp_path, name):
    """A file or folder the run writes that is a symlink to itself (a `ln -s` gone wrong): resolving it raised
    pathlib's RuntimeError ("Symlink loop from ..."), a traceback at every start or resume in that --out_dir."""
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(name)
    with pytest.raises(ValueError, match=rf"^{out / name}: a symlink loop \(its links lead back to themselves, never "
                                         rf"to a file or folder\); remove the link or point it at a real file or "
                                         rf"folder$"):
        check_out_dir(out, {}, {"--data_path": tmp_path / "train.jsonl"})


@pytest.mark.parametrize("name", ["run_summary.json", "train_config.yaml", "metrics.jsonl", "config.json",
                                  "tokenizer.json", "tokenizer_files.json"])
def test_a_folder_in_the_place_of_a_file_the_run_writes_is_one_line_naming_it(tmp_path, name):
    """A run folder whose run_summary.json (train_config.yaml, metrics.jsonl, a model file) is a folder, a `mkdir`
    in its place or a link to one: every start and resume in it checked nothing of the kind, and the run ended where
    it wrote that file in an IsADirectoryError traceback (a resume: after it had removed the summary or trained)."""
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    with pytest.raises(ValueError) as refused:
        check_out_dir(out, {})
    assert str(refused.value) == f"--out_dir {out / name} is a folder, not a file"
    (out / name).rmdir()
    (tmp_path / "elsewhere").mkdir()
    (out / name).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=rf"^--out_dir {out / name} is a folder, not a file$"):
        check_out_dir(out, {})
    (out / name).unlink()
    (out / name).write_text("{}")  # the file itself, and a folder beside it, are fine
    (out / "notes").mkdir()
    check_out_dir(out, {})


def test_a_recorded_config_that_is_a_folder_is_refused_naming_it(tmp_path):
    """recorded_config, the reader every tool shares (chat and evaluate on a model, the trainer on its lineage), read
    a train_config.yaml that is a folder as no record: chat and evaluate went on without the model's task or its
    trained length, and a resume in that folder trained and then ended in an IsADirectoryError traceback."""
    folder = _model(tmp_path / "m")
    (folder / "train_config.yaml").mkdir()
    with pytest.raises(ValueError) as refused:
        model_task(folder)
    assert str(refused.value) == f"{folder / 'train_config.yaml'}: is a directory, not a YAML file"
    (folder / "train_config.yaml").rmdir()
    (folder / "train_config.yaml").symlink_to(tmp_path / "gone")  # a dangling link is no record, as none is
    assert model_task(folder) is None


@pytest.mark.parametrize("name, target", [("step_00000005", "."), ("step_00000005", ".."),
                                          (".tmp_step_00000005", "."), ("step_00000005", "../../elsewhere")])
def test_a_symlink_where_the_run_saves_a_checkpoint_is_one_line_naming_it(tmp_path, name, target):
    """A symlink in checkpoints/ at a checkpoint's name (or its save's temp folder's) leading back to the folder
    that holds it, or anywhere: the save at its step failed with a NotADirectoryError traceback (os.replace onto the
    link), after the training to it; a rotation would remove what a link to another folder leads to."""
    out = tmp_path / "out"
    _checkpoint(out, 3)
    (tmp_path / "elsewhere").mkdir()
    (out / "checkpoints" / name).symlink_to(target)
    resolved = (out / "checkpoints" / name).resolve()
    holds = ", a folder that holds it," if target in (".", "..") else ""
    with pytest.raises(ValueError) as refused:
        check_out_dir(out, {})
    assert str(refused.value) == (f"--out_dir {out / 'checkpoints' / name} is a symlink to {resolved}{holds} not a "
                                  f"checkpoint folder: the run saves its checkpoints there as folders of its own, "
                                  f"and replaces and removes them; remove the link (a checkpoint of another folder "
                                  f"is resumed with --resume PATH)")


def test_a_file_or_a_loop_where_the_run_saves_a_checkpoint_is_one_line_and_other_names_are_left_alone(tmp_path):
    out = tmp_path / "out"
    _checkpoint(out, 3)
    (out / "checkpoints" / "step_00000005").write_text("x")
    with pytest.raises(ValueError, match=rf"^--out_dir {out / 'checkpoints' / 'step_00000005'} is a file, not a "
                                         rf"folder$"):
        check_out_dir(out, {})
    (out / "checkpoints" / "step_00000005").unlink()
    (out / "checkpoints" / "step_00000005").symlink_to("step_00000005")
    with pytest.raises(ValueError, match=rf"^{out / 'checkpoints' / 'step_00000005'}: a symlink loop"):
        check_out_dir(out, {})
    (out / "checkpoints" / "step_00000005").unlink()
    (out / "checkpoints" / "notes").symlink_to("..")  # no save goes there: the run never reads or writes it
    check_out_dir(out, {})


def test_the_metrics_log_keeps_the_resumed_steps_and_writes_only_where_enabled(tmp_path):
    """trainer/metrics_log.py: a resume at step 2 keeps the records up to and including step 2 (the checkpoint's
    own), a non-finite number is written as null (strict JSON has no NaN), and a process with the log disabled (not
    the main one) neither writes, truncates nor removes the file."""
    from trainer.metrics_log import MetricsLog

    log, other = MetricsLog(tmp_path, enabled=True), MetricsLog(tmp_path, enabled=False)
    for step in (1, 2, 3):
        log.write({"step": step, "split": "train", "loss": float("nan") if step == 3 else 1.0 / step})
    other.write({"step": 9, "split": "train"})
    other.truncate_after(1)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[2]) == {"step": 3, "split": "train",
                                                                                     "loss": None}
    log.truncate_after(2)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    other.reset()
    assert (tmp_path / "metrics.jsonl").is_file()
    log.reset()
    assert not (tmp_path / "metrics.jsonl").exists()
    log.truncate_after(2)  # nothing to keep: no file is made
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_resume_says_which_damaged_metrics_lines_its_rewrite_drops(tmp_path, capsys):
    """truncate_after rewrites metrics.jsonl with the records read_metrics reads: a damaged line in the middle (a torn
    write a later append ended, a hand edit) is gone from the file after it, so the resume says so on stderr in the
    other readers' words; the torn last line a killed writer left is dropped without a word, as they skip it."""
    from trainer.metrics_log import MetricsLog

    log = MetricsLog(tmp_path, enabled=True)
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "split": "train"}\n{"step": 2, "spl\nnot json\n{"step": 2, "split": "train"}\n'
                    '{"step": 3, "split": "train"}\n{"step": 4, "sp')
    log.truncate_after(3)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert capsys.readouterr().err == f"note: {path}: 2 lines skipped, torn or damaged (lines 2, 3); the rest is read\n"
    log.truncate_after(2)  # nothing damaged left: nothing said
    assert [r["step"] for r in read_metrics(path)] == [1, 2] and capsys.readouterr().err == ""


@pytest.mark.parametrize("flag, refusal", [
    ("--data_path", "no such data file: {path}"),
    ("--val_data_path", "no such data file: {path}"),
    ("--resume", "--resume {path}: "),
])
def test_a_tilde_of_no_such_user_is_left_as_typed_as_a_shell_leaves_it(flag, refusal, train_data, tmp_path, capsys):
    """`~nosuchuser/x` (quoted, or from a --config YAML) ended every path flag in pathlib's RuntimeError traceback
    ("Could not determine home directory"); a shell leaves such a word as it is, and so does the trainer, whose
    readers then name the path."""
    from tests.training_runs import pretrain_argv, refused_run

    typed = "~no-such-user-h85/x"
    assert run_dir.resolve_input_path(typed) == run_dir.resolve_path(typed) == run_dir.REPO_ROOT / typed
    argv = [*pretrain_argv(train_data, tmp_path / "run"), flag, typed]
    line = refused_run("pretrain", argv, capsys, after_progress=True)
    assert line.startswith("error: " + refusal.format(path=run_dir.REPO_ROOT / typed)), line


@pytest.mark.parametrize("kind", ["file", "fifo", "device"])
def test_a_model_path_that_is_no_folder_says_what_it_is_and_not_how_to_create_it(tmp_path, kind):
    """--from_weight, --teacher and a tool's --model_path naming a FIFO or a device said "no model ... create it with
    `python trainer/train_pretrain.py --out_dir /dev/zero`"; a file was named so by the tools only."""
    import os

    from trainer.args import parse_args
    from trainer.distillation import teacher_model_dir
    from trainer.run_inputs import starting_weights_dir

    if kind == "file":
        path, what = tmp_path / "model.txt", "a file"
        path.write_text("")
    elif kind == "fifo":
        path, what = tmp_path / "model", "a FIFO (a pipe)"
        os.mkfifo(path)
    else:
        path, what = Path("/dev/null"), "a device"
    words = f"{path} is {what}, not a model folder (config.json and the weights)"
    with pytest.raises(ModelNotFound) as refused:
        run_dir.locate_model(path)
    assert str(refused.value) == words
    with pytest.raises(FileNotFoundError) as refused:
        starting_weights_dir(parse_args("sft", ["--from_weight", str(path)]))
    assert str(refused.value) == f"--from_weight {words}"
    with pytest.raises(FileNotFoundError) as refused:
        teacher_model_dir(str(path))
    assert str(refused.value) == f"--teacher {words}"


def test_a_model_folder_without_weights_says_so(tmp_path):
    """A folder with config.json and no weights (a copy that left them out, a save cut short) was 'no model at X;
    create it with `python trainer/train_full_sft.py --out_dir X`', which sent one retraining."""
    folder = tmp_path / "sft"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ModelNotFound) as refused:
        run_dir.locate_model(folder)
    assert str(refused.value) == (f"no model at {folder}: it holds config.json but no weights (model.safetensors or "
                                  f"model.safetensors.index.json or pytorch_model.bin)")
