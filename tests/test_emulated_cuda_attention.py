"""dmfx's CUDA flash attention kernels (cuda_ops/csrc/attention_cuda.cu), run on the CPU through the
emulation of tests/cuda_emu, against dmfx's CPU flash kernels: the CUDA kernels' logic (tiling, online
softmax, masks, causal limits, Philox dropout indices, grouped-query sums, partial tiles, barriers)
checked in CI, where there is no GPU. Every output lives in a NaN-filled guard buffer (a write outside
it fails), shared memory starts as NaN with a canary past each kernel's allotment, and results must
not change by a bit with the order the threads run in or the number of blocks.

What this cannot check, tests/test_cuda_attention.py does on a GPU: real launches, races that
depend on timing within a phase, speed."""

from __future__ import annotations

import sys

import pytest
import torch

if not sys.platform.startswith("linux"):  # (ucontext fibers)
    pytest.skip("the CUDA emulation needs Linux", allow_module_level=True)

from dmfx.cuda_ops import build  # noqa: E402

NAN = float("nan")
NEG = torch.finfo(torch.float32).min
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {F32: 2e-5, F16: 3e-3, BF16: 2e-2}


@pytest.fixture(scope="module")
def emu():
    from cuda_emu import load

    return load()


@pytest.fixture(scope="module")
def cpu():
    return build.load("cpu")


def _guarded(B, L, H, D, dtype, pad, values=None):
    """A [B, H, L, D] view (the [B, L, H, D] layout) into a NaN-filled buffer: NaN in `pad` columns
    past D and before and after the whole buffer. Returns (view, flat buffer, where the view is)."""
    n = B * L * H * (D + pad)
    flat = torch.full((n + 64,), NAN, dtype=dtype)
    buf = flat[32:32 + n].view(B, L, H, D + pad)
    if values is not None:
        buf[..., :D] = values.to(dtype)
    inside = torch.zeros(n + 64, dtype=torch.bool)
    inside[32:32 + n].view(B, L, H, D + pad)[..., :D] = True
    return buf[..., :D].transpose(1, 2), flat, inside


