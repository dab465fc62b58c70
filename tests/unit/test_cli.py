"""The short usage error of every command line: the error line first, then one line pointing to --help, exit
code 2; never argparse's page of usage. (That every tool uses the shared parser: tests/unit/test_layout.py.)"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tests.fake_memory import ALLOCATOR_SAID, fake_memory, refuse_allocation
from tests.paths import REPO
from model.config import MAX_SIZE
from trainer.cli import MAX_COUNT
from trainer.threads import MAX_THREADS, threads_allowed, usable_cores


def test_a_trainer_with_a_bad_preset_prints_two_lines():
    run = subprocess.run([sys.executable, "trainer/train_pretrain.py", "--preset", "foo"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [
        "error: --preset='foo' is not allowed; choose one of cpu-default, cpu-deep, cpu-wide, minimind-26m, "
        "minimind-64m, cpu-moe, minimind-3-moe",
        "train_pretrain.py: run with --help for the flags"]


@pytest.mark.parametrize("module, argv, error", [
    ("eval.evaluate", ["--bogus"], "error: unrecognized arguments: --bogus"),
    ("eval.chat", ["--temperature", "hot"], "error: argument --temperature: 'hot' is not a number"),
    ("scripts.sweep", [], "error: the following arguments are required: config"),
    ("eval.benchmarks.time_to_loss", ["--budget_s"], "error: argument --budget_s: expected one argument"),
    # every --seed takes what numpy and torch can seed with, every --device what the machine has (one type each)
    ("scripts.sweep", ["c.yaml", "--seed", "-1"], "error: argument --seed: -1 is not an integer in 0 .. 4294967295"),
    ("eval.copy_probe", ["--seed", "-1"], "error: argument --seed: -1 is not an integer in 0 .. 4294967295"),
    ("eval.benchmarks.bench_rollout", ["--seed", "4294967296"],
     "error: argument --seed: 4294967296 is not an integer in 0 .. 4294967295"),
    ("scripts.serve", ["--device", "bogus"],
     "error: argument --device: expected auto, cpu, cuda or cuda:N, got 'bogus'"),
    # an empty host (an unset shell variable) bound every interface, as 0.0.0.0 does (found by fuzzing the flags)
    ("scripts.serve", ["--host", ""], "error: argument --host: expected a host name or address (0.0.0.0: every "
                                      "interface), got an empty value"),
    ("scripts.serve", ["--host", " "], "error: argument --host: expected a host name or address (0.0.0.0: every "
                                       "interface), got an empty value"),
    # a number flag reads ASCII numbers only, whatever its type (trainer/number_text.py): int() and float() took
    # other scripts' digits and '_' (a plain type=float flag, ranges of cli.py, --threads)
    ("eval.chat", ["--rope_scaling_factor", "1_0"], "error: argument --rope_scaling_factor: '1_0' is not a number "
                                                    "(numbers are written in ASCII digits 0-9, without '_')"),
    # --rope_scaling_factor's range (model/rope.py's) is the flag's own: a factor out of it was refused only once the
    # model had loaded (extend_context), a whole load later
    ("eval.chat", ["--rope_scaling_factor", "0.5"],
     "error: argument --rope_scaling_factor: 0.5 is not allowed; it must be a number in (1, 1024]"),
    ("eval.evaluate", ["--rope_scaling_factor", "1e30"],
     "error: argument --rope_scaling_factor: 1e+30 is not allowed; it must be a number in (1, 1024]"),
    ("scripts.serve", ["--rope_scaling_factor", "nan"],
     "error: argument --rope_scaling_factor: nan is not allowed; it must be a number in (1, 1024]"),
    ("eval.copy_probe", ["--text", "1_0"], "error: argument --text: 1_0 is not an integer >= 0 (0: none) (numbers "
                                           "are written in ASCII digits 0-9, without '_')"),
    ("scripts.serve", ["--port", "٨٠٠٠"], "error: argument --port: ٨٠٠٠ is not an integer in 0 .. 65535 (0: a free "
                                          "port, printed at start) (numbers are written in ASCII digits 0-9, "
                                          "without '_')"),
    ("eval.chat", ["--top_p", "٠.٥"], "error: argument --top_p: '٠.٥' is not a number (numbers are written in "
                                      "ASCII digits 0-9, without '_')"),
    ("eval.chat", ["--threads", "٢"], f"error: argument --threads: '٢' is not allowed; "
                                      f"{threads_allowed(usable_cores())} (numbers are written in ASCII digits 0-9, "
                                      f"without '_')"),
])
def test_tools_print_the_error_and_a_pointer_to_help(module, argv, error, capsys):
    import importlib

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    first, second = captured.err.splitlines()  # exactly two lines
    assert first == error and second.endswith(": run with --help for the flags")
    assert "usage:" not in captured.err + captured.out


def test_help_still_lists_the_flags(capsys):
    from trainer.args import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args("pretrain", ["--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_ctrl_c_ends_a_tool_in_one_line_with_the_shells_code(capsys):
    """run_main owns Ctrl-C for every tool: KeyboardInterrupt out of main is `interrupted` on stderr and 128 + SIGINT,
    as a shell reports a program the signal ended, not a traceback."""
    import signal

    from trainer.cli import run_main
    from trainer.run_dir import EXIT_INTERRUPTED

    def main() -> int:
        print("half of the answer")
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_info:
        try:
            run_main(main)
        except KeyboardInterrupt:  # left to escape, it would stop the whole test session
            pytest.fail("KeyboardInterrupt went through run_main")
    assert exit_info.value.code == EXIT_INTERRUPTED == 128 + signal.SIGINT == 130
    assert exit_info.value.__context__ is None or exit_info.value.__suppress_context__  # no chained traceback
    captured = capsys.readouterr()
    assert captured.err == "interrupted\n" and captured.out == "half of the answer\n"


def test_ctrl_c_under_an_open_progress_bar_prints_interrupted_on_a_line_of_its_own(capsys):
    """A progress bar the interrupt cuts off holds its line open (tqdm ends the line only when the bar closes):
    evaluate.py's "tokenizing documents: 0%|...| 0/20000 [00:00<?, ? examples/s]interrupted" under load."""
    import sys

    from tqdm import tqdm

    from trainer.cli import run_main
    from trainer.run_dir import EXIT_INTERRUPTED

    def main() -> int:
        bar = tqdm(total=20_000, desc="tokenizing documents", file=sys.stderr)
        bar.update(0)
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_info:
        run_main(main)
    assert exit_info.value.code == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "interrupted" and "tokenizing documents" in err, err
    assert not list(tqdm._instances)  # closed, so no later __del__ draws the bar again after the line


