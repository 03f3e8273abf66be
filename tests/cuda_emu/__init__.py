"""dmfx's CUDA kernels, run on the CPU: the emulated modules the tests use where there is no GPU
(tests/test_emulated_cuda_*.py).

``load(family)`` builds one module per kernel family ("norm", "softmax", "pointwise", "attention",
"cross_entropy"):
the kernel and host code of ``cuda_ops/csrc/<family>_cuda.cu`` and its binding, compiled as C++
against ``prelude.h``, which defines the CUDA built-ins (``threadIdx``/``blockIdx``/``blockDim``/
``gridDim`` in 3-D, ``__syncthreads``, ``__shfl_xor_sync``, shared memory, the CUDA runtime calls and
c10::cuda pieces the host code uses) on the CPU and runs each block's threads as cooperative fibers.
The source is taken verbatim except for these edits, made by text below:

* ``#include`` lines go (the prelude and the shared headers are included once, up front; the
  headers kernel_api.h, softmax_api.h, attention_api.h, pointwise_api.h and cross_entropy_api.h go
  through these edits too);
* ``DMFX_KERNELS_ONLY`` is defined: the bindings' ``TORCH_LIBRARY_IMPL(dmfx, CUDA, m)`` blocks (which
  would register the emulated kernels at the real CUDA key) are left out; the module has the kernel
  functions only;
* ``at::empty`` / ``at::empty_like`` become ``emu::empty_poisoned`` / ``emu::empty_like_poisoned``:
  every output and workspace the host code allocates starts as NaN (255 for bytes), so an element a
  kernel fails to write, or a workspace entry read before it is written, shows as NaN;
* ``at::kCUDA`` becomes ``at::kCPU`` and ``.is_cuda()`` becomes ``.is_cpu()``: the emulated device is
  the CPU, so the host code's device checks still run and require CPU tensors;
* ``kernel<<<grid, block, smem, stream>>>(args)`` becomes ``emu::Cfg(grid, block, smem, stream)(kernel)(args)``;
* ``__launch_bounds__(n, ...)`` of a kernel becomes ``emu::launch_bounds(n, ...)`` at the start of its
  body (more threads per block than that fails, as the launch would on a GPU);
* a block-scope ``__shared__ T name[dims];`` becomes function-static storage (shared by the block's
  threads) that is NaN-filled at the start of each block, with a canary after it;
* the attention family's ``launch`` runs ``emu::launch`` (grid capped by ``set_grid``);
* the CUDA-only headers a .cu file includes (``#include "<name>.cuh"``, e.g. softmax_device.cuh, whose
  device helpers the softmax and attention kernels share) are put, translated, before it: each
  family's module holds its own .cu file only, as each compiles on its own with nvcc.

Every module also has ``set_order`` (0 threads in order, 1 reversed, 2 shuffled each round; 3, 4, 5
warp-serial: each warp runs through its shuffles to its next __syncthreads before the next one starts,
last warp first, first warp first, or shuffled), ``set_grid``
(attention: fewer blocks than work items), ``set_device(sm_count, smem_optin, blocks_per_sm)`` (what
the host code's device queries answer: the grids of the norm / pointwise kernels follow it),
``rounds``, ``launches`` and ``blocks_run``.

A change to those files that moves the markers below fails ``load`` with a message naming the marker.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

from dmfx.cuda_ops.build import CSRC, cache_root

HERE = Path(__file__).resolve().parent
# DMFX_EMU_CSRC: another source directory to emulate (e.g. a copy with a deliberately injected bug,
# to check that the tests catch it); load(family, csrc=...) does the same for one module.
if os.environ.get("DMFX_EMU_CSRC"):
    CSRC = Path(os.environ["DMFX_EMU_CSRC"])
FAMILIES = ("norm", "softmax", "pointwise", "attention", "cross_entropy")
_CUDA_HEADER = re.compile(r'^#include "(\w+\.cuh)"', re.M)

_LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;(){}]*>)?)\s*<<<(.*?)>>>\s*\(", re.S)
_LAUNCH_BOUNDS = re.compile(r"__launch_bounds__\(((?:[^()]|\([^()]*\))*)\)([^{;]*?)\{", re.S)
_STATIC_SHARED = re.compile(r"^(\s*)__shared__\s+([^;\[\]]+?)\s+(\w+)\s*((?:\[[^\]]+\])+)\s*;", re.M)


def _cut(text: str, start: str, end: str, file: str) -> tuple[int, int]:
    a, b = text.find(start), text.find(end)
    if a < 0 or b < 0:
        missing = start if a < 0 else end
        raise RuntimeError(f"tests/cuda_emu: marker {missing!r} not found in {file}; update tests/cuda_emu/__init__.py")
    return a, b


def _static_shared(m: re.Match) -> str:
    ind, typ, name, dims = m.group(1), m.group(2), m.group(3), m.group(4)
    return (f"{ind}static struct {{ {typ} v{dims}; uint32_t canary[16]; }} emu_sh_{name}; "
            f"auto& {name} = emu_sh_{name}.v; "
            f"emu::static_shared(&emu_sh_{name}.v, sizeof(emu_sh_{name}.v), emu_sh_{name}.canary, 16);")


def translate(text: str, file: str) -> str:
    """The text edits every .cu / binding file goes through (see the module docstring)."""
    text = "\n".join(line for line in text.splitlines() if not line.startswith(("#include", "#pragma once")))
    text = text.replace("at::kCUDA", "at::kCPU").replace(".is_cuda()", ".is_cpu()")
    text = text.replace("at::empty(", "emu::empty_poisoned(").replace("at::empty_like(", "emu::empty_like_poisoned(")
    n_launch = len(re.findall(r"<<<", text))
    text, n = _LAUNCH.subn(lambda m: f"emu::Cfg({m.group(2)})({m.group(1)})(", text)
    if n != n_launch:
        raise RuntimeError(f"tests/cuda_emu: rewrote {n} of {n_launch} kernel launches in {file}; update _LAUNCH")
    text = _STATIC_SHARED.sub(_static_shared, text)
    n_lb = text.count("__launch_bounds__(") - text.count("#define __launch_bounds__")
    text, n = _LAUNCH_BOUNDS.subn(lambda m: f"{m.group(2)}{{ emu::launch_bounds({m.group(1)});", text)
    if n != n_lb:
        raise RuntimeError(f"tests/cuda_emu: rewrote {n} of {n_lb} __launch_bounds__ in {file}; update _LAUNCH_BOUNDS")
    left = [ln for ln in text.splitlines() if "__shared__" in ln.split("//")[0] and "extern" not in ln]
    if left:
        raise RuntimeError(f"tests/cuda_emu: __shared__ declarations not rewritten in {file}: {left}")
    return text


def _attention(text: str) -> str:
    s, _ = _cut(text, "template <typename Kernel, typename Arg>\nvoid launch(", "template <typename Kernel, typename Arg>\nvoid launch(",
                "attention_cuda.cu")
    e = text.index("\n}\n", s) + 3
    return text[:s] + ("template <typename Kernel, typename Arg>\nvoid launch(Kernel kernel, int64_t items, size_t floats, "
                       "const Arg& P) {\n  if (items == 0) return;\n  emu::launch(kernel, items, floats, P);\n}\n") + text[e:]


def source(family: str = "attention", csrc: Path | None = None) -> str:
    """The C++ text of the emulated module of `family`, from the sources in `csrc` (default CSRC)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r} (one of {FAMILIES})")
    csrc = csrc or CSRC
    raw = (csrc / f"{family}_cuda.cu").read_text()
    cu = translate(raw, f"{family}_cuda.cu")
    if family == "attention":
        cu = _attention(cu)
    cuda_headers = [translate((csrc / h).read_text(), h) for h in _CUDA_HEADER.findall(raw)]
    bind = translate((csrc / f"{family}_cuda_bind.cpp").read_text(), f"{family}_cuda_bind.cpp")
    return "\n".join([
        "#define DMFX_KERNELS_ONLY",
        "#include <torch/extension.h>",
        "#include <ATen/Dispatch.h>",
        "#include <ATen/OpMathType.h>",
        "#include <algorithm>",
        "#include <cmath>",
        "#include <cstdint>",
        "#include <limits>",
        "#include <type_traits>",
        "#include <vector>",
        '#include "prelude.h"',
        '#include "dmfx_common.h"',
        *(translate((csrc / h).read_text(), h) for h in ("kernel_api.h", "softmax_api.h", "attention_api.h", "pointwise_api.h",
                                                          "cross_entropy_api.h")),
        *cuda_headers,
        cu,
        bind,
        "void set_order(int m) { emu::order_mode = m; }",
        "void set_grid(int g) { emu::grid_cap = g; }",
        "void set_device(int sms, int optin, int per_sm) { emu::sm_count = sms; emu::smem_optin = optin; "
        "emu::blocks_per_sm = per_sm; emu::func_max_dyn_smem.clear(); }",
        "long rounds() { return emu::rounds; }",
        "long launches() { return emu::launches; }",
        "long blocks_run() { return emu::blocks_run; }",
        f'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ dmfx::bind_{family}(m); m.def("set_order", &set_order);'
        ' m.def("set_grid", &set_grid); m.def("set_device", &set_device); m.def("rounds", &rounds);'
        ' m.def("launches", &launches); m.def("blocks_run", &blocks_run); }',
    ])


