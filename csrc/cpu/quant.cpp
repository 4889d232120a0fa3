// CPU kernels for the weight formats (NF4 and NVFP4 quantize / dequantize; int8 and FP8 dequantize) and the per-row
// E4M3 activation quantizer of the FP8 matmul path.
//
// The maths is defined by the pure-PyTorch references in trainstream_hf/ops.py (quantize_nf4_reference, ...),
// which these kernels equal bit for bit (tests/quant/test_formats.py checks with torch.equal). Every rounding
// step is therefore spelled out: float32 arithmetic, one IEEE operation at a time (no FMA contraction),
// conversions through c10's own float8 / bfloat16 / half constructors (the ones torch's .to() uses).
// Reductions are a max (order-free) or an integer sum (exact), so results do not depend on the thread count.
//
// NF4: QLoRA (Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", 2023, arXiv:2305.14314).
// NVFP4: NVIDIA, "Introducing NVFP4 for Efficient and Accurate Low-Precision Inference" (2025).
// FP8 E4M3: OCP 8-bit Floating Point Specification (OFP8) rev. 1.0, 2023; torch.float8_e4m3fn.
// Layouts are documented in trainstream_hf/quant/formats.py.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <type_traits>
#include <vector>

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../include/quant_checks.h"
#include "../include/quant_formats.h"
#include "../include/trainstream.h"
#include "../runtime/thread_pool.h"

#pragma GCC optimize("fp-contract=off")

