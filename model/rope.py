"""RoPE's inverse frequencies, plain or with a context-extending `rope_scaling` exactly as transformers defines it.

`rope_scaling` is None (plain RoPE) or a dict with a `rope_type`:

    linear   {"factor": s}: every frequency divided by s (position interpolation, Chen et al. 2023).
    dynamic  {"factor": s}: NTK-aware; while a sequence fits max_position_embeddings (L) the frequencies are plain,
             beyond that the base becomes theta * (s * T / L - (s - 1)) ** (d / (d - 2)) for the sequence's length T.
    yarn     {"factor": s, "original_max_position_embeddings": L0, optional "beta_fast" (32), "beta_slow" (1),
             "attention_factor", "mscale", "mscale_all_dim", "truncate" (true)}: YaRN (Peng et al. 2023). Frequency
             i keeps its value where its wavelength makes more than beta_fast turns over L0, is divided by s where it
             makes fewer than beta_slow, and is blended linearly in between; cos and sin are multiplied by the
             attention factor, by default 0.1 ln(s) + 1.

The arithmetic follows transformers' modeling_rope_utils step for step (the same fp32 tensors where it uses them),
so the logits equal LlamaForCausalLM's with the same rope_parameters (tests/unit/test_rope_scaling.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping

import torch

from dataset.shown_value import flag_refusal, shown_value

ROPE_TYPES = ("linear", "dynamic", "yarn")
# The largest factor a context extension takes (the tools' --rope_scaling_factor, long_context.py's --scalings):
# published ones stay below it (Llama 3.1: 8, YaRN: up to 32, LongRoPE: 512), and a larger factor is a typo (1e30
# scored rows from a model whose RoPE reads every position as the same, with max_position_embeddings past 10^32).
MAX_FACTOR = 1024
# The keys each type reads besides rope_type; anything else is refused, naming it.
ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate"),
}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_rope_scaling(value: Any, max_position_embeddings: int, head_dim: int | None = None
                       ) -> dict[str, Any] | None:
    """The validated rope_scaling (None, or a new dict with yarn's original_max_position_embeddings filled in as
    transformers does); ValueError naming the key and the allowed values otherwise. `head_dim`, when given, is
    checked against what the type computes (dynamic's exponent d / (d - 2) needs d > 2)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"rope_scaling={shown_value(value)} is not allowed; "
                         f"it must be null or a dict with a rope_type")
    scaling = dict(value)
    if "type" in scaling and "rope_type" not in scaling:  # the older spelling transformers also reads
        scaling["rope_type"] = scaling.pop("type")
    rope_type = scaling.pop("rope_type", None)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling rope_type={shown_value(rope_type)} is not allowed; choose one of "
                         f"{', '.join(map(repr, ROPE_TYPES))}")
    unknown = sorted(set(scaling) - set(ROPE_KEYS[rope_type]))
    if unknown:
        raise ValueError(f"rope_scaling {unknown[0]}={shown_value(scaling[unknown[0]])} is not allowed with rope_type="
                         f"{rope_type!r}; its keys are {', '.join(ROPE_KEYS[rope_type])}")
    if not (_is_number(scaling.get("factor")) and scaling["factor"] >= 1):
        raise ValueError(f"rope_scaling factor={shown_value(scaling.get('factor'))} is not allowed; "
                         f"it must be a number >= 1")
    if rope_type == "dynamic" and head_dim == 2:
        raise ValueError("rope_scaling rope_type='dynamic' is not allowed with head_dim=2 (the config's, by "
                         "default hidden_size / num_attention_heads): its base grows with the exponent head_dim / "
                         "(head_dim - 2); choose 'linear' or 'yarn', or heads of at least 4 dimensions")
    if rope_type == "yarn":
        scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
        original = scaling["original_max_position_embeddings"]
        if not (isinstance(original, int) and not isinstance(original, bool) and original >= 1):
            raise ValueError(f"rope_scaling original_max_position_embeddings={shown_value(original)} is not allowed; "
                             "it must be a positive integer")
        for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            if scaling.get(key) is not None and not _is_number(scaling[key]):
                raise ValueError(f"rope_scaling {key}={shown_value(scaling[key])} is not allowed; it must be a number")
        if not isinstance(scaling.get("truncate", True), bool):
            raise ValueError(f"rope_scaling truncate={shown_value(scaling['truncate'])} is not allowed; "
                             f"it must be true or false")
    return {"rope_type": rope_type, **scaling}


