"""Seeded random chains of the ops dmfx fuses (and their neighbours), compiled with dmfx and compared
with eager: forward always, backward for half of the cases.

A *variant* is one random chain of steps (LayerNorm / RMSNorm idioms, linear with bias, residual
adds, dropout with p=0 or in eval, GELU/ReLU/SiLU, softmax over the last dim with an additive mask,
scaling by mul/div, SwiGLU gate*up, multi-head views and transposes). Each variant is compiled once
with ``dynamic=True`` and called with many *cases*: random shapes (odd sizes, 1s), strided inputs
(transposed, sliced), float32 mostly and some bfloat16, with and without gradients. Parameters are
inputs of the compiled function, so one compiled graph serves every hidden size. A float32 case whose
gradients differ from eager's is judged against eager in float64 (_arbitrate): it passes where dmfx is
within the tolerance of float64, and is drawn again on new data where a ReLU's input sat within
rounding of its kink (the two may take different sides there). A bfloat16 case beyond its tolerance
is drawn again on new data and fails if it fails again, as in the graph fuzz: one bf16 unit of noise
on an ill-conditioned input (an attention whose scores are hundreds apart by a few units) moves the
exact output by several percent, so eager and dmfx, both right to rounding, can land 0.17 apart
(seed 6565); a bug repeats on new data.

Set DMFX_FUZZ_SEED to explore other programs; the failing variant's recipe and case are printed.
"""

import math
import os
import random
import time

import torch
import torch.nn.functional as F
from conftest import assert_few_redrawn, rel_err, relu_kinks

import dmfx

SEED = int(os.environ.get("DMFX_FUZZ_SEED", "20240601"))
N_VARIANTS = int(os.environ.get("DMFX_FUZZ_VARIANTS", "16"))
CASES_PER_VARIANT = 32  # 512 cases in all
TOL = {torch.float32: 1e-4, torch.bfloat16: 4e-2}

# ----------------------------------------------------------------------------------------- steps
# Each step: (name, params it needs, fn(h, ctx, *params) -> h). Params are described by shape kinds
# resolved per case: "H" vector, "HH"/"IH"/"HI" matrices (I = intermediate size), "I" vector.


def _ln_native(h, ctx, w, b):
    return F.layer_norm(h, (h.shape[-1],), w, b, eps=1e-5)


def _ln_idiom(h, ctx, w, b):  # BERT/TF style, written out
    u = h.mean(-1, keepdim=True)
    s = (h - u).pow(2).mean(-1, keepdim=True)
    return w * ((h - u) / torch.sqrt(s + 1e-5)) + b


def _ln_idiom_rsqrt_var(h, ctx, w, b):
    hf = h.float()
    u = hf.mean(-1, keepdim=True)
    v = hf.var(-1, keepdim=True, unbiased=False)
    return ((hf - u) * torch.rsqrt(v + 1e-6)).to(h.dtype) * w + b


def _rms_llama(h, ctx, w):  # LLaMA: float32 inside, weight after the cast back
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * hf.to(h.dtype)


def _rms_gemma(h, ctx, w):  # Gemma: (1 + w), x*x
    hf = h.float()
    out = hf * torch.rsqrt((hf * hf).mean(-1, keepdim=True) + 1e-6)
    return (out * (1.0 + w.float())).to(h.dtype)


def _linear(h, ctx, W, b):
    return F.linear(h, W, b)


def _bdrln(h, ctx, W, b, w, nb):  # linear + dropout(p=0) + residual + LayerNorm: the paper's BDRLN
    return F.layer_norm(F.dropout(F.linear(h, W, b), 0.0, training=True) + h, (h.shape[-1],), w, nb)


def _bdrrms(h, ctx, W, b, w):  # linear + eval-dropout + residual + RMSNorm
    s = F.dropout(F.linear(h, W, b), 0.1, training=False) + h
    return _rms_llama(s, ctx, w)


def _residual_input(h, ctx):
    return h + ctx["x"]


