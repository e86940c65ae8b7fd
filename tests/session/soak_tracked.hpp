// Tracked<T>: a Session and its shadow model, stepped together; every check of the soak (see
// soak.hpp for the list) lives here. The shadow holds, per (layer, head) and in the session's
// row order, what each row must be: its original position, K/V, H2O accumulator, log-count,
// AMS credit and delimiter flag, plus the layer's schedule (targets, tokens since the last event,
// capacity). Values the shadow cannot predict (a merged row's K/V, new accumulators and credit)
// are checked against their rule when they change, then taken from the session, so any later
// change is caught bit-exactly.
#pragma once
#include <algorithm>
#include <bit>
#include <limits>
#include <cmath>
#include <cstring>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "session/soak.hpp"

namespace kvtest::soak {

template <class T>
class Tracked {
 public:
  struct Head {
    std::vector<std::int32_t> pos;
    std::vector<T> k, v;  // [rows][d]
    std::vector<float> acc, log_count, credit;
    std::vector<std::uint8_t> delim;
    std::vector<StoredRow> stored;  // quantized layers: each row's stored form
    std::vector<std::byte> tiles;   // quantized layers: bytes of the tiles checked so far
    std::int64_t tiles_checked = 0;
    // Quantized layers: the residual window fitted at the compression (quant::fit_residual), and
    // whether it bounds the packed cache's bytes by the plain rows' (quant::packed_never_exceeds).
    std::int64_t residual = 0;
    bool bytes_bounded = false;
    std::int64_t rows() const { return static_cast<std::int64_t>(pos.size()); }
  };
  struct Layer {
    std::vector<Head> heads;
    std::int64_t next_position = 0, since = 0, capacity = 0, prompt_length = 0;
    std::vector<std::int64_t> targets;  // empty before the prefill compression
    std::vector<char> reached;          // per head: length has reached the current target
    bool decode_targets_set = false, quantized = false;
  };

  Tracked(std::string name, Plan plan, Session<T> s, const Where& w, Counters& c)
      : name_(std::move(name)), plan_(std::move(plan)), s_(std::move(s)), w_(&w), c_(&c) {
    const SessionConfig& cfg = s_.config();
    hkv_ = cfg.kv_heads, d_ = cfg.head_dim, g_ = cfg.q_heads / cfg.kv_heads;
    interval_ = cfg.decode_interval > 0 ? cfg.decode_interval : (plan_.h2o ? 1 : 0);
    require(s_.decode_interval() == interval_, "decode_interval() ", s_.decode_interval(),
            ", expected ", interval_);
    const auto* h2o = std::get_if<kvpolicy::H2O>(&s_.policy().scorer());
    acc_scale_ = h2o && h2o->reduce == kvpolicy::GqaReduce::sum ? 1.0f : 1.0f / static_cast<float>(g_);
    tracks_acc_ = cfg.record_attention || plan_.h2o;
    layers_.resize(static_cast<std::size_t>(cfg.layers));
    for (auto& L : layers_) {
      L.heads.resize(static_cast<std::size_t>(hkv_));
      L.capacity = cfg.initial_capacity;
    }
  }

  const std::string& name() const { return name_; }
  const Plan& plan() const { return plan_; }
  const Session<T>& session() const { return s_; }
  std::int64_t layers() const { return static_cast<std::int64_t>(layers_.size()); }
  bool quantized(std::int64_t l) const { return layers_[static_cast<std::size_t>(l)].quantized; }
  // The session without the quantizer, stepped first: quantized rows are checked against its rows.
  void set_twin(const Tracked* twin) { twin_ = twin; }

  // A fork of this (uncompressed, recording) session into `plan`, with its shadow.
  Tracked fork(std::string name, Plan plan, Budget budget, std::int64_t interval,
               std::optional<Budget> target) const {
    Tracked t(std::move(name), plan, s_.fork(Policy(plan.spec), budget, interval, target), *w_, *c_);
    const float from = acc_scale_, to = t.acc_scale_;
    t.layers_ = layers_;
    for (auto& L : t.layers_)
      for (auto& m : L.heads) {
        if (plan.h2o && from != to)
          for (auto& a : m.acc) a *= to / from;  // as Session::fork rescales
        m.credit.assign(plan.ams ? m.pos.size() : 0, 0.f);
      }
    t.masks_seen_ = masks_seen_;
    return t;
  }

  void append(std::int64_t l, const TokenBlock<T>& b, bool pass_q, bool pass_flags) {
    Layer& L = layers_[static_cast<std::size_t>(l)];
    s_.append(l, b.K(), b.V(), pass_q ? b.Q() : KVView<const T>{},
              pass_flags ? std::span<const std::uint8_t>(b.flags) : std::span<const std::uint8_t>{});
    masks_seen_ = masks_seen_ || pass_flags;
    std::int64_t maxlen = 0;
    for (const Head& m : L.heads) maxlen = std::max(maxlen, m.rows());
    if (maxlen + b.n > L.capacity) L.capacity = std::max(2 * L.capacity, maxlen + b.n);  // doubling
    for (std::int64_t h = 0; h < hkv_; ++h) {
      Head& m = L.heads[static_cast<std::size_t>(h)];
      for (std::int64_t t = 0; t < b.n; ++t) {
        m.pos.push_back(static_cast<std::int32_t>(L.next_position + t));
        m.k.insert(m.k.end(), b.k_row(h, t), b.k_row(h, t) + d_);
        m.v.insert(m.v.end(), b.v_row(h, t), b.v_row(h, t) + d_);
        m.acc.push_back(0.f);
        m.log_count.push_back(0.f);
        if (plan_.ams) m.credit.push_back(0.f);
        m.delim.push_back(pass_flags ? b.flags[static_cast<std::size_t>(t)] : 0);
        if (L.quantized) m.stored.push_back(stored_form(*plan_.quant, b.k_row(h, t), b.v_row(h, t), d_));
      }
    }
    L.next_position += b.n;
    L.since += b.n;
    c_->tokens += b.n;
  }

