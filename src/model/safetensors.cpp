#include "kallpa/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kallpa::model {
namespace {

using nlohmann::json;

// A header bigger than this is not a weight file's: the format's own readers cap it at 100 MB.
constexpr std::uint64_t kMaxHeaderBytes = 100u << 20;

struct DTypeName {
  std::string_view name;
  SafetensorsDType dtype;
  std::size_t size;
};
constexpr DTypeName kDTypes[] = {
    {"F32", SafetensorsDType::f32, 4},      {"F16", SafetensorsDType::f16, 2}, {"BF16", SafetensorsDType::bf16, 2},
    {"F64", SafetensorsDType::f64, 8},      {"I64", SafetensorsDType::i64, 8}, {"I32", SafetensorsDType::i32, 4},
    {"I16", SafetensorsDType::i16, 2},      {"I8", SafetensorsDType::i8, 1},   {"U8", SafetensorsDType::u8, 1},
    {"BOOL", SafetensorsDType::boolean, 1},
};

Status malformed(const std::string& path, const std::string& field, const std::string& what) {
  return Status(ErrorCode::parse_error, field, fmt::format("{}: {}", path, what));
}

}  // namespace

std::string_view safetensors_dtype_name(SafetensorsDType dtype) noexcept {
  for (const DTypeName& d : kDTypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "?";
}

std::size_t safetensors_dtype_size(SafetensorsDType dtype) noexcept {
  for (const DTypeName& d : kDTypes) {
    if (d.dtype == dtype) return d.size;
  }
  return 0;
}

std::int64_t SafetensorsTensor::elements() const noexcept {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, static_cast<std::size_t>(size_));
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const noexcept {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

Result<std::shared_ptr<const SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    return Status(err == ENOENT ? ErrorCode::not_found : ErrorCode::invalid_argument, "path",
                  fmt::format("cannot open '{}': {}", path, std::strerror(err)));
  }
  struct stat sb {};
  if (::fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    ::close(fd);
    return Status(ErrorCode::invalid_argument, "path", fmt::format("'{}' is not a regular file", path));
  }
  const auto size = static_cast<std::uint64_t>(sb.st_size);
  if (size < 8) {
    ::close(fd);
    return malformed(path, "header", fmt::format("{} bytes: too short for the 8-byte header length", size));
  }
  void* map = ::mmap(nullptr, static_cast<std::size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);
  if (map == MAP_FAILED) {
    return Status(ErrorCode::internal, "path", fmt::format("cannot mmap '{}': {}", path, std::strerror(map_err)));
  }
  std::shared_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->map_ = map;
  file->size_ = size;
  const auto* base = static_cast<const std::byte*>(map);

  std::uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = header_bytes << 8 | static_cast<std::uint8_t>(base[i]);
  if (header_bytes > kMaxHeaderBytes || header_bytes > size - 8) {
    return malformed(path, "header",
                     fmt::format("header length {} does not fit the file ({} bytes)", header_bytes, size));
  }
  const std::string_view text(reinterpret_cast<const char*>(base + 8), static_cast<std::size_t>(header_bytes));
  json header = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!header.is_object()) return malformed(path, "header", "the header is not a JSON object");
  const std::byte* data = base + 8 + header_bytes;
  const std::uint64_t data_bytes = size - 8 - header_bytes;

  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return malformed(path, "__metadata__", "is not an object");
      for (auto& [key, value] : entry.items()) {
        if (!value.is_string()) return malformed(path, "__metadata__." + key, "is not a string");
        file->metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    if (!entry.is_object()) return malformed(path, name, "is not an object");
    SafetensorsTensor t;
    t.name = name;
    const json& dtype = entry["dtype"];
    const DTypeName* known = nullptr;
    if (dtype.is_string()) {
      for (const DTypeName& d : kDTypes) {
        if (d.name == dtype.get<std::string>()) known = &d;
      }
    }
    if (known == nullptr) {
      return malformed(path, name + ".dtype", fmt::format("unknown dtype {}", dtype.dump()));
    }
    t.dtype = known->dtype;
    const json& shape = entry["shape"];
    if (!shape.is_array() || shape.size() > 8) return malformed(path, name + ".shape", "is not an array of <= 8 sizes");
    std::uint64_t elements = 1;
    for (const json& d : shape) {
      if (!d.is_number_unsigned() || d.get<std::uint64_t>() > (std::uint64_t{1} << 40)) {
        return malformed(path, name + ".shape", fmt::format("bad dimension {}", d.dump()));
      }
      t.shape.push_back(d.get<std::int64_t>());
      elements *= d.get<std::uint64_t>();
      if (elements > (std::uint64_t{1} << 48)) return malformed(path, name + ".shape", "too many elements");
    }
    const json& offsets = entry["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      return malformed(path, name + ".data_offsets", "is not two byte offsets");
    }
    const auto begin = offsets[0].get<std::uint64_t>(), end = offsets[1].get<std::uint64_t>();
    if (begin > end || end > data_bytes) {
      return malformed(path, name + ".data_offsets",
                       fmt::format("[{}, {}) is outside the {} data bytes (truncated file?)", begin, end, data_bytes));
    }
    if (end - begin != elements * known->size) {
      return malformed(path, name + ".data_offsets",
                       fmt::format("{} bytes for {} elements of {}", end - begin, elements, known->name));
    }
    t.data = data + begin;
    t.bytes = end - begin;
    ranges.emplace_back(begin, end);
    file->tensors_.emplace(name, std::move(t));
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      return malformed(path, "data_offsets", fmt::format("tensors overlap at byte {}", ranges[i].first));
    }
  }
  return std::shared_ptr<const SafetensorsFile>(std::move(file));
}

}  // namespace kallpa::model
