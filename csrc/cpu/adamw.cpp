// CPU AdamW over fp32 master weights: one memory-bound pass per element, multithreaded.
//
// Maths: torch.optim.AdamW (single-tensor path), Loshchilov & Hutter, "Decoupled Weight Decay
// Regularization" (ICLR 2019). Scalars are formed in double and rounded to float as torch does; no implicit FMA
// contraction; explicit fma where torch's vectorised kernels use one, so results follow torch's rounding. The bf16 copy rounds to nearest even, as
// at::BFloat16's conversion does (NaN stays NaN).
#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include <torch/library.h>

#include "../include/adamw.h"
#include "../include/trainstream.h"
#include "../runtime/thread_pool.h"

#pragma GCC optimize("fp-contract=off")
// GCC 12's own avx512fintrin.h trips -Wmaybe-uninitialized in _mm512_cvtepi32_epi16 (its _mm256_undefined_si256).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace trainstream {
namespace {

using Scalars = AdamwScalars;

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

// Scalar body: the tail of the vector loops and the path for CPUs without AVX2. G is float or uint16_t
// (bf16 bits).
template <typename G>
inline void adamw_scalar(float* __restrict p, float* __restrict m, float* __restrict v, const G* __restrict g,
                         uint16_t* __restrict out, int64_t n, const Scalars& s, float sign) {
  for (int64_t i = 0; i < n; ++i) {
    float gi;
    if constexpr (sizeof(G) == 2) gi = from_bf16(g[i]) * sign; else gi = g[i] * sign;
    const float pi = p[i] * s.decay;
    // torch's vectorised lerp_ and addcmul_ round through fused multiply-adds; so do we. Its addcdiv_ does not: it
    // computes self + (value * t1) / t2, each operation rounded, and so do we. The bits still differ from
    // torch.optim.AdamW's in some elements: torch 2.13's vectorised sqrt on the CPU is not correctly rounded (1 ulp
    // off in ~17% of elements on an AVX-512 host, 2026-12-07), ours is (and so is the CUDA kernel's, which must match).
    const float mi = std::fma(s.one_m_beta1, gi - m[i], m[i]);
    const float vi = std::fma(s.one_m_beta2 * gi, gi, v[i] * s.beta2);
    const float denom = std::sqrt(vi) / s.bc2_sqrt + s.eps;
    const float pn = pi + (s.neg_step * mi) / denom;  // addcdiv_: self + value * t1 / t2, no fma
    m[i] = mi;
    v[i] = vi;
    p[i] = pn;
    if (out != nullptr) out[i] = to_bf16(pn);
  }
}

// AVX-512: 16 lanes, masked tail. Same operations in the same order as adamw_scalar: vsqrtps and vdivps are
// correctly rounded, so every lane equals the scalar result bit for bit.
template <typename G>
__attribute__((target("avx512f,avx512bw,avx512vl,fma")))
void adamw_avx512(float* __restrict p, float* __restrict m, float* __restrict v, const G* __restrict g,
                  uint16_t* __restrict out, int64_t n, const Scalars& s, float sign) {
  const __m512 decay = _mm512_set1_ps(s.decay), omb1 = _mm512_set1_ps(s.one_m_beta1);
  const __m512 b2 = _mm512_set1_ps(s.beta2), omb2 = _mm512_set1_ps(s.one_m_beta2);
  const __m512 bc2 = _mm512_set1_ps(s.bc2_sqrt), eps = _mm512_set1_ps(s.eps);
  const __m512 nstep = _mm512_set1_ps(s.neg_step), sg = _mm512_set1_ps(sign);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i rnd = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), qnan = _mm512_set1_epi32(0x40);
  // The bf16 copy is only written here and read later by a DMA engine: non-temporal stores skip the read for
  // ownership of each line (2 of the ~30 bytes moved per element) and leave the cache to p, m and v.
  const bool stream = out != nullptr && reinterpret_cast<uintptr_t>(out) % 32 == 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? static_cast<__mmask16>(0xffff)
                                    : static_cast<__mmask16>((1u << (n - i)) - 1u);
    __m512 gi;
    if constexpr (sizeof(G) == 2) {
      const __m256i h = _mm256_maskz_loadu_epi16(k, g + i);
      gi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      gi = _mm512_maskz_loadu_ps(k, g + i);
    }
    gi = _mm512_mul_ps(gi, sg);
    const __m512 pv = _mm512_maskz_loadu_ps(k, p + i);
    const __m512 mv = _mm512_maskz_loadu_ps(k, m + i);
    const __m512 vv = _mm512_maskz_loadu_ps(k, v + i);
    const __m512 pi = _mm512_mul_ps(pv, decay);
    const __m512 mi = _mm512_fmadd_ps(omb1, _mm512_sub_ps(gi, mv), mv);
    const __m512 vi = _mm512_fmadd_ps(_mm512_mul_ps(omb2, gi), gi, _mm512_mul_ps(vv, b2));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2), eps);
    const __m512 pn = _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(nstep, mi), denom));
    _mm512_mask_storeu_ps(m + i, k, mi);
    _mm512_mask_storeu_ps(v + i, k, vi);
    _mm512_mask_storeu_ps(p + i, k, pn);
    if (out != nullptr) {
      const __m512i u = _mm512_castps_si512(pn);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(rnd, lsb)), 16);
      const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
      r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), qnan));
      if (stream && k == 0xffff) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(r));
      } else {
        _mm256_mask_storeu_epi16(out + i, k, _mm512_cvtepi32_epi16(r));
      }
    }
  }
  if (stream) _mm_sfence();  // the streamed copies are ordered before whatever reads them (the H2D copy)
}

