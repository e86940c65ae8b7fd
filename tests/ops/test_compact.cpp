// cpu::compact / cpu::compact_state: compaction copies exactly the selected rows (and nothing
// else), for every layout and element type; a bad selection modifies no buffer.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include <kvpolicy/cpu/compact.hpp>

#include "common/random.hpp"
#include "ops/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_ops_compact {

using kvpolicy::KVView;
using kvpolicy::Selection;
using Catch::Matchers::Contains;

namespace {

enum class Form { hnd, nhd, transposed, padded };

// A view of `buf` (sized by buffer_size) in the given form.
template <class T>
KVView<T> make_view(Form f, T* p, std::int64_t L, std::int64_t H, std::int64_t N, std::int64_t D) {
  switch (f) {
    case Form::hnd: return KVView<T>::hnd(p, L, H, N, D);
    case Form::nhd: return KVView<T>::nhd(p, L, H, N, D);
    case Form::transposed: return {p, L, H, N, D, H * D * N, D * N, 1, N};  // [l][h][d][t]
    case Form::padded: {
      const std::int64_t st = D + 3, sh = N * st + 5;  // gaps between rows and heads
      return {p, L, H, N, D, H * sh + 2, sh, st, 1};
    }
  }
  return {};
}
std::int64_t buffer_size(Form f, std::int64_t L, std::int64_t H, std::int64_t N, std::int64_t D) {
  return f == Form::padded ? L * (H * (N * (D + 3) + 5) + 2) : L * H * N * D;
}

Selection random_selection(kvtest::Rng& rng, std::int64_t L, std::int64_t H, std::int64_t T) {
  Selection sel(L, H);
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < H; ++h) {
      auto& k = sel.kept(l, h);
      const std::int64_t kind = rng.integer(0, 6);
      if (kind == 6) {  // runs of consecutive kept tokens separated by gaps
        for (std::int64_t t = rng.integer(0, 3); t < T; t += rng.integer(1, 4))
          for (std::int64_t run = rng.integer(1, 6); run > 0 && t < T; --run) k.push_back(static_cast<std::int32_t>(t++));
        continue;
      }
      const std::int64_t c = kind == 0 ? T : kind == 1 ? 0 : rng.integer(1, T);
      std::vector<std::int32_t> all(static_cast<std::size_t>(T));
      std::iota(all.begin(), all.end(), 0);
      if (kind != 2)  // kind 2: a prefix
        for (std::int64_t i = T - 1; i > 0; --i)
          std::swap(all[static_cast<std::size_t>(i)], all[static_cast<std::size_t>(rng.integer(0, i))]);
      k.assign(all.begin(), all.begin() + c);
      std::sort(k.begin(), k.end());
    }
  return sel;
}

// Reference: a copy of the buffer where row i of each (l, h) is overwritten with the original
// row kept[i].
template <class T>
std::vector<T> reference(const std::vector<T>& before, Form f, std::int64_t L, std::int64_t H,
                         std::int64_t N, std::int64_t D, const Selection& sel) {
  std::vector<T> out = before;
  const auto src = make_view(f, const_cast<T*>(before.data()), L, H, N, D);
  const auto dst = make_view(f, out.data(), L, H, N, D);
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < H; ++h) {
      auto k = sel.kept(l, h);
      for (std::size_t i = 0; i < k.size(); ++i)
        for (std::int64_t e = 0; e < D; ++e)
          dst.at(l, h, static_cast<std::int64_t>(i), e) = src.at(l, h, k[i], e);
    }
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("compact copies exactly the selected rows (HND, NHD, strided)", "[ops]", float,
                   kvpolicy::half, kvpolicy::bfloat16) {
  const Form form = GENERATE(Form::hnd, Form::nhd, Form::transposed, Form::padded);
  kvtest::Rng rng(1000 + static_cast<int>(form));
  for (int trial = 0; trial < 12; ++trial) {
    const std::int64_t L = rng.integer(1, 3), H = rng.integer(1, 4), N = rng.integer(1, 40),
                       D = rng.integer(1, 9);
    INFO("form " << static_cast<int>(form) << " L=" << L << " H=" << H << " N=" << N << " D=" << D);
    auto buf = rng.normals<TestType>(buffer_size(form, L, H, N, D));
    const auto before = buf;
    const auto view = make_view(form, buf.data(), L, H, N, D);
    REQUIRE_NOTHROW(kvpolicy::validate(view, "cache"));
    const Selection sel = random_selection(rng, L, H, N);
    kvpolicy::cpu::compact(kvpolicy::cpu_backend{trial % 3}, view, sel);
    const auto want = reference(before, form, L, H, N, D, sel);
    REQUIRE(kvtest::bytes_of(buf) == kvtest::bytes_of(want));
  }
}

