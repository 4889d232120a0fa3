// Declarations shared by the translation units of trainstream_hf._C.
//
// Every op schema lives in csrc/trainstream.cpp (one TORCH_LIBRARY block); kernels live in
// csrc/cpu/*.cpp and csrc/cuda/*.cu and are registered next to their definition with
// TORCH_LIBRARY_IMPL. Stateful runtime objects (host arena, staging pool) are pybind11 classes whose
// init_* functions are called from the single PYBIND11_MODULE in csrc/trainstream.cpp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>

// Declared, not included: pybind11 costs ~6 s of compile time in each unit that includes it, and only the units
// that build Python classes need it (they include torch/csrc/utils/pybind.h).
namespace pybind11 {
class module_;
}  // namespace pybind11

namespace trainstream {

// csrc/cpu/adamw.cpp -------------------------------------------------------------------------
// One AdamW step (torch.optim.AdamW maths, decoupled weight decay, bias correction) over fp32
// master weights, in place. grad is fp32 or bf16; param_bf16, when given, receives bf16(param)
// after the update in the same pass. All tensors contiguous, same numel, on the CPU. num_threads > 0 caps
// the threads (0: at::get_num_threads()); the result does not depend on it.
void adamw_step_cpu(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                    const at::Tensor& grad, const std::optional<at::Tensor>& param_bf16, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int64_t step,
                    bool maximize, int64_t num_threads);
// The same with bfloat16 exp_avg / exp_avg_sq, stored by stochastic rounding (seeded by seed, step and the element's
// index: the bits do not depend on the thread count).
void adamw_step_sr_cpu(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq, const at::Tensor& grad,
                       const std::optional<at::Tensor>& param_bf16, double lr, double beta1, double beta2, double eps,
                       double weight_decay, int64_t step, bool maximize, int64_t seed, int64_t num_threads);

// csrc/cpu/quant.cpp ------------------------------------------------------------------------
// NF4 and NVFP4 weight formats (layouts in trainstream_hf/quant/formats.py; maths in the *_reference functions
// of trainstream_hf/ops.py, which these equal bit for bit). Weights are 2-D float32 / bfloat16 / float16.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_nf4_cpu(const at::Tensor& weight);
at::Tensor dequantize_nf4_cpu(const at::Tensor& data, const at::Tensor& absmax_q, const at::Tensor& absmax_scale,
                              const at::Tensor& absmax_offset, at::ScalarType dtype);
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_nvfp4_cpu(const at::Tensor& weight);
at::Tensor dequantize_nvfp4_cpu(const at::Tensor& data, const at::Tensor& block_scale,
                                const at::Tensor& tensor_scale, at::ScalarType dtype);

// csrc/runtime/arena.cpp ---------------------------------------------------------------------
void init_arena(pybind11::module_& m);

// csrc/runtime/shared_host.cpp ---------------------------------------------------------------
void init_shared_host(pybind11::module_& m);

// csrc/cpu/staging.cpp -----------------------------------------------------------------------
void init_staging(pybind11::module_& m);

// csrc/autograd/fp8_linear.cpp --------------------------------------------------------------
// The FP8 layer's kept activation quantization: [1 if one is kept else 0, hits, misses] (counted since load over
// the calls with reuse=true; a miss is a quantization made); clear drops the kept one first.
std::vector<int64_t> fp8_activation_cache(bool clear);
// The FP8 layer's GEMM setting, "auto", "cublaslt" or "torch" (TRAINSTREAM_FP8_GEMM, read at the first GEMM): set to
// choice, or read from the environment again (from_env), or only returned (neither).
std::string fp8_gemm_setting(const std::optional<std::string>& choice, bool from_env);
// The GEMM the FP8 layer runs on device under the current setting: "cublaslt" or "torch".
std::string fp8_gemm_on(const at::Device& device);

// One cached plan of the cuBLASLt GEMM (csrc/cuda/fp8_gemm.cu): its key and how its algorithm was chosen.
struct Fp8GemmPlanInfo {
  int64_t device, m, n, k, out_dtype;  // out_dtype: an at::ScalarType
  int64_t candidates, chosen;          // algorithms the heuristic returned; the kept one's index in its order
  bool tuned;                          // chosen by timing (else the heuristic's first choice)
  double ms_chosen, ms_first;          // per GEMM where timed, else -1
  // the byte alignments in the key (the largest power of two up to 256 dividing each address) of b (the FP8 layer's
  // weight), a (its activations) and the output
  int64_t align_w = 0, align_x = 0, align_out = 0;
};
using Fp8GemmPlansSource = std::vector<Fp8GemmPlanInfo> (*)(bool clear);
// fp8_gemm.cu, where it is built, hands over the reader of its plan table at load time; fp8_gemm_plans() returns
// its rows (clear: and forgets them, so that the next call of each shape chooses again), or none.
void set_fp8_gemm_plans_source(Fp8GemmPlansSource source);
std::vector<Fp8GemmPlanInfo> fp8_gemm_plans(bool clear);

// True when this build was compiled with CUDA support (TRAINSTREAM_WITH_CUDA).
bool built_with_cuda();

// The SIMD path the CPU AdamW uses on this machine: "avx512", "avx2" or "scalar" (TRAINSTREAM_CPU_ISA forces one).
const char* adamw_isa();

}  // namespace trainstream
