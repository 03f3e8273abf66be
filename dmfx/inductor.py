"""Inductor as the executor of dmfx's rewritten graphs (option ``compiler="inductor"``, the default).

dmfx's passes leave a graph of its fused ``dmfx::`` ops and the ATen ops they did not absorb: the
loss, embeddings, the residual glue, reshapes. Run as an FX GraphModule, each of those is one ATen
call from Python; Inductor fuses them into generated kernels and calls dmfx's ops as extern kernels.
So after every dmfx pass has run (the forward pipeline, the joint layout search, the backward
passes), each forward, backward and inference graph AOTAutograd hands dmfx is compiled here by
Inductor's inner compiler, ``compile_fx_inner`` (its entry point for one already-partitioned ATen
graph, in torch 2.11 through 2.14), as Inductor's own ``compile_fx`` would call it:

* the graph is traced once more with Inductor's decomposition table (its lowerings assume those
  decompositions: an undecomposed ``aten.t`` is rejected), functionalized, so the in-place GEMM
  accumulations dmfx's backward passes emit (``addmm_`` into a gradient buffer) become functional
  ops Inductor can schedule; dmfx's ops have no decompositions and stay whole;
* dmfx's ops get their inputs with the strides they were traced with (Inductor's
  ``needs_exact_strides`` constraint for custom ops, set for the compile whatever the user's
  ``torch._functorch.config`` says), so Inductor's layouts cannot break a kernel's contract or
  undo dmfx's layout choices;
* the outputs the user sees keep the strides eager gives them (Inductor's ``user_visible_output_idxs``
  convention); the strides of the activations the forward saves reach the backward through
  AOTAutograd's own record of the compiled forward's output strides.

Inductor's joint-graph passes (its SDPA pattern rewrites among them) run on a graph only where
option ``inductor_joint`` has AOTAutograd trace it as Inductor's ``compile_fx`` does (uses_inductor_joint:
the graphs fuse="auto" rewrites for their loss or long causal attention only); they see dmfx's ops as
opaque calls, so they rewrite only what dmfx left to Inductor, as Inductor alone would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.fx import GraphModule, Node

WHY_LEFT = ("no dropout in this graph: on the CPU, Inductor fuses its norms, element-wise chains and attention "
            "as fast as dmfx's kernels (measured: bench/RESULTS.md, issue 16), and each dmfx op would be a "
            "fusion barrier for it, so the graph is Inductor's (option fuse='all' fuses it anyway)")


WHY_LEFT_CUDA = ("on CUDA, dmfx's kernels inside Inductor's code were slower than Inductor alone on the one whole "
                 "model measured (BERT MLM training step, 4 layers, bf16 autocast, H200: 0.87x; bench/RESULTS.md, "
                 "issue 16), so the graph is Inductor's until a GPU measurement says otherwise (option "
                 "fuse='all' fuses it anyway)")


def has_dropout(gm: GraphModule) -> bool:
    """Whether the ATen graph `gm` drops out anywhere: a training ``native_dropout`` with p > 0, or a
    scaled_dot_product_attention call with dropout_p > 0."""
    from .passes.attention import sdpa_call
    from .passes.graph_utils import aten, is_op

    for n in gm.graph.nodes:
        if is_op(n, aten.native_dropout) and n.args[2] is not False and float(n.args[1]) > 0:
            return True
        call = sdpa_call(n) if n.op == "call_function" else None
        if call is not None and isinstance(call["dropout"], (int, float)) and call["dropout"] > 0:
            return True
    return False


@dataclass(frozen=True)
class Scope:
    """What fuse="auto" rewrites in a graph it keeps for dmfx: its loss (the logits' (rows, vocab), else
    None), its eager causal attentions over many keys (long_causal_attention: their most keys, else None),
    or both; every other fusion is Inductor's (skipped: not_the_loss)."""

    loss: tuple[int, int] | None = None
    causal_keys: int | None = None

    def skipped(self) -> tuple[str, ...]:
        """The passes the graph skips: the forward fusions outside its scope, and SCOPE_SKIPS_BACKWARD."""
        kept = ("attention_softmax", "attention") if self.causal_keys is not None else ()
        loss = LOSS_PASSES if self.loss is None else ()
        return tuple(name for name in (*not_the_loss(), *loss, *SCOPE_SKIPS_BACKWARD) if name not in kept)

    def options(self, opts: Any) -> Any:
        """`opts` for the graph's rewrite: the passes skipped, and the attention fused only where causal and long."""
        from dataclasses import replace

        scope = "long-causal" if self.causal_keys is not None else opts.attention_scope
        return replace(skipping(opts, self.skipped()), attention_scope=scope)

    def why(self) -> str:
        """The record's line for it."""
        return WHY_SCOPE.format(what=self._what(), details="; ".join(self._details()))

    def why_unbuilt(self) -> str:
        """Why the graph is left to Inductor whole while dmfx's kernels are not built (WHY_LEFT_UNBUILT)."""
        return WHY_LEFT_UNBUILT.format(what=self._what(), details="; ".join(self._details()))

    def _what(self) -> str:
        return " and ".join(w for w, on in (("its loss", self.loss), ("its causal attention", self.causal_keys)) if on)

    def _details(self) -> list[str]:
        details = []
        if self.loss is not None:
            details.append(f"dmfx's loss over the [{self.loss[0]}, {self.loss[1]}] logits is faster than Inductor's")
        if self.causal_keys is not None:
            details.append(f"one causal attention over {self.causal_keys} keys reads no mask and skips the keys past "
                           "the diagonal, where Inductor reads the whole [L, L] mask and writes the scores")
        return details


