// The C ABI (include/kvpolicy/c/kvpolicy.h): results equal the C++ API's, plug-in scorers act
// like built-ins, and every entry point answers bad input with a status and a message instead
// of crashing or writing (the sanitizer build runs these too).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/random_kv.hpp"
#include "c_api/c_util.hpp"
#include "kvpolicy/c/kvpolicy.h"
#include "kvpolicy/policy.hpp"
#include "kvpolicy/session.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_c_api_c_api {

using namespace kvpolicy;
using ctest::make;
using ctest::mentions;
using ctest::SelOut;

namespace {

struct Cache {
  std::int64_t L, H, T, D;
  std::vector<float> k, v;
  Cache(std::int64_t l, std::int64_t h, std::int64_t t, std::int64_t d, std::uint64_t seed)
      : L(l), H(h), T(t), D(d) {
    kvtest::Rng rng(seed);
    k = rng.normals(L * H * T * D);
    v = rng.normals(L * H * T * D);
  }
  kvp_tensor ck() { return kvp_tensor_hnd(k.data(), KVP_F32, L, H, T, D); }
  kvp_tensor cv() { return kvp_tensor_hnd(v.data(), KVP_F32, L, H, T, D); }
  KVView<float> vk() { return KVView<float>::hnd(k.data(), L, H, T, D); }
  KVView<float> vv() { return KVView<float>::hnd(v.data(), L, H, T, D); }
};


// A plug-in that scores like the built-in knorm (-||k||), counting its calls.
struct NormState {
  int scores = 0, resets = 0, clones = 0;
  int* frees = nullptr;
  bool fail = false, nan = false;
};
const char* norm_name(const void*) { return "myknorm"; }
int norm_score(void* st, const kvp_score_args* a) {
  auto* s = static_cast<NormState*>(st);
  ++s->scores;
  if (s->fail) {
    kvp_plugin_set_error("deliberate failure");
    return 7;
  }
  const kvp_tensor& k = a->keys;
  if (k.dtype != KVP_F32) return 1;
  const float* base = static_cast<const float*>(k.data);
  for (int64_t l = 0; l < k.layers; ++l)
    for (int64_t h = 0; h < k.heads; ++h)
      for (int64_t t = 0; t < k.tokens; ++t) {
        float sq = 0;
        for (int64_t i = 0; i < k.dim; ++i) {
          const float x = base[l * k.stride_layer + h * k.stride_head + t * k.stride_token +
                               i * k.stride_dim];
          sq += x * x;
        }
        a->scores[(l * k.heads + h) * k.tokens + t] = s->nan && t == 3 ? NAN : -std::sqrt(sq);
      }
  return 0;
}
void norm_reset(void* st) { ++static_cast<NormState*>(st)->resets; }
void* norm_clone(const void* st) {
  auto* c = new NormState(*static_cast<const NormState*>(st));
  c->clones++;
  return c;
}
void norm_free(void* st) {
  auto* s = static_cast<NormState*>(st);
  if (s->frees) ++*s->frees;
  delete s;
}
kvp_scorer_plugin norm_plugin(NormState* s) {
  kvp_scorer_plugin p = kvp_scorer_plugin_default();
  p.state = s;
  p.name = norm_name;
  p.score = norm_score;
  p.reset = norm_reset;
  p.clone = norm_clone;
  p.free = norm_free;
  return p;
}

}  // namespace

TEST_CASE("C ABI: version, status names and defaults", "[c_api]") {
  CHECK(std::string(kvp_version()) == "0.1.0");
  CHECK(kvp_abi_version() == KVP_ABI_VERSION);
  CHECK(std::string(kvp_status_string(KVP_ERROR_BAD_SPEC)) == "KVP_ERROR_BAD_SPEC");
  CHECK(std::string(kvp_status_string(KVP_ERROR_INTERNAL)) == "KVP_ERROR_INTERNAL");
  const kvp_compress_params p = kvp_compress_default_params();
  CHECK(p.struct_size == sizeof(kvp_compress_params));
  CHECK(p.budget.kind == KVP_BUDGET_RATIO);
  CHECK(p.budget.value == 0.5);
  CHECK(p.compact == 1);
  const kvp_tensor t = kvp_tensor_nhd(nullptr, KVP_F16, 2, 3, 5, 8);
  CHECK(t.stride_layer == 5 * 3 * 8);
  CHECK(t.stride_head == 8);
  CHECK(t.stride_token == 24);
}

TEST_CASE("C ABI: kvp_compress equals Policy::compress", "[c_api]") {
  const char* specs[] = {"snapkv(window=8)", "h2o", "streaming(sinks=2)", "knorm | adakv",
                         "snapkv(window=8) | pyramid | ams(window=8,sinks=2,keep_last=4)", "tova", "keydiff"};
  for (const char* spec : specs) {
    for (double ratio : {0.25, 0.6}) {
      INFO(spec << " at " << ratio);
      Cache c(2, 2, 40, 16, 11), ref = c;
      kvtest::Rng rng(5);
      std::vector<float> q = rng.normals(2 * 4 * 8 * 16);
      kvp_tensor cq = kvp_tensor_hnd(q.data(), KVP_F32, 2, 4, 8, 16);
      kvp_policy* p = make(spec);
      kvp_compress_params prm = kvp_compress_default_params();
      prm.budget = {KVP_BUDGET_RATIO, ratio};
      SelOut out(2, 2, 40);
      kvp_tensor ck = c.ck(), cv = c.cv();
      const kvp_status st = kvp_compress(p, &prm, &ck, &cv, &cq, nullptr, 0, &out.sel);
      INFO(kvp_last_error());
      REQUIRE(st == KVP_OK);
      CHECK(std::string(kvp_last_error()).empty());

      Policy cpp(spec);
      Inputs<float> in;
      in.queries = KVView<const float>::hnd(q.data(), 2, 4, 8, 16);
      const Selection sel = cpp.compress(cpu_backend{}, ref.vk(), ref.vv(), in,
                                         Budget::ratio(ratio));
      for (std::int64_t r = 0; r < 4; ++r) {
        auto want = sel.kept(r / 2, r % 2);
        CHECK(out.row(r) == std::vector<std::int32_t>(want.begin(), want.end()));
      }
      CHECK(c.k == ref.k);
      CHECK(c.v == ref.v);
      kvp_policy_destroy(p);
    }
  }
}

