// The Python module of dmfx's CPU kernels (cuda_ops/build.py builds each family's <family>_cpu.cpp
// as its own translation unit and links them with this file). Each family file defines
// dmfx::bind_<family>(m), which adds its kernel functions to the module (the self-check and the tests
// call them directly), and, unless built with DMFX_KERNELS_ONLY, registers its ops' CPU and Autograd
// kernels with the dispatcher. Family internals live in named namespaces (dmfx::<family>_impl).
//
// kernel_table / use_kernel_table: the table of kernel pointers the registered kernels call
// (cpu_kernels.h), so build.using_cpu_build can run the ops on another CPU build's kernels.
// (The pointwise family's bind_pointwise is the exception, defined below: see there why.)
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>

#include "cpu_kernels.h"

namespace dmfx {
void bind_norm(pybind11::module_& m);
void bind_softmax(pybind11::module_& m);
void bind_pointwise(pybind11::module_& m);
void bind_attention(pybind11::module_& m);
void bind_cross_entropy(pybind11::module_& m);

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

// ------------------------------------------------------------------------------------ pointwise
// The pointwise family's kernel functions are bound here rather than in pointwise_cpu.cpp, so that
// translation unit does not parse torch's pybind header (about 4.5 s per translation unit here).
namespace dmfx {
void bind_pointwise(pybind11::module_& m) {
  m.def("bias_act_fwd", &bias_act_fwd_cpu, "fused bias + activation + dropout forward (CPU)");
  m.def("bias_act_bwd", &bias_act_bwd_cpu,
        "fused bias + activation + dropout backward with the bias gradient (CPU); a stored bool mask "
        "(native_dropout's) replaces the Philox one",
        pybind11::arg("grad_out"), pybind11::arg("x"), pybind11::arg("bias"), pybind11::arg("act"),
        pybind11::arg("seed"), pybind11::arg("offset"), pybind11::arg("p"), pybind11::arg("output_mask"),
        pybind11::arg("mask") = pybind11::none(), pybind11::arg("mask_scale") = 1.0);
  m.def("glu_fwd", &glu_fwd_cpu, "gated activation act(gate) * up (CPU)");
  m.def("glu_bwd", &glu_bwd_cpu, "gated activation backward [dgate, dup] (CPU)");
  m.def("rope", &rope_cpu, "rotary position embedding of q and k; inverse=True is its backward (CPU)");
}
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
