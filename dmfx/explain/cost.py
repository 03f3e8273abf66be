"""The cost model of dmfx.explain: the paper's operator classes, and per op call its flop and the bytes
it reads and writes, from its argument and output tensors (fake values of a graph's nodes, or real
tensors at run time: both use ``op_cost``).

Bytes of a tensor: ``element_size * min(numel, extent)`` where extent is the span of memory its
strides address (an expanded bias is read once, not once per row). Views move no bytes. Flop: tensor
contractions use ``torch.utils.flop_counter``'s formulas; memory-bound ops are an estimate (a few flop
per output element), which is all they need at 0.2% of the total.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.fx import Node
from torch.utils._pytree import tree_flatten

from ..cuda_ops import ATTENTION_OPS as _ATTENTION_OPS
from ..passes.fusion import absorbed_ops
from ..passes.graph_utils import concrete_int

CONTRACTION = "tensor contraction"
NORMALIZATION = "statistical normalization"
ELEMENTWISE = "element-wise"
LAYOUT = "data layout"
FUSED = "fused"
VIEW = "view"
OTHER = "other"
CLASSES = (CONTRACTION, NORMALIZATION, ELEMENTWISE, LAYOUT, FUSED, OTHER, VIEW)
#: Classes whose ATen ops dmfx aims to fuse (dropout is element-wise, as in the paper).
MEMORY_BOUND = (NORMALIZATION, ELEMENTWISE)

VIEW_NOTE = "view: no data moved (0 bytes)"

_CONTRACTIONS = {
    "mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "addbmm", "matmul", "linear", "mv", "addmv", "dot", "vdot", "einsum",
    "convolution", "convolution_backward", "_convolution", "cudnn_convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
    "_efficient_attention_backward", "_int_mm", "_scaled_mm",
}
_NORMALIZATIONS = {
    "native_layer_norm", "native_layer_norm_backward", "layer_norm", "_fused_rms_norm", "_fused_rms_norm_backward",
    "rms_norm", "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data", "softmax",
    "log_softmax", "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional", "native_group_norm",
    "native_group_norm_backward", "batch_norm_backward",
    # reductions: the statistics of a normalization, or a bias gradient
    "sum", "mean", "var", "var_mean", "std", "std_mean", "amax", "amin", "max", "min", "logsumexp", "prod",
    "norm", "linalg_vector_norm", "any", "all", "argmax", "argmin",
}
_ELEMENTWISE_EXTRA = {
    "native_dropout", "native_dropout_backward", "dropout", "bernoulli", "bernoulli_", "_to_copy", "to",
    "masked_fill", "where", "fill", "fill_", "rand_like", "randn_like", "zeros_like", "ones_like", "full_like",
    "empty_like", "_masked_scale", "lerp", "addcmul", "addcdiv", "clamp_min", "clamp_max",
}
_LAYOUT = {
    "clone", "copy", "copy_", "_copy_from", "_copy_from_and_resize", "cat", "stack", "contiguous", "constant_pad_nd",
    "pad", "slice_scatter", "select_scatter", "as_strided_scatter", "diagonal_scatter", "index_select", "gather",
    "repeat", "roll", "flip", "tril", "triu", "lift_fresh_copy", "_unsafe_index", "index", "scatter", "scatter_add",
    "index_put", "_unsafe_index_put", "index_add", "new_empty_strided", "empty_strided", "alias_copy",
}
_NO_DATA = {
    "_assert_tensor_metadata", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset", "_assert_async",
    "_assert_scalar", "_local_scalar_dense", "empty", "new_empty", "_unsafe_view", "lift_fresh", "alias",
    "detach", "_functionalize_sync", "set_",
}
_GATHERS = {"embedding", "index_select", "gather", "index", "_unsafe_index"}  # read only the rows they return
# in place into the rows their indices name: they read and write those rows of the destination, not all of it
_SCATTERS_IN_PLACE = {"index_put_", "_unsafe_index_put_", "index_add_"}
_LAYOUT |= _SCATTERS_IN_PLACE
_MAY_COPY = {"reshape", "flatten", "contiguous"}  # a view when the strides allow it, else a copy
_FLOP_PER_ELEMENT = {
    "gelu": 8, "gelu_backward": 10, "silu": 4, "silu_backward": 6, "tanh": 4, "tanh_backward": 2, "sigmoid": 4,
    "sigmoid_backward": 2, "erf": 8, "exp": 2, "log": 2, "pow": 2, "rsqrt": 2, "sqrt": 2, "native_dropout": 2,
    "native_dropout_backward": 1, "native_layer_norm": 8, "native_layer_norm_backward": 12, "_softmax": 5,
    "_log_softmax": 5, "_softmax_backward_data": 4, "_log_softmax_backward_data": 4, "_fused_rms_norm": 5,
}





def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches reading or writing `t`: element size * min(numel, memory extent)."""
    sizes = [concrete_int(s) for s in t.shape]
    if any(s == 0 for s in sizes):
        return 0
    numel = math.prod(sizes)
    try:
        strides = [concrete_int(s) for s in t.stride()]
        extent = 1 + sum((s - 1) * abs(st) for s, st in zip(sizes, strides))
    except Exception:  # sparse / nested / no strides
        extent = numel
    return min(numel, extent) * t.element_size()