def test_ctrl_c_inside_a_bars_start_still_prints_interrupted_on_a_line_of_its_own(capsys):
    """A bar the interrupt caught inside its own start, drawn but not yet knowing it was (tqdm sets last_print_t after
    the first draw), writes nothing when its `with` closes it, leaving the line open (evaluate.py's test under load on
    an AMD EPYC: "...examples/s]interrupted"): stderr, run_main's, knows the line is open and interrupted starts a
    new one; one a bar ended (its "\r") gets none."""
    import sys

    from tqdm import tqdm

    from trainer.cli import run_main

    def main() -> int:
        bar = tqdm(total=20_000, desc="tokenizing documents", file=sys.stderr)
        del bar.last_print_t  # as in its __init__ between the first draw and the time kept
        bar.close()  # what the `with` around it does on the way out: nothing written
        raise KeyboardInterrupt

    with pytest.raises(SystemExit):
        run_main(main)
    err = capsys.readouterr().err
    assert err.endswith("?it/s]\ninterrupted\n"), err

    def ended() -> int:
        sys.stderr.write("\rtokenizing documents: 100%")
        sys.stderr.write("\r")
        raise KeyboardInterrupt

    with pytest.raises(SystemExit):
        run_main(ended)
    assert capsys.readouterr().err == "\rtokenizing documents: 100%\rinterrupted\n"


@pytest.mark.parametrize("module_name", ["__main__", "eval.chat"])
def test_begin_command_bounds_openmp_waits_and_quiets_ctrl_c_only_as_the_command(module_name, monkeypatch):
    """A model-running command's one start-up call: OpenMP's spin bounded whether the file runs or is imported (as
    its own bound_openmp_waits() call did), Ctrl-C's loading-time handler only where it runs as the command (what
    that handler prints: tests/unit/test_tool_mains.py)."""
    import os
    import signal

    from trainer.cli import begin_command
    from trainer.threads import SPIN_COUNT

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)  # conftest bounded it for the whole session
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        begin_command(module_name)
        handler = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)
    assert os.environ["GOMP_SPINCOUNT"] == str(SPIN_COUNT)
    assert (handler is not signal.default_int_handler) == (module_name == "__main__")


def test_run_main_exits_with_mains_code(capsys):
    from trainer.cli import run_main

    with pytest.raises(SystemExit) as exit_info:
        run_main(lambda: 3)
    assert exit_info.value.code == 3 and capsys.readouterr().err == ""


NORMS_ONLY = ["--skip_steps", "--norm_rows", "8", "--norm_dim", "8", "--norm_reps", "1"]  # bench_train: a cheap run
ONE_NORM = ["--device", "cpu", "--m", "8", "--n", "8", "--no-residual", "--methods", "eager"]  # bench_norm: cheap
ONE_SECOND = ["--budget_s", "1"]  # time_to_loss: the old code trained with these flags
BENCHMARKS_WITH_THREADS = (*(f"eval.benchmarks.{tool}" for tool in ("bench_diagnostics", "bench_moe", "bench_norm",
                                                                      "bench_rollout", "bench_train", "time_to_loss")),
                           *(f"eval.studies.{tool}" for tool in ("grad_at_init", "norm_inputs", "norm_share")))


