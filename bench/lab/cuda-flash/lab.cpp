// The cuda-flash kernel lab's harness: see lab.h.
#include "lab.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/flash_kernels.h"
#include "backends/cuda/flash_plan.h"

namespace kallpa::lab {
namespace {

// Equal-length sequences in contiguous views: q and o [batch * sq, hq, d], k and v
// [batch * skv, hkv, d].
struct Shape {
  int batch;
  int sq;
  int skv;
  int hq;
  int hkv;
  int d;
  bool bf16;  // else f16 (the harness pairs bf16 with d 128 and f16 with d 64)
  bool causal;
};

std::string describe(const Shape& s) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "b=%d,sq=%d,skv=%d,hq=%d,hkv=%d,d=%d,dtype=%s%s", s.batch, s.sq, s.skv, s.hq, s.hkv,
                s.d, s.bf16 ? "bf16" : "f16", s.causal ? ",causal" : "");
  return buf;
}

// 16-bit storage and its value as the kernels see it.
std::uint16_t to_bits(float x, bool bf16) {
  if (bf16) return static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(x)).x;
  return static_cast<__half_raw>(__float2half_rn(x)).x;
}
float from_bits(std::uint16_t bits, bool bf16) {
  if (bf16) {
    __nv_bfloat16_raw raw;
    raw.x = bits;
    return __bfloat162float(__nv_bfloat16(raw));
  }
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}

bool cuda_ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

// One problem on the device: inputs, output, per-sequence geometry, and the FlashParams over them.
class Problem {
 public:
  explicit Problem(const Shape& s) : shape_(s) {
    const std::size_t q_elems = static_cast<std::size_t>(s.batch) * s.sq * s.hq * s.d;
    const std::size_t kv_elems = static_cast<std::size_t>(s.batch) * s.skv * s.hkv * s.d;
    std::mt19937 rng(1234);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    q_.resize(q_elems);
    k_.resize(kv_elems);
    v_.resize(kv_elems);
    for (auto* host : {&q_, &k_, &v_}) {
      for (std::uint16_t& x : *host) x = to_bits(dist(rng), s.bf16);
    }
    meta_.resize(static_cast<std::size_t>(s.batch));
    for (int b = 0; b < s.batch; ++b) {
      cuda::SeqMeta& m = meta_[static_cast<std::size_t>(b)];
      m.q = m.o = std::int64_t{b} * s.sq * s.hq * s.d;
      m.k = m.v = std::int64_t{b} * s.skv * s.hkv * s.d;
      m.row0 = std::int64_t{b} * s.sq;
      m.sq = s.sq;
      m.skv = s.skv;
    }
    ok_ =
        cuda_ok(cudaMalloc(&dq_, q_elems * 2), "cudaMalloc") && cuda_ok(cudaMalloc(&dk_, kv_elems * 2), "cudaMalloc") &&
        cuda_ok(cudaMalloc(&dv_, kv_elems * 2), "cudaMalloc") && cuda_ok(cudaMalloc(&do_, q_elems * 2), "cudaMalloc") &&
        cuda_ok(cudaMalloc(&dmeta_, meta_.size() * sizeof(cuda::SeqMeta)), "cudaMalloc") &&
        cuda_ok(cudaMemcpy(dq_, q_.data(), q_elems * 2, cudaMemcpyHostToDevice), "cudaMemcpy") &&
        cuda_ok(cudaMemcpy(dk_, k_.data(), kv_elems * 2, cudaMemcpyHostToDevice), "cudaMemcpy") &&
        cuda_ok(cudaMemcpy(dv_, v_.data(), kv_elems * 2, cudaMemcpyHostToDevice), "cudaMemcpy") &&
        cuda_ok(cudaMemcpy(dmeta_, meta_.data(), meta_.size() * sizeof(cuda::SeqMeta), cudaMemcpyHostToDevice),
                "cudaMemcpy");
    p_.q = dq_;
    p_.k = dk_;
    p_.v = dv_;
    p_.o = do_;
    p_.q_dtype = p_.kv_dtype = p_.o_dtype = s.bf16 ? cuda::kBF16 : cuda::kF16;
    p_.meta = static_cast<const cuda::SeqMeta*>(dmeta_);
    p_.batch = s.batch;
    p_.hq = s.hq;
    p_.hkv = s.hkv;
    p_.group = s.hq / s.hkv;
    p_.d = p_.dv = s.d;
    p_.max_sq = s.sq;
    p_.total_q = std::int64_t{s.batch} * s.sq;
    p_.q_rs = p_.o_rs = std::int64_t{s.hq} * s.d;
    p_.q_hs = p_.o_hs = s.d;
    p_.k_rs = p_.v_rs = std::int64_t{s.hkv} * s.d;
    p_.k_hs = p_.v_hs = s.d;
    p_.causal = s.causal;
    p_.scale = 1.0f / std::sqrt(static_cast<float>(s.d));
  }
  ~Problem() {
    for (void* ptr : {dq_, dk_, dv_, do_, dmeta_}) cudaFree(ptr);
  }
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;

