// cuda-flash lab, generation 2: v1's inner loop waits on every tile's global loads (nothing else to
// do meanwhile but other blocks) and transposes V with 2-byte shared stores that, with its
// 72-element pitch, all land in one bank: a 16-way conflict on each. v2 keeps V row-major and takes
// its B fragments with ldmatrix.trans (the hardware transposes the 8x8 pieces), reads K with
// ldmatrix too (four fragments per instruction instead of one), and fetches tiles with cp.async
// into two stages so that tile t + 1 is in flight while tile t is multiplied. Rows outside the
// block's visible range are zero-filled by cp.async itself (source size 0). Tiles that every row of
// the lane sees whole skip the per-element mask. Same layouts and online softmax as v1 otherwise.
#include "backends/cuda/flash_device.cuh"
#include "lab.h"

namespace kallpa::cuda {
namespace {

constexpr int kBlockQ = 64;  // query rows per block, 16 per warp

template <typename T, int D>
__global__ void __launch_bounds__(kTcThreads) flash_forward_v2(FlashParams p) {
  constexpr int BQ = kBlockQ, BK = kTcBlockK;
  constexpr int QS = D + kTcPad;  // row pitch of every tile (elements): ldmatrix rows hit distinct banks
  constexpr int CH = D / 8;       // 16-byte chunks per row
  constexpr int TILE = BK * QS;   // elements of one K or V stage
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
  const std::int64_t k_first = block.first, k_last = block.last;
  auto load_tile = [&](int stage, std::int64_t k0) {
    T* kd = ks + stage * TILE;
    T* vd = vs + stage * TILE;
    for (int idx = tid; idx < BK * CH; idx += kTcThreads) {
      const int r = idx / CH, c = idx % CH;
      const std::int64_t j = k0 + r;
      const bool valid = j >= k_first && j <= k_last;
      cp_async16(kd + r * QS + c * 8, valid ? k + kv_row(p, m, b, j, false) + hk * p.k_hs + c * 8 : k, valid);
      cp_async16(vd + r * QS + c * 8, valid ? v + kv_row(p, m, b, j, true) + hk * p.v_hs + c * 8 : v, valid);
    }
    cp_async_commit();
  };
  const std::int64_t k_begin = k_first / BK * BK;
  if (k_begin <= k_last) load_tile(0, k_begin);  // in flight while Q is staged

  for (int idx = tid; idx < BQ * CH; idx += kTcThreads) {
    const int r = idx / CH, c = idx % CH;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (q0 + r < m.sq) val = *reinterpret_cast<const uint4*>(q + m.q + (q0 + r) * p.q_rs + h * p.q_hs + c * 8);
    *reinterpret_cast<uint4*>(qs + r * QS + c * 8) = val;
  }
  __syncthreads();
  const int row_a = warp * 16 + g;  // this lane's rows in the tile: row_a and row_a + 8
  std::uint32_t qf[D / 16][4];
  for (int kk = 0; kk < D / 16; ++kk) {
    const T* base = qs + row_a * QS + kk * 16 + t4 * 2;
    qf[kk][0] = lds32(base);
    qf[kk][1] = lds32(base + 8 * QS);
    qf[kk][2] = lds32(base + 8);
    qf[kk][3] = lds32(base + 8 * QS + 8);
  }

  std::int64_t row_i[2];
  KeyRange row_keys[2];
  std::int64_t row_pos[2];
  for (int rr = 0; rr < 2; ++rr) {
    row_i[rr] = q0 + row_a + rr * 8;
    row_keys[rr] = visible_keys(p, row_i[rr], m.sq, m.skv);
    row_pos[rr] = row_i[rr] + m.skv - m.sq;
  }
  const std::int64_t whole_first = max(row_keys[0].first, row_keys[1].first);
  const std::int64_t whole_last = min(row_keys[0].last, row_keys[1].last);
  const float slope = p.alibi != nullptr ? p.alibi[h] : 0.0f;

  float acc[D / 8][4];
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};  // row_sum: this lane's part

