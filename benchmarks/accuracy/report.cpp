#include "report.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <map>
#include <set>
#include <tuple>

#include "stats.hpp"

namespace kvbench {

Progress::Progress(double total_units)
    : total_(std::max(total_units, 1.0)),
      tty_(isatty(STDERR_FILENO) != 0),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

void Progress::advance(double units, const std::string& label) {
  done_ += units;
  label_ = label;
  draw(false);
}

void Progress::finish() {
  done_ = total_;
  draw(true);
  if (tty_) std::fputc('\n', stderr);
}

void Progress::draw(bool force) {
  const auto now = std::chrono::steady_clock::now();
  const double frac = std::clamp(done_ / total_, 0.0, 1.0);
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double eta = frac > 0.01 ? elapsed * (1 - frac) / frac : NAN;
  auto clock = [](double s) {
    if (!std::isfinite(s)) return std::string("--:--");
    const int t = static_cast<int>(s + 0.5);
    return fmt("%d:%02d", t / 60, t % 60);
  };
  if (tty_) {
    if (!force && std::chrono::duration<double>(now - last_draw_).count() < 0.2) return;
    last_draw_ = now;
    constexpr int width = 30;
    const int fill = static_cast<int>(frac * width);
    std::string bar(static_cast<std::size_t>(fill), '#');
    bar.resize(width, '.');
    std::fprintf(stderr, "\r[%s] %3d%%  %s elapsed, ETA %s  %-48.48s", bar.c_str(),
                 static_cast<int>(frac * 100), clock(elapsed).c_str(), clock(eta).c_str(),
                 label_.c_str());
    std::fflush(stderr);
    return;
  }
  const int decile = static_cast<int>(frac * 10);
  if (decile == last_decile_ && !force) return;
  last_decile_ = decile;
  std::fprintf(stderr, "progress: %3d%%  %s elapsed, ETA %s  %s\n", decile * 10,
               clock(elapsed).c_str(), clock(eta).c_str(), label_.c_str());
  std::fflush(stderr);
}

std::string markdown_table(const std::vector<std::string>& header,
                           const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> w(header.size());
  for (std::size_t i = 0; i < header.size(); ++i) w[i] = header[i].size();
  for (const auto& r : rows)
    for (std::size_t i = 0; i < r.size() && i < w.size(); ++i) w[i] = std::max(w[i], r[i].size());
  auto line = [&](const std::vector<std::string>& cells) {
    std::string s = "|";
    for (std::size_t i = 0; i < w.size(); ++i) {
      const std::string c = i < cells.size() ? cells[i] : "";
      s += " " + c + std::string(w[i] - c.size(), ' ') + " |";
    }
    return s + "\n";
  };
  std::string out = line(header);
  std::string sep = "|";
  for (auto x : w) sep += std::string(x + 2, '-') + "|";
  out += sep + "\n";
  for (const auto& r : rows) out += line(r);
  return out;
}

std::string fmt(const char* f, ...) {
  va_list ap;
  va_start(ap, f);
  char buf[512];
  const int n = std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  if (n < 0) return {};
  if (static_cast<std::size_t>(n) < sizeof buf) return std::string(buf, static_cast<std::size_t>(n));
  std::string s(static_cast<std::size_t>(n) + 1, '\0');
  va_start(ap, f);
  std::vsnprintf(s.data(), s.size(), f, ap);
  va_end(ap);
  s.resize(static_cast<std::size_t>(n));
  return s;
}

// ---- the report -------------------------------------------------------------------------

namespace {

using json = nlohmann::json;

std::string pct(double x) { return fmt("%.0f%%", 100 * x); }

// A spec inside a markdown table cell: profile folder left out, code span, pipes escaped.
std::string cell(std::string spec) {
  for (const char* dir : {"/benchmarks/profiles/"})
    for (std::size_t at; (at = spec.find(dir)) != std::string::npos;) {
      const auto open = spec.rfind('=', at);
      spec.erase(open + 1, at + std::string(dir).size() - open - 1);
    }
  std::string out = "`";
  for (char c : spec) {
    if (c == '|') out += '\\';
    out += c;
  }
  return out + "`";
}

// The best policy, and those whose every sample equals its own.
std::string best_cell(const std::string& best, const std::vector<std::string>& same) {
  std::string out = cell(best);
  for (const auto& s : same) out += " = " + cell(s);
  return out;
}

std::string em_cell(const std::vector<std::uint8_t>& x) {
  std::int64_t k = 0;
  for (auto v : x) k += v;
  const auto n = static_cast<std::int64_t>(x.size());
  const auto w = stats::wilson(k, n);
  return fmt("%.0f%% [%.0f, %.0f]", n ? 100.0 * double(k) / double(n) : 0.0, 100 * w.lo, 100 * w.hi);
}
json em_json(const std::vector<std::uint8_t>& x) {
  std::int64_t k = 0;
  for (auto v : x) k += v;
  const auto n = static_cast<std::int64_t>(x.size());
  const auto w = stats::wilson(k, n);
  return {{"k", k}, {"n", n}, {"rate", n ? double(k) / double(n) : 0.0}, {"ci", {w.lo, w.hi}}};
}
// A mean and its interval; with fewer than 2 samples there is no interval to show.
std::string mean_cell(const stats::Estimate& e, const char* f = "%+.2f") {
  if (e.n < 2) return fmt(f, e.mean) + " [n/a]";
  return fmt(f, e.mean) + " [" + fmt(f, e.ci.lo) + ", " + fmt(f, e.ci.hi) + "]";
}
json mean_json(const stats::Estimate& e) {
  return {{"mean", e.mean}, {"ci", {e.ci.lo, e.ci.hi}}, {"n", e.n}};
}

// Sort key of a retrieval record: task, length, index.
bool before(const json& a, const json& b) {
  return std::tie(a["task"].get_ref<const std::string&>(), a["length"].get_ref<const json::number_integer_t&>(),
                  a["index"].get_ref<const json::number_integer_t&>()) <
         std::tie(b["task"].get_ref<const std::string&>(), b["length"].get_ref<const json::number_integer_t&>(),
                  b["index"].get_ref<const json::number_integer_t&>());
}

// Per (regime, policy, budget): the paired samples over prompts, in record order.
struct Samples {
  std::vector<std::uint8_t> em;
  std::vector<double> dlogp, kept;
};
using CellKey = std::tuple<std::string, std::string, double>;  // regime, policy, budget

}  // namespace

std::string render_report(json& results) {
  const json& cfg = results["config"];
  const int B = cfg.value("resamples", 2000);
  auto& recs = results["records"];
  // Canonical order, whatever the shards.
  std::sort(recs["retrieval"].begin(), recs["retrieval"].end(), before);
  std::sort(recs["fidelity"].begin(), recs["fidelity"].end(), [](const json& a, const json& b) {
    return std::tie(a["source"].get_ref<const std::string&>(), a["window"].get_ref<const json::number_integer_t&>()) <
           std::tie(b["source"].get_ref<const std::string&>(), b["window"].get_ref<const json::number_integer_t&>());
  });
  std::sort(recs["long"].begin(), recs["long"].end(), [](const json& a, const json& b) {
    return a["prompt"].get<std::int64_t>() < b["prompt"].get<std::int64_t>();
  });
  const auto policies = cfg["policies"].get<std::vector<std::string>>();
  const auto budgets = cfg["budgets"].get<std::vector<double>>();
  const auto regimes = cfg["regimes"].get<std::vector<std::string>>();
  const auto tasks = cfg["tasks"].get<std::vector<std::string>>();
  const std::int64_t grid_length = cfg["grid_length"];
  auto regime_title = [](const std::string& r) {
    return r == "known" ? std::string("question-known") : std::string("question-agnostic");
  };
  json summary;
  std::string md;
  const auto& model = results["model"];
  md += fmt("# kvpolicy accuracy benchmark (suite %s, %s prompts)\n\n",
            cfg["suite"].get<std::string>().c_str(), cfg["prompt_set"].get<std::string>().c_str());
  md += fmt("Model: %s (%s, %lld layers, %lld query / %lld KV heads, head_dim %lld). Threads: %d. "
            "Shards: %zu. Intervals: 95%%, Wilson for exact match (EM), percentile bootstrap "
            "(%d resamples) for means; a policy is said to beat another only when the paired "
            "interval of the difference excludes zero.\n\n",
            model["name"].get<std::string>().c_str(), model["architecture"].get<std::string>().c_str(),
            static_cast<long long>(model["layers"].get<std::int64_t>()),
            static_cast<long long>(model["q_heads"].get<std::int64_t>()),
            static_cast<long long>(model["kv_heads"].get<std::int64_t>()),
            static_cast<long long>(model["head_dim"].get<std::int64_t>()), results["threads"].get<int>(),
            results["shards"].size(), B);

  // ---- retrieval: full-cache curve ----
  const auto& rr = recs["retrieval"];
  if (!rr.empty()) {
    md += "## Retrieval: the full cache over prompt length\n\nEM: greedy decoding reproduces the "
          "answer exactly (teacher-forced: every answer token is the argmax). Greedy: the full "
          "cache's own greedy answer starts with the expected one. log p: the answer's "
          "log-probability (nats).\n\n";
    std::vector<std::vector<std::string>> rows;
    json curve = json::array();
    std::vector<std::pair<std::string, std::int64_t>> keys;
    for (const auto& r : rr) {
      std::pair<std::string, std::int64_t> k{r["task"], r["length"]};
      if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
    }
    for (const auto& t : tasks)
      for (const auto& [task, L] : keys) {
        if (task != t) continue;
        std::vector<std::uint8_t> em, greedy;
        std::vector<double> logp;
        std::int64_t tokens = 0;
        std::set<std::string> sources;
        for (const auto& r : rr)
          if (r["task"] == task && r["length"] == L) {
            em.push_back(r["full_em"].get<bool>());
            greedy.push_back(r["full_greedy_match"].get<bool>());
            logp.push_back(r["full_logp"]);
            tokens = std::max<std::int64_t>(tokens, r["tokens"]);
            sources.insert(r["source"].get<std::string>());
          }
        const auto lp = stats::bootstrap_mean(logp, B);
        rows.push_back({task, std::to_string(L), std::to_string(em.size()), std::to_string(tokens),
                        em_cell(em), em_cell(greedy), mean_cell(lp)});
        curve.push_back({{"task", task}, {"length", L}, {"tokens", tokens}, {"em", em_json(em)},
                         {"greedy", em_json(greedy)}, {"logp", mean_json(lp)}});
      }
    md += markdown_table({"task", "length", "prompts", "tokens (max)", "EM", "greedy", "log p"},
                         rows);
    summary["curve"] = curve;
    // Tasks the full cache cannot do at the grid length are flagged.
    std::string weak;
    for (const auto& c : curve)
      if (c["length"] == grid_length && c["em"]["rate"].get<double>() < 0.9)
        weak += (weak.empty() ? "" : ", ") + c["task"].get<std::string>() +
                fmt(" (%.0f%%)", 100 * c["em"]["rate"].get<double>());
    if (!weak.empty())
      md += fmt("\nBelow 90%% EM with the full cache at the grid length (%lld): %s. Their EM "
                "columns below mostly measure the model; the log-probability change still ranks "
                "policies.\n",
                static_cast<long long>(grid_length), weak.c_str());
    md += "\n";
  }

  // ---- retrieval grid ----
  std::map<std::string, std::map<CellKey, Samples>> by_task;  // task -> cell -> samples
  std::map<CellKey, Samples> pooled;
  for (const auto& r : rr)
    for (const auto& c : r["cells"]) {
      const CellKey k{c["regime"], c["policy"], c["budget"]};
      for (auto* s : {&by_task[r["task"]][k], &pooled[k]}) {
        s->em.push_back(c["em"].get<bool>());
        s->dlogp.push_back(c["dlogp"]);
        s->kept.push_back(c["kept"]);
      }
    }
  json grid_summary = json::object();
  auto grid_table = [&](const std::map<CellKey, Samples>& cells, const std::string& name) {
    std::vector<std::string> header = {"policy"};
    for (const auto& r : regimes)
      for (double b : budgets) header.push_back(fmt("%s %.0f%%", r == "known" ? "QK" : "QA", 100 * b));
    std::vector<std::vector<std::string>> rows;
    json out = json::array();
    for (const auto& p : policies) {
      std::vector<std::string> row = {cell(p)};
      for (const auto& r : regimes)
        for (double b : budgets) {
          const auto it = cells.find({r, p, b});
          if (it == cells.end()) {
            row.push_back("-");
            continue;
          }
          const auto lp = stats::bootstrap_mean(it->second.dlogp, B);
          row.push_back(em_cell(it->second.em) + " · " + mean_cell(lp));
          double kept = 0;
          for (double x : it->second.kept) kept += x;
          out.push_back({{"regime", r}, {"policy", p}, {"budget", b}, {"em", em_json(it->second.em)},
                         {"dlogp", mean_json(lp)},
                         {"kept", it->second.kept.empty() ? 0.0 : kept / double(it->second.kept.size())}});
        }
      rows.push_back(row);
    }
    grid_summary[name] = out;
    return markdown_table(header, rows);
  };
  if (!pooled.empty()) {
    md += fmt("## Retrieval at %lld tokens: policy x budget, both regimes\n\nQK: question-known "
              "(the prompt with its question is compressed, then the answer is decoded); QA: "
              "question-agnostic (the context is compressed, then the question and answer are "
              "appended uncompressed). Budget: kept fraction of the compressed tokens. Cells: EM "
              "[95%% CI] · change of the answer's log-probability against the full cache, nats "
              "[95%% CI] (0 = as good as the full cache).\n\n",
              static_cast<long long>(grid_length));
    md += "### All tasks pooled\n\n" + grid_table(pooled, "all") + "\n";
    for (const auto& t : tasks) {
      if (!by_task.count(t)) continue;
      std::int64_t k = 0, n = 0;
      for (const auto& r : rr)
        if (r["task"] == t && r["length"] == grid_length && !r["cells"].empty()) k += r["full_em"].get<bool>(), ++n;
      md += fmt("### %s (full cache: EM %lld/%lld)\n\n", t.c_str(), static_cast<long long>(k),
                static_cast<long long>(n));
      md += grid_table(by_task[t], t) + "\n";
    }
    summary["retrieval"] = grid_summary;
  }

  // ---- fidelity ----
  const auto& fr = recs["fidelity"];
  std::map<std::pair<std::string, double>, std::vector<double>> fkl, ftop, fnll;
  if (!fr.empty()) {
    std::set<std::string> sources;
    for (const auto& r : fr) {
      sources.insert(r["source"].get<std::string>());
      for (const auto& c : r["cells"]) {
        const std::pair<std::string, double> k{c["policy"], c["budget"]};
        fkl[k].push_back(c["kl"]);
        ftop[k].push_back(c["top1"]);
        fnll[k].push_back(c["dnll"]);
      }
    }
    std::string names;
    for (const auto& s : sources) names += (names.empty() ? "" : ", ") + s;
    md += fmt("## Teacher-forced fidelity\n\n%zu windows of %lld prompt + %lld continuation tokens "
              "from %zu texts (%s). Cells: mean KL(full || policy) in nats [95%% CI] / top-1 "
              "agreement with the full cache / NLL change [95%% CI], each window one sample.\n\n",
              fr.size(), static_cast<long long>(cfg["text_prompt"].get<std::int64_t>()),
              static_cast<long long>(cfg["text_cont"].get<std::int64_t>()), sources.size(), names.c_str());
    std::vector<std::string> header = {"policy"};
    for (double b : budgets) header.push_back(pct(b));
    std::vector<std::vector<std::string>> rows;
    json out = json::array();
    for (const auto& p : policies) {
      std::vector<std::string> row = {cell(p)};
      for (double b : budgets) {
        const auto kl = stats::bootstrap_mean(fkl[{p, b}], B);
        const auto top = stats::bootstrap_mean(ftop[{p, b}], B);
        const auto dn = stats::bootstrap_mean(fnll[{p, b}], B);
        row.push_back(mean_cell(kl, "%.3f") + " / " + pct(top.mean) + " / " + mean_cell(dn, "%+.3f"));
        out.push_back({{"policy", p}, {"budget", b}, {"kl", mean_json(kl)}, {"top1", mean_json(top)},
                       {"dnll", mean_json(dn)}});
      }
      rows.push_back(row);
    }
    md += markdown_table(header, rows) + "\n";

    // Paired against the first policy at the same budget: the same windows.
    std::vector<std::vector<std::string>> prow;
    json paired = json::array();
    for (std::size_t i = 1; i < policies.size(); ++i) {
      std::vector<std::string> row = {cell(policies[i])};
      for (double b : budgets) {
        const auto a = fkl.find({policies[i], b}), z = fkl.find({policies[0], b});
        if (a == fkl.end() || z == fkl.end() || a->second.empty() ||
            a->second.size() != z->second.size()) {
          row.push_back("-");
          continue;
        }
        const auto d = stats::paired_bootstrap(a->second, z->second, B);
        const bool sep = d.ci.excludes_zero();
        row.push_back(mean_cell(d, "%+.4f") + (sep ? " separated" : ""));
        paired.push_back({{"policy", policies[i]}, {"baseline", policies[0]}, {"budget", b},
                          {"kl_diff", mean_json(d)}, {"separated", sep}});
      }
      prow.push_back(row);
    }
    if (!prow.empty())
      md += fmt("Paired against `%s` at the same budget: mean KL difference over the same windows "
                "(negative: lower KL than `%s`) with its paired bootstrap 95%% interval; "
                "\"separated\": the interval excludes zero.\n\n",
                policies[0].c_str(), policies[0].c_str()) +
            markdown_table(header, prow) + "\n";
    summary["fidelity_paired"] = paired;
    summary["fidelity"] = out;
  }

  // ---- long generation ----
  const auto& lr = recs["long"];
  if (!lr.empty()) {
    std::int64_t gen = 0;
    for (const auto& r : lr) gen += r["generated"].get<std::int64_t>();
    const std::int64_t bin = lr[0]["bin"];
    md += fmt("## Long generation with decode-time compression\n\n%zu prompt(s) asking for long "
              "numbered lists or step-by-step arithmetic; the full cache generates %lld tokens "
              "in all (sampled at temperature 0.7, fixed seed), which are teacher-forced through "
              "each policy compressing back to its budget (tokens per KV head) while decoding: "
              "H2O at every step, the others every %lld tokens. Intervals: bootstrap over "
              "%lld-token blocks of the generation(s); neighbouring blocks are correlated, so "
              "with few generations they understate the spread over prompts. Start of the first "
              "generation: \"%s\"\n\n",
              lr.size(), static_cast<long long>(gen),
              static_cast<long long>(cfg["long_interval"].get<std::int64_t>()),
              static_cast<long long>(bin), lr[0]["sample"].get<std::string>().substr(0, 120).c_str());
    std::vector<std::vector<std::string>> rows, curve_rows;
    json out = json::array();
    std::size_t nbins = 0;
    const auto& cells0 = lr[0]["cells"];
    for (std::size_t i = 0; i < cells0.size(); ++i) {
      std::vector<double> kl_b, top_b;
      double kl = 0, top = 0, dn = 0, bytes = 0;
      std::vector<double> curve;
      for (const auto& r : lr) {
        const auto& c = r["cells"][i];
        const auto kb = c["kl_bins"].get<std::vector<double>>();
        const auto tb = c["top1_bins"].get<std::vector<double>>();
        kl_b.insert(kl_b.end(), kb.begin(), kb.end());
        top_b.insert(top_b.end(), tb.begin(), tb.end());
        if (curve.size() < kb.size()) curve.resize(kb.size(), 0.0);
        for (std::size_t b = 0; b < kb.size(); ++b) curve[b] += kb[b] / double(lr.size());
        kl += c["kl"].get<double>() / double(lr.size());
        top += c["top1"].get<double>() / double(lr.size());
        dn += c["dnll"].get<double>() / double(lr.size());
        bytes += c["kv_bytes"].get<double>() / double(lr.size());
      }
      const auto klb = stats::bootstrap_mean(kl_b, B), topb = stats::bootstrap_mean(top_b, B);
      const std::string policy = cells0[i]["policy"];
      const std::int64_t budget = cells0[i]["budget"];
      rows.push_back({cell(policy), std::to_string(budget), mean_cell(klb, "%.3f"),
                      pct(topb.mean) + fmt(" [%.0f, %.0f]", 100 * topb.ci.lo, 100 * topb.ci.hi),
                      fmt("%+.3f", dn), fmt("%.2f", bytes / (1 << 20))});
      std::vector<std::string> crow = {cell(policy) + " @ " + std::to_string(budget)};
      nbins = std::max(nbins, curve.size());
      for (double x : curve) crow.push_back(fmt("%.2f", x));
      curve_rows.push_back(crow);
      out.push_back({{"policy", policy}, {"budget", budget}, {"kl", mean_json(klb)},
                     {"top1", mean_json(topb)}, {"dnll", dn}, {"kv_bytes", bytes}, {"kl_curve", curve}});
      (void)kl;
      (void)top;
    }
    md += markdown_table({"policy", "budget", "KL [95% CI]", "token agreement", "NLL change", "KV MiB"},
                         rows);
    md += fmt("\nMean KL per %lld generated tokens (columns: first token of the block), where a "
              "policy that wipes out a region shows as a jump:\n\n",
              static_cast<long long>(bin));
    std::vector<std::string> header = {"policy @ budget"};
    for (std::size_t b = 0; b < nbins; ++b) header.push_back(std::to_string(b * static_cast<std::size_t>(bin)));
    md += markdown_table(header, curve_rows) + "\n";

    // Paired against the first policy at the same budget: the same blocks of the same generations.
    const std::string base = cells0[0]["policy"];
    std::vector<std::vector<std::string>> prow;
    json paired = json::array();
    for (std::size_t i = 0; i < cells0.size(); ++i) {
      const std::string policy = cells0[i]["policy"];
      const std::int64_t budget = cells0[i]["budget"];
      if (policy == base) continue;
      std::size_t j = cells0.size();
      for (std::size_t k = 0; k < cells0.size(); ++k)
        if (cells0[k]["policy"] == base && cells0[k]["budget"] == budget) j = k;
      if (j == cells0.size()) continue;
      std::vector<double> a, b, dcurve;
      bool pairs = true;  // every generation has as many blocks in both cells
      for (const auto& r : lr) {
        const auto ka = r["cells"][i]["kl_bins"].get<std::vector<double>>();
        const auto kb = r["cells"][j]["kl_bins"].get<std::vector<double>>();
        pairs = pairs && ka.size() == kb.size();
        a.insert(a.end(), ka.begin(), ka.end());
        b.insert(b.end(), kb.begin(), kb.end());
        if (dcurve.size() < ka.size()) dcurve.resize(ka.size(), 0.0);
        for (std::size_t q = 0; q < ka.size() && q < kb.size(); ++q)
          dcurve[q] += (ka[q] - kb[q]) / double(lr.size());
      }
      if (!pairs) continue;  // not paired (cannot happen while every generation has long_tokens)
      const auto d = stats::paired_bootstrap(a, b, B);
      const bool sep = d.ci.excludes_zero();
      std::vector<std::string> row = {cell(policy) + " @ " + std::to_string(budget),
                                      mean_cell(d, "%+.4f"), sep ? "yes" : "no"};
      for (double x : dcurve) row.push_back(fmt("%+.3f", x));
      prow.push_back(row);
      paired.push_back({{"policy", policy}, {"baseline", base}, {"budget", budget},
                        {"kl_diff", mean_json(d)}, {"separated", sep}, {"kl_diff_curve", dcurve}});
    }
    if (!prow.empty()) {
      md += fmt("\nPaired against `%s` at the same budget: mean KL difference (negative: lower KL "
                "than `%s`) with its paired bootstrap 95%% interval over the same %lld-token blocks "
                "(correlated neighbours, as above), then the mean difference per block:\n\n",
                base.c_str(), base.c_str(), static_cast<long long>(bin));
      std::vector<std::string> ph = {"policy @ budget", "KL difference [95% CI]", "separated"};
      for (std::size_t q = 0; q < nbins; ++q) ph.push_back(std::to_string(q * static_cast<std::size_t>(bin)));
      for (auto& r : prow) r.resize(ph.size());
      md += markdown_table(ph, prow) + "\n";
    }
    summary["long_paired"] = paired;
    summary["long"] = out;
  }

  // ---- summary: best per (budget, regime) ----
  {
    // Only when some row exists (a run of the long-generation task alone has none).
    const std::string head =
        "## Summary: the best policy per budget and regime\n\nRetrieval rows rank by the mean "
          "change of the answer log-probability over all tasks' prompts (higher is better), "
          "fidelity rows by mean KL (lower is better). Margin: best minus runner-up with the "
          "paired 95% interval (paired bootstrap over the same prompts or windows; policies with results identical to the best's are listed with it, \"=\"); "
          "\"separated\": the interval excludes zero. EM: the two policies' exact match and "
          "McNemar's exact p. The two are picked as the top two of the same sample that tests "
          "them and no multiplicity correction is made, so a \"yes\" near the boundary is "
          "weaker than its interval suggests; intervals from fewer than ~20 samples (the default "
          "run's per-task cells) are rough.\n\n";
    std::vector<std::vector<std::string>> rows;
    json out = json::array();
    for (double b : budgets) {
      for (const auto& r : regimes) {
        std::vector<std::pair<double, std::string>> rank;
        for (const auto& p : policies) {
          const auto it = pooled.find({r, p, b});
          if (it == pooled.end() || it->second.dlogp.empty()) continue;
          double m = 0;
          for (double x : it->second.dlogp) m += x;
          rank.push_back({m / double(it->second.dlogp.size()), p});
        }
        if (rank.size() < 2) continue;
        // Ties (e.g. identical policies at a generous budget) fall back to the name.
        std::sort(rank.begin(), rank.end(), [](const auto& x, const auto& y) {
          return x.first != y.first ? x.first > y.first : x.second < y.second;
        });
        // The runner-up is the next policy whose results differ from the best's on some prompt
        // (a chain that selects exactly like its scorer, e.g. snapkv | pyramid here, ties).
        const auto& A = pooled.at({r, rank[0].second, b});
        std::vector<std::string> same;
        std::size_t next = 1;
        while (next < rank.size() && pooled.at({r, rank[next].second, b}).dlogp == A.dlogp &&
               pooled.at({r, rank[next].second, b}).em == A.em)
          same.push_back(rank[next++].second);
        if (next == rank.size()) continue;
        const auto& Bs = pooled.at({r, rank[next].second, b});
        const auto d = stats::paired_bootstrap(A.dlogp, Bs.dlogp, B);
        const auto mc = stats::mcnemar(A.em, Bs.em);
        const bool sep = d.ci.excludes_zero();
        std::int64_t ka = 0, kb = 0;
        for (auto v : A.em) ka += v;
        for (auto v : Bs.em) kb += v;
        rows.push_back({pct(b), regime_title(r) + " retrieval", best_cell(rank[0].second, same),
                        cell(rank[next].second), mean_cell(d), sep ? "yes" : "no",
                        fmt("%.0f%% vs %.0f%%, p=%.3g", 100.0 * double(ka) / double(A.em.size()),
                            100.0 * double(kb) / double(Bs.em.size()), mc.p)});
        out.push_back({{"budget", b}, {"task", "retrieval"}, {"regime", r}, {"best", rank[0].second},
                       {"identical", same}, {"runner_up", rank[next].second},
                       {"margin", mean_json(d)}, {"separated", sep},
                       {"mcnemar_p", mc.p}, {"em_diff_ci", {mc.ci.lo, mc.ci.hi}}});
      }
      std::vector<std::pair<double, std::string>> rank;
      for (const auto& p : policies) {
        const auto it = fkl.find({p, b});
        if (it == fkl.end() || it->second.empty()) continue;
        double m = 0;
        for (double x : it->second) m += x;
        rank.push_back({m / double(it->second.size()), p});
      }
      std::sort(rank.begin(), rank.end());
      std::vector<std::string> same;
      std::size_t next = 1;
      while (next < rank.size() && fkl[{rank[next].second, b}] == fkl[{rank[0].second, b}])
        same.push_back(rank[next++].second);
      if (next < rank.size()) {
        const auto d =
            stats::paired_bootstrap(fkl[{rank[0].second, b}], fkl[{rank[next].second, b}], B);
        const bool sep = d.ci.excludes_zero();
        rows.push_back({pct(b), "fidelity (KL)", best_cell(rank[0].second, same),
                        cell(rank[next].second), mean_cell(d, "%+.4f"), sep ? "yes" : "no", "-"});
        out.push_back({{"budget", b}, {"task", "fidelity"}, {"regime", "-"}, {"best", rank[0].second},
                       {"identical", same}, {"runner_up", rank[next].second},
                       {"margin", mean_json(d)}, {"separated", sep}});
      }
    }
    if (!rows.empty())
      md += head + markdown_table({"budget", "measure", "best", "runner-up", "margin [95% CI]",
                                   "separated", "EM"},
                                  rows) + "\n";
    summary["best"] = out;
  }

  // ---- throughput ----
  const auto& thr = results["throughput"];
  if (!thr.empty()) {
    md += "## Throughput\n\nPrefill (chunks of 512 tokens) and greedy decode on this machine; a "
          "compressed row's prefill includes its compression (and, with int2, the packing of the "
          "survivors; int2 = 2-bit rotated codes, 32-token groups, the newest 128 tokens in fp32). "
          "Decode tok/s: the median of 3 rounds in which every row's engine takes turns. Bytes "
          "read per token: every weight matrix once (as held: GGUF types, or fp32 in the 'fp32 "
          "weights' row) plus the K/V held (fp32, or packed tiles + scales + norms + residual "
          "window). GB/s: those bytes times tokens/s, and the share of this machine's read "
          "bandwidth measured in the same run";
    if (thr[0].contains("memory_read_gb_per_s"))
      md += fmt(" (%.1f GB/s, %lld threads)", thr[0]["memory_read_gb_per_s"].get<double>(),
                static_cast<long long>(results.value("threads", 0)));
    md += ".\n\n";
    std::vector<std::vector<std::string>> rows;
    for (const auto& t : thr) {
      std::string c = t["cache"];
      std::string esc;
      for (char ch : c) esc += ch == '|' ? std::string("\\|") : std::string(1, ch);
      const double cm = t["compress_ms"], tps = t["decode_tokens_per_s"];
      const double kv = t["kv_bytes"].get<double>(), wb = t.value("weight_bytes_per_token", 0.0);
      const double bw = t.value("memory_read_gb_per_s", 0.0), gbps = (kv + wb) * tps * 1e-9;
      rows.push_back({std::to_string(t["context"].get<std::int64_t>()), esc,
                      fmt("%.0f", t["prefill_tokens_per_s"].get<double>()),
                      cm > 0 ? fmt("%.0f", cm) : "-", fmt("%.1f", tps),
                      wb > 0 ? fmt("%.1f", wb / (1 << 20)) : "-", fmt("%.1f", kv / (1 << 20)),
                      wb > 0 ? fmt("%.1f", gbps) : "-",
                      wb > 0 && bw > 0 ? fmt("%.0f%%", 100 * gbps / bw) : "-"});
    }
    md += markdown_table({"context", "cache", "prefill tok/s", "compress ms", "decode tok/s",
                          "weights MiB/token", "KV MiB", "GB/s read", "of bandwidth"},
                         rows) +
          "\n";
    // The decode speed-up targets, per context: each ratio is between rows timed in the same
    // rounds.
    auto rate = [&](std::int64_t L, const std::string& cache) {
      for (const auto& t : thr)
        if (t["context"].get<std::int64_t>() == L && t["cache"].get<std::string>() == cache)
          return t["decode_tokens_per_s"].get<double>();
      return 0.0;
    };
    const std::string policy = results["config"].value("throughput_policy", std::string("snapkv"));
    const double budget = results["config"].value("throughput_budget", 0.2);
    const std::string evicted = fmt("%s @ %.0f%%", policy.c_str(), budget * 100);
    std::vector<std::vector<std::string>> sp;
    std::set<std::int64_t> contexts;
    for (const auto& t : thr) contexts.insert(t["context"].get<std::int64_t>());
    for (std::int64_t L : contexts) {
      auto add = [&](const std::string& what, double num, double den, double target) {
        if (num <= 0 || den <= 0) return;
        const double r = num / den;
        std::string shown;
        for (char ch : what) shown += ch == '|' ? std::string("\\|") : std::string(1, ch);
        sp.push_back({std::to_string(L), shown, fmt("%.2fx", r), fmt(">= %.1fx", target),
                      r >= target ? "yes" : "**no**"});
      };
      add("full cache: GGUF weights / fp32 weights", rate(L, "full cache"),
          rate(L, "full cache, fp32 weights"), 1.7);
      add(evicted + " / full cache", rate(L, evicted), rate(L, "full cache"), 2.5);
      add(policy + " | int2 @ " + fmt("%.0f%%", budget * 100) + " / " + evicted,
          rate(L, policy + " | int2 @ " + fmt("%.0f%%", budget * 100)), rate(L, evicted), 1.0);
    }
    if (!sp.empty())
      md += "Decode speed-ups (targets of issue 20, set for 8K):\n\n" +
            markdown_table({"context", "ratio of decode tok/s", "measured", "target", "met"}, sp) +
            "\n";
    // kvzip's reconstruction pass (Engine::reconstruct) against the prefill of the same context.
    std::vector<std::vector<std::string>> rc;
    for (std::int64_t L : contexts)
      for (const auto& t : thr)
        if (t["context"].get<std::int64_t>() == L && t.contains("reconstruct_s")) {
          const double p = t["plain_prefill_s"], r = t["reconstruct_s"];
          rc.push_back({std::to_string(L), fmt("%.2f", p), fmt("%.2f", r), fmt("%.2fx", r / p),
                        r <= 1.2 * p ? "yes" : "**no**"});
          break;
        }
    if (!rc.empty())
      md += "kvzip's context-reconstruction pass (repeats the context in chunks of 2048 tokens) "
            "against a plain prefill of the same context on the same engine (nothing recorded, "
            "nothing compressed):\n\n" +
            markdown_table({"context", "prefill s", "reconstruction s", "ratio", "<= 1.2x"}, rc) +
            "\n";
  }
  std::string times;
  for (const auto& [k, v] : results["seconds"].items())
    times += (times.empty() ? "" : ", ") + k + fmt(" %.0f s", v.get<double>());
  md += "Section times" + std::string(results["shards"].size() > 1 ? " (summed over shards)" : "") +
        ": " + times + ".\n";
  results["summary"] = summary;
  return md;
}

}  // namespace kvbench