  bool ok() const { return ok_; }
  const Shape& shape() const { return shape_; }
  const cuda::FlashParams& params() const { return p_; }
  const std::vector<cuda::SeqMeta>& meta() const { return meta_; }

  // Runs `launch` with p.kernel = `kernel` once and returns the output (empty on a CUDA error).
  std::vector<float> output(Launch launch, cuda::FlashKernel kernel) {
    const std::size_t n = q_.size();
    if (!cuda_ok(cudaMemset(do_, 0xff, n * 2), "cudaMemset")) return {};  // NaN: rows left unwritten show
    cuda::FlashParams p = p_;
    p.kernel = kernel;
    if (!cuda_ok(launch(p, nullptr), "launch") || !cuda_ok(cudaDeviceSynchronize(), "kernel")) return {};
    std::vector<std::uint16_t> bits(n);
    if (!cuda_ok(cudaMemcpy(bits.data(), do_, n * 2, cudaMemcpyDeviceToHost), "cudaMemcpy")) return {};
    std::vector<float> out(n);
    for (std::size_t i = 0; i < n; ++i) out[i] = from_bits(bits[i], shape_.bf16);
    return out;
  }

  // attention.h's definition in f64 over the 16-bit inputs: query i sits at key position
  // i + skv - sq; causal rows see the keys up to it.
  std::vector<float> reference() const {
    const Shape& s = shape_;
    std::vector<float> out(q_.size(), 0.0f);
    std::vector<double> w(static_cast<std::size_t>(s.skv));
    const int group = s.hq / s.hkv;
    const double scale = 1.0 / std::sqrt(static_cast<double>(s.d));
    for (int b = 0; b < s.batch; ++b) {
      for (int h = 0; h < s.hq; ++h) {
        const int hk = h / group;
        for (int i = 0; i < s.sq; ++i) {
          const int last = s.causal ? std::min(s.skv - 1, i + s.skv - s.sq) : s.skv - 1;
          const std::size_t qo = ((static_cast<std::size_t>(b) * s.sq + i) * s.hq + h) * s.d;
          double mx = -INFINITY;
          for (int j = 0; j <= last; ++j) {
            const std::size_t ko = ((static_cast<std::size_t>(b) * s.skv + j) * s.hkv + hk) * s.d;
            double dot = 0.0;
            for (int c = 0; c < s.d; ++c) dot += double{from_bits(q_[qo + c], s.bf16)} * from_bits(k_[ko + c], s.bf16);
            w[static_cast<std::size_t>(j)] = dot * scale;
            mx = std::max(mx, w[static_cast<std::size_t>(j)]);
          }
          double sum = 0.0;
          for (int j = 0; j <= last; ++j)
            sum += (w[static_cast<std::size_t>(j)] = std::exp(w[static_cast<std::size_t>(j)] - mx));
          for (int c = 0; c < s.d; ++c) {
            double acc = 0.0;
            for (int j = 0; j <= last; ++j) {
              const std::size_t vo = ((static_cast<std::size_t>(b) * s.skv + j) * s.hkv + hk) * s.d;
              acc += w[static_cast<std::size_t>(j)] * from_bits(v_[vo + c], s.bf16);
            }
            out[qo + c] = last >= 0 ? static_cast<float>(acc / sum) : 0.0f;
          }
        }
      }
    }
    return out;
  }

  // Milliseconds per launch: the mean of `iters` launches after 3 warm-up launches.
  float time_ms(Launch launch, cuda::FlashKernel kernel, int iters) {
    cuda::FlashParams p = p_;
    p.kernel = kernel;
    for (int i = 0; i < 3; ++i) {
      if (!cuda_ok(launch(p, nullptr), "launch")) return -1.0f;
    }
    cudaEvent_t start = nullptr, stop = nullptr;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    cudaEventRecord(start, nullptr);
    for (int i = 0; i < iters; ++i) launch(p, nullptr);
    cudaEventRecord(stop, nullptr);
    float ms = -1.0f;
    if (cuda_ok(cudaEventSynchronize(stop), "kernel")) cudaEventElapsedTime(&ms, start, stop);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return ms < 0.0f ? ms : ms / static_cast<float>(iters);
  }

 private:
  Shape shape_;
  std::vector<std::uint16_t> q_, k_, v_;
  std::vector<cuda::SeqMeta> meta_;
  void* dq_ = nullptr;
  void* dk_ = nullptr;
  void* dv_ = nullptr;
  void* do_ = nullptr;
  void* dmeta_ = nullptr;
  cuda::FlashParams p_;
  bool ok_ = false;
};

