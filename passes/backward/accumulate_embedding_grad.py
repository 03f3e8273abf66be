"""``accumulate_embedding_grad``: a tied embedding's gradient added into the LM head's weight gradient
in place, row by row, instead of through a dense ``[vocab, hidden]`` zero tensor.

When the input embedding and the LM head share one weight (BERT's MLM head, GPT-2, T5: HF's
``tie_word_embeddings``), the weight's gradient is the sum of two: the head's ``dlogitsᵀ @ hidden``
(a GEMM writing all ``[V, H]``) and the embedding's ``embedding_dense_backward`` (a zero ``[V, H]``
tensor with the token rows' gradients scattered into it). The backward graph adds them:
``add(mm, embedding_dense_backward(grad, indices, V, padding_idx, False))``, which writes a zero
``[V, H]`` tensor, scatters into it, then reads both and writes a third (for BERT's 30522 x 768 weight,
about 280 MB of traffic a step, against 3 MB of token rows). This pass rewrites it to
``index_put_(mm, [indices], grad rows, accumulate=True)``: the token rows are added into the GEMM's
own result, where it is (rows whose index is ``padding_idx`` contribute nothing, as in
``embedding_dense_backward``). Under autocast the head's GEMM runs in bf16/fp16 and its result is
upcast before the add (``add(_to_copy(mm, dtype=float32), embedding_dense_backward(...))``, the
embedding's gradient being float32): the rows go into the upcast copy, a fresh buffer too (BERT MLM,
bf16 autocast: a 94 MB zero fill and a 94 MB read fewer per step).

Only when the GEMM's result is a fresh buffer of this graph that nothing reads after the add (the
same condition as ``accumulate_into_gemm``), of the embedding gradient's shape and dtype, and the
embedding does not scale its gradient by frequency. Under ``compiler="inductor"`` the graph is
functionalized before Inductor sees it, and Inductor's own reinplacing pass puts the ``index_put``
back in place (the GEMM's result is dead after it).

Under Inductor the scatter is its generated loop (atomic adds over the token rows in parallel,
as Inductor compiles ``embedding_dense_backward`` itself): a token repeated in the batch may round
differently from run to run with more than one thread, unless
``torch.use_deterministic_algorithms(True)``. Under ``compiler="fx"`` it is ATen's ``index_put_``,
serial on the CPU.

Numerics: the token rows are added one by one into the GEMM's result instead of being summed first
and then added (a different rounding order; the same sum).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ..fusion import record
from ..graph_utils import PassContext, aten, insert_call, is_dtype_cast, is_op, plain_add, storage_root, val
from .accumulate_into_gemm import _writable_at


def _produced_by_gemm(n: Node) -> bool:
    """`n` is a GEMM's result, through views and transposes (``t(t(mm))`` in AOTAutograd's
    graphs for ``F.linear``'s weight gradient), or a dtype conversion of one: under autocast the head's
    GEMM runs in bf16/fp16 and its weight gradient is upcast (``_to_copy(t(t(mm)), dtype=float32)``)
    before the add. The conversion's result is then the fresh buffer the rows go into."""
    if is_dtype_cast(n):
        n = n.args[0]
    return is_op(storage_root(n), aten.mm.default, aten.addmm.default)


def accumulate_embedding_grad(gm: GraphModule, ctx: PassContext) -> None:
    """``add(gemm, embedding_dense_backward(g, idx, V, pad, False))`` ->
    ``index_put_(gemm, [idx], masked_fill(g, idx == pad, 0), accumulate=True)`` (module docstring)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in list(graph.nodes):
        pair = plain_add(n)
        if pair is None:
            continue
        for acc, emb in (pair, pair[::-1]):
            if not is_op(emb, aten.embedding_dense_backward.default) or len(emb.users) != 1:
                continue
            if not _produced_by_gemm(acc):
                continue
            grad, indices, _num_weights, padding_idx, scale_by_freq = emb.args[:5]
            if scale_by_freq:
                ctx.miss("accumulate_embedding_grad", n, "the embedding scales its gradient by token frequency")
                break
            v_acc, v_grad, v_idx = val(acc), val(grad), val(indices)
            if not all(isinstance(v, torch.Tensor) for v in (v_acc, v_grad, v_idx)) or v_acc.dtype != v_grad.dtype:
                ctx.miss("accumulate_embedding_grad", n, "the two gradients differ in dtype")
                break
            if storage_root(acc) in {storage_root(x) for x in (grad, indices) if isinstance(x, Node)}:
                ctx.miss("accumulate_embedding_grad", n, "the rows it would add are a view of the buffer they go into")
                break
            if not _writable_at(acc, n, order):
                ctx.miss("accumulate_embedding_grad", n, "the GEMM's result is read later, or is not this graph's own")
                break
            H = v_acc.shape[-1]
            if not isinstance(H, int):  # a symbolic size is no graph value the reshape could take
                ctx.miss("accumulate_embedding_grad", n, "the hidden size is symbolic")
                break
            with graph.inserting_before(n):
                rows = insert_call(graph, ctx, aten.reshape.default, (grad, [-1, H]))
                flat = insert_call(graph, ctx, aten.reshape.default, (indices, [-1]))
                if isinstance(padding_idx, int) and padding_idx >= 0:
                    is_pad = insert_call(graph, ctx, aten.eq.Scalar, (flat, padding_idx))
                    pad_rows = insert_call(graph, ctx, aten.unsqueeze.default, (is_pad, 1))
                    rows = insert_call(graph, ctx, aten.masked_fill.Scalar, (rows, pad_rows, 0.0))
                summed = graph.call_function(aten.index_put_.default, (acc, [flat], rows, True))
                summed.meta["val"] = val(acc)
            n.replace_all_uses_with(summed)
            record(ctx, "accumulate_embedding_grad", [n, emb], into=summed)
            graph.erase_node(n)
            graph.erase_node(emb)
            break
