// A host emulation of the kernels the device policy runner (kvpolicy/cuda/policy.hpp) drives,
// with cuda_device's interface: "device" memory is host memory, and each kernel is its CPU stage
// (each kernel's agreement with its CPU stage is tested op by op in tests/agreement). What the
// emulation checks is the runner's own part: the stages it calls and in what order, which
// budgets (host or device) each step reads, the protection it passes, the workspace it carves
// (each kernel's scratch must lie inside the caller's workspace, clear of the scores and budgets,
// and is overwritten with NaN bytes after every kernel, as a kernel's leftovers), and the CSR
// capacity it was promised. A failed check throws std::logic_error (not a Catch assertion: the
// tensor-parallel tests run the emulation on several threads at once).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <kvpolicy/cuda/policy.hpp>

namespace kvtest {

#define KVT_EMULATION_EXPECT(cond)                                                     \
  do {                                                                                 \
    if (!(cond))                                                                       \
      throw std::logic_error(std::string("device emulation: check failed: ") + #cond + \
                             " (line " + std::to_string(__LINE__) + ")");              \
  } while (false)

struct EmulatedDevice {
  // The caller's workspace (set by the test) and the regions the runner must not hand out.
  const std::byte* ws_begin = nullptr;
  std::size_t ws_bytes = 0;
  mutable std::vector<std::string> calls;  // "upload", "score:snapkv", "adakv:device", "ams:device", "select:device", ...
  // The end of the workspace regions of the current event that outlive a kernel (the scores, the
  // uploaded budgets, a paged event's dense copy), as the kernels have seen them: scratch must
  // start after it. An event starts with its upload (the budgets lie past its scores), so the
  // upload resets it: a batch's next event lays its regions out afresh.
  mutable const std::byte* reserved_end = nullptr;

