"""Export a Llama-compatible MiniNorm model as one GGUF file, for llama.cpp, Ollama, LM Studio and the like.

    python scripts/convert_to_gguf.py --model_path out/sft_plain                 # -> out/sft_plain-f16.gguf
    python scripts/convert_to_gguf.py --model_path out/sft_plain --outtype q8_0 --outfile out/sft.gguf

The input is a MiniNorm model directory with norm_type='rmsnorm', norm_placement='pre', norm_affine=True and
norm_depth_scaling=False (any other config gets the Llama export's one-line refusal), or a Llama directory written
by convert_to_llama.py. qk_norm=False writes llama.cpp's LLaMA architecture; qk_norm=True (qk_norm_scope='head')
writes its qwen3 architecture (per-head QK-norm, RoPE on rotate-half pairs, so q/k rows keep their order), and
its qwen3moe architecture for a mixture of experts (num_experts > 0; each block's experts stacked into
ffn_{gate,up,down}_exps). llama.cpp's qwen3moe always renormalises the top-k routing weights, so an MoE model
needs norm_topk_prob=True.
The file is written with the `gguf` package (llama.cpp's own writer): the architecture's metadata, every tensor
under llama.cpp's name, the byte-level BPE tokenizer as llama.cpp's `gpt2` model with the `gpt-2`
pre-tokenizer (our split pattern is GPT-2's), eos `<|im_end|>`, no token added in front of a prompt, and the
model's chat template (ChatML with tools and thinking) as tokenizer.chat_template. A tokenizer that splits text
otherwise (an imported checkpoint's own pre-tokenizer or normalizer) is refused: llama.cpp would cut text where
it does not. The file records its model directory under mininorm.source (relative to the repo, or its name: never
a path of this machine, so one model gives the same bytes wherever it lies), and an existing --outfile is replaced
only when it has that key (an earlier export by this tool). docs/gguf.md shows llama.cpp and Ollama using it.
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
from typing import TYPE_CHECKING, Any, NamedTuple  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig  # noqa: E402

from dataset.atomic_io import atomic_path, check_folder_path, first_line  # noqa: E402
from model.config import MiniNormConfig  # noqa: E402
from model.llama_compat import (NotExportable, check_exportable, stacked_experts,  # noqa: E402
                                to_llama_state_dict, to_target_config)
from model.loading import config_model_type, load_config, load_model  # noqa: E402
from dataset.shown_value import shown_value  # noqa: E402
from trainer.cli import ToolParser, path_arg, run_main  # noqa: E402
from trainer.run_dir import ModelNotFound, locate_model, report_error, resolve_path, shown_path  # noqa: E402

if TYPE_CHECKING:
    from gguf import MODEL_ARCH, GGMLQuantizationType
    from transformers import PreTrainedTokenizerBase

INSTALL_HINT = "the GGUF export needs the gguf package: pip install -r requirements.txt (or pip install gguf==0.19.0)"
OUT_TYPES = ("f32", "f16", "bf16", "q8_0")
GGUF_MAGIC = b"GGUF"
# The metadata key that marks a file this tool wrote (its value: source_label's name of the model directory): only
# such a file is replaced.
SOURCE_KEY = "mininorm.source"
# The only split llama.cpp's "gpt-2" pre-tokenizer computes: byte-level, GPT-2's regex, no prefix space
# (tests/unit/test_gguf.py checks ours is exactly this). trim_offsets changes offsets, not the pieces.
GPT2_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    return gguf


def default_outfile(model_dir: Path, outtype: str) -> Path:
    """out/<model directory name>-<outtype>.gguf, under the repo root."""
    return resolve_path(f"out/{model_dir.name}-{outtype}.gguf")


def source_label(model_dir: Path) -> str:
    """The model directory as SOURCE_KEY records it: relative to the repo root when it lies inside (out/sft_plain),
    else its name alone. Never an absolute path: the file's bytes (and its size) would then depend on where the
    repo or the model lies, and GGUF's own source keys (general.source.url, general.source.huggingface.repository)
    name where a model is published, not a folder on the machine that converted it."""
    shown = shown_path(model_dir)
    return model_dir.name if Path(shown).is_absolute() else shown


def _written_here(gguf: Any, path: Path) -> bool:
    """Whether the GGUF file at `path` has SOURCE_KEY, i.e. this tool wrote it."""
    try:
        return SOURCE_KEY in gguf.GGUFReader(path).fields
    except Exception:  # noqa: BLE001 -- a damaged file of any kind is not one to replace
        return False


def check_outfile(gguf: Any, outfile: Path) -> None:
    """Refuse to replace anything but a GGUF file this tool wrote: one downloaded elsewhere is not ours to delete."""
    check_folder_path(outfile, "--outfile", itself=False)
    if outfile.is_dir():
        raise ValueError(f"--outfile {outfile} is a folder; name the .gguf file to write")
    if outfile.exists():
        with open(outfile, "rb") as f:
            if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
                raise ValueError(f"--outfile {outfile} exists and is not a GGUF file; not replacing it")
        if not _written_here(gguf, outfile):
            raise ValueError(f"--outfile {outfile} is a GGUF file this tool did not write (no {SOURCE_KEY} in its "
                             "metadata); not replacing it: choose another name, or delete it yourself")


def check_tokenizer(model_dir: Path) -> None:
    """Refuse a tokenizer that llama.cpp's `gpt2` model with the `gpt-2` pre-tokenizer would not reproduce: another
    split regex, a prefix space, a normalizer, or a model other than byte-level BPE."""
    file = model_dir / "tokenizer.json"
    try:
        spec = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file}: cannot read it ({error})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{file}: not a tokenizer.json (a JSON object)")
    pre, model = spec.get("pre_tokenizer"), spec.get("model")
    why = ("is not GPT-2's byte-level split (ByteLevel with use_regex=true, add_prefix_space=false), the only one "
           "written as llama.cpp's 'gpt-2' pre-tokenizer; llama.cpp would cut text where this tokenizer does not")
    if not isinstance(pre, dict) or {key: pre.get(key) for key in GPT2_PRE_TOKENIZER} != GPT2_PRE_TOKENIZER:
        raise NotExportable(f"cannot convert {model_dir} to GGUF: {file.name}'s pre_tokenizer {shown_value(pre)} {why}")
    if spec.get("normalizer") is not None:
        raise NotExportable(f"cannot convert {model_dir} to GGUF: {file.name}'s normalizer "
                                 f"{shown_value(spec['normalizer'])} is not supported; llama.cpp's 'gpt2' tokenizer "
                                 "does not normalize text")
    if not isinstance(model, dict) or model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = model.get("type") if isinstance(model, dict) else model
        raise NotExportable(f"cannot convert {model_dir} to GGUF: {file.name}'s model {shown_value(kind)} is not the "
                                 "byte-level BPE that llama.cpp's 'gpt2' tokenizer is")


def _check_llama_dir(config: LlamaConfig, model_dir: Path) -> None:
    """A Llama directory must be one that the plain LLaMA graph of llama.cpp computes exactly."""
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    problems = {"attention_bias": config.attention_bias, "mlp_bias": getattr(config, "mlp_bias", False),
                "hidden_act": config.hidden_act != "silu", "rope_type": rope_type != "default"}
    bad = [name for name, is_bad in problems.items() if is_bad]
    if bad:
        value = shown_value(getattr(config, bad[0], rope_type))
        raise NotExportable(f"cannot convert {model_dir} to GGUF: {bad[0]}={value} is not what a MiniNorm Llama export "
                            "has (no biases, silu, default RoPE)")


def _check_moe(config: MiniNormConfig, model_dir: Path) -> None:
    """What llama.cpp's qwen3moe graph computes beyond Qwen3-MoE's switches: renormalised top-k weights."""
    if config.is_moe and not config.norm_topk_prob:
        raise NotExportable(f"cannot convert {model_dir} to GGUF: norm_topk_prob=False is not what llama.cpp "
                                 "computes (its qwen3moe always renormalises the top-k routing weights to sum to 1)")


def load_llama_weights(model_dir: Path) -> tuple[LlamaConfig | Qwen3Config | Qwen3MoeConfig, dict[str, torch.Tensor],
                                                 Any]:
    """(LlamaConfig, or Qwen3Config for a model with per-head QK-norm, or Qwen3MoeConfig for a mixture of experts;
    float32 state dict under transformers' key names, experts stacked as llama.cpp holds them; tokenizer) of a
    MiniNorm model or a Llama export. The config is checked before any weight is loaded."""
    model_type = config_model_type(model_dir)
    if model_type is None:
        load_config(model_dir)  # names config.json and what is wrong with it
    if model_type == MiniNormConfig.model_type:
        config = load_config(model_dir)
        architecture = "qwen3_moe" if config.is_moe else "qwen3" if config.qk_norm else "llama"
        check_exportable(config, model_dir, "GGUF", architecture=architecture)
        _check_moe(config, model_dir)
        target = to_target_config(config, architecture)
        _check_llama_dir(target, model_dir)  # the GGUF written here has plain RoPE
    elif model_type == "llama":
        _check_llama_dir(load_config(model_dir), model_dir)
    else:
        raise ValueError(f"{model_dir} is not a MiniNorm model or a Llama export "
                         f"(model_type={shown_value(model_type)})")
    check_tokenizer(model_dir)
    model, tokenizer = load_model(model_dir, device="cpu", dtype="float32")
    if model_type == "llama":
        return model.config, dict(model.state_dict()), tokenizer
    return target, stacked_experts(to_llama_state_dict(model.state_dict()), target.num_hidden_layers), tokenizer


def rope_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q_proj / k_proj rows reordered for llama.cpp's LLaMA RoPE.

    transformers rotates each head's first half against its second half (x_i with x_{i+d/2}); llama.cpp's
    LLaMA graph rotates adjacent pairs (x_{2i} with x_{2i+1}). Moving row i of each half to position 2i and
    row i + d/2 to 2i + 1 gives the same attention scores.
    """
    rows, columns = weight.shape
    head_dim = rows // n_heads
    return weight.reshape(n_heads, 2, head_dim // 2, columns).transpose(1, 2).reshape(rows, columns)


def tensor_type(gguf: Any, shape: tuple[int, ...], outtype: str) -> GGMLQuantizationType:
    """The GGML type a tensor is stored in: norms (1-D) always f32, as llama.cpp expects; q8_0 needs rows that
    are whole 32-element blocks (others fall back to f16)."""
    types = gguf.GGMLQuantizationType
    if len(shape) == 1 or outtype == "f32":
        return types.F32
    if outtype == "q8_0":
        block = gguf.GGML_QUANT_SIZES[types.Q8_0][0]
        return types.Q8_0 if shape[-1] % block == 0 else types.F16
    return {"f16": types.F16, "bf16": types.BF16}[outtype]


class GGUFTensor(NamedTuple):
    name: str                # llama.cpp's name, e.g. blk.0.attn_q.weight
    shape: tuple[int, ...]   # as in torch (rows, columns)
    data: np.ndarray         # as stored: float32 / float16 / bf16 bits / q8_0 blocks
    qtype: Any               # gguf.GGMLQuantizationType


def gguf_arch(gguf: Any, config: LlamaConfig | Qwen3Config | Qwen3MoeConfig) -> MODEL_ARCH:
    """llama.cpp's architecture for the config: qwen3 (per-head QK-norm, RoPE on rotate-half pairs), qwen3moe (the
    same with sparse MLPs) or llama."""
    return {"qwen3": gguf.MODEL_ARCH.QWEN3, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE}.get(config.model_type,
                                                                                  gguf.MODEL_ARCH.LLAMA)


def gguf_tensors(gguf: Any, config: LlamaConfig | Qwen3Config, state: dict[str, torch.Tensor], outtype: str
                 ) -> list[GGUFTensor]:
    """(GGUF name, data as written, GGML type) for every weight; a tied LM head is not written (llama.cpp reuses
    token_embd, as transformers does)."""
    arch = gguf_arch(gguf, config)
    names = gguf.TensorNameMap(arch, config.num_hidden_layers)
    tensors = []
    for key, value in state.items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for the weight {key!r} ({arch.name} architecture)")
        value = value.detach().float()
        if arch in (gguf.MODEL_ARCH.QWEN3, gguf.MODEL_ARCH.QWEN3MOE):
            pass  # llama.cpp's qwen3 graphs rotate half against half (NEOX), as transformers does
        elif key.endswith("self_attn.q_proj.weight"):
            value = rope_interleaved(value, config.num_attention_heads)
        elif key.endswith("self_attn.k_proj.weight"):
            value = rope_interleaved(value, config.num_key_value_heads)
        qtype = tensor_type(gguf, tuple(value.shape), outtype)
        tensors.append(GGUFTensor(name, tuple(value.shape), gguf.quants.quantize(value.numpy(), qtype), qtype))
    return tensors


def vocabulary(gguf: Any, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> tuple[list[str], list[int]]:
    """Token strings (byte-level BPE spelling, as in tokenizer.json) and llama.cpp token types, by id; ids the
    tokenizer lacks (a padded embedding) become unused [PAD<id>] entries."""
    by_id = {token_id: token for token, token_id in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder  # id -> AddedToken
    tokens, types = [], []
    for token_id in range(vocab_size):
        if token_id not in by_id:
            tokens.append(f"[PAD{token_id}]")
            types.append(gguf.TokenType.UNUSED)
        elif token_id in added:
            tokens.append(added[token_id].content)
            types.append(gguf.TokenType.CONTROL if added[token_id].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[token_id])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _file_type(gguf: Any, outtype: str):
    kinds = gguf.LlamaFileType
    return {"f32": kinds.ALL_F32, "f16": kinds.MOSTLY_F16, "bf16": kinds.MOSTLY_BF16, "q8_0": kinds.MOSTLY_Q8_0}[
        outtype]


def write_gguf(gguf: Any, path: Path, name: str, model_dir: Path, config: LlamaConfig,
               tokenizer: PreTrainedTokenizerBase, tensors: list[GGUFTensor], outtype: str) -> None:
    logical_shapes = {tensor.name: tensor.shape for tensor in tensors}
    writer = gguf.GGUFWriter(path, arch=gguf.MODEL_ARCH_NAMES[gguf_arch(gguf, config)])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_string(SOURCE_KEY, source_label(model_dir))
    parameters = sum(int(np.prod(shape)) for shape in logical_shapes.values())
    writer.add_size_label(gguf.size_label(parameters, 0, 0, 0))  # "4.5M": a tied head is counted once
    writer.add_file_type(_file_type(gguf, outtype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if config.model_type == "qwen3_moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)

    tokens, types = vocabulary(gguf, tokenizer, config.vocab_size)
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre("gpt-2")  # the split regex; ours is GPT-2's (tests/unit/test_gguf.py checks)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(gguf.SpecialVocab(model_dir, load_merges=True).merges)
    eos = tokenizer.eos_token_id
    writer.add_eos_token_id(eos)
    # The tokenizer has no bos: in packed pretraining every document follows an <|im_end|>, so that is this
    # model's "start of text". Naming it keeps llama.cpp from its gpt2 default (id 11, an ordinary token here);
    # nothing is ever added in front of a prompt.
    writer.add_bos_token_id(eos)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    for setter, token_id in ((writer.add_pad_token_id, tokenizer.pad_token_id),
                             (writer.add_unk_token_id, tokenizer.unk_token_id)):
        if token_id is not None:
            setter(token_id)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)

    for tensor in tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def convert_to_gguf(model_path: str | Path | None = None, outfile: str | Path | None = None,
                    outtype: str = "f16", name: str | None = None) -> Path:
    """Write the GGUF file; returns its path. Raises NotExportable / ModelNotFound / ValueError."""
    if outtype not in OUT_TYPES:
        raise ValueError(f"--outtype {shown_value(outtype)} is not one of {', '.join(OUT_TYPES)}")
    gguf = _gguf()
    model_dir = locate_model(model_path)[0].resolve()
    out = (resolve_path(outfile) if outfile is not None else default_outfile(model_dir, outtype)).resolve()
    check_outfile(gguf, out)
    config, state, tokenizer = load_llama_weights(model_dir)
    tensors = gguf_tensors(gguf, config, state, outtype)
    try:
        with atomic_path(out) as staging:
            write_gguf(gguf, staging, name or f"MiniNorm {model_dir.name}", model_dir, config, tokenizer, tensors,
                       outtype)
    except OSError as error:  # a full disk, a quota: one line; the temporary file is gone, an older file stays
        raise ValueError(f"writing {out} failed: {first_line(error)}") from None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description="Export a Llama-, Qwen3- or Qwen3-MoE-compatible MiniNorm model as a GGUF file")
    parser.add_argument("--model_path", type=path_arg, default=None,
                        help="MiniNorm model directory or its Llama export (default: out/sft, else out/pretrain)")
    parser.add_argument("--outfile", type=path_arg, default=None,
                        help="the .gguf file (default: out/<model dir>-<outtype>.gguf)")
    parser.add_argument("--outtype", default="f16", choices=OUT_TYPES,
                        help="matrix storage; norms stay f32. f32 is exact; q8_0 falls back to f16 "
                             "for rows that are not whole 32-element blocks")
    parser.add_argument("--name", default=None, help="general.name in the file (default: MiniNorm <model dir>)")
    args = parser.parse_args(argv)
    try:
        out = convert_to_gguf(args.model_path, args.outfile, args.outtype, args.name)
    except (ModelNotFound, NotExportable, ValueError) as error:
        return report_error(error)
    print(f"wrote {out} ({args.outtype}, {out.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    run_main(main)
