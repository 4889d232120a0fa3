// The FP8 tensor-core linear layer as one op with its autograd node in C++ (trainstream_hf/quant/matmul.py,
// fp8_w8a8_scaled_mm).
//
// Why C++: on the H200 the host side of one FP8 layer call, not its kernels, set the step time (benchmarks/NOTES.md,
// 2026-12-03 to 2026-12-05): a torch.autograd.Function whose backward re-entered Python, then the Python around the op (the
// activation-reuse bookkeeping, a separate quantize call, the (..., K) -> (T, K) reshape and the output view, each of
// those two an autograd node of its own) cost more host time per layer than nn.Linear's whole call. Here one call
// from Python does the reshape, the quantization (or its reuse), the GEMM and the view, and the backward never takes
// the GIL.
//
//   fp8_linear(x, w, w_scale, reuse, w_t, outliers) -> y = _scaled_mm(e4m3(x) per row, w^T, scale_a = s_x (T, 1),
//       scale_b = w_scale (1, N)) in x's dtype, as (..., N). x (..., K) bfloat16 / float16; w (N, K) float8_e4m3fn
//       codes, w_scale (N,) float32. reuse: keep this quantization of x for the next call on the same x (below). w_t:
//       optional, w's codes transposed, (K, N) contiguous, handed to the backward (below); the forward does not read
//       it. outliers = k > 0: the k input channels of largest max |x| over the tokens (torch.topk on the device: no
//       host sync, no data-dependent shape) are zeroed in the quantized operand and multiplied in x's dtype against
//       their dequantized weight columns (rounded to x's dtype; x's values are exact), float32 accumulation, added
//       into the FP8 GEMM's output by one addmm_: y = fp8 GEMM(x with them zeroed) + x[:, I] W_hat[:, I]^T
//       (trainstream_hf/quant/outliers.py's decomposition, as one op: its Python autograd Function cost host time
//       per layer call; this runs torch's ops from C++ and keeps the C++ backward, which the split does not change:
//       dx = dy W_hat). On CUDA that addmm_ rounds the outlier product to x's dtype before adding it (measured,
//       csrc/autograd/dequant_linear.cpp's LoRA header): two roundings of y instead of one, on the tensor cores
//       instead of a float32 GEMM and two float32 (T, N) passes. That quantization is a temporary, never kept or
//       reused (with reuse, a miss).
//   fp8_linear_dgrad(dy, w, w_scale, w_t) -> dx = _scaled_mm(e4m3(dy * w_scale) per row, w (column-major), scale_a =
//       s_g, scale_b = ones (1, K)) in dy's dtype, dy (T, N): the straight-through input gradient (maths in matmul.py).
//
// The transposed weight. Hopper's FP8 GEMMs take both operands K-major, so the backward's (N, K) operand must be
// column-major: a (K, N) row-major copy of w. Without w_t the backward makes one per call (transpose_bytes: N*K bytes
// read and written, 7 calls and ~8% of a Llama-3-8B block's FP8 step on the H100). With w_t it takes that copy as it
// is, the same bytes, so dx is the same bits. The caller owns the copy and keeps it in step with w (QuantLinear keeps
// one per layer, trainstream_hf/quant/linear.py); it is held by the autograd node in saved_data, not saved with
// save_for_backward, so saved-tensor hooks never see it: it is a layer's weight, not an activation, and the engine's
// activation offloader would otherwise copy it to the host and back every step.
//
// Reuse of one quantized activation. Llama's q / k / v projections read one hidden state, gate / up another:
// quantizing it once instead of three (two) times saves 3 of the 7 per-token quantizations of a block's forward. The
// last quantization is kept with everything that would change x's contents or layout: a weak reference to x's
// TensorImpl (never its address alone: a freed tensor's memory is reused by the next allocation of the same size), its
// version counter (bumped by every in-place write through x or any view or detach() of it: autograd's own check for
// saved tensors), data pointer, sizes, strides, dtype, device and the current stream (a consumer on another stream
// is not ordered after the quantizing kernel). Writes that bypass the version counter are not seen, as autograd does
// not see them: through x.data (its own counter), from outside torch, or a CUDA graph replay rewriting its static
// outputs. Never kept or reused: inference tensors (no version counter), calls with reuse=false, calls traced into a
// compiled graph (whose code writes buffers without version bumps), and calls while the current CUDA stream is being
// captured into a graph. The kept copy (T x K bytes + T floats) goes at the first
// backward through an FP8 layer (the forward is over), when another quantization replaces it, when the next call
// finds its tensor dead, or at fp8_forget_activation(); the reused result is the same bits as a fresh one.
//
// w and w_scale are saved with save_for_backward, so saved-tensor hooks (the engine's weight pager, activation
// checkpointing) see them as they see any saved tensor. No gradient for w, w_scale, w_t.
//
// The GEMM. On CUDA, scaled_mm_rowwise below runs torch._scaled_mm or this library's cuBLASLt call
// (csrc/cuda/fp8_gemm.cu), as TRAINSTREAM_FP8_GEMM says: "auto" (the default), "cublaslt" or "torch". The variable is
// read once, at the first GEMM, not per call (a getenv per GEMM is host time on every layer call);
// fp8_gemm_setting() changes the setting at run time or reads the variable again (ops.set_fp8_gemm). "auto" takes
// cuBLASLt where the build has it (ops.fp8_gemm_rowwise has a CUDA kernel) and the device is sm_90 (Hopper: where
// its row-wise scaling was written and tested), torch._scaled_mm elsewhere.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "../include/autograd_common.h"
#include "../include/trainstream.h"

