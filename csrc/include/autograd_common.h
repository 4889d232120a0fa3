// Helpers the autograd nodes (csrc/autograd/) share.
#pragma once

#include <ATen/core/Tensor.h>
#include <cmath>

namespace trainstream {

// Whether t is a tensor torch.compile traces with (FakeTensor, FunctionalTensor: the Python or Functionalize dispatch
// key; no data). On such tensors a node calls its op and the op's gradient through the dispatcher, below autograd,
// which gives the registered fake kernels: a compiled region holds the op whole (the kernels read data pointers). On
// real tensors it calls the kernels directly (a TorchDispatchMode then sees the ops they dispatch).
inline bool traced(const at::Tensor& t) {
  return t.defined() &&
         t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
}

// Whether s is a power of two: a product scaled by it is exact in any floating dtype (barring overflow).
inline bool power_of_two(double s) {
  int exponent = 0;
  return s > 0 && std::frexp(s, &exponent) == 0.5;
}

}  // namespace trainstream
