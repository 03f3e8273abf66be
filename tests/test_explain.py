"""dmfx.explain: the cost model on hand-built graphs, classification, coverage, the static count against
an independent run-time count on a HF BertLayer, JSON round-trip, the CLI; dmfx.observability."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import dmfx
from dmfx.explain import (
    CONTRACTION,
    ELEMENTWISE,
    FUSED,
    LAYOUT,
    NORMALIZATION,
    OTHER,
    VIEW,
    Report,
    classify,
    coverage,
    explain,
    graph_rows,
    op_cost,
    peak_memory,
    runtime_bytes,
    tensor_bytes,
    totals,
)

aten = torch.ops.aten
REPO = Path(__file__).resolve().parents[1]
transformers = pytest.importorskip("transformers")


def rows_by_op(gm):
    out = {}
    for r in graph_rows(gm, "g", "after"):
        out.setdefault(r["op"], []).append(r)
    return out


# ------------------------------------------------------------------ cost model on hand-built graphs


def test_mm_flop_and_bytes():
    M, K, N = 7, 33, 5
    gm = make_fx(lambda a, b: torch.mm(a, b), tracing_mode="fake")(torch.randn(M, K), torch.randn(K, N))
    (r,) = rows_by_op(gm)["aten::mm"]
    assert r["class"] == CONTRACTION
    assert r["flop"] == 2 * M * K * N
    assert r["bytes_read"] == 4 * (M * K + K * N)
    assert r["bytes_written"] == 4 * M * N
    assert r["intensity"] == pytest.approx(2 * M * K * N / (4 * (M * K + K * N + M * N)), rel=1e-3)


def test_linear_cross_entropy_costs_its_gemms_and_its_chunk_buffers():
    N, H, V = 12, 8, 50
    h, w, t = torch.randn(N, H), torch.randn(V, H), torch.randint(0, V, (N,))
    op, bwd = torch.ops.dmfx.linear_cross_entropy.default, torch.ops.dmfx.linear_cross_entropy_backward.default
    gemm, logits = 2 * N * V * H, 4 * N * V
    args = (h, w, None, t, -100, 0.0, 1, 4)
    plain, with_grads = op_cost(op, args, {}, op(*args)), op_cost(op, (*args, [True, True, False]), {}, None)
    assert plain.cls == FUSED and plain.flop == gemm and with_grads.flop == 3 * gemm
    args_bytes = 4 * (N * H + V * H) + 8 * N
    assert plain.bytes == args_bytes + tensor_bytes(op(*args)[0]) + 4 * N * 2 + 2 * logits
    lse = op(*args)[1]
    scale = op_cost(bwd, (torch.ones(()), h, w, None, t, lse, -100, 0.0, 1, 4, [True, True, False], h, w), {}, None)
    redo = op_cost(bwd, (torch.ones(()), h, w, None, t, lse, -100, 0.0, 1, 4, [True, True, False]), {}, None)
    assert scale.flop == 0 and redo.flop == 3 * gemm and redo.bytes - scale.bytes == 5 * logits


def test_varlen_attention_costs_the_pairs_of_each_sequence():
    """Option unpad's attention: its GEMMs over each sequence's own query-key pairs (sum of L_b^2),
    read from cu_seqlens where it holds values, estimated from T and B in a graph's fake values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    T, H, D = 14, 4, 8
    cu = torch.tensor([0, 2, 11, 14], dtype=torch.int32)
    q, k, v = (torch.randn(T, H, D) for _ in range(3))
    fwd, bwd = torch.ops.dmfx.varlen_attention.default, torch.ops.dmfx.varlen_attention_backward.default
    out, stats = fwd(q, k, v, cu, D ** -0.5, False, None, 0.0)
    pairs = 2 * 2 + 9 * 9 + 3 * 3
    gemm = 2 * H * pairs * (D + D)
    c = op_cost(fwd, (q, k, v, cu, D ** -0.5, False, None, 0.0), {}, (out, stats))
    assert c.cls == FUSED and c.flop == gemm and c.note == ""
    b = op_cost(bwd, (out, q, k, v, out, stats, cu, D ** -0.5, False, None, 0.0), {}, (q, k, v))
    assert b.flop == 2 * gemm + 2 * H * pairs * D
    qkv = torch.randn(T, 3 * H * D)
    assert op_cost(torch.ops.dmfx.qkv_varlen_attention.default, (qkv, H, cu, 1.0, False, None, 0.0), {}, None).flop == gemm
    with FakeTensorMode() as mode:
        fq, fk, fv, fcu = (mode.from_tensor(t) for t in (q, k, v, cu))
        est = op_cost(fwd, (fq, fk, fv, fcu, 1.0, False, None, 0.0), {}, None)
    assert est.flop == 2 * H * (T * T // 3) * (D + D) and "estimated" in est.note


def test_layer_norm_bytes():
    R, H = 9, 17

    def f(x, w, b):
        return aten.native_layer_norm(x, [H], w, b, 1e-5)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(R, H), torch.randn(H), torch.randn(H))
    (r,) = rows_by_op(gm)["aten::native_layer_norm"]
    assert r["class"] == NORMALIZATION
    assert r["bytes_read"] == 4 * (R * H + 2 * H)
    assert r["bytes_written"] == 4 * (R * H + 2 * R)  # out + mean + rstd ([R, 1] each)


