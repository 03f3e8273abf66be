"""Seeded random programs that write their inputs and buffers in place, compiled with dmfx and
compared with eager: values, the written inputs and buffers after each call, which outputs alias
which inputs, and gradients.

tests/test_mutation.py checks one graph of each kind by hand (a static-cache decode step, running
statistics, ``copy_`` into an input, an output that is a view of an input). The bugs of a lowering
that turns writes into a functional body plus an epilogue (dmfx/functionalize.py), and of the pass
that makes the epilogue's writes in place again (``reinplace_input_writes``), live where writes and
reads interleave: an input read before and after it is written, a buffer written twice, a slice of
an input written while the whole is read by a fused op, a cache written and then read by attention,
an output that is a view of an input a later call writes again, an in-place op on an intermediate
another reader saw before. This file generates small programs of such steps between the ops dmfx
fuses (LayerNorm, RMSNorm, bias + GELU, residual adds, attention over a static cache with HF's mask,
written out or through SDPA), and runs each with two or three calls on the same state (the second at
other cache positions, the third at another number of new tokens: a recompile under automatic
dynamic shapes), against an eager copy of the module and inputs:

* every output within FP32_TOL of eager's (rel_err), and every written input and buffer after each
  call within FP32_TOL of eager's;
* an output that shares storage with an input (or buffer) in eager shares it in dmfx too, and one that
  does not, does not (a returned view must see the next call's writes, and a fresh output must not);
* in training programs (parameters require grad), every parameter's gradient of a random cotangent,
  within FP32_TOL of eager's relative to the largest.

A program eager itself rejects (autograd's "modified by an inplace operation") is drawn again. Programs
run with fallback=False: a graph dmfx cannot lower raises instead of quietly running eagerly.

Reproduce a failure with the seed and program index it prints:
``DMFX_MUTATION_FUZZ_SEED=<seed> DMFX_MUTATION_FUZZ_ONLY=<index> pytest tests/test_mutation_fuzz.py``.
"""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from test_fuzz_graphs import LlamaRMSNorm
from torch import nn

import dmfx

SEED = int(os.environ.get("DMFX_MUTATION_FUZZ_SEED", "2026"))
ONLY = os.environ.get("DMFX_MUTATION_FUZZ_ONLY")
N_PROGRAMS = 48  # (compiler "fx", half of them training; about 1 s each)
N_INDUCTOR_PROGRAMS = 6  # (compiler "inductor", fuse="all": dmfx's rewrites compiled by Inductor; 5-10 s each)
N_AUTO_PROGRAMS = 8  # (the defaults, compiler "inductor" and fuse="auto"; 1-3 s each)
FP32_TOL = 1e-4
H, HEADS, LMAX = 32, 4, 16

COMPUTE = ["ln", "rms", "mlp", "mlp_inplace", "attn"]
WRITES = ["running", "state_copy", "state_slice", "state_index", "scale_input", "cache"]
READS = ["read_state", "read_stats", "read_input", "scale_by_state"]
OUTPUTS = ["out_h", "out_state", "out_state_view", "out_cache_view", "out_input", "out_stats"]