#ifdef TRAINSTREAM_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

namespace trainstream {
namespace {

// t itself where it is contiguous at a 16-byte aligned address (cuBLAS' operand rule), else an aligned copy.
at::Tensor aligned(const at::Tensor& t) {
  if (t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0) return t;
  return t.clone(at::MemoryFormat::Contiguous);
}

void check_operands(const at::Tensor& w, const at::Tensor& w_scale, const char* op) {
  TORCH_CHECK_VALUE(w.dim() == 2, op, ": w must be 2-D (out_features, in_features), got shape ", w.sizes());
  TORCH_CHECK_TYPE(w.scalar_type() == at::kFloat8_e4m3fn, op, ": w must be float8_e4m3fn, got ", w.scalar_type());
  TORCH_CHECK_TYPE(w_scale.scalar_type() == at::kFloat, op, ": w_scale must be float32, got ", w_scale.scalar_type());
  TORCH_CHECK_VALUE(w_scale.numel() == w.size(0), op, ": w_scale must hold one scale per row of w (", w.size(0),
                    "), got shape ", w_scale.sizes());
}

using QuantizeFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&);

c10::TypedOperatorHandle<QuantizeFn>& quantize_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("trainstream::quantize_rows_e4m3", "")
                       .typed<QuantizeFn>();
  return op;
}

// Whether the current stream of a device of this type is being captured into a CUDA graph.
bool capturing(at::DeviceType type) {
#ifdef TRAINSTREAM_WITH_CUDA
  if (type == at::kCUDA) return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#endif
  (void)type;
  return false;
}

// The kept activation quantization (see the top of this file). Leaked on purpose: its tensors must not be freed
// during static destruction, after the CUDA context is gone.
struct KeptActivation {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> src;
  uint32_t version;
  const void* data;
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  at::Device device;
  c10::StreamId stream;
  at::Tensor xq, sx;
};

struct ActivationCache {
  std::mutex mu;
  std::optional<KeptActivation> kept;
  int64_t hits = 0, misses = 0;
};

ActivationCache& activation_cache() {
  static auto* cache = new ActivationCache();
  return *cache;
}

c10::StreamId current_stream(const at::Device& device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device).id();
}

bool same(const KeptActivation& k, const at::Tensor& x, c10::StreamId stream) {
  if (k.src.expired() || k.src._unsafe_get_target() != x.unsafeGetTensorImpl()) return false;
  return k.version == x.unsafeGetTensorImpl()->version_counter().current_version() && k.data == x.data_ptr() &&
         k.sizes == x.sizes() && k.strides == x.strides() && k.dtype == x.scalar_type() && k.device == x.device() &&
         k.stream == stream;
}

