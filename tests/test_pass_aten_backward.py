"""passes/backward/aten_backward.py: PyTorch's own backward ops, left where the forward pipeline did not rewrite
a chain, become dmfx's backward kernels.

* On hand-built backward graphs: ``native_layer_norm_backward``, ``gelu_backward`` (erf and tanh),
  ``silu_backward``, ``threshold_backward(., ., 0)`` with the bias-gradient ``sum`` after them, and
  ``_softmax_backward_data`` with the scale after it each become one dmfx op with the same values;
  near-misses (a norm over two dims, a threshold other than 0, a softmax over another dim or with a
  cast, bf16 statistics) are left alone and named in the record's misses. ``native_dropout_backward``
  (a mask the forward stored) folds into the activation backward after it, or becomes the identity
  kernel reading the mask, with the bias sum.
* End to end: a BertLayer compiled with the forward fusions skipped has none of PyTorch's backward
  ops left, its gradients equal eager's, and the folds of passes/backward/ apply to the new ops.
"""

from __future__ import annotations

import pytest
import torch
from conftest import compiled_step_matches_eager, rel_err, targets, tiny_bert_layer
from torch.fx.experimental.proxy_tensor import make_fx

import dmfx
from dmfx.passes import PassContext
from dmfx.passes.backward.aten_backward import fuse_aten_backward

aten = torch.ops.aten


