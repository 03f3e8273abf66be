"""The fused pointwise ops (cuda_ops/pointwise.py) against their pure-PyTorch references, on CPU.

bias_act_dropout (+ backward), glu (+ backward) and rope: random shapes with odd sizes, empty leading
dims and non-contiguous inputs; float64 gradcheck; torch.library.opcheck; dropout statistics and
masks bit for bit against the NumPy Philox reference; clear errors for bad input.

Tolerances (relative norm error, conftest.rel_err): fp32 1e-5 against an fp32 reference; fp16 / bf16
2e-3 / 1e-2 against the reference computed in fp32 from the same low-precision inputs (the kernels
compute in fp32 and round once); fp64 1e-12.
"""

import pytest
import torch
from conftest import rel_err
from torch.library import opcheck

from dmfx.cuda_ops import new_seed, pointwise as P, reference as R

# Every test here runs on each CPU build of the kernels (conftest.cpu_build: native and AVX2).
pytestmark = pytest.mark.usefixtures("cpu_build")

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACTS = list(P.ACTS)
SIZES = [1, 7, 33, 1023]


def _activation(lead, N, dtype, layout="contiguous"):
    """Random x [*lead, N] in `layout`: contiguous, permuted leading dims, a slice of wider rows, or
    a non-unit last-dim stride (the kernel then copies)."""
    if layout == "permuted" and len(lead) == 2:
        t = torch.randn(lead[1], lead[0], N).transpose(0, 1)
    elif layout == "sliced":
        t = torch.randn(*lead, N + 5)[..., 2 : N + 2]
    elif layout == "last_strided":
        t = torch.randn(*lead[:-1], N, lead[-1]).transpose(-1, -2) if lead else torch.randn(N)
    else:
        t = torch.randn(*lead, N)
    return (t * 2 + 0.3).to(dtype)


def _cases():
    """(lead, N, layout) combinations, kept small for 2 cores."""
    for N in SIZES:
        yield (3,), N, "contiguous"
        yield (0,), N, "contiguous"
        yield (2, 5), N, "permuted"
        yield (4,), N, "sliced"
    yield (3, 4), 7, "last_strided"
    yield (), 33, "contiguous"


