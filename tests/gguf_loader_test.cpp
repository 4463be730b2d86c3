// GGUF loader: every metadata type, tensor views, alignment, versions, and corrupt files (each must
// give parse_error naming the field, never a crash or a read past the image; run under ASan in the
// Sanitize build).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "kallpa/model/gguf.h"
#include "support/gguf_writer.h"

namespace {

using kallpa::ErrorCode;
using kallpa::model::GgufFile;
using kallpa::model::GgufValueType;
using kallpa::model::GgufWriter;
using kallpa::ops::GgmlType;

using Bytes = std::vector<std::byte>;

template <typename T>
void poke(Bytes& b, std::uint64_t at, T v) {
  ASSERT_LE(at + sizeof(T), b.size());
  std::memcpy(b.data() + at, &v, sizeof(T));
}

Bytes f32_bytes(const std::vector<float>& v) {
  Bytes out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

Bytes filled(std::size_t n, std::uint8_t seed) {
  Bytes out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>((i * 31 + seed) & 0xff);
  return out;
}

// A small file with two tensors and a handful of keys.
GgufWriter small_writer() {
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_u32("test.u32", 7);
  w.add_string_array("test.strings", {"a", "bc", ""});
  w.add_tensor("a.weight", GgmlType::f32, {8, 2}, f32_bytes({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}));
  w.add_tensor("b.weight", GgmlType::q8_0, {64, 3}, filled(3 * 2 * 34, 5));
  return w;
}

void expect_parse_error(const Bytes& bytes, const std::string& field, const std::string& in_message = "") {
  auto f = GgufFile::from_bytes(bytes);
  ASSERT_FALSE(f.is_ok()) << "expected a parse error at " << field;
  EXPECT_EQ(f.status().code(), ErrorCode::parse_error) << f.status().to_string();
  EXPECT_EQ(f.status().field(), field) << f.status().to_string();
  EXPECT_NE(f.status().message().find("at byte "), std::string::npos) << f.status().to_string();
  if (!in_message.empty()) {
    EXPECT_NE(f.status().message().find(in_message), std::string::npos) << f.status().to_string();
  }
}

TEST(GgufLoader, ReadsEveryMetadataType) {
  GgufWriter w;
  w.add_u8("t.u8", 200);
  w.add_i8("t.i8", -100);
  w.add_u16("t.u16", 60000);
  w.add_i16("t.i16", -30000);
  w.add_u32("t.u32", 4000000000u);
  w.add_i32("t.i32", -2000000000);
  w.add_u64("t.u64", 0xfedcba9876543210ull);
  w.add_i64("t.i64", -9000000000000000000ll);
  w.add_f32("t.f32", 1.5f);
  w.add_f64("t.f64", -2.25);
  w.add_bool("t.bool", true);
  w.add_string("t.string", "héllo");
  w.add_string("t.empty", "");
  w.add_array("t.arr_i32", GgufValueType::i32, std::vector<std::int32_t>{1, -2, 3});
  w.add_array("t.arr_f32", GgufValueType::f32, std::vector<float>{0.5f, -1.0f});
  w.add_array("t.arr_u8", GgufValueType::u8, std::vector<std::uint8_t>{});
  w.add_array("t.arr_bool", GgufValueType::boolean, std::vector<std::uint8_t>{1, 0, 1});
  w.add_array("t.arr_f64", GgufValueType::f64, std::vector<double>{1e300});
  w.add_string_array("t.arr_str", {"x", "", "yz"});
  {  // [[1, 2], [3]] as array of array of u16, and [["a"], []] as array of array of string
    Bytes raw;
    GgufWriter::put(raw, static_cast<std::uint32_t>(GgufValueType::array));
    GgufWriter::put(raw, std::uint64_t{2});
    GgufWriter::put(raw, static_cast<std::uint32_t>(GgufValueType::u16));
    GgufWriter::put(raw, std::uint64_t{2});
    GgufWriter::put(raw, std::uint16_t{1});
    GgufWriter::put(raw, std::uint16_t{2});
    GgufWriter::put(raw, static_cast<std::uint32_t>(GgufValueType::u16));
    GgufWriter::put(raw, std::uint64_t{1});
    GgufWriter::put(raw, std::uint16_t{3});
    w.add_raw("t.nested", GgufValueType::array, raw);
    Bytes raw2;
    GgufWriter::put(raw2, static_cast<std::uint32_t>(GgufValueType::array));
    GgufWriter::put(raw2, std::uint64_t{2});
    GgufWriter::put(raw2, static_cast<std::uint32_t>(GgufValueType::string));
    GgufWriter::put(raw2, std::uint64_t{1});
    GgufWriter::put_string(raw2, "a");
    GgufWriter::put(raw2, static_cast<std::uint32_t>(GgufValueType::string));
    GgufWriter::put(raw2, std::uint64_t{0});
    w.add_raw("t.nested_str", GgufValueType::array, raw2);
  }
  auto f = GgufFile::from_bytes(w.finish());
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  const GgufFile& g = **f;
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(g.alignment(), 32u);
  EXPECT_EQ(g.metadata().size(), 21u);
  EXPECT_EQ(g.metadata()[0].key, "t.u8");
  EXPECT_EQ(*g.get_u8("t.u8"), 200);
  EXPECT_EQ(*g.get_i8("t.i8"), -100);
  EXPECT_EQ(*g.get_u16("t.u16"), 60000);
  EXPECT_EQ(*g.get_i16("t.i16"), -30000);
  EXPECT_EQ(*g.get_u32("t.u32"), 4000000000u);
  EXPECT_EQ(*g.get_i32("t.i32"), -2000000000);
  EXPECT_EQ(*g.get_u64("t.u64"), 0xfedcba9876543210ull);
  EXPECT_EQ(*g.get_i64("t.i64"), -9000000000000000000ll);
  EXPECT_EQ(*g.get_f32("t.f32"), 1.5f);
  EXPECT_EQ(*g.get_f64("t.f64"), -2.25);
  EXPECT_TRUE(*g.get_bool("t.bool"));
  EXPECT_EQ(*g.get_string("t.string"), "héllo");
  EXPECT_EQ(*g.get_string("t.empty"), "");
  EXPECT_EQ(*g.get_uint("t.u8"), 200u);
  EXPECT_EQ(*g.get_uint("t.u64"), 0xfedcba9876543210ull);
  EXPECT_EQ(*g.get_float("t.f32"), 1.5);
  EXPECT_EQ(*g.get_float("t.f64"), -2.25);
  EXPECT_EQ(*g.get_numeric_array<std::int32_t>("t.arr_i32"), (std::vector<std::int32_t>{1, -2, 3}));
  EXPECT_EQ(*g.get_numeric_array<float>("t.arr_f32"), (std::vector<float>{0.5f, -1.0f}));
  EXPECT_TRUE(g.get_numeric_array<std::uint8_t>("t.arr_u8")->empty());
  EXPECT_EQ(*g.get_numeric_array<bool>("t.arr_bool"), (std::vector<bool>{true, false, true}));
  EXPECT_EQ(*g.get_numeric_array<double>("t.arr_f64"), (std::vector<double>{1e300}));
  auto strs = g.get_string_array("t.arr_str");
  ASSERT_TRUE(strs.is_ok());
  ASSERT_EQ(strs->size(), 3u);
  EXPECT_EQ((*strs)[0], "x");
  EXPECT_EQ((*strs)[1], "");
  EXPECT_EQ((*strs)[2], "yz");
  auto nested = g.get_array("t.nested");
  ASSERT_TRUE(nested.is_ok());
  ASSERT_EQ((*nested)->element_type(), GgufValueType::array);
  ASSERT_EQ((*nested)->items().size(), 2u);
  EXPECT_EQ((*nested)->items()[0].element_type(), GgufValueType::u16);
  EXPECT_EQ((*nested)->items()[0].size(), 2u);
  EXPECT_EQ((*nested)->items()[1].size(), 1u);
  std::uint16_t third = 0;
  std::memcpy(&third, (*nested)->items()[1].raw(), 2);
  EXPECT_EQ(third, 3);
  auto nested_str = g.get_array("t.nested_str");
  ASSERT_TRUE(nested_str.is_ok());
  EXPECT_EQ((*nested_str)->items()[0].strings()[0], "a");
  EXPECT_TRUE((*nested_str)->items()[1].strings().empty());
  EXPECT_EQ((*nested)->to_string(), "[2 x array]");

  // Typed errors.
  auto missing = g.get_u32("t.nope");
  EXPECT_EQ(missing.status().code(), ErrorCode::not_found);
  EXPECT_EQ(missing.status().field(), "t.nope");
  auto wrong = g.get_u32("t.string");
  EXPECT_EQ(wrong.status().code(), ErrorCode::invalid_argument);
  EXPECT_EQ(wrong.status().field(), "t.string");
  EXPECT_NE(wrong.status().message().find("has type string, expected uint32"), std::string::npos);
  EXPECT_EQ(g.get_u32("t.u64").status().code(), ErrorCode::invalid_argument);  // strict
  EXPECT_EQ(g.get_uint("t.i8").status().code(), ErrorCode::invalid_argument);  // negative
  EXPECT_EQ(g.get_uint("t.f32").status().code(), ErrorCode::invalid_argument);
  EXPECT_EQ(g.get_string_array("t.arr_i32").status().code(), ErrorCode::invalid_argument);
  EXPECT_EQ(g.get_numeric_array<std::uint32_t>("t.arr_i32").status().code(), ErrorCode::invalid_argument);
  EXPECT_EQ(g.get_array("t.u8").status().code(), ErrorCode::invalid_argument);
}

TEST(GgufLoader, TensorViewsPointIntoTheFile) {
  Bytes bytes = small_writer().finish();
  auto f = GgufFile::from_bytes(bytes);
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  const GgufFile& g = **f;
  ASSERT_EQ(g.tensors().size(), 2u);
  EXPECT_EQ(g.data_offset() % 32, 0u);
  auto a = g.tensor("a.weight");
  ASSERT_TRUE(a.is_ok());
  EXPECT_EQ((*a)->type, GgmlType::f32);
  EXPECT_EQ((*a)->n_dims, 2);
  EXPECT_EQ((*a)->ne[0], 8);
  EXPECT_EQ((*a)->ne[1], 2);
  EXPECT_EQ((*a)->nbytes, 64u);
  EXPECT_EQ((*a)->nrows(), 2);
  EXPECT_EQ((*a)->row_bytes(), 32u);
  EXPECT_EQ((*a)->shape_string(), "[8, 2]");
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>((*a)->data) % 32, 0u);
  float v[16];
  std::memcpy(v, (*a)->data, sizeof v);
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[15], 16.0f);
  auto b = g.tensor("b.weight");
  ASSERT_TRUE(b.is_ok());
  EXPECT_EQ((*b)->type, GgmlType::q8_0);
  EXPECT_EQ((*b)->nbytes, 3u * 2 * 34);
  EXPECT_EQ((*b)->offset, 64u);
  EXPECT_EQ((*b)->file_offset, g.data_offset() + 64);
  EXPECT_EQ(std::memcmp((*b)->data, filled(3 * 2 * 34, 5).data(), (*b)->nbytes), 0);
  auto none = g.tensor("c.weight");
  EXPECT_EQ(none.status().code(), ErrorCode::not_found);
  EXPECT_EQ(none.status().field(), "c.weight");
}

