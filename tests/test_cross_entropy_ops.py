"""dmfx::cross_entropy and its backward against the pure-PyTorch reference (reference.cross_entropy:
``F.cross_entropy`` on the logits upcast to float32) and against eager autograd in float64.

Tolerances: fp32 in relative norm 1e-5; fp16 / bf16 logits are read as they are and accumulated in
fp32, so the loss and lse compare with the fp32 reference of the same low-precision logits at 1e-5
too, and dlogits (rounded once to the logits' dtype) within 2e-3 (fp16) and 1e-2 (bf16). Gradients use
a random cotangent; each is judged relative to its own norm (one gradient per call).
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from torch.library import opcheck

import dmfx
from dmfx.cuda_ops import CROSS_ENTROPY_REDUCTIONS as CODES, reference as R

# Every test here runs on each CPU build of the kernels (conftest.cpu_build: native and AVX2).
pytestmark = pytest.mark.usefixtures("cpu_build")

IGNORE = -100
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
VOCAB = [1, 33, 2049, 5003]  # one class; above the vector width; one chunk (2048) and a bit, several
REDUCTIONS = ["none", "mean", "sum"]
SMOOTHING_REDUCTIONS = [(0.0, "mean"), (0.1, "none"), (0.0, "sum"), (0.2, "mean")]
op, backward_op = torch.ops.dmfx.cross_entropy.default, torch.ops.dmfx.cross_entropy_backward.default


def _logits(N, V, dtype, scale=3.0, strided=False):
    if strided:  # rows of a wider buffer: a row stride of V + 5, unit stride along V
        return (torch.randn(N, V + 5, dtype=torch.float64) * scale)[:, 2:V + 2].to(dtype)
    return (torch.randn(N, V, dtype=torch.float64) * scale).to(dtype)


def _target(N, V, ignored_every=3):
    t = torch.randint(0, V, (N,))
    if ignored_every:
        t[::ignored_every] = IGNORE
    return t


def _eager(logits, target, eps, reduction, cotangent, grad_logits=None):
    """Eager's loss and dlogits in float64 (logits upcast first), for a cotangent of the loss; the
    logits' own gradient grad_logits added as autograd would."""
    x = logits.detach().double().requires_grad_()
    loss = F.cross_entropy(x, target, ignore_index=IGNORE, label_smoothing=eps, reduction=reduction)
    (loss * cotangent.double()).sum().backward()
    return loss, x.grad if grad_logits is None else x.grad + grad_logits.double()


