// PLACEHOLDER (being written): CPU AdamW kernel.
#include <torch/library.h>
#include "../include/trainstream.h"
namespace trainstream {
void adamw_step_cpu(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                    const at::Tensor& grad, const std::optional<at::Tensor>& param_bf16, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int64_t step,
                    bool maximize) {
  TORCH_CHECK(false, "adamw_step_ is not implemented yet");
}
}  // namespace trainstream
TORCH_LIBRARY_IMPL(trainstream, CPU, m) { m.impl("adamw_step_", &trainstream::adamw_step_cpu); }
