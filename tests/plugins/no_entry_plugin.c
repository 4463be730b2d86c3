/* A shared library that is not a kallpa plugin: it exports a misspelt entry point. */
#include <kallpa/plugin_abi.h>

KALLPA_PLUGIN_EXPORT const void* kallpa_attention_plugin_initialise(void) { return 0; }