def _run(fn, *args):
    """Trace `fn` (fake), run the pass, and return (eager values, rewritten graph's values, graph, ctx)."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    ctx = PassContext()
    fuse_aten_backward(gm, ctx)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return fn(*args), gm(*args), gm, ctx


def _close(got, want, tol=1e-5):
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if b is not None:
            assert a.shape == b.shape and rel_err(a, b) < tol


@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_layer_norm_backward_becomes_dmfx(affine):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16)
    w = torch.randn(16) if affine != "none" else None
    b = torch.randn(16) if affine == "both" else None
    _, mean, rstd = aten.native_layer_norm(x, [16], w, b, 1e-5)
    g = torch.randn_like(x)
    mask = [True, w is not None, b is not None]

    def f(g, x, mean, rstd, w, b):
        return aten.native_layer_norm_backward(g, x, [16], mean, rstd, w, b, mask)

    want, got, gm, ctx = _run(f, g, x, mean, rstd, w, b)
    assert ctx.fired == {"aten_backward": 1}
    assert aten.native_layer_norm_backward.default not in targets(gm)
    assert torch.ops.dmfx.norm_backward.default in targets(gm)
    _close(got, want)


def test_layer_norm_backward_near_misses():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 8)
    _, mean, rstd = aten.native_layer_norm(x, [4, 8], None, None, 1e-5)

    def two_dims(g, x, mean, rstd):
        return aten.native_layer_norm_backward(g, x, [4, 8], mean, rstd, None, None, [True, False, False])

    _, _, gm, ctx = _run(two_dims, torch.randn_like(x), x, mean, rstd)
    assert aten.native_layer_norm_backward.default in targets(gm) and not ctx.fired
    assert any("more than the last dim" in m for m in ctx.missed), ctx.missed

    xb = torch.randn(3, 8, dtype=torch.bfloat16)
    _, mean, rstd = aten.native_layer_norm(xb, [8], None, None, 1e-5)  # bf16 statistics on the CPU

    def bf16(g, x, mean, rstd):
        return aten.native_layer_norm_backward(g, x, [8], mean, rstd, None, None, [True, False, False])

    _, _, gm, ctx = _run(bf16, torch.randn_like(xb), xb, mean, rstd)
    assert aten.native_layer_norm_backward.default in targets(gm)
    assert any("statistics in torch.bfloat16" in m for m in ctx.missed), ctx.missed


ACTS = {
    "gelu": lambda g, h: aten.gelu_backward(g, h),
    "gelu_tanh": lambda g, h: aten.gelu_backward(g, h, approximate="tanh"),
    "silu": lambda g, h: aten.silu_backward(g, h),
    "relu": lambda g, h: aten.threshold_backward(g, torch.relu(h), 0),
}


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("bias_sum", [True, False])
def test_activation_backward_becomes_dmfx_with_its_bias_gradient(act, bias_sum):
    """gelu_backward(g, h) (h: the linear's output, bias inside the GEMM) and the bias gradient
    sum(view(dx, [rows, F]), [0]) become one bias_act_dropout_backward."""
    torch.manual_seed(0)
    h, g = torch.randn(2, 6, 24), torch.randn(2, 6, 24)

    def f(g, h):
        dx = ACTS[act](g, h)
        flat = dx.view(-1, 24)
        return (flat, flat.sum([0], keepdim=True).view(24)) if bias_sum else (flat,)

    want, got, gm, ctx = _run(f, g, h)
    assert ctx.fired == {"aten_backward": 1}
    assert ctx.replaced == {"aten_backward": 2 if bias_sum else 1}
    ts = targets(gm)
    assert torch.ops.dmfx.bias_act_dropout_backward.default in ts
    assert not {aten.gelu_backward.default, aten.silu_backward.default, aten.threshold_backward.default} & set(ts)
    assert (aten.sum.dim_IntList in ts) is False
    _close(got, want)


def test_activation_backward_near_misses():
    torch.manual_seed(0)
    h, g = torch.randn(4, 8), torch.randn(4, 8)

    def thresh(g, h):
        return aten.threshold_backward(g, h, 0.5)  # not relu's

    _, _, gm, ctx = _run(thresh, g, h)
    assert aten.threshold_backward.default in targets(gm) and not ctx.fired

    def partial_sum(g, h):
        dx = aten.gelu_backward(g, h)
        return dx.sum([1])  # over the features: no bias gradient

    want, got, gm, ctx = _run(partial_sum, g, h)
    assert ctx.replaced == {"aten_backward": 1} and aten.sum.dim_IntList in targets(gm)
    _close([got], [want])

    def mixed(g, h):
        return aten.gelu_backward(g.double(), h.double())  # fine: one dtype after the casts

    _, _, gm, ctx = _run(mixed, g, h)
    assert ctx.fired == {"aten_backward": 1}


def _dropout_mask(shape, p=0.3):
    return torch.rand(shape) >= p


@pytest.mark.parametrize("act", list(ACTS))
def test_stored_dropout_mask_folds_into_the_activation_backward(act):
    """native_dropout_backward(g, mask, s) read only by gelu_backward (the forward's dropout after the
    activation, stored by PyTorch), with the bias sum: dropout, activation and sum in one kernel."""
    torch.manual_seed(0)
    h, g, mask = torch.randn(2, 6, 24), torch.randn(2, 6, 24), _dropout_mask((2, 6, 24))

    def f(g, mask, h):
        dx = ACTS[act](aten.native_dropout_backward(g, mask, 1 / 0.7), h)
        flat = dx.view(-1, 24)
        return flat, flat.sum([0])

    want, got, gm, ctx = _run(f, g, mask, h)
    assert ctx.fired == {"aten_backward": 1} and ctx.replaced == {"aten_backward": 3}
    ts = targets(gm)
    assert aten.native_dropout_backward.default not in ts and aten.sum.dim_IntList not in ts
    assert ts.count(torch.ops.dmfx.bias_act_dropout_backward.default) == 1
    _close(got, want)


def test_stored_dropout_mask_alone_becomes_the_identity_kernel_with_its_bias_sum():
    """A dropout backward no activation reads (dropout after a linear: BERT's hidden dropout) and the
    bias gradient after it: one identity kernel with the stored mask."""
    torch.manual_seed(0)
    g, mask = torch.randn(3, 5, 16), _dropout_mask((3, 5, 16))

    def f(g, mask):
        d = aten.native_dropout_backward(g, mask, 2.0)
        return d, d.sum([0, 1])

    want, got, gm, ctx = _run(f, g, mask)
    assert ctx.replaced == {"aten_backward": 2}
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.dmfx.bias_act_dropout_backward.default]
    assert node.args[3] == "identity" and node.args[7].name.startswith("mask") and node.args[8] == 2.0
    _close(got, want)


def test_stored_dropout_mask_near_misses():
    torch.manual_seed(0)
    h, g, mask = torch.randn(4, 8), torch.randn(4, 8), _dropout_mask((4, 8))

    def two_readers(g, mask, h):  # the dropout's gradient is read twice: not folded into the GELU
        d = aten.native_dropout_backward(g, mask, 1.25)
        return aten.gelu_backward(d, h), d * 3

    want, got, gm, ctx = _run(two_readers, g, mask, h)
    assert ctx.fired == {"aten_backward": 2}  # GELU and the dropout, each its own kernel
    assert aten.native_dropout_backward.default not in targets(gm)
    _close(got, want)

    def byte_mask(g, mask, h):  # a mask that is not native_dropout's bool mask
        return aten.native_dropout_backward(g, mask.to(torch.uint8), 1.25)

    want, got, gm, ctx = _run(byte_mask, g, mask, h)
    assert aten.native_dropout_backward.default in targets(gm) and not ctx.fired
    assert any("not a bool tensor" in m for m in ctx.missed), ctx.missed

    y = torch.softmax(torch.randn(2, 3, 8, 8), -1)
    gs, ms = torch.randn(2, 3, 8, 8), _dropout_mask((2, 3, 8, 8))

    def softmax_dropout_read_twice(g, mask, y):  # the dropout's gradient is read elsewhere too
        d = aten.native_dropout_backward(g, mask, 1.25)
        return aten._softmax_backward_data(d, y, -1, torch.float32), d

    want, got, gm, ctx = _run(softmax_dropout_read_twice, gs, ms, y)
    ts = targets(gm)
    assert ctx.fired == {"aten_backward": 2} and aten.native_dropout_backward.default not in ts
    assert torch.ops.dmfx.attention_softmax_backward.default in ts and torch.ops.dmfx.bias_act_dropout_backward.default in ts
    _close(got, want)


@pytest.mark.parametrize("scale", ["div", "none"])
def test_stored_dropout_mask_folds_into_the_softmax_backward(scale):
    """Attention-probability dropout stored by PyTorch: dropout backward, softmax backward and the
    1/sqrt(d) after it in one dmfx::attention_softmax_backward reading the mask."""
    torch.manual_seed(0)
    y = torch.softmax(torch.randn(2, 3, 8, 8), -1)
    g, mask = torch.randn(2, 3, 8, 8), _dropout_mask((2, 3, 8, 8))

    def f(g, mask, y):
        d = aten._softmax_backward_data(aten.native_dropout_backward(g, mask, 1.25), y, -1, torch.float32)
        return d / 8.0 if scale == "div" else d

    want, got, gm, ctx = _run(f, g, mask, y)
    assert ctx.fired == {"aten_backward": 1} and ctx.replaced == {"aten_backward": 3 if scale == "div" else 2}
    assert targets(gm) == [torch.ops.dmfx.attention_softmax_backward.default]
    _close([got], [want])


@pytest.mark.parametrize("scale", ["div", "mul", "none"])
def test_softmax_backward_becomes_dmfx_with_the_scale(scale):
    torch.manual_seed(0)
    y = torch.softmax(torch.randn(2, 3, 5, 7), -1)
    g = torch.randn_like(y)

    def f(g, y):
        d = aten._softmax_backward_data(g, y, -1, torch.float32)
        return {"div": lambda: d / 8.0, "mul": lambda: d * 0.125, "none": lambda: d}[scale]()

    want, got, gm, ctx = _run(f, g, y)
    assert ctx.fired == {"aten_backward": 1}
    ts = targets(gm)
    assert ts.count(torch.ops.dmfx.attention_softmax_backward.default) == 1 and len(ts) == 1, ts
    _close([got], [want])


def test_softmax_backward_near_misses():
    torch.manual_seed(0)
    y = torch.softmax(torch.randn(2, 5, 7), 1)
    g = torch.randn_like(y)

    def other_dim(g, y):
        return aten._softmax_backward_data(g, y, 1, torch.float32)

    _, _, gm, ctx = _run(other_dim, g, y)
    assert aten._softmax_backward_data.default in targets(gm) and not ctx.fired
    assert any("another dim" in m for m in ctx.missed), ctx.missed

    def cast(g, y):  # softmax computed in fp32 from an fp16 input (HF under autocast)
        return aten._softmax_backward_data(g, y, -1, torch.float16)

    gm = make_fx(cast, tracing_mode="fake")(g, y)  # (traced only: the CPU kernel has no such case)
    ctx = PassContext()
    fuse_aten_backward(gm, ctx)
    assert aten._softmax_backward_data.default in targets(gm) and not ctx.fired
    assert any("a cast around the softmax" in m for m in ctx.missed), ctx.missed


FORWARD_FUSIONS = ["layer_norm", "bias_dropout_residual_norm", "attention_softmax", "attention", "qkv_attention",
                   "bias_act_dropout", "dropout"]


def test_bert_layer_with_unfused_forward_gets_dmfx_backward_kernels():
    layer, ref = tiny_bert_layer()
    compiled_step_matches_eager(layer, ref, {"fallback": False, "skip": FORWARD_FUSIONS})
    (rec,) = dmfx.records()
    fw, bw = targets(rec.forward_graph), targets(rec.backward_graph)
    assert aten.native_layer_norm.default in fw  # the forward really was left alone
    for op in (aten.native_layer_norm_backward.default, aten.gelu_backward.default, aten._softmax_backward_data.default):
        assert op not in bw, rec.backward_graph.code
    assert rec.fired.get("aten_backward") == 4  # two layer norms, GELU (with its bias sum), softmax
    assert rec.fired.get("fold_gradient_adds") == 1  # the attention output norm's two gradients
    # the two dense layers before the norms keep their bias in the GEMM: its gradient comes out of the
    # norm backward (dbias), the bias sum after GELU out of the activation backward
    assert rec.fired.get("fold_bias_grads") == 2
    assert bw.count(aten.sum.dim_IntList) == 3  # Q, K, V's (the attention was left unfused)


def test_bert_layer_with_dropout_and_unfused_forward_reads_pytorchs_stored_masks():
    """Dropout on, forward fusions skipped: the forward's native_dropout masks are read by dmfx's
    backward kernels (none of PyTorch's dropout backwards is left), and the gradients equal those of the
    same compiled forward with PyTorch's backward ops (same seed, so the same masks)."""
    import copy

    layer, _ = tiny_bert_layer(dropout=0.2)
    grads, recs = [], []
    for extra in ([], ["aten_backward"]):
        m = copy.deepcopy(layer)
        f = torch.compile(m, backend="dmfx", options={"fallback": False, "skip": [*FORWARD_FUSIONS, *extra]})
        torch.manual_seed(1)
        x = torch.randn(2, 9, 32, requires_grad=True)
        (f(x)[0] * torch.randn(2, 9, 32)).sum().backward()
        grads.append([x.grad] + [p.grad for p in m.parameters()])
        recs.append(dmfx.records()[-1])
    bw = targets(recs[0].backward_graph)
    assert aten.native_dropout_backward.default not in bw
    assert targets(recs[1].backward_graph).count(aten.native_dropout_backward.default) == 3
    assert recs[0].fired.get("aten_backward") == 6  # the three dropouts read inside the kernels after them
    for name, a, b in zip(["x"] + [n for n, _ in layer.named_parameters()], *grads):
        floor = 1e-6 if name.endswith("key.bias") else 0.0  # zero up to rounding (softmax's shift invariance)
        assert (a - b).abs().max() <= 1e-5 * b.abs().max() + floor, name


def test_skipping_aten_backward_keeps_pytorchs_ops():
    layer, _ = tiny_bert_layer()
    f = torch.compile(layer, backend="dmfx", options={"fallback": False, "skip": [*FORWARD_FUSIONS, "aten_backward"]})
    x = torch.randn(2, 9, 32, requires_grad=True)
    f(x)[0].sum().backward()
    (rec,) = dmfx.records()
    assert aten.native_layer_norm_backward.default in targets(rec.backward_graph)
    assert "aten_backward" not in rec.fired