  // attend() with the block's queries; checks the output against the fp64 reference when
  // `check` (always when H2O statistics are tracked, whose increments are checked row by row).
  void attend(std::int64_t l, const TokenBlock<T>& b, bool check) {
    Layer& L = layers_[static_cast<std::size_t>(l)];
    std::vector<float> out(static_cast<std::size_t>(b.hq * b.n * d_));
    s_.attend(l, b.Q(), out.data());
    if (!check && !tracks_acc_) return;
    const std::vector<HeadRows> rows = L.quantized ? decoded_rows(l) : shadow_rows(l);
    std::vector<std::vector<double>> colsum;
    const auto ref = reference_attention(rows, b, tracks_acc_ ? &colsum : nullptr);
    double err = 0, scale = 1;
    for (double x : ref) scale = std::max(scale, std::abs(x));
    for (std::size_t i = 0; i < ref.size(); ++i) err = std::max(err, std::abs(out[i] - ref[i]));
    // Packed attention folds decoded tiles in fp32 (test_session_quant.cpp: 1e-4).
    require(err / scale <= (L.quantized ? 1e-4 : 2e-5), "layer ", l,
            ": attend() differs from the reference attention over the shadow's rows by ",
            err / scale);
    ++c_->attend_checks;
    if (!tracks_acc_) return;
    for (std::int64_t h = 0; h < hkv_; ++h) {
      Head& m = L.heads[static_cast<std::size_t>(h)];
      const auto acc = s_.accumulated(l, h);
      const auto& cs = colsum[static_cast<std::size_t>(h)];
      for (std::size_t j = 0; j < acc.size(); ++j) {
        // fp32: one rounding of the sum, the probabilities to ~1e-6 of their sum.
        const double add = static_cast<double>(acc_scale_) * cs[j];
        const double want = static_cast<double>(m.acc[j]) + add;
        const double tol = 3e-7 * std::abs(want) + 2e-5 * add + 1e-9;
        if (std::abs(acc[j] - want) > tol)
          failure("layer ", l, " head ", h, " row ", j, " (position ", m.pos[j],
                  "): accumulated ", acc[j], ", expected ", m.acc[j], " + ", add, " = ", want);
      }
      m.acc.assign(acc.begin(), acc.end());
      c_->acc_checks += static_cast<std::int64_t>(acc.size());
    }
  }

  // compress_if_due(l), checked against the schedule; on an event, every per-row rule.
  bool compress_if_due(std::int64_t l) {
    Layer& L = layers_[static_cast<std::size_t>(l)];
    const int expect = expected_event(l);  // 0 none, 1 prefill, 2 decode-time
    const std::vector<std::int64_t> budgets = expect == 1 ? requested_budgets(l) : L.targets;
    const bool did = s_.compress_if_due(l);
    require(did == (expect != 0), "layer ", l, ": compress_if_due() returned ", did,
            ", the schedule says ", expect == 0 ? "nothing is due" : "an event is due",
            " (since ", L.since, ", interval ", interval_, ")");
    if (did) on_event(l, expect == 1, budgets);
    return did;
  }

  // An explicit compress(l) after the prefill: back to the targets now, whatever is due.
  void compress_now(std::int64_t l) {
    const std::vector<std::int64_t> budgets = layers_[static_cast<std::size_t>(l)].targets;
    s_.compress(l);
    on_event(l, false, budgets);
  }

  void shrink_to_fit() {
    s_.shrink_to_fit();
    for (auto& L : layers_) {
      std::int64_t len = 1;
      for (const Head& m : L.heads) len = std::max(len, m.rows());
      if (len < L.capacity) L.capacity = len;
    }
    ++c_->shrinks;
  }

