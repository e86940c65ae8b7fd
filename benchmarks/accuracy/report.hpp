// Output helpers of the accuracy benchmark: a progress bar on stderr, a small JSON writer, and
// markdown tables.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

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

// Minimal JSON writer: objects, arrays, numbers (non-finite -> null), strings, booleans.
class Json {
 public:
  Json& begin_object(const char* key = nullptr);
  Json& end_object();
  Json& begin_array(const char* key = nullptr);
  Json& end_array();
  Json& value(const char* key, double v);
  Json& value(const char* key, std::int64_t v);
  Json& value(const char* key, int v) { return value(key, static_cast<std::int64_t>(v)); }
  Json& value(const char* key, bool v);
  Json& value(const char* key, const std::string& v);
  Json& value(const char* key, const char* v) { return value(key, std::string(v)); }
  const std::string& str() const { return out_; }

 private:
  void key(const char* k);
  std::string out_;
  std::vector<bool> first_;  // per open container: no element written yet
};

std::string json_escape(const std::string& s);

// Markdown table: header, then rows of cells (already formatted).
std::string markdown_table(const std::vector<std::string>& header,
                           const std::vector<std::vector<std::string>>& rows);
// printf-style formatting into a std::string.
std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));

}  // namespace kvbench