TEMPLATE_TEST_CASE("compact: head dims of common sizes (whole-row copies of 64..512 bytes)",
                   "[ops]", float, kvpolicy::half) {
  const Form form = GENERATE(Form::hnd, Form::nhd, Form::padded);
  const std::int64_t D = GENERATE(16, 32, 64, 128);
  kvtest::Rng rng(2000 + static_cast<int>(form) * 7 + D);
  for (int trial = 0; trial < 3; ++trial) {
    const std::int64_t L = 1, H = 3, N = 48;
    INFO("form " << static_cast<int>(form) << " D=" << D);
    auto buf = rng.normals<TestType>(buffer_size(form, L, H, N, D));
    const auto before = buf;
    const auto view = make_view(form, buf.data(), L, H, N, D);
    const Selection sel = random_selection(rng, L, H, N);
    kvpolicy::cpu::compact(kvpolicy::cpu_backend{2}, view, sel);
    REQUIRE(kvtest::bytes_of(buf) == kvtest::bytes_of(reference(before, form, L, H, N, D, sel)));
  }
}

TEST_CASE("compact moves the kept rows' values (hand-checked)", "[ops]") {
  // One head, 6 tokens of dim 2; row t holds {10t, 10t+1}.
  std::vector<float> buf(12);
  for (int t = 0; t < 6; ++t) buf[2 * t] = 10.f * t, buf[2 * t + 1] = 10.f * t + 1;
  Selection sel(1, 1);
  sel.kept(0, 0) = {1, 4, 5};
  kvpolicy::cpu::compact(kvpolicy::cpu_backend{1}, KVView<float>::hnd(buf.data(), 1, 1, 6, 2), sel);
  CHECK(buf == std::vector<float>{10, 11, 40, 41, 50, 51, 30, 31, 40, 41, 50, 51});
}

TEMPLATE_TEST_CASE("compact: the streamed path (non-temporal stores) gives the same bytes",
                   "[ops]", float, kvpolicy::half) {
  // compact() streams only above kStreamBytes per call; detail::compact_head takes the choice
  // directly, so small hand-built cases cover it. Row sizes: 16 bytes (one chunk), 48 (no whole
  // 64-byte block), 80 (one block and a tail), 256 and 512 bytes; the buffer starts 0, 16 or 48
  // bytes past a 64-byte boundary, so row boundaries fall anywhere inside cache lines.
  const std::int64_t D = GENERATE(8, 24, 40, 128, 256) / static_cast<std::int64_t>(sizeof(TestType) / 2);
  const std::size_t skew = GENERATE(0, 16, 48);
  kvtest::Rng rng(3000 + static_cast<int>(D * 3 + static_cast<std::int64_t>(skew)));
  for (int trial = 0; trial < 8; ++trial) {
    const std::int64_t L = 1, H = 2, N = rng.integer(1, 70);
    INFO("D=" << D << " skew=" << skew << " N=" << N);
    const auto before = rng.normals<TestType>(L * H * N * D);
    // A 64-byte aligned buffer, then `skew` bytes in (a multiple of 16: the element alignment
    // of a large malloc).
    std::vector<unsigned char> raw(before.size() * sizeof(TestType) + 128);
    auto* aligned = reinterpret_cast<unsigned char*>(
        (reinterpret_cast<std::uintptr_t>(raw.data()) + 63) / 64 * 64);
    auto* p = reinterpret_cast<TestType*>(aligned + skew);
    std::memcpy(static_cast<void*>(p), before.data(), before.size() * sizeof(TestType));
    const auto view = KVView<TestType>::hnd(p, L, H, N, D);
    const Selection sel = random_selection(rng, L, H, N);
    for (std::int64_t h = 0; h < H; ++h)
      kvpolicy::cpu::detail::compact_head(view, 0, h, sel.kept(0, h), /*stream=*/true);
    std::vector<TestType> got(before.size());
    std::memcpy(static_cast<void*>(got.data()), p, got.size() * sizeof(TestType));
    REQUIRE(kvtest::bytes_of(got) == kvtest::bytes_of(reference(before, Form::hnd, L, H, N, D, sel)));
  }
}

