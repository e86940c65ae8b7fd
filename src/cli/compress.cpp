// `kvpolicy compress`: reads keys, values and (optionally) queries from .npy files, checks them
// all, runs one selection of a kvpolicy::Policy over the whole cache (Policy::select, as the C
// ABI's kvp_compress and Python's Policy.compress do) and writes into the output directory:
//   indices.npy  int64 [L][H][K]: kept token indices of each (layer, KV head), ascending, padded
//                with -1 past counts[l, h] (K = the largest count; per-head budgets can differ)
//   counts.npy   int64 [L][H]
//   keys.npy, values.npy  [L][H][K][d], the input dtype: row j < counts[l, h] of head (l, h) is
//                token indices[l, h, j] of the input; rows past the count are zeros
//   summary.json policy, budget, shapes, kept counts per layer and head, kept fraction, seconds
// (a 3-d input [H][T][d] gives the same without the layer axis). Every check runs before the
// first write; the files are written under temporary names and renamed into place at the end,
// so a failure leaves nothing behind (and removes the directory if this run created it).
#include "compress.hpp"

#include <iostream>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>
#include <type_traits>
#include <utility>
#include <vector>

#include "failure.hpp"
#include "kvpolicy/kvpolicy.hpp"
#include "npy.hpp"

namespace kvpolicy_cli {

std::string policy_help() {
  using kvpolicy::detail::names_of;
  return "policy spec, e.g. \"snapkv(window=32) | adakv\": a scorer (" +
         names_of(static_cast<kvpolicy::scorer_types*>(nullptr)) + "), then allocators (" +
         names_of(static_cast<kvpolicy::allocator_types*>(nullptr)) +
         "); mergers and quantizers are Session stages. Stage parameters: README, Policies";
}

namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;  // keys in the order written
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// numpy's notation: (2, 4, 40, 32), (5,).
std::string shape_text(const std::vector<std::int64_t>& s) {
  std::ostringstream os;
  os << '(';
  for (std::size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << (s.size() == 1 ? ",)" : ")");
  return os.str();
}

const char* dtype_text(NpyType t) { return t == NpyType::f32 ? "float32" : "float16"; }

std::string num(double x, const char* fmt = "%.4g") {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, x);
  return buf;
}

// A library message without its "kvpolicy: " prefix.
std::string library_message(const kvpolicy::Error& e) {
  std::string m = e.what();
  const std::string prefix = "kvpolicy: ";
  return m.rfind(prefix, 0) == 0 ? m.substr(prefix.size()) : m;
}

// ---- inputs -----------------------------------------------------------------------------------

struct Input {
  std::string path;
  NpyArray a;
  const std::vector<std::int64_t>& shape() const { return a.shape; }
  std::string describe() const { return path + " " + shape_text(a.shape); }
};

// The first NaN or Inf in C order, reported with its index.
void require_finite(const Input& in) {
  const std::size_t n = in.a.type == NpyType::f32 ? in.a.f32.size() : in.a.f16.size();
  for (std::size_t i = 0; i < n; ++i) {
    const char* what = nullptr;
    if (in.a.type == NpyType::f32) {
      const float x = in.a.f32[i];
      if (std::isnan(x)) what = "NaN";
      else if (std::isinf(x)) what = x > 0 ? "inf" : "-inf";
    } else {
      const std::uint16_t b = in.a.f16[i];
      if ((b & 0x7C00u) == 0x7C00u) what = (b & 0x03FFu) ? "NaN" : (b & 0x8000u) ? "-inf" : "inf";
    }
    if (!what) continue;
    std::vector<std::int64_t> idx(in.a.shape.size());
    std::size_t rest = i;
    for (std::size_t d = idx.size(); d-- > 0;) {
      const auto ext = static_cast<std::size_t>(in.a.shape[d]);
      idx[d] = static_cast<std::int64_t>(rest % ext);
      rest /= ext;
    }
    std::ostringstream os;
    os << "contains " << what << " at index [";
    for (std::size_t d = 0; d < idx.size(); ++d) os << (d ? ", " : "") << idx[d];
    os << "] (the first non-finite value; the policy needs finite inputs)";
    throw Failure(in.path, os.str());
  }
}

// keys/values: [L][H][T][d] or [H][T][d]; queries: [L][Hq][n][d] or [Hq][n][d].
void require_rank(const Input& in, const char* layout4, const char* layout3) {
  const std::size_t r = in.a.shape.size();
  if (r != 3 && r != 4)
    throw Failure(in.path, "expected a 4-d array " + std::string(layout4) + " or a 3-d " +
                               layout3 + ", got " + std::to_string(r) + "-d shape " +
                               shape_text(in.a.shape));
  for (const std::int64_t d : in.a.shape)
    if (d == 0) throw Failure(in.path, "shape " + shape_text(in.a.shape) + " has an empty axis");
}

struct Shape {
  bool lifted = false;  // 3-d input: one layer, results without the layer axis
  std::int64_t L = 0, H = 0, T = 0, D = 0, Dv = 0, Hq = 0, n = 0;
};

Shape check_inputs(const Input& k, const Input& v, const Input* q) {
  require_rank(k, "[layers][kv_heads][tokens][head_dim]", "[kv_heads][tokens][head_dim]");
  require_rank(v, "[layers][kv_heads][tokens][head_dim]", "[kv_heads][tokens][head_dim]");
  if (q) require_rank(*q, "[layers][q_heads][queries][head_dim]", "[q_heads][queries][head_dim]");
  const auto lift = [](const std::vector<std::int64_t>& s) {
    std::vector<std::int64_t> r = s;
    if (r.size() == 3) r.insert(r.begin(), 1);
    return r;
  };
  const auto same_rank = [&](const Input& x, const char* what) {
    if (x.shape().size() != k.shape().size())
      throw Failure(x.path, std::to_string(x.shape().size()) + "-d shape " +
                                shape_text(x.shape()) + " while keys " + k.describe() + " are " +
                                std::to_string(k.shape().size()) + "-d (" + what +
                                " and keys must have the same rank)");
  };
  const auto same_dtype = [&](const Input& x) {
    if (x.a.type != k.a.type)
      throw Failure(x.path, std::string("dtype ") + dtype_text(x.a.type) + " differs from keys " +
                                k.path + "'s " + dtype_text(k.a.type) +
                                " (keys, values and queries must share one dtype)");
  };
  same_rank(v, "values");
  same_dtype(v);
  const auto ks = lift(k.shape()), vs = lift(v.shape());
  Shape s;
  s.lifted = k.shape().size() == 3;
  s.L = ks[0], s.H = ks[1], s.T = ks[2], s.D = ks[3], s.Dv = vs[3];
  if (vs[0] != s.L || vs[1] != s.H || vs[2] != s.T)
    throw Failure(v.path, "shape " + shape_text(v.shape()) + " does not match keys " +
                              k.describe() + ": " + (s.lifted ? "" : "layers, ") +
                              "kv_heads and tokens must be equal");
  if (q) {
    same_rank(*q, "queries");
    same_dtype(*q);
    const auto qs = lift(q->shape());
    s.Hq = qs[1], s.n = qs[2];
    const std::string sh = "shape " + shape_text(q->shape()) + " does not fit keys " + k.describe();
    if (qs[0] != s.L) throw Failure(q->path, sh + ": the number of layers differs");
    if (qs[3] != s.D) throw Failure(q->path, sh + ": head_dim differs");
    if (s.Hq % s.H != 0)
      throw Failure(q->path, sh + ": " + std::to_string(s.Hq) +
                                 " query heads are not a multiple of " + std::to_string(s.H) +
                                 " KV heads (GQA)");
    if (s.n > s.T)
      throw Failure(q->path, sh + ": " + std::to_string(s.n) +
                                 " queries (the last positions of the sequence) for only " +
                                 std::to_string(s.T) + " tokens");
  }
  if (s.T > std::numeric_limits<std::int32_t>::max())
    throw Failure(k.path, "more tokens than the int32 index range holds");
  return s;
}

// ---- options ----------------------------------------------------------------------------------

kvpolicy::Budget make_budget(const CompressOptions& o) {
  if (o.has_budget == o.has_budget_tokens)
    throw Failure("--budget", o.has_budget ? "give --budget or --budget-tokens, not both"
                                           : "give --budget (a fraction of the tokens in (0, 1]) "
                                             "or --budget-tokens (tokens per layer and KV head)");
  if (o.has_budget) {
    if (!(o.budget > 0 && o.budget <= 1))
      throw Failure("--budget", num(o.budget, "%g") +
                                    " is outside (0, 1] (the kept fraction of each layer's "
                                    "tokens; --budget-tokens takes a count)");
    return kvpolicy::Budget::ratio(o.budget);
  }
  if (o.budget_tokens < 1)
    throw Failure("--budget-tokens", "must be at least 1, got " + std::to_string(o.budget_tokens));
  return kvpolicy::Budget::tokens(o.budget_tokens);
}

kvpolicy::Policy make_policy(const std::string& spec) {
  kvpolicy::Policy p;
  try {
    p = kvpolicy::Policy(spec);
  } catch (const kvpolicy::Error& e) {
    throw Failure("--policy", library_message(e));
  }
  if (kvpolicy::has(p.needs(), kvpolicy::Needs::reconstruction))
    throw Failure("--policy", "'" + p.spec() + "' reads context-reconstruction scores, which an "
                              "engine produces with a reconstruction pass through a Session (C: "
                              "kvp_session_reconstruct; Python: Session.reconstruct); kvpolicy "
                              "compress has only the cached keys and values");
  if (p.merger() || p.quantizer())
    throw Failure("--policy", "'" + p.spec() + "' has a " + (p.merger() ? "merger" : "quantizer") +
                                  " stage; kvpolicy compress selects and compacts only (mergers "
                                  "and quantizers run in a Session: the C ABI or Python)");
  return p;
}

// Queries the policy reads, in words, or "" when it reads none.
std::string queries_needed(const kvpolicy::Policy& p) {
  using kvpolicy::Needs;
  const Needs n = p.needs();
  if (!kvpolicy::has(n, Needs::queries) && !kvpolicy::has(n, Needs::accumulated)) return "";
  const std::int64_t w = p.query_window();
  if (w > 0) return "the last " + std::to_string(w) + " queries";
  return "queries (it sums the attention every query given pays to each key)";
}

// The nearest existing ancestor of `out` (itself if it exists) must be a writable directory.
void check_out_dir(const std::string& out) {
  if (out.empty()) throw Failure("--out", "empty path");
  std::error_code ec;
  fs::path p = out;
  while (!p.empty() && !fs::exists(p, ec)) p = p.parent_path();
  if (p.empty()) p = ".";
  const bool self = p == fs::path(out);
  if (!fs::is_directory(p, ec))
    throw Failure(out, self ? "exists and is not a directory"
                            : "cannot create it: " + p.string() + " is not a directory");
  if (::access(p.c_str(), W_OK | X_OK) != 0)
    throw Failure(out, self ? std::string("directory is not writable: ") + std::strerror(errno)
                            : "cannot create it in " + p.string() + ": " + std::strerror(errno));
}

// ---- output -----------------------------------------------------------------------------------

void write_text(const std::string& path, const std::string& text) {
  errno = 0;
  std::ofstream os(path, std::ios::binary | std::ios::trunc);
  if (!os) throw std::runtime_error(std::strerror(errno ? errno : EIO));
  os << text;
  os.close();
  if (!os) throw std::runtime_error(std::strerror(errno ? errno : EIO));
}

// Files written under temporary names in `dir`, renamed into place by commit(). Until then the
// destructor removes them, and the directories this run created.
class StagedDir {
 public:
  explicit StagedDir(std::string dir) : dir_(std::move(dir)) {}
  StagedDir(const StagedDir&) = delete;
  StagedDir& operator=(const StagedDir&) = delete;
  ~StagedDir() {
    if (committed_) return;
    std::error_code ec;
    for (const auto& f : files_) fs::remove(f.first, ec);
    for (const auto& d : created_) fs::remove(d, ec);  // innermost first; only if empty
  }

