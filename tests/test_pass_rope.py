"""The rope fusion (passes/rope.py): HF's apply_rotary_pos_emb on q and k becomes one dmfx::rope; an
unpaired or wrongly split rotation is left alone."""

import torch
from conftest import check_same, rewrite, rotate_every_two, rotate_half, targets

aten = torch.ops.aten


def apply_rope(q, k, cos, sin):  # HF LLaMA's apply_rotary_pos_emb
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def test_rope_pairs_q_and_k():
    B, S, D = 2, 6, 8
    q = torch.randn(B, S, 4, D).transpose(1, 2)  # [B, H, S, D] with permuted strides, as HF makes it
    k = torch.randn(B, S, 2, D).transpose(1, 2)  # grouped-query: fewer k heads
    ang = torch.randn(B, S, D // 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    gm, ctx = rewrite(apply_rope, q, k, cos, sin)
    assert ctx.fired.get("rope") == 1 and aten.cat.default not in targets(gm) and aten.neg.default not in targets(gm)
    check_same(apply_rope, gm, q, k, cos, sin)


def test_rope_alone_or_wrong_halves_is_left_alone():
    q, cos, sin = torch.randn(2, 3, 6, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    one = lambda q, cos, sin: q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)  # noqa: E731
    gm, ctx = rewrite(one, q, cos, sin)
    assert "rope" not in ctx.fired and any("rope" in m for m in ctx.missed)
    check_same(one, gm, q, cos, sin)

    def swapped(q, k, cos, sin):  # not a rotation by halves: cat((x1, -x2))
        r = lambda x: torch.cat((x[..., :4], -x[..., 4:]), -1)  # noqa: E731
        return q * cos + r(q) * sin, k * cos + r(k) * sin

    gm, ctx = rewrite(swapped, q, q.clone(), cos.unsqueeze(1), sin.unsqueeze(1))
    assert "rope" not in ctx.fired


def apply_rope_interleaved(q, k, cos, sin):  # Cohere's apply_rotary_pos_emb
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_every_two(q) * sin, k * cos + rotate_every_two(k) * sin


def _interleaved_tables(B, S, D):
    ang = torch.randn(B, S, D // 2)
    return ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)


def test_interleaved_rope_pairs_q_and_k():
    B, S, D = 2, 6, 8
    q = torch.randn(B, S, 4, D).transpose(1, 2)
    k = torch.randn(B, S, 2, D).transpose(1, 2)
    cos, sin = _interleaved_tables(B, S, D)
    gm, ctx = rewrite(apply_rope_interleaved, q, k, cos, sin)
    assert ctx.fired.get("rope") == 1, ctx.missed
    assert not {aten.stack.default, aten.neg.default, aten.slice.Tensor} & set(targets(gm))
    (rope,) = [n for n in gm.graph.nodes if n.target is torch.ops.dmfx.rope.default]
    assert rope.args[5] is True
    check_same(apply_rope_interleaved, gm, q, k, cos, sin)
    # halves-equal tables are not enough to hide a wrong pairing: the tables here are random
    cos, sin = torch.randn(B, S, D), torch.randn(B, S, D)
    check_same(apply_rope_interleaved, gm, q, k, cos, sin)


def test_gptj_rope_with_its_tables_computed_once_per_tensor():
    """GPT-J (HF's GPTJAttention) repeats its sin/cos tables inside apply_rotary_pos_emb, once for k and
    again for q, and rotates only the first rotary_dim features of each head, in [B, S, H, D] before
    the transpose: the equal tables pair the two sites."""
    rot = 4

    def apply_rotary_pos_emb(x, sin, cos):
        sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
        cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
        return (x * cos) + (rotate_every_two(x) * sin)

    def gptj(q, k, table, pos):
        sin, cos = torch.split(table[pos], rot // 2, dim=-1)
        k_rot, k_pass, q_rot, q_pass = k[..., :rot], k[..., rot:], q[..., :rot], q[..., rot:]
        k_rot = apply_rotary_pos_emb(k_rot, sin, cos)
        q_rot = apply_rotary_pos_emb(q_rot, sin, cos)
        return torch.cat([k_rot, k_pass], dim=-1).transpose(1, 2), torch.cat([q_rot, q_pass], dim=-1).transpose(1, 2)

    B, S, H, D = 2, 5, 4, 8
    q, k = torch.randn(B, S, H, D), torch.randn(B, S, H, D)
    table, pos = torch.randn(16, rot), torch.arange(S).expand(B, S)
    gm, ctx = rewrite(gptj, q, k, table, pos)
    assert ctx.fired.get("rope") == 1, ctx.missed
    assert aten.stack.default not in targets(gm)
    check_same(gptj, gm, q, k, table, pos)

    def late_k(q, k, table, pos):  # k's rotated half is read (by its cat) before q is rotated: left alone
        sin, cos = torch.split(table[pos], rot // 2, dim=-1)
        key = torch.cat([apply_rotary_pos_emb(k[..., :rot], sin, cos), k[..., rot:]], dim=-1).transpose(1, 2)
        query = torch.cat([apply_rotary_pos_emb(q[..., :rot], sin, cos), q[..., rot:]], dim=-1).transpose(1, 2)
        return key, query

    gm, ctx = rewrite(late_k, q, k, table, pos)
    assert "rope" not in ctx.fired and any("a reader of q' or k' comes before" in m for m in ctx.missed), ctx.missed
    check_same(late_k, gm, q, k, table, pos)


def test_interleaved_rope_near_misses_are_left_alone():
    B, S, D = 2, 6, 8
    q, k = torch.randn(B, 4, S, D), torch.randn(B, 2, S, D)
    cos, sin = _interleaved_tables(B, S, D)

    def wrong_order(q, k, cos, sin):  # stack((x1, -x2)): the transposed rotation, not rotate_every_two
        r = lambda x: torch.stack((x[..., ::2], -x[..., 1::2]), -1).flatten(-2)  # noqa: E731
        return q * cos.unsqueeze(1) + r(q) * sin.unsqueeze(1), k * cos.unsqueeze(1) + r(k) * sin.unsqueeze(1)

    def other_dim(q, k, cos, sin):  # stacked on dim -2, then flattened: not an interleaving
        r = lambda x: torch.stack((-x[..., 1::2], x[..., ::2]), -2).flatten(-2)  # noqa: E731
        return q * cos.unsqueeze(1) + r(q) * sin.unsqueeze(1), k * cos.unsqueeze(1) + r(k) * sin.unsqueeze(1)

    def mixed(q, k, cos, sin):  # q interleaved, k by halves: two different rotations do not pair
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * c + rotate_every_two(q) * s, k * c + rotate_half(k) * s

    def random_tables(q, k, cos, sin):  # tables computed twice by random ops are not the same values
        def emb(x):
            noise = torch.rand_like(cos)
            return x * (cos + noise).unsqueeze(1) + rotate_every_two(x) * sin.unsqueeze(1)

        return emb(q), emb(k)

    for fn in (wrong_order, other_dim, mixed):
        gm, ctx = rewrite(fn, q, k, cos, sin)
        assert "rope" not in ctx.fired, fn.__name__
        check_same(fn, gm, q, k, cos, sin)
    gm, ctx = rewrite(random_tables, q, k, cos, sin)
    assert "rope" not in ctx.fired
    assert sum("rope" in m for m in ctx.missed) == 2, ctx.missed


def apply_rope_deinterleave(q, k, cos, sin):  # DeepSeek V3's apply_rotary_pos_emb_interleave
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    return torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], -1), torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], -1)