@pytest.mark.parametrize("eps, reduction", SMOOTHING_REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", VOCAB)
def test_forward_and_backward_match_the_reference(V, dtype, eps, reduction):
    x, t = _logits(11, V, dtype, strided=V > 1), _target(11, V)
    loss, lse = op(x, t, IGNORE, eps, CODES[reduction])
    ref_loss, ref_lse = R.cross_entropy(x, t, IGNORE, eps, CODES[reduction])
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    assert loss.dtype == lse.dtype == stat and loss.shape == ref_loss.shape and lse.shape == (11, 2)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    # (V = 1 with smoothing: every loss is 0 up to rounding; judged against the lse's scale)
    assert rel_err(loss, ref_loss, scale=ref_loss if V > 1 else ref_lse.sum(-1)) < tol
    assert rel_err(lse, ref_lse) < tol
    g = torch.randn(loss.shape, dtype=stat)
    dx = backward_op(g, x, t, lse, IGNORE, eps, CODES[reduction], None)
    want = _eager(x, t, eps, reduction, g)[1]
    assert dx.dtype == dtype and dx.shape == x.shape and dx.is_contiguous()
    assert rel_err(dx, want, scale=want if V > 1 else torch.ones(1)) < GRAD_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_grad_logits_is_added_in_the_same_pass(reduction, dtype):
    x, t = _logits(9, 301, dtype), _target(9, 301)
    loss, lse = op(x, t, IGNORE, 0.0, CODES[reduction])
    g, gl = torch.randn(loss.shape), torch.randn(9, 301, dtype=torch.float64)
    dx = backward_op(g, x, t, lse, IGNORE, 0.0, CODES[reduction], gl.to(dtype))
    want = _eager(x, t, 0.0, reduction, g, gl.to(dtype))[1]
    assert rel_err(dx, want) < GRAD_TOL[dtype]
    # a strided grad_logits (the tangent of a logits output read through a view) is read in place
    wide = torch.randn(9, 310).to(dtype)
    dx = backward_op(g, x, t, lse, IGNORE, 0.0, CODES[reduction], wide[:, 3:304])
    assert rel_err(dx, _eager(x, t, 0.0, reduction, g, wide[:, 3:304])[1]) < GRAD_TOL[dtype]


def test_autograd_through_the_op_matches_eager():
    x, t = _logits(16, 50, torch.float32).requires_grad_(), _target(16, 50)
    loss = dmfx.cross_entropy(x, t, label_smoothing=0.05)
    loss.backward()
    _, want = _eager(x, t, 0.05, "mean", torch.ones(()))
    assert rel_err(x.grad, want) < 1e-5


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_gradcheck_float64(eps, reduction):
    x, t = _logits(6, 9, torch.float64).requires_grad_(), _target(6, 9)
    assert torch.autograd.gradcheck(lambda x: op(x, t, IGNORE, eps, CODES[reduction])[0], (x,))


def test_double_backward_raises():
    x, t = _logits(4, 5, torch.float64).requires_grad_(), _target(4, 5, 0)
    (dx,) = torch.autograd.grad(op(x, t, IGNORE, 0.0, 1)[0], x, create_graph=True)
    with pytest.raises(NotImplementedError, match="dmfx::cross_entropy_backward: double backward"):
        dx.sum().backward()


def test_opcheck_both_ops():
    x, t = _logits(5, 13, torch.float32), _target(5, 13)
    for reduction in CODES.values():
        opcheck(op, (x, t, IGNORE, 0.1, reduction))
        loss, lse = op(x, t, IGNORE, 0.1, reduction)
        opcheck(backward_op, (torch.randn(loss.shape), x, t, lse, IGNORE, 0.1, reduction, None))
        opcheck(backward_op, (torch.randn(loss.shape), x, t, lse, IGNORE, 0.1, reduction, torch.randn(5, 13)))


# ------------------------------------------------------------------------------- soft-capped logits
# softcap > 0: the logits are c = cap * tanh(z / cap) (Gemma 2) and the op returns z's gradient, what it
# returns with softcap 0 times 1 - (c / cap)^2 (ignored rows too: their grad_logits times it).

CAP = 30.0


def _capped_logits(N, V, dtype, strided=False):
    """Soft-capped logits in `dtype` (|c| < CAP), rows of a wider buffer (row stride V + 5) if strided."""
    z = torch.randn(N, V + 5 if strided else V, dtype=torch.float64) * 25
    c = (CAP * torch.tanh(z / CAP)).clamp(-0.99 * CAP, 0.99 * CAP).to(dtype)
    return c[:, 2:V + 2] if strided else c


def _eager_capped(logits, target, eps, reduction, cotangent, grad_logits=None):
    """Eager autograd in float64 of F.cross_entropy(cap * tanh(z / cap)) w.r.t. the raw logits z, z the
    float64 preimage of `logits`; grad_logits: a cotangent of the capped logits themselves."""
    z = (CAP * torch.atanh(logits.double() / CAP)).requires_grad_()
    c = CAP * torch.tanh(z / CAP)
    loss = F.cross_entropy(c, target, ignore_index=IGNORE, label_smoothing=eps, reduction=reduction)
    total = (loss * cotangent.double()).sum()
    if grad_logits is not None:
        total = total + (c * grad_logits.double()).sum()
    total.backward()
    return z.grad


def _cap_factor(logits):
    c = logits.double() / CAP
    return 1 - c * c


@pytest.mark.parametrize("with_grad_logits", [False, True], ids=["no_grad_logits", "grad_logits"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_softcap_gives_the_raw_logits_gradient(dtype, reduction, with_grad_logits):
    N, V, eps = 7, 2100, 0.1  # (two of the CPU kernel's chunks)
    x, t = _capped_logits(N, V, dtype, strided=True), _target(N, V)  # rows 0, 3, 6 ignored
    assert x.stride(0) == V + 5
    loss, lse = op(x, t, IGNORE, eps, CODES[reduction])
    g = torch.randn(loss.shape, dtype=loss.dtype)
    gl = torch.randn(N, V).to(dtype) if with_grad_logits else None
    dz = backward_op(g, x, t, lse, IGNORE, eps, CODES[reduction], gl, CAP)
    assert dz.dtype == dtype and dz.shape == x.shape and dz.is_contiguous()
    # what the op returns today (softcap 0) times the cap's derivative (two roundings to bf16 there: 1e-2)
    today = backward_op(g, x, t, lse, IGNORE, eps, CODES[reduction], gl)
    assert rel_err(dz, today.double() * _cap_factor(x)) < GRAD_TOL[dtype]
    # eager autograd through the cap, w.r.t. the raw logits
    want = _eager_capped(x, t, eps, reduction, g, gl)
    assert rel_err(dz, want) < GRAD_TOL[dtype]
    ignored = t == IGNORE
    if gl is None:  # zeros, as without the cap
        assert not dz[ignored].any()
    else:  # grad_logits times the factor, on their own
        assert rel_err(dz[ignored], gl[ignored].double() * _cap_factor(x[ignored])) < GRAD_TOL[dtype]
        assert rel_err(dz[ignored], want[ignored]) < GRAD_TOL[dtype]


def test_opcheck_backward_with_softcap():
    x, t = _capped_logits(5, 13, torch.float32), _target(5, 13)
    for reduction in CODES.values():
        loss, lse = op(x, t, IGNORE, 0.1, reduction)
        opcheck(backward_op, (torch.randn(loss.shape), x, t, lse, IGNORE, 0.1, reduction, None, CAP))
        opcheck(backward_op, (torch.randn(loss.shape), x, t, lse, IGNORE, 0.1, reduction, torch.randn(5, 13)),
                {"softcap": CAP})


@pytest.mark.parametrize("cap, shown", [(-1.0, "-1"), (float("inf"), "inf"), (float("nan"), "nan")])
def test_a_bad_softcap_raises_value_error(cap, shown):
    x, t = torch.randn(4, 6), torch.tensor([0, 1, IGNORE, 3])
    _, lse = op(x, t, IGNORE, 0.0, 1)
    with pytest.raises(ValueError, match=rf"dmfx::cross_entropy_backward: softcap must be finite and >= 0 .*, got {shown}"):
        backward_op(torch.ones(()), x, t, lse, IGNORE, 0.0, 1, None, cap)


# ------------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_every_row_ignored_matches_pytorch(reduction):
    x, t = _logits(4, 10, torch.float32).requires_grad_(), torch.full((4,), IGNORE)
    loss = dmfx.cross_entropy(x, t, reduction=reduction)
    want = F.cross_entropy(x.detach(), t, reduction=reduction)  # mean: nan (0 / 0); sum: 0; none: zeros
    torch.testing.assert_close(loss, want, equal_nan=True)
    loss.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))  # eager's gradient is zero there too


def test_one_row_and_an_empty_batch():
    x, t = _logits(1, 37, torch.float32), torch.tensor([5])
    assert rel_err(dmfx.cross_entropy(x, t), F.cross_entropy(x, t)) < 1e-6
    empty, no_t = torch.empty(0, 37), torch.empty(0, dtype=torch.long)
    torch.testing.assert_close(dmfx.cross_entropy(empty, no_t), F.cross_entropy(empty, no_t), equal_nan=True)
    assert dmfx.cross_entropy(empty, no_t, reduction="sum").item() == 0.0
    loss, lse = op(empty, no_t, IGNORE, 0.0, 2)
    assert backward_op(torch.ones(()), empty, no_t, lse, IGNORE, 0.0, 2, None).shape == (0, 37)


def test_another_ignore_index_and_a_target_equal_to_it_inside_the_classes():
    x, t = _logits(6, 8, torch.float32), torch.tensor([0, 3, 3, 7, 1, 3])
    for ii in (3, -1):
        want = F.cross_entropy(x, t, ignore_index=ii)
        assert rel_err(dmfx.cross_entropy(x, t, ignore_index=ii), want) < 1e-6


def test_nan_and_masked_logits_give_what_eager_gives():
    x, t = _logits(4, 16, torch.float32), torch.tensor([1, 2, 3, 4])
    x[0, 5] = float("nan")  # a NaN row: NaN loss
    x[1, :8] = float("-inf")  # a vocabulary mask: finite
    x[3, 6] = float("nan")  # NaN in an ignored row: ignored
    t[3] = IGNORE
    loss, _ = op(x, t, IGNORE, 0.0, CODES["none"])
    torch.testing.assert_close(loss, F.cross_entropy(x, t, reduction="none"), equal_nan=True)


@pytest.mark.parametrize("where", [0, 17, 40, 95, 99])
def test_a_nan_anywhere_in_a_long_row_gives_a_nan_loss(where):
    """The row max runs in vectors (at::vec::maximum) over the body of the row and element by element over
    its tail: a NaN in the first vector, a later one, or the tail makes the row's loss NaN (eager's), and
    the other rows keep their values."""
    x, t = _logits(3, 100, torch.float32), torch.tensor([1, 2, 3])
    x[1, where] = float("nan")
    x[2, 30:] = float("-inf")
    loss, _ = op(x, t, IGNORE, 0.0, CODES["none"])
    torch.testing.assert_close(loss, F.cross_entropy(x, t, reduction="none"), equal_nan=True)
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2]]).all()