TEST_CASE("C ABI: per-event inputs (reconstruction scores, ams credit, RoPE frequencies) equal "
          "the C++ API's", "[c_api]") {
  constexpr std::int64_t L = 2, H = 2, T = 40, D = 16, S = T + 6;  // S: padded state rows
  kvtest::Rng rng(21);
  std::vector<float> q = rng.normals(L * 2 * H * 8 * D), rec(static_cast<std::size_t>(L * H * S));
  for (auto& x : rec) x = static_cast<float>(rng.uniform());
  std::vector<float> freqs(D / 2);
  for (std::int64_t i = 0; i < D / 2; ++i)
    freqs[static_cast<std::size_t>(i)] = std::pow(5000.f, -2.f * static_cast<float>(i) / D);
  kvp_tensor cq = kvp_tensor_hnd(q.data(), KVP_F32, L, 2 * H, 8, D);
  Inputs<float> in;
  in.queries = KVView<const float>::hnd(q.data(), L, 2 * H, 8, D);
  // C state and C++ state advance side by side over three events.
  std::vector<float> c_state(static_cast<std::size_t>(L * H * S), 0.f), cpp_state = c_state;
  for (int event = 0; event < 3; ++event)
    for (const char* spec : {"kvzip(sinks=2) | adakv", "expected(window=8)",
                             "knorm | ams(window=8,min_seg_len=4,sinks=2,keep_last=4)"}) {
      INFO(spec << ", event " << event);
      Cache c(L, H, T, D, 30 + static_cast<std::uint64_t>(event));
      kvp_policy* p = make(spec);
      kvp_compress_params prm = kvp_compress_default_params();
      prm.budget = {KVP_BUDGET_RATIO, 0.4};
      prm.compact = 0;
      prm.reconstruction = rec.data();
      prm.reconstruction_stride = S;
      prm.rope_inv_freq = freqs.data();
      prm.rope_pairs = D / 2;
      prm.alloc_state = c_state.data();
      prm.alloc_state_stride = S;
      SelOut out(L, H, T);
      kvp_tensor ck = c.ck(), cv = c.cv();
      REQUIRE(kvp_compress(p, &prm, &ck, &cv, &cq, nullptr, 0, &out.sel) == KVP_OK);
      Inputs<float> cin = in;
      cin.keys = c.vk();
      cin.values = c.vv();
      cin.reconstruction = rec.data();
      cin.state_stride = S;
      cin.rope_inv_freq = freqs;
      EventInfo ev;
      ev.alloc_state = cpp_state.data();
      ev.alloc_state_stride = S;
      const Selection sel = Policy(spec).select(cpu_backend{}, cin, Budget::ratio(0.4), ev);
      for (std::int64_t r = 0; r < L * H; ++r) {
        auto want = sel.kept(r / H, r % H);
        CHECK(out.row(r) == std::vector<std::int32_t>(want.begin(), want.end()));
      }
      CHECK(c_state == cpp_state);
      kvp_policy_destroy(p);
    }
  REQUIRE(std::any_of(c_state.begin(), c_state.end(), [](float x) { return x > 0.f; }));

  // Bad per-event inputs: a status and a message, nothing written.
  Cache c(L, H, T, D, 40);
  kvp_tensor ck = c.ck(), cv = c.cv();
  kvp_policy* z = make("kvzip | adakv");
  SelOut out(L, H, T);
  kvp_compress_params prm = kvp_compress_default_params();
  CHECK(kvp_compress(z, &prm, &ck, &cv, &cq, nullptr, 0, &out.sel) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("kvp_compress_params.reconstruction"));
  prm.reconstruction = rec.data();
  prm.reconstruction_stride = T - 1;
  CHECK(kvp_compress(z, &prm, &ck, &cv, &cq, nullptr, 0, &out.sel) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("state_stride 39 is below the 40 tokens"));
  prm.reconstruction_stride = -1;
  CHECK(kvp_compress(z, &prm, &ck, &cv, &cq, nullptr, 0, &out.sel) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("negative reconstruction_stride"));
  prm = kvp_compress_default_params();
  prm.rope_pairs = 4;
  CHECK(kvp_compress(z, &prm, &ck, &cv, &cq, nullptr, 0, &out.sel) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("rope_inv_freq is NULL but rope_pairs is 4"));
  prm = kvp_compress_default_params();
  prm.rope_inv_freq = freqs.data();
  CHECK(kvp_compress(z, &prm, &ck, &cv, &cq, nullptr, 0, &out.sel) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("rope_pairs is 0"));
  prm = kvp_compress_default_params();
  prm.alloc_state = c_state.data();
  prm.alloc_state_stride = T - 2;
  kvp_policy* a = make("knorm | ams(window=8)");
  CHECK(kvp_compress(a, &prm, &ck, &cv, &cq, nullptr, 0, &out.sel) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("alloc_state_stride 38 is below the 40 tokens"));
  // Non-finite per-event inputs are named (a negative credit too).
  prm = kvp_compress_default_params();
  std::vector<float> bad_rec = rec;
  bad_rec[static_cast<std::size_t>(S + 3)] = NAN;  // layer 0, head 1, token 3
  prm.reconstruction = bad_rec.data();
  prm.reconstruction_stride = S;
  CHECK(kvp_compress(z, &prm, &ck, &cv, &cq, nullptr, 0, &out.sel) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("reconstruction score of layer 0, head 1, token 3 is nan"));
  prm = kvp_compress_default_params();
  std::vector<float> bad_state(c_state.size(), 0.f);
  bad_state[5] = -1.f;
  prm.alloc_state = bad_state.data();
  prm.alloc_state_stride = S;
  CHECK(kvp_compress(a, &prm, &ck, &cv, &cq, nullptr, 0, &out.sel) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("credit state (EventInfo::alloc_state) of layer 0, head 0, token 5 is -1"));
  CHECK(bad_state[6] == 0.f);  // nothing updated
  prm = kvp_compress_default_params();
  std::vector<float> bad_freqs = freqs;
  bad_freqs[2] = INFINITY;
  prm.rope_inv_freq = bad_freqs.data();
  prm.rope_pairs = D / 2;
  kvp_policy* e = make("expected(window=8)");
  CHECK(kvp_compress(e, &prm, &ck, &cv, &cq, nullptr, 0, &out.sel) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("RoPE frequency 2 is inf"));
  kvp_policy_destroy(e);
  CHECK(std::all_of(out.counts.begin(), out.counts.end(), [](std::int64_t n) { return n == -1; }));
  // Batches take none of them.
  prm = kvp_compress_default_params();
  prm.reconstruction = rec.data();
  const kvp_sequence seq{ck, cv, cq, nullptr};
  CHECK(kvp_compress_batch(z, &prm, &seq, 1, &out.sel) == KVP_ERROR_UNSUPPORTED);
  CHECK(mentions("kvp_compress and kvp_cuda_compress only"));
  kvp_policy_destroy(a);
  kvp_policy_destroy(z);
}

