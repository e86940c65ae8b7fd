// Tensor parallelism over KV heads. Engines that outgrow one GPU shard each layer's KV heads
// across ranks (vLLM, SGLang, TensorRT-LLM): rank r holds heads [first_head, first_head + H_r)
// of the model's `model_heads`, with their query groups. Each rank runs the policy on its own
// heads (EventInfo::shard). Most stages work per head and need nothing from other ranks; the
// stages that compare or combine heads (Policy::spans_heads(): adakv, tova, expected) exchange
// a few numbers through the one collective the engine provides, an all-gather, which it
// implements with its own communicator (NCCL, MPI, torch.distributed). kvpolicy ships no
// communication layer. With the hook every rank keeps exactly the tokens a single-rank run over
// all heads keeps for its heads (tests/core/test_head_shard.cpp checks this for every chain).
//
// What crosses ranks, per compression event (R ranks, L layers in the event, T tokens):
// - every chain: nothing, unless a stage spans heads. A total budget (Budget::total) is split
//   over the model's rows exactly as a single rank would split it (first_head, model_heads).
// - a chain that spans heads first gathers one 256-byte record per rank (its layers, heads,
//   tokens, whether it evicts and any error of its local checks), so that an error on one rank
//   is raised on every rank instead of leaving the others blocked in the next collective; with
//   an allocator that spans heads, a second record after scoring does the same for the
//   scorer's own checks.
// - adakv, per layer: 16 bytes (its free budget and pool size), then, unless the layer keeps its
//   whole pool or nothing more, two 32 KiB histograms of 4096 int64 counts and the entries that
//   tie at the histograms' edge (8 bytes for their count, then 16 bytes per entry of the largest rank's
//   share, usually a handful).
// - tova: the window attention of every head of every layer, 4 T bytes per head and layer
//   (its score is the mean over all heads), padded to the largest rank's heads, after an
//   8-byte count.
// - expected: the largest score of each layer, 4 bytes per layer (its sinks' score).
// Every all-gather sends the same byte count from every rank. Sums are taken in rank order from
// the gathered values, so the result is bit for bit the single-rank one.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kvpolicy/core/error.hpp"

