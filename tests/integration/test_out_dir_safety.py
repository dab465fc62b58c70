"""One run per --out_dir: a trainer never silently replaces a finished model or mixes two runs. A new run where one
finished, or a resume of another run's checkpoint there, is refused in one line naming the directory and
--overwrite; --overwrite removes the old run's files, but only once the new run's inputs are all
checked (a bad one leaves the old run whole); --resume auto continues the directory's own run (its run
id, in train_config.yaml and every checkpoint, says which), also in a directory written before run ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.training_runs import finetune_argv, pretrain_argv, refused_run, run_in_process, train_losses
from trainer.run_dir import read_metrics

SHORT = ("--batch_size", "4", "--max_steps", "4")


def _run_id(out_dir: Path) -> str:
    return yaml.safe_load((out_dir / "train_config.yaml").read_text())["run_id"]


def _checkpoint_run_id(checkpoint: Path) -> str:
    return json.loads((checkpoint / "trainer_state.json").read_text())["run_id"]


@pytest.fixture
def finished(train_data, tmp_path) -> Path:
    """A finished 4-step run with a checkpoint at step 3."""
    out_dir = tmp_path / "first"
    run_in_process("pretrain", pretrain_argv(train_data, out_dir, *SHORT))
    return out_dir


def test_a_new_run_where_one_finished_is_refused_and_changes_nothing(finished, train_data, capsys):
    before = {p.name: p.read_bytes() for p in finished.iterdir() if p.is_file()}
    error = refused_run("pretrain", pretrain_argv(train_data, finished, "--max_steps", "2"), capsys)
    assert error.startswith(f"error: --out_dir {finished} already holds a run: a finished model (run_summary.json, "
                            f"config.json, model.safetensors, generation_config.json) and checkpoints "
                            f"(checkpoints/step_00000003); pass --overwrite "), error
    assert {p.name: p.read_bytes() for p in finished.iterdir() if p.is_file()} == before


def _files(out_dir: Path) -> dict[Path, bytes]:
    return {path.relative_to(out_dir): path.read_bytes() for path in out_dir.rglob("*") if path.is_file()}


def test_resume_auto_asking_again_for_the_finished_run_leaves_it_as_it_is(finished, train_data, capsys):
    """The same command with --resume auto where its run finished: nothing is left to train (it used to train the
    steps after the newest checkpoint again); a larger --max_steps goes on from that checkpoint."""
    before = _files(finished)
    capsys.readouterr()
    summary = run_in_process("pretrain", pretrain_argv(train_data, finished, *SHORT, "--resume", "auto"))
    out = capsys.readouterr().out
    loss = json.loads((finished / "run_summary.json").read_text())["final_val"]["loss"]
    assert (f"--resume auto: {finished} holds this run, finished (4 steps, val loss {loss:.4f}): nothing left to "
            f"train, its model stays as it is; a larger --max_steps trains it on from checkpoints/step_00000003, "
            f"--overwrite trains it anew") in out, out
    assert "resumed from" not in out
    assert _files(finished) == before
    assert summary.status == "finished" and summary.steps == 4 and summary.final_val["loss"] == loss
    run_in_process("pretrain", pretrain_argv(train_data, finished, *SHORT, "--max_steps", "5", "--resume", "auto"))
    out = capsys.readouterr().out
    assert "at optimizer step 3" in out and "--max_steps was 4 there and is 5 now" in out
    assert json.loads((finished / "run_summary.json").read_text())["steps"] == 5


def test_a_finished_run_without_checkpoints_is_not_restarted_by_resume_auto(train_data, tmp_path, capsys):
    out_dir = tmp_path / "no_checkpoints"
    argv = pretrain_argv(train_data, out_dir, *SHORT, "--save_interval", "100")
    run_in_process("pretrain", argv)
    before = _files(out_dir)
    capsys.readouterr()
    run_in_process("pretrain", argv + ["--resume", "auto"])  # the same run: nothing to do
    assert "nothing left to train, its model stays as it is; --overwrite trains it anew" in capsys.readouterr().out
    assert _files(out_dir) == before
    error = refused_run("pretrain", argv + ["--max_steps", "5", "--resume", "auto"], capsys)
    assert error == (f"error: --out_dir {out_dir} already holds a run: a finished model (run_summary.json, "
                     f"config.json, model.safetensors, generation_config.json), and no checkpoint to go on from; "
                     f"pass --overwrite to remove its files and start anew there, or choose another --out_dir")
    assert _files(out_dir) == before


def test_overwrite_removes_the_old_run_first(finished, train_data, capsys):
    old_id = _run_id(finished)
    capsys.readouterr()
    run_in_process("pretrain", pretrain_argv(train_data, finished, "--batch_size", "4", "--max_steps", "2",
                                             "--save_interval", "100", "--overwrite"))
    out = capsys.readouterr().out
    assert (f"--overwrite: removed the previous run's checkpoints, metrics.jsonl, run_summary.json, "
            f"train_config.yaml, config.json, model.safetensors, generation_config.json from {finished}") in out
    assert not (finished / "checkpoints").exists()  # the old step 3 cannot be resumed into the new run
    assert [r["step"] for r in read_metrics(finished, "train")] == [1, 2]
    assert json.loads((finished / "run_summary.json").read_text())["steps"] == 2
    assert _run_id(finished) != old_id


def test_resume_auto_continues_the_directorys_own_run(finished, train_data, tmp_path):
    """The run id is the directory's and every checkpoint's; an interrupted run (here: the finished run without its
    final model) resumed with --resume auto keeps its id and gives the uninterrupted run's losses."""
    run_id = _run_id(finished)
    assert _checkpoint_run_id(finished / "checkpoints" / "step_00000003") == run_id
    interrupted = tmp_path / "interrupted"
    shutil.copytree(finished, interrupted)
    for name in ("run_summary.json", "model.safetensors", "config.json", "generation_config.json"):
        (interrupted / name).unlink()
    run_in_process("pretrain", pretrain_argv(train_data, interrupted, *SHORT, "--resume", "auto"))
    assert _run_id(interrupted) == run_id
    assert train_losses(interrupted) == train_losses(finished)
    assert json.loads((interrupted / "run_summary.json").read_text())["steps"] == 4


