// The scalars of one AdamW step and the checks on its arguments, shared by the CPU kernel (csrc/cpu/adamw.cpp) and
// the CUDA kernel (csrc/cuda/adamw.cu): both form every scalar here, in double rounded once to float, so that the
// two kernels, which apply the same float operations in the same order, write the same bits.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>

namespace trainstream {

struct AdamwScalars {
  float decay;        // 1 - lr * weight_decay
  float one_m_beta1;  // 1 - beta1
  float beta2;
  float one_m_beta2;  // 1 - beta2
  float bc2_sqrt;     // sqrt(1 - beta2^t)
  float eps;
  float neg_step;     // -lr / (1 - beta1^t)
};

inline void adamw_check_buffer(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t numel,
                               const at::Device& device) {
  TORCH_CHECK(t.device() == device, "adamw_step_: ", name, " must be on ", device, " (param's device), got one on ",
              t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "adamw_step_: ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "adamw_step_: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, "adamw_step_: ", name, " has ", t.numel(), " elements, param has ", numel);
}

// Checks every argument of adamw_step_ (all tensors on param's device) and returns the step's scalars.
inline AdamwScalars adamw_prepare(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                  const at::Tensor& grad, const std::optional<at::Tensor>& param_bf16, double lr,
                                  double beta1, double beta2, double eps, double weight_decay, int64_t step,
                                  int64_t num_threads) {
  const int64_t n = param.numel();
  const at::Device device = param.device();
  adamw_check_buffer(param, "param", at::kFloat, n, device);
  adamw_check_buffer(exp_avg, "exp_avg", at::kFloat, n, device);
  adamw_check_buffer(exp_avg_sq, "exp_avg_sq", at::kFloat, n, device);
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16,
              "adamw_step_: grad must be float32 or bfloat16, got ", grad.scalar_type());
  adamw_check_buffer(grad, "grad", grad.scalar_type(), n, device);
  if (param_bf16.has_value()) adamw_check_buffer(*param_bf16, "param_bf16", at::kBFloat16, n, device);
  TORCH_CHECK(step >= 1, "adamw_step_: step counts updates from 1, got ", step);
  TORCH_CHECK(num_threads >= 0, "adamw_step_: num_threads must be >= 0 (0: the default), got ", num_threads);
  TORCH_CHECK(lr >= 0.0 && eps >= 0.0 && weight_decay >= 0.0,
              "adamw_step_: lr, eps and weight_decay must be >= 0, got ", lr, ", ", eps, ", ", weight_decay);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0 && beta2 >= 0.0 && beta2 < 1.0,
              "adamw_step_: betas must be in [0, 1), got (", beta1, ", ", beta2, ")");
  AdamwScalars s;
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.one_m_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_m_beta2 = static_cast<float>(1.0 - beta2);
  s.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  s.eps = static_cast<float>(eps);
  s.neg_step = static_cast<float>(-(lr / (1.0 - std::pow(beta1, static_cast<double>(step)))));
  return s;
}

}  // namespace trainstream
