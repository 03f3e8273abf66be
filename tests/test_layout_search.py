"""The exact layout search (passes/layout_search.py) on problems with known optimal answers, and
against brute force on random ones."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from conftest import tiny_bert_layer
from torch.fx.experimental.proxy_tensor import make_fx

import dmfx
from dmfx.passes import PassContext
from dmfx.passes.layout import COL, DROP, KEEP, ROW, build_problem, choose_layouts
from dmfx.passes.layout_search import INF, Infeasible, LayoutProblem, SearchTooWide, brute_force, solve

ORDERS = ["BLHD", "BHLD", "BHDL"]


def copy_cost(nbytes):
    """A consumer reading layout `have` when it wants `want` pays a copy (read + write)."""
    return lambda have, want=None: 0.0 if want is None or have == want else 2.0 * nbytes


def test_chain_is_a_shortest_path():
    """GEMM -> X -> kernel A -> Y -> kernel B -> Z -> GEMM. Each kernel reads in any order but costs
    more when its input and output orders differ (a strided transpose); the GEMMs want BLHD at the
    ends. The cheapest path keeps BLHD all along (cost 0); forcing Z to BHLD puts the one transpose
    where it is cheapest (kernel B, 3 units, not kernel A, 5)."""
    p = LayoutProblem()
    for v in "XYZ":
        p.var(v, ORDERS)
    p.add(["X"], lambda x: 0.0 if x == "BLHD" else 10.0, "gemm1 writes")
    p.add(["X", "Y"], lambda x, y: 0.0 if x == y else 5.0, "kernel A")
    p.add(["Y", "Z"], lambda y, z: 0.0 if y == z else 3.0, "kernel B")
    p.add(["Z"], lambda z: 0.0 if z == "BLHD" else 10.0, "gemm2 reads")
    s = solve(p)
    assert s.assignment == {"X": "BLHD", "Y": "BLHD", "Z": "BLHD"} and s.cost == 0.0
    p.add(["Z"], {("BHLD",): 0.0}, "an output that must be BHLD")
    s = solve(p)
    assert s.assignment == {"X": "BLHD", "Y": "BLHD", "Z": "BHLD"} and s.cost == 13.0


def test_shared_tensor_has_one_layout_or_pays_a_copy():
    """X is read by two ops that prefer different orders: one layout for X, and the consumer that
    disagrees pays its copy; the cheaper copy is chosen."""
    p = LayoutProblem()
    p.var("X", ORDERS)
    p.add(["X"], lambda x: 0.0 if x == "BLHD" else 4.0, "producer (native BLHD, else a copy of 4)")
    p.add(["X"], lambda x: 0.0 if x == "BHLD" else 7.0, "consumer 1 (copies 7 unless BHLD)")
    p.add(["X"], lambda x: 0.0 if x == "BLHD" else 2.0, "consumer 2 (copies 2 unless BLHD)")
    s = solve(p)
    # BLHD: 0 + 7 + 0 = 7; BHLD: 4 + 0 + 2 = 6; BHDL: 4 + 7 + 2 = 13
    assert s.assignment == {"X": "BHLD"} and s.cost == 6.0


def test_diamond_with_a_residual_edge():
    """A -> (B, C) -> D with a residual A -> D: a loop in the interaction graph, solved exactly."""
    p = LayoutProblem()
    for v in "ABCD":
        p.var(v, ["rm", "cm"])
    same = lambda a, b: 0.0 if a == b else 1.0  # noqa: E731
    p.add(["A", "B"], same)
    p.add(["A", "C"], same)
    p.add(["B", "D"], same)
    p.add(["C", "D"], lambda c, d: 0.0 if c != d else 1.5)  # C's op transposes for free
    p.add(["A", "D"], same, "residual")
    p.add(["A"], {("rm",): 0.0}, "graph input, fixed")
    s = solve(p)
    best, cost = brute_force(p)
    assert s.cost == cost == 1.0
    assert p.cost_of(s.assignment) == s.cost


@pytest.mark.parametrize("seed", range(25))
def test_random_problems_match_brute_force(seed):
    rng = random.Random(seed)
    p = LayoutProblem()
    names = [f"t{i}" for i in range(rng.randint(2, 7))]
    for n in names:
        p.var(n, ORDERS[: rng.randint(1, 3)])
    for _ in range(rng.randint(1, 10)):
        k = rng.randint(1, min(3, len(names)))
        vs = rng.sample(names, k)
        table = {}
        for combo in itertools.product(*(p.domains[v] for v in vs)):
            table[combo] = INF if rng.random() < 0.1 else float(rng.randint(0, 20))
        p.add(vs, table)
    try:
        best, cost = brute_force(p)
    except Infeasible:
        with pytest.raises(Infeasible):
            solve(p)
        return
    s = solve(p)
    assert s.cost == cost, (s.assignment, best)


def test_infeasible_and_too_wide_are_reported():
    p = LayoutProblem()
    p.var("X", ["a", "b"])
    p.add(["X"], {("a",): 0.0})
    p.add(["X"], {("b",): 0.0})
    with pytest.raises(Infeasible):
        solve(p)
    q = LayoutProblem()
    names = [f"v{i}" for i in range(12)]
    for n in names:
        q.var(n, ["a", "b", "c", "d"])
    q.add(names[:11], lambda *a: 0.0)  # one op reading 11 tensors: a 4**11 table
    with pytest.raises(SearchTooWide):
        solve(q, max_table=1 << 16)


def test_bad_problems_are_named():
    p = LayoutProblem()
    with pytest.raises(ValueError, match="no candidate"):
        p.var("X", [])
    p.var("X", ["a"])
    with pytest.raises(KeyError, match="unknown layout variable"):
        p.add(["X", "Y"], lambda x, y: 0.0, "gemm")


# ------------------------------------------------------------------ the layout pass on FX graphs


aten = torch.ops.aten


def _layout(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    ref = gm(*args)
    ctx = PassContext()
    p, model = build_problem(gm)
    choose_layouts(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    got = gm(*args)
    for r, g in zip(ref if isinstance(ref, (tuple, list)) else [ref], got if isinstance(got, (tuple, list)) else [got]):
        assert torch.allclose(r, g, rtol=1e-5, atol=1e-5)
        assert r.stride() == g.stride()  # graph outputs keep the strides PyTorch expects
    return gm, ctx, p, model


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def _choices(p):
    s = solve(p)
    return {n.name: c for n, c in s.assignment.items()}, s.cost


A, W = torch.randn(6, 8), torch.randn(8, 5)


def test_gemm_writes_the_transposed_layout_and_the_copy_goes():
    """c = a @ w; c.t().contiguous() * 2: the optimum writes c column-major ((wᵀ·aᵀ)ᵀ, free in BLAS),
    so its transpose is already contiguous and the copy is dropped: 0 bytes against the copy's 240."""
    def fn(a, w):
        return a.mm(w).t().contiguous() * 2

    gm0 = make_fx(fn, tracing_mode="fake")(A, W)
    p, model = build_problem(gm0)
    choice, cost = _choices(p)
    assert cost == 0.0 and sorted(choice.values()) == sorted([COL, DROP])
    traced = {n: (KEEP if d[0] == KEEP else ROW) for n, d in model.vars.items()}
    assert p.cost_of(traced) == 2 * 6 * 5 * 4
    gm, ctx, _, _ = _layout(fn, A, W)
    assert _count(gm, aten.clone.default) == 0 and ctx.fired == {"layout": 2}


