// A small persistent pool of worker threads shared by the CPU kernels (AdamW) and the staging pool.
//
// Why not at::parallel_for: in a torch extension it expands ParallelOpenMP.h inline, which needs the
// extension itself compiled with -fopenmp and then links a second OpenMP runtime beside the one torch
// ships. A pool of our own avoids that and lets the staging pool run copies while compute threads work.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace trainstream {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }  // + the calling thread

  // Runs fn(begin, end) over [0, n) on up to `num_threads` threads (the caller among them): the range is cut
  // into up to kChunksPerThread contiguous chunks per thread, each of >= grain elements, which the threads
  // claim in order as they finish the previous one; returns when all chunks are done.
  // Re-entrant calls (from inside fn) run serially on the calling thread. The first exception thrown
  // by a chunk is rethrown on the caller.
  void parallel_for(int64_t n, int64_t grain, int num_threads,
                    const std::function<void(int64_t, int64_t)>& fn);

 private:
  static constexpr int kChunksPerThread = 4;
  void worker_loop(int index);
  void run_chunks(const std::function<void(int64_t, int64_t)>& fn, int64_t n, int chunks);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::mutex call_mutex_;  // one parallel_for at a time owns the workers
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0;
  int job_chunks_ = 0;
  int job_threads_ = 0;
  std::atomic<int64_t> next_{0};  // the next chunk to claim
  int64_t generation_ = 0;
  int pending_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
};

// Process-wide pool sized to std::thread::hardware_concurrency(); created on first use.
ThreadPool& global_pool();

// Threads the CPU kernels use by default: at::get_num_threads(), so torch.set_num_threads applies.
int default_num_threads();

}  // namespace trainstream