def _rel(a, b):
    """||a - b|| / ||b||, with an RMS floor of 0.1 (gradients that are zero up to rounding)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / max(b.norm().item(), 0.1 * b.numel() ** 0.5)).item()


def _mask(kind, B, H, Lq, Lk, dtype, gen):
    if kind == "none":
        return None
    if kind == "padding":  # HF's [B, 1, 1, Lk]: the last sequence padded
        m = torch.zeros(B, 1, 1, Lk)
        m[-1, ..., max(1, Lk // 2):] = NEG
        return m
    if kind == "bool":  # a row with no visible key, a column always visible
        m = torch.rand(Lq, Lk, generator=gen) < 0.7
        m[:, -1] = True
        m[0] = False
        return m
    if kind == "full":
        return torch.randn(B, H, Lq, Lk, generator=gen).to(dtype)
    if kind == "rowconst":
        return torch.randn(Lq, 1, generator=gen).to(dtype)
    if kind == "allpad":  # batch 0 has every key hidden
        m = torch.zeros(B, 1, 1, Lk)
        m[0] = NEG
        return m
    raise ValueError(kind)


def _case(emu, cpu, B, Hq, Hk, Lq, Lk, D, Dv, kind="none", causal=False, p=0.0, dtype=F32, pad=4, order=0, grid=3,
          softcap=0.0):
    gen = torch.Generator().manual_seed(B * 1000 + Lq * 7 + Lk)
    scale, (s, o) = D ** -0.5, (1234, 5678)
    vq, vk, vv = (torch.randn(B, L, H, d, generator=gen).to(dtype) for L, H, d in ((Lq, Hq, D), (Lk, Hk, D), (Lk, Hk, Dv)))
    go = torch.randn(B, Lq, Hq, Dv, generator=gen).to(dtype)
    mask = _mask(kind, B, Hq, Lq, Lk, dtype, gen)
    emu.set_order(order)
    emu.set_grid(grid)
    q, *_ = _guarded(B, Lq, Hq, D, dtype, pad, vq)
    k, *_ = _guarded(B, Lk, Hk, D, dtype, pad, vk)
    v, *_ = _guarded(B, Lk, Hk, Dv, dtype, pad, vv)
    g, *_ = _guarded(B, Lq, Hq, Dv, dtype, pad, go)
    out, fo, io = _guarded(B, Lq, Hq, Dv, dtype, pad)
    stats = emu.flash_fwd(q, k, v, mask, scale, causal, s, o, p, out, softcap=softcap)
    dq, fdq, idq = _guarded(B, Lq, Hq, D, dtype, pad)
    dk, fdk, idk = _guarded(B, Lk, Hk, D, dtype, pad)
    dv, fdv, idv = _guarded(B, Lk, Hk, Dv, dtype, pad)
    emu.flash_bwd(g, q, k, v, stats, mask, scale, causal, s, o, p, dq, dk, dv, softcap=softcap)
    what = (f"B={B} Hq={Hq} Hk={Hk} Lq={Lq} Lk={Lk} D={D} Dv={Dv} {kind} causal={causal} p={p} {dtype} pad={pad} "
            f"softcap={softcap}")
    for flat, inside, name in ((fo, io, "out"), (fdq, idq, "dq"), (fdk, idk, "dk"), (fdv, idv, "dv")):
        assert torch.isnan(flat[~inside]).all(), f"{what}: {name} written outside the tensor"
    # the CPU kernels, in float32, on the same values (same seed: the same dropout mask)
    cq, ck, cv, cg = (t.float().transpose(1, 2) for t in (vq, vk, vv, go))
    cmask = None if mask is None else (mask if mask.dtype == torch.bool else mask.float())
    cout = torch.empty(B, Lq, Hq, Dv).transpose(1, 2)
    cstats = cpu.flash_fwd(cq, ck, cv, cmask, scale, causal, s, o, p, cout, softcap=softcap)
    cdq, cdk, cdv = torch.empty_like(cq), torch.empty_like(ck), torch.empty_like(cv)
    cpu.flash_bwd(cg, cq, ck, cv, cstats, cmask, scale, causal, s, o, p, cdq, cdk, cdv, softcap=softcap)
    for name, a, b in (("out", out, cout), ("dq", dq, cdq), ("dk", dk, cdk), ("dv", dv, cdv)):
        assert not torch.isnan(a).any(), f"{what}: NaN in {name}"
        if b.numel():
            assert _rel(a.float(), b) < TOL[dtype], f"{what}: {name} relative error {_rel(a.float(), b)}"
    dead = torch.isinf(cstats[0])  # rows with no visible key: zeros, stats (-inf, 0)
    assert torch.equal(torch.isinf(stats[0]), dead), f"{what}: fully masked rows differ"
    assert (stats[1][dead] == 0).all()
    if (~dead).any():
        assert (stats[0][~dead] - cstats[0][~dead]).abs().max() < 1e-3, what
        assert _rel(stats[1][~dead], cstats[1][~dead]) < 1e-4, what
    return out, stats, dq, dk, dv


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("kind", ["none", "padding", "bool", "full", "rowconst", "allpad"])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_masks_dtypes_dropout(emu, cpu, dtype, kind, p):
    _case(emu, cpu, 2, 3, 3, 37, 37, 64, 64, kind, False, p, dtype)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("kind", ["none", "padding", "full"])
@pytest.mark.parametrize("causal", [False, True])
def test_soft_capped_scores(emu, cpu, dtype, kind, causal):
    """Gemma 2's soft cap, softcap * tanh(s * scale / softcap) before the mask, and its factor in the
    backward's dS: as the CPU kernels compute them, over several key tiles, grouped-query, with dropout
    (a cap of 0.5 against scores of about 1: most of them in the tanh's curved part)."""
    _case(emu, cpu, 2, 4, 2, 70, 130, 64, 64, kind, causal, 0.1, dtype, softcap=0.5)


@pytest.mark.parametrize("lengths", [(1, 1), (1, 37), (37, 1), (64, 64), (65, 129), (130, 37), (37, 130), (130, 130)])
@pytest.mark.parametrize("causal", [False, True])
def test_lengths_and_causal(emu, cpu, lengths, causal):
    """Partial tiles, one-row and one-key cases, causal with Lq < Lk and Lq > Lk (rows with no key)."""
    _case(emu, cpu, 1, 2, 2, *lengths, 32, 32, "padding", causal, 0.1, F32)


@pytest.mark.parametrize("dims", [(32, 32), (64, 64), (80, 80), (96, 96), (128, 128), (64, 32), (16, 128), (3, 5), (128, 1)])
@pytest.mark.parametrize("pad", [4, 3])
def test_head_dims_and_load_paths(emu, cpu, dims, pad):
    """Every head-dim template, D != Dv, odd dims; rows 16-byte aligned (pad 4, float32: vector
    loads) or not (pad 3, bfloat16: scalar loads)."""
    _case(emu, cpu, 1, 2, 2, 70, 70, *dims, "bool", True, 0.1, F32 if pad == 4 else BF16, pad=pad)


@pytest.mark.parametrize("Hk", [1, 2])
@pytest.mark.parametrize("D", [32, 128])
def test_grouped_query_cross_attention(emu, cpu, Hk, D):
    _case(emu, cpu, 2, 4, Hk, 45, 77, D, D, "padding", True, 0.15, F16)


def test_dropout_everything(emu, cpu):
    _case(emu, cpu, 1, 2, 2, 20, 20, 32, 32, "none", False, 1.0, F32)


@pytest.mark.parametrize("args", [(2, 4, 2, 70, 130, 64, 64, "padding", True, 0.2, F32),
                                  (1, 2, 2, 40, 40, 128, 128, "bool", False, 0.1, BF16)])
def test_results_do_not_depend_on_scheduling(emu, cpu, args):
    """Threads run in order, reversed or shuffled at every barrier, or warp by warp (each to its next
    __syncthreads), on 1 to 1000 blocks: the same bits (a read of shared memory another thread writes
    in the same phase would show here)."""
    ref = _case(emu, cpu, *args, order=0, grid=3)
    for order, grid in ((1, 1), (2, 2), (2, 1000), (3, 2), (5, 3)):
        got = _case(emu, cpu, *args, order=order, grid=grid)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), (order, grid)


