"""Export a MiniNorm model as a stock transformers `LlamaForCausalLM`, `Qwen3ForCausalLM` or `Qwen3MoeForCausalLM`
directory.

    python scripts/convert_to_llama.py --model_path out/pretrain --out_dir out/llama
    python scripts/convert_to_llama.py --model_path out/qk --target qwen3 --out_dir out/qwen3
    python scripts/convert_to_llama.py --model_path out/moe --target qwen3_moe --out_dir out/qwen3_moe

A model with norm_type='rmsnorm', norm_placement='pre', norm_affine=True and norm_depth_scaling=False is a LLaMA
(qk_norm=False) or a Qwen3 (qk_norm=True, qk_norm_scope='head') with renamed norm keys (model/llama_compat.py holds
the mapping), so the result loads in plain transformers, vLLM, llama.cpp's converter and so on, with the same
logits; the same model with a mixture of experts (num_experts > 0) is a Qwen3-MoE (qwen3_moe). Each --target names
the class written and is never switched silently: a target that cannot express the model is refused, naming the
switch (an MoE model on --target qwen3 names num_experts and points to qwen3_moe). The directory is written under
a temporary name and renamed into place, and the logits are checked against ours unless --no_verify. The model
directory is loaded strictly: a weight missing from model.safetensors, or one config.json does not expect, is
refused in one line. An existing --out_dir is replaced only when it is empty or a previous export by this tool
to the same target (its exported_from.json says so); one that contains the model, or lies inside it, is refused.
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
from transformers import (LlamaForCausalLM, PreTrainedModel, Qwen3ForCausalLM,  # noqa: E402
                          Qwen3MoeForCausalLM)
from transformers.utils import logging as hf_logging  # noqa: E402

from dataset.atomic_io import first_line  # noqa: E402
from dataset.json_text import strict_json  # noqa: E402
from model.config import MiniNormConfig  # noqa: E402
from model.export_dir import EXPORT_MARKER, check_out_dir, earlier_source, staged_dir  # noqa: E402
from model.llama_compat import NotExportable, check_exportable, to_target_config, to_target_state_dict  # noqa: E402
from model.generation_defaults import savable_generation_config  # noqa: E402
from model.loading import (check_tokenizer_fits, config_model_type, load_config, load_dir_tokenizer,  # noqa: E402
                           load_strictly)
from model.model import MiniNormForCausalLM  # noqa: E402
from dataset.shown_value import shown_value  # noqa: E402
from trainer.cli import DefaultsHelpFormatter, ToolParser, path_arg, run_main  # noqa: E402
from trainer.run_dir import (CONFIG_FILE, ModelNotFound, locate_model, recorded_config, report_error,  # noqa: E402
                            resolve_path)


def _patch_config_json(path: Path) -> None:
    """Add the top-level rope_theta (and rope_scaling); save_pretrained already wrote "architectures" and "dtype"
    (the weights')."""
    config = json.loads(path.read_text())
    # Readers that predate rope_parameters (transformers 4.x, llama.cpp's converter) look for rope_theta and
    # would silently fall back to 10000.
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    if config["rope_parameters"]["rope_type"] != "default":  # and their rope_scaling, for the same reason
        config["rope_scaling"] = {k: v for k, v in config["rope_parameters"].items() if k != "rope_theta"}
    if "num_local_experts" in config:  # transformers 5 writes Qwen3-MoE's expert count under its attribute_map
        config["num_experts"] = config["num_local_experts"]  # name; Qwen3-MoE checkpoints and their readers use this
    path.write_text(strict_json(config, indent=2) + "\n")


def _tokenizer_files(model_path: Path, staging: Path, vocab_size: int) -> None:
    tokenizer = load_dir_tokenizer(model_path)
    check_tokenizer_fits(tokenizer, vocab_size, model_path)
    tokenizer.save_pretrained(staging)
    # transformers 5 names the class TokenizersBackend; older readers know the same tokenizer.json loader
    # as PreTrainedTokenizerFast.
    config_file = staging / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    # transformers 5 writes the template to chat_template.jinja only; readers before it (transformers 4.x, tools
    # that read the JSON) look for it here.
    if tokenizer.chat_template:
        tokenizer_config["chat_template"] = tokenizer.chat_template
    config_file.write_text(strict_json(tokenizer_config, indent=2, ensure_ascii=False) + "\n")


# --target -> (the name messages use, the transformers class written).
TARGETS: dict[str, tuple[str, type[PreTrainedModel]]] = {
    "llama": ("Llama", LlamaForCausalLM),
    "qwen3": ("Qwen3", Qwen3ForCausalLM),
    "qwen3_moe": ("Qwen3-MoE", Qwen3MoeForCausalLM),
}


@torch.no_grad()
def max_logit_difference(ours: MiniNormForCausalLM, export_dir: Path, target: str = "llama", seq_len: int = 16
                         ) -> float:
    """Largest |logit difference| between our model and the exported directory loaded by stock transformers."""
    theirs = TARGETS[target][1].from_pretrained(export_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ours.config.vocab_size, (2, min(seq_len, ours.config.max_position_embeddings)),
                        generator=generator)
    return (ours.float()(ids).logits - theirs(ids).logits).abs().max().item()


@torch.no_grad()
def run_as_loaded(export_dir: Path, target: str, config: MiniNormConfig) -> None:
    """One forward of the exported directory as stock transformers loads it by default (dtype="auto": the weights'
    own bf16 or fp16), which max_logit_difference's fp32 copy does not exercise: a kernel may refuse in half
    precision a width it runs in fp32 (Qwen3-MoE's grouped_mm experts: multiples of 8 values there, of 4 in fp32).
    RuntimeError where it cannot run."""
    theirs = TARGETS[target][1].from_pretrained(export_dir).eval()
    theirs(torch.arange(min(4, config.max_position_embeddings)).unsqueeze(0) % config.vocab_size)


def _unrunnable_hint(config: MiniNormConfig) -> str:
    """Why transformers may fail to run an export that is correct: its default Qwen3-MoE experts (grouped_mm) need
    each expert weight row to be a multiple of 16 bytes, 4 fp32 values (8 in bf16 or fp16), of both widths."""
    widths = {"hidden_size": config.hidden_size, "moe_intermediate_size": config.moe_intermediate_size}
    if not config.is_moe or not any(width % 8 for width in widths.values()):
        return ""
    sizes = ", ".join(f"{name}={width}" for name, width in widths.items())
    return (f"; its default grouped_mm experts need hidden_size and moe_intermediate_size to be multiples of 4 "
            f"(8 in bf16 or fp16), and this model has {sizes}: export with --no_verify and load it with "
            "experts_implementation='eager'")


def convert_to_llama(model_path: str | Path, out_dir: str | Path, verify: bool = True, target: str = "llama") -> Path:
    """Write the `target` ("llama", "qwen3" or "qwen3_moe") directory; returns its path. Raises NotExportable /
    ModelNotFound / ValueError."""
    if target not in TARGETS:
        raise ValueError(f"--target {shown_value(target)} is not allowed; choose one of "
                         f"{', '.join(map(repr, TARGETS))}")
    name, model_class = TARGETS[target]
    source = locate_model(model_path)[0].resolve()
    out_dir = resolve_path(out_dir).resolve()
    # Checked as plain JSON: MiniNormConfig.from_pretrained on another model type (say, an earlier export)
    # fails with a traceback instead of this line.
    model_type = config_model_type(source)
    if model_type is None:
        load_config(source)  # names config.json and what is wrong with it
    if model_type != MiniNormConfig.model_type:
        raise ValueError(f"{source} is not a MiniNorm model (model_type={shown_value(model_type)})")
    check_out_dir(source, out_dir, EXPORT_MARKER, f"a previous {name} export", {"target": target})
    # The run's record comes along (below): one chat would refuse (a folder in its place, not UTF-8) is refused
    # before the work, not left out of the export quietly.
    recorded_config(source)
    config = load_config(source)
    check_exportable(config, source, name, architecture=target)  # before loading any weights
    # Sampling settings come along; a length limit saved by an older trainer does not (see generation_defaults).
    generation_config = savable_generation_config(source, config.vocab_size)
    ours = load_strictly(source, MiniNormForCausalLM, norm_impl="eager").eval()
    with torch.device("meta"):
        exported = model_class(to_target_config(ours.config, target))
    state = {key: tensor.detach().clone() for key, tensor in to_target_state_dict(ours.state_dict(),
                                                                                   ours.config).items()}
    exported.load_state_dict(state, strict=True, assign=True)
    exported.tie_weights()
    exported.generation_config = generation_config
    provenance: dict[str, object] = {"source": str(source), "target": target, "max_logit_difference": None}
    with staged_dir(out_dir, EXPORT_MARKER, provenance) as staging:
        exported.save_pretrained(staging, safe_serialization=True)
        _patch_config_json(staging / "config.json")
        _tokenizer_files(source, staging, ours.config.vocab_size)
        if (source / CONFIG_FILE).is_file():  # keeps the task (sft/pretrain) for eval/chat.py
            shutil.copy2(source / CONFIG_FILE, staging / CONFIG_FILE)
        if verify:
            half = ours.dtype != torch.float32  # as saved: max_logit_difference turns ours to fp32
            try:
                diff = max_logit_difference(ours, staging, target)
                if half:
                    run_as_loaded(staging, target, ours.config)
            except RuntimeError as error:  # stock transformers cannot run what was written: one line, not a traceback
                raise ValueError(f"stock transformers' {model_class.__name__} cannot run the exported model "
                                 f"({first_line(error, named=True)}); nothing written{_unrunnable_hint(ours.config)}"
                                 ) from None
            if not diff <= 1e-4:
                raise ValueError(f"the exported model's logits differ from ours by {diff:.3g}; nothing written")
            provenance["max_logit_difference"] = diff
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description="Export a MiniNorm model as a stock LlamaForCausalLM, Qwen3ForCausalLM or "
                                    "Qwen3MoeForCausalLM",
                        formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--model_path", type=path_arg, default="out/pretrain", help="MiniNorm model directory")
    parser.add_argument("--target", default="llama", choices=tuple(TARGETS),
                        help="llama: LlamaForCausalLM (needs qk_norm=False); qwen3: Qwen3ForCausalLM (needs "
                             "qk_norm=True with qk_norm_scope='head'); qwen3_moe: Qwen3MoeForCausalLM (qwen3's "
                             "needs, with num_experts > 0); all need pre-LN RMSNorm with gains; llama and qwen3 "
                             "need num_experts=0")
    parser.add_argument("--out_dir", type=path_arg, default="out/llama",
                        help="where the exported directory goes; an empty folder or a previous export to the same "
                             f"target (its {EXPORT_MARKER} says so) is replaced")
    parser.add_argument("--no_verify", action="store_true", help="skip the logits check against our model")
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()
    earlier = earlier_source(resolve_path(args.out_dir), EXPORT_MARKER)  # what a success replaces, to say so
    try:
        out = convert_to_llama(args.model_path, args.out_dir, verify=not args.no_verify, target=args.target)
    except (ModelNotFound, NotExportable, ValueError) as error:
        return report_error(error)
    class_name = TARGETS[args.target][1].__name__
    replaced = f"; it replaced the earlier export there, of {earlier}" if earlier else ""
    print(f"wrote {out} ({class_name}{'' if args.no_verify else ', logits verified against ours'}){replaced}")
    return 0


if __name__ == "__main__":
    run_main(main)
