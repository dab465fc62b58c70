"""MiniNormConfig: the model's shape and its normalization switches, saved with every checkpoint."""

from __future__ import annotations

import math
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple

from transformers import AutoConfig, PretrainedConfig

from model.rmsnorm_math import check_p, floor_fraction
from model.rope import check_rope_scaling, check_rope_theta
from dataset.shown_value import shown_value


class NormType(StrEnum):
    RMSNORM = "rmsnorm"
    PRMSNORM = "prmsnorm"
    LAYERNORM = "layernorm"
    DYT = "dyt"
    NONE = "none"


class NormPlacement(StrEnum):
    PRE = "pre"
    POST = "post"
    SANDWICH = "sandwich"
    RES_POST = "res_post"
    DEEPNORM = "deepnorm"
    MIX = "mix"


# The names the papers use for two placements: accepted as input, stored as the placement's own value.
PLACEMENT_ALIASES: MappingProxyType[str, NormPlacement] = MappingProxyType({
    "peri": NormPlacement.SANDWICH,      # Peri-LN (Kim et al., ICML 2025)
    "reordered": NormPlacement.RES_POST,  # OLMo-2's reordered norm
})
# The paper or model each placement is known by, for --help and the validation message.
PLACEMENT_NAMES: MappingProxyType[NormPlacement, str] = MappingProxyType({
    NormPlacement.SANDWICH: "Peri-LN",
    NormPlacement.RES_POST: "OLMo-2 reordered norm",
    NormPlacement.DEEPNORM: "DeepNet",
    NormPlacement.MIX: "Mix-LN",
})


class QKNormScope(StrEnum):
    HEAD = "head"  # one norm over each head's head_dim features (Gemma-3, Qwen-3)
    FULL = "full"  # one norm over all query heads together, one over all key heads (OLMo-2)


def placement_choices() -> str:
    """The allowed norm_placement values with their paper names and aliases, for messages and --help."""
    aliases = {target: alias for alias, target in PLACEMENT_ALIASES.items()}
    parts = []
    for placement in NormPlacement:
        notes = [PLACEMENT_NAMES[placement]] if placement in PLACEMENT_NAMES else []
        if placement in aliases:
            notes.append(f"alias {aliases[placement]!r}")
        parts.append(repr(placement.value) + (f" ({'; '.join(notes)})" if notes else ""))
    return ", ".join(parts)


def deepnorm_alpha(num_layers: int) -> float:
    """DeepNorm's residual weight for a decoder-only model of L blocks: (2L)^(1/4) (Wang et al. 2022)."""
    return (2 * num_layers) ** 0.25


def deepnorm_beta(num_layers: int) -> float:
    """DeepNorm's init gain of the value, output and MLP projections for L decoder blocks: (8L)^(-1/4)."""
    return (8 * num_layers) ** -0.25


class NormImpl(StrEnum):
    AUTO = "auto"
    EAGER = "eager"
    COMPILE = "compile"
    TRITON = "triton"


def _swiglu_hidden(hidden_size: int) -> int:
    """SwiGLU width: 8/3 of hidden (same parameter count as a 4x GELU MLP), rounded up to a multiple of 64."""
    return 64 * math.ceil(hidden_size * 8 / 3 / 64)


# Named shapes. "cpu-default" (the first default) fits a pretraining run in 10 minutes on 2 CPU cores; "cpu-deep"
# and "cpu-wide" have about its parameter count (4.4M and 4.3M against 4.5M) at twice and half its depth, for
# recipe searches of depth against width: "cpu-wide" won and is the pretraining default (trainer/arg_fields.py,
# docs/recipe.md); the minimind-* presets match MiniMind's published sizes.
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
    # cpu-wide's shape with its MLP split into 4 experts of the same width, one per token (top-1): the same active
    # parameters per token as cpu-wide, four times the MLP parameters (docs/architecture.md, Mixture of experts).
    "cpu-moe": MappingProxyType(dict(
        hidden_size=320, num_hidden_layers=2, num_attention_heads=10, num_key_value_heads=2,
        max_position_embeddings=512, num_experts=4, num_experts_per_tok=1)),
    # MiniMind-3's MoE model (198M parameters, 64M active): minimind-3's shape, per-head QK-norm, its MLP width
    # ceil(768 pi / 64) * 64 = 2432 as each of 4 experts, top-1 (docs/architecture.md, "The minimind-* presets").
    "minimind-3-moe": MappingProxyType(dict(
        hidden_size=768, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=32768, rope_theta=1e6, qk_norm=True, intermediate_size=2432,
        num_experts=4, num_experts_per_tok=1, moe_intermediate_size=2432, norm_topk_prob=True,
        router_aux_loss_coef=5e-4)),
})