def test_a_gemm_reads_a_transposed_operand_so_the_copy_goes():
    """The copy feeds a GEMM, which reads the transposed view through its flags: the copy is dropped
    and the first GEMM stays row-major (it is also a graph output)."""
    def fn(a, w, y):
        c = a.mm(w)
        return y.mm(c.t().contiguous()), c

    gm, ctx, p, model = _layout(fn, A, W, torch.randn(3, 5))
    assert _count(gm, aten.clone.default) == 0 and ctx.fired == {"layout": 1}
    assert _count(gm, aten.mm.default) == 2 and _count(gm, aten.t.default) == 1


def test_copy_kept_when_every_alternative_costs_more():
    """c is a graph output (its layout is fixed) and the copy feeds an element-wise op (its layout
    follows its input): the copy stays, and is listed as chosen knowingly, with its bytes."""
    def fn(a, w):
        c = a.mm(w)
        return c.t().contiguous() * 2, c

    gm, ctx, p, model = _layout(fn, A, W)
    assert _count(gm, aten.clone.default) == 1 and ctx.fired == {}
    (copy,) = ctx.copies
    assert copy["bytes"] == 2 * 6 * 5 * 4 and "not possible" in copy["why"]


def test_one_layout_for_a_tensor_read_twice():
    """Two copies of one GEMM's transpose: one choice (column-major) removes both."""
    def fn(a, w):
        c = a.mm(w)
        return c.t().contiguous() * 2, c.t().contiguous() + 1

    gm, ctx, p, model = _layout(fn, A, W)
    assert _count(gm, aten.clone.default) == 0 and ctx.fired == {"layout": 3}


