"""dmfx's CUDA norm kernels (cuda_ops/csrc/norm_cuda.cu: norm_fwd, norm_bwd, dropout), run on the CPU
through the emulation of tests/cuda_emu, against dmfx's CPU kernels on the same inputs: block
reductions, the vectorised / scalar paths, row buffers in shared memory or the global workspace,
the column-sum partials and their reduction kernel, grid-stride loops over rows, Philox dropout masks
(bit-identical: same seed and offset). Mirrors tests/test_cuda_norm.py (same tolerances), at
sizes the emulation runs quickly.

What this cannot check, tests/test_cuda_norm.py does on a GPU: real launches and limits, races
that depend on timing within a phase, speed."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import assert_kernel_close as assert_close

if not sys.platform.startswith("linux"):  # (ucontext fibers)
    pytest.skip("the CUDA emulation needs Linux", allow_module_level=True)

from dmfx.cuda_ops import build  # noqa: E402

EPS = 1e-5
SEED, OFFSET = 1234, 56
F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
DTYPES = [F32, F16, BF16, F64]
IDS = ["fp32", "fp16", "bf16", "fp64"]
TOL = {F32: (1e-4, 1e-5), F64: (1e-9, 1e-11), F16: (2e-3, 2e-3), BF16: (1.6e-2, 1.6e-2)}
LOW = (F16, BF16)
NAMES = ("out", "sum", "mean", "rstd", "dx", "dresidual", "dweight", "dnorm_bias", "dbias")
STATS = ("mean", "rstd")
H200 = (2, 232448, 2)  # the emulated device: 2 SMs (grid-stride loops run), an H100/H200's opt-in smem
SMALL_SMEM = (2, 48 * 1024, 2)  # 48 KB: the global-workspace fallbacks at moderate H

COMBOS = [
    dict(bias=True, residual=True, weight=True, norm_bias=True, return_sum=True, mask=[True] * 5),
    dict(bias=False, residual=False, weight=False, norm_bias=False, return_sum=False, mask=[True] * 5),
    dict(bias=True, residual=False, weight=True, norm_bias=False, return_sum=True, mask=[True, False, True, False, True]),
    dict(bias=False, residual=True, weight=False, norm_bias=True, return_sum=False, mask=[False, True, False, True, False]),
]


@pytest.fixture(scope="module")
def emu():
    from cuda_emu import load

    m = load("norm")
    m.set_device(*H200)
    m.set_order(0)
    yield m
    m.set_device(*H200)
    m.set_order(0)


@pytest.fixture(scope="module")
def cpu():
    return build.load("cpu")


def _base_shape(rows, H, layout):
    if layout == "permuted":
        return (rows // 2, 2, H)
    if layout == "unaligned":
        return (rows, H + 1)
    return (rows, H)


def _view(base, layout):
    if layout == "permuted":
        return base.permute(1, 0, 2)
    if layout == "unaligned":
        return base[..., 1:]
    return base


def make_inputs(rows, H, dtype, layout, combo, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def activation():
        return _view(torch.randn(_base_shape(rows, H, layout), generator=gen).to(dtype), layout)

    def vector(center=0.0, spread=1.0):
        return (center + spread * torch.randn(H, generator=gen)).to(dtype)

    return dict(
        x=activation(), dy=activation(),
        bias=vector() if combo["bias"] else None,
        residual=activation() if combo["residual"] else None,
        weight=vector(1.0, 0.1) if combo["weight"] else None,
        norm_bias=vector() if combo["norm_bias"] else None,
        grad_sum=activation() if combo["return_sum"] else None,
    )


def upcast(t):
    return {k: (None if v is None else v.float()) for k, v in t.items()}


def run_norm(ext, t, *, p, rms, return_sum, mask, dy2=None):
    out, s, mean, rstd = ext.norm_fwd(t["x"], t["bias"], t["residual"], t["weight"], t["norm_bias"],
                                      SEED, OFFSET, p, EPS, rms, return_sum)
    grads = ext.norm_bwd(t["dy"], t["grad_sum"], t["x"], t["bias"], t["residual"], t["weight"],
                         None if rms else mean, rstd, SEED, OFFSET, p, rms, mask, dy2)
    return dict(zip(NAMES, [out, s, mean, rstd, *grads]))


def check(cpu, emu, rows, H, dtype, rms, p, combo, layout="contiguous", seed=0):
    what = f"rows={rows} H={H} {dtype} rms={rms} p={p} layout={layout} combo={combo}"
    kw = dict(p=p, rms=rms, return_sum=combo["return_sum"], mask=combo["mask"])
    t = make_inputs(rows, H, dtype, layout, combo, seed)
    got = run_norm(emu, t, **kw)
    exp = run_norm(cpu, t, **kw)
    for name in NAMES:
        assert got[name].device.type == "cpu"
        assert got[name].shape == exp[name].shape and got[name].dtype == exp[name].dtype, f"{name} ({what})"
    if dtype in LOW:
        ref = run_norm(cpu, upcast(t), **kw)
        for name in NAMES:
            tol = TOL[F32] if name in STATS else TOL[dtype]
            assert_close(got[name].float(), ref[name].float(), tol, f"emulated CUDA {name} vs fp32 ({what})")
    else:
        for name in NAMES:
            assert_close(got[name], exp[name], TOL[dtype], f"{name} ({what})")
    if p > 0 and combo["return_sum"]:  # s = dropout(x + bias) + residual: the same Philox mask
        x = t["x"].float() + (t["bias"].float() if t["bias"] is not None else 0)
        dropped_cpu = (exp["sum"].float() == 0) & (x != 0)
        dropped_emu = (got["sum"].float() == 0) & (x != 0)
        if t["residual"] is None:
            assert torch.equal(dropped_cpu, dropped_emu), f"dropout masks differ ({what})"
    return got


def test_functions_match_the_cuda_bindings(emu, cpu):
    names = lambda m: {n for n in dir(m) if not n.startswith("_")}  # noqa: E731
    hooks = {"set_order", "set_grid", "set_device", "rounds", "launches", "blocks_run"}
    assert names(emu) - hooks == {"norm_fwd", "norm_bwd", "dropout"}
    assert names(emu) - hooks <= names(cpu)


# ------------------------------------------------------------------------------------------------
# Standalone dropout: bit-identical
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
def test_dropout_bit_identical(cpu, emu, dtype, p):
    for n in (0, 1, 3, 4, 5, 7, 1000, 4099):
        for seed, offset in ((0, 0), (1234, 56), (-1, 2**40 + 3)):
            ones = torch.ones(n, dtype=dtype)
            assert torch.equal(emu.dropout(ones, seed, offset, p), cpu.dropout(ones, seed, offset, p)), f"n={n} p={p}"
            base = torch.randn(n + 1, generator=torch.Generator().manual_seed(n)).to(dtype)
            for part in (slice(0, n), slice(1, n + 1)):  # odd storage offset: the scalar path
                got, exp = emu.dropout(base[part], seed, offset, p), cpu.dropout(base[part], seed, offset, p)
                assert got.dtype == exp.dtype and torch.equal(got, exp), f"values n={n} p={p} part={part}"


def test_dropout_non_contiguous_and_grid_stride(cpu, emu):
    x = torch.randn(3, 5, 7).transpose(0, 2)
    got = emu.dropout(x, 9, 10, 0.3)
    assert got.is_contiguous() and torch.equal(got, cpu.dropout(x, 9, 10, 0.3))
    # More groups of 4 than threads of the capped grid (2 SMs x 8 x 4 blocks x 256 threads = 16384):
    # the grid-stride loop runs twice.
    x = torch.randn(70001)
    before = emu.blocks_run()
    assert torch.equal(emu.dropout(x, 3, 4, 0.25), cpu.dropout(x, 3, 4, 0.25))
    assert emu.blocks_run() - before == 64


def test_norm_dropout_mask_matches_dropout_kernel(cpu, emu):
    for H in (1, 7, 768, 1023):
        x = torch.ones(5, H)
        mask = cpu.dropout(x, SEED, OFFSET, 0.5)
        _, s_emu, _, _ = emu.norm_fwd(x, None, None, None, None, SEED, OFFSET, 0.5, EPS, False, True)
        assert torch.equal(s_emu, mask), f"H={H}"


# ------------------------------------------------------------------------------------------------
# norm_fwd / norm_bwd against the CPU kernels
# ------------------------------------------------------------------------------------------------


# H: 1, 3 (scalar path, one warp), 33 (scalar, 2 warps), 768 (vector path), 1000 (fp32/fp64 vector,
# fp16/bf16 scalar: 1000 % 8 = 0 -> vector too), 1023 (scalar, > 512 chunks: threads loop over chunks).
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("H", [1, 3, 33, 768, 1000, 1023])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_matches_cpu(cpu, emu, dtype, H, rms):
    rows = 9 if H < 1000 else 5  # more rows than the grid's 4 blocks: the row loop runs
    for i, combo in enumerate(COMBOS):
        for p in (0.0, 0.1, 1.0):
            if p == 1.0 and i % 2:
                continue
            check(cpu, emu, rows, H, dtype, rms, p, combo, seed=i)


@pytest.mark.parametrize("rows", [0, 1])
def test_norm_few_rows(cpu, emu, rows):
    for dtype in (F32, BF16):
        for combo in COMBOS[:2]:
            check(cpu, emu, rows, 64, dtype, False, 0.1, combo)


@pytest.mark.parametrize("layout", ["permuted", "unaligned"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_norm_strided_layouts(cpu, emu, layout, dtype):
    for H in (7, 256):
        for rms in (False, True):
            check(cpu, emu, 6, H, dtype, rms, 0.1, COMBOS[0], layout)


# Thresholds of norm_cuda.cu: more chunks than kMaxThreads (512: threads loop over chunks); the row
# buffers in shared memory or in a global workspace (smem_limit = opt-in - 1 KB); the backward's
# column partials in shared memory or not; dynamic shared memory above 48 KB (cudaFuncSetAttribute).
@pytest.mark.parametrize("device,H,dtype", [
    (H200, 4096, F32),        # 1024 chunks (2 per thread); bwd: row + cols in smem, 86 KB (opt-in)
    (H200, 4104, F16),        # H % 8 = 0, 513 chunks: one thread has two
    (SMALL_SMEM, 2048, F32),  # bwd: row + cols in smem (43 KB)
    (SMALL_SMEM, 4096, F32),  # bwd: row in smem, cols in the global partials
    (SMALL_SMEM, 6144, F32),  # bwd: both in global memory
    (SMALL_SMEM, 12288, F32),  # fwd: the row in the global workspace too
    (SMALL_SMEM, 6144, F64),  # fwd: 48 KB row > limit: global workspace (double)
], ids=["h200-4096", "h200-4104-fp16", "48k-2048", "48k-4096", "48k-6144", "48k-12288", "48k-6144-fp64"])
def test_norm_large_hidden_and_smem_fallbacks(cpu, emu, device, H, dtype):
    emu.set_device(*device)
    try:
        for rms in (False, True):
            check(cpu, emu, 5, H, dtype, rms, 0.1, COMBOS[0])
        check(cpu, emu, 3, H, dtype, False, 0.0, COMBOS[2])
    finally:
        emu.set_device(*H200)


def test_norm_3d_and_1d_inputs(cpu, emu):
    gen = torch.Generator().manual_seed(1)
    for shape in ((2, 3, 40), (40,)):
        x = torch.randn(shape, generator=gen)
        w, b = torch.randn(40, generator=gen), torch.randn(40, generator=gen)
        got = emu.norm_fwd(x, b, None, w, b, SEED, OFFSET, 0.2, EPS, False, True)
        exp = cpu.norm_fwd(x, b, None, w, b, SEED, OFFSET, 0.2, EPS, False, True)
        for name, a, e in zip(NAMES, got, exp):
            assert_close(a, e, TOL[F32], f"{name} shape={shape}")
        dy = torch.randn(shape, generator=gen)
        gg = emu.norm_bwd(dy, None, x, b, None, w, got[2], got[3], SEED, OFFSET, 0.2, False, [True] * 5, None)
        ge = cpu.norm_bwd(dy, None, x, b, None, w, exp[2], exp[3], SEED, OFFSET, 0.2, False, [True] * 5, None)
        for name, a, e in zip(NAMES[4:], gg, ge):
            assert_close(a, e, TOL[F32], f"{name} shape={shape}")


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "unaligned"])
@pytest.mark.parametrize("H", [7, 768])
def test_norm_bwd_second_gradient(cpu, emu, dtype, layout, H):
    combo = COMBOS[0]
    t = make_inputs(6, H, dtype, layout, combo, seed=3)
    dy2 = _view(torch.randn(_base_shape(6, H, layout), generator=torch.Generator().manual_seed(9)).to(dtype), layout)
    kw = dict(p=0.1, rms=False, return_sum=True, mask=combo["mask"])
    got, exp = run_norm(emu, t, dy2=dy2, **kw), run_norm(cpu, t, dy2=dy2, **kw)
    for name in NAMES:
        assert_close(got[name].float(), exp[name].float(), TOL[dtype], f"{name} with grad_out2 ({dtype} {layout} H={H})")


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_norm_bwd_dbias_without_bias(cpu, emu, p):
    gen = torch.Generator().manual_seed(4)
    x, dy = torch.randn(7, 96, generator=gen), torch.randn(7, 96, generator=gen)
    w = torch.randn(96, generator=gen)
    res = []
    for ext in (emu, cpu):
        _, _, mean, rstd = ext.norm_fwd(x, None, None, w, None, SEED, OFFSET, p, EPS, False, False)
        res.append(ext.norm_bwd(dy, None, x, None, None, w, mean, rstd, SEED, OFFSET, p, False, [True] * 5, None))
    for name, a, e in zip(NAMES[4:], *res):
        assert_close(a, e, TOL[F32], f"{name} p={p}")
    assert res[0][4].shape == (96,)


def test_norm_independent_of_thread_order_and_grid(cpu, emu):
    """Bit-identical results whatever order the threads run in (no race within a phase that the
    schedule could expose) and whatever the grid (deterministic column sums need a fixed grid, so
    only the thread order is varied for the backward's partial sums)."""
    t = make_inputs(9, 200, F32, "contiguous", COMBOS[0], seed=5)
    kw = dict(p=0.1, rms=False, return_sum=True, mask=[True] * 5)
    base = run_norm(emu, t, **kw)
    try:
        for mode in (1, 2, 3, 4, 5):
            emu.set_order(mode)
            again = run_norm(emu, t, **kw)
            for name in NAMES:
                assert torch.equal(again[name], base[name]), f"{name} changes with thread order {mode}"
        emu.set_order(0)
        emu.set_device(7, 232448, 3)  # another grid: forward outputs (per-row) must not change
        other = run_norm(emu, t, **kw)
        for name in ("out", "sum", "mean", "rstd", "dx", "dresidual"):
            assert torch.equal(other[name], base[name]), f"{name} changes with the grid"
    finally:
        emu.set_order(0)
        emu.set_device(*H200)


def test_rejects_non_emulated_device_and_bad_args(emu):
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="bias is on meta"):
        emu.norm_fwd(x, torch.empty(8, device="meta"), None, None, None, 0, 0, 0.0, EPS, False, False)
    with pytest.raises(RuntimeError, match="kernel but x is on meta"):
        emu.norm_fwd(torch.empty(3, 8, device="meta"), None, None, None, None, 0, 0, 0.0, EPS, False, False)
    with pytest.raises(RuntimeError, match="kernel but x is on meta"):
        emu.dropout(torch.empty(3, 8, device="meta"), 0, 0, 0.1)


