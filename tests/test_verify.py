"""The graph verifier (passes/verify.py) and the bounded records (dmfx.records()).

* Each invariant is caught on a hand-built graph: an in-place op writing the storage of its own
  operand (issue 15's ``addmm_(view(g), view(g), W)``), a written buffer read later through a view,
  through ``out=``, a written graph input, a written buffer that is a graph output, stale fake values
  (shape, dtype, strides; symbolic shapes too), a dropped fake value, a graph that does not lint;
  what the real passes make (accumulating GEMM chains) passes.
* The driver refreshes the values of nodes a pass rewired, so later passes see real strides.
* End to end through torch.compile: a broken pass injected into the forward pipeline, the backward
  pipeline or the joint graph's layout search is caught, warns and falls back (outputs and gradients
  equal eager) with fallback=True, and raises with fallback=False or under "strict"; clean BertLayer
  and LLaMA training steps pass, with the verifier run after every pass.
* dmfx.records() keeps at most MAX_RECORDS records, and only the GRAPHS_KEPT most recent hold their
  GraphModules: older ones are released with the compiled code.
"""

from __future__ import annotations

import copy
import gc
import logging
import re
import weakref

import pytest
import torch
from conftest import compiled_step_matches_eager, rel_err, tiny_bert_layer
from torch.fx.experimental.proxy_tensor import make_fx

import dmfx
from dmfx import backend, passes
from dmfx.passes import PassContext
from dmfx.passes.backward import BACKWARD_PIPELINE, accumulate_into_gemm
from dmfx.passes.fusion import record
from dmfx.passes.graph_utils import insert_call, run_passes, val
from dmfx.passes.verify import GraphVerificationError, GraphVerifier


@pytest.fixture(autouse=True)
def _compiled_afresh():
    """Every compile here runs the passes: the tests plant broken passes and count the verifier's
    checks, which no compile cache can see (its key is dmfx's source files). Under
    DMFX_COMPILER=inductor an earlier compile of the same graph would otherwise be served."""
    with torch.compiler.config.patch(force_disable_caches=True):
        yield

aten = torch.ops.aten


def _trace(fn, *args, mode="fake"):
    return make_fx(fn, tracing_mode=mode)(*args)


def _node(gm, target, k=0):
    return [n for n in gm.graph.nodes if n.target is target][k]


def _placeholder(gm, k):
    return [n for n in gm.graph.nodes if n.op == "placeholder"][k]


def _caught(gm, edit, match):
    """The verifier made from `gm` raises, naming the pass, after `edit` (a hand-made broken pass)."""
    verifier = GraphVerifier(gm)
    edit(gm)
    with pytest.raises(GraphVerificationError, match=match) as e:
        verifier.check(gm, "broken_pass")
    assert "after pass 'broken_pass'" in str(e.value)
    return e.value


def _accumulate(gm, add, acc, a, b, view_to=None):
    """What a broken accumulate_into_gemm would make: `add` becomes ``addmm_(acc, a, b)`` (viewed to
    `view_to`), with correct fake values."""
    g, ctx = gm.graph, PassContext()
    with g.inserting_before(add):
        summed = insert_call(g, ctx, aten.addmm_.default, (acc, a, b))
        out = insert_call(g, ctx, aten.view.default, (summed, view_to)) if view_to else summed
    add.replace_all_uses_with(out)
    g.erase_node(add)
    g.eliminate_dead_code()
    gm.recompile()


# ----------------------------------------------------------------------------- storage invariants


def test_inplace_op_writing_its_own_operand_is_caught():
    """Issue 15: LN(Linear(x) + x)'s backward, ``dres + view(view(dres) @ W)``, became
    ``addmm_(view(dres), view(dres), W)``: BLAS with its output aliasing an operand."""

    def f(g, w):
        h = (g * 2).view(2, 3, 16)
        return h + (h.view(6, 16) @ w).view(2, 3, 16)

    gm = _trace(f, torch.randn(6, 16), torch.randn(16, 16))

    def broken(gm):
        add, mm = _node(gm, aten.add.Tensor), _node(gm, aten.mm.default)
        with gm.graph.inserting_before(add):
            acc = insert_call(gm.graph, PassContext(), aten.view.default, (add.args[0], [6, 16]))
        _accumulate(gm, add, acc, mm.args[0], mm.args[1], [2, 3, 16])

    e = _caught(gm, broken, r"node addmm_\w* writes the storage of its input view_1 \(the storage of mul\), "
                            r"which it also reads \(through view_\w+\)")
    assert e.node.startswith("addmm_")


