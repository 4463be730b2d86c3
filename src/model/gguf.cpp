#include "kallpa/model/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <new>

#include <fmt/format.h>

namespace kallpa::model {

namespace {

constexpr std::uint32_t kMagic = 0x46554747u;  // "GGUF" little-endian
constexpr std::uint64_t kDefaultAlignment = 32;
constexpr int kMaxArrayDepth = 16;
constexpr int kMaxDims = 4;

template <typename T>
T load(const std::byte* p) noexcept {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Fixed size of a scalar value type in bytes, 0 for string/array/unknown.
std::uint64_t scalar_size(std::uint32_t t) noexcept {
  switch (static_cast<GgufValueType>(t)) {
    case GgufValueType::u8:
    case GgufValueType::i8:
    case GgufValueType::boolean: return 1;
    case GgufValueType::u16:
    case GgufValueType::i16: return 2;
    case GgufValueType::u32:
    case GgufValueType::i32:
    case GgufValueType::f32: return 4;
    case GgufValueType::u64:
    case GgufValueType::i64:
    case GgufValueType::f64: return 8;
    default: return 0;
  }
}

bool known_value_type(std::uint32_t t) noexcept { return t <= 12; }

// The smallest number of bytes one value of this type takes (used to bound counts).
std::uint64_t min_value_size(std::uint32_t t) noexcept {
  if (t == static_cast<std::uint32_t>(GgufValueType::string)) return 8;
  if (t == static_cast<std::uint32_t>(GgufValueType::array)) return 12;
  return scalar_size(t);
}

}  // namespace

// ---- GgufValue ----

bool GgufValue::is_integer() const noexcept {
  switch (type_) {
    case GgufValueType::u8:
    case GgufValueType::i8:
    case GgufValueType::u16:
    case GgufValueType::i16:
    case GgufValueType::u32:
    case GgufValueType::i32:
    case GgufValueType::u64:
    case GgufValueType::i64: return true;
    default: return false;
  }
}

std::uint64_t GgufValue::as_u64() const noexcept {
  if (raw_ == nullptr || is_array()) return 0;
  switch (type_) {
    case GgufValueType::u8: return load<std::uint8_t>(raw_);
    case GgufValueType::u16: return load<std::uint16_t>(raw_);
    case GgufValueType::u32: return load<std::uint32_t>(raw_);
    case GgufValueType::u64: return load<std::uint64_t>(raw_);
    default: return 0;
  }
}

std::int64_t GgufValue::as_i64() const noexcept {
  if (raw_ == nullptr || is_array()) return 0;
  switch (type_) {
    case GgufValueType::i8: return load<std::int8_t>(raw_);
    case GgufValueType::i16: return load<std::int16_t>(raw_);
    case GgufValueType::i32: return load<std::int32_t>(raw_);
    case GgufValueType::i64: return load<std::int64_t>(raw_);
    default: return 0;
  }
}

double GgufValue::as_f64() const noexcept {
  if (raw_ == nullptr || is_array()) return 0.0;
  if (type_ == GgufValueType::f32) return static_cast<double>(load<float>(raw_));
  if (type_ == GgufValueType::f64) return load<double>(raw_);
  return 0.0;
}

bool GgufValue::as_bool() const noexcept {
  return type_ == GgufValueType::boolean && raw_ != nullptr && load<std::uint8_t>(raw_) != 0;
}

std::string GgufValue::to_string() const {
  switch (type_) {
    case GgufValueType::u8:
    case GgufValueType::u16:
    case GgufValueType::u32:
    case GgufValueType::u64: return fmt::format("{}", as_u64());
    case GgufValueType::i8:
    case GgufValueType::i16:
    case GgufValueType::i32:
    case GgufValueType::i64: return fmt::format("{}", as_i64());
    case GgufValueType::f32:
    case GgufValueType::f64: return fmt::format("{}", as_f64());
    case GgufValueType::boolean: return as_bool() ? "true" : "false";
    case GgufValueType::string: return fmt::format("\"{}\"", str_);
    case GgufValueType::array: return fmt::format("[{} x {}]", count_, gguf_value_type_name(elem_type_));
  }
  return "?";
}

std::string_view gguf_value_type_name(GgufValueType type) noexcept {
  switch (type) {
    case GgufValueType::u8: return "uint8";
    case GgufValueType::i8: return "int8";
    case GgufValueType::u16: return "uint16";
    case GgufValueType::i16: return "int16";
    case GgufValueType::u32: return "uint32";
    case GgufValueType::i32: return "int32";
    case GgufValueType::f32: return "float32";
    case GgufValueType::boolean: return "bool";
    case GgufValueType::string: return "string";
    case GgufValueType::array: return "array";
    case GgufValueType::u64: return "uint64";
    case GgufValueType::i64: return "int64";
    case GgufValueType::f64: return "float64";
  }
  return "unknown";
}

std::string TensorView::shape_string() const {
  std::string s = "[";
  for (int i = 0; i < n_dims; ++i) s += fmt::format("{}{}", i ? ", " : "", ne[static_cast<std::size_t>(i)]);
  return s + "]";
}

// ---- parser ----

class GgufParser {
 public:
  GgufParser(GgufFile& file) : f_(file), base_(file.base_), size_(file.size_) {}  // NOLINT

