"""Fuzz of the unpad pass's mask check (passes/unpad.py, padding_mask_input and _probe_shapes): one
attention under a padding mask combined with a position mask of many kinds (causal, windows,
shifted, scaled and chunked windows, a prefix, the last keys of the length, positions added to
positions, a window over the real tokens' positions counted from the padding mask), with constants
drawn from a seed, as a bool or an additive mask, run under dynamic=True (and automatic dynamic
shapes) on padded batches of three lengths, each longer than the last, so a graph checked at one
length runs at another. Whatever the pass decides (unpad, guard, or leave alone), every real
position's output, and in training every gradient, is eager's. This is how a mask that hides keys
only past the lengths the pass probed shows: the scaled window did (a wrong answer, fixed by
_scaled_positions; 6 of these cases fail without it). And how a mask the pass needlessly refuses
shows: an additive mask's zeros, whose shape is the length, once read as scaled positions."""

import pytest
import torch

import dmfx

UNPAD = {"unpad": True, "fuse": "all", "cache": False}

# family -> keep(q, k, S, c0, c1, m): True where query position q may read key position k (before padding;
# m: the padding mask), [S, S] or [B, S, S]
FAMILIES = {
    "none": lambda q, k, S, c0, c1, m: torch.ones_like(q - k, dtype=torch.bool),
    "causal": lambda q, k, S, c0, c1, m: k <= q,
    "causal window": lambda q, k, S, c0, c1, m: (k <= q) & (q - k < c0),
    "window": lambda q, k, S, c0, c1, m: (q - k).abs() <= c0,
    "shifted window": lambda q, k, S, c0, c1, m: (q - k + c1).abs() <= c0,
    "scaled window": lambda q, k, S, c0, c1, m: (q - k).abs() // c1 <= c0,
    "scaled product": lambda q, k, S, c0, c1, m: (q - k) * c1 <= c0,
    "chunked": lambda q, k, S, c0, c1, m: q // c0 == k // c0,
    "prefix": lambda q, k, S, c0, c1, m: (k < c0) | (k <= q),
    "last keys": lambda q, k, S, c0, c1, m: k >= S - c0,
    "positions added": lambda q, k, S, c0, c1, m: (q + q - k - k).abs() <= c0,
    # (a window over the real tokens' own positions, counted from the padding mask: [B, S, S])
    "real-token window": lambda q, k, S, c0, c1, m: (m.cumsum(-1)[:, :, None] - m.cumsum(-1)[:, None, :]).abs() <= c0,
}
CASES = [(f, 0) for f in FAMILIES] + [(f, s) for f in ("scaled window", "chunked", "prefix", "last keys") for s in (1, 2)]
# (each case's mask is a bool one or, every other case, an additive one)


