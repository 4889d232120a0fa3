// RMSNorm of the Llama family, fused: CUDA kernels (maths and rounding points as csrc/cpu/norm.cpp).
//
// One block per row: the row's sum of squares (forward) or of g * x (backward) is reduced in float32 across the
// block (warp shuffles, then one value per warp through shared memory), then the block writes the row. A row of a
// Llama-3-8B (4096 features) is 8 KiB of bf16: it stays in L1 / L2 between the two passes over it.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <tuple>

namespace trainstream {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float block_sum(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x < 32) {
    total = threadIdx.x < blockDim.x / 32 ? shared[threadIdx.x] : 0.f;
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    if (threadIdx.x == 0) shared[0] = total;
  }
  __syncthreads();
  total = shared[0];
  __syncthreads();  // shared[] is reused by the caller's next reduction
  return total;
}

template <typename T>
__device__ __forceinline__ T round_to(float v) {
  return static_cast<T>(v);
}

template <typename T>
__global__ void rms_norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                    float* __restrict__ rstd, int64_t k, float eps) {
  __shared__ float shared[32];
  const int64_t o = static_cast<int64_t>(blockIdx.x) * k;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x) {
    const float v = static_cast<float>(x[o + i]);
    sum += v * v;
  }
  sum = block_sum(sum, shared);
  const float rs = 1.f / sqrtf(sum / static_cast<float>(k) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = rs;
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x) {
    const T h = round_to<T>(static_cast<float>(x[o + i]) * rs);
    y[o + i] = round_to<T>(static_cast<float>(h) * static_cast<float>(w[i]));
  }
}

template <typename T>
__global__ void rms_norm_bwd_kernel(const T* __restrict__ gy, const T* __restrict__ x, const T* __restrict__ w,
                                    const float* __restrict__ rstd, T* __restrict__ dx, int64_t k) {
  __shared__ float shared[32];
  const int64_t o = static_cast<int64_t>(blockIdx.x) * k;
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x) {
    const float g = static_cast<float>(round_to<T>(static_cast<float>(gy[o + i]) * static_cast<float>(w[i])));
    s += g * static_cast<float>(x[o + i]);
  }
  s = block_sum(s, shared);
  const float rs = rstd[blockIdx.x];
  const float c = rs * rs * rs * s / static_cast<float>(k);
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x) {
    const float g = static_cast<float>(round_to<T>(static_cast<float>(gy[o + i]) * static_cast<float>(w[i])));
    dx[o + i] = round_to<T>(rs * g - static_cast<float>(x[o + i]) * c);
  }
}

void check(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK_VALUE(x.dim() == 2, op, ": x must be (rows, features), got ", x.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(1), op, ": weight must be (", x.size(1), "), got ",
                    weight.sizes());
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), op, ": weight must have x's dtype (", x.scalar_type(),
                   "), got ", weight.scalar_type());
  TORCH_CHECK_VALUE(x.device() == weight.device(), op, ": x and weight must be on one device");
  TORCH_CHECK_VALUE(x.size(0) <= 2147483647, op, ": at most 2^31 - 1 rows");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd_cuda(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check(x_in, weight_in, "rms_norm_fwd");
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows == 0) return {y, rstd};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_fwd_cuda", [&] {
    rms_norm_fwd_kernel<scalar_t><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rstd.data_ptr<float>(), k,
        static_cast<float>(eps));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {y, rstd};
}

at::Tensor rms_norm_bwd_cuda(const at::Tensor& gy_in, const at::Tensor& x_in, const at::Tensor& weight_in,
                             const at::Tensor& rstd_in) {
  check(x_in, weight_in, "rms_norm_bwd");
  TORCH_CHECK_VALUE(gy_in.sizes() == x_in.sizes() && gy_in.scalar_type() == x_in.scalar_type(),
                    "rms_norm_bwd: gy must have x's shape and dtype");
  TORCH_CHECK_VALUE(rstd_in.numel() == x_in.size(0) && rstd_in.scalar_type() == at::kFloat,
                    "rms_norm_bwd: rstd must hold one float32 per row");
  const at::Tensor gy = gy_in.contiguous(), x = x_in.contiguous(), weight = weight_in.contiguous(),
                   rstd = rstd_in.contiguous();
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor dx = at::empty_like(x);
  if (rows == 0) return dx;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_bwd_cuda", [&] {
    rms_norm_bwd_kernel<scalar_t><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        gy.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), rstd.data_ptr<float>(),
        dx.data_ptr<scalar_t>(), k);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dx;
}

}  // namespace trainstream

TORCH_LIBRARY_IMPL(trainstream, CUDA, m) {
  m.impl("rms_norm_fwd", &trainstream::rms_norm_fwd_cuda);
  m.impl("rms_norm_bwd", &trainstream::rms_norm_bwd_cuda);
}