// Counts a quantization made where reuse was asked for but is not possible here.
void count_miss() {
  auto& cache = activation_cache();
  std::lock_guard<std::mutex> lock(cache.mu);
  cache.misses++;
}

// quantize_rows_e4m3(x2d), or the kept result for this very x (x2d = x.reshape(-1, K)).
std::tuple<at::Tensor, at::Tensor> quantized_activation(const at::Tensor& x, const at::Tensor& x2d, bool reuse) {
  auto& cache = activation_cache();
  const bool keep = reuse && !x.is_inference() && !capturing(x.device().type());
  if (!keep) {
    if (reuse) count_miss();  // asked for, but not allowed here
  } else {
    const c10::StreamId stream = current_stream(x.device());
    std::unique_lock<std::mutex> lock(cache.mu);
    if (cache.kept && same(*cache.kept, x, stream)) {
      cache.hits++;
      return {cache.kept->xq, cache.kept->sx};
    }
    cache.misses++;
    cache.kept.reset();  // release the old copy before the new one is made
    lock.unlock();
    auto [xq, sx] = quantize_op().call(x2d, std::nullopt);
    lock.lock();
    cache.kept = KeptActivation{c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(x.getIntrusivePtr()),
                                x.unsafeGetTensorImpl()->version_counter().current_version(), x.data_ptr(),
                                x.sizes().vec(), x.strides().vec(), x.scalar_type(), x.device(), stream, xq, sx};
    return {xq, sx};
  }
  return quantize_op().call(x2d, std::nullopt);
}

// The (1, K) float32 ones the backward's scale_b is, one per (device, K), made outside graph capture only.
at::Tensor unit_scales(int64_t k, const at::TensorOptions& options) {
  static auto* mu = new std::mutex();
  static auto* kept = new std::map<std::tuple<int, int, int64_t>, at::Tensor>();
  if (capturing(options.device().type())) return at::ones({1, k}, options);
  const at::Device device = options.device();
  const auto key = std::make_tuple(static_cast<int>(device.type()), static_cast<int>(device.index()), k);
  std::lock_guard<std::mutex> lock(*mu);
  auto it = kept->find(key);
  if (it == kept->end()) it = kept->emplace(key, at::ones({1, k}, options)).first;
  return it->second;
}

// The GEMM setting (see the top of this file). kUnread until the first GEMM or fp8_gemm_setting() reads
// TRAINSTREAM_FP8_GEMM; one atomic load per GEMM after that.
enum Gemm : int { kUnread = 0, kAuto = 1, kTorch = 2, kCublasLt = 3 };
constexpr const char* kGemmNames[] = {"unread", "auto", "torch", "cublaslt"};
std::atomic<int> gemm_setting{kUnread};

Gemm parse_gemm(std::string text, const char* source) {
  text.erase(std::remove_if(text.begin(), text.end(), [](unsigned char c) { return std::isspace(c); }), text.end());
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  if (text.empty() || text == "auto") return kAuto;
  if (text == "torch") return kTorch;
  if (text == "cublaslt") return kCublasLt;
  TORCH_CHECK_VALUE(false, source, "='", text, "': expected auto, cublaslt or torch");
}

Gemm gemm_from_env() {
  const char* choice = std::getenv("TRAINSTREAM_FP8_GEMM");
  return choice == nullptr ? kAuto : parse_gemm(choice, "TRAINSTREAM_FP8_GEMM");
}

Gemm current_gemm() {
  int g = gemm_setting.load(std::memory_order_relaxed);
  if (g == kUnread) {
    int expected = kUnread;
    gemm_setting.compare_exchange_strong(expected, gemm_from_env());  // a concurrent set wins
    g = gemm_setting.load();
  }
  return static_cast<Gemm>(g);
}

using GemmFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::ScalarType);

c10::OperatorHandle gemm_handle() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("trainstream::fp8_gemm_rowwise", "");
  return op;
}