namespace trainstream {
namespace {

using quant::kNf4Block;
using quant::kNf4Group;
using quant::kNvfp4Block;
using quant::kE4m3Max;
using quant::kE2m1Max;

// bitsandbytes' NF4 code (bitsandbytes/backends/utils.py, _NF4_QUANT_TABLE); same values as ops.NF4_CODE.
constexpr float kNf4Code[16] = TRAINSTREAM_NF4_CODE;

// E2M1 code -> value; bit 3 is the sign.
constexpr float kE2m1Value[16] = TRAINSTREAM_E2M1_VALUES;

struct Nf4Midpoints {
  float m[15];
  Nf4Midpoints() {
    for (int i = 0; i < 15; ++i) m[i] = (kNf4Code[i] + kNf4Code[i + 1]) * 0.5f;
  }
};
const Nf4Midpoints& nf4_midpoints() {
  static const Nf4Midpoints mids;
  return mids;
}

// Index of the nearest NF4 code: the number of midpoints strictly below v (ties go to the lower code), as
// torch.bucketize(v, midpoints) counts. Branch-free binary search over the 15 sorted midpoints.
inline uint8_t nf4_encode(float v, const float* mid) {
  int idx = 0;
  idx += (mid[idx + 7] < v) ? 8 : 0;
  idx += (mid[idx + 3] < v) ? 4 : 0;
  idx += (mid[idx + 1] < v) ? 2 : 0;
  idx += (mid[idx] < v) ? 1 : 0;
  return static_cast<uint8_t>(idx);
}

// Round v to the nearest E2M1 value, ties to the even code, saturating at +-6 (what torch's float->fp4 test
// helper _f32_to_floatx_unpacked does); sign from the sign bit, so -0.0 encodes as 0x8.
inline uint8_t e2m1_encode(float v) {
  const float a = std::fabs(v);
  uint8_t c = static_cast<uint8_t>((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                                   (a >= 3.5f) + (a > 5.0f));
  return static_cast<uint8_t>(c | (std::signbit(v) ? 8 : 0));
}

using quant::check_buffer;
using quant::check_out_dtype;
using quant::check_weight;

// Calls fn(const T* x) with the weight's data as float / BFloat16 / Half.
template <typename Fn>
void with_input(const at::Tensor& w, Fn&& fn) {
  switch (w.scalar_type()) {
    case at::kFloat: fn(w.data_ptr<float>()); break;
    case at::kBFloat16: fn(w.data_ptr<at::BFloat16>()); break;
    case at::kHalf: fn(w.data_ptr<at::Half>()); break;
    default: TORCH_INTERNAL_ASSERT(false, "unchecked weight dtype");
  }
}

template <typename Fn>
void with_output(at::Tensor& out, Fn&& fn) {
  switch (out.scalar_type()) {
    case at::kFloat: fn(out.data_ptr<float>()); break;
    case at::kBFloat16: fn(out.data_ptr<at::BFloat16>()); break;
    case at::kHalf: fn(out.data_ptr<at::Half>()); break;
    default: TORCH_INTERNAL_ASSERT(false, "unchecked output dtype");
  }
}

void parallel(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  global_pool().parallel_for(n, grain, default_num_threads(), fn);
}

// The NF4 absmax offset: their mean, summed exactly (in fixed point with 32 bits below the largest absmax's
// leading bit) so that every device and thread count gets the same float. Mirrors ops._nf4_offset_reference.
float nf4_offset(const float* absmax, int64_t nb) {
  float amax = 0.0f;
  for (int64_t i = 0; i < nb; ++i) amax = std::max(amax, absmax[i]);
  if (amax == 0.0f) return 0.0f;
  int e = 0;
  std::frexp(amax, &e);
  const int k = 32 - e;
  int64_t total = 0;
  for (int64_t i = 0; i < nb; ++i) total += static_cast<int64_t>(std::floor(std::ldexp(double(absmax[i]), k)));
  const double mean = static_cast<double>(total) / static_cast<double>(nb);
  return static_cast<float>(std::ldexp(mean, -k));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_nf4_cpu(const at::Tensor& weight) {
  check_weight(weight, "quantize_nf4", kNf4Block);
  const at::Tensor w = weight.contiguous();
  const int64_t rows = w.size(0), cols = w.size(1);
  const int64_t nb = w.numel() / kNf4Block, ng = (nb + kNf4Group - 1) / kNf4Group;
  const auto opts = w.options();
  at::Tensor data = at::empty({rows, cols / 2}, opts.dtype(at::kByte));
  at::Tensor absmax_q = at::empty({nb}, opts.dtype(at::kFloat8_e4m3fn));
  at::Tensor absmax_scale = at::empty({ng}, opts.dtype(at::kFloat));
  at::Tensor absmax_offset = at::empty({}, opts.dtype(at::kFloat));
  std::vector<float> absmax(nb), dq(nb);
  std::atomic<bool> finite{true};

  with_input(w, [&](const auto* x) {
    // 1. absmax per block of 64.
    parallel(nb, 1024, [&](int64_t b0, int64_t b1) {
      bool ok = true;
      for (int64_t b = b0; b < b1; ++b) {
        float m = 0.0f;
        for (int64_t i = 0; i < kNf4Block; ++i) {
          const float a = std::fabs(static_cast<float>(x[b * kNf4Block + i]));
          ok = ok && std::isfinite(a);
          m = std::max(m, a);
        }
        absmax[b] = m;
      }
      if (!ok) finite.store(false);
    });
    TORCH_CHECK_VALUE(finite.load(), "quantize_nf4: weight contains inf or NaN");

    // 2. Double quantisation: absmax - offset, per group of 256 scaled into E4M3 by max|.| / 448.
    const float offset = nf4_offset(absmax.data(), nb);
    absmax_offset.data_ptr<float>()[0] = offset;
    auto* q = absmax_q.data_ptr<c10::Float8_e4m3fn>();
    float* s2 = absmax_scale.data_ptr<float>();
    parallel(ng, 64, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t lo = g * kNf4Group, hi = std::min(nb, lo + kNf4Group);
        float m = 0.0f;
        for (int64_t b = lo; b < hi; ++b) m = std::max(m, std::fabs(absmax[b] - offset));
        const float s = m / kE4m3Max;
        s2[g] = s;
        for (int64_t b = lo; b < hi; ++b) {
          const c10::Float8_e4m3fn qb(s > 0.0f ? (absmax[b] - offset) / s : 0.0f);
          q[b] = qb;
          dq[b] = static_cast<float>(qb) * s + offset;
        }
      }
    });

    // 3. Codes against the dequantised absmax (what dequantize will multiply by), two per byte, the even
    //    element in the high nibble (bitsandbytes' order).
    const float* mid = nf4_midpoints().m;
    uint8_t* out = data.data_ptr<uint8_t>();
    parallel(nb, 1024, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float d = dq[b];
        const auto* xb = x + b * kNf4Block;
        uint8_t* ob = out + b * (kNf4Block / 2);
        for (int64_t i = 0; i < kNf4Block; i += 2) {
          const float v0 = d != 0.0f ? static_cast<float>(xb[i]) / d : 0.0f;
          const float v1 = d != 0.0f ? static_cast<float>(xb[i + 1]) / d : 0.0f;
          ob[i / 2] = static_cast<uint8_t>((nf4_encode(v0, mid) << 4) | nf4_encode(v1, mid));
        }
      }
    });
  });
  return {data, absmax_q, absmax_scale, absmax_offset};
}

