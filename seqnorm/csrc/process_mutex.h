// A mutex of process-wide state (the kept memory, the product routes' trials) that a fork leaves usable.
//
// fork() copies only the thread that calls it: a mutex another thread held at that moment stays locked in the
// child, with no thread there to unlock it, and the child's first kernel call waited on it forever. Every
// ProcessMutex is locked before a fork (pthread_atfork's prepare, in the order they were made) and unlocked after it
// in the parent and in the child, so the child starts with every one free and the state consistent. They are never
// held one inside another, so that order cannot deadlock.
#pragma once

#include <mutex>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define SEQNORM_HAS_ATFORK 1
#endif

namespace seqnorm {

class ProcessMutex {
 public:
  // Never to be destroyed (the fork handlers keep its address): made with `new`, or a member of an object that is.
  ProcessMutex() { enroll(this); }
  ProcessMutex(const ProcessMutex&) = delete;
  ProcessMutex& operator=(const ProcessMutex&) = delete;

  void lock() { mutex_.lock(); }
  void unlock() { mutex_.unlock(); }
  bool try_lock() { return mutex_.try_lock(); }

 private:
  struct Registry {
    std::mutex mutex;  // held from a fork's prepare to its end, so no mutex enrolls meanwhile
    std::vector<ProcessMutex*> all;
  };

  static Registry& registry() {
    static Registry* registry = new Registry();  // never destroyed: a fork may come during exit
    return *registry;
  }

  static void enroll(ProcessMutex* mutex) {
    Registry& all = registry();
#ifdef SEQNORM_HAS_ATFORK
    static const int registered = pthread_atfork(&prepare, &after, &after);
    (void)registered;
#endif
    std::lock_guard<std::mutex> lock(all.mutex);
    all.all.push_back(mutex);
  }

  static void prepare() {
    Registry& all = registry();
    all.mutex.lock();
    for (ProcessMutex* mutex : all.all) mutex->mutex_.lock();
  }

  // In the parent and in the child alike: the forking thread took every lock in prepare, and in the child it is
  // that same thread (the only one), so it may unlock them.
  static void after() {
    Registry& all = registry();
    for (auto it = all.all.rbegin(); it != all.all.rend(); ++it) (*it)->mutex_.unlock();
    all.mutex.unlock();
  }

  std::mutex mutex_;
};

}  // namespace seqnorm
