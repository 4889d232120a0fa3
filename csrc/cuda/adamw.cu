// AdamW over fp32 master weights on the GPU: the optimizer state of parameters the plan keeps on the device, or
// streams through it (trainstream_hf/engine/device_adamw.py).
//
// The same float operations in the same order as csrc/cpu/adamw.cpp, with the same scalars (csrc/include/adamw.h):
// every multiply, add and fused multiply-add is an explicit round-to-nearest intrinsic (nvcc cannot contract or
// reorder them), and sqrt and division are the correctly rounded ones, as the CPU's vsqrtps / vdivps are. A parameter
// stepped here therefore holds the same bits as one stepped on the host. One thread per element, grid-stride.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "../include/adamw.h"

namespace trainstream {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ uint16_t to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

__device__ __forceinline__ float load_grad(const float* g, int64_t i) { return g[i]; }
__device__ __forceinline__ float load_grad(const uint16_t* g, int64_t i) {
  return __uint_as_float(static_cast<uint32_t>(g[i]) << 16);
}

template <typename G>
__global__ void adamw_kernel(float* __restrict__ p, float* __restrict__ m, float* __restrict__ v,
                             const G* __restrict__ g, uint16_t* __restrict__ out, int64_t n, AdamwScalars s,
                             float sign) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float gi = __fmul_rn(load_grad(g, i), sign);
    const float mo = m[i];
    const float pi = __fmul_rn(p[i], s.decay);
    const float mi = __fmaf_rn(s.one_m_beta1, __fsub_rn(gi, mo), mo);
    const float vi = __fmaf_rn(__fmul_rn(s.one_m_beta2, gi), gi, __fmul_rn(v[i], s.beta2));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.bc2_sqrt), s.eps);
    const float pn = __fadd_rn(pi, __fdiv_rn(__fmul_rn(s.neg_step, mi), denom));
    m[i] = mi;
    v[i] = vi;
    p[i] = pn;
    if (out != nullptr) out[i] = to_bf16(pn);
  }
}

void adamw_step_cuda(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq, const at::Tensor& grad,
                     const std::optional<at::Tensor>& param_bf16, double lr, double beta1, double beta2, double eps,
                     double weight_decay, int64_t step, bool maximize, int64_t num_threads) {
  const AdamwScalars s = adamw_prepare(param, exp_avg, exp_avg_sq, grad, param_bf16, lr, beta1, beta2, eps,
                                       weight_decay, step, num_threads);  // num_threads: CPU only
  const int64_t n = param.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(param.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, static_cast<int64_t>(sms) * 16);
  uint16_t* out = param_bf16.has_value()
                      ? reinterpret_cast<uint16_t*>(param_bf16->data_ptr<at::BFloat16>()) : nullptr;
  const float sign = maximize ? -1.0f : 1.0f;
  if (grad.scalar_type() == at::kBFloat16) {
    adamw_kernel<uint16_t><<<blocks, kThreads, 0, stream>>>(
        param.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
        reinterpret_cast<const uint16_t*>(grad.data_ptr<at::BFloat16>()), out, n, s, sign);
  } else {
    adamw_kernel<float><<<blocks, kThreads, 0, stream>>>(param.data_ptr<float>(), exp_avg.data_ptr<float>(),
                                                          exp_avg_sq.data_ptr<float>(), grad.data_ptr<float>(), out,
                                                          n, s, sign);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace trainstream

TORCH_LIBRARY_IMPL(trainstream, CUDA, m) { m.impl("adamw_step_", &trainstream::adamw_step_cuda); }