// AVX2: 8 lanes, scalar tail.
template <typename G>
__attribute__((target("avx2,fma")))
void adamw_avx2(float* __restrict p, float* __restrict m, float* __restrict v, const G* __restrict g,
                uint16_t* __restrict out, int64_t n, const Scalars& s, float sign) {
  const __m256 decay = _mm256_set1_ps(s.decay), omb1 = _mm256_set1_ps(s.one_m_beta1);
  const __m256 b2 = _mm256_set1_ps(s.beta2), omb2 = _mm256_set1_ps(s.one_m_beta2);
  const __m256 bc2 = _mm256_set1_ps(s.bc2_sqrt), eps = _mm256_set1_ps(s.eps);
  const __m256 nstep = _mm256_set1_ps(s.neg_step), sg = _mm256_set1_ps(sign);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i rnd = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1), qnan = _mm256_set1_epi32(0x40);
  const int64_t nv = n & ~int64_t{7};
  for (int64_t i = 0; i < nv; i += 8) {
    __m256 gi;
    if constexpr (sizeof(G) == 2) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g + i));
      gi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      gi = _mm256_loadu_ps(g + i);
    }
    gi = _mm256_mul_ps(gi, sg);
    const __m256 pv = _mm256_loadu_ps(p + i), mv = _mm256_loadu_ps(m + i), vv = _mm256_loadu_ps(v + i);
    const __m256 pi = _mm256_mul_ps(pv, decay);
    const __m256 mi = _mm256_fmadd_ps(omb1, _mm256_sub_ps(gi, mv), mv);
    const __m256 vi = _mm256_fmadd_ps(_mm256_mul_ps(omb2, gi), gi, _mm256_mul_ps(vv, b2));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2), eps);
    const __m256 pn = _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(nstep, mi), denom));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    _mm256_storeu_ps(p + i, pn);
    if (out != nullptr) {
      const __m256i u = _mm256_castps_si256(pn);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
      __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(rnd, lsb)), 16);
      // |u| > inf as signed compare is exact here: both sides are below 2^31.
      const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
      r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), qnan), nan);
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(packed));
    }
  }
  adamw_scalar<G>(p + nv, m + nv, v + nv, g + nv, out ? out + nv : nullptr, n - nv, s, sign);
}

enum class Isa { kScalar, kAvx2, kAvx512 };

