// kvpolicy: the command-line tool. One subcommand for now:
//   kvpolicy compress --keys k.npy --values v.npy [--queries q.npy] --policy "snapkv | adakv"
//                     (--budget 0.2 | --budget-tokens N) --out DIR [--report] [--threads N]
// runs a policy on a cache dumped from another engine (compress.cpp). Exit status: 0 on success,
// 1 when an input, the policy or the output fails (one line on stderr, `kvpolicy compress:
// <file or option>: <problem>`), 2 for a malformed command line.
#include <CLI/CLI.hpp>
#include <exception>
#include <iostream>
#include <new>
#include <string>

#include "compress.hpp"
#include "failure.hpp"

namespace {

constexpr const char* kCompressFooter = R"(Inputs
  keys, values: float32 or float16 .npy files (C or Fortran order), shape
    [layers][kv_heads][tokens][head_dim] (HND) or [kv_heads][tokens][head_dim] for one layer.
    Values need the keys' dtype, rank, layers, kv_heads and tokens; their head_dim may differ.
  queries: [layers][q_heads][n][head_dim] (or 3-d): the queries of the last n positions, after
    RoPE, q_heads a multiple of kv_heads (GQA), same dtype as the keys. Policies that read them:
    snapkv and tova (the last window), h2o (sums the attention of all queries given), ams.
  float16 is read from the header's dtype (xtensor has no half type) and kept as float16: the
  policy runs on the float16 cache, as Python's Policy does, and keys.npy/values.npy are float16.
  Other dtypes (float64, int32, ...), NaN or Inf anywhere, ranks other than 3/4 and shapes that
  disagree are refused before anything is written.

Outputs in DIR (3-d inputs give the same without the layer axis; K = the largest kept count)
  indices.npy  int64 [L][H][K]: kept token indices per (layer, KV head), ascending, -1 past
               counts[l, h] (per-head budgets, e.g. adakv, make rows ragged)
  counts.npy   int64 [L][H]
  keys.npy     [L][H][K][head_dim], values.npy [L][H][K][value_dim], the input dtype: row j of
               head (l, h) is input token indices[l, h, j]; rows past the count are zeros
  summary.json policy, budget, shapes, kept counts per layer and head, kept fraction, seconds
  Files are written under temporary names and renamed at the end: on error DIR gets nothing.

Exit status: 0 success; 1 bad input, policy or output (one line on stderr:
`kvpolicy compress: <file or option>: <problem>`); 2 malformed command line.)";

}  // namespace

int main(int argc, char** argv) {
  kvpolicy_cli::CompressOptions o;
  CLI::App app("kvpolicy " KVPOLICY_VERSION_STRING
               ": KV-cache compression policies (README: Policies, Spec strings).",
               "kvpolicy");
  app.require_subcommand(1);
  app.set_version_flag("--version", KVPOLICY_VERSION_STRING);
  app.get_formatter()->column_width(26);

  CLI::App* c = app.add_subcommand(
      "compress",
      "Run a policy on keys/values (and queries) dumped as .npy files: one compression event "
      "over the whole cache. Writes the kept token indices, the compacted keys/values and "
      "summary.json into --out.");
  c->add_option("--keys", o.keys, "keys .npy (see Inputs below)")->required();
  c->add_option("--values", o.values, "values .npy")->required();
  c->add_option("--queries", o.queries,
                "queries .npy, for policies that read them (default: none)");
  c->add_option("--policy", o.policy, kvpolicy_cli::policy_help())->required();
  CLI::Option* budget =
      c->add_option("--budget", o.budget,
                    "kept fraction in (0, 1] of each (layer, KV head)'s T tokens: round(r * T), "
                    "which allocators may move between heads and layers (no default: exactly "
                    "one of --budget and --budget-tokens)");
  CLI::Option* tokens = c->add_option("--budget-tokens", o.budget_tokens,
                                      "kept tokens per (layer, KV head), >= 1 (all of them "
                                      "when T is smaller) (no default)");
  c->add_option("--out", o.out,
                "output directory; created when missing, files of the same names replaced")
      ->required();
  c->add_flag("--report", o.report,
              "also print kept counts per layer and KV head and score statistics of kept vs "
              "evicted tokens (default: off)");
  c->add_option("--threads", o.threads, "OpenMP threads (0: OpenMP's default)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  c->footer(kCompressFooter);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    std::cerr << (c->parsed() ? "kvpolicy compress: " : "kvpolicy: ") << e.what() << " (see '"
              << (c->parsed() ? "kvpolicy compress --help" : "kvpolicy --help") << "')\n";
    return 2;
  }
  o.has_budget = budget->count() > 0;
  o.has_budget_tokens = tokens->count() > 0;

  try {
    kvpolicy_cli::compress(o, std::cout);
  } catch (const kvpolicy_cli::Failure& f) {
    std::cerr << "kvpolicy compress: " << f.subject() << ": " << f.what() << "\n";
    return 1;
  } catch (const std::bad_alloc&) {
    std::cerr << "kvpolicy compress: " << o.keys << ": out of memory\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "kvpolicy compress: " << o.keys << ": " << e.what() << "\n";
    return 1;
  }
  return 0;
}
