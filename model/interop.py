"""Importing a transformers Llama or Qwen3 (dense) checkpoint as a MiniNorm model: the config mapping, the checks
that refuse what MiniNorm cannot compute exactly, and the weights.

A Llama is MiniNorm's pre-LN RMSNorm model without QK-norm; a Qwen3 is the same with per-head QK-norm
(model/llama_compat.py), whose heads may be as wide as the checkpoint says (head_dim: Qwen3's are 128 whatever
hidden_size / num_attention_heads). Whatever else a checkpoint uses (biases, a sliding window, a RoPE variant
MiniNorm does not compute) is refused in one line naming the field, before any weight is read. An import may also
swap the RMSNorms for another norm (SWAPPABLE_NORMS), keeping the learned gains: the start of a "what if its norms
were different?" fine-tune, no longer the same function.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import SafetensorError, safe_open
from transformers import LlamaConfig, PretrainedConfig, Qwen3Config

from model.config import MiniNormConfig, NormType
from model.llama_compat import from_llama_key
from model.loading import INDEX_FILE, index_shards
from model.model import MiniNormForCausalLM
from model.weight_checks import (WEIGHT_DTYPES, check_finite, few, in_two_shards, layers_held,
                                 wrong_weight_dtype)
from dataset.shown_value import shown_value

IMPORTABLE = ("llama", "qwen3")
# The transformers config class of each importable model_type: what it reads for a field config.json leaves out.
CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {"llama": LlamaConfig, "qwen3": Qwen3Config}
# The config.json fields every import reads: the shape, without defaults (MiniNormConfig checks their values).
REQUIRED_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "max_position_embeddings")


class NotImportable(ValueError):
    """The checkpoint uses something MiniNorm cannot compute exactly."""


def _as_transformers_reads(hf: Mapping[str, Any], field: str) -> Any:
    """config.json's `field`, or where it leaves the field out, its architecture's default: Qwen3Config's head_dim is
    128 and its num_key_value_heads 32, not what the other sizes imply (None: derived from them, as LLaMA's are)."""
    return hf[field] if field in hf else getattr(CONFIG_CLASSES[hf["model_type"]], field, None)


# The special tokens' ids a config.json may name (MiniNormConfig fields of the same names).
SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_token_ids(hf: Mapping[str, Any], tokenizer: Any | None) -> dict[str, Any]:
    """config.json's bos, eos and pad ids. One it leaves out is the checkpoint's tokenizer's where that names one
    (the ids its text is tokenized with), otherwise what transformers reads (LlamaConfig: bos 1, eos 2; Qwen3Config:
    none), not None: the import's config.json, and an export of it, would otherwise name no eos where transformers
    reads the source as stopping at one. A value config.json gives, null included, is kept as given."""
    ids = {}
    for field in SPECIAL_TOKEN_IDS:
        from_tokenizer = getattr(tokenizer, field, None) if tokenizer is not None else None
        ids[field] = (hf[field] if field in hf else from_tokenizer if from_tokenizer is not None
                      else _as_transformers_reads(hf, field))
    return ids


def _refuse(source: Path, field: str, value: Any, why: str) -> NotImportable:
    """The one-line refusal naming `field`; its value quoted by shown_value (a whole list or dict, a long
    layer_types, would bury the rest)."""
    return NotImportable(f"cannot import {source}: {field}={shown_value(value)} {why}")


def _rope_from(hf: Mapping[str, Any], field: str, source: Path) -> tuple[Any, dict | None]:
    """(rope_theta, rope_scaling or None) as config.json's `field` (rope_parameters or rope_scaling) gives them."""
    params = hf.get(field) or {}
    if not isinstance(params, Mapping):
        raise _refuse(source, field, params, "is not allowed; it must be an object (or null)")
    params = dict(params)
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _refuse(source, "partial_rotary_factor", partial, "is not supported; MiniNorm rotates the whole head")
    return theta, ({"rope_type": rope_type, **params} if rope_type != "default" else None)


def _rope_of(hf: Mapping[str, Any], source: Path) -> tuple[Any, dict | None]:
    """(rope_theta, rope_scaling or None) from a config.json's rope_parameters (transformers 5) or its
    rope_theta / rope_scaling (transformers 4), as found: MiniNormConfig checks both (model/rope.py, ROPE_TYPES:
    the rope types it computes as transformers does). A config.json with both, saying different things, is
    refused: transformers takes the legacy rope_scaling then, which an edit of rope_parameters would not expect."""
    given = [field for field in ("rope_parameters", "rope_scaling") if hf.get(field)]
    readings = [_rope_from(hf, field, source) for field in given or ["rope_parameters"]]
    if len(readings) == 2 and readings[0] != readings[1]:
        raise NotImportable(f"cannot import {source}: its config.json gives both rope_parameters="
                            f"{shown_value(hf['rope_parameters'])} and rope_scaling={shown_value(hf['rope_scaling'])}, "
                            "which disagree; keep the one meant (transformers reads rope_scaling when both are there)")
    return readings[0]


# A Llama's and a Qwen3's norm: an import that keeps it computes the checkpoint's function exactly.
CHECKPOINT_NORM = NormType.RMSNORM.value
# The norms an import may swap the checkpoint's RMSNorm for: each keeps the learned gain (`weight`) and starts its
# own extra parameters (LayerNorm's and DyT's bias, DyT's alpha) at their initial values.
SWAPPABLE_NORMS = (CHECKPOINT_NORM, NormType.PRMSNORM.value, NormType.LAYERNORM.value, NormType.DYT.value)


def mininorm_config_from(hf: Mapping[str, Any], source: Path, norm_type: str = CHECKPOINT_NORM,
                         tokenizer: Any | None = None) -> MiniNormConfig:
    """The MiniNormConfig of a Llama / Qwen3 config.json (a plain dict); NotImportable names the first field that
    does not map. `norm_type` other than rmsnorm (one of SWAPPABLE_NORMS) swaps every norm, QK-norms included.
    `tokenizer` (the checkpoint's, when it has one) gives the special token ids config.json leaves out."""
    if norm_type not in SWAPPABLE_NORMS:
        raise ValueError(f"--norm_type {shown_value(norm_type)} is not allowed; choose one of "
                         f"{', '.join(map(repr, SWAPPABLE_NORMS))}")
    if not isinstance(hf, Mapping):
        raise NotImportable(f"cannot import {source}: its config.json is not a JSON object")
    model_type = hf.get("model_type")
    if "model_type" not in hf:
        raise NotImportable(f"cannot import {source}: its config.json has no model_type; it must be one of "
                            f"{', '.join(map(repr, IMPORTABLE))}")
    if model_type not in IMPORTABLE:
        raise _refuse(source, "model_type", model_type,
                      f"cannot be imported; choose one of {', '.join(map(repr, IMPORTABLE))}")
    for field in REQUIRED_SIZES:  # a missing intermediate_size would read as MiniNormConfig's derived width
        if field not in hf:
            raise NotImportable(f"cannot import {source}: its config.json has no {field} (a positive integer)")
    checks = [
        ("hidden_act", hf.get("hidden_act", "silu"), lambda v: v == "silu",
         "is not supported; MiniNorm's MLP is SwiGLU with silu"),
        ("attention_bias", hf.get("attention_bias", False), lambda v: v is False,
         "is not supported; MiniNorm's projections have no bias"),
        ("mlp_bias", hf.get("mlp_bias", False), lambda v: v is False,
         "is not supported; MiniNorm's projections have no bias"),
        ("use_sliding_window", hf.get("use_sliding_window", False), lambda v: v is False,
         "is not supported; MiniNorm attends to the whole context"),
        ("layer_types", hf.get("layer_types"), lambda v: v is None or isinstance(v, list),
         "is not supported; MiniNorm attends to the whole context in every layer"),
        ("pretraining_tp", hf.get("pretraining_tp", 1), lambda v: v == 1,
         "is not supported; MiniNorm computes its projections whole"),
        # transformers dequantizes (or needs bitsandbytes, optimum, ... to); the tensors alone are not the weights
        ("quantization_config", hf.get("quantization_config"), lambda v: v is None,
         f"is not supported; MiniNorm imports unquantized weights ({', '.join(map(str, WEIGHT_DTYPES))})"),
    ]
    for field, value, ok, why in checks:
        if not ok(value):
            raise _refuse(source, field, value, why)
    # One entry per layer, so a long list: the entry that is not full attention is named, not the whole list.
    other = next((i for i, kind in enumerate(hf.get("layer_types") or []) if kind != "full_attention"), None)
    if other is not None:
        raise _refuse(source, f"layer_types[{other}]", hf["layer_types"][other],
                      "is not supported; MiniNorm attends to the whole context in every layer (full_attention)")
    rope_theta, rope_scaling = _rope_of(hf, source)
    fields: dict[str, Any] = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=_as_transformers_reads(hf, "num_key_value_heads") or hf["num_attention_heads"],
        # Qwen3Config's unset head_dim is 128 whatever the width; LlamaConfig's (None) is hidden / heads, MiniNorm's
        head_dim=_as_transformers_reads(hf, "head_dim"),
        intermediate_size=hf["intermediate_size"], max_position_embeddings=hf["max_position_embeddings"],
        rope_theta=rope_theta, tie_word_embeddings=hf.get("tie_word_embeddings", False),
        initializer_range=hf.get("initializer_range", 0.02), norm_eps=hf.get("rms_norm_eps", 1e-6),
        **special_token_ids(hf, tokenizer),
        norm_type=norm_type, norm_placement="pre", qk_norm=model_type == "qwen3", qk_norm_scope="head")
    if rope_scaling is not None:
        fields["rope_scaling"] = rope_scaling
    try:
        config = MiniNormConfig(**fields)
    except ValueError as error:  # a value MiniNorm refuses, under MiniNorm's name for it (rms_norm_eps: norm_eps)
        raise NotImportable(f"cannot import {source}: as MiniNorm's config, {error}") from None
    return config


