// embedding_from_host on the CPU: the table's rows by ids (index_select), the same values as nn.Embedding's forward.
// csrc/cuda/embedding.cu reads them from pinned host memory on the GPU.
#include <ATen/core/Tensor.h>
#include <ATen/ops/index_select.h>
#include <torch/library.h>

#include "../embedding.h"

namespace trainstream {
namespace {

at::Tensor embedding_from_host_cpu(const at::Tensor& ids, const at::Tensor& weight) {
  check_embedding_from_host(ids, weight);
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(weight.size(1));
  return at::index_select(weight, 0, ids.reshape({-1})).view(shape);
}

}  // namespace
}  // namespace trainstream

TORCH_LIBRARY_IMPL(trainstream, CPU, m) { m.impl("embedding_from_host", &trainstream::embedding_from_host_cpu); }