def _check_choice(field: str, value: Any, enum: type[StrEnum]) -> StrEnum:
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in enum)
        raise ValueError(f"{field}={shown_value(value)} is not allowed; choose one of {allowed}") from None


def _check_placement(value: Any) -> NormPlacement:
    if isinstance(value, str) and value in PLACEMENT_ALIASES:
        return PLACEMENT_ALIASES[value]
    try:
        return NormPlacement(value)
    except ValueError:
        raise ValueError(f"norm_placement={shown_value(value)} is not allowed; choose one of "
                         f"{placement_choices()}") from None


# The largest size a field takes (each width, count and length): no model with a dimension past it fits any
# machine's memory, and past 2**63 torch's size arguments overflowed (a TypeError or OverflowError traceback once
# the model was built, where a flag had taken 10**30).
MAX_SIZE = 2 ** 31 - 1
# norm_eps's largest value: the norms add it to the mean square of activations of order 1 (x / sqrt(mean(x^2) + eps)),
# where a floor of 1 already outweighs them; 1e39 passed as "finite" and is inf in float32, which made every norm's
# output 0 and the model dead (it trained on to ppl = vocab size). Real models use 1e-5 .. 1e-6.
MAX_NORM_EPS = 1.0


def is_number(value: Any) -> bool:
    """A JSON number: an int or a float, not a bool (which Python counts as an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    # bool is an int subclass: `num_hidden_layers: true` in a config.json must not read as 1
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fields(config: "MiniNormConfig") -> None:
    """Refuse, in one line naming the field and the allowed values, a value of the wrong type or range: a string
    "false" is truthy, NaN passes every `not x > 0` guard written the other way round, and a bool passes
    isinstance(v, int)."""
    for field in ("qk_norm", "tie_word_embeddings", "use_cache", "norm_affine", "norm_depth_scaling",
                  "init_depth_scaling", "smeared_keys"):
        if not isinstance(getattr(config, field), bool):
            raise ValueError(f"{field}={shown_value(getattr(config, field))} is not allowed; it must be true or false")
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "max_position_embeddings"):
        value = getattr(config, field)
        if not _is_int(value) or not 1 <= value <= MAX_SIZE:
            raise ValueError(f"{field}={shown_value(value)} is not allowed; it must be a positive integer, at most "
                             f"{MAX_SIZE}")
    if config.max_position_embeddings < 2:  # every tool generates or scores at least a token after another
        raise ValueError(f"max_position_embeddings={config.max_position_embeddings} is not allowed; it must be an "
                         f"integer in [2, {MAX_SIZE}]: a sequence holds a token and the next one it predicts (a chat's "
                         f"prompt and the token generated after it)")
    size = config.intermediate_size
    if size is not None and (not _is_int(size) or not 1 <= size <= MAX_SIZE):
        raise ValueError(f"intermediate_size={shown_value(size)} is not allowed; it must be a positive integer, "
                         f"at most {MAX_SIZE} (or null: the SwiGLU width derived from hidden_size)")
    for field in ("rope_theta", "norm_eps", "initializer_range", "dyt_alpha_init"):
        value = getattr(config, field)
        if not (is_number(value) and 0 < value < math.inf):
            raise ValueError(f"{field}={shown_value(value)} is not allowed; it must be a finite float > 0")
        setattr(config, field, float(value))
    if config.norm_eps > MAX_NORM_EPS:
        raise ValueError(f"norm_eps={shown_value(config.norm_eps)} is not allowed; it must be a float in (0, "
                         f"{MAX_NORM_EPS:g}]: eps is a floor under the mean square of activations of order 1, so past "
                         f"1 it outweighs them and the norm no longer normalizes (past float32's maximum it is inf "
                         f"there, and every norm's output 0)")
    if not (is_number(config.dropout) and 0 <= config.dropout < 1):
        raise ValueError(f"dropout={shown_value(config.dropout)} is not allowed; it must be a float in [0, 1)")
    config.dropout = float(config.dropout)
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, field)
        ids = value if isinstance(value, list) and field == "eos_token_id" else [value]
        if value is not None and not all(_is_int(i) and 0 <= i < config.vocab_size for i in ids):
            also = " (or a list of them)" if field == "eos_token_id" else ""
            raise ValueError(f"{field}={shown_value(value)} is not allowed; it must be null or a token id in "
                             f"[0, vocab_size={config.vocab_size}){also}")


def _check_head_dim(config: "MiniNormConfig") -> None:
    """Validate head_dim and fill its default, hidden_size / num_attention_heads (which the heads must then
    divide). RoPE rotates pairs of features, so a head's width is even."""
    if config.head_dim is None:
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(f"num_attention_heads={config.num_attention_heads} is not allowed; it must divide "
                             f"hidden_size={config.hidden_size} (or set head_dim)")
        if (config.hidden_size // config.num_attention_heads) % 2:
            raise ValueError(f"num_attention_heads={config.num_attention_heads} is not allowed; head_dim = "
                             f"hidden_size / num_attention_heads must be even for RoPE (or set head_dim)")
        config.head_dim = config.hidden_size // config.num_attention_heads
        return
    value = config.head_dim
    if not _is_int(value) or not 2 <= value <= MAX_SIZE or value % 2:
        raise ValueError(f"head_dim={shown_value(value)} is not allowed; it must be a positive even integer, at "
                         f"most {MAX_SIZE}, for RoPE (or null: hidden_size / num_attention_heads)")


def _check_combination(config: "MiniNormConfig") -> None:
    """Refuse, in one line naming both fields, the combinations that have no meaning."""
    if config.norm_type != NormType.NONE:
        return
    if config.norm_placement == NormPlacement.DEEPNORM:
        raise ValueError("norm_placement='deepnorm' is not allowed with norm_type='none': DeepNorm's up-weighted "
                         "residual x = N(alpha * x + f(x)) grows without bound unless N normalizes it")
    if config.norm_depth_scaling:
        raise ValueError("norm_depth_scaling=True is not allowed with norm_type='none': it scales a norm's output "
                         "and there is no norm")
    if not config.norm_affine:
        raise ValueError("norm_affine=False is not allowed with norm_type='none': there is no norm whose gain "
                         "and bias it would remove")


def _check_moe(config: "MiniNormConfig") -> None:
    """Validate the mixture-of-experts fields (and fill moe_intermediate_size's default)."""
    if not _is_int(config.num_experts) or not 0 <= config.num_experts <= MAX_SIZE:
        raise ValueError(f"num_experts={shown_value(config.num_experts)} is not allowed; it must be an integer in 0 .. "
                         f"{MAX_SIZE} (0: the dense MLP)")
    top_k = config.num_experts_per_tok
    if not _is_int(top_k) or top_k < 1 or (config.num_experts and top_k > config.num_experts):
        raise ValueError(f"num_experts_per_tok={shown_value(top_k)} is not allowed; it must be an integer in "
                         f"[1, num_experts={config.num_experts}]")
    if config.moe_intermediate_size is None:
        config.moe_intermediate_size = config.intermediate_size
    width = config.moe_intermediate_size
    if not _is_int(width) or not 1 <= width <= MAX_SIZE:
        raise ValueError(f"moe_intermediate_size={shown_value(width)} is not allowed; it must be a positive "
                         f"integer, at most {MAX_SIZE}")
    if not isinstance(config.norm_topk_prob, bool):
        raise ValueError(f"norm_topk_prob={shown_value(config.norm_topk_prob)} is not allowed; "
                         f"it must be true or false")
    for field in ("router_aux_loss_coef", "router_z_loss_coef"):
        value = getattr(config, field)
        if not (is_number(value) and 0 <= value < math.inf):
            raise ValueError(f"{field}={shown_value(value)} is not allowed; it must be a finite float >= 0")
        setattr(config, field, float(value))


class SwitchedFields(NamedTuple):
    """Config fields the model reads only when a switch turns their feature on: `used_by` names the switch (its
    field, then the values that turn it on), `switches` the fields it reads, `active` whether a config's fields (a
    mapping of every field's value) turn it on."""

    fields: tuple[str, ...]
    used_by: str
    switches: tuple[str, ...]
    active: Callable[[Mapping[str, Any]], bool]


_NORM_WITH_EPS = (NormType.RMSNORM, NormType.PRMSNORM, NormType.LAYERNORM)
# Each field read only under a switch (model/norms.py build_norm, model/model.py): a model built with another value
# of it is the same model. An entry whose switch an earlier entry's fields hold (qk_norm) comes after it.
# norm_impl is not here: it says how a norm computes, not what, and sweeps fix it for the machine across norm types.
SWITCHED_FIELDS: tuple[SwitchedFields, ...] = (
    SwitchedFields(("prms_p",), "norm_type prmsnorm", ("norm_type",),
                   lambda fields: fields["norm_type"] == NormType.PRMSNORM),
    SwitchedFields(("dyt_alpha_init",), "norm_type dyt", ("norm_type",),
                   lambda fields: fields["norm_type"] == NormType.DYT),
    SwitchedFields(("norm_eps",), f"norm_type {', '.join(_NORM_WITH_EPS[:-1])} or {_NORM_WITH_EPS[-1]}",
                   ("norm_type",), lambda fields: fields["norm_type"] in _NORM_WITH_EPS),
    # norm_type none: the QK-norms are identities too, with no weights
    SwitchedFields(("qk_norm",), "a norm_type other than none", ("norm_type",),
                   lambda fields: fields["norm_type"] != NormType.NONE),
    SwitchedFields(("qk_norm_scope",), "qk_norm true", ("qk_norm",), lambda fields: fields["qk_norm"] is True),
    SwitchedFields(("mix_ln_ratio",), "norm_placement mix", ("norm_placement",),
                   lambda fields: fields["norm_placement"] == NormPlacement.MIX),
    # DeepNorm initialises the residual projections with its beta gain in place of the depth scaling
    SwitchedFields(("init_depth_scaling",), "a norm_placement other than deepnorm", ("norm_placement",),
                   lambda fields: fields["norm_placement"] != NormPlacement.DEEPNORM),
    SwitchedFields(("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "router_aux_loss_coef",
                    "router_z_loss_coef"), "num_experts > 0", ("num_experts",),
                   lambda fields: _is_int(fields["num_experts"]) and fields["num_experts"] > 0),
)


class MiniNormConfig(PretrainedConfig):
    """LLaMA-style decoder shape plus the normalization switches (see docs/architecture.md, "The norms, exactly")."""

    model_type = "mininorm"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 6400
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    # Each attention head's width. None: hidden_size / num_attention_heads (every model before the field existed,
    # whose config.json loads as the model it was); a value of its own sizes the projections to heads x head_dim,
    # as transformers' LlamaConfig and Qwen3Config do (Qwen3-0.6B: hidden 1024, 16 heads of 128).
    head_dim: int | None = None
    intermediate_size: int | None = None  # None: the SwiGLU default derived from hidden_size
    max_position_embeddings: int = 512  # at least 2: a token and the next one it predicts
    rope_theta: float = 1e6
    # None: plain RoPE; or {"rope_type": "linear" | "dynamic" | "yarn", "factor": ..., ...} as transformers
    # defines it (model/rope.py), e.g. YaRN to run past the trained length at inference.
    rope_scaling: dict | None = None
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
    norm_eps: float = 1e-6  # in (0, MAX_NORM_EPS = 1]: added to the mean square inside the square root
    norm_impl: str = "auto"
    qk_norm: bool = False
    # The norm laboratory (docs/architecture.md). A checkpoint saved before these existed loads with these
    # defaults, which are the model it was.
    qk_norm_scope: str = "head"
    norm_affine: bool = True
    dyt_alpha_init: float = 0.5
    mix_ln_ratio: float = 0.25
    norm_depth_scaling: bool = False
    init_depth_scaling: bool = True
    # Smeared keys (docs/architecture.md, "Smeared keys"): each attention key mixed with the previous position's,
    # which lets one layer match "the token before this key" -- what copying from the context needs. Not an
    # operation of LLaMA or Qwen3: those exports refuse it.
    smeared_keys: bool = False
    # Mixture of experts (docs/architecture.md, "Mixture of experts"); transformers' Qwen3-MoE names. 0 experts: the
    # dense SwiGLU MLP, and the other MoE fields are not read.
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int | None = None  # None: intermediate_size (top-1 then has the dense model's FLOPs)
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0

    def __post_init__(self, **kwargs: Any) -> None:
        self.norm_type = _check_choice("norm_type", self.norm_type, NormType).value
        self.norm_placement = _check_placement(self.norm_placement).value
        self.norm_impl = _check_choice("norm_impl", self.norm_impl, NormImpl).value
        self.qk_norm_scope = _check_choice("qk_norm_scope", self.qk_norm_scope, QKNormScope).value
        self.prms_p = check_p(self.prms_p, "prms_p")
        _check_fields(self)
        if not (is_number(self.mix_ln_ratio) and 0 <= self.mix_ln_ratio <= 1):
            raise ValueError(f"mix_ln_ratio={shown_value(self.mix_ln_ratio)} is not allowed; "
                             f"it must be a float in [0, 1]")
        self.mix_ln_ratio = float(self.mix_ln_ratio)
        _check_combination(self)
        _check_head_dim(self)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} is not allowed; it must divide "
                             f"num_attention_heads={self.num_attention_heads}")
        check_rope_theta(self.rope_theta, self.head_dim, self.max_position_embeddings)
        self.rope_scaling = check_rope_scaling(self.rope_scaling, self.max_position_embeddings, self.head_dim)
        if self.intermediate_size is None:
            self.intermediate_size = _swiglu_hidden(self.hidden_size)
        _check_moe(self)
        super().__post_init__(**kwargs)

    @property
    def is_moe(self) -> bool:
        """Whether the blocks' MLPs are sparse mixtures of experts."""
        return self.num_experts > 0

    def block_placements(self) -> list[NormPlacement]:
        """Each block's own placement: norm_placement, except for `mix`, whose first floor(mix_ln_ratio * L)
        blocks are post-LN and the rest pre-LN (Mix-LN)."""
        placement = NormPlacement(self.norm_placement)
        layers = self.num_hidden_layers
        if placement != NormPlacement.MIX:
            return [placement] * layers
        post = floor_fraction(layers, self.mix_ln_ratio)
        return [NormPlacement.POST] * post + [NormPlacement.PRE] * (layers - post)

    @property
    def has_final_norm(self) -> bool:
        """A final norm before the LM head exists exactly when the last block leaves an un-normalized stream."""
        return self.block_placements()[-1] not in (NormPlacement.POST, NormPlacement.DEEPNORM)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "MiniNormConfig":
        """Build a config from a named preset; keyword overrides win."""
        if name not in PRESETS:
            raise ValueError(f"preset={shown_value(name)} is not allowed; choose one of "
                             f"{', '.join(map(repr, PRESETS))}")
        return cls(**{**PRESETS[name], **overrides})