TEST_CASE("C ABI: half-precision caches and selection-only calls", "[c_api]") {
  const std::int64_t L = 1, H = 2, T = 30, D = 8;
  kvtest::Rng rng(3);
  std::vector<half> k = rng.normals<half>(L * H * T * D), v = rng.normals<half>(L * H * T * D);
  const std::vector<half> k0 = k, v0 = v;
  kvp_policy* p = make("knorm");
  kvp_compress_params prm = kvp_compress_default_params();
  prm.budget = {KVP_BUDGET_PER_HEAD, 10};
  prm.compact = 0;
  SelOut out(L, H, T);
  kvp_tensor ck = kvp_tensor_hnd(k.data(), KVP_F16, L, H, T, D);
  REQUIRE(kvp_compress(p, &prm, &ck, nullptr, nullptr, nullptr, 0, &out.sel) == KVP_OK);
  CHECK(out.counts[0] == 10);
  CHECK(out.counts[1] == 10);
  CHECK(std::memcmp(k.data(), k0.data(), k.size() * sizeof(half)) == 0);  // select only

  Policy cpp("knorm");
  Inputs<half> in;
  in.keys = KVView<const half>::hnd(k.data(), L, H, T, D);
  const Selection sel = cpp.select(cpu_backend{}, in, Budget::tokens(10));
  for (std::int64_t h = 0; h < H; ++h) {
    auto want = sel.kept(0, h);
    CHECK(out.row(h) == std::vector<std::int32_t>(want.begin(), want.end()));
  }
  // Compacting needs the values too, in the keys' dtype.
  prm.compact = 1;
  CHECK(kvp_compress(p, &prm, &ck, nullptr, nullptr, nullptr, 0, &out.sel) ==
        KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("values"));
  std::vector<float> vf(v.size());
  kvp_tensor cvf = kvp_tensor_hnd(vf.data(), KVP_F32, L, H, T, D);
  CHECK(kvp_compress(p, &prm, &ck, &cvf, nullptr, nullptr, 0, &out.sel) ==
        KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("dtype"));
  CHECK(std::memcmp(k.data(), k0.data(), k.size() * sizeof(half)) == 0);
  kvp_tensor cv = kvp_tensor_hnd(v.data(), KVP_F16, L, H, T, D);
  REQUIRE(kvp_compress(p, &prm, &ck, &cv, nullptr, nullptr, 0, &out.sel) == KVP_OK);
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t i = 0; i < 10; ++i) {
      const std::int64_t src = out.idx[static_cast<std::size_t>(h * T + i)];
      CHECK(std::memcmp(&k[static_cast<std::size_t>((h * T + i) * D)],
                        &k0[static_cast<std::size_t>((h * T + src) * D)], D * sizeof(half)) == 0);
      CHECK(std::memcmp(&v[static_cast<std::size_t>((h * T + i) * D)],
                        &v0[static_cast<std::size_t>((h * T + src) * D)], D * sizeof(half)) == 0);
    }
  kvp_policy_destroy(p);
}

