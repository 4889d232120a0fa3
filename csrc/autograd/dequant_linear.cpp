// The weight-only quantized linear layer's autograd node in C++ (trainstream_hf/quant/matmul.py, path "dequant").
//
//   dequant_linear(x, packed, fmt) -> y = linear(x, dequantize_<fmt>(*packed, x.dtype)), x (..., K) -> y (..., N),
//       differentiable in x:
//       dx = dy @ dequantize_<fmt>(*packed, dy.dtype). The weight is decoded again in the backward, never saved in
//       16 bits; packed (the format's codes and scales, fmt.tensor_names order) is saved with save_for_backward, so
//       saved-tensor hooks (the engine's weight pager, checkpointing) see it. No gradient for the weight.
//
// Why C++: the Python autograd Function cost the 8B nf4 block step more host time than its kernels took on the H200
// (profile-engine-nf4-peft-h200-ffeb4e4.json, 2026-12-04); here the backward runs without Python and the GIL, as fp8_linear.cpp's does.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <type_traits>
#include <utility>
#include <string>
#include <vector>

#include "../include/autograd_common.h"
#include "../include/trainstream.h"

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


// ---------------------------------------------------------------------------------------------------------------
// The weight-only layer with a LoRA adapter in the same node (trainstream_hf/quant/lora.py):
//
//   lora_dequant_linear(x, packed, fmt, lora_a, lora_b, scaling) -> y = x W^T + scaling (x A^T) B^T
//
// with W = dequantize_<fmt>(*packed) in the compute dtype c (the autocast dtype under autocast, else x's, which must
// then be the adapters'), and the adapter's product accumulated into the base GEMM's output by a second GEMM with
// beta = 1 (addmm): no separate multiply and add over the (T, N) output in the forward, nor add of the two (T, K)
// input gradients in the backward (dx = dy W, then += (dy B s) A). One rounding fewer than PEFT's graph (which
// rounds the adapter's product, then the sum): not PEFT's bits, closer to the exact sum.
//
// bf16 x with float32 adapters outside autocast (PEFT's default: get_peft_model upcasts bf16 adapters to float32),
// the split regime: PEFT widens x to float32 and multiplies in float32, which on the 8B LoRA step cost ~40 ms of
// copies of activation-sized tensors per step (profile on the H100, benchmarks/NOTES.md). Here nothing
// activation-sized is widened: each float32 operand of an adapter product is split into bfloat16 parts (t = t0 + t1
// + t2, exact; ops split_bf16) laid side by side along the inner dimension, and the product is one bf16 GEMM with
// float32 accumulation (float32 output where the result stays float32): x A^T = [x] [A0; A1; A2]^T exactly term by
// term, and for products of two float32 operands the six terms above 2^-24 (p0 q0, p0 q1, p1 q0, p0 q2, p2 q0, p1 q1)
// -- float32-level results, summed in another order than PEFT's float32 GEMMs. The gradients of A and B are float32,
// as PEFT's. The adapter's terms of y and dx are added into the base's bf16 GEMM output by one addmm_. On the CPU that
// rounds once: y = bf16(y_base + t), PEFT's y (t = s x A^T B^T in float32), and dx rounded once where PEFT rounds the
// adapter's input gradient, then the sum. On CUDA, cuBLAS rounds alpha A B to bf16 before it adds C: every output of
// a bf16 addmm_ equalled bf16(c + bf16(alpha a b)), for alpha 1, 1.5 and 2, cuBLAS and cuBLASLt, either setting of
// torch's reduced-precision reduction (H100, torch 2.11, scripts/diag_split.py, gpu-round-h100-b35d7c8.txt). So there dx has PEFT's
// two roundings and y one more than PEFT's, bf16(y_base + bf16(t)): at most 2^-8 |t| per element more, visible only
// where the adapter's term is comparable to the base's (the GPU test's adapter-dominated layer: 1.34x PEFT's mean
// error against float64). Adding t in float32 instead would cost a (tokens, out_features) float32 pass per layer.
// ---------------------------------------------------------------------------------------------------------------

