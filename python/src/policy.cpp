// Policy: selection and in-place compaction of whole caches [L][Hkv][T][d], float32 or float16.
// The Python wrapper (kvpolicy/_policy.py) resolves the budget arguments, lifts 3-d caches and
// copies for inplace=False; here arrays are viewed without copying and the GIL is released while
// the library works.
#include <cstring>
#include <optional>
#include <string>

#include <pybind11/stl.h>

#include "arrays.hpp"
#include "kvpolicy/kvpolicy.hpp"
#include "shard.hpp"

namespace kvpy {
namespace {

using kvpolicy::Budget;
using kvpolicy::Policy;

struct Call {
  py::array keys;
  std::optional<py::array> values, queries, accumulated, observed, reconstruction;
  std::vector<float> rope_inv_freq{};
};

Call arrays_of(const py::handle& keys, const py::handle& values, const py::handle& queries,
               const py::handle& accumulated, const py::handle& observed,
               const py::handle& reconstruction) {
  Call c{as_array(keys, "keys"), {}, {}, {}, {}, {}};
  if (!values.is_none()) c.values = as_array(values, "values");
  if (!queries.is_none()) c.queries = as_array(queries, "queries");
  if (!accumulated.is_none()) c.accumulated = as_array(accumulated, "accumulated");
  if (!observed.is_none()) c.observed = as_array(observed, "observed");
  if (!reconstruction.is_none()) c.reconstruction = as_array(reconstruction, "reconstruction");
  return c;
}

// A float32 C-contiguous [L][H][T] state array (h2o's sums or observation counts, kvzip's
// reconstruction scores).
template <class T>
const float* state_of(const py::array& a, const kvpolicy::KVView<T>& keys, const char* what) {
  if (!a.dtype().is(py::dtype::of<float>()))
    type_error(what, ": dtype ", dtype_str(a), " is not supported (expected float32)");
  require_rank(a, 3, what, "[layers][kv_heads][tokens]");
  if (a.shape(0) != keys.layers || a.shape(1) != keys.heads || a.shape(2) != keys.tokens)
    value_error(what, ": shape [", a.shape(0), "][", a.shape(1), "][", a.shape(2),
                "] does not match keys [", keys.layers, "][", keys.heads, "][", keys.tokens, "]");
  if (!(a.flags() & py::array::c_style)) value_error(what, ": must be C-contiguous");
  return static_cast<const float*>(a.data());
}

// Inputs<T> over the call's arrays (checked: dtypes agree, accumulated is float32 [L][H][T]
// C-contiguous). `writable`: keys/values are compacted in place.
template <class T>
kvpolicy::Inputs<T> inputs_of(const Call& c, bool writable, kvpolicy::KVView<T>& k_mut,
                              kvpolicy::KVView<T>& v_mut) {
  const auto want = kvpolicy::dtype_of<T>;
  auto same_dtype = [&](const py::array& a, const char* what) {
    if (cache_dtype(a, what) != want)
      type_error(what, ": dtype ", dtype_str(a), " differs from keys' ", kvpolicy::dtype_name(want),
                 " (keys, values and queries share one element type)");
  };
  kvpolicy::Inputs<T> in;
  k_mut = kv_view<T>(c.keys, "keys", writable);
  in.keys = k_mut;
  if (c.values) {
    same_dtype(*c.values, "values");
    v_mut = kv_view<T>(*c.values, "values", writable);
    in.values = v_mut;
  }
  if (c.queries) {
    same_dtype(*c.queries, "queries");
    in.queries = kv_view<T>(*c.queries, "queries", false);
  }
  if (c.accumulated) in.accumulated = state_of(*c.accumulated, in.keys, "accumulated");
  if (c.observed) in.observed = state_of(*c.observed, in.keys, "observed");
  if (c.reconstruction) in.reconstruction = state_of(*c.reconstruction, in.keys, "reconstruction");
  in.rope_inv_freq = c.rope_inv_freq;
  return in;
}

template <class T>
py::tuple run(const Policy& p, const Call& c, const Budget& budget, const kvpolicy::EventInfo& ev,
              bool compact, bool scores, const PyGather& gather) {
  kvpolicy::KVView<T> k, v;
  const kvpolicy::Inputs<T> in = inputs_of<T>(c, compact, k, v);
  kvpolicy::Selection sel;
  kvpolicy::ScoreMap map;
  {
    py::gil_scoped_release nogil;
    const kvpolicy::cpu_backend be{};
    kvpolicy::detail::require_finite_inputs(in);
    sel = with_gather_errors(
        gather, [&] { return p.select(be, in, budget, ev, scores ? &map : nullptr); });
    if (compact) kvpolicy::detail::compact_kv(be, k, v, sel);
  }
  py::tuple out = selection_arrays(sel);
  py::object s = py::none();
  if (scores) {
    py::array_t<float> a({map.layers(), map.heads(), map.tokens()});
    std::copy_n(map.data(), map.layers() * map.heads() * map.tokens(), a.mutable_data());
    s = a;
  }
  return py::make_tuple(out[0], out[1], s, sel.warning());
}

py::tuple dispatch(const Policy& p, const py::handle& keys, const py::handle& values,
                   const py::handle& queries, const py::handle& accumulated,
                   const py::handle& observed, const py::handle& reconstruction, char kind,
                   double value, std::int64_t first_layer, std::int64_t model_layers, bool compact,
                   bool scores, std::vector<float> rope_inv_freq, const py::object& shard) {
  Call c = arrays_of(keys, values, queries, accumulated, observed, reconstruction);
  c.rope_inv_freq = std::move(rope_inv_freq);
  if (compact && !c.values) value_error("values: compress needs the values to compact");
  const Budget budget = make_budget(kind, value);
  kvpolicy::EventInfo ev;
  ev.first_layer = first_layer;
  ev.model_layers = model_layers;
  // shard: None, or (rank, ranks, first_head, model_heads, all_gather or None).
  kvpolicy::HeadShard hs;
  PyGather gather;
  ev.shard = shard_of(shard, hs, gather);
  return cache_dtype(c.keys, "keys") == kvpolicy::DType::f32
             ? run<float>(p, c, budget, ev, compact, scores, gather)
             : run<kvpolicy::half>(p, c, budget, ev, compact, scores, gather);
}

std::string needs_names(kvpolicy::Needs n) {
  using kvpolicy::Needs;
  std::string s;
  auto add = [&](Needs f, const char* name) {
    if (kvpolicy::has(n, f)) s += (s.empty() ? "" : ",") + std::string(name);
  };
  add(Needs::keys, "keys");
  add(Needs::values, "values");
  add(Needs::queries, "queries");
  add(Needs::accumulated, "accumulated");
  add(Needs::reconstruction, "reconstruction");
  return s;
}

}  // namespace

void bind_policy(py::module_& m) {
  m.attr("cuda_built") = cuda_built();
  py::class_<Policy> cls(m, "Policy");
  bind_policy_device(cls);
  cls
      .def(py::init<std::string_view>(), py::arg("spec"))
      .def_property_readonly("spec", &Policy::spec)
      .def_property_readonly("scorer", [](const Policy& p) { return std::string(p.scorer_name()); })
      .def_property_readonly("quantizer", &Policy::quantizer_name)
      .def_property_readonly("merger",
                             [](const Policy& p) {
                               if (!p.merger()) return std::string();
                               return std::visit([](const auto& m) { return std::string(m.name); },
                                                 *p.merger());
                             })
      .def_property_readonly("allocators",
                             [](const Policy& p) {
                               std::vector<std::string> v;
                               for (const auto& a : p.allocators())
                                 v.push_back(std::visit([](const auto& x) { return std::string(x.name); }, a));
                               return v;
                             })
      .def_property_readonly("query_window", &Policy::query_window)
      .def_property_readonly("needs", [](const Policy& p) { return needs_names(p.needs()); })
      .def_property_readonly("decode_time", &Policy::decode_time)
      .def_property_readonly("spans_heads", &Policy::spans_heads)
      .def("__repr__", [](const Policy& p) { return "Policy('" + p.spec() + "')"; })
      .def("_run", &dispatch, py::arg("keys"), py::arg("values"), py::arg("queries"),
           py::arg("accumulated"), py::arg("observed"), py::arg("reconstruction"), py::arg("kind"),
           py::arg("value"), py::arg("first_layer"),
           py::arg("model_layers"), py::arg("compact"),
           py::arg("scores"), py::arg("rope_inv_freq"), py::arg("shard"));
}

}  // namespace kvpy