def test_resume_of_another_runs_checkpoint_is_refused(finished, train_data, tmp_path, capsys):
    other = tmp_path / "other"
    run_in_process("pretrain", pretrain_argv(train_data, other, *SHORT))
    checkpoint = other / "checkpoints" / "step_00000003"
    argv = pretrain_argv(train_data, finished, *SHORT, "--resume", str(checkpoint))
    error = refused_run("pretrain", argv, capsys)
    assert error.startswith(f"error: --resume {checkpoint}: that checkpoint is of run {_run_id(other)}, and "
                            f"--out_dir {finished} already holds a run (run {_run_id(finished)}): "), error
    assert "--overwrite" in error
    # Into a directory holding no run, the checkpoint's run goes on there, under its own id.
    branched = tmp_path / "branched"
    run_in_process("pretrain", pretrain_argv(train_data, branched, *SHORT, "--resume", str(checkpoint)))
    assert _run_id(branched) == _run_id(other)
    assert len(train_losses(branched)) == 1


def test_a_directory_from_before_run_ids_resumes_its_own_checkpoints(finished, train_data):
    """Written by a MiniNorm without run ids: --resume auto falls back to the data-order checks."""
    config = yaml.safe_load((finished / "train_config.yaml").read_text())
    del config["run_id"]
    (finished / "train_config.yaml").write_text(yaml.safe_dump(config))
    state_file = finished / "checkpoints" / "step_00000003" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["run_id"]
    state_file.write_text(json.dumps(state))
    for name in ("run_summary.json", "model.safetensors"):
        (finished / name).unlink()
    run_in_process("pretrain", pretrain_argv(train_data, finished, *SHORT, "--resume", "auto"))
    assert [r["step"] for r in read_metrics(finished, "train")] == [1, 2, 3, 4]


@pytest.mark.parametrize("task", ["sft", "lora", "dpo"])
def test_fine_tuning_runs_refuse_to_replace_a_finished_run(task, train_data, tiny_models, tmp_path, capsys):
    out_dir = tmp_path / task
    argv = finetune_argv(task, train_data, tiny_models.sft, out_dir, "--max_steps", "2")
    run_in_process(task, argv)
    error = refused_run(task, argv, capsys)
    assert error.startswith(f"error: --out_dir {out_dir} already holds a run: a finished model"), error
    run_in_process(task, argv + ["--overwrite"])
    assert [r["step"] for r in read_metrics(out_dir, "train")] == [1, 2]


