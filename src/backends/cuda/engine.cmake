# The engine's op set on CUDA (runtime/ops.h): included by the root CMakeLists once kallpa_engine
# exists; only when this directory built its CUDA kernels (nvcc found, KALLPA_WITH_CUDA on). The
# toolkit's targets found in this directory's CMakeLists are local to it, so it is looked up again.
if(NOT TARGET kallpa_cuda_engine_kernels)
  return()
endif()
find_package(CUDAToolkit REQUIRED)
get_target_property(kallpa_cuda_arch kallpa_attention CUDA_ARCHITECTURES)
target_sources(kallpa_engine PRIVATE $<TARGET_OBJECTS:kallpa_cuda_engine_kernels>
  ${CMAKE_CURRENT_LIST_DIR}/cuda_ops.cpp)
set_property(TARGET kallpa_engine PROPERTY CUDA_ARCHITECTURES ${kallpa_cuda_arch})
# cuBLAS is loaded at run time (dlopen); only its header is needed here.
target_include_directories(kallpa_engine SYSTEM PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
target_link_libraries(kallpa_engine PRIVATE CUDA::cudart_static ${CMAKE_DL_LIBS})