def test_large_logits_lose_no_precision():
    # eager's log_softmax keeps z - max exact; so does the kernel's (max, log-sum) pair, forward and backward
    # (without smoothing: its mean-logit term sums the raw logits in fp32, cross_entropy_api.h)
    x, t = _logits(3, 100, torch.float32, scale=1.0) + 1e4, torch.tensor([0, 50, 99])
    loss, lse = op(x, t, IGNORE, 0.0, 2)
    want, dwant = _eager(x, t, 0.0, "sum", torch.ones(()))
    assert rel_err(loss, want) < 1e-6
    assert rel_err(backward_op(torch.ones(()), x, t, lse, IGNORE, 0.0, 2, None), dwant) < 1e-6


# ------------------------------------------------------------------------------- bad input


def test_bad_input_gives_clear_errors():
    x, t = torch.randn(4, 6), torch.tensor([0, 1, 2, 3])
    with pytest.raises(IndexError, match=r"dmfx::cross_entropy: target\[2\] = 6 is neither a class of the logits' 6"):
        op(x, torch.tensor([0, 1, 6, IGNORE]), IGNORE, 0.0, 1)
    with pytest.raises(IndexError, match=r"target\[0\] = -3"):
        op(x, torch.tensor([-3, 1, 2, 3]), IGNORE, 0.0, 1)
    with pytest.raises(RuntimeError, match="dmfx::cross_entropy: target must be int64 class indices, got Int"):
        op(x, t.int(), IGNORE, 0.0, 1)
    with pytest.raises(RuntimeError, match=r"target must have shape \[N\] = \[4\]"):
        op(x, t[:3], IGNORE, 0.0, 1)
    with pytest.raises(RuntimeError, match=r"logits must have shape \[N, V\]"):
        op(x[None], t, IGNORE, 0.0, 1)
    with pytest.raises(RuntimeError, match="logits must be float32, float16, bfloat16 or float64, got Long"):
        op(t[:, None].expand(4, 6).contiguous(), t, IGNORE, 0.0, 1)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\], got 1.5"):
        op(x, t, IGNORE, 1.5, 1)
    with pytest.raises(ValueError, match="reduction must be 0 \\(none\\), 1 \\(mean\\) or 2 \\(sum\\), got 3"):
        op(x, t, IGNORE, 0.0, 3)
    with pytest.raises(ValueError, match="reduction must be one of"):
        dmfx.cross_entropy(x, t, reduction="avg")
    with pytest.raises(TypeError, match="dmfx::cross_entropy: target must be a Tensor"):
        dmfx.cross_entropy(x, [0, 1, 2, 3])


