// cuda-flash's split-KV decode kernel on tensor cores.
#include <type_traits>

#include "backends/cuda/flash_device.cuh"
#include "backends/cuda/flash_kernels.h"

namespace kallpa::cuda {
namespace {

// ---- split-KV decode kernel on tensor cores -----------------------------------------------------
// Few query rows against many keys, a memory-bound problem. The generic kernel reads it badly:
// each lane reads a whole key row (uncoalesced) and each query head re-reads its KV head's keys.
// Here one warp owns every query row of one KV head -- (query row, head of the group)
// pairs, at most 16: the m16 of an mma tile -- over one range of keys (a split), and streams
// 16-key K/V steps through two shared-memory stages of its own with cp.async: every K/V byte is
// read once, coalesced, for the whole group, and the scores and P.V run on tensor cores as in the
// prefill kernels. Each warp writes a partial result (unnormalised output, max, sum) that
// flash_combine merges; warps synchronise only among their own lanes.

template <typename T, typename QT, int D>
__global__ void __launch_bounds__(kDecodeThreads, kDecodeBlocksPerSm) flash_decode_tc(FlashParams p) {
  constexpr int BK = kDecodeStepKeys;
  constexpr int QS = D + kTcPad;
  constexpr int CH = D / 8;
  constexpr int STEP = BK * QS;  // elements of one K or V step
  extern __shared__ __align__(16) unsigned char dec_smem[];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int split = static_cast<int>(blockIdx.x) * kDecodeWarps + warp;
  const int hk = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const SeqMeta m = p.meta[b];
  if (split >= p.num_splits || m.sq == 0) return;  // whole warp; only warp barriers follow
  T* ks = reinterpret_cast<T*>(dec_smem) + warp * 4 * STEP;  // this warp's K stages, then its V stages
  T* vs = ks + 2 * STEP;
  const QT* q = static_cast<const QT*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const int rows = m.sq * p.group;  // tile row r: query row r / group of head hk * group + r % group

  // Keys of this split that some row sees (visible ranges grow with the row).
  const std::int64_t split_first = static_cast<std::int64_t>(split) * p.keys_per_split;
  const auto lo = static_cast<std::int32_t>(max(visible_keys(p, 0, m.sq, m.skv).first, split_first));
  const auto hi = static_cast<std::int32_t>(
      min(visible_keys(p, m.sq - 1, m.sq, m.skv).last, split_first + p.keys_per_split - 1));

  std::int32_t first[2], last[2], pos[2], head[2];
  std::int64_t qrow[2];
  bool live[2];
  for (int rr = 0; rr < 2; ++rr) {
    const int r = g + rr * 8;
    live[rr] = r < rows;
    qrow[rr] = live[rr] ? r / p.group : 0;
    head[rr] = hk * p.group + (live[rr] ? r % p.group : 0);
    const KeyRange keys = visible_keys(p, qrow[rr], m.sq, m.skv);
    first[rr] = static_cast<std::int32_t>(max(keys.first, std::int64_t{lo}));
    last[rr] = live[rr] ? static_cast<std::int32_t>(min(keys.last, std::int64_t{hi})) : -1;
    pos[rr] = static_cast<std::int32_t>(qrow[rr] + m.skv - m.sq);
  }
  // A fragments of Q (rows g and g + 8), loaded once; rows past `rows` are zero; f32 q is rounded.
  std::uint32_t qf[D / 16][4];
  #pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int rr = e & 1, col = kk * 16 + t4 * 2 + (e >> 1) * 8;
      const QT* src = q + m.q + qrow[rr] * p.q_rs + head[rr] * p.q_hs + col;
      if constexpr (std::is_same_v<QT, float>) {
        qf[kk][e] = live[rr] ? pack2<T>(src[0], src[1]) : 0u;
      } else {
        qf[kk][e] = live[rr] ? lds32(src) : 0u;
      }
    }
  }
  const float slope0 = p.alibi != nullptr && live[0] ? p.alibi[head[0]] : 0.0f;
  const float slope1 = p.alibi != nullptr && live[1] ? p.alibi[head[1]] : 0.0f;

