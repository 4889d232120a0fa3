// embedding_from_host: rows of a frozen embedding table kept in pinned host memory, gathered by token ids into a
// tensor on the ids' device (csrc/cpu/embedding.cpp, csrc/cuda/embedding.cu). The checks both kernels share.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace trainstream {

inline void check_embedding_from_host(const at::Tensor& ids, const at::Tensor& weight) {
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt,
                   "embedding_from_host: ids must be int64 or int32, got ", ids.scalar_type());
  TORCH_CHECK_VALUE(weight.dim() == 2, "embedding_from_host: weight must be (vocab, dim), got ", weight.sizes());
  TORCH_CHECK_VALUE(weight.device().is_cpu(), "embedding_from_host: weight must be in host memory, got it on ",
                    weight.device());
  TORCH_CHECK_VALUE(weight.is_contiguous(), "embedding_from_host: weight must be contiguous");
}

}  // namespace trainstream
