"""MiniNormConfig: the model's shape and its normalization switches, saved with every checkpoint."""

from __future__ import annotations

import math
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from model.rmsnorm_math import check_p


class NormType(StrEnum):
    RMSNORM = "rmsnorm"
    PRMSNORM = "prmsnorm"
    LAYERNORM = "layernorm"
    NONE = "none"


class NormPlacement(StrEnum):
    PRE = "pre"
    POST = "post"
    SANDWICH = "sandwich"
    RES_POST = "res_post"


class NormImpl(StrEnum):
    AUTO = "auto"
    EAGER = "eager"
    COMPILE = "compile"
    TRITON = "triton"


def _swiglu_hidden(hidden_size: int) -> int:
    """SwiGLU width: 8/3 of hidden (same parameter count as a 4x GELU MLP), rounded up to a multiple of 64."""
    return 64 * math.ceil(hidden_size * 8 / 3 / 64)


# Named shapes. "cpu-default" fits the default pretraining run in 10 minutes on 2 CPU cores; "cpu-deep" and
# "cpu-wide" have about its parameter count (4.4M and 4.3M against 4.5M) at twice and half its depth, for recipe
# searches of depth against width; the minimind-* presets match MiniMind's published sizes.
PRESETS: MappingProxyType[str, MappingProxyType[str, Any]] = MappingProxyType({
    "cpu-default": MappingProxyType(dict(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=512)),
    "cpu-deep": MappingProxyType(dict(
        hidden_size=192, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
        max_position_embeddings=512)),
    "cpu-wide": MappingProxyType(dict(
        hidden_size=320, num_hidden_layers=2, num_attention_heads=10, num_key_value_heads=2,
        max_position_embeddings=512)),
    "minimind-26m": MappingProxyType(dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=32768)),
    "minimind-64m": MappingProxyType(dict(
        hidden_size=768, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=32768)),
})


def _check_choice(field: str, value: Any, enum: type[StrEnum]) -> StrEnum:
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in enum)
        raise ValueError(f"{field}={value!r} is not allowed; choose one of {allowed}") from None


class MiniNormConfig(PretrainedConfig):
    """LLaMA-style decoder shape plus the normalization switches (see docs/architecture.md, "The norms, exactly")."""

    model_type = "mininorm"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 6400
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    intermediate_size: int | None = None  # None: the SwiGLU default derived from hidden_size
    max_position_embeddings: int = 512
    rope_theta: float = 1e6
    tie_word_embeddings: bool = True
    dropout: float = 0.0
    initializer_range: float = 0.02
    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = 2
    pad_token_id: int | None = 0
    # Normalization switches.
    norm_type: str = "rmsnorm"
    norm_placement: str = "pre"
    prms_p: float = 0.0625
    norm_eps: float = 1e-6
    norm_impl: str = "auto"
    qk_norm: bool = False

    def __post_init__(self, **kwargs: Any) -> None:
        self.norm_type = _check_choice("norm_type", self.norm_type, NormType).value
        self.norm_placement = _check_choice("norm_placement", self.norm_placement, NormPlacement).value
        self.norm_impl = _check_choice("norm_impl", self.norm_impl, NormImpl).value
        self.prms_p = check_p(self.prms_p, "prms_p")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps={self.norm_eps!r} is not allowed; it must be > 0")
        for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field}={value!r} is not allowed; it must be a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not allowed; it must divide "
                             f"hidden_size={self.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} is not allowed; it must divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not allowed; head_dim = "
                             f"hidden_size / num_attention_heads must be even for RoPE")
        if self.intermediate_size is None:
            self.intermediate_size = _swiglu_hidden(self.hidden_size)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} is not allowed; it must be in [0, 1)")
        super().__post_init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "MiniNormConfig":
        """Build a config from a named preset; keyword overrides win."""
        if name not in PRESETS:
            raise ValueError(f"preset={name!r} is not allowed; choose one of {', '.join(map(repr, PRESETS))}")
        return cls(**{**PRESETS[name], **overrides})


AutoConfig.register(MiniNormConfig.model_type, MiniNormConfig)