Isa detect_isa() {
  const char* forced = std::getenv("TRAINSTREAM_CPU_ISA");
  Isa best = Isa::kScalar;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::kAvx2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) best = Isa::kAvx512;
  if (forced == nullptr || *forced == '\0') return best;
  const std::string f(forced);
  const Isa want = f == "scalar" ? Isa::kScalar : f == "avx2" ? Isa::kAvx2 : f == "avx512" ? Isa::kAvx512 : best;
  TORCH_CHECK(f == "scalar" || f == "avx2" || f == "avx512",
              "TRAINSTREAM_CPU_ISA must be scalar, avx2 or avx512, got '", f, "'");
  TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best), "TRAINSTREAM_CPU_ISA=", f,
              " is not supported by this CPU");
  return want;
}

template <typename G>
void adamw_chunk(float* p, float* m, float* v, const G* g, uint16_t* out, int64_t n, const Scalars& s,
                 float sign, Isa isa) {
  switch (isa) {
    case Isa::kAvx512: adamw_avx512<G>(p, m, v, g, out, n, s, sign); break;
    case Isa::kAvx2: adamw_avx2<G>(p, m, v, g, out, n, s, sign); break;
    default: adamw_scalar<G>(p, m, v, g, out, n, s, sign);
  }
}

}  // namespace

const char* adamw_isa() {
  switch (detect_isa()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}


void adamw_step_cpu(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                    const at::Tensor& grad, const std::optional<at::Tensor>& param_bf16, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int64_t step,
                    bool maximize, int64_t num_threads) {
  TORCH_CHECK(param.device().is_cpu(), "adamw_step_: param must be a CPU tensor, got one on ", param.device());
  const int64_t n = param.numel();
  const Scalars s = adamw_prepare(param, exp_avg, exp_avg_sq, grad, param_bf16, lr, beta1, beta2, eps, weight_decay,
                                  step, num_threads);
  const float sign = maximize ? -1.0f : 1.0f;

  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  uint16_t* out = param_bf16.has_value()
                      ? reinterpret_cast<uint16_t*>(param_bf16->data_ptr<at::BFloat16>()) : nullptr;
  const bool g16 = grad.scalar_type() == at::kBFloat16;
  const void* g = grad.data_ptr();
  const Isa isa = detect_isa();
  constexpr int64_t kGrain = 1 << 16;
  // Chunks start at multiples of 16 elements so every thread's loads stay 64-byte aligned.
  const int threads = num_threads > 0 ? static_cast<int>(num_threads) : default_num_threads();
  global_pool().parallel_for((n + 15) / 16, kGrain / 16, threads, [&](int64_t b, int64_t e) {
    const int64_t lo = b * 16, hi = std::min(n, e * 16);
    if (lo >= hi) return;
    uint16_t* o = out ? out + lo : nullptr;
    if (g16) {
      adamw_chunk<uint16_t>(p + lo, m + lo, v + lo, static_cast<const uint16_t*>(g) + lo, o, hi - lo, s, sign, isa);
    } else {
      adamw_chunk<float>(p + lo, m + lo, v + lo, static_cast<const float*>(g) + lo, o, hi - lo, s, sign, isa);
    }
  });
}

namespace {

// Stochastic rounding to bf16: the float's bits plus 16 random bits, truncated. E[result] = f (unbiased), so a moment
// whose per-step change is below half a bf16 ulp (beta2 = 0.999: 0.1% against 0.39%) still moves on average, where
// round-to-nearest would freeze it. NaN stays a quiet NaN; +-inf stays inf. Branch-free, so the loop vectorizes.
__attribute__((always_inline)) inline uint16_t to_bf16_sr(float f, uint32_t r16) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t mag = u & 0x7fffffffu;
  const uint32_t rounded = (u + r16) >> 16;
  const uint32_t special = mag > 0x7f800000u ? ((u >> 16) | 0x40u) : (u >> 16);  // NaN quietened, inf kept
  return static_cast<uint16_t>(mag >= 0x7f800000u ? special : rounded);
}

// to_bf16 (round to nearest even, NaN quietened) without a branch, for the vectorized loop: the same bits.
__attribute__((always_inline)) inline uint16_t to_bf16_rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) | 0x40u) : rounded);
}

