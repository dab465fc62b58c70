"""write_report: report.md, report.json and the plots of one or more sweeps (the parts of a study)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dataset.atomic_io import atomic_write_text, make_dirs
from dataset.json_text import strict_json
from eval.studies.ablation.baseline import data_key, unigram_baseline
from eval.studies.ablation.load import SEED_KEY, Part, Trial, duplicate_trials, group_variants, load_sweep
from eval.studies.ablation.plots import plot_curves, plot_grad_profile, plot_lr_warmup, plot_pre_post, plot_prms_p
from eval.studies.ablation.study2 import ESCAPE_MARGIN, read_bench_step_times
from eval.studies.ablation.study2_section import study2_section, write_seed2_yaml
from eval.studies.ablation.tables import markdown_table, variant_rows
from trainer.run_dir import shown_path


def _part_markdown(part: Part, rows: list[dict[str, Any]], plots: dict[str, bool], heading: bool) -> list[str]:
    config, trials = part.config, part.trials
    fixed = {k: spec["value"] for k, spec in config["parameters"].items() if "value" in spec}
    counts = {s: sum(t.status == s for t in trials) for s in ("finished", "diverged", "failed", "not run")}
    seeds = sorted({t.params.get(SEED_KEY) for t in trials if SEED_KEY in t.params}, key=str)
    # finished trials whose run_summary.json holds no final loss (damaged, edited): named, not dropped in silence
    no_loss = [t.trial_id for t in trials if t.status == "finished" and t.final_val_loss is None]
    # ... and those whose curve lost a NaN or infinite val loss (the trials the mean curves average)
    no_point = [t for t in trials if t.final_val_loss is not None and t.non_finite_val_steps]
    md = [f"## Part `{part.name}`", ""] if heading else []
    if heading and config.get("description"):
        md += [str(config["description"]), ""]
    md += [f"Method `{config['method']}`, metric `{(config.get('metric') or {}).get('name')}`; "
           f"{len(trials)} trials: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) +
           (f"; seeds {seeds}" if seeds else "") + f"; folder `{shown_path(part.sweep_dir)}`.", "",
           *([f"Left out of the means: {len(no_loss)} finished trial(s) whose run_summary.json holds no finite "
              f"final val loss: {', '.join(f'`{tid}`' for tid in no_loss)}.", ""] if no_loss else []),
           *([f"Left out of the mean curves: the NaN or infinite val losses in metrics.jsonl of {len(no_point)} "
              f"finished trial(s): " + ", ".join(f"`{t.trial_id}` (steps {', '.join(map(str, t.non_finite_val_steps))})"
                                                 for t in no_point) + ".", ""] if no_point else []),
           markdown_table(config, rows), ""]
    for name, made in plots.items():
        if made:
            md += [f"![{name[:-4]}]({name})", ""]
    md += ["Fixed settings: " + ", ".join(f"`{k}={v}`" for k, v in fixed.items()), ""]
    return md


def _machines_markdown(parts: list[Part]) -> list[str]:
    """Where and from which code the finished and diverged trials ran (run_summary.json's `machine` and `code`):
    a study that spans sessions spans machines, and their kernels round differently."""
    ran = [t for p in parts for t in p.trials if t.status in ("finished", "diverged")]
    if not ran:
        return []
    def recorded(trial: Trial, key: str) -> str | None:  # text only: an edited list or number is no record
        value = trial.summary.get(key)
        return value if isinstance(value, str) and value else None

    machines: dict[str, int] = {}
    for trial in ran:
        key = recorded(trial, "machine") or "not recorded"
        machines[key] = machines.get(key, 0) + 1
    codes = {code for t in ran if (code := recorded(t, "code"))}
    line = "Machines: " + "; ".join(f"{name}: {n} trial{'s' if n > 1 else ''}" for name, n in machines.items())
    if codes:
        line += (f". Code: {len(codes)} version{'s' if len(codes) > 1 else ''} (`git describe`: "
                 + ", ".join(f"`{c}`" for c in sorted(codes)) + ")")
    return [line + ".", ""]


def _attach_variants_and_baselines(parts: list[Part], unigram: bool) -> dict[str, dict[str, Any]]:
    """Group each part's trials into variants and, with `unigram`, give each part the unigram baseline of its data
    (built once per data); returns the baselines by data."""
    baselines: dict[str, dict[str, Any]] = {}
    for part in parts:
        part.variants = group_variants(part.config, part.trials)
        source = next((t for t in part.trials if t.final_val_loss is not None), None)
        if unigram and source is not None:
            key = data_key(source.run_dir)
            if key not in baselines:
                baselines[key] = unigram_baseline(source.run_dir)
            part.unigram = baselines[key]
    return baselines


def _intro_markdown(names: list[str], baselines: dict[str, dict[str, Any]]) -> list[str]:
    """The report's title, what its numbers mean, and the unigram baselines."""
    md = [f"# Ablation report: {', '.join(f'`{n}`' for n in names)}", "",
          "Final val loss: the trainer's last evaluation over the whole validation split (run_summary.json), "
          "mean ± sample std (n-1) over the finished seeds; diverged (NaN/inf) and failed trials are counted "
          "and left out of the mean. grad L0 / L_last: the gradient norm of the first block's parameters over "
          "the last block's at the last diagnostics step (geometric mean over seeds; far below 1: the gradient "
          "vanishes toward the input). Step time and tokens/s: median over the variant's trials of each run's "
          "median step (the machine may be shared, so treat speed as indicative).", ""]
    for baseline in baselines.values():
        md += [f"Unigram baseline: **{baseline['loss']:.4f}** nats ({baseline['bits_per_byte']:.3f} bits/byte) on "
               f"{baseline['tokens']:,} validation targets at max_seq_len {baseline['max_seq_len']}: add-one-smoothed "
               f"token frequencies of the training split, scored like the trials (data: {baseline['data']}; "
               f"rebuilt from trial `{baseline['from_trial']}`). \"vs unigram\" is the final loss minus it.", ""]
    return md


def _duplicates_markdown(duplicates: list[dict[str, Any]]) -> list[str]:
    """Whether the trials two parts both ran (identical parameters) got the same final val losses."""
    if not duplicates:
        return []
    worst = max(d["abs_diff"] for d in duplicates)
    return [f"{len(duplicates)} trials ran in two parts with identical parameters; their final val losses differ "
            f"by at most {worst:.2g} (the same parameters give the same numbers: "
            + ("**yes**" if worst == 0 else "**no**") + "). Each part's table counts its own copy.", ""]


def _part_plots(part: Part, out: Path, prefix: str) -> dict[str, bool]:
    """Draw a part's plots into `out` (names prefixed with `prefix`); by file name, whether each was drawn."""
    return {f"{prefix}val_curves.png": plot_curves(part.variants, out / f"{prefix}val_curves.png", part.baseline),
            f"{prefix}prms_p.png": plot_prms_p(part.variants, out / f"{prefix}prms_p.png"),
            f"{prefix}pre_post_warmup.png": plot_pre_post(part.variants, out / f"{prefix}pre_post_warmup.png"),
            f"{prefix}lr_warmup.png": plot_lr_warmup(part.variants, out / f"{prefix}lr_warmup.png", part.baseline),
            f"{prefix}grad_profile.png": plot_grad_profile(part.variants, out / f"{prefix}grad_profile.png")}


def _part_sections(parts: list[Part],
                   out: Path) -> tuple[list[str], list[dict[str, Any]], list[str], dict[str, int]]:
    """Each part's table, plots (drawn into `out`, prefixed with the part's name when there are several) and
    settings; returns the markdown, the variant rows, the plots drawn and the trials counted by status."""
    rows_all, plots_all, counts = [], [], {"finished": 0, "diverged": 0, "failed": 0, "not run": 0}
    md: list[str] = []
    for part in parts:
        rows = variant_rows(part.variants, part.name, part.baseline)
        plots = _part_plots(part, out, f"{part.name}_" if len(parts) > 1 else "")
        md += _part_markdown(part, rows, plots, heading=len(parts) > 1)
        rows_all += rows
        plots_all += [name for name, made in plots.items() if made]
        for status in counts:
            counts[status] += sum(t.status == status for t in part.trials)
    return md, rows_all, plots_all, counts


def _study2_section(parts: list[Part], out: Path, step_times: str | Path | None,
                    escape_margin: float) -> tuple[list[str], dict[str, Any]]:
    """The second edition's section over all the parts, refused in one line when they were scored on different
    data."""
    bench = read_bench_step_times(step_times) if step_times else None
    unigram_losses = {p.baseline for p in parts if p.baseline is not None}
    if len(unigram_losses) > 1:
        raise ValueError("--study2: the parts were scored on different data (unigram losses "
                         f"{sorted(unigram_losses)}); report them apart")
    return study2_section(parts, out, next(iter(unigram_losses), None), bench, escape_margin)


def _trial_entries(parts: list[Part]) -> list[dict[str, Any]]:
    """report.json's record of every trial of every part."""
    return [{"part": p.name, "trial_id": t.trial_id, "status": t.status, "params": t.params,
             "final_val_loss": t.final_val_loss, "grad_in_out": t.grad_in_out,
             "median_step_time_s": t.summary.get("median_step_time_s"),
             "tokens_per_s": t.summary.get("tokens_per_s"), "machine": t.summary.get("machine"),
             "code": t.summary.get("code")} for p in parts for t in p.trials]


def write_report(sweep_dirs: str | Path | list[str | Path], out_dir: str | Path | None = None,
                 unigram: bool = False, study2: bool = False, step_times: str | Path | None = None,
                 escape_margin: float = ESCAPE_MARGIN, seed2_dir: str | Path | None = None) -> Path:
    """Write report.md, report.json and the plots of one or more sweeps; returns the markdown path. `study2` adds
    the second edition's section over all the parts together (with `step_times`, the interleaved benchmark's JSON);
    `seed2_dir` also writes the second-seed sweep YAML there, from the first part's learning-rate grid (and
    the other parts that extend it: `is_rate_grid`)."""
    import matplotlib
    matplotlib.use("Agg")
    dirs = [Path(d) for d in (sweep_dirs if isinstance(sweep_dirs, (list, tuple)) else [sweep_dirs])]
    parts = [Part(d, *load_sweep(d)) for d in dirs]  # read first: a wrong folder leaves nothing behind
    out = make_dirs(Path(out_dir) if out_dir else dirs[0] / "report")
    names = [p.name for p in parts]
    if len(set(names)) < len(names):
        raise ValueError(f"two sweep folders hold sweeps of the same name ({', '.join(names)}); report them apart")
    md = _intro_markdown(names, _attach_variants_and_baselines(parts, unigram)) + _machines_markdown(parts)
    duplicates = duplicate_trials(parts)
    md += _duplicates_markdown(duplicates)
    sections, rows_all, plots_all, counts = _part_sections(parts, out)
    md += sections
    if study2:
        section, study2_payload = _study2_section(parts, out, step_times, escape_margin)
        md += section
        plots_all += study2_payload["plots"]
    if seed2_dir:
        seed2 = write_seed2_yaml(parts[0], seed2_dir, parts[1:])
        print(f"second-seed sweep written: OMP_NUM_THREADS=1 python scripts/sweep.py {seed2}")
    atomic_write_text(out / "report.md", "\n".join(md))
    payload = {"sweeps": names, "counts": counts, "variants": rows_all, "plots": plots_all,
               "unigram": {p.name: p.unigram for p in parts if p.unigram}, "duplicates": duplicates,
               "trials": _trial_entries(parts)}
    if study2:
        payload["study2"] = study2_payload
    atomic_write_text(out / "report.json", strict_json(payload, indent=1, default=str))
    return out / "report.md"
