"""dmfx::attention_softmax / dmfx::attention_softmax_backward (cuda_ops/softmax.py, csrc/softmax_cpu.cpp) on the CPU.

Against reference_softmax (pure PyTorch in fp32/fp64, Philox mask from reference.philox_keep):
fp32 at relative-norm error 1e-5; fp16 / bf16 at 2e-3 / 1e-2 against the reference computed in fp32
from the same low-precision inputs (the kernel computes in fp32 and rounds once). Dropout masks are
compared bit for bit. Gradients: float64 gradcheck (fixed seed, so the mask is deterministic) and
comparison with autograd through the reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import rel_err
from torch.library import opcheck

import dmfx  # noqa: F401  (registers the ops)
from dmfx.cuda_ops import new_seed, reference as R, softmax as S

# Every test here runs on each CPU build of the kernels (conftest.cpu_build: native and AVX2).
pytestmark = pytest.mark.usefixtures("cpu_build")

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NEG = torch.finfo(torch.float32).min
op = torch.ops.dmfx.attention_softmax
op_bwd = torch.ops.dmfx.attention_softmax_backward


def _padding_mask(B, Sk, dtype=torch.float32):
    """HF-style additive padding mask [B, 1, 1, Sk]: 0 or finfo.min, at least one position open."""
    keep = torch.rand(B, 1, 1, Sk) < 0.7
    keep[..., 0] = True
    return torch.where(keep, 0.0, NEG).to(dtype)


def _mask(kind, shape, dtype):
    """A mask of `kind` broadcastable to scores of `shape` (None for kind 'none')."""
    *lead, Sq, Sk = shape
    if kind == "none":
        return None
    if kind == "padding":  # [B, 1, 1, Sk] (fp32 finfo.min): what HF BERT passes
        B = lead[0] if lead else 1
        m = _padding_mask(B, Sk)
        return m.reshape(B, *([1] * (len(lead) - 1)), 1, Sk) if lead else m.reshape(1, Sk)
    if kind == "bool":  # [Sq, Sk] bool, True = attend
        m = torch.rand(Sq, Sk) < 0.8
        m[:, 0] = True
        return m
    if kind == "same":  # full shape, scores' dtype, small finite values
        return torch.randn(shape).to(dtype)
    if kind == "half":  # fp16 mask (cast to fp32 by the op when scores are not fp16)
        return (torch.randn(Sq, Sk) * 0.5).half()
    if kind == "rowconst":  # [.., Sq, 1]: one value per row (stride-0 last dim after broadcasting)
        return torch.randn(*([1] * len(lead)), Sq, 1).to(dtype)
    if kind == "strided":  # last dim not unit-stride: transposed [Sk, Sq] storage
        return torch.randn(Sk, Sq).t()
    raise ValueError(kind)


def _check_fwd(scores, mask, scale, causal, p, dtype=None):
    dtype = dtype or scores.dtype
    seed = new_seed() if p > 0 else None
    out, probs = op(scores, mask, scale, causal, seed, p)
    ref_out, ref_probs = S.reference_softmax(scores, mask, scale, causal, seed, p)
    assert out.shape == scores.shape and out.dtype == scores.dtype and out.is_contiguous()
    if p > 0:
        assert probs.shape == scores.shape and probs.dtype == scores.dtype and probs.is_contiguous()
    else:
        assert probs.shape == (0,)
    if scores.numel():
        assert torch.isfinite(out).all()
        assert rel_err(out, ref_out) < TOL[dtype], (rel_err(out, ref_out), TOL[dtype])
        if p > 0:
            assert rel_err(probs, ref_probs) < TOL[dtype]
            # The dropout mask is the Philox mask, bit for bit: kept <=> out != 0 where probs != 0.
            keep = R.philox_keep(scores.numel(), p, seed).reshape(scores.shape)
            nz = probs != 0
            assert torch.equal((out != 0)[nz], keep[nz])
    return out, probs, seed


# ---------------------------------------------------------------------------------------- forward

SHAPES = [(2, 3, 5, 7), (1, 2, 4, 128), (3, 1, 33), (2, 1, 1023), (1, 1, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask_kind", ["none", "padding", "bool", "same"])
def test_forward_matches_reference(shape, mask_kind, dtype):
    scores = (torch.randn(shape) * 3).to(dtype)
    mask = _mask(mask_kind, shape, dtype)
    for causal, p in ((False, 0.0), (True, 0.1)):
        _check_fwd(scores, mask, 0.3, causal, p)


@pytest.mark.parametrize("mask_kind", ["half", "rowconst", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_other_masks(mask_kind, dtype):
    shape = (2, 3, 6, 37)
    scores = torch.randn(shape).to(dtype)
    _check_fwd(scores, _mask(mask_kind, shape, dtype), 0.5, False, 0.0)
    _check_fwd(scores, _mask(mask_kind, shape, dtype), 1.0, True, 0.3)


def test_forward_fp64():
    scores = torch.randn(2, 3, 9, 17, dtype=torch.float64)
    mask = torch.randn(3, 1, 17, dtype=torch.float64)
    out, _, _ = _check_fwd(scores, mask, 0.7, True, 0.0)
    out, probs, seed = _check_fwd(scores, mask, 0.7, False, 0.2)


def test_empty_and_degenerate_shapes():
    for shape in [(0, 4, 8), (2, 0, 5), (3, 4, 0), (0,)]:
        s = torch.randn(shape)
        out, probs = op(s, None, 1.0, False, new_seed(), 0.1)
        assert out.shape == s.shape and probs.shape == s.shape
    out, _ = op(torch.randn(4, 3, 1), None, 2.0, False, None, 0.0)  # Sk = 1: ones
    assert torch.equal(out, torch.ones(4, 3, 1))
    out, _ = op(torch.randn(4, 3, 1), None, 2.0, True, None, 0.0)  # causal, Sq > Sk: rows 0, 1 see nothing
    assert torch.equal(out, torch.tensor([0.0, 0.0, 1.0]).reshape(1, 3, 1).expand(4, 3, 1))
    x = torch.randn(9)  # 1-D scores
    assert rel_err(op(x, None, 1.0, False, None, 0.0)[0], torch.softmax(x, 0)) < 1e-6


def test_noncontiguous_scores():
    base = torch.randn(2, 6, 3, 40)  # [B, Sq, H, Sk] viewed as [B, H, Sq, Sk]: read in place
    for scores in (base.permute(0, 2, 1, 3), base[..., 3:36], base.transpose(-1, -2)):
        mask = _padding_mask(2, scores.shape[-1]).expand(2, 1, 1, scores.shape[-1])
        _check_fwd(scores, mask, 0.25, False, 0.0)
        _check_fwd(scores, mask, 0.25, True, 0.15)
    # an expanded (0-stride) mask of the full shape, as HF builds it
    s = torch.randn(2, 3, 5, 11)
    m = _padding_mask(2, 11).expand(2, 3, 5, 11)
    _check_fwd(s, m, 1.0, False, 0.0)


def test_causal_alignment():
    # Sq < Sk (KV cache): bottom-right aligned, element (i, j) masked iff j > i + Sk - Sq.
    s = torch.randn(2, 3, 4, 10)
    out, _ = op(s, None, 1.0, True, None, 0.0)
    i = torch.arange(4)[:, None]
    j = torch.arange(10)[None, :]
    allowed = j <= i + 6
    assert (out[..., ~allowed] == 0).all() and (out[..., allowed] > 0).all()
    ref = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    assert rel_err(out, ref) < 1e-6
    # Sq == Sk: the usual top-left lower triangle.
    s = torch.randn(3, 8, 8)
    ref = torch.softmax(s.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf")), -1)
    assert rel_err(op(s, None, 1.0, True, None, 0.0)[0], ref) < 1e-6
    # Sq > Sk: the first Sq - Sk rows see nothing -> zeros, never NaN.
    out, _ = op(torch.randn(2, 6, 4), None, 1.0, True, None, 0.0)
    assert (out[:, :2] == 0).all() and torch.allclose(out[:, 2:].sum(-1), torch.ones(2, 4))


def test_masked_rows_and_special_values():
    s = torch.randn(4, 6)
    bool_mask = torch.ones(4, 6, dtype=torch.bool)
    bool_mask[1] = False  # fully masked row -> zeros
    out, _ = op(s, bool_mask, 1.0, False, None, 0.0)
    assert (out[1] == 0).all() and torch.allclose(out[[0, 2, 3]].sum(-1), torch.ones(3))
    # -inf scores everywhere in a row -> zeros (like torch's _safe_softmax), also with dropout
    s2 = s.clone()
    s2[2] = float("-inf")
    out, probs = op(s2, None, 1.0, False, new_seed(), 0.5)
    assert (out[2] == 0).all() and (probs[2] == 0).all() and torch.isfinite(out).all()
    # finfo.min everywhere (HF): what eager gives (uniform), not zeros
    add = torch.zeros(4, 6)
    add[3] = NEG
    out, _ = op(s, add, 0.125, False, None, 0.0)
    assert rel_err(out, torch.softmax(s * 0.125 + add, -1)) < 1e-6
    # NaN propagates like eager: a NaN row, others untouched; also NaN next to -inf
    s3 = s.clone()
    s3[0, 2] = float("nan")
    s3[1] = float("-inf")
    s3[1, 4] = float("nan")
    out, _ = op(s3, None, 1.0, False, None, 0.0)
    assert torch.isnan(out[0]).all() and torch.isnan(out[1]).all()
    assert torch.equal(out[2:], op(s[2:], None, 1.0, False, None, 0.0)[0])
    # large logits: max-subtracted, no overflow
    out, _ = op(torch.tensor([[1e4, 1e4 - 1.0, -1e4]]), None, 1.0, False, None, 0.0)
    assert torch.allclose(out, torch.softmax(torch.tensor([[1.0, 0.0, -2e4]]), -1))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_statistics(p):
    s = torch.randn(4, 8, 64, 64)
    seed = new_seed()
    out, probs = op(s, None, 1.0, False, seed, p)
    keep = R.philox_keep(s.numel(), p, seed).reshape(s.shape)
    assert torch.equal(out != 0, keep)
    n = s.numel()
    kept = keep.float().mean().item()
    assert abs(kept - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    torch.testing.assert_close(out[keep], probs[keep] / (1 - p), rtol=1e-6, atol=0)
    # p = 1 drops everything, still returns the probabilities
    out, probs = op(s, None, 1.0, False, seed, 1.0)
    assert (out == 0).all() and torch.allclose(probs.sum(-1), torch.ones(4, 8, 64))
    # different offsets give different masks; same seed, same mask
    out2, _ = op(s, None, 1.0, False, seed.clone(), p)
    assert torch.equal((op(s, None, 1.0, False, seed, p)[0] != 0), out2 != 0)
    other = seed.clone()
    other[1] += 1
    assert not torch.equal(op(s, None, 1.0, False, other, p)[0] != 0, out2 != 0)


# ---------------------------------------------------------------------------------------- backward


def _ref_backward(grad_out, probs, seed, p, scale):
    acc = torch.float64 if probs.dtype == torch.float64 else torch.float32
    g = grad_out.to(acc)
    if p > 0:
        g = R.dropout(g, seed, p)
    pr = probs.to(acc)
    return (scale * pr * (g - (g * pr).sum(-1, keepdim=True))).to(probs.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (2, 4, 128), (3, 1023), (1, 1)])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_backward_kernel_matches_formula(shape, dtype, p):
    seed = new_seed() if p > 0 else None
    _, probs = op(torch.randn(shape).to(dtype), None, 1.0, False, new_seed(), 0.5)
    grad_out = torch.randn(shape).to(dtype)
    got = op_bwd(grad_out, probs, seed, p, 0.37)
    ref = _ref_backward(grad_out, probs, seed, p, 0.37)
    assert got.shape == probs.shape and got.dtype == dtype and got.is_contiguous()
    assert rel_err(got, ref) < TOL[dtype]
    # non-contiguous grad_out (e.g. an expanded gradient) is read correctly
    g2 = torch.randn(shape[-1]).to(dtype).expand(shape)
    assert rel_err(op_bwd(g2, probs, seed, p, 0.37), _ref_backward(g2, probs, seed, p, 0.37)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (2, 4, 128), (3, 1023)])
def test_backward_with_a_stored_mask(shape, dtype):
    """A dropout mask PyTorch's native_dropout stored (the forward was not dmfx's): the kernel's
    gradient is aten's _softmax_backward_data(native_dropout_backward(g, mask, s), probs) times scale."""
    aten = torch.ops.aten
    probs = torch.softmax(torch.randn(shape, dtype=torch.float64), -1).to(dtype)
    grad_out = torch.randn(shape).to(dtype)
    mask = torch.rand(shape) >= 0.3
    got = op_bwd(grad_out, probs, None, 0.0, 0.37, mask, 1 / 0.7)
    g64 = aten.native_dropout_backward(grad_out.double(), mask, 1 / 0.7)
    ref = 0.37 * aten._softmax_backward_data(g64, probs.double(), -1, torch.float64)
    assert got.shape == probs.shape and got.dtype == dtype
    assert rel_err(got, ref) < TOL[dtype]
    # a mask with permuted leading dims is read in place
    mt = mask.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(op_bwd(grad_out, probs, None, 0.0, 0.37, mt, 1 / 0.7), got)