def _ref_grads(fn, inputs, grad_out):
    """Autograd of the fp32 (fp64 for fp64) reference `fn` at `inputs`."""
    acc = torch.float64 if inputs[0].dtype == torch.float64 else torch.float32
    leaves = [None if t is None else t.detach().to(acc).requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    gos = grad_out if isinstance(grad_out, tuple) else (grad_out,)
    torch.autograd.backward(outs, [g.to(acc) for g in gos])
    return [None if t is None else t.grad for t in leaves]


# ------------------------------------------------------------------------------------------------
# bias + activation + dropout
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_bias_act_dropout_matches_reference(act, dtype, p):
    for lead, N, layout in _cases():
        x = _activation(lead, N, dtype, layout)
        bias = torch.randn(N).to(dtype)
        seed = new_seed() if p > 0 else None
        out = torch.ops.dmfx.bias_act_dropout(x, bias, act, seed, p)
        assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
        if x.numel() == 0:
            continue
        what = f"{act} {dtype} p={p} {lead} N={N} {layout}"
        assert rel_err(out, P.reference_bias_act_dropout(x, bias, act, seed, p)) < TOL[dtype], what

        # Backward: dx and dbias against autograd of the fp32 reference (same mask).
        g = _activation(lead, N, dtype)
        dx, db = torch.ops.dmfx.bias_act_dropout_backward(g, x, bias, act, seed, p, [True, True])
        rdx, rdb = _ref_grads(lambda x_, b_: P.reference_bias_act_dropout(x_, b_, act, seed, p), [x, bias], g)
        assert dx.shape == x.shape and dx.dtype == dtype and db.shape == (N,) and db.dtype == dtype
        if rdx.norm() > 0:  # relu with p > 0 on tiny shapes can zero everything
            assert rel_err(dx, rdx) < TOL[dtype], what + " dx"
            assert rel_err(db, rdb, scale=rdb.abs() + rdx.abs().sum(tuple(range(rdx.dim() - 1)))) < TOL[dtype], what + " dbias"


@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_bias_act_dropout_without_bias_and_fp64(act):
    x = _activation((4, 3), 19, torch.float64, "permuted")
    seed = new_seed()
    out = torch.ops.dmfx.bias_act_dropout(x, None, act, seed, 0.25)
    assert rel_err(out, P.reference_bias_act_dropout(x, None, act, seed, 0.25)) < TOL[torch.float64]
    g = torch.randn_like(x)
    dx, db = torch.ops.dmfx.bias_act_dropout_backward(g, x, None, act, seed, 0.25, [True, True])
    (rdx,) = _ref_grads(lambda x_: P.reference_bias_act_dropout(x_, None, act, seed, 0.25), [x], g)
    assert rel_err(dx, rdx) < TOL[torch.float64]
    # no bias here, but its gradient is still asked for: the column sums of dx (a bias inside the GEMM)
    assert rel_err(db, rdx.sum((0, 1))) < TOL[torch.float64]
    _, db_only = torch.ops.dmfx.bias_act_dropout_backward(g, x, None, act, seed, 0.25, [False, True])
    assert rel_err(db_only, rdx.sum((0, 1))) < TOL[torch.float64]


def test_bias_act_dropout_backward_output_mask():
    x = _activation((6,), 40, torch.float32)
    b, g, seed = torch.randn(40), torch.randn(6, 40), new_seed()
    full_dx, full_db = torch.ops.dmfx.bias_act_dropout_backward(g, x, b, "gelu", seed, 0.1, [True, True])
    dx, db = torch.ops.dmfx.bias_act_dropout_backward(g, x, b, "gelu", seed, 0.1, [True, False])
    assert torch.equal(dx, full_dx) and db.shape == (0,)
    dx, db = torch.ops.dmfx.bias_act_dropout_backward(g, x, b, "gelu", seed, 0.1, [False, True])
    assert dx.shape == (0,) and torch.allclose(db, full_db, rtol=1e-6, atol=1e-6)
    dx, db = torch.ops.dmfx.bias_act_dropout_backward(g, x, b, "gelu", seed, 0.1, [False, False])
    assert dx.shape == (0,) and db.shape == (0,)
    # No rows: the bias gradient is zero.
    e = torch.randn(0, 40)
    dx, db = torch.ops.dmfx.bias_act_dropout_backward(e, e, b, "gelu", seed, 0.1, [True, True])
    assert dx.shape == (0, 40) and torch.equal(db, torch.zeros(40))


@pytest.mark.parametrize("act", ACTS)
def test_bias_act_dropout_gradcheck(act):
    x = _activation((3, 2), 7, torch.float64, "permuted").requires_grad_()
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    seed = torch.tensor([1234, 5], dtype=torch.int64)  # fixed seed: a deterministic mask
    for p in (0.0, 0.3):
        s = seed if p > 0 else None
        assert torch.autograd.gradcheck(lambda x_, b_: torch.ops.dmfx.bias_act_dropout(x_, b_, act, s, p), (x, b))


def test_bias_act_dropout_python_api():
    x = _activation((2, 3), 16, torch.float32).requires_grad_()
    b = torch.randn(16, requires_grad=True)
    out = P.bias_act_dropout(x, b, act="gelu_tanh", p=0.5, training=False)  # eval: no dropout
    ref = P.reference_bias_act_dropout(x, b, "gelu_tanh", None, 0.0)
    assert rel_err(out, ref) < 1e-5
    out.sum().backward()
    rdx, rdb = _ref_grads(lambda x_, b_: P.reference_bias_act_dropout(x_, b_, "gelu_tanh", None, 0.0), [x, b], torch.ones(2, 3, 16))
    assert rel_err(x.grad, rdx) < 1e-5 and rel_err(b.grad, rdb) < 1e-5
    # Training: a fresh seed per call from torch's generator, so torch.manual_seed reproduces a run.
    torch.manual_seed(7)
    a = P.bias_act_dropout(x, b, p=0.5)
    torch.manual_seed(7)
    assert torch.equal(a, P.bias_act_dropout(x, b, p=0.5))
    assert not torch.equal(a, P.bias_act_dropout(x, b, p=0.5))
    # Only bias needs a gradient.
    x2 = x.detach()
    b.grad = None
    P.bias_act_dropout(x2, b, act="silu").sum().backward()
    assert b.grad is not None and b.grad.shape == (16,)


def test_bias_act_dropout_double_backward_is_a_clear_error():
    x = _activation((3,), 8, torch.float64).requires_grad_()
    out = torch.ops.dmfx.bias_act_dropout(x, None, "gelu", None, 0.0)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        gx.sum().backward()


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_bias_act_dropout_opcheck(p):
    x = _activation((2, 3), 8, torch.float32).requires_grad_()
    b = torch.randn(8, requires_grad=True)
    seed = new_seed() if p > 0 else None
    opcheck(torch.ops.dmfx.bias_act_dropout.default, (x, b, "gelu", seed, p))
    g = torch.randn(2, 3, 8)
    opcheck(torch.ops.dmfx.bias_act_dropout_backward.default, (g, x.detach(), b.detach(), "gelu", seed, p, [True, True]),
            test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
@pytest.mark.parametrize("act", ["gelu", "relu", "identity"])
def test_bias_act_dropout_backward_with_a_stored_mask(act, dtype):
    """A mask PyTorch's native_dropout stored (the forward was not dmfx's): the backward multiplies by
    mask * mask_scale, as native_dropout_backward does, then by act'(x + b), and sums dbias."""
    for lead, N, layout in _cases():
        x = _activation(lead, N, dtype, layout)
        b = torch.randn(N, dtype=dtype)
        g = torch.randn(*lead, N, dtype=dtype)
        mask = torch.rand(*lead, N) >= 0.4  # (native_dropout's mask: bool, kept where True)
        if layout == "permuted":  # a mask with permuted leading dims, read in place
            mask = mask.transpose(0, 1).contiguous().transpose(0, 1)
        scale = 1 / 0.6
        dx, db = torch.ops.dmfx.bias_act_dropout_backward(g, x, b, act, None, 0.0, [True, True], mask, scale)
        (rdx,) = _ref_grads(lambda v: P.reference_act(v + b.to(v.dtype), act), [x], g.to(torch.float64) * mask * scale)
        assert dx.dtype == dtype and dx.shape == x.shape
        assert rel_err(dx, rdx) < TOL[dtype], (lead, N, layout)
        assert rel_err(db, rdx.reshape(-1, N).sum(0)) < TOL[dtype] * 4, (lead, N, layout)
        assert not dx[~mask].any()  # dropped elements are exact zeros


def test_bias_act_dropout_backward_stored_mask_checks_and_opcheck():
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    mask = torch.rand(4, 8) > 0.5
    opcheck(torch.ops.dmfx.bias_act_dropout_backward.default,
            (g, x, None, "silu", None, 0.0, [True, True], mask, 2.0), test_utils=("test_schema", "test_faketensor"))
    dx, db = torch.ops.dmfx.bias_act_dropout_backward(g, g, None, "identity", None, 0.0, [True, True], mask, 2.0)
    assert torch.equal(dx, g * mask * 2.0) and torch.allclose(db, (g * mask * 2.0).sum(0), atol=1e-6)
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        torch.ops.dmfx.bias_act_dropout_backward(g, x, None, "gelu", None, 0.0, [True, True], mask.float(), 2.0)
    with pytest.raises(ValueError, match=r"mask must have the shape of x \[4, 8\], got \[8, 4\]"):
        torch.ops.dmfx.bias_act_dropout_backward(g, x, None, "gelu", None, 0.0, [True, True], mask.t(), 2.0)
    with pytest.raises(ValueError, match="a stored mask and p = 0.1 > 0 would be two dropout masks"):
        torch.ops.dmfx.bias_act_dropout_backward(g, x, None, "gelu", new_seed(), 0.1, [True, True], mask, 2.0)
    from dmfx.cuda_ops.build import load

    K = load("cpu")  # the kernel's own checks, for callers that bypass the op
    with pytest.raises(RuntimeError, match="mask must be a bool tensor"):
        K.bias_act_bwd(g, x, None, 2, 0, 0, 0.0, [True, True], mask.float(), 2.0)
    with pytest.raises(RuntimeError, match="mask_scale must be finite"):
        K.bias_act_bwd(g, x, None, 2, 0, 0, 0.0, [True, True], mask, float("inf"))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_statistics_and_mask(p):
    x = (torch.rand(300, 257) + 0.5).to(torch.float32)  # positive: zero <=> dropped
    seed = new_seed()
    out = torch.ops.dmfx.bias_act_dropout(x, None, "identity", seed, p)
    kept = out != 0
    n = x.numel()
    frac = kept.float().mean().item()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(frac - (1 - p)) < 5 * sigma, (frac, 1 - p)
    assert torch.equal(kept.flatten(), R.philox_keep(n, p, seed))
    torch.testing.assert_close(out[kept], x[kept] * (1.0 / (1.0 - p)), rtol=1e-6, atol=0)
    # The backward regenerates the same mask with the same scale.
    g = torch.rand(300, 257) + 0.5
    dx, _ = torch.ops.dmfx.bias_act_dropout_backward(g, x, None, "identity", seed, p, [True, False])
    assert torch.equal(dx != 0, kept)
    torch.testing.assert_close(dx[kept], g[kept] * (1.0 / (1.0 - p)), rtol=1e-6, atol=0)


def test_dropout_mask_follows_logical_index_of_strided_input():
    base = torch.rand(5, 4, 9) + 0.5
    x = base.transpose(0, 1)  # [4, 5, 9], permuted leading dims
    seed = new_seed()
    out = torch.ops.dmfx.bias_act_dropout(x, None, "identity", seed, 0.5)
    assert torch.equal((out != 0).flatten(), R.philox_keep(x.numel(), 0.5, seed))
    assert torch.equal(out, torch.ops.dmfx.bias_act_dropout(x.contiguous(), None, "identity", seed, 0.5))


def test_dropout_p_edges():
    x = torch.rand(3, 10) + 0.5
    seed = new_seed()
    assert torch.equal(torch.ops.dmfx.bias_act_dropout(x, None, "identity", seed, 1.0), torch.zeros(3, 10))
    assert torch.equal(torch.ops.dmfx.bias_act_dropout(x, None, "identity", seed, 0.0), x)
    assert torch.equal(torch.ops.dmfx.bias_act_dropout(x, None, "identity", None, 0.0), x)


def test_bias_act_dropout_errors():
    x, b = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(ValueError, match="unknown activation 'softplus'.*identity, relu, gelu, gelu_tanh, silu, tanh"):
        torch.ops.dmfx.bias_act_dropout(x, b, "softplus", None, 0.0)
    with pytest.raises(ValueError, match="p must be in"):
        torch.ops.dmfx.bias_act_dropout(x, b, "gelu", new_seed(), 1.5)
    with pytest.raises(ValueError, match="p must be in"):
        torch.ops.dmfx.bias_act_dropout(x, b, "gelu", new_seed(), -0.1)
    with pytest.raises(ValueError, match="needs a seed"):
        torch.ops.dmfx.bias_act_dropout(x, b, "gelu", None, 0.1)
    with pytest.raises(ValueError, match="seed must be an int64 CPU tensor"):
        torch.ops.dmfx.bias_act_dropout(x, b, "gelu", torch.tensor([1.0, 2.0]), 0.1)
    with pytest.raises(RuntimeError, match=r"bias must have shape \[8\]"):
        torch.ops.dmfx.bias_act_dropout(x, torch.randn(7), "gelu", None, 0.0)
    with pytest.raises(RuntimeError, match="bias has dtype Double but x has dtype Float"):
        torch.ops.dmfx.bias_act_dropout(x, b.double(), "gelu", None, 0.0)
    with pytest.raises(RuntimeError, match="x must be float32, float16, bfloat16 or float64"):
        torch.ops.dmfx.bias_act_dropout(torch.ones(3, 8, dtype=torch.int32), None, "gelu", None, 0.0)
    with pytest.raises(RuntimeError, match="grad_out must have the shape of x"):
        torch.ops.dmfx.bias_act_dropout_backward(torch.randn(3, 7), x, b, "gelu", None, 0.0, [True, True])
    with pytest.raises(ValueError, match="output_mask needs 2 entries"):
        torch.ops.dmfx.bias_act_dropout_backward(x, x, b, "gelu", None, 0.0, [True])
    with pytest.raises(TypeError, match="x must be a Tensor"):
        P.bias_act_dropout([1.0, 2.0])


@pytest.mark.parametrize("op", P.OPS)
def test_the_ops_kernels_and_autograd_are_the_extensions_cxx_ones(op):
    """No Python runs between the dispatcher and a pointwise kernel: once the extension is loaded, each
    op's CPU and Autograd kernels are the ones pointwise_cpu.cpp registers (not a Python function)."""
    from dmfx.cuda_ops.build import load

    load("cpu")
    dump = torch._C._dispatch_dump(f"dmfx::{op}").splitlines()
    for key in ("CPU", "Autograd[alias]"):
        (line,) = [ln for ln in dump if ln.startswith(f"{key}: ")]
        assert "pointwise_cpu.cpp" in line and "unboxed" in line, line


def test_kernel_rejects_bad_activation_code():
    from dmfx.cuda_ops.build import load

    with pytest.raises(RuntimeError, match="unknown activation code 9"):
        load("cpu").bias_act_fwd(torch.randn(2, 3), None, 9, 0, 0, 0.0)


# ------------------------------------------------------------------------------------------------
# gated activations
# ------------------------------------------------------------------------------------------------


def _glu_inputs(lead, N, dtype, layout):
    if layout == "stacked":  # the two halves of one [..., 2N] projection, read in place
        base = (torch.randn(*lead, 2 * N) * 2).to(dtype)
        return base[..., :N], base[..., N:]
    return _activation(lead, N, dtype, layout), _activation(lead, N, dtype, layout)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_glu_matches_reference(act, dtype):
    for lead, N, layout in [((3,), 1, "contiguous"), ((2, 5), 33, "stacked"), ((0,), 7, "contiguous"),
                            ((2, 3), 1023, "permuted"), ((4,), 17, "sliced"), ((2, 3), 6, "last_strided")]:
        gate, up = _glu_inputs(lead, N, dtype, layout)
        out = torch.ops.dmfx.glu(gate, up, act)
        assert out.shape == gate.shape and out.dtype == dtype and out.is_contiguous()
        if gate.numel() == 0:
            continue
        what = f"{act} {dtype} {lead} N={N} {layout}"
        assert rel_err(out, P.reference_glu(gate, up, act)) < TOL[dtype], what
        g = _activation(lead, N, dtype)
        dgate, dup = torch.ops.dmfx.glu_backward(g, gate, up, act, [True, True])
        rg, ru = _ref_grads(lambda a, u: P.reference_glu(a, u, act), [gate, up], g)
        if rg.norm() > 0:
            assert rel_err(dgate, rg) < TOL[dtype], what + " dgate"
        assert rel_err(dup, ru) < TOL[dtype], what + " dup"
        only_up = torch.ops.dmfx.glu_backward(g, gate, up, act, [False, True])
        assert only_up[0].shape == (0,) and torch.equal(only_up[1], dup)


@pytest.mark.parametrize("act", ACTS)
def test_glu_gradcheck(act):
    base = torch.randn(3, 2, 10, dtype=torch.float64)
    gate = base[..., :5].clone().requires_grad_()
    up = base[..., 5:].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, u: torch.ops.dmfx.glu(a, u, act), (gate, up))
    # Strided views of one stacked leaf.
    stacked = base.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda s: P.glu(s[..., :5], s[..., 5:], act), (stacked,))