def test_view_chain_moves_no_bytes_but_a_contiguous_copy_does():
    def f(x):
        v = x.view(2, 3, 4, 5).permute(0, 2, 3, 1).transpose(1, 2).unsqueeze(0).squeeze(0)
        return v.contiguous().view(-1), x[1:].select(0, 0).t()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(6, 20))
    rows = graph_rows(gm, "g", "after")
    views = [r for r in rows if r["class"] == VIEW]
    assert {r["op"] for r in views} >= {"aten::view", "aten::permute", "aten::transpose", "aten::slice", "aten::select", "aten::t"}
    assert all(r["bytes_read"] == r["bytes_written"] == 0 and "no data moved" in r["note"] for r in views)
    (copy,) = [r for r in rows if r["class"] != VIEW]
    assert copy["class"] == LAYOUT and copy["bytes_read"] == copy["bytes_written"] == 4 * 120
    t = totals(rows)
    assert t[VIEW]["kernels"] == 0 and t[VIEW]["bytes"] == 0 and t[LAYOUT]["kernels"] == 1
    assert sum(c["bytes_pct"] for c in t.values()) == pytest.approx(100.0)


def test_expanded_tensor_is_read_once_and_reshape_copies_only_when_it_must():
    b = torch.randn(16)
    assert tensor_bytes(b.expand(8, 16)) == 4 * 16
    assert tensor_bytes(torch.randn(4, 5).t()) == 4 * 20
    assert tensor_bytes(torch.randn(0, 5)) == 0
    x = torch.randn(4, 6).t()  # not viewable as [24]
    out = x.reshape(24)
    assert classify(aten.reshape.default, (x,), out) == LAYOUT
    assert op_cost(aten.reshape.default, (x,), {}, out).bytes == 2 * 4 * 24
    y = torch.randn(4, 6)
    assert classify(aten.reshape.default, (y,), y.reshape(24)) == VIEW


@pytest.mark.parametrize(
    "op, cls",
    [
        (aten.mm.default, CONTRACTION), (aten.addmm.default, CONTRACTION), (aten.bmm.default, CONTRACTION),
        (aten.native_layer_norm.default, NORMALIZATION), (aten._softmax.default, NORMALIZATION),
        (aten._softmax_backward_data.default, NORMALIZATION), (aten.sum.dim_IntList, NORMALIZATION),
        (aten.gelu.default, ELEMENTWISE), (aten.add.Tensor, ELEMENTWISE), (aten.native_dropout.default, ELEMENTWISE),
        (aten.native_dropout_backward.default, ELEMENTWISE), (aten.gelu_backward.default, ELEMENTWISE),
        (aten.clone.default, LAYOUT), (aten.cat.default, LAYOUT), (aten.view.default, VIEW), (aten.expand.default, VIEW),
        (aten._unsafe_view.default, VIEW), (aten.detach.default, VIEW), (aten.embedding.default, OTHER),
        (torch.ops.dmfx.dropout.default, FUSED), (torch.ops.dmfx.bias_dropout_residual_norm.default, FUSED),
    ],
)
def test_classification(op, cls):
    assert classify(op) == cls


