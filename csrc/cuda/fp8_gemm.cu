// Row-wise scaled FP8 GEMM on cuBLASLt with its algorithm chosen once per shape (host code only).
//
//   fp8_gemm_rowwise(a, b, scale_a, scale_b, out_dtype)
//       -> out (M, N) = (a (M, K) b (N, K)^T) * scale_a (M) x scale_b (N)
//
// the product torch._scaled_mm(a, b.t(), scale_a (M, 1), scale_b (1, N), out_dtype) computes for row-wise scales,
// through the same library: cuBLASLt with outer-vector scaling (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, cuBLAS
// 12.9+ on sm_90). What differs is the host side: torch's scaled_gemm creates its descriptors and asks
// cublasLtMatmulAlgoGetHeuristic for an algorithm on every call, which the FP8 layer pays 14 times per Llama block
// step (benchmarks/NOTES.md 2026-12-05, profile-quant-fp8-h200-f4de1e0.json.gz: ~60 us of untraced host time inside each profiled _scaled_mm call); here
// the heuristic's answer is kept per (device, M, N, K, output dtype, operand alignments).
//
// Layout: cuBLASLt is column-major. The row-major out (M, N) is the column-major (N, M) product op(A) op(B) with
// A = b seen as (K, N) column-major, transposed (op(A) = b, N x K), and B = a seen as (K, M) column-major, not
// transposed: the "TN" layout FP8 needs on Hopper. A's outer scale vector runs along op(A)'s rows (scale_b), B's
// along op(B)'s columns (scale_a).
//
// The FP8 layer's default GEMM on sm_90 where this is built (TRAINSTREAM_FP8_GEMM=auto; csrc/autograd/fp8_linear.cpp).
//
// Algorithm choice, once per key (device, M, N, K, output dtype, alignments): the heuristic is asked for up to
// kCandidates algorithms, and outside CUDA graph capture each is timed on the current stream (one warm-up run, then
// kReps back-to-back runs between two CUDA events, on the call's own operands and output), the fastest kept; ties go
// to the heuristic's order. The heuristic ranks by a model of the kernels, not by running them, and its first
// choice is not always the fastest for these skinny-K or wide-N shapes; timing them once costs one host sync and
// kCandidates * (kReps + 1) GEMMs at the first use of each shape (the ~10 shapes of a Llama block's step). Predicted
// effect, not measured: at most a few percent of the FP8 GEMMs' time, and none where the heuristic's first choice is
// already the fastest; fp8_gemm_plans() reports per shape what was chosen and the two times, to measure it.
//
// Deterministic per process: the first call for a key fixes its algorithm, and every later call (eager, or captured
// into a graph) runs that one, so one shape always gives the same bits in a process. Different processes may time
// differently and pick another algorithm (another summation order, results within a rounding);
// TRAINSTREAM_FP8_GEMM_TUNE=0 keeps the heuristic's first choice everywhere (reproducible across processes). While
// the current stream is being captured into a CUDA graph nothing is timed (a sync would break the capture, and the
// timing runs would be recorded into the graph): the heuristic's first choice is used and kept for the key, so the
// graph and later eager calls agree. Timing is not done under another thread's global-mode capture either; nothing
// here can see that, as with any library that syncs (cudnn.benchmark).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "../include/trainstream.h"