  // The whole state of layer l against the shadow, bit-exactly where the shadow knows it.
  void verify(std::int64_t l) {
    Layer& L = layers_[static_cast<std::size_t>(l)];
    require(s_.capacity(l) == L.capacity, "layer ", l, ": capacity ", s_.capacity(l),
            ", expected ", L.capacity, " (growth by doubling)");
    const auto b = s_.budgets(l);
    require(std::vector<std::int64_t>(b.begin(), b.end()) == L.targets, "layer ", l,
            ": budgets() differ from the targets");
    require(s_.quantized(l) == L.quantized, "layer ", l, ": quantized() is ", s_.quantized(l));
    for (std::int64_t h = 0; h < hkv_; ++h) {
      const Head& m = L.heads[static_cast<std::size_t>(h)];
      const std::int64_t n = m.rows();
      require(s_.length(l, h) == n, "layer ", l, " head ", h, ": length ", s_.length(l, h),
              ", expected ", n);
      require_same(s_.positions(l, h), m.pos, l, h, "positions");
      for (std::int64_t i = 1; i < n; ++i)
        require(m.pos[static_cast<std::size_t>(i - 1)] < m.pos[static_cast<std::size_t>(i)],
                "layer ", l, " head ", h, ": positions not ascending and unique at row ", i);
      require_same(s_.accumulated(l, h), m.acc, l, h, "accumulated");
      require_same(s_.log_counts(l, h), m.log_count, l, h, "log_counts");
      require_same(s_.alloc_state(l, h), m.credit, l, h, "alloc_state");
      require_same(s_.delimiters(l, h), m.delim, l, h, "delimiters");
      if (!L.quantized) {
        const T* k = s_.keys(l).row(0, h, 0);
        const T* v = s_.values(l).row(0, h, 0);
        if (n > 0 && (std::memcmp(k, m.k.data(), m.k.size() * sizeof(T)) != 0 ||
                      std::memcmp(v, m.v.data(), m.v.size() * sizeof(T)) != 0))
          failure("layer ", l, " head ", h, ": K/V rows differ from the tokens at their positions",
                  first_row_diff(k, v, m));
      } else {
        verify_packed(l, h);
      }
      if (!L.targets.empty() && interval_ > 0 && !L.quantized) {
        // [target, target + interval) once the head has reached its target.
        const std::int64_t t = L.targets[static_cast<std::size_t>(h)];
        require(n < t + interval_, "layer ", l, " head ", h, ": length ", n,
                " is not below target + interval = ", t, " + ", interval_);
        require(n >= t || !L.reached[static_cast<std::size_t>(h)], "layer ", l, " head ", h,
                ": length ", n, " fell below its target ", t);
        if (n >= t) L.reached[static_cast<std::size_t>(h)] = 1;
      }
    }
    if (twin_ && L.quantized)
      for (std::int64_t h = 0; h < hkv_; ++h) {
        const auto& tm = twin_->layers_[static_cast<std::size_t>(l)].heads[static_cast<std::size_t>(h)];
        require(tm.pos == L.heads[static_cast<std::size_t>(h)].pos &&
                    tm.log_count == L.heads[static_cast<std::size_t>(h)].log_count,
                "layer ", l, " head ", h, ": the quantized session kept other rows or counts than "
                "the same policy without its quantizer");
      }
  }

  // kv_bytes() against the lengths (or the packed caches).
  void verify_bytes() const {
    std::size_t want = 0;
    for (std::int64_t l = 0; l < layers(); ++l)
      for (std::int64_t h = 0; h < hkv_; ++h)
        want += quantized(l) ? s_.packed(l, h).memory_bytes()
                             : static_cast<std::size_t>(s_.length(l, h) * d_ * 2) * sizeof(T);
    require(s_.kv_bytes() == want, "kv_bytes() ", s_.kv_bytes(), ", expected ", want);
  }

  // decode() of every packed cache of layer l against the rows at their positions, within the
  // bound the block scales give (quant/block.hpp: half a step per element of the stored form).
  void verify_decode(std::int64_t l) {
    const Layer& L = layers_[static_cast<std::size_t>(l)];
    if (!L.quantized) return;
    const auto& qc = *plan_.quant;
    const std::vector<HeadRows> rows = decoded_rows(l);
    for (std::int64_t h = 0; h < hkv_; ++h) {
      const Head& m = L.heads[static_cast<std::size_t>(h)];
      const auto& p = s_.packed(l, h);
      for (std::int64_t r = 0; r < m.rows(); ++r) {
        double bk = 0, bv = 0;  // L2 bounds of the row's K and V errors
        if (r < p.packed_tokens()) {
          const std::int64_t tile = r / qc.group, j = r % qc.group, per = d_ / qc.group;
          for (std::int64_t c = 0; c < d_; ++c) {
            const double s = BlockRef::at(p.key_tile(tile), static_cast<std::size_t>(c), qc.bits, qc.group).scale;
            bk += 0.25 * s * s;
          }
          for (std::int64_t bl = 0; bl < per; ++bl) {
            const double s = BlockRef::at(p.value_tile(tile), static_cast<std::size_t>(j * per + bl), qc.bits, qc.group).scale;
            bv += 0.25 * s * s * qc.group;
          }
          bk = m.stored[static_cast<std::size_t>(r)].norm * std::sqrt(bk);
          bv = std::sqrt(bv);
        }
        double ek = 0, ev = 0, nk = 0, nv = 0;
        const auto& hr = rows[static_cast<std::size_t>(h)];
        for (std::int64_t i = 0; i < d_; ++i) {
          const double k0 = kvpolicy::to_float(m.k[static_cast<std::size_t>(r * d_ + i)]);
          const double v0 = kvpolicy::to_float(m.v[static_cast<std::size_t>(r * d_ + i)]);
          ek += std::pow(hr.k[static_cast<std::size_t>(r * d_ + i)] - k0, 2), nk += k0 * k0;
          ev += std::pow(hr.v[static_cast<std::size_t>(r * d_ + i)] - v0, 2), nv += v0 * v0;
        }
        ek = std::sqrt(ek), ev = std::sqrt(ev);
        const double tk = bk * (1 + 1e-4) + 2e-5 * std::sqrt(nk) + 1e-6;
        const double tv = bv * (1 + 1e-4) + 2e-5 * std::sqrt(nv) + 1e-6;
        if (ek > tk || ev > tv)
          failure("layer ", l, " head ", h, " row ", r, " (position ", m.pos[static_cast<std::size_t>(r)],
                  ", ", r < p.packed_tokens() ? "packed" : "residual", "): decode() error K ", ek,
                  " (bound ", tk, "), V ", ev, " (bound ", tv, ")");
      }
    }
    ++c_->decode_checks;
  }