def test_bad_backward_input_gives_clear_errors():
    x, t = torch.randn(4, 6), torch.tensor([0, 1, 2, 3])
    _, lse = op(x, t, IGNORE, 0.0, 1)
    with pytest.raises(RuntimeError, match=r"dmfx::cross_entropy_backward: grad_loss must be a Float tensor .* of shape \[\]"):
        backward_op(torch.ones(4), x, t, lse, IGNORE, 0.0, 1, None)
    with pytest.raises(RuntimeError, match=r"grad_loss must be .* of shape \[N\]"):
        backward_op(torch.ones(()), x, t, lse, IGNORE, 0.0, 0, None)
    with pytest.raises(RuntimeError, match=r"lse must be the forward's \[4, 2\] Float tensor"):
        backward_op(torch.ones(()), x, t, lse[:3], IGNORE, 0.0, 1, None)
    with pytest.raises(RuntimeError, match="grad_logits must have the shape, dtype and device of logits"):
        backward_op(torch.ones(()), x, t, lse, IGNORE, 0.0, 1, torch.randn(4, 6).double())


# ------------------------------------------------------------------------------- linear_cross_entropy
# dmfx::linear_cross_entropy (the logits GEMM and the loss, chunk by chunk) against the reference on the
# whole [N, V] logits (reference.linear_cross_entropy) and against eager autograd in float64. Tolerances:
# fp32 1e-5 (loss, lse, gradients); bf16: the loss and lse within 2e-3 of the reference on the same bf16
# inputs (the chunk's GEMM may round a logit differently from the whole GEMM's), the gradients within
# 2e-2 of float64 eager (dlogits, dhidden and each chunk's share of dweight are rounded to bf16 once).

