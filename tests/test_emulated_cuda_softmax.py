"""dmfx's CUDA attention-softmax kernels (cuda_ops/csrc/softmax_cuda.cu: softmax_fwd, softmax_bwd),
run on the CPU through the emulation of tests/cuda_emu, against dmfx's CPU kernels on the same
inputs: the warp-per-row kernels (N = 8 for Sk <= 256, N = 32 for Sk <= 1024; vector loads when
Sk % 4 == 0 and rows are aligned, else scalar), the block-per-row kernels (Sk > 1024), every mask
form, causal limits, fully masked and NaN rows, and the Philox dropout masks (bit-identical: same
seed and offset). Mirrors tests/test_cuda_softmax.py (same tolerances), at sizes the emulation runs
quickly.

What this cannot check, tests/test_cuda_softmax.py does on a GPU: real launches, races that depend
on timing within a phase, speed."""

from __future__ import annotations

import sys

import pytest
import torch

if not sys.platform.startswith("linux"):  # (ucontext fibers)
    pytest.skip("the CUDA emulation needs Linux", allow_module_level=True)

from conftest import rel_err, softmax_mask  # noqa: E402

from dmfx.cuda_ops import build  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
IDS = ["fp32", "fp16", "bf16", "fp64"]
NEG = torch.finfo(torch.float32).min
SEED, OFFSET = 1234, 56


@pytest.fixture(scope="module")
def emu():
    from cuda_emu import load

    m = load("softmax")
    m.set_order(0)
    yield m
    m.set_order(0)


@pytest.fixture(scope="module")
def cpu():
    return build.load("cpu")


def _compare(got, expected, dtype, what):
    assert got.device.type == "cpu"
    assert got.shape == expected.shape and got.dtype == expected.dtype, what
    if expected.numel() == 0:
        return
    assert torch.equal(torch.isnan(got), torch.isnan(expected)), f"{what}: NaN positions differ"
    fin = ~torch.isnan(expected)
    assert rel_err(got[fin], expected[fin]) <= TOL[dtype], f"{what}: rel err {rel_err(got[fin], expected[fin])}"