def _numel(t: torch.Tensor) -> int:
    return math.prod(concrete_int(s) for s in t.shape)


def tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def op_name(func: Any) -> str:
    """'aten::mm', 'dmfx::bias_dropout_residual_norm', ... (overload dropped)."""
    if isinstance(func, torch._ops.OpOverload):
        return f"{func.namespace}::{func._schema.name.split('::')[-1]}"
    if isinstance(func, torch._ops.OpOverloadPacket):
        return str(func._qualified_op_name)
    return getattr(func, "__name__", str(func))


def _base_name(func: Any) -> str:
    name = op_name(func).split("::")[-1]
    return name


def is_fused(func: Any) -> bool:
    return isinstance(func, torch._ops.OpOverload) and func.namespace == "dmfx"


def _moves_no_data(func: Any, args: Sequence[Any], out: Any) -> bool:
    name = _base_name(func)
    if func is operator.getitem or name in _NO_DATA:
        return True
    if name in _MAY_COPY:
        inp = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if inp is None or not isinstance(out, torch.Tensor):
            return False
        try:
            inp.view(out.shape)  # works iff the strides allow a view
            return True
        except RuntimeError:
            return False
    return bool(getattr(func, "is_view", False))


def classify(func: Any, args: Sequence[Any] = (), out: Any = None) -> str:
    """The paper's operator class of one op (``CLASSES``)."""
    if is_fused(func):
        return FUSED
    if _moves_no_data(func, args, out):
        return VIEW
    name = _base_name(func)
    if name in _MAY_COPY:
        return LAYOUT
    if name in _CONTRACTIONS:
        return CONTRACTION
    if name in _NORMALIZATIONS:
        return NORMALIZATION
    if name in _LAYOUT:
        return LAYOUT
    if name in _ELEMENTWISE_EXTRA or (isinstance(func, torch._ops.OpOverload) and torch.Tag.pointwise in func.tags):
        return ELEMENTWISE
    return OTHER


def _attention_cost(name: str, args: Sequence[Any]) -> tuple[int, int] | None:
    """(flop, bytes moved inside the op) of a dmfx attention op (None for other ops): the flop of its
    GEMMs, and for the unfused form (dmfx::attention) the [B, H, Lq, Lk] scores its GEMMs write and its
    softmax kernels read (forward: written and read once; backward: d(probs) written and read, d(scores)
    written and read twice). The fused form (flash) keeps them in cache; its backward recomputes Q·Kᵀ."""
    if name not in _ATTENTION_OPS:
        return None
    backward = name.endswith("backward")
    first = args[1] if backward else args[0]  # q, or the stacked qkv
    if name.startswith("qkv_"):
        B, L, F = (concrete_int(s) for s in first.shape)
        H = int(args[2] if backward else args[1])
        Lq = Lk = L
        D = Dv = F // (3 * H)
    else:
        k, v = (args[2], args[3]) if backward else (args[1], args[2])
        B, H, Lq, D = (concrete_int(s) for s in first.shape)
        Lk, Dv = concrete_int(k.shape[2]), concrete_int(v.shape[3])
    gemm = 2 * B * H * Lq * Lk * (D + Dv)  # Q·Kᵀ and P·V
    scores = B * H * Lq * Lk * first.element_size()
    if "flash" in name:
        return (2 * gemm + 2 * B * H * Lq * Lk * D if backward else gemm), 0
    return (2 * gemm if backward else gemm), (6 * scores if backward else 2 * scores)


_VARLEN_OPS = ("varlen_attention", "varlen_attention_backward", "qkv_varlen_attention", "qkv_varlen_attention_backward")


