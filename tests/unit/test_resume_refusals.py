"""check_resume_compatible (trainer/resume_checks.py) for the post-training flags: a GRPO/PPO checkpoint trained with
--lora cannot be resumed without it (nor one without it with it), and a distillation cannot change its teacher; each
refusal is one line naming the flag with both values."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import trainer.threads
from trainer.arg_fields import requested_model_fields
from trainer.args import parse_args
from trainer.resume_checks import check_resume_compatible, check_resume_length

CHECKPOINT = Path("/runs/x/checkpoints/step_00000002")


def _state(**config) -> dict:
    return {"config": config}


@pytest.mark.parametrize("task", ["grpo", "ppo"])
def test_a_lora_policy_resumes_only_as_lora(task):
    check_resume_compatible(CHECKPOINT, _state(lora=True, lora_rank=8), parse_args(task, ["--lora"]), {})
    with pytest.raises(ValueError) as refused:
        check_resume_compatible(CHECKPOINT, _state(lora=True, lora_rank=8), parse_args(task, []), {})
    assert str(refused.value) == ("--resume step_00000002: --lora was True there and is False now; the saved "
                                  "adapters have that shape (resume with --lora True, or start a new run)")
    with pytest.raises(ValueError, match="--lora was False there and is True now"):
        check_resume_compatible(CHECKPOINT, _state(lora=False), parse_args(task, ["--lora"]), {})
    with pytest.raises(ValueError, match="--lora_rank was 8 there and is 4 now"):
        check_resume_compatible(CHECKPOINT, _state(lora=True, lora_rank=8),
                                parse_args(task, ["--lora", "--lora_rank", "4"]), {})


def test_every_data_order_flag_that_differs_is_named_in_one_line():
    saved = _state(max_seq_len=32, seed=42, val_fraction=0.01)
    with pytest.raises(ValueError) as refused:
        check_resume_compatible(CHECKPOINT, saved, parse_args("pretrain", ["--max_seq_len", "64", "--seed", "7"]), {})
    assert str(refused.value) == ("--resume step_00000002: --max_seq_len was 32 there and is 64 now, --seed was 42 "
                                  "there and is 7 now; the saved data position is only valid for the same samples "
                                  "in the same order (resume with --max_seq_len 32 --seed 42, or start a new run)")


REFERENCE = ("the run is scored against its starting weights (its reference model), which the checkpoint does not "
             "hold")


@pytest.mark.parametrize("task, flag, reason", [("distill", "teacher", "a run distils from one teacher"),
                                                ("dpo", "from_weight", REFERENCE), ("grpo", "from_weight", REFERENCE),
                                                ("ppo", "from_weight", REFERENCE)])
def test_a_run_keeps_the_model_it_is_scored_against(task, flag, reason, tmp_path):
    """A distillation's teacher, and DPO's reference model and GRPO's and PPO's KL reference (--from_weight's
    weights), are in no checkpoint: resumed with another one of the same shape, the run went on against another
    model without a word (not even a 'changed since the checkpoint' note)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    args = parse_args(task, [f"--{flag}", str(tmp_path / "a")])
    check_resume_compatible(CHECKPOINT, _state(**{flag: str(tmp_path / "a")}), args, {})
    check_resume_compatible(CHECKPOINT, _state(), args, {})  # a checkpoint that did not record it
    with pytest.raises(ValueError) as refused:
        check_resume_compatible(CHECKPOINT, _state(**{flag: str(tmp_path / "b")}), args, {})
    assert str(refused.value) == (f"--resume step_00000002: --{flag} was {tmp_path / 'b'} there and is "
                                  f"{tmp_path / 'a'} now; {reason} (resume with --{flag} {tmp_path / 'b'}, or start "
                                  f"a new run)")


@pytest.mark.parametrize("task, flags", [("sft", []), ("lora", []), ("distill", []), ("grpo", ["--beta", "0"]),
                                         ("ppo", ["--lora"])])
def test_a_run_that_reads_its_starting_weights_once_may_find_them_elsewhere(task, flags, tmp_path):
    """Those runs' checkpoints hold every weight they train or score with (GRPO/PPO under --lora: the base model
    under the adapters is the reference): a moved --from_weight is no change."""
    args = parse_args(task, ["--from_weight", str(tmp_path / "a"), *flags])
    check_resume_compatible(CHECKPOINT, _state(from_weight=str(tmp_path / "b"), lora=args.lora), args, {})

@pytest.mark.parametrize("task", ["pretrain", "sft", "lora", "dpo", "distill", "grpo", "ppo"])
def test_a_resume_whose_length_ends_before_the_checkpoint_is_refused_naming_its_step(task):
    """Every trainer plans its length and then checks it here: a --max_steps below the checkpoint's step (or fewer
    --epochs than it has begun) trained nothing and "finished", writing the checkpoint's model as a run of more
    steps than asked; its step itself ends the run there; above it, the run trains on."""
    state = {"step": 6, "epoch": 2, "samples_done_in_epoch": 8}
    for length in (6, 7):
        check_resume_length(CHECKPOINT, state, parse_args(task, ["--max_steps", str(length)]), length)
    with pytest.raises(ValueError) as refused:
        check_resume_length(CHECKPOINT, state, parse_args(task, ["--max_steps", "5"]), 5)
    assert str(refused.value) == ("--resume step_00000002: --max_steps is 5 and the checkpoint is at optimizer step "
                                  "6; a run cannot end before the step it resumes at (resume with --max_steps 6 or "
                                  "more (6: the run ends there, with its model), or start a new run)")
    with pytest.raises(ValueError) as refused:  # --epochs: the length the data gives, 6 + what is left - 1 epoch
        check_resume_length(CHECKPOINT, state, parse_args(task, ["--epochs", "2", "--max_steps", "-1"]), 4)
    assert str(refused.value) == ("--resume step_00000002: --epochs is 2 and the checkpoint is at optimizer step 6, "
                                  "in epoch 3; a run cannot end before the step it resumes at (resume with --epochs "
                                  "3 or more, or start a new run)")


# ---------------------------------------------------------------- trainer_state.json, validated where it is read
GOOD_STATE = {"step": 3, "epoch": 0, "samples_done_in_epoch": 12, "tokens_seen": 384, "total_steps": 4,
              "processes": 1, "run_id": "5ea30241348b", "wandb_run_id": None, "train_time_s": 0.5,
              "budget_fixed": False, "threads": 1, "config": {"seed": 42},
              "data": {"path": "/d/pretrain.jsonl", "train_samples": 296, "tokens": 9500, "digest": "3ae8"},
              "files": ["model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.bin"]}


def _write_state(tmp_path: Path, content: object, name: str = "step_00000003") -> Path:
    checkpoint = tmp_path / "checkpoints" / name
    checkpoint.mkdir(parents=True)
    state_file = checkpoint / "trainer_state.json"
    if isinstance(content, bytes):
        state_file.write_bytes(content)
    else:
        state_file.write_text(content if isinstance(content, str) else json.dumps(content))
    return checkpoint

def _finished_run(recorded: dict, folder: Path) -> dict:
    """A finished run's files in `folder` as a run writes them (its train_config.yaml `recorded`, a model, the
    summary), for finished_run_asked_again; the summary."""
    import yaml

    (folder / "train_config.yaml").write_text(yaml.safe_dump(recorded))
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    summary = {"status": "finished", "steps": 4}
    (folder / "run_summary.json").write_text(json.dumps(summary))
    return summary



def _without(*keys: str) -> dict:
    return {k: v for k, v in GOOD_STATE.items() if k not in keys}