def test_accumulating_gemms_as_the_pass_makes_them_pass():
    """The real accumulate_into_gemm (a fresh buffer nothing reads afterwards, chained over three
    GEMMs) breaks no invariant."""

    def f(g, a1, a2, a3, w):
        h = g * 2
        return ((h + a1 @ w) + a2 @ w) + a3 @ w

    args = (torch.randn(6, 16), *(torch.randn(6, 8) for _ in range(3)), torch.randn(8, 16))
    gm = _trace(f, *args)
    ref = gm(*args)
    verifier = GraphVerifier(gm)
    ctx = PassContext()
    accumulate_into_gemm(gm, ctx)
    gm.recompile()
    assert ctx.fired == {"accumulate_into_gemm": 3}
    verifier.check(gm, "accumulate_into_gemm")
    assert rel_err(gm(*args), ref) < 1e-6


def test_written_buffer_read_later_through_a_view_is_caught():
    def f(g, a, w):
        h = g * 2
        s = h + a @ w.t()
        return s, h.view(-1) * 3

    gm = _trace(f, torch.randn(6, 16), torch.randn(6, 8), torch.randn(16, 8))

    def broken(gm):
        add, mm = _node(gm, aten.add.Tensor), _node(gm, aten.mm.default)
        _accumulate(gm, add, add.args[0], *mm.args)

    _caught(gm, broken, r"node mul_1 reads view \(the storage of mul\) after node addmm_\w* wrote its storage")


def test_out_argument_writing_a_buffer_read_later_is_caught():
    """``out=`` is a write too (a keyword argument the schema marks ``Tensor(a!)``)."""

    def f(g, a, w):
        h = g * 2
        y = a @ w.t()
        return y, h.sum()

    gm = _trace(f, torch.randn(6, 16), torch.randn(6, 8), torch.randn(16, 8))

    def broken(gm):  # mm writes into h (out=h) before the sum reads it
        mm, h = _node(gm, aten.mm.default), _node(gm, aten.mul.Tensor)
        with gm.graph.inserting_before(mm):
            out = insert_call(gm.graph, PassContext(), aten.mm.out, mm.args, {"out": h})
        mm.replace_all_uses_with(out)
        gm.graph.erase_node(mm)

    _caught(gm, broken, r"node sum_1 reads mul after node mm_out wrote its storage")


def test_written_graph_input_is_caught():
    def f(g, a, w):
        return g + a @ w.t()

    gm = _trace(f, torch.randn(6, 16), torch.randn(6, 8), torch.randn(16, 8))

    def broken(gm):
        add, mm = _node(gm, aten.add.Tensor), _node(gm, aten.mm.default)
        _accumulate(gm, add, add.args[0], *mm.args)

    _caught(gm, broken, r"node addmm_\w* writes graph input g_1, which the caller sees")


def test_input_written_by_the_given_graph_stays_allowed():
    """A graph traced with an input mutation may keep it; writing another input is still caught."""

    def f(g, h):
        g.add_(1)
        return g * h

    gm = _trace(f, torch.randn(4), torch.randn(4))
    verifier = GraphVerifier(gm)
    verifier.check(gm, "a_pass_that_changes_nothing")

    def broken(gm):
        mul = _node(gm, aten.mul.Tensor)
        with gm.graph.inserting_before(mul):
            insert_call(gm.graph, PassContext(), aten.add_.Tensor, (_placeholder(gm, 1), 1))

    broken(gm)
    with pytest.raises(GraphVerificationError, match=r"node add_\w* writes graph input h_1"):
        verifier.check(gm, "broken_pass")


def test_written_buffer_that_is_a_graph_output_is_caught():
    def f(g, a, w):
        h = g * 2
        return h + a @ w.t(), h

    gm = _trace(f, torch.randn(6, 16), torch.randn(6, 8), torch.randn(16, 8))

    def broken(gm):
        add, mm = _node(gm, aten.add.Tensor), _node(gm, aten.mm.default)
        _accumulate(gm, add, add.args[0], *mm.args)

    _caught(gm, broken, r"graph output mul holds the value from before node addmm_\w* wrote its storage")


