"""The norm laboratory (issue 27): Dynamic Tanh, parameter-free norms, DeepNorm, Mix-LN, LayerNorm Scaling,
full-width QK-norm, the init depth-scaling switch and the placement aliases.

Every formula is checked against an fp64 reference written here from docs/architecture.md (not from the code under
test), or against an exact identity the papers state (Mix-LN at ratio 0 and 1, depth scaling of a 1-layer model,
DeepNorm's alpha and beta against a seeded reference init).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from model.config import MiniNormConfig
from model.llama_compat import NotExportable, check_compatible, check_exportable
from model.model import Attention, MiniNormForCausalLM
from model.norms import DyT, LayerNorm, RMSNorm, build_norm
from trainer.arg_fields import MODEL_FIELDS, build_model_config
from trainer.args import parse_args
from tests.model_training import assert_fits_batch
from trainer.diagnostics import NormDiagnostics

NEW_FIELDS = ("qk_norm_scope", "norm_affine", "dyt_alpha_init", "mix_ln_ratio", "norm_depth_scaling",
              "init_depth_scaling")
DTYPE = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


def config_of(**overrides: object) -> MiniNormConfig:
    base = dict(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64, norm_impl="eager", prms_p=0.25)
    return MiniNormConfig(**{**base, **overrides})


def model_of(seed: int = 0, **overrides: object) -> MiniNormForCausalLM:
    torch.manual_seed(seed)
    return MiniNormForCausalLM(config_of(**overrides)).eval()


@torch.no_grad()
def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Weights far from the init (gains != 1, biases != 0, alpha != its init), so a dropped parameter shows."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen, dtype=param.dtype)
        if param.ndim == 1:
            param.copy_((0.0 if name.endswith("bias") else 1.0) + 0.2 * noise)
        else:
            param.copy_(noise * param.shape[-1] ** -0.5)
    return model


def ids_of(batch: int = 2, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def rms_fp64(x: torch.Tensor, gain: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x.double()
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if gain is None else y * gain.double()


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("norm_type", "tanh", ["'dyt'", "'rmsnorm'"]),
    ("norm_placement", "periln", ["'deepnorm'", "'mix'", "Peri-LN", "alias 'peri'", "OLMo-2", "alias 'reordered'"]),
    ("qk_norm_scope", "all", ["'head'", "'full'"]),
    ("dyt_alpha_init", 0.0, ["> 0"]),
    ("dyt_alpha_init", -0.5, ["> 0"]),
    ("dyt_alpha_init", math.inf, ["finite"]),
    ("dyt_alpha_init", math.nan, ["finite"]),
    ("dyt_alpha_init", "0.5", ["float"]),
    ("mix_ln_ratio", -0.25, ["[0, 1]"]),
    ("mix_ln_ratio", 1.5, ["[0, 1]"]),
    ("mix_ln_ratio", math.nan, ["[0, 1]"]),
    ("norm_affine", "no", ["true or false"]),
    ("norm_depth_scaling", 1, ["true or false"]),
    ("init_depth_scaling", None, ["true or false"]),
])
def test_invalid_new_value_names_field_value_and_allowed(field: str, value: object, allowed: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        MiniNormConfig(**{field: value})
    message = str(info.value)
    assert f"{field}={value!r}" in message and "\n" not in message
    for choice in allowed:
        assert choice in message


@pytest.mark.parametrize(("overrides", "named"), [
    (dict(norm_placement="deepnorm"), "norm_placement='deepnorm'"),
    (dict(norm_depth_scaling=True), "norm_depth_scaling=True"),
    (dict(norm_affine=False), "norm_affine=False"),
])
def test_meaningless_combinations_are_refused_in_one_line(overrides: dict, named: str) -> None:
    with pytest.raises(ValueError) as info:
        MiniNormConfig(norm_type="none", **overrides)
    message = str(info.value)
    assert named in message and "norm_type='none'" in message and "\n" not in message


def test_every_other_combination_of_the_new_switches_builds_and_runs() -> None:
    """The switches cross freely except for the refusals above: a grid over all of them builds and runs."""
    ids = ids_of(1, 6)
    built = 0
    for norm_type in ("rmsnorm", "prmsnorm", "layernorm", "dyt", "none"):
        for placement in ("pre", "post", "sandwich", "res_post", "deepnorm", "mix"):
            for affine in (True, False):
                for depth_scaling in (False, True):
                    overrides = dict(norm_type=norm_type, norm_placement=placement, norm_affine=affine,
                                     norm_depth_scaling=depth_scaling, qk_norm=True, qk_norm_scope="full",
                                     mix_ln_ratio=0.5, init_depth_scaling=False, num_hidden_layers=2)
                    refused = norm_type == "none" and (placement == "deepnorm" or not affine or depth_scaling)
                    if refused:
                        with pytest.raises(ValueError):
                            config_of(**overrides)
                        continue
                    with torch.no_grad():
                        logits = model_of(**overrides)(ids).logits
                    assert torch.isfinite(logits).all()
                    built += 1
    assert built == 5 * 6 * 2 * 2 - (6 * 3 + 1)


def test_placement_aliases_are_stored_as_one_value(tmp_path) -> None:
    for alias, value in (("peri", "sandwich"), ("reordered", "res_post")):
        config = MiniNormConfig(norm_placement=alias)
        assert config.norm_placement == value and type(config.norm_placement) is str
        assert f'"norm_placement": "{value}"' in config.to_json_string()
        model = model_of(norm_placement=alias)
        same = model_of(norm_placement=value)
        assert model.state_dict().keys() == same.state_dict().keys()
        model.save_pretrained(tmp_path / alias)
        assert MiniNormForCausalLM.from_pretrained(tmp_path / alias).config.norm_placement == value
    help_text = MODEL_FIELDS["norm_placement"].help
    assert "Peri-LN" in help_text and "'peri'" in help_text and "OLMo-2" in help_text and "'reordered'" in help_text


def test_new_fields_are_trainer_flags_and_aliases_parse() -> None:
    assert set(NEW_FIELDS) <= set(MODEL_FIELDS)
    args = parse_args("pretrain", ["--norm_type", "dyt", "--norm_placement", "peri", "--norm_affine", "false",
                                   "--dyt_alpha_init", "0.8", "--norm_depth_scaling", "--init_depth_scaling", "false",
                                   "--qk_norm", "--qk_norm_scope", "full"])
    config = build_model_config(args, vocab_size=97)
    assert (config.norm_type, config.norm_placement, config.norm_affine, config.dyt_alpha_init) == (
        "dyt", "sandwich", False, 0.8)
    assert (config.norm_depth_scaling, config.init_depth_scaling, config.qk_norm_scope) == (True, False, "full")
    # mix_ln_ratio is read only by mix (a flag the run would not use is refused: docs/training.md)
    args = parse_args("pretrain", ["--norm_placement", "mix", "--mix_ln_ratio", "0.5"])
    assert build_model_config(args, vocab_size=97).mix_ln_ratio == 0.5


def test_a_refused_combination_is_a_one_line_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args("pretrain", ["--norm_type", "none", "--norm_placement", "deepnorm"])
    assert info.value.code == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(error_lines) == 1 and "norm_placement='deepnorm'" in error_lines[0]


def test_a_config_saved_before_the_new_fields_loads_as_the_model_it_was(tmp_path) -> None:
    """An old checkpoint's config.json has none of the new keys: it must load as today's model, same logits."""
    model = randomize(model_of(qk_norm=True))
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    assert set(NEW_FIELDS) <= set(saved)
    old = {key: value for key, value in saved.items() if key not in NEW_FIELDS}
    path.write_text(json.dumps(old))
    loaded = MiniNormForCausalLM.from_pretrained(tmp_path).eval()
    config = loaded.config
    assert (config.qk_norm_scope, config.norm_affine, config.norm_depth_scaling, config.init_depth_scaling) == (
        "head", True, False, True)
    assert MiniNormConfig.from_dict(old).norm_affine is True
    ids = ids_of()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_new_fields_round_trip(tmp_path) -> None:
    config = config_of(norm_type="dyt", norm_placement="mix", norm_affine=False, dyt_alpha_init=1.5, mix_ln_ratio=0.6,
                       norm_depth_scaling=True, init_depth_scaling=False, qk_norm=True, qk_norm_scope="full")
    config.save_pretrained(tmp_path)
    loaded = MiniNormConfig.from_pretrained(tmp_path)
    for field in NEW_FIELDS:
        assert getattr(loaded, field) == getattr(config, field)


# ---------------------------------------------------------------------------------------------- DyT


def dyt_fp64(x, alpha, weight, bias):
    """Zhu et al. (2025), eq. 1: DyT(x) = weight * tanh(alpha * x) + bias."""
    t = torch.tanh(alpha.double() * x.double())
    return t if weight is None else weight.double() * t + bias.double()


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(5, 48), (2, 3, 17), (64,)])
def test_dyt_forward_and_gradients_match_fp64_formulas(shape: tuple[int, ...], affine: bool) -> None:
    gen = torch.Generator().manual_seed(len(shape))
    n = shape[-1]
    norm = DyT(n, alpha_init=0.7, affine=affine)
    with torch.no_grad():
        norm.alpha.fill_(0.9)
        if affine:
            norm.weight.copy_(torch.rand(n, generator=gen) + 0.5)
            norm.bias.copy_(torch.randn(n, generator=gen))
    assert sum(p.numel() for p in norm.parameters()) == (1 + 2 * n if affine else 1)
    x = (3 * torch.randn(shape, generator=gen)).requires_grad_(True)
    dy = torch.randn(shape, generator=gen)
    y = norm(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), dyt_fp64(x, norm.alpha, norm.weight, norm.bias), rtol=1e-6, atol=1e-6)
    params = [norm.alpha, *([norm.weight, norm.bias] if affine else [])]
    grads = torch.autograd.grad((y * dy).sum(), [x, *params])
    # d/dx, d/dalpha, d/dw, d/db of w * tanh(alpha x) + b, with t = tanh(alpha x) and dtanh = 1 - t^2.
    xd, dyd, a = x.detach().double(), dy.double(), norm.alpha.detach().double()
    t = torch.tanh(a * xd)
    w = norm.weight.detach().double() if affine else torch.ones(n, dtype=DTYPE)
    rows = tuple(range(len(shape) - 1))
    expected = [dyd * w * a * (1 - t * t), (dyd * w * xd * (1 - t * t)).sum().reshape(1)]
    if affine:
        expected += [(dyd * t).sum(rows) if rows else dyd * t, dyd.sum(rows) if rows else dyd]
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_dyt_alpha_starts_at_the_papers_default() -> None:
    # Zhu et al. (2025) initialize alpha to alpha_0 = 0.5 by default (also MiniNormConfig's dyt_alpha_init).
    norm = DyT(16)
    assert norm.alpha.item() == 0.5
    x = 3 * torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(norm(x).double(), torch.tanh(0.5 * x.double()), rtol=1e-6, atol=1e-6)


def test_dyt_gradcheck_fp64() -> None:
    norm = DyT(7, alpha_init=0.6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_()
    x = torch.randn(3, 7, dtype=DTYPE, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, a, w, b: torch.func.functional_call(
        norm, {"alpha": a, "weight": w, "bias": b}, (x,)), (x, *[p.detach().requires_grad_(True) for p in
                                                               (norm.alpha, norm.weight, norm.bias)]))


def test_dyt_computes_in_fp32_and_returns_the_input_dtype() -> None:
    norm = DyT(64, alpha_init=0.5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_()
    x = (4 * torch.randn(8, 64, generator=torch.Generator().manual_seed(0))).bfloat16()
    y = norm(x)
    assert y.dtype == torch.bfloat16
    reference = dyt_fp64(x.float(), norm.alpha, norm.weight, norm.bias).float().bfloat16()
    assert torch.equal(y, reference)
    y, summed = norm.add_and_norm(x, x)
    assert torch.equal(summed, x + x) and torch.equal(y, norm(x + x))


def test_dyt_init_in_the_model_is_alpha_init_ones_and_zeros() -> None:
    model = MiniNormForCausalLM(config_of(norm_type="dyt", dyt_alpha_init=1.25, qk_norm=True))
    dyts = [m for m in model.modules() if isinstance(m, DyT)]
    assert len(dyts) == 3 * 2 + 3 * 2 + 1  # two per block, QK-norm's two per block, the final norm
    for module in dyts:
        assert module.alpha.shape == (1,) and module.alpha.item() == 1.25
        assert torch.equal(module.weight, torch.ones_like(module.weight))
        assert torch.equal(module.bias, torch.zeros_like(module.bias))
    assert MiniNormConfig().dyt_alpha_init == 0.5


@pytest.mark.parametrize("impl", ["eager", "compile", "triton", "auto"])
def test_dyt_runs_under_every_norm_impl(impl: str) -> None:
    """DyT is elementwise: every norm_impl runs its one formula (triton falls back on CPU instead of refusing)."""
    norm = build_norm(config_of(norm_type="dyt", norm_impl=impl), 16)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(norm(x).double(), dyt_fp64(x, norm.alpha, norm.weight, norm.bias))


# ---------------------------------------------------------------------------------------------- norm_affine


@pytest.mark.parametrize("impl", ["eager", "compile"])
@pytest.mark.parametrize("norm_type", ["rmsnorm", "prmsnorm"])
def test_parameter_free_rmsnorm_matches_fp64(norm_type: str, impl: str) -> None:
    config = config_of(norm_type=norm_type, norm_affine=False, prms_p=0.25, norm_impl=impl)
    norm = build_norm(config, 40)
    assert isinstance(norm, RMSNorm) and norm.weight is None and not list(norm.parameters())
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(2), requires_grad=True)
    y = norm(x)
    k = 40 if norm_type == "rmsnorm" else 10
    x64 = x.detach().double()
    expected = x64 / torch.sqrt(x64[:, :k].pow(2).mean(-1, keepdim=True) + config.norm_eps)
    torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=1e-6)
    # The backward: the parameter-free norm is the affine one at gain 1 exactly.
    affine = build_norm(config_of(norm_type=norm_type, prms_p=0.25, norm_impl=impl), 40)
    dy = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    grad, = torch.autograd.grad((y * dy).sum(), x)
    x2 = x.detach().clone().requires_grad_(True)
    reference, = torch.autograd.grad((affine(x2) * dy).sum(), x2)
    assert torch.equal(grad, reference)


def test_parameter_free_layernorm_matches_torch_and_fp64() -> None:
    norm = build_norm(config_of(norm_type="layernorm", norm_affine=False), 24)
    assert isinstance(norm, LayerNorm) and not list(norm.parameters())
    x = 5 + 3 * torch.randn(4, 24, generator=torch.Generator().manual_seed(4))
    x64 = x.double()
    expected = (x64 - x64.mean(-1, keepdim=True)) / torch.sqrt(x64.var(-1, unbiased=False, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(norm(x), nn.LayerNorm(24, eps=1e-6, elementwise_affine=False)(x))
    assert norm(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("norm_type", ["rmsnorm", "prmsnorm", "layernorm", "dyt"])
def test_parameter_free_models_have_no_norm_gains_and_train(norm_type: str) -> None:
    model = model_of(norm_type=norm_type, norm_affine=False, qk_norm=True).train()
    names = [name for name, _ in model.named_parameters() if "norm" in name]
    assert names == ([name for name in names if name.endswith(".alpha")] if norm_type == "dyt" else [])
    assert not any(name.endswith((".weight", ".bias")) for name in names)
    # Parameter-free DyT bounds the final hidden state to [-1, 1], so the logits start ~50x smaller: slower.
    assert_fits_batch(model, ids_of(4, 24), ratio=0.8 if norm_type == "dyt" else 0.5)


# ---------------------------------------------------------------------------------------------- placements


def test_mix_ratio_0_is_pre_and_1_is_post_with_the_same_weights() -> None:
    ids = ids_of()
    for ratio, plain in ((0.0, "pre"), (1.0, "post")):
        reference = randomize(model_of(norm_placement=plain, num_hidden_layers=4))
        mix = model_of(norm_placement="mix", mix_ln_ratio=ratio, num_hidden_layers=4)
        assert list(mix.state_dict()) == list(reference.state_dict())
        mix.load_state_dict(reference.state_dict())
        with torch.no_grad():
            assert torch.equal(mix(ids).logits, reference(ids).logits)


@pytest.mark.parametrize(("layers", "ratio", "posts"), [(4, 0.25, 1), (4, 0.5, 2), (3, 0.5, 1), (100, 0.29, 29),
                                                        (4, 0.99, 3), (4, 1.0, 4), (1, 0.5, 0)])
def test_mix_has_floor_ratio_times_layers_post_blocks_then_pre(layers: int, ratio: float, posts: int) -> None:
    config = config_of(norm_placement="mix", mix_ln_ratio=ratio, num_hidden_layers=layers)
    assert [p.value for p in config.block_placements()] == ["post"] * posts + ["pre"] * (layers - posts)
    assert config.has_final_norm == (posts < layers)
    if layers <= 4:
        model = model_of(norm_placement="mix", mix_ln_ratio=ratio, num_hidden_layers=layers)
        assert isinstance(model.model.norm, RMSNorm) == (posts < layers)


def test_mix_is_post_blocks_followed_by_pre_blocks() -> None:
    """Mix-LN at ratio 0.5 of 4 layers computes a post-LN model's first two blocks, then a pre-LN model's last two
    and its final norm."""
    post = randomize(model_of(norm_placement="post", num_hidden_layers=4), 1)
    pre = randomize(model_of(norm_placement="pre", num_hidden_layers=4), 2)
    mix = model_of(norm_placement="mix", mix_ln_ratio=0.5, num_hidden_layers=4)
    state = {k: v for k, v in post.state_dict().items() if k.startswith(("model.layers.0.", "model.layers.1."))}
    state |= {k: v for k, v in pre.state_dict().items() if not k.startswith(("model.layers.0.", "model.layers.1."))}
    mix.load_state_dict(state)
    ids = ids_of()
    with torch.no_grad():
        x = mix.model.embed_tokens(ids)
        positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        rope = mix.model.rotary(positions, x.dtype)
        for block in (*post.model.layers[:2], *pre.model.layers[2:]):
            x = block(x, rope, None, None)
        expected = mix.lm_head(pre.model.norm(x))
        torch.testing.assert_close(mix(ids).logits, expected, rtol=0, atol=0)


def deepnorm_fp64_logits(model: MiniNormForCausalLM, ids: torch.Tensor, alpha: float) -> torch.Tensor:
    """x = RMSNorm(alpha * x + f(x)) for both sublayers of every block, no final norm (DeepNet, eq. 2), with the
    norm written out in fp64 here; the sublayers f are the model's own attention and MLP."""
    inner = model.model
    x = inner.embed_tokens(ids).double()
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    rope = inner.rotary(positions, torch.float64)
    for block in inner.layers:
        x = rms_fp64(alpha * x + block.self_attn(x, rope, None, None), block.attn_out_norm.weight, 1e-6)
        x = rms_fp64(alpha * x + block.mlp(x), block.mlp_out_norm.weight, 1e-6)
    return x @ inner.embed_tokens.weight.double().T