TEST(GgufLoader, CustomAlignmentAndVersion2) {
  GgufWriter w(2);
  w.set_alignment(64);
  w.add_u32("general.alignment", 64);
  w.add_tensor("x", GgmlType::f32, {3}, f32_bytes({1, 2, 3}));
  w.add_tensor("y", GgmlType::f16, {5}, filled(10, 1));
  auto f = GgufFile::from_bytes(w.finish());
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_EQ((*f)->version(), 2u);
  EXPECT_EQ((*f)->alignment(), 64u);
  EXPECT_EQ((*f)->data_offset() % 64, 0u);
  EXPECT_EQ((*f)->tensor("y").value()->offset, 64u);
}

TEST(GgufLoader, OpensFilesByMmap) {
  const auto path =
      std::filesystem::temp_directory_path() / ("kallpa_gguf_test_" + std::to_string(::getpid()) + ".gguf");
  ASSERT_TRUE(small_writer().write_file(path.string()).is_ok());
  auto f = GgufFile::open(path.string());
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_EQ((*f)->path(), path.string());
  EXPECT_EQ(*(*f)->get_u32("test.u32"), 7u);
  EXPECT_EQ((*f)->tensor("a.weight").value()->nbytes, 64u);
  f = kallpa::Result<std::shared_ptr<const GgufFile>>(kallpa::Status(ErrorCode::internal, "", ""));  // unmap
  std::filesystem::remove(path);

  auto missing = GgufFile::open(path.string());
  EXPECT_EQ(missing.status().code(), ErrorCode::not_found);
  auto dir = GgufFile::open(std::filesystem::temp_directory_path().string());
  EXPECT_EQ(dir.status().code(), ErrorCode::invalid_argument);
}