def skipping(opts: Any, names: Sequence[str]) -> Any:
    """`opts` (Options) with the passes `names` skipped as well."""
    from dataclasses import replace

    return replace(opts, skip=tuple(dict.fromkeys((*opts.skip, *names))))


def auto_decision(aten_gm: GraphModule, devices: tuple[str, ...], training: bool) -> tuple[str | None, Scope | None]:
    """What fuse="auto" does with a graph under Inductor: ``(why, scope)``. `why`: the reason the graph is
    better compiled by Inductor alone (None: dmfx rewrites it); `scope`: what of it dmfx rewrites where
    that is not everything (its loss, its long causal attentions: Scope), else None. On the CPU, dmfx's
    fusions pay under Inductor where a graph drops out (fused Philox dropout whose mask is regenerated
    in the backward, the norm backward with its folded gradients: BERT MLM training 1.03-1.05x
    Inductor) and lose 3-9% where it does not (LLaMA causal-LM training at 256 tokens; BERT inference
    at parity), measured in bench/RESULTS.md; except a loss over large logits in training (loss_pays)
    and eager causal attention over many keys (long_causal_attention: the LLaMA step at 2048 tokens
    1.22x Inductor with it, 0.96x without; its inference forward 1.30x at 2048 keys, 1.05x at 256). The
    loss in training only: the fused loss's gain is its backward's; its forward alone (an evaluation
    loss) is Inductor's or a little slower ([1024, 32000] float32, 1 thread: 26 against 23 ms). On
    CUDA, the one whole model measured (the first GPU run) was slower rewritten than under Inductor
    alone, dropout and all (WHY_LEFT_CUDA): every CUDA graph is Inductor's until a measurement says
    otherwise."""
    if devices == ("cuda",):
        return WHY_LEFT_CUDA, None
    if devices != ("cpu",) or has_dropout(aten_gm):
        return None, None
    scope = Scope(loss_pays(aten_gm) if training else None, long_causal_attention(aten_gm, training))
    return (None, scope) if scope != Scope() else (WHY_LEFT, None)


def long_causal_attention(aten_gm: GraphModule, training: bool = True) -> int | None:
    """The most keys of an eager attention in `aten_gm` whose float32 softmax runs under a causal mask
    the graph computes from constants (HF's create_causal_mask without an attention mask:
    attention_softmax's causal_softmax_keys) over at least causal_scope_min_keys keys (512 in training;
    in inference 256 for float32 scores, 1024 for bf16/fp16 ones); None where there is none. Inductor
    computes such an attention with the [L, L] mask materialized, every key read and the scores
    written; as one causal attention it reads no mask, and dmfx's kernel skips the keys past each
    block's diagonal: the LLaMA step with eager attention at 2048 tokens ran 1.22x Inductor with it,
    0.96x without, its inference forward 1.30x (bench/RESULTS.md). Not a model's own causal
    scaled_dot_product_attention calls (HF's "sdpa"): there PyTorch's kernel skips the masked half
    too, and the same step ran no faster with dmfx's (1.015x against 1.027x)."""
    from .passes.attention import causal_scope_min_keys
    from .passes.attention_softmax import causal_softmax_keys

    found = filter(None, map(causal_softmax_keys, aten_gm.graph.nodes))
    keys = [k for k, dtype in found if k >= causal_scope_min_keys(training, dtype)]
    return max(keys, default=None)