@pytest.mark.parametrize("layers", [1, 3, 6])
def test_deepnorm_forward_is_the_papers_formula_with_alpha_2l_to_the_quarter(layers: int) -> None:
    model = randomize(model_of(norm_placement="deepnorm", num_hidden_layers=layers)).double()
    assert isinstance(model.model.norm, nn.Identity)
    ids = ids_of()
    with torch.no_grad():
        expected = deepnorm_fp64_logits(model, ids, (2 * layers) ** 0.25)
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-9, atol=1e-9)
        # The same formula with post-LN's alpha = 1 is another model: alpha is really applied.
        assert not torch.allclose(model(ids).logits, deepnorm_fp64_logits(model, ids, 1.0), atol=1e-3)


@pytest.mark.parametrize("layers", [2, 5])
def test_deepnorm_init_gain_is_8l_to_the_minus_quarter_on_v_o_and_mlp(layers: int) -> None:
    """Seeded reference: the same seed with post-LN and no depth scaling draws the same normal numbers; DeepNorm
    multiplies the value, output and MLP projections' draws by beta = (8L)^(-1/4) and leaves query and key at 1."""
    beta = (8 * layers) ** -0.25
    deep = model_of(norm_placement="deepnorm", num_hidden_layers=layers)
    plain = model_of(norm_placement="post", num_hidden_layers=layers, init_depth_scaling=False)
    plain_state = plain.state_dict()
    for name, tensor in deep.state_dict().items():
        gain = beta if name.endswith(("v_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight",
                                      "down_proj.weight")) else 1.0
        torch.testing.assert_close(tensor, gain * plain_state[name], rtol=1e-6, atol=0, msg=name)
    # ... and the init statistics say so: std of v over std of q is beta (16k draws each, ~1% noise).
    big = MiniNormForCausalLM(config_of(norm_placement="deepnorm", num_hidden_layers=layers, hidden_size=256,
                                        num_attention_heads=4, num_key_value_heads=4))
    attn = big.model.layers[0].self_attn
    ratio = (attn.v_proj.weight.std() / attn.q_proj.weight.std()).item()
    assert ratio == pytest.approx(beta, rel=0.03)
    assert attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.03)


