"""Gradient norms per layer at initialization, for every norm placement and type (Xiong et al., 2020, Fig. 3).

    python eval/studies/grad_at_init.py                       # 8-layer cpu-default shape, 3 seeds, 2 batches: ~3 min
    python eval/studies/grad_at_init.py --layers 12 --seeds 5 --data_path my.jsonl
    python eval/studies/grad_at_init.py --variants scripts/sweep_configs/study2_variants --layers 12 --hidden_size 64

With --variants, the networks are the given trainer `--config` files (every norm switch: parameter-free norms,
LayerNorm Scaling, QK-norm, ...) instead of the placement x norm-type grid, each named by its file's stem.

Xiong et al. ("On Layer Normalization in the Transformer Architecture") show that at initialization the
gradient of the FFN's weights grows toward the output layers with Post-LN and stays flat with Pre-LN. This
script measures the same thing here: for each placement x norm type x seed, the model is freshly initialized,
and for each of a few fixed batches of the default pretraining data we take the next-token loss's gradient and
record, per layer, the L2 norm of the gradient of the FFN's output matrix (`mlp.down_proj.weight`, W^2 in
Xiong's notation), of the whole FFN, of the attention, and of the whole block. Norms are averaged over batches
and seeds (the spread over seeds is kept too).

Writes to --out (default eval/studies/results/grad_at_init/): `results.json` (every number), `grad_at_init.md` (tables)
and `grad_at_init.png` (one panel per norm type, a line per placement, layers on x).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `import model...` work from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dataset.atomic_io import atomic_write_text  # noqa: E402
from dataset.json_text import strict_json  # noqa: E402
from model.config import MAX_SIZE, PLACEMENT_ALIASES, MiniNormConfig, NormPlacement, NormType, placement_choices  # noqa: E402
from dataset.shown_value import shown_text, shown_value  # noqa: E402
from model.model import MiniNormForCausalLM  # noqa: E402
from trainer.cli import ToolParser, benchmark_threads, int_within, output_folder, run_main  # noqa: E402
from trainer.diagnostics import NormDiagnostics  # noqa: E402
from trainer.figures import save_figure  # noqa: E402
from trainer.machine import machine_line  # noqa: E402
from trainer.memory import FP32_BYTES, allocation_failure_line, past_memory, working_on  # noqa: E402
from trainer.run_dir import report_error, resolve_input_path  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "grad_at_init"
# The defaults are the committed results' variants; --placements and --norm_types take any MiniNormConfig values
# (deepnorm, mix, dyt, ...), and a combination the config refuses is skipped with its reason.
PLACEMENTS = ("pre", "post", "sandwich", "res_post")
NORM_TYPES = ("rmsnorm", "layernorm", "prmsnorm", "none")
# Per layer, which parameters each reported quantity covers (attribute paths inside a Block).
QUANTITIES = {
    "ffn_w2": ("mlp.down_proj",),
    "ffn": ("mlp",),
    "attn": ("self_attn",),
    "block": ("",),
}
# Activation statistics taken with trainer.diagnostics on the same forward/backward: they explain the gradients
# (a norm's Jacobian scales its backward by 1 / RMS of its input).
ACTIVATIONS = ("resid_rms", "resid_grad_rms")

TOKEN_BYTES = 8  # a batch's token ids: torch.long
# What an allocation that still fails (the model's own tensors beside the batch's) is lowered by
SHRINK = "lower --batch_size, --seq_len or the model's sizes (--layers, --hidden_size, --intermediate_size)"

INIT_LABELS = {"model": "MiniNorm's own (N(0, 0.02), residual projections / sqrt(2L))",
               "xavier": "Xavier-normal block weights, no depth scaling (Xiong et al.'s setting)"}


def names_within(allowed: Sequence[str], choices: str) -> Callable[[str], list[str]]:
    """A comma-separated flag's type: each name one of `allowed` (the library's values, model/config.py), refused up
    front; unchecked, a misspelt name was only a skipped combination, and a grid of them wrote no results."""
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",")]
        unknown = [name for name in names if name not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"{shown_text(', '.join(map(repr, unknown)))} not allowed; "
                                             f"choose from {choices}")
        return names
    return parse


placement_names = names_within([*(p.value for p in NormPlacement), *PLACEMENT_ALIASES], placement_choices())
norm_type_names = names_within([t.value for t in NormType], ", ".join(repr(t.value) for t in NormType))


def variant_files(spec: str) -> list[Path]:
    """The YAML files of --variants: comma-separated files or directories (a directory: its *.yaml, sorted)."""
    files: list[Path] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        path = Path(part)
        if path.is_dir():
            files += sorted(path.glob("*.yaml"))
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"--variants: {part} is neither a YAML file nor a directory")
    if not files:
        raise ValueError(f"--variants {spec}: no YAML files there")
    return files


def variant_fields(path: Path) -> dict:
    """A variant file's model fields: every key must be a MiniNormConfig field (the norm switches)."""
    import yaml

    fields = yaml.safe_load(path.read_text()) or {}
    known = MiniNormConfig().to_dict()
    unknown = sorted(k for k in fields if k not in known) if isinstance(fields, dict) else []
    if not isinstance(fields, dict):
        raise ValueError(f"{path}: not a variant file (a mapping of model fields), got {shown_value(fields)}")
    if unknown:
        raise ValueError(f"{path}: {', '.join(unknown)} not model fields (a variant file sets norm switches only)")
    return fields