def test_glu_opcheck_and_errors():
    base = torch.randn(2, 3, 16, requires_grad=True)
    opcheck(torch.ops.dmfx.glu.default, (base[..., :8], base[..., 8:], "silu"))
    g = torch.randn(2, 3, 8)
    opcheck(torch.ops.dmfx.glu_backward.default, (g, base.detach()[..., :8], base.detach()[..., 8:], "gelu", [True, True]),
            test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        torch.ops.dmfx.glu(g, g, "swish")
    with pytest.raises(RuntimeError, match="up must have the shape of gate"):
        torch.ops.dmfx.glu(g, torch.randn(2, 3, 7), "silu")
    with pytest.raises(RuntimeError, match="up has dtype Half but gate has dtype Float"):
        torch.ops.dmfx.glu(g, g.half(), "silu")
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(torch.ops.dmfx.glu(x, x.detach(), "silu").sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        gx.sum().backward()


# ------------------------------------------------------------------------------------------------
# rotary embedding
# ------------------------------------------------------------------------------------------------


def _hf_qk(B, S, Hq, Hk, D, dtype):
    """q, k as HF makes them: [B, S, H*D] -> view -> transpose(1, 2) (permuted strides)."""
    q = torch.randn(B, S, Hq * D).view(B, S, Hq, D).transpose(1, 2).to(dtype)
    k = torch.randn(B, S, Hk * D).view(B, S, Hk, D).transpose(1, 2).to(dtype)
    return q, k


def _tables(B, S, D, form, dtype):
    """cos, sin in the broadcastable forms HF and others use (halves deliberately not equal)."""
    cos, sin = torch.randn(B, S, D), torch.randn(B, S, D)
    if form == "hf":  # [B, 1, S, D]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    elif form == "SD":
        cos, sin = cos[0], sin[0]
    elif form == "1SD":
        cos, sin = cos[:1], sin[:1]
    elif form == "sliced":  # a slice of a longer [max_pos, D] table
        cos, sin = torch.randn(S + 3, D)[1 : S + 1], torch.randn(S + 3, D)[2 : S + 2]
    return cos.to(dtype), sin.to(dtype)


#: dmfx::rope's pairings as its (interleaved, deinterleave) flags: rotate_half's (LLaMA), rotate_every_two's
#: (GPT-J, Cohere), DeepSeek's (pairs in, halves out).
PAIRINGS = {"rotate_half": (False, False), "interleaved": (True, False), "deinterleave": (False, True)}


@pytest.mark.parametrize("pairing", list(PAIRINGS))
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
def test_rope_matches_reference(dtype, pairing):
    flags = PAIRINGS[pairing]
    for (B, S, Hq, Hk, D), form in [((2, 5, 4, 2, 8), "hf"), ((1, 7, 3, 3, 2), "SD"), ((2, 3, 2, 1, 64), "1SD"),
                                    ((2, 4, 2, 2, 6), "sliced"), ((0, 4, 2, 2, 8), "SD"), ((1, 1, 1, 1, 128), "hf")]:
        q, k = _hf_qk(B, S, Hq, Hk, D, dtype)
        cos, sin = _tables(B if B else 1, S, D, form, dtype)
        qo, ko = torch.ops.dmfx.rope(q, k, cos, sin, False, *flags)
        assert qo.shape == q.shape and ko.shape == k.shape
        # contiguous, or (q and k permuted alike, as HF makes them) in q's memory order
        assert (qo.is_contiguous() and ko.is_contiguous()) or (qo.stride() == q.stride() and ko.stride() == k.stride())
        if q.numel() == 0:
            continue
        rq, rk = P.reference_rope(q, k, cos, sin, *flags)
        what = f"{dtype} {(B, S, Hq, Hk, D)} {form} {pairing}"
        assert rel_err(qo, rq) < TOL[dtype], what
        assert rel_err(ko, rk) < TOL[dtype], what
        # inverse=True is the transpose map: <rope(x), g> == <x, rope_inv(g)>.
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        iq, ik = torch.ops.dmfx.rope(gq, gk, cos, sin, True, *flags)
        if dtype in (torch.float32, torch.float64):
            lhs = (qo.double() * gq.double()).sum() + (ko.double() * gk.double()).sum()
            rhs = (q.double() * iq.double()).sum() + (k.double() * ik.double()).sum()
            assert abs(lhs - rhs) <= 1e-4 * (abs(lhs) + 1), what


def test_rope_inverse_formula():
    D, h = 8, 4
    g = torch.randn(2, 3, 5, D)
    k = torch.randn(2, 1, 5, D)
    cos, sin = torch.randn(5, D), torch.randn(5, D)  # halves not equal
    out, _ = torch.ops.dmfx.rope(g, k, cos, sin, True)
    expect = g * cos + torch.cat((g[..., h:] * sin[..., h:], -g[..., :h] * sin[..., :h]), -1)
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)
    # interleaved: the pairs (2i, 2i + 1)
    out, _ = torch.ops.dmfx.rope(g, k, cos, sin, True, True)
    ev, od = g[..., 0::2], g[..., 1::2]
    expect = g * cos + torch.stack((od * sin[..., 1::2], -ev * sin[..., 0::2]), -1).flatten(-2)
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)
    # ... and the forward, written out: out[2i] = x[2i] c[2i] - x[2i+1] s[2i], out[2i+1] = x[2i+1] c[2i+1] + x[2i] s[2i+1]
    out, _ = torch.ops.dmfx.rope(g, k, cos, sin, False, True)
    expect = g * cos + torch.stack((-od * sin[..., 0::2], ev * sin[..., 1::2]), -1).flatten(-2)
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)
    # deinterleave (DeepSeek's): out[i] = x[2i] c[i] - x[2i+1] s[i], out[i+h] = x[2i+1] c[i+h] + x[2i] s[i+h]
    out, _ = torch.ops.dmfx.rope(g, k, cos, sin, False, False, True)
    expect = torch.cat((ev * cos[..., :h] - od * sin[..., :h], od * cos[..., h:] + ev * sin[..., h:]), -1)
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)
    # ... and its inverse: the transposed map reads by halves and writes the pairs back
    out, _ = torch.ops.dmfx.rope(g, k, cos, sin, True, False, True)
    lo, hi = g[..., :h], g[..., h:]
    expect = torch.stack((lo * cos[..., :h] + hi * sin[..., h:], hi * cos[..., h:] - lo * sin[..., :h]), -1).flatten(-2)
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)


