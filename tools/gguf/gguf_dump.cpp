// kallpa_gguf_dump: prints what kallpa's GGUF reader sees in a file as JSON, for cross-checking
// against the independent gguf-py reader (tools/gguf/crosscheck.py). Not installed.
//
//   kallpa_gguf_dump FILE [--llama] [--dequant NAME[:ROWS]]... [--matmul NAME --x FILE.f32 --batch B [--activations
//   f32|q8]]
//
// Output: {"ok", "error"?, "version", "alignment", "data_offset", "file_size", "metadata": [...],
// "tensors": [...], "llama"?: {...}, "dequant"?: {NAME: [floats]}, "matmul"?: {NAME: [floats]}}.
// Exit status 0 when the file parsed (errors of --llama etc. are reported inside the JSON).
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kallpa/model/gguf.h"
#include "kallpa/model/llama.h"
#include "kallpa/ops/quant.h"

using nlohmann::json;
using namespace kallpa::model;
using namespace kallpa::ops;

namespace {

json status_json(const kallpa::Status& st) {
  return json{
      {"code", std::string(kallpa::error_code_name(st.code()))}, {"field", st.field()}, {"message", st.message()}};
}

json element(GgufValueType t, const std::byte* p) {
  auto get = [p](auto v) {
    std::memcpy(&v, p, sizeof v);
    return v;
  };
  switch (t) {
    case GgufValueType::u8: return get(std::uint8_t{});
    case GgufValueType::i8: return get(std::int8_t{});
    case GgufValueType::u16: return get(std::uint16_t{});
    case GgufValueType::i16: return get(std::int16_t{});
    case GgufValueType::u32: return get(std::uint32_t{});
    case GgufValueType::i32: return get(std::int32_t{});
    case GgufValueType::u64: return get(std::uint64_t{});
    case GgufValueType::i64: return get(std::int64_t{});
    case GgufValueType::f32: return static_cast<double>(get(float{}));
    case GgufValueType::f64: return get(double{});
    case GgufValueType::boolean: return get(std::uint8_t{}) != 0;
    default: return nullptr;
  }
}

std::size_t element_size(GgufValueType t) {
  switch (t) {
    case GgufValueType::u8:
    case GgufValueType::i8:
    case GgufValueType::boolean: return 1;
    case GgufValueType::u16:
    case GgufValueType::i16: return 2;
    case GgufValueType::u32:
    case GgufValueType::i32:
    case GgufValueType::f32: return 4;
    default: return 8;
  }
}

json value_json(const GgufValue& v) {
  if (v.type() == GgufValueType::string) return std::string(v.as_string());
  if (!v.is_array()) return element(v.type(), v.raw());
  json arr = json::array();
  if (v.element_type() == GgufValueType::string) {
    for (auto s : v.strings()) arr.push_back(std::string(s));
  } else if (v.element_type() == GgufValueType::array) {
    for (const auto& item : v.items())
      arr.push_back(
          json{{"element_type", std::string(gguf_value_type_name(item.element_type()))}, {"value", value_json(item)}});
  } else {
    for (std::uint64_t i = 0; i < v.size(); ++i)
      arr.push_back(element(v.element_type(), v.raw() + i * element_size(v.element_type())));
  }
  return arr;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: %s FILE [--llama] [--dequant NAME[:ROWS]]... [--matmul NAME --x FILE --batch B [--activations "
                 "f32|q8]]\n",
                 argv[0]);
    return 2;
  }
  const std::string path = argv[1];
  bool llama = false;
  std::vector<std::string> dequant;
  std::string matmul_name, x_path;
  long batch = 1;
  MatmulOptions matmul_options;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--llama") llama = true;
    else if (a == "--dequant" && i + 1 < argc) dequant.push_back(argv[++i]);
    else if (a == "--matmul" && i + 1 < argc) matmul_name = argv[++i];
    else if (a == "--x" && i + 1 < argc) x_path = argv[++i];
    else if (a == "--batch" && i + 1 < argc) batch = std::stol(argv[++i]);
    else if (a == "--activations" && i + 1 < argc) {
      const std::string v = argv[++i];
      if (v != "f32" && v != "q8") {
        std::fprintf(stderr, "--activations must be f32 or q8\n");
        return 2;
      }
      matmul_options.activations = v == "q8" ? MatmulOptions::Activations::q8 : MatmulOptions::Activations::f32;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  json out;
  auto file = GgufFile::open(path);
  if (!file) {
    out["ok"] = false;
    out["error"] = status_json(file.status());
    std::cout << out.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
    return 0;
  }
  const GgufFile& f = **file;
  out["ok"] = true;
  out["version"] = f.version();
  out["alignment"] = f.alignment();
  out["data_offset"] = f.data_offset();
  out["file_size"] = f.file_size();
  json md = json::array();
  for (const auto& kv : f.metadata()) {
    json e{{"key", std::string(kv.key)},
           {"type", std::string(gguf_value_type_name(kv.value.type()))},
           {"value", value_json(kv.value)}};
    if (kv.value.is_array()) e["element_type"] = std::string(gguf_value_type_name(kv.value.element_type()));
    md.push_back(std::move(e));
  }
  out["metadata"] = std::move(md);
  json ts = json::array();
  for (const auto& t : f.tensors()) {
    ts.push_back(json{{"name", std::string(t.name)},
                      {"type", std::string(ggml_type_name(t.type))},
                      {"ne", std::vector<std::int64_t>(t.ne.begin(), t.ne.begin() + t.n_dims)},
                      {"offset", t.offset},
                      {"file_offset", t.file_offset},
                      {"nbytes", t.nbytes}});
  }
  out["tensors"] = std::move(ts);
  if (llama) {
    LlamaWeights w;
    auto cfg = load_llama_config(f, &w);
    if (!cfg) {
      out["llama"] = json{{"error", status_json(cfg.status())}};
    } else {
      out["llama"] = json{{"n_layer", cfg->n_layer},
                          {"n_embd", cfg->n_embd},
                          {"n_ff", cfg->n_ff},
                          {"n_head", cfg->n_head},
                          {"n_head_kv", cfg->n_head_kv},
                          {"head_dim", cfg->head_dim},
                          {"n_rot", cfg->n_rot},
                          {"vocab_size", cfg->vocab_size},
                          {"context_length", cfg->context_length},
                          {"rope_freq_base", cfg->rope_freq_base},
                          {"rms_norm_eps", cfg->rms_norm_eps},
                          {"tied_embeddings", cfg->tied_embeddings}};
    }
  }
  for (const std::string& spec : dequant) {
    const auto colon = spec.find(':');
    const std::string name = spec.substr(0, colon);
    auto t = f.tensor(name);
    if (!t) {
      out["dequant_error"][name] = status_json(t.status());
      continue;
    }
    const TensorView& tv = **t;
    std::int64_t rows = tv.nrows();
    if (colon != std::string::npos) rows = std::min<std::int64_t>(rows, std::stol(spec.substr(colon + 1)));
    std::vector<float> v(static_cast<std::size_t>(rows * tv.ne[0]));
    const auto st = dequantize_row(tv.type, tv.data, v.data(), rows * tv.ne[0]);
    if (!st) {
      out["dequant_error"][name] = status_json(st);
      continue;
    }
    out["dequant"][name] = v;
  }
  if (!matmul_name.empty()) {
    auto t = f.tensor(matmul_name);
    if (!t) {
      out["matmul_error"] = status_json(t.status());
    } else {
      auto wm = as_weight_matrix(**t);
      if (!wm) {
        out["matmul_error"] = status_json(wm.status());
      } else {
        std::vector<float> x(static_cast<std::size_t>(batch * wm->cols));
        std::ifstream in(x_path, std::ios::binary);
        in.read(reinterpret_cast<char*>(x.data()), static_cast<std::streamsize>(x.size() * sizeof(float)));
        if (!in) {
          std::fprintf(stderr, "cannot read %zu floats from %s\n", x.size(), x_path.c_str());
          return 1;
        }
        std::vector<float> y(static_cast<std::size_t>(batch * wm->rows));
        const auto st = matmul(*wm, x.data(), batch, wm->cols, y.data(), wm->rows, matmul_options);
        if (!st) out["matmul_error"] = status_json(st);
        else out["matmul"] = y;
        out["quant_isa"] = std::string(quant_kernel_isa());
      }
    }
  }
  std::cout << out.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
  return 0;
}
