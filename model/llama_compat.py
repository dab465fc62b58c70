"""Mapping between MiniNorm and transformers' LLaMA, Qwen3 and Qwen3-MoE: the configs, the state-dict keys, and
the compatibility checks.

A MiniNorm model with `norm_type="rmsnorm"`, `norm_placement="pre"`, `norm_affine=True` and
`norm_depth_scaling=False` is a LLaMA when `qk_norm=False`, and a Qwen3 when `qk_norm=True` with
`qk_norm_scope="head"`: the same GQA attention with rotate-half RoPE, SwiGLU MLP, RMSNorm computed in fp32
(Qwen3 adds one over each head's queries and keys, before RoPE), final norm and LM head. Only two key names
differ (`attn_norm` / `mlp_norm` are their `input_layernorm` / `post_attention_layernorm`). The tests use this
mapping as an independent reference; the export tool uses it to write plain LLaMA / Qwen3 checkpoints, and
model/interop.py to import them. A mixture-of-experts model (num_experts > 0) with Qwen3's switches is a Qwen3-MoE
whose every block is sparse: the router keeps its name (`mlp.gate`), the experts are stacked into transformers'
two 3-D tensors per block (to_qwen3_moe_state_dict).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

from dataset.atomic_io import first_line
from model.config import MiniNormConfig, NormPlacement, NormType, QKNormScope

# Our key suffix -> LLaMA's. Everything else has the same name in both models.
_KEY_RENAMES = {
    ".attn_norm.weight": ".input_layernorm.weight",
    ".mlp_norm.weight": ".post_attention_layernorm.weight",
}


@dataclass(frozen=True)
class AtLeast:
    """A requirement met by any value >= minimum (Qwen3-MoE's expert count)."""

    minimum: int


# Where a model's smeared keys came from, and how to train one that exports.
SMEARED_KEYS_HINT = ("; smeared keys come from pretraining with --smeared_keys true (the base of the chat model that "
                     "uses its tools) or from the default SFT: a plain pretraining, then train_full_sft.py "
                     "--smeared_keys false, keeps a model exportable")
# What each architecture needs of the switches that change the computation: (field, required value or
# AtLeast(minimum), why the target needs it). The refusal names the first switch that differs, then why.
_REQUIREMENTS: dict[str, tuple[tuple[str, object, str], ...]] = {
    "llama": (
        ("num_experts", 0, "LLaMA's MLP is dense, not a mixture of experts"),
        ("norm_type", NormType.RMSNORM.value, "LLaMA normalizes with RMSNorm"),
        ("norm_placement", NormPlacement.PRE.value, "LLaMA is pre-LN: x + f(RMSNorm(x)) with a final norm"),
        ("qk_norm", False, "LLaMA has no norm on queries and keys; --target qwen3 exports per-head QK-norm"),
        ("norm_affine", True, "LLaMA's RMSNorm has a learned gain"),
        ("norm_depth_scaling", False, "LLaMA does not scale its norms' outputs by depth"),
        ("smeared_keys", False, f"LLaMA's attention keys are each position's own: it cannot mix in the "
                                f"previous position's{SMEARED_KEYS_HINT}"),
    ),
    "qwen3": (
        ("num_experts", 0, "Qwen3's MLP is dense; --target qwen3_moe exports a mixture of experts"),
        ("norm_type", NormType.RMSNORM.value, "Qwen3 normalizes with RMSNorm"),
        ("norm_placement", NormPlacement.PRE.value, "Qwen3 is pre-LN: x + f(RMSNorm(x)) with a final norm"),
        ("qk_norm", True, "Qwen3 normalizes each head's queries and keys; --target llama exports a model without"),
        ("qk_norm_scope", QKNormScope.HEAD.value, "Qwen3's QK-norm is one RMSNorm over each head's head_dim"),
        ("norm_affine", True, "Qwen3's RMSNorm has a learned gain"),
        ("norm_depth_scaling", False, "Qwen3 does not scale its norms' outputs by depth"),
        ("smeared_keys", False, f"Qwen3's attention keys are each position's own: it cannot mix in the "
                                f"previous position's{SMEARED_KEYS_HINT}"),
    ),
    # Every MiniNorm MoE block is sparse: Qwen3-MoE's decoder_sparse_step=1 with no mlp_only_layers says so, and
    # it has no other shape switch MiniNorm lacks. The router z-loss is a training loss only; it is not exported.
    "qwen3_moe": (
        ("num_experts", AtLeast(1), "Qwen3-MoE's MLPs are mixtures of experts; --target qwen3 exports a dense model"),
        ("norm_type", NormType.RMSNORM.value, "Qwen3-MoE normalizes with RMSNorm"),
        ("norm_placement", NormPlacement.PRE.value, "Qwen3-MoE is pre-LN: x + f(RMSNorm(x)) with a final norm"),
        ("qk_norm", True, "Qwen3-MoE normalizes each head's queries and keys; no target exports experts without"),
        ("qk_norm_scope", QKNormScope.HEAD.value, "Qwen3-MoE's QK-norm is one RMSNorm over each head's head_dim"),
        ("norm_affine", True, "Qwen3-MoE's RMSNorm has a learned gain"),
        ("norm_depth_scaling", False, "Qwen3-MoE does not scale its norms' outputs by depth"),
        ("smeared_keys", False, f"Qwen3-MoE's attention keys are each position's own: it cannot mix in the "
                                f"previous position's{SMEARED_KEYS_HINT}"),
    ),
}
# The architectures' display names, for messages.
ARCHITECTURES = {"llama": "LLaMA", "qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE"}


class NotExportable(ValueError):
    """The model's config uses a switch that the target architecture cannot express."""


def _first_mismatch(config: MiniNormConfig, architecture: str) -> tuple[str, str] | None:
    """(message, why) for the first switch that `architecture` cannot express; None when it can express all."""
    name = ARCHITECTURES[architecture]
    for field, required, why in _REQUIREMENTS[architecture]:
        if field == "qk_norm_scope" and not config.qk_norm:
            continue  # read only with QK-norm on
        value = getattr(config, field)
        if isinstance(required, AtLeast):
            if value < required.minimum:
                return f"{field}={value!r} is not {name}-compatible; {name} needs {field} >= {required.minimum}", why
        elif value != required:
            return f"{field}={value!r} is not {name}-compatible; {name} needs {field}={required!r}", why
    return None


def check_compatible(config: MiniNormConfig, architecture: str = "llama") -> None:
    """Raise ValueError naming the first switch that makes `config` something `architecture` (a key of
    ARCHITECTURES) cannot express.

    `norm_impl` (how the norm is computed), `dropout` (training only) and `init_depth_scaling` (the initial weights
    only) do not matter for the architecture; `prms_p`, `dyt_alpha_init` and `mix_ln_ratio` are read only by
    switches refused here.
    """
    mismatch = _first_mismatch(config, architecture)
    if mismatch is not None:
        raise ValueError(mismatch[0])


def check_exportable(config: MiniNormConfig, model_path: Path, target: str, architecture: str = "llama") -> None:
    """The exporters' one-line refusal: NotExportable naming the model, the `target` format, the switch and
    why `architecture` (and so every client of that format) cannot express it."""
    mismatch = _first_mismatch(config, architecture)
    if mismatch is not None:
        message, why = mismatch
        raise NotExportable(f"cannot convert {model_path} to {target}: {message} ({why})")
    # transformers' config classes validate shapes MiniNorm allows: LlamaConfig wants hidden_size to be a multiple of
    # num_attention_heads even with a head_dim of its own (a StrictDataclassError traceback after the weights loaded)
    try:
        to_target_config(config, architecture)
    except StrictDataclassError as error:
        name = ARCHITECTURES[architecture]
        raise NotExportable(f"cannot convert {model_path} to {target}: transformers' {name} config refuses its shape "
                            f"({first_line(error.__cause__ or error)})") from None


def rope_parameters(config: MiniNormConfig) -> dict:
    """transformers' rope_parameters for the config: rope_theta, the RoPE type and its scaling keys."""
    return {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}


def _shared_fields(config: MiniNormConfig) -> dict:
    """The fields LlamaConfig and Qwen3Config name alike."""
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=rope_parameters(config),
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
        attention_bias=False,
        # Our dropout also acts on the residual branches, which neither has a switch for; export is for inference.
        attention_dropout=0.0,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )


