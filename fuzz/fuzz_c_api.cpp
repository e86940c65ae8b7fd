// libFuzzer target: the C ABI (include/kvpolicy/c/kvpolicy.h) as an engine in C would drive it,
// with every argument decoded from the input: a sequence of kvp_* calls over a few policy and
// session slots, with tensor descriptors (shapes, strides, dtypes, layouts, null pointers),
// budgets, parameter structs, spec strings, paged block tables and plug-in scorer tables whose
// callbacks misbehave (NaN or missing scores, error codes, NULL names, failing clones).
//
// The harness never lies about memory: a descriptor's data pointer is backed by exactly the
// elements its extents and strides reach (the library cannot check that); a descriptor that
// reaches more than kMaxElems is passed with data = NULL. Descriptors the ABI rejects by their
// fields (negative extents or strides, aliasing strides, unknown dtypes) get a small real buffer.
// Output buffers are exactly as large as the counts the call is given.
//
// Checked after every call (kvpolicy.h, Conventions):
// - the status is a kvp_status; KVP_OK leaves kvp_last_error() empty, a failure sets it;
// - KVP_ERROR_INTERNAL never happens (an unexpected exception escaped the argument checks);
// - a failing call has not modified any caller buffer (except the documented
//   KVP_ERROR_SHARED_BLOCK of kvp_compress_paged, which compacts the other requests);
// - successful selections are ascending, inside the cache, and compaction moved exactly the kept
//   rows to the front (compared element by element against a copy of the input);
// - paged results stay inside the request's own pages; session lengths and positions are sane;
// - plug-in states are freed exactly once, only by their owner, and none outlives its last
//   handle (the caller frees the states it kept; the rest must be gone after the last destroy).
// A crash, a sanitizer report or a leak is a finding too.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "fuzz_common.hpp"
#include "kvpolicy/c/kvpolicy.h"

using kvp_fuzz::finding;
using kvp_fuzz::pick_double;
using kvp_fuzz::pick_int;

namespace {

constexpr std::int64_t kMaxElems = 1 << 15;  // the most elements one buffer may hold

// ---- Memory the harness hands out, and checks on it ----------------------------------------

// Every buffer of one input; exact-size heap blocks so ASan's redzones sit at their ends.
class Arena {
 public:
  void* alloc(std::size_t bytes) {
    blocks_.emplace_back(new std::byte[std::max<std::size_t>(bytes, 1)]);
    return blocks_.back().get();
  }
  template <class T>
  T* alloc_n(std::size_t n) {
    return static_cast<T*>(alloc(n * sizeof(T)));
  }

 private:
  std::vector<std::unique_ptr<std::byte[]>> blocks_;
};

// Copies of the caller buffers a call may write, to check that a failing call wrote none.
class Watch {
 public:
  void add(const void* p, std::size_t bytes) {
    if (!p || bytes == 0) return;
    const auto* b = static_cast<const std::byte*>(p);
    spans_.push_back({b, std::vector<std::byte>(b, b + bytes)});
  }
  void require_unchanged(const char* call) const {
    for (const auto& s : spans_)
      if (std::memcmp(s.at, s.copy.data(), s.copy.size()) != 0)
        finding("%s failed (%s) but modified a caller buffer of %zu bytes", call,
                kvp_last_error(), s.copy.size());
  }

 private:
  struct Span {
    const std::byte* at;
    std::vector<std::byte> copy;
  };
  std::vector<Span> spans_;
};

// C enum fields hold any int; in C++ loading one outside the enumerators is undefined, so the
// harness writes and reads such fields as raw ints (as the library does).
template <class E>
void set_enum(E& field, int v) {
  static_assert(sizeof field == sizeof v);
  std::memcpy(&field, &v, sizeof v);
}
template <class E>
int get_enum(const E& field) {
  int v;
  std::memcpy(&v, &field, sizeof v);
  return v;
}

// The status contract of every call; returns the status.
kvp_status check_status(kvp_status st, const char* call) {
  const int v = get_enum(st);
  if (v < KVP_OK || v > KVP_ERROR_INTERNAL) finding("%s returned %d, not a kvp_status", call, v);
  const char* msg = kvp_last_error();
  if (!msg) finding("%s: kvp_last_error() is NULL", call);
  if (st == KVP_OK && msg[0] != '\0') finding("%s succeeded but set the error '%s'", call, msg);
  if (st != KVP_OK && msg[0] == '\0') finding("%s failed with %d and no message", call, v);
  if (st == KVP_ERROR_INTERNAL) finding("%s: internal error: %s", call, msg);
  return st;
}

// ---- Tensors ------------------------------------------------------------------------------

int elem_bytes(int dtype) { return dtype == KVP_F16 || dtype == KVP_BF16 ? 2 : 4; }

std::uint16_t to_bf16(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<std::uint16_t>(u >> 16);
}
std::uint16_t to_f16(float x) {  // truncating; enough to give finite and non-finite halves
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000);
  const int exp = static_cast<int>((u >> 23) & 0xFF) - 127 + 15;
  if (((u >> 23) & 0xFF) == 0xFF) return sign | 0x7C00 | ((u & 0x7FFFFF) ? 0x200 : 0);
  if (exp >= 31) return sign | 0x7C00;
  if (exp <= 0) return sign;
  return static_cast<std::uint16_t>(sign | (exp << 10) | ((u >> 13) & 0x3FF));
}

// Elements an N-d strided view reaches: nullopt when it cannot be backed (too many), -1 for a
// view with a negative extent or stride (the ABI rejects it by its fields), 0 for an empty view.
std::optional<std::int64_t> reach(const std::int64_t* ext, const std::int64_t* str, int n) {
  bool empty = false;
  for (int i = 0; i < n; ++i) {
    if (ext[i] < 0 || str[i] < 0) return -1;
    empty = empty || ext[i] == 0;
  }
  if (empty) return 0;
  __int128 last = 0;
  for (int i = 0; i < n; ++i) last += static_cast<__int128>(ext[i] - 1) * str[i];
  if (last + 1 > kMaxElems) return std::nullopt;
  return static_cast<std::int64_t>(last + 1);
}

// Shapes of one input: most descriptors follow them, so that calls get past the checks.
struct Anchor {
  std::int64_t L, H, g, T, d, nq;
  int dtype;
};

struct Ctx {
  FuzzedDataProvider& fdp;
  Arena& arena;
  kvp_fuzz::Rng rng;
  Anchor a;
};

// Backs `*data` for a view reaching `r` elements of `dtype`, filled with fuzz-chosen values.
void back(Ctx& c, std::optional<std::int64_t> r, int dtype, void** data, bool allow_nonfinite) {
  *data = nullptr;
  if (!r) return;                           // too large to back: NULL, never a short buffer
  if (c.fdp.ConsumeIntegralInRange<int>(0, 15) == 0) return;  // an explicit NULL
  const std::int64_t n = std::max<std::int64_t>(*r, 1);
  const int eb = elem_bytes(dtype);
  void* p = c.arena.alloc(static_cast<std::size_t>(n * eb));
  const kvp_fuzz::Fill f = kvp_fuzz::pick_fill(c.fdp, allow_nonfinite);
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = kvp_fuzz::fill_value(f, c.rng, static_cast<std::size_t>(i));
    if (eb == 4) {
      static_cast<float*>(p)[i] = x;
    } else {
      const std::uint16_t h = dtype == KVP_F16 ? to_f16(x) : to_bf16(x);
      static_cast<std::uint16_t*>(p)[i] = h;
    }
  }
  *data = p;
}

