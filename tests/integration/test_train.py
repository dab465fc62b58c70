"""The training core in one process on a tiny model: outputs, gradient accumulation against the full batch (SFT's
uneven label masks included), SFT from a pretrained dir and its real-token throughput, --compile against eager,
the validation split by document, divergence handling, flags. Resume: tests/integration/test_train_resume.py; several
processes (DDP, FSDP2): tests/integration/test_train_processes.py."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch
import yaml
from accelerate.state import AcceleratorState
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.training_runs import (REPO, SFT_STEPS, STEPS, TINY, pretrain_argv, refused_run, run_in_process, sft_argv,
                                 strict_json_files, train_losses, val_losses, write_jsonl)
from trainer.arg_fields import build_model_config
from trainer.args import args_from_run_config, parse_args
from trainer.command import main
from trainer.core import Trainer
from trainer.run_dir import final_metric, read_metrics, read_summary
from trainer.run_summary import TrainingDiverged


def test_pretrain_writes_a_loadable_hf_model_dir(reference_run):
    summary = json.loads((reference_run / "run_summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == STEPS
    from trainer.machine import machine_line
    cpu_and_torch = machine_line().split(" thread(s)")[0].rsplit(", ", 1)[0]  # all but the thread count and date
    assert summary["machine"].startswith(cpu_and_torch + ", ")  # the run names the machine it ran on
    described = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty", "--abbrev=12"],
                               capture_output=True, text=True)
    assert summary["code"] == (described.stdout.strip() if described.returncode == 0 else "unknown")  # and the code
    losses = train_losses(reference_run)
    assert len(losses) == STEPS and losses[-1] < losses[0]
    val = read_metrics(reference_run / "metrics.jsonl", "val")
    assert [r["step"] for r in val] == [4, 8] and summary["final_val"]["loss"] == pytest.approx(val[-1]["val_loss"])
    assert summary["sample"].startswith("The history of")
    model = AutoModelForCausalLM.from_pretrained(reference_run)
    assert type(model).__name__ == "MiniNormForCausalLM"
    assert model.config.norm_type == "rmsnorm" and model.config.norm_placement == "pre"
    assert model.generation_config.eos_token_id == 2
    tokenizer_config = json.loads((reference_run / "tokenizer_config.json").read_text())
    template = tokenizer_config.get("chat_template") or (reference_run / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template
    # The resumable state keeps its weights in fp32. (The last checkpoint is step 6 of 8, so its values are not
    # the final model's; resume tests compare the continued curve instead.)
    checkpoint = sorted((reference_run / "checkpoints").iterdir())[-1]
    weights = load_file(checkpoint / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in weights.values())



def test_the_run_writes_files_with_the_mode_a_plain_open_gives(reference_run):
    """safetensors writes its file through a private temporary one: the model's and every checkpoint's
    model.safetensors were 0600, readable by their owner only (a model trained in a group's folder, a chat or server
    run by another user, another user's process reading a checkpoint on shared storage), while every other file the
    run writes had the umask's mode."""
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {path.relative_to(reference_run).as_posix(): oct(stat.S_IMODE(path.stat().st_mode))
             for path in reference_run.rglob("*") if path.is_file()}
    assert "checkpoints/step_00000006/model.safetensors" in modes
    assert modes == dict.fromkeys(modes, oct(0o666 & ~umask))

@pytest.mark.parametrize("task", ["pretrain", "sft"])
def test_gradient_accumulation_matches_the_full_batch(task, train_data, reference_run, sft_reference_run,
                                                      tmp_path):
    """Batch 2 x 2 micro-steps against batch 4. On SFT data the micro-batches hold very different numbers of
    supervised tokens: a loss averaged per micro-batch (the classic bug) weights them wrongly and fails here."""
    out_dir = tmp_path / "accumulated"
    extra = ("--batch_size", "2", "--accumulation_steps", "2")
    if task == "pretrain":
        run_in_process(task, pretrain_argv(train_data, out_dir, *extra))
        reference = reference_run
    else:
        run_in_process(task, sft_argv(train_data, reference_run, out_dir, *extra))
        reference = sft_reference_run
    assert train_losses(out_dir) == pytest.approx(train_losses(reference), rel=1e-5)
    ours, theirs = load_file(out_dir / "model.safetensors"), load_file(reference / "model.safetensors")
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-4, atol=1e-5)