  std::int64_t capacity_sum() const {
    std::int64_t n = 0;
    for (std::int64_t l = 0; l < layers(); ++l) n += s_.capacity(l);
    return n;
  }

 private:
  template <class... A>
  [[noreturn]] void failure(const A&... what) const {
    fail(*w_, name_ + " '" + plan_.spec + "'", what...);
  }
  template <class... A>
  void require(bool ok, const A&... what) const {
    if (!ok) failure(what...);
  }
  template <class X>
  void require_same(std::span<const X> got, const std::vector<X>& want, std::int64_t l,
                    std::int64_t h, const char* what) const {
    if (got.size() == want.size() &&
        (want.empty() || std::memcmp(got.data(), want.data(), want.size() * sizeof(X)) == 0))
      return;
    std::ostringstream os;
    os << "layer " << l << " head " << h << ": " << what << " (" << got.size() << " rows) differ from the shadow ("
       << want.size() << " rows)";
    for (std::size_t i = 0; i < std::min(got.size(), want.size()); ++i)
      if (std::memcmp(&got[i], &want[i], sizeof(X)) != 0) {
        os << ", first at row " << i << ": " << +got[i] << " vs " << +want[i];
        break;
      }
    failure(os.str());
  }
  std::string first_row_diff(const T* k, const T* v, const Head& m) const {
    for (std::int64_t i = 0; i < m.rows(); ++i)
      if (std::memcmp(k + i * d_, m.k.data() + i * d_, d_ * sizeof(T)) != 0 ||
          std::memcmp(v + i * d_, m.v.data() + i * d_, d_ * sizeof(T)) != 0)
        return ", first at row " + std::to_string(i) + " (position " +
               std::to_string(m.pos[static_cast<std::size_t>(i)]) + ")";
    return "";
  }

  // 0: nothing due; 1: the prefill compression; 2: a decode-time event (SessionConfig).
  int expected_event(std::int64_t l) {
    Layer& L = layers_[static_cast<std::size_t>(l)];
    if (L.targets.empty()) return L.heads[0].rows() == 0 ? 0 : 1;
    if (interval_ == 0 || L.since < interval_) return 0;
    const auto& target = s_.config().decode_target;
    if (target && !L.decode_targets_set) {
      L.targets = head_budgets(*target, L.prompt_length);
      L.decode_targets_set = true;
      L.reached.assign(static_cast<std::size_t>(hkv_), 0);
    }
    for (std::int64_t h = 0; h < hkv_; ++h)
      if (L.heads[static_cast<std::size_t>(h)].rows() > L.targets[static_cast<std::size_t>(h)]) return 2;
    return 0;
  }

  // Per-head token counts of a budget (SessionConfig): tokens(n) n per head, total(n) split as
  // evenly as possible (the first heads get the remainder), neither clamped to the prompt;
  // ratio(r) round(r * prompt).
  std::vector<std::int64_t> head_budgets(const Budget& b, std::int64_t prompt) const {
    const auto n = static_cast<std::int64_t>(b.value());
    std::vector<std::int64_t> out(static_cast<std::size_t>(hkv_), n);
    if (b.kind() == Budget::Kind::ratio)
      std::fill(out.begin(), out.end(), std::llround(b.value() * static_cast<double>(prompt)));
    if (b.kind() == Budget::Kind::total)
      for (std::int64_t h = 0; h < hkv_; ++h) out[static_cast<std::size_t>(h)] = n / hkv_ + (h < n % hkv_ ? 1 : 0);
    return out;
  }
  // The prefill's per-head budgets before any allocator (Session::compress).
  std::vector<std::int64_t> requested_budgets(std::int64_t l) const {
    std::int64_t len = 0;
    for (const Head& m : layers_[static_cast<std::size_t>(l)].heads) len = std::max(len, m.rows());
    return head_budgets(s_.config().budget, len);
  }

  // Last row of each chunk the merger cuts the head's rows into (semantic: delimiter flags and
  // the chunk cap, gsc::ends_chunk; nearest: the whole row).
  std::vector<std::int64_t> chunk_ends(const Head& m) const {
    std::vector<std::int64_t> ends;
    const std::int64_t n = m.rows();
    const bool flags = plan_.merger == MergerKind::semantic && masks_seen_;
    std::int64_t start = 0;
    for (std::int64_t j = 0; j < n; ++j) {
      const bool end = plan_.merger == MergerKind::nearest
                           ? j == n - 1
                           : (flags && m.delim[static_cast<std::size_t>(j)] != 0) ||
                                 (plan_.chunk > 0 && j - start + 1 == plan_.chunk) || j == n - 1;
      if (end) ends.push_back(j), start = j + 1;
    }
    return ends;
  }

  // One head's event: `from[i]` is the row before the event that row i came from.
  struct HeadEvent {
    std::int64_t n = 0, per_row = 0;
    std::vector<std::int64_t> from;
    std::vector<char> kept;
    kvpolicy::Protect protect;
    bool merged = false;  // the merger ran over this head
  };

