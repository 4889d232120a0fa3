// CPU AdamW over fp32 master weights: one memory-bound pass per element, multithreaded.
//
// Maths: torch.optim.AdamW (single-tensor path), Loshchilov & Hutter, "Decoupled Weight Decay
// Regularization" (ICLR 2019). Scalars are formed in double and rounded to float as torch does; no implicit FMA
// contraction; explicit fma where torch's vectorised kernels use one, so results follow torch's rounding. The bf16 copy rounds to nearest even, as
// at::BFloat16's conversion does (NaN stays NaN).
#include <cmath>
#include <cstring>

#include <torch/library.h>

#include "../include/trainstream.h"
#include "../runtime/thread_pool.h"

#pragma GCC optimize("fp-contract=off", "no-math-errno", "no-trapping-math")

namespace trainstream {
namespace {

struct Scalars {
  float decay;        // 1 - lr * weight_decay
  float one_m_beta1;  // 1 - beta1
  float beta2;
  float one_m_beta2;  // 1 - beta2
  float bc2_sqrt;     // sqrt(1 - beta2^t)
  float eps;
  float neg_step;     // -lr / (1 - beta1^t)
};

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// G is float or uint16_t (bf16 bits). Simple loops: GCC vectorises them per clone target.
template <typename G>
__attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
void adamw_chunk(float* __restrict p, float* __restrict m, float* __restrict v, const G* __restrict g,
                 uint16_t* __restrict out, int64_t n, Scalars s, float sign) {
  for (int64_t i = 0; i < n; ++i) {
    float gi;
    if constexpr (sizeof(G) == 2) gi = from_bf16(g[i]) * sign; else gi = g[i] * sign;
    const float pi = p[i] * s.decay;
    // torch's vectorised lerp_ and addcmul_ round through fused multiply-adds; so do we.
    const float mi = std::fma(s.one_m_beta1, gi - m[i], m[i]);
    const float vi = std::fma(s.one_m_beta2 * gi, gi, v[i] * s.beta2);
    const float denom = std::sqrt(vi) / s.bc2_sqrt + s.eps;
    const float pn = std::fma(s.neg_step, mi / denom, pi);  // addcdiv_
    m[i] = mi;
    v[i] = vi;
    p[i] = pn;
  }
  if (out != nullptr) {
    for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(p[i]);
  }
}

void check_buffer(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), "adamw_step_: ", name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "adamw_step_: ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "adamw_step_: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, "adamw_step_: ", name, " has ", t.numel(), " elements, param has ", numel);
}

}  // namespace

void adamw_step_cpu(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                    const at::Tensor& grad, const std::optional<at::Tensor>& param_bf16, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int64_t step,
                    bool maximize) {
  const int64_t n = param.numel();
  check_buffer(param, "param", at::kFloat, n);
  check_buffer(exp_avg, "exp_avg", at::kFloat, n);
  check_buffer(exp_avg_sq, "exp_avg_sq", at::kFloat, n);
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16,
              "adamw_step_: grad must be float32 or bfloat16, got ", grad.scalar_type());
  check_buffer(grad, "grad", grad.scalar_type(), n);
  if (param_bf16.has_value()) check_buffer(*param_bf16, "param_bf16", at::kBFloat16, n);
  TORCH_CHECK(step >= 1, "adamw_step_: step counts updates from 1, got ", step);
  TORCH_CHECK(lr >= 0.0 && eps >= 0.0 && weight_decay >= 0.0,
              "adamw_step_: lr, eps and weight_decay must be >= 0, got ", lr, ", ", eps, ", ", weight_decay);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0 && beta2 >= 0.0 && beta2 < 1.0,
              "adamw_step_: betas must be in [0, 1), got (", beta1, ", ", beta2, ")");

  Scalars s;
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.one_m_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_m_beta2 = static_cast<float>(1.0 - beta2);
  s.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  s.eps = static_cast<float>(eps);
  s.neg_step = static_cast<float>(-(lr / (1.0 - std::pow(beta1, static_cast<double>(step)))));
  const float sign = maximize ? -1.0f : 1.0f;

  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  uint16_t* out = param_bf16.has_value()
                      ? reinterpret_cast<uint16_t*>(param_bf16->data_ptr<at::BFloat16>()) : nullptr;
  const bool g16 = grad.scalar_type() == at::kBFloat16;
  const void* g = grad.data_ptr();
  constexpr int64_t kGrain = 1 << 16;
  // Chunks start at multiples of 16 elements so every thread's loads stay 64-byte aligned.
  global_pool().parallel_for((n + 15) / 16, kGrain / 16, default_num_threads(), [&](int64_t b, int64_t e) {
    const int64_t lo = b * 16, hi = std::min(n, e * 16);
    if (lo >= hi) return;
    uint16_t* o = out ? out + lo : nullptr;
    if (g16) {
      adamw_chunk<uint16_t>(p + lo, m + lo, v + lo, static_cast<const uint16_t*>(g) + lo, o, hi - lo, s, sign);
    } else {
      adamw_chunk<float>(p + lo, m + lo, v + lo, static_cast<const float*>(g) + lo, o, hi - lo, s, sign);
    }
  });
}

}  // namespace trainstream

TORCH_LIBRARY_IMPL(trainstream, CPU, m) { m.impl("adamw_step_", &trainstream::adamw_step_cpu); }
