"""Fuzz of what a graph does with an unpadded encoder's output (issue 16: never a wrong answer).

Each case compiles a small BERT encoder followed by a random chain of ops on its hidden states, ending
in one that collapses the positions (a pooling, a reduction, a scan, a softmax over the positions, a
GEMM over them, an attention, a slice of the last positions, a pick of the first, a view merging the
positions with the features, features gathered before a sum over the positions), under
``unpad=True``, and checks the result against eager's on the whole output: the pass either unpads
the graph, where nothing reads the padding positions, or leaves it padded and says why. Padding
positions hold zeros in an unpadded graph and values in eager, so a reader of them that the pass
missed shows as a different result here.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

import dmfx

SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
UNPAD = {"unpad": True}


def _masked(h, m, w=None):
    return h * m[..., None].to(h.dtype)


# Ops that keep [B, S, H] (position for position, or mixing features only)
KEEP = {
    "sin": lambda h, m, w: h.sin(),
    "affine": lambda h, m, w: h * 2 + 1,
    "gelu": lambda h, m, w: torch.nn.functional.gelu(h),
    "linear": lambda h, m, w: h @ w,
    "softmax over features": lambda h, m, w: torch.softmax(h, -1),
    "layer norm": lambda h, m, w: torch.nn.functional.layer_norm(h, h.shape[-1:], w[0]),  # (weighted: a mean
    # over the features of a layer norm without one is 0, its gradients rounding noise)
    "masked": _masked,
    "double": lambda h, m, w: h.double(),
}
# Ops that collapse the positions: [B, ...] or a scalar
COLLAPSE = {
    "mean": lambda h, m, w: h.mean(1),
    "sum": lambda h, m, w: h.sum(1),
    "max": lambda h, m, w: h.amax(1),
    "max over the batch": lambda h, m, w: h.amax(0),
    "cumsum": lambda h, m, w: h.cumsum(1)[:, -1],
    "logsumexp": lambda h, m, w: h.logsumexp(1),
    "var": lambda h, m, w: h.var(1),
    "softmax pooling": lambda h, m, w: (torch.softmax(h.sum(-1), 1)[..., None] * h).sum(1),
    "gram": lambda h, m, w: h.transpose(1, 2) @ h,
    "flip": lambda h, m, w: h.flip(1)[:, 0],
    "first token": lambda h, m, w: h[:, 0],
    "last two positions": lambda h, m, w: h[:, -2:].mean(1),
    "positions picked": lambda h, m, w: h.index_select(1, torch.tensor([0, 6])).amax(1),
    "positions indexed": lambda h, m, w: h[:, torch.tensor([1, 7])].sum(1),
    "masked mean": lambda h, m, w: _masked(h, m).sum(1) / m.sum(1, keepdim=True).to(h.dtype),
    "attention pooling": lambda h, m, w: torch.nn.functional.scaled_dot_product_attention(
        h.new_ones(h.shape[0], 1, 1, h.shape[-1]), h[:, None], h[:, None]),
    "masked attention pooling": lambda h, m, w: torch.nn.functional.scaled_dot_product_attention(
        h.new_ones(h.shape[0], 1, 1, h.shape[-1]), h[:, None], h[:, None], attn_mask=m.bool()[:, None, None, :]),
    "whole mean": lambda h, m, w: h.mean(),
    "flattened max": lambda h, m, w: h.reshape(h.shape[0], -1).amax(1),  # (a view merging the positions)
    "features gathered": lambda h, m, w: h.gather(2, torch.zeros_like(h[..., :3], dtype=torch.long)).sum(1),
    "features indexed": lambda h, m, w: h.unflatten(-1, (4, 8))[:, :, torch.tensor([0, 1]), torch.tensor([2, 3])].sum(1),
    "positions gathered": lambda h, m, w: h.gather(1, torch.tensor([0, 6]).expand(h.shape[0], -1)[..., None].expand(
        -1, -1, h.shape[-1])).sum(1),
}


class Chain(torch.nn.Module):
    def __init__(self, keep: list[str], collapse: str):
        super().__init__()
        cfg = transformers.BertConfig(vocab_size=100, attn_implementation="eager", **SMALL)
        self.encoder = transformers.BertModel(cfg, add_pooling_layer=False).eval()
        self.w = torch.nn.Parameter(torch.randn(32, 32) / 32 ** 0.5)
        self.keep, self.collapse = keep, collapse

    def forward(self, input_ids, attention_mask):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        for k in self.keep:
            h = KEEP[k](h, attention_mask, self.w if h.dtype == self.w.dtype else self.w.double())
        return COLLAPSE[self.collapse](h, attention_mask, self.w)


def _case(seed: int) -> tuple[list[str], str]:
    rnd = random.Random(seed)
    collapse = list(COLLAPSE)[(seed // 2) % len(COLLAPSE)]  # (each once inferring, once training)
    return rnd.sample(list(KEEP), rnd.randint(0, 2)), collapse


def _run(model, run, ids, mask, R):
    """The output, and with a cotangent `R` every parameter's gradient of (output * R).sum()."""
    if R is None:
        with torch.no_grad():
            return run(ids, mask), []
    params = list(model.parameters())
    for p in params:
        p.grad = None
    out = run(ids, mask)
    (out * R).sum().backward()
    return out.detach(), [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]