@pytest.mark.parametrize("module, argv, flag, allowed", [
    *((f"eval.benchmarks.{tool}", ["--preset", "bogus"], "--preset", "invalid choice: 'bogus' (choose from")
      for tool in ("bench_moe", "bench_diagnostics", "bench_rollout", "bench_post_training")),
    ("eval.benchmarks.bench_moe", ["--experts", "abc"], "--experts", "'abc' is not comma-separated integers >= 1"),
    ("eval.benchmarks.bench_moe", ["--experts", "2,0"], "--experts", "'2,0' is not comma-separated integers >= 1"),
    ("eval.benchmarks.bench_moe", ["--threads", "0"], "--threads", f"0 is not an integer in 1 .. {MAX_THREADS}"),
    ("eval.benchmarks.bench_moe", ["--rounds", "0"], "--rounds", f"0 is not an integer in 1 .. {MAX_COUNT}"),
    ("eval.benchmarks.bench_moe", ["--calls", "0"], "--calls", f"0 is not an integer in 1 .. {MAX_COUNT}"),
    ("eval.benchmarks.bench_moe", ["--batch_size", "-1"], "--batch_size", "-1 is not an integer >= 1"),
    ("eval.benchmarks.bench_diagnostics", ["--intervals", "abc"], "--intervals",
     "'abc' is not comma-separated integers >= 1"),
    # the model config's values (a ValueError traceback from MiniNormConfig before)
    ("eval.benchmarks.bench_diagnostics", ["--norm_type", "bogus"], "--norm_type",
     "invalid choice: 'bogus' (choose from 'rmsnorm', 'prmsnorm', 'layernorm', 'dyt', 'none')"),
    ("eval.benchmarks.bench_diagnostics", ["--norm_placement", "bogus"], "--norm_placement",
     "invalid choice: 'bogus' (choose from 'pre', 'post', 'sandwich', 'res_post', 'deepnorm', 'mix', 'peri',"),
    ("eval.benchmarks.bench_diagnostics", ["--norm_impl", "bogus"], "--norm_impl",
     "invalid choice: 'bogus' (choose from 'auto', 'eager', 'compile', 'triton')"),
    ("eval.benchmarks.bench_diagnostics", ["--threads", "0"], "--threads",
     f"0 is not an integer in 1 .. {MAX_THREADS}"),
    ("eval.benchmarks.bench_rollout", ["--rounds", "0"], "--rounds", f"0 is not an integer in 1 .. {MAX_COUNT}"),
    ("eval.benchmarks.bench_post_training", ["--batch_size", "-1"], "--batch_size", "-1 is not an integer >= 1"),
    ("eval.benchmarks.bench_load", ["--competitors", "x"], "--competitors", "'x' is not comma-separated integers >= 0"),
    ("eval.benchmarks.bench_load", ["--rounds", "-1"], "--rounds", f"-1 is not an integer in 0 .. {MAX_COUNT}"),
    ("eval.benchmarks.bench_norm", ["--m", "0"], "--m", "0 is not an integer >= 1"),
    ("eval.benchmarks.bench_norm", ["--threads", "0"], "--threads", f"0 is not an integer in 1 .. {MAX_THREADS}"),
    # every benchmark's and study's --threads: at most MAX_THREADS (10**9 ended in libgomp's "Out of memory
    # allocating ..."; -3 in bench_train and time_to_loss in torch.set_num_threads' RuntimeError traceback)
    *((module, ["--threads", "1000000000"], "--threads", f"1000000000 is not an integer in 1 .. {MAX_THREADS}")
      for module in BENCHMARKS_WITH_THREADS if module != "eval.benchmarks.bench_train"),
    ("eval.benchmarks.bench_train", ["--threads", "1000000000"], "--threads",
     f"1000000000 is not an integer in 0 .. {MAX_THREADS} (0: torch's default)"),
    ("eval.benchmarks.bench_train", ["--threads", "-3"], "--threads", f"-3 is not an integer in 0 .. {MAX_THREADS}"),
    ("eval.benchmarks.time_to_loss", ["--threads", "-3"], "--threads", f"-3 is not an integer in 1 .. {MAX_THREADS}"),
    # counts of steps, calls, rows: >= 1 (0 steps or calls ended in an empty median's StatisticsError, --norm_dim 0 in
    # a reshape's RuntimeError, 10**30 rows in torch's allocator), sizes at most model/config.py's MAX_SIZE, the
    # trainer's shortest sequence (MIN_SEQ_LEN) and its --time_budget_s' year, a finite loss, margin or FLOP/s
    ("eval.benchmarks.bench_train", [*NORMS_ONLY, "--norm_reps", "0"], "--norm_reps",
     f"0 is not an integer in 1 .. {MAX_COUNT}"),
    ("eval.benchmarks.bench_train", [*NORMS_ONLY, "--norm_dim", "0"], "--norm_dim",
     f"0 is not an integer in 1 .. {MAX_SIZE}"),
    ("eval.benchmarks.bench_train", [*NORMS_ONLY, "--norm_rows", "1" + "0" * 30], "--norm_rows",
     f" is not an integer in 1 .. {MAX_SIZE}"),
    ("eval.benchmarks.bench_train", [*NORMS_ONLY, "--peak_flops", "inf"], "--peak_flops",
     "inf is not a finite number > 0"),
    ("eval.benchmarks.bench_train", ["--seq_len", "1"], "--seq_len", f"1 is not an integer in 2 .. {MAX_SIZE}"),
    ("eval.benchmarks.bench_train", ["--steps", "0"], "--steps", f"0 is not an integer in 1 .. {MAX_COUNT}"),
    ("eval.benchmarks.time_to_loss", ["--budget_s", "0"], "--budget_s", "0 is outside (0, 3.1536e+07]"),
    ("eval.benchmarks.time_to_loss", [*ONE_SECOND, "--target_loss", "nan"], "--target_loss",
     "nan is not a finite number >= 0"),
    ("eval.benchmarks.time_to_loss", [*ONE_SECOND, "--eval_batches", "-1"], "--eval_batches",
     "-1 is not an integer >= 0 (0: the whole validation split)"),
    # A seed that is no integer was "invalid literal for int() with base 10: 'x'" without the flag; one past numpy's
    # seeds reached the trainer's refusal only after the first recipe's start.
    ("eval.benchmarks.time_to_loss", [*ONE_SECOND, "--seeds", "0,x"], "--seeds",
     "'0,x' is not comma-separated integers in 0 .. 4294967295"),
    ("eval.benchmarks.time_to_loss", [*ONE_SECOND, "--seeds", "0,,1"], "--seeds",
     "'0,,1' is not comma-separated integers in 0 .. 4294967295"),
    ("dataset.tools", ["calculator", "--max_chars", "-5"], "--max_chars", "-5 is not an integer >= 1"),
    ("eval.studies.ablation_report", ["sweep", "--study2", "--escape_margin", "inf"], "--escape_margin",
     "inf is not a finite number >= 0"),
    ("eval.benchmarks.bench_norm_variants", ["sweep.yaml", "--out", "t.json", "--rounds", "0"], "--rounds",
     f"0 is not an integer in 1 .. {MAX_COUNT}"),
    ("eval.benchmarks.bench_norm_variants", ["sweep.yaml", "--out", "t.json", "--warmup", "-1"], "--warmup",
     f"-1 is not an integer in 0 .. {MAX_COUNT}"),
    ("eval.benchmarks.bench_vs_minimind", ["--minimind_dir", "nowhere", "--log_interval", "0"], "--log_interval",
     f"0 is not an integer in 1 .. {MAX_COUNT}"),
    ("eval.benchmarks.bench_vs_minimind", ["--minimind_dir", "nowhere", "--warmup", "-20"], "--warmup",
     f"-20 is not an integer in 0 .. {MAX_COUNT}"),
    ("eval.benchmarks.bench_vs_minimind", ["--minimind_dir", "nowhere", "--seq_len", "1"], "--seq_len",
     f"1 is not an integer in 2 .. {MAX_SIZE}"),
    ("eval.benchmarks.bench_serve", ["--model_path", "nowhere", "--requests", "0"], "--requests",
     f"0 is not an integer in 1 .. {MAX_COUNT}"),
    ("eval.benchmarks.bench_serve", ["--model_path", "nowhere", "--repeats", "0"], "--repeats",
     f"0 is not an integer in 1 .. {MAX_COUNT}"),
    # a partial RMSNorm's p: the model's range (model/rmsnorm_math.py's P_RANGE, (0, 1]); bench_norm's 0 and 2 ran
    # (partial_size clamps k into 1 .. n), its nan was a ValueError traceback
    ("eval.benchmarks.bench_norm", [*ONE_NORM, "--p", "0"], "--p", "0 is outside (0, 1]"),
    ("eval.benchmarks.bench_norm", [*ONE_NORM, "--p", "nan"], "--p", "nan is outside (0, 1]"),
    ("eval.studies.norm_share", ["--prms_p", "1.5"], "--prms_p", "1.5 is outside (0, 1]"),
    # eval/copy_probe.py: --cue_pairs -1 was refused after the model loaded, --text -1 beside --lengths and --rows
    ("eval.copy_probe", ["--model_path", "nowhere", "--cue_pairs", "-1"], "--cue_pairs",
     "-1 is not an integer >= 0 (0: no such probe)"),
    ("eval.copy_probe", ["--model_path", "nowhere", "--text", "-1"], "--text", "-1 is not an integer >= 0 (0: none)"),
    ("eval.benchmarks.bench_serve", ["--tokens", "8"], "--tokens", "goes only with --stream_against"),
    ("eval.benchmarks.bench_serve", ["--stream_against", "HEAD", "--repeats", "2"], "--repeats",
     "not with --stream_against (which takes --tokens and --rounds)"),
    ("eval.benchmarks.bench_serve", ["--stream_against", "--tokens", "0"], "--tokens",
     "0 is not an integer in 1 .. 8192"),
])
def test_benchmarks_refuse_bad_flags_in_one_line_naming_them(module, argv, flag, allowed, capsys):
    """These were tracebacks (a ValueError from the preset list or int(), a zero-division or an empty median), or
    silently something else (bench_norm --m 0 ran 1024 rows)."""
    import importlib

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith(f"error: argument {flag}: ") and allowed in first, first