#: Logits of at least this many elements (4 MB of float32: past a core's L2 cache, so the loss is a pass
#: over memory) make a loss worth fusing in a graph otherwise left to Inductor (loss_pays).
LARGE_LOGITS = 1 << 20

#: The forward pipeline's passes a graph rewritten only for its loss still runs: the losses' own and the
#: passes that fuse nothing. Every other pass, a fusion added later included, is skipped (not_the_loss).
#: The backward passes run (they fold the scope's gradients: the loss's, the attention's bias sums),
#: except SCOPE_SKIPS_BACKWARD.
LOSS_PASSES = ("softcap", "cross_entropy", "linear_cross_entropy")
LOSS_ONLY_PASSES = ("remove_metadata_asserts", "identity_clones", "noop_clones", *LOSS_PASSES, "unpad", "layout")

#: The backward passes a graph rewritten for its scope only skips: aten_backward makes dmfx kernels of
#: the ATen backward chains of what the forward left to Inductor (softmax, SiLU/GELU, norms), each a
#: fusion barrier in Inductor's backward, with casts around it under autocast. With it, a one-layer
#: LLaMA step (1024 tokens) whose forward dmfx left alone ran 0.67x Inductor in bf16 and 0.83x in
#: float32; without it, 1.00x and 0.95x (bench/RESULTS.md, stop 46).
SCOPE_SKIPS_BACKWARD = ("aten_backward",)


def not_the_loss() -> tuple[str, ...]:
    """The forward passes a graph rewritten only for its loss skips (LOSS_ONLY_PASSES)."""
    from .passes import PIPELINE

    return tuple(name for name in PIPELINE if name not in LOSS_ONLY_PASSES)


WHY_SCOPE = ("fuse='auto': rewritten for {what} only (no dropout in this graph, so its other fusions are "
             "Inductor's; {details}: bench/RESULTS.md, issue 16)")

#: Why a graph auto_decision keeps for its loss or attention is left to Inductor whole after all: dmfx's
#: kernels are not built on this machine yet, and their one-time build (about a minute on 2 cores) would
#: cost the first compile more than the fusions save. The decision is kept in the compile cache like any
#: whole-graph one, and dropped once the kernels are built (left_for_unbuilt_kernels, backend._compile_graph).
WHY_LEFT_UNBUILT = ("no dropout in this graph, and dmfx's kernels are not built on this machine yet: only {what} "
                    "would be dmfx's ({details}), which does not pay for their one-time build here (run "
                    "`python -m dmfx build` once, or let a graph that needs them build them)")


def left_for_unbuilt_kernels(why: str | None) -> bool:
    """Whether a kept decision to leave a graph to Inductor whole (its reason `why`) was made only
    because dmfx's kernels were not built (WHY_LEFT_UNBUILT)."""
    return why is not None and why.startswith(WHY_LEFT_UNBUILT[:WHY_LEFT_UNBUILT.index("{")])


def loss_pays(aten_gm: GraphModule) -> tuple[int, int] | None:
    """The (rows, vocab) of a loss in `aten_gm` whose fusion pays on the CPU where the rest of
    the graph is left to Inductor: ``nll_loss_forward(_log_softmax(z, 1))``, ATen's
    ``F.cross_entropy`` (an LM's loss), over an LM head's logits (_reads_a_gemm: not a shifted copy of
    them) of at least LARGE_LOGITS elements (symbolic sizes read by their hints, without a guard); None
    where there is none. dmfx's loss reads the logits
    once forward (online log-sum-exp) and once backward, and saves only each row's (max, log-sum): on
    [1024, 32000] float32, 1 thread, forward and backward took 92 ms against 139 ms for Inductor's
    generated loss, and the LLaMA causal-LM training step ran 1.04-1.05x Inductor with only the loss
    fused (bench/RESULTS.md, 2026-12-04). Whether the fused op takes it (class weights, label
    smoothing, its other near-misses) is the pass's to say."""
    from .passes.graph_utils import aten, concrete_int, is_op, tensor_meta

    for n in aten_gm.graph.nodes:
        if not is_op(n, aten.nll_loss_forward) or not is_op(n.args[0], aten._log_softmax):
            continue
        if not _reads_a_gemm(n.args[0].args[0]):
            continue
        meta = tensor_meta(n.args[0])
        if meta is not None and len(meta.shape) == 2:
            rows, vocab = (concrete_int(d) for d in meta.shape)
            if rows * vocab >= LARGE_LOGITS:
                return rows, vocab
    return None