  Status parse() {
    Status st = parse_header();
    if (!st) return st;
    st = parse_kvs();
    if (!st) return st;
    st = parse_alignment();
    if (!st) return st;
    st = parse_tensor_infos();
    if (!st) return st;
    return place_tensors();
  }

 private:
  Status fail(std::string field, std::uint64_t at, std::string_view what) const {
    return {ErrorCode::parse_error, std::move(field),
            fmt::format("at byte {} of {} (file size {}): {}", at, f_.path_, size_, what)};
  }

  std::uint64_t remaining() const noexcept { return size_ - pos_; }

  // Reads a fixed-size little-endian value; fails when it would cross the end of the file.
  template <typename T>
  bool read(T& out) noexcept {
    if (remaining() < sizeof(T)) return false;
    out = load<T>(base_ + pos_);
    pos_ += sizeof(T);
    return true;
  }

  template <typename T>
  Status read_field(T& out, const std::string& field, std::string_view what) {
    const std::uint64_t at = pos_;
    if (!read(out)) {
      return fail(field, at,
                  fmt::format("file ends while reading {} ({} bytes needed, {} left)", what, sizeof(T), remaining()));
    }
    return {};
  }

  Status read_string(std::string_view& out, const std::string& field) {
    const std::uint64_t at = pos_;
    std::uint64_t len = 0;
    if (!read(len)) {
      return fail(field + ".length", at,
                  fmt::format("file ends while reading a string length ({} bytes left)", remaining()));
    }
    if (len > remaining()) {
      return fail(field + ".length", at,
                  fmt::format("string length {} exceeds the {} bytes left in the file", len, remaining()));
    }
    out = std::string_view(reinterpret_cast<const char*>(base_ + pos_), static_cast<std::size_t>(len));
    pos_ += len;
    return {};
  }

  Status parse_header() {
    std::uint32_t magic = 0;
    if (!read(magic)) return fail("header.magic", 0, "file is too short for a GGUF header");
    if (magic != kMagic) {
      return fail("header.magic", 0,
                  fmt::format("bad magic 0x{:08x} (expected 0x{:08x}, \"GGUF\"); not a GGUF file", magic, kMagic));
    }
    Status st = read_field(f_.version_, "header.version", "the version");
    if (!st) return st;
    if (f_.version_ != 2 && f_.version_ != 3) {
      const std::uint32_t swapped = __builtin_bswap32(f_.version_);
      return fail("header.version", 4,
                  fmt::format("unsupported GGUF version {} (supported: 2, 3){}", f_.version_,
                              swapped == 2 || swapped == 3 ? "; this looks like a big-endian GGUF file, which "
                                                             "kallpa does not read"
                                                           : ""));
    }
    st = read_field(tensor_count_, "header.tensor_count", "the tensor count");
    if (!st) return st;
    st = read_field(kv_count_, "header.kv_count", "the metadata count");
    if (!st) return st;
    // Every key/value takes at least 13 bytes (key length 8, type 4, value 1) and every tensor info
    // at least 32 (name length 8, n_dims 4, one dim 8, type 4, offset 8).
    if (kv_count_ > remaining() / 13) {
      return fail("header.kv_count", 16,
                  fmt::format("{} metadata entries cannot fit in the {} bytes left", kv_count_, remaining()));
    }
    if (tensor_count_ > remaining() / 32) {
      return fail("header.tensor_count", 8,
                  fmt::format("{} tensor infos cannot fit in the {} bytes left", tensor_count_, remaining()));
    }
    return {};
  }