def test_written_part_of_a_split_read_later_is_caught():
    """getitem of a list of views (split) is a view of the buffer."""

    def f(g, a, w):
        h = g * 2
        first, _ = h.split(3, 0)
        return h + a @ w.t(), first * 3

    gm = _trace(f, torch.randn(6, 16), torch.randn(6, 8), torch.randn(16, 8))

    def broken(gm):
        add, mm = _node(gm, aten.add.Tensor), _node(gm, aten.mm.default)
        _accumulate(gm, add, add.args[0], *mm.args)

    _caught(gm, broken, r"node mul_1 reads getitem \(the storage of mul\) after node addmm_\w* wrote its storage")


# --------------------------------------------------------------------------------- fake values


def _relu_graph(mode="fake"):
    args = (torch.randn(6, 8), torch.randn(8, 4))
    return _trace(lambda x, w: (x @ w).relu() * 2, *args, mode=mode), args


def _set_val(target, make):
    def edit(gm):
        n = _node(gm, target)
        n.meta["val"] = make(n.meta["val"])

    return edit


def test_stale_shape_is_caught():
    gm, _ = _relu_graph()
    _caught(gm, _set_val(aten.relu.default, lambda v: v[:3]),
            r"node relu's fake value is stale: meta\['val'\] has shape \(3, 4\) where running it gives \(6, 4\)")


def test_stale_dtype_is_caught():
    gm, _ = _relu_graph()
    _caught(gm, _set_val(aten.relu.default, lambda v: v.double()),
            r"node relu's fake value is stale: meta\['val'\] has dtype torch.float64 where running it gives torch.float32")


def test_stale_strides_are_caught():
    """A GEMM output marked column-major (as if the layout search had written it transposed) while
    the op writes it row-major."""
    gm, _ = _relu_graph()
    _caught(gm, _set_val(aten.mm.default, lambda v: v.t().contiguous().t()),
            r"node mm's fake value is stale: meta\['val'\] has strides \(1, 6\) where running it gives \(4, 1\)")


def test_stale_strides_under_symbolic_shapes_are_caught_without_guards():
    gm, _ = _relu_graph(mode="symbolic")
    shape_env = _node(gm, aten.mm.default).meta["val"].fake_mode.shape_env
    guards = len(shape_env.guards)
    verifier = GraphVerifier(gm)
    verifier.check(gm, "a_pass_that_changes_nothing")
    _set_val(aten.mm.default, lambda v: v.t().contiguous().t())(gm)
    with pytest.raises(GraphVerificationError, match=r"node mm's fake value is stale: meta\['val'\] has strides"):
        verifier.check(gm, "broken_pass")
    assert len(shape_env.guards) == guards  # the verifier adds no guard to the compiled program


def test_dropped_fake_value_is_caught():
    def broken(gm):  # a new node without meta["val"]
        relu = _node(gm, aten.relu.default)
        with gm.graph.inserting_after(relu):
            neg = gm.graph.call_function(aten.neg.default, (relu,))
        relu.replace_all_uses_with(neg, delete_user_cb=lambda u: u is not neg)

    gm, _ = _relu_graph()
    _caught(gm, broken, r"node neg\w* \(neg.default\) has no fake value")


def test_a_graph_that_does_not_lint_is_caught():
    def broken(gm):  # the relu moved before the GEMM it reads
        _node(gm, aten.mm.default).prepend(_node(gm, aten.relu.default))

    gm, _ = _relu_graph()
    _caught(gm, broken, r"the graph does not lint")


def test_the_driver_refreshes_nodes_a_pass_rewired():
    """A pass that replaces a producer by one with other strides (the GEMM written column-major,
    its own nodes' values right) leaves the readers' values to run_passes, which re-derives them:
    the next pass sees the strides that will exist, and the verifier finds nothing."""

    def transposed_gemm(gm, ctx):
        mm = _node(gm, aten.mm.default)
        a, b = mm.args
        g = gm.graph
        with g.inserting_before(mm):
            tb = insert_call(g, ctx, aten.t.default, (b,))
            ta = insert_call(g, ctx, aten.t.default, (a,))
            out = insert_call(g, ctx, aten.t.default, (insert_call(g, ctx, aten.mm.default, (tb, ta)),))
        mm.replace_all_uses_with(out)
        g.erase_node(mm)

    seen = {}

    def next_pass(gm, ctx):
        seen["relu"] = _node(gm, aten.relu.default).meta["val"].stride()

    gm, args = _relu_graph()
    ref = gm(*args)
    run_passes(gm, PassContext(), {"transposed_gemm": transposed_gemm, "next": next_pass}, verify="strict")
    assert seen["relu"] == (1, 6)
    gm.recompile()
    assert rel_err(gm(*args), ref) < 1e-6


