import os

import pytest
import torch

# The graph verifier (passes/verify.py) checks the graph after every pass in every test, and a
# violation fails the test (strict: it raises even under fallback=True). DMFX_VERIFY=0 runs without.
os.environ.setdefault("DMFX_VERIFY", "strict")

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


def tiny_bert_layer(dropout=0.0):
    """An HF BertLayer (hidden 32, 4 heads, eager attention, dropout off unless asked) in train mode,
    and a copy."""
    import copy

    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                  hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = transformers.models.bert.modeling_bert.BertLayer(cfg).train()
    return layer, copy.deepcopy(layer)


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