  Status parse_value(GgufValue& v, std::uint32_t type, const std::string& field, int depth) {
    const std::uint64_t at = pos_;
    v.type_ = static_cast<GgufValueType>(type);
    v.count_ = 1;
    if (!known_value_type(type)) {
      return fail(field + ".type", at, fmt::format("unknown metadata value type {}", type));
    }
    if (v.type_ == GgufValueType::string) return read_string(v.str_, field);
    if (v.type_ != GgufValueType::array) {
      const std::uint64_t n = scalar_size(type);
      if (n > remaining()) {
        return fail(field, at, fmt::format("file ends inside a {} value", gguf_value_type_name(v.type_)));
      }
      v.raw_ = base_ + pos_;
      if (v.type_ == GgufValueType::boolean && load<std::uint8_t>(v.raw_) > 1) {
        return fail(field, at, fmt::format("bool value {} is neither 0 nor 1", load<std::uint8_t>(v.raw_)));
      }
      pos_ += n;
      return {};
    }
    // Array: element type, count, elements.
    if (depth >= kMaxArrayDepth) {
      return fail(field, at, fmt::format("arrays nested deeper than {} levels", kMaxArrayDepth));
    }
    std::uint32_t elem = 0;
    Status st = read_field(elem, field + ".element_type", "an array element type");
    if (!st) return st;
    if (!known_value_type(elem)) {
      return fail(field + ".element_type", at, fmt::format("unknown array element type {}", elem));
    }
    v.elem_type_ = static_cast<GgufValueType>(elem);
    st = read_field(v.count_, field + ".count", "an array length");
    if (!st) return st;
    const std::uint64_t min_size = min_value_size(elem);
    if (v.count_ > remaining() / min_size) {
      return fail(field + ".count", at + 4,
                  fmt::format("array of {} {} elements cannot fit in the {} bytes left", v.count_,
                              gguf_value_type_name(v.elem_type_), remaining()));
    }
    if (v.elem_type_ == GgufValueType::string) {
      v.strings_.resize(static_cast<std::size_t>(v.count_));
      for (std::uint64_t i = 0; i < v.count_; ++i) {
        st = read_string(v.strings_[static_cast<std::size_t>(i)], fmt::format("{}[{}]", field, i));
        if (!st) return st;
      }
      return {};
    }
    if (v.elem_type_ == GgufValueType::array) {
      v.items_.resize(static_cast<std::size_t>(v.count_));
      for (std::uint64_t i = 0; i < v.count_; ++i) {
        st = parse_value(v.items_[static_cast<std::size_t>(i)], elem, fmt::format("{}[{}]", field, i), depth + 1);
        if (!st) return st;
      }
      return {};
    }
    v.raw_ = base_ + pos_;
    if (v.elem_type_ == GgufValueType::boolean) {
      for (std::uint64_t i = 0; i < v.count_; ++i) {
        if (load<std::uint8_t>(v.raw_ + i) > 1) {
          return fail(fmt::format("{}[{}]", field, i), pos_ + i, "bool value is neither 0 nor 1");
        }
      }
    }
    pos_ += v.count_ * min_size;  // bounded by the check above
    return {};
  }

