"""MiniNormConfig: validation messages, presets and their parameter counts, serialization."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from transformers import AutoConfig

from model.config import PRESETS, MiniNormConfig
from model.model import MiniNormForCausalLM


def param_count(config: MiniNormConfig) -> int:
    """Parameters of the model, tied embedding counted once; built on the meta device (no memory, instant)."""
    with torch.device("meta"):
        model = MiniNormForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("norm_type", "batchnorm", ["'rmsnorm'", "'prmsnorm'", "'layernorm'", "'dyt'", "'none'"]),
    ("norm_type", "RMSNorm", ["'rmsnorm'"]),
    # "peri" and "reordered" are aliases of sandwich and res_post (tests/unit/test_norm_lab.py).
    ("norm_placement", "middle", ["'pre'", "'post'", "'sandwich'", "'res_post'", "'deepnorm'", "'mix'"]),
    ("norm_impl", "cuda", ["'auto'", "'eager'", "'compile'", "'triton'"]),
    ("prms_p", 0, ["(0, 1]"]),
    ("prms_p", -0.1, ["(0, 1]"]),
    ("prms_p", 1.5, ["(0, 1]"]),
    ("prms_p", True, ["(0, 1]"]),  # bool passes isinstance(value, numbers.Real): it read as p = 1
    ("norm_eps", 0.0, ["> 0"]),
    ("dropout", 1.0, ["[0, 1)"]),
    ("hidden_size", 0, ["positive integer"]),
    # Values a config.json can hold that used to be accepted (and gave another model) or failed with a traceback.
    ("rope_theta", float("nan"), ["finite float > 0"]),
    ("rope_theta", 0, ["finite float > 0"]),
    ("rope_theta", -1.0, ["finite float > 0"]),
    # Finite, but not RoPE in fp32: 1e300 is inf there (every frequency but the first 0), 1e-300 is 0 (NaN angles).
    ("rope_theta", 1e300, ["at most 3.4028234663852886e+38", "no rotation"]),
    ("rope_theta", 1e-300, ["angles", "not finite", "by position 511", "larger rope_theta"]),
    ("norm_eps", float("inf"), ["finite float > 0"]),
    ("norm_eps", "1e-6", ["finite float > 0"]),
    ("norm_eps", None, ["finite float > 0"]),
    # Finite, but past float32's maximum: inf there, every norm's output 0 and the model dead (SFT trained on to
    # ppl = vocab size, exit 0; convert_to_gguf an OverflowError traceback). Bounded by 1, with the reason.
    ("norm_eps", 1e39, ["a float in (0, 1]", "no longer normalizes"]),
    ("norm_eps", 1.5, ["a float in (0, 1]"]),
    ("initializer_range", "x", ["finite float > 0"]),
    ("qk_norm", "false", ["true or false"]),  # a string "false" is truthy
    ("tie_word_embeddings", "false", ["true or false"]),
    ("intermediate_size", "128", ["positive integer"]),
    ("intermediate_size", 0, ["positive integer"]),
    ("intermediate_size", -64, ["positive integer"]),
    ("intermediate_size", 128.0, ["positive integer"]),
    ("num_hidden_layers", True, ["positive integer"]),  # bool passes isinstance(value, int)
    ("vocab_size", True, ["positive integer"]),
    ("dropout", "0.1", ["[0, 1)"]),
    ("dropout", None, ["[0, 1)"]),
    # Sizes past 2**31 - 1 (the flags took 10**30): torch.empty's TypeError ("Overflow when unpacking long long") or
    # an OverflowError traceback once the model was built (found by fuzzing the flags).
    *[(field, 10 ** 30, ["positive integer", "at most 2147483647"])
      for field in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "moe_intermediate_size",
                    "max_position_embeddings")],
    ("hidden_size", 2 ** 31, ["positive integer", "at most 2147483647"]),
    # No prompt fits beside a token to generate: eval/chat.py --prompt Hi was a traceback ("the prompt has 2 tokens;
    # it must have 1 to 0")
    ("max_position_embeddings", 1, ["integer in [2, 2147483647]", "the next one it predicts"]),
    ("num_experts", 10 ** 30, ["integer in 0 .. 2147483647"]),
    # head_dim: RoPE rotates pairs, so an even width; null is hidden_size / num_attention_heads
    *[("head_dim", value, ["positive even integer", "at most 2147483647", "or null"])
      for value in (0, -2, 7, 1, 2 ** 31, "64", 64.0, True)],
    ("pad_token_id", "0", ["null or a token id", "[0, vocab_size=6400)"]),
    ("eos_token_id", 6400, ["null or a token id", "[0, vocab_size=6400)"]),
])
def test_invalid_value_names_field_value_and_allowed(field: str, value: object, allowed: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        MiniNormConfig(**{field: value})
    message = str(info.value)
    assert message.startswith(f"{field}={value!r}")  # this field's own check, not a later one that reads it
    for choice in allowed:
        assert choice in message



@pytest.mark.parametrize(("field", "value", "shown", "allowed"), [
    # A tensor's repr is every element over many lines (40 lines for 20 x 20): its type, shape and dtype instead.
    ("hidden_size", torch.ones(20, 20), "<Tensor of shape (20, 20), torch.float32>", "it must be a positive integer"),
    ("norm_placement", torch.ones(30), "<Tensor of shape (30,), torch.float32>", "choose one of 'pre', 'post'"),
    ("prms_p", torch.full((20, 20), 0.5, dtype=torch.float64), "<Tensor of shape (20, 20), torch.float64>",
     "it must be a float in (0, 1]"),
    ("norm_eps", torch.tensor(1e-5), "tensor(1.0000e-05)", "it must be a finite float > 0"),  # 0-d: one line
    # A long repr is cut at 57 characters and "..." (60 in all).
    ("rope_scaling", list(range(40)), "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16...",
     "it must be null or a dict with a rope_type"),
    ("norm_type", "x" * 80, "'" + "x" * 56 + "...", "choose one of 'rmsnorm'"),
    # A short value holding a tensor: the tensor's repr breaks lines, joined here with one space.
    ("rope_scaling", [torch.ones(3, 2)], "[tensor([[1., 1.], [1., 1.], [1., 1.]])]",
     "it must be null or a dict with a rope_type"),
])
def test_a_refused_value_is_quoted_on_one_short_line(field: str, value: object, shown: str, allowed: str) -> None:
    with pytest.raises(ValueError) as info:
        MiniNormConfig(**{field: value})
    message = str(info.value)
    assert message.startswith(f"{field}={shown} is not allowed; ") and allowed in message
    assert "\n" not in message and len(message) < 250

@pytest.mark.parametrize("field", ["vocab_size", "num_hidden_layers", "intermediate_size", "moe_intermediate_size",
                                   "num_experts", "max_position_embeddings"])
def test_a_size_of_exactly_2_31_minus_1_is_taken(field: str) -> None:
    """MAX_SIZE (2**31 - 1) is the largest size allowed, not the first refused: only sizes past it are (584cdcc)."""
    config = MiniNormConfig(**{field: 2 ** 31 - 1})
    assert getattr(config, field) == 2 ** 31 - 1


def test_heads_must_divide_hidden() -> None:
    with pytest.raises(ValueError, match=re.escape("num_attention_heads=5")) as info:
        MiniNormConfig(hidden_size=64, num_attention_heads=5, num_key_value_heads=1)
    assert "hidden_size=64" in str(info.value)


def test_kv_heads_must_divide_heads() -> None:
    with pytest.raises(ValueError, match=re.escape("num_key_value_heads=3")) as info:
        MiniNormConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=3)
    assert "num_attention_heads=4" in str(info.value)


def test_head_dim_must_be_even_for_rope() -> None:
    with pytest.raises(ValueError, match="even"):
        MiniNormConfig(hidden_size=72, num_attention_heads=8, num_key_value_heads=2)  # head_dim 9


def test_a_head_dim_of_its_own_sizes_the_attention_and_needs_no_divisibility(tmp_path) -> None:
    """head_dim set (Qwen3-0.6B's shape: hidden 1024, 16 heads of 128): the projections are heads x head_dim wide,
    hidden_size need not divide by the heads, and config.json keeps it; unset, it is hidden / heads as before."""
    config = MiniNormConfig(hidden_size=60, num_attention_heads=4, num_key_value_heads=2, head_dim=32, qk_norm=True,
                            qk_norm_scope="full")
    with torch.device("meta"):
        attention = MiniNormForCausalLM(config).model.layers[0].self_attn
    assert attention.q_proj.weight.shape == (4 * 32, 60) and attention.k_proj.weight.shape == (2 * 32, 60)
    assert attention.v_proj.weight.shape == (2 * 32, 60) and attention.o_proj.weight.shape == (60, 4 * 32)
    assert attention.q_norm.weight.shape == (4 * 32,) and attention.k_norm.weight.shape == (2 * 32,)
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["head_dim"] == 32
    assert AutoConfig.from_pretrained(tmp_path).head_dim == 32
    assert MiniNormConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2).head_dim == 16


def test_a_config_json_saved_before_head_dim_existed_loads_as_hidden_over_heads(tmp_path) -> None:
    MiniNormConfig(hidden_size=96, num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    saved.pop("head_dim", None)
    path.write_text(json.dumps(saved))
    assert AutoConfig.from_pretrained(tmp_path).head_dim == 24


def test_valid_values_are_stored_as_plain_strings() -> None:
    config = MiniNormConfig(norm_type="prmsnorm", norm_placement="res_post", norm_impl="eager", prms_p=1,
                            qk_norm=True)
    assert (config.norm_type, config.norm_placement, config.norm_impl) == ("prmsnorm", "res_post", "eager")
    assert type(config.norm_type) is str and config.prms_p == 1.0 and type(config.prms_p) is float
    assert '"norm_placement": "res_post"' in config.to_json_string()


def test_defaults() -> None:
    config = MiniNormConfig()
    assert (config.norm_type, config.norm_placement, config.norm_impl, config.qk_norm) == ("rmsnorm", "pre", "auto",
                                                                                           False)
    assert (config.prms_p, config.norm_eps) == (0.0625, 1e-6)
    assert (config.qk_norm_scope, config.norm_affine, config.dyt_alpha_init, config.mix_ln_ratio,
            config.norm_depth_scaling, config.init_depth_scaling) == ("head", True, 0.5, 0.25, False, True)
    assert config.intermediate_size == 704 and config.head_dim == 32
    assert config.tie_word_embeddings and config.eos_token_id == 2


def test_serialization_round_trip_keeps_every_field(tmp_path) -> None:
    config = MiniNormConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=1, norm_type="layernorm",
                            norm_placement="sandwich", prms_p=0.25, norm_eps=1e-5, norm_impl="eager", qk_norm=True,
                            dropout=0.1, intermediate_size=320)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is MiniNormConfig
    for field in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "norm_type",
                  "norm_placement", "prms_p", "norm_eps", "norm_impl", "qk_norm", "dropout", "rope_theta"):
        assert getattr(loaded, field) == getattr(config, field), field


def test_loading_an_invalid_config_file_fails_loudly(tmp_path) -> None:
    MiniNormConfig().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(path.read_text().replace('"norm_placement": "pre"', '"norm_placement": "middle"'))
    with pytest.raises(ValueError, match="norm_placement='middle'"):
        AutoConfig.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------------------------- presets


def test_cpu_default_preset() -> None:
    config = MiniNormConfig.from_preset("cpu-default")
    count = param_count(config)
    print(f"cpu-default: {count:,} parameters")
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (256, 4, 6400)
    assert 4.3e6 < count < 4.7e6


@pytest.mark.parametrize("preset, layers", [("cpu-deep", 8), ("cpu-wide", 2)])
def test_depth_and_width_presets_match_cpu_default_in_size(preset: str, layers: int) -> None:
    config = MiniNormConfig.from_preset(preset)
    default = MiniNormConfig.from_preset("cpu-default")
    assert config.num_hidden_layers == layers and config.hidden_size // config.num_attention_heads == 32
    assert abs(param_count(config) / param_count(default) - 1) < 0.06


def test_minimind_26m_preset_matches_minimind() -> None:
    config = MiniNormConfig.from_preset("minimind-26m")
    shape = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
             config.vocab_size, config.intermediate_size)
    assert shape == (512, 8, 8, 2, 6400, 1408)
    count = param_count(config)
    print(f"minimind-26m: {count:,} parameters")
    # MiniMind2-Small reports 25.83M (tied embedding counted once).
    assert abs(count - 25.83e6) < 0.05e6


def test_minimind_64m_preset() -> None:
    config = MiniNormConfig.from_preset("minimind-64m")
    shape = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads)
    assert shape == (768, 8, 8, 4)
    count = param_count(config)
    print(f"minimind-64m: {count:,} parameters")
    assert 50e6 < count < 65e6


def test_preset_overrides_win_and_unknown_preset_is_refused() -> None:
    config = MiniNormConfig.from_preset("minimind-26m", norm_type="prmsnorm", num_hidden_layers=2)
    assert (config.hidden_size, config.num_hidden_layers, config.norm_type) == (512, 2, "prmsnorm")
    with pytest.raises(ValueError) as info:
        MiniNormConfig.from_preset("gpt2")
    assert "preset='gpt2'" in str(info.value)
    for name in PRESETS:
        assert repr(name) in str(info.value)


@pytest.mark.parametrize("theta", [10.0, 1e6, 1e30, torch.finfo(torch.float32).max])
def test_a_rope_theta_taken_is_the_one_the_model_rotates_by(theta: float) -> None:
    """Up to the largest fp32 (the dtype RoPE computes its powers in) the model's frequencies are theta^(-2i/d),
    against fp64, and its cos and sin finite at its last position; one float past it is refused: fp32 made it inf
    and every frequency but the first 0 (1e300 was taken so, and trained without positions)."""
    config = MiniNormConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=theta)
    rotary = MiniNormForCausalLM(config).model.rotary
    cos, sin = rotary(torch.tensor([[1, 511]]), torch.float32)
    want = torch.tensor([theta ** (-i / 16) for i in range(0, 16, 2)], dtype=torch.float64)
    assert torch.allclose(sin[0, 0, :8].double(), torch.sin(want), rtol=1e-5, atol=0)  # position 1: sin(frequency)
    assert torch.isfinite(cos).all() and torch.isfinite(sin).all()
    if theta == torch.finfo(torch.float32).max:
        with pytest.raises(ValueError, match=r"^rope_theta=3\.402823466385289e\+38 is not allowed; it must be at most"):
            MiniNormConfig(rope_theta=math.nextafter(theta, math.inf))


def test_a_rope_theta_whose_last_positions_angle_is_not_finite_is_refused_one_position_sooner_taken() -> None:
    """rope_theta 1e-44 (an fp32 subnormal) with head_dim 16: the highest frequency theta^(-14/16) is finite in fp32
    (3.2e38), so only the angle position x frequency tells: at position 1 it is finite and the model's cos and sin
    are too (max_position_embeddings 2, taken); at position 2 it is inf in fp32, cos and sin NaN
    (max_position_embeddings 3, refused, naming that last position)."""
    highest = torch.tensor(1e-44, dtype=torch.float32) ** torch.tensor(-14 / 16, dtype=torch.float32)
    assert torch.isfinite(highest) and not torch.isfinite(highest * 2)  # the fp32 facts the bound rests on
    config = MiniNormConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=1e-44,
                            max_position_embeddings=2)
    cos, sin = MiniNormForCausalLM(config).model.rotary(torch.tensor([[0, 1]]), torch.float32)
    assert torch.isfinite(cos).all() and torch.isfinite(sin).all()
    with pytest.raises(ValueError, match=r"^rope_theta=1e-44 is not allowed; RoPE's fp32 angles .* by position 2: "):
        MiniNormConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=1e-44,
                       max_position_embeddings=3)


@pytest.mark.parametrize("head_dim", [1, 2, 3, 16, 64, 129])
@pytest.mark.parametrize("positions", [2, 3, 512, 2 ** 31])
def test_the_rope_theta_check_refuses_where_some_fp32_frequency_or_angle_is_not_finite(head_dim: int,
                                                                                       positions: int) -> None:
    """check_rope_theta computes only the first and last frequencies (the largest is one of them); it refuses
    exactly where every frequency, computed as the model does, has one that is not finite or whose angle at the last
    position is not: thetas across fp32's subnormals, its normals and up to its largest."""
    from model.rope import check_rope_theta, inverse_frequencies

    for theta in (1e-300, 1e-46, 1e-45, 3e-45, 1e-44, 1e-40, 1e-38, 1e-30, 1e-9, 0.5, 1.0, 1e4, 1e30,
                  float(torch.finfo(torch.float32).max)):
        frequencies, _ = inverse_frequencies(head_dim, theta, None, positions)
        finite = bool(frequencies.isfinite().all() and (frequencies * float(positions - 1)).isfinite().all())
        try:
            check_rope_theta(theta, head_dim, positions)
            taken = True
        except ValueError:
            taken = False
        assert taken == finite, (theta, head_dim, positions)


def test_the_rope_theta_check_of_a_huge_head_computes_no_frequency_per_dimension() -> None:
    """A head of 2**40 dimensions (a --hidden_size past any memory) is checked from two frequencies: the check
    built all 2**39 first (seconds at 2**28, before the memory check refused the model; an allocation error here)."""
    from model.rope import check_rope_theta

    check_rope_theta(1e4, 2 ** 40, 512)
    with pytest.raises(ValueError, match=r"^rope_theta=1e-300 is not allowed; RoPE's fp32 angles"):
        check_rope_theta(1e-300, 2 ** 40, 512)


def test_a_config_built_under_the_meta_device_checks_its_rope_theta_all_the_same() -> None:
    """The trainers build a model's config from disk under torch.device("meta") (trainer/run_inputs.py): the
    rope_theta check computes its frequencies on the CPU there too (it called .item() on a meta tensor: every SFT
    from a saved model failed)."""
    with torch.device("meta"):
        assert MiniNormConfig(rope_theta=1e6).rope_theta == 1e6
        with pytest.raises(ValueError, match=r"^rope_theta=1e\+300 is not allowed"):
            MiniNormConfig(rope_theta=1e300)
        with pytest.raises(ValueError, match=r"^rope_theta=1e-300 is not allowed; RoPE's fp32 angles"):
            MiniNormConfig(rope_theta=1e-300)