  void on_event(std::int64_t l, bool prefill, const std::vector<std::int64_t>& budgets) {
    Layer& L = layers_[static_cast<std::size_t>(l)];
    std::int64_t len = 0, shortest = std::numeric_limits<std::int64_t>::max();
    for (const Head& m : L.heads) len = std::max(len, m.rows()), shortest = std::min(shortest, m.rows());
    const bool uneven = !prefill && *std::min_element(budgets.begin(), budgets.end()) !=
                                        *std::max_element(budgets.begin(), budgets.end());
    const bool uniform = shortest == len && !uneven;  // one event over all heads (Session::compress)
    const std::int64_t total = std::accumulate(budgets.begin(), budgets.end(), std::int64_t{0});
    std::vector<Head> next(static_cast<std::size_t>(hkv_));
    std::vector<std::int64_t> targets(static_cast<std::size_t>(hkv_));
    for (std::int64_t h = 0; h < hkv_; ++h) {
      const Head& m = L.heads[static_cast<std::size_t>(h)];
      const std::int64_t b = budgets[static_cast<std::size_t>(h)];
      HeadEvent e = map_rows(l, h, m);
      e.per_row = uniform ? std::min(total, hkv_ * len) / hkv_ : std::min(b, e.n);
      e.protect = s_.policy().protect(e.n, e.per_row);
      e.merged = plan_.merger != MergerKind::none &&
                 (uniform ? total < hkv_ * len : static_cast<std::int64_t>(e.from.size()) < e.n);
      const std::int64_t kept = static_cast<std::int64_t>(e.from.size());
      if (!prefill || !plan_.head_alloc)
        require(kept == std::min(e.n, b), "layer ", l, " head ", h, ": ", prefill ? "prefill" : "decode",
                " event kept ", kept, " of ", e.n, " rows, expected min(rows, budget ", b, ")");
      check_selection(l, h, m, e);
      next[static_cast<std::size_t>(h)] = carry_rows(l, h, m, e);
      targets[static_cast<std::size_t>(h)] = prefill ? (kept < e.n ? kept : b) : b;
      c_->evicted += e.n - kept;
    }
    if (prefill) L.prompt_length = len;
    const auto got = s_.budgets(l);
    require(std::vector<std::int64_t>(got.begin(), got.end()) == targets, "layer ", l,
            ": budgets() after the event are not the expected targets");
    if (prefill) L.reached.assign(static_cast<std::size_t>(hkv_), 0);
    L.targets = targets;
    L.heads = std::move(next);
    L.since = 0;
    if (prefill && plan_.quant) {
      L.quantized = true;
      for (Head& m : L.heads) {
        m.residual = kvpolicy::quant::fit_residual(*plan_.quant, d_, m.rows(),
                                                   static_cast<std::size_t>(2 * d_) * sizeof(T));
        kvpolicy::quant::QuantConfig fitted = *plan_.quant;
        fitted.residual = static_cast<int>(m.residual);
        m.bytes_bounded = kvpolicy::quant::packed_never_exceeds(
            fitted, d_, m.rows(), static_cast<std::size_t>(2 * d_) * sizeof(T));
        if (m.rows() >= plan_.quant->group && sizeof(T) == 4)  // fp32 rows: always bounded
          require(m.bytes_bounded, "layer ", l, ": ", m.rows(), " fp32 survivors, no bounded window");
        m.stored.clear();
        for (std::int64_t r = 0; r < m.rows(); ++r)
          m.stored.push_back(stored_form(*plan_.quant, m.k.data() + r * d_, m.v.data() + r * d_, d_));
      }
    }
    ++(prefill ? c_->prefill_events : c_->decode_events);
    ++c_->chain_events[plan_.chain];
  }

  HeadEvent map_rows(std::int64_t l, std::int64_t h, const Head& m) const {
    HeadEvent e;
    e.n = m.rows();
    e.kept.assign(static_cast<std::size_t>(e.n), 0);
    const auto ps = s_.positions(l, h);
    std::int64_t j = 0;
    for (std::size_t i = 0; i < ps.size(); ++i) {
      while (j < e.n && m.pos[static_cast<std::size_t>(j)] < ps[i]) ++j;
      require(j < e.n && m.pos[static_cast<std::size_t>(j)] == ps[i], "layer ", l, " head ", h,
              ": after the event row ", i, " holds position ", ps[i],
              ", which is not a row before it or not in ascending order");
      e.from.push_back(j);
      e.kept[static_cast<std::size_t>(j)] = 1;
      ++j;
    }
    return e;
  }

  // The protected rows survive; streaming and H2O keep exactly what their scores say.
  void check_selection(std::int64_t l, std::int64_t h, const Head& m, const HeadEvent& e) {
    const std::int64_t n = e.n, kept = static_cast<std::int64_t>(e.from.size());
    if (kept == n) return;
    const std::int64_t s0 = std::min(e.protect.sinks, n), rb = std::max(s0, n - e.protect.recent);
    for (std::int64_t j = 0; j < n; ++j)
      if ((j < s0 || j >= rb) && !e.kept[static_cast<std::size_t>(j)])
        failure("layer ", l, " head ", h, ": protected row ", j, " of ", n, " (sinks ",
                e.protect.sinks, ", recent ", e.protect.recent, ") was evicted");
    std::vector<char> want(static_cast<std::size_t>(n), 0);
    if (plan_.streaming_sinks >= 0) {
      for (std::int64_t j = 0; j < n; ++j) want[static_cast<std::size_t>(j)] = j < s0 || j >= n - (kept - s0);
      ++c_->streaming_exact;
    } else if (plan_.h2o_exact) {
      std::vector<std::int64_t> others;
      for (std::int64_t j = 0; j < n; ++j)
        if (j < s0 || j >= rb) want[static_cast<std::size_t>(j)] = 1;
        else others.push_back(j);
      std::sort(others.begin(), others.end(), [&](std::int64_t a, std::int64_t b) {
        const float x = m.acc[static_cast<std::size_t>(a)], y = m.acc[static_cast<std::size_t>(b)];
        return x != y ? x > y : a > b;  // the library's top-k order: score, then more recent
      });
      const std::int64_t free = kept - (s0 + n - rb);
      for (std::int64_t i = 0; i < free; ++i) want[static_cast<std::size_t>(others[static_cast<std::size_t>(i)])] = 1;
      ++c_->h2o_exact;
    } else {
      return;
    }
    for (std::int64_t j = 0; j < n; ++j)
      require(want[static_cast<std::size_t>(j)] == e.kept[static_cast<std::size_t>(j)], "layer ", l,
              " head ", h, ": row ", j, " (position ", m.pos[static_cast<std::size_t>(j)], ", score ",
              m.acc[static_cast<std::size_t>(j)], ") was ", e.kept[static_cast<std::size_t>(j)] ? "kept" : "evicted",
              " against the policy's order");
  }

