// cuda-flash lab: the kernel of generations 6, 7 and 8 (forward_v6.cu, forward_v7.cu,
// forward_v8.cu), one template: the FlashAttention-2 algorithm on Hopper's wgmma
// (src/backends/cuda/flash_wgmma.cuh), sm_90a only. mma.sync kernels stall each warp on its own
// mma results and fragment loads; wgmma multiplies a 64-row tile per warpgroup straight from
// shared memory and runs asynchronously, so the softmax can proceed while the tensor cores work.
// - A block is two warpgroups, 128 query rows (64 each) against 128-key tiles of K and V, which
//   stream through two shared-memory stages by cp.async (every thread loads; no producer warps).
// - v6 (Overlap and FastLoads off): per tile, S = Q K^T, softmax, O += P V, each waited for in turn.
// - v7 (Overlap): the products overlapped (FlashAttention-3's intra-warpgroup pipelining): S for
//   tile j and O += P V for tile j - 1 are issued together, and tile j's softmax runs while the
//   second product is still on the tensor cores; O's rescale for tile j waits for it.
// - v8 (Overlap and FastLoads): v7 with the loads' address arithmetic hoisted out of the tile loop.
// v6 with FastLoads is production's forward_wgmma.cu. Lean softmax only.
#pragma once

#include "backends/cuda/flash_device.cuh"
#include "backends/cuda/flash_wgmma.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KALLPA_LAB_WGMMA_BODY 1
#else
#define KALLPA_LAB_WGMMA_BODY 0
#endif

