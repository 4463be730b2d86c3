// f32 activations in an Ops object's memory, grown on demand: what a forward pass keeps between
// calls so that a steady stream of batches allocates nothing. The contents do not survive growth.
#pragma once

#include <cstdint>

#include "kallpa/ops/ops.h"
#include "kallpa/status.h"

namespace kallpa::ops {

class Scratch {
 public:
  Scratch() = default;
  ~Scratch() { reset(); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  // At least `floats` floats in `ops`' memory; out_of_memory naming `what` when it fails.
  Status reserve(Ops& ops, std::int64_t floats, const char* what);
  float* get() const noexcept { return data_; }
  std::int64_t size() const noexcept { return size_; }  // floats
  void reset() noexcept;

 private:
  Ops* ops_ = nullptr;
  float* data_ = nullptr;
  std::int64_t size_ = 0;
};

}  // namespace kallpa::ops
