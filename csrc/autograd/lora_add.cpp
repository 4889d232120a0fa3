// A LoRA adapter's contribution as one op with its autograd node in C++ (trainstream_hf/quant/lora.py).
//
//   lora_add(result, x, lora_a, lora_b, scaling) -> result + (x A^T) B^T * scaling
//
// what PEFT's vanilla lora.Linear.forward adds to its base layer's output (`result + lora_B(lora_A(dropout(x))) *
// scaling` with dropout off), with PEFT's dtypes and rounding: x is taken in the adapters' dtype (PEFT's
// _cast_input_dtype), or, under autocast, both matmuls run in the autocast dtype as F.linear would (autocast casts
// the fp32 adapters of get_peft_model(autocast_adapter_dtype=True) to it); (x A^T) B^T is rounded, then times
// scaling, then added to result (type promotion, then back to result's dtype, as PEFT's final `.to`). The backward
// takes autograd's own matmul forms for the three gradients (dB = g^T (x A^T), dA = (g B)^T x, dx = (g B) A with
// g = d_out * scaling), so the numbers are the ones PEFT's graph computes.
//
// A power-of-two scaling (lora_alpha / r = 2 for the recipes' 32 / 16) is folded into the small (N, r) copy of B
// instead of multiplying the (T, N) product, forward and backward: scaling by 2^k commutes with every rounding of
// the matmul (products, fp32 accumulation, the final cast), so the bits are PEFT's, barring results in the subnormal
// range, and the step saves two passes over a T x N activation per adapter. Any other scaling is multiplied where
// PEFT multiplies.
//
// Why C++: per adapter and step PEFT's path is ~14 ops and ~9 autograd nodes (two weight casts, two linear layers
// with their view nodes, a multiply, an add, three gradient casts), each with its host cost; a Llama-3-8B LoRA over
// all linear layers has 224 adapters, and its training step is host-bound on the H200 (benchmarks/NOTES.md). Here
// one call from Python and one node.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>

#include "../include/autograd_common.h"

namespace trainstream {
namespace {

// The dtype the matmuls run in: the autocast dtype where autocast is on for x's device (and x, A are floating),
// else the adapters' dtype.
at::ScalarType compute_dtype(const at::Tensor& x, const at::Tensor& a) {
  const auto device = x.device().type();
  if (at::autocast::is_autocast_enabled(device)) return at::autocast::get_autocast_dtype(device);
  return a.scalar_type();
}

at::Tensor as(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

void check(const at::Tensor& result, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && b.size(1) == a.size(0),
                    "lora_add: lora_a must be (r, in_features) and lora_b (out_features, r), got ", a.sizes(), " and ",
                    b.sizes());
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == a.size(1), "lora_add: x must be (..., ", a.size(1), "), got ",
                    x.sizes());
  TORCH_CHECK_VALUE(result.dim() == x.dim() && result.size(-1) == b.size(0) &&
                        result.sizes().slice(0, x.dim() - 1) == x.sizes().slice(0, x.dim() - 1),
                    "lora_add: result must be (..., ", b.size(0), ") over x's leading dimensions, got ", result.sizes(),
                    " for x ", x.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()) && at::isFloatingType(a.scalar_type()) &&
                       a.scalar_type() == b.scalar_type(),
                   "lora_add: x and the adapters must be floating point, the adapters of one dtype; got ",
                   x.scalar_type(), ", ", a.scalar_type(), ", ", b.scalar_type());
}

struct Forward {
  at::Tensor out, x2d, ya, a, b;  // out; what the backward needs (x2d: x as saved, b: times scaling if folded)
};

Forward forward_impl(const at::Tensor& result, const at::Tensor& x, const at::Tensor& lora_a,
                     const at::Tensor& lora_b, double scaling) {
  check(result, x, lora_a, lora_b);
  const at::ScalarType c = compute_dtype(x, lora_a);
  Forward f;
  const at::Tensor x2d = as(x, c).reshape({-1, x.size(-1)});
  // Saved for dA: x itself where the compute dtype is at least as wide (the widening cast is exact and redone in
  // backward: the fp32 copy PEFT's graph saves for fp32 adapters would double those bytes), else the cast.
  f.x2d = at::elementSize(x.scalar_type()) <= at::elementSize(c) ? x.reshape({-1, x.size(-1)}) : x2d;
  f.a = as(lora_a, c);
  f.ya = at::mm(x2d, f.a.t());
  at::Tensor ys;
  if (power_of_two(scaling)) {
    f.b = as(lora_b, c).mul(scaling);  // exact: a power of two
    ys = at::mm(f.ya, f.b.t());
  } else {
    f.b = as(lora_b, c);
    ys = at::mm(f.ya, f.b.t()).mul(scaling);
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = lora_b.size(0);
  const at::Tensor sum = at::add(result, ys.view(sizes));
  f.out = as(sum, result.scalar_type());
  return f;
}

}  // namespace

