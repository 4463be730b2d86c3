// The one thing the vendored common/json.cpp takes from ggml.h: an assertion that aborts.
#pragma once

#include <cstdio>
#include <cstdlib>

#define GGML_ASSERT(x)                                                               \
  do {                                                                               \
    if (!(x)) {                                                                      \
      std::fprintf(stderr, "%s:%d: assertion failed: %s\n", __FILE__, __LINE__, #x); \
      std::abort();                                                                  \
    }                                                                                \
  } while (0)