TEMPLATE_TEST_CASE("compact(keys, values): the same bytes as two calls, checked before writing",
                   "[ops]", float, kvpolicy::half) {
  const Form form = GENERATE(Form::hnd, Form::nhd, Form::padded);
  const std::int64_t D = GENERATE(3, 64);
  kvtest::Rng rng(4000 + static_cast<int>(form) * 7 + static_cast<int>(D));
  for (int trial = 0; trial < 6; ++trial) {
    const std::int64_t L = rng.integer(1, 2), H = rng.integer(1, 4), N = rng.integer(1, 40);
    INFO("form " << static_cast<int>(form) << " L=" << L << " H=" << H << " N=" << N << " D=" << D);
    auto k = rng.normals<TestType>(buffer_size(form, L, H, N, D));
    auto v = rng.normals<TestType>(buffer_size(form, L, H, N, D));
    const auto k0 = k, v0 = v;
    const Selection sel = random_selection(rng, L, H, N);
    kvpolicy::cpu::compact(kvpolicy::cpu_backend{trial % 3}, make_view(form, k.data(), L, H, N, D),
                           make_view(form, v.data(), L, H, N, D), sel);
    REQUIRE(kvtest::bytes_of(k) == kvtest::bytes_of(reference(k0, form, L, H, N, D, sel)));
    REQUIRE(kvtest::bytes_of(v) == kvtest::bytes_of(reference(v0, form, L, H, N, D, sel)));
  }
  // A selection that does not fit the values leaves the keys as they were too.
  std::vector<float> k(2 * 8 * 4, 1.f), v(2 * 6 * 4, 2.f);
  const auto kb = k, vb = v;
  Selection sel(1, 2);
  sel.kept(0, 0) = {1, 7};
  sel.kept(0, 1) = {0, 2};
  CHECK_THROWS_WITH(kvpolicy::cpu::compact(kvpolicy::cpu_backend{2},
                                           KVView<float>::hnd(k.data(), 1, 2, 8, 4),
                                           KVView<float>::hnd(v.data(), 1, 2, 6, 4), sel),
                    Contains("index 7 at layer 0, head 0 is outside [0, 6)"));
  CHECK(k == kb);
  CHECK(v == vb);
}

TEMPLATE_TEST_CASE("compact_state moves per-token state with the rows", "[ops]", float,
                   std::int32_t) {
  kvtest::Rng rng(77);
  const std::int64_t L = 3, H = 2, T = 33, sh = T + 4, sl = H * sh + 1;
  std::vector<TestType> state(static_cast<std::size_t>(L * sl));
  for (std::size_t i = 0; i < state.size(); ++i) state[i] = static_cast<TestType>(3 * i + 1);
  const auto before = state;
  const Selection sel = random_selection(rng, L, H, T);
  kvpolicy::cpu::compact_state(kvpolicy::cpu_backend{2}, state.data(), sl, sh, sel);
  auto want = before;
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < H; ++h) {
      auto k = sel.kept(l, h);
      for (std::size_t i = 0; i < k.size(); ++i)
        want[static_cast<std::size_t>(l * sl + h * sh) + i] = before[static_cast<std::size_t>(l * sl + h * sh + k[i])];
    }
  CHECK(state == want);
}