at::Tensor lora_add_forward(const at::Tensor& result, const at::Tensor& x, const at::Tensor& lora_a,
                            const at::Tensor& lora_b, double scaling) {
  return forward_impl(result, x, lora_a, lora_b, scaling).out;
}

namespace {

class LoraAddFunction : public torch::autograd::Function<LoraAddFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& result, const at::Tensor& x,
                            const at::Tensor& lora_a, const at::Tensor& lora_b, double scaling) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Forward f = forward_impl(result, x, lora_a, lora_b, scaling);
    ctx->save_for_backward({f.x2d, f.ya, f.a, f.b});
    ctx->saved_data["scaling"] = scaling;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    // dtypes: result, x, adapters, and the sum's (result's and the compute dtype's promotion)
    ctx->saved_data["dtypes"] = std::vector<int64_t>{
        static_cast<int64_t>(result.scalar_type()), static_cast<int64_t>(x.scalar_type()),
        static_cast<int64_t>(lora_a.scalar_type()),
        static_cast<int64_t>(at::promote_types(result.scalar_type(), f.ya.scalar_type()))};
    return f.out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();  // read once (a second read fails under checkpointing)
    const at::Tensor &x2d = saved[0], &ya = saved[1], &a = saved[2], &b = saved[3];
    const auto dtypes = ctx->saved_data["dtypes"].toIntVector();
    const auto result_dtype = static_cast<at::ScalarType>(dtypes[0]);
    const auto x_dtype = static_cast<at::ScalarType>(dtypes[1]);
    const auto adapter_dtype = static_cast<at::ScalarType>(dtypes[2]);
    const auto sum_dtype = static_cast<at::ScalarType>(dtypes[3]);
    const at::ScalarType c = ya.scalar_type();
    torch::autograd::variable_list out(5);
    const at::Tensor& g = grads[0];
    if (!g.defined()) return out;
    // out = (result + ys).to(result dtype): the sum's gradient in its dtype, then each addend's in its own.
    const at::Tensor g_sum = as(g, sum_dtype);
    if (ctx->needs_input_grad(0)) out[0] = as(g_sum, result_dtype);
    if (!(ctx->needs_input_grad(1) || ctx->needs_input_grad(2) || ctx->needs_input_grad(3))) return out;
    const double scaling = ctx->saved_data["scaling"].toDouble();
    const bool folded = power_of_two(scaling);  // then b holds B * scaling
    const at::Tensor g_c = as(g_sum, c).reshape({-1, b.size(0)});
    const at::Tensor g_yb = folded ? g_c : g_c.mul(scaling);
    if (ctx->needs_input_grad(3)) {
      const at::Tensor d_b = at::mm(g_yb.t(), ya);
      out[3] = as(folded ? d_b.mul(scaling) : d_b, adapter_dtype);
    }
    if (ctx->needs_input_grad(1) || ctx->needs_input_grad(2)) {
      const at::Tensor g_ya = at::mm(g_yb, b);
      if (ctx->needs_input_grad(2)) out[2] = as(at::mm(g_ya.t(), as(x2d, c)), adapter_dtype);
      if (ctx->needs_input_grad(1)) {
        out[1] = as(at::mm(g_ya, a), x_dtype).view(ctx->saved_data["x_sizes"].toIntVector());
      }
    }
    return out;
  }
};

at::Tensor lora_add_autograd(const at::Tensor& result, const at::Tensor& x, const at::Tensor& lora_a,
                             const at::Tensor& lora_b, double scaling) {
  return LoraAddFunction::apply(result, x, lora_a, lora_b, scaling);
}

}  // namespace
}  // namespace trainstream

TORCH_LIBRARY_IMPL(trainstream, CompositeExplicitAutograd, m) {
  m.impl("lora_add", &trainstream::lora_add_forward);
}

TORCH_LIBRARY_IMPL(trainstream, Autograd, m) {
  m.impl("lora_add", &trainstream::lora_add_autograd);
}
