#include "kallpa/device.h"

#include <algorithm>
#include <cstdint>

#include <fmt/format.h>

namespace kallpa {

Result<DeviceBuffer> DeviceBuffer::allocate(DeviceMemory& memory, std::size_t bytes) noexcept {
  Result<void*> p = memory.allocate(bytes);
  if (!p) return p.status();
  DeviceBuffer b;
  b.memory_ = &memory;
  b.data_ = *p;
  b.bytes_ = bytes;
  return b;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    memory_ = std::exchange(other.memory_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::reset() noexcept {
  if (memory_ != nullptr && data_ != nullptr) memory_->free(data_);
  memory_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

namespace {

struct Extent {
  std::int64_t low = 0;
  std::int64_t high = 0;  // one past the last byte
};

Extent extent_of(const TensorView& t) noexcept {
  const auto [low, high] = view_byte_extent(t);
  return {low, high};
}

}  // namespace

std::pair<std::int64_t, std::int64_t> view_byte_extent(const TensorView& t) noexcept {
  std::int64_t low = 0, high = 0;
  for (int d = 0; d < t.rank; ++d) {
    const auto u = static_cast<std::size_t>(d);
    if (t.shape[u] == 0) return {0, 0};
    const std::int64_t reach = (t.shape[u] - 1) * t.stride[u];
    (reach < 0 ? low : high) += reach;
  }
  const auto esize = static_cast<std::int64_t>(dtype_size(t.dtype));
  return {low * esize, (high + 1) * esize};
}

Result<StagedProblem> StagedProblem::stage(DeviceMemory& memory, const AttentionProblem& host,
                                           std::size_t margin_bytes) noexcept {
  StagedProblem s;
  s.memory_ = &memory;
  s.device_ = host;
  const auto margin = static_cast<std::int64_t>(margin_bytes);
  auto mirror = [&](const char* name, const TensorView& h, TensorView& d, Mirror& m) -> Status {
    if (!h.present()) return {};
    const Extent e = extent_of(h);
    auto* host_data = static_cast<std::byte*>(h.data);
    std::byte* begin = host_data + e.low - margin;
    const auto bytes = static_cast<std::size_t>(e.high - e.low + 2 * margin);
    Result<DeviceBuffer> buf = DeviceBuffer::allocate(memory, bytes);
    if (!buf) return Status(buf.status().code(), name, buf.status().message());
    if (Status st = memory.upload(buf->data(), begin, bytes); !st) {
      return Status(st.code(), name, fmt::format("upload of {} bytes: {}", bytes, st.message()));
    }
    m.host_begin = begin;
    m.buffer = std::move(*buf);
    d.data = static_cast<std::byte*>(m.buffer.data()) + (host_data - begin);
    d.device = memory.device();
    return {};
  };
  if (Status st = mirror("q", host.q, s.device_.q, s.q_); !st) return st;
  if (Status st = mirror("k", host.k, s.device_.k, s.k_); !st) return st;
  if (Status st = mirror("v", host.v, s.device_.v, s.v_); !st) return st;
  if (Status st = mirror("o", host.o, s.device_.o, s.o_); !st) return st;
  if (Status st = mirror("lse", host.lse, s.device_.lse, s.lse_); !st) return st;
  return s;
}

Status StagedProblem::download(const Mirror& m) const noexcept {
  if (m.buffer.data() == nullptr) return {};
  return memory_->download(m.host_begin, m.buffer.data(), m.buffer.bytes());
}

Status StagedProblem::download_outputs() const noexcept {
  if (Status st = download(o_); !st) return st;
  return download(lse_);
}

Status StagedProblem::download_inputs() const noexcept {
  for (const Mirror* m : {&q_, &k_, &v_}) {
    if (Status st = download(*m); !st) return st;
  }
  return {};
}

}  // namespace kallpa
