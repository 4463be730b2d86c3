#include "support/gguf_writer.h"

#include <cerrno>
#include <cstdio>
#include <fstream>

#include <fmt/format.h>

namespace kallpa::model {

void GgufWriter::put_string(std::vector<std::byte>& out, std::string_view s) {
  put(out, static_cast<std::uint64_t>(s.size()));
  const std::size_t at = out.size();
  out.resize(at + s.size());
  if (!s.empty()) std::memcpy(out.data() + at, s.data(), s.size());
}

void GgufWriter::add_string(std::string_view key, std::string_view v) {
  std::vector<std::byte> raw;
  put_string(raw, v);
  add_raw(key, GgufValueType::string, std::move(raw));
}

void GgufWriter::add_string_array(std::string_view key, const std::vector<std::string>& v) {
  std::vector<std::byte> raw;
  put(raw, static_cast<std::uint32_t>(GgufValueType::string));
  put(raw, static_cast<std::uint64_t>(v.size()));
  for (const auto& s : v) put_string(raw, s);
  add_raw(key, GgufValueType::array, std::move(raw));
}

void GgufWriter::add_raw(std::string_view key, GgufValueType type, std::vector<std::byte> value_bytes) {
  kvs_.push_back(Kv{std::string(key), type, std::move(value_bytes)});
}

void GgufWriter::add_tensor(std::string_view name, std::uint32_t type, std::vector<std::int64_t> ne,
                            std::vector<std::byte> data) {
  tensors_.push_back(Tensor{std::string(name), type, std::move(ne), std::move(data)});
}

bool GgufWriter::remove_kv(std::string_view key) {
  for (auto it = kvs_.begin(); it != kvs_.end(); ++it) {
    if (it->key == key) {
      kvs_.erase(it);
      return true;
    }
  }
  return false;
}

bool GgufWriter::remove_tensor(std::string_view name) {
  for (auto it = tensors_.begin(); it != tensors_.end(); ++it) {
    if (it->name == name) {
      tensors_.erase(it);
      return true;
    }
  }
  return false;
}

bool GgufWriter::replace_tensor(std::string_view name, std::uint32_t type, std::vector<std::int64_t> ne,
                                std::vector<std::byte> data) {
  for (auto& t : tensors_) {
    if (t.name == name) {
      t.type = type;
      t.ne = std::move(ne);
      t.data = std::move(data);
      return true;
    }
  }
  return false;
}

std::vector<std::byte> GgufWriter::finish(Layout* layout) const {
  Layout lay;
  std::vector<std::byte> out;
  put(out, static_cast<std::uint32_t>(0x46554747u));
  put(out, version_);
  put(out, static_cast<std::uint64_t>(tensors_.size()));
  put(out, static_cast<std::uint64_t>(kvs_.size()));
  for (const Kv& kv : kvs_) {
    lay.kv_at.push_back(out.size());
    put_string(out, kv.key);
    put(out, static_cast<std::uint32_t>(kv.type));
    lay.kv_value_at.push_back(out.size());
    out.insert(out.end(), kv.value.begin(), kv.value.end());
  }
  const std::uint64_t a = alignment_ == 0 ? 1 : alignment_;
  auto align_up = [a](std::uint64_t x) { return x + (a - x % a) % a; };
  std::uint64_t offset = 0;
  std::vector<std::uint64_t> offsets;
  for (const Tensor& t : tensors_) {
    TensorLayout tl;
    tl.info_at = out.size();
    put_string(out, t.name);
    tl.n_dims_at = out.size();
    put(out, static_cast<std::uint32_t>(t.ne.size()));
    tl.dims_at = out.size();
    for (std::int64_t d : t.ne) put(out, static_cast<std::uint64_t>(d));
    tl.type_at = out.size();
    put(out, t.type);
    tl.offset_at = out.size();
    put(out, offset);
    offsets.push_back(offset);
    offset = align_up(offset + t.data.size());
    lay.tensors.push_back(tl);
  }
  lay.data_at = align_up(out.size());
  out.resize(static_cast<std::size_t>(lay.data_at), std::byte{0});
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const auto& d = tensors_[i].data;
    lay.tensors[i].data_at = lay.data_at + offsets[i];
    out.resize(static_cast<std::size_t>(lay.data_at + offsets[i]), std::byte{0});
    out.insert(out.end(), d.begin(), d.end());
  }
  out.resize(static_cast<std::size_t>(align_up(out.size())), std::byte{0});
  if (layout != nullptr) *layout = std::move(lay);
  return out;
}

Status GgufWriter::write_file(const std::string& path) const {
  const std::vector<std::byte> bytes = finish();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return {ErrorCode::internal, "path", fmt::format("cannot create '{}'", path)};
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!f) return {ErrorCode::internal, "path", fmt::format("cannot write '{}'", path)};
  return {};
}

}  // namespace kallpa::model