namespace kallpa::cuda {

template <typename T, int D, bool Overlap, bool FastLoads>
__global__ void __launch_bounds__(kWgmmaThreads, 1) flash_forward_v6(FlashParams p) {
#if KALLPA_LAB_WGMMA_BODY
  constexpr int BQ = kWgmmaBlockQ, BK = kWgmmaBlockK, CH = D / 8;
  constexpr std::uint32_t kQBytes = BQ * D * 2, kTileBytes = BK * D * 2;
  extern __shared__ __align__(1024) unsigned char wg_smem[];
  // Swizzle atoms must start on 1024-byte boundaries; the launcher allocates 1 KiB of slack.
  const std::uint32_t raw = smem_addr(wg_smem);
  const std::uint32_t pad = (1024u - raw % 1024u) % 1024u;
  unsigned char* const q_tile = wg_smem + pad;
  unsigned char* const k_tiles = q_tile + kQBytes;  // K stages 0 and 1, then V stages 0 and 1
  const std::uint32_t q_addr = raw + pad, k_addr = q_addr + kQBytes, v_addr = k_addr + 2 * kTileBytes;

  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int group = warp / 4;  // warpgroup: query rows 64 group ..
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
  for (int idx = tid; idx < BQ * CH; idx += kWgmmaThreads) {
    const int r = idx / CH, c = idx % CH;
    const bool valid = q0 + r < m.sq;
    cp_async16(q_tile + swizzled_chunk(BQ, r, c), valid ? q + m.q + (q0 + r) * p.q_rs + h * p.q_hs + c * 8 : q, valid);
  }
  // Rows outside the block's visible keys are zero-filled: their weight is 0, and 0 * NaN is NaN.
  auto load_rows = [&](unsigned char* dst, const T* src, bool is_v, std::int64_t head_stride, std::int32_t k0) {
    #pragma unroll 1
    for (int idx = tid; idx < BK * CH; idx += kWgmmaThreads) {
      const int r = idx / CH, c = idx % CH;
      const std::int32_t j = k0 + r;
      const bool valid = j >= k_first && j <= k_last;
      cp_async16(dst + swizzled_chunk(BK, r, c), valid ? src + kv_row(p, m, b, j, is_v) + hk * head_stride + c * 8 : src,
                 valid);
    }
  };
  // FastLoads (v8): a thread copies the same 16-byte chunk of rows lrow, lrow + kRowsPerPass,
  // ... of every tile, so its shared-memory offsets are constants (the swizzle depends on the row
  // mod 8, and kRowsPerPass is a multiple of 8) and its global address moves by one stride per
  // copy, where load_rows() recomputes row, validity, kv_row() and the swizzle for each. Tiles that
  // are whole, visible and unpaged only; the others take load_rows().
  constexpr int kRowsPerPass = kWgmmaThreads / CH;
  static_assert(kRowsPerPass % 8 == 0 && BK % kRowsPerPass == 0);
  const int lrow = tid / CH, lchunk = tid % CH;
  const std::uint32_t lane_offset = swizzled_chunk(BK, lrow, lchunk);
  auto load_fast = [&](std::uint32_t dst, const T* src, std::int64_t row_stride) {
    #pragma unroll
    for (int pass = 0; pass < BK / kRowsPerPass; ++pass) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + pass * kRowsPerPass * 128), "l"(src)
                   : "memory");
      src += kRowsPerPass * row_stride;
    }
  };
  auto fast_tile = [&](std::int32_t k0) { return FastLoads && !p.paged && k0 >= k_first && k0 + BK - 1 <= k_last; };
  // The K (is_v false) or V tile of keys k0 .. k0 + BK - 1 into `stage`.
  auto load_tile = [&](bool is_v, int stage, std::int32_t k0) {
    const std::uint32_t tile = (is_v ? 2 + stage : stage) * kTileBytes;  // from the first K stage
    const T* src = is_v ? v : k;
    const std::int64_t head_stride = is_v ? p.v_hs : p.k_hs;
    if (fast_tile(k0)) {
      const std::int64_t row_stride = is_v ? p.v_rs : p.k_rs;
      load_fast(k_addr + tile + lane_offset,
                src + (is_v ? m.v : m.k) + hk * head_stride + lchunk * 8 + (lrow + k0) * row_stride, row_stride);
    } else {
      load_rows(k_tiles + tile, src, is_v, head_stride, k0);
    }
  };
  auto load_k = [&](int stage, std::int32_t k0) { load_tile(false, stage, k0); };
  auto load_v = [&](int stage, std::int32_t k0) { load_tile(true, stage, k0); };

  const std::int32_t k_begin = k_first / BK * BK;
  const int tiles = k_begin <= k_last ? (k_last - k_begin) / BK + 1 : 0;

  const int row_b = group * 64 + (warp % 4) * 16 + g;  // this lane's rows in the block: row_b, row_b + 8
  std::int32_t first[2], last[2];
  std::int32_t whole_first = 0, whole_last = m.skv - 1;
  #pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const KeyRange keys = visible_keys(p, q0 + row_b + rr * 8, m.sq, m.skv);
    first[rr] = static_cast<std::int32_t>(keys.first);
    last[rr] = static_cast<std::int32_t>(max(keys.last, std::int64_t{-1}));
    whole_first = max(whole_first, first[rr]);
    whole_last = min(whole_last, last[rr]);
  }
  const float scale_log2 = p.scale * kLog2e;

  float o[D / 2];
  #pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY};  // raw scores (the scale folds into the exponent)
  float row_sum[2] = {0.0f, 0.0f};            // this lane's part
  float s[BK / 2];                            // scores of the current tile
  std::uint32_t pr[BK / 16][4];               // its probabilities: the A fragments of O += P V

  // S = Q K^T for the K tile in `stage`: D / 16 instructions of 16 dims each.
  auto issue_scores = [&](int stage) {
    const std::uint32_t q_base = q_addr + group * 64 * 128, k_base = k_addr + stage * kTileBytes;
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const std::uint32_t panel_q = (kk / 4) * (BQ * 128), panel_k = (kk / 4) * (BK * 128), col = (kk % 4) * 32;
      const std::uint64_t a = sw128_desc(q_base + panel_q + col, 16, 1024);
      const std::uint64_t bk = sw128_desc(k_base + panel_k + col, 16, 1024);
      if (kk == 0) {
        wgmma_ss_n128<T, false>(s, a, bk);
      } else {
        wgmma_ss_n128<T, true>(s, a, bk);
      }
    }
  };
  // O += P V for the V tile in `stage`: BK / 16 instructions of 16 keys each.
  auto issue_values = [&](int stage, const std::uint32_t (&prob)[BK / 16][4]) {
    const std::uint32_t v_base = v_addr + stage * kTileBytes;
    #pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      wgmma_rs<T, D>(o, prob[kk], sw128_desc(v_base + kk * 16 * 128, BK * 128, 1024));
    }
  };
  // The online softmax of tile k0's scores (the lean form): new row maxima, the factor alpha for
  // what the rows summed so far, the probabilities rounded into `prob`.
  auto softmax = [&](std::int32_t k0, std::uint32_t (&prob)[BK / 16][4], float (&alpha)[2]) {
    const bool whole = k0 >= whole_first && k0 + BK - 1 <= whole_last;
    if (!__all_sync(kFullMask, whole)) {
      #pragma unroll
      for (int n = 0; n < BK / 8; ++n) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const std::int32_t j = k0 + n * 8 + t4 * 2 + (e & 1);
          if (j < first[e / 2] || j > last[e / 2]) s[4 * n + e] = -INFINITY;
        }
      }
    }
    float chain[2][4];
    #pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      #pragma unroll
      for (int c = 0; c < 4; ++c) chain[rr][c] = -INFINITY;
    }
    #pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& mx = chain[e / 2][(n & 1) * 2 + (e & 1)];
        mx = fmaxf(mx, s[4 * n + e]);
      }
    }
    float base[2];
    #pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float tmax = fmaxf(fmaxf(chain[rr][0], chain[rr][1]), fmaxf(chain[rr][2], chain[rr][3]));
      tmax = fmaxf(tmax, __shfl_xor_sync(kFullMask, tmax, 1));
      tmax = fmaxf(tmax, __shfl_xor_sync(kFullMask, tmax, 2));
      const float new_max = fmaxf(row_max[rr], tmax);
      base[rr] = new_max == -INFINITY ? 0.0f : new_max * scale_log2;
      alpha[rr] = fast_exp2(fmaf(row_max[rr], scale_log2, -base[rr]));
      row_max[rr] = new_max;
      row_sum[rr] *= alpha[rr];
    }
    float sum[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
    #pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[4 * n + e] = fast_exp2(fmaf(s[4 * n + e], scale_log2, -base[e / 2]));
        sum[e / 2][e & 1] += s[4 * n + e];
      }
    }
    row_sum[0] += sum[0][0] + sum[0][1];
    row_sum[1] += sum[1][0] + sum[1][1];
    #pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      prob[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
      prob[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      prob[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      prob[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };
  // Past the first tiles a row's maximum rarely moves: skip the multiplies by exactly 1.
  auto rescale = [&](const float (&alpha)[2]) {
    if (__any_sync(kFullMask, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
      #pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[4 * n + 0] *= alpha[0];
        o[4 * n + 1] *= alpha[0];
        o[4 * n + 2] *= alpha[1];
        o[4 * n + 3] *= alpha[1];
      }
    }
  };

  // cp.async groups, in commit order: Q with K tile 0, V tile 0, then per tile one K and one V
  // group (empty past the last tile), so that every wait below counts the same.
  if (tiles > 0) load_k(0, k_begin);
  cp_async_commit();
  if (tiles > 0) load_v(0, k_begin);
  cp_async_commit();
  float alpha[2];
  if constexpr (!Overlap) {
    for (int t = 0; t < tiles; ++t) {
      const int stage = t & 1;
      const std::int32_t k0 = k_begin + t * BK;
      cp_async_wait<1>();  // K tile t (and Q); V tile t may still be in flight
      fence_async_shared();
      __syncthreads();  // ... for every thread; and every warpgroup is done with tile t - 1
      wgmma_fence();
      issue_scores(stage);
      wgmma_commit();
      // The next tile's loads are issued while the tensor cores work.
      if (t + 1 < tiles) load_k(stage ^ 1, k0 + BK);
      cp_async_commit();
      if (t + 1 < tiles) load_v(stage ^ 1, k0 + BK);
      cp_async_commit();
      wgmma_wait<0>();
      pin_registers(s);
      softmax(k0, pr, alpha);
      rescale(alpha);

      cp_async_wait<2>();  // V tile t
      fence_async_shared();
      __syncthreads();
      wgmma_fence();
      issue_values(stage, pr);
      wgmma_commit();
      wgmma_wait<0>();
      pin_registers(o);
    }
  } else if (tiles > 0) {
    cp_async_wait<1>();  // Q and K tile 0
    fence_async_shared();
    __syncthreads();
    if (tiles > 1) load_k(1, k_begin + BK);
    cp_async_commit();
    wgmma_fence();
    issue_scores(0);
    wgmma_commit();
    wgmma_wait<0>();
    pin_registers(s);
    softmax(k_begin, pr, alpha);  // O is still 0: nothing to rescale
    if (tiles > 1) load_v(1, k_begin + BK);
    cp_async_commit();
    std::uint32_t next[BK / 16][4];
    // Tile t's probabilities go to `fresh` while tile t - 1's, in `prev`, feed the tensor cores; the
    // loop is unrolled by two so that the buffers swap roles instead of being copied (ptxas
    // serialises wgmma whose input registers other instructions write while it may run).
    auto step = [&](int t, const std::uint32_t (&prev)[BK / 16][4], std::uint32_t (&fresh)[BK / 16][4]) {
      const int stage = t & 1;
      const std::int32_t k0 = k_begin + t * BK;
      cp_async_wait<1>();  // K tile t and V tile t - 1; V tile t may still be in flight
      fence_async_shared();
      __syncthreads();  // every warpgroup is past tile t - 1's scores: K stage t + 1 is free
      wgmma_fence();
      issue_scores(stage);
      wgmma_commit();
      issue_values(stage ^ 1, prev);  // tile t - 1
      wgmma_commit();
      if (t + 1 < tiles) load_k(stage ^ 1, k0 + BK);
      cp_async_commit();
      wgmma_wait<1>();  // the scores; the values product keeps running
      pin_registers(s);
      softmax(k0, fresh, alpha);
      wgmma_wait<0>();
      pin_registers(o);
      rescale(alpha);
      __syncthreads();  // every warpgroup is done with V stage t - 1
      if (t + 1 < tiles) load_v(stage ^ 1, k0 + BK);
      cp_async_commit();
    };
    for (int t = 1; t < tiles; t += 2) {
      step(t, pr, next);
      if (t + 1 < tiles) step(t + 1, next, pr);
    }
    cp_async_wait<0>();  // the last V tile
    fence_async_shared();
    __syncthreads();
    wgmma_fence();
    if ((tiles - 1) % 2 == 0) {
      issue_values((tiles - 1) & 1, pr);
    } else {
      issue_values((tiles - 1) & 1, next);
    }
    wgmma_commit();
    wgmma_wait<0>();
    pin_registers(o);
  }
  cp_async_wait<0>();  // a block whose rows see no key still has Q's copy in flight

  T* out = static_cast<T*>(p.o);
  #pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float total = row_sum[rr];
    total += __shfl_xor_sync(kFullMask, total, 1);
    total += __shfl_xor_sync(kFullMask, total, 2);
    const std::int64_t i = q0 + row_b + rr * 8;
    if (i >= m.sq) continue;
    const std::int64_t o_off = m.o + i * p.o_rs + h * p.o_hs;
    const float inv = total == 0.0f ? 0.0f : 1.0f / total;
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      out[o_off + n * 8 + t4 * 2] = static_cast<T>(o[4 * n + 2 * rr] * inv);
      out[o_off + n * 8 + t4 * 2 + 1] = static_cast<T>(o[4 * n + 2 * rr + 1] * inv);
    }
    if (p.lse != nullptr && t4 == 0) {
      p.lse[m.lse + h * p.lse_hs + i * p.lse_is] =
          total == 0.0f ? -INFINITY : (row_max[rr] * scale_log2 + log2f(total)) * kLn2;
    }
  }
#else
  (void)p;
  __trap();  // not built for this device; the launcher never starts it there
#endif
}

inline LaunchShape launch_shape_v6(const FlashParams& p) {
  LaunchShape s;
  s.grid[0] = static_cast<unsigned>((p.max_sq + kWgmmaBlockQ - 1) / kWgmmaBlockQ);
  s.grid[1] = static_cast<unsigned>(p.hq);
  s.grid[2] = static_cast<unsigned>(p.batch);
  s.block = kWgmmaThreads;
  s.smem_bytes = wgmma_smem_bytes(p.d);  // the same tiles as production's
  return s;
}

}  // namespace kallpa::cuda
