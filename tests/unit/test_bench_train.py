"""eval/benchmarks/bench_train.py's step table says which optimizer its trainers step: the one the trainer is
given (its --help and docs/benchmarks.md describe the table by it)."""

from __future__ import annotations

import argparse

import pytest

from eval.benchmarks import bench_train
from tests.fake_memory import ALLOCATOR_SAID, FAKE_MEMORY, fake_memory, refuse_allocation


class _Built(Exception):
    def __init__(self, train_args: argparse.Namespace) -> None:
        super().__init__()
        self.train_args = train_args


def _stop_at_the_first_trainer(args: argparse.Namespace) -> None:
    raise _Built(args)


def test_the_step_tables_title_names_the_optimizer_the_trainer_steps(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench_train, "Trainer", _stop_at_the_first_trainer)
    with pytest.raises(_Built) as built:
        bench_train.main(["--presets", "cpu-default", "--dtypes", "float32", "--variants", "rms,llama",
                          "--skip_norms", "--steps", "1", "--warmup", "0"])
    stepped = built.value.train_args.optimizer
    title = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Training step"))
    assert f"clip + {stepped} step)" in title
    others = {"adamw", "muon"} - {stepped}
    assert not any(other in title.lower() for other in others)


@pytest.mark.parametrize(("variants", "said"), [
    ("rms", "--variants: 'rms' lacks llama, the baseline the table compares the others with"),
    ("rms,llama,rmsnorm", "--variants: unknown rmsnorm; allowed: rms,rms_eager,rms_compiled,ln,llama"),
    # the trainer's refusal named its own --preset and --dtype, after the GEMM probe (and any earlier preset's rows)
    ("rms,llama --presets cpu-default,bogus", "--presets: unknown bogus; allowed: cpu-default,cpu-deep,"),
    ("rms,llama --dtypes float32,float33", "--dtypes: unknown float33; allowed: auto,bfloat16,float16,float32")])