def test_deepseek_rope_pairs_in_halves_out():
    """DeepSeek's rope_interleave (DeepSeek V3, Mistral 4, ...): the pairs (2i, 2i + 1) rotate into the
    halves (i, i + D/2) with tables of D/2, k with one head (MLA's shared rotary key), q a slice of a
    wider head as DeepSeek's q_rot is."""
    B, S, D = 2, 6, 8
    q = torch.randn(B, S, 4, D + 4).transpose(1, 2)[..., 4:]  # [B, H, S, D], strided
    k = torch.randn(B, 1, S, D)
    cos, sin = torch.randn(B, S, D), torch.randn(B, S, D)  # (random: a wrong table half shows)
    gm, ctx = rewrite(apply_rope_deinterleave, q, k, cos, sin)
    assert ctx.fired.get("rope") == 1, ctx.missed
    assert not {aten.sub.Tensor, aten.mul.Tensor} & set(targets(gm)), targets(gm)
    (rope,) = [n for n in gm.graph.nodes if n.target is torch.ops.dmfx.rope.default]
    assert rope.args[5:] == (False, True)
    check_same(apply_rope_deinterleave, gm, q, k, cos, sin, tol=1e-6)


def test_deepseek_rope_layers_share_their_doubled_tables():
    """Two layers rotating with the model's one pair of tables: two fused ops, one cat([c, c]) per table
    (made at the first site, read again at the second), and the second layer's q depends on the first's."""
    B, S, D = 2, 6, 8

    def two_layers(q, k, cos, sin):
        q1, k1 = apply_rope_deinterleave(q, k, cos, sin)
        return apply_rope_deinterleave(q1 * 2, k1 + 1, cos, sin)

    q, k = torch.randn(B, 4, S, D), torch.randn(B, 1, S, D)
    cos, sin = torch.randn(B, S, D), torch.randn(B, S, D)
    gm, ctx = rewrite(two_layers, q, k, cos, sin)
    assert ctx.fired.get("rope") == 2, ctx.missed
    ropes = [n for n in gm.graph.nodes if n.target is torch.ops.dmfx.rope.default]
    assert len(ropes) == 2 and ropes[0].args[2:4] == ropes[1].args[2:4]
    assert sum(n.target is aten.cat.default for n in gm.graph.nodes) == 2, targets(gm)
    check_same(two_layers, gm, q, k, cos, sin, tol=1e-6)


