// A diagnostic for the Hopper kernels' building blocks (flash_wgmma.cuh), run by tools/gpu-check.sh
// on a compute capability 9.0 device: one warpgroup computes
//   S = Q K^T  (Q 64 x 128 and K 128 x 128, both K-major in the swizzled layout; wgmma_ss_n128)
//   O = P V    (P 64 x 128 from registers in the score accumulator's layout, V 128 keys x 128
//               dims MN-major in the swizzled layout; wgmma_rs)
// on small integers (exact in bf16 and f32), and compares each element with the host's product.
// When a kernel fails conformance this says which operand layout is wrong, and where.
// Prints one line per product and exits non-zero on any mismatch.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "backends/cuda/flash_device.cuh"
#include "backends/cuda/flash_wgmma.cuh"

namespace {

using kallpa::cuda::swizzled_chunk;
constexpr int M = 64, N = 128, K = 128;

__global__ void probe(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* pm,
                      const __nv_bfloat16* v, float* s_out, float* o_out) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace kallpa::cuda;
  extern __shared__ __align__(1024) unsigned char probe_smem[];
  const std::uint32_t pad = (1024u - smem_addr(probe_smem) % 1024u) % 1024u;
  unsigned char* qs = probe_smem + pad;
  unsigned char* ks = qs + M * K * 2;
  unsigned char* vs = ks + N * K * 2;
  const int tid = static_cast<int>(threadIdx.x);
  // Plain 16-byte stores into the swizzled layout (rows of 16 chunks of 8 elements).
  for (int idx = tid; idx < M * K / 8; idx += 128) {
    const int r = idx / (K / 8), c = idx % (K / 8);
    *reinterpret_cast<uint4*>(qs + swizzled_chunk(M, r, c)) = reinterpret_cast<const uint4*>(q)[idx];
  }
  for (int idx = tid; idx < N * K / 8; idx += 128) {
    const int r = idx / (K / 8), c = idx % (K / 8);
    *reinterpret_cast<uint4*>(ks + swizzled_chunk(N, r, c)) = reinterpret_cast<const uint4*>(k)[idx];
    *reinterpret_cast<uint4*>(vs + swizzled_chunk(K, r, c)) = reinterpret_cast<const uint4*>(v)[idx];
  }
  fence_async_shared();
  __syncthreads();
  const std::uint32_t q_addr = smem_addr(qs), k_addr = smem_addr(ks), v_addr = smem_addr(vs);
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;

  float s[N / 2];
  for (int i = 0; i < N / 2; ++i) s[i] = 0.0f;
  wgmma_fence();
  #pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const std::uint32_t col = (kk % 4) * 32;
    const std::uint64_t a = sw128_desc(q_addr + (kk / 4) * (M * 128) + col, 16, 1024);
    const std::uint64_t b = sw128_desc(k_addr + (kk / 4) * (N * 128) + col, 16, 1024);
    if (kk == 0) {
      wgmma_ss_n128<__nv_bfloat16, false>(s, a, b);
    } else {
      wgmma_ss_n128<__nv_bfloat16, true>(s, a, b);
    }
  }
  wgmma_commit();
  wgmma_wait<0>();
  pin_registers(s);
  for (int n = 0; n < N / 8; ++n) {
    for (int e = 0; e < 4; ++e) {
      const int row = warp * 16 + g + (e / 2) * 8, col = n * 8 + t4 * 2 + (e & 1);
      s_out[row * N + col] = s[4 * n + e];
    }
  }

  // P's A fragments, read from global memory in the accumulator's layout (rows g, g + 8).
  std::uint32_t a[K / 16][4];
  auto pair = [&](int row, int col) {
    const __nv_bfloat162 x{pm[row * K + col], pm[row * K + col + 1]};
    return *reinterpret_cast<const std::uint32_t*>(&x);
  };
  for (int kk = 0; kk < K / 16; ++kk) {
    const int r0 = warp * 16 + g, c0 = kk * 16 + t4 * 2;
    a[kk][0] = pair(r0, c0);
    a[kk][1] = pair(r0 + 8, c0);
    a[kk][2] = pair(r0, c0 + 8);
    a[kk][3] = pair(r0 + 8, c0 + 8);
  }
  float o[N / 2];
  for (int i = 0; i < N / 2; ++i) o[i] = 0.0f;
  wgmma_fence();
  #pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    wgmma_rs<__nv_bfloat16, N>(o, a[kk], sw128_desc(v_addr + kk * 16 * 128, K * 128, 1024));
  }
  wgmma_commit();
  wgmma_wait<0>();
  pin_registers(o);
  for (int n = 0; n < N / 8; ++n) {
    for (int e = 0; e < 4; ++e) {
      const int row = warp * 16 + g + (e / 2) * 8, col = n * 8 + t4 * 2 + (e & 1);
      o_out[row * N + col] = o[4 * n + e];
    }
  }