  int stage = 0;
  for (std::int64_t k0 = k_begin; k0 <= k_last; k0 += BK, stage ^= 1) {
    if (k0 + BK <= k_last) {
      load_tile(stage ^ 1, k0 + BK);  // that stage's readers finished at the previous barrier
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // this stage's tile, written by every thread's copies, is complete
    const T* kt = ks + stage * TILE;
    const T* vt = vs + stage * TILE;

    float s[BK / 8][4];
    for (int n = 0; n < BK / 8; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
      for (int kk = 0; kk < D / 16; kk += 2) {
        std::uint32_t kf[4];  // B fragments of key rows n*8.., dims kk*16.. (0, 1) and (kk+1)*16.. (2, 3)
        ldsm_x4(kf, kt + (n * 8 + (lane & 7)) * QS + kk * 16 + (lane >> 3) * 8);
        mma_16816<T>(s[n], qf[kk], kf[0], kf[1]);
        mma_16816<T>(s[n], qf[kk + 1], kf[2], kf[3]);
      }
    }

    const bool whole = k0 >= whole_first && k0 + BK - 1 <= whole_last;
    float tile_max[2] = {-INFINITY, -INFINITY};
    for (int n = 0; n < BK / 8; ++n) {
      for (int e = 0; e < 4; ++e) {
        const int rr = e / 2;
        const std::int64_t j = k0 + n * 8 + t4 * 2 + (e & 1);
        const bool seen = whole || (j >= row_keys[rr].first && j <= row_keys[rr].last);
        s[n][e] = seen ? score_log2(p, s[n][e], slope, row_pos[rr], j) : -INFINITY;
        tile_max[rr] = fmaxf(tile_max[rr], s[n][e]);
      }
    }
    float base[2];
    for (int rr = 0; rr < 2; ++rr) {
      tile_max[rr] = fmaxf(tile_max[rr], __shfl_xor_sync(kFullMask, tile_max[rr], 1));
      tile_max[rr] = fmaxf(tile_max[rr], __shfl_xor_sync(kFullMask, tile_max[rr], 2));
      const float new_max = fmaxf(row_max[rr], tile_max[rr]);
      base[rr] = new_max == -INFINITY ? 0.0f : new_max;
      const float alpha = exp2f(row_max[rr] - base[rr]);
      row_max[rr] = new_max;
      row_sum[rr] *= alpha;
      for (int n = 0; n < D / 8; ++n) {
        acc[n][2 * rr] *= alpha;
        acc[n][2 * rr + 1] *= alpha;
      }
    }
    for (int n = 0; n < BK / 8; ++n) {
      for (int e = 0; e < 4; ++e) {
        s[n][e] = exp2f(s[n][e] - base[e / 2]);
        row_sum[e / 2] += s[n][e];
      }
    }

    for (int kk = 0; kk < BK / 16; ++kk) {
      const std::uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                  pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                  pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      for (int n = 0; n < D / 8; n += 2) {
        std::uint32_t vf[4];  // keys kk*16 + 0..7 / 8..15 of dims n*8.. (0, 1) and (n+1)*8.. (2, 3)
        ldsm_x4_trans(vf, vt + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * QS + (n + (lane >> 4)) * 8);
        mma_16816<T>(acc[n], a, vf[0], vf[1]);
        mma_16816<T>(acc[n + 1], a, vf[2], vf[3]);
      }
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
  }

  T* o = static_cast<T*>(p.o);
  for (int rr = 0; rr < 2; ++rr) {
    float total = row_sum[rr];
    total += __shfl_xor_sync(kFullMask, total, 1);
    total += __shfl_xor_sync(kFullMask, total, 2);
    if (row_i[rr] >= m.sq) continue;
    const std::int64_t o_off = m.o + row_i[rr] * p.o_rs + h * p.o_hs;
    for (int n = 0; n < D / 8; ++n) {
      for (int e = 0; e < 2; ++e) {
        const float val = total == 0.0f ? 0.0f : acc[n][2 * rr + e] / total;
        o[o_off + n * 8 + t4 * 2 + e] = static_cast<T>(val);
      }
    }
    if (p.lse != nullptr && t4 == 0) {
      p.lse[m.lse + h * p.lse_hs + row_i[rr] * p.lse_is] =
          total == 0.0f ? -INFINITY : (row_max[rr] + log2f(total)) * kLn2;
    }
  }
}

LaunchShape launch_shape(const FlashParams& p) {
  const auto d = static_cast<std::size_t>(p.d);
  LaunchShape s;
  s.grid[0] = static_cast<unsigned>((p.max_sq + kBlockQ - 1) / kBlockQ);
  s.grid[1] = static_cast<unsigned>(p.hq);
  s.grid[2] = static_cast<unsigned>(p.batch);
  s.block = kTcThreads;
  // 2-byte elements: Q, and K and V row-major in two stages each, rows padded.
  s.smem_bytes = 2 * (kBlockQ * (d + kTcPad) + 4 * kTcBlockK * (d + kTcPad));
  return s;
}

cudaError_t launch(const FlashParams& p, cudaStream_t stream) {
  auto* kernel = p.d == 64 ? flash_forward_v2<__half, 64> : flash_forward_v2<__nv_bfloat16, 128>;
  return launch_with_smem(kernel, launch_shape(p), p, stream);
}

}  // namespace
}  // namespace kallpa::cuda

int main() {
  return kallpa::lab::run({"v2", "cp.async double buffering, ldmatrix (V row-major, ldmatrix.trans)",
                           kallpa::cuda::launch, false});
}