namespace trainstream {
namespace {

#define TS_CUBLAS_CHECK(expr)                                                                             \
  do {                                                                                                    \
    const cublasStatus_t status_ = (expr);                                                                \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, "fp8_gemm_rowwise: ", #expr, " failed: cuBLAS status ", \
                static_cast<int>(status_));                                                               \
  } while (0)

cudaDataType_t cuda_dtype(at::ScalarType t) {
  switch (t) {
    // float32 output would need C in another type than D (cuBLASLt's FP8 rules); the FP8 layer never asks for it
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    default: TORCH_CHECK_TYPE(false, "fp8_gemm_rowwise: out_dtype must be bfloat16 or float16, got ", t);
  }
}

// The largest power of two (up to 256) dividing the address: the alignment the algorithm may assume.
int64_t alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  int64_t a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

// One cuBLASLt handle per device, made on first use and kept for the process (leaked on purpose: destroying it
// during static destruction would run after the CUDA context is gone).
cublasLtHandle_t handle_for(int device) {
  static std::mutex mu;
  static auto* handles = new std::unordered_map<int, cublasLtHandle_t>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles->find(device);
  if (it != handles->end()) return it->second;
  cublasLtHandle_t h = nullptr;
  TS_CUBLAS_CHECK(cublasLtCreate(&h));
  handles->emplace(device, h);
  return h;
}

struct Key {
  std::array<int64_t, 9> v;  // device, m, n, k, out dtype, alignment of a, b, out, and the fast-accumulation flag
  bool operator==(const Key& o) const { return v == o.v; }
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = 0;
    for (int64_t x : k.v) h = h * 1000003u ^ std::hash<int64_t>()(x);
    return h;
  }
};

struct Plan {
  cublasLtMatmulAlgo_t algo;
  size_t workspace;
  int candidates = 1;      // algorithms the heuristic returned
  int chosen = 0;          // index of the kept one in the heuristic's order
  bool tuned = false;      // chosen by timing (false: the heuristic's first, as under capture or with tuning off)
  float ms_chosen = -1.f;  // per GEMM, from the timing (-1: not timed)
  float ms_first = -1.f;
};

// RAII for the per-call descriptors (cheap to make; the algorithm search is what is cached).
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  ~Descriptors() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

constexpr size_t kMaxWorkspace = 32u << 20;
constexpr int kCandidates = 8;
constexpr int kReps = 3;

std::mutex plans_mu;
std::unordered_map<Key, Plan, KeyHash>* plans = new std::unordered_map<Key, Plan, KeyHash>();  // leaked on purpose

// TRAINSTREAM_FP8_GEMM_TUNE=0 (or false / off): keep the heuristic's first choice. Read once.
bool tuning_on() {
  static const bool on = [] {
    const char* v = std::getenv("TRAINSTREAM_FP8_GEMM_TUNE");
    if (v == nullptr) return true;
    std::string t(v);
    std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
    return !(t == "0" || t == "false" || t == "off");
  }();
  return on;
}

bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;  // active, or invalidated (still inside a capture)
}

// Milliseconds per GEMM of one algorithm (one warm-up run, then kReps timed), or a negative value where it fails
// to run. Writes the call's own output (the real product follows).
float time_algo(cublasLtHandle_t handle, const Descriptors& d, const cublasLtMatmulAlgo_t& algo, size_t workspace,
                void* ws, const void* a_ptr, const void* b_ptr, void* out_ptr, cudaStream_t stream) {
  const float alpha = 1.0f, beta = 0.0f;
  auto run = [&] {
    return cublasLtMatmul(handle, d.op, &alpha, a_ptr, d.a, b_ptr, d.b, &beta, b_ptr, d.c, out_ptr, d.c, &algo,
                          workspace ? ws : nullptr, workspace, stream);
  };
  if (run() != CUBLAS_STATUS_SUCCESS) return -1.f;
  cudaEvent_t start = nullptr, end = nullptr;
  C10_CUDA_CHECK(cudaEventCreate(&start));
  C10_CUDA_CHECK(cudaEventCreate(&end));
  C10_CUDA_CHECK(cudaEventRecord(start, stream));
  bool ok = true;
  for (int r = 0; r < kReps && ok; ++r) ok = run() == CUBLAS_STATUS_SUCCESS;
  C10_CUDA_CHECK(cudaEventRecord(end, stream));
  C10_CUDA_CHECK(cudaEventSynchronize(end));
  float ms = 0.f;
  C10_CUDA_CHECK(cudaEventElapsedTime(&ms, start, end));
  C10_CUDA_CHECK(cudaEventDestroy(start));
  C10_CUDA_CHECK(cudaEventDestroy(end));
  return ok ? ms / kReps : -1.f;
}