  static double count_of(float log_count) { return std::nearbyint(std::exp(static_cast<double>(log_count))); }

  // The head's rows after the event: every per-row column checked against its rule, then taken.
  Head carry_rows(std::int64_t l, std::int64_t h, const Head& m, const HeadEvent& e) {
    const auto ps = s_.positions(l, h);
    const auto lc = s_.log_counts(l, h), acc = s_.accumulated(l, h), cr = s_.alloc_state(l, h);
    const auto dl = s_.delimiters(l, h);
    const std::size_t kept = e.from.size();
    std::vector<char> grown(kept, 0);
    std::vector<double> gain(static_cast<std::size_t>(e.n), 0.0);  // count growth, by row before
    for (std::size_t i = 0; i < kept; ++i) {
      const auto j = static_cast<std::size_t>(e.from[i]);
      const double c = count_of(lc[i]);
      require(c >= 1 && std::abs(std::exp(static_cast<double>(lc[i])) - c) <= 1e-5 * c, "layer ", l,
              " head ", h, " row ", i, ": log_count ", lc[i], " is not the log of a count");
      require(std::bit_cast<std::uint32_t>(acc[i]) == std::bit_cast<std::uint32_t>(m.acc[j]), "layer ",
              l, " head ", h, " row ", i, " (position ", ps[i], "): accumulator ", acc[i],
              " is not the one its position had before the event (", m.acc[j], ")");
      if (std::bit_cast<std::uint32_t>(lc[i]) == std::bit_cast<std::uint32_t>(m.log_count[j])) continue;
      require(e.merged && c > count_of(m.log_count[j]), "layer ", l, " head ", h, " row ", i,
              " (position ", ps[i], "): log_count went from ", m.log_count[j], " to ", lc[i],
              e.merged ? "" : " without a merge");
      grown[i] = 1;
      gain[j] = c - count_of(m.log_count[j]);
      ++c_->merged_rows;
    }
    if (e.merged) check_chunks(l, h, m, e, gain, dl);
    else require_carried(dl, m.delim, e, l, h, "delimiters");
    if (plan_.ams) {
      double sum = 0;
      for (std::size_t i = 0; i < kept; ++i) {
        const double old = m.credit[static_cast<std::size_t>(e.from[i])];
        require(cr[i] >= 0 && cr[i] >= plan_.ams_lambda * old * (1 - 1e-6), "layer ", l, " head ", h,
                " row ", i, ": AMS credit ", cr[i], " below lambda x its previous ", old);
        sum += cr[i];
      }
      require(sum <= 1 + 1e-4, "layer ", l, " head ", h, ": AMS credit sums to ", sum, " > 1");
      ++c_->credit_checks;
    }
    Head out;
    out.pos.assign(ps.begin(), ps.end());
    out.acc.assign(acc.begin(), acc.end());
    out.log_count.assign(lc.begin(), lc.end());
    out.credit.assign(cr.begin(), cr.end());
    out.delim.assign(dl.begin(), dl.end());
    for (std::size_t i = 0; i < kept; ++i) {
      const std::int64_t j = e.from[i];
      const T* k = m.k.data() + j * d_;
      const T* v = m.v.data() + j * d_;
      if (grown[i]) {  // a merged row: the session's (or, once packed, the unquantized twin's)
        if (plan_.quant) {
          const Head& tm = twin_->layers_[static_cast<std::size_t>(l)].heads[static_cast<std::size_t>(h)];
          require(tm.pos == out.pos, "layer ", l, " head ", h, ": the twin kept other rows");
          k = tm.k.data() + static_cast<std::int64_t>(i) * d_, v = tm.v.data() + static_cast<std::int64_t>(i) * d_;
        } else {
          k = s_.keys(l).row(0, h, static_cast<std::int64_t>(i));
          v = s_.values(l).row(0, h, static_cast<std::int64_t>(i));
        }
        if (plan_.merger == MergerKind::nearest)  // nearest folds values only
          require(std::memcmp(k, m.k.data() + j * d_, d_ * sizeof(T)) == 0, "layer ", l, " head ", h,
                  " row ", i, ": nearest changed a kept key");
      }
      out.k.insert(out.k.end(), k, k + d_);
      out.v.insert(out.v.end(), v, v + d_);
    }
    return out;
  }

