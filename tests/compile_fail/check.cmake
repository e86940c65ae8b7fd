# ctest driver (cmake -P) for one compile-fail case. The source states what must happen:
#   // expect-error: <CMake regex>     (any number; all must match the compiler's output)
# With no expect-error line the source must compile cleanly (the control case, which proves the
# harness fails only for the reason under test).
#   -DCXX=<compiler> -DFLAGS_FILE=<response file with -std, -I, -fopenmp> -DSOURCE=<file.cpp>
foreach(var CXX FLAGS_FILE SOURCE)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check.cmake: -D${var}=... is required")
  endif()
endforeach()

file(STRINGS "${SOURCE}" lines REGEX "^// expect-error: ")
set(expected "")
foreach(line IN LISTS lines)
  string(REGEX REPLACE "^// expect-error: " "" re "${line}")
  list(APPEND expected "${re}")
endforeach()

# ASCII quotes in diagnostics, so the expectations need no locale-specific characters.
set(ENV{LC_ALL} C)
execute_process(COMMAND "${CXX}" "@${FLAGS_FILE}" -fsyntax-only "${SOURCE}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
get_filename_component(name "${SOURCE}" NAME)

if(NOT expected)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${name} should compile but failed:\n${out}")
  endif()
  message(STATUS "${name}: compiles, as expected")
  return()
endif()

if(rc EQUAL 0)
  message(FATAL_ERROR "${name} compiled, but it must be rejected (expected: ${expected})")
endif()
set(missing "")
foreach(re IN LISTS expected)
  if(NOT out MATCHES "${re}")
    list(APPEND missing "${re}")
  endif()
endforeach()
if(missing)
  message(FATAL_ERROR "${name} failed to compile, but the diagnostics lack: ${missing}\n"
                      "--- compiler output ---\n${out}")
endif()
message(STATUS "${name}: rejected with the expected diagnostics (${expected})")