# ---------------------------------------------------------------------------- end to end


class Block(torch.nn.Module):
    """LN(Linear(x) + x): the norm's input gradient is also the linear's upstream gradient."""

    def __init__(self, H=32):
        super().__init__()
        self.lin = torch.nn.Linear(H, H)
        self.ln = torch.nn.LayerNorm(H)

    def forward(self, x):
        return self.ln(self.lin(x) + x)


def accumulate_into_own_operand(gm, ctx):
    """The bug of issue 15 as a pass: ``add(g, view(mm(view(g), w)))`` becomes
    ``view(addmm_(view(g), view(g), w))`` (accumulate_into_gemm without its operand check)."""
    g = gm.graph
    for add in list(g.nodes):
        if add.target is not aten.add.Tensor:
            continue
        acc, other = add.args
        if not (isinstance(other, torch.fx.Node) and other.target is aten.view.default
                and other.args[0].target is aten.mm.default):
            continue
        a, w = other.args[0].args
        if not (a.target is aten.view.default and a.args[0] is acc):
            continue
        with g.inserting_before(add):
            acc2d = insert_call(g, ctx, aten.view.default, (acc, list(val(a).shape)))
        record(ctx, "accumulate_into_gemm", [add])
        _accumulate(gm, add, acc2d, a, w, other.args[1])


