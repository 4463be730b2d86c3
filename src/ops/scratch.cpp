#include "kallpa/ops/scratch.h"

namespace kallpa::ops {

Status Scratch::reserve(Ops& ops, std::int64_t floats, const char* what) {
  if (floats <= size_ && ops_ == &ops) return {};
  reset();
  auto p = ops.allocate(static_cast<std::size_t>(floats) * sizeof(float), what);
  if (!p) return p.status();
  ops_ = &ops;
  data_ = static_cast<float*>(*p);
  size_ = floats;
  return {};
}

void Scratch::reset() noexcept {
  if (ops_ != nullptr) ops_->free(data_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace kallpa::ops