_modules: dict = {}


def load(family: str = "attention", csrc: Path | None = None):
    """The emulated module of `family` (built once per source version, in dmfx's kernel cache
    directory): the CUDA bindings' functions with their signatures, on CPU tensors. `csrc`: another
    source directory to emulate (default CSRC), e.g. a copy with a planted bug."""
    csrc = Path(csrc or CSRC)
    if (family, csrc) not in _modules:
        from torch.utils.cpp_extension import load_inline

        src = source(family, csrc)
        headers = "".join(p.read_text() for p in sorted(csrc.glob("*.h")))
        prelude = (HERE / "prelude.h").read_text()
        import torch
        from filelock import FileLock

        key = src + prelude + headers + torch.__version__ + sys.version  # (an extension built by another torch must not load)
        tag = hashlib.sha256(key.encode()).hexdigest()[:12]
        name = f"dmfx_{family}_emu_{tag}"
        build = cache_root() / name
        build.mkdir(parents=True, exist_ok=True)
        # load_inline's own lock is a file that a build killed half-way leaves behind, after which every
        # later load waits for it forever. Builds are serialised by this lock instead (as cuda_ops/build.py
        # does), so a `lock` file found while holding it is such a leftover.
        with FileLock(str(build) + ".lock", timeout=600):
            (build / "lock").unlink(missing_ok=True)
            _modules[family, csrc] = load_inline(name=name, cpp_sources=[src], extra_include_paths=[str(csrc), str(HERE)],
                                                 extra_cflags=["-O2", "-Wno-unknown-pragmas"], build_directory=str(build),
                                                 verbose=False)
    return _modules[family, csrc]
