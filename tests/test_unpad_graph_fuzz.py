"""The graph-shape fuzz (tests/test_fuzz_graphs.py) under ``unpad=True``, on padded batches.

test_fuzz_graphs.py's programs are where bugs with several readers live: a value read by a GEMM and a
residual, one module applied at two call sites, one Parameter in two linears or in an embedding and a
tied LM head, two views of one projection, a value worked on as a ``[L, B, H]`` view or a
``[B * L, H]`` one, intermediates returned while later steps read them. The rest of the suite runs
them padded only (option ``unpad`` off), and the unpad tests use HF models, whose graphs have none of
these shapes. Here every attention of a program reads HF's padding mask, built in the graph from an
``attention_mask`` input ``[B, L]`` (1: a real token) as HF builds it, so the pass may run the
program on the real tokens. Batches are padded on the right or on the left.

What is compared, the contract of an unpadded graph (passes/unpad.py): every output at the real
positions (padding positions hold zeros there, eager's values in eager), and every gradient of a
random cotangent that is zero at the padding positions (a loss that ignores padding, as HF's do with
label -100). The pass must either give eager's answer, or leave the graph padded and say why; most
programs must be unpadded, or the fuzz tests nothing.

Eager runs PyTorch's attention as the math backend computes it (``sdpa_kernel(SDPBackend.MATH)``), as
dmfx's attention does. They differ only where a query has every key hidden by a finite additive mask
(HF's causal mask on a left-padded batch hides every key of a padding query with finfo.min) and its
output is read (an unmasked mean over the positions): there the default CPU kernel's backward (torch
2.11 and 2.14) gives gradients far from the math backend's and a float64 reference (0.6-0.9 of the largest),
while the forwards agree.

Reproduce a failure with ``DMFX_GRAPH_FUZZ_SEED=<seed> DMFX_GRAPH_FUZZ_ONLY=<index>`` as printed.
"""

from __future__ import annotations

import copy
import random
import time

import torch
from test_fuzz_graphs import (
    FP32_TOL,
    ONLY,
    SEED,
    Program,
    _leaves,
    compare,
    describe,
    error_summary,
    fixed_recipe,
    leaf_names,
    make_inputs,
    make_recipe,
    mark_batch_and_length_dynamic,
)
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import dmfx

N_PROGRAMS, N_CASES = 24, 3
MIN_UNPADDED_FRACTION = 0.5


class Padded(nn.Module):
    """A program whose attentions read HF's additive padding mask, built in the graph from the
    ``[B, L]`` attention_mask as BERT's ``get_extended_attention_mask`` builds it. `causal`: HF's causal mask of a
    decoder's padded batch instead (the padding keys and each query's later keys hidden). `pool`: also return
    the program's first output pooled over the positions, masked (sentence-transformers' mean
    pooling: unpadded) or not (``mean(1)``, a reader of the padding positions: the graph stays padded
    where the mean reads a value of the region), or nothing (None)."""

    def __init__(self, program: nn.Module, pool: str | None, causal: bool):
        super().__init__()
        self.program, self.pool, self.causal = program, pool, causal

    def forward(self, x, x2, attention_mask, ids):
        if self.causal:  # (a decoder's: HF's causal mask built with the attention mask, [B, 1, L, L])
            L = attention_mask.shape[1]
            keep = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()[None, None] \
                & attention_mask[:, None, None, :].bool()
            ext = torch.where(keep, 0.0, torch.finfo(x.dtype).min).to(x.dtype)
        else:
            ext = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        outs = self.program(x, x2, ext, ids)
        if self.pool == "masked_mean":
            m = attention_mask[..., None].to(outs[0].dtype)
            return (*outs, (outs[0] * m).sum(1) / m.sum(1).clamp(min=1e-9))
        if self.pool == "mean":
            return (*outs, outs[0].mean(1))
        return outs


def padded_recipe(index: int) -> dict | None:
    """Program `index` of the float32 graph fuzz with every attention reading the padding mask, and its
    pooling (Padded); None for a program without attention (nothing for the pass to unpad)."""
    recipe = make_recipe(index, torch.float32)
    attns = [spec for kind, spec in recipe["modules"].values() if kind == "attn"]
    if not attns:
        return None
    for spec in attns:
        spec["mask"] = "padding"
    rng = random.Random(f"{SEED}/unpad/{index}")
    recipe["pool"] = rng.choice((None, "masked_mean", "masked_mean", "mean"))
    recipe["causal"] = rng.random() < 0.5
    return recipe


def padded_indices() -> list[int]:
    """The first N_PROGRAMS programs of the graph fuzz that have an attention (or DMFX_GRAPH_FUZZ_ONLY's)."""
    if ONLY is not None:
        return [int(ONLY)]
    found = [i for i in range(20 * N_PROGRAMS) if padded_recipe(i) is not None]
    return found[:N_PROGRAMS]