namespace kvpolicy {

struct HeadShard {
  std::int64_t rank = 0;         // this rank, in [0, ranks)
  std::int64_t ranks = 1;        // ranks sharing the model's KV heads
  std::int64_t first_head = 0;   // model index of this rank's first KV head
  std::int64_t model_heads = 0;  // KV heads of the model over all ranks (0: this rank's own)
  // all_gather(user, send, recv, bytes): every rank calls it with the same `bytes`; recv
  // (ranks * bytes) receives rank r's `send` at offset r * bytes. Blocking: when it returns,
  // recv is filled. Returns 0, or nonzero on failure (raised as kvpolicy::Error). Ranks must
  // hold ascending, contiguous head ranges (rank r + 1 starts where rank r ends). Null is
  // allowed for chains that exchange nothing (see Policy::spans_heads()).
  int (*all_gather)(void* user, const void* send, void* recv, std::size_t bytes) = nullptr;
  void* user = nullptr;
};

namespace detail {

// The shard an event runs on: null or one rank means a single-rank run.
inline bool sharded(const HeadShard* s) { return s && s->ranks > 1; }

// Model heads and this rank's first head for an event of `heads` local KV heads.
inline std::int64_t model_heads(const HeadShard* s, std::int64_t heads) {
  return s && s->model_heads > 0 ? s->model_heads : heads;
}
inline std::int64_t first_head(const HeadShard* s) { return s ? s->first_head : 0; }

// Local checks of a shard for an event of `heads` KV heads.
inline void check_shard(const HeadShard& s, std::int64_t heads) {
  constexpr std::int64_t kMostHeads = 65536;  // keeps row counts and budgets far from overflow
  KVP_REQUIRE(s.model_heads <= kMostHeads && s.ranks <= kMostHeads, "head shard: model_heads ",
              s.model_heads, " and ranks ", s.ranks, " must be at most ", kMostHeads);
  KVP_REQUIRE(s.ranks >= 1 && s.rank >= 0 && s.rank < s.ranks, "head shard: rank ", s.rank,
              " is outside [0, ", s.ranks, ")");
  KVP_REQUIRE(s.first_head >= 0 && s.model_heads >= 0 &&
                  (s.model_heads == 0 || s.first_head + heads <= s.model_heads),
              "head shard: heads [", s.first_head, ", ", s.first_head + heads,
              ") of rank ", s.rank, " do not fit the model's ", s.model_heads, " KV heads");
  KVP_REQUIRE(s.ranks == 1 || s.model_heads > 0, "head shard: model_heads must be given when ",
              s.ranks, " ranks share the heads");
  KVP_REQUIRE(s.ranks > 1 || (s.first_head == 0 && (s.model_heads == 0 || s.model_heads == heads)),
              "head shard: a single rank holds every KV head (first_head 0, model_heads 0 or ",
              heads, "), got first_head ", s.first_head, " and model_heads ", s.model_heads);
}

// A chain that combines heads across ranks needs the engine's all-gather.
inline void require_all_gather(const HeadShard& s) {
  KVP_REQUIRE(s.ranks == 1 || s.all_gather,
              "head shard: this policy combines KV heads across ranks and needs "
              "HeadShard::all_gather (the engine's all-gather), which is null");
}

// Every rank's `mine` (the same count on every rank), concatenated in rank order.
template <class T>
std::vector<T> all_gather(const HeadShard& s, std::span<const T> mine) {
  static_assert(std::is_trivially_copyable_v<T>);
  std::vector<T> out(mine.size() * static_cast<std::size_t>(s.ranks));
  if (s.ranks == 1) {
    std::copy(mine.begin(), mine.end(), out.begin());
    return out;
  }
  const int rc = s.all_gather(s.user, mine.data(), out.data(), mine.size_bytes());
  KVP_REQUIRE(rc == 0, "head shard: the engine's all_gather failed on rank ", s.rank,
              " (returned ", rc, ")");
  return out;
}

// Every rank's `mine` (counts may differ), concatenated in rank order: the counts first, then
// the entries padded to the largest count. `counts`, if given, receives each rank's count.
template <class T>
std::vector<T> all_gather_v(const HeadShard& s, std::span<const T> mine,
                            std::vector<std::int64_t>* counts_out = nullptr) {
  const auto n = static_cast<std::int64_t>(mine.size());
  if (s.ranks == 1) {
    if (counts_out) counts_out->assign(1, n);
    return std::vector<T>(mine.begin(), mine.end());
  }
  const std::vector<std::int64_t> counts = all_gather(s, std::span<const std::int64_t>(&n, 1));
  if (counts_out) *counts_out = counts;
  const std::int64_t most = *std::max_element(counts.begin(), counts.end());
  std::vector<T> padded(static_cast<std::size_t>(most));
  std::copy(mine.begin(), mine.end(), padded.begin());
  const std::vector<T> all = all_gather(s, std::span<const T>(padded));
  std::vector<T> out;
  for (std::int64_t r = 0; r < s.ranks; ++r)
    out.insert(out.end(), all.begin() + r * most, all.begin() + r * most + counts[static_cast<std::size_t>(r)]);
  return out;
}

// Sums over ranks, element by element in rank order (the same bits on every rank). `v` is
// replaced by the sums.
template <class T>
void all_sum(const HeadShard* s, std::span<T> v) {
  if (!sharded(s)) return;
  const std::vector<T> all = all_gather(*s, std::span<const T>(v));
  std::fill(v.begin(), v.end(), T{});
  for (std::int64_t r = 0; r < s->ranks; ++r)
    for (std::size_t i = 0; i < v.size(); ++i) v[i] += all[static_cast<std::size_t>(r) * v.size() + i];
}

// The event's agreement step for chains that exchange data: every rank reports whether its
// local checks passed (`error` empty) with its layers, heads and tokens; if any rank failed,
// every rank throws (the failing rank its own message, the others naming it), and the head
// ranges must tile [0, model_heads) in rank order with equal layer and token counts and one
// model_heads. Returns whether any rank evicts. An engine whose own checks fail on one rank
// before it calls the policy can report that through agree() too: the other ranks' events then
// fail with its message.
inline bool agree(const HeadShard& s, const std::string& error, std::int64_t layers,
                  std::int64_t heads, std::int64_t tokens, bool evicts) {
  struct Record {
    std::int64_t failed, heads, first_head, tokens, evicts, layers, model_heads, pad;
    char message[192];
  };
  static_assert(sizeof(Record) == 256);
  Record mine{};
  mine.failed = error.empty() ? 0 : 1;
  mine.heads = heads;
  mine.first_head = s.first_head;
  mine.tokens = tokens;
  mine.evicts = evicts ? 1 : 0;
  mine.layers = layers;
  mine.model_heads = s.model_heads;
  std::memcpy(mine.message, error.data(), std::min(error.size(), sizeof mine.message - 1));
  const std::vector<Record> all = all_gather(s, std::span<const Record>(&mine, 1));
  if (!error.empty()) throw Error(error);
  for (std::int64_t r = 0; r < s.ranks; ++r) {  // a failure first, whichever rank it was
    const Record& o = all[static_cast<std::size_t>(r)];
    KVP_REQUIRE(!o.failed, "head shard: rank ", r, " failed its checks: ",
                std::string(o.message, std::find(o.message, o.message + sizeof o.message, '\0')));
  }
  bool any = false;
  std::int64_t next = 0;
  for (std::int64_t r = 0; r < s.ranks; ++r) {
    const Record& o = all[static_cast<std::size_t>(r)];
    KVP_REQUIRE(o.model_heads == s.model_heads, "head shard: rank ", r, " has model_heads ",
                o.model_heads, ", rank ", s.rank, " has ", s.model_heads);
    KVP_REQUIRE(o.layers == layers, "head shard: rank ", r, " has ", o.layers,
                " layers, rank ", s.rank, " has ", layers);
    KVP_REQUIRE(o.first_head == next, "head shard: rank ", r, " holds heads from ", o.first_head,
                " but the ranks before it end at ", next,
                " (ranks must hold ascending, contiguous head ranges)");
    KVP_REQUIRE(o.tokens == tokens, "head shard: rank ", r, " has ", o.tokens,
                " tokens, rank ", s.rank, " has ", tokens);
    next += o.heads;
    any = any || o.evicts;
  }
  KVP_REQUIRE(next == s.model_heads, "head shard: the ranks hold ", next,
              " KV heads, model_heads is ", s.model_heads);
  return any;
}

}  // namespace detail
}  // namespace kvpolicy
