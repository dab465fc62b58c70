"""eval/benchmarks/bench_train.py's step table says which optimizer its trainers step: the one the trainer is
given (its --help and docs/benchmarks.md describe the table by it)."""

from __future__ import annotations

import argparse

import pytest

from eval.benchmarks import bench_train


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
    ("rms,llama,rmsnorm", "--variants: unknown rmsnorm; allowed: rms,rms_eager,rms_compiled,ln,llama")])
def test_variants_are_refused_as_parsed_before_anything_is_measured(variants: str, said: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        bench_train.main(["--skip_norms", "--variants", variants])
    assert stopped.value.code == 2
    captured = capsys.readouterr()
    assert said in captured.err
    assert captured.out == ""  # no machine line, no GEMM probe: refused first
