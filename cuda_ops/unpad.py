"""The unpad family: where the real tokens of a padded batch are.

``dmfx::unpad_index(Tensor mask) -> (Tensor indices, Tensor cu_seqlens)``
    ``mask`` ``[B, S]``: an HF padding mask (``attention_mask``: 1 for a real token, 0 for padding;
    bool, integer or floating point, padding on either side or in holes). ``indices`` (int64 ``[T]``)
    are the flat positions ``b * S + s`` of the real tokens in row-major order, so the packed tensor
    ``x.view(B * S, ...)[indices]`` holds sequence after sequence, each in position order;
    ``cu_seqlens`` (int32 ``[B + 1]``) their offsets: sequence b is packed rows
    ``cu_seqlens[b]:cu_seqlens[b + 1]``, as the varlen attention ops read them
    (``dmfx::varlen_attention``). T, the number of real tokens, depends on the mask's values: in a
    traced graph it is a data-dependent size (an unbacked SymInt), so a batch with another number of
    real tokens runs the same compiled graph, without a recompile.

    A mask value other than 0 and 1 raises ValueError: HF's own masks treat such values differently
    from one attention implementation to the next, so dmfx does not guess (the unpad pass, which
    emits this op, documents it). On CUDA finding the real tokens synchronizes with the host once
    (``nonzero``), as every unpadding implementation does (FlashAttention's ``unpad_input``).

``dmfx::unpad_targets(Tensor target, Tensor mask, Tensor indices, int ignore_index) -> Tensor``
    The targets of the real rows, ``target.reshape(-1)[indices]`` (``target`` ``[B * S]`` or
    ``[B, S]``, ``indices`` unpad_index's), for a loss computed on the real rows alone. Raises
    ValueError where a padding position's target is not ``ignore_index``: that position's loss term
    needs logits the packed rows do not have. A causal LM's shifted labels put the first real
    token's label on the padding position before it (left padding, holes); eager counts that term.

Both ops are computed with ATen ops (``nonzero``, ``cumsum``, ``index_select``), once per forward
pass: they have no kernel of their own and no autograd formula (their outputs are integer indices
and targets). The pass that emits them is passes/unpad.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._library import LIB, check_tensor

LIB.define("unpad_index(Tensor mask) -> (Tensor indices, Tensor cu_seqlens)")

LIB.define("unpad_targets(Tensor target, Tensor mask, Tensor indices, int ignore_index) -> Tensor")

OPS = ("unpad_index", "unpad_targets")


def _check_mask(mask: Tensor) -> None:
    check_tensor("unpad_index", "mask", mask)
    if mask.dim() != 2:
        raise ValueError(f"dmfx::unpad_index: mask must be a 2-D [batch, seq] padding mask, got shape {list(mask.shape)}")
    if mask.is_complex():
        raise TypeError(f"dmfx::unpad_index: mask must be bool, integer or floating point, got {mask.dtype}")


def _unpad_index(mask: Tensor) -> tuple[Tensor, Tensor]:
    _check_mask(mask)
    keep = mask if mask.dtype == torch.bool else mask != 0
    if mask.dtype != torch.bool and bool((keep & (mask != 1)).any()):
        bad = mask[keep & (mask != 1)][0].item()
        raise ValueError(
            f"dmfx::unpad_index: the padding mask (attention_mask) must hold only 0 (padding) and 1 (a real "
            f"token), got {bad}; pass a 0/1 mask, or compile without options={{'unpad': True}}"
        )
    indices = keep.reshape(-1).nonzero().reshape(-1)
    cu_seqlens = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=mask.device)
    torch.cumsum(keep.sum(1, dtype=torch.int32), 0, dtype=torch.int32, out=cu_seqlens[1:])
    return indices, cu_seqlens


LIB.impl("unpad_index", _unpad_index, "CompositeExplicitAutograd")


@torch.library.register_fake("dmfx::unpad_index")
def _unpad_index_fake(mask: Tensor) -> tuple[Tensor, Tensor]:
    _check_mask(mask)
    rows = mask.shape[0] * mask.shape[1]
    shape_env = getattr(torch.library.get_ctx(), "_shape_env", None)
    if shape_env is None:
        raise RuntimeError("dmfx::unpad_index: the number of real tokens is data-dependent; tracing it needs a "
                           "fake mode with a shape environment (torch.compile's)")
    # The number of real tokens: data-dependent, 0 to every position. Made directly rather than with
    # ctx.new_dynamic_size(), which Dynamo's shape environment refuses outside fullgraph=True: this
    # size is always valid, and dmfx (not Dynamo) emits the op.
    from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size

    tokens = shape_env.create_unbacked_symint()
    _constrain_range_for_size(tokens, min=0, max=rows if isinstance(rows, int) else None)
    return (mask.new_empty((tokens,), dtype=torch.int64),
            mask.new_empty((mask.shape[0] + 1,), dtype=torch.int32))


def _check_targets(target: Tensor, mask: Tensor, indices: Tensor) -> None:
    _check_mask(mask)
    check_tensor("unpad_targets", "target", target)
    check_tensor("unpad_targets", "indices", indices)
    if target.numel() != mask.numel() or target.dim() not in (1, 2):
        raise ValueError(f"dmfx::unpad_targets: target must hold one class index per position of the mask "
                         f"{list(mask.shape)} ([batch * seq] or [batch, seq]), got shape {list(target.shape)}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"dmfx::unpad_targets: target must hold integer class indices, got {target.dtype}")


def _unpad_targets(target: Tensor, mask: Tensor, indices: Tensor, ignore_index: int) -> Tensor:
    _check_targets(target, mask, indices)
    flat = target.reshape(-1)
    padding = (mask == 0).reshape(-1)
    counted = padding & (flat != ignore_index)
    if bool(counted.any()):
        where = counted.nonzero()[0].item()
        b, s = divmod(where, mask.shape[1])
        raise ValueError(
            f"dmfx::unpad_targets: the loss has target {flat[where].item()} at padding position [{b}, {s}] (not "
            f"ignore_index {ignore_index}): eager counts that term, from the position's logits, which unpad=True "
            f"does not compute. Give padding positions the label {ignore_index} (HF's collators do; labels=input_ids "
            f"does not). A causal LM shifts the labels by one, so with left padding (or padding inside a sequence) "
            f"each sequence's first real label falls on the padding before it: pad on the right, or label that token "
            f"{ignore_index}. Or compile without options={{'unpad': True}}")
    return flat.index_select(0, indices)


LIB.impl("unpad_targets", _unpad_targets, "CompositeExplicitAutograd")


@torch.library.register_fake("dmfx::unpad_targets")
def _unpad_targets_fake(target: Tensor, mask: Tensor, indices: Tensor, ignore_index: int) -> Tensor:
    _check_targets(target, mask, indices)
    return target.new_empty(indices.shape)


def unpad_index(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(indices, cu_seqlens) of the real tokens of the padding mask `mask` [B, S] (see the module
    docstring)."""
    check_tensor("unpad_index", "mask", mask)
    return torch.ops.dmfx.unpad_index(mask)


def unpad(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The real tokens of `x` [B, S, ...] packed: (x_packed [T, ...], indices, cu_seqlens)."""
    indices, cu_seqlens = unpad_index(mask)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).index_select(0, indices), indices, cu_seqlens


def pad(x_packed: Tensor, indices: Tensor, batch: int, seq: int) -> Tensor:
    """`x_packed` [T, ...] scattered back to [batch, seq, ...], zeros at the padding."""
    full = x_packed.new_zeros((batch * seq, *x_packed.shape[1:]))
    return full.index_copy(0, indices, x_packed).view(batch, seq, *x_packed.shape[1:])