  void create() {
    std::error_code ec;
    for (fs::path p = dir_; !p.empty() && !fs::exists(p, ec); p = p.parent_path())
      created_.push_back(p);
    fs::create_directories(dir_, ec);
    if (ec) throw Failure(dir_, "cannot create the directory: " + ec.message());
  }

  void write(const std::string& name, const std::function<void(const std::string&)>& fn) {
    const fs::path tmp = fs::path(dir_) / ("." + name + ".tmp-" + std::to_string(::getpid()));
    files_.emplace_back(tmp, name);
    try {
      fn(tmp.string());
    } catch (const std::exception& e) {
      throw Failure(dir_, "cannot write " + name + ": " + e.what());
    }
  }

  void commit() {
    std::vector<fs::path> done;
    for (const auto& [tmp, name] : files_) {
      std::error_code ec;
      fs::rename(tmp, fs::path(dir_) / name, ec);
      if (ec) {
        for (const auto& d : done) fs::remove(d, ec);
        throw Failure(dir_, "cannot rename into " + name + ": " + ec.message());
      }
      done.push_back(fs::path(dir_) / name);
    }
    committed_ = true;
  }

 private:
  std::string dir_;
  std::vector<std::pair<fs::path, std::string>> files_;
  std::vector<fs::path> created_;
  bool committed_ = false;
};

// The result of the selection, in the files' layout.
struct Outcome {
  kvpolicy::Selection sel;
  kvpolicy::ScoreMap scores;
  kvpolicy::Protect protect;  // the tokens the selection kept whatever their score
  std::int64_t width = 0;     // K: the largest kept count
  std::vector<std::int64_t> indices, counts;
  std::vector<unsigned char> keys, values;  // [L][H][K][d] in the input dtype
  double policy_seconds = 0;
};

template <class T>
std::vector<T> elements(NpyArray& a) {
  if constexpr (std::is_same_v<T, float>) {
    return std::move(a.f32);
  } else {
    std::vector<T> v(a.f16.size());
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = T::from_bits(a.f16[i]);
    a.f16 = {};
    return v;
  }
}

// Rows of `src` [L][H][T][d] gathered by the selection into [L][H][K][d] (zeros past a count).
template <class T>
std::vector<unsigned char> gather(const std::vector<T>& src, const Shape& s, std::int64_t d,
                                  const kvpolicy::Selection& sel, std::int64_t width) {
  std::vector<T> out(static_cast<std::size_t>(s.L * s.H * width * d), T(0.f));
  for (std::int64_t l = 0; l < s.L; ++l)
    for (std::int64_t h = 0; h < s.H; ++h) {
      const auto kept = sel.kept(l, h);
      for (std::size_t j = 0; j < kept.size(); ++j)
        std::copy_n(src.begin() + ((l * s.H + h) * s.T + kept[j]) * d, d,
                    out.begin() + ((l * s.H + h) * width + static_cast<std::int64_t>(j)) * d);
    }
  std::vector<unsigned char> bytes(out.size() * sizeof(T));
  if (!bytes.empty()) std::memcpy(bytes.data(), out.data(), bytes.size());
  return bytes;
}

// Where a library error during the selection comes from, for the message's subject.
std::string subject_of(const std::string& message, const CompressOptions& o) {
  if (message.find("quer") != std::string::npos) return o.queries.empty() ? "--queries" : o.queries;
  if (message.find("budget") != std::string::npos)
    return o.has_budget ? "--budget" : "--budget-tokens";
  return "--policy";
}

template <class T>
Outcome run(const kvpolicy::Policy& policy, const kvpolicy::Budget& budget, Input& k, Input& v,
            Input* q, const Shape& s, const CompressOptions& o) {
  const std::vector<T> kd = elements<T>(k.a), vd = elements<T>(v.a);
  std::vector<T> qd;
  if (q) qd = elements<T>(q->a);
  kvpolicy::Inputs<T> in;
  in.keys = kvpolicy::KVView<const T>::hnd(kd.data(), s.L, s.H, s.T, s.D);
  in.values = kvpolicy::KVView<const T>::hnd(vd.data(), s.L, s.H, s.T, s.Dv);
  if (q) in.queries = kvpolicy::KVView<const T>::hnd(qd.data(), s.L, s.Hq, s.n, s.D);

  Outcome r;
  const auto t0 = Clock::now();
  try {
    r.sel = policy.select(kvpolicy::cpu_backend{o.threads}, in, budget, kvpolicy::EventInfo{},
                          &r.scores, &r.protect);
  } catch (const kvpolicy::Error& e) {
    const std::string m = library_message(e);
    throw Failure(subject_of(m, o), m);
  }
  r.policy_seconds = seconds_since(t0);
  r.sel.validate(s.T);

  for (std::int64_t l = 0; l < s.L; ++l)
    for (std::int64_t h = 0; h < s.H; ++h) r.width = std::max(r.width, r.sel.count(l, h));
  r.indices.assign(static_cast<std::size_t>(s.L * s.H * r.width), -1);
  for (std::int64_t l = 0; l < s.L; ++l)
    for (std::int64_t h = 0; h < s.H; ++h) {
      const auto kept = r.sel.kept(l, h);
      r.counts.push_back(static_cast<std::int64_t>(kept.size()));
      std::copy(kept.begin(), kept.end(),
                r.indices.begin() + (l * s.H + h) * r.width);
    }
  r.keys = gather(kd, s, s.D, r.sel, r.width);
  r.values = gather(vd, s, s.Dv, r.sel, r.width);
  return r;
}

// ---- report -----------------------------------------------------------------------------------

// min / mean / max of finite scores; non-finite ones (ams lowers the tokens it does not pick to
// -inf) are counted apart.
struct Stat {
  std::int64_t n = 0, nonfinite = 0;
  double min = 0, max = 0, sum = 0;
  void add(float x) {
    if (!std::isfinite(x)) {
      ++nonfinite;
      return;
    }
    min = n ? std::min(min, double(x)) : x;
    max = n ? std::max(max, double(x)) : x;
    sum += x;
    ++n;
  }
  std::string text() const {
    std::string t = n ? num(min) + " / " + num(sum / double(n)) + " / " + num(max) : "-";
    if (nonfinite) t += " (+" + std::to_string(nonfinite) + " non-finite)";
    return t;
  }
};

// Rows of cells printed as left-aligned columns two spaces apart.
void print_table(std::ostream& os, const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> w;
  for (const auto& r : rows)
    for (std::size_t c = 0; c < r.size(); ++c) {
      if (w.size() <= c) w.push_back(0);
      w[c] = std::max(w[c], r[c].size());
    }
  for (const auto& r : rows) {
    std::string line;
    for (std::size_t c = 0; c < r.size(); ++c) {
      line += r[c];
      if (c + 1 < r.size()) line.append(w[c] + 2 - r[c].size(), ' ');
    }
    os << line << '\n';
  }
}

void print_report(std::ostream& os, const Outcome& r, const Shape& s) {
  os << "\nkept tokens per layer and KV head (of " << s.T << " each)\n";
  std::vector<std::vector<std::string>> rows = {{"layer", "kept", "fraction", "per KV head"}};
  for (std::int64_t l = 0; l < s.L; ++l) {
    std::int64_t sum = 0;
    std::string heads;
    for (std::int64_t h = 0; h < s.H; ++h) {
      sum += r.sel.count(l, h);
      if (h) heads += ' ';  // (not `(h ? " " : "") + ...`: GCC 12's false -Wrestrict, bug 105329)
      heads += std::to_string(r.sel.count(l, h));
    }
    rows.push_back({std::to_string(l), std::to_string(sum) + "/" + std::to_string(s.H * s.T),
                    num(100.0 * double(sum) / double(s.H * s.T), "%.1f%%"), heads});
  }
  print_table(os, rows);
  if (r.scores.layers() != s.L || r.scores.heads() != s.H || r.scores.tokens() != s.T) {
    os << "\nscores: the policy returned none\n";
    return;
  }
  // Protected tokens (the first `sinks`, the last `recent`) are kept whatever their score (snapkv
  // gives its window the largest float): they are counted, not averaged.
  const std::int64_t sinks = std::min(r.protect.sinks, s.T);
  const std::int64_t recent_begin = std::max(sinks, s.T - r.protect.recent);
  os << "\nscores of kept and evicted tokens (the policy's; higher = keep): min / mean / max\n"
     << "(without the protected tokens, " << sinks << " sinks + " << s.T - recent_begin
     << " recent per head, which are kept whatever their score)\n";
  rows = {{"layer", "head", "kept", "protected", "kept scores", "evicted scores"}};
  for (std::int64_t l = 0; l < s.L; ++l) {
    Stat layer_kept, layer_evicted;
    std::int64_t layer_count = 0;
    for (std::int64_t h = 0; h < s.H; ++h) {
      std::vector<char> kept(static_cast<std::size_t>(s.T), 0);
      for (const std::int32_t t : r.sel.kept(l, h)) kept[static_cast<std::size_t>(t)] = 1;
      Stat a, b;
      const auto row = r.scores.row(l, h);
      for (std::int64_t t = 0; t < s.T; ++t) {
        if (t < sinks || t >= recent_begin) continue;
        const auto i = static_cast<std::size_t>(t);
        (kept[i] ? a : b).add(row[i]);
        (kept[i] ? layer_kept : layer_evicted).add(row[i]);
      }
      layer_count += r.sel.count(l, h);
      rows.push_back({std::to_string(l), std::to_string(h), std::to_string(r.sel.count(l, h)),
                      std::to_string(sinks + s.T - recent_begin), a.text(), b.text()});
    }
    if (s.H > 1)
      rows.push_back({std::to_string(l), "all", std::to_string(layer_count),
                      std::to_string(s.H * (sinks + s.T - recent_begin)), layer_kept.text(),
                      layer_evicted.text()});
  }
  print_table(os, rows);
}

}  // namespace