def _residual_save(h, ctx):  # remember h, add it back two steps later (or at the end)
    ctx["saved"].append(h)
    return h


def _residual_restore(h, ctx):
    return h + ctx["saved"].pop() if ctx["saved"] else h


def _dropout_p0(h, ctx):
    return F.dropout(h, 0.0, training=True)


def _dropout_eval(h, ctx):
    return F.dropout(h, 0.5, training=False)


def _gelu(h, ctx):
    return F.gelu(h)


def _gelu_tanh(h, ctx):
    return F.gelu(h, approximate="tanh")


def _relu(h, ctx):
    return F.relu(h)


def _silu(h, ctx):
    return F.silu(h)


def _bias_gelu(h, ctx, b):
    return F.gelu(h + b)


def _scale_mul(h, ctx):
    return h * 0.37


def _scale_div(h, ctx):
    return h / 2.5


def _swiglu(h, ctx, Wg, Wu, Wd):
    return F.linear(F.silu(F.linear(h, Wg)) * F.linear(h, Wu), Wd)


def _mlp(h, ctx, W1, b1, W2, b2):
    return F.linear(F.gelu(F.linear(h, W1, b1)), W2, b2)


def _attention(heads):
    def attn(h, ctx):
        B, L, H = h.shape
        q = h.view(B, L, heads, -1).transpose(1, 2)  # [B, heads, L, H/heads]
        s = q @ q.transpose(-1, -2) * 0.125 + ctx["mask"][:, None]
        p = s.softmax(dim=-1)
        return (p @ q).transpose(1, 2).reshape(B, L, H)

    attn.__name__ = f"attention{heads}"
    return attn


def _softmax_last(h, ctx):  # softmax over the hidden dim with an additive per-feature mask
    return (h / 0.8 + ctx["hmask"]).softmax(-1) * h.shape[-1]


def _transpose_roundtrip(h, ctx):  # work on a [L, B, H] view, come back
    t = h.transpose(0, 1)
    t = t * torch.sigmoid(t)
    return t.transpose(0, 1)


def _view_flat(h, ctx):  # through a [B*L, H] view and back
    B, L, H = h.shape
    return F.relu(h.reshape(B * L, H)).view(B, L, H)


STEPS = {
    "ln_native": (("H", "H"), _ln_native),
    "ln_idiom": (("H", "H"), _ln_idiom),
    "ln_idiom_var": (("H", "H"), _ln_idiom_rsqrt_var),
    "rms_llama": (("H",), _rms_llama),
    "rms_gemma": (("H",), _rms_gemma),
    "linear": (("HH", "H"), _linear),
    "bdrln": (("HH", "H", "H", "H"), _bdrln),
    "bdrrms": (("HH", "H", "H"), _bdrrms),
    "residual_input": ((), _residual_input),
    "residual_save": ((), _residual_save),
    "residual_restore": ((), _residual_restore),
    "dropout_p0": ((), _dropout_p0),
    "dropout_eval": ((), _dropout_eval),
    "gelu": ((), _gelu),
    "gelu_tanh": ((), _gelu_tanh),
    "relu": ((), _relu),
    "silu": ((), _silu),
    "bias_gelu": (("H",), _bias_gelu),
    "scale_mul": ((), _scale_mul),
    "scale_div": ((), _scale_div),
    "swiglu": (("IH", "IH", "HI"), _swiglu),
    "mlp": (("IH", "I", "HI", "H"), _mlp),
    "softmax_last": ((), _softmax_last),
    "transpose_roundtrip": ((), _transpose_roundtrip),
    "view_flat": ((), _view_flat),
}
NORMS = {"ln_native", "ln_idiom", "ln_idiom_var", "rms_llama", "rms_gemma", "bdrln", "bdrrms"}


LAYOUTS = ("contiguous", "transposed", "sliced")