__attribute__((always_inline)) inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// 32 random bits per element, a function of (seed, step, element index) only: the result does not depend on the
// thread count or the chunking. "lowbias32" integer finaliser (C. Wellons, hash-prospector).
__attribute__((always_inline)) inline uint32_t sr_bits(uint32_t seed, uint32_t step, uint64_t index) {
  uint32_t h = static_cast<uint32_t>(index) ^ static_cast<uint32_t>(index >> 32) * 0x27d4eb2du ^ seed * 0x9e3779b9u ^
               step * 0x85ebca6bu;
  h ^= h >> 16;
  h *= 0x7feb352du;
  h ^= h >> 15;
  h *= 0x846ca68bu;
  h ^= h >> 16;
  return h;
}

template <typename G, bool kOut>
__attribute__((always_inline)) inline void adamw_sr_body(float* __restrict p, uint16_t* __restrict m,
                                                         uint16_t* __restrict v, const G* __restrict g,
                                                         uint16_t* __restrict out, int64_t lo, int64_t hi,
                                                         const Scalars& s, float sign, uint32_t seed, uint32_t step) {
  const float decay = s.decay, omb1 = s.one_m_beta1, b2 = s.beta2, omb2 = s.one_m_beta2, bc2 = s.bc2_sqrt,
              eps = s.eps, nstep = s.neg_step;
  for (int64_t i = lo; i < hi; ++i) {
    float gi;
    if constexpr (sizeof(G) == 2) gi = bf16_to_float(g[i]) * sign; else gi = g[i] * sign;
    const float m0 = bf16_to_float(m[i]), v0 = bf16_to_float(v[i]);
    const float pi = p[i] * decay;
    const float mi = std::fma(omb1, gi - m0, m0);
    const float vi = std::fma(omb2 * gi, gi, v0 * b2);
    const float denom = std::sqrt(vi) / bc2 + eps;
    const float pn = pi + (nstep * mi) / denom;  // addcdiv_, as above
    const uint32_t r = sr_bits(seed, step, static_cast<uint64_t>(i));
    m[i] = to_bf16_sr(mi, r & 0xffffu);
    v[i] = to_bf16_sr(vi, r >> 16);
    p[i] = pn;
    if constexpr (kOut) out[i] = to_bf16_rne(pn);
  }
}

// The loop, inlined into one function per instruction set (below), each compiled for it and vectorized by the
// compiler: the same operations in the same order in every one (fp-contract off, explicit fma, correctly rounded
// sqrt and division), so they write the same bits.
template <typename G>
__attribute__((always_inline)) inline void adamw_sr_loop(float* p, uint16_t* m, uint16_t* v, const G* g,
                                                         uint16_t* out, int64_t lo, int64_t hi, const Scalars& s,
                                                         float sign, uint32_t seed, uint32_t step) {
  if (out != nullptr) {
    adamw_sr_body<G, true>(p, m, v, g, out, lo, hi, s, sign, seed, step);
  } else {
    adamw_sr_body<G, false>(p, m, v, g, out, lo, hi, s, sign, seed, step);
  }
}

template <typename G>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void adamw_sr_avx512(
    float* p, uint16_t* m, uint16_t* v, const G* g, uint16_t* out, int64_t lo, int64_t hi, const Scalars& s,
    float sign, uint32_t seed, uint32_t step) {
  adamw_sr_loop<G>(p, m, v, g, out, lo, hi, s, sign, seed, step);
}

template <typename G>
__attribute__((target("avx2,fma"))) void adamw_sr_avx2(
    float* p, uint16_t* m, uint16_t* v, const G* g, uint16_t* out, int64_t lo, int64_t hi, const Scalars& s,
    float sign, uint32_t seed, uint32_t step) {
  adamw_sr_loop<G>(p, m, v, g, out, lo, hi, s, sign, seed, step);
}