  Status parse_kvs() {
    f_.kvs_.resize(static_cast<std::size_t>(kv_count_));
    f_.kv_index_.reserve(static_cast<std::size_t>(kv_count_));
    for (std::uint64_t i = 0; i < kv_count_; ++i) {
      GgufKeyValue& kv = f_.kvs_[static_cast<std::size_t>(i)];
      const std::string field = fmt::format("kv[{}]", i);
      kv.file_offset = pos_;
      Status st = read_string(kv.key, field + ".key");
      if (!st) return st;
      if (kv.key.empty()) return fail(field + ".key", kv.file_offset, "empty metadata key");
      const std::string vfield = fmt::format("kv[{}]({})", i, kv.key);
      std::uint32_t type = 0;
      st = read_field(type, vfield + ".type", "a metadata value type");
      if (!st) return st;
      st = parse_value(kv.value, type, vfield, 0);
      if (!st) return st;
      if (!f_.kv_index_.emplace(kv.key, static_cast<std::size_t>(i)).second) {
        return fail(field + ".key", kv.file_offset, fmt::format("duplicate metadata key '{}'", kv.key));
      }
    }
    return {};
  }

  Status parse_alignment() {
    f_.alignment_ = kDefaultAlignment;
    auto it = f_.kv_index_.find("general.alignment");
    if (it == f_.kv_index_.end()) return {};
    const GgufKeyValue& kv = f_.kvs_[it->second];
    const std::string field = fmt::format("kv[{}](general.alignment)", it->second);
    if (kv.value.type() != GgufValueType::u32) {
      return fail(field, kv.file_offset,
                  fmt::format("general.alignment has type {}, expected uint32", gguf_value_type_name(kv.value.type())));
    }
    const std::uint64_t a = kv.value.as_u64();
    if (a == 0 || (a & (a - 1)) != 0) {
      return fail(field, kv.file_offset, fmt::format("general.alignment {} is not a power of two", a));
    }
    f_.alignment_ = a;
    return {};
  }

