"""How this machine links a torch C++ extension, and whether an error message with a number survives it.

On the H200 image (torch 2.11) dmfx's kernel modules came out without libstdc++.so among their
NEEDED libraries (a static copy of libstdc++ inside each module), and every TORCH_CHECK whose message
formats an integer died in that copy's std::ostream::_M_insert<long> (bench/RESULTS.md). This builds
one tiny extension whose check formats an integer, linked as torch links it and again with an
explicit -lstdc++ before the driver's own libraries, and calls each in a process of its own.
Found there: CXX=/opt/gcc/bin/g++ linked libstdc++ statically (-lstdc++ did not change that) and
both modules crashed; cuda_ops/build.py now builds with a compiler that links libstdc++.so instead
(_build_compilers). Run it on a new GPU image to see how that image links.

Usage (repository root)::

    python3 bench/gpu_link_probe.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

SRC = """
#include <torch/extension.h>
int64_t boom(int64_t n) { TORCH_CHECK(n < 0, "n must be negative, got ", n, " in ", at::IntArrayRef({n, 2})); return n; }
"""


def sh(cmd: str) -> str:
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    return (r.stdout + r.stderr).strip()


def main() -> None:
    for var in ("CXX", "CC", "LDFLAGS", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "TORCH_CUDA_ARCH_LIST"):
        print(f"{var}={os.environ.get(var)!r}")
    print("c++:", shutil.which("c++"), "->", os.path.realpath(shutil.which("c++") or ""), "|", sh("c++ --version").splitlines()[0])
    print("libstdc++ the driver links:", sh("c++ -print-file-name=libstdc++.so"), sh("c++ -print-file-name=libstdc++.a"))
    print("static in the specs:", sh("c++ -dumpspecs | grep -n static-libstdc || true")[:400] or "(none)")
    from torch.utils.cpp_extension import load_inline
    root = tempfile.mkdtemp()
    for name, ld in (("probe_plain", []), ("probe_lstdcxx", ["-lstdc++"])):
        d = os.path.join(root, name)
        os.makedirs(d)
        load_inline(name, cpp_sources=[SRC], functions=["boom"], extra_ldflags=ld, build_directory=d, verbose=False)
        so = next(f for f in os.listdir(d) if f.endswith(".so"))
        print(f"\n{name}: link line:", sh(f"grep -A1 '^rule link' {d}/build.ninja | tail -1; grep '^ldflags' {d}/build.ninja"))
        print(f"{name}: NEEDED:", sh(f"readelf -d {d}/{so} | grep NEEDED | sed 's/.*\\[//; s/\\]//' | tr '\\n' ' '"))
        code = (f"import sys, torch; sys.path.insert(0, {d!r}); import {name}\n"
                f"try:\n    {name}.boom(3)\nexcept Exception as e:\n    print('raised:', str(e).splitlines()[0])")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        print(f"{name}: rc={r.returncode} {r.stdout.strip()} {r.stderr.strip()[-300:] if r.returncode else ''}")


if __name__ == "__main__":
    main()