def make_variant(rng: random.Random, index: int) -> dict:
    """A random recipe of 2-7 steps with at least one norm, and what stays fixed across its cases
    (each would otherwise recompile): dtype, input layout, whether gradients are taken, which
    dimension is sometimes 1 (Dynamo specializes sizes 0/1)."""
    heads = rng.choice([1, 1, 2, 4])
    names = list(STEPS) + ["attention"] * 3
    steps = [rng.choice(names) for _ in range(rng.randint(2, 7))]
    if not NORMS & set(steps):
        steps.insert(rng.randint(0, len(steps)), rng.choice(sorted(NORMS)))
    if "residual_save" in steps and "residual_restore" not in steps[steps.index("residual_save"):]:
        steps.append("residual_restore")
    return {
        "index": index,
        "steps": steps,
        "heads": heads,
        "dtype": torch.bfloat16 if index % 6 == 5 else torch.float32,
        "layout": LAYOUTS[index % 3],
        "backward": index % 2 == 0,
        "one": ("B", "L", "H")[index % 3] if heads == 1 or index % 3 != 2 else "B",
    }


def build_fn(variant: dict):
    fns = []
    for name in variant["steps"]:
        if name == "attention":
            fns.append((0, _attention(variant["heads"])))
        else:
            kinds, fn = STEPS[name]
            fns.append((len(kinds), fn))

    def chain(x, mask, hmask, *params):
        ctx = {"x": x, "mask": mask, "hmask": hmask, "saved": []}
        h, i = x, 0
        for n, fn in fns:
            h = fn(h, ctx, *params[i:i + n])
            i += n
        while ctx["saved"]:
            h = h + ctx["saved"].pop()
        return h

    return chain


def param_kinds(variant: dict) -> list[str]:
    return [k for name in variant["steps"] if name != "attention" for k in STEPS[name][0]]


def make_case(rng: random.Random, variant: dict, j: int) -> dict:
    """Case 0 has general sizes (> 1); every 8th case sets the variant's `one` dimension to 1."""
    heads = variant["heads"]
    B = rng.choice([2, 3, 4, 5])
    L = rng.choice([2, 3, 5, 7, 9, 16, 31])
    k = rng.choice([2, 3, 5, 7, 8, 11, 16])
    H = heads * k if heads > 1 else rng.choice([3, 7, 8, 13, 24, 33, 64, 97])
    if j == 0:
        B, L, H = 2, 5, heads * 6
    elif j % 8 == 4:
        B, L, H = (1 if variant["one"] == d else v for d, v in (("B", B), ("L", L), ("H", H)))
    return {"B": B, "L": L, "H": H, "I": 2 * H + 1, "layout": variant["layout"], "backward": variant["backward"]}


def make_inputs(case: dict, variant: dict, gen: torch.Generator):
    B, L, H, I, dtype = case["B"], case["L"], case["H"], case["I"], variant["dtype"]
    randn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    if case["layout"] == "transposed":
        x = randn(L, B, H).transpose(0, 1)
    elif case["layout"] == "sliced":
        x = randn(B, 2 * L, H + 3)[:, ::2, 1:H + 1]
    else:
        x = randn(B, L, H)
    x = x.to(dtype)
    mask = torch.where(torch.rand(B, L, L, generator=gen) < 0.3, -1e4, 0.0)
    mask = (mask * (1 - torch.eye(L))).to(dtype)  # never a fully masked row
    hmask = torch.where(torch.rand(H, generator=gen) < 0.2, -30.0, 0.0).to(dtype)
    shapes = {"H": (H,), "I": (I,), "HH": (H, H), "IH": (I, H), "HI": (H, I)}
    params = []
    for k in param_kinds(variant):
        fan_in = shapes[k][-1]
        p = randn(*shapes[k]) / math.sqrt(fan_in) if len(shapes[k]) == 2 else 1.0 + 0.3 * randn(*shapes[k])
        params.append(p.to(dtype))
    return x, mask, hmask, params