def to_llama_config(config: MiniNormConfig) -> LlamaConfig:
    """The LlamaConfig of the same shape (raises ValueError when the config is not LLaMA-compatible)."""
    check_compatible(config, "llama")
    return LlamaConfig(**_shared_fields(config), mlp_bias=False)


def to_qwen3_config(config: MiniNormConfig) -> Qwen3Config:
    """The Qwen3Config of the same shape (raises ValueError when the config is not Qwen3-compatible)."""
    check_compatible(config, "qwen3")
    return Qwen3Config(**_shared_fields(config), use_sliding_window=False)


def to_qwen3_moe_config(config: MiniNormConfig) -> Qwen3MoeConfig:
    """The Qwen3MoeConfig of the same shape, every block sparse (raises ValueError when the config is not
    Qwen3-MoE-compatible)."""
    check_compatible(config, "qwen3_moe")
    return Qwen3MoeConfig(
        **_shared_fields(config), use_sliding_window=False, decoder_sparse_step=1, mlp_only_layers=[],
        num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
        router_aux_loss_coef=config.router_aux_loss_coef)


def to_target_config(config: MiniNormConfig, architecture: str) -> LlamaConfig | Qwen3Config | Qwen3MoeConfig:
    """to_llama_config, to_qwen3_config or to_qwen3_moe_config, by the ARCHITECTURES key."""
    return {"llama": to_llama_config, "qwen3": to_qwen3_config, "qwen3_moe": to_qwen3_moe_config}[architecture](
        config)