def test_bias_part(emu, cpu):
    """Per-(batch, head) column sums of dq, dk and dv, as the CPU kernel writes them."""
    B, H, L, D = 2, 3, 21, 32
    emu.set_order(0)
    q, k, v, go = (torch.randn(B, L, H, D).transpose(1, 2) for _ in range(4))
    res = []
    for m in (emu, cpu):
        out = torch.empty(B, L, H, D).transpose(1, 2)
        st = m.flash_fwd(q, k, v, None, 0.3, True, 7, 9, 0.2, out)
        dq, dk, dv = (torch.empty(B, L, H, D).transpose(1, 2) for _ in range(3))
        bp = torch.empty(3, B, H, D)
        m.flash_bwd(go, q, k, v, st, None, 0.3, True, 7, 9, 0.2, dq, dk, dv, bp)
        res.append((out, dq, dk, dv, bp))
    for a, b in zip(*res):
        assert _rel(a, b) < 2e-5


def test_empty_inputs(emu):
    B, H, L, D = 2, 3, 21, 32
    q, k, v, go = (torch.randn(B, L, H, D).transpose(1, 2) for _ in range(4))
    out = torch.full((B, H, L, D), NAN)
    st = emu.flash_fwd(q, k[:, :, :0], v[:, :, :0], None, 1.0, False, 0, 0, 0.0, out)
    assert (out == 0).all() and torch.isinf(st[0]).all() and (st[1] == 0).all()
    st = emu.flash_fwd(q[:, :, :0], k, v, None, 1.0, False, 0, 0, 0.0, out[:, :, :0])
    assert st.shape == (2, B, H, 0)
    dq, dk, dv = (torch.full((B, H, L, D), NAN) for _ in range(3))
    emu.flash_bwd(go[:, :, :0], q[:, :, :0], k, v, st, None, 1.0, False, 0, 0, 0.0, dq[:, :, :0], dk, dv)
    assert (dk == 0).all() and (dv == 0).all()
    st = emu.flash_fwd(q[:0], k[:0], v[:0], None, 1.0, False, 0, 0, 0.0, out[:0])
    assert st.shape == (2, 0, H, L)


