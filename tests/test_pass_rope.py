"""The rope fusion (passes/rope.py): HF's apply_rotary_pos_emb on q and k becomes one dmfx::rope; an
unpaired or wrongly split rotation is left alone."""

import torch
from conftest import check_same, rewrite, targets

aten = torch.ops.aten


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


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