TEST(GgufLoader, RejectsBadHeaders) {
  expect_parse_error({}, "header.magic", "too short");
  Bytes good = small_writer().finish();

  Bytes b = good;
  poke(b, 0, std::uint32_t{0x46554746});  // "FUGF"
  expect_parse_error(b, "header.magic", "not a GGUF file");

  b = good;
  poke(b, 4, std::uint32_t{1});
  expect_parse_error(b, "header.version", "unsupported GGUF version 1");
  b = good;
  poke(b, 4, std::uint32_t{4});
  expect_parse_error(b, "header.version");

  b = good;
  poke(b, 8, std::uint64_t{1} << 40);
  expect_parse_error(b, "header.tensor_count", "cannot fit");
  b = good;
  poke(b, 16, ~std::uint64_t{0});
  expect_parse_error(b, "header.kv_count", "cannot fit");
  b = good;
  poke(b, 16, std::uint64_t{4});  // one more key than there is: the tensor infos are read as a key
  auto f = GgufFile::from_bytes(b);
  EXPECT_EQ(f.status().code(), ErrorCode::parse_error) << f.status().to_string();
}

TEST(GgufLoader, RejectsBadMetadata) {
  GgufWriter::Layout lay;
  Bytes good = small_writer().finish(&lay);

  Bytes b = good;
  poke(b, lay.kv_at[1], std::uint64_t{1} << 50);  // key length
  expect_parse_error(b, "kv[1].key.length", "exceeds");

  b = good;
  poke(b, lay.kv_value_at[1] - 4, std::uint32_t{13});  // value type
  expect_parse_error(b, "kv[1](test.u32).type", "unknown metadata value type 13");

  b = good;
  poke(b, lay.kv_value_at[2] + 4, std::uint64_t{1} << 61);  // string array count
  expect_parse_error(b, "kv[2](test.strings).count", "cannot fit");

  b = good;
  poke(b, lay.kv_value_at[2] + 12, std::uint64_t{1000000});  // length of the first string
  expect_parse_error(b, "kv[2](test.strings)[0].length", "exceeds");

  b = good;
  poke(b, lay.kv_value_at[2], std::uint32_t{99});  // element type
  expect_parse_error(b, "kv[2](test.strings).element_type", "unknown array element type 99");

  GgufWriter w;
  w.add_bool("t.bool", true);
  w.add_u32("t.dup", 1);
  w.add_u32("t.dup", 2);
  Bytes d = w.finish(&lay);
  expect_parse_error(d, "kv[2].key", "duplicate metadata key 't.dup'");
  poke(d, lay.kv_value_at[0], std::uint8_t{2});
  expect_parse_error(d, "kv[0](t.bool)", "neither 0 nor 1");

  GgufWriter a;
  a.add_string("general.alignment", "32");
  expect_parse_error(a.finish(), "kv[0](general.alignment)", "expected uint32");
  GgufWriter a2;
  a2.add_u32("general.alignment", 48);
  expect_parse_error(a2.finish(), "kv[0](general.alignment)", "not a power of two");
  GgufWriter a3;
  a3.add_u32("general.alignment", 0);
  expect_parse_error(a3.finish(), "kv[0](general.alignment)", "not a power of two");

  // Arrays nested 17 deep.
  Bytes raw;
  for (int i = 0; i < 17; ++i) {
    GgufWriter::put(raw, static_cast<std::uint32_t>(GgufValueType::array));
    GgufWriter::put(raw, std::uint64_t{1});
  }
  GgufWriter::put(raw, static_cast<std::uint32_t>(GgufValueType::u8));
  GgufWriter::put(raw, std::uint64_t{0});
  GgufWriter deep;
  deep.add_raw("t.deep", GgufValueType::array, raw);
  auto f = GgufFile::from_bytes(deep.finish());
  ASSERT_FALSE(f.is_ok());
  EXPECT_EQ(f.status().code(), ErrorCode::parse_error);
  EXPECT_NE(f.status().message().find("nested deeper than 16"), std::string::npos) << f.status().to_string();
}