int pick_dtype(Ctx& c, int hint) {
  switch (c.fdp.ConsumeIntegralInRange<int>(0, 11)) {
    case 0: return c.fdp.ConsumeIntegralInRange<int>(KVP_F32, KVP_BF16);
    case 1: return c.fdp.ConsumeIntegral<int>();
    default: return hint;
  }
}

// Products of extents for strides, saturating at INT64_MAX: a session's fuzzed shape may be huge,
// and such a descriptor is then passed without data (see back()).
std::int64_t sat_mul(std::int64_t a, std::int64_t b) {
  const __int128 p = static_cast<__int128>(a) * b;
  return p > INT64_MAX ? INT64_MAX : p < INT64_MIN ? INT64_MIN : static_cast<std::int64_t>(p);
}

// A dense [l][h][t][d] descriptor: HND, NHD, permuted with padding, or with fuzzed fields.
kvp_tensor make_tensor(Ctx& c, std::int64_t l, std::int64_t h, std::int64_t t, std::int64_t d,
                       int dtype_hint, bool allow_nonfinite = true) {
  FuzzedDataProvider& fdp = c.fdp;
  const int dtype = pick_dtype(c, dtype_hint);
  kvp_tensor x{};
  std::int64_t ext[4] = {l, h, t, d}, str[4] = {0, 0, 0, 1};
  switch (fdp.ConsumeIntegralInRange<int>(0, 7)) {
    case 0:  // absent
      set_enum(x.dtype, dtype);
      return x;
    case 1:
    case 2: {  // NHD
      str[0] = sat_mul(sat_mul(t, h), d), str[1] = d, str[2] = sat_mul(h, d), str[3] = 1;
      break;
    }
    case 3: {  // dims in a fuzzed order, each padded
      int order[4] = {0, 1, 2, 3};
      std::rotate(order, order + fdp.ConsumeIntegralInRange<int>(0, 3), order + 4);
      if (fdp.ConsumeBool()) std::swap(order[0], order[3]);
      std::int64_t span = 1;
      for (int k = 3; k >= 0; --k) {
        str[order[k]] = span;
        const std::int64_t pad = fdp.ConsumeIntegralInRange<std::int64_t>(0, 2);
        span = sat_mul(span, ext[order[k]] > INT64_MAX - pad ? INT64_MAX : ext[order[k]] + pad);
        span = std::max<std::int64_t>(span, 1);
      }
      break;
    }
    case 4: {  // every field fuzzed
      for (auto& e : ext) e = pick_int(fdp, 0, 6, kvp_fuzz::Edges::sizes);
      for (auto& s : str) s = pick_int(fdp, 0, 48);
      break;
    }
    default:  // HND
      str[0] = sat_mul(sat_mul(h, t), d), str[1] = sat_mul(t, d), str[2] = d, str[3] = 1;
  }
  set_enum(x.dtype, dtype);
  x.layers = ext[0], x.heads = ext[1], x.tokens = ext[2], x.dim = ext[3];
  x.stride_layer = str[0], x.stride_head = str[1], x.stride_token = str[2], x.stride_dim = str[3];
  back(c, reach(ext, str, 4), dtype, &x.data, allow_nonfinite);
  return x;
}

kvp_budget make_budget(Ctx& c) {
  kvp_budget b;
  const int kind = c.fdp.ConsumeIntegralInRange<int>(0, 12);
  set_enum(b.kind, kind <= 2 ? kind : kind <= 10 ? kind % 3 : kind * 7 - 80);
  b.value = get_enum(b.kind) == KVP_BUDGET_RATIO
                ? pick_double(c.fdp, 0.0, 1.0)
                : static_cast<double>(pick_int(c.fdp, 0, 2 * c.a.T + 2));
  return b;
}

const kvp_compress_params* make_params(Ctx& c) {
  if (c.fdp.ConsumeIntegralInRange<int>(0, 5) == 0) return nullptr;
  auto* p = c.arena.alloc_n<kvp_compress_params>(1);
  *p = kvp_compress_default_params();
  if (c.fdp.ConsumeIntegralInRange<int>(0, 15) == 0)
    p->struct_size = c.fdp.ConsumeIntegral<std::uint32_t>();
  p->budget = make_budget(c);
  p->compact = c.fdp.ConsumeIntegralInRange<int>(0, 4) == 0 ? 0 : 1;
  p->threads = static_cast<int>(pick_int(c.fdp, -1, 2));
  if (c.fdp.ConsumeIntegralInRange<int>(0, 7) == 0) {  // a one-rank shard with fuzzed numbers
    auto* s = c.arena.alloc_n<kvp_head_shard>(1);
    *s = kvp_head_shard{};
    s->rank = pick_int(c.fdp, -1, 1);
    s->ranks = pick_int(c.fdp, 0, 1);
    s->first_head = pick_int(c.fdp, -1, 4);
    s->model_heads = c.fdp.ConsumeBool() ? pick_int(c.fdp, -1, 8) : c.fdp.ConsumeIntegral<std::int64_t>();
    p->shard = s;
  }
  return p;
}

// kvp_compress's per-event inputs (ABI 4: kvzip's scores, ams's credit, RoPE frequencies) over
// buffers sized for the keys actually passed (rows of the chosen stride), so that what the
// library must reject is a fuzzed stride or value, never a short buffer. `prm` stays as it was
// when the keys' extents are too large to back.
const kvp_compress_params* with_event_inputs(Ctx& c, const kvp_compress_params* prm,
                                             const kvp_tensor& k) {
  if (!prm || c.fdp.ConsumeIntegralInRange<int>(0, 3) != 0) return prm;
  if (k.layers < 0 || k.heads < 0 || k.tokens < 0 || k.dim < 0 || k.layers > 64 ||
      k.heads > 64 || k.tokens > 4096 || k.dim > 512)
    return prm;
  auto* p = c.arena.alloc_n<kvp_compress_params>(1);
  *p = *prm;
  const std::int64_t rows = k.layers * k.heads;
  const auto buffer = [&](std::int64_t& stride) {
    // (bounded: pick_int's edge values would ask for buffers of 2^62 floats)
    stride = c.fdp.ConsumeIntegralInRange<std::int64_t>(-1, k.tokens + 3);  // < T: rejected
    const std::int64_t n = std::max<std::int64_t>(rows * std::max(stride, k.tokens), 1);
    auto* b = c.arena.alloc_n<float>(static_cast<std::size_t>(n));
    const kvp_fuzz::Fill f = kvp_fuzz::pick_fill(c.fdp, true);
    for (std::int64_t i = 0; i < n; ++i)
      b[i] = kvp_fuzz::fill_value(f, c.rng, static_cast<std::size_t>(i));
    return b;
  };
  if (c.fdp.ConsumeBool()) p->reconstruction = buffer(p->reconstruction_stride);
  if (c.fdp.ConsumeBool()) p->alloc_state = buffer(p->alloc_state_stride);
  if (c.fdp.ConsumeBool()) {  // rope_pairs floats (the library checks it against head_dim)
    p->rope_pairs = c.fdp.ConsumeIntegralInRange<std::int64_t>(0, k.dim / 2 + 1);
    auto* f = c.arena.alloc_n<float>(static_cast<std::size_t>(p->rope_pairs + 1));
    const kvp_fuzz::Fill fill = kvp_fuzz::pick_fill(c.fdp, true);
    for (std::int64_t i = 0; i <= p->rope_pairs; ++i)
      f[i] = kvp_fuzz::fill_value(fill, c.rng, static_cast<std::size_t>(i));
    p->rope_inv_freq = f;
  }
  return p;
}

// ---- Plug-in scorers ----------------------------------------------------------------------

