"""The dropout fusion (passes/dropout.py): a native_dropout no chain took becomes dmfx::dropout."""

import torch
import torch.nn.functional as F
from conftest import check_same, count, rewrite, targets

dmfx_ops = torch.ops.dmfx


def test_standalone_dropout_becomes_philox_dropout():
    fn = lambda x: F.dropout(x, 0.2, training=True) * 3  # noqa: E731
    gm, ctx = rewrite(fn, torch.randn(8, 8))
    assert ctx.fired == {"dropout": 1}
    assert count(gm, dmfx_ops.dropout) == 1 and torch.ops.aten.native_dropout.default not in targets(gm)


# ------------------------------------------------------------------------------- identity_clones
# torch 2.11 traces a training dropout of p = 0 as clone(x); a user's .clone() looks the same.

aten = torch.ops.aten


def _clones(gm):
    return count(gm, aten.clone)


def test_identity_clone_mid_chain_is_dropped_and_the_chain_fuses():
    """A clone between a GEMM and the residual add of a LayerNorm (BERT's output with hidden dropout
    p = 0 on torch 2.11): dropped, so bias_dropout_residual_norm takes the chain."""
    def fn(h, res, W, b, g, be):
        return F.layer_norm(F.linear(h, W, b).clone() + res, (16,), g, be)

    args = (torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.randn(16, 16), torch.randn(16), torch.randn(16), torch.randn(16))
    gm, ctx = rewrite(fn, *args)
    assert ctx.fired.get("bias_dropout_residual_norm") == 1 and "identity_clones" not in ctx.fired, ctx.fired
    assert _clones(gm) == 0 and count(gm, aten.addmm) == 0  # the bias is the fused op's
    check_same(fn, gm, *args)
    # without the pass the copy stays and hides the GEMM from the fusion: its bias is not taken
    gm, ctx = rewrite(fn, *args, passes=["bias_dropout_residual_norm", "layer_norm"])
    assert _clones(gm) == 1 and count(gm, aten.addmm) == 1


def test_identity_clones_kept_where_the_copy_matters():
    x = torch.randn(3, 4)

    def of_an_input(x):  # the input's clone: an in-place update after the graph, or an alias of an input
        return x.clone() * 2

    def returned(x):  # the clone is an output beside the value it copies: two outputs, two buffers
        y = x * 2
        return y, y.clone()

    def transposed(x):  # preserve_format of a transposed (non-contiguous) value: left alone
        return (x * 2).t().clone() + 1

    def contiguous_format(x):  # a clone to another layout is a real copy (layout's business)
        return (x * 2).t().clone(memory_format=torch.contiguous_format) + 1

    def of_a_view_of_an_input(x):  # the input's storage, seen through a view
        return x.view(4, 3).clone() * 2

    def viewed_by_an_output(x):  # an output is a view of the clone: it must not become a view of x
        y = x * 2
        return y, y.clone().view(4, 3)

    for fn in (of_an_input, returned, transposed, contiguous_format, of_a_view_of_an_input, viewed_by_an_output):
        gm, ctx = rewrite(fn, x, passes=["identity_clones"])
        assert _clones(gm) == 1, fn.__name__
        out, exp = gm(x), fn(x)
        for o, e in zip(out if isinstance(out, tuple) else (out,), exp if isinstance(exp, tuple) else (exp,)):
            torch.testing.assert_close(o, e)
    for fn in (returned, viewed_by_an_output):
        y, y2 = rewrite(fn, x, passes=["identity_clones"])[0](x)
        assert y.data_ptr() != y2.data_ptr(), fn.__name__


def test_identity_clones_in_a_graph_that_updates_an_input():
    """A buffer updated in place from a clone: dmfx lowers the graph to its functional body (the
    update becomes the functional ``copy`` of the new value, written into the buffer after the graph),
    so the clone is dropped where it is not returned and kept where it is; either way the buffer gets
    the value, and no output shares storage with the buffer."""
    import dmfx

    def update_only(buf, x):
        c = (x * 2).clone()
        buf.copy_(c)
        return c + 1

    def update_and_return(buf, x):
        c = (x * 2).clone()
        buf.copy_(c)
        return c + 1, c

    x = torch.randn(3, 4)
    for fn, dropped in ((update_only, True), (update_and_return, False)):
        torch._dynamo.reset()
        dmfx.reset()
        buf, ref_buf = torch.zeros(3, 4), torch.zeros(3, 4)
        out = torch.compile(fn, backend="dmfx", options={"fallback": False, "fuse": "all", "compiler": "fx"})(buf, x)
        exp = fn(ref_buf, x)
        torch.testing.assert_close(buf, ref_buf)
        for o, e in zip(out if isinstance(out, tuple) else (out,), exp if isinstance(exp, tuple) else (exp,)):
            torch.testing.assert_close(o, e)
            assert o.data_ptr() != buf.data_ptr()
        assert all(r.fallback is None for r in dmfx.records())
        gm, _ = rewrite(fn, torch.zeros(3, 4), x, passes=["identity_clones"])  # the body the backend rewrote
        assert _clones(gm) == (0 if dropped else 1), fn.__name__
