// cuda-flash's prefill kernel on mma.sync (m16n8k16, f32 accumulation, sm_80 and later): what runs
// on tensor cores wherever the Hopper kernel (forward_wgmma.cu) does not apply -- other devices,
// softcap, ALiBi, a non-positive scale (choose_kernel(), flash_plan.h).
#include "backends/cuda/flash_device.cuh"
#include "backends/cuda/flash_kernels.h"

namespace kallpa::cuda {
namespace {

// FlashAttention-2's forward: a block of 4 warps owns 128 query rows of one (sequence, head), each
// warp 32 of them as two 16-row slices, and keeps their scores, running max/sum and output in
// registers in the mma.m16n8k16 accumulator layout (PTX ISA, "Matrix Fragments for
// mma.m16n8k16"): lane = 4g + t holds rows g and g + 8, columns 2t and 2t + 1 of each 8-column
// tile. The score accumulators of two adjacent 8-key tiles are exactly the A operand of P.V for 16
// keys, so P never leaves registers. Every K or V fragment a warp reads from shared memory
// (ldmatrix; ldmatrix.trans for V, kept row-major) feeds both slices' mma. K/V tiles of 64 keys
// stream through two stages by cp.async, tile t + 1 in flight while tile t is multiplied; rows
// outside the block's visible range are zero-filled by cp.async itself (source size 0). Q's
// fragments do not fit in registers beside the accumulators, so they are re-read from shared
// memory for each tile. Key positions are int32 (a sequence has at most 2^31 - 1 keys).
//
// Plain (no softcap or ALiBi) scores with one multiply. Lean (Plain and a positive scale) takes
// the maximum of raw scores, folds the scale into the exponent's FFMA and runs max and sum as four
// independent chains per row, which frees the registers to score a whole 64-key tile at once; the
// general softmax scores it in two 32-key halves at D 128 (two 64-key score slices beside the 128
// output accumulators would spill).

template <typename T, int D, bool Plain, bool Lean>
__global__ void __launch_bounds__(kTcThreads) flash_forward_tensor_core(FlashParams p) {
  constexpr int BQ = kTcBlockQ, BK = kTcBlockK;
  constexpr int QS = D + kTcPad;
  constexpr int CH = D / 8;
  constexpr int TILE = BK * QS;
  // Keys scored at a time: a whole tile, or half of one (see above).
  constexpr int SUB = Lean || D <= 64 ? BK : BK / 2;
  static_assert(BK % SUB == 0 && SUB % 16 == 0);
  extern __shared__ __align__(16) unsigned char tc_smem[];
  T* qs = reinterpret_cast<T*>(tc_smem);
  T* ks = qs + BQ * QS;  // stages 0 and 1
  T* vs = ks + 2 * TILE;

  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int b = static_cast<int>(blockIdx.z), h = static_cast<int>(blockIdx.y);
  const SeqMeta m = p.meta[b];
  const std::int64_t q0 = block_first_row(BQ);
  if (q0 >= m.sq) return;  // uniform over the block
  const int hk = h / p.group;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  const KeyRange block = block_keys(p, m, q0, BQ);
  const auto k_first = static_cast<std::int32_t>(block.first), k_last = static_cast<std::int32_t>(block.last);
  for (int idx = tid; idx < BQ * CH; idx += kTcThreads) {
    const int r = idx / CH, c = idx % CH;
    const bool valid = q0 + r < m.sq;
    cp_async16(qs + r * QS + c * 8, valid ? q + m.q + (q0 + r) * p.q_rs + h * p.q_hs + c * 8 : q, valid);
  }
  cp_async_commit();
  auto load_tile = [&](int stage, std::int32_t k0) {
    T* kd = ks + stage * TILE;
    T* vd = vs + stage * TILE;
    #pragma unroll 1  // unrolled, its hoisted addresses stay live through the tile and spill
    for (int idx = tid; idx < BK * CH; idx += kTcThreads) {
      const int r = idx / CH, c = idx % CH;
      const std::int32_t j = k0 + r;
      const bool valid = j >= k_first && j <= k_last;
      cp_async16(kd + r * QS + c * 8, valid ? k + kv_row(p, m, b, j, false) + hk * p.k_hs + c * 8 : k, valid);
      cp_async16(vd + r * QS + c * 8, valid ? v + kv_row(p, m, b, j, true) + hk * p.v_hs + c * 8 : v, valid);
    }
    cp_async_commit();
  };
  const std::int32_t k_begin = k_first / BK * BK;
  if (k_begin <= k_last) load_tile(0, k_begin);

  const int row_w = warp * 32;  // the warp's first row in the block; slice sl holds rows row_w + 16 sl ..
  std::int32_t first[2][2], last[2][2], pos[2][2];  // [slice][rr]: rows g and g + 8 of the slice
  std::int32_t whole_first = 0, whole_last = m.skv - 1;
  #pragma unroll
  for (int sl = 0; sl < 2; ++sl) {
    #pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const std::int64_t i = q0 + row_w + sl * 16 + rr * 8 + g;
      const KeyRange keys = visible_keys(p, i, m.sq, m.skv);
      first[sl][rr] = static_cast<std::int32_t>(keys.first);
      last[sl][rr] = static_cast<std::int32_t>(max(keys.last, std::int64_t{-1}));
      pos[sl][rr] = static_cast<std::int32_t>(i + m.skv - m.sq);
      whole_first = max(whole_first, first[sl][rr]);
      whole_last = min(whole_last, last[sl][rr]);
    }
  }
  const float slope = p.alibi != nullptr ? p.alibi[h] : 0.0f;
  const float scale_log2 = p.scale * kLog2e;

