// cuda-flash lab, generation 1: FlashAttention-2's forward on mma.sync m16n8k16, the plainest form.
// A block of 4 warps owns 64 query rows of one (sequence, head); each warp owns 16 of them and
// keeps their scores, running max/sum and output in registers in the mma.m16n8k16 accumulator
// layout (PTX ISA, "Matrix Fragments for mma.m16n8k16"): lane = 4g + t holds rows g and g + 8,
// columns 2t and 2t + 1 of each 8-column tile. The score accumulators of two adjacent 8-key tiles
// are exactly the A operand of P.V for 16 keys, so P never leaves registers. K tiles are staged
// row-major and V tiles transposed in shared memory by synchronous loads, so every operand
// register is one aligned 32-bit shared load. General softmax (score_log2(), exp2f).
#include "backends/cuda/flash_device.cuh"
#include "lab.h"

namespace kallpa::cuda {
namespace {

constexpr int kBlockQ = 64;  // query rows per block, 16 per warp

template <typename T, int D>
__global__ void __launch_bounds__(kTcThreads) flash_forward_v1(FlashParams p) {
  constexpr int BQ = kBlockQ, BK = kTcBlockK;
  constexpr int QS = D + kTcPad;   // row pitch of the Q and K tiles (elements)
  constexpr int VS = BK + kTcPad;  // row pitch of the transposed V tile
  constexpr int CH = D / 8;        // 16-byte chunks per row
  extern __shared__ __align__(16) unsigned char tc_smem[];
  T* qs = reinterpret_cast<T*>(tc_smem);
  T* ks = qs + BQ * QS;
  T* vt = ks + BK * QS;

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

  const KeyRange block = block_keys(p, m, q0, BQ);
  const std::int64_t k_first = block.first, k_last = block.last;
  std::int64_t row_i[2];
  KeyRange row_keys[2];
  std::int64_t row_pos[2];
  for (int rr = 0; rr < 2; ++rr) {
    row_i[rr] = q0 + row_a + rr * 8;
    row_keys[rr] = visible_keys(p, row_i[rr], m.sq, m.skv);
    row_pos[rr] = row_i[rr] + m.skv - m.sq;
  }
  const float slope = p.alibi != nullptr ? p.alibi[h] : 0.0f;

  float acc[D / 8][4];
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};  // row_sum: this lane's part

  for (std::int64_t k0 = k_first / BK * BK; k0 <= k_last; k0 += BK) {
    __syncthreads();  // the previous tile's readers are done
    for (int idx = tid; idx < BK * CH; idx += kTcThreads) {
      const int r = idx / CH, c = idx % CH;
      const std::int64_t j = k0 + r;
      uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
      if (j >= k_first && j <= k_last) {
        kv = *reinterpret_cast<const uint4*>(k + kv_row(p, m, b, j, false) + hk * p.k_hs + c * 8);
        vv = *reinterpret_cast<const uint4*>(v + kv_row(p, m, b, j, true) + hk * p.v_hs + c * 8);
      }
      *reinterpret_cast<uint4*>(ks + r * QS + c * 8) = kv;
      const T* ve = reinterpret_cast<const T*>(&vv);
      for (int e = 0; e < 8; ++e) vt[(c * 8 + e) * VS + r] = ve[e];
    }
    __syncthreads();

    float s[BK / 8][4];
    for (int n = 0; n < BK / 8; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
      const T* kb = ks + (n * 8 + g) * QS + t4 * 2;
      for (int kk = 0; kk < D / 16; ++kk) mma_16816<T>(s[n], qf[kk], lds32(kb + kk * 16), lds32(kb + kk * 16 + 8));
    }

    float tile_max[2] = {-INFINITY, -INFINITY};
    for (int n = 0; n < BK / 8; ++n) {
      for (int e = 0; e < 4; ++e) {
        const int rr = e / 2;
        const std::int64_t j = k0 + n * 8 + t4 * 2 + (e & 1);
        const bool seen = j >= row_keys[rr].first && j <= row_keys[rr].last;
        s[n][e] = seen ? score_log2(p, s[n][e], slope, row_pos[rr], j) : -INFINITY;
        tile_max[rr] = fmaxf(tile_max[rr], s[n][e]);
      }
    }
    float base[2];
    for (int rr = 0; rr < 2; ++rr) {
      // The four lanes of a quad hold one row between them.
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
      for (int n = 0; n < D / 8; ++n) {
        const T* vb = vt + (n * 8 + g) * VS + kk * 16 + t4 * 2;
        mma_16816<T>(acc[n], a, lds32(vb), lds32(vb + 8));
      }
    }
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
  // 2-byte elements: Q and K tiles row-major, V transposed (D rows of 64 + 8 keys).
  s.smem_bytes = 2 * (kBlockQ * (d + kTcPad) + kTcBlockK * (d + kTcPad) + d * (kTcBlockK + kTcPad));
  return s;
}

cudaError_t launch(const FlashParams& p, cudaStream_t stream) {
  auto* kernel = p.d == 64 ? flash_forward_v1<__half, 64> : flash_forward_v1<__nv_bfloat16, 128>;
  return launch_with_smem(kernel, launch_shape(p), p, stream);
}

}  // namespace
}  // namespace kallpa::cuda

int main() {
  return kallpa::lab::run({"v1", "mma.sync m16n8k16, synchronous loads, V transposed by scalar stores",
                           kallpa::cuda::launch, false});
}