def test_sft_continues_from_the_pretrained_dir(train_data, reference_run, sft_reference_run, tokenizer, tmp_path,
                                               capsys):
    summary = json.loads((sft_reference_run / "run_summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == SFT_STEPS
    losses = train_losses(sft_reference_run)
    assert losses[-1] < losses[0]
    pretrained = load_file(reference_run / "model.safetensors")
    tuned = load_file(sft_reference_run / "model.safetensors")
    assert pretrained.keys() == tuned.keys() and any(not torch.equal(pretrained[k], tuned[k]) for k in tuned)
    capsys.readouterr()
    with pytest.raises(SystemExit):  # refused with the flags, before anything is loaded
        run_in_process("sft", sft_argv(train_data, reference_run, tmp_path / "x", "--hidden_size", "64"))
    error = capsys.readouterr().err.splitlines()[0]
    assert error.startswith("error: --hidden_size cannot change when fine-tuning"), error


def test_sft_throughput_counts_real_tokens(train_data, reference_run, tokenizer, tmp_path):
    """One epoch over a whole file (given as its own validation set, so nothing is held out): tokens_seen is every
    conversation's real length, counted here with the tokenizer, and tokens/s is those tokens over the steps' time
    (the first step, with its warm-up, left out), not the padded batch x max_seq_len."""
    rows = [json.loads(line) for line in (train_data / "sft.jsonl").read_text().splitlines()][:48]
    data = write_jsonl(tmp_path / "sft48.jsonl", rows)
    real = sum(min(64, len(tokenizer.apply_chat_template(row["conversations"], tokenize=True)["input_ids"]))
               for row in rows)
    argv = sft_argv(train_data, reference_run, tmp_path / "run", "--batch_size", "4", "--max_steps", "-1",
                    "--epochs", "1")
    argv[argv.index("--data_path") + 1] = str(data)
    summary = run_in_process("sft", [*argv, "--val_data_path", str(data)])
    assert summary.steps == 12 and summary.tokens_seen == real < 12 * 4 * 64
    steps = read_metrics(tmp_path / "run", "train")
    first_step_tokens = steps[0]["tokens_seen"]
    seconds = sum(r["step_time_s"] for r in steps[1:])
    assert summary.tokens_per_s == pytest.approx((real - first_step_tokens) / seconds, rel=1e-9)


def test_sft_run_notes_the_supervision_its_max_seq_len_cuts(train_data, reference_run, tokenizer, tmp_path, capsys):
    """A reply longer than --max_seq_len allows loses its end: the run says how many samples and supervised tokens,
    counted here from the tokenizer's own chat template; a run whose replies all fit says nothing."""
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    reply = "A long answer that keeps going " * 8
    long = [{"role": "user", "content": "Tell me everything."}, {"role": "assistant", "content": reply}]
    data = write_jsonl(tmp_path / "cut.jsonl", [{"conversations": short}, {"conversations": long}] * 2)
    full = tokenizer.apply_chat_template(long, tokenize=True)["input_ids"]
    answer = len(tokenizer(reply, add_special_tokens=False)["input_ids"]) + 1  # the reply, then <|im_end|>
    end = len(full) - 1  # the answer's tokens end before the closing newline
    assert end - answer < 64 < end
    cut = end - 64
    base = [*sft_argv(train_data, reference_run, tmp_path / "run", "--max_steps", "1", "--batch_size", "2"),
            "--val_data_path", str(data)]
    base[base.index("--data_path") + 1] = str(data)
    run_in_process("sft", base)
    printed = capsys.readouterr().out
    given = 2 * (answer + len(tokenizer("Hello.", add_special_tokens=False)["input_ids"]) + 1)
    assert (f"note: --max_seq_len 64 cuts the supervised end off 2 of 4 samples ({2 * cut} of their {given} "
            f"supervised tokens, {2 * cut / given:.1%}); a larger --max_seq_len keeps them") in printed
    base[base.index("--max_seq_len") + 1] = str(len(full))
    base[base.index("--out_dir") + 1] = str(tmp_path / "fits")
    run_in_process("sft", base)
    assert "cuts the supervised end" not in capsys.readouterr().out


def test_a_warmup_not_shorter_than_the_run_is_one_note_on_stderr(train_data, tmp_path, capsys):
    """--warmup_steps 3 on a run of 3 steps (or a task's default warmup past a short --max_steps) never reaches the
    peak rate, and the run said nothing: now one note line at the start (trainer/schedule.py, warmup_note)."""
    run_in_process("pretrain", pretrain_argv(train_data, tmp_path / "run", "--max_steps", "3", "--warmup_steps", "3"))
    notes = [line for line in capsys.readouterr().err.splitlines() if "--warmup_steps" in line]
    assert notes == ["note: --warmup_steps 3 is not shorter than the run's 3 optimizer steps: the learning rate rises "
                     "all run, to 3/4 of its peak at the last step, and never decays; a --warmup_steps below 3 "
                     "reaches the peak"]


def test_compile_matches_eager_evaluates_and_samples(train_data, reference_run, tmp_path):
    """--compile on: the same losses as the eager reference (tolerance), validation and the sample run, checkpoints
    and the final model save. (Resuming compiled, under DDP and FSDP2: tests/integration/test_train_processes.py.)"""
    out_dir = tmp_path / "compiled"
    argv = pretrain_argv(train_data, out_dir, "--batch_size", "4", "--compile", "on")
    summary = run_in_process("pretrain", argv)
    assert summary.status == "finished" and summary.sample.startswith("The history of")
    assert train_losses(out_dir) == pytest.approx(train_losses(reference_run), rel=1e-5)
    assert val_losses(out_dir) == pytest.approx(val_losses(reference_run), rel=1e-5)
    ours, theirs = load_file(out_dir / "model.safetensors"), load_file(reference_run / "model.safetensors")
    assert ours.keys() == theirs.keys()  # compiling in place keeps the plain module's names
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-4, atol=1e-5)
    assert sorted(p.name for p in (out_dir / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]


@pytest.mark.parametrize(("max_steps", "compiled"), [(999, False), (1000, True)])
def test_compile_auto_compiles_long_runs_only(train_data, tmp_path, max_steps, compiled):
    """--compile auto: the one-time compile (tens of seconds on a CPU) is paid from 1000 optimizer steps on; a
    shorter run stays eager. Only the trainer is built (compiling happens at the first forward)."""
    from trainer.core import Trainer

    AcceleratorState._reset_state(reset_partial_state=True)
    argv = pretrain_argv(train_data, tmp_path / "run", "--compile", "auto", "--max_steps", str(max_steps))
    trainer = Trainer(parse_args("pretrain", argv))
    assert trainer.compiled is compiled
    assert hasattr(trainer.unwrapped, "_compiled_call_impl") and (trainer.unwrapped._compiled_call_impl is not None) \
        is compiled


@pytest.mark.parametrize(("checkpointing", "options"), [("false", {"cpp_wrapper": True}), ("true", {})])
def test_a_cpu_compile_builds_with_the_cpp_wrapper_except_under_gradient_checkpointing(train_data, tmp_path,
                                                                                      monkeypatch, checkpointing,
                                                                                      options):
    """--compile on, on CPU: Inductor's C++ wrapper (one built module per graph; test_compile_matches_eager_... runs
    it), but not with --gradient_checkpointing, whose recomputation's RNG-state op torch 2.13's C++ wrapper cannot
    call (an InductorError at the first step); on a GPU, Inductor's defaults. Only the trainer is built."""
    from model.model import MiniNormForCausalLM
    from trainer.core import Trainer
    from trainer.machine import compile_options

    asked = []
    monkeypatch.setattr(MiniNormForCausalLM, "compile", lambda self, **kwargs: asked.append(kwargs))
    AcceleratorState._reset_state(reset_partial_state=True)
    argv = pretrain_argv(train_data, tmp_path / "run", "--compile", "on", "--gradient_checkpointing", checkpointing)
    Trainer(parse_args("pretrain", argv))
    assert asked == [{"options": options}]
    assert compile_options(torch.device("cuda"), gradient_checkpointing=False) == {}


@pytest.mark.parametrize("missing", ["headers", "compiler"])
def test_a_machine_without_compile_build_tools_refuses_compile_flags_and_runs_the_auto_choices_eagerly(
        train_data, tmp_path, monkeypatch, capsys, request, missing):
    """On CPU Inductor builds C++ that includes Python.h, with g++: without the headers (Debian's python3-dev) or
    the compiler, the default run (norm_impl auto compiles the norms on CPU) and any compiled run ended at their
    first step in an InductorError traceback. Now --compile on and --norm_impl compile are refused in one line before
    the data is read, and the auto choices say why and stay eager."""
    import sysconfig

    import torch._inductor.config as inductor_config

    from model.kernels.compiled import cpu_compile_problem
    from model.norms import resolve_norm_impl
    from trainer.core import Trainer

    if missing == "headers":
        real_get_path = sysconfig.get_path
        monkeypatch.setattr(sysconfig, "get_path", lambda name, *more, **named: str(tmp_path) if name == "include"
                            else real_get_path(name, *more, **named))
        said = (f"Python's C headers are missing ({tmp_path / 'Python.h'}; on Debian and Ubuntu: apt install "
                f"python3-dev)")
    else:  # Inductor's own config, patched its way (a monkeypatch of the proxy broke it for the next tests)
        no_compiler = inductor_config.patch({"cpp.cxx": ("no-such-c++-compiler",)})
        no_compiler.__enter__()
        request.addfinalizer(lambda: no_compiler.__exit__(None, None, None))
        said = "Inductor finds no C++ compiler (g++; on Debian and Ubuntu: apt install g++)"
    cpu_compile_problem.cache_clear()  # checked once per process: again here, and again after the test
    try:
        for flag, value, instead in (("--compile", "on", "off"), ("--norm_impl", "compile", "eager")):
            AcceleratorState._reset_state(reset_partial_state=True)
            with pytest.raises(ValueError) as error:
                Trainer(parse_args("pretrain", pretrain_argv(train_data, tmp_path / "refused", flag, value)))
            assert str(error.value) == (f"{flag} {value}: torch.compile cannot build here: {said}; or run with "
                                        f"{flag} {instead}")
        AcceleratorState._reset_state(reset_partial_state=True)
        trainer = Trainer(parse_args("pretrain", pretrain_argv(train_data, tmp_path / "auto", "--compile", "auto",
                                                               "--norm_impl", "auto", "--max_steps", "1000")))
        assert not trainer.compiled and trainer.unwrapped._compiled_call_impl is None
        assert resolve_norm_impl("auto", torch.device("cpu")) == "eager"
        assert (f"note: the norms (norm_impl auto) and the model (--compile auto) run eagerly: torch.compile "
                f"cannot build here: {said}\n") in capsys.readouterr().err
    finally:
        cpu_compile_problem.cache_clear()


def test_held_out_split_is_by_document(tokenizer, tmp_path):
    """--data_path without --val_data_path: whole documents are held out. Each document here repeats one word that
    is a single token of its own, so every token tells its document: none may be on both sides."""
    words = [token[1:] for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
             if token.startswith("\u0120") and token[1:].isalpha() and len(token) > 4][:200]
    ids = {tokenizer(" " + word, add_special_tokens=False)["input_ids"][0]: i for i, word in enumerate(words)}
    assert len(ids) == len(words)
    data = write_jsonl(tmp_path / "docs.jsonl", [{"text": " " + " ".join([word] * (20 + i % 50))}
                                                 for i, word in enumerate(words)])
    from trainer.data import build_run_data

    args = parse_args("pretrain", ["--data_path", str(data), "--max_seq_len", "32", "--val_fraction", "0.05"])
    run = build_run_data(args, tokenizer, quiet=True)

    def documents(dataset) -> set[int]:
        tokens = torch.cat([dataset[i]["input_ids"] for i in range(len(dataset))]).tolist()
        assert set(tokens) <= set(ids) | {tokenizer.eos_token_id}
        return {ids[t] for t in tokens if t in ids}

    train, val = documents(run.train), documents(run.val)
    assert len(val) >= 8 and len(train) > 150
    assert not train & val


@pytest.mark.parametrize("update_inside_backward", [False, True], ids=["plain", "update-inside-backward"])
def test_nan_loss_stops_with_the_step_and_a_saved_state(update_inside_backward, train_data, tmp_path, monkeypatch,
                                                        capsys):
    """A NaN loss at step 6 stops the run with the last good state. With `update_inside_backward`, backward also
    applies the optimizer update, as DeepSpeed's engine does: the loss must be checked before that backward, or
    the saved weights are NaN. The run also says at its start what DeepSpeed's order means for a NaN gradient."""
    import trainer.run_start

    out_dir = tmp_path / "nan"
    monkeypatch.setattr(trainer.run_start, "update_inside_backward", lambda accelerator: update_inside_backward)
    AcceleratorState._reset_state(reset_partial_state=True)
    run = Trainer(parse_args("pretrain", pretrain_argv(train_data, out_dir, "--batch_size", "4")))
    calls = {"n": 0}

    def poison_after_five(module, inputs, output):
        calls["n"] += module.training  # count training forwards only, not evaluation
        return output * float("nan") if calls["n"] > 5 else output

    run.unwrapped.lm_head.register_forward_hook(poison_after_five)
    if update_inside_backward:
        backward = run.accelerator.backward

        def backward_then_update(loss, **kwargs):
            backward(loss, **kwargs)
            if run.accelerator.sync_gradients:
                run.optimizer.optimizer.step()

        monkeypatch.setattr(run.accelerator, "backward", backward_then_update)
    try:
        with pytest.raises(TrainingDiverged, match="optimizer step 6") as error:
            run.run()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert error.value.checkpoint.name == "step_00000005"
    weights = load_file(error.value.checkpoint / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())  # the last good weights, not NaN ones
    # Every file it wrote is strict JSON (the summary's step time and throughput are not finite: null there), and
    # what reads the summary takes it: a diverged run, no sweep metric.
    files = strict_json_files(out_dir)
    summary = files[out_dir / "run_summary.json"][0]
    assert summary["status"] == "diverged" and summary["median_step_time_s"] is None
    assert {out_dir / "metrics.jsonl", error.value.checkpoint / "trainer_state.json"} <= set(files)
    assert read_summary(out_dir) == summary and final_metric(summary, "val_loss") is None
    said = "a non-finite gradient under a finite loss is caught one update late" in capsys.readouterr().out
    assert said == update_inside_backward


def test_a_run_diverging_under_a_huge_loss_multiplier_names_it(train_data, tmp_path):
    """A load-balancing loss weighed by 1e30 makes the first loss infinite: the divergence line (one line) names the
    multiplier set away from its default, where the user should look; one left at its default (the z-loss's 0) is
    not named. It named none before."""
    out_dir = tmp_path / "run"
    with pytest.raises(TrainingDiverged) as error:
        run_in_process("pretrain", pretrain_argv(train_data, out_dir, "--num_experts", "2", "--num_experts_per_tok",
                                                 "1", "--router_aux_loss_coef", "1e30", "--router_z_loss_coef", "0"))
    checkpoint = out_dir / "checkpoints" / "step_00000000"
    assert str(error.value) == (f"training diverged at optimizer step 1 (non-finite loss or gradient); the last good "
                                f"state is saved in {checkpoint}; loss multipliers set away from their defaults: "
                                f"--router_aux_loss_coef 1e+30")
    assert read_summary(out_dir)["status"] == "diverged"


def test_yaml_config_with_command_line_overrides(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 0.01\nnorm_type: prmsnorm\nprms_p: 0.25\nbatch_size: 3\n")
    args = parse_args("pretrain", ["--config", str(config), "--batch_size", "5"])
    assert args.learning_rate == 0.01 and args.batch_size == 5
    assert args.model == {"norm_type": "prmsnorm", "prms_p": 0.25}
    config.write_text("learning_rat: 0.01\n")
    with pytest.raises(SystemExit):
        parse_args("pretrain", ["--config", str(config)])


@pytest.mark.parametrize("argv, message", [
    (["--norm_type", "batchnorm"], "invalid choice: 'batchnorm' (choose from 'rmsnorm', 'prmsnorm', 'layernorm'"),
    (["--norm_placement", "mid"], "invalid choice: 'mid' (choose from 'pre', 'post', 'sandwich'"),
    (["--norm_impl", "cuda"], "invalid choice: 'cuda' (choose from 'auto', 'eager', 'compile', 'triton')"),
    (["--prms_p", "1.5"], "prms_p=1.5 is not allowed"),
    (["--dtype", "int8"], "--dtype='int8' is not allowed"),
    (["--batch_size", "0"], "--batch_size=0 is not allowed"),
    (["--compile", "yes"], "--compile='yes' is not allowed; choose one of auto, on, off"),
    (["--optimizer", "sgd"], "--optimizer='sgd' is not allowed; choose one of adamw, muon"),
    (["--muon_adjust_lr", "spectral"], "--muon_adjust_lr='spectral' is not allowed; choose one of original, "
                                       "match_rms_adamw"),
    (["--lr_schedule", "linear"], "--lr_schedule='linear' is not allowed; choose one of cosine, wsd"),
    (["--decay_fraction", "0"], "--decay_fraction=0.0 is not allowed; it must be in (0, 1]"),
    (["--muon_lr", "-1"], "--muon_lr=-1.0 is not allowed; it must be a positive number"),
    (["--muon_momentum", "1"], "--muon_momentum=1.0 is not allowed; it must be in [0, 1)"),
    # refused at the first step, after the whole corpus was tokenized into 2-token rows
    (["--copy_rows", "1", "--max_seq_len", "2"],
     "--max_seq_len=2 is not allowed; copy rows (--copy_rows 1) need rows of at least 12 tokens"),
])
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args("pretrain", argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    # an IndexError in the first forward pass, after the data was tokenized
    (("--vocab_size", "5"), "error: --vocab_size=5 is not allowed; the tokenizer has 6400 tokens, so it must be >= "
                            "6400 (leave it unset for exactly that)"),
    # below the config's default eos id (2): refused by that id's name, a field no flag sets
    (("--vocab_size", "2"), "error: --vocab_size=2 is not allowed; the tokenizer has 6400 tokens, so it must be >= "
                            "6400 (leave it unset for exactly that)"),
    # a 71-line traceback at the first step
    (("--norm_impl", "triton"), "error: --norm_impl triton needs a CUDA device (its kernels take GPU tensors), not "
                                "cpu; use auto or eager here"),
])
def test_what_the_run_cannot_start_with_is_refused_before_the_data(flags, message, train_data, tmp_path, capsys):
    error = refused_run("pretrain", pretrain_argv(train_data, tmp_path / "run", *flags), capsys)
    assert error == message and not (tmp_path / "run").exists()


def test_a_model_too_big_for_memory_is_one_line(train_data, tmp_path, capsys):
    """A size within the model's bounds whose weights no memory holds (the embedding alone: 6400 x 2**30 fp32 = 25
    TiB) was the allocator's RuntimeError traceback (found by fuzzing the flags); it is one line naming the sizes
    to lower."""
    argv = pretrain_argv(train_data, tmp_path / "run", "--hidden_size", str(2 ** 30), "--intermediate_size", "128")
    error = refused_run("pretrain", argv, capsys, after_progress=True)
    assert error == ("error: out of memory in the set-up of the model, its optimizer and objective "
                     "(DefaultCPUAllocator: can't allocate memory: you tried to allocate 27487790694400 bytes): lower "
                     "--batch_size (a higher --accumulation_steps keeps the effective batch), --max_seq_len or the "
                     "model's sizes, or give --gradient_checkpointing")


@pytest.mark.parametrize("message, said", [
    ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.10 GiB of which 3.06 MiB is "
     "free.", "CUDA out of memory. Tried to allocate 20.00 MiB"),
    ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: not enough memory: you tried to allocate "
     "64 bytes. Error code 12", "DefaultCPUAllocator: not enough memory: you tried to allocate 64 bytes"),
    ("Expected all tensors to be on the same device", None),
])
def test_out_of_memory_reads_the_allocators_words(message, said):
    from trainer.memory import out_of_memory

    assert out_of_memory(RuntimeError(message)) == said
    assert out_of_memory(MemoryError()) == "MemoryError"