// y + s (a @ b), in y's place. Run eagerly: one addmm_, the product accumulated by the GEMM (beta = 1). Traced by
// torch.compile, an in-place addmm_ is functionalized into addmm(y, a, b), which copies y into a new tensor before
// its GEMM: a device-to-device copy of a (tokens, features) tensor per call, two per adapter a step (673 copies, 10.3
// ms of an 8B step on the H100: the profile in table-llama3.1-8b-at-ckpt-peak-h100-46a4ce7.json), and inductor keeps
// a bf16 addmm fused. There, on CUDA and for a power-of-two s, the sum is a product and an add, s folded into b
// (exact), which inductor leaves unfused when the sum feeds pointwise kernels (it fuses the add into them) and
// otherwise fuses into an addmm again: either way the value of the eager addmm_ on CUDA, bf16(y + bf16(s a b)) (the
// header). Not on the CPU, whose addmm_ rounds once. Never add(..., alpha): inductor (torch 2.13) fuses add(y, mm(a,
// b), alpha=s) into addmm(y, a, b) without the alpha (benchmarks/NOTES.md, 2026-12-07).
at::Tensor add_product(at::Tensor y, const at::Tensor& a, const at::Tensor& b, double s) {
  if (y.is_cuda() && (traced(y) || traced(a)) && power_of_two(s)) {
    return at::add(y, at::mm(a, s == 1.0 ? b : b.mul(s)));
  }
  return y.addmm_(a, b, /*beta=*/1, s);
}

at::ScalarType lora_compute_dtype(const at::Tensor& x) {
  const auto device = x.device().type();
  return at::autocast::is_autocast_enabled(device) ? at::autocast::get_autocast_dtype(device) : x.scalar_type();
}

// The split regime (above): bf16 x, float32 adapters, autocast off.
bool split_regime(const at::Tensor& x, const at::Tensor& a) {
  return !at::autocast::is_autocast_enabled(x.device().type()) && x.scalar_type() == at::kBFloat16 &&
         a.scalar_type() == at::kFloat;
}

// a @ b of bf16 matrices with a float32 result (float32 accumulation): aten::mm.dtype on CUDA (looked up by name:
// torch builds without it widen instead); on the CPU, which has no kernel for it, the operands widened first
// (exact), which gives the same float32 products.
at::Tensor mm_f32(const at::Tensor& a, const at::Tensor& b) {
  using MmDtype = at::Tensor(const at::Tensor&, const at::Tensor&, at::ScalarType);
  static const auto op = [] {
    auto handle = c10::Dispatcher::singleton().findSchema({"aten::mm", "dtype"});
    return handle ? std::optional<c10::TypedOperatorHandle<MmDtype>>(handle->typed<MmDtype>()) : std::nullopt;
  }();
  if (a.is_cuda() && op) return op->call(a, b, at::kFloat);
  return at::mm(a.to(at::kFloat), b.to(at::kFloat));
}

at::Tensor split_parts(const at::Tensor& t, std::vector<int64_t> pattern, int64_t dim) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("trainstream::split_bf16", "")
                       .typed<at::Tensor(const at::Tensor&, at::IntArrayRef, int64_t)>();
  return op.call(t, pattern, dim);
}

// The float32 sum of `parts` column blocks of y (rows, parts * r) -> (rows, r), or row blocks (parts * r, cols) ->
// (r, cols).
at::Tensor sum_blocks(const at::Tensor& y, int64_t parts, int64_t dim) {
  if (dim == 1) return y.view({y.size(0), parts, y.size(1) / parts}).sum(1);
  return y.view({parts, y.size(0) / parts, y.size(1)}).sum(0);
}

void check_lora(const at::Tensor& x, const at::Tensor& w, const at::Tensor& a, const at::Tensor& b, at::ScalarType c) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == w.size(1), "lora_dequant_linear: x must be (..., ", w.size(1),
                    "), got ", x.sizes());
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && a.size(1) == w.size(1) && b.size(0) == w.size(0) &&
                        b.size(1) == a.size(0),
                    "lora_dequant_linear: lora_a must be (r, ", w.size(1), ") and lora_b (", w.size(0),
                    ", r), got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type() && at::isFloatingType(a.scalar_type()),
                   "lora_dequant_linear: the adapters must be floating point, of one dtype; got ", a.scalar_type(),
                   " and ", b.scalar_type());
  TORCH_CHECK_TYPE(at::autocast::is_autocast_enabled(x.device().type()) || a.scalar_type() == c ||
                       split_regime(x, a),
                   "lora_dequant_linear: outside autocast x and the adapters must share a dtype (or be bfloat16 x "
                   "with float32 adapters), got ", c, " and ", a.scalar_type(), " (ops.lora_add takes that case)");
}

