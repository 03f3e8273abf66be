"""The softcap fusion (passes/softcap.py): Gemma 2's soft-capped logits, ``tanh(z / cap) * cap`` read by a
loss, become dmfx::softcap, whose backward reads its output, so a training step keeps one
``[tokens, vocab]`` tensor fewer (the fused loss keeps the same capped logits); near-misses (a scaled
tanh that is not a cap, inference, the tanh read elsewhere) are left alone with their reason, and a
soft cap no loss reads (an attention's) is not this fusion's. End to end: Gemma 2 with its labels, its
loss, logits and gradients as eager's, under fuse="all" and under the default loss-only rewrite, the cap's
backward folded into the loss's (passes/backward/fold_softcap_grad.py)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import check_same, rel_err, rewrite

import dmfx

aten, dmfx_ops = torch.ops.aten, torch.ops.dmfx
N, V, CAP = 24, 301, 3.0


def capped_loss(z, t):  # Gemma2ForCausalLM: the cap in the logits' dtype, then HF's loss (upcast, view)
    logits = torch.tanh(z / CAP) * CAP
    return F.cross_entropy(logits.float().view(-1, V), t.view(-1), ignore_index=-100), logits


def _inputs(dtype=torch.float32, grad=True):
    z = (4 * torch.randn(2, N // 2, V)).to(dtype).requires_grad_(grad)  # logits of about 4: the cap bends them
    t = torch.randint(0, V, (2, N // 2))
    t[0, :3] = -100
    return z, t


def _softcaps(gm):
    return [n for n in gm.graph.nodes if n.target is dmfx_ops.softcap.default]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_soft_capped_logits_of_a_loss_are_one_op(dtype):
    z, t = _inputs(dtype)
    gm, ctx = rewrite(capped_loss, z, t)
    assert ctx.fired.get("softcap") == 1 and ctx.fired.get("cross_entropy") == 1, (ctx.fired, ctx.missed)
    (n,) = _softcaps(gm)
    assert n.args[1] == CAP
    assert not [x for x in gm.graph.nodes if x.target in (aten.tanh.default, aten.div.Tensor)]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    check_same(capped_loss, gm, z, t, tol=tol)
    loss, logits = gm(z, t)
    want_loss, want_logits = capped_loss(z, t)
    R = torch.randn_like(want_logits, dtype=torch.float32).to(dtype)
    (got,) = torch.autograd.grad(loss + (logits * R).float().sum(), z)
    (want,) = torch.autograd.grad(want_loss + (want_logits * R).float().sum(), z)
    assert rel_err(got.float(), want.float()) < tol


def _large_saved(fn, *args) -> int:
    """How many distinct storages of at least [N, V] elements `fn`'s autograd keeps for the backward."""
    kept = {}

    def pack(x):
        if x.numel() >= N * V:
            kept[x.untyped_storage().data_ptr()] = x.numel()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn(*args)
    del out
    return len(kept)


def test_the_step_keeps_one_logits_sized_tensor_fewer():
    """Eager (and the fused loss alone) keep the tanh's output and the capped logits; with the cap fused
    the capped logits are all: dmfx::softcap's backward and dmfx::cross_entropy's read the same tensor."""
    z, t = _inputs()
    loss_only, _ = rewrite(capped_loss, z, t, passes=["cross_entropy"])
    both, ctx = rewrite(capped_loss, z, t, passes=["softcap", "cross_entropy"])
    assert ctx.fired.get("softcap") == 1
    assert _large_saved(capped_loss, z, t) == 2  # eager: tanh(z / cap) and log_softmax's output
    assert _large_saved(loss_only, z, t) == 2  # the tanh's output and the capped logits
    assert _large_saved(both, z, t) == 1


def test_the_cap_written_as_a_product_fires_too():
    def fn(z, t):  # z * (1 / cap), and cap * tanh(.)
        logits = CAP * torch.tanh(z * (1 / CAP))
        return F.cross_entropy(logits.view(-1, V), t.view(-1))

    z, t = _inputs()
    gm, ctx = rewrite(fn, z, t)
    assert ctx.fired.get("softcap") == 1, ctx.missed
    check_same(fn, gm, z, t)