enum class Score : std::uint8_t { fill, partial, nonfinite, fail, fail_message, nothing };

struct PluginState {
  static constexpr std::uint32_t kMagic = 0x6b767073;
  std::uint32_t magic = kMagic;
  std::string name;
  bool name_null = false;
  bool clone_fails = false;
  bool library_owns = false;  // set when a policy took it (or cloned it)
  std::vector<Score> script;  // one behaviour per score() call, cycled
  std::size_t calls = 0;
  std::uint64_t seed = 0;
  double sink = 0;  // what reading the inputs summed (keeps the reads)
};

std::set<PluginState*>& live_states() {
  static std::set<PluginState*> s;
  return s;
}

PluginState* checked(const void* state, const char* cb) {
  auto* s = static_cast<PluginState*>(const_cast<void*>(state));
  if (!live_states().count(s) || s->magic != PluginState::kMagic)
    finding("plug-in %s() called with a state that is not alive (%p)", cb, state);
  return s;
}

// Reads every element of a view the library handed to the plug-in: ASan checks that it lies in
// the caller's memory.
double touch(const kvp_tensor& t, const char* what) {
  if (!t.data) return 0;
  if (t.layers < 0 || t.heads < 0 || t.tokens < 0 || t.dim < 0)
    finding("plug-in got %s with a negative extent", what);
  if (t.layers == 0 || t.heads == 0 || t.tokens == 0 || t.dim == 0) return 0;
  const int eb = get_enum(t.dtype) == KVP_F32 ? 4 : 2;
  double s = 0;
  for (std::int64_t l = 0; l < t.layers; ++l)
    for (std::int64_t h = 0; h < t.heads; ++h)
      for (std::int64_t k = 0; k < t.tokens; ++k)
        for (std::int64_t i = 0; i < t.dim; ++i) {
          const std::int64_t off =
              l * t.stride_layer + h * t.stride_head + k * t.stride_token + i * t.stride_dim;
          unsigned char b;
          std::memcpy(&b, static_cast<const std::byte*>(t.data) + off * eb, 1);
          s += b;
        }
  return s;
}

const char* plugin_name(const void* state) {
  PluginState* s = checked(state, "name");
  return s->name_null ? nullptr : s->name.c_str();
}

int plugin_score(void* state, const kvp_score_args* args) {
  PluginState* s = checked(state, "score");
  if (!args) finding("plug-in score() got NULL args");
  const kvp_tensor& k = args->keys;
  s->sink += touch(k, "keys") + touch(args->values, "values") + touch(args->queries, "queries");
  const std::int64_t n = k.layers * k.heads * k.tokens;
  if (n > 0 && !args->scores) finding("plug-in score() got no score buffer for %lld scores",
                                      static_cast<long long>(n));
  const Score b = s->script.empty() ? Score::fill : s->script[s->calls++ % s->script.size()];
  kvp_fuzz::Rng rng(s->seed + s->calls);
  switch (b) {
    case Score::fail:
      return static_cast<int>(rng.next() % 3) - 2 == 0 ? 7 : -1;
    case Score::fail_message:
      kvp_plugin_set_error(rng.next() % 4 == 0 ? nullptr : "fuzz plug-in says no");
      return 3;
    case Score::nothing:
      return 0;
    default:
      break;
  }
  const std::int64_t upto = b == Score::partial ? n / 2 : n;
  for (std::int64_t i = 0; i < upto; ++i) {
    auto v = static_cast<float>(rng.uniform());
    if (rng.next() % 5 == 0) v = static_cast<float>(rng.next() % 3);  // ties
    if (b == Score::nonfinite && i == n / 3) v = rng.next() % 2 ? NAN : -INFINITY;
    args->scores[i] = v;
  }
  return 0;
}

void plugin_reset(void* state) { checked(state, "reset"); }

void* plugin_clone(const void* state) {
  PluginState* s = checked(state, "clone");
  if (s->clone_fails) return nullptr;
  auto* c = new PluginState(*s);
  c->library_owns = true;  // a clone belongs to the policy made with it
  live_states().insert(c);
  return c;
}

void plugin_free(void* state) {
  PluginState* s = checked(state, "free");
  if (!s->library_owns) finding("the library freed plug-in state '%s', which it does not own",
                                s->name.c_str());
  live_states().erase(s);
  delete s;
}

struct Plugins {
  std::vector<kvp_scorer_plugin> tables;
  std::vector<PluginState*> states;  // states[i] belongs to tables[i] (may be NULL)
};

Plugins make_plugins(Ctx& c) {
  static const char* const kNames[] = {"mine", "p1", "other_2", "snapkv", "adakv", "",
                                       "Bad",  "a b", "external"};
  FuzzedDataProvider& fdp = c.fdp;
  Plugins out;
  const int n = fdp.ConsumeIntegralInRange<int>(0, 3);
  for (int i = 0; i < n; ++i) {
    kvp_scorer_plugin p = kvp_scorer_plugin_default();
    PluginState* s = nullptr;
    if (fdp.ConsumeIntegralInRange<int>(0, 7) != 0) {
      s = new PluginState;
      live_states().insert(s);
      s->name = fdp.ConsumeIntegralInRange<int>(0, 5) == 0
                    ? fdp.ConsumeRandomLengthString(12)
                    : kNames[fdp.ConsumeIntegralInRange<std::size_t>(0, std::size(kNames) - 1)];
      s->name_null = fdp.ConsumeIntegralInRange<int>(0, 15) == 0;
      s->clone_fails = fdp.ConsumeIntegralInRange<int>(0, 3) == 0;
      for (int k = fdp.ConsumeIntegralInRange<int>(0, 4); k > 0; --k)
        s->script.push_back(static_cast<Score>(fdp.ConsumeIntegralInRange<int>(0, 5)));
      s->seed = c.rng.next();
    }
    p.state = s;
    // Without a state the callbacks would have nothing to check: keep them, but only with one.
    p.name = s && fdp.ConsumeIntegralInRange<int>(0, 15) != 0 ? plugin_name : nullptr;
    p.score = s && fdp.ConsumeIntegralInRange<int>(0, 15) != 0 ? plugin_score : nullptr;
    p.reset = s && fdp.ConsumeBool() ? plugin_reset : nullptr;
    p.clone = s && fdp.ConsumeBool() ? plugin_clone : nullptr;
    p.free = s ? plugin_free : nullptr;
    if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0) p.struct_size = fdp.ConsumeIntegral<std::uint32_t>();
    p.needs = fdp.ConsumeIntegralInRange<int>(0, 9) == 0 ? fdp.ConsumeIntegral<std::uint32_t>()
                                                         : fdp.ConsumeIntegralInRange<std::uint32_t>(0, 7) & 6u;
    p.query_window = pick_int(fdp, -1, 4, kvp_fuzz::Edges::sizes);
    p.sinks = pick_int(fdp, 0, 3);
    p.recent = pick_int(fdp, 0, 3);
    out.tables.push_back(p);
    out.states.push_back(s);
  }
  return out;
}

// ---- Handles ------------------------------------------------------------------------------

struct SessionSlot {
  kvp_session* s = nullptr;
  kvp_session_config cfg{};
};

struct World {
  kvp_policy* policies[4] = {};
  SessionSlot sessions[3];
  std::vector<PluginState*> caller_states;  // states the harness still owns
};

