# The SDK: `cmake --install BUILD [--prefix P] [--component kallpa_sdk]` puts the attention headers,
# libkallpa_attention, a CMake package (find_package(kallpa) -> kallpa::attention, and
# kallpa::plugin_abi for plugins that need only the C header) and kallpa.pc for pkg-config.
# The kallpa command itself is the component kallpa_cli.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# Header-only target for plugins: the C ABI needs no kallpa library at all.
add_library(kallpa_plugin_abi INTERFACE)
add_library(kallpa::plugin_abi ALIAS kallpa_plugin_abi)
target_include_directories(kallpa_plugin_abi INTERFACE
  $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include> $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
set_target_properties(kallpa_plugin_abi PROPERTIES EXPORT_NAME plugin_abi)

set_target_properties(kallpa_attention PROPERTIES EXPORT_NAME attention
  VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
target_include_directories(kallpa_attention PUBLIC $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)

install(TARGETS kallpa_attention kallpa_plugin_abi EXPORT kallpaTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT kallpa_sdk NAMELINK_COMPONENT kallpa_sdk)
# The attention library's public headers: include/kallpa/*.h. The subdirectories belong to the
# engine and the server, which are not part of the SDK.
file(GLOB kallpa_sdk_headers CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/include/kallpa/*.h)
install(FILES ${kallpa_sdk_headers} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kallpa COMPONENT kallpa_sdk)
install(EXPORT kallpaTargets NAMESPACE kallpa:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kallpa COMPONENT kallpa_sdk)

configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/kallpaConfig.cmake.in
  ${PROJECT_BINARY_DIR}/kallpaConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kallpa)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/kallpaConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/kallpaConfig.cmake ${PROJECT_BINARY_DIR}/kallpaConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kallpa COMPONENT kallpa_sdk)

# pkg-config resolves ${pcfiledir}, which keeps the file right wherever --prefix puts it.
file(RELATIVE_PATH kallpa_pc_up /root/${CMAKE_INSTALL_LIBDIR}/pkgconfig /root)
string(REGEX REPLACE "/$" "" kallpa_pc_up "${kallpa_pc_up}")
configure_file(${CMAKE_CURRENT_LIST_DIR}/kallpa.pc.in ${PROJECT_BINARY_DIR}/kallpa.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/kallpa.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT kallpa_sdk)

# The command line program, finding the libraries beside it after installation.
set_target_properties(kallpa PROPERTIES INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR}")
install(TARGETS kallpa_engine LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT kallpa_cli)
install(TARGETS kallpa RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT kallpa_cli)
