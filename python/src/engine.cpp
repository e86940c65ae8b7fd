// The reference engine: Model (a Llama-family GGUF, weights dequantized to fp32), its tokenizer,
// and Engine (one sequence whose KV cache is a Session compressed by a policy). Engines keep
// their Model alive (keep_alive), so a notebook may drop its own reference to the model.
#include <pybind11/stl.h>

#include <cmath>

#include "arrays.hpp"
#include "engine/engine.hpp"
#include "retrieval.hpp"  // benchmarks/accuracy: the retrieval tasks and corpora
#include "tasks.hpp"  // benchmarks/accuracy: the accuracy benchmark's tasks

namespace kvpy {
namespace {

using kvpolicy::Budget;
using kvpolicy::engine::Engine;
using kvpolicy::engine::EngineConfig;
using kvpolicy::engine::Matrix;
using kvpolicy::engine::Model;
using kvpolicy::engine::Tokenizer;

py::array_t<float> matrix_array(const Matrix& m) {
  py::array_t<float> a({static_cast<py::ssize_t>(m.rows()), static_cast<py::ssize_t>(m.cols())});
  std::copy_n(m.data(), m.size(), a.mutable_data());
  return a;
}

py::array_t<float> vector_array(std::span<const float> s) {
  py::array_t<float> a(static_cast<py::ssize_t>(s.size()));
  std::copy(s.begin(), s.end(), a.mutable_data());
  return a;
}

Budget budget_of(char kind, double value) {
  if (kind == 't') return Budget::tokens(static_cast<std::int64_t>(value));
  if (kind == 'T') return Budget::total(static_cast<std::int64_t>(value));
  return Budget::ratio(value);
}

py::dict config_dict(const Model& m) {
  const auto& c = m.config();
  py::dict d;
  d["architecture"] = c.architecture;
  d["name"] = c.name;
  d["n_layers"] = c.n_layers;
  d["n_embd"] = c.n_embd;
  d["n_ff"] = c.n_ff;
  d["n_head"] = c.n_head;
  d["n_head_kv"] = c.n_head_kv;
  d["head_dim"] = c.head_dim;
  d["n_vocab"] = c.n_vocab;
  d["n_ctx_train"] = c.n_ctx_train;
  d["rope_base"] = c.rope_base;
  d["rms_eps"] = c.rms_eps;
  return d;
}

// The accuracy benchmark's tasks (benchmarks/accuracy/tasks.hpp) in the form kvpolicy/tasks.py
// drives: prompt construction and scoring stay the C++ benchmark's own.
void bind_tasks(py::module_& m) {
  m.def(
      "passkey_prompt",
      [](const Model& model, std::int64_t length, double depth, std::uint64_t seed) {
        const auto pieces = kvbench::passkey_pieces(model, kvbench::passkey_digits(seed, length, depth));
        const std::int64_t units = kvbench::passkey_units(pieces, length);
        const auto before = static_cast<std::int64_t>(std::lround(depth * static_cast<double>(units)));
        std::vector<std::int32_t> ids = pieces.head;
        kvbench::append_units(ids, pieces, before);
        ids.insert(ids.end(), pieces.key.begin(), pieces.key.end());
        kvbench::append_units(ids, pieces, units - before);
        ids.insert(ids.end(), pieces.question.begin(), pieces.question.end());
        return py::make_tuple(ids, pieces.key_digits);
      },
      py::arg("model"), py::arg("length"), py::arg("depth"), py::arg("seed"));
  m.def("first_five_digits", &kvbench::first_five_digits, py::arg("text"));
  m.def(
      "fidelity_text",
      [](const Model& model, const std::string& path, std::int64_t prompt, std::int64_t cont) {
        const auto t = kvbench::load_fidelity_text(model, path, prompt, cont);
        return py::make_tuple(t.name, t.prompt, t.continuation);
      },
      py::arg("model"), py::arg("path"), py::arg("prompt_tokens"), py::arg("cont_tokens"));
  // Retrieval tasks (benchmarks/accuracy/retrieval.hpp): corpora are tokenized once per set.
  struct CorpusSet {
    kvbench::PromptSet set;
    std::vector<kvbench::Corpus> corpora;
  };
  auto prompt_set = [](const std::string& s) {
    KVP_REQUIRE(s == "eval" || s == "calibration", "prompt_set must be 'eval' or 'calibration' (got '",
                s, "')");
    return s == "eval" ? kvbench::PromptSet::eval : kvbench::PromptSet::calibration;
  };
  py::class_<CorpusSet>(m, "CorpusSet")
      .def_property_readonly("names", [](const CorpusSet& c) {
        std::vector<std::string> out;
        for (const auto& x : c.corpora) out.push_back(x.name);
        return out;
      });
  m.def(
      "load_corpora",
      [prompt_set](const Model& model, const std::string& set) {
        CorpusSet c{prompt_set(set), {}};
        py::gil_scoped_release nogil;
        for (const auto& path : kvbench::corpus_paths(c.set))
          c.corpora.push_back(kvbench::load_corpus(model, path));
        return c;
      },
      py::arg("model"), py::arg("prompt_set") = "eval");
  m.def("retrieval_tasks", &kvbench::retrieval_tasks);
  m.def(
      "retrieval_prompt",
      [](const Model& model, const CorpusSet& c, const std::string& task, std::int64_t length,
         std::int64_t index) {
        const auto p = kvbench::make_retrieval_prompt(model, c.corpora, c.set, task, length, index);
        py::dict d;
        d["context"] = p.context;
        d["question"] = p.question;
        d["prefix"] = p.prefix;
        d["answer"] = p.answer;
        d["answer_text"] = p.answer_text;
        d["source"] = p.source;
        d["depths"] = p.depths;
        return d;
      },
      py::arg("model"), py::arg("corpora"), py::arg("task"), py::arg("length"), py::arg("index"));
  m.def(
      "run_retrieval",
      [](const Model& model, const CorpusSet& c, const std::string& task, std::int64_t length,
         std::int64_t index, const std::vector<std::pair<std::string, double>>& grid,
         const std::vector<std::string>& regimes, std::int64_t record_queries, int threads,
         std::int64_t greedy_tokens) {
        std::vector<kvbench::GridPoint> g;
        for (const auto& [p, b] : grid) g.push_back({p, b});
        std::vector<kvbench::Regime> rs;
        for (const auto& r : regimes) {
          KVP_REQUIRE(r == "known" || r == "agnostic", "regimes: unknown regime '", r,
                      "' (known, agnostic)");
          rs.push_back(r == "known" ? kvbench::Regime::question_known
                                    : kvbench::Regime::question_agnostic);
        }
        kvpolicy::engine::EngineConfig cfg;
        cfg.policy = "streaming";
        cfg.threads = threads;
        cfg.record_queries = record_queries;
        cfg.record_attention = true;
        kvbench::RetrievalPrompt p;
        kvbench::RetrievalOutcome r;
        {
          py::gil_scoped_release nogil;
          p = kvbench::make_retrieval_prompt(model, c.corpora, c.set, task, length, index);
          r = kvbench::run_retrieval(model, p, g, rs, cfg, greedy_tokens);
        }
        py::dict d;
        d["tokens"] = p.context.size() + p.question.size();
        d["answer"] = p.answer_text;
        d["source"] = p.source;
        d["full_em"] = r.full.em;
        d["full_logp"] = r.full.logp;
        d["full_greedy"] = r.full_greedy;
        py::list cells;
        for (std::size_t ri = 0; ri < rs.size(); ++ri)
          for (std::size_t i = 0; i < g.size(); ++i) {
            py::dict x;
            x["regime"] = regimes[ri];
            x["policy"] = g[i].policy;
            x["budget"] = g[i].budget;
            x["em"] = r.cells[ri][i].em;
            x["logp"] = r.cells[ri][i].logp;
            x["dlogp"] = r.cells[ri][i].logp - r.full.logp;
            x["kept"] = r.kept_fraction[ri][i];
            cells.append(x);
          }
        d["cells"] = cells;
        return d;
      },
      py::arg("model"), py::arg("corpora"), py::arg("task"), py::arg("length"), py::arg("index"),
      py::arg("grid"), py::arg("regimes"), py::arg("record_queries"), py::arg("threads") = 0,
      py::arg("greedy_tokens") = 0);
  py::class_<kvbench::Reference>(m, "FidelityReference")
      .def_readonly("nll", &kvbench::Reference::nll);
  m.def(
      "reference_run",
      [](Engine& full, const std::vector<std::int32_t>& cont) {
        py::gil_scoped_release nogil;
        return kvbench::reference_run(full, cont);
      },
      py::arg("engine"), py::arg("continuation"));
  m.def(
      "compare_run",
      [](Engine& e, const std::vector<std::int32_t>& cont, const kvbench::Reference& ref) {
        kvbench::Fidelity f;
        {
          py::gil_scoped_release nogil;
          f = kvbench::compare_run(e, cont, ref);
        }
        py::dict d;
        d["kl"] = f.kl;
        d["top1"] = f.top1;
        d["nll"] = f.nll;
        d["delta_nll"] = f.delta_nll;
        return d;
      },
      py::arg("engine"), py::arg("continuation"), py::arg("reference"));
}

}  // namespace

void bind_engine(py::module_& m) {
  bind_tasks(m);
  m.def("default_model_path", &kvpolicy::engine::default_model_path,
        "$KVPOLICY_MODEL, else ${KVPOLICY_CACHE:-~/.cache/kvpolicy}/SmolLM2-135M-Instruct.Q4_1.gguf "
        "(scripts/fetch_model.sh puts it there).");

  py::class_<Tokenizer>(m, "Tokenizer")
      .def("encode", &Tokenizer::encode, py::arg("text"), py::arg("parse_special") = true,
           py::arg("add_bos") = false)
      .def("decode", [](const Tokenizer& t, const std::vector<std::int32_t>& ids) {
        return py::bytes(t.decode(ids));
      }, py::arg("ids"))
      .def("token", &Tokenizer::token, py::arg("id"))
      .def_property_readonly("n_vocab", &Tokenizer::n_vocab)
      .def_property_readonly("bos", &Tokenizer::bos)
      .def_property_readonly("eos", &Tokenizer::eos)
      .def(
          "apply_chat_template",
          [](const Tokenizer& t, const std::vector<std::pair<std::string, std::string>>& msgs,
             bool add_generation_prompt) {
            std::vector<kvpolicy::engine::ChatMessage> v;
            for (const auto& [role, content] : msgs) v.push_back({role, content});
            return t.apply_chat_template(v, add_generation_prompt);
          },
          py::arg("messages"), py::arg("add_generation_prompt") = true);

  py::class_<Model, std::unique_ptr<Model>>(m, "Model")
      .def_static(
          "load",
          [](const std::string& path) {
            py::gil_scoped_release nogil;
            return Model::load(path);
          },
          py::arg("path"))
      .def_property_readonly("config", &config_dict)
      .def_property_readonly("tokenizer", &Model::tokenizer, py::return_value_policy::reference_internal);

  py::class_<Engine>(m, "Engine")
      .def(py::init([](const Model& model, const std::string& policy, char kind, double value,
                       int threads, std::int64_t prefill_chunk, std::int64_t record_queries,
                       bool record_attention, std::int64_t decode_interval) {
             EngineConfig c;
             c.policy = policy;
             c.budget = budget_of(kind, value);
             c.threads = threads;
             c.prefill_chunk = prefill_chunk;
             c.record_queries = record_queries;
             c.record_attention = record_attention;
             c.decode_interval = decode_interval;
             return Engine(model, c);
           }),
           py::arg("model"), py::arg("policy"), py::arg("kind"), py::arg("value"),
           py::arg("threads"), py::arg("prefill_chunk"), py::arg("record_queries"),
           py::arg("record_attention"), py::arg("decode_interval"), py::keep_alive<1, 2>())
      .def(
          "prefill",
          [](Engine& e, const std::vector<std::int32_t>& tokens, bool all_logits) {
            Matrix out;
            {
              py::gil_scoped_release nogil;
              out = e.prefill(tokens, all_logits);
            }
            return matrix_array(out);
          },
          py::arg("tokens"), py::arg("all_logits") = false)
      .def(
          "extend",
          [](Engine& e, const std::vector<std::int32_t>& tokens, bool all_logits) {
            Matrix out;
            {
              py::gil_scoped_release nogil;
              out = e.extend(tokens, all_logits);
            }
            return matrix_array(out);
          },
          py::arg("tokens"), py::arg("all_logits") = false)
      .def(
          "step",
          [](Engine& e, std::int32_t token) {
            std::span<const float> s;
            {
              py::gil_scoped_release nogil;
              s = e.step(token);
            }
            return vector_array(s);
          },
          py::arg("token"))
      .def(
          "generate",
          [](Engine& e, std::int64_t max_new, std::optional<std::vector<std::int32_t>> stop) {
            py::gil_scoped_release nogil;
            return stop ? e.generate(max_new, *stop) : e.generate(max_new);
          },
          py::arg("max_new"), py::arg("stop") = py::none())
      .def(
          "teacher_force",
          [](Engine& e, const std::vector<std::int32_t>& cont) {
            kvpolicy::engine::TeacherForced tf;
            {
              py::gil_scoped_release nogil;
              tf = e.teacher_force(cont);
            }
            return py::make_tuple(vector_array(tf.logprob), tf.argmax);
          },
          py::arg("continuation"))
      .def(
          "fork",
          [](const Engine& e, const std::string& policy, char kind, double value) {
            return e.fork(policy, budget_of(kind, value));
          },
          py::arg("policy"), py::arg("kind"), py::arg("value"), py::keep_alive<0, 1>())
      .def(
          "reconstruct",
          [](Engine& e, std::int64_t chunk, std::int64_t first) {
            py::gil_scoped_release nogil;
            e.reconstruct({chunk, first});
          },
          py::arg("chunk") = 2048, py::arg("first") = 0)
      .def("compress_now", &Engine::compress_now)
      .def("reset", &Engine::reset)
      .def_property_readonly("position", &Engine::position)
      .def_property_readonly("last_logits",
                             [](const Engine& e) { return vector_array(e.last_logits()); })
      .def_property_readonly("kv_bytes", [](const Engine& e) { return e.session().kv_bytes(); })
      .def(
          "lengths",
          [](const Engine& e, std::int64_t layer) {
            const auto s = e.session().lengths(layer);
            return std::vector<std::int64_t>(s.begin(), s.end());
          },
          py::arg("layer"))
      .def(
          "positions",
          [](const Engine& e, std::int64_t layer, std::int64_t head) {
            const auto s = e.session().positions(layer, head);
            return std::vector<std::int32_t>(s.begin(), s.end());
          },
          py::arg("layer"), py::arg("head"));
}

}  // namespace kvpy
