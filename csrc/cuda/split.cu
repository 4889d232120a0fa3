// split_bf16 on the GPU (maths, rounding and layout as csrc/cpu/split.cpp): one thread per element of t, which
// writes its parts to every block the pattern names.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include "../split.h"

namespace trainstream {
namespace {

struct Pattern {
  int n;
  int part[kSplitMaxPattern];
};

__global__ void split_bf16_kernel(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst, int64_t rows,
                                  int64_t cols, Pattern pat, bool row_blocks) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  const int64_t r = i / cols, c = i - r * cols;
  const float v = src[i];
  __nv_bfloat16 parts[3];
  parts[0] = __float2bfloat16_rn(v);
  const float rest = v - __bfloat162float(parts[0]);
  parts[1] = __float2bfloat16_rn(rest);
  parts[2] = __float2bfloat16_rn(rest - __bfloat162float(parts[1]));
  for (int j = 0; j < pat.n; ++j) {
    const int64_t at = row_blocks ? (j * rows + r) * cols + c : r * (pat.n * cols) + j * cols + c;
    dst[at] = parts[pat.part[j]];
  }
}

at::Tensor split_bf16_cuda(const at::Tensor& t_in, at::IntArrayRef pattern, int64_t dim) {
  check_split(t_in, pattern, dim);
  const c10::cuda::CUDAGuard guard(t_in.device());
  const at::Tensor t = t_in.contiguous();
  at::Tensor out = split_output(t, pattern, dim);
  const int64_t rows = t.size(0), cols = t.size(1), total = rows * cols;
  if (total == 0) return out;
  Pattern pat{static_cast<int>(pattern.size()), {}};
  for (int j = 0; j < pat.n; ++j) pat.part[j] = static_cast<int>(pattern[j]);
  constexpr int kThreads = 256;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  split_bf16_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      t.data_ptr<float>(), reinterpret_cast<__nv_bfloat16*>(out.data_ptr<at::BFloat16>()), rows, cols, pat,
      dim == 0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace trainstream

TORCH_LIBRARY_IMPL(trainstream, CUDA, m) { m.impl("split_bf16", &trainstream::split_bf16_cuda); }
