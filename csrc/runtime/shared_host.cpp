// Host memory shared by the processes of one host (peer="auto", trainstream_hf/engine/peer.py).
//
// A POSIX shared-memory segment (shm_open) mapped MAP_SHARED into each process and, where the arena is pinned,
// page-locked in each with cudaHostRegister: one physical copy of a frozen base's packed weights that every GPU of
// the host reads by DMA. CUDA IPC handles (cudaIpcGetMemHandle) cover device memory only; registered shared pages
// are how host memory is shared between CUDA processes.
//
// The creator reserves the pages up front (posix_fallocate): a /dev/shm too small for the segment is an error
// here, not a SIGBUS at the first write. The name is unlinked (shared_host_unlink) once every process has mapped
// the segment, so nothing is left in /dev/shm whatever happens next; the pages go when the last mapping does. A
// tensor's deleter unregisters and unmaps its mapping. Every error of shared_host_create removes the name it made;
// a creator killed before the unlink leaves it to the next run (remove_stale_segments in engine/peer.py).
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ops/from_blob.h>
#include <torch/csrc/utils/pybind.h>

#ifdef TRAINSTREAM_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "../include/trainstream.h"

namespace py = pybind11;

namespace trainstream {
namespace {

std::atomic<int64_t> g_shared_mapped{0};
std::atomic<int64_t> g_shared_pinned{0};

void check_name(const std::string& name) {
  TORCH_CHECK(name.size() >= 2 && name.size() < 250 && name[0] == '/' && name.find('/', 1) == std::string::npos,
              "shared host memory: the name must be '/' followed by up to 248 characters without '/', got '",
              name, "'");
}

std::string errno_text(const char* what, const std::string& name) {
  return std::string(what) + " '" + name + "': " + std::strerror(errno);
}

// Maps fd (nbytes long) and wraps the mapping as a uint8 CPU tensor; registers it with CUDA when pin is set.
at::Tensor map_segment(int fd, int64_t nbytes, bool pin, const std::string& name) {
  void* p = mmap(nullptr, static_cast<size_t>(nbytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_errno = errno;
  close(fd);
  errno = map_errno;
  TORCH_CHECK(p != MAP_FAILED, errno_text("shared host memory: mmap of", name));
  if (pin) {
#ifdef TRAINSTREAM_WITH_CUDA
    const cudaError_t err = cudaHostRegister(p, static_cast<size_t>(nbytes), cudaHostRegisterPortable);
    if (err != cudaSuccess) {
      munmap(p, static_cast<size_t>(nbytes));
      TORCH_CHECK(false, "shared host memory: cudaHostRegister of '", name, "' (", nbytes,
                  " bytes) failed: ", cudaGetErrorString(err));
    }
    g_shared_pinned += nbytes;
#else
    munmap(p, static_cast<size_t>(nbytes));
    TORCH_CHECK(false, "shared host memory: pinning needs a CUDA build (built without CUDA); use pin=False");
#endif
  }
  g_shared_mapped += nbytes;
  return at::from_blob(
      p, {nbytes},
      [nbytes, pin](void* ptr) {
#ifdef TRAINSTREAM_WITH_CUDA
        if (pin) {
          cudaHostUnregister(ptr);
          g_shared_pinned -= nbytes;
        }
#endif
        munmap(ptr, static_cast<size_t>(nbytes));
        g_shared_mapped -= nbytes;
      },
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

// A new segment of nbytes (the name must not exist), its pages reserved, mapped here.
at::Tensor shared_host_create(const std::string& name, int64_t nbytes, bool pin) {
  check_name(name);
  TORCH_CHECK(nbytes > 0, "shared host memory: nbytes must be > 0, got ", nbytes);
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, errno_text("shared host memory: shm_open (create) of", name));
  int rc = ftruncate(fd, static_cast<off_t>(nbytes));
  if (rc == 0) rc = posix_fallocate(fd, 0, static_cast<off_t>(nbytes));  // returns the error, not via errno
  else rc = errno;
  if (rc != 0) {
    close(fd);
    shm_unlink(name.c_str());
    TORCH_CHECK(false, "shared host memory: cannot reserve ", nbytes, " bytes for '", name, "' (",
                std::strerror(rc), "); /dev/shm is too small? (containers often mount 64 MiB: raise it, e.g. "
                "docker run --shm-size, or set peer=False)");
  }
  try {
    return map_segment(fd, nbytes, pin, name);
  } catch (...) {
    shm_unlink(name.c_str());
    throw;
  }
}

// An existing segment, which must be exactly nbytes long, mapped here.
at::Tensor shared_host_open(const std::string& name, int64_t nbytes, bool pin) {
  check_name(name);
  TORCH_CHECK(nbytes > 0, "shared host memory: nbytes must be > 0, got ", nbytes);
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, errno_text("shared host memory: shm_open of", name));
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size != nbytes) {
    const int64_t size = st.st_size;
    close(fd);
    TORCH_CHECK(false, "shared host memory: '", name, "' holds ", size, " bytes, expected ", nbytes);
  }
  return map_segment(fd, nbytes, pin, name);
}

// Removes the name (mappings stay valid). False when it did not exist.
bool shared_host_unlink(const std::string& name) {
  check_name(name);
  return shm_unlink(name.c_str()) == 0;
}

}  // namespace

void init_shared_host(py::module_& m) {
  m.def("shared_host_create", &shared_host_create, py::arg("name"), py::arg("nbytes"), py::arg("pin"),
        py::call_guard<py::gil_scoped_release>(),
        "A new POSIX shared-memory segment of nbytes (pages reserved), mapped as a uint8 CPU tensor; "
        "page-locked with cudaHostRegister when pin.");
  m.def("shared_host_open", &shared_host_open, py::arg("name"), py::arg("nbytes"), py::arg("pin"),
        py::call_guard<py::gil_scoped_release>(),
        "An existing segment of exactly nbytes, mapped as a uint8 CPU tensor (registered with CUDA when pin).");
  m.def("shared_host_unlink", &shared_host_unlink, py::arg("name"),
        "Removes a segment's name; existing mappings stay valid. False when the name did not exist.");
  m.def("shared_host_bytes", [] { return g_shared_mapped.load(); },
        "Bytes of shared host memory mapped in this process.");
  m.def("shared_host_pinned_bytes", [] { return g_shared_pinned.load(); },
        "Bytes of shared host memory registered with CUDA in this process.");
}

}  // namespace trainstream
