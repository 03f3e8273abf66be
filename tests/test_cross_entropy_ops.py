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