# The largest rope_theta: RoPE's powers theta^(2i/d) are computed in fp32 (as transformers computes them), where a
# larger base is inf and every frequency but the first 1 / inf = 0: no rotation, the positions silently unread.
FP32_MAX = float(torch.finfo(torch.float32).max)


# Cached: every MiniNormConfig checks its theta, and a run builds its config several times (the flags' check, the
# largest tensor's, the model's). A refusal raises, which is not cached.
@functools.lru_cache(maxsize=64)
def check_rope_theta(theta: float, head_dim: int, max_position_embeddings: int) -> None:
    """Refuse (ValueError, one line) a finite rope_theta > 0 whose fp32 RoPE is no RoPE: past FP32_MAX (fp32 makes
    it inf, its frequencies 0), or so small that the angle position x frequency of some position the model takes
    is not finite in fp32 (1e-300 is 0 there: inf frequencies, NaN angles, a NaN model)."""
    if theta > FP32_MAX:
        raise ValueError(f"rope_theta={shown_value(theta)} is not allowed; it must be at most {FP32_MAX!r} (RoPE's "
                         f"frequencies are computed in fp32, where a larger base is inf and every frequency but the "
                         f"first 0: no rotation)")
    # theta^(-2i/d) is monotone in i, so the largest frequency is the first (theta >= 1: 1) or the last (theta < 1),
    # and only those two are computed, as inverse_frequencies computes every one (fp32; on the CPU, whatever the
    # default device: a config built under torch.device("meta") would make them meta). All head_dim / 2 of them
    # took seconds at a head_dim of 2**28 (a --hidden_size of 2**30, which the memory check then refuses).
    ends = torch.tensor([0, 2 * ((head_dim - 1) // 2)], dtype=torch.int64, device=torch.device("cpu"))
    frequencies = 1.0 / _powers(head_dim, theta, None, ends)
    if not torch.isfinite(frequencies * float(max_position_embeddings - 1)).all() or not frequencies.isfinite().all():
        raise ValueError(f"rope_theta={shown_value(theta)} is not allowed; RoPE's fp32 angles (position x "
                         f"theta^(-2i/{head_dim})) are not finite with it by position {max_position_embeddings - 1}: "
                         f"give a larger rope_theta")


def yarn_attention_factor(scaling: Mapping[str, Any]) -> float:
    """The factor YaRN multiplies cos and sin by: attention_factor when given, else 0.1 ln(s) + 1 (or the ratio of
    that with mscale to that with mscale_all_dim, when both are given)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def magnitude(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return magnitude(factor, scaling["mscale"]) / magnitude(factor, scaling["mscale_all_dim"])
    return magnitude(factor)


def _powers(head_dim: int, base: float | torch.Tensor, device: torch.device | None,
            dimensions: torch.Tensor | None = None) -> torch.Tensor:
    """theta^(2i/d) for i < d/2, in fp32 (base may be an fp32 tensor, as dynamic scaling makes it); `dimensions`
    (int64, some of 0, 2, ... d - 2): those powers only."""
    if dimensions is None:
        dimensions = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device)
    return base ** (dimensions.float() / head_dim)


def _yarn(head_dim: int, theta: float, scaling: Mapping[str, Any], device: torch.device | None) -> torch.Tensor:
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension_of(turns: float) -> float:
        """The (fractional) frequency index whose wavelength fits `turns` times into the original length."""
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    powers = _powers(head_dim, theta, device)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    keep = 1 - ramp  # 1: the frequency is kept (extrapolated), 0: divided by the factor (interpolated)
    return 1.0 / (factor * powers) * (1 - keep) + 1.0 / powers * keep


def inverse_frequencies(head_dim: int, theta: float, scaling: Mapping[str, Any] | None, max_position_embeddings: int,
                        seq_len: torch.Tensor | None = None, device: torch.device | None = None
                        ) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim/2,) in fp32, the factor cos and sin are multiplied by). `seq_len`, the
    longest position + 1 of the batch, matters only for dynamic scaling."""
    rope_type = scaling["rope_type"] if scaling else None
    if rope_type == "linear":
        return 1.0 / _powers(head_dim, theta, device) / scaling["factor"], 1.0
    if rope_type == "dynamic" and seq_len is not None and int(seq_len) > max_position_embeddings:
        grown = scaling["factor"] * seq_len / max_position_embeddings - (scaling["factor"] - 1)
        return 1.0 / _powers(head_dim, theta * grown ** (head_dim / (head_dim - 2)), device), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling, device), yarn_attention_factor(scaling)
    return 1.0 / _powers(head_dim, theta, device), 1.0


def check_scaling_factor(factor: Any, flag: str | None = "rope_scaling_factor") -> float:
    """`factor` if it is a number in (1, MAX_FACTOR], the range of the tools' --rope_scaling_factor, which needs no
    model to check (the tools' flag type checks it before the model loads; extend_context again); ValueError,
    flag_refusal's line (`flag` None: an argparse type's), otherwise."""
    if not (_is_number(factor) and 1 < factor <= MAX_FACTOR):  # NaN fails both comparisons
        raise ValueError(flag_refusal(flag, factor, f"it must be a number in (1, {MAX_FACTOR}]"))
    return factor


def extend_context(model: Any, factor: float | None, trained_length: int | None = None) -> str | None:
    """YaRN at inference, as the tools' --rope_scaling_factor asks: a MiniNorm model without rope_scaling gets
    {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": L} and max_position_embeddings
    factor x L (never fewer than it had), in its config and its RotaryEmbedding. L is `trained_length`, the
    positions the model trained on (a run's --max_seq_len: YaRN extends what the model attended over, and the CPU
    presets train rows of 256 of their 512 positions), else its max_position_embeddings. None changes nothing;
    ValueError names what is refused. Returns what it did, in words (None: nothing)."""
    if factor is None:
        return None
    config = model.config
    check_scaling_factor(factor)
    if getattr(config, "model_type", None) != "mininorm":
        raise ValueError(f"--rope_scaling_factor works on MiniNorm models, not model_type="
                         f"{shown_value(getattr(config, 'model_type', None))}; set rope_parameters in its "
                         f"config.json instead")
    if config.rope_scaling is not None:
        has = config.rope_scaling
        raise ValueError(f"--rope_scaling_factor is not allowed: the model already has rope_scaling (rope_type "
                         f"{shown_value(has.get('rope_type'))}, factor {shown_value(has.get('factor'))}); it "
                         f"extends only a model without one")
    positions = config.max_position_embeddings
    original = min(trained_length, positions) if trained_length else positions
    scaling = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original}
    set_rope_scaling(model, scaling, max(int(original * factor), positions))
    trained = "trained" if trained_length else "model's"
    return (f"YaRN x{factor:g} over the {original:,} {trained} positions: a context of "
            f"{config.max_position_embeddings:,} positions")


def set_rope_scaling(model: Any, scaling: Mapping[str, Any] | None, max_position_embeddings: int) -> None:
    """Give a loaded MiniNorm model another rope_scaling (validated; None: plain RoPE) and max_position_embeddings,
    in its config and its RotaryEmbedding alike (the frequencies are recomputed at every forward)."""
    checked = check_rope_scaling(scaling, max_position_embeddings, model.config.head_dim)
    model.config.rope_scaling, model.config.max_position_embeddings = checked, max_position_embeddings
    rotary = model.model.rotary
    rotary.rope_scaling, rotary.max_position_embeddings = checked, max_position_embeddings
