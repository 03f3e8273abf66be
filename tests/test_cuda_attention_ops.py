"""dmfx's attention ops on CUDA against the same ops on the CPU.

On CUDA, dmfx::attention / qkv_attention run the paper's form (cuBLAS batched GEMMs on strided views
around the CUDA softmax kernels), and dmfx::flash_attention / qkv_flash_attention run dmfx's fused CUDA
kernel (csrc/attention_cuda.cu; tests/test_cuda_attention.py tests it in depth) where it applies,
else the same unfused form (the cost model picks PyTorch's SDPA on CUDA unless told otherwise). The CPU
ops (test_attention_ops.py) are the specification: outputs and gradients must match them, with the
same Philox dropout mask (so dropout runs compare exactly), and an HF BERT layer compiled with every
attention form must match eager on the GPU.

Without a GPU every test is skipped.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from conftest import rel_err  # noqa: E402

import dmfx  # noqa: E402
from dmfx.cuda_ops import new_seed  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}


def _heads(B, L, H, D, dtype):
    return torch.randn(B, L, H, D, dtype=torch.float64).to(dtype).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("op", ["attention", "flash_attention"])
@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("Hk", [4, 2])
def test_attention_ops_match_the_cpu(dtype, op, p, Hk):
    B, H, L, D = 2, 4, 40, 16
    q, k, v = _heads(B, L, H, D, dtype), _heads(B, L, Hk, D, dtype), _heads(B, L, Hk, D, dtype)
    mask = torch.zeros(B, 1, 1, L, dtype=dtype)
    mask[1, ..., 30:] = torch.finfo(torch.float32).min
    seed = new_seed() if p else None
    f = getattr(torch.ops.dmfx, op)
    grads = {}
    for dev in ("cpu", "cuda"):
        args = [t.to(dev).detach().requires_grad_() for t in (q, k, v)]
        out = f(*args, mask.to(dev), 0.25, False, seed, p)[0]
        g = torch.ones_like(out)
        grads[dev] = (out, *torch.autograd.grad(out, args, g))
    for a, b in zip(grads["cuda"], grads["cpu"]):
        assert rel_err(a.cpu(), b) < TOL[dtype] * 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flash_backward_bias_gradients_match_the_cpu(dtype):
    """bias_grad=True (the backward pass's fold of the Q/K/V bias gradients): CUDA runs the unfused form
    and sums after it; the CPU kernel sums per (batch, head). Same values, packed and separate."""
    B, H, L, D = 2, 4, 24, 16
    qkv = torch.randn(B, L, 3 * H * D, dtype=dtype)
    q, k, v = (_heads(B, L, H, D, dtype) for _ in range(3))
    seed = new_seed()
    res = {}
    for dev in ("cpu", "cuda"):
        out, stats = torch.ops.dmfx.qkv_flash_attention(qkv.to(dev), H, None, 0.25, False, seed, 0.2)
        packed = torch.ops.dmfx.qkv_flash_attention_backward(torch.ones_like(out), qkv.to(dev), H, stats, None, 0.25,
                                                             False, seed, 0.2, bias_grad=True)
        o2, st2 = torch.ops.dmfx.flash_attention(q.to(dev), k.to(dev), v.to(dev), None, 0.25, False, seed, 0.2)
        sep = torch.ops.dmfx.flash_attention_backward(torch.ones_like(o2), q.to(dev), k.to(dev), v.to(dev), st2, None,
                                                      0.25, False, seed, 0.2, bias_grad=True)
        res[dev] = (*packed, *sep)
    for a, b in zip(res["cuda"], res["cpu"]):
        scale = b.abs().max().clamp_min(1.0)
        assert ((a.cpu() - b).abs().max() / scale).item() < TOL[dtype] * 10


@pytest.mark.parametrize("form", ["flash", "gemm", "sdpa"])
def test_bert_layer_on_the_gpu_matches_eager(form):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    layer = transformers.models.bert.modeling_bert.BertLayer(cfg).cuda().train()
    ref = copy.deepcopy(layer)
    x = torch.randn(2, 16, 64, device="cuda", requires_grad=True)
    out = torch.compile(layer, backend="dmfx", options={"attention": form, "fallback": False})(x)[0]
    R = torch.randn_like(out)  # (a plain sum of squares after the LayerNorm is constant: no gradient)
    (out * R).sum().backward()
    gx, x.grad = x.grad, None
    (ref(x)[0] * R).sum().backward()
    assert rel_err(gx, x.grad) < 1e-4
    forms = {f for r in dmfx.records() for f, _ in r.attention_forms.values()}
    assert forms == {form}  # (a forced "flash" runs dmfx's CUDA kernel)