@pytest.mark.parametrize("seed", range(2 * len(COLLAPSE)))
def test_a_chain_after_the_encoder_is_eagers(seed):
    """Odd seeds train: every parameter's gradient of a random cotangent is eager's too (judged against
    the largest). Every third seed pads on the left, except where the first token is picked (a padding
    position then: the graph outputs' contract, not a reader). Half the seeds compile with
    dynamic=True and run a second batch of other sizes through the same graph."""
    torch.manual_seed(seed)
    keep, collapse = _case(seed)
    model = Chain(keep, collapse).train(seed % 2 == 1)
    dynamic = seed % 4 in (1, 2)
    compiled = torch.compile(model, backend="dmfx", options=UNPAD, dynamic=dynamic or None)
    g = torch.Generator().manual_seed(seed)
    for B, S, lengths in [(3, 9, (5, 9, 7)), (2, 12, (12, 6))][:2 if dynamic else 1]:
        ids = torch.randint(2, 100, (B, S), generator=g)
        mask = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).long()  # (right: token 0 is real)
        if seed % 3 == 0 and collapse != "first token":
            mask = mask.flip(1)
        ids = ids.masked_fill(mask == 0, 0)
        R = None
        if model.training:
            with torch.no_grad():
                R = torch.randn(model(ids, mask).shape, generator=g, dtype=torch.float64 if "double" in keep else None)
        ref, ref_grads = _run(model, model, ids, mask, R)
        out, grads = _run(model, compiled, ids, mask, R)
        record = dmfx.records()[-1]
        why = [m for m in record.missed if m.startswith("unpad")]
        assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (keep, collapse, S, record.fired.get("unpad"), why)
        if grads:
            largest = max(g.abs().max() for g in ref_grads)
            worst = max((a - b).abs().max() for a, b in zip(grads, ref_grads))
            assert worst <= 1e-5 * largest, (keep, collapse, S, float(worst / largest), record.fired.get("unpad"), why)
    assert len(dmfx.records()) == 1  # (a symbolic graph ran the second batch)
    if collapse in ("masked mean", "first token", "masked attention pooling") and "masked" not in keep:
        assert record.fired.get("unpad"), (keep, collapse, why)  # (nothing reads the padding: unpadded)


# Ops between two encoder layers: a value computed from the first layer's output read back by the
# second, which runs on the packed tokens. Those that put a position's value at another position (a
# slice, a pick, a permutation, an outer product over the tokens) read a padding position's value
# into real tokens where the padding is there: the graph stays padded. Those that keep each position
# (or zero the padding first) are unpadded.
BETWEEN = {
    "last position added": (lambda h, m: h + h[:, -1:], False),
    "last position picked and added": (lambda h, m: h + h[:, -1, None], False),
    "last position expanded": (lambda h, m: h + h[:, -1:].expand(-1, h.shape[1], -1), False),
    "positions permuted": (lambda h, m: h[:, torch.arange(h.shape[1]).flip(0)], False),
    "outer product over the tokens": (lambda h, m: (h[:, :, None] * h[:, None]).sum(2) / h.shape[1], False),
    "outer difference over the tokens": (lambda h, m: (h[:, :, None] - h[:, None]).abs().amax(2), False),
    "masked mean added": (lambda h, m: h + (h * m[..., None]).sum(1, keepdim=True) / m.sum(1)[:, None, None], True),
    "features permuted": (lambda h, m: h.unflatten(-1, (4, 8)).transpose(-1, -2).flatten(-2), True),
    "scaled by position": (lambda h, m: h * torch.arange(h.shape[1], dtype=h.dtype)[None, :, None] / 8, True),
    "positions regrouped with the features": (lambda h, m: h + h.reshape(3, 32, 9).transpose(1, 2), False),
}


