import contextlib
import os
from unittest import mock

import pytest
import torch
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

# The graph verifier (passes/verify.py) checks the graph after every pass in every test, and a
# violation fails the test (strict: it raises even under fallback=True). DMFX_VERIFY=0 runs without.
os.environ.setdefault("DMFX_VERIFY", "strict")
# The suite runs dmfx's rewritten graphs as FX GraphModules (seconds to compile) unless a test asks for
# Inductor (compiler="inductor", the default users get: tests/test_inductor.py). DMFX_COMPILER=inductor
# runs the whole suite under Inductor, where fuse="auto" leaves every graph without dropout to it
# whole; add DMFX_FUSE=all to have those rewritten too (tests of the "auto" decision then fail).
os.environ.setdefault("DMFX_COMPILER", "fx")

from dmfx.cuda_ops import build  # noqa: E402  (after DMFX_VERIFY is set)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch and starts from a known seed."""
    import dmfx

    torch._dynamo.reset()
    dmfx.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture(params=build.CPU_BUILDS)
def cpu_build(request):
    """Runs the test once on each CPU build of the kernels (build.CPU_BUILDS: the native -march build
    and the AVX2 baseline), so a bug in either code path shows on any AVX-512 machine. Where a build
    cannot run, or adds nothing (no AVX-512: the native build is the AVX2 path), that run skips with
    the reason. The op-test files use it through ``pytestmark = pytest.mark.usefixtures("cpu_build")``."""
    reason = build.cpu_build_unavailable(request.param)
    if reason is not None:
        pytest.skip(reason)
    with build.using_cpu_build(request.param):
        yield request.param


def rel_err(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """||a - b|| / ||b|| (or / ||scale||): the project's way to compare with eager."""
    a, b = a.detach().double(), b.detach().double()
    denom = (scale.detach().double() if scale is not None else b).norm().item()
    return (a - b).norm().item() / max(denom, 1e-30)


@contextlib.contextmanager
def relu_kinks(activations: dict | None = None):
    """Within it, every ``F.relu`` call (and `activations`' "relu" entry, a dict holding F.relu itself)
    appends to the yielded list whether its input has an element within 1e-5 of its largest of 0: where
    float32 values may round to either side of ReLU's kink, so that two correct computations pass a
    cotangent there or not (the fuzzes' arbiters run float64 eager inside it)."""
    import torch.nn.functional as F

    near: list[bool] = []
    relu = F.relu

    def recording(h, *args, **kwargs):
        m = h.detach().abs()
        near.append(bool((m <= 1e-5 * m.amax().clamp_min(1e-30)).any()))
        return relu(h, *args, **kwargs)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(F, "relu", recording))
        if activations:
            stack.enter_context(mock.patch.dict(activations, {"relu": recording}))
        yield near


def compilers_raising(error):
    """A stand-in for dmfx.backend._compiler whose graph compilers raise ``error(kind)`` (kind: "forward",
    "backward" or "inference"), for the fallback around AOTAutograd's step."""
    def compiler_of(kind, *args, **kwargs):
        def compile_one(gm, example_inputs):
            raise error(kind)
        return compile_one
    return compiler_of