def test_init_depth_scaling_false_drops_only_the_output_and_down_projection_scaling() -> None:
    layers = 3
    scaled, plain = model_of(num_hidden_layers=layers), model_of(num_hidden_layers=layers, init_depth_scaling=False)
    plain_state = plain.state_dict()
    for name, tensor in scaled.state_dict().items():
        gain = (2 * layers) ** -0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
        torch.testing.assert_close(tensor, gain * plain_state[name], rtol=1e-6, atol=0, msg=name)


def scaled_by_hooks(model: MiniNormForCausalLM) -> list:
    """A reference for LayerNorm Scaling: forward hooks multiply each block norm's output by 1/sqrt(l)."""
    handles = []
    for index, block in enumerate(model.model.layers):
        for name in ("attn_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm"):
            norm = getattr(block, name)
            if norm is not None:
                factor = 1.0 / math.sqrt(index + 1)
                handles.append(norm.register_forward_hook(lambda m, a, out, f=factor: out * f))
    return handles


def test_depth_scaling_leaves_a_one_layer_model_unchanged() -> None:
    ids = ids_of()
    for placement in ("pre", "post", "sandwich"):
        plain = randomize(model_of(norm_placement=placement, num_hidden_layers=1))
        scaled = model_of(norm_placement=placement, num_hidden_layers=1, norm_depth_scaling=True)
        scaled.load_state_dict(plain.state_dict())
        with torch.no_grad():
            assert torch.equal(scaled(ids).logits, plain(ids).logits)


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich", "res_post", "deepnorm", "mix"])
def test_depth_scaling_multiplies_each_block_norm_by_one_over_sqrt_l(placement: str) -> None:
    overrides = dict(norm_placement=placement, num_hidden_layers=4, mix_ln_ratio=0.5, qk_norm=True)
    plain = randomize(model_of(**overrides))
    scaled = model_of(norm_depth_scaling=True, **overrides)
    scaled.load_state_dict(plain.state_dict())
    ids = ids_of()
    with torch.no_grad():
        result = scaled(ids).logits
        unscaled = plain(ids).logits
        handles = scaled_by_hooks(plain)
        expected = plain(ids).logits
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(result, unscaled, atol=1e-3)


