// Compress the requests of a paged KV cache in place and give their emptied pages back to the
// engine's block manager. Usage: paged_compact ["policy spec"] (default "snapkv | adakv").
#include <kvpolicy/kvpolicy.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace kvp = kvpolicy;

// The engine's side: a pool of fixed-size pages and a free list. Block ids never change; a
// request's block table grows at the end while it decodes and is truncated by compaction.
struct BlockManager {
  std::vector<std::int32_t> free;
  explicit BlockManager(std::int32_t blocks) {
    for (std::int32_t b = blocks; b-- > 0;) free.push_back(b);
  }
  std::int32_t take() {
    const std::int32_t b = free.back();
    free.pop_back();
    return b;
  }
  void give_back(const std::vector<std::int32_t>& ids) {
    free.insert(free.end(), ids.begin(), ids.end());
  }
};

struct Request {
  std::int64_t length = 0;
  std::vector<std::int32_t> table;
  std::vector<float> queries;  // its last `window` queries, [layer][q_head][window][dim]
  kvp::PagedSequence seq() const { return {table, length}; }
};

int run(const kvp::Policy& policy) {
  const std::int64_t layers = 2, kv_heads = 2, q_heads = 6, dim = 64, window = 64;
  const std::int64_t page = 16, blocks = 128;
  std::vector<float> k(layers * blocks * page * kv_heads * dim), v(k.size());
  const auto keys = kvp::PagedKVView<float>::nhd(k.data(), blocks, layers, kv_heads, page, dim);
  const auto values = kvp::PagedKVView<float>::nhd(v.data(), blocks, layers, kv_heads, page, dim);
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  for (auto* buf : {&k, &v})
    for (float& x : *buf) x = normal(rng);

  // Three requests that grew side by side, so their pages interleave in the pool.
  BlockManager manager(blocks);
  std::vector<Request> reqs(3);
  reqs[0].length = 300, reqs[1].length = 517, reqs[2].length = 190;
  for (std::int64_t p = 0; p * page < 517; ++p)
    for (Request& r : reqs)
      if (p * page < r.length) r.table.push_back(manager.take());
  std::vector<kvp::PagedSequence> seqs;
  std::vector<kvp::KVView<const float>> queries;
  for (Request& r : reqs) {
    r.queries.resize(layers * q_heads * window * dim);
    for (float& x : r.queries) x = normal(rng);
    seqs.push_back(r.seq());
    queries.push_back(kvp::KVView<const float>::hnd(r.queries.data(), layers, q_heads, window, dim));
  }

  // Keep a dense copy of each request to check the result against.
  std::vector<std::vector<float>> before;
  for (const Request& r : reqs) {
    before.emplace_back(layers * kv_heads * r.length * dim);
    kvp::paged_gather(kvp::cpu_backend{}, keys, r.seq(),
                      kvp::KVView<float>::hnd(before.back().data(), layers, kv_heads, r.length, dim));
  }

  const std::size_t free_before = manager.free.size();
  const auto results = kvp::compress_paged_batch(policy, kvp::cpu_backend{}, keys, values, seqs,
                                                 queries, kvp::Budget::tokens(128));

  bool ok = true;
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    Request& r = reqs[i];
    const kvp::PagedCompactResult& c = results[i].compact;
    const std::int64_t old_length = r.length, old_pages = static_cast<std::int64_t>(r.table.size());
    // The engine's bookkeeping: truncate the table, free the rest, mask each head past lengths.
    manager.give_back(c.freed_blocks);
    r.table.resize(static_cast<std::size_t>(c.pages_used));
    r.length = c.new_length;
    const auto [lo, hi] = std::minmax_element(c.lengths.begin(), c.lengths.end());
    std::printf("request %zu: %lld tokens on %lld pages -> %lld tokens (per head %lld..%lld) on "
                "%lld pages, %zu freed\n",
                i, (long long)old_length, (long long)old_pages, (long long)r.length,
                (long long)*lo, (long long)*hi, (long long)c.pages_used, c.freed_blocks.size());

    // Row j of each (layer, head) must now hold the j-th kept token.
    std::vector<float> after(layers * kv_heads * r.length * dim);
    kvp::paged_gather(kvp::cpu_backend{}, keys, r.seq(),
                      kvp::KVView<float>::hnd(after.data(), layers, kv_heads, r.length, dim));
    for (std::int64_t l = 0; l < layers; ++l)
      for (std::int64_t h = 0; h < kv_heads; ++h) {
        const auto kept = results[i].selection.kept(l, h);
        for (std::size_t j = 0; j < kept.size(); ++j) {
          const float* now = &after[((l * kv_heads + h) * r.length + j) * dim];
          const float* was = &before[i][((l * kv_heads + h) * old_length + kept[j]) * dim];
          ok = ok && std::memcmp(now, was, dim * sizeof(float)) == 0;
        }
      }
  }
  std::printf("policy '%s': free blocks %zu -> %zu; kept tokens at the front: %s\n",
              policy.spec().c_str(), free_before, manager.free.size(), ok ? "yes" : "NO");
  return ok && manager.free.size() > free_before ? 0 : 1;
}

int main(int argc, char** argv) {
  try {
    return run(kvp::Policy(argc > 1 ? argv[1] : "snapkv | adakv"));
  } catch (const kvp::Error& e) {  // a bad spec, or a policy paged compaction cannot run
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