def to_llama_key(key: str) -> str:
    """One MiniNorm state-dict key as LLaMA names it."""
    for ours, theirs in _KEY_RENAMES.items():
        if key.endswith(ours):
            return key[: -len(ours)] + theirs
    return key


def to_llama_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors (not copies) under LLaMA's key names."""
    return {to_llama_key(key): tensor for key, tensor in state_dict.items()}


def stacked_experts(state_dict: Mapping[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """The state dict with each block's experts stacked per projection, as llama.cpp's ffn_*_exps tensors hold
    them: `model.layers.{i}.mlp.experts.{gate,up}_proj.weight` (experts, width, hidden) and `...down_proj.weight`
    (experts, hidden, width), expert e at index e. The other keys (all of a dense model's) keep their names and
    tensors."""
    state = {key: tensor for key, tensor in state_dict.items() if ".mlp.experts." not in key}
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        count = sum(1 for key in state_dict if key.startswith(prefix) and key.endswith(".gate_proj.weight"))
        if not count:  # a dense block
            continue
        for proj in ("gate_proj", "up_proj", "down_proj"):
            state[f"{prefix}{proj}.weight"] = torch.stack([state_dict[f"{prefix}{e}.{proj}.weight"]
                                                           for e in range(count)])
    return state


def to_qwen3_moe_state_dict(state_dict: Mapping[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """The weights under transformers' Qwen3-MoE names: LLaMA's renames, and each block's experts in its two 3-D
    tensors, `mlp.experts.gate_up_proj` (experts, 2 x width, hidden: each expert's gate rows, then its up rows)
    and `mlp.experts.down_proj` (experts, hidden, width). The stacked tensors are new; the rest are ours."""
    state = stacked_experts(to_llama_state_dict(state_dict), num_layers)
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        gate, up = state.pop(prefix + "gate_proj.weight"), state.pop(prefix + "up_proj.weight")
        state[prefix + "gate_up_proj"] = torch.cat((gate, up), dim=1)
        state[prefix + "down_proj"] = state.pop(prefix + "down_proj.weight")
    return state


def to_target_state_dict(state_dict: Mapping[str, torch.Tensor], config: MiniNormConfig
                         ) -> dict[str, torch.Tensor]:
    """The weights as the transformers class of the config's architecture names them: to_qwen3_moe_state_dict
    for a mixture of experts, to_llama_state_dict (LLaMA and Qwen3 alike) otherwise."""
    if config.is_moe:
        return to_qwen3_moe_state_dict(state_dict, config.num_hidden_layers)
    return to_llama_state_dict(state_dict)


def from_llama_key(key: str) -> str:
    """One LLaMA / Qwen3 state-dict key as MiniNorm names it (the inverse of to_llama_key)."""
    for ours, theirs in _KEY_RENAMES.items():
        if key.endswith(theirs):
            return key[: -len(theirs)] + ours
    return key
