// C ABI: dense batches and paged-KV compaction, over kvpolicy/batch.hpp and kvpolicy/paged.hpp.
#include <algorithm>
#include <limits>
#include <vector>

#include "c/c_internal.hpp"
#include "kvpolicy/batch.hpp"
#include "kvpolicy/paged.hpp"

using namespace kvpolicy;
using namespace kvpolicy::capi;

namespace kvpolicy::capi {
void check_selection_out(const kvp_selection& out, std::int64_t L, std::int64_t H,
                         std::int64_t T, const char* what);
void write_selection(const Selection& sel, kvp_selection& out);
}  // namespace kvpolicy::capi

namespace {
// One budget per sequence when any sequence has its own (the others get `fallback`); empty when
// none has, meaning `fallback` for all (what the batch API takes).
template <class Seq>
std::vector<Budget> sequence_budgets(const Seq* seqs, std::size_t n, const Budget& fallback) {
  std::vector<Budget> out;
  if (std::none_of(seqs, seqs + n, [](const Seq& s) { return s.budget != nullptr; })) return out;
  for (std::size_t i = 0; i < n; ++i) {
    const std::string what = "seqs[" + std::to_string(i) + "].budget";
    out.push_back(seqs[i].budget ? budget_from(*seqs[i].budget, what.c_str()) : fallback);
  }
  return out;
}
}  // namespace

extern "C" kvp_status kvp_compress_batch(const kvp_policy* policy, const kvp_compress_params* params,
                                         const kvp_sequence* seqs, size_t num_seqs,
                                         kvp_selection* out) {
  return guard([&] {
    KVP_C_NONNULL(policy, "policy");
    KVP_REQUIRE(num_seqs == 0 || seqs, "seqs is NULL but num_seqs is ", num_seqs);
    kvp_compress_params storage;
    const kvp_compress_params& prm = params_or_default(params, storage);
    require_no_shard(prm, "kvp_compress_batch");
    require_no_event_inputs(prm, "kvp_compress_batch");
    KVP_REQUIRE(out || prm.compact, "out is NULL and params.compact is 0: nothing to do");
    const Policy& p = policy->policy;
    require_policy_stages_dense(p, "kvp_compress_batch");
    if (num_seqs == 0) return;
    const Budget budget = budget_from(prm.budget, "params.budget");
    const std::vector<Budget> budgets = sequence_budgets(seqs, num_seqs, budget);
    dispatch(seqs[0].keys.dtype, "seqs[0].keys", [&](auto tag) {
      using T = decltype(tag);
      std::vector<DenseSequence<T>> dense(num_seqs);
      std::vector<std::string> names;
      for (std::size_t i = 0; i < num_seqs; ++i) {
        const std::string s = "seqs[" + std::to_string(i) + "]";
        dense[i].keys = view_of<T>(seqs[i].keys, (s + ".keys").c_str());
        if (seqs[i].values.data) dense[i].values = view_of<T>(seqs[i].values, (s + ".values").c_str());
        KVP_REQUIRE(!prm.compact || dense[i].values.data, s,
                    ".values is absent but params.compact is set");
        if (seqs[i].queries.data)
          dense[i].queries = view_of<const T>(seqs[i].queries, (s + ".queries").c_str());
        if (out)
          check_selection_out(out[i], dense[i].keys.layers, dense[i].keys.heads,
                              dense[i].keys.tokens, ("out[" + std::to_string(i) + "]").c_str());
      }
      const cpu_backend be{prm.threads};
      std::vector<Selection> sels;
      if (prm.compact) {
        sels = compress_batch<T>(p, be, dense, budget, budgets);
      } else {
        // Selection only: the batch API compacts, so select per sequence (inputs unchanged).
        for (std::size_t i = 0; i < num_seqs; ++i) {
          Inputs<T> in;
          in.keys = dense[i].keys;
          in.values = dense[i].values;
          in.queries = dense[i].queries;
          detail::require_finite_inputs(in);
        }
        for (std::size_t i = 0; i < num_seqs; ++i) {
          Inputs<T> in;
          in.keys = dense[i].keys;
          in.values = dense[i].values;
          in.queries = dense[i].queries;
          sels.push_back(p.select(be, in, budgets.empty() ? budget : budgets[i]));
        }
      }
      if (out)
        for (std::size_t i = 0; i < num_seqs; ++i) write_selection(sels[i], out[i]);
    });
  });
}

extern "C" kvp_paged_tensor kvp_paged_tensor_make(kvp_layout layout, void* data, kvp_dtype dtype,
                                                  int64_t num_blocks, int64_t layers,
                                                  int64_t heads, int64_t page_size,
                                                  int64_t dim) {
  kvp_paged_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.num_blocks = num_blocks, t.layers = layers, t.heads = heads;
  t.page_size = page_size, t.dim = dim;
  t.stride_layer = num_blocks * page_size * heads * dim;
  t.stride_block = page_size * heads * dim;
  t.stride_dim = 1;
  if (raw_enum(layout) == KVP_LAYOUT_HND) {
    t.stride_head = page_size * dim;
    t.stride_token = dim;
  } else {
    t.stride_token = heads * dim;
    t.stride_head = dim;
  }
  return t;
}

namespace {

template <class T>
PagedKVView<T> paged_view_of(const kvp_paged_tensor& t, const char* what) {
  KVP_REQUIRE(dtype_from(t.dtype, what) == dtype_of<T>, what, " has dtype ",
              dtype_name(dtype_from(t.dtype, what)), " but the keys are ",
              dtype_name(dtype_of<T>));
  PagedKVView<T> v;
  v.data = static_cast<T*>(t.data);
  v.num_blocks = t.num_blocks;
  v.layers = t.layers, v.heads = t.heads, v.page_size = t.page_size, v.dim = t.dim;
  v.stride_layer = t.stride_layer, v.stride_block = t.stride_block;
  v.stride_head = t.stride_head, v.stride_token = t.stride_token, v.stride_dim = t.stride_dim;
  validate(v, what);
  return v;
}

}  // namespace

