// RMSNorm of the Llama family (transformers' LlamaRMSNorm and its copies) as one op with its autograd node in C++.
//
//   rms_norm(x, weight, eps) -> weight * to_x_dtype(float(x) * rsqrt(mean(float(x)^2, -1) + eps)), x (..., K)
//
// The module's forward is eight ops (an fp32 copy of x, pow, mean, add, rsqrt, multiply, a copy back, the weight's
// multiply) and its backward about as many, each a pass over a T x K activation: 65 norms per step of a Llama-3-8B,
// on both sides of every block. Here the forward is one kernel (rms_norm_fwd: the row's sum of squares and the
// output in one pass over x) and the backward one more (rms_norm_bwd); the weight's gradient, needed only when the
// norm trains (a full fine-tune, not LoRA), is taken with torch ops as autograd would. Saved: x, the per-row rstd
// (T floats) and the weight -- the module's graph saves an fp32 copy of x besides.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <vector>

namespace trainstream {
namespace {

using FwdFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double);
using BwdFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);

c10::TypedOperatorHandle<FwdFn>& fwd_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("trainstream::rms_norm_fwd", "").typed<FwdFn>();
  return op;
}

c10::TypedOperatorHandle<BwdFn>& bwd_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("trainstream::rms_norm_bwd", "").typed<BwdFn>();
  return op;
}

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0), "rms_norm: x must be (..., ",
                    weight.size(0), ") for a weight of ", weight.size(0), " features, got ", x.sizes());
}

}  // namespace

at::Tensor rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  const at::Tensor x2d = x.reshape({-1, weight.size(0)}).contiguous();
  return std::get<0>(fwd_op().call(x2d, weight, eps)).view(x.sizes());
}

namespace {

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    check(x, weight);
    const at::Tensor x2d = x.reshape({-1, weight.size(0)}).contiguous();
    auto [y, rstd] = fwd_op().call(x2d, weight, eps);
    ctx->save_for_backward({x2d, weight, rstd});
    ctx->saved_data["sizes"] = x.sizes().vec();
    return y.view(x.sizes());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();  // read once (a second read fails under checkpointing)
    const at::Tensor &x2d = saved[0], &weight = saved[1], &rstd = saved[2];
    torch::autograd::variable_list out(3);
    if (!grads[0].defined()) return out;
    const at::Tensor gy = grads[0].reshape({-1, weight.size(0)}).contiguous();
    if (ctx->needs_input_grad(0)) {
      out[0] = bwd_op().call(gy, x2d, weight, rstd).view(ctx->saved_data["sizes"].toIntVector());
    }
    if (ctx->needs_input_grad(1)) {  // as autograd forms it: (gy * h) in x's dtype, summed over the rows
      const at::Tensor h = (x2d.to(at::kFloat) * rstd.unsqueeze(1)).to(x2d.scalar_type());
      out[1] = (gy * h).sum(0);
    }
    return out;
  }
};

at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return RmsNormFunction::apply(x, weight, eps);
}

}  // namespace
}  // namespace trainstream

TORCH_LIBRARY_IMPL(trainstream, CompositeExplicitAutograd, m) {
  m.impl("rms_norm", &trainstream::rms_norm_forward);
}

TORCH_LIBRARY_IMPL(trainstream, Autograd, m) {
  m.impl("rms_norm", &trainstream::rms_norm_autograd);
  m.impl("rms_norm_fwd", torch::CppFunction::makeFallthrough());
  m.impl("rms_norm_bwd", torch::CppFunction::makeFallthrough());
}
