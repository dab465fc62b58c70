"""Correctness of our RMSNorm kernels, kept apart from any timing: the kernels against fp32 autograd references
at LLM shapes (values, both gradients, a bit-identical rerun; plain and with the residual add; one case of more
than 2^31 elements), and the whole model with norm_impl="triton" against "eager" and under torch.compile. Each
prints a markdown table and returns whether everything passed. tests/unit/test_kernels.py checks the same on CPU
under the Triton interpreter, at small shapes."""

from __future__ import annotations

import torch

from eval.benchmarks.rmsnorm.methods import EPS
from model.norms import partial_size

CHECK_ROW_LENGTHS = [96, 512, 768, 1024, 2048, 4096, 8192, 16384]


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def _reference(h: torch.Tensor, w: torch.Tensor, k: int, dy: torch.Tensor):
    """fp32 autograd reference of y = h * rsqrt(mean(h[:, :k]^2) + eps) * w (h already rounded)."""
    hf = h.detach().float().requires_grad_()
    wf = w.detach().float().requires_grad_()
    y = hf * torch.rsqrt(hf[:, :k].pow(2).mean(-1, keepdim=True) + EPS) * wf
    y.backward(dy.float())
    return y.detach(), hf.grad, wf.grad


def _chunked_errors(h: torch.Tensor, w: torch.Tensor, k: int, dy: torch.Tensor, y: torch.Tensor,
                    dx: torch.Tensor, dw: torch.Tensor, rows: int = 1 << 16) -> tuple[float, float, float]:
    """Relative max errors of (y, dx, dw) against the fp32 reference, computed a block of rows at a time so that
    inputs of more than 2^31 elements fit next to their reference."""
    y_err = dx_err = 0.0
    y_scale = dx_scale = 0.0
    dw_ref = torch.zeros(w.shape, dtype=torch.float64, device=w.device)
    for start in range(0, h.shape[0], rows):
        part = slice(start, start + rows)
        y_ref, dx_ref, dw_part = _reference(h[part], w, k, dy[part])
        y_err = max(y_err, (y[part].float() - y_ref).abs().max().item())
        dx_err = max(dx_err, (dx[part].float() - dx_ref).abs().max().item())
        y_scale, dx_scale = max(y_scale, y_ref.abs().max().item()), max(dx_scale, dx_ref.abs().max().item())
        dw_ref += dw_part.double()
    return y_err / y_scale, dx_err / dx_scale, _rel_err(dw, dw_ref.float())


def check(shapes: list[tuple[int, int]], dtype: torch.dtype, tol: float,
          device: torch.device, ps: tuple[float, ...] = (1.0, 0.0625)) -> bool:
    """Our kernels against fp32 references; dW and dx determinism; the fused residual variant."""
    from model.kernels import add_rms_norm, rms_norm
    ok = True
    print("| M | N | p | variant | weight | y err | dx err | dw err | bit-identical rerun | result |")
    print("|---:|---:|---:|---|---|---:|---:|---:|---|---|")
    for m, n in shapes:
        for p in ps:
            for residual in (False, True):
                for w_dtype in dict.fromkeys((dtype, torch.float32)):
                    torch.manual_seed(m * 31 + n)
                    k = partial_size(n, p)
                    x = torch.randn(m, n, device=device, dtype=dtype) * 2
                    r = torch.randn(m, n, device=device, dtype=dtype) if residual else None
                    w = (torch.rand(n, device=device) + 0.5).to(w_dtype)
                    dy = torch.randn(m, n, device=device, dtype=dtype)
                    dws, dxs = [], []
                    for _ in range(2):
                        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
                        if residual:
                            y, h = add_rms_norm(xg, r, wg, EPS, p)
                        else:
                            y, h = rms_norm(xg, wg, EPS, p), x
                        y.backward(dy)
                        dws.append(wg.grad)
                        dxs.append(xg.grad)
                        del xg, wg
                    errs = _chunked_errors(h, w, k, dy, y, dxs[0], dws[0])
                    same = torch.equal(dws[0], dws[1]) and torch.equal(dxs[0], dxs[1])
                    good = same and all(e <= tol for e in errs) and y.dtype == dtype and dws[0].dtype == w_dtype
                    ok &= good
                    print(f"| {m} | {n} | {p} | {'add+norm' if residual else 'norm'} | "
                          f"{str(w_dtype).removeprefix('torch.')} | {errs[0]:.2e} | {errs[1]:.2e} | {errs[2]:.2e} "
                          f"| {same} | {'PASS' if good else 'FAIL'} |", flush=True)
                    del x, r, w, dy, y, h, dws, dxs
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    return ok