@pytest.mark.parametrize("task, flag, error_start, error_end", [
    ("pretrain", "--data_path", "error: no such data file: {missing}", ""),
    # the command named wrote out/pretrain (out/sft), not the folder the flag names
    ("sft", "--from_weight", "error: --from_weight {missing}: no model to start from there",
     "; create it with `python trainer/train_pretrain.py --out_dir {missing}` (or pass --from_weight DIR)"),
    ("distill", "--teacher", "error: --teacher {missing}: no model there",
     "; create it with `python trainer/train_full_sft.py --out_dir {missing}` (or pass --teacher DIR)"),
    ("grpo", "--reward_model", "error: --reward_model {missing}: no model there", ""),
])
def test_overwrite_with_a_bad_input_is_refused_and_leaves_the_old_run_whole(task, flag, error_start, error_end,
                                                                          finished, train_data, tiny_models,
                                                                          tmp_path, capsys):
    """--overwrite removes the previous run's files only once the new run's inputs have all been checked: a
    mistyped path is a one-line error that changes nothing (it used to remove the old model first)."""
    missing = str(tmp_path / "missing")
    before = {p.relative_to(finished): p.read_bytes() for p in finished.rglob("*") if p.is_file()}
    if task == "pretrain":
        argv = pretrain_argv(train_data, finished, *SHORT)
    else:
        argv = finetune_argv(task, train_data, tiny_models.sft, finished, "--max_steps", "2")
    if flag in argv:  # the flag's good value goes: the missing path replaces it
        argv = [*argv[:argv.index(flag)], *argv[argv.index(flag) + 2:]]
    argv += [flag, missing, "--overwrite"]
    error = refused_run(task, argv, capsys)
    assert error.startswith(error_start.format(missing=missing)), error
    assert error.endswith(error_end.format(missing=missing)), error
    assert {p.relative_to(finished): p.read_bytes() for p in finished.rglob("*") if p.is_file()} == before


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _damage(path: Path, how: str) -> None:
    path.write_bytes(path.read_bytes()[:1000] if how == "truncated" else b"damaged" if how == "garbage" else b"")


@pytest.mark.parametrize("name, how", [
    ("model.safetensors", "truncated"),
    ("optimizer.bin", "garbage"),
    ("scheduler.bin", "garbage"),
    ("random_states_0.pkl", "empty"),
])
def test_overwrite_with_a_damaged_checkpoint_is_refused_and_leaves_the_old_run_whole(name, how, finished,
                                                                                     reference_run, train_data,
                                                                                     tmp_path, capsys):
    """--overwrite --resume CHECKPOINT removes the directory's run only once the checkpoint has been read: a damaged
    file of it is one line naming the file, and the finished run stays (it used to be removed first)."""
    checkpoint = tmp_path / "damaged" / "step_00000003"
    shutil.copytree(reference_run / "checkpoints" / "step_00000003", checkpoint)
    _damage(checkpoint / name, how)
    before = _snapshot(finished)
    error = refused_run("pretrain", pretrain_argv(train_data, finished, *SHORT, "--resume", str(checkpoint),
                                               "--overwrite"), capsys)
    assert error.startswith(f"error: --resume {checkpoint}: {checkpoint / name} ") and "damaged" in error, error
    assert _snapshot(finished) == before


@pytest.fixture
def starting_model(tiny_models, tmp_path) -> Path:
    """A copy of the tiny SFT model, to start fine-tuning runs from (and to see that nothing removes it)."""
    return Path(shutil.copytree(tiny_models.sft, tmp_path / "start"))