def _weight_files(source: Path) -> list[Path]:
    if (source / INDEX_FILE).is_file():
        try:
            return index_shards(source)
        except ValueError as error:
            raise NotImportable(f"cannot import {source}: {error}") from None
    single = source / "model.safetensors"
    if single.is_file():
        return [single]
    raise NotImportable(f"cannot import {source}: no model.safetensors (or its index) there; save the model "
                        "with safe_serialization=True")


def read_state_dict(source: Path, config: MiniNormConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in fp32 under MiniNorm's key names. A tied config takes the LM head from the
    embedding; a checkpoint whose own lm_head.weight then differs from it, or an untied one without an LM head,
    is refused: transformers would silently drop or invent that head."""
    state: dict[str, torch.Tensor] = {}
    holders: dict[str, Path] = {}
    for file in _weight_files(source):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    # Older checkpoints saved RoPE's inverse frequencies; they follow from rope_theta, and
                    # transformers ignores them too.
                    if key.endswith("rotary_emb.inv_freq"):
                        continue
                    if key in holders:
                        raise NotImportable(f"cannot import {source}: {in_two_shards(key, holders[key], file)}")
                    holders[key] = file
                    tensor = f.get_tensor(key)
                    if tensor.dtype not in WEIGHT_DTYPES:  # .float() would make them weights, silently wrong
                        raise NotImportable(f"cannot import {source}: {wrong_weight_dtype(key, tensor.dtype, file)}")
                    check_finite([(key, tensor)], f"cannot import {source}", NotImportable)
                    state[from_llama_key(key)] = tensor.float()
        except SafetensorError as error:
            raise NotImportable(f"cannot import {source}: {file} is not a readable safetensors file ({error})"
                                ) from None
    head, embedding = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if embedding is None:
        raise NotImportable(f"cannot import {source}: its weights have no model.embed_tokens.weight")
    if config.tie_word_embeddings:
        if head is not None and not torch.equal(head, embedding):
            raise NotImportable(f"cannot import {source}: tie_word_embeddings=True but its lm_head.weight differs "
                                "from model.embed_tokens.weight; the tied model would drop its LM head")
        state["lm_head.weight"] = embedding
    elif head is None:
        raise NotImportable(f"cannot import {source}: tie_word_embeddings=False but it has no lm_head.weight")
    return state


def model_from(config: MiniNormConfig, state: Mapping[str, torch.Tensor], source: Path) -> MiniNormForCausalLM:
    """The MiniNorm model with the checkpoint's tensors. With swapped norms, the parameters the checkpoint lacks
    (only norm biases and DyT's alpha) keep their initial values: zero bias, alpha = dyt_alpha_init. Weights
    that do not map (missing, unexpected, or of another shape than config.json gives) are refused in one line."""
    swapped = config.norm_type != CHECKPOINT_NORM
    # Layers the weights lack are refused before the meta model is built: one of num_hidden_layers=10**9 took
    # hours to build (its modules, one by one), only to name a billion layers' keys missing.
    held = layers_held(state)
    if config.num_hidden_layers > held:
        raise NotImportable(f"cannot import {source}: its config.json gives num_hidden_layers="
                            f"{config.num_hidden_layers}, but its weights hold {held} layers")
    # The shapes come from a model on the meta device: a config.json that asks for more memory than there is
    # (vocab_size=10**12) is refused by the comparison below, not by the allocator.
    with torch.device("meta"):
        model = MiniNormForCausalLM(config)
    expected = {key: tensor.shape for key, tensor in model.state_dict().items()}
    missing = [key for key in expected.keys() - state.keys() if not (swapped and key.endswith((".bias", ".alpha")))]
    unexpected = state.keys() - expected.keys()
    shapes = [f"{key} ({list(state[key].shape)}, config.json gives {list(expected[key])})"
              for key in expected.keys() & state.keys() if state[key].shape != expected[key]]
    problems = [f"{what} {few(keys, shown)}" for what, keys, shown in (
        ("missing", missing, 3), ("unexpected", unexpected, 3), ("of another shape", shapes, 1)) if keys]
    if problems:
        raise NotImportable(f"cannot import {source}: its weights do not match its config.json"
                            f"{'' if not swapped else f' with norm_type={config.norm_type!r}'}: {'; '.join(problems)}")
    if swapped:  # the norms' new parameters start at their initial values, so this model is built for real
        model = MiniNormForCausalLM(config)
    # Unswapped, every tensor comes from the checkpoint and is assigned to the meta model: no initialisation to pay.
    model.load_state_dict(state, strict=not swapped, assign=not swapped)
    model.tie_weights()
    return model.eval()