def test_a_view_the_layout_cannot_express_keeps_the_copy():
    """Attention's eager head split: (x @ w).view(B, L, H, D).permute(0, 2, 1, 3).contiguous().view(B*H, L, D)
    feeding bmm. Without the copy the last view is impossible; column-major does not help: kept."""
    B, L, H, D = 2, 3, 4, 5

    def fn(x, w, k):
        q = x.mm(w).view(B, L, H, D).permute(0, 2, 1, 3).contiguous().view(B * H, L, D)
        return torch.bmm(q, k)

    gm, ctx, p, model = _layout(fn, torch.randn(B * L, 7), torch.randn(7, H * D), torch.randn(B * H, D, 6))
    assert _count(gm, aten.clone.default) == 1 and ctx.fired == {}
    assert len(ctx.copies) == 1


def test_dynamic_shapes_are_left_alone():
    def fn(a, w):
        return a.mm(w).t().contiguous() * 2

    gm = make_fx(fn, tracing_mode="symbolic")(A, W)
    ctx = PassContext()
    choose_layouts(gm, ctx)
    assert _count(gm, aten.clone.default) == 1 and ctx.fired == {}


def test_bert_inference_context_copy_is_dropped():
    """An HF BertLayer in inference (eager attention, no dropout) with attention as SDPA (forced: for
    fp32 the cost model now picks dmfx's kernel, which writes that layout by construction), whose
    CPU kernel writes the context as [B, L, H, D] in memory, so HF's transpose(1, 2).contiguous()
    copies nothing new: the search drops it (with a reshape after it, should SDPA pick another
    kernel at run time), and the output equals eager's."""
    layer = tiny_bert_layer()[0].eval()
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        out = torch.compile(layer, backend="dmfx", options={"fallback": False, "attention": "sdpa"})(x)[0]
        ref = layer(x)[0]
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    (rec,) = dmfx.records()
    assert rec.fired.get("layout") == 1 and [f for f, _ in rec.attention_forms.values()] == ["sdpa"]
    assert aten.clone.default not in [n.target for n in rec.inference_graph.graph.nodes]
    assert dmfx.records()[0].copies == []


# ------------------------------------------------------------------ forward and backward as one problem

M_, N_, K_ = 16, 8, 6


def _slice_and_transpose(a, w, g1, b1, g2, b2):
    """h = a @ w is read by a LayerNorm over the first K_ of its columns (a slice) and, transposed
    and copied, by a LayerNorm over its rows. Both LayerNorms run as dmfx kernels (they read rows),
    and each kernel's backward reads its input again."""
    h = a.mm(w)
    y1 = torch.nn.functional.layer_norm(h[:, :K_], (K_,), g1, b1)
    y2 = torch.nn.functional.layer_norm(h.t().contiguous(), (M_,), g2, b2)
    return y1, y2


def _slice_and_transpose_args():
    torch.manual_seed(0)
    return [torch.randn(M_, 5), torch.randn(5, N_), torch.randn(K_), torch.randn(K_), torch.randn(M_), torch.randn(M_)]


