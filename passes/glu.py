"""Gated activations: ``act(gate) * up`` (SwiGLU, GeGLU; separate or stacked projections) ->
``dmfx::glu``, whose backward computes both gradients in one kernel instead of the activation's
backward and two multiplications."""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from .fusion import Fusion, Match, Miss, Replacement
from .graph_utils import PassContext, activation_name, aten, commuted, insert_call, kernel_friendly, only_user, same_shape, tensor_meta


def match_glu(act: Node, ctx: PassContext) -> Match | Miss | None:
    """`act` (GELU, SiLU or tanh; not ReLU) read only by a multiplication with a tensor of its shape."""
    name = activation_name(act)
    if name is None or name == "relu" or len(act.users) != 1:
        return None
    mul = only_user(act)
    for a, up in commuted(mul, aten.mul):
        if a is not act or not isinstance(up, Node) or up is act:
            continue
        gm_, um, om = tensor_meta(act.args[0]), tensor_meta(up), tensor_meta(mul)
        if not (kernel_friendly(gm_) and um is not None and om is not None):
            continue
        if not (same_shape(gm_.shape, um.shape) and same_shape(um.shape, om.shape) and gm_.dtype == um.dtype == om.dtype
                and gm_.device == um.device):
            return Miss("gate and up differ in shape, dtype or device (broadcast)", at=mul)
        return Match({"gate": act.args[0], "up": up, "act": name, "mul": mul}, [act, mul], returned=(mul,))
    return None


def rewrite_glu(graph: Graph, m: Match, ctx: PassContext) -> Replacement:
    with graph.inserting_before(m["mul"]):
        fused = insert_call(graph, ctx, torch.ops.dmfx.glu.default, (m["gate"], m["up"], m["act"]))
    return Replacement(fused, {m["mul"]: fused})


#: act(gate) * up -> dmfx::glu.
GLU = Fusion("glu", (aten.gelu, aten.silu, aten.tanh), match_glu, rewrite_glu)
