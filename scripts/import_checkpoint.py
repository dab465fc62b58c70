"""Import a transformers Llama or Qwen3 (dense) checkpoint directory as a MiniNorm model directory.

    python scripts/import_checkpoint.py --source path/to/hf_model --out_dir out/imported
    python trainer/train_full_sft.py --from_weight out/imported --tokenizer_path out/imported

A Llama is MiniNorm's pre-LN RMSNorm model; a Qwen3 is the same with per-head QK-norm (qk_norm=True,
qk_norm_scope='head'). The result has MiniNorm's config, the weights in fp32, the checkpoint's tokenizer files,
chat template and generation settings when it has them, and imported_from.json (the source and the measured logit
difference); the trainers' --from_weight, chat, evaluation and the server take it like a model trained here. What
MiniNorm cannot compute exactly (biases, a sliding window, an unsupported RoPE type, an LM head that contradicts
tie_word_embeddings) is refused in one line before any weight is loaded; a head_dim of the checkpoint's own (Qwen3's
128) is imported as it is. The logits are checked against transformers' own model unless --no_verify. --norm_type
layernorm (or prmsnorm, dyt) swaps every norm for that one, keeping the learned gains, for a fine-tune with other
norms; the logit difference is then measured, not required to be small. An existing --out_dir is replaced only
when it is empty or an earlier import.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, from the repo root or from scripts/
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

import json  # noqa: E402
import shutil  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from dataset.atomic_io import check_not_a_folder, first_line  # noqa: E402
from model.export_dir import IMPORT_MARKER, check_out_dir, earlier_source, staged_dir  # noqa: E402
from model.generation_defaults import savable_generation_config  # noqa: E402
from model.interop import (CHECKPOINT_NORM, SWAPPABLE_NORMS, NotImportable, mininorm_config_from,  # noqa: E402
                           model_from, read_state_dict)
from model.loading import check_tokenizer_fits, load_config, load_dir_tokenizer, missing_package  # noqa: E402
from model.model import MiniNormForCausalLM  # noqa: E402
from trainer.cli import DefaultsHelpFormatter, ToolParser, path_arg, run_main  # noqa: E402
from trainer.run_dir import TOKENIZER_FILES, report_error, resolve_input_path, resolve_path  # noqa: E402

MAX_LOGIT_DIFFERENCE = 1e-4


@torch.no_grad()
def max_logit_difference(source: Path, ours: MiniNormForCausalLM, seq_len: int = 16) -> float:
    """Largest |logit difference| between transformers' model of `source` and ours, on random token ids."""
    try:
        theirs = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    except ImportError as error:  # its config.json asks for a package (flash-attn for flash_attention_2)
        raise ValueError(f"{missing_package(source, error)}; the logits check needs transformers' model of it "
                         f"(--no_verify skips the check)") from None
    ids = torch.randint(0, ours.config.vocab_size, (2, min(seq_len, ours.config.max_position_embeddings)),
                        generator=torch.Generator().manual_seed(0))
    return (ours.float().eval()(ids).logits - theirs(ids).logits).abs().max().item()


def import_checkpoint(source: str | Path, out_dir: str | Path, verify: bool = True, norm_type: str = CHECKPOINT_NORM
                      ) -> tuple[Path, float | None]:
    """Write the MiniNorm directory; returns (its path, the measured max |logit difference| or None).
    `norm_type` other than rmsnorm swaps the norms (model/interop.py): the difference is then measured, not
    required to be small. Raises NotImportable / ValueError."""
    source = resolve_input_path(source).resolve()
    out_dir = resolve_path(out_dir).resolve()
    config_file = source / "config.json"
    if not config_file.is_file():
        raise ValueError(f"--source {source}: no config.json there; pass a transformers checkpoint directory")
    try:
        hf_config = json.loads(config_file.read_text())
    # ValueError: JSONDecodeError, or an integer past Python's 4300 digits; RecursionError: arrays nested too deep
    except (OSError, ValueError, RecursionError) as error:
        raise ValueError(f"{config_file}: not readable JSON ({first_line(error)})") from None
    check_out_dir(source, out_dir, IMPORT_MARKER, "an earlier import")
    config = mininorm_config_from(hf_config, source, norm_type)  # refuses before any weight is read
    load_config(source)  # transformers' own fields (dtype, ...), named here: AutoTokenizer reads them below too
    for name in TOKENIZER_FILES:  # copied below when a file: a folder in one's place was left out quietly
        check_not_a_folder(source / name)
    if (source / "tokenizer.json").is_file():  # a tokenizer this project reads (a tokenizer.model alone is copied)
        tokenizer = load_dir_tokenizer(source)  # after the config's checks: AutoTokenizer reads config.json too
        check_tokenizer_fits(tokenizer, config.vocab_size, source)
        config = mininorm_config_from(hf_config, source, norm_type, tokenizer)  # its ids fill config.json's gaps
    generation_config = savable_generation_config(source, config.vocab_size)  # before any weight is read
    ours = model_from(config, read_state_dict(source, config), source)
    ours.generation_config = generation_config
    diff = None
    provenance = {"source": str(source), "model_type": hf_config["model_type"], "norm_type": norm_type,
                  "max_logit_difference": diff}
    with staged_dir(out_dir, IMPORT_MARKER, provenance) as staging:
        ours.save_pretrained(staging, safe_serialization=True)
        for name in TOKENIZER_FILES:  # the tokenizer's files and the chat template, copied as they are
            if (source / name).is_file():
                shutil.copy2(source / name, staging / name)
        if verify:
            diff = max_logit_difference(source, ours)
            if norm_type == CHECKPOINT_NORM and not diff <= MAX_LOGIT_DIFFERENCE:
                raise ValueError(f"the imported model's logits differ from {source}'s by {diff:.3g}; "
                                 "nothing written")
            provenance["max_logit_difference"] = diff
    return out_dir, diff


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description="Import a transformers Llama or Qwen3 (dense) checkpoint as a MiniNorm model",
                        formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--source", type=path_arg, required=True,
                        help="transformers checkpoint directory (config.json, model.safetensors, tokenizer files)")
    parser.add_argument("--out_dir", type=path_arg, default="out/imported",
                        help="where the MiniNorm directory goes; an empty folder or an earlier import is replaced")
    parser.add_argument("--norm_type", default=CHECKPOINT_NORM, choices=SWAPPABLE_NORMS,
                        help=f"the norm the model gets: {CHECKPOINT_NORM} keeps the checkpoint's function exactly; "
                             "another one keeps each learned gain, starts biases at 0 (and DyT's alpha at its init) "
                             "and changes the logits (the difference is measured and printed); fine-tune it afterwards")
    parser.add_argument("--no_verify", action="store_true",
                        help="skip the logits check against transformers' own model of --source")
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()
    earlier = earlier_source(resolve_path(args.out_dir), IMPORT_MARKER)  # what a success replaces, to say so
    try:
        out, diff = import_checkpoint(args.source, args.out_dir, verify=not args.no_verify, norm_type=args.norm_type)
    except (NotImportable, ValueError) as error:
        return report_error(error)
    swapped = "" if args.norm_type == CHECKPOINT_NORM else f", norm_type={args.norm_type!r}"
    measured = "" if diff is None else f", max logit difference {diff:.2g} from transformers"
    replaced = f"; it replaced the earlier import there, of {earlier}" if earlier else ""
    print(f"wrote {out} (MiniNorm{swapped}{measured}){replaced}")
    return 0


if __name__ == "__main__":
    run_main(main)
