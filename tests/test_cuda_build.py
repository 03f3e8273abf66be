"""The CUDA kernels compile with nvcc (no GPU needed). Runs wherever nvcc and a CUDA build of torch are
present (CI's machines have both); the GPU tests themselves are in test_cuda_norm.py."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from dmfx.cuda_ops import build

needs_nvcc = pytest.mark.skipif(
    shutil.which("nvcc") is None or torch.version.cuda is None,
    reason="needs nvcc on PATH and a CUDA build of torch (torch.version.cuda is None or nvcc missing)",
)


@needs_nvcc
def test_cuda_extension_compiles():
    code = ("import os; from dmfx.cuda_ops import build; m = build.load('cuda'); "
            "print('ARCH', repr(os.environ.get('TORCH_CUDA_ARCH_LIST'))); "
            "print('FUNCS', sorted(f for f in dir(m) if not f.startswith('_')))")
    # No CUDA_HOME here on purpose: nvcc on these machines is a wrapper in /usr/local/bin, from which
    # torch guesses CUDA_HOME=/usr/local (no libcudart); build.py must find the real toolkit itself.
    # No TORCH_CUDA_ARCH_LIST either: build.py targets the visible GPUs (Hopper without one) and sets
    # the variable for its build only, so the process's other extension builds never see it.
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "TORCH_CUDA_ARCH_LIST")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1500)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "ARCH None" in r.stdout, r.stdout
    funcs = eval(r.stdout.split("FUNCS", 1)[1].strip())
    cpu = sorted(f for f in dir(build.load("cpu")) if not f.startswith("_") and f not in build.CPU_ONLY_FUNCTIONS)
    assert {"dropout", "norm_bwd", "norm_fwd"} <= set(funcs)
    assert funcs == cpu, "the CUDA module must expose the same functions as the CPU module"