def _reads_a_gemm(x: Any) -> bool:
    """Whether the logits `x` a loss reads are a GEMM's output seen through views and dtype casts (an
    LM head's logits, as transformers 5.x's losses read them), rather than a copy of a slice of them:
    transformers 4.x's causal-LM losses shift the logits (``logits[..., :-1, :].contiguous()``), and the
    fused loss over that copy, with the copy's backward (a zero-filled [B, L, V] and an add the fold of
    the logits' gradient does not take), ran 0.88-0.96x Inductor on a LLaMA step where the graph left to
    Inductor whole ran 1.005x (bench/RESULTS.md, 2026-12-04, transformers 4.46)."""
    from .passes.graph_utils import aten, is_op
    from .passes.softcap import capped_logits

    while x is not None and not is_op(x, aten.mm, aten.addmm, aten.bmm, aten.baddbmm):
        if is_op(x, aten.view, aten._unsafe_view, aten.reshape, aten.alias, aten._to_copy):
            x = x.args[0]
        else:  # Gemma 2's soft cap (passes/softcap.py fuses it with the loss's), or not an LM head's logits
            x = capped_logits(x)
    return x is not None


def _contiguous(v: Any) -> bool:
    from torch._prims_common import is_contiguous_or_false  # (no guard on symbolic sizes)

    return isinstance(v, torch.Tensor) and is_contiguous_or_false(v)


def pin_contiguous_outputs(gm: GraphModule) -> int:
    """Keep the Dynamo graph `gm`'s contiguous outputs contiguous under Inductor: a ``.contiguous()``
    after each (traced as nothing where the value is contiguous anyway). Inductor keeps an output's
    strides as its decomposed graph has them, and a decomposition can change them: its ``cat``
    drops empty inputs and clones the one left with that one's layout, so HF's DynamicCache, which
    appends the prefill's keys to an empty tensor, gets the keys in the attention's transposed layout
    (eager: contiguous), the first decode step is compiled for that layout and the second, whose
    cache ``cat`` made contiguous, compiles a third graph. Returns how many outputs it pinned."""
    out = _output_node(gm)
    outputs = out.args[0]
    if not isinstance(outputs, (tuple, list)):
        return 0
    pinned = list(outputs)
    for i, a in enumerate(outputs):
        if not isinstance(a, Node) or a.op == "placeholder" or (a.op == "call_method" and a.target == "contiguous"):
            continue  # (not a computed tensor, or pinned already: the graph is compiled a second time)
        if _contiguous(a.meta.get("example_value")):
            with gm.graph.inserting_before(out):
                pinned[i] = gm.graph.call_method("contiguous", (a,))
            pinned[i].meta.update(a.meta)
    count = sum(p is not a for p, a in zip(pinned, outputs))
    if count:
        out.args = (type(outputs)(pinned),)
        gm.recompile()
    return count


