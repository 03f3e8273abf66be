"""The backward-graph passes (passes/backward.py) and the op change they rely on.

* ``dmfx::norm_backward(..., grad_out2=g2)`` equals ``norm_backward(grad_out + g2, ...)`` for every
  variant (LayerNorm/RMSNorm, dropout, residual, bias, weight), passes opcheck, and names a bad
  ``grad_out2``.
* ``fold_gradient_adds`` and ``accumulate_into_gemm`` fire on hand-built backward graphs, leave the
  near-misses alone (a gradient read twice, a graph input, a broadcasting add, mixed dtypes), and the
  rewritten graphs compute the same values.
* End to end: a BertLayer's backward has no add left, its gradients equal eager's, and skipping the
  passes brings the adds back.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import dmfx
from conftest import compiled_step_matches_eager, tiny_bert_layer
from dmfx.cuda_ops import new_seed
from dmfx.passes import PassContext
from dmfx.passes.backward import accumulate_into_gemm, fold_gradient_adds, run_backward_pipeline

aten = torch.ops.aten
nb = torch.ops.dmfx.norm_backward
on_both_cpu_builds = pytest.mark.usefixtures("cpu_build")  # the op-level tests: conftest.cpu_build


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ------------------------------------------------------------------ the op: norm_backward(grad_out2)


def _norm_case(rms, dropout, residual, dtype=torch.float64):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 24, dtype=dtype)
    bias, w, nbias = (torch.randn(24, dtype=dtype) for _ in range(3))
    res = torch.randn(3, 5, 24, dtype=dtype) if residual else None
    seed = new_seed() if dropout else None
    p = 0.25 if dropout else 0.0
    out, _, mean, rstd = torch.ops.dmfx.bias_dropout_residual_norm(
        x, bias, res, w, None if rms else nbias, seed, p, 1e-5, rms, False)
    return x, bias, res, w, (None if rms else mean), rstd, seed, p


@on_both_cpu_builds
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_grad_out2_equals_the_sum(rms, dropout, residual):
    x, bias, res, w, mean, rstd, seed, p = _norm_case(rms, dropout, residual)
    g1, g2, gs = torch.randn_like(x), torch.randn_like(x), torch.randn_like(x)
    mask = [True, residual, True, not rms, True]
    want = nb(g1 + g2, gs, x, bias, res, w, mean, rstd, seed, p, rms, mask)
    got = nb(g1, gs, x, bias, res, w, mean, rstd, seed, p, rms, mask, grad_out2=g2)
    for name, a, b in zip(["dx", "dresidual", "dweight", "dnorm_bias", "dbias"], got, want):
        assert a.shape == b.shape, name
        if b.numel():
            assert rel_err(a, b) < 1e-12, name


@on_both_cpu_builds
@pytest.mark.parametrize("dropout", [False, True])
def test_dbias_without_bias_is_the_column_sum_of_dx(dropout):
    """The bias gradient is asked for although the bias stayed in the GEMM before the norm."""
    x, _, res, w, mean, rstd, seed, p = _norm_case(False, dropout, True)
    g = torch.randn_like(x)
    dx, _, _, _, db = nb(g, None, x, None, res, w, mean, rstd, seed, p, False, [True, False, False, False, True])
    assert db.shape == (24,) and rel_err(db, dx.sum((0, 1))) < 1e-12


@on_both_cpu_builds
def test_grad_out2_strided():
    """A non-contiguous second gradient (a transposed view) is read through its strides."""
    x, bias, res, w, mean, rstd, seed, p = _norm_case(False, False, True)
    g1 = torch.randn_like(x)
    g2 = torch.randn(3, 24, 5, dtype=x.dtype).transpose(1, 2)
    mask = [True, False, True, True, True]
    want = nb(g1 + g2, None, x, bias, res, w, mean, rstd, None, 0.0, False, mask)
    got = nb(g1, None, x, bias, res, w, mean, rstd, None, 0.0, False, mask, grad_out2=g2)
    for a, b in zip(got, want):
        if b.numel():
            assert rel_err(a, b) < 1e-12


@on_both_cpu_builds
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grad_out2_low_precision(dtype):
    """In bf16/fp16 the kernel adds the two gradients in float32 (eager rounds their sum to the low
    precision first): close to eager's answer."""
    x, bias, res, w, mean, rstd, seed, p = _norm_case(False, True, True, dtype)
    g1, g2 = torch.randn_like(x), torch.randn_like(x)
    mask = [True, True, True, True, True]
    want = nb(g1 + g2, None, x, bias, res, w, mean, rstd, seed, p, False, mask)
    got = nb(g1, None, x, bias, res, w, mean, rstd, seed, p, False, mask, grad_out2=g2)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        if b.numel():
            assert rel_err(a.float(), b.float()) < 3e-2


