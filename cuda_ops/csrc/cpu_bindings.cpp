// The Python module of dmfx's CPU kernels, and the one translation unit of every family's glue
// (cuda_ops/build.py). Each <family>_cpu.cpp has two parts: its kernels, compiled as the file's own
// translation unit, and, under DMFX_CPU_GLUE, its glue, included here: dmfx::bind_<family>(m), which
// adds the family's kernel functions to the module (the self-check and the tests call them directly),
// and, unless built with DMFX_KERNELS_ONLY, the registration of its ops' CPU and Autograd kernels with
// the dispatcher (the ops on top of the kernel table, cpu_kernels.h, and the autograd formulas). Family
// internals live in named namespaces (dmfx::<family>_impl, dmfx::<family>_ops).
//
// Why one glue unit: the glue is all templates of torch's heaviest headers (torch/library.h, the
// autograd Function machinery, pybind11: about 15 s of parsing), parsed once here instead of once per
// family; the kernel units parse ATen's tensor headers only.
//
// Why -O1 (the pragma, before any include, so it covers the templates instantiated here; the kernel
// units keep the command line's -O3): this unit is host code that calls into libtorch, and a call of
// an op costs the same with it at -O1 as at -O3 (bench/host_overhead, bench/RESULTS.md), while it
// compiles about 20% faster; at -O0 a call costs 2-7x more. (gcc only; another compiler ignores it.)
//
// kernel_table / use_kernel_table: the table of kernel pointers the registered kernels call
// (cpu_kernels.h), so build.using_cpu_build can run the ops on another CPU build's kernels.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O1")
// At -O1 gcc 12's range analysis loses track of a std::vector<bool>'s size where the glue copies one
// (the output_mask a kernel takes by value) and warns of a memmove of a "negative" size: a false positive.
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif
#define DMFX_CPU_GLUE

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>

#include "cpu_kernels.h"

#include "norm_cpu.cpp"
#include "softmax_cpu.cpp"
#include "pointwise_cpu.cpp"
#include "attention_cpu.cpp"
#include "cross_entropy_cpu.cpp"

namespace dmfx {
namespace {
const CpuKernels own_kernels;
std::atomic<const CpuKernels*> active_kernels{&own_kernels};

int64_t kernel_table() { return reinterpret_cast<int64_t>(&own_kernels); }

// Makes the registered kernels call the table at `address` (another build's kernel_table()); returns
// the address of the table they called before.
int64_t use_kernel_table(int64_t address) {
  const auto* table = reinterpret_cast<const CpuKernels*>(address);
  TORCH_CHECK(table != nullptr && table->size == static_cast<int64_t>(sizeof(CpuKernels)) &&
                  table->version == CpuKernels::kVersion,
              "dmfx: use_kernel_table: not a kernel table of this version of dmfx's CPU kernels");
  return reinterpret_cast<int64_t>(active_kernels.exchange(table));
}
}  // namespace

const CpuKernels& cpu_kernels() { return *active_kernels.load(std::memory_order_acquire); }
}  // namespace dmfx

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  dmfx::bind_norm(m);
  dmfx::bind_softmax(m);
  dmfx::bind_pointwise(m);
  dmfx::bind_attention(m);
  dmfx::bind_cross_entropy(m);
  m.def("kernel_table", &dmfx::kernel_table, "the address of this module's table of CPU kernel pointers");
  m.def("use_kernel_table", &dmfx::use_kernel_table, pybind11::arg("address"),
        "make the registered CPU kernels call the table at `address`; returns the previous table's address");
}