def test_rope_gradcheck_including_tables():
    q, k = _hf_qk(2, 3, 2, 1, 4, torch.float64)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    cos, sin = _tables(2, 3, 4, "hf", torch.float64)
    cos, sin = cos.requires_grad_(), sin.requires_grad_()
    for flags in PAIRINGS.values():
        for inverse in (False, True):
            assert torch.autograd.gradcheck(lambda *a: torch.ops.dmfx.rope(*a, inverse, *flags), (q, k, cos, sin))
        # Tables broadcast over the batch too.
        c2, s2 = (t.detach()[0, 0].clone().requires_grad_() for t in (cos, sin))
        assert torch.autograd.gradcheck(lambda *a: torch.ops.dmfx.rope(*a, False, *flags), (q, k, c2, s2))
        # It is linear in (q, k): double backward works (the backward is rope itself), the tables' too.
        assert torch.autograd.gradgradcheck(
            lambda a, b: torch.ops.dmfx.rope(a, b, cos.detach(), sin.detach(), False, *flags), (q, k)
        )
        assert torch.autograd.gradgradcheck(lambda *a: torch.ops.dmfx.rope(*a, True, *flags), (q, k, cos, sin))


def test_rope_autograd_one_output_unused():
    q, k = _hf_qk(1, 4, 2, 2, 8, torch.float32)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    cos, sin = _tables(1, 4, 8, "hf", torch.float32)
    qo, ko = P.rope(q, k, cos, sin)
    (qo * torch.randn_like(qo)).sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k))
    assert q.grad is not None and q.grad.norm() > 0