const char* pick_spec(Ctx& c, Arena& arena) {
  static const char* const kSpecs[] = {
      "streaming",
      "streaming(sinks=2) | uniform",
      "snapkv(window=2,kernel=3) | adakv",
      "snapkv(window=2,pool=max,reduce=max,sinks=1) | pyramid(window=2)",
      "snapkv(window=1) | ams(window=1)",
      "h2o",
      "h2o(recent=0.5,normalize=true,reduce=sum) | adakv(alpha=0.5)",
      "tova",
      "knorm | uniform",
      "keydiff | pyramid(beta=4)",
      "snapkv(window=2) | depthkv(weights=1:2:3)",
      "knorm | depthkv(weights=1)",
      "streaming | semantic(tau=0.5,chunk=2)",
      "h2o | nearest",
      "streaming | int2",
      "knorm | int4(group=8)",
      "snapkv(window=1) | kivi",
      "kvzip(sinks=1) | adakv",
      "expected(window=1)",
      "knorm | ams(window=1,min_seg_len=1)",
      "mine",
      "mine | adakv",
      "p1 | pyramid | ams",
      "other_2 | semantic",
      "mine(x=1)",
      "",
      "nope | uniform",
  };
  FuzzedDataProvider& fdp = c.fdp;
  if (fdp.ConsumeIntegralInRange<int>(0, 9) == 0) return nullptr;
  if (fdp.ConsumeIntegralInRange<int>(0, 5) == 0) {
    const std::string s = fdp.ConsumeRandomLengthString(48);
    char* p = arena.alloc_n<char>(s.size() + 1);
    std::memcpy(p, s.c_str(), s.size() + 1);
    return p;
  }
  return kSpecs[fdp.ConsumeIntegralInRange<std::size_t>(0, std::size(kSpecs) - 1)];
}

void check_info(const kvp_policy* p) {
  kvp_policy_info info{};
  if (check_status(kvp_policy_get_info(p, &info), "kvp_policy_get_info") != KVP_OK)
    finding("kvp_policy_get_info failed on a live policy: %s", kvp_last_error());
  if (!info.spec || !info.scorer || info.spec[0] == '\0' || info.scorer[0] == '\0')
    finding("kvp_policy_get_info: empty spec or scorer");
  if ((info.needs & ~(KVP_NEEDS_VALUES | KVP_NEEDS_QUERIES | KVP_NEEDS_RECONSTRUCTION)) != 0 ||
      info.query_window < -1)
    finding("kvp_policy_get_info: needs %u, query_window %lld", info.needs,
            static_cast<long long>(info.query_window));
}

// Marks which state a new policy took: the one whose table's name is the policy's scorer.
void record_ownership(World& w, const kvp_policy* p, const Plugins& pl) {
  kvp_policy_info info{};
  check_status(kvp_policy_get_info(p, &info), "kvp_policy_get_info");
  for (std::size_t i = 0; i < pl.tables.size(); ++i) {
    PluginState* s = pl.states[i];
    if (s && !s->name_null && s->name == info.scorer && pl.tables[i].name) s->library_owns = true;
  }
  for (PluginState* s : pl.states)
    if (s && !s->library_owns) w.caller_states.push_back(s);
}

void op_create(Ctx& c, World& w, int slot) {
  Plugins pl = make_plugins(c);
  const char* spec = pick_spec(c, c.arena);
  kvp_policy* p = reinterpret_cast<kvp_policy*>(std::uintptr_t{8});  // must be overwritten
  const bool with_ptr = c.fdp.ConsumeIntegralInRange<int>(0, 15) != 0;
  const kvp_scorer_plugin* tables = pl.tables.empty() && c.fdp.ConsumeBool() ? nullptr
                                                                             : pl.tables.data();
  const kvp_status st =
      pl.tables.empty() && c.fdp.ConsumeBool()
          ? check_status(kvp_policy_create(spec, with_ptr ? &p : nullptr), "kvp_policy_create")
          : check_status(kvp_policy_create_with_plugins(spec, tables, pl.tables.size(),
                                                        with_ptr ? &p : nullptr),
                         "kvp_policy_create_with_plugins");
  if (st != KVP_OK) {
    if (with_ptr && p != nullptr) finding("a failed kvp_policy_create left *out = %p", (void*)p);
    for (PluginState* s : pl.states)
      if (s) w.caller_states.push_back(s);  // nothing is owned on failure
    return;
  }
  if (!p) finding("kvp_policy_create succeeded with *out = NULL");
  check_info(p);
  record_ownership(w, p, pl);
  kvp_policy_destroy(w.policies[slot]);
  w.policies[slot] = p;
}

// ---- Dense compression ----------------------------------------------------------------------

struct SelBuf {
  kvp_selection sel{};
  std::int64_t rows = 0;  // entries counts holds (when not NULL)
};

SelBuf make_selection(Ctx& c, std::int64_t L, std::int64_t H, std::int64_t T) {
  FuzzedDataProvider& fdp = c.fdp;
  SelBuf b;
  kvp_selection& s = b.sel;
  const bool fuzzed = fdp.ConsumeIntegralInRange<int>(0, 7) == 0;
  s.layers = fuzzed ? pick_int(fdp, 0, 4) : L;
  s.heads = fuzzed ? pick_int(fdp, 0, 4) : H;
  s.capacity = fdp.ConsumeIntegralInRange<int>(0, 5) == 0 ? pick_int(fdp, -1, T + 2) : T;
  const __int128 rows = static_cast<__int128>(s.layers) * s.heads;
  if (rows >= 0 && rows <= kMaxElems && fdp.ConsumeIntegralInRange<int>(0, 15) != 0) {
    b.rows = static_cast<std::int64_t>(rows);
    s.counts = c.arena.alloc_n<std::int64_t>(static_cast<std::size_t>(b.rows));
    std::fill_n(s.counts, b.rows, -7);
  }
  const bool small = rows >= 0 && rows <= kMaxElems && s.capacity >= 0 && s.capacity <= kMaxElems;
  const __int128 idx = small ? rows * s.capacity : 0;
  if (small && idx <= kMaxElems && fdp.ConsumeIntegralInRange<int>(0, 5) != 0) {
    s.indices = c.arena.alloc_n<std::int32_t>(static_cast<std::size_t>(idx));
    std::fill_n(s.indices, static_cast<std::int64_t>(idx), -7);
  }
  return b;
}

std::size_t tensor_bytes(const kvp_tensor& t) {
  const std::int64_t ext[4] = {t.layers, t.heads, t.tokens, t.dim};
  const std::int64_t str[4] = {t.stride_layer, t.stride_head, t.stride_token, t.stride_dim};
  const int dt = get_enum(t.dtype);
  const auto r = reach(ext, str, 4);
  if (!t.data || !r) return 0;
  return static_cast<std::size_t>(std::max<std::int64_t>(*r, 1) * elem_bytes(dt));
}

void watch_tensor(Watch& w, const kvp_tensor& t) { w.add(t.data, tensor_bytes(t)); }
void watch_selection(Watch& w, const SelBuf& b) {
  w.add(b.sel.counts, static_cast<std::size_t>(b.rows) * sizeof(std::int64_t));
  if (b.sel.indices)
    w.add(b.sel.indices,
          static_cast<std::size_t>(b.rows * b.sel.capacity) * sizeof(std::int32_t));
}