// Whether "auto" takes cuBLASLt on this CUDA device: the build has the GEMM (fp8_gemm.cu registers its kernel only
// where cuBLAS has row-wise FP8 scaling) and the device is sm_90. Per device, decided once.
bool auto_takes_cublaslt(c10::DeviceIndex index) {
#ifdef TRAINSTREAM_WITH_CUDA
  static std::array<std::atomic<int>, 64> known{};  // 0 unknown, 1 no, 2 yes
  const size_t i = static_cast<size_t>(index);
  if (i < known.size()) {
    const int k = known[i].load(std::memory_order_relaxed);
    if (k != 0) return k == 2;
  }
  const bool yes = gemm_handle().hasKernelForDispatchKey(c10::DispatchKey::CUDA) &&
                   at::cuda::getDeviceProperties(index)->major == 9;
  if (i < known.size()) known[i].store(yes ? 2 : 1, std::memory_order_relaxed);
  return yes;
#else
  (void)index;
  return false;
#endif
}

bool use_cublaslt(const at::Tensor& a) {
  if (!a.is_cuda()) return false;
  const Gemm g = current_gemm();
  return g == kCublasLt || (g == kAuto && auto_takes_cublaslt(a.device().index()));
}

// a (M, K) x b (N, K)^T with row-wise scales sa (M, 1) and sb (N values), in out_dtype: torch._scaled_mm, or the
// cuBLASLt call with its algorithm cached per shape (csrc/cuda/fp8_gemm.cu), as the GEMM setting says.
at::Tensor scaled_mm_rowwise(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa, const at::Tensor& sb,
                             at::ScalarType out_dtype) {
  if (use_cublaslt(a)) {
    static auto gemm = gemm_handle().typed<GemmFn>();
    return gemm.call(a, b, sa.reshape({-1}), sb.reshape({-1}), out_dtype);
  }
  return at::_scaled_mm(a, b.t(), sa, sb.view({1, -1}), std::nullopt, std::nullopt, out_dtype, false);
}

void check_transposed(const at::Tensor& w_t, const at::Tensor& w, const char* op) {
  TORCH_CHECK_TYPE(w_t.scalar_type() == at::kFloat8_e4m3fn, op, ": w_t must be float8_e4m3fn, got ",
                   w_t.scalar_type());
  TORCH_CHECK_VALUE(w_t.dim() == 2 && w_t.size(0) == w.size(1) && w_t.size(1) == w.size(0), op,
                    ": w_t must be w transposed, (", w.size(1), ", ", w.size(0), "), got shape ", w_t.sizes());
  TORCH_CHECK_VALUE(w_t.device() == w.device(), op, ": w_t must be on w's device (", w.device(), "), got ",
                    w_t.device());
}

}  // namespace

std::string fp8_gemm_setting(const std::optional<std::string>& choice, bool from_env) {
  TORCH_CHECK_VALUE(!(choice.has_value() && from_env), "fp8_gemm_setting: give a choice or from_env, not both");
  if (from_env) {
    gemm_setting.store(gemm_from_env());
  } else if (choice.has_value()) {
    gemm_setting.store(parse_gemm(*choice, "fp8 GEMM"));
  }
  return kGemmNames[current_gemm()];
}

std::string fp8_gemm_on(const at::Device& device) {
  if (!device.is_cuda()) return "torch";
  const Gemm g = current_gemm();
  const bool lt = g == kCublasLt || (g == kAuto && auto_takes_cublaslt(device.has_index() ? device.index() : 0));
  return lt ? "cublaslt" : "torch";
}

namespace {
std::atomic<Fp8GemmPlansSource> plans_source{nullptr};  // constant-initialised: set from another file's static init
}  // namespace

void set_fp8_gemm_plans_source(Fp8GemmPlansSource source) { plans_source.store(source); }

std::vector<Fp8GemmPlanInfo> fp8_gemm_plans(bool clear) {
  const Fp8GemmPlansSource source = plans_source.load();
  return source == nullptr ? std::vector<Fp8GemmPlanInfo>() : source(clear);
}

