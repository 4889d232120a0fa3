// Input checks shared by the CPU (csrc/cpu/quant.cpp) and CUDA (csrc/cuda/quant.cu) quantization kernels, so both
// raise the same Python exception types and messages as the references in trainstream_hf/ops.py: ValueError
// (TORCH_CHECK_VALUE), TypeError (TORCH_CHECK_TYPE), RuntimeError (TORCH_CHECK).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace trainstream {
namespace quant {

inline void check_weight(const at::Tensor& w, const char* op, int64_t multiple) {
  TORCH_CHECK_VALUE(w.dim() == 2, op, ": weight must be 2-D (out_features, in_features), got shape ", w.sizes());
  const auto t = w.scalar_type();
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, op,
                   ": weight must be float32, bfloat16 or float16, got ", t);
  TORCH_CHECK_VALUE(w.numel() > 0, op, ": weight is empty (shape ", w.sizes(), ")");
  TORCH_CHECK_VALUE(w.size(1) % multiple == 0, op, ": in_features must be a multiple of ", multiple, ", got ",
                    w.size(1), "; pad the weight's columns (and the input's features) with zeros");
}

inline void check_out_dtype(at::ScalarType dtype, const char* op) {
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
                   ": dtype must be float32, bfloat16 or float16, got ", dtype);
}

// A packed companion tensor (scales, offsets): its dtype and shape. The dispatcher sends a call with any CUDA
// argument to the CUDA kernel, which also checks the device (the CPU kernel only ever sees CPU tensors).
inline void check_buffer(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype,
                         at::IntArrayRef sizes) {
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == sizes, op, ": ", name, " must have shape ", sizes, ", got ", t.sizes());
}

}  // namespace quant
}  // namespace trainstream