SWEEP_AND_OUT = ["sweep.yaml", "--out", "t.json"]  # bench_norm_variants' required arguments (never read: refused first)


@pytest.mark.parametrize("module, argv, flag, low", [
    ("eval.benchmarks.bench_checkpoint", [], "--rounds", 1),
    *(("eval.benchmarks.bench_diagnostics", [], flag, low)
      for flag, low in (("--block_steps", 1), ("--blocks", 1), ("--warmup", 0))),
    *(("eval.benchmarks.bench_load", [], flag, low)
      for flag, low in (("--rounds", 0), ("--steps", 1), ("--warmup", 0), ("--start_bursts", 0))),
    ("eval.benchmarks.bench_moe", [], "--rounds", 1),
    ("eval.benchmarks.bench_moe", [], "--calls", 1),
    *(("eval.benchmarks.bench_norm", ONE_NORM, flag, low)
      for flag, low in (("--rounds", 1), ("--norm_repeats", 1), ("--lab_steps", 1), ("--lab_warmup", 0))),
    *(("eval.benchmarks.bench_norm_variants", SWEEP_AND_OUT, flag, low)
      for flag, low in (("--rounds", 1), ("--steps", 1), ("--warmup", 0))),
    ("eval.benchmarks.bench_post_training", [], "--steps", 1),
    ("eval.benchmarks.bench_rollout", [], "--rounds", 1),
    ("eval.benchmarks.bench_serve", ["--model_path", "nowhere"], "--requests", 1),
    ("eval.benchmarks.bench_serve", ["--model_path", "nowhere"], "--repeats", 1),
    ("eval.benchmarks.bench_serve", ["--stream_against"], "--rounds", 1),
    *(("eval.benchmarks.bench_train", NORMS_ONLY, flag, low)
      for flag, low in (("--steps", 1), ("--warmup", 0), ("--norm_reps", 1))),
    *(("eval.benchmarks.bench_vs_minimind", ["--minimind_dir", "nowhere"], flag, low)
      for flag, low in (("--steps", 1), ("--warmup", 0), ("--log_interval", 1))),
    ("eval.studies.norm_inputs", ["no_model"], "--batches", 1),
    *(("eval.studies.norm_share", [], flag, low)
      for flag, low in (("--rounds", 1), ("--steps", 1), ("--profile_steps", 1), ("--warmup", 0))),
])
def test_every_count_of_a_benchmark_or_study_is_at_most_max_count_before_any_work(module, argv, flag, low, capsys):
    """A count of rounds, steps, calls or repetitions of 10**30 ran until killed (bench_moe --rounds, bench_train
    --norm_reps, ...): each is at most trainer/cli.py's MAX_COUNT, refused as the flags are parsed, naming the flag
    and the bound, before anything is read, built or timed."""
    import importlib

    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main([*argv, flag, str(10**30)])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines()[0] == (f"error: argument {flag}: {10**30} is not an integer in {low} .. "
                                            f"{MAX_COUNT}"), captured.err


