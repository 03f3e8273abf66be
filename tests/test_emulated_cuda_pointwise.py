"""dmfx's CUDA pointwise kernels (cuda_ops/csrc/pointwise_cuda.cu: bias_act_fwd/bwd, glu_fwd/bwd,
rope, softcap_fwd/bwd), run on the CPU through the emulation of tests/cuda_emu, against dmfx's CPU kernels on the same
inputs: every activation, the 128-bit vector and the scalar paths, 2-D blocks and grids (chunks along
x, a grid-stride loop over rows along y, q and k along z for rope), the bias-gradient partials and
their column sums, Philox dropout masks (bit-identical: same seed and offset). Mirrors
tests/test_cuda_pointwise.py (same tolerances), at sizes the emulation runs quickly.

What this cannot check, tests/test_cuda_pointwise.py does on a GPU: real launches, races that depend
on timing, speed."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import assert_kernel_close as assert_close

if not sys.platform.startswith("linux"):  # (ucontext fibers)
    pytest.skip("the CUDA emulation needs Linux", allow_module_level=True)

from dmfx.cuda_ops import (
    build,  # noqa: E402
    pointwise as P,  # noqa: E402
)

SEED, OFFSET = 1234, 56
F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
TOL = {F32: (1e-4, 1e-5), F64: (1e-9, 1e-11), F16: (2e-3, 2e-3), BF16: (1.6e-2, 1.6e-2)}
LOW = (F16, BF16)
DTYPES = [F32, F16, BF16, F64]
IDS = ["fp32", "fp16", "bf16", "fp64"]
ACT_CODES = {name: i for i, name in enumerate(P.ACTS)}
EMU = "emu"


@pytest.fixture(scope="module")
def emu():
    from cuda_emu import load

    m = load("pointwise")
    m.set_device(2, 232448, 2)
    yield m
    m.set_device(2, 232448, 2)


@pytest.fixture(scope="module")
def cpu():
    return build.load("cpu")


def activation(rows, N, dtype, layout, gen, positive=False):
    shape = {"permuted": (2, rows // 2, N), "unaligned": (rows, N + 1)}.get(layout, (rows, N))
    assert layout != "permuted" or rows % 2 == 0
    base = torch.rand(shape, generator=gen) + 0.5 if positive else torch.randn(shape, generator=gen) * 2 + 0.3
    t = base.to(dtype)
    if layout == "permuted":
        return t.transpose(0, 1)
    if layout == "unaligned":
        return t[:, 1:]
    return t


def compare(fn, dtype, what):
    """fn(ext_kind, dtype) on the emulated CUDA and the CPU kernels; fp16/bf16 both against the CPU
    kernel on fp32-upcast inputs (as tests/test_cuda_pointwise.py does)."""
    got, exp = fn(EMU, dtype), fn("cpu", dtype)
    ref = fn("cpu", F32) if dtype in LOW else None
    for i, (a, b) in enumerate(zip(got, exp)):
        if dtype in LOW:
            assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{i}]"
            assert_close(a.float(), ref[i], TOL[dtype], f"emulated CUDA {what}[{i}] vs fp32")
        else:
            assert_close(a, b, TOL[dtype], f"{what}[{i}]")


def test_functions_match_the_cuda_bindings(emu, cpu):
    names = lambda m: {n for n in dir(m) if not n.startswith("_")}  # noqa: E731
    hooks = {"set_order", "set_grid", "set_device", "rounds", "launches", "blocks_run"}
    assert names(emu) - hooks == {"bias_act_fwd", "bias_act_bwd", "glu_fwd", "glu_bwd", "rope", "softcap_fwd", "softcap_bwd"}
    assert names(emu) - hooks <= names(cpu)
    # and together the families are the CUDA module's functions: the CPU module's, less its CPU-only ones
    from cuda_emu import FAMILIES, load

    every = set().union(*(names(load(f)) - hooks for f in FAMILIES))
    assert every == names(cpu) - set(build.CPU_ONLY_FUNCTIONS)


# ------------------------------------------------------------------------------------------------
# bias + activation + dropout
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("p", [0.1, 0.5, 1.0])
def test_bias_act_masks_bit_identical(cpu, emu, dtype, p):
    for N in (1, 3, 7, 8, 768, 1023):
        for layout in ("contiguous", "unaligned", "permuted"):
            gen = torch.Generator().manual_seed(N)
            x = activation(6, N, dtype, layout, gen, positive=True)
            b = (torch.rand(N, generator=gen) + 0.1).to(dtype)
            g = activation(6, N, dtype, layout, gen, positive=True)
            ident = ACT_CODES["identity"]
            expected = cpu.bias_act_fwd(x, b, ident, SEED, OFFSET, p)
            got = emu.bias_act_fwd(x, b, ident, SEED, OFFSET, p)
            assert torch.equal(got, expected), f"N={N} p={p} {layout}"
            dx_cpu, _ = cpu.bias_act_bwd(g, x, b, ident, SEED, OFFSET, p, [True, False])
            dx_emu, _ = emu.bias_act_bwd(g, x, b, ident, SEED, OFFSET, p, [True, False])
            assert torch.equal(dx_emu != 0, dx_cpu != 0), f"backward mask N={N} p={p} {layout}"


# N: 1, 3, 33 (scalar path), 768 (vector), 1000 (vector for fp32/fp64/fp16/bf16: 1000 % 8 = 0),
# 1030 (scalar, more than 256 chunks: several blocks along x).
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("act", list(P.ACTS))
def test_bias_act_matches_cpu(cpu, emu, dtype, act):
    code = ACT_CODES[act]
    for N in (1, 3, 33, 768, 1000, 1030):
        for rows in (1, 6) if N < 1000 else (6,):
            for layout in ("contiguous", "unaligned", "permuted"):
                if layout == "permuted" and rows % 2:
                    continue
                for has_bias, mask, p in ((True, [True, True], 0.0), (False, [True, True], 0.2),
                                          (True, [False, True], 0.2), (True, [True, False], 1.0)):

                    def run(kind, dt):
                        gen = torch.Generator().manual_seed(rows * 7919 + N)
                        x = activation(rows, N, dtype, layout, gen).to(dt)
                        g = activation(rows, N, dtype, layout, gen).to(dt)
                        b = torch.randn(N, generator=gen).to(dtype).to(dt) if has_bias else None
                        ext = emu if kind == EMU else cpu
                        out = ext.bias_act_fwd(x, b, code, SEED, OFFSET, p)
                        dx, db = ext.bias_act_bwd(g, x, b, code, SEED, OFFSET, p, mask)
                        return out, dx, db

                    compare(run, dtype, f"{act} N={N} rows={rows} {layout} bias={has_bias} mask={mask} p={p}")


def test_bias_act_zero_rows(cpu, emu):
    for N in (1, 768):
        x = torch.randn(0, N)
        b = torch.randn(N)
        assert emu.bias_act_fwd(x, b, 2, SEED, OFFSET, 0.1).shape == (0, N)
        dx, db = emu.bias_act_bwd(x, x, b, 2, SEED, OFFSET, 0.1, [True, True])
        dx_c, db_c = cpu.bias_act_bwd(x, x, b, 2, SEED, OFFSET, 0.1, [True, True])
        assert dx.shape == dx_c.shape and torch.equal(db, db_c)


def test_bias_grad_many_rows_deterministic(cpu, emu):
    """More rows than the grid's threads along y (grid-stride loop), more chunks than a block along
    x, many partial rows summed by col_sum_kernel."""
    gen = torch.Generator().manual_seed(3)
    for rows, N in ((3000, 8), (41, 3072), (3, 9000), (600, 3)):
        x = torch.randn(rows, N, generator=gen)
        g = torch.randn(rows, N, generator=gen)
        b = torch.randn(N, generator=gen)
        code = ACT_CODES["gelu"]
        dx_c, db_c = cpu.bias_act_bwd(g, x, b, code, SEED, OFFSET, 0.1, [True, True])
        dx, db = emu.bias_act_bwd(g, x, b, code, SEED, OFFSET, 0.1, [True, True])
        assert_close(dx, dx_c, TOL[F32], f"dx rows={rows} N={N}")
        assert_close(db, db_c, (1e-4, 1e-4), f"dbias rows={rows} N={N}")
        _, db2 = emu.bias_act_bwd(g, x, b, code, SEED, OFFSET, 0.1, [False, True])
        assert torch.equal(db, db2), "the bias gradient must not depend on whether dx is written"
        emu.set_order(2)
        try:
            _, db3 = emu.bias_act_bwd(g, x, b, code, SEED, OFFSET, 0.1, [True, True])
        finally:
            emu.set_order(0)
        assert torch.equal(db, db3), "the bias gradient must be deterministic"
        out_c = cpu.bias_act_fwd(x, b, code, SEED, OFFSET, 0.1)
        assert_close(emu.bias_act_fwd(x, b, code, SEED, OFFSET, 0.1), out_c, TOL[F32], f"out rows={rows}")


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_bias_grad_without_bias(cpu, emu, p):
    gen = torch.Generator().manual_seed(5)
    x, g = torch.randn(50, 3072, generator=gen), torch.randn(50, 3072, generator=gen)
    code = ACT_CODES["gelu"]
    dx_c, db_c = cpu.bias_act_bwd(g, x, None, code, SEED, OFFSET, p, [True, True])
    dx, db = emu.bias_act_bwd(g, x, None, code, SEED, OFFSET, p, [True, True])
    assert db.shape == (3072,)
    assert_close(dx, dx_c, TOL[F32], "dx")
    assert_close(db, db_c, (1e-4, 1e-4), "dbias without bias")
    assert_close(db, dx.sum(0), (1e-4, 1e-4), "dbias = column sums of dx")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "unaligned"])
def test_bias_act_bwd_with_a_stored_mask(cpu, emu, dtype, layout):
    """native_dropout's bool mask instead of Philox (the forward was PyTorch's): the vector and scalar
    paths, a mask with permuted leading dims, bit-identical zeros where the mask drops."""
    gen = torch.Generator().manual_seed(9)
    x = activation(12, 264, dtype, layout, gen)
    g = activation(12, 264, dtype, layout, gen)
    b = torch.randn(264, generator=gen).to(dtype)
    if layout == "permuted":  # x is [6, 2, 264] with its leading dims swapped in memory; so is the mask
        mask = (torch.rand(2, 6, 264, generator=gen) >= 0.35).transpose(0, 1)
    else:
        mask = torch.rand(12, 264, generator=gen) >= 0.35
    for act in ("gelu", "identity"):
        code = ACT_CODES[act]
        dx_c, db_c = cpu.bias_act_bwd(g, x, b, code, 0, 0, 0.0, [True, True], mask, 1 / 0.65)
        dx, db = emu.bias_act_bwd(g, x, b, code, 0, 0, 0.0, [True, True], mask, 1 / 0.65)
        assert_close(dx, dx_c, TOL[dtype], f"dx {act}")
        assert_close(db, db_c, TOL[dtype] if dtype in LOW else (1e-4, 1e-4), f"dbias {act}")
        assert not dx[~mask].any()


def test_grid_does_not_change_results(cpu, emu):
    """Other emulated devices give other grids (plan_launch sizes the y grid by the SM count)."""
    gen = torch.Generator().manual_seed(8)
    x, g, b = torch.randn(37, 520, generator=gen), torch.randn(37, 520, generator=gen), torch.randn(520, generator=gen)
    base = emu.bias_act_fwd(x, b, 4, SEED, OFFSET, 0.3)
    dx0, db0 = emu.bias_act_bwd(g, x, b, 4, SEED, OFFSET, 0.3, [True, True])
    try:
        for sms in (1, 5, 100):
            emu.set_device(sms, 232448, 2)
            assert torch.equal(emu.bias_act_fwd(x, b, 4, SEED, OFFSET, 0.3), base), f"sms={sms}"
            dx, db = emu.bias_act_bwd(g, x, b, 4, SEED, OFFSET, 0.3, [True, True])
            assert torch.equal(dx, dx0), f"sms={sms}"
            assert_close(db, db0, (1e-5, 1e-6), f"dbias sms={sms}")
    finally:
        emu.set_device(2, 232448, 2)


# ------------------------------------------------------------------------------------------------
# gated activations
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("act", list(P.ACTS))
def test_glu_matches_cpu(cpu, emu, dtype, act):
    code = ACT_CODES[act]
    for N in (1, 7, 768, 1030):
        for rows in (1, 5):
            for layout in ("stacked", "contiguous", "unaligned"):
                for mask in ([True, True], [True, False], [False, True]):

                    def run(kind, dt):
                        gen = torch.Generator().manual_seed(rows * 31 + N)
                        if layout == "stacked":  # halves of one [rows, 2N] projection
                            base = activation(rows, 2 * N, dtype, "contiguous", gen).to(dt)
                            gate, up = base[:, :N], base[:, N:]
                        else:
                            gate = activation(rows, N, dtype, layout, gen).to(dt)
                            up = activation(rows, N, dtype, layout, gen).to(dt)
                        g = activation(rows, N, dtype, "contiguous", gen).to(dt)
                        ext = emu if kind == EMU else cpu
                        return (ext.glu_fwd(gate, up, code), *ext.glu_bwd(g, gate, up, code, mask))

                    compare(run, dtype, f"glu {act} N={N} rows={rows} {layout} mask={mask}")


# ------------------------------------------------------------------------------------------------
# rotary embedding
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("pairing", [(False, False), (True, False), (False, True)],
                         ids=["rotate_half", "interleaved", "deinterleave"])
def test_rope_matches_cpu(cpu, emu, dtype, inverse, pairing):
    for (B, S, Hq, Hk, D), form in [((2, 5, 4, 2, 8), "hf"), ((1, 7, 3, 3, 2), "SD"), ((2, 9, 8, 2, 128), "hf"),
                                    ((2, 4, 2, 2, 6), "1SD"), ((0, 4, 2, 2, 8), "SD"), ((3, 17, 5, 1, 64), "BSD"),
                                    ((1, 3, 2, 1, 1026), "SD")]:

        def run(kind, dt):
            gen = torch.Generator().manual_seed(B * 100 + S)
            q = torch.randn(B, S, Hq * D, generator=gen).view(B, S, Hq, D).transpose(1, 2)
            k = torch.randn(B, S, Hk * D, generator=gen).view(B, S, Hk, D).transpose(1, 2)
            cos, sin = torch.randn(max(B, 1), S, D, generator=gen), torch.randn(max(B, 1), S, D, generator=gen)
            if form in ("hf", "BSD"):
                cos, sin = cos[:B].unsqueeze(1), sin[:B].unsqueeze(1)
            elif form == "SD":
                cos, sin = cos[0], sin[0]
            else:
                cos, sin = cos[:1], sin[:1]
            q, k, cos, sin = (t.to(dtype).to(dt) for t in (q, k, cos, sin))
            ext = emu if kind == EMU else cpu
            return tuple(ext.rope(q, k, cos, sin, inverse, *pairing))

        compare(run, dtype, f"rope {(B, S, Hq, Hk, D)} {form} inverse={inverse} (interleaved, deinterleave)={pairing}")


# ------------------------------------------------------------------------------------------------
# soft cap
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_softcap_matches_cpu(cpu, emu, dtype):
    """Forward and backward (from a given output) on the vector and scalar paths, permuted rows."""
    for N in (1, 7, 768, 1030):
        for rows in (1, 6):
            for layout in ("contiguous", "unaligned", "permuted"):
                if layout == "permuted" and rows % 2:
                    continue

                def run(kind, dt):
                    gen = torch.Generator().manual_seed(rows * 131 + N)
                    x = (activation(rows, N, dtype, layout, gen) * 3).to(dt)
                    g = activation(rows, N, dtype, layout, gen).to(dt)
                    out = activation(rows, N, dtype, layout, gen).clamp_(-1.9, 1.9).to(dt)  # (|out| < cap)
                    ext = emu if kind == EMU else cpu
                    # (the backward's operands in different layouts each way: each read by its own strides)
                    return (ext.softcap_fwd(x, 2.0), ext.softcap_bwd(g, out.contiguous(), 2.0),
                            ext.softcap_bwd(g.contiguous(), out, 2.0))

                compare(run, dtype, f"softcap N={N} rows={rows} {layout}")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_softcap_edges(cpu, emu, dtype):
    """Saturation to exactly +-cap (and a zero gradient there), inf, an empty batch, a 0-dim x."""
    x = torch.tensor([100.0, -100.0, float("inf"), float("-inf"), 0.5, -0.25, 3.0, 1e4]).to(dtype)
    out = emu.softcap_fwd(x, 3.0)
    assert torch.equal(out[:4], torch.tensor([3.0, -3.0, 3.0, -3.0]).to(dtype)), out
    assert_close(out, cpu.softcap_fwd(x, 3.0), TOL[dtype], "softcap edges")
    dx = emu.softcap_bwd(torch.ones_like(x), out, 3.0)
    assert torch.equal(dx[:4], torch.zeros(4, dtype=dtype)) and torch.equal(dx[-1], torch.zeros((), dtype=dtype))
    assert emu.softcap_fwd(torch.randn(0, 8).to(dtype), 3.0).shape == (0, 8)
    assert emu.softcap_bwd(torch.randn(0, 8).to(dtype), torch.randn(0, 8).to(dtype), 3.0).shape == (0, 8)
    s = torch.tensor(1.25).to(dtype)
    assert emu.softcap_fwd(s, 3.0).shape == () and emu.softcap_bwd(s, s, 3.0).shape == ()
    assert_close(emu.softcap_fwd(s, 3.0), cpu.softcap_fwd(s, 3.0), TOL[dtype], "softcap 0-dim")
    with pytest.raises(ValueError, match="dmfx::softcap: cap must be positive and finite, got -1"):
        emu.softcap_fwd(x, -1.0)


def test_rejects_tensors_not_on_the_emulated_device(emu):
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="bias is on meta but x is on cpu"):
        emu.bias_act_fwd(x, torch.empty(8, device="meta"), 2, 0, 0, 0.0)
    with pytest.raises(RuntimeError, match="up is on meta but gate is on cpu"):
        emu.glu_fwd(x, torch.empty(3, 8, device="meta"), 4)
    with pytest.raises(RuntimeError, match="kernel but x is on meta"):
        emu.bias_act_fwd(torch.empty(3, 8, device="meta"), None, 0, 0, 0, 0.0)
    with pytest.raises(RuntimeError, match="dmfx::softcap_backward: out is on meta but grad_out is on cpu"):
        emu.softcap_bwd(x, torch.empty(3, 8, device="meta"), 2.0)