def test_rope_opcheck_and_errors():
    q, k = _hf_qk(2, 3, 2, 1, 8, torch.float32)
    cos, sin = _tables(2, 3, 8, "hf", torch.float32)
    for flags in PAIRINGS.values():
        opcheck(torch.ops.dmfx.rope.default,
                (q.detach().requires_grad_(), k.detach().requires_grad_(), cos, sin, False, *flags))
    with pytest.raises(RuntimeError, match="interleaved and deinterleave exclude each other"):
        torch.ops.dmfx.rope(q, k, cos, sin, False, True, True)
    with pytest.raises(RuntimeError, match="head dim D .* must be even"):
        torch.ops.dmfx.rope(torch.randn(1, 2, 3, 5), torch.randn(1, 1, 3, 5), torch.randn(3, 5), torch.randn(3, 5), False)
    with pytest.raises(RuntimeError, match="cos of shape .* must broadcast to q's shape"):
        torch.ops.dmfx.rope(q, k, torch.randn(4, 8), sin, False)
    with pytest.raises(RuntimeError, match="sin of shape .* must broadcast to k's shape"):
        torch.ops.dmfx.rope(q, k, cos, torch.randn(2, 2, 3, 8), False)
    with pytest.raises(RuntimeError, match="same rank"):
        torch.ops.dmfx.rope(q, k[0], cos, sin, False)
    with pytest.raises(RuntimeError, match=r"cos of shape .* must broadcast to k's shape"):
        torch.ops.dmfx.rope(q, torch.randn(2, 1, 4, 8), cos, sin, False)  # k of another length
    with pytest.raises(RuntimeError, match=r"same head dim D"):
        torch.ops.dmfx.rope(q, torch.randn(2, 1, 3, 6), cos, sin, False)
    with pytest.raises(RuntimeError, match="cos has dtype Half but q has dtype Float"):
        torch.ops.dmfx.rope(q, k, cos.half(), sin, False)
    with pytest.raises(TypeError, match="cos must be a Tensor"):
        P.rope(q, k, None, sin)


