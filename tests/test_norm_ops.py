"""The fused ops against their pure-PyTorch references (cuda_ops/reference.py).

Tolerances: fp32 compares to a float32 reference at rtol 1e-5 (relative norm); fp16 and bf16 compare
the kernel (which accumulates in fp32 and rounds once) with the reference computed in fp32 from the
same low-precision inputs and rounded once: relative-norm error within 2e-3 (fp16) and 1e-2 (bf16),
i.e. a few units in the last place of the output dtype.
"""

import pytest
import torch
from conftest import rel_err
from torch.library import opcheck

import dmfx
from dmfx.cuda_ops import new_seed, reference as R

# Every test here runs on each CPU build of the kernels (conftest.cpu_build: native and AVX2).
pytestmark = pytest.mark.usefixtures("cpu_build")

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
HIDDEN = [1, 7, 768, 1023]
LEAD = [(0,), (3,), (2, 5)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(lead, H, dtype, *, noncontig=False):
    x = torch.randn(*lead, H) * 2 + 0.5
    if noncontig and len(lead) == 2:
        x = torch.randn(lead[1], lead[0], H).transpose(0, 1) * 2 + 0.5
    return x.to(dtype), torch.randn(H).to(dtype), torch.randn(H).to(dtype)


def _seed():
    return new_seed()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("lead", LEAD)
def test_layer_norm_matches_reference(lead, H, dtype):
    x, w, b = _inputs(lead, H, dtype)
    out, mean, rstd = torch.ops.dmfx.layer_norm(x, w, b, 1e-5)
    ref = R.layer_norm(x, w, b, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype and mean.shape == x.shape[:-1]
    if x.numel():
        assert rel_err(out, ref) < TOL[dtype]
        xf = x.float()
        torch.testing.assert_close(mean, xf.mean(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", HIDDEN)
def test_rms_norm_matches_reference(H, dtype):
    x, w, _ = _inputs((2, 5), H, dtype)
    out, rstd = torch.ops.dmfx.rms_norm(x, w, 1e-6)
    assert rel_err(out, R.rms_norm(x, w, 1e-6)) < TOL[dtype]
    assert rstd.dtype == torch.float32 and rstd.shape == (2, 5)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [7, 768, 1023])
def test_bias_dropout_residual_norm_matches_reference(H, dtype, p, rms):
    x, w, nb = _inputs((2, 5), H, dtype, noncontig=True)
    bias, res = torch.randn(H).to(dtype), torch.randn(2, 5, H).to(dtype)
    seed = _seed()
    out, s, mean, rstd = torch.ops.dmfx.bias_dropout_residual_norm(x, bias, res, w, nb, seed, p, 1e-5, rms, True)
    ref_out, ref_s = R.bias_dropout_residual_norm(x, bias, res, w, nb, seed, p, 1e-5, rms)
    assert rel_err(out, ref_out) < TOL[dtype]
    assert rel_err(s, ref_s) < TOL[dtype]
    assert mean.numel() == (0 if rms else 10)


def test_noncontiguous_inputs_are_read_in_place():
    base = torch.randn(6, 4, 32)
    x = base.permute(1, 0, 2)  # [4, 6, 32], leading dims permuted, last dim unit stride
    w, b = torch.randn(32), torch.randn(32)
    assert not x.is_contiguous()
    out = dmfx.layer_norm(x, w, b)
    assert rel_err(out, R.layer_norm(x.contiguous(), w, b, 1e-5)) < 1e-6
    # last dim strided too (falls back to a contiguous copy inside the kernel wrapper)
    y = torch.randn(5, 32).t()  # [32, 5] with stride 32 along the normalized dim
    assert rel_err(dmfx.layer_norm(y, w[:5].contiguous(), None), R.layer_norm(y.contiguous(), w[:5], None, 1e-5)) < 1e-6


def test_empty_batch_forward_and_backward():
    x = torch.randn(0, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    out = dmfx.layer_norm(x, w, b)
    out.sum().backward()
    assert out.shape == (0, 16)
    assert torch.equal(w.grad, torch.zeros(16)) and torch.equal(b.grad, torch.zeros(16))


# ------------------------------------------------------------------------------- gradients


def _dbl(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def test_gradcheck_layer_norm():
    x, w, b = _dbl(3, 4, 9), _dbl(9), _dbl(9)
    assert torch.autograd.gradcheck(lambda x, w, b: torch.ops.dmfx.layer_norm(x, w, b, 1e-5)[0], (x, w, b))
    assert torch.autograd.gradcheck(lambda x: torch.ops.dmfx.layer_norm(x, None, None, 1e-5)[0], (x,))


def test_gradcheck_rms_norm():
    x, w = _dbl(5, 9), _dbl(9)
    assert torch.autograd.gradcheck(lambda x, w: torch.ops.dmfx.rms_norm(x, w, 1e-6)[0], (x, w))


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("rms", [False, True])
def test_gradcheck_bias_dropout_residual_norm(p, rms):
    x, bias, res, w, nb = _dbl(2, 3, 8), _dbl(8), _dbl(2, 3, 8), _dbl(8), _dbl(8)
    seed = _seed()

    def f(x, bias, res, w, nb):
        out, s, _, _ = torch.ops.dmfx.bias_dropout_residual_norm(x, bias, res, w, nb, seed, p, 1e-5, rms, True)
        return out, s

    assert torch.autograd.gradcheck(f, (x, bias, res, w, nb))


def test_gradcheck_dropout():
    x, seed = _dbl(4, 7), _seed()
    assert torch.autograd.gradcheck(lambda x: torch.ops.dmfx.dropout(x, seed, 0.4), (x,))


# ------------------------------------------------------------------------------- opcheck


def test_opcheck_all_ops():
    x, w, b = torch.randn(3, 5, 16, requires_grad=True), torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    res, bias = torch.randn(3, 5, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    seed = _seed()
    opcheck(torch.ops.dmfx.layer_norm.default, (x, w, b, 1e-5))
    opcheck(torch.ops.dmfx.layer_norm.default, (x, None, None, 1e-5))
    opcheck(torch.ops.dmfx.rms_norm.default, (x, w, 1e-6))
    for rms in (False, True):
        opcheck(torch.ops.dmfx.bias_dropout_residual_norm.default, (x, bias, res, w, b, seed, 0.1, 1e-5, rms, True))
        opcheck(torch.ops.dmfx.bias_dropout_residual_norm.default, (x, None, res, w, None, None, 0.0, 1e-5, rms, False))
    opcheck(torch.ops.dmfx.dropout.default, (x, seed, 0.2))
    out, _, mean, rstd = torch.ops.dmfx.bias_dropout_residual_norm(x, bias, res, w, b, seed, 0.1, 1e-5, False, False)
    opcheck(
        torch.ops.dmfx.norm_backward.default,
        (torch.randn_like(x), None, x.detach(), bias.detach(), res.detach(), w.detach(), mean.detach(), rstd.detach(), seed,
         0.1, False, [True, True, True, True, True]),
    )


# ------------------------------------------------------------------------------- dropout


def test_dropout_p0_is_exact_identity():
    x = torch.randn(64, 33)
    assert torch.equal(torch.ops.dmfx.dropout(x, _seed(), 0.0), x)
    out = torch.ops.dmfx.bias_dropout_residual_norm(x, None, None, None, None, _seed(), 0.0, 1e-5, False, True)[1]
    assert torch.equal(out, x)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_statistics(p):
    x = torch.ones(1000, 1000)
    out = torch.ops.dmfx.dropout(x, _seed(), p)
    kept = (out != 0).double().mean().item()
    n = x.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(kept - (1 - p)) < 6 * sigma  # kept fraction
    assert abs(out.double().mean().item() - 1.0) < 6 * sigma / (1 - p)  # inverted scaling keeps the mean
    assert torch.allclose(out[out != 0], torch.tensor(1 / (1 - p)))


def test_dropout_same_seed_same_mask_and_matches_numpy_philox():
    x, seed = torch.randn(37, 41), _seed()
    a, b = torch.ops.dmfx.dropout(x, seed, 0.3), torch.ops.dmfx.dropout(x, seed, 0.3)
    assert torch.equal(a, b)
    assert not torch.equal(a, torch.ops.dmfx.dropout(x, _seed(), 0.3))
    keep = R.philox_keep(x.numel(), 0.3, seed).reshape(x.shape)
    assert torch.equal(a != 0, keep & (x != 0))
    # the fused norm op uses the same mask for the same logical elements
    s = torch.ops.dmfx.bias_dropout_residual_norm(x, None, None, None, None, seed, 0.3, 1e-5, False, True)[1]
    assert torch.equal(s, a)


def test_manual_seed_reproduces_dropout():
    x = torch.randn(128, 64)
    torch.manual_seed(123)
    a = dmfx.dropout(x, 0.5)
    torch.manual_seed(123)
    b = dmfx.dropout(x, 0.5)
    assert torch.equal(a, b)


def test_dropout_backward_regenerates_the_mask():
    x = torch.randn(50, 20, requires_grad=True)
    seed = _seed()
    out = torch.ops.dmfx.dropout(x, seed, 0.25)
    (g,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(g != 0, out.detach() != 0)


# ------------------------------------------------------------------------------- bad input


def test_bad_input_gives_clear_errors():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r"dmfx::norm_fwd: weight must have shape \[8\]"):
        torch.ops.dmfx.layer_norm(x, torch.randn(7), None, 1e-5)
    with pytest.raises(RuntimeError, match="dmfx::norm_fwd: bias has dtype"):
        torch.ops.dmfx.bias_dropout_residual_norm(x, torch.randn(8, dtype=torch.float64), None, None, None, None, 0.0, 1e-5, False, False)
    with pytest.raises(RuntimeError, match="residual must have the shape of x"):
        torch.ops.dmfx.bias_dropout_residual_norm(x, None, torch.randn(4, 9), None, None, None, 0.0, 1e-5, False, False)
    with pytest.raises(ValueError, match=r"dropout probability p must be in \[0, 1\]"):
        torch.ops.dmfx.dropout(x, _seed(), 1.5)
    with pytest.raises(ValueError, match="seed must be an int64 CPU tensor"):
        torch.ops.dmfx.dropout(x, torch.zeros(3, dtype=torch.int64), 0.1)
    with pytest.raises(RuntimeError, match="x must be float32, float16, bfloat16 or float64"):
        torch.ops.dmfx.layer_norm(torch.ones(4, 8, dtype=torch.int32), None, None, 1e-5)
    with pytest.raises(RuntimeError, match="non-empty last"):
        torch.ops.dmfx.layer_norm(torch.randn(4, 0), None, None, 1e-5)