def test_embedding_reads_only_the_rows_it_returns():
    table, idx = torch.randn(1000, 8), torch.randint(0, 1000, (3,))
    out = torch.nn.functional.embedding(idx, table)
    c = op_cost(aten.embedding.default, (table, idx), {}, out)
    assert c.bytes_read == 3 * 8 * 4 + 3 * 8 and c.bytes_written == 3 * 8 * 4


def test_an_in_place_scatter_moves_the_rows_it_adds_not_the_whole_destination():
    """accumulate_embedding_grad's index_put_ into a [V, H] weight gradient: the indices and rows are
    read, and only as many destination bytes as the rows are read and written."""
    dst, idx, rows = torch.randn(1000, 8), torch.randint(0, 1000, (3,)), torch.randn(3, 8)
    c = op_cost(aten.index_put_.default, (dst, [idx], rows, True), {}, dst)
    assert classify(aten.index_put_.default) == LAYOUT
    assert c.bytes_read == 3 * 8 + 3 * 8 * 4 + 3 * 8 * 4 and c.bytes_written == 3 * 8 * 4


# ------------------------------------------------------------------ coverage on a known split


def _fused_graph():
    def f(x, seed):
        d = torch.ops.dmfx.dropout(x, seed, 0.1)
        return torch.relu(d) + 1

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 8), torch.tensor([1, 2]))
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.dmfx.dropout.default]
    return gm, node


def _absorbed(fn, *inputs):
    """What a fused node absorbed (passes/fusion.py), as the ops of the graph of `fn` on `inputs`."""
    from dmfx.passes.fusion import AbsorbedOp

    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    return [AbsorbedOp.of(n) for n in gm.graph.nodes if n.op == "call_function"]


def test_coverage_known_split():
    gm, node = _fused_graph()
    x = torch.randn(4, 8)
    # the kernel absorbed 3 memory-bound ops
    node.meta["dmfx_absorbed"] = _absorbed(lambda t: aten.native_dropout(torch.tanh(t) * 2, 0.1, True)[0], x)
    cov = coverage(gm)
    assert (cov.fused, cov.total) == (3, 5) and cov.ratio == pytest.approx(0.6)
    assert sorted(m["op"] for m in cov.misses) == ["aten::add", "aten::relu"]
    assert all(m["reason"] == "no dmfx pattern covers it" for m in cov.misses)
    relu = next(n.name for n in gm.graph.nodes if n.target is aten.relu.default)
    record = types.SimpleNamespace(forward_graph=gm, backward_graph=None, inference_graph=None,
                                   missed=[f"relu_chain at {relu}: its input has other users"])
    cov = coverage(record)
    assert cov.per_graph["forward"]["fused"] == 3
    assert next(m for m in cov.misses if m["op"] == "aten::relu")["reason"] == "relu_chain: its input has other users"
    node.meta["dmfx_absorbed"] = _absorbed(lambda t: (t * 2).view(-1), x)  # a view moves no data: not counted
    assert coverage(gm).fused == 1


def test_coverage_against_an_unfused_baseline():
    gm, _ = _fused_graph()

    def unfused(x):
        d = aten.native_dropout(x, 0.1, True)[0]
        return torch.tanh(torch.relu(d) + 1) * 2

    before = make_fx(unfused, tracing_mode="fake")(torch.randn(4, 8))
    cov = coverage({"forward": gm}, before={"forward": before})
    assert (cov.fused, cov.total) == (3, 5)  # 5 memory-bound ops before, relu and add left


# ------------------------------------------------------------------ run-time counters


def test_runtime_bytes_counts_ops_and_skips_views():
    a, b = torch.randn(7, 33), torch.randn(33, 5)
    rt = runtime_bytes(lambda: (a @ b).t().contiguous().view(-1))
    mm = 4 * (7 * 33 + 33 * 5 + 7 * 5)
    copy = 2 * 4 * 35
    assert rt.total == mm + copy and rt.kernels == 2
    assert rt.by_class == {CONTRACTION: mm, LAYOUT: copy}
    assert rt.result.shape == (35,)


def test_peak_memory_tracks_live_storages():
    def f():
        a = torch.randn(1000)
        b = torch.randn(2000)
        del a
        c = torch.randn(500)
        return b, c

    pm = peak_memory(f)
    assert pm.peak_bytes == 4 * 3000 and pm.device == "cpu"
    v = torch.randn(100)
    assert peak_memory(lambda: v.view(10, 10)[2:]).peak_bytes == 0  # views allocate nothing