def test_rope_outputs_keep_the_memory_order_of_permuted_q_and_k():
    """HF makes q and k with view + transpose(1, 2); eager's element-wise rope keeps that memory
    order, so the traced graph's later views (e.g. after SDPA) rely on it. dmfx::rope does the same."""
    from torch.library import opcheck

    q, k = (torch.randn(2, 6, 4, 8).transpose(1, 2) for _ in range(2))
    cos, sin = torch.randn(2, 6, 8).unsqueeze(1), torch.randn(2, 6, 8).unsqueeze(1)
    qo, ko = torch.ops.dmfx.rope(q, k, cos, sin, False)
    assert qo.stride() == q.stride() and ko.stride() == k.stride()
    rq, rk = P.reference_rope(q, k, cos, sin)
    assert rel_err(qo, rq) < 1e-6 and rel_err(ko, rk) < 1e-6
    opcheck(torch.ops.dmfx.rope.default, (q, k, cos, sin, False))


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_grouped_query_k_keeps_its_memory_order_too(inverse):
    """k with fewer heads (GQA) in the same [B, L, H, D] memory order: both outputs keep it (else the
    backward of a dmfx attention, whose dq/dk come in that layout, would copy them back)."""
    q = torch.randn(2, 6, 4, 8).transpose(1, 2)
    k = torch.randn(2, 6, 2, 8).transpose(1, 2)
    cos, sin = torch.randn(2, 6, 8).unsqueeze(1), torch.randn(2, 6, 8).unsqueeze(1)
    qo, ko = torch.ops.dmfx.rope(q, k, cos, sin, inverse)
    assert qo.stride() == q.stride() and ko.stride() == k.stride()
    rq, _ = torch.ops.dmfx.rope(q.contiguous(), q.contiguous(), cos, sin, inverse)
    rk, _ = torch.ops.dmfx.rope(k.contiguous(), k.contiguous(), cos, sin, inverse)
    assert torch.equal(qo, rq) and torch.equal(ko, rk)


