// Session<float> (prefill + decode-time compression of one sequence) and the quantizers
// (int2 / int4 / kivi: encode, decode, PackedCache and packed attention), fp32 only.
#include <optional>

#include <pybind11/stl.h>

#include "arrays.hpp"
#include "kvpolicy/kvpolicy.hpp"

namespace kvpy {
namespace {

using kvpolicy::Budget;
using kvpolicy::KVView;
using kvpolicy::Policy;
using kvpolicy::Session;
using kvpolicy::SessionConfig;
using kvpolicy::quant::PackedCache;
using kvpolicy::quant::Part;
using kvpolicy::quant::QuantConfig;

Budget budget_of(char kind, double value, const char* what) {
  if (kind == 'r') return Budget::ratio(value);
  if (kind == 't') return Budget::tokens(static_cast<std::int64_t>(value));
  if (kind == 'T') return Budget::total(static_cast<std::int64_t>(value));
  value_error(what, ": budget kind must be 'r', 't' or 'T'");
}

KVView<const float> f32_layer(const py::handle& obj, const char* what) {
  const py::array a = as_array(obj, what);
  cache_dtype(a, what, false);
  return layer_view<float>(a, what);
}

template <class V>
py::array_t<V> copy_span(std::span<const V> s) {
  py::array_t<V> a(static_cast<py::ssize_t>(s.size()));
  std::copy(s.begin(), s.end(), a.mutable_data());
  return a;
}

// Rows [0, n) of head h of a session layer view, copied to [n][d].
py::array_t<float> copy_rows(const KVView<const float>& v, std::int64_t h, std::int64_t n) {
  py::array_t<float> a({n, v.dim});
  float* o = a.mutable_data();
  for (std::int64_t t = 0; t < n; ++t) std::copy_n(v.row(0, h, t), v.dim, o + t * v.dim);
  return a;
}

void bind_session_class(py::module_& m) {
  using S = Session<float>;
  py::class_<S>(m, "Session")
      .def(py::init([](const Policy& policy, std::int64_t layers, std::int64_t kv_heads,
                       std::int64_t q_heads, std::int64_t head_dim, char kind, double value,
                       std::int64_t record_queries, bool record_attention,
                       std::int64_t decode_interval, std::int64_t initial_capacity,
                       std::vector<float> rope_inv_freq) {
             SessionConfig c;
             c.rope_inv_freq = std::move(rope_inv_freq);
             c.layers = layers, c.kv_heads = kv_heads, c.q_heads = q_heads, c.head_dim = head_dim;
             c.budget = budget_of(kind, value, "Session");
             c.record_queries = record_queries;
             c.record_attention = record_attention;
             c.decode_interval = decode_interval;
             c.initial_capacity = initial_capacity;
             return S(policy, c);
           }),
           py::arg("policy"), py::arg("layers"), py::arg("kv_heads"), py::arg("q_heads"),
           py::arg("head_dim"), py::arg("kind"), py::arg("value"), py::arg("record_queries"),
           py::arg("record_attention"), py::arg("decode_interval"), py::arg("initial_capacity"),
           py::arg("rope_inv_freq"))
      .def_property_readonly("policy", [](const S& s) { return s.policy(); })
      .def_property_readonly("layers", [](const S& s) { return s.config().layers; })
      .def_property_readonly("kv_heads", [](const S& s) { return s.config().kv_heads; })
      .def_property_readonly("q_heads", [](const S& s) { return s.config().q_heads; })
      .def_property_readonly("head_dim", [](const S& s) { return s.config().head_dim; })
      .def_property_readonly("decode_interval", &S::decode_interval)
      .def(
          "append",
          [](S& s, std::int64_t layer, const py::handle& k, const py::handle& v,
             const py::handle& q) {
            const auto kv = f32_layer(k, "k"), vv = f32_layer(v, "v");
            const auto qv = q.is_none() ? KVView<const float>{} : f32_layer(q, "q");
            py::gil_scoped_release nogil;
            s.append(layer, kv, vv, qv);
          },
          py::arg("layer"), py::arg("k"), py::arg("v"), py::arg("q") = py::none())
      .def(
          "attend",
          [](S& s, std::int64_t layer, const py::handle& q) {
            const auto qv = f32_layer(q, "q");
            auto out = new_f32({qv.heads, qv.tokens, qv.dim});
            float* o = out.mutable_data();
            py::gil_scoped_release nogil;
            s.attend(layer, qv, o);
            return out;
          },
          py::arg("layer"), py::arg("q"))
      .def(
          "reconstruct",
          [](S& s, std::int64_t layer, const py::handle& k, const py::handle& v,
             const py::handle& q) {
            const auto kv = f32_layer(k, "k"), vv = f32_layer(v, "v"), qv = f32_layer(q, "q");
            auto out = new_f32({qv.heads, qv.tokens, qv.dim});
            float* o = out.mutable_data();
            py::gil_scoped_release nogil;
            s.reconstruct(layer, kv, vv, qv, o);
            return out;
          },
          py::arg("layer"), py::arg("k"), py::arg("v"), py::arg("q"))
      .def("clear_reconstruction", &S::clear_reconstruction)
      .def("reconstructed", &S::reconstructed, py::arg("layer"))
      .def(
          "reconstruction",
          [](const S& s, std::int64_t layer, std::int64_t head) {
            return copy_span<float>(s.reconstruction(layer, head));
          },
          py::arg("layer"), py::arg("head"))
      .def("take_warning", &S::take_warning)
      .def(
          "compress_if_due",
          [](S& s, std::int64_t layer) {
            py::gil_scoped_release nogil;
            return s.compress_if_due(layer);
          },
          py::arg("layer"))
      .def(
          "compress",
          [](S& s, std::int64_t layer) {
            kvpolicy::Selection sel;
            {
              py::gil_scoped_release nogil;
              sel = s.compress(layer);
            }
            return selection_arrays(sel);
          },
          py::arg("layer"))
      .def(
          "lengths",
          [](const S& s, std::int64_t layer) { return copy_span<std::int64_t>(s.lengths(layer)); },
          py::arg("layer"))
      .def(
          "budgets",
          [](const S& s, std::int64_t layer) { return copy_span<std::int64_t>(s.budgets(layer)); },
          py::arg("layer"))
      .def(
          "keys",
          [](const S& s, std::int64_t layer, std::int64_t head) {
            return copy_rows(s.keys(layer), head, s.length(layer, head));
          },
          py::arg("layer"), py::arg("head"))
      .def(
          "values",
          [](const S& s, std::int64_t layer, std::int64_t head) {
            return copy_rows(s.values(layer), head, s.length(layer, head));
          },
          py::arg("layer"), py::arg("head"))
      .def(
          "positions",
          [](const S& s, std::int64_t layer, std::int64_t head) {
            return copy_span<std::int32_t>(s.positions(layer, head));
          },
          py::arg("layer"), py::arg("head"))
      .def(
          "log_counts",
          [](const S& s, std::int64_t layer, std::int64_t head) {
            return copy_span<float>(s.log_counts(layer, head));
          },
          py::arg("layer"), py::arg("head"))
      .def("capacity", &S::capacity, py::arg("layer"))
      .def(
          "reserve",
          [](S& s, std::int64_t layer, std::int64_t tokens) {
            py::gil_scoped_release nogil;
            s.reserve(layer, tokens);
          },
          py::arg("layer"), py::arg("tokens"))
      .def("shrink_to_fit", [](S& s) {
        py::gil_scoped_release nogil;
        s.shrink_to_fit();
      })
      .def("quantized", py::overload_cast<std::int64_t>(&S::quantized, py::const_),
           py::arg("layer"))
      .def("packed", &S::packed, py::arg("layer"), py::arg("head"))
      .def_property_readonly("kv_bytes", &S::kv_bytes);
}

// --- quantizers ---------------------------------------------------------------------------

// One quantizer stage built from its spec ("int2", "kivi(bits=4,group=64)").
struct PyQuantizer {
  Policy::AnyQuantizer q;
  std::string spec;