// After a successful selection: ascending indices inside the cache; with compaction, row i of
// every kept list holds what row kept[i] held before (compared against `before`).
void check_compressed(const kvp_tensor& kv, const std::vector<std::byte>& before,
                      const kvp_selection& s, bool compacted, const char* call) {
  if (!s.counts || !kv.data) return;  // no counts asked for, or an absent tensor (values)
  const int dt = get_enum(kv.dtype);
  const std::size_t eb = static_cast<std::size_t>(elem_bytes(dt));
  for (std::int64_t l = 0; l < s.layers; ++l)
    for (std::int64_t h = 0; h < s.heads; ++h) {
      const std::int64_t r = l * s.heads + h, n = s.counts[r];
      if (n < 0 || n > kv.tokens)
        finding("%s: row %lld keeps %lld of %lld tokens", call, static_cast<long long>(r),
                static_cast<long long>(n), static_cast<long long>(kv.tokens));
      if (!s.indices) continue;
      const std::int32_t* k = s.indices + r * s.capacity;
      for (std::int64_t i = 0; i < n; ++i) {
        if (k[i] < 0 || k[i] >= kv.tokens || (i > 0 && k[i] <= k[i - 1]))
          finding("%s: row %lld index %d at %lld is not ascending in range", call,
                  static_cast<long long>(r), k[i], static_cast<long long>(i));
        if (!compacted || before.empty()) continue;
        for (std::int64_t e = 0; e < kv.dim; ++e) {
          const std::int64_t base = l * kv.stride_layer + h * kv.stride_head + e * kv.stride_dim;
          const std::size_t now = static_cast<std::size_t>(base + i * kv.stride_token) * eb;
          const std::size_t was = static_cast<std::size_t>(base + k[i] * kv.stride_token) * eb;
          if (std::memcmp(static_cast<const std::byte*>(kv.data) + now, before.data() + was, eb))
            finding("%s: after compaction row (%lld,%lld) token %lld dim %lld is not old token "
                    "%d", call, static_cast<long long>(l), static_cast<long long>(h),
                    static_cast<long long>(i), static_cast<long long>(e), k[i]);
        }
      }
    }
}

std::vector<std::byte> snapshot(const kvp_tensor& t) {
  const std::size_t n = tensor_bytes(t);
  const auto* p = static_cast<const std::byte*>(t.data);
  return n ? std::vector<std::byte>(p, p + n) : std::vector<std::byte>{};
}

kvp_policy* pick_policy(Ctx& c, World& w) {
  return w.policies[c.fdp.ConsumeIntegralInRange<int>(0, 3)];
}

void op_compress(Ctx& c, World& w) {
  const Anchor& a = c.a;
  kvp_policy* p = pick_policy(c, w);
  kvp_tensor k = make_tensor(c, a.L, a.H, a.T, a.d, a.dtype);
  const kvp_compress_params* prm = with_event_inputs(c, make_params(c), k);
  kvp_tensor v = make_tensor(c, a.L, a.H, a.T, a.d, a.dtype);
  kvp_tensor q = make_tensor(c, a.L, a.H * a.g, a.nq, a.d, a.dtype);
  SelBuf out = make_selection(c, a.L, a.H, a.T);
  const bool null_k = c.fdp.ConsumeIntegralInRange<int>(0, 31) == 0;
  const bool null_out = c.fdp.ConsumeIntegralInRange<int>(0, 31) == 0;
  Watch watch;
  watch_tensor(watch, k);
  watch_tensor(watch, v);
  watch_tensor(watch, q);
  watch_selection(watch, out);
  const auto k_before = snapshot(k), v_before = snapshot(v);
  const kvp_status st =
      check_status(kvp_compress(p, prm, null_k ? nullptr : &k, &v, &q, nullptr, 0,
                                null_out ? nullptr : &out.sel),
                   "kvp_compress");
  if (st != KVP_OK) return watch.require_unchanged("kvp_compress");
  const bool compacted = prm ? prm->compact != 0 : true;
  check_compressed(k, k_before, out.sel, compacted, "kvp_compress (keys)");
  check_compressed(v, v_before, out.sel, compacted, "kvp_compress (values)");
}

void op_batch(Ctx& c, World& w) {
  const Anchor& a = c.a;
  kvp_policy* p = pick_policy(c, w);
  const kvp_compress_params* prm = make_params(c);
  const auto n = c.fdp.ConsumeIntegralInRange<std::size_t>(0, 3);
  auto* seqs = c.arena.alloc_n<kvp_sequence>(std::max<std::size_t>(n, 1));
  std::vector<SelBuf> outs;
  Watch watch;
  std::vector<std::vector<std::byte>> kb, vb;
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t T = c.fdp.ConsumeBool() ? a.T : c.fdp.ConsumeIntegralInRange<std::int64_t>(0, 12);
    kvp_sequence& s = seqs[i];
    s.keys = make_tensor(c, a.L, a.H, T, a.d, a.dtype);
    s.values = make_tensor(c, a.L, a.H, T, a.d, a.dtype);
    s.queries = make_tensor(c, a.L, a.H * a.g, std::min(a.nq, T), a.d, a.dtype);
    s.budget = nullptr;
    if (c.fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {
      auto* b = c.arena.alloc_n<kvp_budget>(1);
      *b = make_budget(c);
      s.budget = b;
    }
    outs.push_back(make_selection(c, a.L, a.H, T));
    watch_tensor(watch, s.keys);
    watch_tensor(watch, s.values);
    watch_selection(watch, outs.back());
    kb.push_back(snapshot(s.keys));
    vb.push_back(snapshot(s.values));
  }
  kvp_selection* out = nullptr;
  if (c.fdp.ConsumeIntegralInRange<int>(0, 5) != 0) {
    out = c.arena.alloc_n<kvp_selection>(std::max<std::size_t>(n, 1));
    for (std::size_t i = 0; i < n; ++i) out[i] = outs[i].sel;
  }
  const kvp_status st = check_status(kvp_compress_batch(p, prm, n ? seqs : nullptr, n, out),
                                     "kvp_compress_batch");
  if (st != KVP_OK) return watch.require_unchanged("kvp_compress_batch");
  const bool compacted = prm ? prm->compact != 0 : true;
  if (out)
    for (std::size_t i = 0; i < n; ++i) {
      check_compressed(seqs[i].keys, kb[i], out[i], compacted, "kvp_compress_batch (keys)");
      check_compressed(seqs[i].values, vb[i], out[i], compacted, "kvp_compress_batch (values)");
    }
}

// ---- Paged compression ----------------------------------------------------------------------

kvp_paged_tensor make_paged(Ctx& c, std::int64_t blocks, std::int64_t page, int dtype_hint) {
  FuzzedDataProvider& fdp = c.fdp;
  const Anchor& a = c.a;
  const int dtype = pick_dtype(c, dtype_hint);
  kvp_paged_tensor t;
  const int mode = fdp.ConsumeIntegralInRange<int>(0, 5);
  if (mode <= 3) {  // the enums go by value: only valid ones (an invalid one is UB in C++)
    t = kvp_paged_tensor_make(mode % 2 ? KVP_LAYOUT_HND : KVP_LAYOUT_NHD, nullptr, KVP_F32,
                              blocks, a.L, a.H, page, a.d);
  } else {
    t = {};
    constexpr auto kSizes = kvp_fuzz::Edges::sizes;
    t.num_blocks = pick_int(fdp, 0, 8, kSizes), t.layers = pick_int(fdp, 0, 3, kSizes);
    t.heads = pick_int(fdp, 0, 3, kSizes), t.page_size = pick_int(fdp, 0, 5, kSizes);
    t.dim = pick_int(fdp, 0, 5, kSizes);
    t.stride_layer = pick_int(fdp, 0, 512), t.stride_block = pick_int(fdp, 0, 128);
    t.stride_head = pick_int(fdp, 0, 32), t.stride_token = pick_int(fdp, 0, 32);
    t.stride_dim = pick_int(fdp, 0, 2);
  }
  set_enum(t.dtype, dtype);
  const std::int64_t ext[5] = {t.layers, t.num_blocks, t.heads, t.page_size, t.dim};
  const std::int64_t str[5] = {t.stride_layer, t.stride_block, t.stride_head, t.stride_token,
                               t.stride_dim};
  back(c, reach(ext, str, 5), dtype, &t.data, true);
  return t;
}

