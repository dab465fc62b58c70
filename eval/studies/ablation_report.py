"""Ablation report of one or more sweeps run by scripts/sweep.py:

    python eval/studies/ablation_report.py SWEEP_DIR [SWEEP_DIR ...] [--out DIR] [--unigram]

Writes DIR/report.md (default: the first SWEEP_DIR's report/) with one section per sweep (a "part" of a study):
per variant (a trial's swept parameters minus `seed`), the final validation loss mean ± std over seeds, how
many seeds diverged, the gradient-norm ratio between the first and the last block at the last diagnostics step
(when the trials logged diagnostics), median step time and tokens/s; plus report.json with the same numbers and
PNG plots per part (prefixed with the part's name when there are several):
- val_curves.png: validation-loss curves per variant (mean over the finished seeds); panels by learning rate
  when it is swept without the norm type, else by everything but the norm type;
- prms_p.png: final validation loss against p for pRMSNorm (RMSNorm drawn at p = 1, its special case);
- pre_post_warmup.png: pre vs post placement, with and without warmup, per norm type (bars);
- lr_warmup.png: final validation loss against the learning rate, one line per placement x warmup (the Post-LN
  warmup plot of Xiong et al. 2020), when learning rate and warmup are both swept;
- grad_profile.png: each block's gradient norm at the last diagnostics step, one line per variant.

Trials that ran in two parts with the same parameters are listed with the difference of their final losses (a
determinism check: the same parameters must give the same numbers). `--unigram` adds the unigram baseline (the
loss of a model that knows only the training split's token frequencies) for each part's data and sequence length,
rebuilt from a trial's own train_config.yaml, to the tables and plots.

Every number comes from the trials' own files: run_summary.json (final val loss, step time, tokens/s) and
metrics.jsonl (the curves, the diagnostics). Diverged and failed trials are counted, not averaged.

`--study2` adds the second edition's section (eval/studies/ablation/study2.py says every rule): per variant
(a `config` variant file) the best loss, the learning-rate sensitivity, loss against the rate in one plot, val loss
against steps and wall-clock seconds, speed relative to pre RMSNorm, stability, and the Post-LN plateau escapes.
`--write_seed2 DIR` writes the second-seed sweep (DIR/<first sweep>_seed2.yaml) from the first SWEEP_DIR's grid.

This file is the command; the work is done by its own package, eval/studies/ablation/.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

from eval.studies.ablation.report import write_report  # noqa: E402
from eval.studies.ablation.study2 import ESCAPE_MARGIN  # noqa: E402
from trainer.cli import ToolParser, float_within, output_folder, run_main  # noqa: E402
from trainer.run_dir import report_error, resolve_input_path  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description="Markdown + PNG report of sweeps run by scripts/sweep.py")
    parser.add_argument("sweep_dirs", nargs="+", metavar="sweep_dir",
                        help="e.g. out/sweeps/study_norms; several: one section per sweep")
    parser.add_argument("--out", type=output_folder,
                        help="output folder (default: the first SWEEP_DIR's report/)")
    parser.add_argument("--unigram", action="store_true",
                        help="add the unigram baseline of each sweep's data (rebuilt from a trial's train_config.yaml)")
    parser.add_argument("--study2", action="store_true",
                        help="add the second edition's section (docs/study.md): best loss and learning-rate "
                             "sensitivity per variant, loss-vs-rate and wall-clock plots, stability, Post-LN escapes")
    parser.add_argument("--step_times", help="--study2: the interleaved step times "
                                             "(JSON of eval/benchmarks/bench_norm_variants.py)")
    parser.add_argument("--escape_margin", type=float_within(0, math.inf), default=ESCAPE_MARGIN,
                        help="--study2: nats below the unigram loss that count as off the plateau")
    parser.add_argument("--write_seed2", metavar="DIR",
                        help="write DIR/<first sweep>_seed2.yaml: one more seed of every variant at its best rate "
                             "of the first SWEEP_DIR's learning-rate grid (and print the command that runs it)")
    args = parser.parse_args(argv)
    if (args.step_times or args.escape_margin != ESCAPE_MARGIN) and not args.study2:
        parser.error("--step_times and --escape_margin need --study2")
    try:
        sweep_dirs = [resolve_input_path(path) for path in args.sweep_dirs]  # from here, else the repo root
        step_times = resolve_input_path(args.step_times) if args.step_times else None
        path = write_report(sweep_dirs, args.out, args.unigram, args.study2, step_times,
                            args.escape_margin, args.write_seed2)
    except (FileNotFoundError, ValueError) as error:
        return report_error(error)
    print(f"report written to {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