struct LoraForward {
  at::Tensor y, x2d, ya, a, b;
};

LoraForward lora_forward_impl(const at::Tensor& x, at::TensorList packed, const std::string& fmt,
                              const at::Tensor& lora_a, const at::Tensor& lora_b, double scaling) {
  const int64_t count = decoder(fmt).packed;
  TORCH_CHECK_VALUE(static_cast<int64_t>(packed.size()) == count, "lora_dequant_linear: ", fmt, " takes ", count,
                    " packed tensors, got ", packed.size());
  const at::ScalarType c = lora_compute_dtype(x);
  const at::Tensor w = decode(fmt, packed.vec(), c);
  check_lora(x, w, lora_a, lora_b, c);
  LoraForward f;
  if (split_regime(x, lora_a)) {  // nothing widened; a, b kept in float32 (the backward splits them again)
    f.x2d = x.reshape({-1, w.size(1)});
    f.a = lora_a;
    f.b = lora_b;
    f.ya = sum_blocks(mm_f32(f.x2d, split_parts(lora_a, {0, 1, 2}, 0).t()), 3, 1);  // x A^T, (T, r) float32
    at::Tensor y2d = at::mm(f.x2d, w.t());
    // y += s (x A^T) B^T: terms h0 b0, h0 b1, h0 b2, h1 b0, h2 b0, h1 b1. On CUDA the bf16 addmm_ rounds s h B^T to
    // bf16 before adding it to y (see the header).
    y2d = add_product(y2d, split_parts(f.ya, {0, 0, 0, 1, 2, 1}, 1), split_parts(lora_b, {0, 1, 2, 0, 0, 1}, 1).t(),
                      scaling);
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = w.size(0);
    f.y = y2d.view(sizes);
    return f;
  }
  f.x2d = (x.scalar_type() == c ? x : x.to(c)).reshape({-1, w.size(1)});
  f.a = lora_a.scalar_type() == c ? lora_a : lora_a.to(c);
  f.b = lora_b.scalar_type() == c ? lora_b : lora_b.to(c);
  f.ya = at::mm(f.x2d, f.a.t());
  at::Tensor y2d = at::mm(f.x2d, w.t());
  y2d = add_product(y2d, f.ya, f.b.t(), scaling);
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = w.size(0);
  f.y = y2d.view(sizes);
  return f;
}