def _varlen_cost(name: str, args: Sequence[Any]) -> tuple[int, str] | None:
    """(flop, note) of a dmfx varlen attention op (option unpad; None for other ops): its GEMMs over the
    query-key pairs of each sequence, ``sum_b L_b^2`` per head, Q·Kᵀ and P·V forward, twice that and
    Q·Kᵀ again backward (flash: the scores stay in cache). The lengths are read from cu_seqlens where
    it holds values (the run-time counter); in a graph's fake values it does not, and the pairs are
    estimated as if the T packed tokens were B sequences of equal length (said in the note)."""
    if name not in _VARLEN_OPS:
        return None
    backward = name.endswith("backward")
    try:
        if name.startswith("qkv_"):
            qkv, heads, cu = (args[1], args[2], args[5]) if backward else (args[0], args[1], args[2])
            Hq = int(heads)
            D = Dv = concrete_int(qkv.shape[-1]) // (3 * Hq)
            T = concrete_int(qkv.shape[0])
        else:
            q, k, v, cu = (args[1], args[2], args[3], args[6]) if backward else (args[0], args[1], args[2], args[3])
            T, Hq, D = (concrete_int(s) for s in q.shape)
            Dv = concrete_int(v.shape[-1])
        B = concrete_int(cu.shape[0]) - 1
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(cu, FakeTensor) or cu.device.type == "meta":
            pairs, note = T * T // max(B, 1), "query-key pairs estimated as equal sequence lengths"
        else:
            lengths = (cu[1:] - cu[:-1]).to(torch.int64)
            pairs, note = int((lengths * lengths).sum()), ""
    except Exception:  # noqa: BLE001 (unknown sizes: priced as a memory-bound op)
        return None
    gemm = 2 * Hq * pairs * (D + Dv)
    return (2 * gemm + 2 * Hq * pairs * D if backward else gemm), note


def _linear_ce_cost(name: str, args: Sequence[Any], kwargs: dict) -> tuple[int, int] | None:
    """(flop, bytes moved inside the op) of dmfx::linear_cross_entropy and its backward (None for other
    ops): its GEMMs' flop, ``2 N V H`` each (the logits; dhidden and dweight where it computes them), and
    the ``[chunk, V]`` buffers that go through memory inside it, ``L = N V`` elements in all: the logits
    written and read (2 L), and where gradients are computed the logits read again, the dlogits written
    and read by both GEMMs (4 L more). A backward that only scales the forward's gradients does neither."""
    if name not in ("linear_cross_entropy", "linear_cross_entropy_backward"):
        return None
    backward = name.endswith("backward")

    def arg(i: int, key: str, default: Any = None) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    hidden, weight = arg(1, "hidden") if backward else arg(0, "hidden"), arg(2, "weight") if backward else arg(1, "weight")
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return None
    N, H, V = concrete_int(hidden.shape[0]), concrete_int(hidden.shape[1]), concrete_int(weight.shape[0])
    gemm, L = 2 * N * V * H, N * V * hidden.element_size()
    if backward:
        given = [arg(11 + i, k) for i, k in enumerate(("dhidden", "dweight", "dbias"))]
        redo = [bool(m) and g is None for m, g in zip(arg(10, "output_mask", [False] * 3), given)]
        if not any(redo):
            return 0, 0
        return gemm * (1 + redo[0] + redo[1]), 5 * L
    grads = [bool(g) for g in arg(8, "grads", [False] * 3)]
    if not any(grads):
        return gemm, 2 * L
    return gemm * (1 + grads[0] + grads[1]), 6 * L


def _flop(func: Any, cls: str, args: Sequence[Any], kwargs: dict, out: Any) -> int:
    if cls == CONTRACTION:
        from torch.utils.flop_counter import flop_registry

        fn = flop_registry.get(getattr(func, "overloadpacket", func))
        if fn is None and _base_name(func).endswith("_"):  # addmm_ (a GEMM accumulating in place): addmm's count
            fn = flop_registry.get(getattr(torch.ops.aten, _base_name(func).rstrip("_"), None))
        if fn is None:
            return 0
        try:
            return int(fn(*args, **kwargs, out_val=out))
        except Exception:
            return 0
    if cls in (VIEW, LAYOUT):
        return 0
    outs = tensors(out)
    if not outs:
        return 0
    elements = max(_numel(t) for t in outs)
    if cls == FUSED:  # a chain of a few element-wise ops and perhaps a normalization (attention: op_cost)
        elements = max([elements] + [_numel(t) for t in tensors(args)])
        return 8 * elements
    return _FLOP_PER_ELEMENT.get(_base_name(func), 1) * elements


