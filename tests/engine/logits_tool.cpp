// Test helper for the NumPy cross-checks: writes the synthetic Llama fixture, prints the logits
// of the last of the given tokens as a JSON array, or (--all-positions) the logits of every
// position (JSON), computed by the model alone (no tokenizer, so that any architecture's file
// runs), in chunks of N tokens (default: one prefill; 1: decode steps), and N greedy tokens after.
//
//   kallpa_logits_tool --write-synthetic OUT.gguf [--matrix-type q4_1|q8_0|q4_0|f16|f32]
//   kallpa_logits_tool MODEL.gguf ID [ID ...]
//   kallpa_logits_tool --all-positions [--chunk N] [--top K] [--generate N] MODEL.gguf ID [ID ...]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "kallpa/runtime/engine.h"
#include "support/synthetic_llama.h"

namespace {

void print_row(const float* row, std::int64_t vocab, std::int64_t top) {
  if (top <= 0) {
    std::printf("[");
    for (std::int64_t i = 0; i < vocab; ++i) std::printf("%s%.7g", i ? "," : "", double(row[i]));
    std::printf("]");
    return;
  }
  std::vector<std::int32_t> ids(static_cast<std::size_t>(vocab));
  for (std::int64_t i = 0; i < vocab; ++i) ids[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i);
  top = std::min(top, vocab);
  std::partial_sort(ids.begin(), ids.begin() + top, ids.end(),
                    [&](std::int32_t a, std::int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
  std::printf("[");
  for (std::int64_t i = 0; i < top; ++i) {
    const std::int32_t id = ids[static_cast<std::size_t>(i)];
    std::printf("%s[%d,%.7g]", i ? "," : "", id, double(row[id]));
  }
  std::printf("]");
}

// Every position's logits, chunk by chunk through LlamaModel::forward with all_logits; then, with
// --generate N, N greedy decode steps. Prints {"logits": [per position], "generated": [ids]}, each
// position's row in full or, with --top K, as its K best [id, logit] pairs.
int all_positions(int argc, char** argv) {
  using namespace kallpa;
  int arg = 2;
  std::int64_t chunk = 0, top = 0, generate = 0;
  for (; arg + 1 < argc && std::strncmp(argv[arg], "--", 2) == 0; arg += 2) {
    const std::int64_t value = std::atoll(argv[arg + 1]);
    if (std::strcmp(argv[arg], "--chunk") == 0) {
      chunk = value;
    } else if (std::strcmp(argv[arg], "--top") == 0) {
      top = value;
    } else if (std::strcmp(argv[arg], "--generate") == 0) {
      generate = value;
    } else {
      std::fprintf(stderr, "unknown option %s\n", argv[arg]);
      return 2;
    }
  }
  if (arg + 1 >= argc) {
    std::fprintf(stderr, "usage: %s --all-positions [--chunk N] [--top K] [--generate N] MODEL.gguf ID...\n", argv[0]);
    return 2;
  }
  auto file = model::GgufFile::open(argv[arg]);
  if (!file) {
    std::fprintf(stderr, "%s\n", file.status().to_string().c_str());
    return 1;
  }
  std::vector<std::int32_t> ids;
  for (int i = arg + 1; i < argc; ++i) ids.push_back(std::atoi(argv[i]));
  auto ops = ops::make_cpu_ops();
  auto m = model::LlamaModel::load(*file, *ops);
  if (!m) {
    std::fprintf(stderr, "%s\n", m.status().to_string().c_str());
    return 1;
  }
  const auto n = static_cast<std::int64_t>(ids.size());
  auto cache = (*m)->make_cache({.page_size = 16, .max_tokens = n + generate + 16});
  if (!cache) {
    std::fprintf(stderr, "%s\n", cache.status().to_string().c_str());
    return 1;
  }
  Dispatcher dispatcher;
  const ops::SeqId seq = (*cache)->add_sequence();
  if (chunk <= 0) chunk = n;
  const std::int64_t vocab = (*m)->config().vocab_size;
  std::vector<float> logits(static_cast<std::size_t>((n + generate) * vocab));
  auto run = [&](std::int64_t done, std::int64_t count) {
    model::ForwardItem item;
    item.seq = seq;
    item.tokens =
        std::span<const std::int32_t>(ids).subspan(static_cast<std::size_t>(done), static_cast<std::size_t>(count));
    item.start_pos = done;
    item.all_logits = true;
    Status s = (*cache)->reserve(seq, done + count);
    if (s) s = (*m)->forward({&item, 1}, **cache, dispatcher, logits.data() + done * vocab);
    if (!s) std::fprintf(stderr, "%s\n", s.to_string().c_str());
    return s.is_ok();
  };
  for (std::int64_t done = 0; done < n; done += chunk) {
    if (!run(done, std::min(chunk, n - done))) return 1;
  }
  for (std::int64_t g = 0; g < generate; ++g) {
    const float* last = logits.data() + (n + g - 1) * vocab;
    ids.push_back(static_cast<std::int32_t>(std::max_element(last, last + vocab) - last));
    if (g + 1 < generate && !run(n + g, 1)) return 1;
  }
  std::printf("{\"logits\":[");
  const std::int64_t rows = n + std::max<std::int64_t>(generate - 1, 0);
  for (std::int64_t t = 0; t < rows; ++t) {
    if (t) std::printf(",");
    print_row(logits.data() + t * vocab, vocab, top);
  }
  std::printf("],\"generated\":[");
  for (std::int64_t g = 0; g < generate; ++g) std::printf("%s%d", g ? "," : "", ids[static_cast<std::size_t>(n + g)]);
  std::printf("]}\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kallpa;
  if (argc >= 2 && std::strcmp(argv[1], "--all-positions") == 0) return all_positions(argc, argv);
  if (argc >= 3 && std::strcmp(argv[1], "--write-synthetic") == 0) {
    model::SyntheticLlamaSpec spec;
    if (argc >= 5 && std::strcmp(argv[3], "--matrix-type") == 0) {
      const std::string t = argv[4];
      spec.matrix_type = t == "q8_0"   ? ops::GgmlType::q8_0
                         : t == "q4_0" ? ops::GgmlType::q4_0
                         : t == "f16"  ? ops::GgmlType::f16
                         : t == "f32"  ? ops::GgmlType::f32
                                       : ops::GgmlType::q4_1;
    }
    const auto bytes = model::synthetic_llama(spec);
    std::ofstream out(argv[2], std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    return out ? 0 : 1;
  }
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s MODEL.gguf ID [ID ...] | --write-synthetic OUT.gguf\n", argv[0]);
    return 2;
  }
  runtime::EngineOptions options;
  options.model_path = argv[1];
  options.cache.max_tokens = 1024;
  // KALLPA_DEVICE runs the model on a device, strictly: every op there, none on the CPU.
  if (const char* device = std::getenv("KALLPA_DEVICE"); device != nullptr && *device != '\0') {
    options.device = device;
    options.strict_device = true;
  }
  auto engine = runtime::Engine::load(options);
  if (!engine) {
    std::fprintf(stderr, "%s\n", engine.status().to_string().c_str());
    const bool absent = engine.status().code() == ErrorCode::unsupported && engine.status().field() == "device";
    return absent ? 77 : 1;
  }
  std::vector<std::int32_t> ids;
  for (int i = 2; i < argc; ++i) ids.push_back(std::atoi(argv[i]));
  runtime::Session session(**engine, {.temperature = 0});
  if (Status s = session.feed(ids); !s) {
    std::fprintf(stderr, "%s\n", s.to_string().c_str());
    return 1;
  }
  std::printf("[");
  const auto logits = session.logits();
  for (std::size_t i = 0; i < logits.size(); ++i) std::printf("%s%.7g", i ? "," : "", double(logits[i]));
  std::printf("]\n");
  return 0;
}