@pytest.mark.parametrize("task, flag, where", [
    ("lora", "--from_weight", "same"),
    ("sft", "--from_weight", "same"),
    ("dpo", "--from_weight", "out_dir inside"),
    ("sft", "--from_weight", "input inside"),
    ("lora", "--from_weight", "symlink"),
    ("distill", "--teacher", "same"),
    ("grpo", "--reward_model", "same"),
])
def test_an_out_dir_that_is_the_runs_input_is_refused_before_anything_is_touched(task, flag, where, starting_model,
                                                                                tiny_models, train_data, tmp_path,
                                                                                capsys):
    """With --overwrite the run would remove the model it starts from (a LoRA run emptied its base model and
    exited 0); it is refused in one line naming both flags, also through a symlink and when one holds the other."""
    source = starting_model
    out_dir = {"same": source, "out_dir inside": source / "run", "input inside": tmp_path / "outer",
               "symlink": tmp_path / "link"}[where]
    if where == "symlink":
        out_dir.symlink_to(source)
    if where == "input inside":
        out_dir.mkdir()
        source = Path(shutil.move(str(source), out_dir / "merged"))
    argv = finetune_argv(task, train_data, tiny_models.sft, out_dir, "--max_steps", "2", "--overwrite")
    argv[argv.index("--from_weight") + 1] = str(source if flag == "--from_weight" else tiny_models.sft)
    if flag != "--from_weight":
        argv += [flag, str(source)]
    before = _snapshot(source)
    error = refused_run(task, argv, capsys)
    assert error.startswith("error: --out_dir ") and flag in error and "choose an --out_dir apart" in error, error
    assert _snapshot(source) == before


@pytest.mark.parametrize("case, error_start", [
    ("out_dir a file", "error: --out_dir {file} is a file, not a folder"),
    ("out_dir under a file", "error: --out_dir {file}/run: {file} is a file, not a folder"),
    ("tokenizer_path a file", "error: --tokenizer_path {file}: cannot read the tokenizer of {file}"),
    ("from_weight without weights", "error: --from_weight {weightless}: no model to start from there"),
    ("from_weight with a damaged config.json", "error: --from_weight {damaged}/config.json: "),
])
def test_a_path_flag_that_cannot_be_used_is_one_line_naming_it(case, error_start, tiny_models, train_data, tmp_path,
                                                              capsys):
    """Each used to end in an OSError traceback (FileExistsError, NotADirectoryError, a tokenizer or config that is
    not JSON), some only after the data was tokenized."""
    file = tmp_path / "afile"
    file.write_text("hi\n")
    weightless, damaged = tmp_path / "weightless", tmp_path / "damaged"
    weightless.mkdir()
    shutil.copy(tiny_models.sft / "config.json", weightless)
    shutil.copytree(tiny_models.sft, damaged)
    (damaged / "config.json").write_text("{ not json")
    task, out_dir = ("pretrain" if case.startswith(("out_dir", "tokenizer")) else "sft"), tmp_path / "out"
    extra = {"out_dir a file": [], "out_dir under a file": [], "tokenizer_path a file": ["--tokenizer_path", str(file)],
             "from_weight without weights": [], "from_weight with a damaged config.json": []}[case]
    out_dir = {"out_dir a file": file, "out_dir under a file": file / "run"}.get(case, out_dir)
    if task == "pretrain":
        argv = pretrain_argv(train_data, out_dir, *SHORT, *extra)
    else:
        start = weightless if "without" in case else damaged
        argv = finetune_argv(task, train_data, start, out_dir, "--max_steps", "2")
    error = refused_run(task, argv, capsys)
    assert error.startswith(error_start.format(file=file, weightless=weightless, damaged=damaged)), error
    assert not out_dir.exists() or out_dir == file