std::vector<int64_t> fp8_activation_cache(bool clear) {
  auto& cache = activation_cache();
  std::lock_guard<std::mutex> lock(cache.mu);
  if (clear) cache.kept.reset();
  return {cache.kept.has_value() ? 1 : 0, cache.hits, cache.misses};
}

// The outlier split of x2d (T, K) for k channels (see the top of this file): y = GEMM(e4m3(x2d * keep)) + x_out cols^T.
// keep (K,) float32 is 1 but 0 on the chosen channels: quantize_rows_e4m3's column scale zeroes them as it reads x
// (no zeroed copy of x; +-0 codes, the same values). The channels' max |x| is one inf-norm reduction (no |x| copy),
// the same values and so the same choice as trainstream_hf/quant/outliers.py's select_outliers.
struct OutlierSplit {
  at::Tensor keep, x_out, cols;  // (K,) float32; (T, k), (N, k) = dequantize(w, x.dtype)[:, I] in x's dtype
};

OutlierSplit split_outliers(const at::Tensor& x2d, const at::Tensor& w, const at::Tensor& w_scale, int64_t k) {
  const at::Tensor amax = at::linalg_vector_norm(x2d, INFINITY, at::IntArrayRef{0}, false, std::nullopt);
  const at::Tensor idx = std::get<1>(at::topk(amax, k, /*dim=*/-1, /*largest=*/true, /*sorted=*/false));
  return {at::ones({x2d.size(1)}, x2d.options().dtype(at::kFloat)).index_fill_(0, idx, 0), x2d.index_select(1, idx),
          w.index_select(1, idx).to(at::kFloat).mul_(w_scale.reshape({-1, 1})).to(x2d.scalar_type())};
}

at::Tensor fp8_linear_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale, bool reuse,
                              const std::optional<at::Tensor>& w_t, int64_t outliers) {
  check_operands(w, w_scale, "fp8_linear");
  if (w_t.has_value() && w_t->defined()) check_transposed(*w_t, w, "fp8_linear");  // now, not in the backward
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == w.size(1), "fp8_linear: x must be (..., ", w.size(1), "), got ",
                    x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
                   "fp8_linear: x must be bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(outliers >= 0 && outliers <= w.size(1), "fp8_linear: outliers must be a channel count in [0, ",
                    w.size(1), "], got ", outliers);
  const at::Tensor x2d = x.reshape({-1, w.size(1)});
  at::Tensor y;
  if (outliers > 0 && x2d.size(0) > 0) {
    if (reuse) count_miss();  // the split quantizes a temporary
    const OutlierSplit split = split_outliers(x2d, w, w_scale, outliers);
    auto [xq, sx] = quantize_op().call(x2d, std::optional<at::Tensor>(split.keep));
    y = scaled_mm_rowwise(aligned(xq), aligned(w), aligned(sx), aligned(w_scale), x.scalar_type());
    y.addmm_(split.x_out, split.cols.t());
  } else {
    auto [xq, sx] = quantized_activation(x, x2d, reuse);
    y = scaled_mm_rowwise(aligned(xq), aligned(w), aligned(sx), aligned(w_scale), x.scalar_type());
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = w.size(0);
  return y.view(sizes);
}

at::Tensor fp8_linear_dgrad(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& w_scale,
                            const std::optional<at::Tensor>& w_t) {
  check_operands(w, w_scale, "fp8_linear_dgrad");
  TORCH_CHECK_VALUE(dy.dim() == 2 && dy.size(1) == w.size(0), "fp8_linear_dgrad: dy must be (tokens, ", w.size(0),
                    "), got ", dy.sizes());
  const bool given = w_t.has_value() && w_t->defined();
  if (given) check_transposed(*w_t, w, "fp8_linear_dgrad");
  static auto transpose = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("trainstream::transpose_bytes", "")
                              .typed<at::Tensor(const at::Tensor&)>();
  auto [gq, sg] = quantize_op().call(dy, std::optional<at::Tensor>(w_scale.reshape({-1})));  // dy * s_w, per row
  // The (N, K) operand column-major = a row-major (K, N) copy viewed back: the caller's, or one made now.
  const at::Tensor wt = given ? aligned(*w_t) : transpose.call(w);
  const at::Tensor ones = unit_scales(w.size(1), dy.options().dtype(at::kFloat));
  return scaled_mm_rowwise(gq, wt, sg, ones, dy.scalar_type());
}

namespace {

using Fp8LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool,
                               const std::optional<at::Tensor>&, int64_t);
using Fp8DgradFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&);