@on_both_cpu_builds
def test_grad_out2_opcheck():
    x, bias, res, w, mean, rstd, seed, p = _norm_case(False, True, True, torch.float32)
    g1, g2 = torch.randn_like(x), torch.randn_like(x)
    torch.library.opcheck(nb, (g1, None, x, bias, res, w, mean, rstd, seed, p, False, [True] * 5),
                          {"grad_out2": g2})


@on_both_cpu_builds
def test_grad_out2_bad_shape_is_named():
    x, bias, res, w, mean, rstd, seed, p = _norm_case(False, False, False)
    with pytest.raises(RuntimeError, match=r"norm_bwd: grad_out2 must have the shape of x"):
        nb(torch.randn_like(x), None, x, bias, None, w, mean, rstd, None, 0.0, False, [True] * 5,
           grad_out2=torch.randn(3, 5, 12, dtype=x.dtype))


# ------------------------------------------------------------------ the passes on hand-built graphs


def _trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def _run(gm, ctx_pass, *args):
    ref = gm(*args)
    ctx = PassContext()
    ctx_pass(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    return ref, gm(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args]), ctx


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _ln_saved(H=16, rows=(2, 6)):
    x = torch.randn(*rows, H)
    w, b = torch.randn(H), torch.randn(H)
    _, mean, rstd = torch.ops.dmfx.layer_norm(x, w, b, 1e-5)
    return x, w, mean, rstd


def test_fold_gradient_adds_fires():
    x, w, mean, rstd = _ln_saved()

    def f(g1, g2, x, w, mean, rstd):
        d = nb(g1 + g2, None, x, None, None, w, mean, rstd, None, 0.0, False, [True, False, True, True, False])
        return d[0], d[2], d[3]

    args = (torch.randn_like(x), torch.randn_like(x), x, w, mean, rstd)
    gm = _trace(f, *args)
    ref, got, ctx = _run(gm, fold_gradient_adds, *args)
    assert ctx.fired == {"fold_gradient_adds": 1}
    assert aten.add.Tensor not in _targets(gm)
    (n,) = [n for n in gm.graph.nodes if n.target is nb.default]
    assert n.kwargs.get("grad_out2") is not None
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-5


def test_fold_gradient_adds_leaves_near_misses():
    x, w, mean, rstd = _ln_saved()

    def read_twice(g1, g2, x, w, mean, rstd):  # the summed gradient is also an output
        s = g1 + g2
        return nb(s, None, x, None, None, w, mean, rstd, None, 0.0, False, [True, False, True, True, False])[0], s

    def broadcasting(g1, g2, x, w, mean, rstd):  # g2 is a row: the add broadcasts
        return nb(g1 + g2[0, :1], None, x, None, None, w, mean, rstd, None, 0.0, False, [True, False, True, True, False])[0]

    def scaled(g1, g2, x, w, mean, rstd):  # add with alpha
        return nb(torch.add(g1, g2, alpha=2.0), None, x, None, None, w, mean, rstd, None, 0.0, False,
                  [True, False, True, True, False])[0]

    args = (torch.randn_like(x), torch.randn_like(x), x, w, mean, rstd)
    for fn in (read_twice, broadcasting, scaled):
        gm = _trace(fn, *args)
        ref, got, ctx = _run(gm, fold_gradient_adds, *args)
        assert ctx.fired == {}, fn.__name__
        assert aten.add.Tensor in _targets(gm), fn.__name__
        assert len(ctx.missed) == 1, (fn.__name__, ctx.missed)