# pretraining's remedy (the trainers' own are tests/integration/test_memory_limits.py's)
LOWER = ("lower --batch_size (a higher --accumulation_steps keeps the effective batch), --max_seq_len or the model's "
         "sizes, or give --gradient_checkpointing")


@pytest.mark.parametrize("error, code, line", [
    (MemoryError(), 2, f"error: out of memory (MemoryError): {LOWER}"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 140737488355328 bytes. Error code 12 (Cannot allocate memory)"), 2,
     f"error: out of memory (DefaultCPUAllocator: can't allocate memory: you tried to allocate 140737488355328 "
     f"bytes): {LOWER}"),
    (RuntimeError("Expected all tensors to be on the same device"), None, None),
])
def test_only_an_allocation_failure_becomes_the_out_of_memory_line(error, code, line, monkeypatch, tmp_path, capsys):
    """The run's out-of-memory refusal (the CPU allocator's text is torch 2.13's for torch.empty(2**45)) is for
    allocation failures only: any other RuntimeError keeps its traceback, which is where a bug is read from."""
    import trainer.command

    class FailingTrainer:
        def __init__(self, *_: object) -> None:
            pass

        def run(self) -> None:
            raise error

    monkeypatch.setattr(trainer.command, "Trainer", FailingTrainer)
    if code is None:
        with pytest.raises(RuntimeError) as raised:
            main("pretrain", ["--out_dir", str(tmp_path / "run")])
        assert raised.value is error
        return
    with pytest.raises(SystemExit) as exit_info:
        main("pretrain", ["--out_dir", str(tmp_path / "run")])
    assert exit_info.value.code == code
    assert capsys.readouterr().err.strip().splitlines()[-1] == line


