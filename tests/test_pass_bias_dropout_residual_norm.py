"""The bias_dropout_residual_norm fusion (passes/bias_dropout_residual_norm.py, the paper's BDRLN) on
small hand-built ATen graphs: linear bias + dropout + residual add + LayerNorm/RMSNorm become one
dmfx::bias_dropout_residual_norm (the bias taken out of addmm, the sum returned when it is read
elsewhere, a broadcast residual expanded); near-misses are left alone."""

import torch
import torch.nn.functional as F
from conftest import check_same, count, rewrite, targets

dmfx_ops = torch.ops.dmfx
aten = torch.ops.aten


def _bert_output(h, res, W, b, gamma, beta, p):
    """BertSelfOutput/BertOutput: LayerNorm(dropout(dense(h)) + residual)."""
    return F.layer_norm(F.dropout(F.linear(h, W, b), p, training=True) + res, (W.shape[0],), gamma, beta, 1e-12)


def _bert_args(H=32, L=6):
    return torch.randn(2, L, H), torch.randn(2, L, H), torch.randn(H, H), torch.randn(H), torch.randn(H), torch.randn(H)


def test_bias_dropout_residual_layer_norm_fires_after_linear():
    fn = lambda *a: _bert_output(*a, 0.1)  # noqa: E731
    gm, ctx = rewrite(fn, *_bert_args())
    assert ctx.fired.get("bias_dropout_residual_norm") == 1
    t = targets(gm)
    assert torch.ops.aten.addmm.default not in t and torch.ops.aten.mm.default in t  # bias moved into the kernel
    assert torch.ops.aten.native_dropout.default not in t
    assert count(gm, dmfx_ops.bias_dropout_residual_norm) == 1


def test_bdrln_without_dropout_matches_eager_and_commuted_add():
    fn = lambda h, res, W, b, g, be: F.layer_norm(res + F.linear(h, W, b), (32,), g, be, 1e-12)  # noqa: E731
    args = _bert_args()
    gm, ctx = rewrite(fn, *args)
    assert ctx.fired.get("bias_dropout_residual_norm") == 1
    check_same(fn, gm, *args)


def test_bdrln_takes_a_clone_as_a_p0_dropout():
    """torch 2.11 traces a p=0 training dropout as clone(h): the chain still fuses, bias included,
    and the copy is gone (a clone is the identity on values)."""
    fn = lambda h, res, W, b, g, be: F.layer_norm(F.linear(h, W, b).clone() + res, (32,), g, be, 1e-12)  # noqa: E731
    args = _bert_args()
    gm, ctx = rewrite(fn, *args)
    assert ctx.fired.get("bias_dropout_residual_norm") == 1
    t = targets(gm)
    assert torch.ops.aten.clone.default not in t and torch.ops.aten.addmm.default not in t
    check_same(fn, gm, *args)


def test_bdrln_returns_the_sum_when_it_is_used_elsewhere():
    def fn(h, res, W, b, g, be):  # pre-LN style: the residual stream continues past the norm
        s = F.linear(h, W, b) + res
        return F.layer_norm(s, (32,), g, be), s * 2

    args = _bert_args()
    gm, ctx = rewrite(fn, *args)
    assert ctx.fired.get("bias_dropout_residual_norm") == 1
    node = next(n for n in gm.graph.nodes if n.target is dmfx_ops.bias_dropout_residual_norm.default)
    assert node.args[-1] is True  # return_sum
    check_same(fn, gm, *args)


def test_dropout_output_with_another_user_is_not_fused_into_the_norm():
    def fn(h, res, W, b, g, be):
        d = F.dropout(F.linear(h, W, b), 0.1, training=True)
        return F.layer_norm(d + res, (32,), g, be), d

    gm, ctx = rewrite(fn, *_bert_args())
    # the dropout stays outside the norm kernel (its output is needed): bias + dropout fuse on their
    # own, and the plain residual add still fuses into the norm
    assert any("other users" in m for m in ctx.missed)
    (f,) = [n for n in gm.graph.nodes if n.target is dmfx_ops.bias_dropout_residual_norm.default]
    assert f.args[5] is None and f.args[6] == 0.0  # no seed, p = 0: no dropout inside
    assert ctx.fired.get("bias_act_dropout") == 1
    assert torch.ops.aten.native_dropout.default not in targets(gm)


def test_residual_add_rmsnorm_llama_style():
    def block(h, a, w):  # h = h + attn_out; x = rmsnorm(h); both are used
        h = h + a
        var = h.pow(2).mean(-1, keepdim=True)
        return w * (h * torch.rsqrt(var + 1e-6)), h

    h, a, w = torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.randn(16)
    gm, ctx = rewrite(block, h, a, w)
    assert ctx.fired.get("bias_dropout_residual_norm") == 1
    (f,) = [n for n in gm.graph.nodes if n.target is dmfx_ops.bias_dropout_residual_norm.default]
    assert f.args[8] is True and f.args[9] is True  # rms, and the sum is returned for the next residual
    assert aten.add.Tensor not in targets(gm)
    check_same(block, gm, h, a, w)


def test_broadcast_residual_is_expanded_into_the_norm():
    """BERT's embeddings: (word + type) + position[1, S, H] -> LayerNorm: the broadcast add fuses too."""
    def emb(a, pos, w, b):
        return F.layer_norm(a + pos, (16,), w, b, 1e-12)

    a, pos, w, b = torch.randn(3, 5, 16), torch.randn(1, 5, 16), torch.randn(16), torch.randn(16)
    gm, ctx = rewrite(emb, a, pos, w, b)
    assert ctx.fired.get("bias_dropout_residual_norm") == 1 and aten.add.Tensor not in targets(gm)
    check_same(emb, gm, a, pos, w, b)
    # gradients through the expanded residual are summed back to [1, S, H]
    ap, pp = a.clone().requires_grad_(), pos.clone().requires_grad_()
    out = torch.compile(emb, backend="dmfx")(ap, pp, w, b)
    R = torch.randn_like(out)
    (out * R).sum().backward()
    ae, pe = a.clone().requires_grad_(), pos.clone().requires_grad_()
    (emb(ae, pe, w, b) * R).sum().backward()
    assert pp.grad.shape == pos.shape
    torch.testing.assert_close(pp.grad, pe.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ap.grad, ae.grad, rtol=1e-5, atol=1e-5)