def test_a_file_where_the_checkpoints_go_is_one_line_before_the_data(train_data, tmp_path, capsys):
    """An --out_dir whose `checkpoints` is a file: the run trained to its first --save_interval and ended in a
    FileExistsError traceback there."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "checkpoints").write_text("not a folder\n")
    error = refused_run("pretrain", pretrain_argv(train_data, out_dir, *SHORT), capsys)
    assert error == f"error: --out_dir {out_dir / 'checkpoints'} is a file, not a folder"
    assert sorted(p.name for p in out_dir.iterdir()) == ["checkpoints"]

@pytest.mark.parametrize("name", ["run_summary.json", "train_config.yaml"])
def test_a_folder_in_the_place_of_a_run_file_refuses_the_resume_and_changes_nothing(name, finished, train_data,
                                                                                     capsys):
    """A run folder whose run_summary.json or train_config.yaml was replaced by a folder: `--resume auto` went on
    from the checkpoint and ended in an IsADirectoryError traceback, when it removed the summary (after its checks)
    or wrote its config."""
    (finished / name).unlink()
    (finished / name).mkdir()
    before = _files(finished)
    argv = pretrain_argv(train_data, finished, "--batch_size", "4", "--max_steps", "6", "--resume", "auto")
    error = refused_run("pretrain", argv, capsys)
    assert error == f"error: --out_dir {finished / name} is a folder, not a file"
    assert _files(finished) == before and (finished / name).is_dir()


@pytest.mark.parametrize("text, why", [
    ("task: [pretrain\n", "invalid YAML"),
    ("- a\n", "a list, expected the run's flags"),
    ("", "an empty file, expected the run's flags"),
])
def test_a_damaged_train_config_refuses_the_resume_of_the_finished_run_and_changes_nothing(text, why, finished,
                                                                                            train_data, capsys):
    """`--resume auto` asking again for the finished run, its train_config.yaml not YAML, not a mapping or emptied:
    read as no record, the run was not the one asked for, so it trained on from its checkpoint and wrote its model,
    summary and config anew without a word. Now one line names the file, and nothing is touched."""
    (finished / "train_config.yaml").write_text(text)
    before = _files(finished)
    error = refused_run("pretrain", pretrain_argv(train_data, finished, *SHORT, "--resume", "auto"), capsys)
    assert error.startswith(f"error: {finished / 'train_config.yaml'}: {why}") and "\n" not in error, error
    assert _files(finished) == before


@pytest.mark.parametrize("target", [".", ".."])
def test_a_symlink_where_a_checkpoint_goes_refuses_the_resume_before_any_training(target, finished, train_data,
                                                                                  capsys):
    """checkpoints/step_00000005 a symlink to checkpoints/ itself (or to the run folder): `--resume auto` trained
    steps 4 and 5 and died with a NotADirectoryError traceback at the save of step 5, the link in its way."""
    link = finished / "checkpoints" / "step_00000005"
    link.symlink_to(target)
    before = _files(finished)
    argv = pretrain_argv(train_data, finished, "--batch_size", "4", "--max_steps", "6", "--save_interval", "1",
                         "--resume", "auto")
    error = refused_run("pretrain", argv, capsys)
    assert error.startswith(f"error: --out_dir {link} is a symlink to {link.resolve()}, a folder that holds it, not "
                            f"a checkpoint folder: "), error
    assert _files(finished) == before and link.is_symlink()


@pytest.mark.parametrize("task, flag", [("sft", "--from_weight"), ("lora", "--from_weight"),
                                        ("distill", "--teacher")])
def test_an_input_model_missing_a_weight_is_refused_naming_it(task, flag, tiny_models, train_data, tmp_path,
                                                              capsys):
    """transformers fills a weight missing from model.safetensors with a fresh initialisation and only logs it: a
    run started (or distilled) from such a damaged model trained on as if nothing were wrong (rc 0)."""
    from safetensors.torch import load_file, save_file

    damaged = Path(shutil.copytree(tiny_models.sft, tmp_path / "damaged"))
    weights = load_file(damaged / "model.safetensors")
    save_file({name: tensor for name, tensor in weights.items() if name != "model.norm.weight"},
              damaged / "model.safetensors", metadata={"format": "pt"})
    start = damaged if flag == "--from_weight" else tiny_models.sft
    argv = finetune_argv(task, train_data, start, tmp_path / "out", "--max_steps", "2")
    if flag == "--teacher":
        argv += ["--teacher", str(damaged)]
    error = refused_run(task, argv, capsys, after_progress=True)  # the weights are read after the data is built
    assert error.startswith(f"error: {flag} ") and "model.norm.weight" in error and str(damaged) in error, \
        error


@pytest.mark.parametrize("name, flag", [("metrics.jsonl", "--data_path"), ("checkpoints/val.jsonl", "--val_data_path")])
def test_a_data_file_that_the_run_would_write_over_is_refused(train_data, tmp_path, capsys, name, flag):
    """A data file kept as one of the run's own files in --out_dir (metrics.jsonl, under checkpoints/): the run
    replaced it with its metrics, or --overwrite removed it, and nothing said so."""
    out_dir = tmp_path / "run"
    data = out_dir / name
    data.parent.mkdir(parents=True)
    shutil.copy(train_data / "pretrain.jsonl", data)
    before = data.read_bytes()
    argv = pretrain_argv(train_data, out_dir, *SHORT, flag, str(data))
    error = refused_run("pretrain", argv, capsys)
    assert error == (f"error: {flag} {data} is the run's own {name.split('/')[0]} in --out_dir {out_dir}: the run "
                     f"would write over (or remove) the data it reads; move the data or choose another --out_dir")
    assert data.read_bytes() == before