  explicit PyQuantizer(std::string_view s) : spec(s) {
    auto stages = kvpolicy::parse_spec(s);
    auto* types = static_cast<kvpolicy::quantizer_types*>(nullptr);
    KVP_REQUIRE(stages.size() == 1, "quantizer spec '", s, "': one stage expected (",
                kvpolicy::detail::names_of(types), ")");
    KVP_REQUIRE(kvpolicy::detail::make_stage(stages[0], q, types), "unknown quantizer '",
                stages[0].name, "' (valid quantizers: ", kvpolicy::detail::names_of(types), ")");
    spec = stages[0].text;
  }
  const QuantConfig& config() const {
    return std::visit([](const auto& x) -> const QuantConfig& { return x.config; }, q);
  }
  template <class F>
  decltype(auto) with(Part part, F&& f) const {
    return std::visit([&](const auto& x) { return f(part == Part::keys ? x.keys() : x.values()); }, q);
  }
};

Part part_of(const std::string& s) {
  if (s == "keys") return Part::keys;
  if (s == "values") return Part::values;
  value_error("part: expected 'keys' or 'values', got '", s, "'");
}

void bind_quant_classes(py::module_& m) {
  py::class_<PyQuantizer>(m, "Quantizer")
      .def(py::init<std::string_view>(), py::arg("spec"))
      .def_readonly("spec", &PyQuantizer::spec)
      .def_property_readonly("bits", [](const PyQuantizer& q) { return q.config().bits; })
      .def_property_readonly("group", [](const PyQuantizer& q) { return q.config().group; })
      .def_property_readonly("residual", [](const PyQuantizer& q) { return q.config().residual; })
      .def_property_readonly("rotate", [](const PyQuantizer& q) { return q.config().rotate; })
      .def_property_readonly("token_norm", [](const PyQuantizer& q) { return q.config().token_norm; })
      .def(
          "bytes_per_token",
          [](const PyQuantizer& q, std::int64_t d) {
            kvpolicy::quant::validate(q.config(), d, q.spec);
            return kvpolicy::quant::bytes_per_token(q.config(), d);
          },
          py::arg("head_dim"))
      .def(
          "packed_bytes",
          [](const PyQuantizer& q, std::int64_t tokens, std::int64_t d, const std::string& part) {
            return q.with(part_of(part), [&](const auto& x) { return x.packed_bytes(tokens, d); });
          },
          py::arg("tokens"), py::arg("head_dim"), py::arg("part"))
      .def(
          "_encode",
          [](const PyQuantizer& q, const py::handle& x, const std::string& part) {
            const py::array a = as_array(x, "x");
            cache_dtype(a, "x", false);
            const auto v = kv_view<float>(a, "x", false);
            const Part p = part_of(part);
            const std::size_t row =
                q.with(p, [&](const auto& z) { return z.packed_bytes(v.tokens, v.dim); });
            py::array_t<std::uint8_t> out({v.layers, v.heads, static_cast<std::int64_t>(row)});
            auto* o = reinterpret_cast<std::byte*>(out.mutable_data());
            const std::size_t n = static_cast<std::size_t>(v.layers * v.heads) * row;
            py::gil_scoped_release nogil;
            q.with(p, [&](const auto& z) {
              z.encode(v, std::span<std::byte>(o, n));
              return 0;
            });
            return out;
          },
          py::arg("x"), py::arg("part"))
      .def(
          "_decode",
          [](const PyQuantizer& q, const py::handle& packed, std::int64_t tokens,
             std::int64_t head_dim, const std::string& part) {
            const py::array a = as_array(packed, "packed");
            if (!a.dtype().is(py::dtype::of<std::uint8_t>()))
              type_error("packed: dtype ", dtype_str(a), " is not supported (expected uint8)");
            require_rank(a, 3, "packed", "[layers][heads][bytes]");
            if (!(a.flags() & py::array::c_style)) value_error("packed: must be C-contiguous");
            const Part p = part_of(part);
            const std::int64_t L = a.shape(0), H = a.shape(1);
            const std::size_t row =
                q.with(p, [&](const auto& z) { return z.packed_bytes(tokens, head_dim); });
            if (static_cast<std::size_t>(a.shape(2)) != row)
              value_error("packed: rows of ", a.shape(2), " bytes, but ", tokens, " tokens of head_dim ",
                          head_dim, " take ", row);
            auto out = new_f32({L, H, tokens, head_dim});
            const auto v = KVView<float>::hnd(out.mutable_data(), L, H, tokens, head_dim);
            const auto* in = static_cast<const std::byte*>(a.data());
            py::gil_scoped_release nogil;
            q.with(p, [&](const auto& z) {
              z.decode(std::span<const std::byte>(in, static_cast<std::size_t>(L * H) * row), v);
              return 0;
            });
            return out;
          },
          py::arg("packed"), py::arg("tokens"), py::arg("head_dim"), py::arg("part"));

  py::class_<PackedCache>(m, "PackedCache")
      .def(py::init([](const PyQuantizer& q, std::int64_t d) {
             return PackedCache(q.config(), d, q.spec);
           }),
           py::arg("quantizer"), py::arg("head_dim"))
      .def_property_readonly("head_dim", &PackedCache::head_dim)
      .def_property_readonly("size", &PackedCache::size)
      .def_property_readonly("packed_tokens", &PackedCache::packed_tokens)
      .def_property_readonly("residual_tokens", &PackedCache::residual_tokens)
      .def_property_readonly("memory_bytes", &PackedCache::memory_bytes)
      .def("__len__", &PackedCache::size)
      .def(
          "append",
          [](PackedCache& c, const py::handle& k, const py::handle& v) {
            const py::array ka = as_array(k, "k"), va = as_array(v, "v");
            cache_dtype(ka, "k", false);
            cache_dtype(va, "v", false);
            require_rank(ka, 2, "k", "[tokens][head_dim]");
            require_rank(va, 2, "v", "[tokens][head_dim]");
            const auto ks = element_strides(ka, "k"), vs = element_strides(va, "v");
            const KVView<const float> kv{static_cast<const float*>(ka.data()), 1, 1, ka.shape(0),
                                         ka.shape(1), 0, 0, ks[0], ks[1]};
            const KVView<const float> vv{static_cast<const float*>(va.data()), 1, 1, va.shape(0),
                                         va.shape(1), 0, 0, vs[0], vs[1]};
            if (kv.tokens != vv.tokens)
              value_error("v: ", vv.tokens, " tokens, k has ", kv.tokens);
            kvpolicy::validate(kv, "k");
            kvpolicy::validate(vv, "v");
            py::gil_scoped_release nogil;
            c.append(kv, vv, 0, 0, 0, kv.tokens);
          },
          py::arg("k"), py::arg("v"))
      .def("decode", [](const PackedCache& c) {
        auto k = new_f32({c.size(), c.head_dim()}), v = new_f32({c.size(), c.head_dim()});
        c.decode(k.mutable_data(), v.mutable_data());
        return py::make_tuple(k, v);
      });

  m.def(
      "packed_attention",
      [](const std::vector<PackedCache>& heads, const py::handle& q, bool causal) {
        const auto qv = f32_layer(q, "q");
        auto out = new_f32({qv.heads, qv.tokens, qv.dim});
        float* o = out.mutable_data();
        kvpolicy::quant::PackedAttentionArgs args;
        args.causal = causal;
        py::gil_scoped_release nogil;
        kvpolicy::quant::packed_attention(kvpolicy::cpu_backend{},
                                          std::span<const PackedCache>(heads), qv, args, o);
        return out;
      },
      py::arg("heads"), py::arg("q"), py::arg("causal") = false,
      "Attention of q [Hq][n][d] (float32) over the packed caches of one layer's KV heads "
      "(GQA: Hq a multiple of len(heads)); returns float32 [Hq][n][d]. causal: query i of n sees "
      "the cache up to its own position (the last n tokens are the queries' own).");
}

}  // namespace

void bind_session(py::module_& m) { bind_session_class(m); }
void bind_quant(py::module_& m) { bind_quant_classes(m); }

}  // namespace kvpy
