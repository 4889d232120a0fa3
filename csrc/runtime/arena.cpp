// Host arena: page-locked (cudaHostAlloc) or aligned pageable slabs, sub-allocated as CPU tensors.
//
// Each slab keeps a free list (offset -> size) with neighbours coalesced on free; allocation is best fit
// over all slabs. A tensor's deleter returns its block and holds a shared_ptr to the arena state, so a
// closed arena releases its slabs when the last tensor from it dies, never before.
#include <atomic>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <vector>

#include <ATen/ops/from_blob.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/utils/pybind.h>

#ifdef TRAINSTREAM_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "../include/trainstream.h"

namespace py = pybind11;

namespace trainstream {
namespace {

std::atomic<int64_t> g_reserved{0};
std::atomic<int64_t> g_pinned{0};

struct Slab {
  char* base;
  int64_t size;
  std::map<int64_t, int64_t> free;  // offset -> size
};

void* alloc_host(int64_t n, bool pinned) {
  void* p = nullptr;
  if (pinned) {
#ifdef TRAINSTREAM_WITH_CUDA
    cudaError_t err = cudaHostAlloc(&p, static_cast<size_t>(n), cudaHostAllocPortable);
    TORCH_CHECK(err == cudaSuccess, "HostArena: cudaHostAlloc of ", n, " bytes failed: ",
                cudaGetErrorString(err));
#else
    TORCH_CHECK(false, "HostArena: pinned memory needs a CUDA build (built without CUDA); use pinned=False");
#endif
  } else {
    TORCH_CHECK(posix_memalign(&p, 4096, static_cast<size_t>(n)) == 0 && p != nullptr,
                "HostArena: could not allocate ", n, " bytes of host memory");
  }
  return p;
}

void free_host(void* p, bool pinned) {
  if (pinned) {
#ifdef TRAINSTREAM_WITH_CUDA
    cudaFreeHost(p);
#endif
  } else {
    std::free(p);
  }
}

struct ArenaState {
  int64_t slab_bytes;
  bool pinned;
  int64_t alignment;
  std::mutex mu;
  std::vector<Slab> slabs;
  int64_t reserved = 0, used = 0, peak = 0, live = 0;
  bool closed = false;

  ~ArenaState() {
    for (auto& s : slabs) {
      free_host(s.base, pinned);
      g_reserved -= s.size;
      if (pinned) g_pinned -= s.size;
    }
  }

  int64_t largest_free_locked() const {
    int64_t best = 0;
    for (const auto& s : slabs)
      for (const auto& kv : s.free) best = std::max(best, kv.second);
    return best;
  }

  void add_slab(int64_t n) {
    char* p = static_cast<char*>(alloc_host(n, pinned));
    slabs.push_back(Slab{p, n, {{0, n}}});
    reserved += n;
    g_reserved += n;
    if (pinned) g_pinned += n;
  }

  void reserve(int64_t nbytes) {
    constexpr int64_t kRound = int64_t(2) << 20;
    std::lock_guard<std::mutex> lock(mu);
    TORCH_CHECK(!closed, "HostArena: arena is closed");
    while (nbytes > 0) {
      int64_t n = std::min(nbytes, slab_bytes);
      n = (n + kRound - 1) / kRound * kRound;
      add_slab(n);
      nbytes -= n;
    }
  }

  struct Block { size_t slab; int64_t off; char* ptr; };

