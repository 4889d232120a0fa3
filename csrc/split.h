// split_bf16's shared checks (csrc/cpu/split.cpp, csrc/cuda/split.cu).
#pragma once
#include <ATen/core/Tensor.h>

namespace trainstream {
constexpr int64_t kSplitMaxPattern = 8;
void check_split(const at::Tensor& t, at::IntArrayRef pattern, int64_t dim);
at::Tensor split_output(const at::Tensor& t, at::IntArrayRef pattern, int64_t dim);
}  // namespace trainstream
