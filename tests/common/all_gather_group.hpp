// Test helper: an in-memory all-gather among threads that stand for tensor-parallel ranks
// (kvpolicy::HeadShard::all_gather, kvp_head_shard.all_gather).
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

namespace kvtest {

// An all-gather among `ranks` threads. A call that waits more than 20 s for the others (a rank
// that skipped a collective: the bug this file exists to catch) fails instead of hanging.
class Group {
 public:
  explicit Group(int ranks) : ranks_(ranks), sends_(static_cast<std::size_t>(ranks)) {}

  struct Member {
    Group* group = nullptr;
    int rank = 0;
    std::int64_t calls = 0;
  };

  // The all_gather callback; `user` is the calling rank's Member.
  static int all_gather(void* user, const void* send, void* recv, std::size_t bytes) {
    auto& m = *static_cast<Member*>(user);
    Group& g = *m.group;
    ++m.calls;
    g.sends_[static_cast<std::size_t>(m.rank)] = {send, bytes};
    if (!g.arrive()) return 2;
    int rc = 0;
    for (int r = 0; r < g.ranks_; ++r) {
      const auto& [p, n] = g.sends_[static_cast<std::size_t>(r)];
      if (n != bytes) rc = 3;  // ranks disagree on the size: the library's bug
      else if (bytes > 0) std::memcpy(static_cast<char*>(recv) + static_cast<std::size_t>(r) * bytes, p, bytes);
    }
    if (!g.arrive()) return 2;  // the senders' buffers stay valid until every rank has copied
    return rc;
  }

 private:
  bool arrive() {
    std::unique_lock lock(mu_);
    const std::int64_t gen = generation_;
    if (++arrived_ == ranks_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return true;
    }
    return cv_.wait_for(lock, std::chrono::seconds(20), [&] { return generation_ != gen; });
  }

  int ranks_;
  std::vector<std::pair<const void*, std::size_t>> sends_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::int64_t generation_ = 0;
};

}  // namespace kvtest