def test_deepseek_rope_near_misses_are_left_alone():
    B, S, D = 2, 6, 8
    q, k = torch.randn(B, 4, S, D), torch.randn(B, 1, S, D)
    cos, sin = torch.randn(B, S, D // 2).unsqueeze(1), torch.randn(B, S, D // 2).unsqueeze(1)

    def emb(x, c, s, first=(0, 1), signs=(1, 1), dim=-1):
        x1, x2 = x[..., first[0]::2], x[..., first[1]::2]
        return torch.cat([x1 * c - signs[0] * x2 * s, x2 * c + signs[1] * x1 * s], dim)

    def swapped_slices(q, k, c, s):  # x[..., 1::2] taken as the first of a pair
        return emb(q, c, s, (1, 0)), emb(k, c, s, (1, 0))

    def plus_not_minus(q, k, c, s):  # x1 * c + x2 * s: not a rotation
        r = lambda x: torch.cat([x[..., 0::2] * c + x[..., 1::2] * s, x[..., 1::2] * c + x[..., 0::2] * s], -1)  # noqa: E731
        return r(q), r(k)

    def tables_swapped(q, k, c, s):  # the second half rotated with the sine where the cosine goes
        r = lambda x: torch.cat([x[..., 0::2] * c - x[..., 1::2] * s, x[..., 1::2] * s + x[..., 0::2] * c], -1)  # noqa: E731
        return r(q), r(k)

    def stacked_on_another_dim(q, k, c, s):  # cat along the heads: not the halves of one row
        return emb(q, c, s, dim=1), emb(k, c, s, dim=1)

    def slice_read_again(q, k, c, s):  # x1 has a reader outside the rotation
        return emb(q, c, s), emb(k, c, s), q[..., 0::2] * 2

    def only_q(q, k, c, s):  # no k rotated with the same tables: nothing to pair with
        return emb(q, c, s), k * 2

    for fn in (swapped_slices, plus_not_minus, tables_swapped, stacked_on_another_dim, slice_read_again, only_q):
        gm, ctx = rewrite(fn, q, k, cos, sin)
        assert "rope" not in ctx.fired, fn.__name__
        check_same(fn, gm, q, k, cos, sin)
    one = torch.randn(B, 1, S, 1)  # one angle per token, broadcast along D/2: not the kernel's tables
    fn = lambda q, k, c, s: (emb(q, c, s), emb(k, c, s))  # noqa: E731
    gm, ctx = rewrite(fn, q, k, one, one * 0.5)
    assert "rope" not in ctx.fired
    check_same(fn, gm, q, k, one, one * 0.5)
