"""The CUDA kernels of the fused cross-entropy (csrc/cross_entropy_cuda.cu) against the CPU kernels.

The CPU kernels (csrc/cross_entropy_cpu.cpp, tested against the pure-PyTorch reference in
test_cross_entropy_ops.py) are the specification. On a machine with a CUDA GPU these tests check that
the forward (loss, (max, log-sum) pairs) and the backward (with and without grad_logits) match the CPU
kernels for vocabularies below a warp, around the block (256 threads x 4 per tile) and LM-sized, every
reduction, label smoothing, strided rows, fp32 / fp16 / bf16 / fp64; that the ops run on CUDA through
autograd like on the CPU; and that a target out of range gives NaN there (the CPU raises).
Tolerances as in test_emulated_cuda_cross_entropy.py. Without a GPU every test is skipped.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from conftest import rel_err  # noqa: E402

DEV = "cuda"
IGNORE = -100
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.fixture(scope="module")
def ext():
    from dmfx.cuda_ops import build

    return build.load("cpu"), build.load("cuda")


def _close(got, want, tol, what):
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, what
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN positions differ"
    fin = torch.isfinite(want)
    if fin.any():
        assert rel_err(got[fin], want[fin]) <= tol, f"{what}: {rel_err(got[fin], want[fin])}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [5, 255, 1025, 32000, 50257])
def test_matches_cpu(ext, V, dtype):
    cpu, cuda = ext
    gen = torch.Generator().manual_seed(V)
    N = 64 if V < 32000 else 16
    logits = (torch.randn(N, V + 3, generator=gen, dtype=torch.float64) * 3).to(dtype)[:, 1:V + 1]
    target = torch.randint(0, V, (N,), generator=gen)
    target[::5] = IGNORE
    stat_tol = TOL[torch.float64] if dtype == torch.float64 else TOL[torch.float32]
    for eps, reduction in ((0.0, 1), (0.1, 0), (0.0, 2)):
        what = f"V={V} {dtype} eps={eps} reduction={reduction}"
        want = cpu.cross_entropy_fwd(logits, target, IGNORE, eps, reduction)
        got = cuda.cross_entropy_fwd(logits.to(DEV), target.to(DEV), IGNORE, eps, reduction)
        _close(got[0], want[0], stat_tol, f"{what} loss")
        _close(got[1], want[1], stat_tol, f"{what} lse")
        g = torch.randn(want[0].shape, generator=gen, dtype=want[0].dtype)
        gl = torch.randn(N, V, generator=gen).to(dtype) if reduction == 0 else None
        d_want = cpu.cross_entropy_bwd(g, logits, target, want[1], IGNORE, eps, reduction, gl)
        d_got = cuda.cross_entropy_bwd(g.to(DEV), logits.to(DEV), target.to(DEV), want[1].to(DEV), IGNORE, eps,
                                       reduction, None if gl is None else gl.to(DEV))
        _close(d_got, d_want, TOL[dtype], f"{what} dlogits")


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_matches_cpu(ext, dtype):
    """cross_entropy_bwd of soft-capped logits (softcap > 0: the raw logits' gradient) against the CPU
    kernel: strided rows, ignored rows with and without grad_logits, every reduction."""
    cpu, cuda = ext
    gen = torch.Generator().manual_seed(3)
    N, V, cap = 48, 1025, 30.0
    wide = cap * torch.tanh(torch.randn(N, V + 3, generator=gen, dtype=torch.float64) * 25 / cap)
    logits = wide.clamp(-0.99 * cap, 0.99 * cap).to(dtype)[:, 1:V + 1]
    target = torch.randint(0, V, (N,), generator=gen)
    target[::5] = IGNORE
    for eps, reduction, with_gl in ((0.0, 1, True), (0.1, 0, False), (0.1, 2, True)):
        lse = cpu.cross_entropy_fwd(logits, target, IGNORE, eps, reduction)[1]
        g = torch.randn(N if reduction == 0 else (), generator=gen, dtype=lse.dtype)
        gl = torch.randn(N, V, generator=gen).to(dtype) if with_gl else None
        want = cpu.cross_entropy_bwd(g, logits, target, lse, IGNORE, eps, reduction, gl, cap)
        got = cuda.cross_entropy_bwd(g.to(DEV), logits.to(DEV), target.to(DEV), lse.to(DEV), IGNORE, eps, reduction,
                                     None if gl is None else gl.to(DEV), cap)
        _close(got, want, TOL[dtype], f"{dtype} eps={eps} reduction={reduction} grad_logits={with_gl} softcap={cap}")


def test_the_op_runs_through_autograd_on_cuda():
    import dmfx

    x = torch.randn(40, 1000, dtype=torch.float64)
    t = torch.randint(0, 1000, (40,))
    t[3] = IGNORE
    xc = x.to(DEV).float().requires_grad_()
    xr = x.float().requires_grad_()
    dmfx.cross_entropy(xc, t.to(DEV), label_smoothing=0.1).backward()
    dmfx.cross_entropy(xr, t, label_smoothing=0.1).backward()
    assert rel_err(xc.grad.cpu(), xr.grad) < 1e-5


def test_a_target_out_of_range_gives_nan():
    x, t = torch.randn(3, 40, device=DEV), torch.tensor([1, 40, IGNORE], device=DEV)
    loss, _ = torch.ops.dmfx.cross_entropy(x, t, IGNORE, 0.0, 0)
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1]) and loss[2] == 0


@pytest.mark.parametrize("in_forward, reduction", [(True, "mean"), (False, "mean"), (True, "sum"), (False, "none")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_matches_the_cpu(dtype, in_forward, reduction):
    """dmfx::linear_cross_entropy (a composite: ATen's GEMMs around this family's kernels; on CUDA dweight
    accumulates low-precision chunks by a GEMM into float32) on CUDA against the same op on the CPU."""
    import dmfx

    gen = torch.Generator().manual_seed(7)
    N, H, V = 300, 64, 5003
    h = torch.randn(N, H, generator=gen).to(dtype)
    w = (torch.randn(V, H, generator=gen) / H**0.5 * 3).to(dtype)
    b = torch.randn(V, generator=gen).to(dtype)
    t = torch.randint(0, V, (N,), generator=gen)
    t[::7] = IGNORE
    g = torch.randn(N if reduction == "none" else ())
    results = []
    for dev in ("cpu", DEV):
        leaves = [x.detach().to(dev).requires_grad_() for x in (h, w, b)]
        loss = dmfx.linear_cross_entropy(*leaves[:2], t.to(dev), leaves[2], reduction=reduction, chunk=128,
                                         grads_in_forward=in_forward)
        (loss * g.to(dev)).sum().backward()
        results.append([loss.detach(), *(x.grad for x in leaves)])
    tol = TOL[dtype] if dtype == torch.float32 else 2e-2
    for name, got, want in zip(("loss", "dhidden", "dweight", "dbias"), results[1], results[0]):
        _close(got, want, tol, f"{dtype} {reduction} in_forward={in_forward} {name}")
