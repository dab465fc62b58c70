"""Norms against independent references: fp64 formulas, torch.nn.RMSNorm, nn.LayerNorm, a hand-derived backward.

Triton is tested in tests/unit/test_kernels.py; here the implementations are "eager" (the reference) and "compile"
(the CPU fast path). Compiling costs seconds per new shape, so the compile tests use few shapes.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from torch import nn

from model.config import MiniNormConfig, NormImpl
from model.norms import LayerNorm, NoNorm, RMSNorm, build_norm, partial_size, resolve_norm_impl
from model.rmsnorm_math import floor_fraction
from tests.norm_reference import expected_partial_size

EPS = 1e-6
SIZES = [41, 96, 123, 1128]
# Per-dtype tolerances (atol, rtol) against an fp64 reference.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def ref_prms_forward(x: torch.Tensor, w: torch.Tensor, eps: float, p: float) -> torch.Tensor:
    """fp64 (partial) RMSNorm written from the formula: y = x / sqrt(sum(x[:k]^2) / k + eps) * w, k = ceil(n p)."""
    k = expected_partial_size(x.shape[-1], p)
    x, w = x.double(), w.double()
    rms = torch.sqrt((x[..., :k] * x[..., :k]).sum(dim=-1, keepdim=True) / k + eps)
    return x / rms * w


def ref_prms_backward(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, eps: float,
                      p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 backward from docs/architecture.md: g = dy*w, dx_i = r*g_i - [i<k]*r^3*x_i*(1/k)*sum_j g_j*x_j,
    dw_i = sum over rows of dy_i*x_i*r."""
    k = expected_partial_size(x.shape[-1], p)
    x, w, dy = x.double(), w.double(), dy.double()
    n = x.shape[-1]
    r = 1.0 / torch.sqrt((x[..., :k] ** 2).sum(dim=-1, keepdim=True) / k + eps)
    g = dy * w
    in_stats = (torch.arange(n) < k).double()
    dx = r * g - in_stats * r**3 * x * (g * x).sum(dim=-1, keepdim=True) / k
    dw = (dy * x * r).reshape(-1, n).sum(dim=0)
    return dx, dw


def ref_layernorm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w.double() + b.double()