  Status parse_tensor_infos() {
    f_.tensors_.resize(static_cast<std::size_t>(tensor_count_));
    f_.tensor_index_.reserve(static_cast<std::size_t>(tensor_count_));
    for (std::uint64_t i = 0; i < tensor_count_; ++i) {
      TensorView& t = f_.tensors_[static_cast<std::size_t>(i)];
      const std::string field = fmt::format("tensor_infos[{}]", i);
      const std::uint64_t start = pos_;
      Status st = read_string(t.name, field + ".name");
      if (!st) return st;
      if (!f_.tensor_index_.emplace(t.name, static_cast<std::size_t>(i)).second) {
        return fail(field + ".name", start, fmt::format("duplicate tensor name '{}'", t.name));
      }
      std::uint32_t n_dims = 0;
      std::uint64_t at = pos_;
      st = read_field(n_dims, field + ".n_dims", "a dimension count");
      if (!st) return st;
      if (n_dims < 1 || n_dims > kMaxDims) {
        return fail(field + ".n_dims", at,
                    fmt::format("tensor '{}' has {} dimensions (1..{} allowed)", t.name, n_dims, kMaxDims));
      }
      t.n_dims = static_cast<int>(n_dims);
      std::uint64_t elements = 1;
      bool any_zero = false;
      for (std::uint32_t d = 0; d < n_dims; ++d) {
        std::uint64_t dim = 0;
        at = pos_;
        st = read_field(dim, fmt::format("{}.dims[{}]", field, d), "a dimension");
        if (!st) return st;
        if (dim > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
          return fail(fmt::format("{}.dims[{}]", field, d), at,
                      fmt::format("tensor '{}' dimension {} is {} (negative or too large)", t.name, d, dim));
        }
        if (dim == 0) any_zero = true;
        if (!any_zero && elements > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) / dim) {
          return fail(fmt::format("{}.dims[{}]", field, d), at,
                      fmt::format("tensor '{}' element count overflows (dims product > 2^63-1)", t.name));
        }
        if (!any_zero) elements *= dim;
        t.ne[d] = static_cast<std::int64_t>(dim);
      }
      std::uint32_t type = 0;
      at = pos_;
      st = read_field(type, field + ".type", "a tensor type");
      if (!st) return st;
      const auto traits = ops::ggml_type_traits(type);
      if (!traits) {
        return fail(field + ".type", at, fmt::format("tensor '{}' has unknown ggml type {}", t.name, type));
      }
      t.type = static_cast<ops::GgmlType>(type);
      if (t.ne[0] % traits->block_size != 0) {
        return fail(field + ".dims[0]", start,
                    fmt::format("tensor '{}' row length {} is not a multiple of {}'s block size {}", t.name, t.ne[0],
                                traits->name, traits->block_size));
      }
      // Bytes: (ne0 / block) * type_size * ne1 * ne2 * ne3, checked for overflow.
      std::uint64_t bytes = static_cast<std::uint64_t>(t.ne[0] / traits->block_size) *
                            static_cast<std::uint64_t>(traits->type_size);  // < 2^63 * 1/1 * 292/256
      for (int d = 1; d < 4 && bytes != 0; ++d) {
        const auto dim = static_cast<std::uint64_t>(t.ne[static_cast<std::size_t>(d)]);
        if (dim != 0 && bytes > std::numeric_limits<std::uint64_t>::max() / dim) {
          return fail(field + ".dims", start, fmt::format("tensor '{}' byte size overflows", t.name));
        }
        bytes *= dim;
      }
      if (any_zero) bytes = 0;
      t.nbytes = bytes;
      at = pos_;
      offset_field_at_.push_back(at);
      st = read_field(t.offset, field + ".offset", "a tensor data offset");
      if (!st) return st;
      if (t.offset % f_.alignment_ != 0) {
        return fail(field + ".offset", at,
                    fmt::format("tensor '{}' data offset {} is not a multiple of the alignment {}", t.name, t.offset,
                                f_.alignment_));
      }
    }
    return {};
  }

  Status place_tensors() {
    // The data section starts at the next multiple of the alignment after the tensor infos.
    const std::uint64_t a = f_.alignment_;
    const std::uint64_t end_of_infos = pos_;
    std::uint64_t data = end_of_infos + (a - end_of_infos % a) % a;
    if (data < end_of_infos) data = std::numeric_limits<std::uint64_t>::max();  // overflow
    f_.data_offset_ = data;
    std::vector<std::size_t> order;
    order.reserve(f_.tensors_.size());
    for (std::size_t i = 0; i < f_.tensors_.size(); ++i) {
      TensorView& t = f_.tensors_[i];
      const std::string field = fmt::format("tensor_infos[{}].offset", i);
      if (t.nbytes == 0) {
        t.file_offset = data;
        t.data = nullptr;
        continue;
      }
      if (data > size_ || t.offset > size_ - data || t.nbytes > size_ - data - t.offset) {
        return fail(field, offset_field_at_[i],
                    fmt::format("tensor '{}' data [{} + {}, {} bytes) lies outside the file ({} bytes; data "
                                "section starts at byte {})",
                                t.name, data, t.offset, t.nbytes, size_, data));
      }
      t.file_offset = data + t.offset;
      t.data = base_ + t.file_offset;
      order.push_back(i);
    }
    std::sort(order.begin(), order.end(),
              [&](std::size_t x, std::size_t y) { return f_.tensors_[x].offset < f_.tensors_[y].offset; });
    for (std::size_t j = 1; j < order.size(); ++j) {
      const TensorView& prev = f_.tensors_[order[j - 1]];
      const TensorView& cur = f_.tensors_[order[j]];
      if (cur.offset < prev.offset + prev.nbytes) {
        return fail(
            fmt::format("tensor_infos[{}].offset", order[j]), offset_field_at_[order[j]],
            fmt::format("tensor '{}' data overlaps tensor '{}' ([{}, {}) vs [{}, {}) in the data section)", cur.name,
                        prev.name, cur.offset, cur.offset + cur.nbytes, prev.offset, prev.offset + prev.nbytes));
      }
    }
    return {};
  }