def padded_inputs(recipe: dict, B: int, L: int, gen: torch.Generator, left: bool) -> dict:
    """The program's inputs (make_inputs), with a ``[B, L]`` attention_mask of random lengths (at least
    one real token per row) on the `left` or the right in place of the additive mask."""
    inputs = make_inputs(recipe, B, L, gen)
    lengths = torch.randint(1, L + 1, (B,), generator=gen)
    pos = torch.arange(L)[None, :]
    real = pos >= L - lengths[:, None] if left else pos < lengths[:, None]
    return {**inputs, "mask": real.long()}


def forward_backward(recipe, module, inputs, cotangents=None, gen=None):
    """Outputs at the real positions, and the gradients of every leaf for cotangents R that are zero at
    the padding positions (d(sum(out * R)))."""
    inputs = {k: (v.detach().requires_grad_(recipe[f"{k}_grad"]) if k in ("x", "x2") else v)
              for k, v in inputs.items()}
    mark_batch_and_length_dynamic(inputs)
    outs = module(inputs["x"], inputs["x2"], inputs["mask"], inputs["ids"])
    tokens = len(outs) - bool(recipe["pool"])  # (the program's outputs, then a pooled [B, H] one)
    real = lambda i, o: inputs["mask"].view(*inputs["mask"].shape, *[1] * (o.dim() - 2)).to(o.dtype) \
        if i < tokens else torch.ones((), dtype=o.dtype)  # noqa: E731
    if cotangents is None:
        cotangents = [torch.randn(o.shape, generator=gen).to(o.dtype) * real(i, o) for i, o in enumerate(outs)]
    leaves = _leaves(recipe, inputs, module)
    grads = torch.autograd.grad(sum((o * R).sum() for o, R in zip(outs, cotangents)), leaves, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
    return [(o * real(i, o)).detach() for i, o in enumerate(outs)], grads, cotangents


def run_padded(recipe: dict, options: dict | None = None) -> tuple[list[str], int, int, list[str]]:
    """Every case of `recipe` (right padding, then left, alternately) under unpad (and `options`) against
    eager: the failures, the graphs compiled, how many were unpadded, and why the others were not."""
    torch._dynamo.reset()
    dmfx.reset()
    torch.manual_seed(recipe["seed"])
    module = Padded(Program(recipe), recipe["pool"], recipe["causal"]).train()
    ref = copy.deepcopy(module)
    compiled = torch.compile(module, backend="dmfx", options={"fallback": False, "unpad": True, **(options or {})})
    gen = torch.Generator().manual_seed(recipe["seed"])
    names = leaf_names(recipe, module)
    failures = []
    for i, (B, L) in enumerate(recipe["cases"]):
        inputs = padded_inputs(recipe, B, L, gen, left=i % 2 == 1)
        with sdpa_kernel(SDPBackend.MATH):  # (eager as the op defines it: see the module docstring)
            exp = forward_backward(recipe, ref, inputs, gen=gen)
        try:
            got = forward_backward(recipe, compiled, inputs, exp[2])
        except Exception as e:  # noqa: BLE001  (a program dmfx cannot compile is a failure, with its recipe)
            failures.append(f"case B={B} L={L}: raised {error_summary(e)}")
            break
        bad, _ = compare(names, got[:2], exp[:2], {"outputs": [FP32_TOL] * len(exp[0]), "grads": [FP32_TOL] * len(exp[1])})
        if bad:
            failures.append(f"case B={B} L={L} ({'left' if i % 2 else 'right'} padding): " + "; ".join(bad))
    records = dmfx.records()
    failures += [f"fell back: {r.fallback}" for r in records if r.fallback is not None]
    unpadded = sum(bool(r.fired.get("unpad")) for r in records)
    why = [m for r in records if not r.fired.get("unpad") for m in r.missed if m.startswith("unpad")]
    return failures, len(records), unpadded, why


def fuzz_padded(what: str, programs: int, cases: int, options: dict | None = None) -> None:
    """The first `programs` programs with attention (padded_indices), each on its first `cases` cases,
    compiled under unpad with `options`: every one equals eager at its real positions, and most
    graphs are unpadded."""
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    start, n_programs, pooled, graphs, unpadded, failed, misses = time.perf_counter(), 0, 0, 0, 0, [], []
    with torch._dynamo.config.patch({limit: 32}):
        for index in padded_indices()[:programs]:
            recipe = padded_recipe(index)
            recipe["cases"] = recipe["cases"][:cases]
            failures, n, k, why = run_padded(recipe, options)
            n_programs, graphs, unpadded = n_programs + 1, graphs + n, unpadded + k
            pooled += recipe["pool"] is not None
            misses += why
            if failures:
                failed.append(f"{describe(recipe)}\n  pooled: {recipe['pool']}, causal: {recipe['causal']}\n"
                              + "\n".join(f"  {f}" for f in failures))
    summary = (f"{n_programs} programs with attention, {pooled} pooled, {graphs} graphs, {unpadded} unpadded, "
               f"seed {SEED}, {time.perf_counter() - start:.0f}s; why not: "
               f"{sorted(set(random.Random(0).sample(misses, min(6, len(misses)))))}")
    print(f"\ndmfx graph fuzz under unpad{what}:", summary)
    assert not failed, f"{len(failed)} of {n_programs} programs differ from eager:\n" + "\n".join(failed[:4])
    assert unpadded >= MIN_UNPADDED_FRACTION * graphs, summary


def test_graph_fuzz_under_unpad_gives_eagers_answer_at_the_real_tokens():
    """Tied weights, one module applied twice, values with several readers, views of one buffer, a
    value worked on transposed or flattened: on padded batches under ``unpad=True``, every program
    equals eager at its real positions, outputs and gradients; most of them are unpadded."""
    fuzz_padded("", N_PROGRAMS, N_CASES)


INDUCTOR_PROGRAMS, INDUCTOR_CASES = 6, 2


def test_graph_fuzz_under_unpad_and_the_default_compiler():
    """The compiler users get by default (Inductor runs the unpadded graphs, dmfx's ops and the varlen
    attention as extern kernels, the token count T a data-dependent size): the first programs, on
    their first cases, equal eager's at the real tokens."""
    fuzz_padded(" and Inductor", INDUCTOR_PROGRAMS, INDUCTOR_CASES, {"compiler": "inductor"})


def test_regression_a_gradient_sum_of_the_token_count_by_the_width():
    """Found by this fuzz (seed 11, program 206): x laid out as ``[L, B, H]`` (transposed), a = attn(x),
    then chunk2(x + a) multiplied and added to a. The backward pass's ``plain_add`` compared an add's
    operand shapes with ``!=``, which under unpad asked whether T, the real tokens' count (data
    dependent), is 128 (2H): the compile failed with GuardOnDataDependentSymNode. Shapes are compared
    without guarding on T now (graph_utils.same_size)."""
    attn = {"heads": 4, "qkv": "split", "impl": "bert", "rope": None, "mask": "padding", "bias": True, "p": 0.0}
    recipe = fixed_recipe(
        "regression: chunk2(x + attn(x)) multiplied, + attn(x); x transposed", 64,
        {"attn0": ("attn", attn), "chunk20": ("chunk2", {"how": "chunk", "bias": True})},
        [((2,), "module", "attn0", (0,)), ((3,), "add", None, (0, 2)), ((4, 5), "module", "chunk20", (3,)),
         ((6,), "mul", None, (4, 5)), ((7,), "add", None, (6, 2))],
        [7], [(2, 9), (4, 31)], layout="transposed", pool=None, causal=False, seed=44786168)
    failures, graphs, unpadded, why = run_padded(recipe)
    assert not failures, failures
    assert unpadded == graphs == 1, why


def test_regression_a_norms_gradient_read_twice_by_its_backward():
    """Found by this fuzz (seed 31, program 168): s = Linear(x) + x; h = RMSNorm(s) + s; two attentions
    read h, their sum returned. Unpadded, the backward's ``dmfx::norm_backward`` read the gradient sum
    ``g = dattn0 + dattn1`` twice, as grad_out and as grad_sum (s reaches the output through the norm
    and as it is); fold_gradient_adds folded the add into grad_out alone and then failed to erase it
    (RuntimeError: the node still had a user). It folds only a sum the norm reads once now."""
    attn = {"heads": 4, "rope": None, "mask": "padding", "p": 0.0}
    recipe = fixed_recipe(
        "regression: h = rms(s) + s, s = Linear(x) + x; attn0(h) + attn1(h)", 12,
        {"linear0": ("linear", {"bias": False}), "rms_t50": ("rms_t5", {}),
         "attn0": ("attn", {**attn, "qkv": "chunk", "impl": "bert", "bias": True}),
         "attn1": ("attn", {**attn, "qkv": "separate", "impl": "sdpa", "bias": False})},
        [((2,), "module", "linear0", (0,)), ((3,), "add", None, (2, 0)), ((4,), "module", "rms_t50", (3,)),
         ((5,), "add", None, (4, 3)), ((6,), "module", "attn0", (5,)), ((7,), "module", "attn1", (5,)),
         ((8,), "add", None, (6, 7))],
        [8, 2], [(3, 3), (5, 8)], pool=None, causal=False, seed=1)
    failures, graphs, unpadded, why = run_padded(recipe)
    assert not failures, failures
    assert unpadded == graphs == 1, why
