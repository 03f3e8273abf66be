"""TEMPORARY development shim (deleted when the attention family's varlen kernels land): the varlen
attention ops' schemas with pure-PyTorch kernels, so the unpad pass can be built and tested first."""

from __future__ import annotations

import torch

from ._library import LIB

if not hasattr(torch.ops.dmfx, "varlen_attention"):
    LIB.define("varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale, bool causal, Tensor? seed, "
               "float p) -> (Tensor out, Tensor stats)")
    LIB.define("varlen_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor stats, "
               "Tensor cu_seqlens, float scale, bool causal, Tensor? seed, float p) -> (Tensor dq, Tensor dk, Tensor dv)")
    LIB.define("qkv_varlen_attention(Tensor qkv, int heads, Tensor cu_seqlens, float scale, bool causal, Tensor? seed, "
               "float p) -> (Tensor out, Tensor stats)")
    LIB.define("qkv_varlen_attention_backward(Tensor grad_out, Tensor qkv, int heads, Tensor out, Tensor stats, "
               "Tensor cu_seqlens, float scale, bool causal, Tensor? seed, float p) -> Tensor")

    def _fwd(q, k, v, cu, scale, causal, seed, p):
        T, Hq, _ = q.shape
        g = Hq // k.shape[1]
        out = q.new_zeros((T, Hq, v.shape[2]))
        stats = q.new_zeros((2, Hq, T), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        c = cu.tolist()
        for b in range(len(c) - 1):
            s, e = c[b], c[b + 1]
            if e == s:
                continue
            Q = q[s:e].transpose(0, 1).float()
            K = k[s:e].transpose(0, 1).repeat_interleave(g, 0).float()
            V = v[s:e].transpose(0, 1).repeat_interleave(g, 0).float()
            z = Q @ K.transpose(-1, -2) * scale
            if causal:
                n = e - s
                z = z.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            P = torch.softmax(z, -1)
            out[s:e] = (P @ V).transpose(0, 1).to(q.dtype)
        return out, stats

    def _bwd(go, q, k, v, out, stats, cu, scale, causal, seed, p):
        T, Hq, _ = q.shape
        g = Hq // k.shape[1]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        c = cu.tolist()
        for b in range(len(c) - 1):
            s, e = c[b], c[b + 1]
            if e == s:
                continue
            Q = q[s:e].transpose(0, 1).float()
            K = k[s:e].transpose(0, 1).repeat_interleave(g, 0).float()
            V = v[s:e].transpose(0, 1).repeat_interleave(g, 0).float()
            G = go[s:e].transpose(0, 1).float()
            z = Q @ K.transpose(-1, -2) * scale
            if causal:
                n = e - s
                z = z.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            P = torch.softmax(z, -1)
            dV = P.transpose(-1, -2) @ G
            dP = G @ V.transpose(-1, -2)
            dS = P * (dP - (dP * P).sum(-1, keepdim=True)) * scale
            dQ, dK = dS @ K, dS.transpose(-1, -2) @ Q
            dq[s:e] = dQ.transpose(0, 1).to(q.dtype)
            hk = k.shape[1]
            dk[s:e] = dK.view(hk, g, e - s, -1).sum(1).transpose(0, 1).to(k.dtype)
            dv[s:e] = dV.view(hk, g, e - s, -1).sum(1).transpose(0, 1).to(v.dtype)
        return dq, dk, dv

    def _split(qkv, heads):
        T = qkv.shape[0]
        per = qkv.view(T, 3, heads, qkv.shape[1] // (3 * heads))
        return per[:, 0], per[:, 1], per[:, 2]

    for name, fn in {
        "varlen_attention": _fwd,
        "varlen_attention_backward": _bwd,
        "qkv_varlen_attention": lambda qkv, heads, cu, scale, causal, seed, p: _fwd(*_split(qkv, heads), cu, scale, causal,
                                                                                    seed, p),
        "qkv_varlen_attention_backward": lambda go, qkv, heads, out, stats, cu, scale, causal, seed, p: torch.cat(
            [t.reshape(t.shape[0], -1) for t in _bwd(go, *_split(qkv, heads), out, stats, cu, scale, causal, seed, p)], 1),
    }.items():
        LIB.impl(name, fn, "CompositeExplicitAutograd")

    @torch.library.register_fake("dmfx::varlen_attention")
    def _f1(q, k, v, cu, scale, causal, seed, p):
        return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), q.new_empty((2, q.shape[1], q.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("dmfx::varlen_attention_backward")
    def _f2(go, q, k, v, out, stats, cu, scale, causal, seed, p):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    @torch.library.register_fake("dmfx::qkv_varlen_attention")
    def _f3(qkv, heads, cu, scale, causal, seed, p):
        T = qkv.shape[0]
        D = qkv.shape[1] // (3 * heads)
        return qkv.new_empty((T, heads, D)), qkv.new_empty((2, heads, T), dtype=torch.float32)

    @torch.library.register_fake("dmfx::qkv_varlen_attention_backward")
    def _f4(go, qkv, heads, out, stats, cu, scale, causal, seed, p):
        return qkv.new_empty(qkv.shape)

    def _setup(ctx, inputs, output):
        ctx.inputs = inputs
        ctx.out = output

    def _backward(ctx, go, gstats):
        q, k, v, cu, scale, causal, seed, p = ctx.inputs
        out, stats = ctx.out
        dq, dk, dv = torch.ops.dmfx.varlen_attention_backward(go, q, k, v, out, stats, cu, scale, causal, seed, p)
        return dq, dk, dv, None, None, None, None, None

    def _setup_qkv(ctx, inputs, output):
        ctx.inputs = inputs
        ctx.out = output

    def _backward_qkv(ctx, go, gstats):
        qkv, heads, cu, scale, causal, seed, p = ctx.inputs
        out, stats = ctx.out
        return (torch.ops.dmfx.qkv_varlen_attention_backward(go, qkv, heads, out, stats, cu, scale, causal, seed, p),
                None, None, None, None, None, None)

    torch.library.register_autograd("dmfx::varlen_attention", _backward, setup_context=_setup)
    torch.library.register_autograd("dmfx::qkv_varlen_attention", _backward_qkv, setup_context=_setup_qkv)
