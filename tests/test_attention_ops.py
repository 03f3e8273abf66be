"""dmfx::attention / dmfx::qkv_attention and their backwards (cuda_ops/attention.py) on the CPU.

Against reference_attention (pure PyTorch GEMMs in fp32/fp64 around reference_softmax, with the
kernels' Philox dropout mask): fp32 at relative-norm error 1e-5, fp16/bf16 looser. Gradients: float64
gradcheck through every output (fixed seed, so the dropout mask is deterministic), the mask gradient
(T5's position bias) included. Layouts: the output and the gradients come in the projections'
[B, L, H, D] layout, which is what lets the pass drop eager's transpose copies.
"""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err, relaid
from torch.library import opcheck

import dmfx  # noqa: F401  (registers the ops)
from dmfx.cuda_ops import new_seed
from dmfx.cuda_ops.attention import attention, reference_attention, reference_varlen_attention

# Every test here runs on each CPU build of the kernels (conftest.cpu_build: native and AVX2).
pytestmark = pytest.mark.usefixtures("cpu_build")

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}
op = torch.ops.dmfx.attention
qkv_op = torch.ops.dmfx.qkv_attention


def _heads(B, L, H, D, dtype=torch.float32, layout="blhd"):
    """A [B, H, L, D] tensor laid out as the projections write it ([B, L, H, D]) or contiguous."""
    if layout == "blhd":
        return torch.randn(B, L, H, D).to(dtype).transpose(1, 2)
    return torch.randn(B, H, L, D).to(dtype)