def _step(options, shape=(2, 5, 32)):
    """One training step of Block compiled with `options` against eager: (compiled, eager) output and
    input and parameter gradients."""
    torch.manual_seed(0)
    m = Block()
    ref = copy.deepcopy(m)
    x = torch.randn(*shape, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    R = torch.randn(*shape)
    out = torch.compile(m, backend="dmfx", options=options)(x)
    (out * R).sum().backward()
    exp = ref(xr)
    (exp * R).sum().backward()
    assert rel_err(out, exp) < 1e-5
    assert rel_err(x.grad, xr.grad) < 1e-5
    for p, q in zip(m.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-5


def test_the_broken_backward_pass_is_caught_and_falls_back(monkeypatch, caplog):
    monkeypatch.setenv("DMFX_VERIFY", "0")
    monkeypatch.setitem(BACKWARD_PIPELINE, "accumulate_into_gemm", accumulate_into_own_operand)
    with caplog.at_level(logging.WARNING, logger="dmfx"):
        _step({"verify": True})
    assert "backward pass 'accumulate_into_gemm' failed" in caplog.text
    assert re.search(r"node addmm_\w* writes the storage of its input view_\w* \(the storage of getitem\w*\), "
                     r"which it also reads", caplog.text), caplog.text
    assert "accumulate_into_gemm" not in dmfx.records()[-1].fired  # (the backward as AOTAutograd derived it)


def test_without_the_verifier_the_broken_pass_runs(monkeypatch):
    """(So the test above shows the verifier's work: without it the broken pass fires and the
    backward runs BLAS with an output aliasing its operand, undefined: wrong gradients on AVX-512.)"""
    monkeypatch.setenv("DMFX_VERIFY", "0")
    monkeypatch.setitem(BACKWARD_PIPELINE, "accumulate_into_gemm", accumulate_into_own_operand)
    torch.compile(Block(), backend="dmfx")(torch.randn(2, 5, 32, requires_grad=True)).sum().backward()
    rec = dmfx.records()[-1]
    assert rec.fired.get("accumulate_into_gemm") == 1
    (acc, a, _) = _node(rec.backward_graph, aten.addmm_.default).args
    assert acc.args[0] is a.args[0]  # addmm_(view(g), view(g), W)


@pytest.mark.parametrize("how", ["fallback=False", "strict"])
def test_the_broken_backward_pass_raises(monkeypatch, how):
    monkeypatch.setenv("DMFX_VERIFY", "0")
    monkeypatch.setitem(BACKWARD_PIPELINE, "accumulate_into_gemm", accumulate_into_own_operand)
    options = {"verify": True, "fallback": False} if how == "fallback=False" else {"verify": "strict"}
    with pytest.raises(Exception, match=r"after pass 'accumulate_into_gemm': node addmm_\w* writes the storage"):
        _step(options)


def test_strict_from_the_environment_raises_under_fallback(monkeypatch):
    monkeypatch.setenv("DMFX_VERIFY", "strict")
    monkeypatch.setitem(BACKWARD_PIPELINE, "accumulate_into_gemm", accumulate_into_own_operand)
    with pytest.raises(Exception, match=r"dmfx graph verifier: after pass 'accumulate_into_gemm'"):
        _step({})


def _raising_in_the_backward_compile(monkeypatch):
    """A failure in dmfx's compile of the backward graph outside its passes (which fall back on their own):
    the step that carries the forward's fusions onto the backward graph raises."""
    from dmfx.passes import fusion

    def broken(forward, backward):
        raise RuntimeError("made up for the test")

    monkeypatch.setattr(fusion, "carry_to_backward", broken)
    monkeypatch.setattr(backend, "_warned", set())  # (each test sees its warning)


@pytest.mark.parametrize("compiler", ["inductor", "fx"])
def test_a_backward_that_fails_to_compile_runs_as_derived(monkeypatch, caplog, compiler):
    """The backward compiles at the first backward(), after the forward ran dmfx's forward graph, so it
    cannot go back to PyTorch whole: with fallback on it runs as AOTAutograd derived it (the graph the
    forward's saved values and dmfx's ops' derivatives call for), compiled by the chosen compiler
    (Inductor, or FX), with eager's gradients; the record and the log say so."""
    from dmfx import inductor

    _raising_in_the_backward_compile(monkeypatch)
    compiled_by_inductor = []
    compile_graph = inductor.compile_graph
    monkeypatch.setattr(inductor, "compile_graph",
                        lambda gm, inputs, kind, *a, **k: compiled_by_inductor.append(kind) or compile_graph(gm, inputs, kind, *a, **k))
    with caplog.at_level(logging.WARNING, logger="dmfx"):
        _step({"compiler": compiler, "cache": False, "fuse": "all"})
    how = {"inductor": "by Inductor", "fx": "as an FX GraphModule"}[compiler]
    assert "the backward of graph" in caplog.text and "made up for the test" in caplog.text, caplog.text
    assert f"AOTAutograd derived it, {how}" in caplog.text, caplog.text
    rec = dmfx.records()[-1]
    assert rec.fallback is None and rec.fired, rec  # (the forward is dmfx's)
    assert any(f"the backward graph failed to compile (RuntimeError); compiled it as AOTAutograd derived it, {how}" in m
               for m in rec.missed), rec.missed
    assert rec.compiled.get("backward") and rec.backward_graph is not None
    assert compiled_by_inductor == (["forward", "backward"] if compiler == "inductor" else []), compiled_by_inductor
    assert rec.compiler == compiler


def test_a_backward_that_fails_to_compile_raises_without_the_fallback(monkeypatch):
    _raising_in_the_backward_compile(monkeypatch)
    with pytest.raises(Exception, match="made up for the test"):
        _step({"cache": False, "fuse": "all", "fallback": False})


def _wrong_gemm_strides(gm, ctx):
    """A broken forward pass: marks the first GEMM's output column-major, which the op does not write."""
    for n in gm.graph.nodes:
        if n.target in (aten.mm.default, aten.addmm.default):
            n.meta["val"] = n.meta["val"].t().contiguous().t()
            return


def test_a_stale_value_from_a_forward_pass_falls_back(monkeypatch, caplog):
    monkeypatch.setenv("DMFX_VERIFY", "1")
    monkeypatch.setitem(passes.PIPELINE, "dropout", _wrong_gemm_strides)
    with caplog.at_level(logging.WARNING, logger="dmfx"):
        _step({})
    assert "pass 'dropout' failed" in caplog.text and "fake value is stale" in caplog.text
    assert dmfx.records()[-1].fallback.startswith("pass dropout failed: GraphVerificationError")


def test_a_broken_joint_layout_search_falls_back_or_raises(monkeypatch, caplog):
    monkeypatch.setenv("DMFX_VERIFY", "0")
    monkeypatch.setattr(passes, "choose_joint_layouts", _wrong_gemm_strides)
    with caplog.at_level(logging.WARNING, logger="dmfx"):
        _step({"verify": True})
    assert "joint pass 'layout' failed" in caplog.text and "fake value is stale" in caplog.text
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"after pass 'layout': node (mm|addmm)\w*'s fake value is stale"):
        _step({"verify": "strict"})


def _count_checks(monkeypatch):
    checked: list[str] = []
    check = GraphVerifier.check

    def counting(self, gm, after):
        checked.append(after)
        check(self, gm, after)

    monkeypatch.setattr(GraphVerifier, "check", counting)
    return checked


def test_clean_bert_layer_step_passes_after_every_pass(monkeypatch):
    checked = _count_checks(monkeypatch)
    layer, ref = tiny_bert_layer()
    compiled_step_matches_eager(layer, ref, {"verify": "strict", "fallback": False})
    rec = dmfx.records()[-1]
    assert rec.fallback is None and rec.fired.get("accumulate_into_gemm")
    # the lowering, the forward pipeline, the joint graph's layout search, the backward pipeline: every pass
    assert checked == [*passes.LOWERING, *passes.PIPELINE, "reshape_fused_views", "layout", *BACKWARD_PIPELINE,
                       "reshape_fused_views"]


def test_clean_llama_step_passes(monkeypatch):
    transformers = pytest.importorskip("transformers")
    checked = _count_checks(monkeypatch)
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, num_hidden_layers=1, vocab_size=100)
    cfg._attn_implementation = "eager"
    m = transformers.LlamaModel(cfg).train()
    ref = copy.deepcopy(m)
    ids = torch.randint(0, 100, (2, 12))
    out = torch.compile(m, backend="dmfx", options={"verify": "strict", "fallback": False})(
        input_ids=ids, use_cache=False).last_hidden_state
    exp = ref(input_ids=ids, use_cache=False).last_hidden_state
    R = torch.randn_like(exp)
    (out * R).sum().backward()
    (exp * R).sum().backward()
    assert rel_err(out, exp) < 1e-5
    scale = torch.cat([q.grad.flatten() for q in ref.parameters() if q.grad is not None])
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert rel_err(p.grad, q.grad, scale) < 1e-5, name
    fired = {k for r in dmfx.records() for k in r.fired}
    assert {"rope", "glu", "attention", "accumulate_into_gemm"} <= fired, fired
    assert "rope" in checked and "unstack_dx" in checked and "layout" in checked