# ------------------------------------------------------------------------------------------------
# soft cap
# ------------------------------------------------------------------------------------------------


def _softcap_cases(dtype):
    """(x, what): odd and strided layouts, an empty batch, a 0-dim x, large |x| where the tanh saturates."""
    for lead, N, layout in [((3,), 1023, "contiguous"), ((2, 5), 33, "permuted"), ((4,), 17, "sliced"),
                            ((3, 4), 7, "last_strided"), ((0,), 7, "contiguous"), ((5,), 1, "contiguous")]:
        yield _activation(lead, N, dtype, layout), f"{lead} N={N} {layout}"
    yield torch.tensor(1.7).to(dtype), "0-dim"
    yield (torch.randn(6, 37) * 200).to(dtype), "large |x|"


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
def test_softcap_matches_reference(dtype):
    cap = 2.5
    for x, what in _softcap_cases(dtype):
        what = f"{dtype} {what}"
        out = torch.ops.dmfx.softcap(x, cap)
        assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous(), what
        g = torch.randn(x.shape).to(dtype)
        dx = torch.ops.dmfx.softcap_backward(g, out, cap)
        assert dx.shape == x.shape and dx.dtype == dtype and dx.is_contiguous(), what
        if x.numel() == 0:
            continue
        assert rel_err(out, R.softcap(x, cap)) < TOL[dtype], what
        # the backward from the output it is given: against the reference formula on that output ...
        assert rel_err(dx, R.softcap_backward(g, out, cap)) < TOL[dtype], what + " dx"
        # ... and against autograd of the reference forward (in fp16 / bf16 the output's rounding moves
        # 1 - (out / cap)^2 by far more than a rounding where the tanh bends, as eager's saved tanh does)
        if dtype in (torch.float32, torch.float64):
            (rdx,) = _ref_grads(lambda v: R.softcap(v, cap), [x], g)
            assert rel_err(dx, rdx) < TOL[dtype], what + " dx vs autograd"


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
def test_softcap_saturates_to_the_cap_exactly(dtype):
    """Where tanh rounds to +-1 (|x / cap| > 20: in float64 too) the output is +-cap and the gradient
    exactly 0; inf gives +-cap, NaN stays NaN."""
    cap = 3.0
    x = torch.tensor([100.0, -100.0, 1e4, -1e4, float("inf"), float("-inf"), 0.0, float("nan")]).to(dtype)
    x = torch.cat([x, torch.randn(29).to(dtype)])  # (a vector tail too)
    out = torch.ops.dmfx.softcap(x, cap)
    assert torch.equal(out[:6], torch.tensor([cap, -cap] * 3).to(dtype)), out[:6]
    assert out[6] == 0 and torch.isnan(out[7])
    dx = torch.ops.dmfx.softcap_backward(torch.ones_like(x), out, cap)
    assert torch.equal(dx[:6], torch.zeros(6, dtype=dtype)) and dx[6] == 1, dx[:7]
    assert torch.isfinite(dx[8:]).all() and rel_err(out[8:], R.softcap(x[8:], cap)) < TOL[dtype]


def test_softcap_formula_written_out():
    x, g, cap = torch.randn(7, 45) * 6, torch.randn(7, 45), 4.0
    out = torch.ops.dmfx.softcap(x, cap)
    torch.testing.assert_close(out, cap * torch.tanh(x / cap), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.ops.dmfx.softcap_backward(g, out, cap), g * (1 - (out / cap) ** 2), rtol=1e-6,
                               atol=1e-6)
    # d/dx of cap * tanh(x / cap) = 1 - tanh(x / cap)^2
    torch.testing.assert_close(torch.ops.dmfx.softcap_backward(g, out, cap), g / torch.cosh(x / cap) ** 2, rtol=1e-5,
                               atol=1e-6)
    # a few ulp of each element, the small ones too (where out ~ x: a tanh with an absolute error of
    # 1e-7, e.g. 1 - 2 / (exp(2v) + 1), would be off by far more there)
    small = torch.logspace(-6, 0, 301) * torch.tensor([1.0, -1.0]).repeat(151)[:301]
    got, want = torch.ops.dmfx.softcap(small, cap).double(), cap * torch.tanh(small.double() / cap)
    assert ((got - want).abs() / want.abs()).max() < 4e-7