@pytest.mark.parametrize("content, message", [
    ([1, 2], "is not a JSON object (a list)"),
    ("null", "is not a JSON object (null)"),
    (b"\xff\xfe\x00\x81", "not valid UTF-8 (byte 0xff at offset 0)"),
    ("{", "is not valid JSON"),
    (_without("step"), "'step' is missing"),
    (_without("epoch"), "'epoch' is missing"),
    (_without("tokens_seen"), "'tokens_seen' is missing"),
    (_without("samples_done_in_epoch"), "older MiniNorm"),
    ({**GOOD_STATE, "step": "3"}, "'step' must be an integer >= 0, not '3'"),
    ({**GOOD_STATE, "step": True}, "'step' must be an integer >= 0, not True"),
    ({**GOOD_STATE, "step": -5}, "'step' must be an integer >= 0, not -5"),
    ({**GOOD_STATE, "samples_done_in_epoch": -4}, "'samples_done_in_epoch' must be an integer >= 0, not -4"),
    ({**GOOD_STATE, "epoch": 99}, "'epoch' is 99, more than its 3 optimizer steps"),
    ({**GOOD_STATE, "step": 5}, "'step' is 5, but the checkpoint is step_00000003"),
    ({**GOOD_STATE, "files": "model.safetensors"}, "'files' must be a list of file names"),
    ({**GOOD_STATE, "files": ["../../etc/passwd"]}, "'files' must be a list of file names"),
    ({**GOOD_STATE, "config": [1]}, "'config' must be a JSON object"),
    ({**GOOD_STATE, "data": "x"}, "'data' must be a JSON object"),
    ({**GOOD_STATE, "data": {"path": "/d"}}, "'data' must be a JSON object"),
    ({**GOOD_STATE, "processes": 0}, "'processes' must be an integer >= 1"),
    ({**GOOD_STATE, "total_steps": "4"}, "'total_steps' must be an integer >= 0"),
    ({**GOOD_STATE, "train_time_s": "x"}, "'train_time_s' must be a number >= 0"),
    ({**GOOD_STATE, "run_id": 5}, "'run_id' must be a string"),
    ({**GOOD_STATE, "threads": "many"}, "'threads' must be an integer in 1 .. 4096"),
    ({**GOOD_STATE, "threads": True}, "'threads' must be an integer in 1 .. 4096, not True"),
    ({**GOOD_STATE, "threads": 10**9}, "'threads' must be an integer in 1 .. 4096, not 1000000000"),
    ({**GOOD_STATE, "digests": ["model.safetensors"]}, "'digests' must be a JSON object of file names"),
    ({**GOOD_STATE, "digests": {"/etc/passwd": {"bytes": 1, "sha256": "0" * 64}}}, "'digests' must be a JSON object"),
    ({**GOOD_STATE, "digests": {"model.safetensors": {"bytes": -1, "sha256": "0" * 64}}}, "'digests' must be"),
    ({**GOOD_STATE, "digests": {"model.safetensors": {"bytes": 1, "sha256": "abc"}}}, "64 hex digits"),
    ({**GOOD_STATE, "digests": {"model.safetensors": {"bytes": 1, "sha256": "0" * 65}}}, "64 hex digits"),
    ({**GOOD_STATE, "digests": {"": {"bytes": 1, "sha256": "0" * 64}}}, "'digests' must be a JSON object"),
    # a value quoted as every refusal quotes one (dataset/shown_value.py: one line, cut at 60 characters): a
    # 10,000-element list or text was printed whole
    ({**GOOD_STATE, "step": [1] * 10_000}, f"'step' must be an integer >= 0, not {str([1] * 10_000)[:57]}...;"),
    ({**GOOD_STATE, "step": "3\n" * 5_000}, "'step' must be an integer >= 0, not '" + "3\\n" * 18 + "3\\...;"),
], ids=lambda value: None)
def test_a_damaged_trainer_state_is_refused_in_one_line_naming_the_file_and_field(content, message, tmp_path):
    from trainer.checkpoint_state import read_trainer_state

    checkpoint = _write_state(tmp_path, content)
    with pytest.raises(ValueError) as refused:
        read_trainer_state(checkpoint)
    text = str(refused.value)
    assert text.startswith(f"{checkpoint / 'trainer_state.json'}: ") and message in text, text[:500]
    assert "\n" not in text and len(text) < 300 + len(str(checkpoint)), text[:500]


def test_a_sound_trainer_state_is_read_as_written(tmp_path):
    from trainer.checkpoint_state import read_trainer_state

    assert read_trainer_state(_write_state(tmp_path, GOOD_STATE)) == GOOD_STATE
    # Written before some fields existed (data, files, run_id...): still read; a copy under another name too.
    old = _without("data", "files", "run_id", "threads", "budget_fixed", "processes", "total_steps")
    assert read_trainer_state(_write_state(tmp_path, old, name="copied")) == old


@pytest.mark.parametrize("field", ["processes", "threads"])
def test_a_checkpoint_without_processes_or_threads_resumes_and_a_null_one_is_refused_in_one_line(field, tmp_path):
    """A checkpoint saved before the field existed has none and resumes (one process's files; the thread count the
    session picks). Every save since writes an integer: a null is no save's and is refused naming the file and field
    (a null 'processes' ended the file check with a TypeError)."""
    from trainer.checkpoint import agree_on_start
    from trainer.checkpoint_state import read_trainer_state

    accelerator, root = _save_trained_checkpoints(tmp_path, (1,))
    state_file = root / "step_00000001" / "trainer_state.json"
    saved = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({key: value for key, value in saved.items() if key != field}))
    assert field not in agree_on_start(accelerator, "auto", tmp_path, None).resume.state
    state_file.write_text(json.dumps({**saved, field: None}))
    with pytest.raises(ValueError) as refused:
        agree_on_start(accelerator, "auto", tmp_path, None)
    allowed = "an integer in 1 .. 4096" if field == "threads" else "an integer >= 1"
    assert str(refused.value) == (f"--resume auto: {state_file}: '{field}' must be {allowed}, not null; the "
                                  f"checkpoint is damaged; {NO_EARLIER_CHECKPOINT}")
    with pytest.raises(ValueError):
        read_trainer_state(state_file.parent)


def test_a_data_position_past_the_training_set_is_refused(tmp_path):
    state = {**GOOD_STATE, "samples_done_in_epoch": 10 ** 9}
    args = parse_args("pretrain", [])
    with pytest.raises(ValueError) as refused:
        check_resume_compatible(CHECKPOINT, state, args, GOOD_STATE["data"])
    assert str(refused.value) == ("--resume step_00000002: trainer_state.json: 'samples_done_in_epoch' is "
                                  "1000000000, more than the 296 training samples")



def test_other_data_of_the_same_size_is_named_as_other_token_ids():
    """A file whose probed samples hold other tokens, but as many samples and tokens (a prompt edited in place), was
    refused with the same description on both sides ('... (296 training samples, 9500 tokens) there and is ...
    (296 training samples, 9500 tokens) now'), as if only the path, which may change, differed."""
    edited = {**GOOD_STATE["data"], "path": "/data/edited.jsonl", "digest": "0123456789abcdef"}
    with pytest.raises(ValueError) as refused:
        check_resume_compatible(CHECKPOINT, GOOD_STATE, parse_args("pretrain", []), edited)
    assert str(refused.value) == ("--resume step_00000002: --data_path was /d/pretrain.jsonl (296 training "
                                  "samples, 9500 tokens) there and is /data/edited.jsonl (296 training samples, 9500 "
                                  "tokens, other token ids in the samples compared) now; the saved data position is "
                                  "only valid for the same training data (resume with the same file, or start a new "
                                  "run)")

# ---------------------------------------------------------------- the model's architecture
def test_a_bare_resume_takes_the_architecture_from_the_checkpoint():
    from trainer.resume_checks import adopt_saved_architecture

    saved = {"config": {"norm_type": "prmsnorm", "prms_p": 0.25, "hidden_size": 32, "norm_impl": "triton",
                        "dropout": 0.1}}
    args = parse_args("pretrain", ["--dropout", "0.0"])
    adopt_saved_architecture(CHECKPOINT, saved, args)
    # The architecture comes from the checkpoint; what only changes how it runs (norm_impl, dropout) stays the flags'.
    assert args.model == {"norm_type": "prmsnorm", "prms_p": 0.25, "hidden_size": 32, "dropout": 0.0}


