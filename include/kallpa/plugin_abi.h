/* The stable C ABI for out-of-tree attention backends (plugins).
 *
 * A plugin is a shared library that exports one function, KALLPA_PLUGIN_ENTRY_POINT:
 *
 *   const kallpa_plugin_table* kallpa_attention_plugin_init(const kallpa_plugin_host* host,
 *                                                           char* error, size_t error_capacity);
 *
 * It returns a table of function pointers that stays valid until kallpa calls its destroy (or,
 * on failure, NULL with a NUL-terminated reason written to error). kallpa copies the table, checks
 * the version and adapts it to an attention backend held to the same health check and conformance
 * suite as a built-in one (`kallpa conformance --backend NAME --plugin LIB`).
 *
 * Versioning (the rules that let the table grow without breaking old plugins):
 *  - abi_major changes only when an existing field changes meaning or layout; a plugin whose major
 *    differs from kallpa's is refused with a message naming both.
 *  - abi_minor grows when fields are appended to the END of a struct; nothing is ever removed or
 *    reordered. Every struct starts with struct_size (its size as its writer was compiled), so
 *    the reader uses only the fields that lie inside it: kallpa treats fields beyond a plugin's
 *    struct_size as absent (an older-minor plugin loads), and a plugin must do the same with the
 *    structs kallpa passes (kallpa may be newer than the plugin).
 *
 * The problem a plugin receives has already been validated against the attention contract (see
 * include/kallpa/attention.h, whose header comment is the specification); plugins must never
 * throw or unwind across these calls (kallpa catches C++ exceptions at the boundary and counts
 * them as failures, but a C plugin has no such safety net). run() may be called concurrently.
 *
 * Pure C (C99), no kallpa headers or libraries needed.
 */
#ifndef KALLPA_PLUGIN_ABI_H
#define KALLPA_PLUGIN_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KALLPA_PLUGIN_ABI_MAJOR 1
/* 1.0: the first table. 1.1: appended kallpa_plugin_table.description. */
#define KALLPA_PLUGIN_ABI_MINOR 1

#define KALLPA_PLUGIN_ENTRY_POINT "kallpa_attention_plugin_init"

#if defined(_WIN32)
#define KALLPA_PLUGIN_EXPORT __declspec(dllexport)
#else
#define KALLPA_PLUGIN_EXPORT __attribute__((visibility("default")))
#endif

/* Values of the enums of include/kallpa/tensor.h and attention.h. */
enum { KALLPA_DTYPE_F32 = 0, KALLPA_DTYPE_F16 = 1, KALLPA_DTYPE_BF16 = 2 };
enum { KALLPA_DEVICE_CPU = 0, KALLPA_DEVICE_CUDA = 1, KALLPA_DEVICE_OPENCL = 2, KALLPA_DEVICE_PLUGIN = 3 };
enum { KALLPA_Q_DENSE = 0, KALLPA_Q_PACKED = 1 };
enum { KALLPA_KV_DENSE = 0, KALLPA_KV_PACKED = 1, KALLPA_KV_PAGED = 2 };

/* What run() returns: 0 on success, else one of these (kallpa's ErrorCode values). */
enum {
  KALLPA_PLUGIN_OK = 0,
  KALLPA_PLUGIN_INVALID_ARGUMENT = 1,
  KALLPA_PLUGIN_UNSUPPORTED = 2,
  KALLPA_PLUGIN_BACKEND_FAILURE = 3,
  KALLPA_PLUGIN_OUT_OF_MEMORY = 6,
  KALLPA_PLUGIN_INTERNAL = 7
};

/* A strided view; shape and stride (in elements) are meaningful up to rank (at most 4). */
typedef struct kallpa_tensor {
  void* data; /* NULL: absent (only lse may be absent) */
  int64_t shape[4];
  int64_t stride[4];
  int32_t rank;
  int32_t dtype;       /* KALLPA_DTYPE_* */
  int32_t device_kind; /* KALLPA_DEVICE_* */
  int32_t device_index;
} kallpa_tensor;

