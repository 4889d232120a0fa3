// The weight-only quantized linear layer's autograd node in C++ (trainstream_hf/quant/matmul.py, path "dequant").
//
//   dequant_linear(x, packed, fmt) -> y = linear(x, dequantize_<fmt>(*packed, x.dtype)), x (..., K) -> y (..., N),
//       differentiable in x:
//       dx = dy @ dequantize_<fmt>(*packed, dy.dtype). The weight is decoded again in the backward, never saved in
//       16 bits; packed (the format's codes and scales, fmt.tensor_names order) is saved with save_for_backward, so
//       saved-tensor hooks (the engine's weight pager, checkpointing) see it. No gradient for the weight.
//
// Why C++: the Python autograd Function cost the 8B nf4 block step more host time than its kernels took on the H200
// (benchmarks/NOTES.md, sessions 7-8); here the backward runs without Python and the GIL, as fp8_linear.cpp's does.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace trainstream {
namespace {

// A format's dequantize_<fmt>(*packed, ScalarType dtype) op and its packed tensor count, looked up once (the layer
// calls this twice per training step).
struct Decoder {
  c10::OperatorHandle op;
  int64_t packed;
};

const Decoder& decoder(const std::string& fmt) {
  auto find = [](const char* name, int64_t packed) {
    return Decoder{c10::Dispatcher::singleton().findSchemaOrThrow(name, ""), packed};
  };
  if (fmt == "int8") { static const Decoder d = find("trainstream::dequantize_int8", 2); return d; }
  if (fmt == "fp8") { static const Decoder d = find("trainstream::dequantize_fp8", 2); return d; }
  if (fmt == "nvfp4") { static const Decoder d = find("trainstream::dequantize_nvfp4", 3); return d; }
  if (fmt == "nf4") { static const Decoder d = find("trainstream::dequantize_nf4", 4); return d; }
  TORCH_CHECK_VALUE(false, "dequant_linear: unknown format '", fmt, "' (int8, nf4, fp8 or nvfp4)");
}

// dequantize_<fmt>(*packed, dtype) through the dispatcher (boxed: the schemas differ per format).
at::Tensor decode(const std::string& fmt, const std::vector<at::Tensor>& packed, at::ScalarType dtype) {
  const c10::OperatorHandle& op = decoder(fmt).op;
  torch::jit::Stack stack;
  stack.reserve(packed.size() + 1);
  for (const auto& t : packed) stack.emplace_back(t);
  stack.emplace_back(dtype);
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

}  // namespace

at::Tensor dequant_linear_forward(const at::Tensor& x, at::TensorList packed, c10::string_view fmt_view) {
  const std::string fmt(fmt_view);
  const int64_t count = decoder(fmt).packed;
  TORCH_CHECK_VALUE(static_cast<int64_t>(packed.size()) == count, "dequant_linear: ", fmt, " takes ", count,
                    " packed tensors, got ", packed.size());
  TORCH_CHECK_VALUE(x.dim() >= 1, "dequant_linear: x must be (..., in_features), got a scalar");
  // (..., K) -> (T, K) -> (T, N) -> (..., N) here, below autograd: no view nodes of their own (the layer is called
  // 224 times per step of an 8B Llama LoRA).
  const at::Tensor w = decode(fmt, packed.vec(), x.scalar_type());
  TORCH_CHECK_VALUE(x.size(-1) == w.size(1), "dequant_linear: x must be (..., ", w.size(1), "), got ", x.sizes());
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = w.size(0);
  return at::linear(x.reshape({-1, w.size(1)}), w).view(sizes);
}

namespace {

class DequantLinearFunction : public torch::autograd::Function<DequantLinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, at::TensorList packed,
                            c10::string_view fmt) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward(packed.vec());
    ctx->saved_data["fmt"] = std::string(fmt);
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    return dequant_linear_forward(x, packed, fmt);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();  // read once (a second read fails under checkpointing)
    at::Tensor dx;
    if (ctx->needs_input_grad(0) && grads[0].defined()) {
      const at::Tensor& dy = grads[0];
      const at::Tensor w = decode(ctx->saved_data["fmt"].toStringRef(), saved, dy.scalar_type());
      dx = dy.reshape({-1, w.size(0)}).mm(w).view(ctx->saved_data["x_sizes"].toIntVector());
    }
    // One gradient per forward input: x, then each packed tensor (a TensorList counts as its tensors), fmt.
    torch::autograd::variable_list out(saved.size() + 2);
    out[0] = dx;
    return out;
  }
};

at::Tensor dequant_linear_autograd(const at::Tensor& x, at::TensorList packed, c10::string_view fmt) {
  return DequantLinearFunction::apply(x, packed, fmt);
}

}  // namespace
}  // namespace trainstream

TORCH_LIBRARY_IMPL(trainstream, CompositeExplicitAutograd, m) {
  m.impl("dequant_linear", &trainstream::dequant_linear_forward);
}

TORCH_LIBRARY_IMPL(trainstream, Autograd, m) {
  m.impl("dequant_linear", &trainstream::dequant_linear_autograd);
}
