// A device's ops with the CPU behind them: an op the device reports `unsupported` for (a weight
// type without a kernel, an op not written yet) runs on the CPU instead, with explicit copies of
// its inputs down and its outputs up. Each such op is counted by name and logged once; in strict
// mode nothing falls back and the device's `unsupported` error is returned instead.
//
// Weights follow the same rule at placement: a matrix the device cannot take stays in host memory
// (placed as the CPU wants it), and every product with it runs on the CPU.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "kallpa/ops/ops.h"

namespace kallpa::ops {

class FallbackOps final : public Ops {
 public:
  FallbackOps(std::unique_ptr<Ops> device, bool strict);

  std::string_view device_name() const noexcept override { return device_->device_name(); }
  Device device() const noexcept override { return device_->device(); }
  bool host_addressable() const noexcept override { return device_->host_addressable(); }
  // Ops run on the CPU so far, by op name ("matmul", "rope", ...).
  std::map<std::string, std::uint64_t> fallbacks() const;

  Result<void*> allocate(std::size_t bytes, std::string_view what) override { return device_->allocate(bytes, what); }
  void free(void* address) noexcept override { device_->free(address); }
  Status upload(void* dst, const void* host_src, std::size_t bytes) override {
    return device_->upload(dst, host_src, bytes);
  }
  Status download(void* host_dst, const void* src, std::size_t bytes) override {
    return device_->download(host_dst, src, bytes);
  }
  Status copy(void* dst, const void* src, std::size_t bytes) override { return device_->copy(dst, src, bytes); }
  Status finish() override { return device_->finish(); }
  Result<std::shared_ptr<const void>> place_weights(std::span<WeightMatrix* const> matrices, WeightUse use,
                                                    const CopiedFn& copied) override;

  Status embedding(const WeightMatrix& table, std::span<const std::int32_t> ids, float* out) override;
  Status rmsnorm(const float* x, const float* weight, float eps, float* y, std::int64_t rows,
                 std::int64_t dim) override;
  Status matmul(const WeightMatrix& w, const float* x, std::int64_t rows, float* y, std::int64_t decode_rows) override;
  Status matmul_group(std::span<const MatmulJob> jobs, const float* x, std::int64_t rows,
                      std::int64_t decode_rows) override;
  Status rope(float* x, std::span<const std::int32_t> positions, std::int64_t heads, std::int64_t head_dim,
              std::int64_t n_rot, float theta) override;
  Status rope_ext(float* x, std::span<const std::int32_t> positions, std::int64_t heads, std::int64_t head_dim,
                  std::int64_t n_rot, const RopeParams& params) override;
  Status swiglu(const float* gate, const float* up, float* out, std::int64_t n) override;
  Status geglu(const float* gate, const float* up, float* out, std::int64_t n) override;
  Status layernorm(const float* x, const float* weight, const float* bias, float eps, float* y, std::int64_t rows,
                   std::int64_t dim) override;
  Status gelu_erf(float* x, std::int64_t n) override;
  Status scale(float* x, float s, std::int64_t n) override;
  Status add_bias(float* x, const float* bias, std::int64_t rows, std::int64_t dim) override;
  Status add(float* x, const float* y, std::int64_t n) override;
  Status gather_rows(const float* x, std::span<const std::int64_t> rows, std::int64_t dim, float* out) override;
  Status scatter_rows(const float* src, std::int64_t dim, void* dst, DType dst_type,
                      std::span<const std::int64_t> rows) override;

 private:
  // Whether to run `op` on the CPU after the device answered `s`: false when s is ok or another
  // error; counts and logs when true. In strict mode it is always false.
  bool fall_back(const Status& s, const char* op);
  bool on_host(const WeightMatrix& w) const { return host_weights_.count(w.data) != 0; }
  // Host copies of device floats, and back.
  Result<std::vector<float>> down(const float* src, std::int64_t n);
  Status up(float* dst, const std::vector<float>& src) { return device_->upload(dst, src.data(), src.size() * 4); }

  std::unique_ptr<Ops> device_;
  std::unique_ptr<Ops> cpu_;
  bool strict_;
  std::set<const void*> host_weights_;  // data of matrices kept in host memory
  mutable std::mutex mu_;
  std::map<std::string, std::uint64_t> counts_;
};

}  // namespace kallpa::ops
