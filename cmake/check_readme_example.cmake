# ctest driver (cmake -P): the C++ block that follows the marker line
#   <!-- example: examples/readme_example.cpp -->
# in README.md must be identical to examples/readme_example.cpp.
#   -DREADME=<README.md> -DEXAMPLE=<examples/readme_example.cpp>
file(READ "${README}" readme)
file(READ "${EXAMPLE}" example)
set(marker "<!-- example: examples/readme_example.cpp -->")
string(FIND "${readme}" "${marker}" at)
if(at LESS 0)
  message(FATAL_ERROR "README.md lacks the marker line '${marker}' before the example")
endif()
string(SUBSTRING "${readme}" ${at} -1 rest)
set(fence_open "```cpp\n")
string(FIND "${rest}" "${fence_open}" open)
if(open LESS 0)
  message(FATAL_ERROR "README.md: no ```cpp block after '${marker}'")
endif()
string(LENGTH "${fence_open}" n)
math(EXPR open "${open} + ${n}")
string(SUBSTRING "${rest}" ${open} -1 rest)
string(FIND "${rest}" "\n```" close)
if(close LESS 0)
  message(FATAL_ERROR "README.md: the example's code block is not closed")
endif()
math(EXPR close "${close} + 1")  # keep the block's last newline
string(SUBSTRING "${rest}" 0 ${close} block)
if(NOT block STREQUAL example)
  file(WRITE "${CMAKE_CURRENT_BINARY_DIR}/readme_block.cpp" "${block}")
  message(FATAL_ERROR "README.md's example differs from ${EXAMPLE}; compare with "
                      "${CMAKE_CURRENT_BINARY_DIR}/readme_block.cpp (diff -u) and copy one onto "
                      "the other")
endif()
message(STATUS "README.md's example matches ${EXAMPLE}")