at::Tensor dequantize_nf4_cpu(const at::Tensor& data, const at::Tensor& absmax_q, const at::Tensor& absmax_scale,
                              const at::Tensor& absmax_offset, at::ScalarType dtype) {
  TORCH_CHECK(data.dim() == 2, "dequantize_nf4: data must be 2-D (out_features, in_features / 2), got shape ",
              data.sizes());
  TORCH_CHECK(data.scalar_type() == at::kByte, "dequantize_nf4: data must be uint8, got ", data.scalar_type());
  TORCH_CHECK((data.size(1) * 2) % kNf4Block == 0, "dequantize_nf4: in_features (", data.size(1) * 2,
              ") must be a multiple of ", kNf4Block);
  check_out_dtype(dtype, "dequantize_nf4");
  const int64_t rows = data.size(0), cols = data.size(1) * 2;
  const int64_t nb = rows * cols / kNf4Block, ng = (nb + kNf4Group - 1) / kNf4Group;
  check_buffer(absmax_q, "dequantize_nf4", "absmax_q", at::kFloat8_e4m3fn, {nb});
  check_buffer(absmax_scale, "dequantize_nf4", "absmax_scale", at::kFloat, {ng});
  check_buffer(absmax_offset, "dequantize_nf4", "absmax_offset", at::kFloat, {});
  const at::Tensor dc = data.contiguous(), qc = absmax_q.contiguous(), sc = absmax_scale.contiguous();
  at::Tensor out = at::empty({rows, cols}, data.options().dtype(dtype));
  const uint8_t* in = dc.data_ptr<uint8_t>();
  const auto* q = qc.data_ptr<c10::Float8_e4m3fn>();
  const float* s2 = sc.data_ptr<float>();
  const float offset = absmax_offset.item<float>();
  with_output(out, [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    parallel(nb, 1024, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float d = static_cast<float>(q[b]) * s2[b / kNf4Group] + offset;
        const uint8_t* ib = in + b * (kNf4Block / 2);
        T* ob = o + b * kNf4Block;
        for (int64_t i = 0; i < kNf4Block / 2; ++i) {
          ob[2 * i] = static_cast<T>(kNf4Code[ib[i] >> 4] * d);
          ob[2 * i + 1] = static_cast<T>(kNf4Code[ib[i] & 0xF] * d);
        }
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_nvfp4_cpu(const at::Tensor& weight) {
  check_weight(weight, "quantize_nvfp4", kNvfp4Block);
  const at::Tensor w = weight.contiguous();
  const int64_t rows = w.size(0), cols = w.size(1), nb = w.numel() / kNvfp4Block;
  const auto opts = w.options();
  at::Tensor data = at::empty({rows, cols / 2}, opts.dtype(at::kByte));
  at::Tensor block_scale = at::empty({rows, cols / kNvfp4Block}, opts.dtype(at::kFloat8_e4m3fn));
  at::Tensor tensor_scale = at::empty({}, opts.dtype(at::kFloat));
  std::vector<float> bmax(nb);
  std::atomic<bool> finite{true};

  with_input(w, [&](const auto* x) {
    parallel(nb, 4096, [&](int64_t b0, int64_t b1) {
      bool ok = true;
      for (int64_t b = b0; b < b1; ++b) {
        float m = 0.0f;
        for (int64_t i = 0; i < kNvfp4Block; ++i) {
          const float a = std::fabs(static_cast<float>(x[b * kNvfp4Block + i]));
          ok = ok && std::isfinite(a);
          m = std::max(m, a);
        }
        bmax[b] = m;
      }
      if (!ok) finite.store(false);
    });
    TORCH_CHECK_VALUE(finite.load(), "quantize_nvfp4: weight contains inf or NaN");
    float amax = 0.0f;
    for (int64_t b = 0; b < nb; ++b) amax = std::max(amax, bmax[b]);
    // Per-tensor scale so that the largest block scale lands on E4M3's 448: amax / (448 * 6).
    const float ts = amax / (kE4m3Max * kE2m1Max);
    tensor_scale.data_ptr<float>()[0] = ts;

    auto* sb = block_scale.data_ptr<c10::Float8_e4m3fn>();
    uint8_t* out = data.data_ptr<uint8_t>();
    parallel(nb, 4096, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const c10::Float8_e4m3fn s(ts > 0.0f ? (bmax[b] / kE2m1Max) / ts : 0.0f);
        sb[b] = s;
        const float t = ts * static_cast<float>(s);
        const auto* xb = x + b * kNvfp4Block;
        uint8_t* ob = out + b * (kNvfp4Block / 2);
        // Two codes per byte, the even element in the low nibble (torch.float4_e2m1fn_x2's order).
        for (int64_t i = 0; i < kNvfp4Block; i += 2) {
          const uint8_t c0 = t > 0.0f ? e2m1_encode(static_cast<float>(xb[i]) / t) : 0;
          const uint8_t c1 = t > 0.0f ? e2m1_encode(static_cast<float>(xb[i + 1]) / t) : 0;
          ob[i / 2] = static_cast<uint8_t>(c0 | (c1 << 4));
        }
      }
    });
  });
  return {data, block_scale, tensor_scale};
}

at::Tensor dequantize_nvfp4_cpu(const at::Tensor& data, const at::Tensor& block_scale,
                                const at::Tensor& tensor_scale, at::ScalarType dtype) {
  TORCH_CHECK(data.dim() == 2, "dequantize_nvfp4: data must be 2-D (out_features, in_features / 2), got shape ",
              data.sizes());
  TORCH_CHECK(data.scalar_type() == at::kByte, "dequantize_nvfp4: data must be uint8, got ", data.scalar_type());
  TORCH_CHECK((data.size(1) * 2) % kNvfp4Block == 0, "dequantize_nvfp4: in_features (", data.size(1) * 2,
              ") must be a multiple of ", kNvfp4Block);
  check_out_dtype(dtype, "dequantize_nvfp4");
  const int64_t rows = data.size(0), cols = data.size(1) * 2, nb = rows * cols / kNvfp4Block;
  check_buffer(block_scale, "dequantize_nvfp4", "block_scale", at::kFloat8_e4m3fn, {rows, cols / kNvfp4Block});
  check_buffer(tensor_scale, "dequantize_nvfp4", "tensor_scale", at::kFloat, {});
  const at::Tensor dc = data.contiguous(), sc = block_scale.contiguous();
  at::Tensor out = at::empty({rows, cols}, data.options().dtype(dtype));
  const uint8_t* in = dc.data_ptr<uint8_t>();
  const auto* sb = sc.data_ptr<c10::Float8_e4m3fn>();
  const float ts = tensor_scale.item<float>();
  with_output(out, [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    parallel(nb, 4096, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float t = ts * static_cast<float>(sb[b]);
        const uint8_t* ib = in + b * (kNvfp4Block / 2);
        T* ob = o + b * kNvfp4Block;
        for (int64_t i = 0; i < kNvfp4Block / 2; ++i) {
          ob[2 * i] = static_cast<T>(kE2m1Value[ib[i] & 0xF] * t);
          ob[2 * i + 1] = static_cast<T>(kE2m1Value[ib[i] >> 4] * t);
        }
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// int8 / FP8 dequantize: w[n, k] = T(float(data[n, k]) * scale[n]), one float32 multiply and one rounding to T, as
// dequantize_int8_reference / dequantize_fp8_reference compute it.

namespace {

template <typename Code>
at::Tensor dequantize_rowwise_cpu(const at::Tensor& data, const at::Tensor& scale, at::ScalarType dtype,
                                  const char* op, at::ScalarType code_type) {
  TORCH_CHECK(data.dim() == 2, op, ": data must be 2-D (out_features, in_features), got shape ", data.sizes());
  TORCH_CHECK(data.scalar_type() == code_type, op, ": data must be ", code_type, ", got ", data.scalar_type());
  check_out_dtype(dtype, op);
  const int64_t rows = data.size(0), cols = data.size(1);
  check_buffer(scale, op, "scale", at::kFloat, {rows});
  const at::Tensor dc = data.contiguous(), sc = scale.contiguous();
  at::Tensor out = at::empty({rows, cols}, data.options().dtype(dtype));
  if (out.numel() == 0) return out;
  const Code* in = reinterpret_cast<const Code*>(dc.data_ptr());
  const float* s = sc.data_ptr<float>();
  with_output(out, [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    parallel(rows, std::max<int64_t>(1, 65536 / cols), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float sr = s[r];
        const Code* ir = in + r * cols;
        T* orow = o + r * cols;
        for (int64_t k = 0; k < cols; ++k) orow[k] = static_cast<T>(static_cast<float>(ir[k]) * sr);
      }
    });
  });
  return out;
}

// max that propagates NaN (as torch.amax does), for non-negative or NaN arguments.
inline float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

}  // namespace

at::Tensor dequantize_int8_cpu(const at::Tensor& data, const at::Tensor& scale, at::ScalarType dtype) {
  return dequantize_rowwise_cpu<int8_t>(data, scale, dtype, "dequantize_int8", at::kChar);
}

at::Tensor dequantize_fp8_cpu(const at::Tensor& data, const at::Tensor& scale, at::ScalarType dtype) {
  return dequantize_rowwise_cpu<c10::Float8_e4m3fn>(data, scale, dtype, "dequantize_fp8", at::kFloat8_e4m3fn);
}

// ---------------------------------------------------------------------------------------------------------------
// Per-row E4M3 quantization (quantize_rows_e4m3_reference in trainstream_hf/ops.py): per row of v = x * col_scale
// (float32), s = max|v| / 448, q = e4m3(clamp(v / s, -448, 448)); s == 0 gives codes +0. NaN propagates as in torch:
// a row holding one gets a NaN scale and NaN codes.

std::tuple<at::Tensor, at::Tensor> quantize_rows_e4m3_cpu(const at::Tensor& x,
                                                          const std::optional<at::Tensor>& col_scale) {
  TORCH_CHECK_VALUE(x.dim() == 2, "quantize_rows_e4m3: x must be 2-D (tokens, features), got shape ", x.sizes());
  const auto t = x.scalar_type();
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf,
                   "quantize_rows_e4m3: x must be float32, bfloat16 or float16, got ", t);
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK_VALUE(cols > 0, "quantize_rows_e4m3: x has no features (shape ", x.sizes(), ")");
  at::Tensor cs;
  if (col_scale.has_value()) {
    check_buffer(*col_scale, "quantize_rows_e4m3", "col_scale", at::kFloat, {cols});
    cs = col_scale->contiguous();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor q = at::empty({rows, cols}, x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor row_scale = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  if (rows == 0) return {q, row_scale};
  const float* c = cs.defined() ? cs.data_ptr<float>() : nullptr;
  auto* qo = q.data_ptr<c10::Float8_e4m3fn>();
  float* so = row_scale.data_ptr<float>();
  with_input(xc, [&](const auto* xp) {
    parallel(rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t r0, int64_t r1) {
      std::vector<float> v(cols);
      for (int64_t r = r0; r < r1; ++r) {
        const auto* xr = xp + r * cols;
        float m = 0.0f;
        for (int64_t k = 0; k < cols; ++k) {
          v[k] = c ? static_cast<float>(xr[k]) * c[k] : static_cast<float>(xr[k]);
          m = nan_max(std::fabs(v[k]), m);
        }
        const float s = m / kE4m3Max;
        so[r] = s;
        c10::Float8_e4m3fn* qr = qo + r * cols;
        for (int64_t k = 0; k < cols; ++k) {
          float e = s != 0.0f ? v[k] / s : 0.0f;
          e = e > kE4m3Max ? kE4m3Max : (e < -kE4m3Max ? -kE4m3Max : e);  // NaN stays NaN, as torch.clamp
          qr[k] = c10::Float8_e4m3fn(e);
        }
      }
    });
  });
  return {q, row_scale};
}

}  // namespace trainstream


namespace trainstream {

// The CPU has no layout constraint worth a kernel: torch's transposing copy.
at::Tensor transpose_bytes_cpu(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 2, "transpose_bytes: x must be 2-D, got shape ", x.sizes());
  TORCH_CHECK_TYPE(x.element_size() == 1, "transpose_bytes: x must have 1-byte elements, got ", x.scalar_type());
  return x.t().contiguous();
}

}  // namespace trainstream

TORCH_LIBRARY_IMPL(trainstream, CPU, m) {
  m.impl("quantize_nf4", &trainstream::quantize_nf4_cpu);
  m.impl("dequantize_nf4", &trainstream::dequantize_nf4_cpu);
  m.impl("quantize_nvfp4", &trainstream::quantize_nvfp4_cpu);
  m.impl("dequantize_nvfp4", &trainstream::dequantize_nvfp4_cpu);
  m.impl("dequantize_int8", &trainstream::dequantize_int8_cpu);
  m.impl("dequantize_fp8", &trainstream::dequantize_fp8_cpu);
  m.impl("quantize_rows_e4m3", &trainstream::quantize_rows_e4m3_cpu);
  m.impl("transpose_bytes", &trainstream::transpose_bytes_cpu);
}
