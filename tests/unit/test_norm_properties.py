"""Invariance properties of the norms, from the RMSNorm paper (Zhang & Sennrich, 2019, §3 and Table 1).

All in fp64 on the eager (reference) implementation of model/norms.py, with random shapes drawn from seeded
torch.Generators and scale factors delta in {1e-3, 0.5, 7, 1e3}.

About eps: with eps > 0 the invariances are only approximate, because RMSNorm_eps(delta * x) equals
RMSNorm_{eps / delta^2}(x) -- a different eps, which matters once mean(x^2) is comparable to eps / delta^2
(delta = 1e-3 with the model's eps = 1e-6 moves the output by ~50%). The exact-invariance tests therefore use
eps = 0 (all inputs are non-zero, so nothing divides by zero) and fp64, and check to 1e-10 relative; the last
test checks that eps identity itself, for eps > 0.

Notation: a = x @ W.T are the summed inputs feeding the norm, y = N(a), loss = sum(c * y) for a fixed random c.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from model.norms import DyT, LayerNorm, RMSNorm
from tests.norm_reference import expected_partial_size

DELTAS = (1e-3, 0.5, 7.0, 1e3)
SEEDS = (0, 1, 2)
KINDS = ("rmsnorm", "prmsnorm", "layernorm")
RTOL, ATOL = 1e-10, 1e-12
DTYPE = torch.float64


def random_shape(gen: torch.Generator) -> tuple[tuple[int, ...], int]:
    """Leading dims (0-3 of them, sizes 1-7) and a feature size n in [2, 300]."""
    lead = tuple(int(s) for s in torch.randint(1, 8, (int(torch.randint(0, 4, (1,), generator=gen)),),
                                               generator=gen))
    return lead, int(torch.randint(2, 301, (1,), generator=gen))


def make_norm(kind: str, n: int, gen: torch.Generator, eps: float = 0.0, unit_gain: bool = False) -> nn.Module:
    """The module under test, with a random gain (and bias for LayerNorm) so the gain is exercised too."""
    if kind == "layernorm":
        norm = LayerNorm(n, eps=eps)
    else:
        # pRMSNorm with a p that makes k a proper, random-ish prefix (k < n for n >= 2).
        norm = RMSNorm(n, eps=eps, p=1.0 if kind == "rmsnorm" else 0.3, impl="eager")
    norm = norm.to(DTYPE)
    if not unit_gain:
        with torch.no_grad():
            norm.weight.copy_(torch.rand(n, generator=gen, dtype=DTYPE) + 0.5)
            if getattr(norm, "bias", None) is not None:
                norm.bias.copy_(torch.randn(n, generator=gen, dtype=DTYPE))
    return norm


def randn(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=DTYPE)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)


def loss_grads(norm: nn.Module, x: torch.Tensor, w: torch.Tensor, c: torch.Tensor):
    """Output y = N(x @ W.T) and the gradients of sum(c * y) with respect to x, W and the gain."""
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = norm(x @ w.T)
    gx, gw, gg = torch.autograd.grad((c * y).sum(), (x, w, norm.weight))
    return y.detach(), gx, gw, gg


@pytest.mark.parametrize("delta", DELTAS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", KINDS)
def test_output_invariant_to_rescaling_the_input(kind: str, seed: int, delta: float) -> None:
    """N(delta * a) = N(a) for any delta > 0 (re-scaling invariance of the summed inputs)."""
    gen = torch.Generator().manual_seed(seed)
    lead, n = random_shape(gen)
    norm = make_norm(kind, n, gen)
    a = randn(lead + (n,), gen)
    close(norm(delta * a), norm(a))


@pytest.mark.parametrize("delta", DELTAS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", KINDS)
def test_weight_matrix_rescaling(kind: str, seed: int, delta: float) -> None:
    """W -> delta * W: the output is unchanged; dLoss/dW scales by 1/delta (so larger weights learn slower,
    the paper's implicit learning-rate adaptation); dLoss/dx and dLoss/dgain are unchanged."""
    gen = torch.Generator().manual_seed(seed)
    lead, n = random_shape(gen)
    m = int(torch.randint(2, 65, (1,), generator=gen))
    norm = make_norm(kind, n, gen)
    x, w, c = randn(lead + (m,), gen), randn((n, m), gen), randn(lead + (n,), gen)
    y, gx, gw, gg = loss_grads(norm, x, w, c)
    y_s, gx_s, gw_s, gg_s = loss_grads(norm, x, delta * w, c)
    close(y_s, y)
    close(gw_s, gw / delta)
    close(gx_s, gx)
    close(gg_s, gg)


@pytest.mark.parametrize("delta", DELTAS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", KINDS)
def test_input_rescaling_leaves_weight_gradient_unchanged(kind: str, seed: int, delta: float) -> None:
    """x -> delta * x: the output and dLoss/dW are unchanged (the weight gradient is invariant to the scale of
    the input); dLoss/dx, taken with respect to the scaled input, scales by 1/delta."""
    gen = torch.Generator().manual_seed(seed)
    lead, n = random_shape(gen)
    m = int(torch.randint(2, 65, (1,), generator=gen))
    norm = make_norm(kind, n, gen)
    x, w, c = randn(lead + (m,), gen), randn((n, m), gen), randn(lead + (n,), gen)
    y, gx, gw, gg = loss_grads(norm, x, w, c)
    y_s, gx_s, gw_s, gg_s = loss_grads(norm, delta * x, w, c)
    close(y_s, y)
    close(gw_s, gw)
    close(gx_s, gx / delta)
    close(gg_s, gg)


@pytest.mark.parametrize("seed", SEEDS)
def test_layernorm_recenters_and_rmsnorm_does_not(seed: int) -> None:
    """Adding the same constant to every element of a row: LayerNorm's output is unchanged, (p)RMSNorm's is not.
    Equivalently for the weight matrix: W -> W + 1 gamma^T adds gamma . x to every summed input of a row."""
    gen = torch.Generator().manual_seed(seed)
    lead, n = random_shape(gen)
    n = max(n, 8)  # pRMSNorm's prefix must not cover the whole row for the contrast below to be generic
    a = randn(lead + (n,), gen)
    shift = 3.0 * randn(lead + (1,), gen)  # one constant per row, of the order of the row's own scale
    layer_norm = make_norm("layernorm", n, gen)
    close(layer_norm(a + shift), layer_norm(a))

    m = 16
    x, w, gamma = randn(lead + (m,), gen), randn((n, m), gen), randn((m,), gen)
    close(layer_norm(x @ (w + gamma).T), layer_norm(x @ w.T))  # w + gamma adds gamma to every row of W

    for kind in ("rmsnorm", "prmsnorm"):
        rms_norm = make_norm(kind, n, gen)
        change = (rms_norm(a + shift) - rms_norm(a)).abs().max().item()
        scale = rms_norm(a).abs().max().item()
        assert change > 1e-3 * scale, f"{kind} should not be re-centering invariant (change {change:.2e})"


@pytest.mark.parametrize("magnitude", (1e-30, 1e-3, 1.0, 1e3, 1e30))
@pytest.mark.parametrize("seed", SEEDS)
def test_rmsnorm_output_lies_on_the_sqrt_n_sphere(seed: int, magnitude: float) -> None:
    """With unit gain and eps = 0, ||RMSNorm(a)||_2 = sqrt(n) for every non-zero a, whatever its size.
    For pRMSNorm the same holds for the first k = ceil(n p) elements, which carry the RMS estimate."""
    gen = torch.Generator().manual_seed(seed)
    lead, n = random_shape(gen)
    a = magnitude * randn(lead + (n,), gen)
    y = make_norm("rmsnorm", n, gen, unit_gain=True)(a)
    close(torch.linalg.vector_norm(y, dim=-1), torch.full(lead, math.sqrt(n), dtype=DTYPE))

    partial = make_norm("prmsnorm", n, gen, unit_gain=True)
    k = expected_partial_size(n, partial.p)
    yp = partial(a)
    close(torch.linalg.vector_norm(yp[..., :k], dim=-1), torch.full(lead, math.sqrt(k), dtype=DTYPE))


@pytest.mark.parametrize("delta", DELTAS)
@pytest.mark.parametrize("kind", KINDS)
def test_with_eps_rescaling_is_the_same_as_changing_eps(kind: str, delta: float) -> None:
    """For eps > 0 the invariance is approximate, and exactly so: N_eps(delta * a) = N_{eps / delta^2}(a)."""
    gen = torch.Generator().manual_seed(7)
    lead, n = random_shape(gen)
    a = randn(lead + (n,), gen)
    eps = 1e-6
    scaled = make_norm(kind, n, torch.Generator().manual_seed(1), eps=eps)
    moved_eps = make_norm(kind, n, torch.Generator().manual_seed(1), eps=eps / delta**2)
    close(scaled(delta * a), moved_eps(a))
    # And the approximation error is what that formula predicts: tiny for delta >= 1, visible for 1e-3 * N(0,1).
    off = (scaled(delta * a) - make_norm(kind, n, torch.Generator().manual_seed(1), eps=0.0)(a)).abs().max()
    assert (off > 1e-2) == (delta == 1e-3)


# ------------------------------------------------------------------ parameter-free norms and Dynamic Tanh (issue 27)


def make_free_norm(kind: str, n: int, eps: float = 0.0) -> nn.Module:
    """The parameter-free variant (norm_affine=False): no gain, no bias."""
    if kind == "layernorm":
        return LayerNorm(n, eps=eps, elementwise_affine=False).to(DTYPE)
    return RMSNorm(n, eps=eps, p=1.0 if kind == "rmsnorm" else 0.3, impl="eager", affine=False).to(DTYPE)


@pytest.mark.parametrize("delta", DELTAS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", KINDS)
def test_parameter_free_norms_keep_the_rescaling_invariances(kind: str, seed: int, delta: float) -> None:
    """Without gain and bias: N(delta * a) = N(a), and W -> delta * W leaves the output unchanged and divides
    dLoss/dW by delta."""
    gen = torch.Generator().manual_seed(seed)
    lead, n = random_shape(gen)
    m = int(torch.randint(2, 65, (1,), generator=gen))
    norm = make_free_norm(kind, n)
    assert not list(norm.parameters())
    a = randn(lead + (n,), gen)
    close(norm(delta * a), norm(a))
    x, w, c = randn(lead + (m,), gen), randn((n, m), gen), randn(lead + (n,), gen)
    grads = []
    for scale in (1.0, delta):
        w_scaled = (scale * w).requires_grad_(True)
        y = norm(x @ w_scaled.T)
        grads.append((y.detach(), torch.autograd.grad((c * y).sum(), w_scaled)[0]))
    close(grads[1][0], grads[0][0])
    close(grads[1][1], grads[0][1] / delta)


@pytest.mark.parametrize("seed", SEEDS)
def test_parameter_free_layernorm_recenters_and_parameter_free_rmsnorm_does_not(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    lead, n = random_shape(gen)
    n = max(n, 8)
    a = randn(lead + (n,), gen)
    shift = 3.0 * randn(lead + (1,), gen)
    layer_norm = make_free_norm("layernorm", n)
    close(layer_norm(a + shift), layer_norm(a))
    rms_norm = make_free_norm("rmsnorm", n)
    change = (rms_norm(a + shift) - rms_norm(a)).abs().max().item()
    assert change > 1e-3 * rms_norm(a).abs().max().item()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("affine", [True, False])
def test_dyt_is_not_scale_invariant_but_trades_scale_for_alpha(affine: bool, seed: int) -> None:
    """DyT has no statistics, so DyT(delta * a) != DyT(a) for delta != 1 (it saturates or linearises); what holds
    instead is DyT_alpha(delta * a) = DyT_{alpha * delta}(a), exactly in fp64."""
    gen = torch.Generator().manual_seed(seed)
    lead, n = random_shape(gen)
    a = randn(lead + (n,), gen)
    norm = DyT(n, alpha_init=0.5, affine=affine).to(DTYPE)
    if affine:
        with torch.no_grad():
            norm.weight.copy_(torch.rand(n, generator=gen, dtype=DTYPE) + 0.5)
            norm.bias.copy_(torch.randn(n, generator=gen, dtype=DTYPE))
    base = norm(a)
    for delta in DELTAS:
        change = (norm(delta * a) - base).abs().max().item()
        assert change > 1e-2, f"DyT should not be scale invariant (delta {delta}: change {change:.2e})"
        moved = DyT(n, alpha_init=0.5 * delta, affine=affine).to(DTYPE)
        moved.load_state_dict({**norm.state_dict(), "alpha": norm.alpha.detach() * delta})
        close(norm(delta * a), moved(a))