  template <class X>
  void require_carried(std::span<const X> got, const std::vector<X>& before, const HeadEvent& e,
                       std::int64_t l, std::int64_t h, const char* what) const {
    for (std::size_t i = 0; i < e.from.size(); ++i)
      require(got[i] == before[static_cast<std::size_t>(e.from[i])], "layer ", l, " head ", h, " row ",
              i, ": ", what, " not carried with its row");
  }

  // Per chunk of the merger: counts grow by at most what the chunk evicted (exactly that where
  // every evicted token must find a core), and semantic's chunk-end flags.
  void check_chunks(std::int64_t l, std::int64_t h, const Head& m, const HeadEvent& e,
                    const std::vector<double>& gain, std::span<const std::uint8_t> dl) {
    const bool exact = plan_.merger == MergerKind::nearest ||
                       (plan_.merger == MergerKind::semantic && plan_.tau <= -1.0);
    const bool rewrite = plan_.merger == MergerKind::semantic && masks_seen_;
    std::vector<std::uint8_t> flags(m.delim);
    const std::int64_t s0 = std::min(e.protect.sinks, e.n), rb = std::max(s0, e.n - e.protect.recent);
    std::int64_t b = 0;
    for (std::int64_t last : chunk_ends(m)) {
      double grow = 0, lost = 0;
      bool target = false, seen = false;
      for (std::int64_t j = last; j >= b; --j) {
        const auto js = static_cast<std::size_t>(j);
        if (e.kept[js]) {
          grow += gain[js];
          target = target || (j >= s0 && j < rb);
          if (rewrite) flags[js] = seen ? 0 : 1;  // gsc::mark_chunk_end
          seen = true;
        } else {
          lost += count_of(m.log_count[js]);
        }
      }
      require(grow <= lost && (!exact || !target || grow == lost), "layer ", l, " head ", h,
              ": the counts of rows [", b, ", ", last, "] grew by ", grow, " for ", lost,
              " evicted tokens");
      b = last + 1;
    }
    require_carried(dl, flags, e, l, h, "chunk-end flags");
    if (rewrite) ++c_->delimiter_rewrites;
  }

  // Rows as the shadow says, fp32, with their log-count bias.
  std::vector<HeadRows> shadow_rows(std::int64_t l) const {
    std::vector<HeadRows> out;
    for (const Head& m : layers_[static_cast<std::size_t>(l)].heads) {
      HeadRows r;
      r.len = m.rows();
      for (const T& x : m.k) r.k.push_back(kvpolicy::to_float(x));
      for (const T& x : m.v) r.v.push_back(kvpolicy::to_float(x));
      r.bias = m.log_count;
      out.push_back(std::move(r));
    }
    return out;
  }
  // A quantized layer's rows as decode() gives them.
  std::vector<HeadRows> decoded_rows(std::int64_t l) const {
    std::vector<HeadRows> out;
    for (std::int64_t h = 0; h < hkv_; ++h) {
      const Head& m = layers_[static_cast<std::size_t>(l)].heads[static_cast<std::size_t>(h)];
      HeadRows r;
      r.len = m.rows();
      r.k.resize(static_cast<std::size_t>(r.len * d_));
      r.v.resize(r.k.size());
      s_.packed(l, h).decode(r.k.data(), r.v.data());
      r.bias = m.log_count;
      out.push_back(std::move(r));
    }
    return out;
  }

