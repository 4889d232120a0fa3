#include "thread_pool.h"

#include <algorithm>
#include <exception>

#include <ATen/Parallel.h>

namespace trainstream {

namespace {
thread_local bool in_pool_job = false;
}

ThreadPool::ThreadPool(int num_threads) {
  const int extra = std::max(0, num_threads - 1);
  workers_.reserve(extra);
  for (int i = 0; i < extra; ++i) workers_.emplace_back([this, i] { worker_loop(i + 1); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop(int index) {
  int64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t)>* job;
    int64_t n;
    int chunks, threads;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      n = job_n_;
      chunks = job_chunks_;
      threads = job_threads_;
    }
    if (index < threads) {
      in_pool_job = true;
      try {
        run_chunks(*job, n, chunks);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
        next_.store(chunks);  // the others stop claiming: the call fails anyway
      }
      in_pool_job = false;
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_.notify_all();
    }
  }
}

void ThreadPool::run_chunks(const std::function<void(int64_t, int64_t)>& fn, int64_t n, int chunks) {
  for (int64_t c = next_.fetch_add(1); c < chunks; c = next_.fetch_add(1)) fn(n * c / chunks, n * (c + 1) / chunks);
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, int num_threads,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t pieces = (n + grain - 1) / grain;
  const int threads = static_cast<int>(std::min<int64_t>({pieces, static_cast<int64_t>(std::max(num_threads, 1)),
                                                          static_cast<int64_t>(size())}));
  if (threads <= 1 || in_pool_job) {
    fn(0, n);
    return;
  }
  // kChunksPerThread chunks per thread, claimed first come first served: a thread that shares its core with
  // another busy thread (the Python thread launching backward's kernels while the AdamW runs) takes fewer, instead
  // of holding every other thread up at the end of the call.
  const int chunks = static_cast<int>(std::min<int64_t>(pieces, static_cast<int64_t>(threads) * kChunksPerThread));
  std::lock_guard<std::mutex> call_lock(call_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    job_n_ = n;
    job_chunks_ = chunks;
    job_threads_ = threads;
    next_.store(0);
    pending_ = threads - 1;
    error_ = nullptr;
    ++generation_;
  }
  wake_.notify_all();
  std::exception_ptr mine;
  in_pool_job = true;
  try {
    run_chunks(fn, n, chunks);
  } catch (...) {
    mine = std::current_exception();
    next_.store(chunks);
  }
  in_pool_job = false;
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
  if (mine) std::rethrow_exception(mine);
  if (error_) std::rethrow_exception(error_);
}

ThreadPool& global_pool() {
  static ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  return pool;
}

int default_num_threads() { return std::max(1, at::get_num_threads()); }

}  // namespace trainstream
