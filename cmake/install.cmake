# Install rules and the package config, so that an installed kvpolicy is found with
#   find_package(kvpolicy CONFIG REQUIRED)          -> kvpolicy::kvpolicy (headers) and
#                                                      kvpolicy::c (the C ABI shared library)
#   find_package(kvpolicy CONFIG REQUIRED COMPONENTS cuda)   -> also kvpolicy::cuda
# Layout under the prefix: include/kvpolicy/..., <libdir>/cmake/kvpolicy/*.cmake, the C ABI
# library in <libdir>, the command-line tool in bin/ and, when the CUDA target was built, its
# library in <libdir>.
# KVPOLICY_INSTALL (top-level CMakeLists.txt) turns them off, e.g. under add_subdirectory.
if(NOT KVPOLICY_INSTALL)
  return()
endif()

include(CMakePackageConfigHelpers)

set(KVPOLICY_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/kvpolicy"
    CACHE STRING "Install directory of kvpolicy's CMake package files, relative to the prefix")
mark_as_advanced(KVPOLICY_INSTALL_CMAKEDIR)

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/kvpolicy"
        DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
        COMPONENT kvpolicy_Development
        FILES_MATCHING
        PATTERN "*.hpp"
        PATTERN "*.h"
        PATTERN "*.cuh"
        PATTERN "*.inl")

install(TARGETS kvpolicy kvpolicy_profile EXPORT kvpolicyTargets
        ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT kvpolicy_Development)
# The C ABI library (kvpolicy::c).
if(TARGET kvpolicy_c)
  install(TARGETS kvpolicy_c EXPORT kvpolicyTargets
          ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT kvpolicy_Development
          LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT kvpolicy_Runtime
          RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}" COMPONENT kvpolicy_Runtime)
endif()

# The command-line tool (src/cli/, `kvpolicy compress`), when built: <prefix>/bin/kvpolicy. Not part
# of the exported targets (nothing links against it).
if(TARGET kvpolicy_cli)
  install(TARGETS kvpolicy_cli
          RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}" COMPONENT kvpolicy_Runtime)
endif()

# The CUDA fast path (cuda/) only exists when KVPOLICY_CUDA is ON and a CUDA compiler was found.
# A compiled library makes the package architecture dependent, so the version file below only
# claims ARCH_INDEPENDENT for the header-only package.
set(KVPOLICY_CONFIG_WITH_CUDA OFF)
set(_kvp_arch_independent "")  # the C ABI library is compiled code
if(TARGET kvpolicy_cuda)
  set(KVPOLICY_CONFIG_WITH_CUDA ON)
  set_target_properties(kvpolicy_cuda PROPERTIES EXPORT_NAME cuda)  # -> kvpolicy::cuda
  install(TARGETS kvpolicy_cuda EXPORT kvpolicyTargets
          ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT kvpolicy_Development
          LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT kvpolicy_Runtime
          RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}" COMPONENT kvpolicy_Runtime)
endif()

install(EXPORT kvpolicyTargets
        NAMESPACE kvpolicy::
        DESTINATION "${KVPOLICY_INSTALL_CMAKEDIR}"
        COMPONENT kvpolicy_Development)

configure_package_config_file(
  "${PROJECT_SOURCE_DIR}/cmake/kvpolicyConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/kvpolicyConfig.cmake"
  INSTALL_DESTINATION "${KVPOLICY_INSTALL_CMAKEDIR}")
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/kvpolicyConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}"
  COMPATIBILITY SameMajorVersion
  ${_kvp_arch_independent})
install(FILES "${PROJECT_BINARY_DIR}/kvpolicyConfig.cmake"
              "${PROJECT_BINARY_DIR}/kvpolicyConfigVersion.cmake"
        DESTINATION "${KVPOLICY_INSTALL_CMAKEDIR}"
        COMPONENT kvpolicy_Development)

install(FILES "${PROJECT_SOURCE_DIR}/LICENSE"
        DESTINATION "${CMAKE_INSTALL_DATADIR}/doc/kvpolicy"
        COMPONENT kvpolicy_Development
        OPTIONAL)