const c10::TypedOperatorHandle<Fp8LinearFn>& linear_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("trainstream::fp8_linear", "").typed<Fp8LinearFn>();
  return op;
}

const c10::TypedOperatorHandle<Fp8DgradFn>& dgrad_op() {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("trainstream::fp8_linear_dgrad", "").typed<Fp8DgradFn>();
  return op;
}

class Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& w_scale, bool reuse, const std::optional<at::Tensor>& w_t,
                            int64_t outliers) {
    at::AutoDispatchBelowADInplaceOrView guard;  // below autograd: the reshape and the view are no nodes of their own
    ctx->save_for_backward({w, w_scale});
    ctx->saved_data["sizes"] = x.sizes().vec();
    // Not through save_for_backward: the caller's weight copy, not an activation (see the top of this file).
    if (w_t.has_value() && w_t->defined()) ctx->saved_data["w_t"] = *w_t;
    // Traced (torch.compile, export): the graph's call never keeps or reuses. A compiler's generated code writes a
    // freed buffer's next contents into the same tensor object without bumping its version counter (inductor's
    // `buf4 = buf0; del buf0  # reuse`), so the kept quantization of the old contents would be taken for the new.
    if (traced(x) || traced(w)) return linear_op().call(x, w, w_scale, /*reuse=*/false, w_t, outliers);
    return fp8_linear_forward(x, w, w_scale, reuse, w_t, outliers);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    fp8_activation_cache(true);  // a backward has begun: the forward's kept quantization is done with
    const auto saved = ctx->get_saved_variables();  // read once (a second read fails under checkpointing)
    at::Tensor dx;
    if (ctx->needs_input_grad(0) && grads[0].defined()) {
      const at::Tensor& w = saved[0];
      const auto kept = ctx->saved_data.find("w_t");
      const std::optional<at::Tensor> w_t =
          kept == ctx->saved_data.end() ? std::nullopt : std::optional<at::Tensor>(kept->second.toTensor());
      const at::Tensor dy = grads[0].reshape({-1, w.size(0)});
      if (traced(dy) || traced(w)) {
        at::AutoDispatchBelowADInplaceOrView guard;
        dx = dgrad_op().call(dy, w, saved[1], w_t);
      } else {
        dx = fp8_linear_dgrad(dy, w, saved[1], w_t);
      }
      dx = dx.view(ctx->saved_data["sizes"].toIntVector());
    }
    return {dx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor fp8_linear_autograd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale, bool reuse,
                               const std::optional<at::Tensor>& w_t, int64_t outliers) {
  return Fp8LinearFunction::apply(x, w, w_scale, reuse, w_t, outliers);
}

}  // namespace
}  // namespace trainstream

TORCH_LIBRARY_IMPL(trainstream, CompositeExplicitAutograd, m) {
  m.impl("fp8_linear", &trainstream::fp8_linear_forward);
  m.impl("fp8_linear_dgrad", &trainstream::fp8_linear_dgrad);
}

TORCH_LIBRARY_IMPL(trainstream, Autograd, m) {
  m.impl("fp8_linear", &trainstream::fp8_linear_autograd);
  // Not differentiable, and called on tensors that require grad (the layer's input): no autograd node at all, rather
  // than the not-implemented fallback's node, which costs host time and warns when a backward reaches it.
  m.impl("quantize_rows_e4m3", torch::CppFunction::makeFallthrough());
  m.impl("transpose_bytes", torch::CppFunction::makeFallthrough());
  m.impl("fp8_linear_dgrad", torch::CppFunction::makeFallthrough());
}
