#include "report.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>

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

std::string json_escape(const std::string& s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': o += "\\\""; break;
      case '\\': o += "\\\\"; break;
      case '\n': o += "\\n"; break;
      case '\t': o += "\\t"; break;
      case '\r': o += "\\r"; break;
      default:
        if (c < 0x20)
          o += fmt("\\u%04x", c);
        else
          o += static_cast<char>(c);
    }
  }
  return o + "\"";
}

void Json::key(const char* k) {
  if (!first_.empty()) {
    if (!first_.back()) out_ += ",";
    first_.back() = false;
    out_ += '\n';
    out_.append(2 * first_.size(), ' ');
  }
  if (k) out_ += json_escape(k) + ": ";
}

Json& Json::begin_object(const char* k) {
  key(k);
  out_ += "{";
  first_.push_back(true);
  return *this;
}
Json& Json::end_object() {
  const bool empty = first_.back();
  first_.pop_back();
  if (!empty) {
    out_ += '\n';
    out_.append(2 * first_.size(), ' ');
  }
  out_ += "}";
  return *this;
}
Json& Json::begin_array(const char* k) {
  key(k);
  out_ += "[";
  first_.push_back(true);
  return *this;
}
Json& Json::end_array() {
  const bool empty = first_.back();
  first_.pop_back();
  if (!empty) {
    out_ += '\n';
    out_.append(2 * first_.size(), ' ');
  }
  out_ += "]";
  return *this;
}
Json& Json::value(const char* k, double v) {
  key(k);
  out_ += std::isfinite(v) ? fmt("%.6g", v) : std::string("null");
  return *this;
}
Json& Json::value(const char* k, std::int64_t v) {
  key(k);
  out_ += std::to_string(v);
  return *this;
}
Json& Json::value(const char* k, bool v) {
  key(k);
  out_ += v ? "true" : "false";
  return *this;
}
Json& Json::value(const char* k, const std::string& v) {
  key(k);
  out_ += json_escape(v);
  return *this;
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

}  // namespace kvbench