  // Score workspace as the kernels ask for it: none for knorm and streaming, else a sizeable
  // region (so a runner that forgot to reserve it fails the scratch check).
  template <class S, kvpolicy::Element T>
  std::size_t score_bytes(const S&, const kvpolicy::Inputs<T>& in) const {
    if constexpr (std::is_same_v<S, kvpolicy::KNorm> || std::is_same_v<S, kvpolicy::Streaming>)
      return 0;
    else
      return static_cast<std::size_t>(in.layers() * in.kv_heads() * in.tokens()) * 8 + 512;
  }
  template <class S, kvpolicy::Element T>
  void score(const S& s, const kvpolicy::Inputs<T>& in, const kvpolicy::cuda::MutableScoreView& out,
             kvpolicy::cuda::Scratch ws) const {
    reserve(out.data,
            static_cast<std::size_t>(out.layers * out.heads * out.row_stride) * sizeof(float));
    check_scratch(ws, score_bytes(s, in), "score");
    calls.push_back("score:" + std::string(S::name));
    kvpolicy::Stats stats;
    kvpolicy::ScoreMap m;
    s.score(kvpolicy::cpu_backend{}, in, stats, m);
    KVT_EMULATION_EXPECT(m.layers() == out.layers);
    KVT_EMULATION_EXPECT(m.heads() == out.heads);
    KVT_EMULATION_EXPECT(m.tokens() == out.tokens);
    for (std::int64_t r = 0; r < out.layers * out.heads; ++r) {
      float* row = out.data + r * out.row_stride;
      std::copy_n(m.data() + r * out.tokens, out.tokens, row);
      // Row padding holds garbage on a device.
      std::fill(row + out.tokens, row + out.row_stride, std::numeric_limits<float>::quiet_NaN());
    }
    poison(ws);
  }
  template <kvpolicy::Element T>
  std::size_t ams_bytes(const kvpolicy::AMS&, const kvpolicy::Inputs<T>& in,
                        kvpolicy::Protect) const {
    return static_cast<std::size_t>(in.layers() * in.kv_heads() * in.tokens()) * 40 + 1024;
  }
  // AMS::allocate on the device scores, with the budgets as the kernels read them (the device
  // ones) and the credit state given; the window attention is the CPU's (the kernel's agreement
  // with it is tested in test_window_attention.cpp).
  template <kvpolicy::Element T>
  void ams(const kvpolicy::AMS& a, const kvpolicy::Inputs<T>& in,
           const kvpolicy::cuda::MutableScoreView& s, const std::int64_t* device,
           kvpolicy::Protect p, float* state, std::int64_t stride,
           kvpolicy::cuda::Scratch ws) const {
    check_scratch(ws, ams_bytes(a, in, p), "ams");
    calls.push_back("ams:device");
    kvpolicy::ScoreMap m = map_of({s.data, s.layers, s.heads, s.tokens, s.row_stride});
    kvpolicy::Stats stats;
    kvpolicy::window_attention_stat(kvpolicy::cpu_backend{}, in, stats, a.window,
                                    kvpolicy::GqaReduce::mean);
    kvpolicy::AllocContext ctx;
    ctx.scores = &m;
    ctx.tokens = s.tokens;
    ctx.protect = p;
    ctx.model_layers = s.layers;
    ctx.stats = &stats;
    ctx.queries = in.queries.tokens;
    ctx.state = state;
    ctx.state_stride = stride;
    std::vector<std::int64_t> b(device, device + s.layers * s.heads);
    a.allocate(ctx, std::span<std::int64_t>(b));
    for (std::int64_t r = 0; r < s.layers * s.heads; ++r)
      std::copy_n(m.data() + r * s.tokens, s.tokens, s.data + r * s.row_stride);
    poison(ws);
  }
  std::size_t adakv_bytes(const kvpolicy::AdaKV&, const kvpolicy::cuda::ScoreView& s,
                          kvpolicy::Protect) const {
    return static_cast<std::size_t>(s.rows()) * 64 + 4096;
  }
  void adakv(const kvpolicy::AdaKV& a, const kvpolicy::cuda::ScoreView& s,
             const std::int64_t* device, kvpolicy::Protect p, std::int64_t* out,
             kvpolicy::cuda::Scratch ws) const {
    calls.push_back("adakv:device");
    std::vector<std::int64_t> b(device, device + s.rows());
    // The kernel cannot check device budgets; it clamps each to [P, T].
    const std::int64_t T = s.tokens, P = std::min(p.total(T), T);
    for (auto& x : b) x = std::clamp(x, P, T);
    run_adakv(a, s, std::move(b), p, out, ws);
  }
  std::size_t select_bytes(std::int64_t rows, std::int64_t tokens) const {
    return static_cast<std::size_t>(rows * tokens) * 20 + 256;
  }
  void upload(void* dst, const void* src, std::size_t bytes) const {
    calls.push_back("upload");
    reserved_end = nullptr;
    reserve(dst, bytes);
    std::memcpy(dst, src, bytes);
  }
  void download(void* dst, const void* src, std::size_t bytes) const {
    calls.push_back("download");
    std::memcpy(dst, src, bytes);
  }
  void select(const kvpolicy::cuda::ScoreView& s, const std::int64_t* device, kvpolicy::Protect p,
              kvpolicy::cuda::CsrSelection& out, kvpolicy::cuda::Scratch ws) const {
    calls.push_back("select:device");
    run_select(s, std::vector<std::int64_t>(device, device + s.rows()), p, out, ws);
  }
  template <kvpolicy::Element T>
  void compact(const kvpolicy::KVView<T>& kv, const kvpolicy::cuda::CsrSelection& sel) const {
    calls.push_back("compact");
    const auto n = static_cast<std::size_t>(sel.rows());
    const kvpolicy::Selection s = kvpolicy::cuda::from_csr(
        sel.layers, sel.heads, std::span<const std::int64_t>(sel.offsets, n + 1),
        std::span<const std::int32_t>(sel.indices, static_cast<std::size_t>(sel.offsets[n])));
    kvpolicy::cpu::compact(kvpolicy::cpu_backend{}, kv, s);
  }
  template <class T, class U>
  void paged_gather(const kvpolicy::PagedKVView<T>& src, const std::int32_t* table,
                    std::int64_t length, const kvpolicy::KVView<U>& dst) const {
    calls.push_back("paged_gather");
    reserve(dst.data, static_cast<std::size_t>(dst.layers * dst.heads * dst.tokens * dst.dim) *
                          sizeof(U));
    const kvpolicy::PagedSequence seq{
        std::span<const std::int32_t>(table, static_cast<std::size_t>(
                                                 (length + src.page_size - 1) / src.page_size)),
        length};
    kvpolicy::paged_gather(kvpolicy::cpu_backend{}, src, seq, dst);
  }
  template <kvpolicy::Element T>
  std::size_t paged_compact_bytes(const kvpolicy::PagedKVView<T>&,
                                  const kvpolicy::cuda::PagedTables& t) const {
    return static_cast<std::size_t>(t.max_tokens) * 16 + 256;
  }
  // One request (the runner compacts one at a time): its table offsets come from the device
  // region the runner uploaded them to.
  template <kvpolicy::Element T>
  void paged_compact(const kvpolicy::PagedKVView<T>& keys, const kvpolicy::PagedKVView<T>& values,
                     const kvpolicy::cuda::PagedTables& t, const kvpolicy::cuda::CsrSelection& sel,
                     kvpolicy::cuda::Scratch ws) const {
    check_scratch(ws, paged_compact_bytes(keys, t), "paged_compact");
    calls.push_back("paged_compact");
    KVT_EMULATION_EXPECT(t.requests == 1);
    const kvpolicy::PagedSequence seq{
        std::span<const std::int32_t>(t.ids + t.offsets[0],
                                      static_cast<std::size_t>(t.offsets[1] - t.offsets[0])),
        t.max_tokens};
    const auto n = static_cast<std::size_t>(sel.rows());
    const kvpolicy::Selection s = kvpolicy::cuda::from_csr(
        sel.layers, sel.heads, std::span<const std::int64_t>(sel.offsets, n + 1),
        std::span<const std::int32_t>(sel.indices, static_cast<std::size_t>(sel.offsets[n])));
    kvpolicy::paged_compact(kvpolicy::cpu_backend{}, keys, values, seq, s);
    poison(ws);
  }