lce_op, lce_backward_op = torch.ops.dmfx.linear_cross_entropy.default, torch.ops.dmfx.linear_cross_entropy_backward.default
LCE_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-3, 2e-2), torch.float64: (1e-12, 1e-12)}
LCE_CHUNKS = [1, 5, 13, 64]  # one row; N (13) not a multiple; exactly N; more than N


def _lce_inputs(N, H, V, dtype, bias=True, ignored_every=3, strided=False):
    h = torch.randn(N, H + 3 if strided else H, dtype=torch.float64)[:, :H].to(dtype)  # (rows of a wider buffer)
    w = (torch.randn(V, H, dtype=torch.float64) / H**0.5 * 3).to(dtype)
    b = torch.randn(V, dtype=torch.float64).to(dtype) if bias else None
    return h, w, b, _target(N, V, ignored_every)


def _lce_eager(h, w, b, t, eps, reduction, cotangent):
    """Eager's loss and gradients of hidden, weight, bias in float64."""
    xs = [x.detach().double().requires_grad_() if x is not None else None for x in (h, w, b)]
    loss = F.cross_entropy(F.linear(*xs), t, ignore_index=IGNORE, label_smoothing=eps, reduction=reduction)
    (loss * cotangent.double()).sum().backward()
    return loss, [x.grad if x is not None else None for x in xs]


# (reduction, gradients computed in the forward): with reduction none they are always recomputed
LCE_MODES = [("mean", True), ("mean", False), ("sum", True), ("sum", False), ("none", False)]