TEMPLATE_TEST_CASE("compact: a bad selection throws and modifies no buffer", "[ops]", float,
                   kvpolicy::half) {
  const Form form = GENERATE(Form::hnd, Form::nhd, Form::transposed);
  kvtest::Rng rng(5);
  const std::int64_t L = 2, H = 3, N = 16, D = 4;
  auto buf = rng.normals<TestType>(buffer_size(form, L, H, N, D));
  const auto before = kvtest::bytes_of(buf);
  const auto view = make_view(form, buf.data(), L, H, N, D);
  // Valid, non-identity lists everywhere except the last (layer, head), so a partial write
  // would show.
  auto good = [&] {
    Selection s(L, H);
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t h = 0; h < H; ++h) s.kept(l, h) = {1, 3, 8, 15};
    return s;
  };
  Selection sel = good();
  std::string expect;
  const int which = GENERATE(0, 1, 2, 3, 4, 5);
  switch (which) {
    case 0: sel.kept(1, 2) = {2, 16}; expect = "index 16 at layer 1, head 2 is outside [0, 16)"; break;
    case 1: sel.kept(1, 2) = {-1, 2}; expect = "index -1 at layer 1, head 2"; break;
    case 2: sel.kept(1, 2) = {5, 4}; expect = "layer 1, head 2 are not strictly ascending"; break;
    case 3: sel.kept(1, 2) = {4, 4}; expect = "not strictly ascending"; break;
    case 4: sel = Selection(L, H + 1); expect = "selection is [2,4] but the cache has [2,3]"; break;
    case 5: sel = Selection(L - 1, H); expect = "selection is [1,3] but the cache has [2,3]"; break;
  }
  if (which >= 4)
    for (std::int64_t l = 0; l < sel.layers(); ++l)
      for (std::int64_t h = 0; h < sel.heads(); ++h) sel.kept(l, h) = {1, 3, 8, 15};
  INFO("case " << which);
  CHECK_THROWS_WITH(kvpolicy::cpu::compact(kvpolicy::cpu_backend{2}, view, sel), Contains(expect));
  CHECK(kvtest::bytes_of(buf) == before);
  // The same buffer compacts fine with a valid selection (so the check above could fail).
  kvpolicy::cpu::compact(kvpolicy::cpu_backend{2}, view, good());
  CHECK(kvtest::bytes_of(buf) != before);
}

TEST_CASE("compact: an empty cache with no memory behind it is a no-op (fuzz_spec regression)",
          "[ops]") {
  // Found by fuzz_spec: Policy::compress on a cache of 0 tokens (an empty std::vector's null
  // data) offset the null pointer to each row (undefined behaviour, UBSan's pointer-overflow).
  const kvpolicy::cpu_backend be{1};
  const Selection none(2, 3);
  CHECK_NOTHROW(kvpolicy::cpu::compact(be, KVView<float>::hnd(nullptr, 2, 3, 0, 8), none));
  CHECK_NOTHROW(kvpolicy::cpu::compact(be, KVView<float>::nhd(nullptr, 2, 3, 0, 8), none));
  Selection empty_rows(1, 2);
  empty_rows.kept(0, 0) = {0, 1};
  empty_rows.kept(0, 1) = {1};
  CHECK_NOTHROW(kvpolicy::cpu::compact(be, KVView<float>::hnd(nullptr, 1, 2, 2, 0), empty_rows));
}

}  // namespace kvt_ops_compact
