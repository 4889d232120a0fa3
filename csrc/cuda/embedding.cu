// embedding_from_host on the GPU: each block copies one token's row of the table straight from pinned host memory
// (mapped into the device's address space: cudaHostGetDevicePointer), so the table never takes device memory and the
// gather needs no host synchronisation; it reads rows x dim x element bytes over PCIe (a 2048-token batch of a
// 4096-wide bf16 table: 16 MiB). Ids out of range fail a device assertion, as nn.Embedding's kernel does.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "../embedding.h"

namespace trainstream {
namespace {

template <typename Id, typename Word>
__global__ void gather_rows_kernel(const Id* __restrict__ ids, const Word* __restrict__ table,
                                   Word* __restrict__ out, int64_t vocab, int64_t words_per_row) {
  const int64_t row = blockIdx.x;
  const int64_t id = static_cast<int64_t>(ids[row]);
  CUDA_KERNEL_ASSERT(id >= 0 && id < vocab && "embedding_from_host: token id out of range");
  const Word* src = table + id * words_per_row;
  Word* dst = out + row * words_per_row;
  for (int64_t k = threadIdx.x; k < words_per_row; k += blockDim.x) dst[k] = src[k];
}

template <typename Id, typename Word>
void launch(const at::Tensor& ids, const void* table, at::Tensor& out, int64_t vocab, int64_t row_bytes) {
  const int64_t rows = ids.numel(), words = row_bytes / static_cast<int64_t>(sizeof(Word));
  const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, words)));
  gather_rows_kernel<Id, Word><<<static_cast<unsigned>(rows), threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      ids.data_ptr<Id>(), static_cast<const Word*>(table), static_cast<Word*>(out.data_ptr()), vocab, words);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor embedding_from_host_cuda(const at::Tensor& ids_in, const at::Tensor& weight) {
  check_embedding_from_host(ids_in, weight);
  TORCH_CHECK_VALUE(ids_in.is_cuda(), "embedding_from_host: ids must be on the GPU for this kernel, got ",
                    ids_in.device());
  TORCH_CHECK_VALUE(weight.is_pinned(), "embedding_from_host: the table must be in pinned host memory (the GPU "
                    "reads it directly)");
  const c10::cuda::CUDAGuard guard(ids_in.device());
  const at::Tensor ids = ids_in.contiguous();
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(weight.size(1));
  at::Tensor out = at::empty(shape, weight.options().device(ids.device()).pinned_memory(false));
  if (ids.numel() == 0 || weight.size(1) == 0) return out;
  void* table = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&table, const_cast<void*>(weight.const_data_ptr()), 0));
  const int64_t row_bytes = weight.size(1) * weight.element_size();
  const auto aligned = [&](int64_t n) {
    return row_bytes % n == 0 && reinterpret_cast<uintptr_t>(table) % n == 0 &&
           reinterpret_cast<uintptr_t>(out.data_ptr()) % n == 0;
  };
  const bool wide = ids.scalar_type() == at::kLong;
  if (aligned(16)) {
    wide ? launch<int64_t, int4>(ids, table, out, weight.size(0), row_bytes)
         : launch<int32_t, int4>(ids, table, out, weight.size(0), row_bytes);
  } else if (aligned(4)) {
    wide ? launch<int64_t, int32_t>(ids, table, out, weight.size(0), row_bytes)
         : launch<int32_t, int32_t>(ids, table, out, weight.size(0), row_bytes);
  } else {
    wide ? launch<int64_t, uint8_t>(ids, table, out, weight.size(0), row_bytes)
         : launch<int32_t, uint8_t>(ids, table, out, weight.size(0), row_bytes);
  }
  return out;
}

}  // namespace
}  // namespace trainstream

TORCH_LIBRARY_IMPL(trainstream, CUDA, m) { m.impl("embedding_from_host", &trainstream::embedding_from_host_cuda); }