def run_case(f, chain, variant, case, gen):
    x, mask, hmask, params = make_inputs(case, variant, gen)
    leaves = [x, *params]
    tol = TOL[variant["dtype"]]
    if not case["backward"]:
        with torch.no_grad():
            out, exp = f(x, mask, hmask, *params), chain(x, mask, hmask, *params)
        assert out.dtype == exp.dtype and out.shape == exp.shape
        assert torch.isfinite(exp).all()
        return _forward_verdict(out, exp, tol, variant)
    a = [t.detach().clone().requires_grad_() for t in leaves]
    b = [t.detach().clone().requires_grad_() for t in leaves]
    out = f(a[0], mask, hmask, *a[1:])
    exp = chain(b[0], mask, hmask, *b[1:])
    assert out.dtype == exp.dtype and out.shape == exp.shape
    ok, why = _forward_verdict(out, exp, tol, variant)
    if not ok:
        return ok, why
    R = torch.randn(exp.shape, generator=gen).to(exp.dtype)
    ga = torch.autograd.grad(out, a, R, allow_unused=True)
    gb = torch.autograd.grad(exp, b, R, allow_unused=True)
    ga = [torch.zeros_like(t) if g is None else g for g, t in zip(ga, a)]
    gb = [torch.zeros_like(t) if g is None else g for g, t in zip(gb, b)]
    # each gradient relative to the norm of all of eager's gradients (some are ~0 in exact arithmetic)
    scale = torch.cat([g.detach().double().flatten() for g in gb])
    if scale.norm() == 0:
        return all(torch.equal(p, q) for p, q in zip(ga, gb)), ("zero grads", None)
    for i, (p, q) in enumerate(zip(ga, gb)):
        if rel_err(p, q, scale) >= tol:
            return _arbitrate(chain, variant, (x, mask, hmask, params), R, ga, (f"grad of input {i}", rel_err(p, q, scale)))
    return True, None


def _forward_verdict(out, exp, tol, variant):
    """(ok, why) for an output against eager's: within `tol` (or eager's is zero) passes; beyond it a
    float32 case fails, a bfloat16 one is inconclusive (None: the caller draws new data once)."""
    why = ("forward", rel_err(out, exp))
    if why[1] < tol or exp.norm() == 0:
        return True, why
    return (None, ("bf16 noise?", why)) if variant["dtype"] == torch.bfloat16 else (False, why)


def _arbitrate(chain, variant, inputs, R, ga, why):
    """A float32 case whose gradients differ from eager's, judged against eager in float64: passed where
    dmfx's gradients are within the tolerance of float64's (eager is the less accurate one: a
    LayerNorm over one feature), inconclusive (None: the caller draws new data for the same shapes)
    where a ReLU's input is within float32 rounding of its kink at 0 (the two may round to different
    sides, and the gradients then differ by the cotangent there, which no tolerance covers); else
    failed. A bfloat16 case is inconclusive (see the docstring: drawn again once)."""
    if variant["dtype"] != torch.float32:
        return None, ("bf16 noise?", why)
    x, mask, hmask, params = inputs
    leaves = [t.detach().double().requires_grad_() for t in (x, *params)]
    with relu_kinks() as near:
        exact = chain(leaves[0], mask.double(), hmask.double(), *leaves[1:])
    gd = torch.autograd.grad(exact, leaves, R.double(), allow_unused=True)
    gd = [torch.zeros_like(t) if g is None else g for g, t in zip(gd, leaves)]
    scale = torch.cat([g.flatten() for g in gd])
    if scale.norm() > 0 and all(rel_err(p.double(), q, scale) < TOL[torch.float32] for p, q in zip(ga, gd)):
        return True, None
    return (None, ("near a ReLU kink", why)) if any(near) else (False, why)