@pytest.mark.parametrize("flags, message", [
    (["--norm_type", "rmsnorm"], "--norm_type was prmsnorm there and is rmsnorm now"),
    (["--norm_eps", "0.1"], "--norm_eps was 1e-06 there and is 0.1 now"),
    (["--hidden_size", "80", "--qk_norm", "true"],
     "--hidden_size was 32 there and is 80 now, --qk_norm was False there and is True now"),
])
def test_an_architecture_flag_that_differs_from_the_checkpoint_is_refused(flags, message):
    from trainer.resume_checks import adopt_saved_architecture

    saved = {"config": {"norm_type": "prmsnorm", "norm_eps": 1e-6, "hidden_size": 32, "qk_norm": False}}
    with pytest.raises(ValueError) as refused:
        adopt_saved_architecture(CHECKPOINT, saved, parse_args("pretrain", flags))
    assert str(refused.value) == (f"--resume step_00000002: the checkpoint's model differs: {message}; the saved "
                                  f"weights have that architecture (resume without those flags, or start a new run)")


@pytest.mark.parametrize("given", [["--preset", "cpu-wide"], ["--preset=cpu-wide"], ["--config", "CONFIG"]])
def test_a_preset_typed_equal_to_the_default_is_compared_with_the_checkpoints(given, tmp_path):
    """`--preset cpu-wide` (the default) typed on a resume of a minimind-26m run went on as minimind-26m without a
    word, while any other preset typed was refused: a typed flag could not be told from the default."""
    from trainer.resume_checks import adopt_saved_architecture

    config = tmp_path / "run.yaml"
    config.write_text("preset: cpu-wide\n")
    saved = {"config": {"preset": "minimind-26m", "hidden_size": 512}}
    with pytest.raises(ValueError) as refused:
        adopt_saved_architecture(CHECKPOINT, saved, parse_args("pretrain", [str(config) if a == "CONFIG" else a
                                                                            for a in given]))
    assert "--preset was minimind-26m there and is cpu-wide now" in str(refused.value)
    bare = parse_args("pretrain", ["--learning_rate", "1e-3"])
    adopt_saved_architecture(CHECKPOINT, saved, bare)
    assert bare.preset == "minimind-26m"


def test_a_resumed_sft_run_keeps_the_smeared_keys_it_was_started_with():
    """SFT turns smeared keys on unless told otherwise: a run started with --smeared_keys false resumes without
    them (the task's default is not a flag the user gave)."""
    from trainer.resume_checks import adopt_saved_architecture

    args = parse_args("sft", [])
    adopt_saved_architecture(CHECKPOINT, {"config": {"smeared_keys": False, "hidden_size": 32}}, args)
    assert args.model["smeared_keys"] is False and "hidden_size" not in args.model  # fine-tuning: --from_weight's


def test_an_sft_flag_the_user_gives_is_not_taken_for_the_tasks_default():
    """`--smeared_keys true`, typed, on a run saved without them is a change the resume refuses (it was read as
    SFT's own default and dropped in silence); the flag equal to the checkpoint's is no change."""
    from trainer.resume_checks import adopt_saved_architecture

    with pytest.raises(ValueError) as refused:
        adopt_saved_architecture(CHECKPOINT, {"config": {"smeared_keys": False}},
                                 parse_args("sft", ["--smeared_keys", "true"]))
    assert "--smeared_keys was False there and is True now" in str(refused.value)
    args = parse_args("sft", ["--smeared_keys", "true"])
    adopt_saved_architecture(CHECKPOINT, {"config": {"smeared_keys": True}}, args)
    assert requested_model_fields(args)["smeared_keys"] is True


def test_sfts_default_is_applied_under_the_flags_not_recorded_as_one():
    assert parse_args("sft", []).model == {}
    assert parse_args("sft", ["--smeared_keys", "true"]).model == {"smeared_keys": True}


def test_the_built_model_must_have_the_checkpoints_architecture():
    from model.config import MiniNormConfig
    from trainer.resume_checks import check_saved_architecture

    config = MiniNormConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, norm_type="rmsnorm")
    check_saved_architecture(CHECKPOINT, {"config": {"hidden_size": 32, "norm_type": "rmsnorm"}}, config)
    with pytest.raises(ValueError) as refused:
        check_saved_architecture(CHECKPOINT, {"config": {"hidden_size": 64, "norm_type": "rmsnorm",
                                                         "dropout": 0.5}}, config)
    assert str(refused.value).startswith("--resume step_00000002: the checkpoint's model differs: hidden_size was 64 "
                                         "there and is 32 now; ")


# ---------------------------------------------------------------- which checkpoint, which files, what is removed
def test_a_process_needs_the_shared_files_and_its_own_rng_state_only():
    from trainer.checkpoint import files_needed_by

    files = ["model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"]
    assert files_needed_by(files, 1, 2) == ["trainer_state.json", "model.safetensors", "optimizer.bin",
                                            "random_states_1.pkl", "scheduler.bin"]
    # a third process where two saved starts from the seed: no RNG file of its own is needed
    assert files_needed_by(files, 2, 2) == ["trainer_state.json", "model.safetensors", "optimizer.bin",
                                            "scheduler.bin"]
    # a listing without this process's RNG state (it was not written): needed all the same
    assert files_needed_by(["model.safetensors"], 0, 1) == ["trainer_state.json", "model.safetensors",
                                                           "random_states_0.pkl"]


def test_a_save_removes_what_kills_left_but_no_complete_checkpoint(tmp_path):
    from trainer.checkpoint import _remove_leftovers

    root = tmp_path / "checkpoints"
    for name, complete in (("step_00000001", True), ("step_00000002", False), (".tmp_step_00000003", True),
                           (".tmp_step_00000001", False), ("notes", False)):
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / "trainer_state.json").write_text("{}")
    (root / "step_00000004").write_text("a file")
    _remove_leftovers(root)
    assert sorted(p.name for p in root.iterdir()) == ["notes", "step_00000001", "step_00000004"]


