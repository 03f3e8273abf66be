"""Which bad-input call of the CUDA attention kernels crashes its process, and where (for a GPU session).

On the first GPU run (an H200, torch 2.11; bench/RESULTS.md, 2026-12-04) three tests of
tests/test_cuda_attention.py died of a segmentation fault instead of raising the error they expect:
test_kernel_errors at its head-dim check (line ~418), test_varlen_kernel_errors at its cu_seqlens
check (~559) and test_varlen_supported_and_unsupported_on_cuda at its float64 op call (~544), while
other bad-input calls of the same tests raised as expected. On the CPU the same host code, with
tensors that claim to be on CUDA, raises every one of these errors (torch 2.11 and 2.14), so the cause
needs a GPU to find. This runs each call in a process of its own (no pytest, no xdist), prints its exit
code and error, and reruns a crashing one under a debugger (gdb, else cuda-gdb, which the H200 image
has) for the native stack. Two controls that must raise cleanly: a softmax kernel's error and a plain
torch error. If the controls crash too, the machine or torch is at fault, not dmfx.

Found by its second run (2026-12-04, evening): every crashing call formats an integer in its message, and each
died in std::ostream::_M_insert<long> inside the kernel module itself: the image's CXX
(/opt/gcc/bin/g++) had linked a static copy of libstdc++ into the module (bench/gpu_link_probe.py
reproduces it with a ten-line extension). cuda_ops/build.py now builds with a compiler that links
libstdc++.so (_build_compilers); this script checks that on the next GPU run.

Usage (repository root, on the GPU machine; the kernels built or carried first)::

    python3 bench/gpu_pinpoint.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys

SETUP = ("import faulthandler, torch, dmfx; faulthandler.enable(); from dmfx.cuda_ops import build; "
         "e = build.load('cuda'); D = 'cuda'; q = torch.randn(1, 2, 4, 32, device=D); out = torch.empty_like(q); "
         "v = torch.randn(7, 2, 32, device=D); cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=D); "
         "V = torch.ops.dmfx.varlen_attention; ")
CALLS = {
    "413 flash_fwd, CPU inputs": "e.flash_fwd(q.cpu(), q.cpu(), q.cpu(), None, 1.0, False, 0, 0, 0.0, out.cpu())",
    "415 flash_fwd, float64": "e.flash_fwd(q.double(), q.double(), q.double(), None, 1.0, False, 0, 0, 0.0, out.double())",
    "418 flash_fwd, D=160": ("big = torch.randn(1, 2, 4, 160, device=D); "
                             "e.flash_fwd(big, big, big, None, 1.0, False, 0, 0, 0.0, torch.empty_like(big))"),
    "420 flash_fwd, wrong out": "e.flash_fwd(q, q, q, None, 1.0, False, 0, 0, 0.0, torch.empty(1, 2, 4, 31, device=D))",
    "555 varlen_fwd, CPU inputs": "e.varlen_fwd(v.cpu(), v.cpu(), v.cpu(), cu.cpu(), 1.0, False, 0, 0, 0.0, v.cpu())",
    "557 varlen_fwd, float64": "e.varlen_fwd(v.double(), v.double(), v.double(), cu, 1.0, False, 0, 0, 0.0, v.double())",
    "559 varlen_fwd, cu_seqlens on the CPU": "e.varlen_fwd(v, v, v, cu.cpu(), 1.0, False, 0, 0, 0.0, torch.empty_like(v))",
    "544 varlen op, float64": "V(v.double(), v.double(), v.double(), cu, 1.0, False, None, 0.0)",
    "544 varlen op, D=160": "w = torch.randn(7, 2, 160, device=D); V(w, w, w, cu, 1.0, False, None, 0.0)",
    "547 varlen op, cu_seqlens on the CPU": "V(v, v, v, cu.cpu(), 1.0, False, None, 0.0)",
    "control: a softmax kernel's error": "e.softmax_fwd(torch.randn(2, 4, device=D), torch.zeros(2, 4), 1.0, False, 0, 0, 0.0)",
    "control: a torch error": "torch.ones(2, device=D) + torch.ones(3, device=D)",
}


def main() -> None:
    debugger = shutil.which("gdb") or shutil.which("cuda-gdb")
    for name, call in CALLS.items():
        code = SETUP + f"\ntry:\n    {call}\n    print('NO ERROR')\nexcept Exception as x:\n    print(type(x).__name__, str(x)[:160])"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        print(f"{name:40s} rc={r.returncode} {r.stdout.strip()[-200:]}", flush=True)
        if r.returncode < 0:
            print(r.stderr[-3000:], flush=True)
            if debugger:
                g = subprocess.run([debugger, "-batch", "-ex", "run", "-ex", "bt 40", "--args", sys.executable, "-c", code],
                                   capture_output=True, text=True, timeout=300)
                print(f"--- {debugger} backtrace:\n{g.stdout[-6000:]}\n{g.stderr[-2000:]}", flush=True)
            else:
                print("--- no gdb or cuda-gdb on this machine: no native stack", flush=True)


if __name__ == "__main__":
    main()