def decompose(gm: GraphModule, example_inputs: Sequence[Any], visible: Sequence[int] = ()) -> GraphModule:
    """`gm` traced again, functionalized (mutations only: views stay views) and with Inductor's
    decompositions applied, under the fake mode of `example_inputs` (AOTAutograd's). The outputs at
    `visible` (those the user sees) that are contiguous in `gm` stay so (pin_contiguous_outputs says
    why a decomposition may change them)."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    outputs = _output_node(gm).args[0]
    keep = {i for i in visible if isinstance(outputs, (tuple, list)) and i < len(outputs)
            and isinstance(outputs[i], Node) and _contiguous(outputs[i].meta.get("val"))}

    def run(*args: Any) -> Any:
        out = torch.fx.Interpreter(gm).run(*args)
        if not keep:
            return out
        return type(out)(o.contiguous() if i in keep and isinstance(o, torch.Tensor) else o for i, o in enumerate(out))

    functional = torch.func.functionalize(run, remove="mutations")
    fake_mode = detect_fake_mode(example_inputs)
    with fake_mode if fake_mode is not None else torch._C._DisableTorchDispatch():  # (no fake mode: real inputs)
        return make_fx(functional, decomposition_table=decompositions())(*example_inputs)


def decompositions() -> dict:
    """Inductor's decomposition table, with its ``cat`` giving eager's layout (_cat_as_eager)."""
    from torch._inductor.decomposition import select_decomp_table

    return {**select_decomp_table(), torch.ops.aten.cat.default: _cat_as_eager}


def uses_inductor_joint(opts: Any) -> bool:
    """Whether AOTAutograd traces a graph's joint (or inference) graph with Inductor's decompositions and
    Inductor's joint-graph passes run on it (option inductor_joint): under compiler="inductor", where the
    option says True, or "auto" and the backward pass aten_backward, which matches undecomposed ATen
    backward ops, is skipped."""
    if opts.compiler != "inductor" or opts.inductor_joint is False:
        return False
    return opts.inductor_joint is True or "aten_backward" in opts.skip


def joint_graph_passes(gm: GraphModule, example_inputs: Sequence[Any]) -> GraphModule:
    """Inductor's joint-graph passes on `gm` (a joint graph before partitioning, or an inference graph),
    as its compile_fx runs them: its pattern rewrites (pointless casts and views, no-op ops, uniform
    constants folded, its attention patterns: they see dmfx's ops as opaque calls, so they rewrite only
    what dmfx left to Inductor), and ATen's random ops as Inductor's."""
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import _recursive_joint_graph_passes
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode

    devices = [x.device for x in example_inputs if isinstance(x, torch.Tensor)]
    device = next((d for d in devices if d.type != "cpu"), devices[0] if devices else None)
    with V.set_fake_mode(detect_fake_mode(example_inputs) or FakeTensorMode()):  # (as compile_fx runs them)
        return _recursive_joint_graph_passes(gm, skip_invoke_subgraph=True, input_device=device)


def replace_random(gm: GraphModule, example_inputs: Sequence[Any]) -> None:
    """ATen's random ops in `gm` (``aten.rand`` / ``randn``: what Inductor's decomposition makes of a
    ``native_dropout`` that no dmfx pass absorbed, e.g. attention dropout where attention stays
    unfused) as Inductor's own random ops, as its ``compile_fx`` does in its joint-graph passes
    before the inner compiler; the inner compiler's lowerings refuse ATen's ("should have been handled
    in replace_random.py") unless ``config.fallback_random`` is set, and then take them as they are."""
    from torch._guards import detect_fake_mode
    from torch._inductor import config
    from torch._inductor.fx_passes.replace_random import replace_random_passes
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode

    if config.fallback_random or not any(n.op == "call_function" and n.target in _ATEN_RANDOM for n in gm.graph.nodes):
        return
    with V.set_fake_mode(detect_fake_mode(example_inputs) or FakeTensorMode()):
        replace_random_passes(gm)
    gm.graph.lint()
    gm.recompile()


_ATEN_RANDOM = (torch.ops.aten.rand.default, torch.ops.aten.randn.default, torch.ops.aten.rand_like.default,
                torch.ops.aten.randn_like.default)


def _cat_as_eager(tensors: Sequence[torch.Tensor], dim: int = 0) -> Any:
    """Inductor's ``cat`` decomposition (empty inputs dropped; a lone remaining input cloned, one input
    repeated expanded: HF's ``DynamicCache`` appends keys to an empty tensor, its rotary embedding
    concatenates the frequencies with themselves), its result in the memory format eager's cat gives.
    Inductor's clones a lone input with that input's strides, where eager's cat is contiguous (for a
    transposed key, say), and a ``view`` a graph traced after eager's cat then fails (HF's rope with
    full rotary: ``cat([rotated, empty])``, under autocast)."""
    from torch._inductor.decomposition import cat
    from torch._prims_common import suggest_memory_format

    out = cat(tensors, dim)
    if out is NotImplemented:
        return out
    formats = {suggest_memory_format(t) for t in tensors}  # (as eager's cat: a legacy empty input counts)
    return out.contiguous(memory_format=formats.pop() if len(formats) == 1 else torch.contiguous_format)


def _output_node(gm: GraphModule) -> Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def user_visible_outputs(gm: GraphModule, kind: str, user_outputs: int) -> list[int]:
    """The outputs the user sees (their strides are kept as eager has them): in an inference or
    backward graph every output; in a forward graph the `user_outputs` outputs after the updated
    values of mutated inputs (AOTAutograd's layout: mutated inputs, user outputs, then the
    activations saved for the backward)."""
    outputs = list(_output_node(gm).args[0])
    start, end = 0, len(outputs)
    if kind == "forward":
        context = torch._guards.TracingContext.try_get()
        meta = getattr(context, "fw_metadata", None)
        start = getattr(meta, "num_mutated_inp_runtime_indices", 0) if meta is not None else 0
        end = min(start + user_outputs, len(outputs))
    return [i for i in range(start, end) if isinstance(outputs[i], Node)]


def mark_user_visible_outputs(gm: GraphModule, visible: list[int]) -> None:
    """Tell Inductor which outputs the user sees (user_visible_outputs)."""
    outputs = list(_output_node(gm).args[0])
    _output_node(gm).meta["user_visible_output_idxs"] = [i for i in visible if isinstance(outputs[i], Node)]


def compile_graph(gm: GraphModule, example_inputs: Sequence[Any], kind: str, graph_id: int, user_outputs: int,
                  max_autotune: bool = False, cudagraphs: "CudaGraphs | None" = None,
                  joint_passes: bool = False) -> Callable:
    """`gm` (one of AOTAutograd's "forward", "backward" or "inference" graphs, after dmfx's passes)
    compiled by Inductor: a boxed callable. `user_outputs`: how many outputs the graph dmfx handed
    AOTAutograd returns (see user_visible_outputs). `cudagraphs`: the Dynamo graph's CUDA-graph
    state (mode="reduce-overhead"), or None. `joint_passes`: run Inductor's joint-graph passes on it
    first (an inference graph under uses_inductor_joint). Raises what Inductor raises."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import BoxedBool

    visible = user_visible_outputs(gm, kind, user_outputs)
    decomposed = decompose(gm, example_inputs, visible)
    if joint_passes:  # (an inference graph: a joint graph had them before it was partitioned)
        decomposed = joint_graph_passes(decomposed, example_inputs)
    replace_random(decomposed, example_inputs)
    mark_user_visible_outputs(decomposed, visible)
    capture = cudagraphs is not None and bool(cudagraphs.enabled)
    static = cudagraphs.static_input_idxs(kind, gm, decomposed, example_inputs) if capture else []
    with config.patch({"max_autotune": max_autotune, "triton.cudagraphs": capture}), \
            functorch_config.patch(custom_op_default_layout_constraint="needs_exact_strides"):
        compiled = compile_fx_inner(decomposed, list(example_inputs), is_backward=kind == "backward",
                                    is_inference=kind == "inference",
                                    cudagraphs=cudagraphs.enabled if capture else BoxedBool(False), graph_id=graph_id,
                                    static_input_idxs=static,
                                    boxed_forward_device_index=cudagraphs.device if cudagraphs is not None else None)
    if capture and kind == "forward":
        partitions = getattr(compiled, "partition_maps", None)
        cudagraphs.forward_partitioned = bool(partitions) and len(partitions) > 1
    return compiled


# --------------------------------------------------------------- CUDA graphs (mode="reduce-overhead")
#
# With option cudagraphs (torch.compile's mode="reduce-overhead"), the graphs dmfx compiles on CUDA
# are handed to Inductor's CUDA-graph trees as Inductor's compile_fx hands its own: one shared state
# per Dynamo graph (whether it is captured, which Inductor turns off when it declines a graph; the
# forward's device, for the backward's tree), and the inputs whose addresses stay put (parameters,
# buffers, inputs Dynamo marks static such as a static KV cache; for the backward, the activations
# the captured forward saved). Inductor then records each graph at its second call and replays it.
# dmfx's kernels launch on the current stream and never synchronize, so they are captured with the
# rest, with one exception that capture_blocker finds: an op that reads a value on the host each call.


_SEEDS = (torch.ops.aten.randint.low,)  # (passes/graph_utils.py insert_seed)


def _is_dmfx_op(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "dmfx"


def _device(n: Any) -> str | None:
    """The device type of the tensor node `n` makes, by its value's metadata, or (a graph read back from
    the compile cache has none) by a device keyword, as the dropout seed's randint has; None: unknown."""
    if not isinstance(n, Node):
        return None
    v = n.meta.get("val")
    if isinstance(v, torch.Tensor):
        return v.device.type
    device = n.kwargs.get("device") if n.op == "call_function" else None
    return torch.device(device).type if device is not None else None


