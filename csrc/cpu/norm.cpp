// RMSNorm as Llama-family models compute it (transformers' LlamaRMSNorm and its copies), fused: CPU kernels.
//
//   rms_norm_fwd(x, weight, eps) -> (y, rstd):  rstd = 1 / sqrt(mean(float(x)^2) + eps) per row (float32),
//       y = weight * to_x_dtype(float(x) * rstd), the product rounded to x's dtype as torch's would be.
//   rms_norm_bwd(gy, x, weight, rstd) -> dx: g = to_x_dtype(gy * weight) (the product autograd forms), then
//       dx = rstd g - x rstd^3 sum(g x) / K per row, in float32, rounded to x's dtype.
//
// x (T, K) contiguous, weight (K,) of x's dtype (float32, bfloat16, float16). The maths, and where each value is
// rounded, follow the unfused module's graph; the row sums are taken in another order than torch's reductions, so
// results may differ from the module in the last bit (tests/test_norm.py bounds it). csrc/cuda/norm.cu: the same on
// the GPU.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

namespace trainstream {
namespace {

void check(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous (rows, features) tensor, got ",
                    x.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(1), op, ": weight must be (", x.size(1), "), got ",
                    weight.sizes());
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), op, ": weight must have x's dtype (", x.scalar_type(),
                   "), got ", weight.scalar_type());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
                   op, ": float32, bfloat16 or float16, got ", x.scalar_type());
}

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd_cpu(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  check(x, weight, "rms_norm_fwd");
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_fwd_cpu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    float* rp = rstd.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = xp + r * k;
        float sum = 0.f;
        for (int64_t i = 0; i < k; ++i) {
          const float v = static_cast<float>(row[i]);
          sum += v * v;
        }
        const float rs = 1.f / std::sqrt(sum / static_cast<float>(k) + static_cast<float>(eps));
        rp[r] = rs;
        for (int64_t i = 0; i < k; ++i) {
          const scalar_t h = round_to<scalar_t>(static_cast<float>(row[i]) * rs);
          yp[r * k + i] = round_to<scalar_t>(static_cast<float>(h) * static_cast<float>(wp[i]));
        }
      }
    });
  });
  return {y, rstd};
}

at::Tensor rms_norm_bwd_cpu(const at::Tensor& gy_in, const at::Tensor& x_in, const at::Tensor& weight_in,
                            const at::Tensor& rstd_in) {
  const at::Tensor gy = gy_in.contiguous(), x = x_in.contiguous(), weight = weight_in.contiguous(),
                   rstd = rstd_in.contiguous();
  check(x, weight, "rms_norm_bwd");
  TORCH_CHECK_VALUE(gy.sizes() == x.sizes() && gy.scalar_type() == x.scalar_type(),
                    "rms_norm_bwd: gy must have x's shape and dtype");
  TORCH_CHECK_VALUE(rstd.numel() == x.size(0) && rstd.scalar_type() == at::kFloat,
                    "rms_norm_bwd: rstd must hold one float32 per row");
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor dx = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_bwd_cpu", [&] {
    const scalar_t* gp = gy.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const float* rp = rstd.data_ptr<float>();
    scalar_t* dp = dx.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t o = r * k;
        float s = 0.f;
        for (int64_t i = 0; i < k; ++i) {
          const float g = static_cast<float>(round_to<scalar_t>(static_cast<float>(gp[o + i]) *
                                                                static_cast<float>(wp[i])));
          s += g * static_cast<float>(xp[o + i]);
        }
        const float rs = rp[r];
        const float c = rs * rs * rs * s / static_cast<float>(k);
        for (int64_t i = 0; i < k; ++i) {
          const float g = static_cast<float>(round_to<scalar_t>(static_cast<float>(gp[o + i]) *
                                                                static_cast<float>(wp[i])));
          dp[o + i] = round_to<scalar_t>(rs * g - static_cast<float>(xp[o + i]) * c);
        }
      }
    });
  });
  return dx;
}

}  // namespace trainstream

TORCH_LIBRARY_IMPL(trainstream, CPU, m) {
  m.impl("rms_norm_fwd", &trainstream::rms_norm_fwd_cpu);
  m.impl("rms_norm_bwd", &trainstream::rms_norm_bwd_cpu);
}
