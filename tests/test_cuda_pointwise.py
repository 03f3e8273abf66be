"""The pointwise family's CUDA kernels (cuda_ops/csrc/pointwise_cuda.cu) against the CPU kernels.

The CPU kernels (pointwise_cpu.cpp) are the specification. On a machine with a CUDA GPU these tests
check that the CUDA extension

* draws bit-identical dropout masks in bias_act_fwd / bias_act_bwd (same Philox mapping);
* matches bias_act_fwd / bias_act_bwd (out, dx, dbias, partial output masks), glu_fwd / glu_bwd and
  rope (forward and inverse) for every activation, and softcap_fwd / softcap_bwd (with its saturation
  to exactly +-cap), N in {1, 7, 768, 1023, 4096} (odd sizes take the scalar path, the others the
  128-bit path), rows in {0, 1, 5, 64}, contiguous / permuted / unaligned (scalar path) inputs, fp32,
  fp64, fp16 and bf16;
* reduces the bias gradient over many rows (grid-stride loop, partials + column sums), deterministically;
* runs the torch.library ops with autograd on the GPU;
* rejects tensors on the wrong device.

Without a GPU every test is skipped.

Tolerances (absolute tolerances scaled by 1 + max|expected|): fp32 rtol 1e-4 / atol 1e-5 (CUDA's
erff/expf/tanhf and ATen's vectorized CPU versions differ by a few ulp); fp64 1e-9 / 1e-11; fp16 and
bf16: the CUDA and the CPU result are both compared with the CPU kernel run on the upcast fp32
inputs (same seed, same mask), within 2e-3 (fp16) and 1.6e-2 (bf16): about four units of roundoff.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_kernel_close as assert_close

from dmfx.cuda_ops import build, pointwise as P

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = "cuda"
SEED, OFFSET = 1234, 56
TOL = {
    torch.float32: (1e-4, 1e-5),
    torch.float64: (1e-9, 1e-11),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
LOW = (torch.float16, torch.bfloat16)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
DTYPE_IDS = ["fp32", "fp16", "bf16", "fp64"]
ACT_CODES = {name: i for i, name in enumerate(P.ACTS)}


@pytest.fixture(scope="module")
def cpu_ext():
    return build.load("cpu")


@pytest.fixture(scope="module")
def cuda_ext():
    return build.load("cuda")


def activation(rows, N, dtype, layout, gen, device, positive=False):
    """[rows, N] in `layout` (permuted: [rows/2, 2, N] viewed transposed; unaligned: rows at an odd
    offset, the scalar path); the same values on every device. positive: in [0.5, 1.5) (then an
    output of 0 means dropped)."""
    shape = {"permuted": (2, rows // 2, N), "unaligned": (rows, N + 1)}.get(layout, (rows, N))
    assert layout != "permuted" or rows % 2 == 0
    base = torch.rand(shape, generator=gen) + 0.5 if positive else torch.randn(shape, generator=gen) * 2 + 0.3
    t = base.to(dtype).to(device)
    if layout == "permuted":
        return t.transpose(0, 1)
    if layout == "unaligned":
        return t[:, 1:]
    return t


def both(fn, dtype):
    """fn(device, dtype) on CUDA and CPU, plus the CPU result on fp32-upcast inputs for fp16/bf16."""
    cuda = fn(DEVICE, dtype)
    cpu = fn("cpu", dtype)
    ref = fn("cpu", torch.float32) if dtype in LOW else None
    return cuda, cpu, ref


def compare(cuda, cpu, ref, dtype, what):
    for i, (a, b) in enumerate(zip(cuda, cpu)):
        assert a.device.type == DEVICE, f"{what}[{i}] on {a.device}"
        if dtype in LOW:
            assert_close(a.float(), ref[i], TOL[dtype], f"CUDA {what}[{i}] vs fp32")
            assert_close(b.float(), ref[i], TOL[dtype], f"CPU {what}[{i}] vs fp32")
            assert a.dtype == b.dtype and a.shape == b.shape
        else:
            assert_close(a, b, TOL[dtype], f"{what}[{i}]")


# ------------------------------------------------------------------------------------------------
# bias + activation + dropout
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("p", [0.1, 0.5, 1.0])
def test_bias_act_masks_bit_identical(cpu_ext, cuda_ext, dtype, p):
    for N in (1, 3, 7, 8, 768, 1023):
        for layout in ("contiguous", "unaligned", "permuted"):

            def make(device):
                gen = torch.Generator().manual_seed(N)
                x = activation(6, N, dtype, layout, gen, device, positive=True)
                b = (torch.rand(N, generator=gen) + 0.1).to(dtype).to(device)
                g = activation(6, N, dtype, layout, gen, device, positive=True)
                return x, b, g

            (x, b, g), (xd, bd, gd) = make("cpu"), make(DEVICE)
            ident = ACT_CODES["identity"]
            expected = cpu_ext.bias_act_fwd(x, b, ident, SEED, OFFSET, p)
            got = cuda_ext.bias_act_fwd(xd, bd, ident, SEED, OFFSET, p)
            # x + b, one multiply, one rounding on both sides: bit-identical values, not only masks.
            assert torch.equal(got.cpu(), expected), f"N={N} p={p} {layout}"
            dx_cpu, _ = cpu_ext.bias_act_bwd(g, x, b, ident, SEED, OFFSET, p, [True, False])
            dx_cuda, _ = cuda_ext.bias_act_bwd(gd, xd, bd, ident, SEED, OFFSET, p, [True, False])
            assert torch.equal(dx_cuda.cpu() != 0, dx_cpu != 0), f"backward mask N={N} p={p} {layout}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("act", list(P.ACTS))
@pytest.mark.parametrize("N", [1, 7, 768, 1023, 4096])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_bias_act_matches_cpu(cpu_ext, cuda_ext, dtype, act, N, p):
    code = ACT_CODES[act]
    for rows in (0, 1, 5, 64):
        for layout in ("contiguous", "unaligned") + (("permuted",) if rows % 2 == 0 else ()):
            for has_bias, mask in ((True, [True, True]), (False, [True, True]), (True, [False, True]), (True, [True, False])):

                def run(device, dt):
                    gen = torch.Generator().manual_seed(rows * 7919 + N)
                    x = activation(rows, N, dtype, layout, gen, device).to(dt)
                    g = activation(rows, N, dtype, layout, gen, device).to(dt)
                    b = torch.randn(N, generator=gen).to(dtype).to(device).to(dt) if has_bias else None
                    out = (cuda_ext if device == DEVICE else cpu_ext).bias_act_fwd(x, b, code, SEED, OFFSET, p)
                    dx, db = (cuda_ext if device == DEVICE else cpu_ext).bias_act_bwd(g, x, b, code, SEED, OFFSET, p, mask)
                    return out, dx, db

                what = f"{act} N={N} rows={rows} {layout} bias={has_bias} mask={mask} p={p}"
                compare(*both(run, dtype), dtype, what)


def test_bias_grad_many_rows_deterministic(cpu_ext, cuda_ext):
    gen = torch.Generator().manual_seed(3)
    for rows, N in ((70000, 8), (4099, 3072), (3, 100000)):
        x = torch.randn(rows, N, generator=gen)
        g = torch.randn(rows, N, generator=gen)
        b = torch.randn(N, generator=gen)
        code = ACT_CODES["gelu"]
        dx_c, db_c = cpu_ext.bias_act_bwd(g, x, b, code, SEED, OFFSET, 0.1, [True, True])
        xd, gd, bd = x.to(DEVICE), g.to(DEVICE), b.to(DEVICE)
        dx, db = cuda_ext.bias_act_bwd(gd, xd, bd, code, SEED, OFFSET, 0.1, [True, True])
        assert_close(dx, dx_c, TOL[torch.float32], f"dx rows={rows} N={N}")
        assert_close(db, db_c, (1e-4, 1e-4), f"dbias rows={rows} N={N}")
        _, db2 = cuda_ext.bias_act_bwd(gd, xd, bd, code, SEED, OFFSET, 0.1, [False, True])
        assert torch.equal(db, db2), "the bias gradient must not depend on whether dx is written"
        _, db3 = cuda_ext.bias_act_bwd(gd, xd, bd, code, SEED, OFFSET, 0.1, [True, True])
        assert torch.equal(db, db3), "the bias gradient must be deterministic"
        out_c = cpu_ext.bias_act_fwd(x, b, code, SEED, OFFSET, 0.1)
        assert_close(cuda_ext.bias_act_fwd(xd, bd, code, SEED, OFFSET, 0.1), out_c, TOL[torch.float32], f"out rows={rows}")


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_bias_grad_without_bias(cpu_ext, cuda_ext, p):
    """dbias asked for with no bias input (the bias stayed in the GEMM): the column sums of dx, as on
    the CPU (passes/aten_backward.py relies on it)."""
    gen = torch.Generator().manual_seed(5)
    x, g = torch.randn(1000, 3072, generator=gen), torch.randn(1000, 3072, generator=gen)
    code = ACT_CODES["gelu"]
    dx_c, db_c = cpu_ext.bias_act_bwd(g, x, None, code, SEED, OFFSET, p, [True, True])
    dx, db = cuda_ext.bias_act_bwd(g.to(DEVICE), x.to(DEVICE), None, code, SEED, OFFSET, p, [True, True])
    assert db.shape == (3072,)
    assert_close(dx, dx_c, TOL[torch.float32], "dx")
    assert_close(db, db_c, (1e-4, 1e-4), "dbias without bias")
    assert_close(db, dx.sum(0), (1e-4, 1e-4), "dbias = column sums of dx")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "unaligned"])
def test_bias_act_bwd_with_a_stored_mask(cpu_ext, cuda_ext, dtype, layout):
    """native_dropout's bool mask instead of Philox, as on the CPU (tests/test_emulated_cuda_pointwise.py
    runs the same case on the emulation)."""
    gen = torch.Generator().manual_seed(9)
    x = activation(12, 264, dtype, layout, gen, "cpu")
    g = activation(12, 264, dtype, layout, gen, "cpu")
    b = torch.randn(264, generator=gen).to(dtype)
    if layout == "permuted":
        mask = (torch.rand(2, 6, 264, generator=gen) >= 0.35).transpose(0, 1)
    else:
        mask = torch.rand(12, 264, generator=gen) >= 0.35
    for act in ("gelu", "identity"):
        code = ACT_CODES[act]
        dx_c, db_c = cpu_ext.bias_act_bwd(g, x, b, code, 0, 0, 0.0, [True, True], mask, 1 / 0.65)
        dx, db = cuda_ext.bias_act_bwd(g.to(DEVICE), x.to(DEVICE), b.to(DEVICE), code, 0, 0, 0.0, [True, True],
                                       mask.to(DEVICE), 1 / 0.65)
        assert_close(dx.cpu(), dx_c, TOL[dtype], f"dx {act}")
        assert_close(db.cpu(), db_c, TOL[dtype] if dtype in LOW else (1e-4, 1e-4), f"dbias {act}")
        assert not dx.cpu()[~mask].any()


# ------------------------------------------------------------------------------------------------
# gated activations
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("act", list(P.ACTS))
@pytest.mark.parametrize("N", [1, 7, 768, 1023, 4096])
def test_glu_matches_cpu(cpu_ext, cuda_ext, dtype, act, N):
    code = ACT_CODES[act]
    for rows in (0, 1, 5, 64):
        for layout in ("stacked", "contiguous", "unaligned"):
            for mask in ([True, True], [True, False], [False, True]):

                def run(device, dt):
                    gen = torch.Generator().manual_seed(rows * 31 + N)
                    if layout == "stacked":  # halves of one [rows, 2N] projection
                        base = activation(rows, 2 * N, dtype, "contiguous", gen, device).to(dt)
                        gate, up = base[:, :N], base[:, N:]
                    else:
                        gate = activation(rows, N, dtype, layout, gen, device).to(dt)
                        up = activation(rows, N, dtype, layout, gen, device).to(dt)
                    g = activation(rows, N, dtype, "contiguous", gen, device).to(dt)
                    ext = cuda_ext if device == DEVICE else cpu_ext
                    return (ext.glu_fwd(gate, up, code), *ext.glu_bwd(g, gate, up, code, mask))

                compare(*both(run, dtype), dtype, f"glu {act} N={N} rows={rows} {layout} mask={mask}")


# ------------------------------------------------------------------------------------------------
# rotary embedding
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("pairing", [(False, False), (True, False), (False, True)],
                         ids=["rotate_half", "interleaved", "deinterleave"])
def test_rope_matches_cpu(cpu_ext, cuda_ext, dtype, inverse, pairing):
    for (B, S, Hq, Hk, D), form in [((2, 5, 4, 2, 8), "hf"), ((1, 7, 3, 3, 2), "SD"), ((2, 33, 32, 8, 128), "hf"),
                                    ((2, 4, 2, 2, 6), "1SD"), ((0, 4, 2, 2, 8), "SD"), ((3, 17, 5, 1, 64), "BSD")]:

        def run(device, dt):
            gen = torch.Generator().manual_seed(B * 100 + S)
            q = torch.randn(B, S, Hq * D, generator=gen).view(B, S, Hq, D).transpose(1, 2)
            k = torch.randn(B, S, Hk * D, generator=gen).view(B, S, Hk, D).transpose(1, 2)
            cos, sin = torch.randn(max(B, 1), S, D, generator=gen), torch.randn(max(B, 1), S, D, generator=gen)
            if form == "hf" or form == "BSD":
                cos, sin = cos[:B].unsqueeze(1), sin[:B].unsqueeze(1)
            elif form == "SD":
                cos, sin = cos[0], sin[0]
            else:
                cos, sin = cos[:1], sin[:1]
            q, k, cos, sin = (t.to(dtype).to(device).to(dt) for t in (q, k, cos, sin))
            ext = cuda_ext if device == DEVICE else cpu_ext
            return tuple(ext.rope(q, k, cos, sin, inverse, *pairing))

        compare(*both(run, dtype), dtype, f"rope {(B, S, Hq, Hk, D)} {form} inverse={inverse} (interleaved, deinterleave)={pairing}")


# ------------------------------------------------------------------------------------------------
# soft cap
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("N", [1, 7, 768, 1023, 4096])
def test_softcap_matches_cpu(cpu_ext, cuda_ext, dtype, N):
    for rows in (0, 1, 5, 64):
        for layout in ("contiguous", "unaligned") + (("permuted",) if rows % 2 == 0 else ()):

            def run(device, dt):
                gen = torch.Generator().manual_seed(rows * 131 + N)
                x = (activation(rows, N, dtype, layout, gen, device) * 3).to(dt)
                g = activation(rows, N, dtype, layout, gen, device).to(dt)
                out = activation(rows, N, dtype, layout, gen, device).clamp_(-1.9, 1.9).to(dt)  # (|out| < cap)
                ext = cuda_ext if device == DEVICE else cpu_ext
                # (the backward's operands in different layouts each way: each read by its own strides)
                return (ext.softcap_fwd(x, 2.0), ext.softcap_bwd(g, out.contiguous(), 2.0),
                        ext.softcap_bwd(g.contiguous(), out, 2.0))

            compare(*both(run, dtype), dtype, f"softcap N={N} rows={rows} {layout}")
    # saturation: exactly +-cap, and a zero gradient there
    x = torch.tensor([100.0, -100.0, float("inf"), float("-inf")]).to(dtype).to(DEVICE)
    out = cuda_ext.softcap_fwd(x, 3.0)
    assert torch.equal(out.cpu(), torch.tensor([3.0, -3.0, 3.0, -3.0]).to(dtype))
    assert not cuda_ext.softcap_bwd(torch.ones_like(out), out, 3.0).cpu().any()


# ------------------------------------------------------------------------------------------------
# The ops with autograd on the GPU; device errors
# ------------------------------------------------------------------------------------------------


def test_ops_autograd_on_gpu_match_cpu():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 96)
    b = torch.randn(96)
    seed = torch.tensor([SEED, OFFSET], dtype=torch.int64)
    grads = {}
    for device in ("cpu", DEVICE):
        xd = x.detach().to(device).requires_grad_()
        bd = b.detach().to(device).requires_grad_()
        out = torch.ops.dmfx.bias_act_dropout(xd, bd, "gelu", seed, 0.2)
        gate, up = out[..., :48], out[..., 48:]
        y = P.glu(gate, up, "silu")
        q = y.view(4, 6, 2, 24).transpose(1, 2)
        k = y[:, :, :24].reshape(4, 6, 1, 24).transpose(1, 2)
        cos = torch.linspace(-1, 1, 6 * 24, device=device).view(6, 24)
        sin = torch.linspace(1, -0.5, 6 * 24, device=device).view(6, 24)
        qo, ko = P.rope(q, k, cos, sin)
        capped = P.softcap(y * 4, 1.5)  # (its autograd saves its output only)
        (qo.square().sum() + ko.sum() + capped.square().sum()).backward()
        grads[device] = (xd.grad.cpu(), bd.grad.cpu())
    for a, e in zip(grads[DEVICE], grads["cpu"]):
        assert_close(a, e, (1e-4, 1e-5), "end-to-end gradient")


def test_rejects_tensors_on_the_wrong_device(cuda_ext):
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(RuntimeError, match="bias is on cpu but x is on cuda"):
        torch.ops.dmfx.bias_act_dropout(x, torch.randn(8), "gelu", None, 0.0)
    with pytest.raises(RuntimeError, match="grad_out is on cpu but x is on cuda"):
        torch.ops.dmfx.bias_act_dropout_backward(torch.randn(3, 8), x, None, "gelu", None, 0.0, [True, True])
    with pytest.raises(RuntimeError, match="up is on cpu but gate is on cuda"):
        torch.ops.dmfx.glu(x, torch.randn(3, 8), "silu")
    q = torch.randn(1, 2, 3, 8, device=DEVICE)
    with pytest.raises(RuntimeError, match="cos is on cpu but q is on cuda"):
        torch.ops.dmfx.rope(q, q, torch.randn(3, 8), torch.randn(3, 8, device=DEVICE), False)
    with pytest.raises(RuntimeError, match="dmfx::softcap_backward: out is on cpu but grad_out is on cuda"):
        torch.ops.dmfx.softcap_backward(x, torch.randn(3, 8), 2.0)
    with pytest.raises(RuntimeError, match="this is the CUDA kernel but x is on cpu"):
        cuda_ext.bias_act_fwd(torch.randn(3, 8), None, 0, 0, 0, 0.0)