@pytest.mark.parametrize("chunk", LCE_CHUNKS)
@pytest.mark.parametrize("reduction, in_forward", LCE_MODES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_matches_the_reference(dtype, bias, reduction, in_forward, chunk):
    h, w, b, t = _lce_inputs(13, 24, 37, dtype, bias, strided=True)
    eps = 0.1 if reduction == "sum" else 0.0
    loss, lse = lce_op(h, w, b, t, IGNORE, eps, CODES[reduction], chunk, [False] * 3)[:2]
    ref_loss, ref_lse = R.linear_cross_entropy(h, w, b, t, IGNORE, eps, CODES[reduction])
    tol, grad_tol = LCE_TOL[dtype]
    assert loss.dtype == lse.dtype == torch.float32 and loss.shape == ref_loss.shape
    assert rel_err(loss, ref_loss) < tol and rel_err(lse, ref_lse) < tol
    # gradients through autograd, computed in the forward (mean, sum) or recomputed in the backward
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in (h, w, b)]
    got = dmfx.linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], label_smoothing=eps,
                                                           reduction=reduction, chunk=chunk, grads_in_forward=in_forward)
    g = torch.randn(got.shape)
    (got * g).sum().backward()
    want_loss, want = _lce_eager(h, w, b, t, eps, reduction, g)
    assert rel_err(got, want_loss) < max(tol, 1e-5)
    for name, x, d in zip(("hidden", "weight", "bias"), leaves, want):
        if x is not None:
            assert x.grad.dtype == dtype and rel_err(x.grad, d) < grad_tol, name


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_cross_entropy_float64_and_the_forward_gradients_directly(reduction):
    h, w, b, t = _lce_inputs(9, 6, 11, torch.float64)
    grads = [reduction != "none"] * 3
    loss, lse, dh, dw, db = lce_op(h, w, b, t, IGNORE, 0.0, CODES[reduction], 4, grads)
    want_loss, want = _lce_eager(h, w, b, t, 0.0, reduction, torch.ones(()) if reduction != "none" else torch.ones(9))
    assert rel_err(loss, want_loss) < 1e-12
    if reduction == "none":
        assert dh.numel() == dw.numel() == db.numel() == 0  # (not computed: the empty stand-ins)
        return
    for got, exp in zip((dh, dw, db), want):  # at a unit loss gradient
        assert got.dtype == torch.float64 and rel_err(got, exp) < 1e-12


@pytest.mark.parametrize("reduction, in_forward", LCE_MODES)
def test_linear_cross_entropy_gradcheck_float64(reduction, in_forward):
    h, w, b, t = (x.requires_grad_() if x.is_floating_point() else x for x in _lce_inputs(7, 5, 9, torch.float64))
    flags = [in_forward] * 3

    def fn(h, w, b):
        return lce_op(h, w, b, t, IGNORE, 0.1, CODES[reduction], 3, flags)[0]

    assert torch.autograd.gradcheck(fn, (h, w, b))
    assert torch.autograd.gradcheck(lambda h, w: lce_op(h, w, None, t, IGNORE, 0.0, CODES[reduction], 2, flags[:2] + [False])[0],
                                    (h, w))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_cross_entropy_every_row_ignored_matches_pytorch(reduction):
    h, w, b, _ = _lce_inputs(6, 8, 10, torch.float32)
    t = torch.full((6,), IGNORE)
    leaves = [x.requires_grad_() for x in (h, w, b)]
    loss = dmfx.linear_cross_entropy(h, w, t, b, reduction=reduction, chunk=4)
    want = F.cross_entropy(F.linear(h, w, b).detach(), t, reduction=reduction)  # mean: nan; sum: 0; none: zeros
    torch.testing.assert_close(loss, want, equal_nan=True)
    loss.sum().backward()
    for x in leaves:
        assert torch.equal(x.grad, torch.zeros_like(x))


def test_linear_cross_entropy_empty_batch():
    w, t = torch.randn(7, 4), torch.empty(0, dtype=torch.long)
    h = torch.empty(0, 4)
    for reduction in CODES.values():
        loss, lse = lce_op(h, w, None, t, IGNORE, 0.0, reduction, 8, [False] * 3)[:2]
        torch.testing.assert_close(loss, F.cross_entropy(torch.empty(0, 7), t, reduction=("none", "mean", "sum")[reduction]),
                                   equal_nan=True)
        assert lse.shape == (0, 2)
    grads = lce_backward_op(torch.ones(()), h, w, None, t, lse, IGNORE, 0.0, 2, 8, [True, True, False])
    assert grads[0].shape == (0, 4) and torch.equal(grads[1], torch.zeros(7, 4)) and grads[2].numel() == 0