def test_accumulate_into_gemm_fires_and_chains():
    """Three GEMMs' dX added to a fresh gradient (unstacked Q, K, V): all three accumulate into it."""
    x, w, mean, rstd = _ln_saved()

    def f(g, x, w, mean, rstd, a1, a2, a3, w1, w2, w3):
        dres = nb(g, None, x, None, None, w, mean, rstd, None, 0.0, False, [True, False, False, False, False])[0]
        out = dres + (a1 @ w1.t()).view(2, 6, 16)
        out = out + (a2 @ w2.t()).view(2, 6, 16)
        return (a3 @ w3.t()).view(2, 6, 16) + out

    a = [torch.randn(12, 8) for _ in range(3)]
    ws = [torch.randn(16, 8) for _ in range(3)]
    args = (torch.randn_like(x), x, w, mean, rstd, *a, *ws)
    gm = _trace(f, *args)
    ref, got, ctx = _run(gm, accumulate_into_gemm, *args)
    assert ctx.fired == {"accumulate_into_gemm": 3}
    t = _targets(gm)
    assert aten.add.Tensor not in t and aten.mm.default not in t and t.count(aten.addmm_.default) == 3
    assert rel_err(got, ref) < 1e-5


def test_accumulate_into_gemm_leaves_near_misses():
    def graph_input(g, a, w):  # g is a graph input (a tangent or saved tensor): not ours to write
        return g + a @ w.t()

    def read_twice(g, a, w):  # the fresh buffer is also returned
        h = g * 2
        return h + a @ w.t(), h

    def mixed_dtype(g, a, w):  # the GEMM runs in another dtype than the gradient
        h = g * 2
        return h + (a.double() @ w.double().t()).float()

    def transposed(g, a, w):  # the fresh buffer is not contiguous
        h = (g * 2).t().contiguous().t()
        return h + a @ w.t()

    args = (torch.randn(6, 16), torch.randn(6, 8), torch.randn(16, 8))
    for fn in (graph_input, read_twice, mixed_dtype, transposed):
        gm = _trace(fn, *args)
        ref, got, ctx = _run(gm, accumulate_into_gemm, *args)
        assert ctx.fired == {}, fn.__name__
        assert aten.addmm_.default not in _targets(gm), fn.__name__
        for r, o in zip(ref if isinstance(ref, tuple) else (ref,), got if isinstance(got, tuple) else (got,)):
            assert rel_err(o, r) < 1e-5


def test_accumulate_into_gemm_never_writes_a_gemm_operand():
    """Regression (issue 15): a residual around one linear, LN(Linear(x) + x), gives the norm's
    dresidual as the linear's upstream gradient too: ``dres + dres @ W`` became ``addmm_(dres, dres,
    W)``, a BLAS call whose output aliases its operand (wrong input gradients on an AVX-512 CPU).
    Also through views, and through a view op returning a list (split) whose part is read later."""

    def own_operand(g, w):  # add(h, mm(h, w)): h is both the accumulator and the GEMM's left operand
        h = g * 2
        return h + h @ w

    def own_operand_viewed(g, w):  # the same through views, as AOTAutograd writes it
        h = (g * 2).view(2, 3, 16)
        return h + (h.view(6, 16) @ w).view(2, 3, 16)

    def right_operand(g, a):  # the accumulator is the GEMM's right operand
        h = g[:, :6].contiguous() * 2  # [6, 6]
        return h + a @ h

    def split_read_later(g, a, w):  # a part of the buffer (split: a list of views) is read after the add
        h = g * 2
        first, _ = h.split(3, 0)
        s = h + a @ w.t()
        return s, first * 3

    cases = [(own_operand, (torch.randn(6, 16), torch.randn(16, 16))),
             (own_operand_viewed, (torch.randn(6, 16), torch.randn(16, 16))),
             (right_operand, (torch.randn(6, 16), torch.randn(6, 6))),
             (split_read_later, (torch.randn(6, 16), torch.randn(6, 8), torch.randn(16, 8)))]
    for fn, args in cases:
        gm = _trace(fn, *args)
        ref, got, ctx = _run(gm, accumulate_into_gemm, *args)
        assert ctx.fired == {}, fn.__name__
        assert aten.addmm_.default not in _targets(gm), fn.__name__
        for r, o in zip(ref if isinstance(ref, tuple) else (ref,), got if isinstance(got, tuple) else (got,)):
            assert rel_err(o, r) < 1e-5


def test_backward_pipeline_keeps_values_on_a_traced_backward():
    """run_backward_pipeline on a whole traced graph: same values, graph lints."""
    x, w, mean, rstd = _ln_saved()

    def f(g1, g2, x, w, mean, rstd, a, wt):
        d = nb(g1 + g2, None, x, None, None, w, mean, rstd, None, 0.0, False, [True, False, True, True, False])
        return d[0] + (a @ wt.t()).view(2, 6, 16), d[2], d[3]

    args = (torch.randn_like(x), torch.randn_like(x), x, w, mean, rstd, torch.randn(12, 8), torch.randn(16, 8))
    gm = _trace(f, *args)
    ref = gm(*args)
    ctx = PassContext()
    run_backward_pipeline(gm, ctx)
    assert ctx.fired == {"fold_gradient_adds": 1, "accumulate_into_gemm": 1}
    for a, b in zip(gm(*args), ref):
        assert rel_err(a, b) < 1e-5


