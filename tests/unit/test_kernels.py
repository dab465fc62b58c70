"""The fused RMSNorm Triton kernels, run on CPU tensors by Triton's interpreter (TRITON_INTERPRET=1).

References are fp64 formulas written here (not model.norms). The interpreter is ~1000x slower than a GPU, so
shapes stay small (M <= 256). The kernels are decorated on first use, so setting the variable per test (a
fixture, undone afterwards) is enough and other test modules never see it.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from model.kernels import MAX_N, add_rms_norm, rms_norm, rmsnorm_triton
from model.norms import partial_size

EPS = 1e-6
# bf16: the interpreter casts fp32 -> bf16 by truncation (GPUs round to nearest), up to 2^-7 relative.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)


def _k(n: int, p: float) -> int:
    return min(n, max(1, math.ceil(n * p)))


def _reference(x: torch.Tensor, w: torch.Tensor, p: float, dy: torch.Tensor, eps: float = EPS):
    """fp64 (y, dx, dw) by autograd of y = x * rsqrt(mean(x[..., :k]^2) + eps) * w."""
    k = _k(x.shape[-1], p)
    xd = x.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    y = xd * torch.rsqrt(xd[..., :k].pow(2).mean(-1, keepdim=True) + eps) * wd
    y.backward(dy.double())
    return y.detach(), xd.grad, wd.grad


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """Max error relative to the largest reference value: robust for rows of any scale."""
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    scale = expected.abs().max().clamp_min(1e-30)
    err = ((actual.double() - expected).abs().max() / scale).item()
    assert err <= tol, f"{what}: relative max error {err:.3g} > {tol:.3g}"


def _run(x: torch.Tensor, w: torch.Tensor, p: float, dy: torch.Tensor):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = rms_norm(x, w, EPS, p)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


# ------------------------------------------------------------------------------------------------ RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,m", [(41, 7), (96, 199), (123, 1), (512, 64), (1128, 256)])
@pytest.mark.parametrize("p", [1.0, 0.5, 0.0625])
def test_rms_norm_matches_fp64(dtype: torch.dtype, n: int, m: int, p: float) -> None:
    x = torch.randn(m, n, dtype=dtype) * 3 + 0.5
    w = (torch.randn(n) + 1).to(dtype)
    dy = torch.randn(m, n, dtype=dtype)
    y, dx, dw = _run(x, w, p, dy)
    y_ref, dx_ref, dw_ref = _reference(x, w, p, dy)
    assert y.dtype == dx.dtype == dtype and dw.dtype == dtype and y.shape == x.shape
    tol = TOL[dtype]
    _assert_close(y, y_ref, tol, "y")
    _assert_close(dx, dx_ref, tol, "dx")
    _assert_close(dw, dw_ref, tol, "dw")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp32_weight_with_half_activations(dtype: torch.dtype) -> None:
    """fp32 master weights with bf16/fp16 activations: y keeps x's dtype, dw the weight's."""
    x, dy, w = torch.randn(33, 96, dtype=dtype), torch.randn(33, 96, dtype=dtype), torch.randn(96)
    y, dx, dw = _run(x, w, 0.25, dy)
    assert (y.dtype, dx.dtype, dw.dtype) == (dtype, dtype, torch.float32)
    y_ref, dx_ref, dw_ref = _reference(x, w, 0.25, dy)
    _assert_close(y, y_ref, TOL[dtype], "y")
    _assert_close(dx, dx_ref, TOL[dtype], "dx")
    _assert_close(dw, dw_ref, 1e-5, "dw")  # fp32 accumulation of exact half products


def test_p_one_is_rmsnorm_and_matches_torch() -> None:
    x, w = torch.randn(20, 128), torch.randn(128)
    torch.testing.assert_close(rms_norm(x, w, EPS, 1.0), torch.nn.functional.rms_norm(x, (128,), w, EPS))
    # p so close to 1 that ceil(n*p) = n takes the same path.
    assert torch.equal(rms_norm(x, w, EPS, 1.0), rms_norm(x, w, EPS, 0.999))


@pytest.mark.parametrize("shape", [(2, 5, 96), (2, 3, 4, 41), (3, 123)], ids=str)
def test_noncontiguous_and_nd_inputs(shape: tuple[int, ...]) -> None:
    n = shape[-1]
    w = torch.randn(n)
    views = {
        "contiguous": torch.randn(shape),
        # last dim strided: a transpose of a tensor whose first dim has size n
        "transposed": torch.randn((n, *shape[:-1])).movedim(0, -1),
        # rows strided, last dim contiguous: a slice of a wider tensor (no copy needed)
        "sliced": torch.randn((*shape[:-1], n + 9))[..., 3:n + 3],
        # leading dims permuted: no [M, N] view exists
        "permuted": torch.randn((shape[-2], *shape[:-2], n)).movedim(0, -2) if len(shape) > 2
        else torch.randn(shape),
    }
    for name, x in views.items():
        assert x.shape == shape, name
        dy = torch.randn(shape).transpose(0, 1).contiguous().transpose(0, 1)  # a non-contiguous gradient
        y, dx, dw = _run(x, w, 0.5, dy)
        y_ref, dx_ref, dw_ref = _reference(x, w, 0.5, dy)
        _assert_close(y, y_ref, 1e-5, f"{name} y")
        _assert_close(dx, dx_ref, 1e-5, f"{name} dx")
        _assert_close(dw, dw_ref, 1e-5, f"{name} dw")


def test_broadcast_gradient_from_sum() -> None:
    """y.sum().backward() hands the kernel an expanded gradient (all strides 0)."""
    x = torch.randn(9, 41, requires_grad=True)
    w = torch.randn(41, requires_grad=True)
    rms_norm(x, w, EPS, 0.3).sum().backward()
    _, dx_ref, dw_ref = _reference(x, w, 0.3, torch.ones(9, 41))
    _assert_close(x.grad, dx_ref, 1e-5, "dx")
    _assert_close(w.grad, dw_ref, 1e-5, "dw")


@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_any_weight_layout(layout: str) -> None:
    """A weight that is a strided view (every other element) or an expansion (stride 0) of another tensor."""
    n = 96
    base = torch.randn(2 * n if layout == "strided" else 1, dtype=torch.float64).float().requires_grad_()
    weight = base[::2] if layout == "strided" else base.expand(n)
    assert not weight.is_contiguous()
    x, r, dy = torch.randn(7, n), torch.randn(7, n), torch.randn(7, n)
    y_ref, dx_ref, dw_ref = _reference(x, weight.detach().contiguous(), 0.5, dy)
    xg = x.clone().requires_grad_()
    y = rms_norm(xg, weight, EPS, 0.5)
    y.backward(dy)
    _assert_close(y, y_ref, 1e-5, "y")
    _assert_close(xg.grad, dx_ref, 1e-5, "dx")
    expected_base_grad = (torch.stack([dw_ref, torch.zeros_like(dw_ref)], 1).flatten() if layout == "strided"
                          else dw_ref.sum(0, keepdim=True))
    _assert_close(base.grad, expected_base_grad, 1e-5, "d(weight's base)")
    y2, h = add_rms_norm(x, r, weight.detach(), EPS, 0.5)
    _assert_close(y2, _reference(x + r, weight.detach().contiguous(), 0.5, dy)[0], 1e-5, "fused y")


def test_launch_makes_the_tensors_device_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton launches on the current CUDA device: a launch for cuda:1 must run with cuda:1 made current."""
    current = [torch.device("cuda", 0)]

    @contextlib.contextmanager
    def device_guard(device):
        previous = current[0]
        current[0] = torch.device(device)
        yield
        current[0] = previous

    launched_on = []

    class RecordingKernel:
        def __getitem__(self, grid):
            return lambda *args, **options: launched_on.append(current[0])

    monkeypatch.setattr(torch.cuda, "device", device_guard)
    rmsnorm_triton.KernelLaunch(grid=(1,), args=(), options={}, device=torch.device("cuda", 1)).run(RecordingKernel())
    assert launched_on == [torch.device("cuda", 1)] and current[0] == torch.device("cuda", 0)
    # The planners record where the tensors live, which is what the guard makes current.
    x = torch.randn(4, 32)
    _, _, rstd, forward = rmsnorm_triton.plan_fwd(x, None, torch.ones(32), EPS, 32)
    _, _, _, backward = rmsnorm_triton.plan_bwd(torch.randn(4, 32), x, torch.ones(32), rstd, 32)
    assert forward.device == backward.device == x.device


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_zero_and_huge_rows(dtype: torch.dtype) -> None:
    n = 512
    x = torch.randn(6, n, dtype=dtype)
    x[0] = 0                                     # r = rsqrt(eps): no NaN, y = 0
    x[1] = torch.randn(n, dtype=dtype) * 1e4     # x^2 = 1e8 overflows fp16: statistics must be fp32
    x[2, :] = 6e4 if dtype == torch.float16 else 1e17  # near the largest squares fp32 can sum over 512
    x[3, 0] = 1e4                                # one spike
    w, dy = torch.randn(n), torch.randn(6, n, dtype=dtype)
    y, dx, dw = _run(x, w, 1.0, dy)
    y_ref, dx_ref, dw_ref = _reference(x, w, 1.0, dy)
    assert torch.equal(y[0], torch.zeros(n, dtype=dtype))
    for row in range(6):
        _assert_close(y[row], y_ref[row], TOL[dtype], f"y row {row}")
        _assert_close(dx[row], dx_ref[row], TOL[dtype], f"dx row {row}")
    _assert_close(dw, dw_ref, 1e-5, "dw")
    # The zero row's gradient is rsqrt(eps) * dy * w exactly as the formula says.
    _assert_close(dx[0], dy[0].double() * w.double() / math.sqrt(EPS), TOL[dtype], "zero-row dx")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_gradient_is_deterministic(dtype: torch.dtype) -> None:
    x, dy, w = torch.randn(256, 1128, dtype=dtype), torch.randn(256, 1128, dtype=dtype), torch.randn(1128)
    first, second = _run(x, w, 1.0, dy), _run(x, w, 1.0, dy)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_longest_kernel_row_and_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    launches = []
    kernels = rmsnorm_triton._kernels
    monkeypatch.setattr(rmsnorm_triton, "_kernels", lambda: launches.append(1) or kernels())
    x, w, dy = torch.randn(2, MAX_N), torch.rand(MAX_N) + 0.5, torch.randn(2, MAX_N)
    y, dx, dw = _run(x, w, 0.01, dy)
    assert len(launches) == 2  # the widest row the kernels take: forward and backward ran in Triton
    y_ref, dx_ref, dw_ref = _reference(x, w, 0.01, dy)
    _assert_close(y, y_ref, 1e-5, "y")
    _assert_close(dx, dx_ref, 1e-5, "dx")
    _assert_close(dw, dw_ref, 1e-5, "dw")
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(3, 8), torch.ones(9), EPS)
    with pytest.raises(ValueError, match="p="):
        rms_norm(torch.randn(3, 8), torch.ones(8), EPS, 0.0)
    with pytest.raises(ValueError, match=str(MAX_N)):  # the planners themselves never take a wider row
        rmsnorm_triton.plan_fwd(torch.randn(1, MAX_N + 1), None, torch.ones(MAX_N + 1), EPS, 1)