# ------------------------------------------------------------------ a HF BertLayer end to end


def _bert_layer():
    from transformers.models.bert.modeling_bert import BertLayer

    cfg = transformers.BertConfig(hidden_size=64, num_attention_heads=2, intermediate_size=128)
    cfg._attn_implementation = "eager"
    return BertLayer(cfg)


@pytest.fixture(scope="module")
def reports():
    torch.manual_seed(0)
    layer = _bert_layer()
    x = torch.randn(2, 16, 64, requires_grad=True)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    out = {"train": explain(layer, x, training=True, measure=True), "infer": explain(layer, x.detach(), training=False)}
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())  # the model is left alone
    assert all(p.grad is None for p in layer.parameters())
    return out


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_static_bytes_agree_with_runtime_count(reports, mode):
    r = reports[mode]
    for stage in ("before", "after"):
        rt = r["runtime"][stage]
        assert rt["total"] > 0
        assert abs(rt["total"] - rt["static_bytes"]) <= 0.10 * rt["static_bytes"], (stage, rt)
        # and class by class for the kernels that matter
        static = r["totals"][stage]
        for cls in (CONTRACTION, NORMALIZATION, FUSED):
            if cls in static and static[cls]["bytes"]:
                assert abs(rt["by_class"].get(cls, 0) - static[cls]["bytes"]) <= 0.10 * static[cls]["bytes"], (stage, cls)


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_report_contents(reports, mode):
    r = reports[mode]
    graphs = {row["graph"] for row in r.rows("after")}
    assert graphs == ({"forward", "backward"} if mode == "train" else {"inference"})
    assert r["kernels"]["after"] < r["kernels"]["before"]
    assert 0 < r.reduction_pct < 100
    assert r["data_movement"]["paper_reduction_pct"] == 22.91
    fused = [row for row in r.rows("after") if row["class"] == FUSED]
    bdrln = [row for row in fused if row["op"] == "dmfx::bias_dropout_residual_norm"]
    assert len(bdrln) == 2
    for row in bdrln:
        assert {"aten::native_layer_norm", "aten::add"} <= set(row["absorbed"])
        assert ("aten::native_dropout" in row["absorbed"]) == (mode == "train")
        assert row["bytes_read"] > 0 and row["intensity"] is not None
    if mode == "train":
        nb = [row for row in r.rows("after", "backward") if row["op"] == "dmfx::norm_backward"]
        assert len(nb) == 2 and all(any("native_layer_norm" in a for a in row["absorbed"]) for row in nb)
    cov = r.coverage
    assert 0 < cov.ratio <= 1 and cov.fused >= 4  # inference of a BertLayer is fully covered now
    # GELU and softmax are fused (bias_act_dropout, attention_softmax); what is left is listed
    assert not any(m["op"] in ("aten::gelu", "aten::_softmax", "aten::_safe_softmax") for m in cov.misses)
    assert any(row["op"] == "dmfx::bias_act_dropout" for row in r.rows("after", "forward" if mode == "train" else "inference"))
    assert all(m["op"] and m.get("reason") for m in cov.misses)
    assert r["peak_memory"]["after"]["peak_bytes"] > 0
    text = str(r)
    assert "22.91" in text and "coverage" in text and "tensor contraction" in text and "no data moved" in text


def test_measure_gives_times_and_mue(reports):
    r = reports["train"]
    m = r["measure"]
    assert m["copy_bandwidth_gbs"] > 0 and m["time_ms"]["after"] > 0 and m["time_ms"]["before"] > 0
    timed = [row for row in r.rows("after") if row.get("time_us") is not None]
    assert {row["graph"] for row in timed} == {"forward", "backward"}
    assert any(row.get("mue") is not None and row["mue"] > 0 for row in timed if row["class"] == FUSED)
    assert "MUE" in str(r)


def test_json_round_trip(reports, tmp_path):
    r = reports["train"]
    path = tmp_path / "r.json"
    text = r.to_json(str(path))
    back = Report.from_json(path.read_text())
    assert back.to_dict() == r.to_dict() == json.loads(text)
    assert str(back) == str(r)
    assert Report.from_dict(r.to_dict()).reduction_pct == r.reduction_pct