template <typename G>
void adamw_sr_chunk(float* p, uint16_t* m, uint16_t* v, const G* g, uint16_t* out, int64_t lo, int64_t hi,
                    const Scalars& s, float sign, uint32_t seed, uint32_t step, Isa isa) {
  switch (isa) {
    case Isa::kAvx512: adamw_sr_avx512<G>(p, m, v, g, out, lo, hi, s, sign, seed, step); break;
    case Isa::kAvx2: adamw_sr_avx2<G>(p, m, v, g, out, lo, hi, s, sign, seed, step); break;
    default: adamw_sr_loop<G>(p, m, v, g, out, lo, hi, s, sign, seed, step);
  }
}

}  // namespace

void adamw_step_sr_cpu(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq, const at::Tensor& grad,
                       const std::optional<at::Tensor>& param_bf16, double lr, double beta1, double beta2, double eps,
                       double weight_decay, int64_t step, bool maximize, int64_t seed, int64_t num_threads) {
  TORCH_CHECK(param.device().is_cpu(), "adamw_step_sr_: param must be a CPU tensor, got one on ", param.device());
  TORCH_CHECK(exp_avg.scalar_type() == at::kBFloat16 && exp_avg_sq.scalar_type() == at::kBFloat16,
              "adamw_step_sr_: exp_avg and exp_avg_sq must be bfloat16 (float32 moments: adamw_step_), got ",
              exp_avg.scalar_type(), " and ", exp_avg_sq.scalar_type());
  TORCH_CHECK(exp_avg.is_contiguous() && exp_avg_sq.is_contiguous() && exp_avg.device().is_cpu() &&
                  exp_avg_sq.device().is_cpu(),
              "adamw_step_sr_: exp_avg and exp_avg_sq must be contiguous CPU tensors");
  const int64_t n = param.numel();
  TORCH_CHECK(exp_avg.numel() == n && exp_avg_sq.numel() == n, "adamw_step_sr_: exp_avg and exp_avg_sq have ",
              exp_avg.numel(), " and ", exp_avg_sq.numel(), " elements, param has ", n);
  // the shared checks and scalars (param stands in for the moments, checked above)
  const Scalars s = adamw_prepare(param, param, param, grad, param_bf16, lr, beta1, beta2, eps, weight_decay, step,
                                  num_threads);
  const float sign = maximize ? -1.0f : 1.0f;
  float* p = param.data_ptr<float>();
  uint16_t* m = reinterpret_cast<uint16_t*>(exp_avg.data_ptr<at::BFloat16>());
  uint16_t* v = reinterpret_cast<uint16_t*>(exp_avg_sq.data_ptr<at::BFloat16>());
  uint16_t* out = param_bf16.has_value()
                      ? reinterpret_cast<uint16_t*>(param_bf16->data_ptr<at::BFloat16>()) : nullptr;
  const bool g16 = grad.scalar_type() == at::kBFloat16;
  const void* g = grad.data_ptr();
  const uint32_t seed32 = static_cast<uint32_t>(seed), step32 = static_cast<uint32_t>(step);
  const Isa isa = detect_isa();
  const int threads = num_threads > 0 ? static_cast<int>(num_threads) : default_num_threads();
  global_pool().parallel_for(n, 1 << 16, threads, [&](int64_t lo, int64_t hi) {
    if (lo >= hi) return;
    if (g16) {
      adamw_sr_chunk<uint16_t>(p, m, v, static_cast<const uint16_t*>(g), out, lo, hi, s, sign, seed32, step32, isa);
    } else {
      adamw_sr_chunk<float>(p, m, v, static_cast<const float*>(g), out, lo, hi, s, sign, seed32, step32, isa);
    }
  });
}

}  // namespace trainstream

TORCH_LIBRARY_IMPL(trainstream, CPU, m) {
  m.impl("adamw_step_", &trainstream::adamw_step_cpu);
  m.impl("adamw_step_sr_", &trainstream::adamw_step_sr_cpu);
}