def _run_both(cpu, emu, scores, mask, scale, causal, p, what):
    dtype = scores.dtype
    out_c, probs_c = cpu.softmax_fwd(scores, mask, scale, causal, SEED, OFFSET, p)
    out_g, probs_g = emu.softmax_fwd(scores, mask, scale, causal, SEED, OFFSET, p)
    _compare(out_g, out_c, dtype, f"{what} out")
    _compare(probs_g, probs_c, dtype, f"{what} probs")
    if p > 0 and scores.numel():
        nz = probs_c != 0
        assert torch.equal((out_g != 0)[nz], (out_c != 0)[nz]), f"{what}: dropout masks differ"
    saved_c = probs_c if p > 0 else out_c
    go = torch.randn(scores.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    g_c = cpu.softmax_bwd(go, saved_c, SEED, OFFSET, p, 0.7)
    g_g = emu.softmax_bwd(go, saved_c, SEED, OFFSET, p, 0.7)
    _compare(g_g, g_c, dtype, f"{what} grad")


def test_functions_match_the_cuda_bindings(emu, cpu):
    names = lambda m: {n for n in dir(m) if not n.startswith("_")}  # noqa: E731
    hooks = {"set_order", "set_grid", "set_device", "rounds", "launches", "blocks_run"}
    assert names(emu) - hooks == {"softmax_fwd", "softmax_bwd"}
    assert names(emu) - hooks <= names(cpu)


# Both sides of each threshold: 256 (N = 8 / 32), 1024 (warp / block kernels), Sk % 4 (vector / scalar).
SK = [1, 7, 33, 128, 256, 257, 1023, 1024, 1025, 2052]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("Sk", SK)
def test_matches_cpu(cpu, emu, Sk, dtype):
    gen = torch.Generator().manual_seed(Sk)
    # fewer rows for the block kernels (one 512-thread block per row is slow to emulate)
    shape = (2, 3, 5, Sk) if Sk <= 1024 else (2, 1, 3, Sk)
    scores = (torch.randn(shape, generator=gen) * 3).to(dtype)
    kinds = ("none", "padding", "bool", "same", "float", "rowconst")
    for kind in kinds:
        mask = softmax_mask(kind, shape, dtype, gen)
        for causal, p in ((False, 0.0), (True, 0.1), (False, 1.0)):
            _run_both(cpu, emu, scores, mask, 0.3, causal, p, f"Sk={Sk} {dtype} {kind} causal={causal} p={p}")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("Sk", [7, 128, 1025])
def test_backward_with_a_stored_mask(cpu, emu, Sk, dtype):
    """native_dropout's bool mask instead of Philox: warp (vector and scalar) and block kernels."""
    gen = torch.Generator().manual_seed(Sk)
    shape = (2, 3, 5, Sk) if Sk <= 1024 else (2, 1, 3, Sk)
    probs = torch.softmax(torch.randn(shape, generator=gen), -1).to(dtype)
    go = torch.randn(shape, generator=gen).to(dtype)
    mask = (torch.rand(shape[1], shape[0], *shape[2:], generator=gen) >= 0.3).transpose(0, 1)
    g_c = cpu.softmax_bwd(go, probs, 0, 0, 0.0, 0.7, mask, 1 / 0.7)
    g_g = emu.softmax_bwd(go, probs, 0, 0, 0.0, 0.7, mask, 1 / 0.7)
    _compare(g_g, g_c, dtype, f"Sk={Sk} stored mask")


@pytest.mark.parametrize("Sk", [8, 128, 1024, 1500])
def test_strided_and_unaligned(cpu, emu, Sk):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(1, 4, 2, Sk + 1, generator=gen) if Sk > 1024 else torch.randn(2, 6, 3, Sk + 1, generator=gen)
    views = {
        "permuted": base[..., :Sk].permute(0, 2, 1, 3),   # vector path, strided leading dims
        "unaligned": base[..., 1:],                       # rows start at odd offsets: scalar path
        "transposed": base[..., :Sk].transpose(-1, -2),   # last dim strided: copied first
    }
    for name, s in views.items():
        if name == "transposed" and Sk > 128:
            continue  # (a 1500-row softmax of length 2..6: slow to emulate, nothing new)
        mask = torch.where(torch.rand(s.shape[0], 1, 1, s.shape[-1], generator=gen) < 0.8, 0.0, NEG)
        for causal, p in ((False, 0.0), (True, 0.2)):
            _run_both(cpu, emu, s, mask, 0.125, causal, p, f"{name} Sk={Sk} causal={causal} p={p}")


def test_causal_short_queries_and_special_rows(cpu, emu):
    for Sq, Sk in ((3, 10), (10, 3), (4, 1100), (1, 1)):
        s = torch.randn(2, Sq, Sk)
        _run_both(cpu, emu, s, None, 1.0, True, 0.1, f"causal Sq={Sq} Sk={Sk}")
    for Sk in (64, 67, 2048):
        s = torch.randn(4, Sk)
        s[1] = float("-inf")  # fully masked -> zeros
        s[2, 5] = float("nan")  # NaN row
        out_c, _ = cpu.softmax_fwd(s, None, 1.0, False, 0, 0, 0.0)
        out_g, _ = emu.softmax_fwd(s, None, 1.0, False, 0, 0, 0.0)
        assert (out_g[1] == 0).all() and torch.isnan(out_g[2]).all()
        _compare(out_g, out_c, torch.float32, f"special rows Sk={Sk}")


def test_rows_not_a_multiple_of_the_warps_per_block(cpu, emu):
    """4 rows (warps) per block: with 5, 6 or 7 rows the last block has idle warps that exit while
    the others shuffle (legal: shuffles are per warp)."""
    for rows in (5, 6, 7):
        s = torch.randn(rows, 40)
        _run_both(cpu, emu, s, None, 1.0, False, 0.1, f"rows={rows}")


def test_empty(emu):
    for shape in [(0, 4, 8), (3, 0), (2, 0, 5)]:
        out, probs = emu.softmax_fwd(torch.randn(shape), None, 1.0, False, 1, 2, 0.1)
        assert out.shape == shape and probs.shape == shape
        g = emu.softmax_bwd(torch.randn(shape), probs, 1, 2, 0.1, 1.0)
        assert g.shape == shape


def test_dropout_mask_is_philox(emu):
    from dmfx.cuda_ops import reference as R

    s = torch.randn(2, 2, 16, 64)
    seed = torch.tensor([SEED, OFFSET])
    for p in (0.1, 0.5):
        out, probs = emu.softmax_fwd(s, None, 1.0, False, SEED, OFFSET, p)
        keep = R.philox_keep(s.numel(), p, seed).reshape(s.shape)
        assert torch.equal(out != 0, keep)
        torch.testing.assert_close(out[keep], probs[keep] / (1 - p), rtol=1e-6, atol=0)


def test_independent_of_thread_order(emu):
    for Sk in (100, 1030):
        s = torch.randn(3, Sk)
        base = emu.softmax_fwd(s, None, 0.5, True, SEED, OFFSET, 0.1)
        gbase = emu.softmax_bwd(s, base[1], SEED, OFFSET, 0.1, 0.5)
        try:
            for mode in (1, 2, 3, 4, 5):
                emu.set_order(mode)
                again = emu.softmax_fwd(s, None, 0.5, True, SEED, OFFSET, 0.1)
                assert all(torch.equal(a, b) for a, b in zip(again, base)), f"Sk={Sk} order={mode}"
                assert torch.equal(emu.softmax_bwd(s, base[1], SEED, OFFSET, 0.1, 0.5), gbase)
        finally:
            emu.set_order(0)


def test_wrong_device(emu):
    s = torch.randn(2, 3, 4)
    with pytest.raises(RuntimeError, match="mask is on meta"):
        emu.softmax_fwd(s, torch.zeros(3, 4, device="meta"), 1.0, False, 0, 0, 0.0)
    with pytest.raises(RuntimeError, match="kernel but scores is on meta"):
        emu.softmax_fwd(s.to("meta"), None, 1.0, False, 0, 0, 0.0)
    with pytest.raises(RuntimeError, match="grad_out is on meta"):
        emu.softmax_bwd(torch.randn(2, 3, 4, device="meta"), s, 0, 0, 0.0, 1.0)