/* The facts of a problem a plugin may base supports() on (kallpa caches verdicts per signature). */
typedef struct kallpa_signature {
  size_t struct_size;
  int32_t device_kind, device_index;
  int32_t q_dtype, kv_dtype, o_dtype;
  int32_t q_layout, kv_layout;
  int32_t hq, hkv, head_dim, head_dim_v;
  int32_t page_size; /* paged only */
  /* 0 or 1 */
  int32_t causal, window, softcap, alibi, lse, unit_stride_last_dim;
} kallpa_signature;

/* A validated problem, with defaults resolved (scale, batch, block_table_stride). Shapes:
 *   q  dense [B, Sq, Hq, D]              packed [Tq, Hq, D] + cu_seqlens_q[B+1]
 *   kv dense [B, Skv, Hkv, D|Dv]         packed [Tkv, Hkv, D|Dv] + cu_seqlens_k[B+1]
 *      paged [blocks, page, Hkv, D|Dv]   + block_table[B * block_table_stride] + seqlens_k[B]
 *   o  like q with Dv;  lse (f32, optional) dense [B, Hq, Sq], packed [Hq, Tq]. */
typedef struct kallpa_problem {
  size_t struct_size;
  const kallpa_signature* signature;
  kallpa_tensor q, k, v, o, lse;
  int32_t batch;
  const int32_t* cu_seqlens_q; /* packed q only */
  const int32_t* cu_seqlens_k; /* packed kv only */
  const int32_t* block_table;  /* paged only */
  int64_t block_table_stride;  /* paged only; never 0 here */
  int32_t max_blocks_per_seq;  /* paged only */
  const int32_t* seqlens_k;    /* paged only */
  float scale;                 /* resolved: 1/sqrt(D) unless the caller gave one */
  float softcap;               /* 0: off */
  int32_t causal;
  int64_t window_left, window_right; /* -1: unbounded */
  const float* alibi_slopes;         /* [Hq] or NULL */
} kallpa_problem;

/* Given to the entry point: who is loading the plugin. */
typedef struct kallpa_plugin_host {
  size_t struct_size;
  uint32_t abi_major, abi_minor;
  const char* kallpa_version;
} kallpa_plugin_host;

typedef struct kallpa_plugin_table {
  size_t struct_size; /* sizeof(kallpa_plugin_table) as the plugin was compiled */
  uint32_t abi_major; /* KALLPA_PLUGIN_ABI_MAJOR as the plugin was compiled */
  uint32_t abi_minor; /* KALLPA_PLUGIN_ABI_MINOR as the plugin was compiled */

  /* ---- ABI 1.0 ---- */
  const char* name; /* unique; letters, digits, '-', '_', '.'; used with --attention */
  const char* version;
  int32_t device_kind; /* KALLPA_DEVICE_* of the memory run() works on */
  int32_t priority;    /* higher wins automatic selection; reference is 0 */
  void* state;         /* passed back to every call */
  /* 1: yes. 0: no, with a reason a person can act on written to why_not. Cheap, no side effects. */
  int32_t (*supports)(void* state, const kallpa_signature* signature, char* why_not, size_t why_not_capacity);
  /* Optional (NULL: none). Scratch bytes run() needs; kallpa hands them over 64-byte aligned. */
  size_t (*workspace_size)(void* state, const kallpa_problem* problem);
  /* Writes o (and lse when present). KALLPA_PLUGIN_OK, or an error code with a message. */
  int32_t (*run)(void* state, const kallpa_problem* problem, void* workspace, size_t workspace_bytes, char* error,
                 size_t error_capacity);
  /* Optional. Called once when kallpa drops the backend; the table is not used afterwards. */
  void (*destroy)(void* state);

  /* ---- ABI 1.1 ---- */
  const char* description; /* optional: one line for `kallpa backends` */
} kallpa_plugin_table;

/* Size of the table as ABI 1.0 defined it: the smallest struct_size kallpa accepts. */
#define KALLPA_PLUGIN_TABLE_SIZE_1_0 (offsetof(kallpa_plugin_table, destroy) + sizeof(void (*)(void*)))

typedef const kallpa_plugin_table* (*kallpa_plugin_init_fn)(const kallpa_plugin_host* host, char* error,
                                                            size_t error_capacity);

#ifdef __cplusplus
}
#endif

#endif /* KALLPA_PLUGIN_ABI_H */