  GgufFile& f_;
  const std::byte* base_;
  std::uint64_t size_;
  std::uint64_t pos_ = 0;
  std::uint64_t tensor_count_ = 0;
  std::uint64_t kv_count_ = 0;
  std::vector<std::uint64_t> offset_field_at_;  // where each tensor info's offset field is
};

// ---- GgufFile ----

GgufFile::~GgufFile() {
  if (map_ != nullptr) ::munmap(map_, static_cast<std::size_t>(size_));
  if (owned_ != nullptr) ::operator delete[](owned_, std::align_val_t{64});
}

Result<std::shared_ptr<const GgufFile>> GgufFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    return Status(err == ENOENT ? ErrorCode::not_found : ErrorCode::invalid_argument, "path",
                  fmt::format("cannot open model file '{}': {}", path, std::strerror(err)));
  }
  struct stat sb {};
  if (::fstat(fd, &sb) != 0) {
    const int err = errno;
    ::close(fd);
    return Status(ErrorCode::internal, "path", fmt::format("cannot stat '{}': {}", path, std::strerror(err)));
  }
  if (!S_ISREG(sb.st_mode)) {
    ::close(fd);
    return Status(ErrorCode::invalid_argument, "path", fmt::format("'{}' is not a regular file", path));
  }
  if (sb.st_size == 0) {
    ::close(fd);
    return Status(ErrorCode::parse_error, "header.magic",
                  fmt::format("at byte 0 of {} (file size 0): file is empty", path));
  }
  const auto size = static_cast<std::uint64_t>(sb.st_size);
  void* map = ::mmap(nullptr, static_cast<std::size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);
  if (map == MAP_FAILED) {
    return Status(ErrorCode::internal, "path", fmt::format("cannot mmap '{}': {}", path, std::strerror(map_err)));
  }
  std::shared_ptr<GgufFile> file(new GgufFile());
  file->path_ = path;
  file->map_ = map;
  file->base_ = static_cast<const std::byte*>(map);
  file->size_ = size;
  GgufParser parser(*file);
  Status st = parser.parse();
  if (!st) return st;
  return std::shared_ptr<const GgufFile>(std::move(file));
}

Result<std::shared_ptr<const GgufFile>> GgufFile::from_bytes(std::span<const std::byte> bytes, std::string name) {
  std::shared_ptr<GgufFile> file(new GgufFile());
  file->path_ = std::move(name);
  if (!bytes.empty()) {
    file->owned_ = static_cast<std::byte*>(::operator new[](bytes.size(), std::align_val_t{64}));
    std::memcpy(file->owned_, bytes.data(), bytes.size());
  }
  file->base_ = file->owned_;
  file->size_ = bytes.size();
  GgufParser parser(*file);
  Status st = parser.parse();
  if (!st) return st;
  return std::shared_ptr<const GgufFile>(std::move(file));
}

const GgufValue* GgufFile::find(std::string_view key) const noexcept {
  auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : &kvs_[it->second].value;
}

Result<const GgufValue*> GgufFile::get(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) {
    return Status(ErrorCode::not_found, std::string(key), fmt::format("metadata key '{}' is not in {}", key, path_));
  }
  return v;
}