def capture_blocker(gm: GraphModule) -> str | None:
    """Why the CUDA graph `gm` (dmfx's rewritten forward graph) must not be captured (None: it may).
    A captured graph replays its kernels with the arguments they had when it was captured, so a dmfx
    op that reads a value on the host at each call would read it once: a dropout seed (a CPU tensor
    drawn for every call, read by a CUDA kernel's launch: each replay would drop the same elements),
    or option unpad's token count."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or not _is_dmfx_op(n.target):
            continue
        name = n.target._schema.name
        if name == "dmfx::unpad_index":
            return "option unpad: the number of real tokens is read on the host at each call"
        devices = {a: _device(a) for a in n.all_input_nodes}
        out = n.meta.get("val")
        out = out[0] if isinstance(out, (tuple, list)) and out else out
        runs_on = out.device.type if isinstance(out, torch.Tensor) else next(
            (d for d in devices.values() if d not in (None, "cpu")), None)
        host = next((a for a, d in devices.items()
                     if d == "cpu" and (runs_on not in (None, "cpu") or a.target in _SEEDS)), None)
        if host is not None:
            return (f"{name} reads {host.name} on the host at each call (a dropout seed: a captured graph "
                    "would replay one dropout mask)")
    return None


def dynamo_static_inputs(gm: GraphModule) -> tuple[int, ...]:
    """The positions of the Dynamo graph `gm`'s inputs whose addresses Dynamo says stay put (its
    parameters and buffers, and tensors marked with torch._dynamo.mark_static_address)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return tuple(i for i, n in enumerate(placeholders)
                 if (n.meta.get("tensor_dict") or {}).get("_dynamo_static_input_type"))