TEST(GgufLoader, RejectsBadTensorInfos) {
  GgufWriter::Layout lay;
  Bytes good = small_writer().finish(&lay);
  const auto& t1 = lay.tensors[1];

  Bytes b = good;
  poke(b, t1.type_at, std::uint32_t{5});  // removed Q4_2
  expect_parse_error(b, "tensor_infos[1].type", "unknown ggml type 5");
  b = good;
  poke(b, t1.type_at, std::uint32_t{1000});
  expect_parse_error(b, "tensor_infos[1].type", "unknown ggml type 1000");

  b = good;
  poke(b, t1.n_dims_at, std::uint32_t{5});
  expect_parse_error(b, "tensor_infos[1].n_dims", "5 dimensions");
  b = good;
  poke(b, t1.n_dims_at, std::uint32_t{0});
  expect_parse_error(b, "tensor_infos[1].n_dims");

  b = good;
  poke(b, t1.dims_at, ~std::uint64_t{0});  // -1 as int64
  expect_parse_error(b, "tensor_infos[1].dims[0]", "negative or too large");
  b = good;
  poke(b, t1.dims_at, std::uint64_t{1} << 40);
  poke(b, t1.dims_at + 8, std::uint64_t{1} << 40);
  expect_parse_error(b, "tensor_infos[1].dims[1]", "overflows");

  b = good;
  poke(b, t1.dims_at, std::uint64_t{48});  // Q8_0 rows must be a multiple of 32
  expect_parse_error(b, "tensor_infos[1].dims[0]", "not a multiple of Q8_0's block size 32");

  b = good;
  poke(b, t1.offset_at, std::uint64_t{40});
  expect_parse_error(b, "tensor_infos[1].offset", "not a multiple of the alignment 32");

  b = good;
  poke(b, t1.offset_at, std::uint64_t{1} << 20);
  expect_parse_error(b, "tensor_infos[1].offset", "outside the file");
  b = good;
  poke(b, t1.offset_at, ~std::uint64_t{0} - 31);  // aligned, overflows when added
  expect_parse_error(b, "tensor_infos[1].offset", "outside the file");

  b = good;
  poke(b, t1.offset_at, std::uint64_t{32});  // overlaps a.weight's 64 bytes
  expect_parse_error(b, "tensor_infos[1].offset", "overlaps tensor 'a.weight'");

  b = good;
  poke(b, t1.dims_at + 8, std::uint64_t{4});  // one row more than the data holds
  expect_parse_error(b, "tensor_infos[1].offset", "outside the file");

  b = good;
  poke(b, t1.info_at + 8, 'a');  // "b.weight" -> "a.weight"
  expect_parse_error(b, "tensor_infos[1].name", "duplicate tensor name 'a.weight'");

  b = good;
  poke(b, t1.info_at, std::uint64_t{1} << 33);
  expect_parse_error(b, "tensor_infos[1].name.length", "exceeds");

  // Truncated data section.
  b = good;
  b.resize(static_cast<std::size_t>(t1.data_at + 10));
  expect_parse_error(b, "tensor_infos[1].offset", "outside the file");
}