class LoraDequantLinearFunction : public torch::autograd::Function<LoraDequantLinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, at::TensorList packed,
                            c10::string_view fmt, const at::Tensor& lora_a, const at::Tensor& lora_b,
                            double scaling) {
    at::AutoDispatchBelowADInplaceOrView guard;
    LoraForward f = lora_forward_impl(x, packed, std::string(fmt), lora_a, lora_b, scaling);
    std::vector<at::Tensor> saved = packed.vec();
    saved.insert(saved.end(), {f.x2d, f.ya, f.a, f.b});
    ctx->save_for_backward(saved);
    ctx->saved_data["fmt"] = std::string(fmt);
    ctx->saved_data["scaling"] = scaling;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["dtypes"] = std::vector<int64_t>{static_cast<int64_t>(x.scalar_type()),
                                                     static_cast<int64_t>(lora_a.scalar_type())};
    return f.y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();  // read once (a second read fails under checkpointing)
    const size_t n_packed = saved.size() - 4;
    const std::vector<at::Tensor> packed(saved.begin(), saved.begin() + n_packed);
    const at::Tensor &x2d = saved[n_packed], &ya = saved[n_packed + 1], &a = saved[n_packed + 2],
                     &b = saved[n_packed + 3];
    const double scaling = ctx->saved_data["scaling"].toDouble();
    const auto dtypes = ctx->saved_data["dtypes"].toIntVector();
    // one gradient per forward input: x, each packed tensor, fmt, lora_a, lora_b, scaling
    torch::autograd::variable_list out(n_packed + 5);
    const at::Tensor& g = grads[0];
    if (!g.defined()) return out;
    // positions in the returned list (every forward argument, fmt included) and in needs_input_grad (tensors only)
    const size_t ia = n_packed + 2, ib = n_packed + 3, ea = n_packed + 1, eb = n_packed + 2;
    const at::ScalarType c = x2d.scalar_type();
    const at::Tensor g2d = (g.scalar_type() == c ? g : g.to(c)).reshape({-1, b.size(0)});
    if (a.scalar_type() != c) {  // the split regime (forward kept the float32 adapters): see the header
      const int64_t r = a.size(0);
      const at::Tensor g_ya = sum_blocks(mm_f32(g2d, split_parts(b, {0, 1, 2}, 1)), 3, 1).mul_(scaling);  // (T, r) f32
      if (ctx->needs_input_grad(eb)) {
        out[ib] = sum_blocks(mm_f32(g2d.t(), split_parts(ya, {0, 1, 2}, 1)), 3, 1).mul_(scaling);
      }
      // g_ya's parts: the first three blocks for dA (x is bf16: exact), all six against A's for dx
      const at::Tensor g6 = split_parts(g_ya, {0, 1, 2, 0, 0, 1}, 1);
      if (ctx->needs_input_grad(ea)) out[ia] = sum_blocks(mm_f32(g6.narrow(1, 0, 3 * r).t(), x2d), 3, 0);
      if (ctx->needs_input_grad(0)) {
        const at::Tensor w = decode(ctx->saved_data["fmt"].toStringRef(), packed, c);
        at::Tensor dx = at::mm(g2d, w);
        dx = add_product(dx, g6, split_parts(a, {0, 0, 0, 1, 2, 1}, 0), 1);  // g0 a0, g1 a0, g2 a0, g0 a1, g0 a2, g1 a1
        out[0] = dx.view(ctx->saved_data["x_sizes"].toIntVector());
      }
      return out;
    }
    const at::Tensor g_ya = at::mm(g2d, b).mul_(scaling);  // (T, r)
    if (ctx->needs_input_grad(eb)) {
      out[ib] = at::mm(g2d.t(), ya).mul_(scaling).to(static_cast<at::ScalarType>(dtypes[1]));
    }
    if (ctx->needs_input_grad(ea)) out[ia] = at::mm(g_ya.t(), x2d).to(static_cast<at::ScalarType>(dtypes[1]));
    if (ctx->needs_input_grad(0)) {
      const at::Tensor w = decode(ctx->saved_data["fmt"].toStringRef(), packed, c);
      at::Tensor dx = at::mm(g2d, w);
      dx = add_product(dx, g_ya, a, 1);
      out[0] = dx.view(ctx->saved_data["x_sizes"].toIntVector()).to(static_cast<at::ScalarType>(dtypes[0]));
    }
    return out;
  }
};

at::Tensor lora_dequant_linear_autograd(const at::Tensor& x, at::TensorList packed, c10::string_view fmt,
                                        const at::Tensor& lora_a, const at::Tensor& lora_b, double scaling) {
  return LoraDequantLinearFunction::apply(x, packed, fmt, lora_a, lora_b, scaling);
}

}  // namespace
}  // namespace trainstream

namespace trainstream {
at::Tensor lora_dequant_linear_forward(const at::Tensor& x, at::TensorList packed, c10::string_view fmt,
                                       const at::Tensor& lora_a, const at::Tensor& lora_b, double scaling) {
  return lora_forward_impl(x, packed, std::string(fmt), lora_a, lora_b, scaling).y;
}
}  // namespace trainstream

TORCH_LIBRARY_IMPL(trainstream, CompositeExplicitAutograd, m) {
  m.impl("dequant_linear", &trainstream::dequant_linear_forward);
  m.impl("lora_dequant_linear", &trainstream::lora_dequant_linear_forward);
}

TORCH_LIBRARY_IMPL(trainstream, Autograd, m) {
  m.impl("dequant_linear", &trainstream::dequant_linear_autograd);
  m.impl("lora_dequant_linear", &trainstream::lora_dequant_linear_autograd);
}