def test_backward_stored_mask_errors_and_opcheck():
    probs = torch.softmax(torch.randn(2, 3, 8), -1)
    g, mask = torch.randn(2, 3, 8), torch.rand(2, 3, 8) > 0.5
    opcheck(op_bwd, (g, probs, None, 0.0, 0.5, mask, 2.0))
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        op_bwd(g, probs, None, 0.0, 1.0, mask.half(), 2.0)
    with pytest.raises(ValueError, match=r"mask must have the shape of probs \[2, 3, 8\], got \[3, 8\]"):
        op_bwd(g, probs, None, 0.0, 1.0, mask[0], 2.0)
    with pytest.raises(ValueError, match="two dropout masks"):
        op_bwd(g, probs, new_seed(), 0.2, 1.0, mask, 2.0)
    from dmfx.cuda_ops.build import load

    with pytest.raises(RuntimeError, match="mask must have the shape of probs"):
        load("cpu").softmax_bwd(g, probs, 0, 0, 0.0, 1.0, mask[0], 2.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_autograd_matches_reference(dtype):
    # no fully masked rows: the reference's own gradient is NaN there
    shape = (2, 3, 6, 40)
    seed = new_seed()
    s = (torch.randn(shape) * 2).to(dtype)
    m = (torch.randn(1, 3, 6, 40) * 0.5).to(dtype)
    go = torch.randn(shape).to(dtype)
    for causal, p, seed_ in ((True, 0.0, None), (False, 0.25, seed)):
        s1, m1 = s.detach().clone().requires_grad_(), m.detach().clone().requires_grad_()
        op(s1, m1, 0.6, causal, seed_, p)[0].backward(go)
        s2, m2 = s.detach().float().requires_grad_(), m.detach().float().requires_grad_()
        S.reference_softmax(s2, m2, 0.6, causal, seed_, p)[0].backward(go.float())
        assert s1.grad.dtype == dtype and m1.grad.shape == m.shape and m1.grad.dtype == dtype
        assert rel_err(s1.grad, s2.grad) < TOL[dtype] * 2
        assert rel_err(m1.grad, m2.grad) < TOL[dtype] * 2


def test_gradcheck_float64():
    seed = torch.tensor([1234, 5], dtype=torch.int64)
    s = torch.randn(2, 3, 5, 6, dtype=torch.float64, requires_grad=True)
    m = torch.randn(3, 1, 6, dtype=torch.float64, requires_grad=True)  # broadcast, learned bias
    bmask = torch.rand(5, 6) < 0.7
    bmask[:, 0] = True
    for p, sd in ((0.0, None), (0.3, seed)):
        assert torch.autograd.gradcheck(lambda a, b: op(a, b, 0.7, True, sd, p)[0], (s, m))
        assert torch.autograd.gradcheck(lambda a: op(a, bmask, 1.3, False, sd, p)[0], (s,))
    # gradient reaching the second output (probs) only, and both outputs
    assert torch.autograd.gradcheck(lambda a: op(a, None, 0.9, False, seed, 0.3)[1], (s,))
    assert torch.autograd.gradcheck(
        lambda a, b: tuple(op(a, b, 0.9, True, seed, 0.3)), (s, m)
    )


def test_fully_masked_rows_have_zero_grad():
    s = torch.randn(3, 5, requires_grad=True)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    op(s, mask, 1.0, False, None, 0.0)[0].backward(torch.randn(3, 5))
    assert (s.grad[1] == 0).all() and torch.isfinite(s.grad).all()


def test_double_backward_is_a_clear_error():
    s = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(op(s, None, 1.0, False, None, 0.0)[0].pow(2).sum(), s, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        g.sum().backward()


# ---------------------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize(
    "mask_kind,causal,p", [("padding", False, 0.1), ("none", True, 0.0), ("bool", False, 0.0)]
)
def test_opcheck_softmax(mask_kind, causal, p):
    shape = (2, 3, 4, 8)
    s = torch.randn(shape, requires_grad=True)
    m = _mask(mask_kind, shape, torch.float32)
    seed = new_seed() if p > 0 else None
    opcheck(op, (s, m, 0.5, causal, seed, p))


def test_opcheck_softmax_backward():
    _, probs = op(torch.randn(2, 3, 8), None, 1.0, False, new_seed(), 0.5)
    opcheck(op_bwd, (torch.randn(2, 3, 8), probs, new_seed(), 0.2, 0.5))
    opcheck(op_bwd, (torch.randn(2, 3, 8), probs, None, 0.0, 1.0))


# ---------------------------------------------------------------------------------------- Python API


def test_python_api():
    s = torch.randn(2, 3, 4, 9)
    m = _padding_mask(2, 9)
    ref = S.reference_softmax(s, m, 0.5, True, None, 0.0)[0]
    assert rel_err(S.attention_softmax(s, m, scale=0.5, causal=True), ref) < 1e-5
    assert rel_err(S.attention_softmax(s, m, 0.5, True, p=0.3, training=False), ref) < 1e-5
    torch.manual_seed(7)
    a = S.attention_softmax(s, m, 0.5, p=0.3)
    torch.manual_seed(7)
    b = S.attention_softmax(s, m, 0.5, p=0.3)
    assert torch.equal(a, b) and (a == 0).any()  # seeded from torch's generator: reproducible
    x = torch.randn(3, 5, requires_grad=True)
    S.attention_softmax(x, p=0.2).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


# ---------------------------------------------------------------------------------------- errors


def test_bad_input_errors():
    s = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="p must be in"):
        op(s, None, 1.0, False, new_seed(), 1.5)
    with pytest.raises(ValueError, match="p must be in"):
        op(s, None, 1.0, False, new_seed(), -0.1)
    with pytest.raises(ValueError, match="needs a seed"):
        op(s, None, 1.0, False, None, 0.1)
    with pytest.raises(ValueError, match="not broadcastable"):
        op(s, torch.randn(5, 4), 1.0, False, None, 0.0)
    with pytest.raises(ValueError, match="not broadcastable"):
        op(s, torch.randn(1, 2, 3, 4), 1.0, False, None, 0.0)
    with pytest.raises(TypeError, match="mask must be bool or a floating"):
        op(s, torch.ones(3, 4, dtype=torch.int32), 1.0, False, None, 0.0)
    with pytest.raises(ValueError, match="mask is on meta"):
        op(s, torch.randn(3, 4, device="meta"), 1.0, False, None, 0.0)
    with pytest.raises(ValueError, match="causal=True needs"):
        op(torch.randn(5), None, 1.0, True, None, 0.0)
    with pytest.raises(TypeError, match="scores must be float32"):
        op(torch.ones(2, 3, dtype=torch.int64), None, 1.0, False, None, 0.0)
    with pytest.raises(ValueError, match="seed must be an int64 CPU tensor"):
        op(s, None, 1.0, False, torch.tensor([1, 2, 3]), 0.1)
    with pytest.raises(TypeError, match="scores must be a Tensor"):
        S.attention_softmax([1.0, 2.0])
    probs = op(s, None, 1.0, False, None, 0.0)[0]
    with pytest.raises(RuntimeError, match="grad_out must have the shape of probs"):
        op_bwd(torch.randn(2, 3, 5), probs, None, 0.0, 1.0)
    with pytest.raises(RuntimeError, match="grad_out has dtype"):
        op_bwd(torch.randn(2, 3, 4, dtype=torch.float64), probs, None, 0.0, 1.0)
    with pytest.raises(ValueError, match="needs a seed"):
        op_bwd(torch.randn(2, 3, 4), probs, None, 0.5, 1.0)


