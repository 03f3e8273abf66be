// The CPU kernel functions of every family (each defined in its <family>_cpu.cpp) and the table of
// pointers to them through which the registered CPU ops call them.
//
// Why a table: the tests run every op on two CPU builds of the same sources (cuda_ops/build.py: the
// native -march build, which registers the ops' kernels with the dispatcher, and the AVX2 baseline
// cpu_avx2, built with DMFX_KERNELS_ONLY, which registers nothing). The native module's registered
// kernels call cpu_kernels().<function>; build.using_cpu_build points that at the AVX2 module's own
// table (kernel_table() / use_kernel_table() in cpu_bindings.cpp), so inside the block every op runs
// the AVX2 code with the same glue, checks and autograd.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace dmfx {

using OptTensor = c10::optional<at::Tensor>;
using Tensors = std::vector<at::Tensor>;

// norm family (norm_cpu.cpp)
Tensors norm_fwd_cpu(const at::Tensor& x, const OptTensor& bias, const OptTensor& residual, const OptTensor& weight,
                     const OptTensor& norm_bias, int64_t seed, int64_t offset, double p, double eps, bool rms,
                     bool return_sum);
Tensors norm_bwd_cpu(const at::Tensor& grad_out, const OptTensor& grad_sum, const at::Tensor& x, const OptTensor& bias,
                     const OptTensor& residual, const OptTensor& weight, const OptTensor& mean, const at::Tensor& rstd,
                     int64_t seed, int64_t offset, double p, bool rms, std::vector<bool> output_mask,
                     const OptTensor& grad_out2);
at::Tensor dropout_cpu(const at::Tensor& x, int64_t seed, int64_t offset, double p);

// softmax family (softmax_cpu.cpp)
Tensors softmax_fwd_cpu(const at::Tensor& scores, const OptTensor& mask, double scale, bool causal, int64_t seed,
                        int64_t offset, double p);
at::Tensor softmax_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& probs, int64_t seed, int64_t offset, double p,
                           double scale, const OptTensor& mask, double mask_scale);

// pointwise family (pointwise_cpu.cpp)
at::Tensor bias_act_fwd_cpu(const at::Tensor& x, const OptTensor& bias, int64_t act, int64_t seed, int64_t offset,
                            double p);
Tensors bias_act_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& x, const OptTensor& bias, int64_t act,
                         int64_t seed, int64_t offset, double p, std::vector<bool> output_mask, const OptTensor& mask,
                         double mask_scale);
at::Tensor glu_fwd_cpu(const at::Tensor& gate, const at::Tensor& up, int64_t act);
Tensors glu_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& gate, const at::Tensor& up, int64_t act,
                    std::vector<bool> output_mask);
Tensors rope_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, bool inverse,
                 bool interleaved, bool deinterleave);
at::Tensor softcap_fwd_cpu(const at::Tensor& x, double cap);
at::Tensor softcap_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& out, double cap);

// attention family (attention_cpu.cpp)
at::Tensor flash_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& mask,
                         double scale, bool causal, int64_t seed, int64_t offset, double p, at::Tensor out,
                         double softcap);
void flash_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& stats, const OptTensor& mask, double scale, bool causal, int64_t seed,
                   int64_t offset, double p, at::Tensor dq, at::Tensor dk, at::Tensor dv, const OptTensor& bias_part,
                   double softcap);
at::Tensor varlen_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                          double scale, bool causal, int64_t seed, int64_t offset, double p, at::Tensor out);
void varlen_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& out, const at::Tensor& stats, const at::Tensor& cu_seqlens, double scale,
                    bool causal, int64_t seed, int64_t offset, double p, at::Tensor dq, at::Tensor dk, at::Tensor dv);

// cross_entropy family (cross_entropy_cpu.cpp)
Tensors cross_entropy_fwd_cpu(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                              double label_smoothing, int64_t reduction);
at::Tensor cross_entropy_bwd_cpu(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
                                 const at::Tensor& lse, int64_t ignore_index, double label_smoothing, int64_t reduction,
                                 const OptTensor& grad_logits, double softcap);

struct CpuKernels {
  // What a table must match to be used: its layout (the size) and this version of the list.
  static constexpr int64_t kVersion = 5;
  int64_t size = sizeof(CpuKernels);
  int64_t version = kVersion;
  decltype(&norm_fwd_cpu) norm_fwd = &norm_fwd_cpu;
  decltype(&norm_bwd_cpu) norm_bwd = &norm_bwd_cpu;
  decltype(&dropout_cpu) dropout = &dropout_cpu;
  decltype(&softmax_fwd_cpu) softmax_fwd = &softmax_fwd_cpu;
  decltype(&softmax_bwd_cpu) softmax_bwd = &softmax_bwd_cpu;
  decltype(&bias_act_fwd_cpu) bias_act_fwd = &bias_act_fwd_cpu;
  decltype(&bias_act_bwd_cpu) bias_act_bwd = &bias_act_bwd_cpu;
  decltype(&glu_fwd_cpu) glu_fwd = &glu_fwd_cpu;
  decltype(&glu_bwd_cpu) glu_bwd = &glu_bwd_cpu;
  decltype(&rope_cpu) rope = &rope_cpu;
  decltype(&softcap_fwd_cpu) softcap_fwd = &softcap_fwd_cpu;
  decltype(&softcap_bwd_cpu) softcap_bwd = &softcap_bwd_cpu;
  decltype(&flash_fwd_cpu) flash_fwd = &flash_fwd_cpu;
  decltype(&flash_bwd_cpu) flash_bwd = &flash_bwd_cpu;
  decltype(&varlen_fwd_cpu) varlen_fwd = &varlen_fwd_cpu;
  decltype(&varlen_bwd_cpu) varlen_bwd = &varlen_bwd_cpu;
  decltype(&cross_entropy_fwd_cpu) cross_entropy_fwd = &cross_entropy_fwd_cpu;
  decltype(&cross_entropy_bwd_cpu) cross_entropy_bwd = &cross_entropy_bwd_cpu;
};

// The table the registered CPU kernels call (this module's own unless use_kernel_table switched it).
const CpuKernels& cpu_kernels();

}  // namespace dmfx