def assert_few_redrawn(redrawn: int, cases: int, summary: str) -> None:
    """The fuzzers' redraw guard. A case beyond its tolerance that passes on new data (a ReLU's kink,
    bf16/fp16 rounding) could also be a bug that shows in only some draws. Rounding needs a redraw in a
    few percent of cases (seeds 6060 and 6363: 1-3%); a tenth or more is a pattern, and fails."""
    assert redrawn <= max(4, cases // 10), f"{redrawn} of {cases} cases needed a redraw: {summary}"


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the backward passes' and their ops' tests compare elementwise."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def assert_param_grads_close(model: torch.nn.Module, ref: torch.nn.Module, tol: float = 1e-5) -> None:
    """Every parameter that has a gradient in `ref` has one in `model`, within `tol` of it relative to
    the norm of all of `ref`'s gradients (some, e.g. a key bias's, are zero in exact arithmetic)."""
    scale = torch.cat([q.grad.flatten() for q in ref.parameters() if q.grad is not None])
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is not None:
            assert p.grad is not None, name
            assert rel_err(p.grad, q.grad, scale) < tol, name


def relaid(t):
    """`t`'s values in another memory layout, as a compiler may hand them to an op: channels-last for a
    4-D tensor (Inductor's layout optimization), else the last dim outermost. None where `t` has no
    other layout (not a tensor, fewer than 2 dims or elements, or only size-1 dims)."""
    if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.numel() < 2:
        return None
    r = t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else None
    if r is None or r.stride() == t.stride():
        r = t.movedim(-1, 0).contiguous().movedim(0, -1)
    return r if r.stride() != t.stride() else None


def fired_without_fallback() -> dict[str, int]:
    """How often each pass fired over dmfx.records(), which must all have been rewritten (no fallback)."""
    import dmfx

    fired: dict[str, int] = {}
    for r in dmfx.records():
        assert r.fallback is None, r.fallback
        for k, v in r.fired.items():
            fired[k] = fired.get(k, 0) + v
    return fired


# ------------------------------------------------------------------ pass tests (tests/test_pass_*.py)


def _as_tuple(fn):
    def g(*a):
        out = fn(*a)
        return out if isinstance(out, tuple) else (out,)

    return g


def rewrite(fn, *inputs, passes=None, **settings):
    """Lower `fn` (all tensors passed as inputs) to ATen like the backend does, run the dmfx passes
    (the forward pipeline; `passes`: only those), return (graph module, context). `settings` are
    PassContext fields (training, attention, ...)."""
    from dmfx.backend import lower_to_aten
    from dmfx.passes import PIPELINE, PassContext, run_pipeline

    gm = lower_to_aten(_as_tuple(fn), inputs)  # exactly what the backend runs the passes on
    settings.setdefault("input_requires_grad", tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs))
    ctx = PassContext(fake_mode=detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if "val" in n.meta]), **settings)
    skip = () if passes is None else tuple(n for n in PIPELINE if n not in passes)
    return run_pipeline(gm, ctx, skip), ctx


def targets(gm):
    """The targets of `gm`'s call nodes, in graph order."""
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def count(gm, op):
    """How many calls of `op`'s default overload `gm` has."""
    return sum(1 for t in targets(gm) if t is op.default)


def check_same(fn, gm, *inputs, tol=1e-5):
    """The rewritten graph `gm` computes what `fn` computes on `inputs`."""
    for a, b in zip(gm(*inputs), _as_tuple(fn)(*inputs)):
        assert rel_err(a, b) < tol


def trace_fake(fn, *args):
    """`fn` traced to an ATen graph on fake values (a hand-built backward graph)."""
    return make_fx(fn, tracing_mode="fake")(*args)


def run_pass(gm, pass_fn, *args):
    """Run `pass_fn` on `gm` with a bare PassContext: (values before, values after, ctx)."""
    from dmfx.passes import PassContext

    ref = gm(*args)
    ctx = PassContext()
    pass_fn(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    return ref, gm(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args]), ctx


def assert_pass_declines(pass_fn, fn, args, absent_op, tol, why=None):
    """`pass_fn` leaves `fn`'s traced graph alone (nothing fired, no `absent_op`), the graph still
    computes `fn` (each output within `tol` of the unrewritten graph's), and, given `why`, a near-miss
    names that reason. Returns the PassContext."""
    gm = trace_fake(fn, *args)
    ref, got, ctx = run_pass(gm, pass_fn, *args)
    assert ctx.fired == {}, fn.__name__
    assert absent_op not in targets(gm), fn.__name__
    for r, o in zip(ref if isinstance(ref, tuple) else (ref,), got if isinstance(got, tuple) else (got,)):
        assert max_rel_err(o, r) < tol
    if why:
        assert any(why in m for m in ctx.missed), (fn.__name__, ctx.missed)
    return ctx


def layer_norm_saved(H=16, rows=(2, 6)):
    """A LayerNorm's input, weight and the mean and rstd dmfx::layer_norm saves for its backward."""
    x = torch.randn(*rows, H)
    w, b = torch.randn(H), torch.randn(H)
    _, mean, rstd = torch.ops.dmfx.layer_norm(x, w, b, 1e-5)
    return x, w, mean, rstd


def assert_kernel_close(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float], what: str,
                        same_dtype: bool = True) -> None:
    """A kernel's output against its reference (the CPU twin of a CUDA kernel, on any device): the
    same shape (and dtype), values within `tol` = (rtol, atol), atol scaled by the reference's
    magnitude (1 + max |expected|). `what` names the case in the failure."""
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if same_dtype:
        assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if expected.numel() == 0:
        return
    rtol, atol = tol
    a, e = actual.double(), expected.double()
    torch.testing.assert_close(a, e, rtol=rtol, atol=atol * (1.0 + e.abs().max().item()), msg=lambda m: f"{what}: {m}")