def test_linear_cross_entropy_never_holds_the_logits():
    """Peak memory of a forward + backward: a few [chunk, V] buffers and the [V, H] gradient, far below the
    [N, V] logits eager makes (dmfx.explain's counter sees inside the composite op)."""
    from dmfx.explain import peak_memory

    N, H, V, chunk = 512, 8, 1000, 16
    h, w, b, t = (x.requires_grad_() if x.is_floating_point() else x for x in _lce_inputs(N, H, V, torch.float32))
    logits_bytes = N * V * 4
    for in_forward, reduction in ((True, "mean"), (False, "mean"), (False, "none")):
        def step():
            h.grad = w.grad = b.grad = None
            loss = dmfx.linear_cross_entropy(h, w, t, b, reduction=reduction, chunk=chunk,
                                                                    grads_in_forward=in_forward)
            loss.sum().backward()

        peak = peak_memory(step, device="cpu").peak_bytes
        assert 0 < peak < logits_bytes / 8, (in_forward, reduction, peak)
    eager = peak_memory(lambda: F.cross_entropy(F.linear(h, w, b), t).backward(), device="cpu").peak_bytes
    assert eager >= 2 * logits_bytes  # (the counter sees eager's logits, their log-probabilities and gradient)


def test_linear_cross_entropy_double_backward_raises():
    h, w, _, t = _lce_inputs(5, 4, 6, torch.float64, False)
    h, w = h.requires_grad_(), w.requires_grad_()
    for flags in ([True, True, False], [False, False, False]):
        dh, = torch.autograd.grad(lce_op(h, w, None, t, IGNORE, 0.0, 1, 2, flags)[0], h, create_graph=True)
        with pytest.raises(NotImplementedError, match="dmfx::linear_cross_entropy_backward: double backward"):
            dh.sum().backward()


def test_linear_cross_entropy_opcheck():
    h, w, b, t = _lce_inputs(7, 5, 9, torch.float32)
    for reduction in CODES.values():
        grads = [reduction != 0] * 3
        opcheck(lce_op, (h, w, b, t, IGNORE, 0.1, reduction, 3, [False] * 3))
        opcheck(lce_op, (h.requires_grad_(), w.requires_grad_(), b.requires_grad_(), t, IGNORE, 0.1, reduction, 3, grads))
        opcheck(lce_op, (h, w, None, t, IGNORE, 0.0, reduction, 16, [False] * 3))
        h, w, b = (x.detach() for x in (h, w, b))
        loss, lse, dh, dw, db = lce_op(h, w, b, t, IGNORE, 0.1, reduction, 3, grads)
        g = torch.randn(loss.shape)
        opcheck(lce_backward_op, (g, h, w, b, t, lse, IGNORE, 0.1, reduction, 3, [True, True, True]))
        if reduction != 0:
            opcheck(lce_backward_op, (g, h, w, b, t, lse, IGNORE, 0.1, reduction, 3, [True, True, True], dh, dw, db))


def test_default_chunk():
    from dmfx.cuda_ops.cross_entropy import CHUNK_ELEMENTS, default_chunk

    for V in (1, 1000, 32000, 50257, 128256, 256000):
        c = default_chunk(1 << 20, V)
        assert c & (c - 1) == 0 and c >= 256 and (c * V <= CHUNK_ELEMENTS or c == 256), (V, c)
    assert default_chunk(100, 32000) == 128 and default_chunk(1, 32000) == 1 and default_chunk(0, 5) == 1
    assert default_chunk(None, 32000) == 512 and default_chunk(None, 128256) == 256  # (N unknown: no cap)