@pytest.mark.parametrize("way", list(BETWEEN))
def test_a_value_read_back_between_layers_is_eagers(way):
    """Training, right padding (the last position is padding in two rows): the outputs at real positions
    and every parameter gradient of a random cotangent over them are eager's; the pass unpads exactly
    where no real token reads another position's value."""
    op, unpads = BETWEEN[way]
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, attn_implementation="eager", **{**SMALL, "num_hidden_layers": 2})
    model = transformers.BertModel(cfg, add_pooling_layer=False).train()
    masks = []
    model.encoder.layer[0].register_forward_hook(lambda mod, args, out: op(out, masks[-1]))

    def run(ids, mask):
        masks.append(mask.to(torch.float32))
        return model(input_ids=ids, attention_mask=mask).last_hidden_state

    g = torch.Generator().manual_seed(1)
    mask = (torch.arange(9)[None, :] < torch.tensor([5, 9, 7])[:, None]).long()
    ids = torch.randint(2, 100, (3, 9), generator=g).masked_fill(mask == 0, 0)
    real = mask.bool()[..., None]
    R = torch.randn(3, 9, 32, generator=g) * real
    why = _compare(way, model, run, ids, mask, R, unpads, real)
    if not unpads:
        assert any("back in the unpadded region" in m or "outer product" in m for m in why), why


# The padding masked out after the encoder (a product with the mask, a fill, a where, an index_put of a
# number), some at sizes that coincide (B == S, S == H): only a mask whose batch and sequence dims meet
# the value's own, and that is 0 (or, filled, true) at its padding positions, gives eager's values there.
# (batch, length, the op, whether the pass unpads)
MASKINGS = {
    "mask": (6, 6, lambda h, m: (h * m[..., None]).sum(1), True),
    "mask unsqueezed and expanded": (6, 6, lambda h, m: (h * m.unsqueeze(-1).expand(h.shape)).sum(1), True),
    "mask flattened with the value": (6, 6, lambda h, m: (h.flatten(0, 1) * m.reshape(-1, 1)).sum(0), True),
    "mask after a linear layer": (6, 6, lambda h, m: ((h @ torch.eye(32).flip(0)) * m[..., None]).sum(1), True),
    "mask after a batched GEMM": (6, 6, lambda h, m: (torch.bmm(h, torch.eye(32).expand(6, 32, 32)) * m[..., None]).sum(1),
                                  True),
    "mask after a GEMM over the batch": (6, 6, lambda h, m: ((torch.eye(6) @ h.flatten(1)).view(h.shape) * m[..., None]).sum(1),
                                         False),
    "E5's average pool (a fill)": (3, 9, lambda h, m: h.masked_fill(~m[..., None].bool(), 0.0).sum(1) / m.sum(1)[:, None],
                                   True),
    "where": (3, 9, lambda h, m: torch.where(m.bool()[..., None], h, 0.0).sum(1), True),
    "one minus one minus the mask": (3, 9, lambda h, m: (h * (1 - (1 - m))[..., None]).sum(1), True),
    "max pooling (a fill of -inf)": (3, 9, lambda h, m: h.masked_fill(m[..., None] == 0, float("-inf")).amax(1), True),
    "sentence-transformers' max pooling": (3, 9, lambda h, m: torch.max(h.clone().index_put_(
        (m[..., None].expand(h.shape) == 0,), torch.tensor(-1e9)), 1)[0], True),
    "a fill where the mask is 1": (3, 9, lambda h, m: h.masked_fill(m[..., None] == 1, 0.0).sum(1), False),
    "where, the wrong way round": (3, 9, lambda h, m: torch.where(m.bool()[..., None], 0.0, h).sum(1), False),
    "a fill of positions (an integer index)": (3, 9, lambda h, m: h.clone().index_put_(
        (1 - m.long(),), torch.tensor(-1e9)).amax(1), False),
    "mask transposed": (6, 6, lambda h, m: (h * m.T[..., None]).sum(1), False),
    "value transposed": (6, 6, lambda h, m: (h.transpose(0, 1) * m[..., None]).sum(0), False),
    "mask along the features": (3, 32, lambda h, m: (h * m[:, None, :]).sum(1), False),
    "positions permuted, then masked": (3, 9, lambda h, m: (h[:, torch.arange(9).flip(0)] * m[..., None]).sum(1), False),
}


