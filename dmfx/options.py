"""Options accepted by ``torch.compile(model, backend="dmfx", options={...})``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

# Passes renamed after the op they emit (one name per fusion): old name -> new name, still accepted.
RENAMED_PASSES = {"bias_activation_dropout": "bias_act_dropout", "gated_activation": "glu", "qkv_stacking": "qkv_attention"}


@dataclass(frozen=True)
class Options:
    #: Turn all rewriting off: graphs run as PyTorch would run them (also: env DMFX_DISABLE=1).
    disable: bool = False
    #: Names of passes to skip (see dmfx.passes.ALL_PASSES: PIPELINE, then BACKWARD_PIPELINE).
    skip: tuple[str, ...] = ()
    #: AOTAutograd partitioner: "min_cut" (recompute cheap ops, save less) or "default".
    partitioner: str = "min_cut"
    #: On a pass error or kernel build failure: warn and run the graph unrewritten (True), or raise.
    fallback: bool = True
    #: Stack the Q, K and V projections into one GEMM (the paper's QKV fusion): "auto" does it where
    #: it pays (training with at least as many tokens as input features: the per-step weight
    #: concatenation then costs less than the backward's three dX GEMMs and two adds; measured in
    #: bench/RESULTS.md), True always (where the pattern allows), False never.
    stack_qkv: bool | str = "auto"
    #: How attention runs: "auto" (dmfx's cost model, see passes/attention.py choose_form), "flash"
    #: (dmfx's fused kernel), "gemm" (the paper's GEMMs around the fused softmax) or "sdpa" (PyTorch's
    #: scaled_dot_product_attention). A forced form still gives way where it cannot run (probabilities
    #: read elsewhere or a mask gradient need "gemm").
    attention: str = "auto"
    #: Time the candidates where dmfx has a choice (today: attention's form) on this machine instead
    #: of using the cost model's rules; results are cached on disk (dmfx_tuning.json in the kernel
    #: cache directory), so each case is timed once per machine.
    tune: bool = False
    #: Collected per-graph records (dmfx.records()) are kept; set False to keep nothing.
    record: bool = True
    #: Check the graph after every pass (passes/verify.py: in-place writes into storage still needed,
    #: stale or missing fake values, lint): True warns and falls back like a failing pass (raises with
    #: fallback=False), "strict" always raises. Also env DMFX_VERIFY=1 / strict (the stronger wins).
    verify: bool | str = False
    #: What runs the rewritten graphs: "inductor" (PyTorch Inductor compiles each forward, backward
    #: and inference graph after dmfx's passes, with dmfx's ops as extern kernels, so the element-wise
    #: glue dmfx does not fuse is fused by Inductor and no Python runs per op) or "fx" (the graphs run
    #: as FX GraphModules, op by op from Python: compiles in seconds). Env DMFX_COMPILER sets the
    #: default (the test suite runs "fx" unless a test asks for Inductor).
    compiler: str = field(default_factory=lambda: _env_default("DMFX_COMPILER", "inductor"))
    #: Which fusions to make: "auto" (where they pay under the compiler: with compiler="inductor" on
    #: the CPU, a graph without dropout is left to Inductor whole, see dmfx/inductor.py
    #: auto_decision) or "all" (every fusion whose pattern matches). Env DMFX_FUSE sets the default
    #: (with DMFX_COMPILER=inductor, the test suite's rewrites then run under Inductor).
    fuse: str = field(default_factory=lambda: _env_default("DMFX_FUSE", "auto"))
    #: Skip the padding of a batch (passes/unpad.py): where a graph's attentions read one HF padding
    #: mask (attention_mask [B, S] of 0/1), the real tokens are packed after the embeddings, every
    #: row-wise op and each attention (variable-length, over the packed sequences) run on them alone,
    #: and outputs are scattered back to [B, S, ...] with zeros at the padding positions. A graph it
    #: applies to is compiled by dmfx even where fuse="auto" would leave it to Inductor whole.
    unpad: bool = False
    #: Let Inductor autotune the kernels it generates (its max_autotune); torch.compile's
    #: mode="max-autotune" sets it, with tune.
    max_autotune: bool = False
    #: Reuse compiled graphs across processes (dmfx/graph_cache.py): with compiler="inductor", dmfx's
    #: compiled forward and backward go through PyTorch's AOTAutograd and FX graph caches, keyed also
    #: by a hash of dmfx's sources and of these options, so a later process skips dmfx's passes after
    #: the forward pipeline, AOTAutograd's tracing and partitioning, and Inductor's code generation.
    cache: bool = True
    #: Capture each graph dmfx compiles on CUDA as CUDA graphs (Inductor's CUDA-graph trees: recorded at
    #: the second call, replayed after, so a step launches no kernel from the host); torch.compile's
    #: mode="reduce-overhead" sets it. Needs compiler="inductor". A graph whose dmfx ops read a value on
    #: the host at each call is not captured (a dropout seed: each replay would drop the same elements;
    #: option unpad's token count): the record says so. Captured graphs are not kept in the compile
    #: cache. Nothing changes for CPU graphs.
    cudagraphs: bool = False
    #: Not a user option: fuse="auto" sets it (dmfx/inductor.py auto_decision). "long-causal": the graph is
    #: rewritten for its causal attention over many keys, and an attention is fused only where that is
    #: the case (passes/attention_softmax.py, passes/attention.py); "all": wherever the cost model says.
    attention_scope: str = "all"
    #: With compiler="inductor", trace AOTAutograd's joint forward+backward graph with Inductor's
    #: decompositions and run Inductor's joint-graph passes on it before partitioning, as Inductor's own
    #: compile_fx does (its min-cut partitioner then recomputes decomposed element-wise ops instead of
    #: saving them; its passes drop pointless casts and views). "auto": where the backward pass
    #: aten_backward is skipped (it matches undecomposed ATen backward ops), as in the graphs fuse="auto"
    #: rewrites for their loss or long causal attention only; True: always (a graph dmfx rewrites whole
    #: then loses aten_backward's fusions: BERT MLM trained slower, bench/RESULTS.md stop 47); False: never.
    inductor_joint: bool | str = "auto"
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name not in ("extra", "attention_scope")]

    @classmethod
    def from_user(cls, options: dict[str, Any] | None) -> "Options":
        options = dict(options or {})
        unknown = sorted(set(options) - set(cls.names()))
        if unknown:
            raise ValueError(
                f"dmfx: unknown option(s) {', '.join(map(repr, unknown))}; valid options are: {', '.join(cls.names())}"
            )
        if "skip" in options:
            skip = options["skip"]
            skip = (skip,) if isinstance(skip, str) else tuple(skip)
            renamed = {s: RENAMED_PASSES[s] for s in skip if s in RENAMED_PASSES}
            if renamed:
                import warnings

                warnings.warn(f"dmfx: pass(es) renamed, use the new names: {renamed}", DeprecationWarning, stacklevel=3)
            options["skip"] = tuple(RENAMED_PASSES.get(s, s) for s in skip)
            from .passes import ALL_PASSES

            bad = [s for s in options["skip"] if s not in ALL_PASSES]
            if bad:
                raise ValueError(f"dmfx: option 'skip' names unknown pass(es) {bad}; passes are: {', '.join(ALL_PASSES)}")
        if options.get("partitioner", "min_cut") not in ("min_cut", "default"):
            raise ValueError(f"dmfx: option 'partitioner' must be 'min_cut' or 'default', got {options['partitioner']!r}")
        if options.get("stack_qkv", "auto") not in ("auto", True, False):
            raise ValueError(f"dmfx: option 'stack_qkv' must be 'auto', True or False, got {options['stack_qkv']!r}")
        if options.get("inductor_joint", "auto") not in ("auto", True, False):
            raise ValueError(
                f"dmfx: option 'inductor_joint' must be 'auto', True or False, got {options['inductor_joint']!r}")
        if options.get("attention", "auto") not in ("auto", "flash", "gemm", "sdpa"):
            raise ValueError(
                f"dmfx: option 'attention' must be 'auto', 'flash', 'gemm' or 'sdpa', got {options['attention']!r}"
            )
        compiler = options.get("compiler", _env_default("DMFX_COMPILER", "inductor"))
        if compiler not in ("inductor", "fx"):
            where = "option 'compiler'" if "compiler" in options else "env DMFX_COMPILER"
            raise ValueError(f"dmfx: {where} must be 'inductor' or 'fx', got {compiler!r}")
        fuse = options.get("fuse", _env_default("DMFX_FUSE", "auto"))
        if fuse not in ("auto", "all"):
            where = "option 'fuse'" if "fuse" in options else "env DMFX_FUSE"
            raise ValueError(f"dmfx: {where} must be 'auto' or 'all', got {fuse!r}")
        if options.get("unpad", False) not in (False, True):
            raise ValueError(f"dmfx: option 'unpad' must be True or False, got {options['unpad']!r}")
        if options.get("cache", True) not in (False, True):
            raise ValueError(f"dmfx: option 'cache' must be True or False, got {options['cache']!r}")
        if options.get("cudagraphs", False) not in (False, True):
            raise ValueError(f"dmfx: option 'cudagraphs' must be True or False, got {options['cudagraphs']!r}")
        if options.get("verify", False) not in (False, True, "strict"):
            raise ValueError(f"dmfx: option 'verify' must be False, True or 'strict', got {options['verify']!r}")
        opts = cls(**options)
        if env_disabled():
            opts = cls(**{**options, "disable": True})
        return opts


_OFF = ("", "0", "false", "no", "off")


def _env_default(name: str, default: str) -> str:
    """An option's default from the environment variable `name` (lower-cased), else `default`."""
    return os.environ.get(name, "").strip().lower() or default


def env_disabled() -> bool:
    return os.environ.get("DMFX_DISABLE", "").strip().lower() not in _OFF

