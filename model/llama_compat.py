"""Mapping between MiniNorm and transformers' LLaMA: the config, the state-dict keys, and the compatibility check.

A MiniNorm model with `norm_type="rmsnorm"`, `norm_placement="pre"`, `qk_norm=False`, `norm_affine=True` and
`norm_depth_scaling=False` is a LLaMA: the same
GQA attention with rotate-half RoPE, SwiGLU MLP, RMSNorm computed in fp32, final norm and LM head. Only two key
names differ (`attn_norm` / `mlp_norm` are LLaMA's `input_layernorm` / `post_attention_layernorm`). The tests
use this mapping as an independent reference; the export tool uses it to write plain LLaMA checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from transformers import LlamaConfig

from model.config import MiniNormConfig, NormPlacement, NormType

# Our key suffix -> LLaMA's. Everything else has the same name in both models.
_KEY_RENAMES = {
    ".attn_norm.weight": ".input_layernorm.weight",
    ".mlp_norm.weight": ".post_attention_layernorm.weight",
}


# Why each switch has no LLaMA equivalent, appended to check_llama_compatible's message by check_exportable.
_WHY = {
    "norm_type": "LLaMA normalizes with RMSNorm",
    "norm_placement": "LLaMA is pre-LN: x + f(RMSNorm(x)) with a final norm",
    "qk_norm": "LLaMA has no norm on queries and keys",
    "norm_affine": "LLaMA's RMSNorm has a learned gain",
    "norm_depth_scaling": "LLaMA does not scale its norms' outputs by depth",
}


class NotLlamaCompatible(ValueError):
    """The model's config uses a switch that LLaMA cannot express."""


def check_llama_compatible(config: MiniNormConfig) -> None:
    """Raise ValueError naming the first switch that makes `config` something LLaMA cannot express.

    `norm_impl` (how the norm is computed), `dropout` (training only) and `init_depth_scaling` (the initial weights
    only) do not matter for the architecture; `prms_p`, `dyt_alpha_init`, `mix_ln_ratio` and `qk_norm_scope` are
    read only by switches refused here.
    """
    if config.norm_type != NormType.RMSNORM:
        raise ValueError(f"norm_type={config.norm_type!r} is not LLaMA-compatible; LLaMA needs norm_type='rmsnorm'")
    if config.norm_placement != NormPlacement.PRE:
        raise ValueError(f"norm_placement={config.norm_placement!r} is not LLaMA-compatible; "
                         "LLaMA needs norm_placement='pre'")
    if config.qk_norm:
        raise ValueError("qk_norm=True is not LLaMA-compatible; LLaMA needs qk_norm=False")
    if not config.norm_affine:
        raise ValueError("norm_affine=False is not LLaMA-compatible; LLaMA needs norm_affine=True")
    if config.norm_depth_scaling:
        raise ValueError("norm_depth_scaling=True is not LLaMA-compatible; LLaMA needs norm_depth_scaling=False")


def check_exportable(config: MiniNormConfig, model_path: Path, target: str) -> None:
    """The exporters' one-line refusal: NotLlamaCompatible naming the model, the `target` format, the switch and
    why LLaMA (and so every LLaMA-format client) cannot express it."""
    try:
        check_llama_compatible(config)
    except ValueError as error:
        message = str(error)
        why = next((reason for switch, reason in _WHY.items() if message.startswith(switch)), None)
        raise NotLlamaCompatible(f"cannot convert {model_path} to {target}: {message}"
                                 + (f" ({why})" if why else "")) from None


def to_llama_config(config: MiniNormConfig) -> LlamaConfig:
    """The LlamaConfig of the same shape (raises ValueError when the config is not LLaMA-compatible)."""
    check_llama_compatible(config)
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
        attention_bias=False,
        mlp_bias=False,
        # Our dropout also acts on the residual branches, which LLaMA has no switch for; export is for inference.
        attention_dropout=0.0,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )


def to_llama_key(key: str) -> str:
    """One MiniNorm state-dict key as LLaMA names it."""
    for ours, theirs in _KEY_RENAMES.items():
        if key.endswith(ours):
            return key[: -len(ours)] + theirs
    return key


def to_llama_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors (not copies) under LLaMA's key names."""
    return {to_llama_key(key): tensor for key, tensor in state_dict.items()}
