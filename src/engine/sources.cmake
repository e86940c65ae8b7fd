# The reference engine's translation units, listed once: src/CMakeLists.txt builds
# kvpolicy_engine from them, fuzz/CMakeLists.txt its instrumented copy. Sets
# KVPOLICY_ENGINE_SOURCES to absolute paths.
set(KVPOLICY_ENGINE_SOURCES
  ggml_types.cpp
  gguf.cpp
  unicode.cpp
  tokenizer.cpp
  weights.cpp
  model.cpp
  engine.cpp)
list(TRANSFORM KVPOLICY_ENGINE_SOURCES PREPEND ${CMAKE_CURRENT_LIST_DIR}/)
