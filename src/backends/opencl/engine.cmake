# The engine's op set on OpenCL (runtime/ops.h): included by the root CMakeLists once kallpa_engine
# exists. The OpenCL::OpenCL target found in this directory's CMakeLists is local to it, so the
# package is looked up again here; without OpenCL the engine simply has no OpenCL ops.
if(NOT TARGET OpenCL::OpenCL)
  find_package(OpenCL QUIET)
endif()
if(NOT TARGET OpenCL::OpenCL)
  return()
endif()

# The kernels are compiled into the library as a raw string (as flash_attention.cl is), so the
# program needs no file at run time. Regenerated at configure time whenever the .cl file changes.
set(kallpa_engine_cl_source ${CMAKE_CURRENT_LIST_DIR}/engine_ops.cl)
set(kallpa_engine_cl_dir ${CMAKE_BINARY_DIR}/generated/opencl_engine)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${kallpa_engine_cl_source})
file(READ ${kallpa_engine_cl_source} kallpa_engine_cl_text)
file(CONFIGURE OUTPUT ${kallpa_engine_cl_dir}/engine_ops_cl.h
  CONTENT "// Generated from src/backends/opencl/engine_ops.cl; do not edit.\n#pragma once\ninline constexpr char kEngineOpsSource[] = R\"kallpa_cl(@kallpa_engine_cl_text@)kallpa_cl\";\n"
  @ONLY)

target_sources(kallpa_engine PRIVATE ${CMAKE_CURRENT_LIST_DIR}/opencl_ops.cpp)
target_include_directories(kallpa_engine PRIVATE ${kallpa_engine_cl_dir})
target_compile_definitions(kallpa_engine PRIVATE CL_TARGET_OPENCL_VERSION=120)
target_link_libraries(kallpa_engine PRIVATE OpenCL::OpenCL)