@dataclass
class CudaGraphs:
    """One Dynamo graph's CUDA-graph state, shared by its forward, backward and inference compiles."""

    enabled: Any  # torch._inductor.utils.BoxedBool: Inductor clears it where it declines the graph
    device: Any  # torch._inductor.cudagraph_utils.BoxedDeviceIndex: the forward's device
    static_inputs: tuple[int, ...]  # dynamo_static_inputs of the Dynamo graph
    lifted: int  # tensors AOTAutograd lifts from the traced graph's attributes, ahead of its inputs
    inputs: int  # the traced graph's inputs (the Dynamo graph's, one for one)
    forward_partitioned: bool = False  # Inductor split the forward around something it cannot capture

    @classmethod
    def new(cls, dynamo_gm: GraphModule, traced: GraphModule) -> "CudaGraphs":
        from torch._inductor.cudagraph_utils import BoxedDeviceIndex
        from torch._inductor.utils import BoxedBool

        lifted = len(dict(traced.named_parameters(remove_duplicate=False))) + len(
            dict(traced.named_buffers(remove_duplicate=False)))
        inputs = sum(n.op == "placeholder" for n in traced.graph.nodes)
        static = dynamo_static_inputs(dynamo_gm)
        if inputs != sum(n.op == "placeholder" for n in dynamo_gm.graph.nodes):
            static = ()  # (not one for one: no input is taken as static)
        return cls(BoxedBool(True), BoxedDeviceIndex(None), static, lifted, inputs)

    def static_input_idxs(self, kind: str, gm: GraphModule, decomposed: GraphModule,
                          example_inputs: Sequence[Any]) -> list[int]:
        """The inputs of AOTAutograd's `kind` graph `gm` (`decomposed`: as Inductor gets it) that Inductor
        may take as static, as its compile_fx would; where the layout is not the expected one, none
        (every input is then copied into the captured graph's memory: slower, never stale)."""
        n = len(example_inputs)
        if sum(p.op == "placeholder" for p in decomposed.graph.nodes) != n:
            return []
        if kind == "backward":
            from torch._inductor.utils import count_tangents

            if self.forward_partitioned:  # (saved activations made outside the captured parts may move)
                return []
            try:
                return list(range(count_tangents(gm)))
            except AssertionError:  # (saved tensors not ahead of the tangents)
                return []
        if n != self.lifted + self.inputs:  # (AOTAutograd merged or dropped inputs: duplicates, views)
            return list(range(min(self.lifted, n)))
        return [*range(self.lifted), *(self.lifted + i for i in self.static_inputs)]