// Every prefix of a valid file is rejected with a parse error (or, for a prefix that still holds
// the whole header and data, accepted) -- and nothing reads past the end (ASan checks this, the
// copy in from_bytes is exactly the prefix).
TEST(GgufLoader, EveryTruncationIsATypedError) {
  GgufWriter::Layout lay;
  const Bytes good = small_writer().finish(&lay);
  const std::uint64_t needed = lay.tensors[1].data_at + 3 * 2 * 34;
  for (std::size_t n = 0; n < good.size(); ++n) {
    Bytes b(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n));
    auto f = GgufFile::from_bytes(b);
    if (n >= needed) {
      EXPECT_TRUE(f.is_ok()) << n << ": " << f.status().to_string();
    } else {
      ASSERT_FALSE(f.is_ok()) << "prefix of " << n << " bytes accepted";
      EXPECT_EQ(f.status().code(), ErrorCode::parse_error) << n;
      EXPECT_FALSE(f.status().field().empty());
    }
  }
}

// Random byte corruption anywhere in the header never crashes; the result is either a valid file
// or a parse error.
TEST(GgufLoader, RandomCorruptionNeverCrashes) {
  GgufWriter::Layout lay;
  const Bytes good = small_writer().finish(&lay);
  std::mt19937_64 rng(1234);
  int accepted = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    Bytes b = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < flips; ++i) {
      const std::size_t at = static_cast<std::size_t>(rng() % lay.data_at);
      b[at] = static_cast<std::byte>(rng() & 0xff);
    }
    auto f = GgufFile::from_bytes(b);
    if (f.is_ok()) {
      ++accepted;
      for (const auto& t : (*f)->tensors()) {
        ASSERT_LE(t.file_offset + t.nbytes, b.size());
      }
    } else {
      EXPECT_EQ(f.status().code(), ErrorCode::parse_error);
    }
  }
  EXPECT_LT(accepted, 3000);
}

}  // namespace