def attention_fp64(attn: Attention, x: torch.Tensor, rope, eps: float) -> torch.Tensor:
    """OLMo-2's QK-norm: RMSNorm over the whole query projection (all heads together) and the whole key
    projection, then heads, RoPE, causal softmax attention with grouped KV heads."""
    batch, length, _ = x.shape
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    x = x.double()
    q = rms_fp64(x @ attn.q_proj.weight.double().T, attn.q_norm.weight, eps)
    k = rms_fp64(x @ attn.k_proj.weight.double().T, attn.k_norm.weight, eps)
    v = x @ attn.v_proj.weight.double().T
    q = q.view(batch, length, heads, head_dim).transpose(1, 2)
    k = k.view(batch, length, kv_heads, head_dim).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    v = v.view(batch, length, kv_heads, head_dim).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    cos, sin = (t.double().unsqueeze(1) for t in rope)

    def rotate(t):
        half = head_dim // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin
    q, k = rotate(q), rotate(k)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    out = scores.masked_fill(~causal, -math.inf).softmax(-1) @ v
    return out.transpose(1, 2).reshape(batch, length, heads * head_dim) @ attn.o_proj.weight.double().T


def test_full_qk_norm_normalizes_all_heads_together() -> None:
    model = randomize(model_of(qk_norm=True, qk_norm_scope="full"))
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (4 * 8,) and attn.k_norm.weight.shape == (2 * 8,)
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(5))
    positions = torch.arange(10).expand(2, -1)
    rope = model.model.rotary(positions, torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, rope, None, None).double(), attention_fp64(attn, x, rope, 1e-6),
                                   rtol=1e-4, atol=1e-5)
    head = model_of(qk_norm=True).model.layers[0].self_attn
    assert head.q_norm.weight.shape == (8,) and MiniNormConfig().qk_norm_scope == "head"


