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

// Kernel generation for decode-shaped problems (Sq * group <= 16 rows per KV head); the older ones
// stay selectable so that benchmarks compare them side by side.
enum class DecodeKernel : int {
  automatic = 0,  // lanes on AVX-512 (half_dots on AMD); elsewhere direct while the K/V of the
                  // call fit in cache, else grouped8 (automatic_decode_kernel in flash_internal.h)
  tiled = 2,      // v2: the general tiled path (per-head tasks, split-KV)
  staged = 3,     // v3: key-chunk tasks over all heads, each block converted to f32 scratch first
  direct = 4,     // v4: like staged, but K/V rows read in place (F16C / bf16 promote in registers)
  stream = 5,     // v5: direct, with each block walked in memory order (key rows across all heads)
                  //     and prefetched a fixed distance ahead as one sequential stream
  fused = 6,      // v6: stream with its prefetches spread over the heads of each step instead of
                  //     one burst per step
  grouped = 7,    // v7: v6's walk in steps of eight keys, up to four query rows of a GQA group served
                  //     from each K/V vector converted once, P·V accumulators in registers per step
  grouped8 = 8,   // v8: v7 with the eight dots of a step reduced in one tree, whole steps of P·V
                  //     unrolled and the row groups planned once per task (fewer instructions per key)
  lanes = 9,      // v9: v8 with a step of one key per vector lane (16 on AVX-512): a step's dots
                  //     reduce in one tree at any width, P·V slices sized for the target's registers
  half_dots = 10, // v10: v9 with its dots on 256-bit halves on AVX-512 (a cheaper tree where 512-bit
                  //     operations run as two halves: AMD Zen 4); v9 elsewhere
};

// Kernel generation of the tiled (prefill) path; the older one stays selectable for benchmarks.
enum class PrefillKernel : int {
  automatic = 0,  // the newest
  rows = 2,       // v2: rows kernel with power-of-two tile strides
  padded = 3,     // v3: v2 with L1-conflict-free tile strides, the rescale folded into P·V, a
                  //     cheaper exp
};

struct Options {
  int threads = 0;  // 0: every thread of the global pool
  Path path = Path::automatic;
  DecodeKernel decode = DecodeKernel::automatic;
  PrefillKernel prefill = PrefillKernel::automatic;
  // Keys per step of decode v9 / v10 on AVX-512: 0 chooses by the K/V geometry and size
  // (decode_short_steps), 8 fixes 8, anything else 16 (KALLPA_CPU_FLASH_STEP).
  int decode_step = 0;
};

// The registered backend's options: the defaults, with the kernel generations taken from
// KALLPA_CPU_FLASH_DECODE (v2..v10), KALLPA_CPU_FLASH_PREFILL (v2, v3) and KALLPA_CPU_FLASH_STEP
// (8, 16) when set, so that `kallpa bench attention` can time one generation against another.
Options options_from_env();

class CpuFlashBackend final : public AttentionBackend {
 public:
  CpuFlashBackend() : options_(options_from_env()) {}
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
  bool use_decode_path(const ValidatedProblem& problem) const noexcept;
  Status run_decode(const ValidatedProblem& problem, Workspace workspace) const;

  Options options_;
};

}  // namespace kallpa::cpu_flash