@pytest.mark.parametrize("argv, flag, allowed", [
    (["--p", "0"], "--p", "0 is outside (0, 1]"),
    (["--n", "512", "16385"], "--n", "16385 is not an integer in 1 .. 16384"),  # the kernels' MAX_N
    (["--n", "0"], "--n", "0 is not an integer in 1 .. 16384"),
    (["--arch", "8"], "--arch", "8 is not an integer in 80 .. 121"),
    (["--arch", "1000"], "--arch", "1000 is not an integer in 80 .. 121"),  # an LLVM error ('sm_1000a') after work
    (["--sm_count", "0"], "--sm_count", "0 is not an integer in 1 .. 192"),
    (["--sm_count", "100000000000"], "--sm_count", "100000000000 is not an integer in 1 .. 192"),  # built a grid
    (["--fwd_warps", "3"], "--fwd_warps", "invalid choice: 3 (choose from 1, 2, 4, 8, 16, 32)"),
    (["--bwd_warps", "64"], "--bwd_warps", "64 is not an integer in 1 .. 32"),
    (["--bwd_stages", "0"], "--bwd_stages", "0 is not an integer in 1 .. 29"),
    # taken and compiled: 1000 stages had not compiled after minutes; past 29 no GPU holds the n = 96 backward's tiles
    (["--bwd_stages", "30"], "--bwd_stages", "30 is not an integer in 1 .. 29"),
    (["--bwd_stages", str(10**30)], "--bwd_stages", f"{10**30} is not an integer in 1 .. 29"),
])
def test_kernel_build_refuses_bad_flags_before_it_builds(argv, flag, allowed, capsys):
    """eval/benchmarks/kernel_build.py's flags took any number, passed on to triton and ptxas (its parse_args: no
    build runs here)."""
    from eval.benchmarks.kernel_build import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith(f"error: argument {flag}: ") and allowed in first, first


def test_the_threads_cases_cover_every_benchmark_and_study_with_threads():
    """A benchmark or study that gains --threads takes trainer/cli.py's benchmark_threads: the table above checks
    each of them for its bound."""
    found = {f"eval.{path.parent.name}.{path.stem}" for folder in ("benchmarks", "studies")
             for path in (REPO / "eval" / folder).glob("*.py")
             if 'add_argument("--threads"' in path.read_text(encoding="utf-8")}
    assert found == set(BENCHMARKS_WITH_THREADS)


# Every path flag of the tools (the paths a trainer takes: tests/unit/test_args.py): an empty value (an unset shell
# variable) or blanks name no file. They were taken for the current folder or a file named by the blanks:
# convert_to_gguf --outfile " " wrote a GGUF file named " " at the repo root, sweep --sweep_dir " " a sweep folder
# named " " (found by fuzzing the flags); the others refused later, naming the repo root or the current folder.
TOOL_PATH_FLAGS = [
    ("eval.chat", [], "--model_path"), ("eval.chat", [], "--lora"), ("eval.evaluate", [], "--data"),
    ("eval.tool_eval", [], "--model_path"), ("eval.long_context", [], "--data"), ("eval.copy_probe", [], "--data"),
    ("scripts.serve", [], "--lora"),
    ("scripts.sweep", ["c.yaml"], "--sweep_dir"), ("scripts.sweep", ["c.yaml"], "--records_dir"),
    ("scripts.convert_to_gguf", [], "--model_path"), ("scripts.convert_to_gguf", [], "--outfile"),
    ("scripts.convert_to_llama", [], "--model_path"), ("scripts.convert_to_llama", [], "--out_dir"),
    ("scripts.import_checkpoint", [], "--source"), ("scripts.import_checkpoint", ["--source", "s"], "--out_dir"),
]