def test_linear_cross_entropy_bad_input_gives_clear_errors():
    h, w, b, t = _lce_inputs(4, 6, 5, torch.float32, ignored_every=0)

    def call(h=h, w=w, b=b, t=t, chunk=2, reduction=1, grads=(False, False, False), eps=0.0):
        return lce_op(h, w, b, t, IGNORE, eps, reduction, chunk, list(grads))

    with pytest.raises(ValueError, match=r"dmfx::linear_cross_entropy: chunk \(rows per chunk\) must be a positive integer, got 0"):
        call(chunk=0)
    with pytest.raises(ValueError, match="chunk .* got -3"):
        call(chunk=-3)
    with pytest.raises(ValueError, match=r"dmfx::linear_cross_entropy: hidden must be 2-D \[N, H\], got shape \[1, 4, 6\]"):
        call(h=h[None])
    with pytest.raises(ValueError, match=r"weight must be \[V, H\] = \[V, 6\] \(F.linear's convention\), got shape \[6, 5\]"):
        call(w=w.t())
    with pytest.raises(ValueError, match=r"bias must be \[V\] = \[5\], got shape \[1, 5\]"):
        call(b=b[None])
    with pytest.raises(TypeError, match="weight must have hidden's dtype torch.float32, got torch.float64"):
        call(w=w.double())
    with pytest.raises(TypeError, match="hidden must be float32, float16, bfloat16 or float64, got torch.int64"):
        call(h=h.long(), w=w.long(), b=b.long())
    with pytest.raises(ValueError, match="weight is on meta but hidden is on cpu"):
        call(w=w.to("meta"))
    with pytest.raises(ValueError, match="target is on meta but hidden is on cpu"):
        call(t=t.to("meta"))
    with pytest.raises(ValueError, match=r"hidden must have a unit stride along H \(its last dim\)"):
        call(h=torch.randn(6, 4).t())
    with pytest.raises(ValueError, match=r"target must be int64 class indices of shape \[N\] = \[4\], got torch.int32"):
        call(t=t.int())
    with pytest.raises(ValueError, match=r"target must be .* of shape \[N\] = \[4\], got torch.int64 of shape \[3\]"):
        call(t=t[:3])
    with pytest.raises(IndexError, match=r"dmfx::linear_cross_entropy: target\[3\] = 5 is neither a class of the weight's 5"):
        call(t=torch.tensor([0, 1, IGNORE, 5]), chunk=2)  # (the row in the batch, not in its chunk)
    with pytest.raises(ValueError, match="reduction must be 0 \\(none\\), 1 \\(mean\\) or 2 \\(sum\\), got 4"):
        call(reduction=4)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\], got -0.5"):
        call(eps=-0.5)
    with pytest.raises(ValueError, match="grads .* need a reduced loss"):
        call(reduction=0, grads=(True, False, False))
    with pytest.raises(ValueError, match=r"grads\[2\] asks for the bias's gradient but bias is None"):
        call(b=None, grads=(False, False, True))
    with pytest.raises(ValueError, match="reduction must be one of"):
        dmfx.linear_cross_entropy(h, w, t, reduction="avg")
    with pytest.raises(TypeError, match="dmfx::linear_cross_entropy: weight must be a Tensor"):
        dmfx.linear_cross_entropy(h, w.tolist(), t)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:  # the fake runs the same checks: tracing fails alike
        fake = [mode.from_tensor(x) for x in (h, w, b, t)]
        with pytest.raises(ValueError, match="chunk .* got 0"):
            lce_op(*fake, IGNORE, 0.0, 1, 0, [False] * 3)
        with pytest.raises(ValueError, match=r"weight must be \[V, H\]"):
            lce_op(fake[0], fake[1].t(), *fake[2:], IGNORE, 0.0, 1, 2, [False] * 3)


def test_linear_cross_entropy_backward_bad_input_gives_clear_errors():
    h, w, b, t = _lce_inputs(4, 6, 5, torch.float32, ignored_every=0)
    loss, lse, dh, dw, db = lce_op(h, w, b, t, IGNORE, 0.0, 1, 2, [True, True, True])

    def call(g=None, lse=lse, reduction=1, mask=(True, True, True), given=(None, None, None)):
        g = torch.ones(()) if g is None else g
        return lce_backward_op(g, h, w, b, t, lse, IGNORE, 0.0, reduction, 2, list(mask), *given)

    with pytest.raises(ValueError, match=r"dmfx::linear_cross_entropy_backward: grad_loss must be a torch.float32 tensor of shape \[\]"):
        call(g=torch.ones(4))
    with pytest.raises(ValueError, match=r"grad_loss must be a torch.float32 tensor of shape \[4\]"):
        call(reduction=0)
    with pytest.raises(ValueError, match=r"lse must be the forward's \[4, 2\] torch.float32 tensor"):
        call(lse=lse[:3])
    with pytest.raises(ValueError, match=r"dweight must be the forward's gradient of weight"):
        call(given=(None, dw[:2], None))
    with pytest.raises(ValueError, match="dhidden .* needs a reduced loss"):
        call(g=torch.ones(4), reduction=0, given=(dh, None, None))