def softmax_mask(kind: str, shape, dtype: torch.dtype, gen: torch.Generator):
    """A softmax kernel test's mask of `kind` for scores of `shape` (the CUDA tests, real and
    emulated, build the same ones)."""
    *lead, Sq, Sk = shape
    if kind == "none":
        return None
    if kind == "padding":  # [B, 1, 1, Sk] fp32 0 / finfo.min
        keep = torch.rand(lead[0], 1, 1, Sk, generator=gen) < 0.7
        keep[..., 0] = True
        return torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    if kind == "bool":  # [Sq, Sk], one fully masked row
        m = torch.rand(Sq, Sk, generator=gen) < 0.8
        m[0] = False
        return m
    if kind == "same":
        return torch.randn(shape, generator=gen).to(dtype)
    if kind == "float":  # fp32 mask (scores of another dtype read it as fp32)
        return torch.randn(Sq, Sk, generator=gen)
    if kind == "rowconst":
        return torch.randn(Sq, 1, generator=gen).to(dtype)
    raise ValueError(kind)


def rotate_half(x):  # HF LLaMA's rotary rotation: the halves (i, i + D/2) rotate
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):  # GPT-J's and Cohere's: the pairs (2i, 2i + 1) rotate
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def tiny_bert_layer(dropout=0.0):
    """dmfx.models.tiny_bert_layer (an HF BertLayer of hidden size 32 in train mode, and a copy); the
    test skips without transformers."""
    pytest.importorskip("transformers")
    from dmfx.models import tiny_bert_layer as build

    return build(dropout)


def compiled_step_matches_eager(layer, ref, options, shape=(2, 9, 32)):
    """One forward + backward of `layer` compiled with dmfx (`options`) against `ref` (its eager copy)
    on the same input and output gradient: the input's and every parameter's gradient agree. (The key
    bias's gradient is zero up to rounding, softmax ignoring a per-row constant: compared with an
    absolute floor.) Returns the compiled input's gradient."""
    f = torch.compile(layer, backend="dmfx", options=options)
    x = torch.randn(*shape, requires_grad=True)
    R = torch.randn(*shape)
    (f(x)[0] * R).sum().backward()
    xr = x.detach().clone().requires_grad_()
    (ref(xr)[0] * R).sum().backward()
    assert rel_err(x.grad, xr.grad) < 1e-5
    for (name, p), q in zip(layer.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name
    return x.grad


def pytest_runtest_logreport(report):
    """With DMFX_FAILURE_LOG set, each failure's test id and error are appended to that file as it
    happens: a GPU run whose time box kills pytest before its summary (bench/gpu_check.sh) still
    says what failed and why."""
    path = os.environ.get("DMFX_FAILURE_LOG")
    if not path or not report.failed:
        return
    text = report.longreprtext or ""
    lines = text.splitlines()
    errors = [ln for ln in lines if ln.startswith("E ")]
    excerpt = "\n".join((errors or lines)[-15:])
    with open(path, "a") as f:
        f.write(f"=== {report.nodeid} ({report.when})\n{excerpt}\n")


def pytest_configure(config):
    """Under pytest-xdist (the README's ``-n 2``) the workers share the machine's cores: each runs torch
    with its share of them (one thread each on CI's 2 cores) instead of every worker starting as many
    threads as there are cores. Tests that set a thread count (test_determinism.py) set it themselves."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and int(workers) > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def seeded_gradient_error(m, f) -> float:
    """|grad . d - (f(w + e d) - f(w - e d)) / 2e| / |fd| for float64 `m`, `f()` reseeding the
    global RNG first, so every dropout mask is the same in each call and `f` is a fixed smooth
    function of the weights: the gradient must be its derivative, whatever masks the seed draws.
    A recompute (activation checkpointing) that drew another mask than its forward would fail it, and
    so would a dropout backward that applied another mask than its forward. Keep out of `m` what
    makes the difference meaningless: float32 inside the model (HF's RMSNorms upcast), and input
    ids at an embedding's padding_idx (its row moves the output but gets no gradient by design).
    Parameters without a gradient (unused) are left out."""
    f().backward()
    params = [q for q in m.parameters() if q.grad is not None]
    gen = torch.Generator().manual_seed(99)
    d = [torch.randn(q.shape, generator=gen, dtype=q.dtype) * (q.detach().abs().mean() + 1e-3) for q in params]
    gd = sum((q.grad * v).sum() for q, v in zip(params, d)).item()
    eps = 1e-6
    with torch.no_grad():
        for q, v in zip(params, d):
            q.add_(v, alpha=eps)
    fp = f().item()
    with torch.no_grad():
        for q, v in zip(params, d):
            q.add_(v, alpha=-2 * eps)
    fm = f().item()
    fd = (fp - fm) / (2 * eps)
    return abs(gd - fd) / abs(fd)
