"""The CUDA tests' own logic, run on the CPU: CI has no GPU, so without this a CUDA test is only ever
run when a session is lent one, and its bugs surface there, in scarce GPU time. The first GPU run
(bench/RESULTS.md, 2026-12-04) found 108 failures of that kind among 1371 tests: a leaf moved with
``.to(dev)`` after the CPU pass had set ``requires_grad`` on it (None gradients), a float passed as a
tensor, a wrong expectation of an optional gradient, a compiled module's parameter names.

Here the tests whose logic goes beyond calling a kernel (autograd through the ops, whole models) run
with the CPU standing in for the GPU: their module's device is patched to "cpu" and the CPU kernels
stand in for the CUDA ones. That checks the test, not the CUDA kernels (the emulated tests and a real
GPU do that): a CPU-against-CPU comparison cannot fail on the kernels' numbers, but a test that
reads the wrong output, expects the wrong shape or names parameters wrongly does (checked: the
norm test's wrong dbias expectation fails here). Not every bug of a GPU test shows on the CPU: the
non-leaf one does not (``x.to("cpu")`` is ``x`` itself, a leaf).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from dmfx.cuda_ops import build


@pytest.fixture
def on_cpu(monkeypatch):
    """Import the CUDA test module `name` with its device constant(s) patched to "cpu"."""

    def load(name: str):
        module = importlib.import_module(f"tests.{name}")
        for const in ("DEV", "DEVICE"):
            if hasattr(module, const):
                monkeypatch.setattr(module, const, "cpu")
        return module

    return load


def test_pointwise_autograd(on_cpu):
    on_cpu("test_cuda_pointwise").test_ops_autograd_on_gpu_match_cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_against_the_cpu_kernels(on_cpu, dtype):
    cpu = build.load("cpu")  # (as the "CUDA" kernels too: the test's logic, not the kernels, is checked here)
    on_cpu("test_cuda_pointwise").test_softcap_matches_cpu(cpu, cpu, dtype, 7)


def test_softmax_autograd(on_cpu):
    on_cpu("test_cuda_softmax").test_ops_and_autograd_on_cuda()


def test_cross_entropy_autograd(on_cpu):
    on_cpu("test_cuda_cross_entropy").test_the_op_runs_through_autograd_on_cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_softcap_against_the_cpu_kernels(on_cpu, dtype):
    cpu = build.load("cpu")  # (as the "CUDA" kernels too: the test's logic, not the kernels, is checked here)
    on_cpu("test_cuda_cross_entropy").test_softcap_matches_cpu((cpu, cpu), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_forward, reduction", [(True, "mean"), (False, "none")])
def test_linear_cross_entropy(on_cpu, dtype, in_forward, reduction):
    on_cpu("test_cuda_cross_entropy").test_linear_cross_entropy_matches_the_cpu(dtype, in_forward, reduction)


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("combo", [0, 2, 3])
def test_norm_gradients_against_autograd(on_cpu, rms, combo):
    module = on_cpu("test_cuda_norm")
    for dtype, H, rows, p in ((torch.float64, 7, 5, 0.0), (torch.float32, 96, 64, 0.1)):
        module.test_norm_grads_match_autograd(build.load("cpu"), dtype, H, rows, rms, p, combo)


@pytest.mark.parametrize("name, autocast", [("bert-mlm", False), ("llama-lm", True)])
def test_whole_models(on_cpu, name, autocast):
    on_cpu("test_cuda_models").test_a_whole_model_trains_as_eager_does_on_the_gpu(name, autocast)


@pytest.mark.parametrize("mask_kind", ["none", "padding", "full"])
def test_soft_capped_flash_attention(on_cpu, mask_kind):
    on_cpu("test_cuda_attention").test_soft_capped_scores_match_the_cpu_kernel(torch.float32, mask_kind, True)