class Program(nn.Module):
    """A plan of steps over h = x ([B, L, H]) and the state it reads and writes: inputs ``x``, ``state``
    ([B, H]), ``cache_k`` / ``cache_v`` ([B, LMAX, H]) and ``pos`` (the new tokens' cache positions),
    and the buffer ``stats`` ([H])."""

    def __init__(self, plan: list[str], sdpa: bool):
        super().__init__()
        self.plan, self.sdpa = plan, sdpa
        self.ln = nn.LayerNorm(H)
        self.rms = LlamaRMSNorm(H)
        self.fc1, self.fc2 = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))
        self.register_buffer("stats", 0.1 * torch.randn(H))

    def attention(self, h, cache_k, cache_v, pos):
        B, L, _ = h.shape
        k, v = self.k(h), self.v(h)
        if torch.is_grad_enabled():  # (a cache holds values, as HF's: its rows carry no gradient)
            k, v = k.detach(), v.detach()
        cache_k.index_copy_(1, pos, k)
        cache_v.index_copy_(1, pos, v)
        keep = torch.arange(LMAX)[None, :] <= pos[:, None]  # (HF's static-cache mask: written keys up to each query)

        def heads(t):
            return t.view(B, -1, HEADS, H // HEADS).transpose(1, 2)

        q, ck, cv = heads(self.q(h)), heads(cache_k), heads(cache_v)
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, ck, cv, attn_mask=keep)
        else:
            bias = torch.zeros(L, LMAX).masked_fill(~keep, torch.finfo(torch.float32).min)
            s = q @ ck.transpose(-1, -2) / (H // HEADS) ** 0.5 + bias
            a = torch.softmax(s, dim=-1) @ cv
        return h + self.o(a.transpose(1, 2).reshape(B, L, H))

    def forward(self, x, state, cache_k, cache_v, pos):
        h, outs = x * 1.5, []
        for step in self.plan:
            if step == "ln":
                h = self.ln(h)
            elif step == "rms":
                h = self.rms(h)
            elif step == "mlp":
                h = h + self.fc2(F.gelu(self.fc1(h)))
            elif step == "mlp_inplace":  # (an intermediate written in place after another op read it)
                g = self.fc1(h)
                seen = g.mean(-1, keepdim=True)
                g.relu_()
                h = h + self.fc2(g) + seen
            elif step == "attn":
                h = self.attention(h, cache_k, cache_v, pos)
            elif step == "running":  # (BatchNorm-style running statistics)
                self.stats.mul_(0.9).add_(0.1 * h.detach().mean((0, 1)))
            elif step == "state_copy":
                state.copy_(h[:, -1].detach())
            elif step == "state_slice":
                state[:, : H // 4].add_(h[:, 0, : H // 4].detach())
            elif step == "state_index":
                state[0] = h[-1, -1].detach() * 0.5
            elif step == "scale_input":
                x.mul_(0.5)
            elif step == "cache":  # (a write of the cache outside attention, then read by a later one)
                cache_v.index_copy_(1, pos, h.detach() * 0.25)
            elif step == "read_state":
                h = h + state[:, None, :]
            elif step == "read_stats":
                h = h - self.stats
            elif step == "read_input":
                h = h + x
            elif step == "scale_by_state":  # (the product saves the state for the backward)
                h = h * (1 + 0.1 * state[:, None, :])
            elif step == "out_h":
                outs.append(h)
            elif step == "out_state":
                outs.append(state)
            elif step == "out_state_view":
                outs.append(state.t())
            elif step == "out_cache_view":
                outs.append(cache_k[:, :2])
            elif step == "out_input":
                outs.append(x)
            elif step == "out_stats":
                outs.append(self.stats)
        return (h, *outs)


def make_plan(rng: random.Random) -> list[str]:
    """Steps: compute ops interleaved with writes, reads of what was written, and outputs; at least
    one write and one fused op."""
    plan = []
    for _ in range(rng.randint(4, 9)):
        kind = rng.choices([COMPUTE, WRITES, READS, OUTPUTS], weights=[4, 3, 2, 1])[0]
        plan.append(rng.choice(kind))
    if not any(s in WRITES or s == "attn" for s in plan):
        plan.insert(rng.randrange(len(plan) + 1), rng.choice(WRITES))
    if not any(s in COMPUTE for s in plan):
        plan.insert(rng.randrange(len(plan) + 1), rng.choice(COMPUTE))
    return plan


def make_inputs(B: int, L: int, start: int, gen: torch.Generator) -> dict:
    return {"x": torch.randn(B, L, H, generator=gen), "state": torch.randn(B, H, generator=gen),
            "cache_k": torch.randn(B, LMAX, H, generator=gen), "cache_v": torch.randn(B, LMAX, H, generator=gen),
            "pos": torch.arange(start, start + L)}


def calls(rng: random.Random) -> list[tuple[int, int]]:
    """(new tokens, first position) per call: the second call writes other cache rows; a third, where
    drawn, another number of new tokens (a recompile, with a symbolic length)."""
    L = rng.choice([1, 2, 3])
    out = [(L, 2), (L, 2 + L)]
    if rng.random() < 0.5:
        out.append((L + 2, 2 + 2 * L))
    return out


def _storages(tensors: dict) -> dict[str, int]:
    return {k: t.untyped_storage().data_ptr() for k, t in tensors.items()}


def _aliases(outs: tuple, state: dict) -> list[frozenset]:
    """Per output, the names of the inputs and buffers whose storage it shares."""
    where = _storages(state)
    return [frozenset(k for k, p in where.items() if p == o.untyped_storage().data_ptr()) for o in outs]


def _state(module: nn.Module, inputs: dict) -> dict:
    return {**{k: v for k, v in inputs.items() if k != "pos"}, "stats": module.stats}


def _run(module, fn, inputs, training: bool, cotangent_gen: torch.Generator | None):
    module.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(training):
        outs = fn(**inputs)
    grads = {}
    if training:
        loss = sum((o * torch.randn(o.shape, generator=cotangent_gen)).sum() for o in outs if o.requires_grad)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return outs, grads


def _session(module: nn.Module, fn, B: int, schedule: list[tuple[int, int]], index: int, training: bool):
    """Call `fn` (`module` or its compiled form) once per entry of `schedule` on one state (inputs
    state, cache_k, cache_v kept across the calls, as a decode loop keeps its cache; a fresh x and
    positions each call); yields (call, L, start, inputs, outputs, gradients) after each. The inputs
    and cotangents depend only on `index`, so two sessions see the same values."""
    gen, cotangents = torch.Generator().manual_seed(index), torch.Generator().manual_seed(7)
    state = {k: v for k, v in make_inputs(B, 1, 0, gen).items() if k != "pos"}
    for c, (L, start) in enumerate(schedule):
        fresh = make_inputs(B, L, start, gen)
        inputs = {**state, "x": fresh["x"], "pos": fresh["pos"]}
        outs, grads = _run(module, fn, inputs, training, cotangents)
        yield c, L, start, inputs, outs, grads


def draw(index: int) -> tuple[list[str], bool, int, list[tuple[int, int]], Program]:
    """Program `index` of SEED: (plan, sdpa, batch, calls, module), drawn again where eager itself
    rejects it (autograd's "modified by an inplace operation": a view of the cache saved for the
    backward and written by a later step; whether eager saves a view or a copy depends on the sizes,
    so the whole session is tried)."""
    rng = random.Random(SEED * 1000 + index)
    training = index % 2 == 1
    for _ in range(50):
        plan, sdpa, B, schedule = make_plan(rng), rng.random() < 0.5, rng.choice([1, 2, 3]), calls(rng)
        torch.manual_seed(SEED + index)
        module = Program(plan, sdpa)
        probe = copy.deepcopy(module)
        try:
            for _ in _session(probe, probe, B, schedule, index, training):
                pass
            return plan, sdpa, B, schedule, module
        except RuntimeError as e:
            if "modified by an inplace operation" not in str(e):
                raise
    raise AssertionError(f"program {index}: eager rejected 50 draws")


def check_program(index: int, compiler: str = "fx", fuse: str | None = None) -> dict:
    """Run program `index` of SEED against eager; returns what it saw (fired passes, graphs). Raises an
    AssertionError naming the program, call and value that differ."""
    training = index % 2 == 1
    plan, sdpa, B, schedule, ref = draw(index)
    mine = copy.deepcopy(ref)
    fuse = fuse or ("all" if compiler == "inductor" else None)
    options = {"fallback": False, "compiler": compiler, **({"fuse": fuse} if fuse else {})}
    compiled = torch.compile(mine, backend="dmfx", options=options)
    where = f"program {index} of seed {SEED} ({'training' if training else 'inference'}, {compiler}, fuse={fuse}, " \
            f"{'sdpa' if sdpa else 'written-out'} attention): {plan}"
    sessions = zip(_session(ref, ref, B, schedule, index, training), _session(mine, compiled, B, schedule, index, training))
    for (c, L, start, inputs_ref, out_ref, grads_ref), (_, _, _, inputs_mine, out_mine, grads_mine) in sessions:
        at = f"{where}, call {c} (B={B}, L={L}, positions from {start})"
        assert len(out_mine) == len(out_ref), at
        for k, (a, b) in enumerate(zip(out_mine, out_ref)):
            assert a.shape == b.shape and a.dtype == b.dtype, f"{at}: output {k} is {a.shape} {a.dtype}, eager's {b.shape}"
            assert rel_err(a, b) < FP32_TOL, f"{at}: output {k} is {rel_err(a, b):.2e} from eager's"
        for name, b in _state(ref, inputs_ref).items():
            a = _state(mine, inputs_mine)[name]
            assert rel_err(a, b) < FP32_TOL, f"{at}: {name} after the call is {rel_err(a, b):.2e} from eager's"
        got, want = _aliases(out_mine, _state(mine, inputs_mine)), _aliases(out_ref, _state(ref, inputs_ref))
        assert got == want, f"{at}: outputs share storage with {got}, eager's with {want}"
        if training:
            assert grads_mine.keys() == grads_ref.keys(), f"{at}: gradients of {sorted(grads_mine)}, eager {sorted(grads_ref)}"
            scale = max((g.abs().max().item() for g in grads_ref.values()), default=0.0)
            for n, g in grads_ref.items():
                err = (grads_mine[n] - g).abs().max().item() / max(scale, 1e-30)
                assert err < FP32_TOL, f"{at}: gradient of {n} is {err:.2e} (of the largest) from eager's"
    records = dmfx.records()
    # (under fuse="auto" a graph may be left to Inductor whole, by choice: never run eagerly)
    whole = [r for r in records if fuse == "auto" and r.compiler == "inductor" and (r.fallback or "").startswith("left to Inductor: ")]
    assert records and all(r.fallback is None for r in records if r not in whole), [r.fallback for r in records]
    fired: dict[str, int] = {}
    for r in records:
        for k, v in r.fired.items():
            fired[k] = fired.get(k, 0) + v
    return {"fired": fired, "graphs": len(records), "whole": len(whole), "epilogue": any(r.epilogue for r in records),
            "compilers": sorted({r.compiler for r in records})}


def _indices(n: int) -> list[int]:
    return [int(ONLY)] if ONLY is not None else list(range(n))


def test_mutation_fuzz_matches_eager():
    seen = []
    for i in _indices(N_PROGRAMS):
        torch._dynamo.reset()
        dmfx.reset()
        seen.append(check_program(i))
    # (the fuzz tests the rewrites only where they fire: most programs fuse, all lower writes)
    fused = sum(bool(s["fired"]) for s in seen)
    assert ONLY is not None or fused >= 0.75 * len(seen), f"only {fused} of {len(seen)} programs fused anything"
    assert ONLY is not None or all(s["epilogue"] for s in seen), "a program wrote nothing"


# programs 25 and 41 of seed 2026: a cache written by two attentions in one training graph, read
# between (Inductor ran the first attention's saved keys after the second write: wrong gradients of
# q, until such graphs were compiled as FX, functionalize.inductor_write_hazard)
# program 85: a state written, then read into the gradients' path (Inductor, with dmfx's rewrite, wrote
# the state wrong; such training graphs are compiled as FX too)
@pytest.mark.parametrize("index", [*range(N_INDUCTOR_PROGRAMS), *([25, 41, 85] if SEED == 2026 else [])])
def test_mutation_fuzz_under_inductor(index):
    if ONLY is not None and int(ONLY) != index:
        pytest.skip("DMFX_MUTATION_FUZZ_ONLY names another program")
    check_program(index, "inductor")


def test_mutation_fuzz_under_the_defaults():
    """The defaults (compiler "inductor", fuse="auto") on the CPU: a graph without dropout is left to
    Inductor whole, unless Inductor would miscompile its writes (functionalize.inductor_write_hazard:
    then dmfx compiles it as FX). Both ways must match eager. (An exploration run of programs 0-199
    of seed 2026 under the defaults found no difference.)"""
    ways = set()
    for i in _indices(N_AUTO_PROGRAMS):
        torch._dynamo.reset()
        dmfx.reset()
        seen = check_program(i, "inductor", "auto")
        ways.add("whole" if seen["whole"] else "fx" if seen["compilers"] == ["fx"] else "rewritten")
    # (both of the defaults' ways with such graphs are taken: the fuzz tests each)
    assert ONLY is not None or {"whole", "fx"} <= ways, ways
