/* The example plugin: the naive attention of naive_attention.c behind kallpa's plugin ABI. Build it
 * against an installed kallpa (see CMakeLists.txt) and run
 *   kallpa --plugin ./libkallpa_plugin_naive.so conformance --backend naive --quick */
#include <stdio.h>

#include <kallpa/plugin_abi.h>

#include "naive_attention.h"

static int32_t naive_supports(void* state, const kallpa_signature* s, char* why_not, size_t capacity) {
  (void)state;
  if (s->device_kind != KALLPA_DEVICE_CPU) {
    snprintf(why_not, capacity, "naive runs on host memory only");
    return 0;
  }
  return 1;
}

static size_t naive_workspace(void* state, const kallpa_problem* p) {
  (void)state;
  return naive_workspace_size(p);
}

static int32_t naive_run(void* state, const kallpa_problem* p, void* workspace, size_t workspace_bytes, char* error,
                         size_t error_capacity) {
  (void)state;
  return naive_attention(p, workspace, workspace_bytes, error, error_capacity);
}

static const kallpa_plugin_table kTable = {
    sizeof(kallpa_plugin_table),
    KALLPA_PLUGIN_ABI_MAJOR,
    KALLPA_PLUGIN_ABI_MINOR,
    "naive",
    "1.0.0",
    KALLPA_DEVICE_CPU,
    -10, /* below reference: never chosen automatically, only by name */
    NULL,
    naive_supports,
    naive_workspace,
    naive_run,
    NULL,
    "example plugin: plain C loops over the plugin ABI (examples/plugin-naive)",
};

KALLPA_PLUGIN_EXPORT const kallpa_plugin_table* kallpa_attention_plugin_init(const kallpa_plugin_host* host, char* error,
                                                                            size_t error_capacity) {
  if (host->abi_major != KALLPA_PLUGIN_ABI_MAJOR) {
    snprintf(error, error_capacity, "built for plugin ABI %d, the host speaks %u", KALLPA_PLUGIN_ABI_MAJOR,
             (unsigned)host->abi_major);
    return NULL;
  }
  return &kTable;
}