@pytest.mark.parametrize("key, message", [
    (None, "wandb has no API key here and no terminal to ask for one; run `wandb login`, set WANDB_API_KEY, or set "
           "WANDB_MODE=offline to log to {run}/wandb"),
    # wandb's AuthenticationError escaped on the main process while the others waited for its word
    ("abc", "WANDB_API_KEY invalid: API key must have 40+ characters, has 3.; or set WANDB_MODE=offline"),
])
def test_use_wandb_without_a_key_or_a_terminal_is_one_line_before_the_data(key, message, train_data, tmp_path,
                                                                           monkeypatch, capsys):
    """wandb.init raised it as a traceback once the data was tokenized and the model built, leaving --out_dir."""
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    if key is not None:
        monkeypatch.setenv("WANDB_API_KEY", key)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # no terminal to ask on
    import wandb

    try:
        error = refused_run("pretrain", pretrain_argv(train_data, tmp_path / "run", "--use_wandb"), capsys)
    finally:  # wandb keeps the settings it read (mode online) for the process: a later test's offline run failed
        wandb.teardown()
    assert error == "error: --use_wandb: " + message.format(run=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_scripts_run_from_repo_root_and_from_trainer_dir():
    for cwd, script in ((REPO, "trainer/train_pretrain.py"), (REPO / "trainer", "train_full_sft.py")):
        run = subprocess.run([sys.executable, script, "--help"], cwd=cwd, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0 and "--norm_placement" in run.stdout, run.stderr


def test_input_paths_are_found_from_the_current_directory_else_from_the_repo_root(train_data, tmp_path, monkeypatch,
                                                                                 capsys):
    """`cd elsewhere && python .../train_pretrain.py --data_path mine.jsonl` reads elsewhere/mine.jsonl, as --config
    and --from_weight are read (it used to look for <repo>/mine.jsonl only: no such data file); the run records the
    file it read (its config: as an absolute path, as it is found only from there). A path in neither place is
    named from the repo root."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(train_data / "pretrain.jsonl", elsewhere / "mine.jsonl")
    monkeypatch.chdir(elsewhere)
    out_dir = tmp_path / "run"
    argv = ["--data_path", "mine.jsonl", "--val_data_path", "mine.jsonl", "--out_dir", str(out_dir),
            "--max_steps", "2", "--save_interval", "1", "--batch_size", "4", *TINY]
    run_in_process("pretrain", argv)
    summary = read_summary(out_dir)
    assert summary["status"] == "finished" and summary["steps"] == 2
    config = yaml.safe_load((out_dir / "train_config.yaml").read_text())
    assert config["data_path"] == config["val_data_path"] == str(elsewhere / "mine.jsonl")
    state = json.loads((out_dir / "checkpoints" / "step_00000001" / "trainer_state.json").read_text())
    assert state["data"]["path"] == str(elsewhere / "mine.jsonl")
    for flag in ("--data_path", "--val_data_path"):
        refused = [*argv, flag, "absent.jsonl", "--out_dir", str(tmp_path / "refused")]
        assert refused_run("pretrain", refused, capsys) == f"error: no such data file: {REPO / 'absent.jsonl'}"


def test_a_run_started_elsewhere_is_finished_from_the_repo_root_with_its_config(train_data, tmp_path, monkeypatch,
                                                                                  capsys):
    """`cd elsewhere && python .../train_pretrain.py --data_path mine.jsonl ...` stopped at step 2 goes on from the
    repo root with the README's `--config elsewhere/out/train_config.yaml --resume auto`: its config records the data
    found only there as its absolute path (it recorded "mine.jsonl", which from the repo root was "no such data
    file: <repo>/mine.jsonl"), and an input read from the repo root (--tokenizer_path model) as typed, as committed
    records and sweep configs name them. The first command given again with --resume auto is the finished run."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(train_data / "pretrain.jsonl", elsewhere / "mine.jsonl")
    monkeypatch.chdir(elsewhere)
    out_dir = elsewhere / "out"
    argv = ["--data_path", "mine.jsonl", "--val_data_path", "mine.jsonl", "--tokenizer_path", "model", "--out_dir",
            str(out_dir), "--save_interval", "1", "--batch_size", "4", *TINY]
    run_in_process("pretrain", [*argv, "--max_steps", "2"])
    recorded = {"data_path": str(elsewhere / "mine.jsonl"), "val_data_path": str(elsewhere / "mine.jsonl"),
                "tokenizer_path": "model", "out_dir": str(out_dir)}
    config = yaml.safe_load((out_dir / "train_config.yaml").read_text())
    assert {name: config[name] for name in recorded} == recorded
    monkeypatch.chdir(REPO)
    run_in_process("pretrain", ["--config", str(out_dir / "train_config.yaml"), "--resume", "auto", "--max_steps",
                                "4"])
    summary = read_summary(out_dir)
    assert summary["status"] == "finished" and summary["steps"] == 4
    assert "resumed from" in capsys.readouterr().out
    config = yaml.safe_load((out_dir / "train_config.yaml").read_text())
    assert {name: config[name] for name in recorded} == recorded
    state = json.loads((out_dir / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert state["data"]["path"] == str(elsewhere / "mine.jsonl") and state["config"]["data_path"] == recorded[
        "data_path"]
    monkeypatch.chdir(elsewhere)
    run_in_process("pretrain", [*argv, "--max_steps", "4", "--resume", "auto"])
    assert "holds this run, finished" in capsys.readouterr().out


def test_resume_survives_a_metrics_line_cut_short_by_a_kill(tmp_path):
    from trainer.metrics_log import MetricsLog
    log = MetricsLog(tmp_path, enabled=True)
    for step in (1, 2, 3):
        log.write({"step": step, "split": "train", "loss": float(step)})
    with open(log.path, "a") as handle:
        handle.write('{"step": 4, "split": "tra')  # the process died mid-write
    log.truncate_after(2)
    assert [r["step"] for r in read_metrics(log.path)] == [1, 2]


@pytest.mark.parametrize("cuda, cuda_bf16, cpu_fast_bf16, expected", [
    (True, True, False, "bfloat16"),
    (True, False, True, "float16"),   # an older GPU: fp16 with loss scaling, whatever the CPU
    (False, False, True, "bfloat16"),
    (False, False, False, "float32"),
])
def test_dtype_auto_picks_by_hardware(cuda, cuda_bf16, cpu_fast_bf16, expected, monkeypatch):
    import trainer.machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cuda_bf16)
    monkeypatch.setattr(trainer.machine, "cpu_has_fast_bf16", lambda: cpu_fast_bf16)
    assert trainer.machine.resolve_dtype("auto") == expected
    assert trainer.machine.resolve_dtype("float32") == "float32"  # an explicit choice is kept


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("loss, grad_norm, scaler_skipped, expected", [
    (2.0, 0.5, None, "applied"),       # bf16/fp32: no grad scaler
    (2.0, INF, None, "diverged"),
    (2.0, NAN, None, "diverged"),
    (NAN, 0.5, None, "diverged"),
    (2.0, 0.5, False, "applied"),      # fp16: the scaler stepped
    (2.0, INF, True, "skipped"),       # fp16 overflow: the scaler skipped the update and lowered its scale
    (2.0, NAN, True, "skipped"),
    (INF, INF, True, "diverged"),      # a non-finite loss is divergence under any precision
])
def test_step_outcome_tells_an_fp16_overflow_from_divergence(loss, grad_norm, scaler_skipped, expected):
    from trainer.step import step_outcome
    assert step_outcome(loss, grad_norm, scaler_skipped) == expected


def test_run_config_gives_back_the_run_args(train_data, reference_run):
    """train_config.yaml, as the trainer wrote it, rebuilds the run's arguments and its model config."""
    recorded = yaml.safe_load((reference_run / "train_config.yaml").read_text())
    args = args_from_run_config(recorded)
    expected = parse_args("pretrain", pretrain_argv(train_data, reference_run, "--batch_size", "4"))
    assert {k: v for k, v in args.to_dict().items() if k not in ("model", "out_dir")} == \
        {k: v for k, v in expected.to_dict().items() if k not in ("model", "out_dir")}
    assert args.resolved_out_dir() == expected.resolved_out_dir()
    assert build_model_config(args, 6400).to_dict() == build_model_config(expected, 6400).to_dict()
    with pytest.raises(ValueError, match="unknown key 'hidden'"):
        args_from_run_config({**recorded, "hidden": 3})


@pytest.mark.parametrize("task", ["pretrain", "sft"])
def test_a_runs_train_config_given_as_config_trains_the_run_again(task, reference_run, sft_reference_run, tmp_path):
    """A run's train_config.yaml as --config, with only another --out_dir: the same run (losses to the bit), under
    an id of its own; the fine-tuning run's recorded architecture comes from --from_weight again, not as flags."""
    run = reference_run if task == "pretrain" else sft_reference_run
    recorded = run / "train_config.yaml"
    again = tmp_path / "again"
    run_in_process(task, ["--config", str(recorded), "--out_dir", str(again)])
    assert train_losses(again) == train_losses(run) and val_losses(again) == val_losses(run)
    assert yaml.safe_load((again / "train_config.yaml").read_text())["run_id"] != \
        yaml.safe_load(recorded.read_text())["run_id"]


def test_a_stopped_run_finishes_with_its_own_config_and_resume_auto(reference_run, tmp_path, capsys):
    """What the chat tools tell a user whose run stopped before its model: `--config RUN/train_config.yaml --resume
    auto` goes on from the newest checkpoint with the run's own flags (none named as changed) to the same end."""
    stopped = tmp_path / "stopped"
    shutil.copytree(reference_run, stopped)
    for name in ("run_summary.json", "model.safetensors", "config.json", "generation_config.json"):
        (stopped / name).unlink()
    capsys.readouterr()
    run_in_process("pretrain", ["--config", str(stopped / "train_config.yaml"), "--out_dir", str(stopped),
                                "--resume", "auto"])
    out = capsys.readouterr().out
    assert "resumed from" in out and "step_00000006" in out and "changed since the checkpoint" not in out, out
    assert val_losses(stopped) == val_losses(reference_run)
    assert load_file(stopped / "model.safetensors").keys() == load_file(reference_run / "model.safetensors").keys()


def _files(run) -> dict:
    return {path.relative_to(run): path.read_bytes() for path in run.rglob("*") if path.is_file()}


def test_resume_auto_leaves_a_finished_sft_run_as_it_is(train_data, reference_run, tmp_path, capsys):
    """The same SFT command again with --resume auto: nothing to train. An SFT command without --copy_rows leaves
    it to the run, which resolves it (train_config.yaml records 0): that once made every such command look changed."""
    finished = tmp_path / "sft"
    argv = sft_argv(train_data, reference_run, finished, "--batch_size", "4")
    at = argv.index("--copy_rows")
    del argv[at:at + 2]
    run_in_process("sft", argv)
    before = _files(finished)
    capsys.readouterr()
    run_in_process("sft", argv + ["--resume", "auto"])
    assert "holds this run, finished" in capsys.readouterr().out
    assert _files(finished) == before


def test_resume_auto_leaves_a_finished_run_of_another_preset_as_it_is(train_data, tmp_path, capsys):
    """The run's command without --preset (the default: the checkpoint's, as a resume of it takes): nothing to
    train. The default preset was compared with the recorded one: the run was resumed and saved again."""
    finished = tmp_path / "deep"
    run_in_process("pretrain", pretrain_argv(train_data, finished, "--batch_size", "4", "--preset", "cpu-deep"))
    before = _files(finished)
    capsys.readouterr()
    run_in_process("pretrain", pretrain_argv(train_data, finished, "--batch_size", "4", "--resume", "auto"))
    assert "holds this run, finished" in capsys.readouterr().out
    assert _files(finished) == before


def test_resume_auto_goes_on_where_a_longer_continuation_stopped(train_data, reference_run, tmp_path, capsys):
    """A run finished at step 8, continued with --max_steps 12 and stopped after its checkpoint at step 9 (its
    summary and model still the 8-step run's): the same command trains on from step 9, it is not 'finished'."""
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    longer = pretrain_argv(train_data, run, "--batch_size", "4", "--max_steps", "12", "--resume", "auto")
    run_in_process("pretrain", longer)  # checkpoints at 9 (and 12: none, the last step saves the model)
    for name in ("run_summary.json", "model.safetensors"):
        shutil.copy(reference_run / name, run / name)  # as if stopped before its end
    capsys.readouterr()
    run_in_process("pretrain", longer)
    out = capsys.readouterr().out
    assert "finished" not in out.split("\n")[0] and "at optimizer step 9" in out, out
    assert json.loads((run / "run_summary.json").read_text())["steps"] == 12


def test_resume_auto_goes_on_where_a_longer_continuation_stopped_before_its_first_checkpoint(
        train_data, reference_run, tmp_path, capsys, monkeypatch):
    """A run finished at step 8 (checkpoints 3 and 6), continued with --max_steps 12 from step 6 and stopped by a
    Ctrl-C at step 7: that continuation had recorded --max_steps 12 in train_config.yaml, so the same command again
    found 'this run, finished (8 steps): nothing left to train' and left metrics.jsonl cut at step 7."""
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    longer = pretrain_argv(train_data, run, "--batch_size", "4", "--max_steps", "12", "--resume", "auto")
    train_step = Trainer.train_step

    def stopped_at_step_8(self, batches, arm_diagnostics=False, step=0):
        if step == 7:
            raise KeyboardInterrupt
        return train_step(self, batches, arm_diagnostics, step)

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "train_step", stopped_at_step_8)
        with pytest.raises(SystemExit):
            main("pretrain", longer)
    AcceleratorState._reset_state(reset_partial_state=True)
    capsys.readouterr()
    run_in_process("pretrain", longer)
    assert "at optimizer step 6" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(run, "train")] == list(range(1, 13))
    assert json.loads((run / "run_summary.json").read_text())["steps"] == 12

def test_resume_auto_on_other_data_is_not_the_finished_run(train_data, reference_run, tmp_path, capsys):
    """--data_path another file on a finished directory is not 'the same run, finished': the resume's data check
    answers it (it was 'nothing left to train', data paths being left out of the comparison)."""
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    other = tmp_path / "other.jsonl"
    lines = (train_data / "pretrain.jsonl").read_text().splitlines()
    other.write_text("\n".join(reversed(lines)) + "\n")
    argv = pretrain_argv(train_data, run, "--batch_size", "4", "--data_path", str(other), "--resume", "auto")
    capsys.readouterr()
    try:
        run_in_process("pretrain", argv)
    except ValueError:
        pass
    assert "holds this run, finished" not in capsys.readouterr().out