@pytest.mark.parametrize("H", [33, 200])
def test_norm_column_sums_over_many_blocks(cpu, emu, H):
    """The backward's column sums (dweight, dnorm_bias, dbias) over a grid of more blocks than the
    column-sum block has thread rows (col_sum.cuh: 16), so every thread row sums several partial rows
    and thread row 0 adds all 16 (the emulated H200's grid of 4 blocks leaves rows 4-15 empty); the
    same bits whatever order the threads run in."""
    emu.set_device(20, 232448, 2)  # 40 blocks at most
    try:
        t = make_inputs(45, H, F32, "contiguous", COMBOS[0], seed=6)
        kw = dict(p=0.1, rms=False, return_sum=True, mask=[True] * 5)
        got, exp = run_norm(emu, t, **kw), run_norm(cpu, t, **kw)
        for name in ("dweight", "dnorm_bias", "dbias"):
            assert_close(got[name], exp[name], TOL[F32], f"{name} H={H} over 40 blocks")
        for mode in (2, 5):
            emu.set_order(mode)
            again = run_norm(emu, t, **kw)
            for name in ("dweight", "dnorm_bias", "dbias"):
                assert torch.equal(again[name], got[name]), f"{name} changes with thread order {mode}"
    finally:
        emu.set_order(0)
        emu.set_device(*H200)
