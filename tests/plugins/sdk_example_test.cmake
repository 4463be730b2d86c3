# The SDK as an outside project sees it (ctest: sdk.example_plugin):
#  1. install kallpa's SDK component into a fresh prefix;
#  2. configure and build examples/plugin-naive against it with find_package(kallpa): the C plugin
#     (kallpa::plugin_abi) and a C++ host program (kallpa::attention) that runs it;
#  3. check pkg-config's answer for the same prefix;
#  4. load the plugin into kallpa and hold it to the quick conformance suite.
# Inputs: KALLPA_BUILD_DIR, KALLPA_SOURCE_DIR, KALLPA_CLI, WORK_DIR, SANITIZER_FLAGS (may be empty).
cmake_minimum_required(VERSION 3.16)

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(run_out "${out}" PARENT_SCOPE)
  set(run_err "${err}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
run("install" ${CMAKE_COMMAND} --install ${KALLPA_BUILD_DIR} --prefix ${prefix} --component kallpa_sdk)

file(GLOB_RECURSE config ${prefix}/*/kallpaConfig.cmake)
file(GLOB_RECURSE pc ${prefix}/*/kallpa.pc)
file(GLOB_RECURSE lib ${prefix}/*/libkallpa_attention.so)
foreach(f config pc lib)
  if(NOT ${f})
    message(FATAL_ERROR "the install has no ${f} file under ${prefix}")
  endif()
endforeach()
foreach(h plugin_abi.h attention.h backend.h dispatcher.h registry.h health.h plugin.h conformance.h)
  if(NOT EXISTS ${prefix}/include/kallpa/${h})
    message(FATAL_ERROR "the install lacks include/kallpa/${h}")
  endif()
endforeach()
if(EXISTS ${prefix}/include/kallpa/runtime)
  message(FATAL_ERROR "engine headers are not part of the SDK")
endif()

# A clean environment: nothing of kallpa's build tree is visible, only the install.
set(sanitize_args "")
if(SANITIZER_FLAGS)  # kallpa was built with a sanitizer: so is the program that links it
  foreach(v CMAKE_C_FLAGS CMAKE_CXX_FLAGS CMAKE_EXE_LINKER_FLAGS CMAKE_SHARED_LINKER_FLAGS)
    list(APPEND sanitize_args "-D${v}=${SANITIZER_FLAGS}")
  endforeach()
endif()
run("configure the example" ${CMAKE_COMMAND} -S ${KALLPA_SOURCE_DIR}/examples/plugin-naive -B ${WORK_DIR}/build
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release -DKALLPA_EXAMPLE_HOST=ON ${sanitize_args})
run("build the example" ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
set(plugin ${WORK_DIR}/build/libkallpa_plugin_naive.so)
if(NOT EXISTS ${plugin})
  message(FATAL_ERROR "the example build did not produce ${plugin}")
endif()

# The C++ side of the SDK: a program linked to the installed kallpa::attention loads the plugin.
run("the example host program" ${WORK_DIR}/build/kallpa_naive_host ${plugin})
message(STATUS "example host: ${run_out}")

find_program(PKG_CONFIG pkg-config)
if(PKG_CONFIG)
  get_filename_component(pc_dir ${pc} DIRECTORY)
  set(ENV{PKG_CONFIG_PATH} ${pc_dir})
  run("pkg-config" ${PKG_CONFIG} --cflags --libs kallpa)
  string(STRIP "${run_out}" flags)
  if(NOT flags MATCHES "-I[^ ]*/include" OR NOT flags MATCHES "-lkallpa_attention")
    message(FATAL_ERROR "pkg-config --cflags --libs kallpa gave '${flags}'")
  endif()
  string(REGEX MATCH "-I([^ ]*)" _ "${flags}")
  if(NOT EXISTS ${CMAKE_MATCH_1}/kallpa/plugin_abi.h)
    message(FATAL_ERROR "pkg-config's include directory ${CMAKE_MATCH_1} does not hold kallpa/plugin_abi.h")
  endif()
endif()

run("kallpa conformance with the example plugin"
    ${KALLPA_CLI} --plugin ${plugin} conformance --backend naive --quick)
string(STRIP "${run_out}" out)
string(REGEX MATCH "[^\n]*$" last "${out}")
if(NOT last MATCHES "^[0-9]+ passed, 0 failed$")
  message(FATAL_ERROR "expected 'N passed, 0 failed', got '${last}'")
endif()
message(STATUS "example plugin: ${last}")