# Readers after the encoder that a pick, a loss or a norm hides (some at sizes that coincide): a batch
# row is not a position, several positions per row are not a pick, a loss whose classes are the
# positions or a norm over them reads them all. (batch, length, the op, whether the pass unpads)
READS = {
    "a batch row summed": (3, 9, lambda h, m: h[0].sum(0), False),
    "a batch row masked": (3, 9, lambda h, m: (h[0] * m[..., None]).sum(1), False),
    "the first row masked": (3, 9, lambda h, m: (h[:1] * m[..., None]).sum(1), False),
    "two positions per row indexed": (3, 9, lambda h, m: h[torch.arange(3)[:, None], torch.tensor([[0, 6]] * 3)].sum(1),
                                      False),
    "the last real token per row": (3, 9, lambda h, m: h[torch.arange(3), m.sum(1).long() - 1], True),
    "a loss per row over the positions": (3, 9, lambda h, m: torch.nn.functional.cross_entropy(
        h.sum(-1), torch.tensor([1, 2, 0]), reduction="none"), False),
    "a norm over the positions": (3, 9, lambda h, m: torch.nn.functional.layer_norm(h.transpose(1, 2), (9,))[..., 0], False),
    "a feature picked (S == H)": (2, 32, lambda h, m: h.transpose(0, 1)[:, :, 0].sum(0), False),
    "positions regrouped with the features": (3, 9, lambda h, m: h.reshape(3, 32, 9).transpose(1, 2).sum(-1), False),
}


@pytest.mark.parametrize("way", list(MASKINGS))
def test_the_mask_masks_only_where_its_dims_meet_the_values(way):
    """Training, right padding: the pooled output and every parameter gradient of a random cotangent are
    eager's. A product with the mask transposed, along the features, or after the positions moved
    reads eager's values at padding positions (those of another row or dim), so the graph stays
    padded; the sizes alone (B == S, S == H) cannot tell it from a masked pooling. Fills, wheres and
    index_puts of a number at the padding (E5's and sentence-transformers' poolings) unpad, the wrong
    way round they do not."""
    _check_after_the_encoder(way, *MASKINGS[way])


@pytest.mark.parametrize("way", list(READS))
def test_a_reader_behind_a_pick_a_loss_or_a_norm_is_found(way):
    """As above: the graph stays padded, with eager's result and gradients, where the op reads the
    padding; GPT-2's last real token per row is a pick (unpadded)."""
    _check_after_the_encoder(way, *READS[way])


def _check_after_the_encoder(way, B, S, op, unpads):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, attn_implementation="eager", **SMALL)
    model = transformers.BertModel(cfg, add_pooling_layer=False).train()

    def run(ids, mask):
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state
        return op(h, mask.to(h.dtype))

    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([*torch.randint(1, S, (B - 1,), generator=g).tolist(), S])  # (row 0 padded, the last full)
    mask = (torch.arange(S)[None] < lengths[:, None]).long()
    ids = torch.randint(2, 100, (B, S), generator=g).masked_fill(mask == 0, 0)
    with torch.no_grad():
        R = torch.randn(run(ids, mask).shape, generator=g)
    _compare(way, model, run, ids, mask, R, unpads)


def _compare(way, model, run, ids, mask, R, unpads, real=None):
    """Eager's output (at the `real` positions, where given) and every parameter gradient of (out * R).sum()
    under unpad, which unpads the graph exactly when `unpads`; its misses."""
    ref, ref_grads = _run(model, run, ids, mask, R)
    out, grads = _run(model, torch.compile(run, backend="dmfx", options=UNPAD), ids, mask, R)
    if real is not None:
        ref, out = ref * real, out * real  # (padding positions: the graph outputs' contract)
    record = dmfx.records()[-1]
    why = [m for m in record.missed if m.startswith("unpad")]
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (way, record.fired.get("unpad"), why)
    largest = max(g.abs().max() for g in ref_grads)
    assert max((a - b).abs().max() for a, b in zip(grads, ref_grads)) <= 1e-5 * largest, (way, why)
    assert bool(record.fired.get("unpad")) == unpads, (way, why)
    return why


def test_a_masked_value_read_back_in_another_layout_stays_padded():
    """Between two layers, with S == H: ``h + (h * mask).transpose(1, 2)`` has the shape of a token
    tensor, so the region took the transposed value as one (its rewrite then failed at run time in
    dmfx::unpad_index's shape check). Its axes are not the region's: the graph stays padded."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, attn_implementation="eager", **{**SMALL, "num_hidden_layers": 2})
    model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    masks = []
    model.encoder.layer[0].register_forward_hook(lambda mod, args, out: out + (out * masks[-1][..., None]).transpose(1, 2))

    def run(ids, mask):
        masks.append(mask.to(torch.float32))
        return model(input_ids=ids, attention_mask=mask).last_hidden_state

    mask = (torch.arange(32)[None, :] < torch.tensor([20, 32])[:, None]).long()
    ids = torch.randint(2, 100, (2, 32), generator=torch.Generator().manual_seed(1)).masked_fill(mask == 0, 0)
    with torch.no_grad():
        ref = run(ids, mask)
        out = torch.compile(run, backend="dmfx", options=UNPAD)(ids, mask)
    why = [m for m in dmfx.records()[-1].missed if m.startswith("unpad")]
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), why
    assert not dmfx.records()[-1].fired.get("unpad") and any("another layout" in m for m in why), why