std::vector<Fp8GemmPlanInfo> plans_report(bool clear) {
  std::lock_guard<std::mutex> lock(plans_mu);
  std::vector<Fp8GemmPlanInfo> rows;
  for (const auto& [key, plan] : *plans) {
    rows.push_back(Fp8GemmPlanInfo{key.v[0], key.v[1], key.v[2], key.v[3], key.v[4], plan.candidates, plan.chosen,
                                   plan.tuned, plan.ms_chosen, plan.ms_first, key.v[5], key.v[6], key.v[7]});
  }
  std::sort(rows.begin(), rows.end(), [](const Fp8GemmPlanInfo& x, const Fp8GemmPlanInfo& y) {
    return std::tie(x.device, x.m, x.n, x.k, x.out_dtype, x.align_w, x.align_x, x.align_out) <
           std::tie(y.device, y.m, y.n, y.k, y.out_dtype, y.align_w, y.align_x, y.align_out);
  });
  if (clear) plans->clear();
  return rows;
}

// Hands plans_report to fp8_gemm_plans() (csrc/autograd/fp8_linear.cpp, built in every build) at load time.
const bool reporter_registered = (set_fp8_gemm_plans_source(&plans_report), true);

}  // namespace

at::Tensor fp8_gemm_rowwise_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                 const at::Tensor& scale_b, at::ScalarType out_dtype) {
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120900
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1),
                    "fp8_gemm_rowwise: a must be (M, K) and b (N, K), got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK_TYPE(a.scalar_type() == at::kFloat8_e4m3fn && b.scalar_type() == at::kFloat8_e4m3fn,
                   "fp8_gemm_rowwise: a and b must be float8_e4m3fn, got ", a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK_TYPE(scale_a.scalar_type() == at::kFloat && scale_b.scalar_type() == at::kFloat,
                   "fp8_gemm_rowwise: the scales must be float32");
  const int64_t m = a.size(0), n = b.size(0), k = a.size(1);
  TORCH_CHECK_VALUE(scale_a.numel() == m && scale_b.numel() == n, "fp8_gemm_rowwise: scale_a must hold ", m,
                    " values and scale_b ", n, ", got ", scale_a.numel(), " and ", scale_b.numel());
  TORCH_CHECK_VALUE(k % 16 == 0 && n % 16 == 0, "fp8_gemm_rowwise: K and N must be multiples of 16, got K=", k,
                    " N=", n);
  TORCH_CHECK_VALUE(a.is_cuda() && b.device() == a.device() && scale_a.device() == a.device() &&
                        scale_b.device() == a.device(),
                    "fp8_gemm_rowwise: every tensor must be on one CUDA device");
  const at::Tensor ac = a.contiguous(), bc = b.contiguous(), sa = scale_a.contiguous(), sb = scale_b.contiguous();
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = at::empty({m, n}, a.options().dtype(out_dtype));
  if (m == 0 || n == 0) return out;
  if (k == 0) return out.zero_();

  Descriptors d;
  TS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  const void* scale_a_ptr = sb.data_ptr();  // cuBLASLt's A is our b
  const void* scale_b_ptr = sa.data_ptr();
  TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a_ptr,
                                                 sizeof(scale_a_ptr)));
  TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b_ptr,
                                                 sizeof(scale_b_ptr)));
  const int32_t outer = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer, sizeof(outer)));
  TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer, sizeof(outer)));
  const int8_t fast_accum = 0;  // torch._scaled_mm's default (use_fast_accum=False)
  TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum,
                                                 sizeof(fast_accum)));
  TS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.a, CUDA_R_8F_E4M3, k, n, k));
  TS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.b, CUDA_R_8F_E4M3, k, m, k));
  TS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.c, cuda_dtype(out_dtype), n, m, n));

  const int device = a.get_device();
  const cublasLtHandle_t handle = handle_for(device);
  const Key key{{device, m, n, k, static_cast<int64_t>(out_dtype), alignment(bc.data_ptr()), alignment(ac.data_ptr()),
                 alignment(out.data_ptr()), fast_accum}};
  Plan plan{};
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(plans_mu);
    auto it = plans->find(key);
    if (it != plans->end()) {
      plan = it->second;
      found = true;
    }
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  if (!found) {
    cublasLtMatmulPreference_t pref = nullptr;
    TS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t max_ws = kMaxWorkspace;
    const uint32_t align_a = static_cast<uint32_t>(key.v[5]), align_b = static_cast<uint32_t>(key.v[6]),
                   align_c = static_cast<uint32_t>(key.v[7]);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof(align_c));
    std::array<cublasLtMatmulHeuristicResult_t, kCandidates> results{};
    int returned = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, d.op, d.a, d.b, d.c, d.c, pref, kCandidates,
                                                                 results.data(), &returned);
    cublasLtMatmulPreferenceDestroy(pref);
    TS_CUBLAS_CHECK(status);
    TORCH_CHECK(returned > 0, "fp8_gemm_rowwise: cuBLASLt has no algorithm for M=", m, " N=", n, " K=", k,
                " (row-wise FP8 scaling needs sm_90 and cuBLAS 12.9+)");
    plan = Plan{results[0].algo, results[0].workspaceSize, returned};
    if (returned > 1 && tuning_on() && !stream_capturing(stream)) {
      size_t most = 0;
      for (int i = 0; i < returned; ++i) most = std::max(most, results[i].workspaceSize);
      const at::Tensor ws =
          most ? at::empty({static_cast<int64_t>(most)}, a.options().dtype(at::kByte)) : at::Tensor();
      float best = -1.f;
      for (int i = 0; i < returned; ++i) {
        if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
        const float ms = time_algo(handle, d, results[i].algo, results[i].workspaceSize,
                                   ws.defined() ? ws.data_ptr() : nullptr, bc.data_ptr(), ac.data_ptr(),
                                   out.data_ptr(), stream);
        if (i == 0) plan.ms_first = ms;
        if (ms >= 0.f && (best < 0.f || ms < best)) {  // strictly faster: ties keep the heuristic's order
          best = ms;
          plan.algo = results[i].algo;
          plan.workspace = results[i].workspaceSize;
          plan.chosen = i;
        }
      }
      plan.tuned = best >= 0.f;
      plan.ms_chosen = best;
    }
    std::lock_guard<std::mutex> lock(plans_mu);
    plan = plans->emplace(key, plan).first->second;  // a concurrent first call's plan wins: one per key
  }
  const at::Tensor workspace =
      plan.workspace ? at::empty({static_cast<int64_t>(plan.workspace)}, a.options().dtype(at::kByte)) : at::Tensor();
  const float alpha = 1.0f, beta = 0.0f;
  // C is unused (beta = 0) but must be a valid pointer other than D's (as torch's scaled_gemm passes mat1).
  TS_CUBLAS_CHECK(cublasLtMatmul(handle, d.op, &alpha, bc.data_ptr(), d.a, ac.data_ptr(), d.b, &beta, ac.data_ptr(),
                                 d.c, out.data_ptr(), d.c, &plan.algo,
                                 workspace.defined() ? workspace.data_ptr() : nullptr, plan.workspace, stream));
  return out;
#else
  (void)a; (void)b; (void)scale_a; (void)scale_b; (void)out_dtype;
  TORCH_CHECK(false, "fp8_gemm_rowwise: this build's cuBLAS is older than 12.9 (no row-wise FP8 scaling)");
#endif
}

}  // namespace trainstream

// Registered only where cuBLAS has row-wise FP8 scaling: the FP8 layer's "auto" GEMM setting takes this GEMM where a
// CUDA kernel for it exists (csrc/autograd/fp8_linear.cpp), and must not pick one that can only raise.
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120900
TORCH_LIBRARY_IMPL(trainstream, CUDA, m) {
  m.impl("fp8_gemm_rowwise", &trainstream::fp8_gemm_rowwise_cuda);
}
#endif
