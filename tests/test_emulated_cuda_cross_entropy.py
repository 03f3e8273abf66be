"""dmfx's CUDA cross-entropy kernels (cuda_ops/csrc/cross_entropy_cuda.cu: cross_entropy_fwd,
cross_entropy_bwd), run on the CPU through the emulation of tests/cuda_emu, against dmfx's CPU kernels
on the same inputs: one block per row with fewer and more elements than threads, several kUnroll tiles
per thread, the block merge of (max, sum) pairs, ignored rows, NaN / masked / large logits, strided
rows, grad_logits, every reduction; and what the CUDA kernels do differently: a target out of range
gives NaN instead of an error.

What this cannot check, a GPU does: real launches, races that depend on timing within a phase, speed."""

from __future__ import annotations

import sys

import pytest
import torch

if not sys.platform.startswith("linux"):  # (ucontext fibers)
    pytest.skip("the CUDA emulation needs Linux", allow_module_level=True)

from conftest import rel_err  # noqa: E402

from dmfx.cuda_ops import build  # noqa: E402

IGNORE = -100
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
IDS = ["fp32", "fp16", "bf16", "fp64"]


@pytest.fixture(scope="module")
def emu():
    from cuda_emu import load

    m = load("cross_entropy")
    m.set_order(0)
    yield m
    m.set_order(0)


@pytest.fixture(scope="module")
def cpu():
    return build.load("cpu")


def _compare(got, expected, tol, what):
    assert got.device.type == "cpu" and got.shape == expected.shape and got.dtype == expected.dtype, what
    if expected.numel() == 0:
        return
    assert torch.equal(torch.isnan(got), torch.isnan(expected)), f"{what}: NaN positions differ"
    fin = torch.isfinite(expected)
    assert torch.equal(got[~fin].nan_to_num(), expected[~fin].nan_to_num()), f"{what}: infinities differ"
    assert rel_err(got[fin], expected[fin]) <= tol, f"{what}: rel err {rel_err(got[fin], expected[fin])}"


def _run_both(cpu, emu, logits, target, eps, reduction, grad_logits=None, what="", softcap=0.0):
    stat_tol = TOL[torch.float64] if logits.dtype == torch.float64 else TOL[torch.float32]
    fwd_c = cpu.cross_entropy_fwd(logits, target, IGNORE, eps, reduction)
    fwd_g = emu.cross_entropy_fwd(logits, target, IGNORE, eps, reduction)
    _compare(fwd_g[0], fwd_c[0], stat_tol, f"{what} loss")
    _compare(fwd_g[1], fwd_c[1], stat_tol, f"{what} lse")
    g = torch.randn(fwd_c[0].shape, generator=torch.Generator().manual_seed(7), dtype=fwd_c[0].dtype)
    d_c = cpu.cross_entropy_bwd(g, logits, target, fwd_c[1], IGNORE, eps, reduction, grad_logits, softcap)
    d_g = emu.cross_entropy_bwd(g, logits, target, fwd_c[1], IGNORE, eps, reduction, grad_logits, softcap)
    _compare(d_g, d_c, TOL[logits.dtype], f"{what} dlogits")


def test_functions_match_the_cuda_bindings(emu, cpu):
    names = lambda m: {n for n in dir(m) if not n.startswith("_")}  # noqa: E731
    hooks = {"set_order", "set_grid", "set_device", "rounds", "launches", "blocks_run"}
    assert names(emu) - hooks == {"cross_entropy_fwd", "cross_entropy_bwd"}
    assert names(emu) - hooks <= names(cpu)


# below one warp, one warp, below / above a block (256), one and several kUnroll tiles (4 x 256)
VOCAB = [1, 5, 32, 255, 257, 1024, 1100, 3001]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("V", VOCAB)
def test_matches_cpu(cpu, emu, V, dtype):
    gen = torch.Generator().manual_seed(V)
    N = 6 if V <= 1100 else 3
    logits = (torch.randn(N, V, generator=gen, dtype=torch.float64) * 3).to(dtype)
    target = torch.randint(0, V, (N,), generator=gen)
    target[::3] = IGNORE
    for eps, reduction in ((0.0, 1), (0.1, 0), (0.0, 2)):
        gl = torch.randn(N, V, generator=gen).to(dtype) if reduction == 0 else None
        _run_both(cpu, emu, logits, target, eps, reduction, gl, f"V={V} {dtype} eps={eps} reduction={reduction}")


def test_strided_rows_and_grad_logits(cpu, emu):
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(5, 310, generator=gen)
    logits, gl = base[:, 3:303], torch.randn(5, 320, generator=gen)[:, 1:301]  # row strides 310 and 320
    target = torch.tensor([0, 299, IGNORE, 17, 150])
    _run_both(cpu, emu, logits, target, 0.0, 1, gl, "strided")
    _run_both(cpu, emu, logits.bfloat16(), target, 0.05, 2, gl.bfloat16(), "strided bf16")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("V", [5, 257, 1100])