 private:
  // A kernel's scratch: inside the workspace's scratch part (after the scores and budgets, which
  // must outlive it) and at least what the kernel asked for.
  void check_scratch(kvpolicy::cuda::Scratch ws, std::size_t need, const char* op) const {
    if (ws.bytes < need)
      throw std::logic_error(std::string(op) + ": scratch of " + std::to_string(ws.bytes) +
                             " bytes, kernel needs " + std::to_string(need));
    if (need == 0) return;
    const auto* p = static_cast<const std::byte*>(ws.data);
    KVT_EMULATION_EXPECT(p >= ws_begin);
    KVT_EMULATION_EXPECT(p >= reserved_end);
    KVT_EMULATION_EXPECT(p + ws.bytes <= ws_begin + ws_bytes);
    KVT_EMULATION_EXPECT(reinterpret_cast<std::uintptr_t>(p) % 256 == 0);
  }
  void reserve(const void* data, std::size_t bytes) const {
    const auto* end = static_cast<const std::byte*>(data) + bytes;
    if (bytes && (!reserved_end || end > reserved_end)) reserved_end = end;
  }
  static void poison(kvpolicy::cuda::Scratch ws) {
    if (ws.bytes) std::memset(ws.data, 0xff, ws.bytes);
  }
  static kvpolicy::ScoreMap map_of(const kvpolicy::cuda::ScoreView& s) {
    kvpolicy::ScoreMap m(s.layers, s.heads, s.tokens);
    for (std::int64_t r = 0; r < s.rows(); ++r)
      std::copy_n(s.data + r * s.row_stride, s.tokens, m.data() + r * s.tokens);
    return m;
  }
  void run_adakv(const kvpolicy::AdaKV& a, const kvpolicy::cuda::ScoreView& s,
                 std::vector<std::int64_t> b, kvpolicy::Protect p, std::int64_t* out,
                 kvpolicy::cuda::Scratch ws) const {
    check_scratch(ws, adakv_bytes(a, s, p), "adakv");
    kvpolicy::ScoreMap m = map_of(s);
    kvpolicy::AllocContext ctx;
    ctx.scores = &m;
    ctx.tokens = s.tokens;
    ctx.protect = p;
    ctx.model_layers = s.layers;
    a.allocate(ctx, std::span<std::int64_t>(b));
    std::copy(b.begin(), b.end(), out);
    poison(ws);
  }
  void run_select(const kvpolicy::cuda::ScoreView& s, const std::vector<std::int64_t>& b,
                  kvpolicy::Protect p, kvpolicy::cuda::CsrSelection& out,
                  kvpolicy::cuda::Scratch ws) const {
    check_scratch(ws, select_bytes(s.rows(), s.tokens), "select");
    kvpolicy::Selection sel;
    kvpolicy::cpu::select(kvpolicy::cpu_backend{}, map_of(s), b, p, sel);
    const kvpolicy::cuda::HostCsr c = kvpolicy::cuda::to_csr(sel);
    KVT_EMULATION_EXPECT(out.layers == s.layers);
    KVT_EMULATION_EXPECT(out.heads == s.heads);
    KVT_EMULATION_EXPECT(static_cast<std::int64_t>(c.indices.size()) <= out.capacity);
    std::copy(c.offsets.begin(), c.offsets.end(), out.offsets);
    std::copy(c.indices.begin(), c.indices.end(), out.indices);
    poison(ws);
  }
};

}  // namespace kvtest