def test_joint_search_prices_the_backward_readers_of_saved_tensors(monkeypatch):
    """Known optimum. B = the bytes of h (512), S = those of its slice (384). Forward alone: keeping
    the copy costs 2B = 1024; writing h column-major drops it, and the first LayerNorm copies its
    now strided slice: 2S = 768, cheaper. With the backward in the problem, that LayerNorm's backward
    reads the strided slice again: 4S = 1536 against the copy's 1024. So inference (forward alone)
    drops the copy and training (the joint graph) keeps it; the joint problem's optimum is exact
    (brute force agrees) and the kept copy is listed with its graph."""
    from dmfx import backend

    joints = []
    real = backend.rewrite_joint

    def spy(joint, joint_inputs, opts, record):
        joints.append(backend._copy(joint))
        return real(joint, joint_inputs, opts, record)

    monkeypatch.setattr(backend, "rewrite_joint", spy)
    args = _slice_and_transpose_args()
    ref = _slice_and_transpose(*args)

    with torch.no_grad():
        out = torch.compile(_slice_and_transpose, backend="dmfx", options={"fallback": False})(*args)
    (inf,) = dmfx.records()
    assert inf.fired.get("layout") == 2 and inf.copies == []  # column-major GEMM, copy dropped
    assert aten.clone.default not in [n.target for n in inf.inference_graph.graph.nodes]
    for r, o in zip(ref, out):
        assert torch.allclose(r, o, rtol=1e-5, atol=1e-5)

    dmfx.reset()
    torch._dynamo.reset()
    leaves = [t.clone().requires_grad_() for t in args]
    eager = [t.clone().requires_grad_() for t in args]
    out = torch.compile(_slice_and_transpose, backend="dmfx", options={"fallback": False})(*leaves)
    sum((o * o).sum() for o in out).backward()
    sum((o * o).sum() for o in _slice_and_transpose(*eager)).backward()
    for a, b in zip(leaves, eager):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-5)
    (rec,) = dmfx.records()
    assert "layout" not in rec.fired
    assert [(c["graph"], c["node"], c["bytes"]) for c in rec.copies] == [("forward", "clone", 1024)]
    assert "without it would cost 512 more bytes" in rec.copies[0]["why"]  # 1536 - 1024
    assert aten.clone.default in [n.target for n in rec.forward_graph.graph.nodes]

    (joint,) = joints
    p, model = build_problem(joint)
    # the forward GEMM (the backward's GEMMs are variables of the same problem)
    (mm,) = [n for n in model.vars if model.vars[n][0] == ROW and all(a.op == "placeholder" for a in n.args)]
    (clone,) = [n for n in model.vars if model.vars[n][0] == KEEP]
    sol = solve(p)
    best, cost = brute_force(p)
    assert sol.cost == cost == 1024.0 and sol.assignment[mm] == ROW and sol.assignment[clone] == KEEP
    assert p.cost_of({**sol.assignment, mm: COL, clone: DROP}) == 4 * M_ * K_ * 4  # 1536: the forward's choice


def test_a_failing_joint_search_warns_and_keeps_the_traced_layouts(monkeypatch, caplog):
    import logging

    from dmfx.passes import layout

    def broken(joint, ctx):
        raise RuntimeError("joint boom")

    monkeypatch.setattr(layout, "choose_joint_layouts", broken)
    monkeypatch.setattr(dmfx.passes, "choose_joint_layouts", broken)
    args = [t.requires_grad_() for t in _slice_and_transpose_args()]
    with caplog.at_level(logging.WARNING, logger="dmfx"):
        out = torch.compile(_slice_and_transpose, backend="dmfx")(*args)
        sum(o.sum() for o in out).backward()
    assert "joint pass 'layout' failed" in caplog.text and "joint boom" in caplog.text
    (rec,) = dmfx.records()
    assert rec.fallback is None and rec.fired == {"layer_norm": 2}  # the fusions stand


def test_skipping_layout_skips_the_joint_search_too():
    args = [t.requires_grad_() for t in _slice_and_transpose_args()]
    out = torch.compile(_slice_and_transpose, backend="dmfx", options={"skip": ["layout"]})(*args)
    sum(o.sum() for o in out).backward()
    (rec,) = dmfx.records()
    assert "layout" not in rec.fired and rec.copies == []


