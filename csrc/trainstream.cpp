// trainstream_hf._C: the one place where op schemas are declared and the Python module is built.
//
// Kernels register themselves beside their definitions (TORCH_LIBRARY_IMPL in csrc/cpu, csrc/cuda).
// The Python face of every op is the package trainstream_hf/ops/ (wrappers, fake kernels, references).
#include <torch/library.h>
#include <torch/csrc/utils/pybind.h>

#include "include/trainstream.h"

namespace trainstream {

bool built_with_cuda() {
#ifdef TRAINSTREAM_WITH_CUDA
  return true;
#else
  return false;
#endif
}

void init_gc_pauses(pybind11::module_& m);  // csrc/runtime/gc_pauses.cpp

}  // namespace trainstream

TORCH_LIBRARY(trainstream, m) {
  // AdamW step over fp32 master weights, in place; optional bf16 copy of the result.
  m.def(
      "adamw_step_(Tensor(a!) param, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor grad, "
      "Tensor(d!)? param_bf16, float lr, float beta1, float beta2, float eps, float weight_decay, "
      "int step, bool maximize, int num_threads=0) -> ()");
  // The same step with bfloat16 moments, stored by stochastic rounding whose random bits depend on (seed, step,
  // element index) only (csrc/cpu/adamw.cpp; CPU kernel only): 4 bytes per parameter instead of 8.
  m.def(
      "adamw_step_sr_(Tensor(a!) param, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor grad, "
      "Tensor(d!)? param_bf16, float lr, float beta1, float beta2, float eps, float weight_decay, "
      "int step, bool maximize, int seed, int num_threads=0) -> ()");

  // Frozen-weight formats (trainstream_hf/quant/formats.py). weight: (out_features, in_features) float32 /
  // bfloat16 / float16. NF4: 4-bit NormalFloat codes, absmax per 64 weights double-quantised to E4M3 per 256.
  m.def(
      "quantize_nf4(Tensor weight) -> (Tensor data, Tensor absmax_q, Tensor absmax_scale, Tensor absmax_offset)");
  m.def(
      "dequantize_nf4(Tensor data, Tensor absmax_q, Tensor absmax_scale, Tensor absmax_offset, "
      "ScalarType dtype) -> Tensor");
  // NVFP4: E2M1 codes, E4M3 scale per 16 weights along in_features, fp32 per-tensor scale.
  m.def("quantize_nvfp4(Tensor weight) -> (Tensor data, Tensor block_scale, Tensor tensor_scale)");
  m.def("dequantize_nvfp4(Tensor data, Tensor block_scale, Tensor tensor_scale, ScalarType dtype) -> Tensor");
  // int8 / FP8 (E4M3): codes (out_features, in_features) and one float32 scale per output row.
  m.def("dequantize_int8(Tensor data, Tensor scale, ScalarType dtype) -> Tensor");
  m.def("dequantize_fp8(Tensor data, Tensor scale, ScalarType dtype) -> Tensor");

  // Per-row E4M3 activation quantizer of the FP8 matmul path (trainstream_hf/quant/matmul.py): x (tokens, features)
  // float32 / bfloat16 / float16, times the optional per-feature float32 col_scale, -> float8_e4m3fn codes and the
  // float32 (tokens, 1) row scale max|row| / 448 (torch._scaled_mm's row-wise scale_a).
  m.def("quantize_rows_e4m3(Tensor x, Tensor? col_scale) -> (Tensor q, Tensor row_scale)");
  // Transposed contiguous copy of a 2-D tensor of 1-byte elements (uint8, int8, float8): the FP8 backward's
  // column-major weight operand. torch's generic strided copy moves bytes at a fraction of memory bandwidth.
  m.def("transpose_bytes(Tensor x) -> Tensor");
  // The FP8 tensor-core linear layer (csrc/autograd/fp8_linear.cpp): y = e4m3(x) w^T with row-wise scales, in x's
  // dtype, x (..., K) quantized per row inside (or the kept quantization of this very x reused), differentiable in x
  // (its backward is fp8_linear_dgrad), and the input gradient dy -> dx alone. w_t: w's codes transposed, (K, N)
  // contiguous, kept by the caller; the backward takes it instead of transposing w on every call. outliers = k > 0:
  // the k input channels of largest max |x| bypass the quantization, multiplied in x's dtype (float32 accumulation).
  m.def("fp8_linear(Tensor x, Tensor w, Tensor w_scale, bool reuse=True, Tensor? w_t=None, int outliers=0) -> Tensor");
  m.def("fp8_linear_dgrad(Tensor dy, Tensor w, Tensor w_scale, Tensor? w_t=None) -> Tensor");
  // a (M, K) x b (N, K)^T with row-wise float32 scales scale_a (M), scale_b (N), float8_e4m3fn operands, on cuBLASLt
  // with its algorithm cached per shape (csrc/cuda/fp8_gemm.cu; CUDA builds only).
  m.def("fp8_gemm_rowwise(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype) -> Tensor");
  // A LoRA adapter's contribution, result + (x A^T) B^T * scaling, with PEFT's dtypes, as one autograd node
  // (csrc/autograd/lora_add.cpp).
  m.def("lora_add(Tensor result, Tensor x, Tensor lora_a, Tensor lora_b, float scaling) -> Tensor");
  // RMSNorm of the Llama family, fused (csrc/autograd/rms_norm.cpp; kernels in csrc/cpu/norm.cpp, csrc/cuda/norm.cu):
  // y = weight * to_x_dtype(x * rsqrt(mean(x^2) + eps)), differentiable in x and weight; the kernels below it take
  // x (rows, features) contiguous and the weight in x's dtype.
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor rstd)");
  m.def("rms_norm_bwd(Tensor gy, Tensor x, Tensor weight, Tensor rstd) -> Tensor");
  // The weight-only quantized linear layer (csrc/autograd/dequant_linear.cpp): y = linear(x, dequantize_<fmt>(*packed,
  // x.dtype)), differentiable in x (dx = dy @ the weight decoded again in dy's dtype).
  m.def("dequant_linear(Tensor x, Tensor[] packed, str fmt) -> Tensor");
  // The same layer with a LoRA adapter in one node: y = x W^T + scaling (x A^T) B^T, the adapter's product
  // accumulated into the base GEMM's output (csrc/autograd/dequant_linear.cpp).
  m.def("lora_dequant_linear(Tensor x, Tensor[] packed, str fmt, Tensor lora_a, Tensor lora_b, float scaling) "
        "-> Tensor");
  // A float32 matrix as bfloat16 parts (t = p0 + p1 + p2), the parts named by pattern laid side by side as row (dim 0)
  // or column (dim 1) blocks: float32 products as one bf16 GEMM (csrc/cpu/split.cpp, csrc/cuda/split.cu).
  m.def("split_bf16(Tensor t, int[] pattern, int dim) -> Tensor");
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "trainstream_hf native runtime: host arena, shared host memory, staging pool, gc pause counter "
            "(ops live in torch.ops.trainstream)";
  m.def("fp8_activation_cache", &trainstream::fp8_activation_cache, pybind11::arg("clear") = false,
        "The FP8 layer's kept activation quantization: [kept (0/1), hits, misses]; clear=True drops it first.");
  m.def("fp8_gemm_setting", &trainstream::fp8_gemm_setting, pybind11::arg("choice") = pybind11::none(),
        pybind11::arg("from_env") = false,
        "The FP8 layer's GEMM setting (auto / cublaslt / torch): set it to choice, or read TRAINSTREAM_FP8_GEMM "
        "again (from_env); returns the setting now.");
  m.def("fp8_gemm_on", &trainstream::fp8_gemm_on, pybind11::arg("device"),
        "The GEMM the FP8 layer runs on this device under the current setting: cublaslt or torch.");
  m.def(
      "fp8_gemm_plans",
      [](bool clear) {
        pybind11::list rows;
        for (const auto& p : trainstream::fp8_gemm_plans(clear)) {
          pybind11::dict row;
          row["device"] = p.device;
          row["m"] = p.m;
          row["n"] = p.n;
          row["k"] = p.k;
          row["out_dtype"] = std::string(c10::toString(static_cast<at::ScalarType>(p.out_dtype)));
          row["candidates"] = p.candidates;
          row["chosen"] = p.chosen;
          row["tuned"] = p.tuned;
          row["ms_chosen"] = p.ms_chosen;
          row["ms_first"] = p.ms_first;
          row["alignments"] = pybind11::make_tuple(p.align_w, p.align_x, p.align_out);
          rows.append(row);
        }
        return rows;
      },
      pybind11::arg("clear") = false,
      "The cuBLASLt FP8 GEMM's cached plans, one dict per shape; clear=True forgets them after reading.");
  m.def("built_with_cuda", &trainstream::built_with_cuda,
        "True when the extension was compiled with CUDA support.");
  m.def("adamw_isa", &trainstream::adamw_isa,
        "SIMD path of the CPU AdamW on this machine: avx512, avx2 or scalar (TRAINSTREAM_CPU_ISA forces one).");
  trainstream::init_arena(m);
  trainstream::init_staging(m);
  trainstream::init_shared_host(m);
  trainstream::init_gc_pauses(m);
}
