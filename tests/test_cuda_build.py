"""The CUDA kernels compile with nvcc (no GPU needed). Runs wherever nvcc and a CUDA build of torch are
present (CI's machines have both); the GPU tests themselves are in test_cuda_kernels.py."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

needs_nvcc = pytest.mark.skipif(
    shutil.which("nvcc") is None or torch.version.cuda is None,
    reason="needs nvcc on PATH and a CUDA build of torch (torch.version.cuda is None or nvcc missing)",
)


@needs_nvcc
def test_cuda_extension_compiles():
    code = "from dmfx.cuda_ops import build; m = build.load('cuda'); print('FUNCS', sorted(f for f in dir(m) if not f.startswith('_')))"
    env = {**os.environ}
    # nvcc here is a wrapper in /usr/local/bin, from which torch guesses CUDA_HOME=/usr/local (no libcudart)
    for home in ("/usr/local/cuda-13.0", "/usr/local/cuda"):
        if "CUDA_HOME" not in env and os.path.isdir(os.path.join(home, "lib64")):
            env["CUDA_HOME"] = home
    if not torch.cuda.is_available():
        env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # H200; no GPU here to detect it from
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1500)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "FUNCS ['dropout', 'norm_bwd', 'norm_fwd']" in r.stdout
