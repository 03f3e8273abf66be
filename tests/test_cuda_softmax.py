"""The CUDA kernels of the fused attention softmax (csrc/softmax_cuda.cu) against the CPU kernels.

The CPU kernels (csrc/softmax_cpu.cpp, tested against the pure-PyTorch reference in
test_softmax_ops.py) are the specification. On a machine with a CUDA GPU these tests check that

* the dropout masks are bit-identical (out != 0 exactly where the Philox mask keeps, for both);
* softmax_fwd / softmax_bwd match the CPU kernels for every kernel path: one warp per row with
  8 or 32 elements per lane (Sk <= 256, <= 1024), the 4-wide vector path (Sk % 4 == 0, aligned rows)
  and the scalar path (odd Sk, unaligned slices), the block-per-row kernels (Sk > 1024);
  fp32, fp16, bf16, fp64; masks of every kind (none, HF padding, bool, same dtype, fp32 with bf16
  scores, one value per row); causal with Sq <= Sk and Sq > Sk; p in {0, 0.1, 1};
* fully masked rows give zeros and NaN propagates, like on the CPU;
* the torch.library ops run on CUDA through autograd and agree with the CPU;
* tensors on the wrong device are rejected with a clear error.

Tolerances: relative-norm error fp32 1e-5, fp64 1e-12, fp16 2e-3, bf16 1e-2 (both kernels compute in
fp32 / fp64 and round once; exp and summation order differ by a few ulps).

Without a GPU every test is skipped.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from conftest import rel_err, softmax_mask  # noqa: E402

DEV = "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
NEG = torch.finfo(torch.float32).min
SEED, OFFSET = 1234, 56


@pytest.fixture(scope="module")
def cpu_ext():
    from dmfx.cuda_ops import build

    return build.load("cpu")


@pytest.fixture(scope="module")
def cuda_ext():
    from dmfx.cuda_ops import build

    return build.load("cuda")


def _compare(got, expected, dtype, what):
    got = got.cpu()
    assert got.shape == expected.shape and got.dtype == expected.dtype, what
    if expected.numel() == 0:
        return
    assert torch.equal(torch.isnan(got), torch.isnan(expected)), f"{what}: NaN positions differ"
    fin = ~torch.isnan(expected)
    assert rel_err(got[fin], expected[fin]) <= TOL[dtype], f"{what}: rel err {rel_err(got[fin], expected[fin])}"


def _run_both(cpu_ext, cuda_ext, scores, mask, scale, causal, p, what):
    dtype = scores.dtype
    out_c, probs_c = cpu_ext.softmax_fwd(scores, mask, scale, causal, SEED, OFFSET, p)
    out_g, probs_g = cuda_ext.softmax_fwd(scores.to(DEV), None if mask is None else mask.to(DEV),
                                          scale, causal, SEED, OFFSET, p)
    _compare(out_g, out_c, dtype, f"{what} out")
    _compare(probs_g, probs_c, dtype, f"{what} probs")
    if p > 0 and scores.numel():
        nz = probs_c != 0
        assert torch.equal((out_g.cpu() != 0)[nz], (out_c != 0)[nz]), f"{what}: dropout masks differ"
    # backward on the forward's probabilities (or out when p == 0)
    saved_c = probs_c if p > 0 else out_c
    go = torch.randn(scores.shape).to(dtype)
    g_c = cpu_ext.softmax_bwd(go, saved_c, SEED, OFFSET, p, 0.7)
    g_g = cuda_ext.softmax_bwd(go.to(DEV), saved_c.to(DEV), SEED, OFFSET, p, 0.7)
    _compare(g_g, g_c, dtype, f"{what} grad")


SK = [1, 7, 33, 128, 256, 257, 1023, 1024, 1025, 2052]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Sk", SK)
def test_matches_cpu(cpu_ext, cuda_ext, Sk, dtype):
    gen = torch.Generator().manual_seed(Sk)
    shape = (2, 3, 5, Sk)
    scores = (torch.randn(shape, generator=gen) * 3).to(dtype)
    for kind in ("none", "padding", "bool", "same", "float", "rowconst"):
        mask = softmax_mask(kind, shape, dtype, gen)
        for causal, p in ((False, 0.0), (True, 0.1), (False, 1.0)):
            _run_both(cpu_ext, cuda_ext, scores, mask, 0.3, causal, p, f"Sk={Sk} {dtype} {kind} causal={causal} p={p}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Sk", [7, 128, 1025])
def test_backward_with_a_stored_mask(cpu_ext, cuda_ext, Sk, dtype):
    """native_dropout's bool mask instead of Philox (tests/test_emulated_cuda_softmax.py runs the same
    case on the emulation)."""
    gen = torch.Generator().manual_seed(Sk)
    shape = (2, 3, 5, Sk)
    probs = torch.softmax(torch.randn(shape, generator=gen), -1).to(dtype)
    go = torch.randn(shape, generator=gen).to(dtype)
    mask = (torch.rand(shape[1], shape[0], *shape[2:], generator=gen) >= 0.3).transpose(0, 1)
    g_c = cpu_ext.softmax_bwd(go, probs, 0, 0, 0.0, 0.7, mask, 1 / 0.7)
    g_g = cuda_ext.softmax_bwd(go.to(DEV), probs.to(DEV), 0, 0, 0.0, 0.7, mask.to(DEV), 1 / 0.7)
    _compare(g_g.cpu(), g_c, dtype, f"Sk={Sk} stored mask")


@pytest.mark.parametrize("Sk", [8, 128, 1024, 1500])
def test_strided_and_unaligned(cpu_ext, cuda_ext, Sk):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2, 6, 3, Sk + 1, generator=gen)
    views = {
        "permuted": base[..., :Sk].permute(0, 2, 1, 3),       # vector path, strided leading dims
        "unaligned": base[..., 1:],                             # rows start at odd offsets: scalar path
        "transposed": base[..., :Sk].transpose(-1, -2),         # last dim strided: copied first
    }
    for name, s in views.items():
        mask = torch.where(torch.rand(2, 1, 1, s.shape[-1], generator=gen) < 0.8, 0.0, NEG)
        for causal, p in ((False, 0.0), (True, 0.2)):
            _run_both(cpu_ext, cuda_ext, s, mask, 0.125, causal, p, f"{name} Sk={Sk} causal={causal} p={p}")


def test_causal_short_queries_and_special_rows(cpu_ext, cuda_ext):
    for Sq, Sk in ((3, 10), (10, 3), (4, 1100), (1, 1)):
        s = torch.randn(2, Sq, Sk)
        _run_both(cpu_ext, cuda_ext, s, None, 1.0, True, 0.1, f"causal Sq={Sq} Sk={Sk}")
    for Sk in (64, 67, 2048):
        s = torch.randn(4, Sk)
        s[1] = float("-inf")  # fully masked -> zeros
        s[2, 5] = float("nan")  # NaN row
        out_c, _ = cpu_ext.softmax_fwd(s, None, 1.0, False, 0, 0, 0.0)
        out_g, _ = cuda_ext.softmax_fwd(s.to(DEV), None, 1.0, False, 0, 0, 0.0)
        assert (out_g[1] == 0).all() and torch.isnan(out_g[2]).all()
        _compare(out_g, out_c, torch.float32, f"special rows Sk={Sk}")


def test_empty(cuda_ext):
    for shape in [(0, 4, 8), (3, 0), (2, 0, 5)]:
        out, probs = cuda_ext.softmax_fwd(torch.randn(shape, device=DEV), None, 1.0, False, 1, 2, 0.1)
        assert out.shape == shape and probs.shape == shape
        g = cuda_ext.softmax_bwd(torch.randn(shape, device=DEV), probs, 1, 2, 0.1, 1.0)
        assert g.shape == shape


def test_dropout_mask_is_philox(cuda_ext):
    from dmfx.cuda_ops import reference as R

    s = torch.randn(4, 8, 64, 64, device=DEV)
    seed = torch.tensor([SEED, OFFSET])
    for p in (0.1, 0.5):
        out, probs = cuda_ext.softmax_fwd(s, None, 1.0, False, SEED, OFFSET, p)
        keep = R.philox_keep(s.numel(), p, seed).reshape(s.shape)
        assert torch.equal(out.cpu() != 0, keep)
        torch.testing.assert_close(out[keep.to(DEV)], probs[keep.to(DEV)] / (1 - p), rtol=1e-6, atol=0)


def test_ops_and_autograd_on_cuda():
    import dmfx  # noqa: F401
    from dmfx.cuda_ops import new_seed

    seed = new_seed()
    s = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    m = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    go = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    grads = {}
    for dev in ("cpu", DEV):
        sd, md = s.detach().to(dev).requires_grad_(), m.detach().to(dev).requires_grad_()
        out, probs = torch.ops.dmfx.attention_softmax(sd, md, 0.5, True, seed, 0.2)
        (out * go.to(dev)).sum().backward()
        grads[dev] = (out.detach().cpu(), sd.grad.cpu(), md.grad.cpu())
    for a, b in zip(grads["cpu"], grads[DEV]):
        assert rel_err(b, a) < 1e-12
    sg = s.detach().to(DEV).requires_grad_()
    small = sg[:1, :1, :4, :6].detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda a: torch.ops.dmfx.attention_softmax(a, None, 0.5, False, seed, 0.2)[0], (small,))


def test_wrong_device(cuda_ext):
    s = torch.randn(2, 3, 4, device=DEV)
    with pytest.raises(RuntimeError, match="mask is on cpu"):
        cuda_ext.softmax_fwd(s, torch.zeros(3, 4), 1.0, False, 0, 0, 0.0)
    with pytest.raises(RuntimeError, match="this is the CUDA kernel"):
        cuda_ext.softmax_fwd(s.cpu(), None, 1.0, False, 0, 0, 0.0)
    with pytest.raises(RuntimeError, match="grad_out is on cpu"):
        cuda_ext.softmax_bwd(torch.randn(2, 3, 4), s, 0, 0, 0.0, 1.0)
    import dmfx  # noqa: F401

    with pytest.raises(ValueError, match="mask is on cpu"):
        torch.ops.dmfx.attention_softmax(s, torch.zeros(3, 4), 1.0, False, None, 0.0)