def test_variants_are_refused_as_parsed_before_anything_is_measured(variants: str, said: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        bench_train.main(["--skip_norms", "--variants", *variants.split(" ")])
    assert stopped.value.code == 2
    captured = capsys.readouterr()
    assert said in captured.err
    assert captured.out == ""  # no machine line, no GEMM probe: refused first


def test_a_norm_table_past_the_memory_is_one_line_before_anything_is_measured(
        monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """--norm_rows x --norm_dim within MAX_SIZE each can be more than the machine holds: the flags alone say so,
    before the machine line, the GEMM probe and the step table (it was the allocator's traceback after them)."""
    fake_memory(monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        bench_train.main(["--skip_steps", "--norm_rows", "1024", "--norm_dim", "1024", "--norm_reps", "1"])
    assert stopped.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: --norm_rows 1024 x --norm_dim 1024: the norm table's 4 fp32 tensors of "
                                   "that shape (input, dy, output, dx) would take 16.0 MiB, more than the 1.0 MiB "
                                   "of a fake 1 MiB memory: lower --norm_rows or --norm_dim, or give --skip_norms\n")


@pytest.mark.parametrize(("presets", "seq_len", "said"), [
    # the trainer's own refusal named its --max_seq_len and --accumulation_steps, after the GEMM probe
    ("cpu-default", "256", "error: the cpu-default trainer's one micro-batch's logits would take 50.0 MiB "
                           "(--batch_size 8 rows x --seq_len 256 tokens x 6400 vocabulary x 4 bytes, fp32), more than "
                           "the 1.0 MiB of a fake 1 MiB memory: lower --batch_size or --seq_len"),
    # a later preset's refusal came after the earlier presets' trainers were built and timed
    ("minimind-26m,cpu-default", "1024", "error: --seq_len 1024 is more than the cpu-default model's 512 positions "
                                         "(its max_position_embeddings): lower --seq_len")])
def test_what_a_presets_trainer_would_refuse_is_one_line_in_the_benchmarks_flags_before_any_work(
        presets: str, seq_len: str, said: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A --batch_size and --seq_len that any preset's trainer refuses (its logits more than the memory, a row longer
    than its model's positions) is one line naming the benchmark's flags, for every preset before any trainer is
    built, the machine line or the GEMM probe."""
    fake_memory(monkeypatch, None if seq_len == "1024" else FAKE_MEMORY)
    monkeypatch.setattr(bench_train, "Trainer", _stop_at_the_first_trainer)
    with pytest.raises(SystemExit) as stopped:
        bench_train.main(["--presets", presets, "--dtypes", "float32", "--variants", "rms,llama", "--seq_len", seq_len,
                          "--skip_norms", "--steps", "1", "--warmup", "0"])
    assert stopped.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"{said}\n"), captured.err


def test_an_allocation_that_fails_in_a_table_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench_train, "bench_norms", refuse_allocation)
    monkeypatch.setattr(bench_train, "gemm_gflops", lambda dtype: 1.0)
    with pytest.raises(SystemExit) as stopped:
        bench_train.main(["--skip_steps"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (f"error: out of memory in the norm table ({ALLOCATOR_SAID}): lower --norm_rows "
                                       f"or --norm_dim\n")


@pytest.mark.parametrize(("argv", "said"), [
    # the trainer's parse_args refused it: 'error: --batch_size=8 is not allowed; one micro-batch would hold
    # --batch_size 8 rows of up to --max_seq_len 2147483647 tokens, ...'
    (["--seq_len", "2147483647"],
     "error: one micro-batch would hold --batch_size 8 rows of up to --seq_len 2147483647 tokens, 17179869176 in all, "
     "more than the 2147483647 (MAX_SIZE, model/config.py) one forward holds: lower --batch_size or --seq_len"),
    # the trainer's refusal as it was built (more rows in a step than its data holds): 'error: the cpu-default
    # float32 trainer of --batch_size 9000 and --seq_len 511 (its --max_seq_len): DATA: 8870 training samples, ...'
    (["--seq_len", "511", "--batch_size", "9000"],
     "error: the cpu-default float32 trainer refuses --batch_size 9000 with --seq_len 511: ")])
def test_a_refusal_of_the_trainers_is_said_in_the_benchmarks_flags(argv: list[str], said: str,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Every refusal bench_train passes on from the trainer's parse_args or the trainer names bench_train's flags
    (--seq_len, --batch_size), never the trainer's own (--max_seq_len, --accumulation_steps), which bench_train
    does not have. The memory is unknown here, so that no logits check refuses first."""
    fake_memory(monkeypatch, None)
    monkeypatch.setattr(bench_train, "gemm_gflops", lambda dtype: 1.0)
    with pytest.raises(SystemExit) as stopped:
        bench_train.main(["--presets", "cpu-default", "--dtypes", "float32", "--variants", "rms,llama",
                          "--skip_norms", "--steps", "1", "--warmup", "0", *argv])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("error: "))
    assert line.startswith(said), err
    assert "--max_seq_len" not in err and "--accumulation_steps" not in err, err


def test_the_trainers_remedies_are_reworded_in_the_benchmarks_flags() -> None:
    """The trainer's refusals of the flags bench_train gives it name its --max_seq_len and --accumulation_steps
    (bench_train's are --seq_len, and none): in_bench_flags rewords them, here on the trainer's own words."""
    from trainer.args import parse_args
    from trainer.memory import shrink_advice
    from trainer.run_length import plan_run_length

    train_args = parse_args("pretrain", bench_train.trainer_argv("cpu-default", "float32", "rmsnorm", 9000, 511,
                                                                 "out/bench_train"))
    with pytest.raises(ValueError) as refused:
        plan_run_length(train_args, 8870, 1, None)
    assert bench_train.in_bench_flags(str(refused.value)) == ("one optimizer step needs 9000 samples, the training "
                                                              "set has 8870; lower --batch_size")
    advice = bench_train.in_bench_flags(shrink_advice(train_args))
    assert advice.startswith("lower --batch_size, --seq_len") and "--max_seq_len" not in advice \
        and "--accumulation_steps" not in advice, advice