def test_kernel_level_errors():
    """The C++ entry points check their arguments themselves (no crash inside a kernel)."""
    from dmfx.cuda_ops import build

    k = build.load("cpu")
    s = torch.randn(2, 3, 4)
    with pytest.raises(RuntimeError, match="softmax_fwd: mask is on meta"):
        k.softmax_fwd(s, torch.randn(3, 4, device="meta"), 1.0, False, 0, 0, 0.0)
    with pytest.raises(RuntimeError, match="mask must be bool, float32 or scores' dtype"):
        k.softmax_fwd(s, torch.randn(3, 4).half(), 1.0, False, 0, 0, 0.0)
    with pytest.raises(RuntimeError, match="not broadcastable"):
        k.softmax_fwd(s, torch.randn(2, 4), 1.0, False, 0, 0, 0.0)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
        k.softmax_fwd(s, None, 1.0, False, 0, 0, 1.5)
    with pytest.raises(RuntimeError, match="causal=True needs"):
        k.softmax_fwd(torch.randn(4), None, 1.0, True, 0, 0, 0.0)
    with pytest.raises(RuntimeError, match="this is the CPU kernel"):
        k.softmax_fwd(torch.randn(2, 2, device="meta"), None, 1.0, False, 0, 0, 0.0)
    with pytest.raises(RuntimeError, match="must be float32, float16"):
        k.softmax_bwd(torch.ones(2, 2, dtype=torch.int32), torch.ones(2, 2, dtype=torch.int32), 0, 0, 0.0, 1.0)