namespace {

Status wrong_type(std::string_view key, const GgufValue& v, std::string_view expected) {
  std::string have(gguf_value_type_name(v.type()));
  if (v.is_array()) have = fmt::format("array of {}", gguf_value_type_name(v.element_type()));
  return {ErrorCode::invalid_argument, std::string(key),
          fmt::format("metadata key '{}' has type {}, expected {}", key, have, expected)};
}

template <typename T>
constexpr GgufValueType value_type_of() {
  if constexpr (std::is_same_v<T, std::uint8_t>) return GgufValueType::u8;
  if constexpr (std::is_same_v<T, std::int8_t>) return GgufValueType::i8;
  if constexpr (std::is_same_v<T, std::uint16_t>) return GgufValueType::u16;
  if constexpr (std::is_same_v<T, std::int16_t>) return GgufValueType::i16;
  if constexpr (std::is_same_v<T, std::uint32_t>) return GgufValueType::u32;
  if constexpr (std::is_same_v<T, std::int32_t>) return GgufValueType::i32;
  if constexpr (std::is_same_v<T, std::uint64_t>) return GgufValueType::u64;
  if constexpr (std::is_same_v<T, std::int64_t>) return GgufValueType::i64;
  if constexpr (std::is_same_v<T, float>) return GgufValueType::f32;
  if constexpr (std::is_same_v<T, double>) return GgufValueType::f64;
  if constexpr (std::is_same_v<T, bool>) return GgufValueType::boolean;
}

template <typename T>
Result<T> get_scalar(const GgufFile& f, std::string_view key) {
  auto v = f.get(key);
  if (!v) return v.status();
  constexpr GgufValueType want = value_type_of<T>();
  if ((*v)->type() != want) return wrong_type(key, **v, gguf_value_type_name(want));
  return load<T>((*v)->raw());
}

}  // namespace

Result<std::uint8_t> GgufFile::get_u8(std::string_view key) const { return get_scalar<std::uint8_t>(*this, key); }
Result<std::int8_t> GgufFile::get_i8(std::string_view key) const { return get_scalar<std::int8_t>(*this, key); }
Result<std::uint16_t> GgufFile::get_u16(std::string_view key) const { return get_scalar<std::uint16_t>(*this, key); }
Result<std::int16_t> GgufFile::get_i16(std::string_view key) const { return get_scalar<std::int16_t>(*this, key); }
Result<std::uint32_t> GgufFile::get_u32(std::string_view key) const { return get_scalar<std::uint32_t>(*this, key); }
Result<std::int32_t> GgufFile::get_i32(std::string_view key) const { return get_scalar<std::int32_t>(*this, key); }
Result<std::uint64_t> GgufFile::get_u64(std::string_view key) const { return get_scalar<std::uint64_t>(*this, key); }
Result<std::int64_t> GgufFile::get_i64(std::string_view key) const { return get_scalar<std::int64_t>(*this, key); }
Result<float> GgufFile::get_f32(std::string_view key) const { return get_scalar<float>(*this, key); }
Result<double> GgufFile::get_f64(std::string_view key) const { return get_scalar<double>(*this, key); }

Result<bool> GgufFile::get_bool(std::string_view key) const {
  auto v = get(key);
  if (!v) return v.status();
  if ((*v)->type() != GgufValueType::boolean) return wrong_type(key, **v, "bool");
  return (*v)->as_bool();
}

Result<std::string_view> GgufFile::get_string(std::string_view key) const {
  auto v = get(key);
  if (!v) return v.status();
  if ((*v)->type() != GgufValueType::string) return wrong_type(key, **v, "string");
  return (*v)->as_string();
}

Result<std::uint64_t> GgufFile::get_uint(std::string_view key) const {
  auto v = get(key);
  if (!v) return v.status();
  const GgufValue& val = **v;
  if (!val.is_integer()) return wrong_type(key, val, "an integer");
  switch (val.type()) {
    case GgufValueType::i8:
    case GgufValueType::i16:
    case GgufValueType::i32:
    case GgufValueType::i64:
      if (val.as_i64() < 0) {
        return Status(ErrorCode::invalid_argument, std::string(key),
                      fmt::format("metadata key '{}' is {}, expected a non-negative integer", key, val.as_i64()));
      }
      return static_cast<std::uint64_t>(val.as_i64());
    default: return val.as_u64();
  }
}

Result<double> GgufFile::get_float(std::string_view key) const {
  auto v = get(key);
  if (!v) return v.status();
  if (!(*v)->is_float()) return wrong_type(key, **v, "float32 or float64");
  return (*v)->as_f64();
}