extern "C" kvp_status kvp_compress_paged(const kvp_policy* policy, const kvp_compress_params* params,
                                         const kvp_paged_tensor* keys,
                                         const kvp_paged_tensor* values, const uint8_t* shared,
                                         const kvp_paged_sequence* seqs, size_t num_seqs,
                                         kvp_paged_result* results) {
  kvp_status status = KVP_OK;
  std::string shared_msg;
  const kvp_status s = guard([&] {
    KVP_C_NONNULL(policy, "policy");
    KVP_C_NONNULL(keys, "keys");
    KVP_C_NONNULL(values, "values");
    KVP_REQUIRE(num_seqs == 0 || seqs, "seqs is NULL but num_seqs is ", num_seqs);
    KVP_REQUIRE(num_seqs == 0 || results, "results is NULL but num_seqs is ", num_seqs);
    kvp_compress_params storage;
    const kvp_compress_params& prm = params_or_default(params, storage);
    require_no_shard(prm, "kvp_compress_paged");
    require_no_event_inputs(prm, "kvp_compress_paged");
    KVP_REQUIRE(prm.compact, "kvp_compress_paged always compacts: params.compact must be set");
    const Policy& p = policy->policy;
    require_policy_stages_dense(p, "kvp_compress_paged");
    if (num_seqs == 0) return;
    const Budget budget = budget_from(prm.budget, "params.budget");
    const std::vector<Budget> budgets = sequence_budgets(seqs, num_seqs, budget);
    dispatch(keys->dtype, "keys", [&](auto tag) {
      using T = decltype(tag);
      const PagedKVView<T> k = paged_view_of<T>(*keys, "keys");
      const PagedKVView<T> v = paged_view_of<T>(*values, "values");
      std::vector<PagedSequence> ps(num_seqs);
      std::vector<KVView<const T>> qs(num_seqs);
      bool any_q = false;
      for (std::size_t i = 0; i < num_seqs; ++i) {
        const std::string s = "seqs[" + std::to_string(i) + "]";
        KVP_REQUIRE(seqs[i].num_pages >= 0, s, ".num_pages is negative");
        KVP_REQUIRE(seqs[i].num_pages == 0 || seqs[i].block_table, s, ".block_table is NULL");
        ps[i].block_table = std::span<const std::int32_t>(
            seqs[i].block_table, static_cast<std::size_t>(seqs[i].num_pages));
        // validate(PagedSequence) checks the length with the table later; here it bounds the
        // page count below.
        KVP_REQUIRE(seqs[i].length >= 0 &&
                        seqs[i].length <= std::numeric_limits<std::int32_t>::max(),
                    s, ".length ", seqs[i].length, " is outside [0, 2^31 - 1]");
        ps[i].length = seqs[i].length;
        if (seqs[i].queries.data) {
          qs[i] = view_of<const T>(seqs[i].queries, (s + ".queries").c_str());
          any_q = true;
        }
        kvp_paged_result& r = results[i];
        const std::int64_t pages = k.page_size > 0 ? (seqs[i].length + k.page_size - 1) / k.page_size : 0;
        KVP_REQUIRE(r.freed_capacity >= 0, "results[", i, "].freed_capacity is negative");
        if (pages > 0 && (!r.freed_blocks || r.freed_capacity < pages))
          raise(KVP_ERROR_BUFFER_TOO_SMALL,
                "kvpolicy: results[" + std::to_string(i) + "].freed_blocks holds " +
                    std::to_string(r.freed_blocks ? r.freed_capacity : 0) +
                    " block ids but the request spans " + std::to_string(pages) + " pages");
      }
      const std::span<const std::uint8_t> sh =
          shared ? std::span<const std::uint8_t>(shared, static_cast<std::size_t>(k.num_blocks))
                 : std::span<const std::uint8_t>{};
      const cpu_backend be{prm.threads};
      std::vector<KVView<const T>> qspan;
      if (any_q) qspan = qs;
      auto res = compress_paged_batch<T>(p, be, k, v, ps, qspan, budget, budgets, sh);
      for (std::size_t i = 0; i < num_seqs; ++i) {
        const PagedCompactResult& c = res[i].compact;
        kvp_paged_result& r = results[i];
        r.compacted = c.compacted ? 1 : 0;
        r.new_length = c.compacted ? c.new_length : seqs[i].length;
        r.pages_used = c.compacted ? c.pages_used
                                   : (k.page_size > 0 ? (seqs[i].length + k.page_size - 1) / k.page_size : 0);
        r.num_freed = static_cast<std::int64_t>(c.freed_blocks.size());
        std::copy(c.freed_blocks.begin(), c.freed_blocks.end(), r.freed_blocks);
        if (r.lengths)
          std::copy(c.lengths.begin(), c.lengths.end(), r.lengths);
        if (!c.compacted) {
          status = KVP_ERROR_SHARED_BLOCK;
          // Appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on the
          // operator+ chains here.
          if (!shared_msg.empty()) shared_msg.append("; ");
          shared_msg.append("seqs[").append(std::to_string(i)).append("] would write shared block(s)");
          for (std::int32_t b : c.shared_conflicts) shared_msg.append(" ").append(std::to_string(b));
        }
      }
    });
  });
  if (s != KVP_OK) return s;
  if (status != KVP_OK)
    set_error("kvpolicy: kvp_compress_paged: " + shared_msg +
              "; those requests were left as they were, the others were compacted");
  return status;
}