std::size_t paged_bytes(const kvp_paged_tensor& t) {
  const std::int64_t ext[5] = {t.layers, t.num_blocks, t.heads, t.page_size, t.dim};
  const std::int64_t str[5] = {t.stride_layer, t.stride_block, t.stride_head, t.stride_token,
                               t.stride_dim};
  const int dt = get_enum(t.dtype);
  const auto r = reach(ext, str, 5);
  if (!t.data || !r) return 0;
  return static_cast<std::size_t>(std::max<std::int64_t>(*r, 1) * elem_bytes(dt));
}

void op_paged(Ctx& c, World& w) {
  FuzzedDataProvider& fdp = c.fdp;
  const Anchor& a = c.a;
  kvp_policy* p = pick_policy(c, w);
  const kvp_compress_params* prm = make_params(c);
  const std::int64_t blocks = fdp.ConsumeIntegralInRange<std::int64_t>(0, 10);
  const std::int64_t page = fdp.ConsumeIntegralInRange<std::int64_t>(1, 6);
  kvp_paged_tensor k = make_paged(c, blocks, page, a.dtype);
  kvp_paged_tensor v = make_paged(c, blocks, page, a.dtype);
  const std::uint8_t* shared = nullptr;
  if (k.num_blocks >= 0 && k.num_blocks <= kMaxElems && fdp.ConsumeIntegralInRange<int>(0, 2) == 0) {
    auto* sh = c.arena.alloc_n<std::uint8_t>(static_cast<std::size_t>(k.num_blocks));
    for (std::int64_t b = 0; b < k.num_blocks; ++b) sh[b] = fdp.ConsumeIntegralInRange<int>(0, 3) == 0;
    shared = sh;
  }
  // Requests over disjoint blocks (mostly): a shuffled list of block ids dealt out in order.
  std::vector<std::int32_t> ids(static_cast<std::size_t>(blocks));
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>(i);
  for (std::size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[c.rng.next() % i]);
  std::size_t next_id = 0;
  const auto n = fdp.ConsumeIntegralInRange<std::size_t>(0, 3);
  auto* seqs = c.arena.alloc_n<kvp_paged_sequence>(std::max<std::size_t>(n, 1));
  auto* res = c.arena.alloc_n<kvp_paged_result>(std::max<std::size_t>(n, 1));
  Watch watch;
  watch.add(k.data, paged_bytes(k));
  watch.add(v.data, paged_bytes(v));
  const __int128 rows = static_cast<__int128>(k.layers) * k.heads;
  for (std::size_t i = 0; i < n; ++i) {
    kvp_paged_sequence& s = seqs[i];
    const std::int64_t pages = fdp.ConsumeIntegralInRange<std::int64_t>(0, 4);
    auto* table = c.arena.alloc_n<std::int32_t>(static_cast<std::size_t>(pages));
    for (std::int64_t j = 0; j < pages; ++j)
      table[j] = fdp.ConsumeIntegralInRange<int>(0, 9) == 0
                     ? static_cast<std::int32_t>(pick_int(fdp, -1, blocks))
                     : (next_id < ids.size() ? ids[next_id++] : 0);
    s.block_table = fdp.ConsumeIntegralInRange<int>(0, 31) == 0 ? nullptr : table;
    s.num_pages = fdp.ConsumeIntegralInRange<int>(0, 15) == 0 ? pick_int(fdp, -1, pages) : pages;
    s.num_pages = std::min(s.num_pages, pages);  // never more entries than the table has
    s.length = fdp.ConsumeIntegralInRange<int>(0, 7) == 0
                   ? pick_int(fdp, 0, pages * page + 1)
                   : fdp.ConsumeIntegralInRange<std::int64_t>(0, pages * page);
    s.queries = make_tensor(c, a.L, a.H * a.g,
                            std::min<std::int64_t>(a.nq, std::max<std::int64_t>(s.length, 0)),
                            a.d, a.dtype);
    s.budget = nullptr;
    if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {
      auto* b = c.arena.alloc_n<kvp_budget>(1);
      *b = make_budget(c);
      s.budget = b;
    }
    kvp_paged_result& r = res[i];
    r = {};
    r.new_length = r.pages_used = r.num_freed = -5;
    r.compacted = -5;
    r.freed_capacity = fdp.ConsumeIntegralInRange<int>(0, 5) == 0 ? pick_int(fdp, -1, pages + 1)
                                                                  : pages;
    if (r.freed_capacity >= 0 && r.freed_capacity <= kMaxElems && fdp.ConsumeIntegralInRange<int>(0, 15) != 0) {
      r.freed_blocks = c.arena.alloc_n<std::int32_t>(static_cast<std::size_t>(r.freed_capacity));
      std::fill_n(r.freed_blocks, r.freed_capacity, -7);
      watch.add(r.freed_blocks, static_cast<std::size_t>(r.freed_capacity) * 4);
    }
    if (rows >= 0 && rows <= kMaxElems && fdp.ConsumeBool()) {
      r.lengths = c.arena.alloc_n<std::int64_t>(static_cast<std::size_t>(rows));
      std::fill_n(r.lengths, static_cast<std::int64_t>(rows), -7);
      watch.add(r.lengths, static_cast<std::size_t>(rows) * 8);
    }
    watch.add(&r, sizeof r);
  }
  const bool null_res = fdp.ConsumeIntegralInRange<int>(0, 31) == 0;
  const kvp_status st = check_status(
      kvp_compress_paged(p, prm, fdp.ConsumeIntegralInRange<int>(0, 31) == 0 ? nullptr : &k, &v,
                         shared, n ? seqs : nullptr, n, null_res ? nullptr : res),
      "kvp_compress_paged");
  if (st != KVP_OK && st != KVP_ERROR_SHARED_BLOCK) return watch.require_unchanged("kvp_compress_paged");
  bool any_shared = false;
  for (std::size_t i = 0; i < n; ++i) {
    const kvp_paged_result& r = res[i];
    const kvp_paged_sequence& s = seqs[i];
    if (r.compacted != 0 && r.compacted != 1) finding("paged: compacted = %d", r.compacted);
    any_shared = any_shared || r.compacted == 0;
    const std::int64_t pages = (s.length + k.page_size - 1) / k.page_size;
    if (r.new_length < 0 || r.new_length > s.length || r.pages_used < 0 || r.pages_used > pages ||
        r.num_freed < 0 || r.num_freed > r.freed_capacity || r.pages_used + r.num_freed != pages)
      finding("paged: request %zu of length %lld (%lld pages) -> new_length %lld, pages_used %lld, "
              "freed %lld", i, static_cast<long long>(s.length), static_cast<long long>(pages),
              static_cast<long long>(r.new_length), static_cast<long long>(r.pages_used),
              static_cast<long long>(r.num_freed));
    for (std::int64_t j = 0; j < r.num_freed; ++j)
      if (std::find(s.block_table + r.pages_used, s.block_table + pages, r.freed_blocks[j]) ==
          s.block_table + pages)
        finding("paged: request %zu freed block %d, not one of its emptied pages", i,
                r.freed_blocks[j]);
    if (r.lengths)
      for (std::int64_t j = 0; j < static_cast<std::int64_t>(rows); ++j)
        if (r.lengths[j] < 0 || r.lengths[j] > r.new_length)
          finding("paged: request %zu head row %lld keeps %lld (new_length %lld)", i,
                  static_cast<long long>(j), static_cast<long long>(r.lengths[j]),
                  static_cast<long long>(r.new_length));
  }
  if ((st == KVP_ERROR_SHARED_BLOCK) != any_shared)
    finding("kvp_compress_paged returned %d but a request has compacted == 0: %d", st, any_shared);
}

