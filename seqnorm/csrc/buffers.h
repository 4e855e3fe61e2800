// The memory of a recurrence's large tensors — what a training step saves for its backward (W_hh h, the gates, the
// cell states, the input projection) and the input projection of a forward without a gradient — kept between calls
// and handed out again rather than returned to the system.
//
// A block of more than 32 MB never comes back from glibc's heap: it is mapped fresh at every allocation and unmapped
// at every free, so each call pays the page faults of all its saved tensors again (an LSTM at 100x64x256x512 saves
// three 52 MB blocks); kept here, they cost those faults once (docs/performance.md, "Kept memory"). This is what
// torch's CUDA caching allocator does on a GPU, for these tensors alone: a block comes back here when the last tensor
// on it dies (autograd frees the saved tensors after the backward), and the next call of a similar size takes it.
// What is kept is at most a limit (set by the Python loader: SEQNORM_KERNEL_CACHE_MB, default 1024 MiB, or
// seqnorm.kernels.set_cache_limit; 0 keeps nothing), the least recently returned let go first;
// seqnorm.kernels.empty_cache() lets go of it all.
//
// Kept memory does not raise the peak: it only stands in for memory a call would allocate anyway. A request no kept
// block serves (a new shape: another batch size or length) lets go of every kept block before it allocates, rather
// than allocating beside them (which raised the peak of a loop whose batch shape varies: docs/performance.md), and a
// block larger than its request gives back the pages beyond it (madvise), which the next larger request faults in
// again.
//
// A tensor made here reports its block's whole size as its storage's size (what a memory count of the saved tensors
// sees), and its storage cannot be resized: only the kernels' own saved tensors come from here, never a result.
#pragma once

#include <torch/extension.h>

#include <c10/core/impl/alloc_cpu.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "process_mutex.h"

namespace seqnorm {

class BufferCache {
 public:
  static constexpr size_t kMinBytes = size_t(1) << 20;  // smaller blocks come back from the heap by themselves
  static constexpr size_t kGrain = size_t(1) << 16;     // block sizes are rounded up to this

  // The one cache of the process; never destroyed (tensors may die after static destructors have run).
  static BufferCache& instance() {
    static BufferCache* cache = new BufferCache();
    return *cache;
  }

  // An uninitialized tensor of `sizes`, contiguous, on a kept block where one fits (at most a quarter larger).
  at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    const size_t bytes = size_t(c10::multiply_integers(sizes)) * options.dtype().itemsize();
    if (!options.device().is_cpu() || bytes < kMinBytes) return at::empty(sizes, options);
    const size_t wanted = (bytes + kGrain - 1) / kGrain * kGrain;
    void* data = nullptr;
    size_t capacity = wanted;
    {
      std::lock_guard<ProcessMutex> lock(mutex_);
      const auto found = blocks_.lower_bound(wanted);
      if (found != blocks_.end() && found->first <= wanted + wanted / 4) {
        data = found->second.data;
        capacity = found->first;
        kept_bytes_ -= capacity;
        blocks_.erase(found);
        ++hits_;
      } else {
        // No kept block serves it, and none can (the smallest large enough is too large): the kept blocks go before
        // the new one is made, as the memory of a process without them would have gone.
        evict(0);
        ++misses_;
      }
    }
    if (data == nullptr) {
      data = c10::alloc_cpu(capacity);
    } else if (capacity > wanted) {
      release_tail(data, wanted, capacity);
    }
    c10::Storage storage(c10::Storage::use_byte_size_t(), capacity,
                         at::DataPtr(data, new Block{data, capacity, 0}, &BufferCache::give_back, at::Device(at::kCPU)),
                         /*allocator=*/nullptr, /*resizable=*/false);
    return at::empty({0}, options).set_(storage, 0, sizes);
  }

  // Lets go of every kept block.
  void clear() {
    std::lock_guard<ProcessMutex> lock(mutex_);
    evict(0);
  }

  void set_limit(int64_t bytes) {
    if (bytes < 0) {  // it was taken as 0, silently
      throw std::invalid_argument("set_cache_limit: expected a number of bytes >= 0, got " + std::to_string(bytes));
    }
    std::lock_guard<ProcessMutex> lock(mutex_);
    limit_ = size_t(bytes);
    evict(limit_);
  }

  // (bytes kept, limit, blocks handed out again, blocks made)
  std::tuple<int64_t, int64_t, int64_t, int64_t> info() {
    std::lock_guard<ProcessMutex> lock(mutex_);
    return {int64_t(kept_bytes_), int64_t(limit_), int64_t(hits_), int64_t(misses_)};
  }

  // For the tests: holds the cache's lock for `seconds` (from another thread, while the test forks).
  void hold_lock(double seconds) {
    std::lock_guard<ProcessMutex> lock(mutex_);
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  }

  // For the tests: whether some thread holds the cache's lock now.
  bool lock_held() {
    if (!mutex_.try_lock()) return true;
    mutex_.unlock();
    return false;
  }

 private:
  struct Block {
    void* data;
    size_t bytes;
    uint64_t returned;  // when it came back (the cache's clock), for letting go of the oldest first
  };

  BufferCache() = default;

  static void give_back(void* context) {
    Block* block = static_cast<Block*>(context);
    instance().put(*block);
    delete block;
  }

  // The whole pages of a reused block beyond its request go back to the system (the block's tensor never touches
  // them; a later, larger request faults them in again, zeroed): what is resident is what a fresh block would be.
  static void release_tail(void* data, size_t wanted, size_t capacity) {
#if defined(__linux__)
    static const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
    const uintptr_t first = (uintptr_t(data) + wanted + page - 1) / page * page;
    const uintptr_t end = (uintptr_t(data) + capacity) / page * page;
    if (first < end) madvise(reinterpret_cast<void*>(first), end - first, MADV_DONTNEED);
#else
    (void)data, (void)wanted, (void)capacity;
#endif
  }

  void put(Block block) {
    std::lock_guard<ProcessMutex> lock(mutex_);
    if (block.bytes > limit_) {
      c10::free_cpu(block.data);
      return;
    }
    evict(limit_ - block.bytes);
    block.returned = ++clock_;
    blocks_.emplace(block.bytes, block);
    kept_bytes_ += block.bytes;
  }

  // Frees the least recently returned blocks until at most `room` bytes are kept (the lock held).
  void evict(size_t room) {
    while (kept_bytes_ > room) {
      auto oldest = blocks_.begin();
      for (auto it = blocks_.begin(); it != blocks_.end(); ++it) {
        if (it->second.returned < oldest->second.returned) oldest = it;
      }
      c10::free_cpu(oldest->second.data);
      kept_bytes_ -= oldest->first;
      blocks_.erase(oldest);
    }
  }

  ProcessMutex mutex_;  // never held with another ProcessMutex (process_mutex.h)
  std::multimap<size_t, Block> blocks_;  // kept, by size
  size_t kept_bytes_ = 0, limit_ = 0;  // nothing kept until the loader sets the limit (seqnorm/kernels)
  uint64_t clock_ = 0, hits_ = 0, misses_ = 0;
};

// A tensor for one of a recurrence's large tensors (BufferCache).
inline at::Tensor saved_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return BufferCache::instance().empty(sizes, options);
}

}  // namespace seqnorm