  // Sizes and bytes by the packing formula (quant/packed_cache.hpp); new tiles within half a
  // step of the stored form, old tiles unchanged; residual rows equal to the stored form.
  void verify_packed(std::int64_t l, std::int64_t h) {
    Head& m = layers_[static_cast<std::size_t>(l)].heads[static_cast<std::size_t>(h)];
    const auto& qc = *plan_.quant;
    const auto& p = s_.packed(l, h);
    const std::int64_t size = m.rows(), G = qc.group;
    require(m.residual <= qc.residual && p.config().residual == m.residual, "layer ", l, " head ",
            h, ": residual window ", p.config().residual, ", expected ", m.residual, " (of ",
            qc.residual, ")");
    const std::int64_t packed = G * std::min((std::max<std::int64_t>(0, size - m.residual) + G - 1) / G, size / G);
    require(p.size() == size && p.packed_tokens() == packed && p.tiles() * G == packed, "layer ", l,
            " head ", h, ": packed cache holds ", p.size(), " tokens, ", p.packed_tokens(),
            " packed; expected ", size, ", ", packed);
    require(!m.bytes_bounded || p.memory_bytes() <= static_cast<std::size_t>(size * 2 * d_) * sizeof(T),
            "layer ", l, " head ", h, ": packed cache holds ", p.memory_bytes(), " bytes, more than ",
            size, " plain rows");
    const std::size_t bb = BlockRef::bytes(qc.bits, qc.group);
    const std::size_t kts = static_cast<std::size_t>(d_) * bb + (qc.token_norm ? 4 * static_cast<std::size_t>(G) : 0);
    const std::size_t vts = static_cast<std::size_t>(d_) * bb;
    require(p.key_tile_size() == kts && p.value_tile_size() == vts, "layer ", l, ": tile sizes ",
            p.key_tile_size(), "/", p.value_tile_size(), ", expected ", kts, "/", vts);
    const std::size_t bytes = static_cast<std::size_t>(p.tiles()) * (kts + vts) +
                              static_cast<std::size_t>((size - packed) * (2 * d_ + 1)) * sizeof(float);
    require(p.memory_bytes() == bytes, "layer ", l, " head ", h, ": memory_bytes() ", p.memory_bytes(),
            ", expected ", bytes);
    for (std::int64_t i = 0; i < m.tiles_checked; ++i)
      require(std::memcmp(p.key_tile(i), m.tiles.data() + static_cast<std::size_t>(i) * (kts + vts), kts) == 0 &&
                  std::memcmp(p.value_tile(i), m.tiles.data() + static_cast<std::size_t>(i) * (kts + vts) + kts, vts) == 0,
              "layer ", l, " head ", h, ": packed tile ", i, " changed after it was written");
    for (std::int64_t i = m.tiles_checked; i < p.tiles(); ++i) {
      check_tile(l, h, m, p, i);
      m.tiles.insert(m.tiles.end(), p.key_tile(i), p.key_tile(i) + kts);
      m.tiles.insert(m.tiles.end(), p.value_tile(i), p.value_tile(i) + vts);
      ++c_->tiles_checked;
    }
    m.tiles_checked = p.tiles();
    for (std::int64_t r = 0; r < size - packed; ++r) {
      const StoredRow& ref = m.stored[static_cast<std::size_t>(packed + r)];
      double ek = 0, ev = 0, nk = 0, nv = 0;
      for (std::int64_t c = 0; c < d_; ++c) {
        const auto cs = static_cast<std::size_t>(c);
        ek = std::max(ek, std::abs(p.residual_keys()[r * d_ + c] - ref.k[cs]));
        ev = std::max(ev, std::abs(p.residual_values()[r * d_ + c] - ref.v[cs]));
        nk += ref.k[cs] * ref.k[cs], nv += ref.v[cs] * ref.v[cs];
      }
      const double norm = p.residual_norms()[r];
      require(ek <= 1e-5 * std::sqrt(nk) + 1e-12 && ev <= 1e-5 * std::sqrt(nv) + 1e-12 &&
                  std::abs(norm - ref.norm) <= 1e-5 * ref.norm,
              "layer ", l, " head ", h, ": residual row ", r, " (position ", m.pos[static_cast<std::size_t>(packed + r)],
              ") is not the stored form of its token (K ", ek, ", V ", ev, ", norm ", norm, " vs ", ref.norm, ")");
    }
  }

  // Tile i: every element within half a quantization step of the stored form (quant/block.hpp).
  template <class P>
  void check_tile(std::int64_t l, std::int64_t h, const Head& m, const P& p, std::int64_t i) const {
    const auto& qc = *plan_.quant;
    const int G = qc.group;
    auto within = [&](double got, double want, float scale, double row_norm, const char* part,
                      std::int64_t row, std::int64_t ch) {
      const double tol = 0.5 * scale * (1 + 1e-5) + 1e-5 * row_norm + 1e-12;
      if (std::abs(got - want) > tol)
        failure("layer ", l, " head ", h, ": packed ", part, " of row ", row, " (position ",
                m.pos[static_cast<std::size_t>(row)], "), channel ", ch, ": decodes to ", got,
                ", stored form ", want, ", more than half a step (", scale, ") apart");
    };
    auto norm2 = [](const std::vector<double>& x) {
      double s = 0;
      for (double v : x) s += v * v;
      return std::sqrt(s);
    };
    for (std::int64_t c = 0; c < d_; ++c) {
      const BlockRef b = BlockRef::at(p.key_tile(i), static_cast<std::size_t>(c), qc.bits, G);
      for (int j = 0; j < G; ++j) {
        const std::int64_t row = i * G + j;
        const StoredRow& ref = m.stored[static_cast<std::size_t>(row)];
        within(b.value(j), ref.k[static_cast<std::size_t>(c)], b.scale, norm2(ref.k), "key", row, c);
      }
    }
    if (qc.token_norm)
      for (int j = 0; j < G; ++j) {
        float nr;
        std::memcpy(&nr, p.key_tile(i) + static_cast<std::size_t>(d_) * BlockRef::bytes(qc.bits, G) + 4 * static_cast<std::size_t>(j), 4);
        const double want = m.stored[static_cast<std::size_t>(i * G + j)].norm;
        require(std::abs(nr - want) <= 1e-5 * want, "layer ", l, " head ", h, ": key tile ", i,
                " holds norm ", nr, " for row ", i * G + j, ", expected ", want);
      }
    const std::int64_t per = d_ / G;
    for (int j = 0; j < G; ++j) {
      const std::int64_t row = i * G + j;
      const StoredRow& ref = m.stored[static_cast<std::size_t>(row)];
      for (std::int64_t bl = 0; bl < per; ++bl) {
        const BlockRef b = BlockRef::at(p.value_tile(i), static_cast<std::size_t>(j * per + bl), qc.bits, G);
        for (int x = 0; x < G; ++x)
          within(b.value(x), ref.v[static_cast<std::size_t>(bl * G + x)], b.scale, norm2(ref.v), "value", row, bl * G + x);
      }
    }
  }

  std::string name_;
  Plan plan_;
  Session<T> s_;
  const Where* w_;
  Counters* c_;
  const Tracked* twin_ = nullptr;
  std::int64_t hkv_ = 0, d_ = 0, g_ = 0, interval_ = 0;
  float acc_scale_ = 1;
  bool tracks_acc_ = false, masks_seen_ = false;
  std::vector<Layer> layers_;
};

}  // namespace kvtest::soak