@dataclass
class OpCost:
    op: str
    cls: str
    flop: int
    bytes_read: int
    bytes_written: int
    note: str = ""

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


def op_cost(func: Any, args: Sequence[Any], kwargs: dict | None, out: Any) -> OpCost:
    """Class, flop and bytes of one op call. The static analysis (fake values from the graph) and the
    run-time counter (real tensors in a TorchDispatchMode) both use this one function."""
    kwargs = kwargs or {}
    cls = classify(func, args, out)
    name = op_name(func)
    if cls == VIEW:
        return OpCost(name, cls, 0, 0, 0, VIEW_NOTE)
    written = sum(tensor_bytes(t) for t in tensors(out))
    if _base_name(func) in _GATHERS and args and isinstance(args[0], torch.Tensor):
        # a lookup reads the rows it returns, not the whole table
        read = min(tensor_bytes(args[0]), written) + sum(tensor_bytes(t) for t in tensors((args[1:], kwargs)))
    elif _base_name(func) in _SCATTERS_IN_PLACE and args and isinstance(args[0], torch.Tensor):
        # an in-place scatter (accumulate_embedding_grad's index_put_) reads its indices and values and
        # reads and writes the destination rows they name (at most the values' size), in place
        given = sum(tensor_bytes(t) for t in tensors((args[1:], kwargs)))
        values = max((tensor_bytes(t) for t in tensors(args[1:]) if t.is_floating_point()), default=0)
        touched = min(tensor_bytes(args[0]), values)
        read, written = given + touched, touched
    else:  # a tensor passed twice is read once (dmfx's identity backward takes the gradient as x too)
        read = sum(tensor_bytes(t) for t in {id(t): t for t in tensors((args, kwargs))}.values())
    cost = _attention_cost(_base_name(func), args) if cls == FUSED else None
    if cost is not None:  # attention: its GEMMs' flop; the unfused form's scores go through memory inside the op
        flop, inside = cost
        note = "includes the scores written and read inside the op" if inside else ""
        return OpCost(name, cls, flop, read + inside // 2, written + inside // 2, note)
    varlen = _varlen_cost(_base_name(func), args) if cls == FUSED else None
    if varlen is not None:
        return OpCost(name, cls, varlen[0], read, written, varlen[1])
    cost = _linear_ce_cost(_base_name(func), args, kwargs) if cls == FUSED else None
    if cost is not None:  # the chunked LM head and loss: its GEMMs' flop, its chunk buffers
        flop, inside = cost
        note = "includes the chunks of logits (and dlogits) written and read inside the op" if inside else ""
        return OpCost(name, cls, flop, read + inside // 2, written + inside // 2, note)
    return OpCost(name, cls, _flop(func, cls, args, kwargs, out), read, written)




def _meta_val(x: Any) -> Any:
    if isinstance(x, Node):
        v = x.meta.get("val")
        if v is None and "tensor_meta" in x.meta:
            return None
        return v
    return x


def node_cost(n: Node) -> OpCost:
    """op_cost of a graph node, from its inputs' and its own fake values."""
    args = torch.fx.node.map_aggregate(n.args, _meta_val)
    kwargs = torch.fx.node.map_aggregate(n.kwargs, _meta_val)
    return op_cost(n.target, args, kwargs, n.meta.get("val"))


def is_dmfx_node(n: Node) -> bool:
    return n.op == "call_function" and is_fused(n.target)


def call_nodes(gm: Any) -> list[Node]:
    """The call nodes of a GraphModule, getitems left out."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


_GEMM_LABELS = {"inside": "{} (inside the op)", "stacked": "{} (stacked with the other projections)",
                "bias": "bias of {}"}


def absorbed_rows(n: Node) -> list[dict]:
    """The ATen ops the fused node `n` absorbed (``meta["dmfx_absorbed"]``, passes/fusion.py) that move
    data (views left out), as the report lists them: ``{"node", "op", "class"}``. A GEMM is named by
    what became of it (a fused op took only its bias, runs it inside, or stacked it with others); the
    ops a backward kernel computes the gradients of are ``grad of ...``."""
    rows = []
    for a in absorbed_ops(n):
        c = op_cost(a.target, a.args, a.kwargs, a.out)
        if c.cls == VIEW:
            continue
        op = _GEMM_LABELS[a.gemm].format(c.op) if c.cls == CONTRACTION else c.op
        rows.append({"node": a.node, "op": f"grad of {op}" if a.grad else op, "class": c.cls})
    return rows
