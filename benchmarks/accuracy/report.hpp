// Output helpers of the accuracy benchmark: a progress bar on stderr, markdown tables, and the
// report: every table, interval and paired comparison, computed from a result's raw records.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvbench {

// A progress bar over weighted work units with an ETA from the rate so far. On a terminal it
// redraws one line; otherwise (CI logs) it prints a line at every 10%.
class Progress {
 public:
  explicit Progress(double total_units);
  void set_total(double total_units) { total_ = total_units; }
  void advance(double units, const std::string& label);
  void finish();

 private:
  void draw(bool force);
  double total_ = 1, done_ = 0;
  int last_decile_ = -1;
  bool tty_ = false;
  std::string label_;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

// Markdown table: header, then rows of cells (already formatted).
std::string markdown_table(const std::vector<std::string>& header,
                           const std::vector<std::vector<std::string>>& rows);
// printf-style formatting into a std::string.
std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));

// The markdown report of a kvpolicy_accuracy result (one run, or merged shards): per-task tables
// with 95% intervals (Wilson for exact match, percentile bootstrap for means), the best policy
// per (budget, regime) with a paired comparison against the runner-up, the long-generation
// curves and the throughput table. Records are sorted first, so the report does not depend on
// the order in which shards ran or were merged. Stores the aggregates in results["summary"].
std::string render_report(nlohmann::json& results);

}  // namespace kvbench