#else
  (void)q, (void)k, (void)pm, (void)v, (void)s_out, (void)o_out;
#endif
}

int report(const char* what, const std::vector<float>& got, const std::vector<float>& want) {
  int bad = 0, first = -1;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      if (first < 0) first = static_cast<int>(i);
      ++bad;
    }
  }
  if (bad == 0) {
    std::printf("%s: all %zu elements exact\n", what, got.size());
  } else {
    std::printf("%s: %d of %zu elements differ; first at row %d col %d: got %g want %g\n", what, bad, got.size(),
                first / N, first % N, got[static_cast<std::size_t>(first)], want[static_cast<std::size_t>(first)]);
  }
  return bad;
}

}  // namespace

int main() {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major != 9 || prop.minor != 0) {
    std::printf("wgmma probe: needs a compute capability 9.0 device\n");
    return 2;
  }
  // Small integers: every product and sum is exact in f32, every input exact in bf16.
  std::vector<float> qf(M * K), kf(N * K), pf(M * K), vf(K * N);
  for (int i = 0; i < M * K; ++i) qf[i] = static_cast<float>((i * 7 + i / K) % 5 - 2);
  for (int i = 0; i < N * K; ++i) kf[i] = static_cast<float>((i * 3 + i / K * 5) % 7 - 3);
  for (int i = 0; i < M * K; ++i) pf[i] = static_cast<float>((i * 5 + i / K) % 3);
  for (int i = 0; i < K * N; ++i) vf[i] = static_cast<float>((i * 11 + i / N * 3) % 9 - 4);
  auto to_bf16 = [](const std::vector<float>& f) {
    std::vector<__nv_bfloat16> b(f.size());
    for (std::size_t i = 0; i < f.size(); ++i) b[i] = __float2bfloat16(f[i]);
    return b;
  };
  std::vector<float> s_want(M * N, 0.0f), o_want(M * N, 0.0f);
  for (int r = 0; r < M; ++r) {
    for (int c = 0; c < N; ++c) {
      for (int x = 0; x < K; ++x) {
        s_want[r * N + c] += qf[r * K + x] * kf[c * K + x];
        o_want[r * N + c] += pf[r * K + x] * vf[x * N + c];
      }
    }
  }
  const auto qb = to_bf16(qf), kb = to_bf16(kf), pb = to_bf16(pf), vb = to_bf16(vf);
  __nv_bfloat16 *dq, *dk, *dp, *dv;
  float *ds, *d_o;
  cudaMalloc(&dq, qb.size() * 2);
  cudaMalloc(&dk, kb.size() * 2);
  cudaMalloc(&dp, pb.size() * 2);
  cudaMalloc(&dv, vb.size() * 2);
  cudaMalloc(&ds, M * N * 4);
  cudaMalloc(&d_o, M * N * 4);
  cudaMemcpy(dq, qb.data(), qb.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dk, kb.data(), kb.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dp, pb.data(), pb.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dv, vb.data(), vb.size() * 2, cudaMemcpyHostToDevice);
  constexpr int kSmem = 1024 + M * K * 2 + N * K * 2 + K * N * 2;
  cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  probe<<<1, 128, kSmem>>>(dq, dk, dp, dv, ds, d_o);
  if (const cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
    std::printf("wgmma probe: kernel failed: %s\n", cudaGetErrorString(e));
    return 1;
  }
  std::vector<float> s_got(M * N), o_got(M * N);
  cudaMemcpy(s_got.data(), ds, M * N * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(o_got.data(), d_o, M * N * 4, cudaMemcpyDeviceToHost);
  const int bad = report("S = Q K^T (K-major A and B, wgmma_ss_n128)", s_got, s_want) +
                  report("O = P V (register A, MN-major B, wgmma_rs)", o_got, o_want);
  return bad == 0 ? 0 : 1;
}
