// `kvpolicy compress`: one compression event of a kvpolicy::Policy over keys/values (and queries)
// read from .npy files; see compress.cpp for what is checked and written.
#pragma once
#include <cstdint>
#include <iosfwd>
#include <string>

namespace kvpolicy_cli {

struct CompressOptions {
  std::string keys, values, queries;  // .npy paths; queries may be empty
  std::string policy;                 // spec string, e.g. "snapkv | adakv"
  std::string out;                    // output directory
  double budget = 0;                  // kept fraction in (0, 1], when has_budget
  std::int64_t budget_tokens = 0;     // kept tokens per (layer, KV head), when has_budget_tokens
  bool has_budget = false, has_budget_tokens = false;
  bool report = false;  // per-layer/per-head kept counts and score statistics on `out`
  int threads = 0;      // OpenMP threads; 0: OpenMP's default
};

// The --policy option's help: the spec grammar with every registered stage by name
// (registry.hpp), so that a new stage needs no edit here.
std::string policy_help();

// Runs the command, printing a one-line summary (and the report) to `out`. Throws Failure (the
// file or option at fault and the problem); then nothing has been left in opts.out.
void compress(const CompressOptions& opts, std::ostream& out);

}  // namespace kvpolicy_cli