# ------------------------------------------------------------------ measured prices (options={"tune": True})


def _transpose_copy(a, w):
    return a.mm(w).t().contiguous() * 2


def test_tuned_prices_follow_the_measurements(monkeypatch):
    """With tune, the search prices in measured seconds. Where the measurements say the GEMM written
    transposed costs 50 us more and the copy 10 us, it keeps the copy (the bytes model drops it:
    test_gemm_writes_the_transposed_layout_and_the_copy_goes) and says why in measured time; where
    they say the transposed GEMM is as fast, it drops the copy as the bytes model does."""
    from dmfx.passes import tuning

    def fake(slow_gemm):
        def measured_seconds(case, op, args, device):
            if case["op"] == "copy":
                return 10e-6
            transposed = args[0].stride(-1) != 1  # (Bᵀ·Aᵀ): the column-major output
            return 100e-6 + (50e-6 if transposed and slow_gemm else 0.0)
        return measured_seconds

    for slow, clones, fired in [(True, 1, {}), (False, 0, {"layout": 2})]:
        monkeypatch.setattr(tuning, "measured_seconds", fake(slow))
        gm = make_fx(_transpose_copy, tracing_mode="fake")(A, W)
        ctx = PassContext(tune=True, training=False)
        choose_layouts(gm, ctx)
        gm.recompile()
        assert _count(gm, aten.clone.default) == clones and ctx.fired == fired
        assert torch.allclose(gm(A, W), _transpose_copy(A, W))
        if slow:
            (copy,) = ctx.copies
            assert "40.0 us more (measured)" in copy["why"], copy["why"]


def test_tuned_prices_are_measured_once_and_cached(tmp_path, monkeypatch):
    """A real tune run: the copy and the GEMM cases are timed on this machine, kept in the tuning
    file, and read from it by a later process (here: the in-process memo cleared) without timing."""
    from dmfx.passes import tuning

    path = tmp_path / tuning.FILE
    monkeypatch.setattr(tuning, "_path", lambda: path)
    monkeypatch.setattr(tuning, "_measured", {})
    gm = make_fx(_transpose_copy, tracing_mode="fake")(A, W)
    choose_layouts(gm, PassContext(tune=True, training=False))
    gm.recompile()
    assert torch.allclose(gm(A, W), _transpose_copy(A, W))
    cases = [json.loads(k) for k in json.loads(path.read_text())]
    assert {c["op"] for c in cases} == {"copy", "aten.mm.default"}

    def no_timing(*args, **kwargs):
        raise AssertionError("a cached case was timed again")

    monkeypatch.setattr(tuning, "_time", no_timing)
    monkeypatch.setattr(tuning, "_measured", {})
    gm = make_fx(_transpose_copy, tracing_mode="fake")(A, W)
    choose_layouts(gm, PassContext(tune=True, training=False))


def test_a_failing_measurement_falls_back_to_bytes(monkeypatch):
    from dmfx.passes import tuning

    def broken(*args, **kwargs):
        raise RuntimeError("cannot time")

    monkeypatch.setattr(tuning, "measured_seconds", broken)
    gm = make_fx(_transpose_copy, tracing_mode="fake")(A, W)
    ctx = PassContext(tune=True, training=False)
    choose_layouts(gm, ctx)
    assert _count(gm, aten.clone.default) == 0 and ctx.fired == {"layout": 2}  # the bytes model's answer


def test_tuned_bert_layer_training_matches_eager(tmp_path, monkeypatch):
    """tune=True end to end on a training step (attention forms and the joint layout search timed):
    gradients equal eager's."""
    from conftest import compiled_step_matches_eager

    from dmfx.passes import tuning

    monkeypatch.setattr(tuning, "_path", lambda: tmp_path / tuning.FILE)
    layer, ref = tiny_bert_layer()
    compiled_step_matches_eager(layer.train(), ref.train(), {"tune": True, "fallback": False})
    (rec,) = dmfx.records()
    assert rec.fallback is None and not [m for m in rec.missed if "layout search not run" in m]