def random_weight(dim: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return 1.0 + 0.5 * torch.randn(dim, generator=gen)


def make_norm(dim: int, p: float = 1.0, impl: str = "eager", seed: int = 0) -> RMSNorm:
    norm = RMSNorm(dim, EPS, p, impl)
    with torch.no_grad():
        norm.weight.copy_(random_weight(dim, seed))
    return norm


def non_contiguous(shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `shape` whose last dim has stride 1 but whose rows are not packed (a column slice)."""
    wide = torch.randn(*shape[:-1], shape[-1] + 5)
    x = wide[..., 2:2 + shape[-1]]
    assert not x.is_contiguous()
    return x


# ---------------------------------------------------------------------------------------------- RMSNorm, p = 1


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("m", [1, 7, 199])
def test_rmsnorm_matches_fp64_and_torch(n: int, m: int) -> None:
    torch.manual_seed(n * m)
    x = torch.randn(m, n) * 3
    norm = make_norm(n)
    torch_norm = nn.RMSNorm(n, eps=EPS)
    with torch.no_grad():
        torch_norm.weight.copy_(norm.weight)
    y = norm(x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y.double(), ref_prms_forward(x, norm.weight, EPS, 1.0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y, torch_norm(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(5, 96), (2, 7, 123), (2, 3, 5, 41)])
def test_rmsnorm_ranks_and_non_contiguous(shape: tuple[int, ...]) -> None:
    torch.manual_seed(1)
    x = non_contiguous(shape)
    norm = make_norm(shape[-1])
    y = norm(x)
    torch.testing.assert_close(y.double(), ref_prms_forward(x, norm.weight, EPS, 1.0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y, norm(x.contiguous()), atol=0, rtol=0)


@pytest.mark.parametrize("n", [96, 1128])
def test_rmsnorm_bf16(n: int) -> None:
    torch.manual_seed(2)
    x = torch.randn(7, n).bfloat16()
    norm = make_norm(n)
    ref = ref_prms_forward(x, norm.weight, EPS, 1.0)
    # fp32 weight with bf16 input (autocast style) and an all-bf16 module (model.to(bfloat16)).
    for module in (norm, make_norm(n).to(torch.bfloat16)):
        y = module(x)
        assert y.dtype == torch.bfloat16
        atol, rtol = TOL[torch.bfloat16]
        torch.testing.assert_close(y.double(), ref, atol=atol, rtol=rtol)


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place between `got` (bf16) and `want` correctly rounded to bf16 (same-sign
    values, so the bit patterns order like the numbers)."""
    return (got.view(torch.int16).int() - want.to(torch.bfloat16).view(torch.int16).int()).abs()


@pytest.mark.parametrize("impl", ["eager", "compile"])
@pytest.mark.parametrize("p", [1.0, 0.0625])
def test_bf16_input_is_normalized_in_fp32(impl: str, p: float) -> None:
    """A bf16 input computed in fp32 and rounded once is the fp64 result correctly rounded to bf16, bar the rare
    value within fp32 error of a rounding midpoint (one ulp off). The same formula computed in bf16 rounds at every
    step (x^2 sum, rsqrt, x*r, *w): about a third of the outputs land one or two ulps away, which a 2e-2 tolerance
    cannot see (bf16's ulp is 2^-8 relative)."""
    torch.manual_seed(20)
    n = 1128
    x = (torch.randn(64, n) * 3).bfloat16()
    for weight_dtype in (torch.float32, torch.bfloat16):  # autocast (fp32 gain) and model.to(bfloat16)
        norm = make_norm(n, p, impl).to(weight_dtype)
        y = norm(x).detach()
        assert y.dtype == torch.bfloat16
        ulps = bf16_ulps(y, ref_prms_forward(x, norm.weight.float(), EPS, norm.p))
        assert ulps.max() <= 1 and (ulps > 0).float().mean() < 1e-3, (weight_dtype, (ulps > 0).float().mean())


def test_layernorm_bf16_input_is_normalized_in_fp32() -> None:
    torch.manual_seed(21)
    n = 1128
    x = (torch.randn(64, n) * 3 + 1).bfloat16()
    norm = build_norm(MiniNormConfig(norm_type="layernorm", norm_eps=EPS), n)
    with torch.no_grad():
        norm.weight.copy_(random_weight(n, 1))
        norm.bias.copy_(0.1 * random_weight(n, 2))
    y = norm(x).detach()
    # Near zero the output's sign can flip within fp32 error; compare where the reference is clearly away from 0.
    want = ref_layernorm(x, norm.weight, norm.bias, EPS)
    away = want.abs() > 1e-2
    ulps = bf16_ulps(y[away], want[away])
    assert ulps.max() <= 1 and (ulps > 0).float().mean() < 1e-3


def test_rmsnorm_tiny_input_uses_eps() -> None:
    """An all-zero row must give zeros (eps inside the sqrt), not NaN."""
    y = make_norm(41)(torch.zeros(3, 41))
    assert torch.equal(y, torch.zeros(3, 41))


def test_rmsnorm_default_eps_is_llamas() -> None:
    """RMSNorm(dim) with no eps normalizes as transformers' LlamaRMSNorm(dim) does by default (eps 1e-6, Llama's
    rms_norm_eps and MiniNormConfig's norm_eps), on rows whose mean square (~1e-6) makes eps count."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = 1e-3 * torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    want = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(RMSNorm(64)(x).double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(RMSNorm(64)(x), LlamaRMSNorm(64)(x), atol=1e-5, rtol=1e-5)


def test_rmsnorm_backward_formula_and_gradcheck() -> None:
    torch.manual_seed(3)
    norm = make_norm(41).double()
    x = torch.randn(4, 41, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(norm, (x,))
    dy = torch.randn(4, 41, dtype=torch.float64)
    norm(x).backward(dy)
    dx_ref, dw_ref = ref_prms_backward(x.detach(), norm.weight.detach(), dy, EPS, 1.0)
    torch.testing.assert_close(x.grad, dx_ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(norm.weight.grad, dw_ref, atol=1e-10, rtol=1e-10)
    # The p = 1 closed form from docs/architecture.md: dx = r * (g - x * r^2 * mean(g * x)).
    xd = x.detach()
    r = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)
    g = dy * norm.weight.detach()
    torch.testing.assert_close(x.grad, r * (g - xd * r**2 * (g * xd).mean(-1, keepdim=True)), atol=1e-10, rtol=1e-10)


# ---------------------------------------------------------------------------------------------- partial RMSNorm


@pytest.mark.parametrize(("n", "p", "k"), [(41, 0.0625, 3), (96, 0.0625, 6), (123, 0.5, 62), (1128, 0.0625, 71),
                                           (96, 1e-4, 1), (41, 1.0, 41), (96, 0.99, 96), (100, 0.07, 7),
                                           (100, 0.14, 14), (1000, 0.001, 1), (3, 0.34, 2)])
def test_partial_size(n: int, p: float, k: int) -> None:
    # k = ceil(n * p) with p read as the decimal it is written as: a float product would give 8 for 100 * 0.07
    # (7.000000000000001) and 15 for 100 * 0.14 (14.000000000000002).
    assert partial_size(n, p) == k == expected_partial_size(n, p)


@pytest.mark.parametrize(("n", "p", "k"), [(100_000, 5e-05, 5), (1_000_000, 2.5e-05, 25), (64, 1e-05, 1),
                                           (10**7, 1.25e-06, 13)])
def test_partial_size_of_a_p_below_1e_4(n: int, p: float, k: int) -> None:
    # Python writes a float below 1e-4 with an exponent (repr(5e-05) == '5e-05'): the decimal it stands for is still
    # 5 / 100000, so k = ceil(n * p) is as small as that (a sign slip on the exponent would read p as 500000 and
    # give k = n, a full RMSNorm).
    assert partial_size(n, p) == k == expected_partial_size(n, p)
    assert floor_fraction(n, p) == math.floor(Fraction(str(p)) * n)  # Mix-LN reads its ratio the same way


@pytest.mark.parametrize("p", [0.0, -0.5, 1.5, float("nan"), "0.5", None])
def test_p_outside_its_range_is_refused_everywhere(p) -> None:
    with pytest.raises(ValueError, match=r"p=.* is not allowed; it must be a float in \(0, 1\]"):
        RMSNorm(8, p=p)
    with pytest.raises(ValueError, match=r"prms_p=.* is not allowed"):
        MiniNormConfig(norm_type="prmsnorm", prms_p=p)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("p", [0.0625, 0.3])
def test_prmsnorm_forward_matches_fp64(n: int, p: float) -> None:
    torch.manual_seed(n)
    x = torch.randn(2, 7, n) * 2
    norm = make_norm(n, p)
    assert norm.k == expected_partial_size(n, p) < n
    y = norm(x)
    torch.testing.assert_close(y.double(), ref_prms_forward(x, norm.weight, EPS, p), atol=1e-5, rtol=1e-5)
    # The partial estimate differs from the full RMS, so this is not RMSNorm in disguise.
    assert not torch.allclose(y, make_norm(n, 1.0)(x), atol=1e-3)


def test_prmsnorm_stats_come_from_the_first_k_and_scale_all() -> None:
    torch.manual_seed(4)
    n, p = 123, 0.0625
    k = expected_partial_size(n, p)
    norm = make_norm(n, p)
    x = torch.randn(5, n)
    y = norm(x)
    # Changing elements past k leaves the RMS (hence y[:k]) unchanged ...
    x2 = x.clone()
    x2[:, k:] *= 10
    y2 = norm(x2)
    torch.testing.assert_close(y2[:, :k], y[:, :k], atol=0, rtol=0)
    torch.testing.assert_close(y2[:, k:], 10 * y[:, k:], atol=1e-5, rtol=1e-5)
    # ... and every element, not only the first k, is scaled by the same factor.
    factor = y / (x * norm.weight)
    torch.testing.assert_close(factor, factor[:, :1].expand_as(factor), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [96, 1128])
def test_prmsnorm_p1_equals_rmsnorm(n: int) -> None:
    torch.manual_seed(5)
    x = torch.randn(7, n)
    full = build_norm(MiniNormConfig(norm_type="rmsnorm", norm_impl="eager"), n)
    partial = build_norm(MiniNormConfig(norm_type="prmsnorm", prms_p=1.0, norm_impl="eager"), n)
    torch_norm = nn.RMSNorm(n, eps=EPS)
    for module in (full, partial, torch_norm):
        with torch.no_grad():
            module.weight.copy_(random_weight(n))
    assert partial.k == n
    assert torch.equal(partial(x), full(x))
    torch.testing.assert_close(partial(x), torch_norm(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("shape", "p"), [((3, 41), 0.0625), ((2, 3, 16), 0.25), ((2, 2, 3, 24), 0.5),
                                          ((3, 20), 1.0)])
def test_prmsnorm_gradcheck_fp64(shape: tuple[int, ...], p: float) -> None:
    torch.manual_seed(6)
    norm = make_norm(shape[-1], p).double()
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    w = norm.weight.detach().clone().requires_grad_(True)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(norm, {"weight": w}, (x,))

    assert torch.autograd.gradcheck(f, (x, w))


@pytest.mark.parametrize("n", [41, 123, 1128])
@pytest.mark.parametrize("p", [0.0625, 0.5])
def test_prmsnorm_backward_matches_design_formula(n: int, p: float) -> None:
    torch.manual_seed(n)
    norm = make_norm(n, p).double()
    x = (torch.randn(3, 5, n, dtype=torch.float64) * 2).requires_grad_(True)
    dy = torch.randn(3, 5, n, dtype=torch.float64)
    norm(x).backward(dy)
    dx_ref, dw_ref = ref_prms_backward(x.detach(), norm.weight.detach(), dy, EPS, norm.p)
    torch.testing.assert_close(x.grad, dx_ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(norm.weight.grad, dw_ref, atol=1e-10, rtol=1e-10)


def test_prmsnorm_fp32_backward_close_to_fp64_formula() -> None:
    torch.manual_seed(7)
    n = 1128
    norm = make_norm(n, 0.0625)
    x = non_contiguous((7, n)).requires_grad_(True)
    dy = torch.randn(7, n)
    norm(x).backward(dy)
    dx_ref, dw_ref = ref_prms_backward(x.detach(), norm.weight.detach(), dy, EPS, norm.p)
    torch.testing.assert_close(x.grad.double(), dx_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(norm.weight.grad.double(), dw_ref, atol=1e-4, rtol=1e-4)


def test_prmsnorm_bf16() -> None:
    torch.manual_seed(8)
    x = torch.randn(2, 7, 1128).bfloat16()
    norm = make_norm(1128, 0.0625)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), ref_prms_forward(x, norm.weight, EPS, norm.p), atol=2e-2, rtol=2e-2)


def test_rmsnorm_rejects_bad_p() -> None:
    for p in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="p="):
            RMSNorm(64, EPS, p)


# ---------------------------------------------------------------------------------------------- implementations


def test_auto_resolves_to_compile_on_cpu_and_triton_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_norm_impl("auto", cpu) == NormImpl.COMPILE
    assert resolve_norm_impl("eager", cpu) == NormImpl.EAGER
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="triton"):
        resolve_norm_impl("triton", cpu)


# The compiled path (an autograd.Function over two compiled kernels, see model/norms.py) checked like the eager one.
# All use N = 123: the row count is dynamic in the compiled kernels, so new M costs no recompilation, while a new N,
# k or dtype does (seconds each). M = 74 exercises the dW partial sums over 32-row blocks with a padded last block.
COMPILE_CASES = [((7, 123), 1.0, True), ((2, 37, 123), 0.0625, False), ((2, 3, 4, 123), 0.0625, True),
                 ((74, 123), 1.0, False)]


def compiled_fwd_bwd(module: RMSNorm, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    module.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    y = module(xi)
    y.backward(dy)
    return y.detach(), xi.grad.clone(), module.weight.grad.clone()


@pytest.mark.parametrize(("shape", "p", "contiguous"), COMPILE_CASES)
def test_compile_matches_fp64_and_eager_forward_and_backward(shape: tuple[int, ...], p: float,
                                                             contiguous: bool) -> None:
    torch.manual_seed(9)
    eager, compiled = make_norm(shape[-1], p, "eager"), make_norm(shape[-1], p, "compile")
    x = (torch.randn(*shape) if contiguous else non_contiguous(shape)) * 2
    dy = torch.randn(*shape)
    y, dx, dw = compiled_fwd_bwd(compiled, x, dy)
    assert (y.dtype, dx.dtype, dw.dtype) == (torch.float32,) * 3 and y.shape == dx.shape == x.shape
    dx_ref, dw_ref = ref_prms_backward(x, compiled.weight.detach(), dy, EPS, compiled.p)
    torch.testing.assert_close(y.double(), ref_prms_forward(x, compiled.weight, EPS, compiled.p),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx.double(), dx_ref, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(dw.double(), dw_ref, atol=5e-5, rtol=1e-5)
    for got, want in zip((y, dx, dw), compiled_fwd_bwd(eager, x, dy)):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)
    # Without autograd (inference) the forward kernel alone runs and gives the same output.
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), y, atol=0, rtol=0)


def test_auto_is_the_compiled_path_on_cpu() -> None:
    torch.manual_seed(12)
    x, dy = torch.randn(5, 123), torch.randn(5, 123)
    for got, want in zip(compiled_fwd_bwd(make_norm(123, 1.0, "auto"), x, dy),
                         compiled_fwd_bwd(make_norm(123, 1.0, "compile"), x, dy)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_auto_checks_the_build_tools_outside_an_outer_compile_only(monkeypatch) -> None:
    """norm_impl auto on CPU asks once per process whether torch.compile can build (cpu_compile_problem, cached):
    traced inside a whole-model compile that cached call was Dynamo's lru_cache UserWarning at every compile and a
    compiler search traced into the graph's code."""
    import model.norms

    asked = []
    monkeypatch.setattr(model.norms, "cpu_compile_problem", lambda: asked.append(torch.compiler.is_compiling()))
    norm, x = make_norm(64, 1.0, "auto"), torch.randn(4, 64)
    assert torch._dynamo.explain(norm)(x).graph_break_count == 0
    assert asked == []
    norm(x)
    assert asked == [False]


@pytest.mark.parametrize("p", [1.0, 0.0625])
def test_compile_under_bf16_autocast_with_fp32_weight(p: float) -> None:
    """Autocast: a bf16 activation (from a bf16 matmul) meets the fp32 gain; y and dx are bf16, dW is fp32."""
    torch.manual_seed(13)
    norm = make_norm(123, p, "compile")
    x, dy = (torch.randn(3, 11, 123) * 2).bfloat16(), torch.randn(3, 11, 123).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, dx, dw = compiled_fwd_bwd(norm, x, dy)
    assert (y.dtype, dx.dtype, dw.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    atol, rtol = TOL[torch.bfloat16]
    dx_ref, dw_ref = ref_prms_backward(x, norm.weight.detach(), dy, EPS, norm.p)
    torch.testing.assert_close(y.double(), ref_prms_forward(x, norm.weight, EPS, norm.p), atol=atol, rtol=rtol)
    torch.testing.assert_close(dx.double(), dx_ref, atol=atol, rtol=rtol)
    # dW is computed in fp32 from the bf16 inputs: only the fp64 reference's rounding differs.
    torch.testing.assert_close(dw.double(), dw_ref, atol=1e-4, rtol=1e-5)


def test_compile_gradcheck_fp64() -> None:
    """fp64 in, fp64 compute: the compiled backward is the derivative of the compiled forward (p < 1)."""
    torch.manual_seed(14)
    norm = make_norm(123, 0.0625, "compile").double()
    x = torch.randn(2, 3, 123, dtype=torch.float64, requires_grad=True)
    w = norm.weight.detach().clone().requires_grad_(True)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(norm, {"weight": w}, (x,))

    assert torch.autograd.gradcheck(f, (x, w))


def test_compile_inside_an_outer_torch_compile() -> None:
    """Under an outer torch.compile (of a block or the whole model) the norm traces as the plain formula."""
    torch.manual_seed(15)
    norm = make_norm(123, 0.0625, "compile")
    x, dy = torch.randn(4, 123), torch.randn(4, 123)
    outer = torch.compile(lambda t: norm(t) * 2.0)
    xi = x.clone().requires_grad_(True)
    outer(xi).backward(dy)
    dx_ref, dw_ref = ref_prms_backward(x, norm.weight.detach(), 2.0 * dy, EPS, norm.p)
    torch.testing.assert_close(xi.grad.double(), dx_ref, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(norm.weight.grad.double(), dw_ref, atol=5e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- LayerNorm, none


@pytest.mark.parametrize("n", SIZES)
def test_layernorm_matches_torch_and_fp64(n: int) -> None:
    torch.manual_seed(n)
    x = non_contiguous((2, 7, n)) * 3 + 1
    ours = build_norm(MiniNormConfig(norm_type="layernorm", norm_eps=EPS), n)
    assert isinstance(ours, LayerNorm)
    theirs = nn.LayerNorm(n, eps=EPS)
    with torch.no_grad():
        for module in (ours, theirs):
            module.weight.copy_(random_weight(n, 1))
            module.bias.copy_(0.1 * random_weight(n, 2))
    y = ours(x)
    torch.testing.assert_close(y, theirs(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y.double(), ref_layernorm(x, ours.weight, ours.bias, EPS), atol=1e-5, rtol=1e-5)
    yb = ours(x.bfloat16())
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.double(), ref_layernorm(x.bfloat16(), ours.weight, ours.bias, EPS),
                               atol=2e-2, rtol=2e-2)


def test_layernorm_gradcheck_fp64() -> None:
    torch.manual_seed(10)
    norm = LayerNorm(24, eps=EPS).double()
    x = torch.randn(3, 24, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(norm, (x,))


def test_none_is_identity() -> None:
    norm = build_norm(MiniNormConfig(norm_type="none"), 41)
    assert isinstance(norm, NoNorm) and not list(norm.parameters())
    x = torch.randn(3, 41)
    assert norm(x) is x


@pytest.mark.parametrize("norm_type", ["rmsnorm", "prmsnorm", "layernorm", "none"])
def test_add_and_norm_equals_add_then_norm(norm_type: str) -> None:
    torch.manual_seed(11)
    norm = build_norm(MiniNormConfig(norm_type=norm_type, norm_impl="eager"), 96)
    x, residual = torch.randn(2, 5, 96), torch.randn(2, 5, 96)
    normed, summed = norm.add_and_norm(x, residual)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, norm(x + residual))


@pytest.mark.parametrize(("norm_type", "cls", "k"), [("rmsnorm", RMSNorm, 96), ("prmsnorm", RMSNorm, 24),
                                                     ("layernorm", LayerNorm, None), ("none", NoNorm, None)])
def test_build_norm_follows_config(norm_type: str, cls: type, k: int | None) -> None:
    config = MiniNormConfig(norm_type=norm_type, prms_p=0.25, norm_eps=1e-5, norm_impl="eager")
    norm = build_norm(config, 96)
    assert type(norm) is cls
    if k is not None:
        assert (norm.k, norm.eps, norm.impl) == (k, 1e-5, NormImpl.EAGER)
    if norm_type == "layernorm":
        assert norm.eps == 1e-5 and norm.bias is not None