def preset_fields(preset: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Every switch's value in a config of `preset` with `overrides` over it, as given (before the config resolves
    them: a placement alias is its placement), for SWITCHED_FIELDS' `active`."""
    fields = {name: getattr(MiniNormConfig, name) for name in {switch for entry in SWITCHED_FIELDS
                                                              for switch in entry.switches}}
    fields.update({**PRESETS.get(preset, {}), **overrides})
    if isinstance(fields["norm_placement"], str) and fields["norm_placement"] in PLACEMENT_ALIASES:
        fields["norm_placement"] = PLACEMENT_ALIASES[fields["norm_placement"]]
    return fields


def field_default(preset: str, overrides: Mapping[str, Any], name: str) -> Any:
    """The value field `name` takes in a config of `preset` with `overrides` over it but `name` left out: the
    preset's or the config's default, resolved as the config resolves it (moe_intermediate_size: intermediate_size's
    value); the default as written where those overrides make no config (a pretraining resume's flags, judged before
    the checkpoint's shape completes them: trainer/arg_checks.py), an unset width resolved all the same
    (_unset_width)."""
    others = {k: v for k, v in overrides.items() if k != name}
    written = PRESETS.get(preset, {}).get(name, getattr(MiniNormConfig, name))
    try:
        return getattr(MiniNormConfig.from_preset(preset, **others), name)
    except (TypeError, ValueError):
        if written is None and name in ("intermediate_size", "moe_intermediate_size"):
            return _unset_width({**PRESETS.get(preset, {}), **others})
        return written


def _unset_width(fields: Mapping[str, Any]) -> int | None:
    """The MLP width a config of `fields` resolves an unset width to, as its __post_init__ does: intermediate_size,
    else hidden_size's SwiGLU width (an expert's unset width is intermediate_size's); None where hidden_size is no
    size."""
    if fields.get("intermediate_size") is not None:
        return fields["intermediate_size"]
    hidden = fields.get("hidden_size", MiniNormConfig.hidden_size)
    return _swiglu_hidden(hidden) if _is_int(hidden) and 1 <= hidden <= MAX_SIZE else None


AutoConfig.register(MiniNormConfig.model_type, MiniNormConfig)