class MaskedAttention(torch.nn.Module):
    """One attention under FAMILIES[family] and the padding mask, as a bool mask or (`additive`) as HF's
    float one (0 where kept, finfo.min where hidden)."""

    def __init__(self, family: str, c0: int, c1: int, additive: bool, d=16, heads=2):
        super().__init__()
        self.keep, self.c0, self.c1, self.additive, self.heads = FAMILIES[family], c0, c1, additive, heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))

    def forward(self, x, attention_mask):
        B, S, D = x.shape
        pos = torch.arange(S, device=x.device)
        q_pos, k_pos = pos[:, None], pos[None, :]
        # (a query always reads itself: no row of a real token is hidden whole, which eager makes NaN)
        keep = self.keep(q_pos, k_pos, S, self.c0, self.c1, attention_mask) | (q_pos == k_pos)
        keep = (keep[None, None] if keep.dim() == 2 else keep[:, None]) & attention_mask[:, None, None, :].bool()
        if self.additive:
            keep = torch.zeros(keep.shape, dtype=x.dtype).masked_fill(~keep, torch.finfo(x.dtype).min)
        q, k, v = (f(x).view(B, S, self.heads, D // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.o(out.transpose(1, 2).reshape(B, S, D))


def padded(gen: torch.Generator, B: int, S: int) -> torch.Tensor:
    """A [B, S] padding mask as a batch padded to its longest sequence has: row 0 whole, the others
    right or left padded or with holes, a real token in every row."""
    mask = torch.ones(B, S, dtype=torch.long)
    for b in range(1, B):
        n = int(torch.randint(1, S + 1, (1,), generator=gen))
        kind = int(torch.randint(0, 3, (1,), generator=gen))
        if kind == 0:
            mask[b, n:] = 0
        elif kind == 1:
            mask[b, :S - n] = 0
        else:
            mask[b] = (torch.rand(S, generator=gen) < 0.6).long()
            mask[b, int(torch.randint(0, S, (1,), generator=gen))] = 1
    return mask


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic"])
@pytest.mark.parametrize("family,seed", CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_every_real_output_is_eagers(family, seed, dynamic):
    """Inference at three growing lengths: every real position's output is eager's, and the pass
    either unpadded each graph or said why not."""
    gen = torch.Generator().manual_seed(1000 * seed + sorted(FAMILIES).index(family))
    c0, c1 = int(torch.randint(2, 17, (1,), generator=gen)), int(torch.randint(2, 7, (1,), generator=gen))
    torch.manual_seed(seed)
    model = MaskedAttention(family, c0, c1, additive=CASES.index((family, seed)) % 2 == 1).eval()
    compiled = torch.compile(model, backend="dmfx", options=UNPAD, dynamic=dynamic)
    # (a first length that often hides no window, then longer ones past most thresholds)
    first = int(torch.randint(4, 13, (1,), generator=gen))
    lengths = [first, int(torch.randint(first + 1, 41, (1,), generator=gen)), int(torch.randint(60, 131, (1,), generator=gen))]
    with torch.no_grad():
        for i, S in enumerate(lengths):
            x = torch.randn(2 + i % 2, S, 16, generator=gen)
            mask = padded(gen, x.shape[0], S)
            real = mask.bool()
            out, ref = compiled(x, mask), model(x, mask)
            assert torch.allclose(out[real], ref[real], atol=1e-5), (family, c0, c1, lengths, S, dmfx.records())
    records = dmfx.records()
    assert records, "nothing compiled"
    for r in records:  # (the pass saw every attention: it fired, or it said why not)
        assert r.fired.get("unpad") or any(m.startswith("unpad") for m in r.missed), r.summary()
    if family == "none":  # (a padding mask alone: unpadded at every length)
        assert all(r.fired.get("unpad") == 1 for r in records), [r.missed for r in records]


@pytest.mark.parametrize("family", ["none", "causal", "chunked", "scaled window", "prefix"])
def test_every_gradient_is_eagers(family):
    """Training under dynamic=True, three lengths: the parameters' gradients through the real
    positions (a random cotangent, zero at the padding, whose outputs unpad leaves at zero) are
    eager's, judged against the largest."""
    gen = torch.Generator().manual_seed(7 + sorted(FAMILIES).index(family))
    torch.manual_seed(0)
    model = MaskedAttention(family, 8, 3, additive=family in ("causal", "prefix"))  # (6 tokens: within each window)
    compiled = torch.compile(model, backend="dmfx", options=UNPAD, dynamic=True)
    for B, S in [(2, 6), (3, 11), (2, 70)]:
        x, mask = torch.randn(B, S, 16, generator=gen), padded(gen, B, S)
        R = torch.randn(B, S, 16, generator=gen) * mask[..., None]
        grads = []
        for run in (compiled, model):
            model.zero_grad()
            (run(x, mask) * R).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        top = max(g.abs().max() for g in grads[1])
        for got, want in zip(*grads):
            assert (got - want).abs().max() <= 1e-5 * top, (family, S)
    assert any(r.fired.get("unpad") for r in dmfx.records()), [r.missed for r in dmfx.records()]