def test_softcap_gradcheck():
    x = _activation((3, 2), 7, torch.float64, "permuted").requires_grad_()
    assert torch.autograd.gradcheck(lambda v: torch.ops.dmfx.softcap(v, 1.7), (x,))
    assert torch.autograd.gradgradcheck(lambda v: P.softcap(v, 1.7), (x,))
    # softcap_backward on its own (out a free input): differentiable in grad_out and in out
    g = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    o = (torch.rand(4, 9, dtype=torch.float64) * 3.2 - 1.6).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: torch.ops.dmfx.softcap_backward(a, b, 1.7), (g, o))
    assert torch.autograd.gradgradcheck(lambda a, b: torch.ops.dmfx.softcap_backward(a, b, 1.7), (g, o))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_saves_its_output_and_nothing_else(dtype):
    """The point of the op: autograd keeps softcap's output (which a loss keeps anyway), not x, and not
    a tanh of x."""
    base = (torch.randn(5, 33) * 4).to(dtype).requires_grad_()
    x = base * 1.0  # (not a leaf: x may be written after the forward)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = P.softcap(x, 3.0)
    assert len(saved) == 1, [tuple(t.shape) for t in saved]
    assert saved[0].data_ptr() == out.data_ptr() and torch.equal(saved[0], out)
    # x itself is not needed: writing it after the forward leaves the backward as it was
    with torch.no_grad():
        x.add_(100.0)
    R_ = torch.randn(5, 33).to(dtype)
    out.backward(R_)
    (want,) = _ref_grads(lambda v: R.softcap(v, 3.0), [base], R_)
    assert rel_err(base.grad, want) < TOL[dtype] * 2


def test_softcap_opcheck():
    x = torch.randn(6, 4, 10).transpose(0, 1).requires_grad_()  # (a permuted x: the output is contiguous)
    opcheck(torch.ops.dmfx.softcap.default, (x, 2.0))
    out = torch.ops.dmfx.softcap(x.detach(), 2.0)
    g = torch.randn(4, 6, 10)
    opcheck(torch.ops.dmfx.softcap_backward.default, (g.requires_grad_(), out.requires_grad_(), 2.0))
    opcheck(torch.ops.dmfx.softcap.default, (torch.randn(0, 5), 0.5))
    # the fake describes the kernel's output: x's shape, contiguous
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fx = mode.from_tensor(x.detach())
    with mode:
        fake = torch.ops.dmfx.softcap(fx, 2.0)
    real = torch.ops.dmfx.softcap(x.detach(), 2.0)
    assert fake.shape == real.shape and fake.stride() == real.stride() and fake.dtype == real.dtype


@pytest.mark.parametrize("cap", [0.0, -1.5, float("inf"), float("-inf"), float("nan")])
def test_softcap_rejects_a_cap_that_is_not_positive_and_finite(cap):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(3, 8)
    mode = FakeTensorMode()
    fx = mode.from_tensor(x)
    message = rf"dmfx::softcap: cap must be positive and finite, got {cap:g}$"
    with pytest.raises(ValueError, match=message):
        torch.ops.dmfx.softcap(x, cap)
    with pytest.raises(ValueError, match=message), mode:  # (and tracing: the fake checks it too)
        torch.ops.dmfx.softcap(fx, cap)
    with pytest.raises(ValueError, match=message):
        torch.ops.dmfx.softcap(torch.empty(3, 8, device="meta"), cap)
    message = rf"dmfx::softcap_backward: cap must be positive and finite, got {cap:g}$"
    with pytest.raises(ValueError, match=message):
        torch.ops.dmfx.softcap_backward(x, x, cap)
    with pytest.raises(ValueError, match=message), mode:
        torch.ops.dmfx.softcap_backward(fx, fx, cap)


def test_softcap_errors():
    g, out = torch.randn(3, 4), torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"dmfx::softcap_backward: out must have the shape of grad_out \[3, 4\], got \[3, 5\]"):
        torch.ops.dmfx.softcap_backward(g, torch.randn(3, 5), 2.0)
    with pytest.raises(RuntimeError, match=r"dmfx::softcap_backward: out has dtype Half but grad_out has dtype Float"):
        torch.ops.dmfx.softcap_backward(g, out.half(), 2.0)
    with pytest.raises(RuntimeError, match=r"dmfx::softcap_backward: grad_out must be float32, float16, bfloat16 or float64"):
        torch.ops.dmfx.softcap_backward(g.int(), out.int(), 2.0)
    with pytest.raises(RuntimeError, match=r"dmfx::softcap: x must be float32, float16, bfloat16 or float64, got Int"):
        torch.ops.dmfx.softcap(torch.ones(3, dtype=torch.int32), 2.0)
    with pytest.raises(TypeError, match="dmfx::softcap: x must be a Tensor"):
        P.softcap([1.0, 2.0], 2.0)
    from dmfx.cuda_ops.build import kernels_for

    K = kernels_for("cpu")  # the kernels' own device checks (the dispatcher would send a meta tensor elsewhere)
    with pytest.raises(RuntimeError, match="dmfx::softcap_backward: out is on meta but grad_out is on cpu"):
        K.softcap_bwd(g, torch.empty(3, 4, device="meta"), 2.0)
    with pytest.raises(RuntimeError, match="dmfx::softcap: this is the CPU kernel but x is on meta"):
        K.softcap_fwd(torch.empty(3, 4, device="meta"), 2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_is_bit_reproducible_and_independent_of_the_thread_count(dtype):
    rows, N = 1500, 72  # rows split in chunks of 32768 / N: several per thread
    x, g = (torch.randn(rows, N) * 4).to(dtype), torch.randn(rows, N).to(dtype)
    before = torch.get_num_threads()
    results = []
    try:
        for n in (2, 2, 1):
            torch.set_num_threads(n)
            out = torch.ops.dmfx.softcap(x, 3.0)
            results.append((out, torch.ops.dmfx.softcap_backward(g, out, 3.0)))
    finally:
        torch.set_num_threads(before)
    for out, dx in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(dx, results[0][1])