def test_near_misses_are_left_alone_with_their_reason():
    def missed(fn, z, t, why):
        gm, ctx = rewrite(fn, z, t)
        assert "softcap" not in ctx.fired and not _softcaps(gm), ctx.fired
        assert any(m.startswith("softcap at") and why in m for m in ctx.missed), ctx.missed
        check_same(fn, gm, z, t)

    def scaled_tanh(z, t):  # 2 * tanh(z / 3): a scaled tanh, not a cap
        return F.cross_entropy((torch.tanh(z / 3.0) * 2.0).view(-1, V), t.view(-1))

    missed(scaled_tanh, *_inputs(), why="the scale inside the tanh is not 1 / cap")
    missed(capped_loss, *_inputs(grad=False), why="not in training")

    def negative_cap(z, t):
        return F.cross_entropy((torch.tanh(z / -3.0) * -3.0).view(-1, V), t.view(-1))

    missed(negative_cap, *_inputs(), why="not a positive finite constant")

    def inner_read(z, t):  # the scaled logits are an output too
        s = z / CAP
        return F.cross_entropy((torch.tanh(s) * CAP).view(-1, V), t.view(-1)), s

    missed(inner_read, *_inputs(), why="read elsewhere")


def test_not_its_chain_where_no_loss_reads_it_or_the_tanh_is_read():
    def attention_like(z):  # Gemma 2's attention scores: a softmax, not a loss, reads the cap
        return torch.softmax(torch.tanh(z / CAP) * CAP, -1)

    def tanh_returned(z, t):
        th = torch.tanh(z / CAP)
        return F.cross_entropy((th * CAP).view(-1, V), t.view(-1)), th

    z, t = _inputs()
    for fn, args in ((attention_like, (z,)), (tanh_returned, (z, t))):
        gm, ctx = rewrite(fn, *args)
        assert not _softcaps(gm) and not any(m.startswith("softcap") for m in ctx.missed), ctx.missed
        check_same(fn, gm, *args)


def _gemma2(vocab):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=8, num_hidden_layers=2, vocab_size=vocab, final_logit_softcapping=3.0)
    cfg._attn_implementation = "eager"
    return transformers.Gemma2ForCausalLM(cfg).train()


def _trains_as_eager(m, ids, options):
    ref = copy.deepcopy(m)
    dmfx.reset()
    out = torch.compile(m, backend="dmfx", options=options)(input_ids=ids, labels=ids, use_cache=False)
    want = ref(input_ids=ids, labels=ids, use_cache=False)
    R = torch.randn_like(want.logits)
    (out.loss + (out.logits * R).sum()).backward()
    (want.loss + (want.logits * R).sum()).backward()
    assert abs(out.loss.item() - want.loss.item()) < 1e-5 * abs(want.loss.item())
    assert rel_err(out.logits, want.logits) < 1e-5
    scale = max(p.grad.abs().max() for p in ref.parameters())
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() / scale < 1e-5, name
    (rec,) = dmfx.records()
    return rec


def test_gemma2_trains_as_eager_with_its_logits_capped_by_one_op():
    rec = _trains_as_eager(_gemma2(96), torch.randint(0, 96, (2, 12)), {"fuse": "all", "fallback": False})
    assert rec.fallback is None and rec.fired.get("softcap") == 1 and rec.fired.get("cross_entropy") == 1, rec.fired
    # the cap's backward runs inside the loss's (fold_softcap_grad)
    assert rec.fired.get("fold_softcap_grad") == 1, (rec.fired, rec.missed)
    backward = [n.target for n in rec.backward_graph.graph.nodes]
    assert dmfx_ops.softcap_backward.default not in backward and dmfx_ops.cross_entropy_backward.default in backward


def test_gemma2s_default_rewrites_its_loss_with_the_cap_where_the_logits_are_large():
    """fuse="auto" (compiler="inductor"): a large loss is rewritten for its loss only (dmfx.inductor.loss_pays);
    Gemma 2's soft cap sits between the LM head and the loss, and is the loss's: both fuse, the rest is
    Inductor's."""
    from dmfx.cuda_ops import selfcheck
    from dmfx.inductor import LARGE_LOGITS

    selfcheck.passes_to_skip(["cpu"])  # (the kernels built and checked: else the graph waits for them whole)
    vocab = 33000
    assert 2 * 16 * vocab >= LARGE_LOGITS
    rec = _trains_as_eager(_gemma2(vocab), torch.randint(0, vocab, (2, 16)), {"compiler": "inductor", "fallback": False})
    assert rec.fallback is None, rec.summary()
    assert rec.fired.get("softcap") == 1 and rec.fired.get("cross_entropy") == 1, rec.fired
    assert rec.fired.get("fold_softcap_grad") == 1, (rec.fired, rec.missed)
    assert not set(rec.fired) & {"rms_norm", "rope", "glu", "attention", "attention_softmax"}, rec.fired