# ---------------------------------------------------------------------------------------------- every switch


NEW_CASES = {
    "dyt": dict(norm_type="dyt"),
    "dyt-free-qk": dict(norm_type="dyt", norm_affine=False, qk_norm=True),
    "rms-free": dict(norm_affine=False),
    "deepnorm": dict(norm_placement="deepnorm"),
    "deepnorm-ln": dict(norm_placement="deepnorm", norm_type="layernorm"),
    "mix": dict(norm_placement="mix", mix_ln_ratio=0.5),
    "depth-scaling": dict(norm_depth_scaling=True),
    "qk-full": dict(qk_norm=True, qk_norm_scope="full"),
    "no-init-scaling": dict(init_depth_scaling=False),
}


@pytest.mark.parametrize("overrides", NEW_CASES.values(), ids=NEW_CASES.keys())
def test_each_new_switch_trains(overrides: dict) -> None:
    # DyT bounds the final hidden state to [-1, 1] (times its gain), so the logits start small and learn slower.
    ratio = 0.8 if overrides.get("norm_type") == "dyt" else 0.5
    assert_fits_batch(model_of(**overrides).train(), ids_of(4, 24), ratio=ratio)


@pytest.mark.parametrize("overrides", NEW_CASES.values(), ids=NEW_CASES.keys())
def test_kv_cache_decoding_equals_full_forward(overrides: dict) -> None:
    model = randomize(model_of(**overrides))
    ids = ids_of(2, 10)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :6], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(6, 10):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("overrides", "has_final"), [(dict(norm_type="dyt"), True),
                                                      (dict(norm_placement="deepnorm"), False),
                                                      (dict(norm_placement="mix", mix_ln_ratio=0.5), True),
                                                      (dict(norm_placement="mix", mix_ln_ratio=1.0), False)])
