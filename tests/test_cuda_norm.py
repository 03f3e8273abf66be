"""Tests of dmfx's CUDA kernels (cuda_ops/csrc/norm_cuda.cu).

The CPU kernels (cuda_ops/csrc/norm_cpu.cpp) are the specification. On a machine with a CUDA GPU
these tests check that the CUDA extension

* draws bit-identical dropout masks (same Philox mapping as the CPU kernel);
* matches the CPU extension for norm_fwd / norm_bwd: LayerNorm and RMSNorm, with and without bias,
  residual, weight, norm_bias, dropout, the returned sum and its gradient, partial output masks,
  H in {1, 7, 768, 1023, 4096} (odd sizes take the scalar path, the others the 128-bit path),
  rows in {0, 1, 5, 64}, contiguous / permuted / unaligned-row inputs, fp32, fp64, fp16 and bf16;
* matches torch.autograd of a pure-PyTorch reference (float64) that applies the dropout kernel's mask;
* handles large H (shared memory opt-in and the global-memory fallback) and many rows per block;
* rejects tensors on the wrong device.

Without a GPU every test is skipped.

Tolerances (all absolute tolerances are scaled by 1 + max|expected|, since gradients and column sums
grow with the magnitude of their inputs):
* fp32: rtol 1e-4, atol 1e-5 -- both kernels accumulate in fp32; only the summation order differs.
* fp64: rtol 1e-9, atol 1e-11 -- same, in fp64.
* fp16 / bf16: both the CUDA and the CPU result are compared with a float32 computation (the CPU
  kernel on the upcast inputs, same seed, hence same mask). The kernels compute in fp32 and round
  each stored value once, so the error is about one unit roundoff of the output type: 2^-11 for
  fp16, 2^-8 for bf16. We allow about four: fp16 rtol = atol = 2e-3; bf16 rtol = atol = 1.6e-2.
  mean / rstd are float32 for these dtypes and use the fp32 tolerance.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_kernel_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = "cuda"
EPS = 1e-5
SEED, OFFSET = 1234, 56

TOL = {
    torch.float32: (1e-4, 1e-5),
    torch.float64: (1e-9, 1e-11),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
LOW_PRECISION = (torch.float16, torch.bfloat16)
NAMES = ("out", "sum", "mean", "rstd", "dx", "dresidual", "dweight", "dnorm_bias", "dbias")
STATS = ("mean", "rstd")


# ------------------------------------------------------------------------------------------------
# Loading the extensions
# ------------------------------------------------------------------------------------------------


def _build_module():
    """dmfx.cuda_ops.build when the package is installed, else cuda_ops/build.py of this checkout."""
    try:
        from dmfx.cuda_ops import build

        return build
    except ImportError:
        path = Path(__file__).resolve().parents[1] / "cuda_ops" / "build.py"
        spec = importlib.util.spec_from_file_location("dmfx_cuda_ops_build", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses need the module registered
        spec.loader.exec_module(module)
        return module


@pytest.fixture(scope="module")
def cpu_ext():
    return _build_module().load("cpu")


@pytest.fixture(scope="module")
def cuda_ext():
    return _build_module().load("cuda")


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------

# Flag combinations of the norm tests, each with an output_mask [dx, dresidual, dweight, dnorm_bias, dbias].
COMBOS = [
    dict(bias=True, residual=True, weight=True, norm_bias=True, return_sum=True, mask=[True] * 5),
    dict(bias=False, residual=False, weight=False, norm_bias=False, return_sum=False, mask=[True] * 5),
    dict(bias=True, residual=False, weight=True, norm_bias=False, return_sum=True,
         mask=[True, False, True, False, True]),
    dict(bias=False, residual=True, weight=False, norm_bias=True, return_sum=False,
         mask=[False, True, False, True, False]),
]


def _base_shape(rows: int, H: int, layout: str) -> tuple[int, ...]:
    if layout == "permuted":  # [L, B, H] viewed as [B, L, H]
        assert rows % 2 == 0
        return (rows // 2, 2, H)
    if layout == "unaligned":  # unit stride on H, rows at an odd element offset: scalar path
        return (rows, H + 1)
    return (rows, H)


def _view(base: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "permuted":
        return base.permute(1, 0, 2)
    if layout == "unaligned":
        return base[..., 1:]
    return base


def make_inputs(rows, H, dtype, layout, combo, device, seed=0):
    """Activations (x, residual, dy, grad_sum) in `layout` and parameter vectors, on `device`.

    The values depend only on (rows, H, dtype, layout, combo, seed), not on the device, so the CPU and
    CUDA kernels see identical inputs with identical strides.
    """
    gen = torch.Generator().manual_seed(seed)

    def activation():
        base = torch.randn(_base_shape(rows, H, layout), generator=gen).to(dtype)
        return _view(base.to(device), layout)

    def vector(center=0.0, spread=1.0):
        return (center + spread * torch.randn(H, generator=gen)).to(dtype).to(device)

    x = activation()
    dy = activation()
    return dict(
        x=x,
        dy=dy,
        bias=vector() if combo["bias"] else None,
        residual=activation() if combo["residual"] else None,
        weight=vector(1.0, 0.1) if combo["weight"] else None,
        norm_bias=vector() if combo["norm_bias"] else None,
        grad_sum=activation() if combo["return_sum"] else None,
    )


def upcast(t: dict, dtype=torch.float32) -> dict:
    return {k: (None if v is None else v.to(dtype)) for k, v in t.items()}


def run_norm(ext, t, *, p, rms, return_sum, mask, seed=SEED, offset=OFFSET):
    """norm_fwd then norm_bwd (with the forward's saved statistics); all outputs by name."""
    out, s, mean, rstd = ext.norm_fwd(t["x"], t["bias"], t["residual"], t["weight"], t["norm_bias"],
                                      seed, offset, p, EPS, rms, return_sum)
    grads = ext.norm_bwd(t["dy"], t["grad_sum"], t["x"], t["bias"], t["residual"], t["weight"],
                         None if rms else mean, rstd, seed, offset, p, rms, mask, None)
    return dict(zip(NAMES, [out, s, mean, rstd, *grads]))


# ------------------------------------------------------------------------------------------------
# Comparison helpers
# ------------------------------------------------------------------------------------------------


def assert_close(actual, expected, tol, what):
    """Values close with rtol and a magnitude-scaled atol (see module docstring); shapes equal."""
    assert_kernel_close(actual, expected, tol, what, same_dtype=False)


def assert_same_layout(cuda_res: dict, cpu_res: dict, what: str):
    """Every output has the CPU kernel's shape and dtype, and lives on the GPU."""
    for name in NAMES:
        a, b = cuda_res[name], cpu_res[name]
        assert a.device.type == DEVICE, f"{what} {name}: on {a.device}"
        assert a.shape == b.shape, f"{what} {name}: shape {tuple(a.shape)} != CPU {tuple(b.shape)}"
        assert a.dtype == b.dtype, f"{what} {name}: dtype {a.dtype} != CPU {b.dtype}"


# ------------------------------------------------------------------------------------------------
# Dropout: bit-identical to the CPU kernel
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
def test_dropout_bit_identical(cpu_ext, cuda_ext, dtype, p):
    for n in (0, 1, 3, 4, 5, 7, 1000, 4099):
        for seed, offset in ((0, 0), (1234, 56), (-1, 2**40 + 3)):
            ones = torch.ones(n, dtype=dtype)
            expected = cpu_ext.dropout(ones, seed, offset, p)
            got = cuda_ext.dropout(ones.to(DEVICE), seed, offset, p)
            assert got.device.type == DEVICE and got.dtype == dtype and got.shape == ones.shape
            assert torch.equal(got.cpu(), expected), f"mask differs: n={n} p={p} seed={seed} offset={offset}"
            # Arbitrary values: one multiply and one rounding on both sides, so also bit-identical.
            # An odd storage offset takes the unaligned (scalar) path of the CUDA kernel.
            base = torch.randn(n + 1, generator=torch.Generator().manual_seed(n)).to(dtype)
            base_dev = base.to(DEVICE)
            for part in (slice(0, n), slice(1, n + 1)):
                got = cuda_ext.dropout(base_dev[part], seed, offset, p)
                expected = cpu_ext.dropout(base[part], seed, offset, p)
                assert torch.equal(got.cpu(), expected), f"values differ: n={n} p={p} part={part}"


def test_dropout_non_contiguous(cpu_ext, cuda_ext):
    x = torch.randn(3, 5, 7).transpose(0, 2)  # logical (contiguous) order defines the mask
    expected = cpu_ext.dropout(x, 9, 10, 0.3)
    got = cuda_ext.dropout(x.to(DEVICE), 9, 10, 0.3)
    assert got.is_contiguous() and torch.equal(got.cpu(), expected)


def test_norm_dropout_mask_matches_dropout_kernel(cpu_ext, cuda_ext):
    """The fused kernel's mask (seen through s = dropout(ones)) is the dropout kernel's mask."""
    for H in (1, 7, 768, 1023):
        x = torch.ones(5, H)
        mask = cpu_ext.dropout(x, SEED, OFFSET, 0.5)
        _, s_cpu, _, _ = cpu_ext.norm_fwd(x, None, None, None, None, SEED, OFFSET, 0.5, EPS, False, True)
        _, s_cuda, _, _ = cuda_ext.norm_fwd(x.to(DEVICE), None, None, None, None, SEED, OFFSET, 0.5, EPS,
                                            False, True)
        assert torch.equal(s_cpu, mask)
        assert torch.equal(s_cuda.cpu(), mask), f"H={H}"


# ------------------------------------------------------------------------------------------------
# norm_fwd / norm_bwd against the CPU kernels
# ------------------------------------------------------------------------------------------------


def check_against_cpu(cpu_ext, cuda_ext, rows, H, dtype, rms, p, combo, layout, seed=0):
    what = f"rows={rows} H={H} {dtype} rms={rms} p={p} layout={layout} combo={combo}"
    kw = dict(p=p, rms=rms, return_sum=combo["return_sum"], mask=combo["mask"])
    cuda_res = run_norm(cuda_ext, make_inputs(rows, H, dtype, layout, combo, DEVICE, seed), **kw)
    cpu_inputs = make_inputs(rows, H, dtype, layout, combo, "cpu", seed)
    cpu_res = run_norm(cpu_ext, cpu_inputs, **kw)
    assert_same_layout(cuda_res, cpu_res, what)
    if dtype in LOW_PRECISION:
        # Both against a float32 computation on the same (upcast) inputs.
        ref = run_norm(cpu_ext, upcast(cpu_inputs), **kw)
        for name in NAMES:
            tol = TOL[torch.float32] if name in STATS else TOL[dtype]
            assert_close(cuda_res[name], ref[name], tol, f"CUDA {name} vs fp32 ({what})")
            assert_close(cpu_res[name], ref[name], tol, f"CPU {name} vs fp32 ({what})")
    else:
        for name in NAMES:
            assert_close(cuda_res[name], cpu_res[name], TOL[dtype], f"{name} ({what})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=["fp32", "fp16", "bf16", "fp64"])
@pytest.mark.parametrize("H", [1, 7, 768, 1023, 4096])
@pytest.mark.parametrize("rows", [0, 1, 5, 64])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_norm_matches_cpu(cpu_ext, cuda_ext, dtype, H, rows, rms, p):
    for i, combo in enumerate(COMBOS):
        # Cycle the layouts over the flag combinations (permuted needs an even row count).
        layout = ("contiguous", "permuted", "unaligned", "contiguous")[i]
        if layout == "permuted" and rows % 2:
            layout = "unaligned"
        check_against_cpu(cpu_ext, cuda_ext, rows, H, dtype, rms, p, combo, layout, seed=i)


@pytest.mark.parametrize("rows,H,dtype", [
    (3, 8192, torch.float32),    # shared memory beyond 48 KB (opt-in)
    (3, 16384, torch.float32),   # backward: row in shared memory, column partials in global memory
    (3, 16384, torch.bfloat16),
    (3, 65536, torch.float32),   # forward and backward fall back to global row buffers
    (2, 32768, torch.float64),
])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_large_hidden(cpu_ext, cuda_ext, rows, H, dtype, rms):
    check_against_cpu(cpu_ext, cuda_ext, rows, H, dtype, rms, 0.1, COMBOS[0], "contiguous")
    check_against_cpu(cpu_ext, cuda_ext, rows, H, dtype, rms, 0.0, COMBOS[2], "unaligned")


@pytest.mark.parametrize("rows,H", [(10000, 7), (3000, 768), (1000, 4096), (600, 16384)])
def test_norm_many_rows_per_block(cpu_ext, cuda_ext, rows, H):
    """More rows than resident blocks: the grid-stride loop and the column partial sums."""
    check_against_cpu(cpu_ext, cuda_ext, rows, H, torch.float32, False, 0.1, COMBOS[0], "contiguous")
    check_against_cpu(cpu_ext, cuda_ext, rows, H, torch.float32, True, 0.0, COMBOS[2], "permuted")


def test_norm_3d_and_1d_inputs(cpu_ext, cuda_ext):
    for shape in [(4, 6, 32), (32,), (2, 1, 3, 16)]:
        x = torch.randn(shape)
        w, nb = torch.randn(shape[-1]), torch.randn(shape[-1])
        cpu = cpu_ext.norm_fwd(x, None, None, w, nb, SEED, OFFSET, 0.1, EPS, False, True)
        cuda = cuda_ext.norm_fwd(x.to(DEVICE), None, None, w.to(DEVICE), nb.to(DEVICE), SEED, OFFSET, 0.1,
                                 EPS, False, True)
        for name, a, b in zip(NAMES, cuda, cpu):
            assert a.shape == b.shape, (shape, name)
            assert_close(a, b, TOL[torch.float32], f"{name} shape={shape}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "unaligned"])
@pytest.mark.parametrize("H", [7, 768])
def test_norm_bwd_second_gradient(cpu_ext, cuda_ext, dtype, layout, H):
    """grad_out2 (the backward pass folds the add of two output gradients into the kernel): CUDA equals
    the CPU kernel given the same two gradients, and equals one gradient holding their sum (fp32)."""
    t = make_inputs(64, H, dtype, layout, COMBOS[0], "cpu", seed=7)
    g2 = make_inputs(64, H, dtype, layout, COMBOS[0], "cpu", seed=8)["dy"]
    out, s, mean, rstd = cpu_ext.norm_fwd(t["x"], t["bias"], t["residual"], t["weight"], t["norm_bias"],
                                          SEED, OFFSET, 0.1, EPS, False, True)
    args = (t["grad_sum"], t["x"], t["bias"], t["residual"], t["weight"], mean, rstd, SEED, OFFSET, 0.1, False,
            [True] * 5)
    cpu = cpu_ext.norm_bwd(t["dy"], *args, g2)
    dev = lambda a: a.to(DEVICE) if isinstance(a, torch.Tensor) else a  # noqa: E731
    cuda = cuda_ext.norm_bwd(dev(t["dy"]), *[dev(a) for a in args], dev(g2))
    tol = TOL[torch.float32] if dtype == torch.float32 else TOL[dtype]
    for name, a, b in zip(NAMES[4:], cuda, cpu):
        assert_close(a, b, tol, f"{name} {dtype} {layout} H={H}")
    if dtype == torch.float32:
        summed = cpu_ext.norm_bwd(t["dy"] + g2, *args, None)
        for name, a, b in zip(NAMES[4:], cpu, summed):
            assert_close(a, b, tol, f"{name} vs the summed gradient")


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_norm_bwd_dbias_without_bias(cpu_ext, cuda_ext, p):
    """output_mask[4] with no bias input (a linear's bias kept in the GEMM): dbias is the column sum of
    dx on CUDA as on the CPU (the backward pass fold_norm_bias_grads and BDRLN's p=0 path rely on it)."""
    t = make_inputs(300, 768, torch.float32, "contiguous", COMBOS[0], "cpu", seed=9)
    out, s, mean, rstd = cpu_ext.norm_fwd(t["x"], None, t["residual"], t["weight"], t["norm_bias"],
                                          SEED, OFFSET, p, EPS, False, True)
    args = (t["grad_sum"], t["x"], None, t["residual"], t["weight"], mean, rstd, SEED, OFFSET, p, False,
            [True, True, True, True, True])
    cpu = cpu_ext.norm_bwd(t["dy"], *args, None)
    dev = lambda a: a.to(DEVICE) if isinstance(a, torch.Tensor) else a  # noqa: E731
    cuda = cuda_ext.norm_bwd(dev(t["dy"]), *[dev(a) for a in args], None)
    assert cuda[4].shape == (768,)
    for name, a, b in zip(NAMES[4:], cuda, cpu):
        assert_close(a, b, TOL[torch.float32], f"{name} p={p}")
    assert_close(cuda[4], cuda[0].sum(0), (1e-4, 1e-4), "dbias = column sums of dx")


def test_norm_bwd_deterministic(cuda_ext):
    """Column sums use per-block partials and a fixed-order reduction: bitwise reproducible."""
    t = make_inputs(2000, 768, torch.float32, "contiguous", COMBOS[0], DEVICE)
    first = run_norm(cuda_ext, t, p=0.1, rms=False, return_sum=True, mask=[True] * 5)
    second = run_norm(cuda_ext, t, p=0.1, rms=False, return_sum=True, mask=[True] * 5)
    for name in NAMES:
        assert torch.equal(first[name], second[name]), name


def test_norm_on_side_stream(cpu_ext, cuda_ext):
    """The kernels run on PyTorch's current stream."""
    t = make_inputs(64, 768, torch.float32, "contiguous", COMBOS[0], DEVICE)
    expected = run_norm(cuda_ext, t, p=0.1, rms=False, return_sum=True, mask=[True] * 5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = run_norm(cuda_ext, t, p=0.1, rms=False, return_sum=True, mask=[True] * 5)
    torch.cuda.current_stream().wait_stream(stream)
    for name in NAMES:
        assert torch.equal(got[name], expected[name]), name


# ------------------------------------------------------------------------------------------------
# Gradients against torch.autograd of a pure-PyTorch reference
# ------------------------------------------------------------------------------------------------


def reference_forward(x, bias, residual, weight, norm_bias, keep_scale, rms):
    s = x if bias is None else x + bias
    s = s * keep_scale
    s = s + residual
    if rms:
        mean = None
        rstd = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)
        y = s * rstd
    else:
        mean = s.mean(-1, keepdim=True)
        rstd = torch.rsqrt((s - mean).pow(2).mean(-1, keepdim=True) + EPS)
        y = (s - mean) * rstd
    if weight is not None:
        y = y * weight
    if norm_bias is not None:
        y = y + norm_bias
    return y, s, mean, rstd


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("H", [1, 7, 768, 1023])
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("combo", [0, 2, 3])
def test_norm_grads_match_autograd(cuda_ext, dtype, H, rows, rms, p, combo):
    combo = COMBOS[combo]
    layout = "permuted" if rows % 2 == 0 else "contiguous"
    t = make_inputs(rows, H, dtype, layout, combo, DEVICE, seed=7)
    mask = [True] * 5
    res = run_norm(cuda_ext, t, p=p, rms=rms, return_sum=combo["return_sum"], mask=mask)

    # The dropout kernel's mask (0 or 1/(1-p), in x's dtype as the fused kernel scales in x's
    # accumulation type), over the logical index of x.
    keep_scale = cuda_ext.dropout(torch.ones(t["x"].shape, dtype=dtype, device=DEVICE), SEED, OFFSET, p)
    r = upcast(t, torch.float64)
    leaves = {k: r[k].clone().requires_grad_(True) for k in ("x", "bias", "weight", "norm_bias") if r[k] is not None}
    # Without a bias the kernel, as the CPU one, still returns dbias when mask asks for it (kernel_api.h
    # alloc_norm_grads: the column sums of dx, which the caller may need): the gradient of an implicit
    # bias of zeros, which the reference differentiates too. Without a weight, dweight is empty.
    if "bias" not in leaves:
        leaves["bias"] = torch.zeros(r["x"].shape[-1], dtype=torch.float64, device=DEVICE, requires_grad=True)
    # A residual leaf even when there is no residual: its gradient is ds, which dresidual returns.
    residual = (r["residual"] if r["residual"] is not None else torch.zeros_like(r["x"])).clone().requires_grad_(True)
    y, s, mean, rstd = reference_forward(leaves["x"], leaves.get("bias"), residual, leaves.get("weight"),
                                         leaves.get("norm_bias"), keep_scale.to(torch.float64), rms)
    loss = (y * r["dy"]).sum()
    if combo["return_sum"]:
        loss = loss + (s * r["grad_sum"]).sum()
    loss.backward()

    tol = TOL[dtype]
    what = f"rows={rows} H={H} {dtype} rms={rms} p={p} combo={combo}"
    assert_close(res["out"], y, tol, f"out ({what})")
    if combo["return_sum"]:
        assert_close(res["sum"], s, tol, f"sum ({what})")
    assert_close(res["rstd"], rstd.squeeze(-1), tol, f"rstd ({what})")
    if not rms:
        assert_close(res["mean"], mean.squeeze(-1), tol, f"mean ({what})")
    assert_close(res["dx"], leaves["x"].grad, tol, f"dx ({what})")
    assert_close(res["dresidual"], residual.grad, tol, f"dresidual ({what})")
    # dnorm_bias is sum_rows(dy) whether or not norm_bias is given (as in the CPU kernel).
    assert_close(res["dnorm_bias"], r["dy"].reshape(-1, H).sum(0), tol, f"dnorm_bias ({what})")
    if "weight" in leaves:
        assert_close(res["dweight"], leaves["weight"].grad, tol, f"dweight ({what})")
    else:
        assert res["dweight"].numel() == 0
    assert_close(res["dbias"], leaves["bias"].grad, tol, f"dbias ({what})")


# ------------------------------------------------------------------------------------------------
# Argument checks
# ------------------------------------------------------------------------------------------------


def test_rejects_tensors_on_the_wrong_device(cuda_ext):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="kernel but x is on"):
        cuda_ext.norm_fwd(x, None, None, None, None, 0, 0, 0.0, EPS, False, False)
    with pytest.raises(RuntimeError, match="kernel but x is on"):
        cuda_ext.dropout(x, 0, 0, 0.1)
    xc = x.to(DEVICE)
    with pytest.raises(RuntimeError, match="weight is on"):
        cuda_ext.norm_fwd(xc, None, None, torch.ones(8), None, 0, 0, 0.0, EPS, False, False)
    _, _, mean, rstd = cuda_ext.norm_fwd(xc, None, None, None, None, 0, 0, 0.0, EPS, False, False)
    with pytest.raises(RuntimeError, match="rstd is on"):
        cuda_ext.norm_bwd(xc, None, xc, None, None, None, mean, rstd.cpu(), 0, 0, 0.0, False, [True] * 5, None)
    with pytest.raises(RuntimeError, match="mean is on"):
        cuda_ext.norm_bwd(xc, None, xc, None, None, None, mean.cpu(), rstd, 0, 0, 0.0, False, [True] * 5, None)
