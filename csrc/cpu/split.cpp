// split_bf16: a float32 matrix as a sum of bfloat16 matrices, laid out for one bf16 GEMM (CPU kernel).
//
//   split_bf16(t (R, C) float32, pattern, dim) -> bfloat16
//
// t = p0 + p1 + p2 with p0 = bf16(t), p1 = bf16(t - p0), p2 = bf16(t - p0 - p1), each rounded to nearest even: for
// t in bfloat16's normal range the sum is exact (8 + 8 + 8 significant bits cover float32's 24). The output holds
// the parts named by `pattern` (indices 0..2, up to 8 of them) side by side: stacked as row blocks (dim 0, shape
// (len * R, C)) or as column blocks (dim 1, shape (R, len * C)). A product of two float32 matrices is then one bf16
// GEMM with float32 accumulation over the concatenated inner dimension, the terms above 2^-24 of the product kept
// (csrc/autograd/dequant_linear.cpp: LoRA adapters in float32 over bf16 activations). csrc/cuda/split.cu: the same
// on the GPU, bit for bit.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "../split.h"

namespace trainstream {

void check_split(const at::Tensor& t, at::IntArrayRef pattern, int64_t dim) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "split_bf16: t must be float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2, "split_bf16: t must be a matrix, got ", t.sizes());
  TORCH_CHECK_VALUE(dim == 0 || dim == 1, "split_bf16: dim must be 0 (row blocks) or 1 (column blocks), got ", dim);
  TORCH_CHECK_VALUE(!pattern.empty() && static_cast<int64_t>(pattern.size()) <= kSplitMaxPattern,
                    "split_bf16: pattern must name 1 to ", kSplitMaxPattern, " parts, got ", pattern.size());
  for (int64_t p : pattern) {
    TORCH_CHECK_VALUE(p >= 0 && p < 3, "split_bf16: pattern entries must be 0, 1 or 2, got ", p);
  }
}

at::Tensor split_output(const at::Tensor& t, at::IntArrayRef pattern, int64_t dim) {
  const int64_t n = static_cast<int64_t>(pattern.size());
  return at::empty(dim == 0 ? std::vector<int64_t>{n * t.size(0), t.size(1)}
                            : std::vector<int64_t>{t.size(0), n * t.size(1)},
                   t.options().dtype(at::kBFloat16));
}

namespace {

at::Tensor split_bf16_cpu(const at::Tensor& t_in, at::IntArrayRef pattern, int64_t dim) {
  check_split(t_in, pattern, dim);
  const at::Tensor t = t_in.contiguous();
  at::Tensor out = split_output(t, pattern, dim);
  const int64_t rows = t.size(0), cols = t.size(1), n = static_cast<int64_t>(pattern.size());
  const float* src = t.data_ptr<float>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  std::vector<int64_t> pat(pattern.begin(), pattern.end());
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const float v = src[r * cols + c];
        c10::BFloat16 parts[3];
        parts[0] = c10::BFloat16(v);
        const float rest = v - static_cast<float>(parts[0]);
        parts[1] = c10::BFloat16(rest);
        parts[2] = c10::BFloat16(rest - static_cast<float>(parts[1]));
        for (int64_t j = 0; j < n; ++j) {
          const int64_t at = dim == 0 ? (j * rows + r) * cols + c : r * (n * cols) + j * cols + c;
          dst[at] = parts[pat[j]];
        }
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace trainstream

TORCH_LIBRARY_IMPL(trainstream, CPU, m) { m.impl("split_bf16", &trainstream::split_bf16_cpu); }
