// The cluster compaction kernel (cuda/compact.cu, sm_90 and later) emulated on the host: its
// per-thread functions (cuda/compact_math.hpp) driven over every block and thread of a cluster,
// each round's loads before its stores as the cluster barrier orders them. The in-place result
// must equal a gather of the kept rows, every unit must be moved exactly once, and the division-
// free stepping must equal the division it replaces. The [gpu] compaction cases run the kernel.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include <kvpolicy/cuda/compact_math.hpp>

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_agreement_compact_rounds {

namespace cm = kvpolicy::cuda::compact_math;

namespace {

struct Layout {
  std::int64_t stride_token, stride_col;
};

// One (layer, head) row of T token rows of `row_units` units, moved in place as the kernel does.
// Returns the number of rounds.
std::int64_t emulate(std::vector<std::uint32_t>& data, const Layout& lay, int row_units,
                     const std::vector<std::int32_t>& kept) {
  const auto n = static_cast<std::int64_t>(kept.size());
  const std::int64_t t0 = cm::first_moved(kept.data(), n);
  const std::int64_t units = (n - t0) * row_units;
  const cm::UnitStep step = cm::unit_step(row_units);
  std::int64_t rounds = 0;
  for (std::int64_t u0 = 0; u0 < units; u0 += cm::cluster_round_units(), ++rounds) {
    std::vector<std::pair<std::int64_t, std::uint32_t>> stores;  // what the round will write
    for (std::int64_t rank = 0; rank < cm::kClusterBlocks; ++rank)
      for (int t = 0; t < cm::kClusterThreads; ++t) {
        const std::int64_t first = cm::cluster_first_unit(u0, rank, t);
        cm::Unit u = cm::unit_at(first, row_units);
        for (int k = 0; k < cm::kClusterUnits; ++k) {
          if (first + std::int64_t{k} * cm::kClusterThreads < units) {
            const std::int64_t src = kept[static_cast<std::size_t>(t0 + u.i)] * lay.stride_token +
                                     u.c * lay.stride_col;
            const std::int64_t dst = (t0 + u.i) * lay.stride_token + u.c * lay.stride_col;
            stores.emplace_back(dst, data[static_cast<std::size_t>(src)]);
          }
          cm::next_unit(u, step, row_units);
        }
      }
    // The round covers units [u0, min(u0 + round, units)), each once.
    const std::int64_t want = std::min(cm::cluster_round_units(), units - u0);
    REQUIRE(static_cast<std::int64_t>(stores.size()) == want);
    std::vector<char> seen(data.size(), 0);
    std::int64_t twice = 0;
    for (const auto& s : stores) {
      twice += seen[static_cast<std::size_t>(s.first)];
      seen[static_cast<std::size_t>(s.first)] = 1;
    }
    REQUIRE(twice == 0);
    for (const auto& [dst, v] : stores) data[static_cast<std::size_t>(dst)] = v;  // after the barrier
  }
  return rounds;
}

}  // namespace

TEST_CASE("the cluster compaction's rounds, emulated on the host, gather the kept rows in place",
          "[agreement]") {
  std::mt19937_64 rng(20261204);
  std::int64_t multi_round = 0;
  for (int row_units : {1, 3, 16, 48, 511, 512, 513, 1024, 2048}) {
    for (std::int64_t T : {1, 2, 37, 300, 4099}) {
      for (int kind = 0; kind < 4; ++kind) {
        // kept: a random ascending subset; kind 1 keeps a prefix in place, kind 2 keeps all
        // (nothing moves), kind 3 keeps only the last token.
        std::vector<std::int32_t> kept;
        const std::int64_t prefix = kind == 1 ? T / 3 : 0;
        for (std::int64_t j = 0; j < T; ++j)
          if (kind == 2 || j < prefix || (kind == 3 ? j == T - 1 : rng() % 5 == 0))
            kept.push_back(static_cast<std::int32_t>(j));
        for (bool transposed : {false, true}) {
          INFO("row_units=" << row_units << " T=" << T << " kind=" << kind << " kept="
                            << kept.size() << (transposed ? " column-major" : " row-major"));
          const Layout lay = transposed ? Layout{1, T} : Layout{row_units, 1};
          std::vector<std::uint32_t> data(static_cast<std::size_t>(T * row_units));
          for (std::int64_t j = 0; j < T; ++j)
            for (int c = 0; c < row_units; ++c)
              data[static_cast<std::size_t>(j * lay.stride_token + c * lay.stride_col)] =
                  static_cast<std::uint32_t>(j * row_units + c);
          std::vector<std::uint32_t> want = data;  // rows past the kept ones keep their bytes
          for (std::size_t i = 0; i < kept.size(); ++i)
            for (int c = 0; c < row_units; ++c)
              want[static_cast<std::size_t>(static_cast<std::int64_t>(i) * lay.stride_token +
                                            c * lay.stride_col)] =
                  static_cast<std::uint32_t>(kept[i] * std::int64_t{row_units} + c);
          multi_round += emulate(data, lay, row_units, kept) > 1 ? 1 : 0;
          REQUIRE(data == want);
        }
      }
    }
  }
  CHECK(multi_round > 0);  // some rows need several rounds (a later round reads past the first)
}

TEST_CASE("the cluster compaction's division-free stepping equals the division", "[agreement]") {
  std::mt19937_64 rng(7);
  for (int row_units : {1, 2, 3, 7, 16, 100, 511, 512, 513, 1000, 4096, 32768}) {
    std::int64_t e = static_cast<std::int64_t>(rng() % 100000);
    cm::Unit u = cm::unit_at(e, row_units);
    const cm::UnitStep step = cm::unit_step(row_units);
    for (int k = 0; k < 64; ++k) {
      e += cm::kClusterThreads;
      cm::next_unit(u, step, row_units);
      const cm::Unit want = cm::unit_at(e, row_units);
      REQUIRE(u.i == want.i);
      REQUIRE(u.c == want.c);
    }
  }
}

}  // namespace kvt_agreement_compact_rounds