  // Exhaustion is a normal outcome (a growable arena adds a slab and retries), so it is reported with
  // ptr == nullptr and a message, not a C++ exception: Python raises ArenaExhaustedError from it.
  Block allocate(int64_t nbytes, std::string* why) {
    std::lock_guard<std::mutex> lock(mu);
    TORCH_CHECK(!closed, "HostArena: arena is closed");
    const int64_t n = (std::max<int64_t>(nbytes, 1) + alignment - 1) / alignment * alignment;
    size_t best_slab = SIZE_MAX;
    int64_t best_off = 0, best_size = INT64_MAX;
    for (size_t i = 0; i < slabs.size(); ++i)
      for (const auto& kv : slabs[i].free)
        if (kv.second >= n && kv.second < best_size) {
          best_slab = i, best_off = kv.first, best_size = kv.second;
        }
    if (best_slab == SIZE_MAX) {
      std::ostringstream msg;
      msg << "HostArena exhausted: requested " << nbytes << " bytes, largest free block "
          << largest_free_locked() << " bytes, reserved " << reserved << ", used " << used
          << "; reserve more (host_arena) or allow the pageable fallback";
      *why = msg.str();
      return {0, 0, nullptr};
    }
    auto& fl = slabs[best_slab].free;
    fl.erase(best_off);
    if (best_size > n) fl.emplace(best_off + n, best_size - n);
    used += n;
    peak = std::max(peak, used);
    ++live;
    return {best_slab, best_off, slabs[best_slab].base + best_off};
  }

  void release(size_t slab, int64_t off, int64_t nbytes) {
    std::lock_guard<std::mutex> lock(mu);
    const int64_t n = (std::max<int64_t>(nbytes, 1) + alignment - 1) / alignment * alignment;
    auto& fl = slabs[slab].free;
    auto it = fl.emplace(off, n).first;
    auto next = std::next(it);
    if (next != fl.end() && it->first + it->second == next->first) {
      it->second += next->second;
      fl.erase(next);
    }
    if (it != fl.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        fl.erase(it);
      }
    }
    used -= n;
    --live;
  }
};

class HostArena {
 public:
  HostArena(int64_t slab_bytes, bool pinned, int64_t alignment) {
    TORCH_CHECK(slab_bytes > 0, "HostArena: slab_bytes must be > 0, got ", slab_bytes);
    TORCH_CHECK(alignment >= 256 && (alignment & (alignment - 1)) == 0,
                "HostArena: alignment must be a power of two >= 256, got ", alignment);
#ifndef TRAINSTREAM_WITH_CUDA
    TORCH_CHECK(!pinned, "HostArena: pinned memory needs CUDA but the extension was built without CUDA; "
                "use pinned=False");
#endif
    state_ = std::make_shared<ArenaState>();
    state_->slab_bytes = slab_bytes;
    state_->pinned = pinned;
    state_->alignment = alignment;
  }

  void reserve(int64_t nbytes) { state().reserve(nbytes); }

  // One slab of at least nbytes (rounded up to 2 MiB): room for a block larger than slab_bytes.
  void add_slab(int64_t nbytes) {
    TORCH_CHECK(nbytes > 0, "HostArena.add_slab: nbytes must be > 0, got ", nbytes);
    auto& st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    TORCH_CHECK(!st.closed, "HostArena: arena is closed");
    constexpr int64_t kRound = int64_t(2) << 20;
    st.add_slab((nbytes + kRound - 1) / kRound * kRound);
  }

  // The tensor, or (None, reason) when no free block is large enough.
  py::object empty(std::vector<int64_t> sizes, py::object dtype_obj) {
    TORCH_CHECK_TYPE(THPDtype_Check(dtype_obj.ptr()), "HostArena.empty: dtype must be a torch.dtype");
    const at::ScalarType dtype = reinterpret_cast<THPDtype*>(dtype_obj.ptr())->scalar_type;
    int64_t numel = 1;
    for (auto s : sizes) {
      TORCH_CHECK(s >= 0, "HostArena.empty: negative size in ", at::IntArrayRef(sizes));
      numel *= s;
    }
    const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
    auto st = state_;
    TORCH_CHECK(st, "HostArena: arena is closed");
    std::string why;
    const auto [slab, off, ptr] = st->allocate(nbytes, &why);
    if (ptr == nullptr) return py::make_tuple(py::none(), why);
    return py::cast(at::from_blob(
        ptr, sizes, [st, slab, off, nbytes](void*) { st->release(slab, off, nbytes); },
        at::TensorOptions().dtype(dtype).device(at::kCPU)));
  }

