// cpu-flash: the FlashAttention-2 algorithm on the CPU. Tiles of queries (the query heads that
// share a KV head are packed together) against tiles of keys with an online softmax, O(N) extra
// memory, f32 accumulation, Highway SIMD with runtime dispatch, threads over batch x KV heads x
// query tiles (heaviest first, fully masked key tiles skipped) and split-KV with a log-sum-exp
// combine for decode. A scalar generic path in the same backend is the fallback and the second
// opinion; every valid CPU problem is supported.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "kallpa/backend.h"

namespace kallpa::cpu_flash {

enum class Path : int {
  automatic = 0,  // fast path when its conditions hold, else generic
  generic = 1,    // scalar per-row online softmax (always applicable)
  fast = 2,       // tiled SIMD path; falls back to generic when its conditions do not hold
};

// The decode kernel for decode-shaped sequences (Sq * group <= 16 rows per KV head). The backend
// chooses for each sequence by its own shape and the machine (choose_decode_kernel in
// flash_internal.h); a named kernel runs that one, for tests and benchmarks that compare them side
// by side.
enum class DecodeKernel : int {
  automatic = 0,        // choose_decode_kernel's choice
  by_head = 1,          // each block head by head, K/V read in place (or converted to f32 first where
                        // the layout cannot be read in place): in cache on AVX2 and narrower targets
  grouped = 2,          // blocks walked in memory order in steps of eight keys across every head, the
                        // rows of a GQA group served together: streamed on AVX2 and narrower targets
  lanes = 3,            // grouped's walk in steps of one key per vector lane: AVX-512
  lanes_half_dots = 4,  // lanes with its dots on 256-bit halves on AVX-512: AVX-512 on AMD
};

struct Options {
  int threads = 0;  // 0: every thread of the global pool
  Path path = Path::automatic;
  DecodeKernel decode = DecodeKernel::automatic;
  // Keys per step of the lanes kernels on AVX-512: 0 chooses by the K/V geometry and size
  // (decode_short_steps), 8 fixes 8, anything else 16.
  int decode_step = 0;
};

class CpuFlashBackend final : public AttentionBackend {
 public:
  CpuFlashBackend() = default;
  explicit CpuFlashBackend(Options options) : options_(options) {}

  std::string_view name() const noexcept override { return "cpu-flash"; }
  std::string_view version() const noexcept override { return "0.1.0"; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::cpu; }
  int priority() const noexcept override;
  std::string_view description() const noexcept override {
    return "FlashAttention-2 on the CPU: tiled online softmax, Highway SIMD, threads, split-KV";
  }
  Support supports(const ProblemSignature& signature) const noexcept override;
  std::size_t workspace_size(const ValidatedProblem& problem) const noexcept override;
  Status run(const ValidatedProblem& problem, Workspace workspace) noexcept override;

  const Options& options() const noexcept { return options_; }
  // True when run() would take the tiled SIMD path for this problem.
  bool uses_fast_path(const ValidatedProblem& problem) const noexcept;
  // The SIMD target Highway picked on this machine, e.g. "AVX3" or "AVX2".
  static std::string simd_target();
  // Every SIMD target compiled in and supported by this CPU, best first; and, for tests, pin the
  // dispatch to one of them (process-wide; "" restores the automatic choice).
  static std::vector<std::string> simd_targets();
  static bool force_simd_target(const std::string& name);

 private:
  Options options_{};
};

}  // namespace kallpa::cpu_flash
