// The FP8 tensor-core linear layer's autograd node in C++ (trainstream_hf/quant/matmul.py, fp8_w8a8_scaled_mm).
//
// Why C++: on the H200 the Python side of one FP8 layer call (a torch.autograd.Function, its backward re-entering
// Python on the autograd thread, and the five ops of the backward each parsed from Python) cost ~160 us of host time
// per forward + backward against ~45 us for nn.Linear, so a block's 7 layers enqueued slower (2.2 ms) than the GPU
// ran them (1.8 ms) (benchmarks/NOTES.md, session 8). Here the backward never takes the GIL and its three kernels
// are launched from C++.
//
//   fp8_linear(x, xq, sx, w, w_scale) -> y = _scaled_mm(xq, w^T, scale_a = sx (T, 1), scale_b = w_scale (1, N))
//       in x's dtype. x (T, K) is the unquantized input: only its dtype and its place in the graph are used (the
//       gradient flows to it); xq / sx its row-wise E4M3 quantization (quantize_rows_e4m3, maybe shared between
//       layers reading the same x). w (N, K) float8_e4m3fn codes, w_scale (N,) float32.
//   fp8_linear_dgrad(dy, w, w_scale) -> dx = _scaled_mm(e4m3(dy * w_scale) per row, w (column-major), scale_a = s_g,
//       scale_b = ones (1, K)) in dy's dtype: the straight-through input gradient (maths in matmul.py).
//
// w and w_scale are saved with save_for_backward, so saved-tensor hooks (the engine's weight pager, activation
// checkpointing) see them as they see any saved tensor. No gradient for xq, sx, w, w_scale.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace trainstream {
namespace {

// t itself where it is contiguous at a 16-byte aligned address (cuBLAS' operand rule), else an aligned copy.
at::Tensor aligned(const at::Tensor& t) {
  if (t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0) return t;
  return t.clone(at::MemoryFormat::Contiguous);
}

void check_operands(const at::Tensor& w, const at::Tensor& w_scale, const char* op) {
  TORCH_CHECK_VALUE(w.dim() == 2, op, ": w must be 2-D (out_features, in_features), got shape ", w.sizes());
  TORCH_CHECK_TYPE(w.scalar_type() == at::kFloat8_e4m3fn, op, ": w must be float8_e4m3fn, got ", w.scalar_type());
  TORCH_CHECK_TYPE(w_scale.scalar_type() == at::kFloat, op, ": w_scale must be float32, got ", w_scale.scalar_type());
  TORCH_CHECK_VALUE(w_scale.numel() == w.size(0), op, ": w_scale must hold one scale per row of w (", w.size(0),
                    "), got shape ", w_scale.sizes());
}

}  // namespace

at::Tensor fp8_linear_forward(const at::Tensor& x, const at::Tensor& xq, const at::Tensor& sx, const at::Tensor& w,
                              const at::Tensor& w_scale) {
  check_operands(w, w_scale, "fp8_linear");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == w.size(1), "fp8_linear: x must be (tokens, ", w.size(1), "), got ",
                    x.sizes());
  TORCH_CHECK_VALUE(xq.sizes() == x.sizes() && sx.dim() == 2 && sx.size(0) == x.size(0) && sx.size(1) == 1,
                    "fp8_linear: xq must have x's shape and sx (tokens, 1); got ", xq.sizes(), " and ", sx.sizes());
  return at::_scaled_mm(aligned(xq), aligned(w).t(), aligned(sx), aligned(w_scale).view({1, -1}), std::nullopt,
                        std::nullopt, x.scalar_type(), false);
}

at::Tensor fp8_linear_dgrad(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& w_scale) {
  check_operands(w, w_scale, "fp8_linear_dgrad");
  TORCH_CHECK_VALUE(dy.dim() == 2 && dy.size(1) == w.size(0), "fp8_linear_dgrad: dy must be (tokens, ", w.size(0),
                    "), got ", dy.sizes());
  static auto quantize = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("trainstream::quantize_rows_e4m3", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&,
                                                                       const std::optional<at::Tensor>&)>();
  static auto transpose = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("trainstream::transpose_bytes", "")
                              .typed<at::Tensor(const at::Tensor&)>();
  auto [gq, sg] = quantize.call(dy, std::optional<at::Tensor>(w_scale.reshape({-1})));  // dy * s_w, per row
  // The (N, K) operand column-major = a row-major (K, N) copy viewed back.
  const at::Tensor w_t = transpose.call(w);
  const at::Tensor ones = at::ones({1, w.size(1)}, dy.options().dtype(at::kFloat));
  return at::_scaled_mm(gq, w_t.t(), sg, ones, std::nullopt, std::nullopt, dy.scalar_type(), false);
}

namespace {

class Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& xq,
                            const at::Tensor& sx, const at::Tensor& w, const at::Tensor& w_scale) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({w, w_scale});
    return fp8_linear_forward(x, xq, sx, w, w_scale);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();  // read once (a second read fails under checkpointing)
    at::Tensor dx;
    if (ctx->needs_input_grad(0) && grads[0].defined()) dx = fp8_linear_dgrad(grads[0], saved[0], saved[1]);
    return {dx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor fp8_linear_autograd(const at::Tensor& x, const at::Tensor& xq, const at::Tensor& sx, const at::Tensor& w,
                               const at::Tensor& w_scale) {
  return Fp8LinearFunction::apply(x, xq, sx, w, w_scale);
}

}  // namespace
}  // namespace trainstream

TORCH_LIBRARY_IMPL(trainstream, CompositeExplicitAutograd, m) {
  m.impl("fp8_linear", &trainstream::fp8_linear_forward);
  m.impl("fp8_linear_dgrad", &trainstream::fp8_linear_dgrad);
}

TORCH_LIBRARY_IMPL(trainstream, Autograd, m) {
  m.impl("fp8_linear", &trainstream::fp8_linear_autograd);
  // Not differentiable, and called on tensors that require grad (the layer's input): no autograd node at all, rather
  // than the not-implemented fallback's node, which costs host time and warns when a backward reaches it.
  m.impl("quantize_rows_e4m3", torch::CppFunction::makeFallthrough());
  m.impl("transpose_bytes", torch::CppFunction::makeFallthrough());
  m.impl("fp8_linear_dgrad", torch::CppFunction::makeFallthrough());
}