def random_batches(num_batches: int, batch_size: int, seq_len: int, vocab_size: int,
                   seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen) for _ in range(num_batches)]


def token_batches(data_path: str | None, num_batches: int, batch_size: int, seq_len: int, seed: int = 0,
                  tokenizer: PreTrainedTokenizerBase | None = None) -> tuple[list[torch.Tensor], str]:
    """Fixed batches (B, seq_len) of packed documents from the pretraining jsonl, and a label of their source.

    Documents are tokenized in file order, joined by eos and cut into rows (the packing the trainer uses);
    rows are then drawn at random (seeded) from a pool four times larger than needed. Without the default
    corpus or tokenizer the batches are random tokens, and the label says so.
    """
    try:
        if tokenizer is None:
            from dataset.tokenization import load_tokenizer
            tokenizer = load_tokenizer()
        if data_path is None:
            from dataset.corpus import ensure_default_corpus
            data_path = str(ensure_default_corpus(quiet=True).pretrain_train)
    except (ImportError, OSError) as error:
        print(f"WARNING: no default data/tokenizer ({error}); using RANDOM TOKENS", file=sys.stderr)
        vocab = MiniNormConfig().vocab_size
        return random_batches(num_batches, batch_size, seq_len, vocab, seed), "random tokens (no corpus available)"

    needed = 4 * num_batches * batch_size * seq_len
    stream: list[int] = []
    from dataset.jsonl import iter_records  # the trainer's reader: a leading byte order mark, a bad line's file:line
    for _, record, _ in iter_records(data_path, "text"):
        if record["text"]:
            stream += tokenizer(record["text"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(stream) >= needed:
            break
    rows = torch.tensor(stream[: len(stream) // seq_len * seq_len], dtype=torch.long).view(-1, seq_len)
    if len(rows) < num_batches * batch_size:
        raise ValueError(f"{data_path} has too few tokens for {num_batches} batches of {batch_size}x{seq_len}")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    picked = rows[order[: num_batches * batch_size]]
    return list(picked.split(batch_size)), f"{Path(data_path).name} (packed, tokenizer vocab {len(tokenizer)})"


def layer_grad_norms(model: MiniNormForCausalLM) -> dict[str, list[float]]:
    """Per quantity, the L2 norm of each layer's gradient over the parameters that quantity covers."""
    out: dict[str, list[float]] = {}
    for quantity, paths in QUANTITIES.items():
        values = []
        for block in model.model.layers:
            params = [p for path in paths for p in block.get_submodule(path).parameters()]
            values.append(float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params if p.grad is not None))))
        out[quantity] = values
    return out


def xavier_init_(model: MiniNormForCausalLM) -> None:
    """Xiong et al.'s setting: Xavier-normal block weights with no depth scaling, so each sublayer's output is
    as large as its input (MiniNorm's own init, std 0.02 and /sqrt(2L) on residual projections, makes it tiny)."""
    for module in model.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.xavier_normal_(module.weight)


def measure(config: MiniNormConfig, batches: list[torch.Tensor], seeds: Sequence[int],
            init: str = "model") -> dict[str, np.ndarray]:
    """Array (seeds, batches, layers) of gradient norms per quantity and of the residual stream's RMS and
    gradient RMS (NormDiagnostics), plus the initial losses."""
    per_quantity: dict[str, list] = {q: [] for q in (*QUANTITIES, *ACTIVATIONS)}
    losses = []
    for seed in seeds:
        torch.manual_seed(seed)
        model = MiniNormForCausalLM(config).train()
        if init == "xavier":
            xavier_init_(model)
        diag = NormDiagnostics(model)
        rows: dict[str, list] = {q: [] for q in per_quantity}
        seed_losses = []
        for ids in batches:
            model.zero_grad(set_to_none=True)
            diag.arm()
            loss = model(ids, labels=ids).loss
            loss.backward()
            stats = diag.after_backward()
            seed_losses.append(loss.item())
            for quantity, values in layer_grad_norms(model).items():
                rows[quantity].append(values)
            for quantity in ACTIVATIONS:
                rows[quantity].append([stats[diag.key(quantity, i)] for i in range(len(model.model.layers))])
        for quantity in per_quantity:
            per_quantity[quantity].append(rows[quantity])
        losses.append(seed_losses)
    result = {q: np.array(v) for q, v in per_quantity.items()}
    result["loss"] = np.array(losses)
    return result


def growth(values: np.ndarray) -> float:
    """Last layer / first layer: > 1 means the gradient grows toward the output."""
    return float(values[-1] / values[0])


def row_label(entry: dict) -> str:
    """The first cells of a table row: the variant file's stem, or placement | norm type."""
    return entry["variant"] if "variant" in entry else f"{entry['placement']} | {entry['norm_type']}"


def write_table(results: dict, path: Path) -> None:
    meta = results["meta"]
    # results.json files written before the heads were recorded name none
    heads = f"{meta['num_attention_heads']} heads of {meta['head_dim']}, " if "head_dim" in meta else ""
    first = "variant" if any("variant" in e for e in results["runs"]) else "placement | norm"
    lines = [
        "# Gradient norm per layer at initialization",
        "",
        f"Model: `{meta['preset']}` shape with {meta['layers']} layers (hidden {meta['hidden_size']}, {heads}"
        f"SwiGLU {meta['intermediate_size']}), init: {INIT_LABELS[meta['init']]}, norm_impl=eager, fp32. "
        f"Data: {meta['data']}; "
        f"{meta['batches']} batches of {meta['batch_size']}x{meta['seq_len']} tokens; seeds {meta['seeds']}. "
        f"Generated by `{' '.join(['python eval/studies/grad_at_init.py', meta['argv']]).strip()}` in "
        f"{meta['seconds']:.0f} s ({meta['machine']}).",
        "",
        "Values: L2 norm of the gradient of the loss with respect to each layer's FFN output matrix "
        "(`mlp.down_proj.weight`, W^2 in Xiong et al.), mean over batches and seeds (± std over seeds for the "
        "first and last layer in the last column). growth = last layer / first layer.",
        "",
    ]
    layers = meta["layers"]
    columns = first.count("|") + 1
    header = (f"| {first} | " + " | ".join(f"L{i}" for i in range(layers))
              + " | growth | first ± std / last ± std |")
    lines += [header, "|" + "---|" * (layers + columns + 2)]
    for entry in results["runs"]:
        # dtype float: a value results.json holds as null (not finite) is NaN again
        mean, std = np.array(entry["ffn_w2_mean"], dtype=float), np.array(entry["ffn_w2_seed_std"], dtype=float)
        cells = " | ".join(f"{v:.3g}" for v in mean)
        lines.append(f"| {row_label(entry)} | {cells} | {growth(mean):.2f} | "
                     f"{mean[0]:.3g} ± {std[0]:.2g} / {mean[-1]:.3g} ± {std[-1]:.2g} |")
    lines += ["", "Whole-block gradient norm (all parameters of the block), mean over batches and seeds:", "",
              f"| {first} | " + " | ".join(f"L{i}" for i in range(layers)) + " | growth |",
              "|" + "---|" * (layers + columns + 1)]
    for entry in results["runs"]:
        mean = np.array(entry["block_mean"], dtype=float)
        lines.append(f"| {row_label(entry)} | " + " | ".join(f"{v:.3g}" for v in mean) + f" | {growth(mean):.2f} |")
    for quantity, title in (("resid_rms", "RMS of the residual stream leaving each block"),
                            ("resid_grad_rms", "RMS of dLoss/d(residual stream) leaving each block")):
        if not all(f"{quantity}_mean" in e for e in results["runs"]):
            continue
        lines += ["", f"{title} (NormDiagnostics), mean over batches and seeds:", "",
                  f"| {first} | " + " | ".join(f"L{i}" for i in range(layers)) + " |",
                  "|" + "---|" * (layers + columns)]
        for entry in results["runs"]:
            lines.append(f"| {row_label(entry)} | " + " | ".join(f"{v:.3g}" for v in entry[f"{quantity}_mean"])
                         + " |")
    lines += ["", "Initial loss (mean over batches and seeds): "
              + ", ".join(f"{row_label(e).replace(' | ', '/')} {e['loss_mean']:.3f}" for e in results["runs"]), ""]
    atomic_write_text(path, "\n".join(lines))


def plot(results: dict, path: Path, quantity: str = "ffn_w2") -> None:
    """Top row: the gradient norm per layer (log scale), one panel per norm type, a line per placement.
    Bottom row: the same divided by layer 0's value, so the depth trend of every placement is comparable."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def panel(entry: dict) -> str:  # one panel per norm type; variant files share one panel
        return "variants" if "variant" in entry else f"norm_type = {entry['norm_type']}"

    panels = list(dict.fromkeys(panel(e) for e in results["runs"]))
    variants = panels == ["variants"]
    fig, axes = plt.subplots(2, len(panels), figsize=(11 if variants else 4.2 * len(panels), 7.2), squeeze=False)
    if variants:  # a dozen lines: twenty distinct colours, and the relative panel on a log scale as well
        for ax in axes.flat:
            ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
        axes[1][0].set_yscale("log")
    styles = {"pre": "o-", "post": "s-", "sandwich": "^-", "res_post": "d-"}
    for column, name in enumerate(panels):
        top, bottom = axes[0][column], axes[1][column]
        for entry in (e for e in results["runs"] if panel(e) == name):
            # dtype float: a value results.json holds as null (not finite) is NaN again
            mean = np.array(entry[f"{quantity}_mean"], dtype=float)
            std = np.array(entry[f"{quantity}_seed_std"], dtype=float)
            layers = np.arange(len(mean))
            style = styles.get(entry["placement"], "o-")
            label = entry.get("variant", entry["placement"])
            top.plot(layers, mean, style, label=label, markersize=4)
            top.fill_between(layers, np.maximum(mean - std, mean * 0.05), mean + std, alpha=0.15)
            bottom.plot(layers, mean / mean[0], style, label=label, markersize=4)
        top.set_yscale("log")
        top.set_title(name, fontsize=10)
        bottom.axhline(1.0, color="gray", lw=0.8, ls="--")
        bottom.set_xlabel("layer (0 = next to the embedding)")
        for ax in (top, bottom):
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7 if name == "variants" else 8, ncol=2 if name == "variants" else 1)
    axes[0][0].set_ylabel("||dLoss/dW2_ffn|| at init (log)")
    axes[1][0].set_ylabel("relative to layer 0")
    meta = results["meta"]
    fig.suptitle(f"Gradient norm of the FFN output matrix per layer at initialization, {meta['init']} init "
                 f"({meta['layers']} layers, hidden {meta['hidden_size']}, {len(meta['seeds'])} seeds, "
                 "band: ± std over seeds)", fontsize=11)
    save_figure(fig, path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command's flags (argv None: sys.argv's)."""
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu-default", help="model preset (model/config.py)")
    parser.add_argument("--layers", type=int_within(1), default=8,
                        help="num_hidden_layers (the preset has 4; more layers make a depth trend visible)")
    parser.add_argument("--hidden_size", type=int_within(1), default=None, help="default: the preset's")
    parser.add_argument("--intermediate_size", type=int_within(1), default=None, help="default: the preset's")
    parser.add_argument("--num_attention_heads", type=int_within(1), default=None, help="default: the preset's")
    parser.add_argument("--num_key_value_heads", type=int_within(1), default=None, help="default: the preset's")
    parser.add_argument("--head_dim", type=int_within(1), default=None,
                        help="width of each attention head, even (default: hidden_size / num_attention_heads)")
    parser.add_argument("--seq_len", type=int_within(2, MAX_SIZE, "a model position bound"), default=256,
                        help="tokens per sequence")
    parser.add_argument("--batch_size", type=int_within(1, MAX_SIZE), default=8, help="sequences per batch")
    parser.add_argument("--batches", type=int_within(1, MAX_SIZE), default=2,
                        help="fixed batches the gradient norms are averaged over")
    parser.add_argument("--seeds", type=int_within(1, MAX_SIZE), default=3,
                        help="initializations per variant (seeds 0 to N-1)")
    parser.add_argument("--placements", type=placement_names, default=",".join(PLACEMENTS),
                        help="comma-separated norm placements")
    parser.add_argument("--norm_types", type=norm_type_names, default=",".join(NORM_TYPES),
                        help="comma-separated norm types")
    parser.add_argument("--variants", default=None,
                        help="trainer --config files of model fields (comma-separated files or directories of *.yaml, "
                             "e.g. scripts/sweep_configs/study2_variants): measure these instead of --placements x "
                             "--norm_types")
    parser.add_argument("--data_path", default=None, help="pretraining jsonl ({'text': ...} lines); "
                        "default: the embedded default corpus")
    parser.add_argument("--random_tokens", action="store_true",
                        help="uniform random token batches instead of text (a sanity baseline; also no tokenizer)")
    parser.add_argument("--init", choices=("model", "xavier"), default="model",
                        help="model: MiniNorm's own init; xavier: Xavier-normal block weights (Xiong et al.)")
    parser.add_argument("--threads", type=benchmark_threads(), default=None,
                        help="torch threads (default: torch's choice)")
    parser.add_argument("--out", type=output_folder, default=None,
                        help="directory of results.json, the table and the plot (default: "
                                                    "eval/studies/results/grad_at_init/)")
    parser.add_argument("--replot", action="store_true", help="only redraw the table and PNG from results.json")
    return parser.parse_args(argv)


def too_large(args: argparse.Namespace) -> str | None:
    """Why the work cannot be held on this machine (None: it may be): the fixed batches' token ids, held throughout,
    and one batch's logits (rows x tokens x the model's vocabulary, fp32) alone are more than all of its memory
    (trainer/memory.py's past_memory, as the trainer checks its logits); sizes within their bounds were the
    allocator's traceback after the data was read."""
    vocab = MiniNormConfig.from_preset(args.preset).vocab_size
    tokens = args.batch_size * args.seq_len
    needed = args.batches * tokens * TOKEN_BYTES + tokens * vocab * FP32_BYTES
    return past_memory(needed, f"--batches {args.batches} x --batch_size {args.batch_size} x --seq_len "
                               f"{args.seq_len}: the batches' token ids (int64) and one batch's logits ({vocab} "
                               f"vocabulary, fp32)", torch.device("cpu"), "lower --batch_size, --seq_len or --batches")


def replot(out: Path) -> dict:
    """--replot: the table and the PNG drawn again from `out`/results.json, which must exist."""
    if not (out / "results.json").is_file():
        raise ValueError(f"--replot: {out / 'results.json'} does not exist (run without --replot to make it)")
    results = json.loads((out / "results.json").read_text())
    write_table(results, out / "grad_at_init.md")
    plot(results, out / "grad_at_init.png")
    return results


def input_batches(args: argparse.Namespace) -> tuple[list[torch.Tensor], str]:
    """The fixed batches every variant is measured on, and the label of their source: random tokens or text."""
    if args.random_tokens:
        vocab = MiniNormConfig.from_preset(args.preset).vocab_size
        return random_batches(args.batches, args.batch_size, args.seq_len, vocab), "RANDOM TOKENS (--random_tokens)"
    data_path = str(resolve_input_path(args.data_path)) if args.data_path else None  # from here, else the repo root
    return token_batches(data_path, args.batches, args.batch_size, args.seq_len)


def model_shape(args: argparse.Namespace) -> dict[str, int]:
    """The MiniNormConfig fields the shape flags set over the preset's (those left unset keep the preset's)."""
    names = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    return {"num_hidden_layers": args.layers, "max_position_embeddings": max(512, args.seq_len),
            **{name: getattr(args, name) for name in names if getattr(args, name) is not None}}


def measured_entry(config: MiniNormConfig, names: dict, batches: list[torch.Tensor], seeds: Sequence[int],
                   init: str) -> dict:
    """One row of results.json: `names` plus, per quantity, the mean over batches and seeds and the std over seeds
    of each layer's value; printed as one line of progress."""
    t0 = time.time()
    with working_on(f"the {row_label(names).replace(' | ', ' ')} network's forward and backward"):
        measured = measure(config, batches, seeds, init)
    entry = {**names, "loss_mean": float(measured["loss"].mean())}
    for quantity in (*QUANTITIES, *ACTIVATIONS):
        per_seed = measured[quantity].mean(axis=1)  # (seeds, layers): mean over batches
        entry[f"{quantity}_mean"] = per_seed.mean(axis=0).tolist()
        entry[f"{quantity}_seed_std"] = per_seed.std(axis=0).tolist()
    w2 = np.array(entry["ffn_w2_mean"])
    print(f"{row_label(entry):>22s}  ffn W2 grad norm first {w2[0]:.3g} last {w2[-1]:.3g} "
          f"growth {growth(w2):.2f}  ({time.time() - t0:.0f} s)", flush=True)
    return entry


def measure_variant_files(args: argparse.Namespace, shape: dict[str, int], batches: list[torch.Tensor],
                          seeds: Sequence[int]) -> list[dict]:
    """--variants: one row per trainer --config file, named by its stem."""
    runs = []
    for file in variant_files(args.variants):
        config = MiniNormConfig.from_preset(args.preset, **shape, **{**variant_fields(file), "norm_impl": "eager"})
        runs.append(measured_entry(config, {"variant": file.stem, "placement": config.norm_placement,
                                            "norm_type": config.norm_type}, batches, seeds, args.init))
    return runs


def measure_grid(args: argparse.Namespace, shape: dict[str, int], batches: list[torch.Tensor],
                 seeds: Sequence[int]) -> list[dict]:
    """One row per --placements x --norm_types combination the config allows (a refused one is printed as
    skipped); the no-norm network is measured once."""
    runs = []
    no_norm_entry = None
    for placement in args.placements:
        for norm_type in args.norm_types:
            try:
                config = MiniNormConfig.from_preset(args.preset, **shape, norm_type=norm_type,
                                                    norm_placement=placement, norm_impl="eager")
            except ValueError as error:  # a refused combination (deepnorm without a norm): no network to measure
                print(f"{placement:>9s} {norm_type:>9s}  skipped: {error}", flush=True)
                continue
            if norm_type == "none" and no_norm_entry is not None:
                # Without norms every placement allowed is the same network (x = x + f(x)) with the same init: reuse.
                runs.append({**no_norm_entry, "placement": placement})
                continue
            entry = measured_entry(config, {"placement": placement, "norm_type": norm_type}, batches, seeds,
                                   args.init)
            runs.append(entry)
            if norm_type == "none":
                no_norm_entry = entry
    return runs


def run_meta(args: argparse.Namespace, argv: Sequence[str] | None, shape: dict[str, int], seeds: list[int],
             data_label: str, start: float) -> dict:
    """results.json's "meta": the model's shape, the data, the command line, the time taken and the machine."""
    config = MiniNormConfig.from_preset(args.preset, **shape)
    return {"preset": args.preset, "init": args.init, "layers": args.layers, "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads, "head_dim": config.head_dim,
            "intermediate_size": config.intermediate_size, "seq_len": args.seq_len,
            "batch_size": args.batch_size, "batches": args.batches, "seeds": seeds, "data": data_label,
            "argv": " ".join(argv if argv is not None else sys.argv[1:]), "seconds": time.time() - start,
            "machine": machine_line()}


def write_results(results: dict, out: Path) -> None:
    """results.json, the markdown tables and the plot, in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", strict_json(results, indent=1))
    write_table(results, out / "grad_at_init.md")
    plot(results, out / "grad_at_init.png")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out) if args.out is not None else DEFAULT_OUT
    if args.replot:
        return replot(out)
    if (refusal := too_large(args)) is not None:
        raise ValueError(refusal)  # before the data is read and any network is built
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.time()
    seeds = list(range(args.seeds))
    shape = model_shape(args)
    measure_all = measure_variant_files if args.variants else measure_grid
    try:
        with working_on("making the batches"):
            batches, data_label = input_batches(args)
        runs = measure_all(args, shape, batches, seeds)
    except (MemoryError, RuntimeError) as error:  # sizes that fit alone, not beside the model's own tensors
        line = allocation_failure_line(error, SHRINK)
        if line is None:
            raise
        raise ValueError(line) from None
    if not runs:  # every combination refused: the results already in --out are kept, not replaced by an empty table
        raise ValueError("no variant to measure: the config refuses every --placements x --norm_types combination")
    results = {"meta": run_meta(args, argv, shape, seeds, data_label, start), "runs": runs}
    write_results(results, out)
    print(f"wrote {out / 'grad_at_init.md'} and {out / 'grad_at_init.png'} in {time.time() - start:.0f} s")
    return results


def command_line() -> int:
    """The command: main()'s results are for in-process callers, which get its ValueError too; here a bad
    --variants file or shape is one line."""
    try:
        main()
    except ValueError as error:
        return report_error(error)
    return 0


if __name__ == "__main__":
    run_main(command_line)