def test_nan_and_fully_masked_rows_as_on_the_cpu(emu, cpu):
    B, H, L, D = 2, 3, 21, 32
    q, k, v = (torch.randn(B, L, H, D).transpose(1, 2) for _ in range(3))
    q = q.clone()
    q[0, 1, 4, 3] = NAN
    mask = torch.ones(L, L, dtype=torch.bool)
    mask[6] = False
    (a, sa), (b, sb) = [(out, m.flash_fwd(q, k, v, mask, 0.5, False, 0, 0, 0.0, out))
                        for m in (emu, cpu) for out in [torch.empty(B, H, L, D)]]
    assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.isnan(sa), torch.isnan(sb))
    assert (a[:, :, 6] == 0).all() and torch.isinf(sa[0, :, :, 6]).all()
    fin = ~torch.isnan(b)
    assert _rel(a[fin], b[fin]) < 2e-5


def test_bad_input_errors(emu):
    B, H, L, D = 2, 3, 21, 32
    q, k, v = (torch.randn(B, L, H, D).transpose(1, 2) for _ in range(3))
    out, dq, dk, dv = (torch.empty(B, H, L, D) for _ in range(4))
    cases = [
        (lambda: emu.flash_fwd(q.double(), k.double(), v.double(), None, 1.0, False, 0, 0, 0.0, out.double()),
         "float32, float16 or bfloat16"),
        (lambda: emu.flash_fwd(*(torch.randn(1, 2, 3, 129) for _ in range(3)), None, 1.0, False, 0, 0, 0.0,
                               torch.empty(1, 2, 3, 129)), "head dims up to 128"),
        (lambda: emu.flash_fwd(q, k, v, None, 1.0, False, 0, 0, 0.0, torch.empty(B, H, L, D + 1)), "out must be"),
        (lambda: emu.flash_bwd(q, q, k, v, torch.empty(2, B, H, L, dtype=torch.float64), None, 1.0, False, 0, 0, 0.0,
                               dq, dk, dv), "stats must be"),
        (lambda: emu.flash_fwd(q, k, v, None, float("inf"), False, 0, 0, 0.0, out), "scale must be finite"),
        (lambda: emu.flash_fwd(q, k, v, torch.zeros(3, L), 1.0, False, 0, 0, 0.0, out), "not broadcastable"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


# ------------------------------------------------------------------------------------ varlen form
# The varlen addressing mode of the same kernels (one block per (head, 64-row tile) of the packed
# sequences, the tiles numbered by varlen_tiles_kernel from cu_seqlens on the device) against the CPU
# varlen kernels in float32 on the same values (same seed: the same Philox mask at (h*T + tq)*T + tk).


def _packed_guarded(T, H, D, dtype, pad, values=None):
    """A [T, H, D] view into a NaN-filled buffer [T, H, D + pad] with NaN before and after it (as
    _guarded). Returns (view, flat buffer, where the view is)."""
    n = T * H * (D + pad)
    flat = torch.full((n + 64,), NAN, dtype=dtype)
    buf = flat[32:32 + n].view(T, H, D + pad)
    if values is not None:
        buf[..., :D] = values.to(dtype)
    inside = torch.zeros(n + 64, dtype=torch.bool)
    inside[32:32 + n].view(T, H, D + pad)[..., :D] = True
    return buf[..., :D], flat, inside


def _cu(lengths, dtype=torch.int32):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def _varlen_run(emu, lengths_or_cu, T, Hq, Hk, D, Dv, causal, p, dtype, pad, gen, cu_dtype=torch.int32):
    """The emulated varlen forward and backward on guarded packed tensors: (values, results, guards)."""
    cu = lengths_or_cu if isinstance(lengths_or_cu, torch.Tensor) else _cu(lengths_or_cu, cu_dtype)
    vals = [torch.randn(T, H, d, generator=gen).to(dtype) for H, d in ((Hq, D), (Hk, D), (Hk, Dv), (Hq, Dv))]
    q, k, v, g = (_packed_guarded(T, H, d, dtype, pad, x)[0] for (H, d), x in zip(((Hq, D), (Hk, D), (Hk, Dv), (Hq, Dv)), vals))
    out, fo, io = _packed_guarded(T, Hq, Dv, dtype, pad)
    s, o = 4321, 8765
    stats = emu.varlen_fwd(q, k, v, cu, D ** -0.5, causal, s, o, p, out)
    dq, fdq, idq = _packed_guarded(T, Hq, D, dtype, pad)
    dk, fdk, idk = _packed_guarded(T, Hk, D, dtype, pad)
    dv, fdv, idv = _packed_guarded(T, Hk, Dv, dtype, pad)
    emu.varlen_bwd(g, q, k, v, out, stats, cu, D ** -0.5, causal, s, o, p, dq, dk, dv)
    guards = ((fo, io, "out"), (fdq, idq, "dq"), (fdk, idk, "dk"), (fdv, idv, "dv"))
    return cu, vals, (out, stats, dq, dk, dv), guards


def _varlen_case(emu, cpu, lengths, Hq=2, Hk=2, D=32, Dv=32, causal=False, p=0.0, dtype=F32, pad=4, order=0, grid=3,
                 cu_dtype=torch.int32):
    gen = torch.Generator().manual_seed(sum(lengths) * 31 + Hq)
    T = sum(lengths)
    emu.set_order(order)
    emu.set_grid(grid)
    cu, vals, (out, stats, dq, dk, dv), guards = _varlen_run(emu, lengths, T, Hq, Hk, D, Dv, causal, p, dtype, pad, gen,
                                                              cu_dtype)
    what = f"lengths={lengths} Hq={Hq} Hk={Hk} D={D} Dv={Dv} causal={causal} p={p} {dtype} pad={pad}"
    for flat, inside, name in guards:
        assert torch.isnan(flat[~inside]).all(), f"{what}: {name} written outside the tensor"
    # the CPU kernels in float32 on the same (rounded) values; the CUDA backward's delta reads out as
    # stored, so the CPU backward gets the emulated out too
    cq, ck, cv, cg = (x.float() for x in vals)
    cout = torch.empty(T, Hq, Dv)
    cstats = cpu.varlen_fwd(cq, ck, cv, cu, D ** -0.5, causal, 4321, 8765, p, cout)
    cdq, cdk, cdv = torch.empty_like(cq), torch.empty_like(ck), torch.empty_like(cv)
    cpu.varlen_bwd(cg, cq, ck, cv, out.float().contiguous(), cstats, cu, D ** -0.5, causal, 4321, 8765, p, cdq, cdk, cdv)
    for name, a, b in (("out", out, cout), ("dq", dq, cdq), ("dk", dk, cdk), ("dv", dv, cdv)):
        assert not torch.isnan(a).any(), f"{what}: NaN in {name}"
        if b.numel():
            assert _rel(a.float(), b) < TOL[dtype], f"{what}: {name} relative error {_rel(a.float(), b)}"
    assert stats.shape == (2, Hq, T) and stats.dtype == F32
    if T:
        assert (stats[0] - cstats[0]).abs().max() < 1e-3, what
        assert _rel(stats[1], cstats[1]) < 1e-4, what
    return out, stats, dq, dk, dv


# many short sequences, a few long ones (several 64-row tiles, partial tiles), empty ones at the start,
# in the middle and at the end, length 1
MIXED = [0, 3, 1, 0, 130, 2, 64, 65, 0, 1, 200, 5, 0]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_varlen_tile_mapping(emu, cpu, causal, p):
    _varlen_case(emu, cpu, MIXED, 2, 1, 32, 32, causal, p, F32)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("lengths", [[1], [37], [0, 1, 0], [9, 9, 9, 9], [64, 0, 64, 1]])
def test_varlen_lengths_and_dtypes(emu, cpu, dtype, lengths):
    """B = 1, length 1, all empty but one, equal lengths (no padding), whole tiles."""
    _varlen_case(emu, cpu, lengths, 2, 2, 64, 64, True, 0.1, dtype, cu_dtype=torch.int64)


@pytest.mark.parametrize("dims", [(32, 32), (64, 32), (80, 80), (128, 128), (3, 5)])
@pytest.mark.parametrize("pad", [4, 3])
def test_varlen_head_dims_gqa_and_load_paths(emu, cpu, dims, pad):
    """Every head-dim template, D != Dv, odd dims; grouped-query heads; rows 16-byte aligned (pad 4,
    float32: vector loads) or not (pad 3, bfloat16: scalar loads)."""
    _varlen_case(emu, cpu, [17, 0, 70, 2], 4, 2, *dims, True, 0.1, F32 if pad == 4 else BF16, pad=pad)


def test_varlen_results_do_not_depend_on_scheduling(emu, cpu):
    """Thread orders and 1 to 1000 blocks (1000: most blocks are surplus, find no tile and exit): the
    same bits."""
    args = ([5, 0, 70, 1, 33], 4, 2, 32, 32, True, 0.2, F32)
    ref = _varlen_case(emu, cpu, *args, order=0, grid=3)
    for order, grid in ((1, 1), (2, 1000), (3, 2), (5, 7)):
        got = _varlen_case(emu, cpu, *args, order=order, grid=grid)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), (order, grid)


def test_varlen_no_tokens(emu):
    for lengths in ([0], [0, 0]):
        q = torch.randn(0, 2, 32)
        out = torch.empty(0, 2, 32)
        st = emu.varlen_fwd(q, q, q, _cu(lengths), 1.0, False, 0, 0, 0.0, out)
        assert st.shape == (2, 2, 0)
        emu.varlen_bwd(q, q, q, q, out, st, _cu(lengths), 1.0, False, 0, 0, 0.0, q.clone(), q.clone(), q.clone())


@pytest.mark.parametrize("cu", [[0, 5, 3, 20], [-4, 2, 9, 40], [0, 20, 0, 20], [3, 3, 3, 3], [0, 40, 50, 60]])
def test_varlen_any_cu_seqlens_is_memory_safe(emu, cu):
    """cu_seqlens the kernels never validate (the CUDA ops do not read it on the host): decreasing,
    negative, overlapping, past T. Each sequence is clamped into [0, T]: no write outside the outputs,
    no error (the values are then meaningless)."""
    gen = torch.Generator().manual_seed(0)
    emu.set_order(0)
    emu.set_grid(3)
    _, _, _, guards = _varlen_run(emu, torch.tensor(cu, dtype=torch.int32), 20, 2, 1, 32, 32, True, 0.1, F32, 4, gen)
    for flat, inside, name in guards:
        assert torch.isnan(flat[~inside]).all(), f"cu={cu}: {name} written outside the tensor"


def test_varlen_bad_input_errors(emu):
    cu = _cu([3, 4])
    q = torch.randn(7, 2, 32)
    out = torch.empty(7, 2, 32)
    cases = [
        (lambda: emu.varlen_fwd(q.double(), q.double(), q.double(), cu, 1.0, False, 0, 0, 0.0, out.double()),
         "float32, float16 or bfloat16"),
        (lambda: emu.varlen_fwd(*(torch.randn(7, 2, 129) for _ in range(3)), cu, 1.0, False, 0, 0, 0.0,
                                torch.empty(7, 2, 129)), "head dims up to 128"),
        (lambda: emu.varlen_fwd(q, q, q, cu.float(), 1.0, False, 0, 0, 0.0, out), "cu_seqlens must be a 1-D int32"),
        (lambda: emu.varlen_fwd(q, q, q, cu, 1.0, False, 0, 0, 0.0, torch.empty(7, 2, 31)), "out must be"),
        (lambda: emu.varlen_bwd(q, q, q, q, out, torch.empty(2, 2, 7, dtype=torch.float64), cu, 1.0, False, 0, 0, 0.0,
                                q.clone(), q.clone(), q.clone()), "stats must be"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()