def check_model(device: torch.device, preset: str = "minimind-26m", batch: int = 4, seq_len: int = 256) -> bool:
    """The model with norm_impl="triton" against "eager" (same weights, same batch): logits, loss and every
    parameter's gradient, in fp32 and under bf16 autocast; then the triton model under
    torch.compile(fullgraph=True) against itself uncompiled."""
    from model.config import MiniNormConfig
    from model.model import MiniNormForCausalLM

    def run(model, ids, autocast: bool):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(ids, labels=ids)
        out.loss.backward()
        params = getattr(model, "_orig_mod", model).named_parameters()  # a compiled model wraps the original
        return out.logits.float(), out.loss.float(), {n: p.grad.float() for n, p in params}

    def compare(name: str, a, b, tol: float) -> bool:
        errs = [_rel_err(a[0], b[0]), _rel_err(a[1], b[1])]
        grad_errs = {n: _rel_err(a[2][n], b[2][n]) for n in b[2]}
        worst = max(grad_errs, key=grad_errs.get)
        good = max(errs + list(grad_errs.values())) <= tol
        print(f"| {name} | {errs[0]:.2e} | {errs[1]:.2e} | {grad_errs[worst]:.2e} ({worst}) | {tol:g} | "
              f"{'PASS' if good else 'FAIL'} |", flush=True)
        return good

    torch.manual_seed(0)
    eager = MiniNormForCausalLM(MiniNormConfig.from_preset(preset, norm_impl="eager")).to(device)
    with torch.no_grad():  # random gains, so that a wrong weight gradient cannot hide behind w = 1
        for param in eager.parameters():
            if param.ndim == 1:
                param.normal_(1.0, 0.2)
    fused = MiniNormForCausalLM(MiniNormConfig.from_preset(preset, norm_impl="triton")).to(device)
    fused.load_state_dict(eager.state_dict())
    ids = torch.randint(0, eager.config.vocab_size, (batch, seq_len), device=device)
    print(f"{preset}, batch {batch} x {seq_len}: relative max errors against the reference\n")
    print("| comparison | logits | loss | worst gradient | tolerance | result |")
    print("|---|---:|---:|---|---:|---|")
    ok = compare("triton vs eager, fp32", run(fused, ids, False), run(eager, ids, False), 1e-4)
    ok &= compare("triton vs eager, bf16 autocast", run(fused, ids, True), run(eager, ids, True), 3e-2)
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True)
    ok &= compare("compiled(fullgraph) triton vs triton, bf16 autocast", run(compiled, ids, True),
                  run(fused, ids, True), 3e-2)
    return ok


def big_shape(device: torch.device, dtype: torch.dtype) -> tuple[int, int] | None:
    """A shape of more than 2^31 elements (64-bit offsets) that fits the device: about 6 tensors of it live."""
    n = 4096
    m = (1 << 31) // n + 64
    need = 7 * m * n * torch.finfo(dtype).bits // 8
    if device.type != "cuda" or torch.cuda.mem_get_info(device)[0] < need:
        return None
    return m, n


def check_kernels(ns: list[int] | None, m: int | None, dtype: torch.dtype, device: torch.device,
                  big: bool = True) -> bool:
    """--check: our kernels at row lengths `ns` (default CHECK_ROW_LENGTHS) and M = `m` (default 1, 1000 and
    32768), plus, when `big` and the device has the memory, one case of more than 2^31 elements."""
    shapes = [(mm, n) for n in (ns or CHECK_ROW_LENGTHS) for mm in ([m] if m else [1, 1000, 32768])]
    # bf16 on the interpreter: fp32 -> bf16 casts truncate there (GPUs round), hence its looser bound.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3,
           torch.bfloat16: 1e-2 if device.type == "cuda" else 2e-2}[dtype]
    ok = check(shapes, dtype, tol, device)
    big_case = big_shape(device, dtype) if big else None
    if big_case is not None:
        print(f"\nM*N = {big_case[0] * big_case[1]:,} > 2^31 (64-bit offsets):\n")
        ok &= check([big_case], dtype, tol, device, ps=(1.0,))
    elif big:
        print("\n(the case of more than 2^31 elements needs a CUDA device with more free memory: not run)")
    return ok