  float acc[D / 8][4];
  #pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  auto load_step = [&](int stage, std::int32_t k0) {
    T* kd = ks + stage * STEP;
    T* vd = vs + stage * STEP;
    #pragma unroll 1  // unrolled, the hoisted addresses of 8 rows stay live through the step
    for (int idx = lane; idx < BK * CH; idx += 32) {
      const int r = idx / CH, c = idx % CH;
      const std::int32_t j = k0 + r;
      const bool valid = j <= hi;
      cp_async16(kd + r * QS + c * 8, valid ? k + kv_row(p, m, b, j, false) + hk * p.k_hs + c * 8 : k, valid);
      cp_async16(vd + r * QS + c * 8, valid ? v + kv_row(p, m, b, j, true) + hk * p.v_hs + c * 8 : v, valid);
    }
    cp_async_commit();
  };
  if (lo <= hi) load_step(0, lo);
  int stage = 0;
  for (std::int32_t k0 = lo; k0 <= hi; k0 += BK, stage ^= 1) {
    if (k0 + BK <= hi) {
      load_step(stage ^ 1, k0 + BK);  // this warp finished reading that stage at the previous syncwarp
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncwarp();  // every lane's copies of this step are visible to the whole warp
    const T* kt = ks + stage * STEP;
    const T* vt = vs + stage * STEP;

    float s[2][4];
    #pragma unroll
    for (int n = 0; n < 2; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
      #pragma unroll
      for (int kk = 0; kk < D / 16; kk += 2) {
        std::uint32_t kf[4];
        ldsm_x4(kf, kt + (n * 8 + (lane & 7)) * QS + kk * 16 + (lane >> 3) * 8);
        mma_16816<T>(s[n], qf[kk], kf[0], kf[1]);
        mma_16816<T>(s[n], qf[kk + 1], kf[2], kf[3]);
      }
    }
    float tile_max[2] = {-INFINITY, -INFINITY};
    #pragma unroll
    for (int n = 0; n < 2; ++n) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rr = e / 2;
        const std::int32_t j = k0 + n * 8 + t4 * 2 + (e & 1);
        const bool seen = j >= first[rr] && j <= last[rr];
        s[n][e] = seen ? score_log2(p, s[n][e], rr == 0 ? slope0 : slope1, pos[rr], j) : -INFINITY;
        tile_max[rr] = fmaxf(tile_max[rr], s[n][e]);
      }
    }
    float base[2], alpha[2];
    bool rescale = false;
    #pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      tile_max[rr] = fmaxf(tile_max[rr], __shfl_xor_sync(kFullMask, tile_max[rr], 1));
      tile_max[rr] = fmaxf(tile_max[rr], __shfl_xor_sync(kFullMask, tile_max[rr], 2));
      const float new_max = fmaxf(row_max[rr], tile_max[rr]);
      base[rr] = new_max == -INFINITY ? 0.0f : new_max;
      alpha[rr] = exp2f(row_max[rr] - base[rr]);
      rescale = rescale || alpha[rr] != 1.0f;
      row_max[rr] = new_max;
      row_sum[rr] *= alpha[rr];
    }
    if (__any_sync(kFullMask, rescale)) scale_rows(acc, alpha[0], alpha[1]);
    #pragma unroll
    for (int n = 0; n < 2; ++n) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = exp2f(s[n][e] - base[e / 2]);
        row_sum[e / 2] += s[n][e];
      }
    }
    const std::uint32_t a[4] = {pack2<T>(s[0][0], s[0][1]), pack2<T>(s[0][2], s[0][3]), pack2<T>(s[1][0], s[1][1]),
                                pack2<T>(s[1][2], s[1][3])};
    #pragma unroll
    for (int n = 0; n < D / 8; n += 2) {
      std::uint32_t vf[4];  // keys 0..7 / 8..15 of dims n*8.. (0, 1) and (n+1)*8.. (2, 3)
      ldsm_x4_trans(vf, vt + ((lane & 7) + ((lane >> 3) & 1) * 8) * QS + (n + (lane >> 4)) * 8);
      mma_16816<T>(acc[n], a, vf[0], vf[1]);
      mma_16816<T>(acc[n + 1], a, vf[2], vf[3]);
    }
    __syncwarp();  // the whole warp is done with this stage before the next step refills it
  }

  #pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float total = row_sum[rr];
    total += __shfl_xor_sync(kFullMask, total, 1);
    total += __shfl_xor_sync(kFullMask, total, 2);
    if (!live[rr]) continue;
    const std::int64_t slot = (static_cast<std::int64_t>(split) * p.total_q + m.row0 + qrow[rr]) * p.hq + head[rr];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      p.part_o[slot * p.dv + n * 8 + t4 * 2] = acc[n][2 * rr];
      p.part_o[slot * p.dv + n * 8 + t4 * 2 + 1] = acc[n][2 * rr + 1];
    }
    if (t4 == 0) {
      p.part_m[slot] = row_max[rr];
      p.part_l[slot] = total;
    }
  }
}

}  // namespace

cudaError_t launch_flash_decode(const FlashParams& p, cudaStream_t stream) {
  const bool bf16 = p.kv_dtype == kBF16, f32_q = p.q_dtype == kF32;
  void (*kernel)(FlashParams) = nullptr;
  if (p.d == 64) {
    kernel = bf16 ? (f32_q ? flash_decode_tc<__nv_bfloat16, float, 64> : flash_decode_tc<__nv_bfloat16, __nv_bfloat16, 64>)
                  : (f32_q ? flash_decode_tc<__half, float, 64> : flash_decode_tc<__half, __half, 64>);
  } else {
    kernel = bf16 ? (f32_q ? flash_decode_tc<__nv_bfloat16, float, 128> : flash_decode_tc<__nv_bfloat16, __nv_bfloat16, 128>)
                  : (f32_q ? flash_decode_tc<__half, float, 128> : flash_decode_tc<__half, __half, 128>);
  }
  return launch_with_smem(kernel, decode_launch(p), p, stream);
}

}  // namespace kallpa::cuda