def test_dmfx_explain_is_the_function_and_its_package_holds_the_parts():
    """``dmfx.explain(model, ...)`` is the function; the package it lives in (dmfx/explain/) exports it
    and its parts (``from dmfx.explain import coverage, ...``), with no module made callable."""
    pkg = sys.modules["dmfx.explain"]
    assert dmfx.explain is explain is pkg.explain and isinstance(pkg, types.ModuleType) and not callable(pkg)
    assert pkg.coverage is coverage and pkg.runtime_bytes is runtime_bytes and pkg.peak_memory is peak_memory
    with pytest.raises(TypeError, match="nn.Module"):
        dmfx.explain(lambda x: x, torch.randn(2))


def test_plot_optional(reports, tmp_path):
    path = reports["infer"].plot(str(tmp_path / "p.png"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert path is None
    else:
        assert Path(path).is_file()


# ------------------------------------------------------------------ CLI and observability


def _run(args, env=None, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_cli_explain_smoke(tmp_path):
    out = tmp_path / "r.json"
    p = _run(["-m", "dmfx", "explain", "--model", "bert-tiny", "--layers", "1", "--batch", "2", "--seq", "8", "--train",
              "--json", str(out)])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "data movement" in p.stdout and "coverage" in p.stdout
    data = json.loads(out.read_text())
    assert data["training"] is True and data["kernels"]["after"] < data["kernels"]["before"]
    assert {"ops", "totals", "coverage", "runtime", "peak_memory", "data_movement"} <= set(data)


def test_cli_usage_lists_both_commands(monkeypatch, capsys):
    from dmfx.__main__ import main

    monkeypatch.setattr(sys, "argv", ["dmfx", "--help"])
    main()
    out = capsys.readouterr().out
    assert "demo" in out and "explain" in out
    monkeypatch.setattr(sys, "argv", ["dmfx", "nope"])
    with pytest.raises(SystemExit, match="unknown command"):
        main()


def test_emit_logs_a_summary(caplog):
    from dmfx.observability import emit

    f = torch.compile(lambda x, w, b: torch.nn.functional.layer_norm(x, (8,), w, b) * 2, backend="dmfx")
    f(torch.randn(4, 8), torch.randn(8), torch.randn(8))
    with caplog.at_level("INFO", logger="dmfx"):
        summary = emit(dmfx.records()[-1])
    assert summary["fired"] == {"layer_norm": 1} and "cpu" in summary["kernels_loaded"]
    assert any("layer_norm" in rec.getMessage() for rec in caplog.records)
    assert emit(object()) is not None  # never raises, even on a foreign object


def test_emit_writes_a_torch_trace_artifact(tmp_path):
    script = (
        "import torch, dmfx\n"
        "from dmfx.observability import emit\n"
        "f = torch.compile(lambda x, w, b: torch.nn.functional.layer_norm(x, (8,), w, b) * 2, backend='dmfx')\n"
        "f(torch.randn(4, 8), torch.randn(8), torch.randn(8))\n"
        "emit(dmfx.records()[-1])\n"
    )
    p = _run(["-c", script], env={"TORCH_TRACE": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-3000:]
    text = "\n".join(f.read_text() for f in tmp_path.iterdir() if f.is_file())
    assert '"name": "dmfx_graph_record"' in text
    payload = text[text.index('"name": "dmfx_graph_record"'):]
    assert '"fired": {"layer_norm": 1}' in payload


def test_explain_takes_dmfx_options():
    """dmfx_options reach the "after" compile (skipping the layer's fusions shows in coverage and
    bytes), and a bad option is a clear error before anything compiles."""
    from conftest import tiny_bert_layer

    layer, _ = tiny_bert_layer()
    x = torch.randn(2, 9, 32)
    full = dmfx.explain(layer, x, training=True)
    skipped = dmfx.explain(layer, x, training=True,
                           dmfx_options={"skip": ["bias_dropout_residual_norm", "layer_norm", "bias_act_dropout"]})
    assert skipped.coverage.fused < full.coverage.fused
    assert skipped.reduction_pct < full.reduction_pct
    with pytest.raises(ValueError, match="unknown option"):
        dmfx.explain(layer, x, training=True, dmfx_options={"nope": 1})