  float acc[2][D / 8][4];
  #pragma unroll
  for (int sl = 0; sl < 2; ++sl) {
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[sl][n][0] = acc[sl][n][1] = acc[sl][n][2] = acc[sl][n][3] = 0.0f;
  }
  float row_max[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};
  float row_sum[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};  // this lane's part

  int stage = 0;
  for (std::int32_t k0 = k_begin; k0 <= k_last; k0 += BK, stage ^= 1) {
    if (k0 + BK <= k_last) {
      load_tile(stage ^ 1, k0 + BK);  // that stage's readers finished at the previous barrier
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // this stage's tile (and, the first time, Q) is complete
    const T* kt = ks + stage * TILE;
    const T* vt = vs + stage * TILE;
    #pragma unroll 1
    for (int sub = 0; sub < BK; sub += SUB) {

    float s[2][SUB / 8][4];
    #pragma unroll
    for (int sl = 0; sl < 2; ++sl) {
      #pragma unroll
      for (int n = 0; n < SUB / 8; ++n) s[sl][n][0] = s[sl][n][1] = s[sl][n][2] = s[sl][n][3] = 0.0f;
    }
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      std::uint32_t qa[2][4];  // A fragments of both slices: rows +0..7 / +8..15, dims kk*16 +0 / +8
      #pragma unroll
      for (int sl = 0; sl < 2; ++sl) {
        ldsm_x4(qa[sl], qs + (row_w + sl * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * QS + kk * 16 + (lane >> 4) * 8);
      }
      #pragma unroll
      for (int n = 0; n < SUB / 8; n += 2) {
        std::uint32_t kf[4];  // B fragments of key rows n*8.. (0, 1) and (n+1)*8.. (2, 3), dims kk*16 +0 / +8
        ldsm_x4(kf, kt + (sub + (n + (lane >> 4)) * 8 + (lane & 7)) * QS + kk * 16 + ((lane >> 3) & 1) * 8);
        #pragma unroll
        for (int sl = 0; sl < 2; ++sl) {
          mma_16816<T>(s[sl][n], qa[sl], kf[0], kf[1]);
          mma_16816<T>(s[sl][n + 1], qa[sl], kf[2], kf[3]);
        }
      }
    }

    const bool whole = k0 + sub >= whole_first && k0 + sub + SUB - 1 <= whole_last;
    float tile_max[2][2];
    if constexpr (Lean) {
      // Raw scores: the maximum is taken before scaling (scale > 0 keeps the order) and the scale
      // folds into the exponent's FFMA; max and sum run as four independent chains per row.
      if (!__all_sync(kFullMask, whole)) {
        #pragma unroll
        for (int sl = 0; sl < 2; ++sl) {
          #pragma unroll
          for (int n = 0; n < SUB / 8; ++n) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
              const std::int32_t j = k0 + sub + n * 8 + t4 * 2 + (e & 1);
              if (j < first[sl][e / 2] || j > last[sl][e / 2]) s[sl][n][e] = -INFINITY;
            }
          }
        }
      }
      float chain[2][2][4];
      #pragma unroll
      for (int sl = 0; sl < 2; ++sl) {
        #pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          #pragma unroll
          for (int c = 0; c < 4; ++c) chain[sl][rr][c] = -INFINITY;
        }
        #pragma unroll
        for (int n = 0; n < SUB / 8; ++n) {
          #pragma unroll
          for (int e = 0; e < 4; ++e) {
            float& m = chain[sl][e / 2][(n & 1) * 2 + (e & 1)];
            m = fmaxf(m, s[sl][n][e]);
          }
        }
        #pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          tile_max[sl][rr] = fmaxf(fmaxf(chain[sl][rr][0], chain[sl][rr][1]), fmaxf(chain[sl][rr][2], chain[sl][rr][3]));
        }
      }
    } else {
      #pragma unroll
      for (int sl = 0; sl < 2; ++sl) {
        tile_max[sl][0] = tile_max[sl][1] = -INFINITY;
        #pragma unroll
        for (int n = 0; n < SUB / 8; ++n) {
          #pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int rr = e / 2;
            const std::int32_t j = k0 + sub + n * 8 + t4 * 2 + (e & 1);
            const bool seen = whole || (j >= first[sl][rr] && j <= last[sl][rr]);
            float x;
            if constexpr (Plain) {
              x = s[sl][n][e] * scale_log2;
            } else {
              x = score_log2(p, s[sl][n][e], slope, pos[sl][rr], j);
            }
            s[sl][n][e] = seen ? x : -INFINITY;
            tile_max[sl][rr] = fmaxf(tile_max[sl][rr], s[sl][n][e]);
          }
        }
      }
    }

    // The rows' new maxima (Lean: raw units; else log2 units), the factor alpha for what they
    // summed so far, and the exponent's offset base.
    float base[2][2], alpha[2][2];
    bool rescale = false;
    #pragma unroll
    for (int sl = 0; sl < 2; ++sl) {
      #pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        float tmax = tile_max[sl][rr];
        tmax = fmaxf(tmax, __shfl_xor_sync(kFullMask, tmax, 1));
        tmax = fmaxf(tmax, __shfl_xor_sync(kFullMask, tmax, 2));
        const float new_max = fmaxf(row_max[sl][rr], tmax);
        if constexpr (Lean) {
          base[sl][rr] = new_max == -INFINITY ? 0.0f : new_max * scale_log2;
          alpha[sl][rr] = fast_exp2(fmaf(row_max[sl][rr], scale_log2, -base[sl][rr]));
        } else {
          base[sl][rr] = new_max == -INFINITY ? 0.0f : new_max;
          alpha[sl][rr] = exp2f(row_max[sl][rr] - base[sl][rr]);
        }
        rescale = rescale || alpha[sl][rr] != 1.0f;
        row_max[sl][rr] = new_max;
        row_sum[sl][rr] *= alpha[sl][rr];
      }
    }
    // Past the first tiles a row's maximum rarely moves: skip the 128 multiplies by exactly 1.
    if (__any_sync(kFullMask, rescale)) {
      scale_rows(acc[0], alpha[0][0], alpha[0][1]);
      scale_rows(acc[1], alpha[1][0], alpha[1][1]);
    }

    #pragma unroll
    for (int sl = 0; sl < 2; ++sl) {
      float sum[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
      #pragma unroll
      for (int n = 0; n < SUB / 8; ++n) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          if constexpr (Lean) {
            s[sl][n][e] = fast_exp2(fmaf(s[sl][n][e], scale_log2, -base[sl][e / 2]));
            sum[e / 2][e & 1] += s[sl][n][e];
          } else {
            s[sl][n][e] = exp2f(s[sl][n][e] - base[sl][e / 2]);
            row_sum[sl][e / 2] += s[sl][n][e];
          }
        }
      }
      if constexpr (Lean) {
        row_sum[sl][0] += sum[0][0] + sum[0][1];
        row_sum[sl][1] += sum[1][0] + sum[1][1];
      }
    }

    #pragma unroll
    for (int kk = 0; kk < SUB / 16; ++kk) {
      std::uint32_t a[2][4];
      #pragma unroll
      for (int sl = 0; sl < 2; ++sl) {
        a[sl][0] = pack2<T>(s[sl][2 * kk][0], s[sl][2 * kk][1]);
        a[sl][1] = pack2<T>(s[sl][2 * kk][2], s[sl][2 * kk][3]);
        a[sl][2] = pack2<T>(s[sl][2 * kk + 1][0], s[sl][2 * kk + 1][1]);
        a[sl][3] = pack2<T>(s[sl][2 * kk + 1][2], s[sl][2 * kk + 1][3]);
      }
      #pragma unroll
      for (int n = 0; n < D / 8; n += 2) {
        std::uint32_t vf[4];  // keys kk*16 + 0..7 / 8..15 of dims n*8.. (0, 1) and (n+1)*8.. (2, 3)
        ldsm_x4_trans(vf, vt + (sub + kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * QS + (n + (lane >> 4)) * 8);
        #pragma unroll
        for (int sl = 0; sl < 2; ++sl) {
          mma_16816<T>(acc[sl][n], a[sl], vf[0], vf[1]);
          mma_16816<T>(acc[sl][n + 1], a[sl], vf[2], vf[3]);
        }
      }
    }
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
  }
  cp_async_wait<0>();  // a block whose rows see no key still has Q's copy in flight

  T* o = static_cast<T*>(p.o);
  #pragma unroll
  for (int sl = 0; sl < 2; ++sl) {
    #pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float total = row_sum[sl][rr];
      total += __shfl_xor_sync(kFullMask, total, 1);
      total += __shfl_xor_sync(kFullMask, total, 2);
      const std::int64_t i = q0 + row_w + sl * 16 + rr * 8 + g;
      if (i >= m.sq) continue;
      const std::int64_t o_off = m.o + i * p.o_rs + h * p.o_hs;
      #pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float val = total == 0.0f ? 0.0f : acc[sl][n][2 * rr + e] / total;
          o[o_off + n * 8 + t4 * 2 + e] = static_cast<T>(val);
        }
      }
      if (p.lse != nullptr && t4 == 0) {
        const float max_log2 = Lean ? row_max[sl][rr] * scale_log2 : row_max[sl][rr];
        p.lse[m.lse + h * p.lse_hs + i * p.lse_is] = total == 0.0f ? -INFINITY : (max_log2 + log2f(total)) * kLn2;
      }
    }
  }
}

// Softcap, ALiBi or a non-positive scale take the general softmax.
template <typename T, int D>
auto* pick_kernel(const FlashParams& p) {
  const bool plain = p.softcap <= 0.0f && p.alibi == nullptr;
  const bool lean = plain && p.scale > 0.0f;
  return lean    ? flash_forward_tensor_core<T, D, true, true>
         : plain ? flash_forward_tensor_core<T, D, true, false>
                 : flash_forward_tensor_core<T, D, false, false>;
}

}  // namespace

cudaError_t launch_forward_tensor_core(const FlashParams& p, cudaStream_t stream) {
  const bool bf16 = p.q_dtype == kBF16;
  auto* kernel = p.d == 64 ? (bf16 ? pick_kernel<__nv_bfloat16, 64>(p) : pick_kernel<__half, 64>(p))
                           : (bf16 ? pick_kernel<__nv_bfloat16, 128>(p) : pick_kernel<__half, 128>(p));
  return launch_with_smem(kernel, tensor_core_launch(p), p, stream);
}

}  // namespace kallpa::cuda
