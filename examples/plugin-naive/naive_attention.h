/* Attention as the contract defines it, in plain C over the plugin ABI's structs: double
 * accumulation, every layout, mask and option. Slow by design; the point is a correct plugin. */
#ifndef KALLPA_EXAMPLE_NAIVE_ATTENTION_H
#define KALLPA_EXAMPLE_NAIVE_ATTENTION_H

#include <stddef.h>

#include <kallpa/plugin_abi.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Scratch doubles run needs: the longest KV sequence of the batch. */
size_t naive_workspace_size(const kallpa_problem* problem);

/* KALLPA_PLUGIN_OK, or an error code with a message in error. */
int32_t naive_attention(const kallpa_problem* problem, void* workspace, size_t workspace_bytes, char* error,
                        size_t error_capacity);

/* Per-sequence geometry, for plugins that build on this one. */
int64_t naive_seqlen_q(const kallpa_problem* p, int32_t b);
int64_t naive_seqlen_k(const kallpa_problem* p, int32_t b);
/* Element offset of o row (b, i) at head 0, dim 0. */
int64_t naive_o_row(const kallpa_problem* p, int32_t b, int64_t i);
float naive_load(const kallpa_tensor* t, int64_t index);
void naive_store(const kallpa_tensor* t, int64_t index, float value);

#ifdef __cplusplus
}
#endif

#endif