void compress(const CompressOptions& o, std::ostream& out) {
  const auto t0 = Clock::now();
  // Options first (cheap), then every input, then the selection; nothing is written before all
  // of them passed.
  const kvpolicy::Budget budget = make_budget(o);
  const kvpolicy::Policy policy = make_policy(o.policy);
  const std::string needs_q = queries_needed(policy);
  if (!needs_q.empty() && o.queries.empty())
    throw Failure("--queries", "policy '" + policy.spec() + "' reads " + needs_q +
                                   ", but no --queries file was given");
  check_out_dir(o.out);

  Input k{o.keys, read_npy(o.keys)};
  Input v{o.values, read_npy(o.values)};
  Input qin;
  Input* q = nullptr;
  if (!o.queries.empty()) {
    qin = Input{o.queries, read_npy(o.queries)};
    q = &qin;
  }
  const Shape s = check_inputs(k, v, q);
  require_finite(k);
  require_finite(v);
  if (q) require_finite(*q);
  const NpyType type = k.a.type;
  const std::vector<std::int64_t> k_shape = k.shape(), v_shape = v.shape();
  const std::vector<std::int64_t> q_shape = q ? q->shape() : std::vector<std::int64_t>{};
  const double read_seconds = seconds_since(t0);

  Outcome r = type == NpyType::f32 ? run<float>(policy, budget, k, v, q, s, o)
                                   : run<kvpolicy::half>(policy, budget, k, v, q, s, o);

  // Output shapes: a 3-d input has no layer axis.
  const auto shape_of = [&](std::vector<std::int64_t> dims) {
    if (s.lifted) dims.erase(dims.begin());
    return dims;
  };
  const std::vector<std::int64_t> idx_shape = shape_of({s.L, s.H, r.width});
  const std::vector<std::int64_t> cnt_shape = shape_of({s.L, s.H});
  const std::vector<std::int64_t> k_out = shape_of({s.L, s.H, r.width, s.D});
  const std::vector<std::int64_t> v_out = shape_of({s.L, s.H, r.width, s.Dv});
  const std::string dt = dtype_text(type);

  const auto t_write = Clock::now();
  StagedDir dir(o.out);
  dir.create();
  dir.write("indices.npy", [&](const std::string& p) {
    write_npy(p, "int64", idx_shape, r.indices.data(), r.indices.size() * sizeof(std::int64_t));
  });
  dir.write("counts.npy", [&](const std::string& p) {
    write_npy(p, "int64", cnt_shape, r.counts.data(), r.counts.size() * sizeof(std::int64_t));
  });
  dir.write("keys.npy", [&](const std::string& p) {
    write_npy(p, dt, k_out, r.keys.data(), r.keys.size());
  });
  dir.write("values.npy", [&](const std::string& p) {
    write_npy(p, dt, v_out, r.values.data(), r.values.size());
  });

  // summary.json
  std::vector<std::int64_t> per_layer;
  json per_head = json::array();
  std::int64_t total = 0;
  for (std::int64_t l = 0; l < s.L; ++l) {
    std::int64_t sum = 0;
    json heads = json::array();
    for (std::int64_t h = 0; h < s.H; ++h) {
      sum += r.sel.count(l, h);
      heads.push_back(r.sel.count(l, h));
    }
    per_layer.push_back(sum);
    per_head.push_back(heads);
    total += sum;
  }
  const std::int64_t all = s.L * s.H * s.T;
  const std::int64_t per_row = budget.global(s.L, s.H, s.T) / (s.L * s.H);
  const auto input = [&](const std::string& path, const std::vector<std::int64_t>& shape) {
    return json{{"file", path}, {"dtype", dt}, {"shape", shape}};
  };
  const auto output = [&](const char* file, const std::string& dtype,
                          const std::vector<std::int64_t>& shape) {
    return json{{"file", file}, {"dtype", dtype}, {"shape", shape}};
  };
  json allocators = json::array();
  for (const auto& a : policy.allocators())
    allocators.push_back(std::visit([](const auto& x) { return std::string(x.name); }, a));
  json summary = {
      {"schema", "kvpolicy-compress/1"},
      {"kvpolicy_version", KVPOLICY_VERSION_STRING},
      {"policy", policy.spec()},
      {"policy_arg", o.policy},
      {"scorer", std::string(policy.scorer_name())},
      {"allocators", allocators},
      {"budget",
       o.has_budget ? json{{"kind", "ratio"}, {"value", o.budget}, {"tokens_per_head", per_row}}
                    : json{{"kind", "tokens"}, {"value", o.budget_tokens},
                           {"tokens_per_head", per_row}}},
      {"inputs",
       {{"keys", input(o.keys, k_shape)},
        {"values", input(o.values, v_shape)},
        {"queries", q ? input(o.queries, q_shape) : json(nullptr)}}},
      {"input_rank", s.lifted ? 3 : 4},
      {"layers", s.L},
      {"kv_heads", s.H},
      {"tokens", s.T},
      {"head_dim", s.D},
      {"value_dim", s.Dv},
      {"q_heads", q ? json(s.Hq) : json(nullptr)},
      {"queries", q ? json(s.n) : json(nullptr)},
      {"outputs",
       {{"indices", output("indices.npy", "int64", idx_shape)},
        {"counts", output("counts.npy", "int64", cnt_shape)},
        {"keys", output("keys.npy", dt, k_out)},
        {"values", output("values.npy", dt, v_out)},
        {"padding", "indices -1, keys/values 0 past counts"}}},
      {"kept",
       {{"per_layer", per_layer},
        {"per_head", per_head},
        {"total", total},
        {"of", all},
        {"fraction", double(total) / double(all)}}},
      {"threads", o.threads},
      // Why the selection departed from the policy to honour the budget (a budget below the
      // scorer's protected window keeps the newest tokens); null when it did not.
      {"warning", r.sel.warning().empty() ? json(nullptr) : json(r.sel.warning())},
  };
  summary["seconds"] = {{"read", read_seconds},
                        {"policy", r.policy_seconds},
                        {"write", seconds_since(t_write)},
                        {"total", seconds_since(t0)}};
  dir.write("summary.json", [&](const std::string& p) {
    const std::string text = summary.dump(2) + "\n";
    write_text(p, text);
  });
  dir.commit();
  if (!r.sel.warning().empty()) std::cerr << "kvpolicy compress: warning: " << r.sel.warning() << "\n";

  out << "kept " << total << " of " << all << " tokens ("
      << num(100.0 * double(total) / double(all), "%.1f%%") << ") in "
      << num(r.policy_seconds, "%.3f") << " s, written to " << o.out << "\n";
  if (o.report) {
    out << "\npolicy   " << policy.spec() << "\nbudget   "
        << (o.has_budget ? "--budget " + num(o.budget, "%g")
                         : "--budget-tokens " + std::to_string(o.budget_tokens))
        << ": " << per_row << " of " << s.T << " tokens per (layer, KV head)"
        << (policy.allocators().empty() ? "" : " before the allocators") << "\ninputs   keys "
        << k.describe() << " " << dt << "\n         values " << v.path << " "
        << shape_text(v_shape) << " " << dt << "\n";
    if (q) out << "         queries " << o.queries << " " << shape_text(q_shape) << " " << dt << "\n";
    print_report(out, r, s);
  }
}

}  // namespace kvpolicy_cli
