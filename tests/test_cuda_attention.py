"""dmfx's fused ("flash") attention CUDA kernels (csrc/attention_cuda.cu) against the CPU kernels.

The CPU flash kernels (csrc/attention_cpu.cpp, tested in test_attention_ops.py) are the specification:
on the same inputs and seed (same Philox dropout mask), dmfx::flash_attention / qkv_flash_attention
and their backwards on CUDA give the CPU's outputs, row statistics and gradients. fp16/bf16 inputs are
compared with the CPU kernel in fp32 on the same (rounded) values. Also against a plain PyTorch
reference (no dropout), and the dropout mask against the NumPy Philox (dmfx.cuda_ops.reference).

Covered: fp32/fp16/bf16; masks (none, HF padding [B, 1, 1, Lk] fp32, bool, full [B, H, Lq, Lk] of q's
dtype, one value per row, fully masked rows); causal with Lq == Lk, Lq < Lk and Lq > Lk; grouped-query
and cross attention; lengths 1, 37, 130 (partial tiles); head dims 32, 64, 80, 128 (and D != Dv); the
projections' [B, L, H, D] views and contiguous tensors; the stacked-QKV op and its bias gradients; many
(batch, head) pairs; empty keys; opcheck; an HF BERT layer compiled with attention="flash".

Tolerances (relative-norm error): fp32 2e-5, fp16 3e-3, bf16 2e-2 (fp32 math in both kernels, one
rounding of the inputs and outputs; summation orders differ).

The varlen ops (packed sequences): against the CPU varlen kernels on many short and a few long
sequences (several 64-row tiles, empty ones), every dtype, head dims 3 to 128, GQA, 700 sequences (the
tile map's chunks), no host synchronization (sync debug mode), bit-reproducible, opcheck, the
NotImplementedError of float64 and head dims over 128.

Without a GPU every test is skipped.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from conftest import rel_err  # noqa: E402

import dmfx  # noqa: E402,F401  (registers the ops)
from dmfx.cuda_ops import new_seed  # noqa: E402
from dmfx.cuda_ops.attention import flash_supported  # noqa: E402

DEV = "cuda"
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NEG = torch.finfo(torch.float32).min
flash = torch.ops.dmfx.flash_attention
flash_bwd = torch.ops.dmfx.flash_attention_backward
qkv_flash = torch.ops.dmfx.qkv_flash_attention


@pytest.fixture(scope="module")
def cuda_ext():
    from dmfx.cuda_ops import build

    return build.load("cuda")


def _base(B, L, H, D):
    """Random [B, L, H, D] values (the projections' layout), float32 on the CPU."""
    return torch.randn(B, L, H, D)


def _put(base, dev, dtype, layout="blhd"):
    """base [B, L, H, D] as a [B, H, L, D] tensor on `dev`: a transposed view (the projections'
    layout) or contiguous; a leaf that requires grad."""
    t = base.to(dev, dtype).transpose(1, 2)
    if layout == "bhld":
        t = t.contiguous()
    return t.detach().requires_grad_()


def _mask(kind, B, H, Lq, Lk, dtype, gen):
    """A kernel-form mask (as the ops hand it on: csrc/op_api.h, kernel_mask) on the CPU."""
    if kind == "none":
        return None
    if kind == "padding":  # HF: [B, 1, 1, Lk] fp32, finfo.min past each sequence's end
        m = torch.zeros(B, 1, 1, Lk)
        m[-1, ..., max(1, Lk // 2):] = NEG
        return m
    if kind == "bool":  # [Lq, Lk], True = attend; row 0 fully masked (zeros)
        m = torch.rand(Lq, Lk, generator=gen) < 0.7
        m[:, -1] = True
        m[0] = False
        return m
    if kind == "full":  # a [B, H, Lq, Lk] additive mask in q's dtype (T5-like position bias)
        return torch.randn(B, H, Lq, Lk, generator=gen).to(dtype)
    if kind == "rowconst":  # one value per row (column stride 0)
        return torch.randn(Lq, 1, generator=gen).to(dtype)
    raise ValueError(kind)


def _run(dev, dtype, bq, bk, bv, mask, scale, causal, seed, p, go, layout="blhd", softcap=0.0):
    """(out, stats, dq, dk, dv) of dmfx::flash_attention and its autograd backward on `dev`, all
    returned on the CPU in float32 (stats as they are)."""
    q, k, v = (_put(t, dev, dtype, layout) for t in (bq, bk, bv))
    if mask is not None:
        mask = mask.to(dev) if mask.dtype == torch.bool else mask.to(dev, mask.dtype if dev == DEV else torch.float32)
    out, stats = flash(q, k, v, mask, scale, causal, seed, p, softcap)
    grads = torch.autograd.grad(out, (q, k, v), go.to(dev, dtype))
    return (out.detach().float().cpu(), stats.cpu(), *(g.float().cpu() for g in grads))


def _compare_with_cpu(dtype, bq, bk, bv, mask, scale, causal, seed, p, layout="blhd", what="", softcap=0.0):
    B, Lq, H, _ = bq.shape
    go = torch.randn(B, H, Lq, bv.shape[3])
    # the CPU kernel (fp32) reads the values the CUDA kernel reads (rounded to dtype)
    rq, rk, rv, rgo = (t.to(dtype).float() for t in (bq, bk, bv, go))
    got = _run(DEV, dtype, bq, bk, bv, mask, scale, causal, seed, p, go.to(dtype), layout, softcap)
    exp = _run("cpu", torch.float32, rq, rk, rv, mask, scale, causal, seed, p, rgo, layout, softcap)
    assert got[1].dtype == torch.float32 and got[1].shape == exp[1].shape
    for name, a, b in zip(("out", "stats", "dq", "dk", "dv"), got, exp):
        assert a.shape == b.shape, (what, name)
        if name == "stats":
            _compare_stats(a, b, dtype, what)
        elif b.numel():
            assert torch.isfinite(a).all(), (what, name)
            assert _err(a, b) < TOL[dtype], (what, name, _err(a, b))
    return got


def _err(a, b):
    """rel_err, with an RMS floor of 0.1 on the denominator: a gradient that is zero up to rounding
    (dq and dk with a single visible key) is compared by its absolute error."""
    floor = 0.1 * b.numel() ** 0.5
    return rel_err(a, b, scale=b if b.double().norm().item() > floor else torch.full_like(b, 0.1))


def _compare_stats(a, b, dtype, what):
    """Row max (-inf for fully masked rows) and 1 / sum (0 there)."""
    dead = torch.isinf(b[0])
    assert torch.equal(torch.isinf(a[0]), dead), what
    assert (a[1][dead] == 0).all(), what
    live = ~dead
    if live.any():
        # the max is one logit: same up to the rounding of a dot product; 1 / sum relative
        assert (a[0][live] - b[0][live]).abs().max() <= 1e-4 * max(1.0, b[0][live].abs().max().item()) * (
            1 if dtype == torch.float32 else 10), what
        assert rel_err(a[1][live], b[1][live]) < 1e-5 * (1 if dtype == torch.float32 else 10), what


# ------------------------------------------------------------------------------------- vs the CPU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", ["none", "padding", "bool", "full", "rowconst"])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_matches_the_cpu_kernel(dtype, mask_kind, p):
    gen = torch.Generator().manual_seed(1)
    B, H, L, D = 2, 3, 37, 64
    bq, bk, bv = (_base(B, L, H, D) for _ in range(3))
    mask = _mask(mask_kind, B, H, L, L, dtype, gen)
    seed = new_seed() if p else None
    _compare_with_cpu(dtype, bq, bk, bv, mask, 0.125, False, seed, p, what=f"{dtype} {mask_kind} p={p}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", ["none", "padding", "full"])
@pytest.mark.parametrize("causal", [False, True])
def test_soft_capped_scores_match_the_cpu_kernel(dtype, mask_kind, causal):
    """Gemma 2's soft cap (softcap * tanh(s * scale / softcap) before the mask) and its factor in dS."""
    gen = torch.Generator().manual_seed(2)
    B, H, L, D = 2, 3, 70, 64
    bq, bk, bv = (_base(B, L, H, D) for _ in range(3))
    mask = _mask(mask_kind, B, H, L, L, dtype, gen)
    _compare_with_cpu(dtype, bq, bk, bv, mask, 0.125, causal, new_seed(), 0.1, what=f"{dtype} {mask_kind} softcap",
                      softcap=0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Lq,Lk", [(1, 1), (1, 37), (37, 37), (130, 130), (37, 130), (130, 37), (64, 64), (65, 129)])
@pytest.mark.parametrize("causal", [False, True])
def test_lengths_and_causal(dtype, Lq, Lk, causal):
    """Partial tiles, cross-attention (Lq != Lk) and bottom-right causal masking (Lq > Lk leaves the
    first rows without a visible key: zeros)."""
    B, H, D = 2, 2, 32
    bq, bk, bv = _base(B, Lq, H, D), _base(B, Lk, H, D), _base(B, Lk, H, D)
    seed = new_seed()
    for p in (0.0, 0.1):
        _compare_with_cpu(dtype, bq, bk, bv, None, 0.2, causal, seed if p else None, p,
                          what=f"{dtype} Lq={Lq} Lk={Lk} causal={causal} p={p}")


@pytest.mark.parametrize("D,Dv", [(32, 32), (64, 64), (80, 80), (128, 128), (64, 32), (16, 128), (3, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims(D, Dv, dtype):
    B, H, L = 2, 2, 70
    bq, bk, bv = _base(B, L, H, D), _base(B, L, H, D), _base(B, L, H, Dv)
    gen = torch.Generator().manual_seed(2)
    _compare_with_cpu(dtype, bq, bk, bv, _mask("padding", B, H, L, L, dtype, gen), D ** -0.5, True, new_seed(), 0.1,
                      what=f"D={D} Dv={Dv}")


@pytest.mark.parametrize("Hk", [1, 2, 4])
@pytest.mark.parametrize("layout", ["blhd", "bhld"])
def test_grouped_query_and_layouts(Hk, layout):
    """GQA (dk, dv summed over the query heads of a group) and both memory layouts."""
    B, H, Lq, Lk, D = 2, 4, 45, 77, 64
    bq, bk, bv = _base(B, Lq, H, D), _base(B, Lk, Hk, D), _base(B, Lk, Hk, D)
    for dtype in DTYPES:
        _compare_with_cpu(dtype, bq, bk, bv, None, 0.125, False, new_seed(), 0.15, layout, what=f"Hk={Hk} {layout}")


def test_unaligned_strided_views():
    """Views whose rows do not start on 4-element boundaries (scalar loads), strided leading dims."""
    B, L, H, D = 2, 33, 3, 24
    big = torch.randn(B, L, H, D + 1)
    go = torch.randn(B, H, L, D)
    res = {}
    for dev in ("cpu", DEV):
        t = big.to(dev)[..., 1:].transpose(1, 2).detach().requires_grad_()
        out, _ = flash(t, t, t, None, 0.3, True, None, 0.0)
        (g,) = torch.autograd.grad(out, (t,), go.to(dev))
        res[dev] = (out.detach().cpu(), g.cpu())
    for a, b in zip(res[DEV], res["cpu"]):
        assert rel_err(a, b) < TOL[torch.float32]


def test_many_batch_heads():
    """B * H beyond the 65,535 limit of a grid's y dimension (the kernels use a 1-D grid)."""
    B, H, L, D = 300, 256, 3, 32
    bq, bk, bv = (_base(B, L, H, D) for _ in range(3))
    _compare_with_cpu(torch.float32, bq, bk, bv, None, 0.3, False, new_seed(), 0.1, what="many heads")


# ------------------------------------------------------------------------------- vs plain PyTorch


def _reference(q, k, v, mask, scale, causal):
    """softmax(q·kᵀ * scale + mask) · v in float64, GQA by repeating k/v, causal bottom-right."""
    q, k, v = (t.detach().double().cpu() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    z = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        z = z + (torch.where(mask, 0.0, float("-inf")) if mask.dtype == torch.bool else mask.double())
    if causal:
        Lq, Lk = z.shape[-2:]
        z = z.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq), float("-inf"))
    return torch.softmax(z, -1).nan_to_num(0.0) @ v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hk,Lq,Lk,causal", [(4, 50, 50, True), (2, 20, 131, False), (1, 131, 20, True)])
def test_matches_pytorch_reference(dtype, Hk, Lq, Lk, causal):
    B, H, D = 2, 4, 64
    gen = torch.Generator().manual_seed(3)
    q = _put(_base(B, Lq, H, D), DEV, dtype)
    k, v = _put(_base(B, Lk, Hk, D), DEV, dtype), _put(_base(B, Lk, Hk, D), DEV, dtype)
    for kind in ("none", "padding", "bool"):
        mask = _mask(kind, B, H, Lq, Lk, dtype, gen)
        out, _ = flash(q, k, v, None if mask is None else mask.to(DEV), 0.125, causal, None, 0.0)
        ref = _reference(q, k, v, mask, 0.125, causal)
        assert rel_err(out.cpu(), ref) < TOL[dtype], (kind, rel_err(out.cpu(), ref))
    if not causal or Lq == Lk:  # PyTorch's own (top-left causal: same only when Lq == Lk)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.125, is_causal=causal, enable_gqa=True)
        assert rel_err(flash(q, k, v, None, 0.125, causal, None, 0.0)[0], sdpa) < TOL[dtype]


def test_gradients_match_pytorch_autograd():
    """fp32 gradients against autograd through the float64 reference (no fully masked rows)."""
    B, H, Hk, Lq, Lk, D = 2, 4, 2, 33, 70, 32
    q = _put(_base(B, Lq, H, D), DEV, torch.float32)
    k, v = _put(_base(B, Lk, Hk, D), DEV, torch.float32), _put(_base(B, Lk, Hk, D), DEV, torch.float32)
    mask = torch.zeros(B, 1, 1, Lk)
    mask[0, ..., 50:] = NEG
    go = torch.randn(B, H, Lq, D)
    out, _ = flash(q, k, v, mask.to(DEV), 0.17, True, None, 0.0)
    got = torch.autograd.grad(out, (q, k, v), go.to(DEV))
    rq, rk, rv = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    exp = torch.autograd.grad(_reference_graph(rq, rk, rv, mask, 0.17), (rq, rk, rv), go.double())
    for a, b in zip(got, exp):
        assert rel_err(a.cpu(), b) < 1e-5


def _reference_graph(q, k, v, mask, scale):
    """_reference with autograd (causal, every row has a visible key)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    z = q @ k.transpose(-1, -2) * scale + mask.double()
    Lq, Lk = z.shape[-2:]
    z = z.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq), float("-inf"))
    return torch.softmax(z, -1) @ v


# ------------------------------------------------------------------------------------------ dropout


def test_dropout_mask_is_the_philox_mask():
    """With v = I (Dv = Lk) the output is the dropped-out probabilities: nonzero exactly where the
    Philox mask of the [B, H, Lq, Lk] probabilities keeps (element ((b * H + h) * Lq + i) * Lk + j),
    scaled by 1 / (1 - p); the keep fraction is 1 - p."""
    from dmfx.cuda_ops import reference as R

    B, H, Lq, Lk, D = 2, 4, 64, 128, 32
    q = torch.randn(B, H, Lq, D, device=DEV) * 0.1
    k = torch.randn(B, H, Lk, D, device=DEV) * 0.1
    v = torch.eye(Lk, device=DEV).expand(B, H, Lk, Lk)
    seed = new_seed()
    for p in (0.1, 0.5):
        dropped, _ = flash(q, k, v, None, 1.0, False, seed, p)
        probs, _ = flash(q, k, v, None, 1.0, False, None, 0.0)
        keep = R.philox_keep(B * H * Lq * Lk, p, seed).reshape(B, H, Lq, Lk).to(DEV)
        assert torch.equal(dropped != 0, keep)
        assert abs(keep.double().mean().item() - (1 - p)) < 0.01
        torch.testing.assert_close(dropped[keep], probs[keep] / (1 - p), rtol=1e-5, atol=0)
    zero, _ = flash(q, k, v, None, 1.0, False, seed, 1.0)
    assert (zero == 0).all()


def test_dropout_gradients_match_the_cpu_and_are_reproducible():
    B, H, L, D = 2, 2, 50, 32
    bq, bk, bv = (_base(B, L, H, D) for _ in range(3))
    seed = new_seed()
    a = _compare_with_cpu(torch.float32, bq, bk, bv, None, 0.3, False, seed, 0.3, what="dropout")
    go = torch.randn(B, H, L, D)
    b = _run(DEV, torch.float32, bq, bk, bv, None, 0.3, False, seed, 0.3, go)
    c = _run(DEV, torch.float32, bq, bk, bv, None, 0.3, False, seed, 0.3, go)
    assert torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(b, c))  # deterministic


# ------------------------------------------------------------------------------ special cases


def test_fully_masked_rows_and_empty_keys():
    B, H, L, D = 1, 2, 40, 64
    q, k, v = (_put(_base(B, L, H, D), DEV, torch.float32) for _ in range(3))
    mask = torch.ones(L, L, dtype=torch.bool, device=DEV)
    mask[2] = False
    mask[39] = False
    out, stats = flash(q, k, v, mask, 1.0, False, new_seed(), 0.1)
    assert torch.isfinite(out).all() and (out[:, :, [2, 39]] == 0).all()
    assert torch.isinf(stats[0, :, :, [2, 39]]).all() and (stats[1, :, :, [2, 39]] == 0).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert (q.grad[:, :, [2, 39]] == 0).all()
    empty = torch.zeros(B, H, 0, D, device=DEV)
    o, st = flash(q.detach(), empty, empty, None, 1.0, False, None, 0.0)
    assert o.shape == (B, H, L, D) and (o == 0).all() and torch.isinf(st[0]).all()
    o, st = flash(q.detach()[:, :, :0], k.detach(), v.detach(), None, 1.0, False, None, 0.0)
    assert o.shape == (B, H, 0, D) and st.shape == (2, B, H, 0)


def test_nan_propagates_like_the_cpu():
    B, H, L, D = 1, 1, 8, 32
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    q[0, 0, 3, 0] = float("nan")
    a, _ = flash(q.to(DEV), k.to(DEV), v.to(DEV), None, 1.0, False, None, 0.0)
    b, _ = flash(q, k, v, None, 1.0, False, None, 0.0)
    assert torch.equal(torch.isnan(a.cpu()), torch.isnan(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_qkv_flash_and_bias_gradients_match_the_cpu(dtype, p):
    """The stacked op (q, k, v: column blocks of one [B, L, 3 * H * D] tensor) and bias_grad=True
    (per-(batch, head) column sums of dq, dk, dv) on CUDA against the CPU kernel in fp32."""
    B, L, H, D = 2, 41, 4, 32
    qkv = torch.randn(B, L, 3 * H * D).to(dtype)
    mask = torch.zeros(B, 1, 1, L)
    mask[1, ..., 30:] = NEG
    seed = new_seed() if p else None
    go = torch.randn(B, H, L, D).to(dtype)
    res = {}
    for dev, dt in (("cpu", torch.float32), (DEV, dtype)):
        x = qkv.to(dev, dt)
        out, stats = qkv_flash(x, H, mask.to(dev), 0.25, True, seed, p)
        dqkv, dbias = torch.ops.dmfx.qkv_flash_attention_backward(go.to(dev, dt), x, H, stats, mask.to(dev), 0.25, True,
                                                                  seed, p, bias_grad=True)
        res[dev] = [t.float().cpu() for t in (out, dqkv, dbias)]
    for name, a, b in zip(("out", "dqkv", "dbias"), res[DEV], res["cpu"]):
        assert rel_err(a, b) < TOL[dtype], (name, rel_err(a, b))
    # the separate op with bias_grad on CUDA agrees with summing its gradients (the key bias's is zero
    # up to rounding: _err's absolute floor)
    q, k, v = (t.transpose(1, 2) for t in qkv.to(DEV).view(B, L, 3, H, D).unbind(2))
    out, stats = flash(q, k, v, None, 0.25, False, seed, p)
    dq, dk, dv, dbq, dbk, dbv = flash_bwd(go.to(DEV), q, k, v, stats, None, 0.25, False, seed, p, bias_grad=True)
    for g, db in ((dq, dbq), (dk, dbk), (dv, dbv)):
        assert _err(db.float(), g.float().sum(dim=(0, 2)).reshape(-1)) < TOL[dtype]


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_opcheck_on_cuda(p):
    from torch.library import opcheck

    B, L, H, D = 2, 6, 2, 32
    q, k, v = (_put(_base(B, L, H, D), DEV, torch.float32) for _ in range(3))
    seed = new_seed() if p else None
    mask = torch.zeros(B, 1, 1, L, device=DEV)
    mask[-1, ..., 4:] = NEG
    opcheck(flash.default, (q, k, v, mask, 0.5, False, seed, p))
    qkv = torch.randn(B, L, 3 * H * D, device=DEV, requires_grad=True)
    opcheck(qkv_flash.default, (qkv, H, None, 0.5, True, seed, p))
    q, k, v = (t.detach() for t in (q, k, v))
    out, stats = flash(q, k, v, mask, 0.5, False, seed, p)
    opcheck(flash_bwd.default, (torch.randn_like(out), q, k, v, stats, mask, 0.5, False, seed, p), {"bias_grad": True})


# ------------------------------------------------------------------------- fallbacks and errors


def test_flash_supported_on_cuda():
    cuda = torch.device(DEV)
    for dtype in DTYPES:
        assert flash_supported(cuda, dtype, 64, 64) and flash_supported(cuda, dtype, 128, 128)
    assert not flash_supported(cuda, torch.float64, 64, 64)
    assert not flash_supported(cuda, torch.float32, 160, 64) and not flash_supported(cuda, torch.float32, 64, 129)
    assert not flash_supported(cuda, torch.float32)  # head dims unknown
    assert flash_supported(torch.device("cpu"), torch.float64)  # the CPU ignores head dims


@pytest.mark.parametrize("dtype,D", [(torch.float64, 32), (torch.float32, 160)])
def test_unsupported_cases_run_the_unfused_form(dtype, D):
    """float64 and head dims over 128 on CUDA: the op still works (GEMMs around the softmax kernels)."""
    B, H, L = 2, 2, 20
    q, k, v = (_put(_base(B, L, H, D), DEV, dtype) for _ in range(3))
    out, _ = flash(q, k, v, None, D ** -0.5, True, None, 0.0)
    ref = _reference(q, k, v, None, D ** -0.5, True)
    assert rel_err(out.cpu(), ref) < (1e-12 if dtype == torch.float64 else 1e-5)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_kernel_errors(cuda_ext):
    q = torch.randn(1, 2, 4, 32, device=DEV)
    out = torch.empty(1, 2, 4, 32, device=DEV)
    with pytest.raises(RuntimeError, match="this is the CUDA kernel"):
        cuda_ext.flash_fwd(q.cpu(), q.cpu(), q.cpu(), None, 1.0, False, 0, 0, 0.0, out.cpu())
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        cuda_ext.flash_fwd(q.double(), q.double(), q.double(), None, 1.0, False, 0, 0, 0.0, out.double())
    with pytest.raises(RuntimeError, match="head dims up to 128"):
        big = torch.randn(1, 2, 4, 160, device=DEV)
        cuda_ext.flash_fwd(big, big, big, None, 1.0, False, 0, 0, 0.0, torch.empty_like(big))
    with pytest.raises(RuntimeError, match="out must be"):
        cuda_ext.flash_fwd(q, q, q, None, 1.0, False, 0, 0, 0.0, torch.empty(1, 2, 4, 31, device=DEV))
    with pytest.raises(RuntimeError, match="unit stride in the head dim"):
        qt = q.transpose(2, 3)
        cuda_ext.flash_fwd(qt, qt, qt, None, 1.0, False, 0, 0, 0.0, out.transpose(2, 3))
    with pytest.raises(RuntimeError, match="mask is on cpu"):
        cuda_ext.flash_fwd(q, q, q, torch.zeros(4, 4), 1.0, False, 0, 0, 0.0, out)
    stats = cuda_ext.flash_fwd(q, q, q, None, 1.0, False, 0, 0, 0.0, out)
    d = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="stats must be"):
        cuda_ext.flash_bwd(out, q, q, q, stats.double(), None, 1.0, False, 0, 0, 0.0, d, d.clone(), d.clone())
    with pytest.raises(RuntimeError, match="bias_part must be"):
        cuda_ext.flash_bwd(out, q, q, q, stats, None, 1.0, False, 0, 0, 0.0, d, d.clone(), d.clone(),
                           torch.empty(3, 1, 2, 31, device=DEV))


# ------------------------------------------------------------------------------------ varlen form
# dmfx::varlen_attention / qkv_varlen_attention (packed sequences, cu_seqlens) on CUDA against the CPU
# varlen kernels in float32 on the same rounded values and seed (the same Philox mask at
# (h * T + tq) * T + tk). The CUDA backward's delta reads the forward's out, rounded to the dtype.

varlen = torch.ops.dmfx.varlen_attention
qkv_varlen = torch.ops.dmfx.qkv_varlen_attention
MIXED = [0, 3, 1, 0, 130, 2, 64, 65, 0, 1, 200, 5, 0]  # many short, a few long over several tiles, empty ones


def _cu(lengths, device="cpu", dtype=torch.int32):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype, device=device)


def _varlen_run(dev, dtype, bq, bk, bv, cu, scale, causal, seed, p, go):
    q, k, v = (t.to(dev, dtype).detach().requires_grad_() for t in (bq, bk, bv))
    out, stats = varlen(q, k, v, cu.to(dev), scale, causal, seed, p)
    grads = torch.autograd.grad(out, (q, k, v), go.to(dev, dtype))
    return (out.detach().float().cpu(), stats.cpu(), *(g.float().cpu() for g in grads))


def _varlen_compare(dtype, lengths, Hq, Hk, D, Dv, causal, p, cu_dtype=torch.int32):
    T = sum(lengths)
    cu = _cu(lengths, dtype=cu_dtype)
    bq, bk, bv, go = (torch.randn(T, H, d) for H, d in ((Hq, D), (Hk, D), (Hk, Dv), (Hq, Dv)))
    seed = new_seed() if p else None
    rq, rk, rv, rgo = (t.to(dtype).float() for t in (bq, bk, bv, go))
    got = _varlen_run(DEV, dtype, bq, bk, bv, cu, D ** -0.5, causal, seed, p, go.to(dtype))
    exp = _varlen_run("cpu", torch.float32, rq, rk, rv, cu, D ** -0.5, causal, seed, p, rgo)
    what = f"lengths={lengths} {dtype} Hq={Hq} Hk={Hk} D={D} Dv={Dv} causal={causal} p={p}"
    assert got[1].dtype == torch.float32 and got[1].shape == (2, Hq, T)
    for name, a, b in zip(("out", "stats", "dq", "dk", "dv"), got, exp):
        assert a.shape == b.shape, (what, name)
        if name == "stats":
            _compare_stats(a, b, dtype, what)
        elif b.numel():
            assert torch.isfinite(a).all(), (what, name)
            assert _err(a, b) < TOL[dtype] * (1 if dtype == torch.float32 else 2), (what, name, _err(a, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_varlen_matches_the_cpu_kernel(dtype, causal, p):
    _varlen_compare(dtype, MIXED, 4, 2, 64, 64, causal, p)


@pytest.mark.parametrize("lengths", [[1], [37], [0, 1, 0], [9, 9, 9, 9], [64, 0, 64, 1], [512, 20, 300]])
@pytest.mark.parametrize("D,Dv", [(32, 32), (64, 64), (80, 80), (128, 128), (64, 32), (3, 5)])
def test_varlen_lengths_and_head_dims(lengths, D, Dv):
    _varlen_compare(torch.bfloat16, lengths, 2, 1, D, Dv, True, 0.1, torch.int64)


def test_varlen_many_sequences():
    """More sequences than a block scans at once (the tile map's chunks of 256) and than 64-row tiles."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 40, (700,), generator=g).tolist()
    _varlen_compare(torch.float16, lengths, 2, 2, 32, 32, False, 0.1)


def test_varlen_never_synchronizes_and_is_reproducible():
    """The ops never read cu_seqlens on the host (CUDA's sync debug mode raises on a synchronizing call),
    and give the same bits twice."""
    T = sum(MIXED)
    q, k, v = (torch.randn(T, 4, 64, device=DEV, requires_grad=True) for _ in range(3))
    cu = _cu(MIXED, DEV)
    seed = new_seed()
    g = torch.randn(T, 4, 64, device=DEV)
    runs = []
    for _ in range(2):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out, _ = varlen(q, k, v, cu, 0.125, True, seed, 0.2)
            grads = torch.autograd.grad(out, (q, k, v), g)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        runs.append([out.detach(), *grads])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_qkv_varlen_and_opcheck_on_cuda():
    from torch.library import opcheck

    H, D = 3, 32
    T = sum(MIXED)
    cu = _cu(MIXED, DEV)
    qkv = torch.randn(T, 3 * H * D, device=DEV, requires_grad=True)
    seed = new_seed()
    a, sa = qkv_varlen(qkv, H, cu, 0.2, True, seed, 0.1)
    q, k, v = qkv.unflatten(1, (3, H, D)).unbind(1)
    b, sb = varlen(q, k, v, cu, 0.2, True, seed, 0.1)
    assert torch.equal(a, b) and torch.equal(sa, sb)
    (dqkv,) = torch.autograd.grad(a, qkv, torch.ones_like(a))
    assert dqkv.shape == qkv.shape and dqkv.is_contiguous()
    opcheck(qkv_varlen.default, (qkv, H, cu, 0.2, True, seed, 0.1))
    opcheck(varlen.default, (q.detach().requires_grad_(), k.detach(), v.detach(), cu, 0.2, False, None, 0.0))


def test_varlen_supported_and_unsupported_on_cuda():
    from dmfx.cuda_ops import varlen_supported

    cuda = torch.device(DEV)
    for dtype in DTYPES:
        assert varlen_supported(cuda, dtype, 64, 64) and varlen_supported(cuda, dtype, 128, 128)
    assert not varlen_supported(cuda, torch.float64, 64, 64) and not varlen_supported(cuda, torch.float32, 160, 64)
    cu = _cu([3, 4], DEV)
    for dtype, D in ((torch.float64, 32), (torch.float32, 160)):
        q = torch.randn(7, 2, D, device=DEV, dtype=dtype)
        with pytest.raises(NotImplementedError, match="dmfx::varlen_attention: no fused kernel"):
            varlen(q, q, q, cu, 1.0, False, None, 0.0)
    q = torch.randn(7, 2, 32, device=DEV)
    with pytest.raises(ValueError, match="cu_seqlens is on cpu"):
        varlen(q, q, q, cu.cpu(), 1.0, False, None, 0.0)


def test_varlen_kernel_errors(cuda_ext):
    cu = _cu([3, 4], DEV)
    q = torch.randn(7, 2, 32, device=DEV)
    out = torch.empty(7, 2, 32, device=DEV)
    with pytest.raises(RuntimeError, match="this is the CUDA kernel"):
        cuda_ext.varlen_fwd(q.cpu(), q.cpu(), q.cpu(), cu.cpu(), 1.0, False, 0, 0, 0.0, out.cpu())
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        cuda_ext.varlen_fwd(q.double(), q.double(), q.double(), cu, 1.0, False, 0, 0, 0.0, out.double())
    with pytest.raises(RuntimeError, match="cu_seqlens must be a 1-D int32 or int64"):
        cuda_ext.varlen_fwd(q, q, q, cu.cpu(), 1.0, False, 0, 0, 0.0, out)


# ----------------------------------------------------------------------------------- end to end


def test_bert_layer_with_the_cuda_flash_kernel_matches_eager():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=128, num_attention_heads=4, intermediate_size=256,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    layer = transformers.models.bert.modeling_bert.BertLayer(cfg).to(DEV).train()
    ref = copy.deepcopy(layer)
    x = torch.randn(2, 37, 128, device=DEV, requires_grad=True)
    R = torch.randn(2, 37, 128, device=DEV)  # (a plain square().sum() of a LayerNorm output has zero gradient)
    out = torch.compile(layer, backend="dmfx", options={"attention": "flash", "fallback": False})(x)[0]
    (out * R).sum().backward()
    gx, x.grad = x.grad, None
    (ref(x)[0] * R).sum().backward()
    assert rel_err(gx, x.grad) < 1e-4
    for (name, p), r in zip(layer.named_parameters(), ref.parameters()):
        # (the key bias's gradient is zero up to rounding: an absolute floor)
        assert rel_err(p.grad, r.grad) < 1e-4 or (p.grad - r.grad).abs().max() < 1e-4, name
    forms = {f for r in dmfx.records() for f, _ in r.attention_forms.values()}
    assert forms == {"flash"}