@pytest.mark.parametrize("module, before, flag", TOOL_PATH_FLAGS)
@pytest.mark.parametrize("value", ["", " "])
def test_a_tools_path_flag_refuses_an_empty_value(module, before, flag, value, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main([*before, flag, value])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == f"error: argument {flag}: expected a path, got an empty value"


def test_the_sweeps_config_refuses_an_empty_value(capsys):
    from scripts.sweep import main

    with pytest.raises(SystemExit):
        main([" "])
    assert capsys.readouterr().err.splitlines()[0] == "error: argument config: expected a path, got an empty value"


LONG = "x" * 10_000  # a value echoed whole made a 10,000-character error line
MAX_LINE = 200  # an error line quoting a value cut by dataset/shown_value.py's shown_value (60 characters) or less


def _flag_error(flag_type, value: str, capsys, choices=None) -> str:
    """The error line a ToolParser prints for `--x value` of `flag_type` (both lines checked: no more)."""
    from trainer.cli import ToolParser

    parser = ToolParser(prog="tool")
    parser.add_argument("--x", type=flag_type, choices=choices, help="the flag under test")
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([f"--x={value}"])
    assert exit_info.value.code == 2
    first, second = capsys.readouterr().err.splitlines()  # exactly two lines: the value's newline is not one
    assert second == "tool: run with --help for the flags"
    return first


def _flag_types() -> dict[str, object]:
    from trainer.arg_parser import FLAG_TYPES
    from trainer.cli import boolean, float_within, int_list, int_within, output_file, output_folder, zero_or_at_least
    from eval.chat import _tool_names
    from eval.studies.grad_at_init import norm_type_names
    from trainer.inference_flags import device_type

    return {"int_within": int_within(1), "int_list": int_list(1), "float_within": float_within(0, 1),
            "float_from_zero": float_within(0, math.inf),
            "zero_or_at_least": zero_or_at_least(1e-5, "off"), "boolean": boolean, "output_file": output_file,
            "output_folder": output_folder,
            "device_type": device_type(), "numbers": FLAG_TYPES["loss_weights"], "path": FLAG_TYPES["data_path"],
            "float": float, "chat_tools": _tool_names, "study_names": norm_type_names}


@pytest.mark.parametrize("kind, value, words", [
    ("int_within", LONG, " is not an integer >= 1"),
    ("int_within", "1\n2", "1 2 is not an integer >= 1"),
    ("int_within", "9" * 10_000, " is not an integer >= 1"),  # past int()'s 4300 digits
    ("int_within", " 0\n", " is not an integer >= 1"),  # int() takes it: the range refuses it
    ("int_list", LONG, " is not comma-separated integers >= 1"),
    ("int_list", "1,\nx", "'1,\\nx' is not comma-separated integers >= 1"),
    ("float_within", LONG, " is not a number"),
    ("float_within", "1" * 10_000, " is outside 0 .. 1"),  # float() takes it (inf): the range refuses it
    ("float_within", "2\n", " is outside 0 .. 1"),
    ("float_from_zero", "1" * 10_000, " is not a finite number >= 0"),  # inf: no budget, loss or FLOP/s
    ("zero_or_at_least", LONG, " is not a number"),
    ("zero_or_at_least", "1" * 10_000, " is not 0 (off) or a finite number >= 1e-05"),
    ("zero_or_at_least", "-1\n", " is not 0 (off) or a finite number >= 1e-05"),
    ("boolean", LONG, "expected a boolean (true/false), got 'xxx"),
    ("boolean", "yes\nno", "expected a boolean (true/false), got 'yes\\nno'"),
    ("output_file", "./" * 5_000 + ".", " is a directory, expected a file"),  # the working directory
    ("output_file", LONG, " cannot name a file (File name too long)"),
    ("output_folder", LONG, " (File name too long)"),
    ("device_type", LONG, "expected auto, cpu, cuda or cuda:N, got 'xxx"),
    ("device_type", "cpu\n", "expected auto, cpu, cuda or cuda:N, got 'cpu\\n'"),
    ("numbers", LONG, " is not a number or comma-separated numbers"),
    ("numbers", "0.5,\nx", "'0.5,\\nx' is not a number or comma-separated numbers"),
    ("path", "none" + " " * 10_000 + "\n", " is not a path; leave the flag out for its default"),
    ("float", LONG, "invalid float value: 'xxx"),  # argparse's own words, for a type that raises ValueError
    ("float", "a\nb", "invalid float value: 'a\\nb'"),
    ("chat_tools", LONG, "unknown tool xxx"),  # eval/chat.py's --tools
    ("chat_tools", "wiki,a\nb", "unknown tool a b; allowed: "),
    ("chat_tools", "wiki,\n wiki ", "tool wiki named more than once"),  # known names only: never long
    ("study_names", LONG, " not allowed; choose from 'rmsnorm'"),  # eval/studies/grad_at_init.py's --norm_types
    ("study_names", "a\nb", "'a\\nb' not allowed; choose from 'rmsnorm'"),
])
def test_a_flags_refusal_quotes_a_long_or_multiline_value_on_one_short_line(kind, value, words, capsys):
    """Each flag type's refusal (trainer/cli.py's, trainer/arg_parser.py's, trainer/inference_flags.py's, and
    argparse's own for a type such as float) quotes the value through dataset/shown_value.py: a value of 10,000
    characters was echoed whole, and one holding a newline split the error line."""
    line = _flag_error(_flag_types()[kind], value, capsys)
    assert line.startswith("error: argument --x: ") and words in line and len(line) <= MAX_LINE, line[:300]


def test_argparses_choice_and_unrecognized_refusals_quote_a_long_value_on_one_short_line(capsys):
    line = _flag_error(str, LONG, capsys, choices=("a", "b"))
    assert line.startswith("error: argument --x: invalid choice: 'xxx") and line.endswith(" (choose from 'a', 'b')")
    assert len(line) <= MAX_LINE, line[:300]
    line = _flag_error(str, "a\nb", capsys, choices=("a", "b"))
    assert line == "error: argument --x: invalid choice: 'a\\nb' (choose from 'a', 'b')"
    from trainer.cli import ToolParser

    with pytest.raises(SystemExit):
        ToolParser(prog="tool").parse_args([LONG, "y\nz"])
    first, second = capsys.readouterr().err.splitlines()
    assert first.startswith("error: unrecognized arguments: xxx") and first.endswith(" y z") and len(first) <= MAX_LINE


def test_an_output_file_that_is_a_directory_is_named_whole_on_one_line(tmp_path, capsys):
    """A directory given as an output file is named whole (the user needs the whole name to find it; a 60-character
    cut hid a temporary folder's end), its newline escaped so the error stays one line; a text past PATH_MAX, which
    only names a directory once pathlib folds its "./" away, is cut."""
    folder = tmp_path / ("a" * 80 + "\nb")
    folder.mkdir()
    line = _flag_error(_flag_types()["output_file"], str(folder), capsys)
    assert line == f"error: argument --x: {tmp_path}/{'a' * 80}\\nb is a directory, expected a file"
    line = _flag_error(_flag_types()["output_file"], "./" * 5_000 + ".", capsys)
    assert line.endswith("... is a directory, expected a file") and len(line) <= MAX_LINE


def test_an_output_folder_is_relative_to_the_repo_root_and_checked_as_parsed(tmp_path, monkeypatch, capsys):
    """trainer/cli.py output_folder, every tool's output folder flag: a relative folder lies under the repo root
    (resolve_path, as every output), whatever the current directory, and the value is that path; one that cannot be
    made (a file in its place or above it) is refused in dataset/atomic_io.py's words, as parsed."""
    from trainer.cli import output_folder

    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    repo.mkdir()
    elsewhere.mkdir()
    (repo / "a_file").write_text("kept\n")
    monkeypatch.setattr("trainer.run_dir.REPO_ROOT", repo)
    monkeypatch.chdir(elsewhere)
    assert output_folder("out/x") == str(repo / "out" / "x")
    assert output_folder(str(elsewhere / "y")) == str(elsewhere / "y")
    assert not (repo / "out").exists()  # checked, not made: the tool makes it
    assert _flag_error(output_folder, "a_file", capsys) == (
        f"error: argument --x: {repo / 'a_file'} is a file, not a folder")
    assert _flag_error(output_folder, "a_file/sub", capsys) == (
        f"error: argument --x: {repo / 'a_file' / 'sub'}: {repo / 'a_file'} is a file, not a folder")


@pytest.mark.parametrize("value, parsed", [("-1e-1", -0.1), ("-1.5E2", -150.0), ("-.5", -0.5), ("-2", -2.0)])
def test_a_negative_number_in_any_spelling_is_a_value_not_a_flag(value, parsed):
    """Python 3.11's argparse took -1e-1 (and -inf) for a flag: `--reward_weights 1 -1e-1` was "expected one
    argument". Every tool's parser (ToolParser) reads any -digit as a value."""
    from trainer.args import parse_args

    args = parse_args("grpo", ["--reward", "math_answer", "--reward", "format", "--reward_weights", "1", value])
    assert args.reward_weights == [1.0, parsed]


@pytest.mark.parametrize("value", ["-inf", "-1e-3", "-nan"])
def test_a_negative_value_a_flag_refuses_is_refused_by_its_rule(value, capsys):
    """`--beta -inf` reaches --beta's own rule (a number >= 0), not argparse's "expected one argument"."""
    from trainer.args import parse_args

    with pytest.raises(SystemExit):
        parse_args("grpo", ["--beta", value])
    error = capsys.readouterr().err.splitlines()[0]
    assert error.startswith("error: --beta=") and "is not allowed; it must be a number >= 0" in error, error


def test_a_path_too_long_to_name_that_no_check_met_is_one_line(tmp_path, capsys):
    """A path flag's component over 255 bytes raises OSError (File name too long) at its first lookup; inputs are not
    each checked for it (`--data_path aaa...a.jsonl`, `--from_weight bbb...b` ended in that traceback): run_main, every
    tool's entry, says it in one line naming the path, exit 2. Other OSErrors still go through as they were."""
    import errno

    from trainer.cli import run_main
    from trainer.run_dir import EXIT_ERROR

    too_long = tmp_path / ("a" * 300 + ".jsonl")

    def main() -> int:
        return int(too_long.is_file())

    with pytest.raises(SystemExit) as exit_info:
        run_main(main)
    assert exit_info.value.code == EXIT_ERROR
    assert capsys.readouterr().err == f"error: {too_long} cannot name a file (File name too long)\n"

    def other() -> int:
        raise OSError(errno.EACCES, "Permission denied", str(tmp_path))

    with pytest.raises(PermissionError):
        run_main(other)


def _output_cases(tmp_path):
    """(module, argv, the refusal's line) of each benchmark's output path that cannot be written."""
    a_file, a_folder = tmp_path / "a_file", tmp_path / "a_folder"
    a_file.write_text("kept\n")
    a_folder.mkdir()
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("parameters: {}\n")
    minimind = tmp_path / "minimind"
    (minimind / "trainer").mkdir(parents=True)
    (minimind / "trainer" / "train_pretrain.py").write_text("")
    return [
        # the results files are trainer/cli.py's output_file, as the eval tools' reports are: refused as parsed
        ("eval.benchmarks.bench_norm", [*ONE_NORM, "--out", str(a_folder)],
         f"error: argument --out: {a_folder} is a directory, expected a file"),
        ("eval.benchmarks.bench_norm", [*ONE_NORM, "--out", str(a_file / "rows.json")],
         f"error: argument --out: {a_file / 'rows.json'}: {a_file} is a file, not a folder"),
        ("eval.benchmarks.bench_checkpoint", ["--presets", "cpu-default", "--rounds", "1", "--dir", str(a_file / "d")],
         f"error: --dir {a_file / 'd'}: {a_file} is a file, not a folder"),
        ("eval.benchmarks.time_to_loss", [*ONE_SECOND, "--out_dir", str(a_file)],
         f"error: argument --out_dir: {a_file} is a file, not a folder"),
        ("eval.benchmarks.bench_norm_variants", [str(sweep), "--out", str(sweep)],
         f"error: --out {sweep} is the sweep's {sweep}: writing there would destroy a file the tool reads; "
         f"choose another --out"),
        ("eval.benchmarks.bench_norm_variants", [str(sweep), "--out", str(a_folder)],
         f"error: argument --out: {a_folder} is a directory, expected a file"),
        ("eval.benchmarks.bench_vs_minimind", ["--minimind_dir", str(minimind), "--steps", "40", "--json",
                                               str(a_folder)],
         f"error: argument --json: {a_folder} is a directory, expected a file"),
        ("eval.benchmarks.bench_vs_minimind", ["--minimind_dir", str(minimind), "--steps", "40", "--log_dir",
                                               str(a_file)],
         f"error: argument --log_dir: {a_file} is a file, not a folder"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_a_benchmarks_output_path_that_cannot_be_written_is_refused_before_the_work(case, tmp_path, capsys):
    """A folder where a results file goes, a file in the way of an output folder, an output that is the tool's own
    input: one line naming the flag, before anything is timed or run (bench_norm's --out folder was an
    IsADirectoryError traceback after its table, bench_checkpoint's --dir under a file a NotADirectoryError,
    time_to_loss's --out_dir a FileExistsError; bench_norm_variants wrote its JSON over the sweep it read, and
    bench_vs_minimind's --json failed after both trainers' runs)."""
    import importlib

    cases = _output_cases(tmp_path)
    assert len(cases) == 8
    module, argv, said = cases[case]
    with pytest.raises(SystemExit) as stopped:
        raise SystemExit(importlib.import_module(module).main(argv))
    assert stopped.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0] == said
    assert captured.out == ""
    assert (tmp_path / "a_file").read_text() == "kept\n" and (tmp_path / "sweep.yaml").read_text() == "parameters: {}\n"


def test_bench_diagnostics_sizes_past_the_memory_are_one_line(monkeypatch, capsys):
    """--batch_size x --seq_len whose logits alone are past the memory: one line before the model is built (it was
    the allocator's traceback in the first step); an allocation failing in a step is one line too."""
    from eval.benchmarks import bench_diagnostics

    fake_memory(monkeypatch)
    flags = ["--blocks", "1", "--block_steps", "1", "--warmup", "0", "--intervals", "1", "--derive", "1"]
    with pytest.raises(SystemExit) as stopped:
        bench_diagnostics.main([*flags, "--batch_size", "2", "--seq_len", "64"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        "error: --batch_size 2 x --seq_len 64: a step's logits (6400 vocabulary, fp32) would take 3.1 MiB, more than "
        "the 1.0 MiB of a fake 1 MiB memory: lower --batch_size or --seq_len\n")

    fake_memory(monkeypatch, None)
    monkeypatch.setattr(bench_diagnostics, "run_modes", refuse_allocation)
    with pytest.raises(SystemExit) as stopped:
        bench_diagnostics.main([*flags, "--batch_size", "1", "--seq_len", "8"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"error: out of memory ({ALLOCATOR_SAID}): lower --batch_size or --seq_len\n"


def test_bench_moe_sizes_past_the_memory_are_one_line(monkeypatch, capsys):
    """--batch_size x --seq_len tokens past the memory: one line before the experts are built and called (it was the
    allocator's traceback); an allocation failing in a call is one line too."""
    from eval.benchmarks import bench_moe

    fake_memory(monkeypatch)
    flags = ["--preset", "cpu-default", "--experts", "2", "--rounds", "1", "--calls", "1"]
    with pytest.raises(SystemExit) as stopped:
        bench_moe.main([*flags, "--batch_size", "4", "--seq_len", "256"])
    assert stopped.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: --batch_size 4 x --seq_len 256: the 3 fp32 tensors of that many tokens x "
                                   "hidden 256 a call holds (input, output, its gradient) would take 3.0 MiB, more "
                                   "than the 1.0 MiB of a fake 1 MiB memory: lower --batch_size or --seq_len\n")

    fake_memory(monkeypatch, None)
    monkeypatch.setattr(bench_moe, "call_seconds", refuse_allocation)
    with pytest.raises(SystemExit) as stopped:
        bench_moe.main([*flags, "--batch_size", "1", "--seq_len", "8"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"error: out of memory ({ALLOCATOR_SAID}): lower --batch_size or --seq_len\n"


@pytest.mark.parametrize(("top_k", "experts", "said"), [
    ("2", "1,2,4", ", top-1 with 1 expert, top-2 with 2,4 experts, "),
    ("8", "2,4", ", top-2 with 2 experts, top-4 with 4 experts, "),
    ("4", "2", ", top-2, "),  # it said top-4: the one expert count has 2
    ("1", "1,2", ", top-1, ")])
def test_bench_moe_names_the_top_k_each_variant_routes_to(top_k, experts, said, monkeypatch, capsys):
    """--top_k past a variant's expert count is lowered to it (each token to every expert): the header said the
    asked --top_k for every variant."""
    from eval.benchmarks import bench_moe

    monkeypatch.setattr(bench_moe, "call_seconds", lambda mlp, x, calls: 0.001)
    bench_moe.main(["--preset", "cpu-default", "--experts", experts, "--top_k", top_k, "--rounds", "1", "--calls",
                    "1", "--batch_size", "1", "--seq_len", "8"])
    header = capsys.readouterr().out.splitlines()[1]
    assert header.startswith("cpu-default: hidden ") and said in header, header


def test_bench_norm_shapes_past_the_memory_are_one_line(monkeypatch, capsys):
    """--m x --n past the device's memory: one line before the copy-bandwidth probe and the timing (it was the
    allocator's traceback after them); an allocation failing in the timing is one line too."""
    from eval.benchmarks import bench_norm

    fake_memory(monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        bench_norm.main(["--device", "cpu", "--m", "1024", "--n", "64", "256", "--methods", "eager"])
    assert stopped.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: --m 1024 x --n 256: the 4 float32 tensors of that shape (x, dy, the "
                                   "output, dx) would take 4.0 MiB, more than the 1.0 MiB of a fake 1 MiB memory: "
                                   "lower --m or --n\n")

    fake_memory(monkeypatch, None)
    monkeypatch.setattr(bench_norm, "time_methods", refuse_allocation)
    assert bench_norm.main(ONE_NORM) == 2
    assert capsys.readouterr().err == f"error: out of memory ({ALLOCATOR_SAID}): lower --m or --n\n"


def test_bench_rollout_tokens_past_the_models_context_are_one_line_before_the_conversion(monkeypatch, capsys):
    """--tokens past what the preset's context takes after the prompt: one line naming the allowed range, before the
    GGUF conversion and the rounds (the engine stopped at the context: an AssertionError after ~80 s)."""
    import re

    from eval.benchmarks import bench_rollout

    class Converted(Exception):
        pass

    def conversion(*args, **kwargs):
        raise Converted

    monkeypatch.setattr(bench_rollout.subprocess, "run", conversion)
    with pytest.raises(SystemExit) as stopped:
        bench_rollout.main(["--preset", "cpu-default", "--tokens", "600", "--threads", "1"])
    assert stopped.value.code == 2
    line = capsys.readouterr().err.splitlines()[-2]
    assert re.fullmatch(r"error: --tokens 600: the cpu-default model's context of 512 takes at most (\d+) new tokens "
                        r"after the (\d+)-token prompt; allowed: 1 \.\. \1", line), line


@pytest.mark.parametrize("kind", ["missing", "a_file"])
def test_bench_serve_names_a_model_path_that_holds_no_model_in_one_line(kind, tmp_path, capsys):
    """--model_path where no model is (nothing, a file) was locate_model's ModelNotFound traceback; now its one line,
    as eval/chat.py says it."""
    from eval.benchmarks import bench_serve

    path = tmp_path / kind
    if kind == "a_file":
        path.write_text("")
    assert bench_serve.main(["--model_path", str(path), "--requests", "1", "--repeats", "1"]) == 2
    captured = capsys.readouterr()
    said = f"no model at {path}; create it with" if kind == "missing" else f"{path} is a file, not a model folder"
    assert captured.err.startswith(f"error: {said}") and captured.err.count("\n") == 1
    assert captured.out == ""
