# kvpolicy_bench_tasks: the accuracy benchmark's tasks, corpora, statistics and report, as one
# static library that the benchmark (benchmarks/), kvpolicy_calibrate and the tests
# (tests/bench/) link, so each source compiles once per build. Included by tests/CMakeLists.txt
# and benchmarks/CMakeLists.txt, whichever comes first; needs kvpolicy_engine.
include_guard(GLOBAL)
find_package(ZLIB REQUIRED)             # gzip-compressed corpora (Debian ships its docs as .gz)
find_package(nlohmann_json 3 REQUIRED)  # results.json, shards, --merge
set(_kvp_acc ${CMAKE_CURRENT_LIST_DIR})
add_library(kvpolicy_bench_tasks STATIC ${_kvp_acc}/tasks.cpp ${_kvp_acc}/retrieval.cpp
            ${_kvp_acc}/report.cpp ${_kvp_acc}/stats.cpp)
target_include_directories(kvpolicy_bench_tasks PUBLIC ${_kvp_acc})
# No FMA contraction: the intervals are the same numbers on every machine and build.
set_source_files_properties(${_kvp_acc}/stats.cpp TARGET_DIRECTORY kvpolicy_bench_tasks
                            PROPERTIES COMPILE_OPTIONS -ffp-contract=off)
target_link_libraries(kvpolicy_bench_tasks PUBLIC kvpolicy_engine kvpolicy_project_flags
                      ZLIB::ZLIB nlohmann_json::nlohmann_json)