Result<const GgufValue*> GgufFile::get_array(std::string_view key) const {
  auto v = get(key);
  if (!v) return v.status();
  if (!(*v)->is_array()) return wrong_type(key, **v, "array");
  return *v;
}

Result<std::span<const std::string_view>> GgufFile::get_string_array(std::string_view key) const {
  auto v = get(key);
  if (!v) return v.status();
  if (!(*v)->is_array() || (*v)->element_type() != GgufValueType::string) {
    return wrong_type(key, **v, "array of string");
  }
  return (*v)->strings();
}

template <typename T>
Result<std::vector<T>> GgufFile::get_numeric_array(std::string_view key) const {
  auto v = get(key);
  if (!v) return v.status();
  constexpr GgufValueType want = value_type_of<T>();
  if (!(*v)->is_array() || (*v)->element_type() != want) {
    return wrong_type(key, **v, fmt::format("array of {}", gguf_value_type_name(want)));
  }
  const GgufValue& val = **v;
  std::vector<T> out(static_cast<std::size_t>(val.size()));
  for (std::size_t i = 0; i < out.size(); ++i) {
    if constexpr (std::is_same_v<T, bool>) {
      out[i] = load<std::uint8_t>(val.raw() + i) != 0;
    } else {
      out[i] = load<T>(val.raw() + i * sizeof(T));
    }
  }
  return out;
}

template Result<std::vector<std::uint8_t>> GgufFile::get_numeric_array<std::uint8_t>(std::string_view) const;
template Result<std::vector<std::int8_t>> GgufFile::get_numeric_array<std::int8_t>(std::string_view) const;
template Result<std::vector<std::uint16_t>> GgufFile::get_numeric_array<std::uint16_t>(std::string_view) const;
template Result<std::vector<std::int16_t>> GgufFile::get_numeric_array<std::int16_t>(std::string_view) const;
template Result<std::vector<std::uint32_t>> GgufFile::get_numeric_array<std::uint32_t>(std::string_view) const;
template Result<std::vector<std::int32_t>> GgufFile::get_numeric_array<std::int32_t>(std::string_view) const;
template Result<std::vector<std::uint64_t>> GgufFile::get_numeric_array<std::uint64_t>(std::string_view) const;
template Result<std::vector<std::int64_t>> GgufFile::get_numeric_array<std::int64_t>(std::string_view) const;
template Result<std::vector<float>> GgufFile::get_numeric_array<float>(std::string_view) const;
template Result<std::vector<double>> GgufFile::get_numeric_array<double>(std::string_view) const;
template Result<std::vector<bool>> GgufFile::get_numeric_array<bool>(std::string_view) const;

const TensorView* GgufFile::find_tensor(std::string_view name) const noexcept {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

Result<const TensorView*> GgufFile::tensor(std::string_view name) const {
  const TensorView* t = find_tensor(name);
  if (t == nullptr) {
    return Status(ErrorCode::not_found, std::string(name), fmt::format("tensor '{}' is not in {}", name, path_));
  }
  return t;
}

Result<ops::WeightMatrix> as_weight_matrix(const TensorView& t) {
  if (t.ne[2] != 1 || t.ne[3] != 1) {
    return Status(ErrorCode::invalid_argument, std::string(t.name),
                  fmt::format("tensor '{}' of shape {} is not a matrix", t.name, t.shape_string()));
  }
  if (!is_compute_supported(t.type)) {
    return Status(ErrorCode::unsupported, std::string(t.name),
                  fmt::format("tensor '{}' has type {}, which has no kernels (supported: {})", t.name,
                              ggml_type_name(t.type), ops::compute_supported_type_names()));
  }
  ops::WeightMatrix w;
  w.type = t.type;
  w.data = t.data;
  w.cols = t.ne[0];
  w.rows = t.ne[1];
  w.row_bytes = row_size(t.type, t.ne[0]);
  return w;
}

}  // namespace kallpa::model