def test_verify_option_is_checked():
    with pytest.raises(ValueError, match=r"option 'verify' must be False, True or 'strict'"):
        dmfx.Options.from_user({"verify": "yes"})


# ---------------------------------------------------------------------------- records


def test_records_are_bounded_and_old_graphs_released(monkeypatch):
    monkeypatch.setattr(backend, "MAX_RECORDS", 3)
    monkeypatch.setattr(backend, "GRAPHS_KEPT", 1)
    compiled, first_graph = [], None
    for k in range(5):
        m = torch.nn.Sequential(torch.nn.Linear(8 + k, 8), torch.nn.LayerNorm(8))
        f = torch.compile(m, backend="dmfx")
        with torch.no_grad():
            f(torch.randn(2, 8 + k))
        compiled.append(f)
        if k == 0:
            first_graph = weakref.ref(dmfx.records()[-1].inference_graph)
    recs = dmfx.records()
    assert len(recs) == 3 and [r.graph_id for r in recs] == sorted(r.graph_id for r in recs)
    assert all(r.fired for r in recs)  # (older records keep their counts)
    # older records' graphs live while their compiled code does (weak references)
    assert all(r.inference_graph is not None for r in recs)
    assert not recs[0]._holds_graphs and recs[-1]._holds_graphs
    del compiled, f, m
    torch._dynamo.reset()
    gc.collect()
    assert first_graph() is None  # dropped from the records and released
    assert recs[0].inference_graph is None and recs[1].inference_graph is None
    assert recs[-1].inference_graph is not None  # the most recent keeps its graph
    assert "graph" in recs[0].summary()


def test_explain_reads_its_graphs_from_bounded_records(monkeypatch):
    """explain finds the record of what it compiled in a full list, and reads the graphs of a record
    that no longer holds them (its compiled code does)."""
    monkeypatch.setattr(backend, "MAX_RECORDS", 1)
    monkeypatch.setattr(backend, "GRAPHS_KEPT", 0)
    torch.compile(torch.nn.Linear(4, 4), backend="dmfx")(torch.randn(2, 4))  # (the list is full)
    layer, _ = tiny_bert_layer()
    report = dmfx.explain(layer, torch.randn(2, 5, 32))
    assert report.coverage.fused > 0, report
