#include "naive_attention.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else { /* subnormal: normalise */
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static uint16_t float_to_half(float f) {
  uint32_t x;
  memcpy(&x, &f, sizeof x);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return (uint16_t)(sign | 0x7e00u); /* NaN */
  if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to or is inf */
  if (abs < 0x38800000u) { /* subnormal half (or zero): round abs * 2^24 to an integer */
    float a;
    memcpy(&a, &abs, sizeof a);
    const float scaled = a * 16777216.0f; /* exact: a power of two */
    const float rounded = nearbyintf(scaled); /* round-to-nearest-even (default mode) */
    return (uint16_t)(sign | (uint16_t)rounded);
  }
  /* normal: rebias, then round the 13 dropped bits to nearest even */
  uint32_t bits = abs - 0x38000000u;
  const uint32_t rem = bits & 0x1fffu;
  bits >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (bits & 1u))) ++bits;
  return (uint16_t)(sign | bits);
}

static float bf16_to_float(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static uint16_t float_to_bf16(float f) {
  uint32_t x;
  memcpy(&x, &f, sizeof x);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* keep NaN a NaN */
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

float naive_load(const kallpa_tensor* t, int64_t index) {
  switch (t->dtype) {
    case KALLPA_DTYPE_F16: return half_to_float(((const uint16_t*)t->data)[index]);
    case KALLPA_DTYPE_BF16: return bf16_to_float(((const uint16_t*)t->data)[index]);
    default: return ((const float*)t->data)[index];
  }
}

void naive_store(const kallpa_tensor* t, int64_t index, float value) {
  switch (t->dtype) {
    case KALLPA_DTYPE_F16: ((uint16_t*)t->data)[index] = float_to_half(value); break;
    case KALLPA_DTYPE_BF16: ((uint16_t*)t->data)[index] = float_to_bf16(value); break;
    default: ((float*)t->data)[index] = value; break;
  }
}

int64_t naive_seqlen_q(const kallpa_problem* p, int32_t b) {
  if (p->signature->q_layout == KALLPA_Q_PACKED) return p->cu_seqlens_q[b + 1] - p->cu_seqlens_q[b];
  return p->q.shape[1];
}

int64_t naive_seqlen_k(const kallpa_problem* p, int32_t b) {
  switch (p->signature->kv_layout) {
    case KALLPA_KV_PACKED: return p->cu_seqlens_k[b + 1] - p->cu_seqlens_k[b];
    case KALLPA_KV_PAGED: return p->seqlens_k[b];
    default: return p->k.shape[1];
  }
}

/* Row offsets of token rows: dense [B, S, H, D] or packed [T, H, D]. */
static int64_t q_like_row(const kallpa_problem* p, const kallpa_tensor* t, int32_t b, int64_t i) {
  if (p->signature->q_layout == KALLPA_Q_PACKED) return (p->cu_seqlens_q[b] + i) * t->stride[0];
  return b * t->stride[0] + i * t->stride[1];
}

int64_t naive_o_row(const kallpa_problem* p, int32_t b, int64_t i) { return q_like_row(p, &p->o, b, i); }

static int64_t kv_row(const kallpa_problem* p, const kallpa_tensor* t, int32_t b, int64_t j) {
  switch (p->signature->kv_layout) {
    case KALLPA_KV_PACKED: return (p->cu_seqlens_k[b] + j) * t->stride[0];
    case KALLPA_KV_PAGED: {
      const int64_t page = t->shape[1];
      const int64_t block = p->block_table[b * p->block_table_stride + j / page];
      return block * t->stride[0] + (j % page) * t->stride[1];
    }
    default: return b * t->stride[0] + j * t->stride[1];
  }
}

static int64_t lse_index(const kallpa_problem* p, int32_t b, int64_t h, int64_t i) {
  if (p->signature->q_layout == KALLPA_Q_PACKED) return h * p->lse.stride[0] + (p->cu_seqlens_q[b] + i) * p->lse.stride[1];
  return b * p->lse.stride[0] + h * p->lse.stride[1] + i * p->lse.stride[2];
}

size_t naive_workspace_size(const kallpa_problem* p) {
  int64_t longest = 1;
  for (int32_t b = 0; b < p->batch; ++b) {
    const int64_t n = naive_seqlen_k(p, b);
    if (n > longest) longest = n;
  }
  return (size_t)longest * sizeof(double);
}

int32_t naive_attention(const kallpa_problem* p, void* workspace, size_t workspace_bytes, char* error,
                        size_t error_capacity) {
  const kallpa_signature* s = p->signature;
  if (workspace == NULL || workspace_bytes < naive_workspace_size(p)) {
    snprintf(error, error_capacity, "workspace of %zu bytes is smaller than the %zu asked for", workspace_bytes,
             naive_workspace_size(p));
    return KALLPA_PLUGIN_INVALID_ARGUMENT;
  }
  double* scores = (double*)workspace;
  const int64_t hq = s->hq, d = s->head_dim, dv = s->head_dim_v, group = s->hq / s->hkv;
  const int qr = p->q.rank, kr = p->k.rank, orank = p->o.rank;
  const int64_t q_hs = p->q.stride[qr - 2], q_ds = p->q.stride[qr - 1];
  const int64_t k_hs = p->k.stride[kr - 2], k_ds = p->k.stride[kr - 1];
  const int64_t v_hs = p->v.stride[kr - 2], v_ds = p->v.stride[kr - 1];
  const int64_t o_hs = p->o.stride[orank - 2], o_ds = p->o.stride[orank - 1];

  for (int32_t b = 0; b < p->batch; ++b) {
    const int64_t sq = naive_seqlen_q(p, b), skv = naive_seqlen_k(p, b);
    for (int64_t i = 0; i < sq; ++i) {
      const int64_t pos = i + skv - sq; /* bottom-right alignment */
      int64_t first = 0, last = skv - 1;
      if (p->causal && pos < last) last = pos;
      /* Windows go up to INT64_MAX (attention.h): compare the window with the distance instead of
         computing pos +/- window, which would overflow; a bound that cuts keeps the sum in range. */
      if (p->window_left >= 0 && p->window_left < pos - first) first = pos - p->window_left;
      if (p->window_right >= 0 && p->window_right < last - pos) last = pos + p->window_right;
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t kvh = h / group;
        const int64_t q_base = q_like_row(p, &p->q, b, i) + h * q_hs;
        const int64_t o_base = naive_o_row(p, b, i) + h * o_hs;
        double max_score = -INFINITY;
        int has_nan = 0;
        for (int64_t j = first; j <= last; ++j) {
          const int64_t k_base = kv_row(p, &p->k, b, j) + kvh * k_hs;
          double dot = 0.0;
          for (int64_t c = 0; c < d; ++c) dot += (double)naive_load(&p->q, q_base + c * q_ds) * naive_load(&p->k, k_base + c * k_ds);
          double score = (double)p->scale * dot;
          if (p->softcap > 0.0f) score = p->softcap * tanh(score / p->softcap);
          if (p->alibi_slopes) score -= (double)p->alibi_slopes[h] * (double)llabs(pos - j);
          scores[j - first] = score;
          if (isnan(score)) has_nan = 1;
          else if (score > max_score) max_score = score;
        }
        const int empty = first > last || (!has_nan && max_score == -INFINITY);
        double sum = 0.0;
        if (!empty) {
          for (int64_t j = first; j <= last; ++j) {
            scores[j - first] = exp(scores[j - first] - max_score);
            sum += scores[j - first];
          }
        }
        for (int64_t c = 0; c < dv; ++c) {
          double acc = 0.0;
          if (!empty) {
            for (int64_t j = first; j <= last; ++j) {
              const int64_t v_base = kv_row(p, &p->v, b, j) + kvh * v_hs;
              acc += scores[j - first] / sum * naive_load(&p->v, v_base + c * v_ds);
            }
          }
          naive_store(&p->o, o_base + c * o_ds, (float)acc);
        }
        if (p->lse.data != NULL) {
          ((float*)p->lse.data)[lse_index(p, b, h, i)] = empty ? -INFINITY : (float)(max_score + log(sum));
        }
      }
    }
  }
  return KALLPA_PLUGIN_OK;
}
