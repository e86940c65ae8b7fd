// libFuzzer target: arbitrary bytes through the GGUF reader, then through everything the engine
// builds from a parsed file (dequantization of each tensor, the tokenizer from its metadata and
// an encode/decode round, the model config and weights, and, for models small enough, a short
// prefill and decode step through a kvpolicy::Session). Every rejection must be a
// kvpolicy::Error; anything else that escapes (another exception, a crash, an ASan/UBSan report,
// a huge allocation) is a finding.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "engine/engine.hpp"
#include "engine/gguf.hpp"
#include "engine/model.hpp"
#include "engine/tokenizer.hpp"
#include "fuzz_common.hpp"
#include "kvpolicy/core/error.hpp"

namespace eng = kvpolicy::engine;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::optional<eng::GgufFile> f;
  try {
    f.emplace(eng::GgufFile::parse(std::vector<std::uint8_t>(data, data + size), "fuzz.gguf"));
  } catch (const kvpolicy::Error&) {
    return 0;
  }
  for (const auto& t : f->tensors()) {
    try {
      (void)f->dequantize(t);
    } catch (const kvpolicy::Error&) {
    }
  }
  try {
    const eng::Tokenizer tok = eng::Tokenizer::from_gguf(*f);
    const auto ids =
        tok.encode("Hello, w\xc3\xb6rld 123  <|im_start|>x\xff\n\tend", true, tok.bos() >= 0);
    (void)tok.decode(ids);
    (void)tok.apply_chat_template({{"user", "hi"}}, true);
  } catch (const kvpolicy::Error&) {
  }
  try {
    const auto model = eng::Model::load(*f);
    const auto& c = model->config();
    if (c.n_layers * c.n_embd * std::max(c.n_ff, c.n_embd) <= (1 << 20)) {
      eng::EngineConfig cfg;
      cfg.policy = "h2o";
      cfg.budget = kvpolicy::Budget::tokens(2);
      eng::Engine e(*model, cfg);
      const std::int32_t last = static_cast<std::int32_t>(c.n_vocab - 1);
      e.prefill(std::vector<std::int32_t>{0, last, 0});
      e.step(last);
    }
  } catch (const kvpolicy::Error&) {
  }
  return 0;
}