TEST_CASE("C ABI: bad input gives a status and a message and writes nothing", "[c_api]") {
  kvp_policy* p = nullptr;
  CHECK(kvp_policy_create(nullptr, &p) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("spec is NULL"));
  CHECK(kvp_policy_create("snapkv", nullptr) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("out is NULL"));
  CHECK(kvp_policy_create("snapk", &p) == KVP_ERROR_BAD_SPEC);
  CHECK(mentions("unknown scorer 'snapk'"));
  CHECK(p == nullptr);
  CHECK(kvp_policy_create("snapkv(windw=3)", &p) == KVP_ERROR_BAD_SPEC);
  CHECK(mentions("windw"));
  CHECK(kvp_policy_create("snapkv | int2 | adakv", &p) == KVP_ERROR_BAD_SPEC);
  CHECK(kvp_policy_create("", &p) == KVP_ERROR_BAD_SPEC);
  CHECK(kvp_policy_clone(nullptr, &p) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(kvp_policy_reset(nullptr) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(kvp_policy_get_info(nullptr, nullptr) == KVP_ERROR_INVALID_ARGUMENT);
  kvp_policy_destroy(nullptr);
  kvp_session_destroy(nullptr);

  Cache c(1, 2, 20, 8, 4);
  const std::vector<float> k0 = c.k, v0 = c.v;
  kvp_policy* pol = make("knorm");
  kvp_compress_params prm = kvp_compress_default_params();
  SelOut out(1, 2, 20);
  kvp_tensor ck = c.ck(), cv = c.cv();
  auto unchanged = [&] { return c.k == k0 && c.v == v0; };

  CHECK(kvp_compress(nullptr, &prm, &ck, &cv, nullptr, nullptr, 0, &out.sel) ==
        KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("policy is NULL"));
  CHECK(kvp_compress(pol, &prm, nullptr, &cv, nullptr, nullptr, 0, &out.sel) ==
        KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("keys is NULL"));
  CHECK(kvp_compress(pol, &prm, &ck, &cv, nullptr, nullptr, 0, nullptr) ==
        KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("out is NULL"));

  kvp_compress_params bad = prm;
  bad.struct_size = 3;
  CHECK(kvp_compress(pol, &bad, &ck, &cv, nullptr, nullptr, 0, &out.sel) ==
        KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("struct_size"));
  bad = prm;
  bad.budget = {KVP_BUDGET_RATIO, 1.5};
  CHECK(kvp_compress(pol, &bad, &ck, &cv, nullptr, nullptr, 0, &out.sel) ==
        KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("above 1"));
  bad.budget = {KVP_BUDGET_PER_HEAD, 2.5};
  CHECK(kvp_compress(pol, &bad, &ck, &cv, nullptr, nullptr, 0, &out.sel) ==
        KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("integer"));
  const int nine = 9;  // what a C caller can store in the enum field
  bad.budget.value = 1;
  std::memcpy(&bad.budget.kind, &nine, sizeof nine);
  CHECK(kvp_compress(pol, &bad, &ck, &cv, nullptr, nullptr, 0, &out.sel) ==
        KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("budget kind"));

  kvp_tensor t = ck;
  const int five = 5;
  std::memcpy(&t.dtype, &five, sizeof five);
  CHECK(kvp_compress(pol, &prm, &t, &cv, nullptr, nullptr, 0, &out.sel) ==
        KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("dtype"));
  t = ck;
  t.stride_token = 3;  // rows overlap
  CHECK(kvp_compress(pol, &prm, &t, &cv, nullptr, nullptr, 0, &out.sel) ==
        KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("overlaps"));
  t = ck;
  t.data = nullptr;
  CHECK(kvp_compress(pol, &prm, &t, &cv, nullptr, nullptr, 0, &out.sel) ==
        KVP_ERROR_INVALID_ARGUMENT);
  t = cv;
  t.tokens = 19;
  CHECK(kvp_compress(pol, &prm, &ck, &t, nullptr, nullptr, 0, &out.sel) ==
        KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("does not match keys"));

  SelOut small(1, 2, 10);
  CHECK(kvp_compress(pol, &prm, &ck, &cv, nullptr, nullptr, 0, &small.sel) ==
        KVP_ERROR_BUFFER_TOO_SMALL);
  CHECK(mentions("capacity"));
  SelOut wrong(2, 2, 20);
  CHECK(kvp_compress(pol, &prm, &ck, &cv, nullptr, nullptr, 0, &wrong.sel) ==
        KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("layers x heads"));

  c.k[17] = NAN;
  CHECK(kvp_compress(pol, &prm, &ck, &cv, nullptr, nullptr, 0, &out.sel) ==
        KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("non-finite"));
  c.k[17] = k0[17];
  CHECK(unchanged());
  CHECK(out.counts[0] == -1);  // nothing written to the outputs either

  // Queries the policy needs but were not given.
  kvp_policy* snap = make("snapkv");
  CHECK(kvp_compress(snap, &prm, &ck, &cv, nullptr, nullptr, 0, &out.sel) ==
        KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("queries"));
  // A budget below the protected tokens: what fits of them (here the first 5 sinks), and a
  // warning that the next call clears.
  kvp_policy* stream = make("streaming(sinks=8)");
  bad = prm;
  bad.budget = {KVP_BUDGET_PER_HEAD, 5};
  bad.compact = 0;
  CHECK(kvp_compress(stream, &bad, &ck, &cv, nullptr, nullptr, 0, &out.sel) == KVP_OK);
  CHECK(out.row(1) == std::vector<std::int32_t>{0, 1, 2, 3, 4});
  CHECK(std::string(kvp_last_warning()) ==
        "budget of 5 tokens per head is below the 8 tokens streaming protects (8 sinks + 0 "
        "recent): kept the first 5 instead");
  bad.budget = {KVP_BUDGET_PER_HEAD, 9};
  CHECK(kvp_compress(stream, &bad, &ck, &cv, nullptr, nullptr, 0, &out.sel) == KVP_OK);
  CHECK(std::string(kvp_last_warning()).empty());
  // A merger or quantizer needs a session.
  kvp_policy* merge = make("snapkv | semantic");
  CHECK(kvp_compress(merge, &prm, &ck, &cv, nullptr, nullptr, 0, &out.sel) ==
        KVP_ERROR_UNSUPPORTED);
  CHECK(mentions("session"));
  CHECK(unchanged());

  size_t bytes = 99;
  CHECK(kvp_compress_workspace_size(pol, &ck, nullptr, &bytes) == KVP_OK);
  CHECK(bytes == 0);
  CHECK(kvp_compress_workspace_size(pol, &ck, nullptr, nullptr) == KVP_ERROR_INVALID_ARGUMENT);

  // A success clears the previous message.
  REQUIRE(kvp_compress(pol, &prm, &ck, &cv, nullptr, nullptr, 0, &out.sel) == KVP_OK);
  CHECK(std::string(kvp_last_error()).empty());
  for (kvp_policy* x : {pol, snap, stream, merge}) kvp_policy_destroy(x);
}

TEST_CASE("C ABI: policy info", "[c_api]") {
  kvp_policy* p = make("snapkv(window=16) | adakv | int2");
  kvp_policy_info info{};
  REQUIRE(kvp_policy_get_info(p, &info) == KVP_OK);
  CHECK(std::string(info.scorer) == "snapkv");
  CHECK(std::string(info.spec).find("adakv") != std::string::npos);
  CHECK(info.query_window == 16);
  CHECK((info.needs & KVP_NEEDS_QUERIES) != 0);
  CHECK(info.has_quantizer == 1);
  CHECK(info.has_merger == 0);
  CHECK(info.decode_time == 0);
  kvp_policy_destroy(p);
  p = make("h2o");
  REQUIRE(kvp_policy_get_info(p, &info) == KVP_OK);
  CHECK(info.decode_time == 1);
  kvp_policy_destroy(p);
  // A quantizer alone: no scorer, reads nothing, keeps (and packs) every token.
  p = make("int2");
  REQUIRE(kvp_policy_get_info(p, &info) == KVP_OK);
  CHECK(std::string(info.scorer).empty());
  CHECK(std::string(info.spec) == "int2");
  CHECK(info.needs == 0);
  CHECK(info.query_window == 0);
  CHECK(info.has_quantizer == 1);
  CHECK(info.decode_time == 0);
  kvp_policy_destroy(p);
}

TEST_CASE("C ABI: a plug-in scorer chains like the built-in it imitates", "[c_api]") {
  int frees = 0;
  auto* st = new NormState;
  st->frees = &frees;
  kvp_scorer_plugin plug = norm_plugin(st);
  kvp_policy* mine = nullptr;
  REQUIRE(kvp_policy_create_with_plugins("myknorm | adakv", &plug, 1, &mine) == KVP_OK);
  kvp_policy_info info{};
  REQUIRE(kvp_policy_get_info(mine, &info) == KVP_OK);
  CHECK(std::string(info.scorer) == "myknorm");
  CHECK(st->resets == 0);
  kvp_policy* builtin = make("knorm | adakv");
  kvp_compress_params prm = kvp_compress_default_params();
  prm.budget = {KVP_BUDGET_RATIO, 0.3};
  Cache a(2, 4, 50, 16, 21), b = a;
  SelOut sa(2, 4, 50), sb(2, 4, 50);
  kvp_tensor ak = a.ck(), av = a.cv(), bk = b.ck(), bv = b.cv();
  REQUIRE(kvp_compress(mine, &prm, &ak, &av, nullptr, nullptr, 0, &sa.sel) == KVP_OK);
  REQUIRE(kvp_compress(builtin, &prm, &bk, &bv, nullptr, nullptr, 0, &sb.sel) == KVP_OK);
  CHECK(st->scores == 1);
  CHECK(sa.counts == sb.counts);
  CHECK(sa.idx == sb.idx);
  CHECK(a.k == b.k);
  CHECK(a.v == b.v);
  // adakv really redistributed (not a uniform split), so the plug-in's scores drove it.
  bool uneven = false;
  for (auto n : sa.counts) uneven = uneven || n != sa.counts[0];
  CHECK(uneven);

  // Failures of the plug-in surface as KVP_ERROR_PLUGIN, and the cache is left alone.
  Cache d(1, 2, 20, 8, 2);
  const std::vector<float> d0 = d.k;
  SelOut sd(1, 2, 20);
  kvp_tensor dk = d.ck(), dv = d.cv();
  st->fail = true;
  CHECK(kvp_compress(mine, &prm, &dk, &dv, nullptr, nullptr, 0, &sd.sel) == KVP_ERROR_PLUGIN);
  CHECK(mentions("myknorm"));
  CHECK(mentions("returned 7"));
  CHECK(mentions("deliberate failure"));
  st->fail = false;
  st->nan = true;
  CHECK(kvp_compress(mine, &prm, &dk, &dv, nullptr, nullptr, 0, &sd.sel) == KVP_ERROR_PLUGIN);
  CHECK(mentions("non-finite score at layer 0, head 0, token 3"));
  st->nan = false;
  CHECK(d.k == d0);

  // reset and clone reach the plug-in; the clone has its own state.
  REQUIRE(kvp_policy_reset(mine) == KVP_OK);
  CHECK(st->resets == 1);
  kvp_policy* copy = nullptr;
  REQUIRE(kvp_policy_clone(mine, &copy) == KVP_OK);
  REQUIRE(kvp_compress(copy, &prm, &dk, &dv, nullptr, nullptr, 0, &sd.sel) == KVP_OK);
  CHECK(st->scores == 3);  // the clone scored with its own state
  // free runs once per state, when the last policy holding it goes.
  kvp_policy_destroy(copy);
  CHECK(frees == 1);
  kvp_policy_destroy(mine);
  CHECK(frees == 2);
  kvp_policy_destroy(builtin);
}

TEST_CASE("C ABI: plug-in registration errors", "[c_api]") {
  int frees = 0;
  NormState st;
  st.frees = &frees;
  kvp_scorer_plugin plug = norm_plugin(&st);
  plug.free = nullptr;  // stack state: never freed by the library here
  kvp_policy* p = nullptr;
  CHECK(kvp_policy_create_with_plugins("myknorm", nullptr, 1, &p) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("plugins is NULL"));
  kvp_scorer_plugin bad = plug;
  bad.score = nullptr;
  CHECK(kvp_policy_create_with_plugins("myknorm", &bad, 1, &p) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("score is NULL"));
  bad = plug;
  bad.struct_size = 1;
  CHECK(kvp_policy_create_with_plugins("myknorm", &bad, 1, &p) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("struct_size"));
  bad = plug;
  bad.name = [](const void*) { return "knorm"; };
  CHECK(kvp_policy_create_with_plugins("knorm", &bad, 1, &p) == KVP_ERROR_BAD_SPEC);
  CHECK(mentions("name of a built-in stage"));
  bad.name = [](const void*) { return "Bad Name"; };
  CHECK(kvp_policy_create_with_plugins("snapkv", &bad, 1, &p) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("lowercase"));
  bad = plug;
  bad.needs = 64;
  CHECK(kvp_policy_create_with_plugins("myknorm", &bad, 1, &p) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("unknown bits"));
  kvp_scorer_plugin two[2] = {plug, plug};
  CHECK(kvp_policy_create_with_plugins("myknorm", two, 2, &p) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("only once"));
  CHECK(kvp_policy_create_with_plugins("myknorm(x=1)", &plug, 1, &p) == KVP_ERROR_BAD_SPEC);
  CHECK(mentions("no parameters"));
  CHECK(kvp_policy_create_with_plugins("other | adakv", &plug, 1, &p) == KVP_ERROR_BAD_SPEC);
  CHECK(mentions("plug-ins: myknorm"));
  CHECK(p == nullptr);
  // A spec that does not use the plug-in does not take its state.
  kvp_scorer_plugin owned = plug;
  owned.free = norm_free;
  REQUIRE(kvp_policy_create_with_plugins("snapkv", &owned, 1, &p) == KVP_OK);
  kvp_policy_destroy(p);
  CHECK(frees == 0);
  CHECK(st.scores == 0);
}

TEST_CASE("C ABI: a session decode loop equals the C++ Session", "[c_api]") {
  const std::int64_t L = 2, Hkv = 2, Hq = 4, D = 16, prompt = 48, steps = 6;
  kvp_policy* p = make("snapkv(window=8) | adakv");
  kvp_session_config cfg = kvp_session_default_config();
  cfg.layers = L, cfg.kv_heads = Hkv, cfg.q_heads = Hq, cfg.head_dim = D;
  cfg.budget = {KVP_BUDGET_RATIO, 0.25};
  kvp_session* s = nullptr;
  REQUIRE(kvp_session_create(p, &cfg, &s) == KVP_OK);

  SessionConfig c;
  c.layers = L, c.kv_heads = Hkv, c.q_heads = Hq, c.head_dim = D;
  c.budget = Budget::ratio(0.25);
  Session<float> ref(Policy("snapkv(window=8) | adakv"), c);

  kvtest::Rng rng(17);
  std::vector<float> out_c(static_cast<std::size_t>(Hq * prompt * D)), out_r = out_c;
  for (std::int64_t step = 0; step <= steps; ++step) {
    const std::int64_t n = step == 0 ? prompt : 1;
    for (std::int64_t l = 0; l < L; ++l) {
      std::vector<float> k = rng.normals(Hkv * n * D), v = rng.normals(Hkv * n * D),
                         q = rng.normals(Hq * n * D);
      kvp_tensor ck = kvp_tensor_hnd(k.data(), KVP_F32, 1, Hkv, n, D);
      kvp_tensor cv = kvp_tensor_hnd(v.data(), KVP_F32, 1, Hkv, n, D);
      kvp_tensor cq = kvp_tensor_hnd(q.data(), KVP_F32, 1, Hq, n, D);
      REQUIRE(kvp_session_append(s, l, &ck, &cv, &cq) == KVP_OK);
      const auto kv = KVView<const float>::hnd(k.data(), 1, Hkv, n, D);
      const auto vv = KVView<const float>::hnd(v.data(), 1, Hkv, n, D);
      const auto qv = KVView<const float>::hnd(q.data(), 1, Hq, n, D);
      ref.append(l, kv, vv, qv);
      REQUIRE(kvp_session_attend(s, l, &cq, out_c.data(), out_c.size()) == KVP_OK);
      ref.attend(l, qv, out_r.data());
      CHECK(std::equal(out_c.begin(), out_c.begin() + Hq * n * D, out_r.begin()));
      int done = -1;
      REQUIRE(kvp_session_compress_if_due(s, l, &done) == KVP_OK);
      CHECK(done == (ref.compress_if_due(l) ? 1 : 0));
    }
  }
  for (std::int64_t l = 0; l < L; ++l) {
    std::vector<std::int64_t> len(Hkv);
    REQUIRE(kvp_session_lengths(s, l, len.data(), len.size()) == KVP_OK);
    for (std::int64_t h = 0; h < Hkv; ++h) {
      REQUIRE(len[h] == ref.length(l, h));
      std::vector<float> k(static_cast<std::size_t>(len[h] * D)), v = k;
      std::vector<std::int32_t> pos(static_cast<std::size_t>(len[h]));
      REQUIRE(kvp_session_read(s, l, h, k.data(), v.data(), pos.data(), len[h]) == KVP_OK);
      auto want = ref.positions(l, h);
      CHECK(pos == std::vector<std::int32_t>(want.begin(), want.end()));
      for (std::int64_t t = 0; t < len[h]; ++t)
        for (std::int64_t i = 0; i < D; ++i)
          CHECK(k[static_cast<std::size_t>(t * D + i)] == ref.keys(l).at(0, h, t, i));
      CHECK(kvp_session_read(s, l, h, k.data(), nullptr, nullptr, len[h] - 1) ==
            KVP_ERROR_BUFFER_TOO_SMALL);
    }
  }
  size_t bytes = 0;
  REQUIRE(kvp_session_kv_bytes(s, &bytes) == KVP_OK);
  CHECK(bytes == ref.kv_bytes());

  // Bad calls on a live session leave it usable.
  std::vector<float> k(static_cast<std::size_t>(Hkv * D));
  kvp_tensor ck = kvp_tensor_hnd(k.data(), KVP_F32, 1, Hkv, 1, D);
  kvp_tensor wrong = kvp_tensor_hnd(k.data(), KVP_F32, 1, 1, 1, D);
  CHECK(kvp_session_append(s, 5, &ck, &ck, nullptr) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("layer 5"));
  CHECK(kvp_session_append(s, 0, &ck, nullptr, nullptr) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(kvp_session_append(s, 0, &wrong, &wrong, nullptr) == KVP_ERROR_INVALID_ARGUMENT);
  kvp_tensor f16 = ck;
  f16.dtype = KVP_F16;
  CHECK(kvp_session_append(s, 0, &f16, &f16, nullptr) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("float32"));
  k[0] = NAN;
  CHECK(kvp_session_append(s, 0, &ck, &ck, nullptr) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("non-finite"));
  float tiny[4];
  std::vector<float> q(static_cast<std::size_t>(Hq * D));
  kvp_tensor cq = kvp_tensor_hnd(q.data(), KVP_F32, 1, Hq, 1, D);
  CHECK(kvp_session_attend(s, 0, &cq, tiny, 4) == KVP_ERROR_BUFFER_TOO_SMALL);
  std::int64_t one[1];
  CHECK(kvp_session_lengths(s, 0, one, 1) == KVP_ERROR_BUFFER_TOO_SMALL);
  CHECK(kvp_session_read(s, 0, 9, nullptr, nullptr, nullptr, 0) == KVP_ERROR_INVALID_ARGUMENT);
  std::vector<std::int64_t> len(Hkv);
  REQUIRE(kvp_session_lengths(s, 0, len.data(), len.size()) == KVP_OK);
  CHECK(len[0] == ref.length(0, 0));

  kvp_session_config bad = cfg;
  kvp_session* s2 = nullptr;
  bad.q_heads = 3;
  CHECK(kvp_session_create(p, &bad, &s2) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("q_heads"));
  bad = cfg;
  bad.struct_size = 0;
  CHECK(kvp_session_create(p, &bad, &s2) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(kvp_session_create(p, nullptr, &s2) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(s2 == nullptr);
  kvp_session_destroy(s);
  kvp_policy_destroy(p);
}

TEST_CASE("C ABI: a quantizing session reports packed layers", "[c_api]") {
  kvp_policy* p = make("snapkv(window=4) | int2(residual=0)");
  kvp_session_config cfg = kvp_session_default_config();
  cfg.layers = 1, cfg.kv_heads = 1, cfg.q_heads = 1, cfg.head_dim = 64;
  cfg.budget = {KVP_BUDGET_RATIO, 0.5};
  kvp_session* s = nullptr;
  REQUIRE(kvp_session_create(p, &cfg, &s) == KVP_OK);
  kvtest::Rng rng(1);
  const std::int64_t n = 64;
  std::vector<float> k = rng.normals(n * 64), v = rng.normals(n * 64), q = rng.normals(n * 64);
  kvp_tensor ck = kvp_tensor_hnd(k.data(), KVP_F32, 1, 1, n, 64);
  kvp_tensor cv = kvp_tensor_hnd(v.data(), KVP_F32, 1, 1, n, 64);
  kvp_tensor cq = kvp_tensor_hnd(q.data(), KVP_F32, 1, 1, n, 64);
  REQUIRE(kvp_session_append(s, 0, &ck, &cv, &cq) == KVP_OK);
  int done = 0;
  REQUIRE(kvp_session_compress_if_due(s, 0, &done) == KVP_OK);
  CHECK(done == 1);
  std::vector<float> rows(static_cast<std::size_t>(n * 64));
  std::vector<std::int32_t> pos(static_cast<std::size_t>(n));
  CHECK(kvp_session_read(s, 0, 0, rows.data(), nullptr, nullptr, n) == KVP_ERROR_UNSUPPORTED);
  CHECK(mentions("quantized"));
  REQUIRE(kvp_session_read(s, 0, 0, nullptr, nullptr, pos.data(), n) == KVP_OK);
  size_t bytes = 0;
  REQUIRE(kvp_session_kv_bytes(s, &bytes) == KVP_OK);
  CHECK(bytes > 0);
  CHECK(bytes < static_cast<size_t>(32 * 64 * 2 * 4));  // below the fp32 size of the survivors
  kvp_session_destroy(s);
  kvp_policy_destroy(p);
}

TEST_CASE("C ABI: CUDA entry points without a usable device", "[c_api]") {
  if (kvp_cuda_device_count() > 0) {
    SUCCEED("a device is present: the CUDA entry points are exercised by the [gpu] tests");
    return;
  }
  size_t bytes = 0;
  const kvp_status s = kvp_cuda_select_workspace_size(4, 100, &bytes);
  CHECK(s != KVP_OK);
  CHECK(std::string(kvp_last_error()).size() > 10);
  float scores[4] = {1, 2, 3, 4};
  std::int64_t budgets[1] = {2};
  kvp_csr out{};
  CHECK(kvp_cuda_select(scores, 1, 1, 4, 4, budgets, 0, 0, nullptr, 0, nullptr, &out) != KVP_OK);
  kvp_tensor t = kvp_tensor_hnd(scores, KVP_F32, 1, 1, 4, 1);
  CHECK(kvp_cuda_compact(&t, &out, nullptr, 0, nullptr) != KVP_OK);
  CHECK(kvp_cuda_compact(nullptr, nullptr, nullptr, 0, nullptr) != KVP_OK);
}

TEST_CASE("C ABI: a session shape beyond the address space is an argument error (fuzz_c_api "
          "regression)", "[c_api]") {
  // Found by fuzz_c_api: kv_heads * initial_capacity * head_dim overflowed while sizing buffers.
  kvp_policy* p = make("knorm");
  kvp_session_config cfg = kvp_session_default_config();
  cfg.layers = 1, cfg.kv_heads = 2, cfg.q_heads = 2, cfg.head_dim = 8;
  cfg.initial_capacity = std::int64_t{1} << 62;
  kvp_session* s = nullptr;
  CHECK(kvp_session_create(p, &cfg, &s) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("need buffers larger than the address space"));
  CHECK(s == nullptr);
  cfg.initial_capacity = 16;
  REQUIRE(kvp_session_create(p, &cfg, &s) == KVP_OK);
  kvp_session_destroy(s);
  kvp_policy_destroy(p);
}

TEST_CASE("C ABI: a plug-in protecting INT64_MAX tokens keeps what the budget allows (fuzz_c_api "
          "regression)", "[c_api]") {
  // Found by fuzz_c_api: Protect::total added sinks + recent and overflowed when a plug-in
  // declared recent = INT64_MAX ("protect everything"). The budget wins, the newest tokens stay,
  // and a warning says so.
  for (const auto& [sinks, recent] : {std::pair<std::int64_t, std::int64_t>{4, INT64_MAX},
                                      {INT64_MAX, 4}, {INT64_MAX, INT64_MAX}}) {
    CAPTURE(sinks, recent);
    auto* st = new NormState;
    kvp_scorer_plugin plug = norm_plugin(st);
    plug.sinks = sinks;
    plug.recent = recent;
    kvp_policy* p = nullptr;
    REQUIRE(kvp_policy_create_with_plugins("myknorm", &plug, 1, &p) == KVP_OK);
    kvp_compress_params prm = kvp_compress_default_params();
    prm.budget = {KVP_BUDGET_PER_HEAD, 6};
    prm.compact = 0;
    Cache c(1, 2, 20, 8, 5);
    SelOut out(1, 2, 20);
    kvp_tensor k = c.ck(), v = c.cv();
    REQUIRE(kvp_compress(p, &prm, &k, &v, nullptr, nullptr, 0, &out.sel) == KVP_OK);
    // The documented rule: the newest min(recent, budget) tokens, then the first of the sinks.
    const std::vector<std::int32_t> want =
        recent == 4 ? std::vector<std::int32_t>{0, 1, 16, 17, 18, 19}
                    : std::vector<std::int32_t>{14, 15, 16, 17, 18, 19};
    CHECK(out.row(0) == want);
    CHECK(out.row(1) == want);
    CHECK(std::string(kvp_last_warning()).find("below the 20 tokens") != std::string::npos);
    kvp_policy_destroy(p);
  }
}

}  // namespace kvt_c_api_c_api