def test_softcap_matches_cpu(cpu, emu, V, dtype):
    """Soft-capped logits (|c| < cap): the raw logits' gradient, the loss's and grad_logits times
    1 - (c / cap)^2, ignored rows (with grad_logits: it times the factor) and strided rows included."""
    gen = torch.Generator().manual_seed(V + 1)
    N, cap = 6, 30.0
    wide = cap * torch.tanh(torch.randn(N, V + 3, generator=gen, dtype=torch.float64) * 25 / cap)
    logits = wide.clamp(-0.99 * cap, 0.99 * cap).to(dtype)[:, 1:V + 1]  # (row stride V + 3)
    target = torch.randint(0, V, (N,), generator=gen)
    target[::3] = IGNORE
    for eps, reduction, with_gl in ((0.0, 1, True), (0.1, 0, False), (0.1, 2, True)):
        gl = torch.randn(N, V, generator=gen).to(dtype) if with_gl else None
        _run_both(cpu, emu, logits, target, eps, reduction, gl,
                  f"V={V} {dtype} eps={eps} reduction={reduction} softcap={cap}", softcap=cap)
    # the cap changes the result (the factor is applied): against the uncapped backward times it
    lse = cpu.cross_entropy_fwd(logits, target, IGNORE, 0.0, 2)[1]
    gl = torch.randn(N, V, generator=gen).to(dtype)
    one = torch.ones((), dtype=lse.dtype)
    d = emu.cross_entropy_bwd(one, logits, target, lse, IGNORE, 0.0, 2, gl, cap)
    plain = cpu.cross_entropy_bwd(one, logits, target, lse, IGNORE, 0.0, 2, gl)
    factor = 1 - (logits.double() / cap) ** 2
    assert rel_err(d, plain.double() * factor) <= TOL[dtype]


def test_special_rows(cpu, emu):
    x = torch.randn(5, 300)
    x[0, 7] = float("nan")  # NaN row
    x[1, :200] = float("-inf")  # masked vocabulary
    x[2] += 1e4  # large logits: the (max, log-sum) pair keeps their precision
    x[3] = float("-inf")  # every logit -inf: NaN (as eager)
    target = torch.tensor([1, 250, 3, 4, 5])
    _run_both(cpu, emu, x, target, 0.0, 0, None, "special rows")


def test_every_row_ignored_and_empty(cpu, emu):
    x, t = torch.randn(3, 40), torch.full((3,), IGNORE)
    loss, lse = emu.cross_entropy_fwd(x, t, IGNORE, 0.0, 1)
    assert torch.isnan(loss) and torch.equal(lse, torch.zeros(3, 2))
    assert emu.cross_entropy_fwd(x, t, IGNORE, 0.0, 2)[0].item() == 0.0
    assert torch.equal(emu.cross_entropy_bwd(torch.ones(()), x, t, lse, IGNORE, 0.0, 1, None), torch.zeros(3, 40))
    empty, no_t = torch.empty(0, 40), torch.empty(0, dtype=torch.long)
    loss, lse = emu.cross_entropy_fwd(empty, no_t, IGNORE, 0.0, 2)
    assert loss.item() == 0.0 and lse.shape == (0, 2)
    assert emu.cross_entropy_bwd(torch.ones(()), empty, no_t, lse, IGNORE, 0.0, 2, None).shape == (0, 40)


def test_a_target_out_of_range_gives_nan_rows(emu):
    x, t = torch.randn(3, 40), torch.tensor([1, 40, -5])
    loss, lse = emu.cross_entropy_fwd(x, t, IGNORE, 0.0, 0)
    assert not torch.isnan(loss[0]) and torch.isnan(loss[1:]).all() and torch.isnan(lse[1:]).all()
    assert torch.isnan(emu.cross_entropy_fwd(x, t, IGNORE, 0.0, 1)[0])
    d = emu.cross_entropy_bwd(torch.ones(3), x, t, lse, IGNORE, 0.0, 0, None)
    assert torch.isfinite(d[0]).all() and torch.isnan(d[1:]).all()


def test_independent_of_thread_order(emu):
    for V in (100, 1100):
        x, t = torch.randn(3, V), torch.tensor([0, IGNORE, V - 1])
        base = emu.cross_entropy_fwd(x, t, IGNORE, 0.1, 0)
        gbase = emu.cross_entropy_bwd(torch.ones(3), x, t, base[1], IGNORE, 0.1, 0, None)
        try:
            for mode in (1, 2, 3, 4, 5):
                emu.set_order(mode)
                again = emu.cross_entropy_fwd(x, t, IGNORE, 0.1, 0)
                assert all(torch.equal(a, b) for a, b in zip(again, base)), f"V={V} order={mode}"
                assert torch.equal(emu.cross_entropy_bwd(torch.ones(3), x, t, base[1], IGNORE, 0.1, 0, None), gbase)
        finally:
            emu.set_order(0)


def test_wrong_device_and_dtype(emu):
    x, t = torch.randn(2, 4), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="kernel but logits is on meta"):
        emu.cross_entropy_fwd(x.to("meta"), t, IGNORE, 0.0, 1)
    with pytest.raises(RuntimeError, match="target is on meta"):
        emu.cross_entropy_fwd(x, t.to("meta"), IGNORE, 0.0, 1)
    with pytest.raises(RuntimeError, match="target must be int64"):
        emu.cross_entropy_fwd(x, t.int(), IGNORE, 0.0, 1)