@pytest.mark.parametrize("n", [MAX_N + 1, 4 * MAX_N + 3])
def test_rows_wider_than_the_kernel_take_the_torch_path(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Wider rows would spill on a GPU: they are computed by the PyTorch formula, in blocks of rows, with the
    kernels' semantics (rounded h, fp32 statistics, both residual dtypes, deterministic dW)."""
    monkeypatch.setattr(rmsnorm_triton, "_kernels", lambda: pytest.fail("a Triton kernel was launched"))
    monkeypatch.setattr(rmsnorm_triton, "_TORCH_BLOCK_ELEMENTS", 3 * n)  # blocks of 3 rows over 7: a short last one
    x, w, dy = torch.randn(7, n), torch.rand(n) + 0.5, torch.randn(7, n)
    y, dx, dw = _run(x, w, 0.01, dy)
    y_ref, dx_ref, dw_ref = _reference(x, w, 0.01, dy)
    _assert_close(y, y_ref, 1e-5, "y")
    _assert_close(dx, dx_ref, 1e-5, "dx")
    _assert_close(dw, dw_ref, 1e-5, "dw")
    assert torch.equal(dw, _run(x, w, 0.01, dy)[2])

    xb = torch.randn(7, n, dtype=torch.bfloat16, requires_grad=True)
    res = torch.randn(7, n, requires_grad=True)
    wg = w.clone().requires_grad_()
    y, h = add_rms_norm(xb, res, wg, EPS, 0.5)
    dh = torch.randn(7, n)
    torch.autograd.backward((y, h), (dy, dh))
    assert y.dtype == h.dtype == torch.float32 and torch.equal(h, xb.detach().float() + res.detach())
    y_ref, dsum_ref, dw_ref = _reference(h, w, 0.5, dy)
    _assert_close(y, y_ref, 1e-5, "fused y")
    _assert_close(res.grad, dsum_ref + dh.double(), 1e-5, "dresidual")
    _assert_close(xb.grad, dsum_ref + dh.double(), TOL[torch.bfloat16], "dx")
    _assert_close(wg.grad, dw_ref, 1e-5, "fused dw")


@pytest.mark.parametrize("n", [96, 768, 4096])
def test_gpu_launch_configuration(n: int) -> None:
    """The block sizes, warps and backward grid chosen for an H100 (132 SMs), run by the interpreter."""
    h100 = rmsnorm_triton.LaunchTarget(sm_count=132)
    assert rmsnorm_triton.bwd_programs(32768, 8, h100) == (256, 128)  # 2 per SM, chunks rounded up to BLOCK_M
    block_n, block_m, _ = rmsnorm_triton.block_config(n, h100)
    assert block_n >= n and block_m * block_n <= 4096
    x, w, dy = torch.randn(150, n), torch.randn(n), torch.randn(150, n)
    r = torch.randn(150, n)
    k = partial_size(n, 0.5)
    y, h, rstd = rmsnorm_triton.rms_norm_fwd(x, r, w, EPS, k, target=h100)
    dh = torch.randn(150, n)
    dx, dr, dw = rmsnorm_triton.rms_norm_bwd(dy, h, w, rstd, k, dh=dh, dr_dtype=torch.float32, target=h100)
    assert torch.equal(h, x + r)
    y_ref, dx_ref, dw_ref = _reference(h, w, 0.5, dy)
    _assert_close(y, y_ref, 1e-5, "y")
    _assert_close(dx, dx_ref + dh.double(), 1e-5, "dx")
    assert torch.equal(dr, dx)
    _assert_close(dw, dw_ref, 1e-5, "dw")


@pytest.mark.parametrize("tuning", [
    rmsnorm_triton.LaunchTuning(bwd_programs_per_sm=1),
    rmsnorm_triton.LaunchTuning(fwd_warps=4, bwd_warps=4, bwd_programs_per_sm=4, bwd_stages=3),
], ids=["1-per-sm", "4-per-sm-3-stages"])
def test_swept_launch_configurations_compute_the_same(tuning: rmsnorm_triton.LaunchTuning) -> None:
    """The GPU sweep's grids (programs per SM) split the rows differently; every split gives the same result."""
    h100 = rmsnorm_triton.LaunchTarget(sm_count=132)
    x, w, dy = torch.randn(700, 512), torch.randn(512), torch.randn(700, 512)
    y, _, rstd = rmsnorm_triton.rms_norm_fwd(x, None, w, EPS, 512, target=h100, tuning=tuning)
    dx, _, dw = rmsnorm_triton.rms_norm_bwd(dy, x, w, rstd, 512, target=h100, tuning=tuning)
    programs, _ = rmsnorm_triton.bwd_programs(700, 8, h100, tuning)
    assert programs == min(700 // 8 + 1, tuning.bwd_programs_per_sm * 132)
    y_ref, dx_ref, dw_ref = _reference(x, w, 1.0, dy)
    _assert_close(y, y_ref, 1e-5, "y")
    _assert_close(dx, dx_ref, 1e-5, "dx")
    _assert_close(dw, dw_ref, 1e-5, "dw")


def test_empty_input() -> None:
    x = torch.randn(0, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    y = rms_norm(x, w, EPS)
    y.sum().backward()
    assert y.shape == (0, 64) and torch.equal(w.grad, torch.zeros(64))


def test_gradcheck_fp64() -> None:
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-6, 0.3), (x, w))
    assert torch.autograd.gradcheck(lambda x, r, w: add_rms_norm(x, r, w, 1e-6, 0.3), (x, r, w))


# ------------------------------------------------------------------------------------ fused residual variant


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,m,p", [(41, 7, 1.0), (96, 199, 0.25), (1128, 64, 0.0625), (512, 256, 1.0)])
def test_add_rms_norm_matches_fp64(dtype: torch.dtype, n: int, m: int, p: float) -> None:
    x = torch.randn(m, n, dtype=dtype, requires_grad=True)
    res = (torch.randn(m, n, dtype=dtype) * 2).requires_grad_()
    w = torch.randn(n, requires_grad=True)
    dy, dh = torch.randn(m, n, dtype=dtype), torch.randn(m, n, dtype=dtype)
    dy_copy, dh_copy = dy.clone(), dh.clone()
    y, h = add_rms_norm(x, res, w, EPS, p)

    # h is the rounded sum; y is the norm of exactly that h (what the unfused path computes).
    if dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16: at most one bf16 step off
        _assert_close(h, x.detach().double() + res.detach().double(), 2 ** -7, "h")
    else:
        assert torch.equal(h, x.detach() + res.detach())
    assert torch.equal(y, rms_norm(h.detach(), w.detach(), EPS, p))

    torch.autograd.backward((y, h), (dy, dh))
    y_ref, dh_norm_ref, dw_ref = _reference(h, w, p, dy)
    dsum_ref = dh_norm_ref + dh.double()
    tol = TOL[dtype]
    _assert_close(y, y_ref, tol, "y")
    _assert_close(x.grad, dsum_ref, tol, "dx")
    _assert_close(res.grad, dsum_ref, tol, "dresidual")
    _assert_close(w.grad, dw_ref, 1e-5, "dw")
    # The leaves' .grad are separate tensors (autograd copies a gradient it hands to two leaves), and the
    # incoming gradients are left as they were.
    assert x.grad.data_ptr() != res.grad.data_ptr()
    assert torch.equal(dy, dy_copy) and torch.equal(dh, dh_copy)


def test_add_rms_norm_mixed_dtypes_and_unused_sum() -> None:
    """bf16 sublayer output + fp32 residual stream: h and y are fp32, each input's gradient keeps its dtype."""
    x = torch.randn(10, 96, dtype=torch.bfloat16, requires_grad=True)
    res = torch.randn(10, 96, requires_grad=True)
    w = torch.randn(96, requires_grad=True)
    y, h = add_rms_norm(x, res, w, EPS, 0.5)
    assert y.dtype == h.dtype == torch.float32
    dy = torch.randn(10, 96)
    y.backward(dy)  # h unused: its gradient is absent
    _, dx_ref, dw_ref = _reference(x.double() + res.double(), w, 0.5, dy)
    assert x.grad.dtype == torch.bfloat16 and res.grad.dtype == torch.float32
    _assert_close(res.grad, dx_ref, 1e-5, "dresidual")
    _assert_close(x.grad, dx_ref, TOL[torch.bfloat16], "dx")
    _assert_close(w.grad, dw_ref, 1e-5, "dw")
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(torch.randn(3, 8), torch.randn(4, 8), torch.ones(8), EPS)


class _BackwardSpy:
    """Records the arguments of every backward launch (rmsnorm_triton.rms_norm_bwd) the custom ops make."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[dict] = []
        original = rmsnorm_triton.rms_norm_bwd

        def spy(dy, x, weight, rstd, k, dh=None, dx_dtype=None, dr_dtype=None, **kwargs):
            self.calls.append({"dh": dh, "dx_dtype": dx_dtype, "dr_dtype": dr_dtype})
            return original(dy, x, weight, rstd, k, dh=dh, dx_dtype=dx_dtype, dr_dtype=dr_dtype, **kwargs)

        monkeypatch.setattr(rmsnorm_triton, "rms_norm_bwd", spy)


def test_unused_sum_gets_no_zero_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """When h is not used, its gradient stays None: no M x N zero tensor is made and read."""
    spy = _BackwardSpy(monkeypatch)
    x, res = torch.randn(6, 64, requires_grad=True), torch.randn(6, 64, requires_grad=True)
    y, _h = add_rms_norm(x, res, torch.randn(64, requires_grad=True), EPS)
    y.backward(torch.randn(6, 64))
    assert len(spy.calls) == 1 and spy.calls[0]["dh"] is None


def test_only_the_sum_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """y unused: the sum's gradient passes straight to both inputs; no kernel runs and the weight gets none."""
    spy = _BackwardSpy(monkeypatch)
    x = torch.randn(5, 48, dtype=torch.bfloat16, requires_grad=True)
    res = torch.randn(5, 48, requires_grad=True)
    w = torch.randn(48, requires_grad=True)
    _y, h = add_rms_norm(x, res, w, EPS)
    dh = torch.randn(5, 48)
    h.backward(dh)
    assert spy.calls == [] and w.grad is None
    assert torch.equal(res.grad, dh) and torch.equal(x.grad, dh.to(torch.bfloat16))


def test_one_gradient_store_shared_by_both_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal dtypes: the kernel writes dL/dh once and autograd receives that one tensor for x and residual
    (as for autograd's own x + residual); a second copy is written only for a residual of another dtype."""
    spy = _BackwardSpy(monkeypatch)
    source = torch.randn(4, 64, requires_grad=True)
    x, res = source * 2, source * 3  # non-leaf inputs, so their incoming gradients can be observed
    seen = []
    x.register_hook(seen.append)
    res.register_hook(seen.append)
    w = torch.randn(64)
    y, _h = add_rms_norm(x, res, w, EPS)
    y.sum().backward()
    assert spy.calls[0]["dr_dtype"] is None
    assert len(seen) == 2 and seen[0].data_ptr() == seen[1].data_ptr()
    _, dsum_ref, _ = _reference((x + res).detach(), w, 1.0, torch.ones(4, 64))
    _assert_close(source.grad, 5 * dsum_ref, 1e-5, "d(source) = 2 * dsum + 3 * dsum")

    mixed_x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    add_rms_norm(mixed_x, torch.randn(4, 64, requires_grad=True), w, EPS)[0].sum().backward()
    assert spy.calls[1]["dr_dtype"] == torch.float32 and spy.calls[1]["dx_dtype"] == torch.bfloat16


def test_shared_gradient_survives_accumulation() -> None:
    """Leaves that already hold a .grad, two backward passes, then an in-place update of one leaf's .grad: the
    other input's gradient must not change (no storage is shared between them)."""
    torch.manual_seed(3)
    x0, r0, w0 = torch.randn(9, 41), torch.randn(9, 41), torch.randn(41)
    c1, c2 = torch.randn(9, 41), torch.randn(9, 41)

    def run(fused: bool):
        x, r, w = (t.double().clone().requires_grad_() for t in (x0, r0, w0))
        x.grad, r.grad = torch.ones_like(x), torch.full_like(r, 2.0)
        for _ in range(2):
            if fused:
                y, h = add_rms_norm(x, r, w, EPS, 0.5)
            else:
                h = x + r
                k = _k(41, 0.5)
                y = h * torch.rsqrt(h[..., :k].pow(2).mean(-1, keepdim=True) + EPS) * w
            (y * c1 + h * c2).sum().backward()
        return x, r, w

    fused, reference = run(True), run(False)
    for a, b in zip(fused, reference):
        torch.testing.assert_close(a.grad, b.grad)
    x, r, _ = fused
    before = r.grad.clone()
    x.grad.mul_(10)
    assert torch.equal(r.grad, before)


def test_residual_gradients_accumulate_correctly_in_a_block() -> None:
    """Pre-LN wiring: both gradients land on the same upstream tensor; autograd must sum them, not alias."""
    def block(x0, w, use_kernel):
        a = torch.tanh(x0 * 1.5)                   # the "sublayer" output, also a function of x0
        y, h = add_rms_norm(a, x0, w, EPS, 0.5) if use_kernel else (None, a + x0)
        if not use_kernel:
            k = _k(h.shape[-1], 0.5)
            y = h * torch.rsqrt(h[..., :k].pow(2).mean(-1, keepdim=True) + EPS) * w
        return (y * torch.cos(h)).sum()
    x0 = torch.randn(16, 41, dtype=torch.float64)
    w = torch.randn(41, dtype=torch.float64)
    grads = []
    for use_kernel in (True, False):
        xg, wg = x0.clone().requires_grad_(), w.clone().requires_grad_()
        block(xg, wg, use_kernel).backward()
        grads.append((xg.grad, wg.grad))
    torch.testing.assert_close(grads[0], grads[1])


# -------------------------------------------------------------------- custom ops, compile, autocast, impls


def test_opcheck_custom_ops() -> None:
    ops = torch.ops.mininorm
    torch.library.opcheck(ops.rms_norm_fwd.default, (torch.randn(7, 41, requires_grad=True),
                                                     torch.randn(41, requires_grad=True), 1e-6, 11))
    torch.library.opcheck(ops.add_rms_norm_fwd.default,
                          (torch.randn(3, 5, 32, dtype=torch.bfloat16, requires_grad=True),
                           torch.randn(3, 5, 32, requires_grad=True), torch.randn(32, requires_grad=True),
                           1e-6, 32))
    x, w = torch.randn(6, 24), torch.randn(24)
    _, rstd = ops.rms_norm_fwd(x, w, 1e-6, 5)
    torch.library.opcheck(ops.rms_norm_bwd.default, (torch.randn(6, 24), x, w, rstd, 5))
    torch.library.opcheck(ops.add_rms_norm_bwd.default, (torch.randn(6, 24), None, x, w, rstd, 5, torch.float32))
    torch.library.opcheck(ops.add_rms_norm_bwd.default,
                          (torch.randn(6, 24), torch.randn(6, 24), x, w, rstd, 5, torch.float32))
    torch.library.opcheck(ops.add_rms_norm_bwd_split.default,
                          (torch.randn(6, 24), None, x, w, rstd, 5, torch.bfloat16, torch.float32))


def test_torch_compile_fullgraph() -> None:
    """The custom ops trace into one graph (fake impls) and the compiled function runs the kernels."""
    def f(x, res, w1, w2):
        y, h = add_rms_norm(x * 2, res, w1, EPS, 0.5)
        return rms_norm(torch.relu(y) + h, w2, EPS).sum()
    args = [torch.randn(4, 6, 64, requires_grad=True) for _ in range(2)] + \
           [torch.randn(64, requires_grad=True) for _ in range(2)]
    eager_out = f(*args)
    eager_grads = torch.autograd.grad(eager_out, args)
    torch._dynamo.reset()
    compiled_out = torch.compile(f, fullgraph=True)(*args)
    compiled_grads = torch.autograd.grad(compiled_out, args)
    torch.testing.assert_close(compiled_out, eager_out)
    torch.testing.assert_close(compiled_grads, eager_grads)


def test_autocast_passes_inputs_through() -> None:
    lin = torch.nn.Linear(64, 64)
    w = torch.ones(64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = lin(torch.randn(5, 64))
        y = rms_norm(a, w, EPS, 0.5)
        y2, h = add_rms_norm(a, torch.randn(5, 64), w, EPS)
    assert a.dtype == y.dtype == torch.bfloat16 and y2.dtype == h.dtype == torch.float32
    (y.float().sum() + y2.sum()).backward()
    assert w.grad.dtype == torch.float32 and lin.weight.grad is not None


def test_norm_impl_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    from model.norms import RMSNorm, resolve_norm_impl
    cpu = torch.device("cpu")
    assert resolve_norm_impl("triton", cpu) == "triton"  # interpreter on
    assert resolve_norm_impl("auto", cpu) == "compile"   # auto never picks the interpreter
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="triton"):
        resolve_norm_impl("triton", cpu)
    with pytest.raises(RuntimeError, match="triton"):
        RMSNorm(32, impl="triton")(torch.randn(2, 32))


@pytest.mark.parametrize("p", [1.0, 0.25])
def test_rmsnorm_module_triton_equals_eager(p: float) -> None:
    from model.norms import RMSNorm
    eager, fused = RMSNorm(96, EPS, p, "eager"), RMSNorm(96, EPS, p, "triton")
    with torch.no_grad():
        eager.weight.normal_()
        fused.weight.copy_(eager.weight)
    x, res = torch.randn(3, 7, 96), torch.randn(3, 7, 96)
    torch.testing.assert_close(fused(x), eager(x))
    for a, b in zip(fused.add_and_norm(x, res), eager.add_and_norm(x, res)):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------------- the model


def _tiny_models(**overrides):
    from model.config import MiniNormConfig
    from model.model import MiniNormForCausalLM
    shape = dict(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, **overrides)
    eager = MiniNormForCausalLM(MiniNormConfig(**shape, norm_impl="eager"))
    with torch.no_grad():  # random gains so the norm weights matter
        for name, param in eager.named_parameters():
            if param.ndim == 1:
                param.normal_(1.0, 0.3)
    fused = MiniNormForCausalLM(MiniNormConfig(**shape, norm_impl="triton"))
    fused.load_state_dict(eager.state_dict())
    return eager, fused


@pytest.mark.parametrize("overrides", [
    dict(norm_type="rmsnorm", norm_placement="pre"),
    dict(norm_type="prmsnorm", prms_p=0.25, norm_placement="pre", qk_norm=True),
    dict(norm_type="rmsnorm", norm_placement="sandwich"),
], ids=["rms-pre", "prms-pre-qk", "rms-sandwich"])
def test_model_triton_matches_eager(overrides: dict) -> None:
    eager, fused = _tiny_models(**overrides)
    ids = torch.randint(0, 101, (2, 13))
    out_e, out_f = eager(ids, labels=ids), fused(ids, labels=ids)
    torch.testing.assert_close(out_f.logits, out_e.logits, rtol=1e-4, atol=1e-5)
    out_e.loss.backward()
    out_f.loss.backward()
    for (name, pe), pf in zip(eager.named_parameters(), fused.parameters()):
        torch.testing.assert_close(pf.grad, pe.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_model_triton_compiles_fullgraph() -> None:
    """torch.compile(fullgraph=True) of the whole model with the kernel inside (aot_eager: the graph capture and
    AOTAutograd are what matter here; inductor's C++ codegen only adds CPU compile time)."""
    eager, fused = _tiny_models(norm_type="prmsnorm", prms_p=0.5)
    ids = torch.randint(0, 101, (2, 9))
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    out_c = compiled(ids, labels=ids)
    out_e = eager(ids, labels=ids)
    torch.testing.assert_close(out_c.logits, out_e.logits, rtol=1e-4, atol=1e-5)
    out_c.loss.backward()
    out_e.loss.backward()
    for (name, pe), pc in zip(eager.named_parameters(), fused.parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-4, atol=1e-6, msg=name)