// ---- Sessions -------------------------------------------------------------------------------

void op_session_create(Ctx& c, World& w, int slot) {
  FuzzedDataProvider& fdp = c.fdp;
  const Anchor& a = c.a;
  kvp_session_config cfg = kvp_session_default_config();
  const bool fuzzed = fdp.ConsumeIntegralInRange<int>(0, 5) == 0;
  constexpr auto kSizes = kvp_fuzz::Edges::sizes;
  cfg.layers = fuzzed ? pick_int(fdp, 0, 4, kSizes) : a.L;
  cfg.kv_heads = fuzzed ? pick_int(fdp, 0, 4, kSizes) : a.H;
  cfg.q_heads = fuzzed ? pick_int(fdp, 0, 8, kSizes) : a.H * a.g;
  cfg.head_dim = fuzzed ? pick_int(fdp, 0, 64, kSizes) : a.d;
  if (fdp.ConsumeBool()) cfg.budget = make_budget(c);
  cfg.initial_capacity = fdp.ConsumeBool() ? pick_int(fdp, 1, 32, kSizes) : 256;
  cfg.decode_interval = fdp.ConsumeBool() ? pick_int(fdp, 0, 3) : 0;
  cfg.has_decode_target = fdp.ConsumeIntegralInRange<int>(0, 3) == 0;
  cfg.decode_target = make_budget(c);
  cfg.threads = static_cast<int>(pick_int(fdp, 0, 2));
  if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0) cfg.struct_size = fdp.ConsumeIntegral<std::uint32_t>();
  kvp_session* s = nullptr;
  const bool null_cfg = fdp.ConsumeIntegralInRange<int>(0, 31) == 0;
  const kvp_policy* p = pick_policy(c, w);
  kvp_policy_info info{};
  if (p && kvp_policy_get_info(p, &info) == KVP_OK &&
      kvp_fuzz::window_too_large_to_back(info.query_window))
    return;
  const kvp_status st = check_status(kvp_session_create(p, null_cfg ? nullptr : &cfg, &s),
                                     "kvp_session_create");
  if (st != KVP_OK) {
    if (s) finding("a failed kvp_session_create left *out = %p", static_cast<void*>(s));
    return;
  }
  if (!s) finding("kvp_session_create succeeded with *out = NULL");
  kvp_session_destroy(w.sessions[slot].s);
  w.sessions[slot] = {s, cfg};
}

void op_session(Ctx& c, World& w, int which) {
  FuzzedDataProvider& fdp = c.fdp;
  SessionSlot& ss = w.sessions[fdp.ConsumeIntegralInRange<int>(0, 2)];
  kvp_session* s = fdp.ConsumeIntegralInRange<int>(0, 31) == 0 ? nullptr : ss.s;
  const kvp_session_config& cf = ss.cfg;
  const std::int64_t layer =
      fdp.ConsumeIntegralInRange<int>(0, 9) == 0 ? pick_int(fdp, -1, 4)
                                                 : fdp.ConsumeIntegralInRange<std::int64_t>(0, std::max<std::int64_t>(cf.layers - 1, 0));
  Watch watch;
  switch (which) {
    case 0: {  // append
      const std::int64_t n = fdp.ConsumeIntegralInRange<std::int64_t>(0, 6);
      kvp_tensor k = make_tensor(c, 1, cf.kv_heads, n, cf.head_dim, KVP_F32, false);
      kvp_tensor v = make_tensor(c, 1, cf.kv_heads, n, cf.head_dim, KVP_F32, false);
      kvp_tensor q = make_tensor(c, 1, cf.q_heads, n, cf.head_dim, KVP_F32, false);
      check_status(kvp_session_append(s, layer, &k, &v, fdp.ConsumeBool() ? &q : nullptr),
                   "kvp_session_append");
      break;
    }
    case 1: {  // attend
      const std::int64_t n = fdp.ConsumeIntegralInRange<std::int64_t>(0, 3);
      kvp_tensor q = make_tensor(c, 1, cf.q_heads, n, cf.head_dim, KVP_F32, false);
      const std::int64_t need = cf.q_heads * n * cf.head_dim;
      std::int64_t len = fdp.ConsumeIntegralInRange<int>(0, 5) == 0 ? pick_int(fdp, 0, need + 1) : need;
      float* out = nullptr;
      if (len >= 0 && len <= kMaxElems) {
        out = c.arena.alloc_n<float>(static_cast<std::size_t>(len));
        std::fill_n(out, len, 0.5f);
        watch.add(out, static_cast<std::size_t>(len) * 4);
      } else {
        len = std::max<std::int64_t>(len, 0);
      }
      if (check_status(kvp_session_attend(s, layer, &q, out, static_cast<std::size_t>(len)),
                       "kvp_session_attend") != KVP_OK)
        watch.require_unchanged("kvp_session_attend");
      break;
    }
    case 2: {  // compress_if_due
      int done = -3;
      const bool want = fdp.ConsumeBool();
      if (check_status(kvp_session_compress_if_due(s, layer, want ? &done : nullptr),
                       "kvp_session_compress_if_due") == KVP_OK &&
          want && done != 0 && done != 1)
        finding("kvp_session_compress_if_due: *compressed = %d", done);
      break;
    }
    case 3: {  // lengths
      const std::int64_t n = fdp.ConsumeIntegralInRange<int>(0, 3) == 0 ? pick_int(fdp, 0, 8) : cf.kv_heads;
      std::int64_t* out = nullptr;
      if (n >= 0 && n <= kMaxElems && fdp.ConsumeIntegralInRange<int>(0, 15) != 0) {
        out = c.arena.alloc_n<std::int64_t>(static_cast<std::size_t>(n));
        std::fill_n(out, n, -7);
        watch.add(out, static_cast<std::size_t>(n) * 8);
      }
      const kvp_status st = check_status(
          kvp_session_lengths(s, layer, out, out ? static_cast<std::size_t>(n) : 0),
          "kvp_session_lengths");
      if (st != KVP_OK) return watch.require_unchanged("kvp_session_lengths");
      for (std::int64_t h = 0; h < cf.kv_heads; ++h)
        if (out[h] < 0) finding("kvp_session_lengths: head %lld has length %lld",
                                static_cast<long long>(h), static_cast<long long>(out[h]));
      break;
    }
    case 4: {  // read
      const std::int64_t head = fdp.ConsumeIntegralInRange<int>(0, 7) == 0
                                    ? pick_int(fdp, -1, 4)
                                    : fdp.ConsumeIntegralInRange<std::int64_t>(0, std::max<std::int64_t>(cf.kv_heads - 1, 0));
      const std::int64_t cap = pick_int(fdp, 0, 64);
      const __int128 rows = static_cast<__int128>(cap) * cf.head_dim;
      float *kb = nullptr, *vb = nullptr;
      std::int32_t* pb = nullptr;
      if (cap >= 0 && cap <= kMaxElems && rows >= 0 && rows <= kMaxElems) {
        if (fdp.ConsumeBool()) kb = c.arena.alloc_n<float>(static_cast<std::size_t>(rows));
        if (fdp.ConsumeBool()) vb = c.arena.alloc_n<float>(static_cast<std::size_t>(rows));
        if (fdp.ConsumeBool()) pb = c.arena.alloc_n<std::int32_t>(static_cast<std::size_t>(cap));
        for (float* b : {kb, vb})
          if (b) std::fill_n(b, static_cast<std::int64_t>(rows), 0.5f), watch.add(b, static_cast<std::size_t>(rows) * 4);
        if (pb) std::fill_n(pb, cap, -7), watch.add(pb, static_cast<std::size_t>(cap) * 4);
      }
      const kvp_status st = check_status(kvp_session_read(s, layer, head, kb, vb, pb, cap),
                                         "kvp_session_read");
      if (st != KVP_OK) return watch.require_unchanged("kvp_session_read");
      if (pb) {
        std::int64_t len = 0;
        std::vector<std::int64_t> lens(static_cast<std::size_t>(cf.kv_heads));
        if (kvp_session_lengths(s, layer, lens.data(), lens.size()) == KVP_OK)
          len = lens[static_cast<std::size_t>(head)];
        for (std::int64_t i = 1; i < len; ++i)
          if (pb[i] <= pb[i - 1]) finding("kvp_session_read: positions not ascending at %lld",
                                          static_cast<long long>(i));
      }
      break;
    }
    default: {  // kv_bytes
      std::size_t bytes = 7;
      const bool want = fdp.ConsumeIntegralInRange<int>(0, 15) != 0;
      check_status(kvp_session_kv_bytes(s, want ? &bytes : nullptr), "kvp_session_kv_bytes");
    }
  }
}