def test_fuzz_random_chains_match_eager(record_property):
    limit_name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    rng = random.Random(SEED)
    gen = torch.Generator().manual_seed(SEED)
    start = time.perf_counter()
    cases = failures = redrawn = 0
    with_norm_fired = 0
    fired_total: dict[str, int] = {}
    failed = []
    with torch._dynamo.config.patch({limit_name: 64}):
        for v in range(N_VARIANTS):
            variant = make_variant(rng, v)
            chain = build_fn(variant)
            dmfx.reset()
            f = torch.compile(chain, backend="dmfx", dynamic=True, options={"fallback": False})
            for j in range(CASES_PER_VARIANT):
                case = make_case(rng, variant, j)
                ok, why = run_case(f, chain, variant, case, gen)
                if ok is None:  # inconclusive (a ReLU's kink, bf16 noise): the same case on new data, once
                    redrawn += 1
                    ok, why = run_case(f, chain, variant, case, gen)
                cases += 1
                if not ok:
                    failures += 1
                    failed.append(f"variant {variant['steps']} heads={variant['heads']} {variant['dtype']} case {case}: {why}")
            recs = dmfx.records()
            assert recs, variant
            assert all(r.fallback is None for r in recs), [r.summary() for r in recs]
            fired_v = {}
            for r in recs:
                for k, n in r.fired.items():
                    fired_v[k] = fired_v.get(k, 0) + n
            for k, n in fired_v.items():
                fired_total[k] = fired_total.get(k, 0) + n
            with_norm_fired += bool(fired_v)
            torch._dynamo.reset()
    seconds = time.perf_counter() - start
    summary = (f"{cases} cases ({N_VARIANTS} variants) in {seconds:.1f}s, seed {SEED}, {redrawn} redrawn (a ReLU's kink, bf16 noise); "
               f"fired {fired_total}")
    print("\ndmfx fuzz:", summary)
    record_property("fuzz", summary)
    assert cases >= 500 or N_VARIANTS < 16
    assert not failed, f"{failures} of {cases} cases differ from eager:\n" + "\n".join(failed[:10])
    assert_few_redrawn(redrawn, cases, summary)
    # every variant has a norm: at least half must fuse something (F.layer_norm with a dynamic hidden
    # size does not fuse today: see test_composability::test_functional_layer_norm_with_a_dynamic_hidden_size_fuses)
    assert with_norm_fired >= N_VARIANTS // 2, (with_norm_fired, fired_total)


def test_arbitration_passes_only_float64s_answer_and_redraws_only_at_a_kink():
    """_arbitrate, which judges a float32 case whose gradients differ from eager's: a gradient within
    the tolerance of float64's passes, a wrong one fails, and a wrong one next to a ReLU's kink (an
    input exactly at 0) is inconclusive; so is a bfloat16 case beyond its tolerance (drawn again once)."""
    variant = {"dtype": torch.float32}
    x, w = torch.randn(3, 4, 5), torch.randn(5)
    mask, hmask = torch.zeros(3, 4, 4), torch.zeros(5)
    R = torch.randn(3, 4, 5)

    def chain(x, mask, hmask, w):
        return F.relu(x * w) * 2

    exact = [2 * R * (x * w > 0) * w, (2 * R * (x * w > 0) * x).sum((0, 1))]
    why = ("grad of input 0", 1.0)
    assert _arbitrate(chain, variant, (x, mask, hmask, [w]), R, exact, why) == (True, None)
    wrong = [exact[0] * 1.01, exact[1]]
    assert _arbitrate(chain, variant, (x, mask, hmask, [w]), R, wrong, why) == (False, why)
    x0 = x.clone()
    x0[0, 0, 0] = 0.0  # at the kink: float64 takes ReLU's zero side
    assert _arbitrate(chain, variant, (x0, mask, hmask, [w]), R, wrong, why) == (None, ("near a ReLU kink", why))
    assert _arbitrate(chain, {"dtype": torch.bfloat16}, (x, mask, hmask, [w]), R, exact, why) == (None, ("bf16 noise?", why))
    out = torch.randn(3, 4, 5)
    assert _forward_verdict(out * 1.001, out, 4e-2, {"dtype": torch.bfloat16})[0] is True
    assert _forward_verdict(out * 1.2, out, 4e-2, {"dtype": torch.bfloat16})[0] is None
    assert _forward_verdict(out * 1.2, out, 1e-4, {"dtype": torch.float32})[0] is False