def _mask(kind, B, H, Lq, Lk, dtype=torch.float32):
    if kind == "none":
        return None
    if kind == "padding":  # HF BERT: [B, 1, 1, Lk] with finfo.min on padded keys
        m = torch.zeros(B, 1, 1, Lk)
        m[-1, ..., Lk // 2 :] = torch.finfo(torch.float32).min
        return m
    if kind == "bool":
        m = torch.rand(Lq, Lk) < 0.8
        m[:, 0] = True
        return m
    if kind == "bias":  # T5: a full [1, H, Lq, Lk] position bias in the scores' dtype
        return torch.randn(1, H, Lq, Lk).to(dtype)
    raise ValueError(kind)


def _check(outs, refs, dtype):
    for name, a, b in zip(("out", "probs", "dropped"), outs, refs):
        assert a.shape == b.shape, name
        if b.numel():
            assert rel_err(a, b) < TOL[dtype], (name, rel_err(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["none", "padding", "bool", "bias"])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_forward_matches_reference(dtype, mask_kind, p):
    B, H, L, D = 2, 4, 24, 16
    q, k, v = (_heads(B, L, H, D, dtype) for _ in range(3))
    mask = _mask(mask_kind, B, H, L, L, dtype)
    seed = new_seed() if p else None
    outs = op(q, k, v, mask, 0.25, False, seed, p)
    _check(outs, reference_attention(q, k, v, mask, 0.25, False, seed, p), dtype)


@pytest.mark.parametrize("Hk", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_and_cross_attention(Hk, causal):
    """Hq a multiple of Hk (GQA / MQA without repeat_kv) and key length != query length (cross-
    attention; causal aligned to the end as SDPA does)."""
    B, H, Lq, Lk, D, Dv = 2, 4, 5, 9, 8, 12
    q = _heads(B, Lq, H, D)
    k = _heads(B, Lk, Hk, D, layout="bhld")
    v = _heads(B, Lk, Hk, Dv)
    seed = new_seed()
    outs = op(q, k, v, None, 0.5, causal, seed, 0.1)
    _check(outs, reference_attention(q, k, v, None, 0.5, causal, seed, 0.1), torch.float32)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5, is_causal=causal and Lq == Lk, enable_gqa=True)
    if not causal or Lq == Lk:
        assert rel_err(op(q, k, v, None, 0.5, causal and Lq == Lk, None, 0.0)[0], ref) < 1e-5


def test_output_and_gradient_layouts():
    """out is [B, H, L, D] in [B, L, H, D] memory; dq/dk/dv come in the same layout; the stacked
    op's gradient is one contiguous [B, L, 3*H*D] tensor."""
    B, H, L, D = 2, 3, 7, 8
    q, k, v = (_heads(B, L, H, D).requires_grad_() for _ in range(3))
    out = op(q, k, v, None, 1.0, False, None, 0.0)[0]
    assert out.shape == (B, H, L, D) and out.transpose(1, 2).is_contiguous()
    g = torch.randn_like(out)
    dq, dk, dv, dz = torch.ops.dmfx.attention_backward(g, q, k, v, *op(q, k, v, None, 1.0, False, None, 0.0)[1:], None, 0.0, 1.0, False)
    for t in (dq, dk, dv):
        assert t.transpose(1, 2).is_contiguous()
    assert dz.numel() == 0
    qkv = torch.randn(B, L, 3 * H * D)
    outs = qkv_op(qkv, H, None, 1.0, False, None, 0.0)
    dqkv, _ = torch.ops.dmfx.qkv_attention_backward(g, qkv, H, outs[1], outs[2], None, 0.0, 1.0, False)
    assert dqkv.shape == qkv.shape and dqkv.is_contiguous()


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_qkv_attention_equals_attention_on_its_blocks(p):
    B, L, H, D = 2, 11, 4, 8
    qkv = torch.randn(B, L, 3 * H * D, dtype=torch.float64, requires_grad=True)
    mask = _mask("padding", B, H, L, L, torch.float64)
    seed = new_seed()
    q, k, v = (t.transpose(1, 2) for t in qkv.view(B, L, 3, H, D).unbind(2))
    a = qkv_op(qkv, H, mask, 0.3, False, seed, p)
    b = op(q, k, v, mask, 0.3, False, seed, p)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    g = torch.randn_like(a[0])
    (ga,) = torch.autograd.grad(a[0], qkv, g)
    (gb,) = torch.autograd.grad(b[0], qkv, g)
    assert rel_err(ga, gb) < 1e-12


@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("Hk", [1, 2])
def test_gradcheck_float64_all_outputs(p, Hk):
    """Gradients of q, k, v and a mask that requires grad, through out, probs and dropped."""
    B, H, Lq, Lk, D = 2, 2, 4, 5, 3
    q = _heads(B, Lq, H, D, torch.float64).requires_grad_()
    k = _heads(B, Lk, Hk, D, torch.float64).requires_grad_()
    v = _heads(B, Lk, Hk, D, torch.float64).requires_grad_()
    mask = torch.randn(B, 1, Lq, Lk, dtype=torch.float64, requires_grad=True)
    seed = new_seed()

    def f(q, k, v, mask):
        out, probs, dropped = op(q, k, v, mask, 0.7, True, seed, p)
        return out, probs, dropped

    assert torch.autograd.gradcheck(f, (q, k, v, mask))


def test_gradcheck_qkv_float64():
    B, L, H, D = 2, 5, 2, 3
    qkv = torch.randn(B, L, 3 * H * D, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(1, H, L, L, dtype=torch.float64, requires_grad=True)
    seed = new_seed()
    assert torch.autograd.gradcheck(lambda x, m: qkv_op(x, H, m, 0.4, False, seed, 0.2), (qkv, mask))


@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("form", ["gemm", "flash"])
def test_opcheck(p, form):
    """Both forms (dmfx::attention / qkv_attention and the flash ops), separate and packed."""
    ops = {"gemm": (torch.ops.dmfx.attention, torch.ops.dmfx.qkv_attention),
           "flash": (torch.ops.dmfx.flash_attention, torch.ops.dmfx.qkv_flash_attention)}[form]
    B, L, H, D = 2, 6, 2, 4
    q, k, v = (_heads(B, L, H, D).requires_grad_() for _ in range(3))
    seed = new_seed() if p else None
    opcheck(ops[0].default, (q, k, v, _mask("padding", B, H, L, L), 0.5, False, seed, p))
    qkv = torch.randn(B, L, 3 * H * D, requires_grad=True)
    opcheck(ops[1].default, (qkv, H, None, 0.5, True, seed, p))


def test_dropout_keeps_the_expected_share():
    B, H, L, D = 2, 4, 64, 8
    q, k, v = (_heads(B, L, H, D) for _ in range(3))
    _, probs, dropped = op(q, k, v, None, 0.1, False, new_seed(), 0.25)
    kept = (dropped != 0).double().mean().item()
    assert abs(kept - 0.75) < 0.02
    assert torch.allclose(dropped[dropped != 0], probs[dropped != 0] / 0.75)


def test_fully_masked_rows_give_zeros():
    B, H, L, D = 1, 2, 4, 8
    q, k, v = (_heads(B, L, H, D) for _ in range(3))
    mask = torch.ones(L, L, dtype=torch.bool)
    mask[1] = False
    out, probs, _ = op(q, k, v, mask, 1.0, False, None, 0.0)
    assert torch.isfinite(out).all() and (out[:, :, 1] == 0).all() and (probs[:, :, 1] == 0).all()


def test_python_api_matches_sdpa():
    B, H, L, D = 2, 4, 10, 16
    q, k, v = (_heads(B, L, H, D) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rel_err(attention(q, k, v, causal=True), ref) < 1e-5
    assert rel_err(attention(q, k, v, causal=True, p=0.5, training=False), ref) < 1e-5


def test_bad_input_errors():
    q = _heads(2, 4, 4, 8)
    with pytest.raises(ValueError, match="q must be 4-D"):
        op(q[0], q, q, None, 1.0, False, None, 0.0)
    with pytest.raises(ValueError, match="multiple of k's and v's 3 heads"):
        k = _heads(2, 4, 3, 8)
        op(q, k, k, None, 1.0, False, None, 0.0)
    with pytest.raises(TypeError, match="one dtype"):
        op(q, q.double(), q, None, 1.0, False, None, 0.0)
    with pytest.raises(ValueError, match="do not fit"):
        op(q, _heads(2, 4, 4, 7), q, None, 1.0, False, None, 0.0)
    with pytest.raises(ValueError, match="not broadcastable"):
        op(q, q, q, torch.zeros(3, 4), 1.0, False, None, 0.0)
    with pytest.raises(ValueError, match="needs a seed"):
        op(q, q, q, None, 1.0, False, None, 0.5)
    with pytest.raises(ValueError, match="3 \\* heads \\* head_dim"):
        qkv_op(torch.randn(2, 4, 20), 3, None, 1.0, False, None, 0.0)
    with pytest.raises(ValueError, match="qkv must be 3-D"):
        qkv_op(torch.randn(8, 24), 2, None, 1.0, False, None, 0.0)


# ------------------------------------------------------------------------------ fused (flash) form

flash = torch.ops.dmfx.flash_attention
qkv_flash = torch.ops.dmfx.qkv_flash_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["none", "padding", "bool", "bias"])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_flash_matches_the_gemm_form(dtype, mask_kind, p):
    """Same values and the same dropout mask (the kernels share the Philox element indexing), with
    a block size that splits the query rows (Lq > rows per block only for long keys: both covered)."""
    for L in (24, 300):
        B, H, D = 2, 2, 8
        q, k, v = (_heads(B, L, H, D, dtype) for _ in range(3))
        mask = _mask(mask_kind, B, H, L, L, dtype)
        seed = new_seed() if p else None
        out, stats = flash(q, k, v, mask, 0.3, False, seed, p)
        ref = op(q, k, v, mask, 0.3, False, seed, p)
        assert out.transpose(1, 2).is_contiguous() and stats.shape == (2, B, H, L)
        assert rel_err(out, ref[0]) < TOL[dtype] * 10
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        g = torch.randn_like(ref[0])
        got = torch.autograd.grad(flash(qs, ks, vs, mask, 0.3, False, seed, p)[0], (qs, ks, vs), g)
        exp = torch.autograd.grad(op(qs, ks, vs, mask, 0.3, False, seed, p)[0], (qs, ks, vs), g)
        for a, b in zip(got, exp):
            assert rel_err(a, b) < TOL[dtype] * 10


def test_flash_takes_operands_without_a_unit_head_stride():
    """The op accepts any strides: q, k, v (and the output gradient) whose head dim is not the
    innermost are copied for the kernel, which reads rows. Same values and gradients as the GEMM form."""
    B, H, L, D = 2, 3, 10, 8
    q, k, v = (torch.randn(B, H, D, L).transpose(2, 3).requires_grad_() for _ in range(3))
    seed = new_seed()
    out = flash(q, k, v, None, 0.3, False, seed, 0.1)[0]
    ref = op(q, k, v, None, 0.3, False, seed, 0.1)[0]
    assert rel_err(out, ref) < 1e-6
    g = torch.randn(B, H, D, L).transpose(2, 3)
    got = torch.autograd.grad(out, (q, k, v), g)
    exp = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, exp):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("Hk", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_flash_gradcheck_float64(Hk, causal, p):
    B, H, Lq, Lk, D = 2, 2, 5, 7, 3
    q = _heads(B, Lq, H, D, torch.float64).requires_grad_()
    k = _heads(B, Lk, Hk, D, torch.float64).requires_grad_()
    v = _heads(B, Lk, Hk, D, torch.float64).requires_grad_()
    mask = torch.randn(B, 1, 1, Lk, dtype=torch.float64)
    seed = new_seed()
    assert torch.autograd.gradcheck(lambda q, k, v: flash(q, k, v, mask, 0.7, causal, seed, p)[0], (q, k, v))


@pytest.mark.parametrize("mask_kind", ["none", "padding", "bool", "bias"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_flash_softcap_matches_reference(mask_kind, causal, p):
    """Gemma 2's soft-capped scores, softcap * tanh(q·kᵀ * scale / softcap) + mask, against the pure
    PyTorch reference: the output and every gradient (random cotangent), grouped-query k/v, a length
    that splits the query rows into blocks, the same dropout mask. The cap (0.5, against scores of
    about 1) bends most scores, so a kernel that skipped it, or its factor in the backward, fails."""
    for L, Hk in ((24, 2), (300, 1)):
        B, H, D = 2, 2, 8
        q = _heads(B, L, H, D).requires_grad_()
        k, v = (_heads(B, L, Hk, D).requires_grad_() for _ in range(2))
        mask = _mask(mask_kind, B, H, L, L)
        seed = new_seed() if p else None
        out = flash(q, k, v, mask, 0.3, causal, seed, p, 0.5)[0]
        ref = reference_attention(q, k, v, mask, 0.3, causal, seed, p, softcap=0.5)[0]
        assert rel_err(out, ref) < 1e-5
        assert rel_err(flash(q, k, v, mask, 0.3, causal, seed, p)[0], ref) > 1e-2  # (the cap matters here)
        R = torch.randn_like(ref)
        got = torch.autograd.grad((out * R).sum(), (q, k, v))
        exp = torch.autograd.grad((ref * R).sum(), (q, k, v))
        for a, b in zip(got, exp):
            assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_flash_softcap_gradcheck_float64_and_opcheck(causal, p):
    B, H, Hk, Lq, Lk, D = 2, 2, 1, 5, 7, 3
    q = _heads(B, Lq, H, D, torch.float64).requires_grad_()
    k, v = (_heads(B, Lk, Hk, D, torch.float64).requires_grad_() for _ in range(2))
    mask = torch.randn(B, 1, 1, Lk, dtype=torch.float64)
    seed = new_seed()
    assert torch.autograd.gradcheck(lambda q, k, v: flash(q, k, v, mask, 0.7, causal, seed, p, 0.8)[0], (q, k, v))
    opcheck(flash.default, (q, k, v, mask, 0.7, causal, seed, p, 0.8))


def test_flash_softcap_errors():
    q = _heads(1, 4, 2, 8)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(RuntimeError, match="softcap must be finite and >= 0"):
            flash(q, q, q, None, 1.0, False, None, 0.0, bad)
    # only the fused kernels cap: bfloat16 on the CPU runs the unfused form, which would not
    with pytest.raises(RuntimeError, match=r"softcap \(soft-capped scores\) needs dmfx's fused kernel"):
        flash(q.bfloat16(), q.bfloat16(), q.bfloat16(), None, 1.0, False, None, 0.0, 2.0)
    with pytest.raises(RuntimeError, match=r"softcap \(soft-capped scores\) needs dmfx's fused kernel"):
        torch.ops.dmfx.flash_attention_backward(q.bfloat16(), q.bfloat16(), q.bfloat16(), q.bfloat16(),
                                                torch.zeros(2, 1, 2, 4), None, 1.0, False, None, 0.0, False, 2.0)


def test_qkv_flash_gradient_is_one_stacked_tensor():
    B, L, H, D = 2, 9, 3, 4
    qkv = torch.randn(B, L, 3 * H * D, dtype=torch.float64, requires_grad=True)
    seed = new_seed()
    assert torch.autograd.gradcheck(lambda x: qkv_flash(x, H, None, 0.4, True, seed, 0.2)[0], (qkv,))
    out, stats = qkv_flash(qkv.detach(), H, None, 0.4, True, seed, 0.2)
    ref = qkv_op(qkv.detach(), H, None, 0.4, True, seed, 0.2)[0]
    assert rel_err(out, ref) < 1e-12
    dqkv, none = torch.ops.dmfx.qkv_flash_attention_backward(torch.ones_like(out), qkv.detach(), H, stats, None, 0.4, True, seed, 0.2)
    assert dqkv.shape == qkv.shape and dqkv.is_contiguous() and none.numel() == 0



@pytest.mark.parametrize("p", [0.0, 0.3])
def test_flash_backwards_take_saved_stats_in_any_layout(p):
    """A compiler may hand a backward its saved row statistics relaid out: Inductor turned the stats of
    a SegFormer block into channels-last (its layout optimization, in a graph with convolutions) and
    told the backward's placeholder so. The flash backwards read them in any layout: same gradients
    as with the contiguous stats, bit for bit."""
    B, L, H, D = 2, 16, 2, 8  # B == H: the [2, B, H, L] stats are channels-last-able without a size-1 dim
    seed = new_seed() if p else None
    q, k, v = (_heads(B, L, H, D) for _ in range(3))
    out, stats = flash(q, k, v, None, 0.3, False, seed, p)
    g = torch.randn_like(out)
    other = relaid(stats)
    assert not other.is_contiguous() and torch.equal(other, stats)
    want = torch.ops.dmfx.flash_attention_backward(g, q, k, v, stats, None, 0.3, False, seed, p)
    got = torch.ops.dmfx.flash_attention_backward(g, q, k, v, other, None, 0.3, False, seed, p)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    qkv = torch.randn(B, L, 3 * H * D)
    out, stats = qkv_flash(qkv, H, None, 0.3, True, seed, p)
    want = torch.ops.dmfx.qkv_flash_attention_backward(g, qkv, H, stats, None, 0.3, True, seed, p, True)
    got = torch.ops.dmfx.qkv_flash_attention_backward(g, qkv, H, relaid(stats), None, 0.3, True, seed, p, True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_qkv_flash_bias_gradient(dtype, masked):
    """bias_grad=True: the kernel also returns the stacked projections' bias gradient (the column sums
    of dqkv over batch and sequence), equal to summing dqkv afterwards; the fused CPU kernel (fp32,
    fp64) sums per (batch, head) in cache, other dtypes take the unfused path."""
    B, L, H, D = 3, 11, 2, 8
    qkv = torch.randn(B, L, 3 * H * D, dtype=dtype)
    mask = None
    if masked:  # padding at the end of one sequence: hidden keys get zero gradient, still summed right
        mask = torch.zeros(B, 1, 1, L, dtype=dtype)
        mask[1, ..., 7:] = torch.finfo(dtype).min
    seed = new_seed()
    out, stats = qkv_flash(qkv, H, mask, 0.35, False, seed, 0.1)
    g = torch.randn_like(out)
    op = torch.ops.dmfx.qkv_flash_attention_backward
    dqkv, db = op(g, qkv, H, stats, mask, 0.35, False, seed, 0.1, bias_grad=True)
    ref, _ = op(g, qkv, H, stats, mask, 0.35, False, seed, 0.1)
    assert torch.equal(dqkv, ref)
    want = ref.double().sum(dim=(0, 1))
    assert db.shape == (3 * H * D,) and db.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-5 if dtype == torch.float32 else 2e-2
    assert ((db.double() - want).abs().max() / want.abs().max()).item() < tol
    torch.library.opcheck(op, (g, qkv, H, stats, mask, 0.35, False, seed, 0.1), {"bias_grad": True})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flash_gemm_paths_agree(dtype):
    """The flash kernels call BLAS directly on raw pointers; without a BLAS in libtorch they run the
    same GEMMs through at::addmm_out. Both paths give the same values (grouped-query heads, a padding
    mask that shortens the keys, bias gradients, size-1 dims with free strides)."""
    from dmfx.cuda_ops.build import kernels_for

    ext = kernels_for(torch.device("cpu"))
    cases = [(2, 4, 2, 9, 13, 8), (1, 2, 2, 1, 5, 1), (2, 2, 1, 300, 300, 16)]
    for B, H, Hk, Lq, Lk, D in cases:
        q, k, v = _heads(B, Lq, H, D, dtype), _heads(B, Lk, Hk, D, dtype), _heads(B, Lk, Hk, D, dtype)
        mask = torch.zeros(B, 1, 1, Lk, dtype=dtype)
        mask[-1, ..., Lk - Lk // 3:] = torch.finfo(dtype).min
        seed = new_seed()
        g = torch.randn(B, H, Lq, D, dtype=dtype)
        results = []
        for use_blas in (True, False):
            before = ext.flash_use_blas(use_blas)
            try:
                out, stats = flash(q, k, v, mask, 0.3, False, seed, 0.1)
                grads = torch.ops.dmfx.flash_attention_backward(g, q, k, v, stats, mask, 0.3, False, seed, 0.1,
                                                                bias_grad=H == Hk)
            finally:
                ext.flash_use_blas(before)
            results.append([out, *grads])
        for a, b in zip(*results):
            assert a.shape == b.shape
            if b.numel():
                assert rel_err(a, b) < TOL[dtype], (B, H, Hk, Lq, Lk, D)


def test_flash_fully_masked_rows_and_empty_keys():
    B, H, L, D = 1, 2, 4, 8
    q, k, v = (_heads(B, L, H, D).requires_grad_() for _ in range(3))
    mask = torch.ones(L, L, dtype=torch.bool)
    mask[2] = False
    out, stats = flash(q, k, v, mask, 1.0, False, None, 0.0)
    assert (out[:, :, 2] == 0).all() and torch.isinf(stats[0, :, :, 2]).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    empty = torch.zeros(B, H, 0, D)
    o, _ = flash(q.detach(), empty, empty, None, 1.0, False, None, 0.0)
    assert o.shape == (B, H, L, D) and (o == 0).all()


def test_queries_with_every_key_hidden_by_a_finite_mask_differentiate_as_the_math_backend():
    """HF's causal mask on a left-padded batch hides every key of a padding query with finfo.min (a
    finite number: the softmax over its equal scores is uniform). Where that query's output is read,
    both fused forms give the math backend's gradients (and float64's); PyTorch's default CPU SDPA
    kernel does not (torch 2.11 and 2.14: 0.6-0.9 of the largest gradient off, the forwards equal), so this is
    the reference, as in tests/test_unpad_graph_fuzz.py."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, L, D = 2, 2, 12, 8
    q, k, v = (_heads(B, L, H, D).requires_grad_() for _ in range(3))
    real = torch.ones(B, L, dtype=torch.bool)
    real[0, :5] = False  # (left padding: queries 0-4 of batch 0 see no real key)
    keep = torch.ones(L, L, dtype=torch.bool).tril()[None, None] & real[:, None, None, :]
    mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    with sdpa_kernel(SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    g = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, (q, k, v), g)
    for form in (flash, op):
        out = form(q, k, v, mask, D ** -0.5, False, None, 0.0)[0]
        assert rel_err(out, ref) < 1e-5
        for x, y in zip(torch.autograd.grad(out, (q, k, v), g), expected):
            assert rel_err(x, y) < 1e-5, form


def test_flash_mask_gradient_is_a_clear_error():
    B, L, H, D = 1, 4, 2, 4
    q, k, v = (_heads(B, L, H, D).requires_grad_() for _ in range(3))
    bias = torch.randn(1, H, L, L, requires_grad=True)
    out, _ = flash(q, k, v, bias, 1.0, False, None, 0.0)
    with pytest.raises(NotImplementedError, match="mask requires grad"):
        out.sum().backward()


def test_flash_kernel_errors():
    from dmfx.cuda_ops.build import load

    m = load("cpu")
    q = _heads(1, 4, 2, 8)
    out = torch.empty(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        m.flash_fwd(q.half(), q.half(), q.half(), None, 1.0, False, 0, 0, 0.0, out.half())
    with pytest.raises(RuntimeError, match="out must be"):
        m.flash_fwd(q, q, q, None, 1.0, False, 0, 0, 0.0, torch.empty(1, 2, 4, 7))
    with pytest.raises(RuntimeError, match="unit stride in the head dim"):
        m.flash_fwd(q.transpose(2, 3), q.transpose(2, 3), q.transpose(2, 3), None, 1.0, False, 0, 0, 0.0, out.transpose(2, 3))


@pytest.mark.parametrize("kind", ["float", "bool"])
def test_flash_skips_padded_keys_exactly(kind):
    """HF padding ([B, 1, 1, Lk], finfo.min or False past each sequence's end) lets the fused kernel
    skip the padded keys: results equal the unfused form's, hidden keys get exactly zero gradient,
    and a batch element whose keys are all hidden still gets the softmax over equal values."""
    B, H, L, D = 3, 2, 40, 8
    q, k, v = (_heads(B, L, H, D).requires_grad_() for _ in range(3))
    keep = torch.ones(B, 1, 1, L, dtype=torch.bool)
    keep[0, ..., 25:] = False
    keep[2] = False  # everything hidden
    mask = keep if kind == "bool" else torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    seed = new_seed()
    a = flash(q, k, v, mask, 0.3, False, seed, 0.1)[0]
    b = op(q, k, v, mask, 0.3, False, seed, 0.1)[0]
    if kind == "bool":  # every key hidden: NaN-free zeros in both (fully masked rows)
        assert (a[2] == 0).all() and (b[2] == 0).all()
    assert rel_err(a, b) < 1e-5
    g = torch.randn_like(a)
    ga = torch.autograd.grad(a, (q, k, v), g)
    gb = torch.autograd.grad(b, (q, k, v), g)
    for x, y in zip(ga, gb):
        assert rel_err(x, y) < 1e-5
    assert (ga[1][0, :, 25:] == 0).all() and (ga[2][0, :, 25:] == 0).all()


# ------------------------------------------------------------------------------------ varlen form
#
# Packed sequences: q [T, Hq, D], k [T, Hk, D], v [T, Hk, Dv], sequence b in rows cu[b] .. cu[b + 1].
# Against reference_varlen_attention (the dense math per sequence, the Philox mask at the global
# indices (h * T + tq) * T + tk): fp32 at 1e-5, fp64 at 1e-12; gradients with a random cotangent,
# each judged relative to the largest.

varlen = torch.ops.dmfx.varlen_attention
varlen_bwd = torch.ops.dmfx.varlen_attention_backward
qkv_varlen = torch.ops.dmfx.qkv_varlen_attention
qkv_varlen_bwd = torch.ops.dmfx.qkv_varlen_attention_backward

# sequence lengths: empty ones at the start, in the middle and at the end, length 1, one sequence
# (B = 1), all equal (no padding at all), many short and one long enough that the CPU kernel splits its
# query rows into blocks (600 rows: 3 blocks in fp32, 6 in fp64)
LENGTHS = {
    "empty_ends": [0, 5, 0, 17, 1, 0],
    "ones": [1, 1, 1, 1],
    "single": [23],
    "equal": [9, 9, 9],
    "mixed": [3, 70, 0, 33, 1, 2, 40],
    "long": [600, 0, 7, 31],
}


def _cu(lengths, dtype=torch.int32):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def _packed_qkv(T, Hq, Hk, D, Dv, dtype=torch.float32, layout="proj"):
    """q [T, Hq, D], k [T, Hk, D], v [T, Hk, Dv]: views of one packed projection output [T, width] with
    a row stride past its width ("proj", what a fused QKV GEMM writes; read in place), or contiguous."""
    if layout == "contig":
        return tuple(torch.randn(T, H, d).to(dtype) for H, d in ((Hq, D), (Hk, D), (Hk, Dv)))
    width = Hq * D + Hk * D + Hk * Dv
    x = torch.randn(T, width + 3).to(dtype)[:, :width]
    q = x[:, : Hq * D].unflatten(1, (Hq, D))
    k = x[:, Hq * D: (Hq + Hk) * D].unflatten(1, (Hk, D))
    v = x[:, (Hq + Hk) * D:].unflatten(1, (Hk, Dv))
    return q, k, v


def _grad_errors(got, want):
    """Each gradient's error relative to the largest reference gradient's norm."""
    top = max(w.double().norm().item() for w in want)
    return [(g.double() - w.double()).norm().item() / max(top, 1e-30) for g, w in zip(got, want)]


def _varlen_vs_reference(lengths, Hq, Hk, D, Dv, causal, p, dtype, layout="proj", cu_dtype=torch.int32):
    cu = _cu(lengths, cu_dtype)
    T = int(cu[-1])
    q, k, v = _packed_qkv(T, Hq, Hk, D, Dv, dtype, layout)
    seed = new_seed() if p else None
    scale = D ** -0.5
    out, stats = varlen(q, k, v, cu, scale, causal, seed, p)
    ref, ref_stats = reference_varlen_attention(q, k, v, cu, scale, causal, seed, p)
    assert out.shape == (T, Hq, Dv) and out.is_contiguous() and out.dtype == dtype
    assert stats.shape == (2, Hq, T) and stats.is_contiguous()
    tol = TOL[dtype]
    assert rel_err(out, ref) < tol, rel_err(out, ref)
    assert rel_err(stats, ref_stats) < (1e-12 if dtype == torch.float64 else 1e-5)
    # gradients with a random cotangent, against the reference's autograd
    R = torch.randn(T, Hq, Dv).to(dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad((varlen(*leaves, cu, scale, causal, seed, p)[0] * R).sum(), leaves)
    want = torch.autograd.grad((reference_varlen_attention(*leaves, cu, scale, causal, seed, p)[0] * R).sum(), leaves)
    for g, t in zip(got, leaves):
        assert g.shape == t.shape and g.dtype == dtype and g.is_contiguous()
    errs = _grad_errors(got, want)
    assert max(errs) < tol * 10, errs


@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_varlen_matches_reference(lengths, causal, p):
    _varlen_vs_reference(LENGTHS[lengths], 4, 2, 16, 16, causal, p, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("Hk", [1, 3])
def test_varlen_gqa_head_dims_layouts(dtype, Hk):
    """Grouped-query heads (Hq = 3 Hk and Hq = Hk), D != Dv, odd dims, int64 cu_seqlens, contiguous
    operands and views of a packed projection."""
    for layout in ("proj", "contig"):
        _varlen_vs_reference([5, 0, 12, 1, 30], 3, Hk, 7, 11, True, 0.1, dtype, layout, torch.int64)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_varlen_equal_lengths_equal_the_flash_op(p):
    """All sequences of one length (a batch without padding): the [B, H, L, D] view of the packed tensors
    through dmfx::flash_attention gives the same output and gradients (no dropout: the two ops' Philox
    indices differ)."""
    B, L, H, D = 3, 37, 4, 16
    q, k, v = (t.detach().requires_grad_() for t in _packed_qkv(B * L, H, H, D, D))
    cu = _cu([L] * B)
    as_batch = lambda t: t.view(B, L, *t.shape[1:]).transpose(1, 2)  # noqa: E731
    for causal in (False, True):
        out = varlen(q, k, v, cu, 0.3, causal, None, 0.0)[0]
        ref = flash(*(as_batch(t) for t in (q, k, v)), None, 0.3, causal, None, 0.0)[0]
        assert rel_err(out, ref.transpose(1, 2).reshape(B * L, H, D)) < 1e-5
        R = torch.randn_like(out)
        got = torch.autograd.grad((out * R).sum(), (q, k, v))
        want = torch.autograd.grad((ref.transpose(1, 2).reshape(B * L, H, D) * R).sum(), (q, k, v))
        assert max(_grad_errors(got, want)) < 1e-5


def test_varlen_dropout_mask_is_the_philox_mask_at_global_indices():
    """The keep bit of (head h, packed query row tq, packed key row tk) is Philox element
    (h * T + tq) * T + tk, bit for bit: with v one-hot at each key's position in its sequence, out is the
    dropped-out probabilities themselves."""
    lengths, H, p = [0, 6, 1, 11, 0, 9], 3, 0.4
    cu = _cu(lengths)
    T, Lmax = int(cu[-1]), max(lengths)
    q, k = (torch.randn(T, H, 8) for _ in range(2))
    v = torch.zeros(T, H, Lmax)
    for b in range(len(lengths)):
        s, e = int(cu[b]), int(cu[b + 1])
        v[s:e, :, : e - s] = torch.eye(e - s)[:, None, :]
    seed = new_seed()
    out = varlen(q, k, v, cu, 0.5, False, seed, p)[0]
    from dmfx.cuda_ops.reference import philox_keep_at

    kept = 0
    for b in range(len(lengths)):
        s, e = int(cu[b]), int(cu[b + 1])
        h, i, j = torch.meshgrid(torch.arange(H), torch.arange(s, e), torch.arange(s, e), indexing="ij")
        keep = philox_keep_at((h * T + i) * T + j, p, seed)  # [H, L, L]
        dropped = out[s:e, :, : e - s].transpose(0, 1)  # [H, L (query), L (key)]
        assert torch.equal(dropped != 0, keep)
        kept += int(keep.sum())
    ref = reference_varlen_attention(q, k, v, cu, 0.5, False, seed, p)[0]
    assert rel_err(out, ref) < 1e-6
    assert 0 < kept < H * sum(n * n for n in lengths)


def test_varlen_no_tokens_and_empty_sequences():
    """T = 0 (every sequence empty): empty outputs and gradients, no NaN anywhere."""
    H, D = 2, 8
    for lengths in ([0], [0, 0, 0]):
        cu = _cu(lengths)
        q, k, v = (torch.randn(0, H, D, requires_grad=True) for _ in range(3))
        out, stats = varlen(q, k, v, cu, 1.0, True, new_seed(), 0.1)
        assert out.shape == (0, H, D) and stats.shape == (2, H, 0)
        dq, dk, dv = varlen_bwd(out, q, k, v, out, stats, cu, 1.0, True, new_seed(), 0.1)
        assert dq.shape == dk.shape == dv.shape == (0, H, D)
        qkv = torch.randn(0, 3 * H * D)
        out, stats = qkv_varlen(qkv, H, cu, 1.0, False, None, 0.0)
        assert qkv_varlen_bwd(out, qkv, H, out, stats, cu, 1.0, False, None, 0.0).shape == (0, 3 * H * D)


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_qkv_varlen_equals_varlen_on_its_blocks(p):
    """The stacked form reads q, k, v as column blocks of qkv [T, 3 * H * D] (any row stride) and returns
    one contiguous dqkv whose blocks are varlen's dq, dk, dv."""
    lengths, H, D = [4, 0, 19, 1, 8], 3, 8
    cu = _cu(lengths)
    T = int(cu[-1])
    qkv = torch.randn(T, 3 * H * D + 5, dtype=torch.float64)[:, : 3 * H * D]
    q, k, v = qkv.unflatten(1, (3, H, D)).unbind(1)
    seed = new_seed()
    a, sa = qkv_varlen(qkv, H, cu, 0.4, True, seed, p)
    b, sb = varlen(q, k, v, cu, 0.4, True, seed, p)
    assert torch.equal(a, b) and torch.equal(sa, sb)
    g = torch.randn_like(a)
    dqkv = qkv_varlen_bwd(g, qkv, H, a, sa, cu, 0.4, True, seed, p)
    assert dqkv.shape == (T, 3 * H * D) and dqkv.is_contiguous()
    dq, dk, dv = varlen_bwd(g, q, k, v, b, sb, cu, 0.4, True, seed, p)
    assert torch.equal(dqkv, torch.stack([dq, dk, dv], dim=1).view(T, 3 * H * D))
    # through autograd: the gradient of the stacked projection
    x = qkv.detach().requires_grad_()
    (gx,) = torch.autograd.grad((qkv_varlen(x, H, cu, 0.4, True, seed, p)[0] * g).sum(), x)
    assert torch.equal(gx, dqkv)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_varlen_gradcheck_float64(causal, p):
    cu = _cu([3, 0, 5, 1])
    T = int(cu[-1])
    q, k, v = (t.detach().requires_grad_() for t in _packed_qkv(T, 4, 2, 3, 4, torch.float64))
    seed = new_seed()
    assert torch.autograd.gradcheck(lambda q, k, v: varlen(q, k, v, cu, 0.7, causal, seed, p)[0], (q, k, v))
    qkv = torch.randn(T, 3 * 2 * 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: qkv_varlen(x, 2, cu, 0.7, causal, seed, p)[0], (qkv,))


def test_varlen_double_backward_and_stats_gradient_raise():
    cu = _cu([3, 4])
    q, k, v = (t.detach().requires_grad_() for t in _packed_qkv(7, 2, 2, 4, 4, torch.float64))
    out, stats = varlen(q, k, v, cu, 0.5, False, None, 0.0)
    assert not stats.requires_grad
    (gq,) = torch.autograd.grad((out * torch.randn_like(out)).sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        gq.sum().backward()
    qkv = torch.randn(7, 24, dtype=torch.float64, requires_grad=True)
    out, _ = qkv_varlen(qkv, 2, cu, 0.5, False, None, 0.0)
    (gx,) = torch.autograd.grad(out.sum(), qkv, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        gx.sum().backward()



def test_varlen_backwards_take_saved_stats_in_any_layout():
    """As test_flash_backwards_take_saved_stats_in_any_layout, for the packed forms' [2, Hq, T] stats."""
    lengths, H, D = [5, 0, 9], 2, 4
    cu = _cu(lengths)
    T = int(cu[-1])
    seed = new_seed()
    q, k, v = _packed_qkv(T, H, H, D, D)
    out, stats = varlen(q, k, v, cu, 0.5, True, seed, 0.2)
    g = torch.randn_like(out)
    other = relaid(stats)
    assert not other.is_contiguous() and torch.equal(other, stats)
    want = varlen_bwd(g, q, k, v, out, stats, cu, 0.5, True, seed, 0.2)
    got = varlen_bwd(g, q, k, v, out, other, cu, 0.5, True, seed, 0.2)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    qkv = torch.randn(T, 3 * H * D)
    out, stats = qkv_varlen(qkv, H, cu, 0.5, True, seed, 0.2)
    want = qkv_varlen_bwd(g, qkv, H, out, stats, cu, 0.5, True, seed, 0.2)
    assert torch.equal(qkv_varlen_bwd(g, qkv, H, out, relaid(stats), cu, 0.5, True, seed, 0.2), want)

@pytest.mark.parametrize("p", [0.0, 0.2])
def test_varlen_opcheck(p):
    cu = _cu([2, 0, 5, 1])
    T = int(cu[-1])
    q, k, v = (t.detach().requires_grad_() for t in _packed_qkv(T, 4, 2, 8, 8))
    seed = new_seed() if p else None
    opcheck(varlen.default, (q, k, v, cu, 0.5, True, seed, p))
    out, stats = varlen(q, k, v, cu, 0.5, True, seed, p)
    opcheck(varlen_bwd.default, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), stats, cu,
                                 0.5, True, seed, p))
    qkv = torch.randn(T, 3 * 2 * 8, requires_grad=True)
    opcheck(qkv_varlen.default, (qkv, 2, cu.long(), 0.5, False, seed, p))
    out, stats = qkv_varlen(qkv, 2, cu, 0.5, False, seed, p)
    opcheck(qkv_varlen_bwd.default, (torch.randn_like(out), qkv.detach(), 2, out.detach(), stats, cu, 0.5, False, seed, p))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_varlen_half_precision_is_computed_in_float32(dtype):
    """CPU float16 / bfloat16: inputs upcast to float32, outputs cast back; stats float32; the same
    values as the float32 kernel on the rounded inputs."""
    cu = _cu([0, 9, 1, 20])
    T = int(cu[-1])
    q, k, v = (t.detach().requires_grad_() for t in _packed_qkv(T, 4, 2, 16, 16, dtype))
    seed = new_seed()
    out, stats = varlen(q, k, v, cu, 0.25, True, seed, 0.1)
    assert out.dtype == dtype and stats.dtype == torch.float32
    f32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref, ref_stats = varlen(*f32, cu, 0.25, True, seed, 0.1)
    assert torch.equal(out, ref.to(dtype)) and torch.equal(stats, ref_stats)
    R = torch.randn(T, 4, 16).to(dtype)
    got = torch.autograd.grad((out * R).sum(), (q, k, v))
    want = torch.autograd.grad((ref * R.float()).sum(), f32)
    for g, w in zip(got, want):
        assert g.dtype == dtype and torch.equal(g, w.to(dtype))
    qkv = torch.randn(T, 3 * 4 * 16).to(dtype)
    assert qkv_varlen(qkv, 4, cu, 0.25, False, None, 0.0)[0].dtype == dtype


def test_varlen_python_api_matches_sdpa_per_sequence():
    from dmfx.cuda_ops import varlen_attention as api

    assert api is dmfx.varlen_attention
    lengths, H, D = [5, 0, 13, 1], 4, 16
    cu = _cu(lengths)
    q, k, v = _packed_qkv(int(cu[-1]), H, 2, D, D)
    out = api(q, k, v, cu, causal=True)
    out_eval = api(q, k, v, cu, causal=True, p=0.5, training=False)
    for b in range(len(lengths)):
        s, e = int(cu[b]), int(cu[b + 1])
        if s == e:
            continue
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(t[s:e].transpose(0, 1) for t in (q, k, v)), is_causal=True, enable_gqa=True).transpose(0, 1)
        assert rel_err(out[s:e], ref) < 1e-5 and rel_err(out_eval[s:e], ref) < 1e-5


def test_varlen_supported():
    from dmfx.cuda_ops import varlen_supported

    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        assert varlen_supported(torch.device("cpu"), dtype, 64, 64)
        assert varlen_supported("cpu", dtype)
    assert not varlen_supported(torch.device("cpu"), torch.int32)
    assert not varlen_supported(torch.device("cuda"), torch.float64, 64, 64)
    assert not varlen_supported(torch.device("cuda"), torch.float32, 160, 64)
    assert not varlen_supported(torch.device("meta"), torch.float32, 64, 64)


def test_varlen_bad_input_errors():
    """Each bad input raises the documented exception, naming the op and the tensor."""
    cu = _cu([3, 4])
    q = torch.randn(7, 4, 8)
    k2 = torch.randn(7, 2, 8)
    cases = [
        (lambda: varlen(q[0], q, q, cu, 1.0, False, None, 0.0), ValueError, "varlen_attention: q must be 3-D"),
        (lambda: varlen(q, q[None], q, cu, 1.0, False, None, 0.0), ValueError, "varlen_attention: k must be 3-D"),
        (lambda: varlen(q, q, q.double(), cu, 1.0, False, None, 0.0), TypeError, "one dtype"),
        (lambda: varlen(q.int(), q.int(), q.int(), cu, 1.0, False, None, 0.0), TypeError, "q must be float32"),
        (lambda: varlen(q, torch.randn(7, 3, 8), torch.randn(7, 3, 8), cu, 1.0, False, None, 0.0), ValueError,
         "multiple of k's and v's 3 heads"),
        (lambda: varlen(q, q[:6], q[:6], cu, 1.0, False, None, 0.0), ValueError, "do not fit"),
        (lambda: varlen(q, torch.randn(7, 4, 5), q, cu, 1.0, False, None, 0.0), ValueError, "do not fit"),
        (lambda: varlen(q, k2, k2, cu[None], 1.0, False, None, 0.0), ValueError, "cu_seqlens must be 1-D"),
        (lambda: varlen(q, k2, k2, cu.float(), 1.0, False, None, 0.0), TypeError, "cu_seqlens must be int32 or int64"),
        (lambda: varlen(q, k2, k2, cu.to("meta"), 1.0, False, None, 0.0), ValueError, "cu_seqlens is on meta"),
        (lambda: varlen(q, k2, k2, cu[:1], 1.0, False, None, 0.0), ValueError, "at least one sequence"),
        (lambda: varlen(q, k2, k2, torch.tensor([1, 3, 7], dtype=torch.int32), 1.0, False, None, 0.0), ValueError,
         "cu_seqlens must start at 0"),
        (lambda: varlen(q, k2, k2, torch.tensor([0, 5, 3, 7], dtype=torch.int32), 1.0, False, None, 0.0), ValueError,
         r"non-decreasing .* cu_seqlens\[2\] = 3 < cu_seqlens\[1\] = 5"),
        (lambda: varlen(q, k2, k2, torch.tensor([0, 3, 6]), 1.0, False, None, 0.0), ValueError,
         r"cu_seqlens must end at T = 7 .* got cu_seqlens\[2\] = 6"),
        (lambda: varlen(q, k2, k2, cu, 1.0, False, None, 0.5), ValueError, "needs a seed"),
        (lambda: varlen(q, k2, k2, cu, float("nan"), False, None, 0.0), ValueError, "scale must be finite"),
        (lambda: qkv_varlen(torch.randn(7, 20), 3, cu, 1.0, False, None, 0.0), ValueError,
         "qkv_varlen_attention: qkv's last dim 20 is not 3 \\* heads \\* head_dim"),
        (lambda: qkv_varlen(torch.randn(2, 7, 24), 2, cu, 1.0, False, None, 0.0), ValueError,
         "qkv_varlen_attention: qkv must be 2-D"),
        (lambda: qkv_varlen(torch.randn(7, 24), 2, torch.tensor([0, 8]), 1.0, False, None, 0.0), ValueError,
         "qkv_varlen_attention: cu_seqlens must end at T = 7"),
        (lambda: varlen_bwd(q, q, k2, k2, q, torch.empty(2, 4, 7), torch.tensor([0, 2, 1, 7]), 1.0, False, None, 0.0),
         ValueError, "varlen_attention_backward: cu_seqlens must be non-decreasing"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc, match=message):
            call()
    # the Python API checks the values too (on every device: the ops read them only on the CPU)
    from dmfx.cuda_ops import varlen_attention as api

    with pytest.raises(ValueError, match="varlen_attention: cu_seqlens must end at T = 7"):
        api(q, k2, k2, torch.tensor([0, 2, 5]))
    with pytest.raises(TypeError, match="cu_seqlens must be a Tensor"):
        api(q, k2, k2, [0, 3, 7])


def test_varlen_kernel_errors():
    from dmfx.cuda_ops.build import load

    m = load("cpu")
    cu = _cu([3, 4])
    q = torch.randn(7, 2, 8)
    out = torch.empty(7, 2, 8)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        m.varlen_fwd(q.half(), q.half(), q.half(), cu, 1.0, False, 0, 0, 0.0, out.half())
    with pytest.raises(RuntimeError, match="out must be"):
        m.varlen_fwd(q, q, q, cu, 1.0, False, 0, 0, 0.0, torch.empty(7, 2, 7))
    with pytest.raises(RuntimeError, match="unit stride in the head dim"):
        m.varlen_fwd(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), _cu([4, 4]), 1.0, False, 0, 0, 0.0,
                     torch.empty(8, 8, 2))
    with pytest.raises(ValueError, match="varlen_fwd: cu_seqlens must end at T = 7"):
        m.varlen_fwd(q, q, q, _cu([3, 3]), 1.0, False, 0, 0, 0.0, out)
    stats = m.varlen_fwd(q, q, q, cu, 1.0, False, 0, 0, 0.0, out)
    with pytest.raises(RuntimeError, match="stats must be"):
        m.varlen_bwd(out, q, q, q, out, stats.double(), cu, 1.0, False, 0, 0, 0.0, *(torch.empty_like(q) for _ in range(3)))


def test_varlen_fakes_take_data_dependent_token_counts():
    """Traced with the token count a data-dependent size (what the unpad pass gives: the real tokens of
    a padded batch, x[mask]), the fakes neither branch on T nor fail; the traced graph runs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    B, L, H, D = 3, 6, 2, 4
    x = torch.randn(B, L, 3 * H * D)
    keep = torch.arange(L)[None, :] < torch.tensor([4, 0, 6])[:, None]
    cu = _cu([4, 0, 6])
    seed = new_seed()

    def f(x, keep, cu, seed):
        packed = x[keep]  # [u0, 3 * H * D]
        out, stats = qkv_varlen(packed, H, cu, 0.5, True, seed, 0.1)
        dqkv = qkv_varlen_bwd(out, packed, H, out, stats, cu, 0.5, True, seed, 0.1)
        q, k, v = packed.unflatten(1, (3, H, D)).unbind(1)
        o2, s2 = varlen(q, k, v, cu, 0.5, True, seed, 0.1)
        dq, dk, dv = varlen_bwd(o2, q, k, v, o2, s2, cu, 0.5, True, seed, 0.1)
        return out, dqkv, o2, dq

    gm = make_fx(f, tracing_mode="symbolic")(x, keep, cu, seed)
    got = gm(x, keep, cu, seed)
    want = f(x, keep, cu, seed)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