def test_diagnostics_watch_the_new_variants(overrides: dict, has_final: bool) -> None:
    model = model_of(**overrides).train()
    diag = NormDiagnostics(model)
    diag.arm()
    ids = ids_of()
    with torch.no_grad():
        x = model.model.embed_tokens(ids)
    model(ids, labels=ids).loss.backward()
    stats = diag.after_backward()
    assert ("diag/final_norm_out_rms" in stats) == has_final
    for i, placement in enumerate(model.config.block_placements()):
        names = ("attn_norm", "mlp_norm") if placement == "pre" else ("attn_out_norm", "mlp_out_norm")
        for name in names:
            assert math.isfinite(stats[f"diag/{name}_out_rms/layer_{i:02d}"])
        assert stats[f"diag/grad_norm/layer_{i:02d}"] > 0
    if overrides.get("norm_type") == "dyt":  # the recorded input RMS is the embedding's, read by the DyT hook
        assert stats["diag/attn_norm_in_rms/layer_00"] == pytest.approx(x.pow(2).mean().sqrt().item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize(("overrides", "switch"), [
    (dict(norm_type="dyt"), "norm_type='dyt'"),
    (dict(norm_placement="deepnorm"), "norm_placement='deepnorm'"),
    (dict(norm_placement="mix"), "norm_placement='mix'"),
    (dict(norm_placement="mix", mix_ln_ratio=0.0), "norm_placement='mix'"),
    (dict(norm_affine=False), "norm_affine=False"),
    (dict(norm_depth_scaling=True), "norm_depth_scaling=True"),
    (dict(qk_norm=True, qk_norm_scope="full"), "qk_norm=True"),
])
def test_llama_export_refuses_every_new_switch_in_one_line(overrides: dict, switch: str, tmp_path) -> None:
    config = config_of(**overrides)
    with pytest.raises(ValueError, match=switch):
        check_compatible(config)
    with pytest.raises(NotExportable) as info:
        check_exportable(config, tmp_path, "GGUF")
    message = str(info.value)
    assert "\n" not in message and switch in message and "(" in message  # the reason LLaMA cannot express it


def test_llama_export_accepts_the_switches_that_keep_a_llama() -> None:
    """init_depth_scaling changes only the initial weights, and the other new fields are read only by refused
    switches: each of these configs is still exactly a LLaMA."""
    for overrides in (dict(init_depth_scaling=False), dict(qk_norm_scope="full"), dict(dyt_alpha_init=2.0),
                      dict(mix_ln_ratio=0.75)):
        check_compatible(config_of(**overrides))


def test_export_scripts_refuse_a_parameter_free_model(tmp_path, tokenizer, capsys) -> None:
    from scripts.convert_to_gguf import main as gguf_main
    from scripts.convert_to_llama import main as llama_main

    path = tmp_path / "model"
    model_of(norm_affine=False).save_pretrained(path)
    tokenizer.save_pretrained(path)
    capsys.readouterr()  # saving's progress bars
    for main, argv in ((llama_main, ["--out_dir", str(tmp_path / "llama")]),
                       (gguf_main, ["--outfile", str(tmp_path / "m.gguf")])):
        assert main(["--model_path", str(path), *argv]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and "norm_affine=False" in error and "gain" in error
    assert not (tmp_path / "llama").exists() and not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("overrides", [dict(norm_affine=False, qk_norm=True, qk_norm_scope="full"),
                                       dict(norm_type="dyt", qk_norm=True),
                                       dict(norm_placement="mix", mix_ln_ratio=0.5, norm_depth_scaling=True)],
                         ids=["rms-free-qk-full", "dyt-qk", "mix-depth-scaling"])
def test_triton_path_matches_eager(overrides: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """norm_impl="triton" (Triton's CPU interpreter here): the parameter-free RMSNorm goes through the fused kernels
    with a gain of ones, DyT falls back to its formula; logits and gradients equal the eager model's."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    eager = randomize(model_of(**overrides)).train()
    fused = model_of(norm_impl="triton", **overrides).train()
    fused.load_state_dict(eager.state_dict())
    ids = ids_of(2, 9)
    out_e, out_f = eager(ids, labels=ids), fused(ids, labels=ids)
    torch.testing.assert_close(out_f.logits, out_e.logits, rtol=1e-4, atol=1e-5)
    out_e.loss.backward()
    out_f.loss.backward()
    grads_e = dict(eager.named_parameters())
    for name, param in fused.named_parameters():
        torch.testing.assert_close(param.grad, grads_e[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_grad_at_init_study_takes_the_new_variants_and_skips_refused_ones(tmp_path, capsys) -> None:
    from eval.studies.grad_at_init import main
    results = main(["--layers", "2", "--seq_len", "16", "--batch_size", "2", "--batches", "1", "--seeds", "1",
                    "--placements", "deepnorm,mix,peri", "--norm_types", "dyt,none", "--random_tokens",
                    "--threads", "1", "--out", str(tmp_path / "out")])
    assert [(r["placement"], r["norm_type"]) for r in results["runs"]] == \
        [("deepnorm", "dyt"), ("mix", "dyt"), ("mix", "none"), ("peri", "dyt"), ("peri", "none")]
    assert all(min(r["block_mean"]) > 0 for r in results["runs"])
    assert "deepnorm      none  skipped: norm_placement='deepnorm' is not allowed" in capsys.readouterr().out


def test_grad_at_init_writes_a_relative_out_under_the_repo_root(tmp_path, monkeypatch) -> None:
    """`cd /tmp && grad_at_init.py --out rel`: --out is relative to the repo root, as every output (trainer/cli.py
    output_folder); results.json and the table were written in the current directory."""
    from eval.studies.grad_at_init import main

    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    repo.mkdir()
    elsewhere.mkdir()
    monkeypatch.setattr("trainer.run_dir.REPO_ROOT", repo)
    monkeypatch.chdir(elsewhere)
    main(["--layers", "2", "--seq_len", "16", "--batch_size", "2", "--batches", "1", "--seeds", "1",
          "--placements", "pre", "--norm_types", "rmsnorm", "--random_tokens", "--threads", "1", "--out", "rel"])
    assert (repo / "rel" / "results.json").is_file() and (repo / "rel" / "grad_at_init.md").is_file()
    assert not (elsewhere / "rel").exists()


def test_a_variant_file_that_is_a_long_list_is_refused_in_one_short_line(tmp_path) -> None:
    """A variant file holding a list (not a mapping of model fields) is quoted as every refusal quotes a value
    (dataset/shown_value.py): its whole repr was printed."""
    from eval.studies.grad_at_init import variant_fields

    path = tmp_path / "variant.yaml"
    path.write_text("".join(f"- norm_type: rmsnorm{i}\n" for i in range(100)))
    with pytest.raises(ValueError) as refused:
        variant_fields(path)
    # the list's repr cut at 57 characters ("[{'norm_type': 'rmsnorm0'}, " is 28, the next item 27) and "..."
    assert str(refused.value) == (f"{path}: not a variant file (a mapping of model fields), got "
                                  "[{'norm_type': 'rmsnorm0'}, {'norm_type': 'rmsnorm1'}, {'...")


def test_grad_at_init_measures_the_study_variant_files(tmp_path) -> None:
    """--variants: each trainer --config file of the second study is measured as the network it describes (the
    parameter-free norm, LayerNorm Scaling and QK-norm included): its gradients equal those of a model built by hand
    from the file's fields, and a file with a field the model does not have is refused naming the file."""
    import yaml

    from eval.studies.grad_at_init import layer_grad_norms, main, random_batches
    from model.config import MiniNormConfig
    from model.model import MiniNormForCausalLM

    from tests.paths import REPO

    directory = REPO / "scripts" / "sweep_configs" / "study2_variants"
    shape = dict(num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2)
    results = main(["--variants", str(directory), "--layers", "3", "--hidden_size", "32", "--intermediate_size", "64",
                    "--num_attention_heads", "4", "--num_key_value_heads", "2", "--seq_len", "16", "--batch_size", "2",
                    "--batches", "1", "--seeds", "1", "--random_tokens", "--threads", "1",
                    "--out", str(tmp_path / "o")])
    files = sorted(directory.glob("*.yaml"))
    assert [r["variant"] for r in results["runs"]] == [f.stem for f in files]
    batch = random_batches(1, 2, 16, MiniNormConfig().vocab_size)[0]
    for file, entry in zip(files, results["runs"]):
        fields = yaml.safe_load(file.read_text())
        torch.manual_seed(0)
        model = MiniNormForCausalLM(MiniNormConfig.from_preset(
            "cpu-default", **shape, max_position_embeddings=512, norm_impl="eager", **fields)).train()
        model(batch, labels=batch).loss.backward()
        expected = layer_grad_norms(model)
        for quantity in ("ffn_w2", "attn", "block"):
            torch.testing.assert_close(torch.tensor(entry[f"{quantity}_mean"]), torch.tensor(expected[quantity]),
                                       msg=f"{file.stem} {quantity}")
    by_name = {r["variant"]: r for r in results["runs"]}
    # The switches the placement x norm grid cannot express change the network at initialization.
    for variant in ("pre_rmsnorm_lns", "pre_rmsnorm_qk", "pre_rmsnorm_free"):
        assert by_name[variant]["block_mean"] != by_name["pre_rmsnorm"]["block_mean"], variant
    table = (tmp_path / "o" / "grad_at_init.md").read_text()
    assert "| pre_rmsnorm_lns |" in table and "| variant |" in table

    bad = tmp_path / "bad.yaml"
    bad.write_text("norm_type: rmsnorm\nlearning_rate: 0.1\n")
    with pytest.raises(ValueError, match="bad.yaml.*learning_rate"):
        main(["--variants", str(bad), "--layers", "2", "--random_tokens", "--out", str(tmp_path / "b")])


def test_norm_inputs_reports_each_norms_input_and_dyt_saturation(tmp_path, tokenizer, capsys, default_corpus,
                                                                  monkeypatch) -> None:
    """eval/studies/norm_inputs.py: the first block's norm sees the token embeddings, so its input RMS and DyT's
    saturated fraction are checked against the embeddings themselves in fp64; a norm has no alpha; the command line
    writes one column group per model."""
    from eval.studies.norm_inputs import SATURATED_AT, main, norm_inputs

    # the command line reads the default corpus's validation split: the run's build (the fixture), not a build of
    # its own into the checkout's dataset/cache (26 CPU-s where no earlier test had made one there)
    monkeypatch.setattr("dataset.corpus.DEFAULT_CACHE_DIR", default_corpus.sft_train.parent)
    from model.config import MiniNormConfig
    from model.model import MiniNormForCausalLM
    from trainer.export import save_model_dir

    shape = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, norm_impl="eager")
    torch.manual_seed(0)
    dyt = MiniNormForCausalLM(MiniNormConfig(**shape, norm_type="dyt")).eval()
    embedding_rms = dyt.model.embed_tokens.weight.double().square().mean().sqrt().item()
    with torch.no_grad():
        dyt.model.layers[0].attn_norm.alpha.fill_(1.5 / embedding_rms)  # about a tenth of the units beyond 3
    batches = [torch.randint(0, len(tokenizer), (2, 16), generator=torch.Generator().manual_seed(i)) for i in (0, 1)]
    stats = norm_inputs(dyt, batches)
    embedded = torch.cat([dyt.model.embed_tokens(b).double() for b in batches])
    first = stats[0]
    assert first.name == "model.layers.0.attn_norm" and stats[-1].name == "model.norm"
    assert first.input_rms == pytest.approx(embedded.square().mean().sqrt().item(), rel=1e-9)
    expected = ((1.5 / embedding_rms * embedded).abs() > SATURATED_AT).double().mean().item()
    assert first.saturated == pytest.approx(expected, abs=1e-6) and 0.02 < first.saturated < 0.3
    assert first.alpha == pytest.approx(1.5 / embedding_rms, rel=1e-6)
    assert len(stats) == 2 * 2 + 1 and all(s.alpha is not None for s in stats)

    torch.manual_seed(0)
    rms = MiniNormForCausalLM(MiniNormConfig(**shape)).eval()
    assert all(s.alpha is None and s.saturated is None for s in norm_inputs(rms, batches))
    for name, model in (("dyt", dyt), ("rms", rms)):
        save_model_dir(model, tokenizer, tmp_path / name)
    assert main([str(tmp_path / "dyt"), str(tmp_path / "rms"), "--labels", "D,R", "--seq_len", "16", "--batches",
                 "1", "--batch_size", "2", "--out", str(tmp_path / "table")]) == 0
    text = (tmp_path / "table").read_text()
    assert "| norm | D: input RMS | alpha | saturated | R: input RMS | alpha | saturated |" in text
    assert text.count("| model.layers.") == 4 and "| model.norm |" in text


@pytest.mark.parametrize("flag", ["--seq_len", "--batch_size"])
def test_norm_inputs_huge_sizes_name_the_flag(tmp_path, capsys, flag) -> None:
    """eval/studies/norm_inputs.py: a --batch_size of 10**30 was 'error: Overflow when unpacking long long' (torch's
    words, no flag) after the model and the data were read; now bounded by the model's size bound (MAX_SIZE) and
    refused by argparse naming the flag, before any model is read."""
    from eval.studies.norm_inputs import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "no_model"), flag, str(10**30)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag}: " in err and "2147483647" in err, err
