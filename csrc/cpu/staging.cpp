// Staging pool: CPU threads that copy pageable tensors into pinned buffers.
//
// One pageable->device copy is driver-staged by a single thread (6-12 GB/s on the reference host);
// splitting the pageable->pinned memcpy over several cores and overlapping it with the DMA of the
// previous buffer (trainstream_hf/engine/staging.py) keeps the PCIe link busy.
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include <torch/csrc/utils/pybind.h>

#include "../include/trainstream.h"
#include "../runtime/thread_pool.h"

namespace py = pybind11;

namespace trainstream {
namespace {

void check_pair(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu(), "StagingPool: dst and src must be CPU tensors");
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "StagingPool: dst and src must be contiguous");
  TORCH_CHECK(dst.scalar_type() == src.scalar_type(), "StagingPool: dtype mismatch, dst is ",
              dst.scalar_type(), ", src is ", src.scalar_type());
  TORCH_CHECK(dst.numel() == src.numel(), "StagingPool: dst has ", dst.numel(), " elements, src has ",
              src.numel());
}

class StagingPool {
 public:
  explicit StagingPool(int num_threads) : num_threads_(num_threads) {
    TORCH_CHECK(num_threads >= 1, "StagingPool: num_threads must be >= 1, got ", num_threads);
    pool_ = std::make_unique<ThreadPool>(num_threads);
    dispatcher_ = std::thread([this] { dispatch_loop(); });
  }
  ~StagingPool() { close(); }

  int num_threads() const { return num_threads_; }

  void copy_(const at::Tensor& dst, const at::Tensor& src) {
    check_pair(dst, src);
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(copy_mu_);
    run(dst, src);
  }

  int64_t copy_async(const at::Tensor& dst, const at::Tensor& src) {
    check_pair(dst, src);
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(!closing_, "StagingPool: pool is closed");
    const int64_t ticket = ++last_ticket_;
    queue_.push_back(Job{ticket, dst, src});
    cv_.notify_all();
    return ticket;
  }

  bool query(int64_t ticket) {
    std::lock_guard<std::mutex> lock(mu_);
    check_ticket(ticket);
    return ticket <= finished_;
  }

  void wait(int64_t ticket) {
    std::exception_ptr err;
    {
      py::gil_scoped_release nogil;
      std::unique_lock<std::mutex> lock(mu_);
      check_ticket(ticket);
      done_cv_.wait(lock, [&] { return ticket <= finished_; });
      auto it = errors_.find(ticket);
      if (it != errors_.end()) {
        err = it->second;
        errors_.erase(it);
      }
    }
    if (err) std::rethrow_exception(err);
  }

  void close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closing_) return;
      closing_ = true;
    }
    cv_.notify_all();
    if (dispatcher_.joinable()) {
      py::gil_scoped_release nogil;
      dispatcher_.join();
    }
  }

 private:
  struct Job {
    int64_t ticket;
    at::Tensor dst, src;
  };

  void check_ticket(int64_t ticket) const {
    TORCH_CHECK(ticket >= 1 && ticket <= last_ticket_, "StagingPool: unknown ticket ", ticket);
  }

  void run(const at::Tensor& dst, const at::Tensor& src) {
    const int64_t nbytes = src.numel() * static_cast<int64_t>(src.element_size());
    char* d = static_cast<char*>(dst.data_ptr());
    const char* s = static_cast<const char*>(src.data_ptr());
    constexpr int64_t kChunk = int64_t(1) << 20;  // >= 1 MiB per thread
    const int64_t chunks = (nbytes + kChunk - 1) / kChunk;
    pool_->parallel_for(chunks, 1, num_threads_, [&](int64_t b, int64_t e) {
      const int64_t lo = b * kChunk, hi = std::min(nbytes, e * kChunk);
      if (hi > lo) std::memcpy(d + lo, s + lo, static_cast<size_t>(hi - lo));
    });
  }

  void dispatch_loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return closing_ || !queue_.empty(); });
        if (queue_.empty()) return;  // closing and drained
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr err;
      try {
        std::lock_guard<std::mutex> lock(copy_mu_);
        run(job.dst, job.src);
      } catch (...) {
        err = std::current_exception();
      }
      {
        // Drop the tensor references without the GIL held is fine: they are plain at::Tensors.
        job.dst.reset();
        job.src.reset();
        std::lock_guard<std::mutex> lock(mu_);
        if (err) errors_[job.ticket] = err;
        finished_ = job.ticket;
      }
      done_cv_.notify_all();
    }
  }

  int num_threads_;
  std::unique_ptr<ThreadPool> pool_;
  std::thread dispatcher_;
  std::mutex mu_, copy_mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<Job> queue_;
  std::map<int64_t, std::exception_ptr> errors_;
  int64_t last_ticket_ = 0, finished_ = 0;
  bool closing_ = false;
};

}  // namespace

void init_staging(py::module_& m) {
  py::class_<StagingPool>(m, "StagingPool", "CPU threads copying pageable tensors into pinned buffers.")
      .def(py::init<int>(), py::arg("num_threads"))
      .def_property_readonly("num_threads", &StagingPool::num_threads)
      .def("copy_", &StagingPool::copy_, py::arg("dst"), py::arg("src"),
           "Copies src into dst with all threads; returns when done (GIL released).")
      .def("copy_async", &StagingPool::copy_async, py::arg("dst"), py::arg("src"),
           "Queues a copy (FIFO); returns a ticket for wait()/query(). The pool keeps both tensors alive.")
      .def("query", &StagingPool::query, py::arg("ticket"))
      .def("wait", &StagingPool::wait, py::arg("ticket"))
      .def("close", &StagingPool::close, "Finishes queued copies and stops the threads.");
}

}  // namespace trainstream