// The largest error against the reference, or NaN when an element is not finite.
double max_error(const std::vector<float>& got, const std::vector<float>& want) {
  double worst = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return NAN;
    worst = std::max(worst, std::fabs(double{got[i]} - want[i]));
  }
  return worst;
}

// The production kernels a generation is compared with on this device.
struct Production {
  const char* name;
  cuda::FlashKernel kernel;
  Launch launch;
};

std::vector<Production> production_kernels(const cuda::DeviceFacts& dev) {
  std::vector<Production> kernels = {
      {"forward_tensor_core", cuda::FlashKernel::tensor_core, cuda::launch_forward_tensor_core}};
#ifdef KALLPA_CUDA_WGMMA_BUILT
  cuda::FlashParams lean;
  lean.scale = 1.0f;
  if (cuda::wgmma_refusal(lean, dev).empty()) {
    kernels.push_back({"forward_wgmma", cuda::FlashKernel::wgmma, cuda::launch_forward_wgmma});
  }
#else
  (void)dev;
#endif
  return kernels;
}

}  // namespace

int run(const Generation& g) {
  std::printf("cuda-flash lab %s: %s\n", g.name, g.what);
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    std::printf("skipped: no CUDA device\n");
    return 77;
  }
  cuda::DeviceFacts dev;
  dev.index = device;
  dev.name = prop.name;
  dev.sm_count = prop.multiProcessorCount;
  dev.cc_major = prop.major;
  dev.cc_minor = prop.minor;
  std::printf("device: %s (compute capability %d.%d, %d SMs)\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);
  if (g.hopper_only && (prop.major != 9 || prop.minor != 0)) {
    std::printf("skipped: %s is sm_90a code; it runs only on compute capability 9.0\n", g.name);
    return 77;
  }
  const std::vector<Production> production = production_kernels(dev);

  // Checks: ragged tiles (lengths that are not multiples of any tile), Sq < Skv, grouped heads.
  const Shape checks[] = {
      {1, 256, 256, 4, 2, 128, true, true}, {2, 200, 333, 4, 1, 128, true, false}, {2, 130, 130, 4, 4, 128, true, true},
      {1, 190, 190, 2, 2, 64, false, true}, {1, 77, 300, 2, 1, 64, false, false},
  };
  bool passed = true;
  for (const Shape& s : checks) {
    Problem prob(s);
    if (!prob.ok()) return 1;
    const std::vector<float> want = prob.reference();
    // bf16 keeps 8 significant bits, f16 11; outputs are averages of values in [-1, 1].
    const double tolerance = s.bf16 ? 2e-2 : 4e-3;
    auto check = [&](const char* name, Launch launch, cuda::FlashKernel kernel) {
      const std::vector<float> got = prob.output(launch, kernel);
      const double err = got.empty() ? NAN : max_error(got, want);
      const bool ok = err <= tolerance;  // false for NaN
      std::printf("check %-22s %-52s max |error| %.2e (tolerance %.0e): %s\n", name, describe(s).c_str(), err,
                  tolerance, ok ? "ok" : "MISMATCH");
      return ok;
    };
    passed = check(g.name, g.launch, cuda::FlashKernel::tensor_core) && passed;
    for (const Production& k : production) passed = check(k.name, k.launch, k.kernel) && passed;
  }
  if (!passed) {
    std::printf("FAILED: %s does not match the reference\n", g.name);
    return 1;
  }

  // Timing: bf16, D 128, Llama-3-8B's heads (32 query, 8 KV), causal and not.
  const Shape benches[] = {
      {1, 4096, 4096, 32, 8, 128, true, true},
      {1, 4096, 4096, 32, 8, 128, true, false},
      {1, 8192, 8192, 32, 8, 128, true, false},
  };
  for (const Shape& s : benches) {
    Problem prob(s);
    if (!prob.ok()) return 1;
    const double flops = 4.0 * s.batch * s.sq * s.skv * s.d * s.hq * (s.causal && s.sq == s.skv ? 0.5 : 1.0);
    auto bench = [&](const char* name, Launch launch, cuda::FlashKernel kernel) {
      const float ms = prob.time_ms(launch, kernel, 20);
      if (ms < 0.0f) return false;
      std::printf("time  %-22s %-52s %8.3f ms %7.1f TFLOP/s\n", name, describe(s).c_str(), ms, flops / ms / 1e9);
      return true;
    };
    if (!bench(g.name, g.launch, cuda::FlashKernel::tensor_core)) return 1;
    for (const Production& k : production) {
      if (!bench(k.name, k.launch, k.kernel)) return 1;
    }
    const cuda::KernelChoice choice = cuda::choose_kernel(prob.params(), prob.meta(), dev);
    std::printf("      (cuda-flash chooses %s here)\n",
                choice.kernel == cuda::FlashKernel::wgmma ? "forward_wgmma" : "forward_tensor_core");
  }
  return 0;
}

}  // namespace kallpa::lab