def test_a_resume_drops_its_own_runs_later_checkpoints_only(tmp_path):
    from types import SimpleNamespace

    from trainer.checkpoint import drop_later_checkpoints

    waits = []
    accelerator = SimpleNamespace(wait_for_everyone=lambda: waits.append(1))
    root = tmp_path / "run" / "checkpoints"
    for step in (1, 2, 3, 4):
        _write_state(tmp_path / "run", {**GOOD_STATE, "step": step}, name=f"step_{step:08d}")
    other = _write_state(tmp_path / "other", GOOD_STATE, name="step_00000002")  # another run's checkpoint
    assert drop_later_checkpoints(accelerator, root, other, writer=True) == []
    assert drop_later_checkpoints(accelerator, root, root / "step_00000002", writer=True) == [
        "step_00000003", "step_00000004"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"] and len(waits) == 2


@pytest.mark.parametrize("content, message", [
    ({**GOOD_STATE, "step": 0, "epoch": 1}, "'epoch' is 1, more than its 0 optimizer steps"),
    ({**GOOD_STATE, "train_time_s": -0.5}, "'train_time_s' must be a number >= 0, not -0.5"),
    ({**GOOD_STATE, "budget_fixed": "yes"}, "'budget_fixed' must be true or false, not 'yes'"),
    ({**GOOD_STATE, "objective_state": {"bco_mean": "0.1"}},
     "'objective_state' must be a JSON object of finite numbers, not {'bco_mean': '0.1'}"),
    ({**GOOD_STATE, "objective_state": [0.1]}, "'objective_state' must be a JSON object of finite numbers, not [0.1]"),
    ({**GOOD_STATE, "objective_state": {"bco_pairs": True}},
     "'objective_state' must be a JSON object of finite numbers, not {'bco_pairs': True}"),
    (json.dumps({**GOOD_STATE, "objective_state": {"bco_mean": 0.5}}).replace("0.5}", "1e999}"),
     "'objective_state' must be a JSON object of finite numbers, not {'bco_mean': inf}"),
], ids=lambda value: None)
def test_more_damaged_trainer_states(content, message, tmp_path):
    from trainer.checkpoint_state import read_trainer_state

    with pytest.raises(ValueError, match=re.escape(message)):
        step = (json.loads(content) if isinstance(content, str) else content)["step"]  # text: a number JSON can't write
        read_trainer_state(_write_state(tmp_path, content, name=f"step_{step:08d}"))
    sound = {**GOOD_STATE, "epoch": 3}  # as many epochs as steps: each epoch took one step
    assert read_trainer_state(_write_state(tmp_path, sound, name="sound_copy")) == sound


def test_a_position_at_the_end_of_the_epoch_and_a_checkpoint_that_recorded_no_value_resume():
    args = parse_args("pretrain", [])
    at_end = {**GOOD_STATE, "samples_done_in_epoch": 296, "config": {}}  # from before the flags: nothing to compare
    check_resume_compatible(CHECKPOINT, at_end, args, GOOD_STATE["data"])


def test_a_kept_flag_recorded_as_null_is_a_value_and_giving_it_is_refused():
    """A checkpoint that records a flag as null ran with it unset: a resume that gives it changes the run as much as
    one that changes a recorded value, and is refused the same way (only a name the checkpoint lacks, a flag from
    after it, is not compared); the advice says to resume without the flag."""
    unset = {**GOOD_STATE, "config": {"seed": None, "max_seq_len": 256}}
    with pytest.raises(ValueError) as refused:
        check_resume_compatible(CHECKPOINT, unset, parse_args("pretrain", ["--max_seq_len", "256"]), GOOD_STATE["data"])
    assert str(refused.value) == ("--resume step_00000002: --seed was unset there and is 42 now; the saved data "
                                  "position is only valid for the same samples in the same order (resume without "
                                  "--seed, or start a new run)")
    both = {**GOOD_STATE, "config": {"seed": None, "max_seq_len": 32}}
    with pytest.raises(ValueError, match=r"\(resume with --max_seq_len 32 and without --seed, or start a new run\)$"):
        check_resume_compatible(CHECKPOINT, both, parse_args("pretrain", []), GOOD_STATE["data"])


def test_the_changed_flags_name_settings_not_places():
    from trainer.resume_checks import changed_flags

    state = {"config": {"learning_rate": 0.001, "out_dir": "/a", "resume": None, "data_path": "/d/x.jsonl",
                        "max_steps": 10}}
    now = {"learning_rate": 0.002, "out_dir": "/b", "resume": "auto", "data_path": "/e/x.jsonl", "max_steps": 10,
           "warmup_steps": 5}  # a flag the checkpoint does not record (from after it): nothing to compare
    assert changed_flags(state, now) == "--learning_rate was 0.001 there and is 0.002 now"


def test_the_changed_flags_leave_out_how_the_machine_does_the_work(monkeypatch):
    """--num_proc (tokenizing workers), --threads and the collective timeouts cannot change the run's numbers beyond
    the last bits --threads' own note names: a resume that changes them notes only the setting that does change."""
    from trainer.resume_checks import changed_flags

    monkeypatch.setattr(trainer.threads, "usable_cores", lambda: 4)  # --threads 2 within them on any machine
    recorded = parse_args("pretrain", []).to_dict()
    machine = ["--num_proc", "4", "--threads", "2", "--dist_init_timeout", "3600", "--dist_timeout", "900"]
    assert changed_flags({"config": recorded}, parse_args("pretrain", machine).to_dict()) == ""
    now = parse_args("pretrain", [*machine, "--learning_rate", "0.5"]).to_dict()
    lr = recorded["learning_rate"]
    assert changed_flags({"config": recorded}, now) == f"--learning_rate was {lr} there and is 0.5 now"


RM = ["--reward_model", "/models/rm"]  # alone: no --reward functions (null in the config)


@pytest.mark.parametrize("task, recorded_flags, flags, note", [
    ("dpo", ["--loss_type", "sigmoid,sft"], ["--loss_type", "sigmoid,sft", "--loss_weights", "0.8,0.2"],
     "--loss_weights was unset there and is [0.8, 0.2] now"),
    ("grpo", RM, [*RM, "--reward", "think_format"], "--reward was unset there and is ['think_format'] now"),
    ("ppo", RM, [*RM, "--reward", "math_answer", "--reward", "think_format"],
     "--reward was unset there and is ['math_answer', 'think_format'] now"),
    ("grpo", [*RM, "--reward", "think_format"], RM, "--reward was ['think_format'] there and is unset now"),
])
def test_a_resume_that_gives_a_flag_the_checkpoint_recorded_unset_notes_it(task, recorded_flags, flags, note):
    """A flag the checkpoint records as null was unset in that run (DPO's --loss_weights: 1 each; GRPO's and PPO's
    --reward beside a --reward_model: no functions): a resume that gives it changes the objective and says so, as
    one that changes a recorded value or leaves it out does (it was silent: null read as not recorded); a
    checkpoint from before the flag (no such name) notes nothing."""
    from trainer.resume_checks import changed_flags

    recorded = parse_args(task, recorded_flags).to_dict()
    assert changed_flags({"config": recorded}, parse_args(task, flags).to_dict()) == note
    assert changed_flags({"config": recorded}, parse_args(task, recorded_flags).to_dict()) == ""
    name = note.split()[0][2:]
    before_the_flag = {key: value for key, value in recorded.items() if key != name}
    assert changed_flags({"config": before_the_flag}, parse_args(task, flags).to_dict()) == ""


@pytest.mark.parametrize("task, recorded_flags, flags, other", [
    ("grpo", [], ["--epsilon_high", "0.2"], ["--epsilon_high", "0.25"]),  # unset, the upper clip is --epsilon's
    ("grpo", ["--epsilon", "0.3"], ["--epsilon", "0.3", "--epsilon_high", "0.3"], ["--epsilon", "0.3",
                                                                                   "--epsilon_high", "0.2"]),
    ("dpo", [], ["--loss_weights", "1"], ["--loss_weights", "0.5"]),  # unset, 1 per --loss_type
    ("dpo", ["--loss_type", "sigmoid,sft"], ["--loss_type", "sigmoid,sft", "--loss_weights", "1,1"],
     ["--loss_type", "sigmoid,sft", "--loss_weights", "1,0.5"]),
    ("grpo", ["--reward", "think_format", "--reward", "math_answer"],  # unset, 1 each
     ["--reward", "think_format", "--reward", "math_answer", "--reward_weights", "1", "1"],
     ["--reward", "think_format", "--reward", "math_answer", "--reward_weights", "1", "2"]),
    ("ppo", RM, [*RM, "--reward_weights", "1"], [*RM, "--reward_weights", "0.5"]),
    ("ppo", [*RM, "--reward", "think_format"], [*RM, "--reward", "think_format", "--reward_weights", "1", "1"],
     [*RM, "--reward", "think_format", "--reward_weights", "2", "1"]),
    ("sft", [], ["--sft_data", "tools"], ["--sft_data", "chat"]),  # unset without --data_path: the tools set
])
def test_a_flag_given_at_the_value_it_has_unset_is_no_change(task, recorded_flags, flags, other, tmp_path):
    """A flag the checkpoint records as null whose value other flags decide (GRPO's --epsilon_high: --epsilon's;
    --loss_weights, --reward_weights: 1 each; SFT's --sft_data: tools) and a resume gives at that value, or the
    other way round, changes nothing: no note (it said '--epsilon_high was unset there and is 0.2 now' of the same
    clip range), and a finished run asked again with it is that run. Another value is still a change, named as
    recorded."""
    from trainer.resume_checks import changed_flags, finished_run_asked_again

    unset, given = parse_args(task, recorded_flags).to_dict(), parse_args(task, flags).to_dict()
    assert changed_flags({"config": unset}, given) == ""
    assert changed_flags({"config": given}, unset) == ""
    summary = _finished_run(unset, tmp_path)
    assert finished_run_asked_again(tmp_path, parse_args(task, ["--out_dir", str(tmp_path), *flags])) == summary
    assert finished_run_asked_again(tmp_path, parse_args(task, ["--out_dir", str(tmp_path), *other])) == {}
    name = next(flag for flag in other if flag not in recorded_flags)[2:]
    assert changed_flags({"config": unset}, parse_args(task, other).to_dict()) == (
        f"--{name} was unset there and is {parse_args(task, other).to_dict()[name]} now")
    before_the_flag = {key: value for key, value in unset.items() if key != name}  # not recorded: not compared
    assert changed_flags({"config": before_the_flag}, parse_args(task, other).to_dict()) == ""


def test_a_grpo_checkpoint_from_before_scale_rewards_notes_a_change_of_scaling():
    """A GRPO run recorded before --scale_rewards existed scaled as its loss type's default: resuming it with that
    scaling notes nothing, with another notes the change (it was silent: the flag is not in its config)."""
    from trainer.resume_checks import changed_flags

    for loss_type, scaled in (("grpo", "group"), ("dr_grpo", "none")):
        old = {"config": {"task": "grpo", "loss_type": loss_type, "learning_rate": 1e-5}}
        same = parse_args("grpo", ["--loss_type", loss_type]).to_dict()
        assert same["scale_rewards"] == scaled and changed_flags(old, same) == ""
        batch = parse_args("grpo", ["--loss_type", loss_type, "--scale_rewards", "batch"]).to_dict()
        assert changed_flags(old, batch) == f"--scale_rewards was {scaled} there and is batch now"
    recorded = {"config": {"task": "grpo", "loss_type": "dr_grpo", "scale_rewards": "group"}}
    assert changed_flags(recorded, parse_args("grpo", ["--loss_type", "dr_grpo", "--scale_rewards", "group"]
                                              ).to_dict()) == ""
    # recorded as null (unset): the loss type's default too, as _with_implied_flags says
    unset = {"config": {"task": "grpo", "loss_type": "dr_grpo", "scale_rewards": None}}
    assert changed_flags(unset, parse_args("grpo", ["--loss_type", "dr_grpo"]).to_dict()) == ""
    assert changed_flags(unset, parse_args("grpo", ["--loss_type", "dr_grpo", "--scale_rewards", "group"]
                                           ).to_dict()) == "--scale_rewards was none there and is group now"


def test_a_dpo_checkpoint_from_before_its_loss_flags_notes_another_loss():
    """A DPO run recorded before --loss_type and --label_smoothing were its flags had the plain sigmoid loss:
    resuming it so notes nothing, with another loss or smoothing notes the change (it was silent)."""
    from trainer.resume_checks import changed_flags

    old = {"config": {"task": "dpo", "beta": 0.15}}
    assert changed_flags(old, parse_args("dpo", []).to_dict()) == ""
    assert changed_flags(old, parse_args("dpo", ["--loss_type", "ipo"]).to_dict()) == \
        "--loss_type was sigmoid there and is ipo now"
    assert changed_flags(old, parse_args("dpo", ["--label_smoothing", "0.1"]).to_dict()) == \
        "--label_smoothing was 0.0 there and is 0.1 now"


def test_a_dpo_checkpoint_from_before_loss_weights_and_discopop_tau_implies_their_defaults():
    """A DPO run recorded before --loss_weights and --discopop_tau existed had one loss type of weight 1 and no
    discopop loss: resuming it as it was notes nothing; asking for discopop with another tau notes both changes."""
    from trainer.resume_checks import changed_flags

    old = {"config": {"task": "dpo", "beta": 0.15, "loss_type": "sigmoid", "label_smoothing": 0.0}}
    assert changed_flags(old, parse_args("dpo", []).to_dict()) == ""
    assert changed_flags(old, parse_args("dpo", ["--loss_type", "discopop", "--discopop_tau", "0.1"]).to_dict()) == \
        "--loss_type was sigmoid there and is discopop now, --discopop_tau was 0.05 there and is 0.1 now"
    assert changed_flags(old, parse_args("dpo", ["--loss_type", "sigmoid", "sft", "--loss_weights", "1", "0.5"]
                                         ).to_dict()) == "--loss_type was sigmoid there and is sigmoid,sft now"


def test_a_checkpoint_goes_on_only_in_its_own_kind_of_run(tmp_path):
    from trainer.resume_checks import check_same_task

    path = tmp_path / "run" / "checkpoints" / "step_00000002"
    check_same_task(path, {"config": {}}, parse_args("dpo", []))  # an older checkpoint that recorded no task
    with pytest.raises(ValueError, match=r"^--resume step_00000002: a sft run's checkpoint; this is the dpo trainer: "
                                         rf"go on with that run with `python trainer/train_full_sft.py --resume "
                                         rf"{re.escape(str(path))}`"):
        check_same_task(path, {"config": {"task": "sft"}}, parse_args("dpo", []))


def test_a_finished_run_asked_again_is_the_same_run_only_without_a_later_checkpoint(tmp_path):

    from trainer.resume_checks import finished_run_asked_again

    args = parse_args("pretrain", ["--out_dir", str(tmp_path)])
    recorded = {**args.to_dict(), "val_data_path": "/resolved/by/the/run.jsonl"}  # left unset on the command line
    recorded.pop("model")
    summary = _finished_run(recorded, tmp_path)
    _write_state(tmp_path, {**GOOD_STATE, "step": 4}, name="step_00000004")
    assert finished_run_asked_again(tmp_path, args) == summary
    assert finished_run_asked_again(tmp_path, parse_args("pretrain", ["--max_seq_len", "64"])) == {}
    _write_state(tmp_path, {**GOOD_STATE, "step": 6}, name="step_00000006")  # a longer continuation, stopped
    assert finished_run_asked_again(tmp_path, args) == {}
    for steps in ("x", None, 4.5, -1):  # a summary edited by hand (a TypeError traceback for "x"): not the run
        (tmp_path / "run_summary.json").write_text(json.dumps({**summary, "steps": steps}))
        assert finished_run_asked_again(tmp_path, args) == {}


def test_a_finished_grpo_run_from_before_scale_rewards_is_asked_again_only_with_its_scaling(tmp_path):
    """A finished GRPO run recorded before --scale_rewards existed scaled as its loss type's default: `--resume auto`
    with that scaling asks for it again; with another it does not (it was taken for the same run: the flag is not in
    its train_config.yaml)."""

    from trainer.resume_checks import finished_run_asked_again

    args = parse_args("grpo", ["--out_dir", str(tmp_path)])
    recorded = {name: value for name, value in args.to_dict().items() if name not in ("model", "scale_rewards")}
    summary = _finished_run(recorded, tmp_path)
    assert finished_run_asked_again(tmp_path, args) == summary
    batch = parse_args("grpo", ["--out_dir", str(tmp_path), "--scale_rewards", "batch"])
    assert finished_run_asked_again(tmp_path, batch) == {}


@pytest.mark.parametrize("task, flags, note", [
    ("ppo", ["--kl_estimator", "k3"], "--kl_estimator was k1 there and is k3 now"),
    ("ppo", ["--whiten_rewards"], "--whiten_rewards was False there and is True now"),
    ("ppo", ["--missing_eos_penalty", "1"], "--missing_eos_penalty was 0.0 there and is 1.0 now"),
    ("grpo", ["--importance_sampling_level", "sequence"],
     "--importance_sampling_level was token there and is sequence now"),
    ("distill", ["--distill_loss", "jsd"], "--distill_loss was kl there and is jsd now"),
    ("distill", ["--lmbda", "0.5", "--max_new_tokens", "64"],
     "--lmbda was 0.0 there and is 0.5 now, --max_new_tokens was 128 there and is 64 now"),
])
def test_a_run_from_before_trls_options_resumes_as_before_and_notes_a_change(task, flags, note, tmp_path):
    """A PPO run recorded before --kl_estimator, --whiten_rewards and --missing_eos_penalty ran with the k1 KL,
    unwhitened rewards and no penalty, a GRPO run before --importance_sampling_level with per-token ratios, a
    distillation run before GKD's flags with Hinton's KL on the data (the values the flags came with): resuming
    it so notes nothing, with another value notes the change (it was silent: the flag is not in its config); a
    finished such run is asked again by the same command only, not by one with the new value."""

    from trainer.resume_checks import changed_flags, finished_run_asked_again

    base = ["--num_iterations", "2"] if task == "grpo" else []  # sequence-level ratios need a second update
    args = parse_args(task, ["--out_dir", str(tmp_path), *base])
    new = ("kl_estimator", "whiten_rewards", "missing_eos_penalty", "importance_sampling_level", "distill_loss",
           "jsd_beta", "lmbda", "seq_kd", "max_new_tokens", "sampling_temperature")
    recorded = {name: value for name, value in args.to_dict().items() if name != "model" and name not in new}
    assert changed_flags({"config": recorded}, args.to_dict()) == ""
    asked = parse_args(task, [*base, *flags]).to_dict()
    assert changed_flags({"config": recorded}, asked) == note
    given = {flag[2:]: asked[flag[2:]] for flag in flags if flag.startswith("--")}
    assert changed_flags({"config": {**recorded, **given}}, asked) == ""  # a recorded value is kept, not replaced
    # only a name the config lacks takes the value from before the flag: one recorded as null was a value (unset)
    assert changed_flags({"config": {**recorded, **dict.fromkeys(given)}}, asked) == ", ".join(
        f"--{name} was unset there and is {value} now" for name, value in given.items())
    summary = _finished_run(recorded, tmp_path)
    assert finished_run_asked_again(tmp_path, args) == summary
    assert finished_run_asked_again(tmp_path, parse_args(task, ["--out_dir", str(tmp_path), *base, *flags])) == {}


@pytest.mark.parametrize("task", ["grpo", "ppo"])
def test_a_resume_with_another_reward_model_notes_it_and_the_same_directory_named_otherwise_does_not(task, tmp_path):
    """--reward_model changes the objective as --reward does: a resume whose reward model resolves to another
    directory than the checkpoint's, or that leaves it out or adds one, notes the change with both directories; the
    same directory named otherwise (another spelling, a symlink, a relative path from the repo root) notes nothing."""
    from trainer.resume_checks import changed_flags
    from trainer.run_dir import REPO_ROOT

    rm, other = tmp_path / "rm", tmp_path / "other"
    rm.mkdir(), other.mkdir()
    (tmp_path / "link").symlink_to(rm)

    def config(*reward_model: str) -> dict:
        flags = ["--reward", "math_answer", *(["--reward_model", *reward_model] if reward_model else [])]
        return parse_args(task, flags).to_dict()

    state = {"config": config(str(rm))}
    assert changed_flags(state, config(str(other))) == f"--reward_model was {rm} there and is {other} now"
    assert changed_flags(state, config()) == f"--reward_model was {rm} there and is unset now"
    assert changed_flags({"config": config()}, config(str(rm))) == f"--reward_model was unset there and is {rm} now"
    for same in (str(rm), str(other / ".." / "rm"), str(tmp_path / "link"), str(tmp_path / "link") + "/"):
        assert changed_flags(state, config(same)) == ""
    relative = {"config": config("out/rm")}  # typed from the repo root, as every path flag
    assert changed_flags(relative, config(str(REPO_ROOT / "out" / "rm"))) == ""
    assert changed_flags(relative, config(str(rm))) == \
        f"--reward_model was {REPO_ROOT / 'out' / 'rm'} there and is {rm} now"
    # beside another setting's change, in the same line
    changed = {**config(str(other)), "learning_rate": 1.0}
    assert changed_flags(state, changed) == (f"--learning_rate was {state['config']['learning_rate']} there and is "
                                             f"1.0 now, --reward_model was {rm} there and is {other} now")


@pytest.mark.parametrize("task", ["grpo", "ppo"])
def test_a_finished_run_asked_again_with_another_reward_model_is_another_run(task, tmp_path):
    """A finished GRPO or PPO run is asked again only by a command whose --reward_model names the same directory
    (however spelled): another directory, or none where it had one, asks for another run."""

    from trainer.resume_checks import finished_run_asked_again

    out, rm, other = tmp_path / "out", tmp_path / "rm", tmp_path / "other"
    for folder in (out, rm, other):
        folder.mkdir()

    def args(*reward_model: str):
        return parse_args(task, ["--out_dir", str(out), "--reward", "math_answer",
                                 *(["--reward_model", *reward_model] if reward_model else [])])

    recorded = {name: value for name, value in args(str(rm)).to_dict().items() if name != "model"}
    summary = _finished_run(recorded, out)
    assert finished_run_asked_again(out, args(str(rm))) == summary
    assert finished_run_asked_again(out, args(str(other / ".." / "rm"))) == summary
    assert finished_run_asked_again(out, args(str(other))) == {}
    assert finished_run_asked_again(out, args()) == {}


def test_which_run_a_directory_continues(tmp_path):
    from trainer.checkpoint import _one_run_per_directory

    out = tmp_path / "out"
    _write_state(out, GOOD_STATE, name="step_00000002")
    refused = _one_run_per_directory({}, None, out, None, overwrite=False)["refused"]
    assert refused.startswith(f"--out_dir {out} already holds a run: checkpoints (checkpoints/step_00000002); pass")
    assert _one_run_per_directory({}, None, out, None, overwrite=True)["clear"] is True
    # a checkpoint of a run before run ids, from elsewhere, into a directory that holds a run: not this run
    (out / "run_summary.json").write_text("{}")
    elsewhere = _write_state(tmp_path / "old", {}, name="step_00000002")
    decision = {"name": elsewhere.name, "state": {}}
    assert _one_run_per_directory(decision, str(elsewhere), out, elsewhere, overwrite=False)["refused"].startswith(
        f"--resume {elsewhere}: that checkpoint is of another run, and --out_dir {out} already holds a run")
    assert set(_one_run_per_directory(decision, "auto", out, None, overwrite=False)) == {"run_id"}  # its own


def test_resume_auto_takes_the_newest_checkpoint_every_process_holds_and_names_the_way_on(tmp_path):
    from trainer.checkpoint import _decide, _way_on

    root = tmp_path / "checkpoints"
    for step in (2, 3):
        _write_state(tmp_path, {**GOOD_STATE, "step": step}, name=f"step_{step:08d}")
    views = [(str(root), ["step_00000002", "step_00000003"]), ("/b/checkpoints", ["step_00000002"])]
    decision = _decide("auto", views, None)
    assert decision["name"] == "step_00000002"
    assert decision["note"] == ("rank 1 does not hold step_00000003; step_00000002 is the newest checkpoint every "
                                "process holds")
    assert _way_on(root / "step_00000003") == ("resume from the checkpoint before it with --resume "
                                               f"{root / 'step_00000002'}")
    assert _way_on(root / "step_00000002").startswith("there is no earlier checkpoint to resume from")


def test_saves_keep_the_newest_and_a_resume_names_a_missing_file_in_one_line(tmp_path):
    from accelerate import Accelerator

    from trainer.checkpoint import CheckpointUnreadable, agree_on_start, save_checkpoint

    accelerator, root = Accelerator(cpu=True), tmp_path / "checkpoints"
    for step in (1, 2, 3):
        save_checkpoint(accelerator, root, step, {**GOOD_STATE, "step": step, "files": None}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003"]
    assert agree_on_start(accelerator, "auto", tmp_path, None).resume.path == root / "step_00000003"
    (root / "step_00000003" / "random_states_0.pkl").unlink()
    with pytest.raises(CheckpointUnreadable) as refused:
        agree_on_start(accelerator, "auto", tmp_path, None)
    assert str(refused.value) == (f"--resume auto: {root / 'step_00000003' / 'random_states_0.pkl'} is missing or "
                                  f"cannot be read; the checkpoint is incomplete: resume from the checkpoint before it "
                                  f"with --resume {root / 'step_00000002'}")


# ---------------------------------------------------------------- the files of a checkpoint, as its save wrote them
def _save_trained_checkpoints(tmp_path: Path, steps: tuple[int, ...]):
    """Checkpoints of a small model and its AdamW moments, one optimizer step apart: (accelerator, their root)."""
    import torch
    from accelerate import Accelerator

    from trainer.checkpoint import save_checkpoint

    torch.manual_seed(0)
    accelerator, root = Accelerator(cpu=True), tmp_path / "checkpoints"
    model = torch.nn.Linear(8, 8)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    for step in steps:
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        save_checkpoint(accelerator, root, step, {**GOOD_STATE, "step": step, "files": None}, keep=len(steps))
    return accelerator, root


NOT_THE_SAVED_FILE = "not the file this checkpoint saved (replaced, truncated or damaged since)"
NO_EARLIER_CHECKPOINT = "there is no earlier checkpoint to resume from: start the run anew (--overwrite)"


def _auto_resume_refused(accelerator, out_dir) -> str:
    """The one-line refusal of `--resume auto` in out_dir, whose newest checkpoint the digest check refuses."""
    from trainer.checkpoint import agree_on_start
    from trainer.checkpoint_state import CheckpointDamaged

    with pytest.raises(CheckpointDamaged) as refused:
        agree_on_start(accelerator, "auto", out_dir, None)
    return str(refused.value)


def test_a_save_records_the_size_and_sha256_of_every_file_it_wrote(tmp_path):
    import hashlib

    _, root = _save_trained_checkpoints(tmp_path, (1,))
    checkpoint = root / "step_00000001"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    written = sorted(p.name for p in checkpoint.iterdir() if p.name != "trainer_state.json")
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl"} <= set(written)
    assert state["digests"] == {name: {"bytes": len((checkpoint / name).read_bytes()),
                                       "sha256": hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()}
                                for name in written}


def test_a_file_copied_in_from_another_checkpoint_is_refused_before_anything_is_loaded(tmp_path):
    """A model.safetensors of step 1 in step 2's folder: the same size and names, and the resume went on with step
    1's weights under step 2's optimizer moments, without a word."""
    from trainer.checkpoint import agree_on_start

    accelerator, root = _save_trained_checkpoints(tmp_path, (1, 2))
    newest, before = root / "step_00000002", root / "step_00000001"
    (newest / "model.safetensors").write_bytes((before / "model.safetensors").read_bytes())
    assert _auto_resume_refused(accelerator, tmp_path) == (
        f"--resume auto: {newest / 'model.safetensors'} has another sha256 than trainer_state.json records: "
        f"{NOT_THE_SAVED_FILE}; resume from the checkpoint before it with --resume {before}")
    assert agree_on_start(accelerator, str(before), tmp_path, before).resume.note == ""  # verified, nothing to say


def test_a_truncated_optimizer_file_is_refused_naming_its_size(tmp_path):
    accelerator, root = _save_trained_checkpoints(tmp_path, (1,))
    optimizer = root / "step_00000001" / "optimizer.bin"
    saved = len(optimizer.read_bytes())
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    assert _auto_resume_refused(accelerator, tmp_path) == (
        f"--resume auto: {optimizer} holds 100 bytes, where trainer_state.json records {saved}: {NOT_THE_SAVED_FILE}; "
        f"{NO_EARLIER_CHECKPOINT}")


def test_a_checkpoint_saved_before_digests_resumes_with_a_note(tmp_path):
    from trainer.checkpoint import agree_on_start

    accelerator, root = _save_trained_checkpoints(tmp_path, (1,))
    state_file = root / "step_00000001" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["digests"]
    state_file.write_text(json.dumps(state))
    start = agree_on_start(accelerator, "auto", tmp_path, None)
    assert start.resume.path == root / "step_00000001"
    assert start.resume.note == ("its trainer_state.json records no digests of its files (written before MiniNorm "
                                 "recorded them): they were not verified")


def test_a_file_the_check_cannot_read_is_refused_in_one_line(tmp_path, monkeypatch):
    """Under several processes only the writer checks the digests while the others wait for its word: an OSError
    escaping the check would end that one process with a traceback and leave the others waiting."""
    import trainer.checkpoint_state as checkpoint_state

    accelerator, root = _save_trained_checkpoints(tmp_path, (1,))
    unreadable = root / "step_00000001" / "optimizer.bin"

    def cannot_read(folder, names):
        raise PermissionError(13, "Permission denied", str(unreadable))

    monkeypatch.setattr(checkpoint_state, "file_digests", cannot_read)
    assert _auto_resume_refused(accelerator, tmp_path) == (
        f"--resume auto: {unreadable} cannot be read (Permission denied); {NO_EARLIER_CHECKPOINT}")


def test_file_digests_and_verify_digests_against_hashlib(tmp_path):
    """file_digests pairs each name with its own file's size and sha256 whatever the order of the names;
    verify_digests names the first file (in name order) that is missing or has another size, then one with other
    bytes of the same size."""
    import hashlib

    from trainer.checkpoint_state import file_digests, verify_digests

    contents = {"a.bin": b"first file", "b.bin": b"the second, longer", "c.bin": b"3"}
    for name, data in contents.items():
        (tmp_path / name).write_bytes(data)
    recorded = file_digests(tmp_path, ["c.bin", "a.bin", "b.bin"])
    assert recorded == {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                        for name, data in contents.items()}
    assert verify_digests(tmp_path, recorded) is None
    (tmp_path / "a.bin").write_bytes(b"first file, grown")
    assert verify_digests(tmp_path, recorded) == (f"{tmp_path / 'a.bin'} holds 17 bytes, where trainer_state.json "
                                                  f"records 10")
    (tmp_path / "a.bin").write_bytes(b"FIRST FILE")
    assert verify_digests(tmp_path, recorded) == (f"{tmp_path / 'a.bin'} has another sha256 than trainer_state.json "
                                                  f"records")
    (tmp_path / "a.bin").unlink()
    assert verify_digests(tmp_path, recorded) == f"{tmp_path / 'a.bin'} is missing"


def test_another_machines_writer_checks_its_copy_against_its_own_state(tmp_path):
    """Without shared storage each machine's first process wrote its own copy and its own trainer_state.json: it
    checks its files against that, not against the digests the main process's state records."""
    from trainer.checkpoint import _check_digests

    _, root = _save_trained_checkpoints(tmp_path, (1,))
    checkpoint = root / "step_00000001"
    main_state = json.loads((checkpoint / "trainer_state.json").read_text())
    main_state["digests"] = {name: {**entry, "sha256": "0" * 64} for name, entry in main_state["digests"].items()}
    assert _check_digests(checkpoint, main_state, main=False) is None
    assert "has another sha256" in _check_digests(checkpoint, main_state, main=True)


def test_another_machines_writer_without_its_state_is_refused_naming_rank_path_and_file_once(tmp_path, monkeypatch):
    """Without shared storage another machine's first process reads its own trainer_state.json; where its copy has
    none, every process's one line names the rank, the checkpoint and the missing file, and says --resume once."""
    from types import SimpleNamespace

    import trainer.checkpoint as checkpoint_module

    _, root = _save_trained_checkpoints(tmp_path, (1,))
    checkpoint = root / "step_00000001"
    main_state = json.loads((checkpoint / "trainer_state.json").read_text())
    (checkpoint / "trainer_state.json").unlink()  # this machine's copy (rank 1's) lacks it
    monkeypatch.setattr(checkpoint_module, "gather_object", lambda mine: [None, *mine])  # rank 0's check passed
    rank_1 = SimpleNamespace(is_main_process=False, is_local_main_process=True)
    with pytest.raises(checkpoint_module.CheckpointDamaged) as refused:
        checkpoint_module._check_writers_copies(rank_1, "auto", checkpoint, main_state, shared_storage=False)
    assert str(refused.value) == (f"--resume auto: rank 1: {checkpoint}: not a complete checkpoint (no "
                                  f"trainer_state.json); {NO_EARLIER_CHECKPOINT}")


def test_an_unused_val_fraction_does_not_refuse_a_resume(tmp_path, capsys):
    """A run without --data_path (the embedded data's own split) never read --val_fraction: a checkpoint saved before
    the unused-flag rule may record one, and its `--resume auto --config RUN/train_config.yaml` (the rule sets the
    YAML's unused value back to the default, noting it) must resume, not be refused for another --val_fraction; a
    --data_path run, whose split it decides, is refused still."""
    recorded = tmp_path / "train_config.yaml"
    recorded.write_text("val_fraction: 0.2\n")
    args = parse_args("pretrain", ["--config", str(recorded)])
    assert args.val_fraction == 0.01 and "--val_fraction=0.2" in capsys.readouterr().err
    check_resume_compatible(CHECKPOINT, _state(val_fraction=0.2), args, {})
    check_resume_compatible(CHECKPOINT, _state(val_fraction=0.2), parse_args("pretrain", []), {})
    with pytest.raises(ValueError, match="--val_fraction was 0.2 there and is 0.01 now"):
        check_resume_compatible(CHECKPOINT, _state(val_fraction=0.2),
                                parse_args("pretrain", ["--data_path", str(tmp_path / "d.jsonl")]), {})


@pytest.mark.parametrize("task, flags, unused", [
    ("pretrain", ["--max_steps", "4"], {"epochs": 3}),  # --epochs beside a fixed --max_steps
    ("sft", ["--max_steps", "4"], {"val_fraction": 0.2, "muon_lr": 0.5}),  # no --data_path; --optimizer adamw
])
def test_a_finished_run_recorded_with_unused_flags_is_that_run_asked_again_with_its_yaml(task, flags, unused, tmp_path,
                                                                                         capsys):
    """A run finished before the unused-flag rule may record flags it never read; `--config RUN/train_config.yaml
    --resume auto` sets them back to their defaults (noted), and is still that finished run (nothing to train), not
    another run; a flag the run did read, changed, is still another run."""
    from trainer.resume_checks import finished_run_asked_again

    recorded = {**parse_args(task, ["--out_dir", str(tmp_path), *flags]).to_dict(), **unused}
    del recorded["model"]
    summary = _finished_run(recorded, tmp_path)
    args = parse_args(task, ["--config", str(tmp_path / "train_config.yaml"), "--resume", "auto"])
    assert capsys.readouterr().err.startswith("note: unused flags left at their defaults: ")
    assert all(getattr(args, name) != value for name, value in unused.items())
    assert finished_run_asked_again(tmp_path, args) == summary
    longer = parse_args(task, ["--config", str(tmp_path / "train_config.yaml"), "--resume", "auto", "--max_steps", "5"])
    assert finished_run_asked_again(tmp_path, longer) == {}


def test_a_recorded_config_gains_no_flag_it_does_not_record():
    """A run recorded before a flag existed is not compared on it; setting back the recorded flags a run did not use
    must not add one (a partial config reads TrainArgs' own defaults, a Muon rate that is not pretraining's)."""
    from trainer.resume_checks import _unused_at_defaults

    assert _unused_at_defaults({"task": "pretrain", "max_steps": 6}) == {"task": "pretrain", "max_steps": 6}
    assert _unused_at_defaults({"task": "pretrain", "max_steps": 6, "epochs": 3}) == {
        "task": "pretrain", "max_steps": 6, "epochs": 1}


def test_a_finished_sweep_trial_with_a_model_flag_its_start_set_back_is_that_run_asked_again(tmp_path):
    """A sweep trial's --prms_p 0.5 beside no --norm_type (rmsnorm, cpu-wide's) is set back when the trial starts
    afresh under `--resume auto` (trainer/arg_checks.py, check_model_flags_at_start), so its recorded model has the
    preset's p; the trial rerun with the same flags (a runner killed after it finished) compared its 0.5 with that
    and trained the trial again instead of returning it. A --prms_p the recorded prmsnorm model reads, changed, is
    another run."""
    from trainer.arg_checks import check_model_flags_at_start
    from trainer.arg_fields import MODEL_FIELDS, build_model_config
    from trainer.args import check_args
    from trainer.resume_checks import finished_run_asked_again

    def recorded_run(argv: list[str]) -> dict:
        first = check_args("pretrain", ["--out_dir", str(tmp_path), "--resume", "auto", *argv])
        check_model_flags_at_start(first, resumed=False)  # no checkpoint in the trial's folder yet
        built = build_model_config(first, vocab_size=6400)  # trainer/run_inputs.py, effective_config
        return {**{k: v for k, v in first.to_dict().items() if k != "model"},
                **{name: getattr(built, name) for name in MODEL_FIELDS}}

    summary = _finished_run(recorded_run(["--prms_p", "0.5"]), tmp_path)
    rerun = check_args("pretrain", ["--out_dir", str(tmp_path), "--resume", "auto", "--prms_p", "0.5"])
    assert finished_run_asked_again(tmp_path, rerun) == summary
    _finished_run(recorded_run(["--norm_type", "prmsnorm", "--prms_p", "0.5"]), tmp_path)
    rerun = check_args("pretrain", ["--out_dir", str(tmp_path), "--resume", "auto", "--norm_type", "prmsnorm",
                                    "--prms_p", "0.25"])
    assert finished_run_asked_again(tmp_path, rerun) == {}


@pytest.mark.parametrize("task", ["sft", "lora", "dpo", "distill", "grpo", "ppo"])
def test_a_fine_tuning_resumes_model_flags_are_checked_at_parsing(task):
    """Only a pretraining --resume leaves its model flags' checks to its start (trainer/arg_checks.py,
    model_checked_at_start: its checkpoint's shape completes them); a fine-tuning run's model is its --from_weight's,
    so a --resume's --dropout past [0, 1) is refused at parsing, in the words of the same command without --resume,
    before any process starts."""
    from trainer.args import check_args

    refusals = []
    for resume in ([], ["--resume", "auto"]):
        with pytest.raises(ValueError) as refused:
            check_args(task, ["--out_dir", "/nonexistent/run", "--dropout", "1.5", *resume])
        refusals.append(str(refused.value))
    assert refusals == ["dropout=1.5 is not allowed; it must be a float in [0, 1)"] * 2


@pytest.mark.parametrize("resume", ["auto", "/runs/x/checkpoints/step_00000002"])
def test_a_pretraining_resumes_model_flags_wait_for_its_checkpoint(resume):
    """A pretraining --resume, `auto` or a checkpoint's path, leaves the model flags' own checks to its start, against
    the checkpoint's shape (trainer/arg_checks.py, check_model_flags_at_start): a --num_attention_heads 3 that
    --preset's width 320 refuses is taken at parsing, and refused there without --resume."""
    from trainer.args import check_args

    argv = ["--out_dir", "/nonexistent/run", "--num_attention_heads", "3"]
    assert check_args("pretrain", [*argv, "--resume", resume]).model["num_attention_heads"] == 3
    with pytest.raises(ValueError, match=r"^num_attention_heads=3 is not allowed; it must divide hidden_size=320 "
                                         r"\(or set head_dim\)$"):
        check_args("pretrain", argv)


def test_a_pretraining_resumes_deferred_model_checks_run_at_its_start(tmp_path):
    """What a pretraining --resume left for its start (trainer/arg_checks.py, check_model_flags_at_start): the model
    config's own checks whether or not a checkpoint is found (--dropout 1.5); where none is (`--resume auto` in an
    empty --out_dir), the unused-flag rule of the same command without --resume: a typed --prms_p beside the default
    rmsnorm refused in the plain run's words, a --config YAML's set back, with the note the run prints."""
    from trainer.arg_checks import check_model_flags_at_start

    argv = ["--out_dir", "/nonexistent/run", "--resume", "auto"]
    for resumed in (True, False):
        with pytest.raises(ValueError, match=r"^dropout=1.5 is not allowed; it must be a float in \[0, 1\)$"):
            check_model_flags_at_start(parse_args("pretrain", [*argv, "--dropout", "1.5"]), resumed=resumed)
    typed = parse_args("pretrain", [*argv, "--prms_p", "0.5"])  # taken at parsing: a checkpoint may be prmsnorm
    with pytest.raises(ValueError) as refused:
        check_model_flags_at_start(typed, resumed=False)
    assert str(refused.value) == ("--prms_p=0.5 is not allowed; only --norm_type prmsnorm uses it: give --norm_type "
                                  "prmsnorm with it, or leave --prms_p out")
    config = tmp_path / "run.yaml"
    config.write_text("prms_p: 0.5\n")
    from_yaml = parse_args("pretrain", [*argv, "--config", str(config)])
    assert from_yaml.model == {"prms_p": 0.5}
    assert check_model_flags_at_start(from_yaml, resumed=False) == (
        "note: unused flags left at their defaults: --prms_p=0.5 (only --norm_type prmsnorm uses it)")
    assert from_yaml.model == {} and "prms_p" not in from_yaml.given