# ------------------------------------------------------------------ end to end


@pytest.mark.parametrize("stack", [True, False])
def test_bert_layer_backward_has_no_gradient_adds(stack):
    layer, ref = tiny_bert_layer()
    # (flash: the packed attention ops that QKV stacking needs; SDPA would leave three projections)
    compiled_step_matches_eager(layer, ref, {"fallback": False, "stack_qkv": stack, "attention": "flash"})
    (rec,) = dmfx.records()
    bw = _targets(rec.backward_graph)
    assert aten.add.Tensor not in bw, rec.backward_graph.code
    assert rec.fired.get("fold_gradient_adds") == 1
    assert rec.fired.get("qkv_attention", 0) == int(stack)
    assert rec.fired.get("accumulate_into_gemm") == (1 if stack else 3)
    # the Q/K/V bias gradients come out of the attention backward (one stacked, or three): no
    # reduction is left
    assert rec.fired.get("fold_bias_grads", 0) == (1 if stack else 3)
    sums = bw.count(aten.sum.dim_IntList)
    assert sums == 0, rec.backward_graph.code
    # the stacked weight is neither kept for the backward nor concatenated again there: dX reads the
    # three weights (unstack_dx)
    assert rec.fired.get("unstack_dx", 0) == int(stack)
    assert aten.cat.default not in bw
    saved = [n.meta["val"].shape for n in rec.backward_graph.graph.nodes if n.op == "placeholder"]
    assert not any(tuple(s) in {(96, 32), (32, 96)} for s in saved), saved


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("layout", ["rows", "cols"])
def test_unstack_dx_fires_and_keeps_values(accumulate, layout):
    """G · cat(Wq, Wk, Wv) (rows: cat of [out, in] weights along 0; cols: the transpose of a cat of
    [in, out] ones along 1) -> one GEMM per weight block, accumulating."""
    from dmfx.passes.backward import unstack_dx

    torch.manual_seed(0)
    ws = [torch.randn(8, 6) for _ in range(3)]
    G, acc = torch.randn(5, 24), torch.randn(5, 6)

    def f(G, acc, w0, w1, w2):
        W = torch.cat([w0, w1, w2], 0) if layout == "rows" else torch.cat([w0.t(), w1.t(), w2.t()], 1).t()
        return torch.addmm(acc, G, W) if accumulate else G @ W

    gm = _trace(f, G, acc, *ws)
    if accumulate:  # as accumulate_into_gemm leaves it: an in-place accumulation into a fresh buffer
        for n in gm.graph.nodes:
            if n.target is aten.addmm.default:
                n.target = aten.addmm_.default
    gm.recompile()
    ref = f(G, acc, *ws)
    ctx = PassContext()
    unstack_dx(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    got = gm(G, acc.clone(), *ws)
    assert ctx.fired == {"unstack_dx": 1}
    ts = _targets(gm)
    assert aten.cat.default not in ts
    assert ts.count(aten.addmm_.default) == (3 if accumulate else 2)
    assert rel_err(got, ref) < 1e-6


def test_unstack_dx_leaves_near_misses():
    """cat(ws, 1) read without a transpose: its blocks are column blocks, not what G's columns
    multiply; and a concatenation that another op reads too."""
    from dmfx.passes.backward import unstack_dx

    ws = [torch.randn(24, 4) for _ in range(3)]
    gm = _trace(lambda G, a, b, c: G @ torch.cat([a, b, c], 1), torch.randn(5, 24), *ws)
    _, _, ctx = _run(gm, unstack_dx, torch.randn(5, 24), *ws)
    assert not ctx.fired and aten.cat.default in _targets(gm)

    # a concatenation read elsewhere too stays: splitting the GEMM would not remove it
    ws = [torch.randn(8, 6) for _ in range(3)]

    def shared(G, a, b, c):
        W = torch.cat([a, b, c], 0)
        return G @ W, W.sum()

    gm = _trace(shared, torch.randn(5, 24), *ws)
    _, _, ctx = _run(gm, unstack_dx, torch.randn(5, 24), *ws)
    assert not ctx.fired and aten.mm.default in _targets(gm)


def test_skipping_the_backward_passes_keeps_the_adds():
    layer, _ = tiny_bert_layer()
    f = torch.compile(layer, backend="dmfx", options={"fallback": False, "stack_qkv": False,
                                                      "skip": ["fold_gradient_adds", "accumulate_into_gemm",
                                                               "fold_bias_grads"]})
    x = torch.randn(2, 9, 32, requires_grad=True)
    f(x)[0].sum().backward()
    (rec,) = dmfx.records()
    assert _targets(rec.backward_graph).count(aten.add.Tensor) == 4
    assert "fold_gradient_adds" not in rec.fired


def test_unknown_pass_name_lists_the_backward_passes():
    from dmfx.options import Options

    with pytest.raises(ValueError, match="fold_gradient_adds, fold_bias_grads, accumulate_into_gemm"):
        Options.from_user({"skip": ["nope"]})
    assert Options.from_user({"skip": "accumulate_into_gemm"}).skip == ("accumulate_into_gemm",)


def _qkv_case(B=2, L=5, H=2, D=4):
    qkv = torch.randn(B, L, 3 * H * D)
    seed = new_seed()
    out, stats = torch.ops.dmfx.qkv_flash_attention(qkv, H, None, 0.3, False, seed, 0.1)
    return torch.randn_like(out), qkv, stats, seed, H


def test_fold_bias_grads_fires_and_leaves_partial_sums():
    from dmfx.passes.backward import fold_bias_grads

    g, qkv, stats, seed, H = _qkv_case()
    B, L, F = qkv.shape
    op = torch.ops.dmfx.qkv_flash_attention_backward

    def rows(g, qkv, stats, seed):  # HF's bias gradient: the 2-D view summed over dim 0, keepdim
        d = op(g, qkv, H, stats, None, 0.3, False, seed, 0.1)[0]
        d2 = d.view(B * L, F)
        return d2.t().mm(torch.ones(B * L, 1)), d2.sum([0], keepdim=True).view(F)

    def batch_only(g, qkv, stats, seed):  # a sum over the batch alone is not a bias gradient
        d = op(g, qkv, H, stats, None, 0.3, False, seed, 0.1)[0]
        return d.sum([0])

    args = (g, qkv, stats, seed)
    gm = _trace(rows, *args)
    ref, got, ctx = _run(gm, fold_bias_grads, *args)
    assert ctx.fired == {"fold_bias_grads": 1} and aten.sum.dim_IntList not in _targets(gm)
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-5
    gm = _trace(batch_only, *args)
    ref, got, ctx = _run(gm, fold_bias_grads, *args)
    assert ctx.fired == {} and aten.sum.dim_IntList in _targets(gm)


@on_both_cpu_builds
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gqa", [False, True])
def test_flash_backward_head_bias_gradients(dtype, gqa):
    """flash_attention_backward(bias_grad=True) returns the bias gradients of the three projections
    ([B, H, L, D] views of [B, L, H*D]): the fused kernel's per-(batch, head) sums, or (bf16, grouped
    k/v) the same sums taken afterwards; dq, dk, dv are unchanged."""
    B, L, H, D = 2, 7, 4, 8
    Hk = 2 if gqa else H  # (grouped k/v: the sums are taken after the kernel)
    q = torch.randn(B, L, H, D, dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(B, L, Hk, D, dtype=dtype).transpose(1, 2) for _ in range(2))
    seed = new_seed()
    out, stats = torch.ops.dmfx.flash_attention(q, k, v, None, 0.3, True, seed, 0.2)
    g = torch.randn_like(out)
    op = torch.ops.dmfx.flash_attention_backward
    got = op(g, q, k, v, stats, None, 0.3, True, seed, 0.2, bias_grad=True)
    ref = op(g, q, k, v, stats, None, 0.3, True, seed, 0.2)
    tol = 1e-12 if dtype == torch.float64 else 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(3):
        assert torch.equal(got[i], ref[i]) and ref[3 + i].numel() == 0
        want = ref[i].double().sum(dim=(0, 2)).reshape(-1)
        scale = ref[i].double().abs().sum(dim=(0, 2)).max()  # (dk's sum is zero up to rounding)
        assert got[3 + i].shape == want.shape and got[3 + i].dtype == dtype
        assert ((got[3 + i].double() - want).abs().max() / scale).item() < tol
    torch.library.opcheck(op, (g, q, k, v, stats, None, 0.3, True, seed, 0.2), {"bias_grad": True})
