"""dmfx's CUDA flash attention kernels, run on the CPU: the emulated module the tests use where there
is no GPU (tests/test_emulated_cuda_flash.py).

The kernel and host code of ``cuda_ops/csrc/attention_cuda.cu`` and its binding are compiled as C++
against ``prelude.h``, which defines the CUDA built-ins (``threadIdx``, ``__syncthreads``,
``__shfl_xor_sync``, shared memory) on the CPU and runs each block's 256 threads as cooperative
fibers. The source is taken verbatim except for three edits, made by text below: the ``#include``
lines and device guards go, the softmax family's device helpers (which the attention kernels use) are
taken from ``softmax_cuda.cu``, and ``launch`` runs the emulated grid instead of a CUDA launch. Shared
memory starts as NaN with a canary past the kernel's allotment; ``set_order`` (threads in order,
reversed, shuffled each round) and ``set_grid`` (fewer blocks than work items: the grid-stride loops
run) let a test check that the results do not depend on scheduling.

A change to those files that moves the markers below fails ``load`` with a message naming the marker.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from dmfx.cuda_ops.build import CSRC, cache_root

HERE = Path(__file__).resolve().parent


def _cut(text: str, start: str, end: str, file: str) -> tuple[int, int]:
    a, b = text.find(start), text.find(end)
    if a < 0 or b < 0:
        missing = start if a < 0 else end
        raise RuntimeError(f"tests/cuda_emu: marker {missing!r} not found in {file}; update tests/cuda_emu/__init__.py")
    return a, b


def source() -> str:
    sm = (CSRC / "softmax_cuda.cu").read_text()
    a, b = _cut(sm, "namespace softmax_impl {", "// Forward, one warp per row", "softmax_cuda.cu")
    b = sm.rindex("// ----", 0, b)
    helpers = sm[a:b] + "}  // namespace softmax_impl\n"
    at = (CSRC / "attention_cuda.cu").read_text()
    at = "\n".join(line for line in at.splitlines() if not line.startswith("#include") and "CUDAGuard" not in line)
    at = at.replace("t->device().is_cuda()", "true")
    s, _ = _cut(at, "template <typename Kernel, typename Arg>\nvoid launch(", "template <typename Kernel, typename Arg>\nvoid launch(",
                "attention_cuda.cu")
    e = at.index("\n}\n", s) + 3
    at = at[:s] + ("template <typename Kernel, typename Arg>\nvoid launch(Kernel kernel, int64_t items, size_t floats, "
                   "const Arg& P) {\n  if (items == 0) return;\n  emu::launch(kernel, items, floats, P);\n}\n") + at[e:]
    bind = (CSRC / "attention_cuda_bind.cpp").read_text()
    bind = "\n".join(line for line in bind.splitlines() if not line.startswith("#include"))
    return "\n".join([
        "#include <torch/extension.h>",
        '#include "prelude.h"',
        '#include "dmfx_common.h"',
        '#include "kernel_api.h"',
        '#include "softmax_api.h"',
        "namespace dmfx {", helpers, "}  // namespace dmfx",
        at, bind,
        "void set_order(int m) { emu::order_mode = m; }",
        "void set_grid(int g) { emu::grid_cap = g; }",
        "long rounds() { return emu::rounds; }",
        'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { dmfx::bind_attention(m); m.def("set_order", &set_order);'
        ' m.def("set_grid", &set_grid); m.def("rounds", &rounds); }',
    ])


_module = None


def load():
    """The emulated module (built once per source version, in dmfx's kernel cache directory):
    ``flash_fwd`` / ``flash_bwd`` with the CUDA bindings' signatures, on CPU tensors."""
    global _module
    if _module is None:
        from torch.utils.cpp_extension import load_inline

        src = source()
        prelude = (HERE / "prelude.h").read_text()
        tag = hashlib.sha256((src + prelude).encode()).hexdigest()[:12]
        build = cache_root() / f"dmfx_flash_emu_{tag}"
        build.mkdir(parents=True, exist_ok=True)
        _module = load_inline(name=f"dmfx_flash_emu_{tag}", cpp_sources=[src], extra_include_paths=[str(CSRC), str(HERE)],
                              extra_cflags=["-O2", "-Wno-unknown-pragmas"], build_directory=str(build), verbose=False)
    return _module