// ---- Everything else ------------------------------------------------------------------------

void op_misc(Ctx& c, World& w) {
  FuzzedDataProvider& fdp = c.fdp;
  switch (fdp.ConsumeIntegralInRange<int>(0, 6)) {
    case 0: {
      const char* s = kvp_status_string(
          static_cast<kvp_status>(fdp.ConsumeIntegralInRange<int>(KVP_OK, KVP_ERROR_INTERNAL)));
      if (!s || !*s) finding("kvp_status_string returned an empty name");
      break;
    }
    case 1:
      if (kvp_abi_version() != KVP_ABI_VERSION || !kvp_version()) finding("version mismatch");
      break;
    case 2: {  // clone
      kvp_policy* out = nullptr;
      const int slot = fdp.ConsumeIntegralInRange<int>(0, 3);
      if (check_status(kvp_policy_clone(pick_policy(c, w), &out), "kvp_policy_clone") == KVP_OK) {
        check_info(out);
        kvp_policy_destroy(w.policies[slot]);
        w.policies[slot] = out;
      } else if (out) {
        finding("a failed kvp_policy_clone left *out = %p", static_cast<void*>(out));
      }
      break;
    }
    case 3:
      check_status(kvp_policy_reset(pick_policy(c, w)), "kvp_policy_reset");
      break;
    case 4: {
      const int slot = fdp.ConsumeIntegralInRange<int>(0, 3);
      kvp_policy_destroy(w.policies[slot]);
      w.policies[slot] = nullptr;
      break;
    }
    case 5: {
      kvp_tensor k = make_tensor(c, c.a.L, c.a.H, c.a.T, c.a.d, c.a.dtype);
      std::size_t bytes = 7;
      if (check_status(kvp_compress_workspace_size(pick_policy(c, w), &k, make_params(c), &bytes),
                       "kvp_compress_workspace_size") == KVP_OK &&
          bytes != 0)
        finding("kvp_compress_workspace_size: %zu bytes on the CPU path", bytes);
      break;
    }
    default: {  // no CUDA in this build: every kvp_cuda_* entry point says so
      std::size_t bytes = 0;
      if (kvp_cuda_device_count() != 0) finding("kvp_cuda_device_count without CUDA");
      if (check_status(kvp_cuda_select_workspace_size(4, 4, &bytes), "kvp_cuda_select_workspace_size") !=
          KVP_ERROR_UNSUPPORTED)
        finding("kvp_cuda_select_workspace_size without CUDA did not say unsupported");
      // The whole-policy device entry points check every argument first (fuzzed here), then
      // refuse; they never succeed and never write.
      const Anchor& a = c.a;
      kvp_policy* p = pick_policy(c, w);
      const kvp_compress_params* prm = make_params(c);
      kvp_tensor k = make_tensor(c, a.L, a.H, a.T, a.d, a.dtype);
      kvp_tensor v = make_tensor(c, a.L, a.H, a.T, a.d, a.dtype);
      kvp_tensor q = make_tensor(c, a.L, a.H * a.g, a.nq, a.d, a.dtype);
      Watch watch;
      watch_tensor(watch, k);
      watch_tensor(watch, v);
      watch_tensor(watch, q);
      kvp_cuda_plan plan{};
      if (check_status(kvp_cuda_compress_plan(p, prm, &k, &v, &q, &plan),
                       "kvp_cuda_compress_plan") == KVP_OK)
        finding("kvp_cuda_compress_plan succeeded without CUDA");
      kvp_csr csr{};
      if (check_status(kvp_cuda_compress(p, prm, &k, &v, &q, nullptr, 0, nullptr, &csr),
                       "kvp_cuda_compress") == KVP_OK)
        finding("kvp_cuda_compress succeeded without CUDA");
      watch.require_unchanged("kvp_cuda_compress");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  Arena arena;
  static constexpr std::int64_t kDims[] = {1, 2, 4, 8, 16, 32};
  Anchor a;
  a.L = fdp.ConsumeIntegralInRange<std::int64_t>(1, 3);
  a.H = fdp.ConsumeIntegralInRange<std::int64_t>(1, 3);
  a.g = fdp.ConsumeIntegralInRange<std::int64_t>(1, 2);
  a.T = fdp.ConsumeIntegralInRange<std::int64_t>(0, 24);
  a.d = kDims[fdp.ConsumeIntegralInRange<std::size_t>(0, std::size(kDims) - 1)];
  a.nq = fdp.ConsumeIntegralInRange<std::int64_t>(0, std::min<std::int64_t>(a.T, 4));
  a.dtype = fdp.ConsumeIntegralInRange<int>(KVP_F32, KVP_BF16);
  Ctx c{fdp, arena, kvp_fuzz::Rng(fdp.ConsumeIntegral<std::uint64_t>()), a};
  World w;
  for (int op = 0; op < 24 && fdp.remaining_bytes() > 0; ++op) {
    switch (fdp.ConsumeIntegralInRange<int>(0, 14)) {
      case 0:
      case 1: op_create(c, w, fdp.ConsumeIntegralInRange<int>(0, 3)); break;
      case 2:
      case 3: op_compress(c, w); break;
      case 4: op_batch(c, w); break;
      case 5: op_paged(c, w); break;
      case 6: op_session_create(c, w, fdp.ConsumeIntegralInRange<int>(0, 2)); break;
      case 7:
      case 8: op_session(c, w, 0); break;
      case 9:
      case 10: op_session(c, w, fdp.ConsumeIntegralInRange<int>(1, 5)); break;
      case 11: {
        const int slot = fdp.ConsumeIntegralInRange<int>(0, 2);
        kvp_session_destroy(w.sessions[slot].s);
        w.sessions[slot] = {};
        break;
      }
      default: op_misc(c, w);
    }
  }
  for (auto& s : w.sessions) kvp_session_destroy(s.s);
  for (auto* p : w.policies) kvp_policy_destroy(p);
  for (PluginState* s : w.caller_states) {
    if (!live_states().count(s)) finding("the library freed a caller's plug-in state");
    live_states().erase(s);
    delete s;
  }
  if (!live_states().empty())
    finding("%zu plug-in state(s) outlived every policy and session holding them",
            live_states().size());
  return 0;
}