  py::dict stats() {
    py::dict d;
    auto& s = state_ ? *state_ : closed_stats_;
    std::lock_guard<std::mutex> lock(s.mu);
    d["reserved"] = s.reserved;
    d["used"] = s.used;
    d["peak"] = s.peak;
    d["largest_free"] = s.largest_free_locked();
    d["num_slabs"] = static_cast<int64_t>(s.slabs.size());
    d["live_allocations"] = s.live;
    d["pinned"] = s.pinned;
    d["alignment"] = s.alignment;
    return d;
  }

  void close() {
    if (!state_) return;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->closed = true;
      closed_stats_.pinned = state_->pinned;
      closed_stats_.alignment = state_->alignment;
      closed_stats_.peak = state_->peak;
    }
    state_.reset();  // slabs go when the last tensor's deleter drops its reference
  }

  bool closed() const { return !state_; }

 private:
  ArenaState& state() {
    TORCH_CHECK(state_, "HostArena: arena is closed");
    return *state_;
  }
  std::shared_ptr<ArenaState> state_;
  ArenaState closed_stats_{};
};

}  // namespace

// A CUDA tensor over pinned host memory (see init_arena's docstring). The device pointer comes from
// cudaHostGetDevicePointer (the identity on 64-bit UVA systems); the view's deleter holds the host tensor.
at::Tensor mapped_device_view(const at::Tensor& host, int64_t device_index) {
#ifdef TRAINSTREAM_WITH_CUDA
  TORCH_CHECK_VALUE(host.device().is_cpu() && host.is_pinned(), "mapped_device_view: host must be a pinned CPU tensor");
  TORCH_CHECK_VALUE(host.is_contiguous(), "mapped_device_view: host must be contiguous");
  void* device_ptr = nullptr;
  if (host.numel() > 0) {
    const cudaError_t err = cudaHostGetDevicePointer(&device_ptr, host.data_ptr(), 0);
    TORCH_CHECK(err == cudaSuccess, "mapped_device_view: cudaHostGetDevicePointer failed: ", cudaGetErrorString(err));
  }
  const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index));
  at::Tensor keep = host;
  return at::for_blob(device_ptr, host.sizes())
      .strides(host.strides())
      .deleter([keep](void*) mutable { keep.reset(); })
      .options(host.options().device(device).pinned_memory(false))
      .target_device(device)
      .make_tensor();
#else
  (void)host;
  (void)device_index;
  TORCH_CHECK(false, "mapped_device_view needs a CUDA build (TRAINSTREAM_CUDA=1)");
#endif
}

void init_arena(py::module_& m) {
  py::class_<HostArena>(m, "HostArena", "Slabs of (pinned) host memory sub-allocated as CPU tensors.")
      .def(py::init<int64_t, bool, int64_t>(), py::arg("slab_bytes"), py::arg("pinned"),
           py::arg("alignment") = 256)
      .def("reserve", &HostArena::reserve, py::arg("nbytes"), py::call_guard<py::gil_scoped_release>())
      .def("add_slab", &HostArena::add_slab, py::arg("nbytes"), py::call_guard<py::gil_scoped_release>())
      .def("empty", &HostArena::empty, py::arg("sizes"), py::arg("dtype"),
           "A CPU tensor in the arena, or (None, reason) when exhausted.")
      .def("stats", &HostArena::stats)
      .def("close", &HostArena::close)
      .def_property_readonly("closed", &HostArena::closed);
  m.def("host_bytes_reserved", [] { return g_reserved.load(); },
        "Bytes currently held in slabs by all host arenas of this process.");
  m.def("pinned_bytes", [] { return g_pinned.load(); },
        "Page-locked bytes currently held by all host arenas of this process.");
  m.def("mapped_device_view", &mapped_device_view, py::arg("host"), py::arg("device_index"),
        "A CUDA tensor on device_index aliasing the pinned host tensor `host` through its device mapping: kernels "
        "read and write host memory over PCIe, nothing is allocated on the device; the view keeps `host` alive.");
}

}  // namespace trainstream
