# ctest driver (cmake -P): install the kvpolicy build tree into a fresh prefix, configure and
# build tests/consumer against that prefix only, and run the program.
#   -DBUILD_DIR=<kvpolicy build>  -DSOURCE_DIR=<tests/consumer>  -DWORK_DIR=<scratch>
#   -DGENERATOR=<cmake generator> -DCXX_COMPILER=<path>  [-DLAUNCHER=ccache] [-DCONFIG=Release]
#   [-DSOURCE_INCLUDE=<kvpolicy's include/>: the consumer must not compile against it]
#   [-DCLI_EXE=<the command-line tool, relative to the prefix>: must be installed and run]
foreach(var BUILD_DIR SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run.cmake: -D${var}=... is required")
  endif()
endforeach()
if(NOT CONFIG)
  set(CONFIG Release)
endif()

function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "consumer test: `${cmd}` failed (${rc})")
  endif()
endfunction()

set(prefix "${WORK_DIR}/prefix")
set(consumer_build "${WORK_DIR}/build")
file(REMOVE_RECURSE "${WORK_DIR}")

message(STATUS "installing kvpolicy into ${prefix}")
step("${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${prefix}" --config "${CONFIG}")

# The command-line tool, when the build has one (-DCLI_EXE=<path under the prefix>): installed
# and runs.
if(CLI_EXE)
  step("${prefix}/${CLI_EXE}" compress --help)
endif()

# The consumer must find kvpolicy in the prefix only: no package registry, no source tree.
set(launcher_arg "")
if(LAUNCHER)
  set(launcher_arg "-DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER}")
endif()
step("${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${consumer_build}" -G "${GENERATOR}"
     "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" ${launcher_arg}
     "-DCMAKE_BUILD_TYPE=${CONFIG}"
     "-DCMAKE_PREFIX_PATH=${prefix}"
     -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
     -DCMAKE_EXPORT_COMPILE_COMMANDS=ON)

file(STRINGS "${consumer_build}/CMakeCache.txt" found REGEX "^kvpolicy_DIR:")
string(REGEX REPLACE "^kvpolicy_DIR:[A-Z]+=" "" found "${found}")
file(REAL_PATH "${prefix}" real_prefix)
file(REAL_PATH "${found}" real_found)
string(FIND "${real_found}" "${real_prefix}/" at)
if(NOT at EQUAL 0)
  message(FATAL_ERROR "consumer test: kvpolicy was found in '${found}', not under ${prefix}")
endif()

# ... and compile against the installed headers, not the source tree's.
file(READ "${consumer_build}/compile_commands.json" commands)
string(FIND "${commands}" "${prefix}/include" at)
if(at LESS 0)
  message(FATAL_ERROR "consumer test: the compile command lacks ${prefix}/include:\n${commands}")
endif()
if(SOURCE_INCLUDE)
  string(FIND "${commands}" "${SOURCE_INCLUDE}" at)
  if(NOT at LESS 0)
    message(FATAL_ERROR "consumer test: compiles against ${SOURCE_INCLUDE}:\n${commands}")
  endif()
endif()

step("${CMAKE_COMMAND}" --build "${consumer_build}" --config "${CONFIG}")
foreach(name kvpolicy_consumer kvpolicy_c_consumer)
  set(exe "${consumer_build}/${name}")
  if(EXISTS "${consumer_build}/${CONFIG}/${name}")  # multi-config generators
    set(exe "${consumer_build}/${CONFIG}/${name}")
  endif()
  step("${exe}")
endforeach()
