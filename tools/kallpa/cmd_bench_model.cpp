// `kallpa bench model`: how fast the engine reads a prompt (pp) and generates (tg), at an empty
// context and after `depth` tokens of context, the way llama-bench reports it so that the two can
// be compared: pp512 and tg128, at depth 0 and 2048, mean and spread over repetitions.
// --batch B adds "tg128 xB": B sequences decoding in lockstep, one forward pass per step over all of
// them (a server's continuous batch at steady state, as llama-batched-bench measures it), so the
// aggregate rate can be set against one sequence's without HTTP, scheduling or sampling in the way.
//
// Each test also gives its matmul rate: 2 ops per weight per token over every projection and the
// output head, against which `kallpa bench peak`'s int16 multiply-add ceiling (the CPU's quantised
// products, prompt and decode rows alike) can be set.
//
// Prompts are real text (a paragraph tiled to length) rather than random ids, so the tokens are
// ones the model meets; generation is greedy and never stops early, so every run does the same work.
//
// --limit also measures the host's read bandwidth (`kallpa bench peak`'s DRAM read) and gives each
// generation test the bytes a token reads (weights and the visible K/V at the run's mean context),
// the rate that bandwidth allows at that many bytes, and the measured rate's fraction of it.
//
// The KV cache holds what the run needs unless --context says otherwise (llama-bench sizes its
// context the same way), and --memory reports where the process's memory went once the runs are
// done: each part's size and resident bytes, and the process's resident and peak figures.
#include "cmd_bench_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/parallel.h"
#include "engine_cli.h"
#include "harness/peak.h"
#include "kallpa/ops/memory_region.h"
#include "output.h"

namespace kallpa::cli {
namespace {

struct BenchModelOptions {
  EngineCliOptions engine;
  std::int64_t prompt_tokens = 512;
  std::int64_t gen_tokens = 128;
  std::vector<std::int64_t> depths = {0, 2048};
  std::vector<std::int64_t> batches = {1};
  int repetitions = 3;
  bool json = false;
  bool memory = false;
  bool limit = false;
  bool context_given = false;  // --context was on the command line
};

constexpr const char* kText =
    "The history of computing is a story of layers. Engineers build a machine, then a language to "
    "describe what it should do, then libraries that hide the details of the language, and finally "
    "applications that people use without thinking about any of it. Each layer must keep its promises "
    "to the layer above, or the whole tower shakes. In 1971 a small chip held 2,300 transistors; fifty "
    "years later a single accelerator holds more than eighty billion. What has not changed is the need "
    "for clear contracts between the parts: a function that sorts must sort, a file system that says a "
    "write is durable must mean it, and an attention kernel that claims to compute softmax(QK^T)V must "
    "do exactly that for every shape it accepts. ";

struct Measurement {
  std::string test;  // "pp512", "tg128", "tg128 x16"
  std::int64_t depth = 0;
  std::int64_t tokens = 0;      // over all sequences of a batch
  std::vector<double> seconds;  // one per repetition
  bool generation = false;      // one sequence's decode steps (tg)
};

double mean(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / double(v.size()); }

// Tokens per second of each repetition: mean and sample standard deviation.
std::pair<double, double> rate_stats(const Measurement& m) {
  std::vector<double> rates;
  for (double s : m.seconds) rates.push_back(s > 0 ? double(m.tokens) / s : 0.0);
  const double mu = mean(rates);
  double var = 0;
  for (double r : rates) var += (r - mu) * (r - mu);
  return {mu, rates.size() > 1 ? std::sqrt(var / double(rates.size() - 1)) : 0.0};
}

Result<std::vector<std::int32_t>> tiled_text(const tokenizer::Tokenizer& tok, std::int64_t n) {
  auto piece = tok.encode(kText, {.add_special = false});
  if (!piece) return piece.status();
  if (piece->empty()) return Status(ErrorCode::internal, "tokenizer", "the benchmark text encodes to no tokens");
  std::vector<std::int32_t> out;
  out.reserve(static_cast<std::size_t>(n));
  while (static_cast<std::int64_t>(out.size()) < n) {
    out.push_back((*piece)[out.size() % piece->size()]);
  }
  return out;
}

Status run_once(runtime::Engine& engine, const BenchModelOptions& o, std::int64_t depth,
                std::span<const std::int32_t> context, std::span<const std::int32_t> prompt, double* pp_seconds,
                double* tg_seconds) {
  using clock = std::chrono::steady_clock;
  runtime::Session session(engine, {.temperature = 0});
  if (depth > 0) {
    if (Status s = session.feed(context.first(static_cast<std::size_t>(depth))); !s) return s;
  }
  const auto t0 = clock::now();
  if (Status s = session.feed(prompt); !s) return s;
  const auto t1 = clock::now();
  *pp_seconds = std::chrono::duration<double>(t1 - t0).count();
  // Generation continues from the depth context alone, not after the prompt, so that pp and tg
  // both start at `depth` tokens (llama-bench measures them that way): rewind to just before the
  // end of the context and feed its last token again, for its logits.
  const std::int32_t last = depth > 0 ? context[static_cast<std::size_t>(depth - 1)] : prompt.front();
  session.rewind(std::max<std::int64_t>(depth - 1, 0));
  if (Status s = session.feed({&last, 1}); !s) return s;
  const auto t2 = clock::now();
  for (std::int64_t i = 0; i < o.gen_tokens; ++i) {
    auto next = session.sample();
    if (!next) return next.status();
    const std::int32_t token = *next;
    if (Status s = session.feed({&token, 1}); !s) return s;
  }
  *tg_seconds = std::chrono::duration<double>(clock::now() - t2).count();
  return {};
}

// `batch` sequences, each the first depth - 1 context tokens and then a token of its own (a
// different one per sequence, so that their generations differ), decoding greedily in lockstep.
Status run_batched(runtime::Engine& engine, const BenchModelOptions& o, std::int64_t depth,
                   std::span<const std::int32_t> context, std::span<const std::int32_t> prompt, std::int64_t batch,
                   double* tg_seconds) {
  using clock = std::chrono::steady_clock;
  const auto n = static_cast<std::size_t>(batch);
  std::vector<std::unique_ptr<runtime::Session>> sessions;
  std::vector<std::int32_t> next(n);
  std::vector<std::int64_t> position(n);
  for (std::size_t b = 0; b < n; ++b) {
    auto& session =
        *sessions.emplace_back(std::make_unique<runtime::Session>(engine, runtime::SamplingParams{.temperature = 0}));
    if (depth > 1) {
      if (Status s = session.feed(context.first(static_cast<std::size_t>(depth - 1))); !s) return s;
    }
    const std::int32_t own = prompt[b % prompt.size()];
    if (Status s = session.feed({&own, 1}); !s) return s;
    auto first = session.sample();
    if (!first) return first.status();
    next[b] = *first;
    position[b] = session.position();
  }
  const auto vocab = static_cast<std::size_t>(engine.config().vocab_size);
  std::vector<float> logits(n * vocab);
  std::vector<model::ForwardItem> items(n);
  const auto t0 = clock::now();
  for (std::int64_t i = 0; i < o.gen_tokens; ++i) {
    for (std::size_t b = 0; b < n; ++b) {
      items[b] = {sessions[b]->seq(), std::span<const std::int32_t>(&next[b], 1), position[b], true};
      if (Status s = engine.cache().reserve(items[b].seq, position[b] + 1); !s) return s;
    }
    if (Status s = engine.model().forward(items, engine.cache(), engine.dispatcher(), logits.data()); !s) return s;
    for (std::size_t b = 0; b < n; ++b) {
      const float* row = logits.data() + b * vocab;
      next[b] = static_cast<std::int32_t>(std::max_element(row, row + vocab) - row);  // greedy: lowest id on ties
      ++position[b];
    }
  }
  *tg_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  return {};
}

struct MemoryPart {
  std::string part;
  std::optional<std::size_t> bytes;  // none for the process's own figures
  std::size_t resident = 0;
};

// A "Name:   123 kB" line of /proc/self/status, in bytes (0 when absent).
std::size_t status_bytes(const std::string& status, std::string_view name) {
  const std::size_t at = status.find(fmt::format("\n{}:", name));
  if (at == std::string::npos) return 0;
  return static_cast<std::size_t>(std::strtoull(status.c_str() + at + name.size() + 2, nullptr, 10)) * 1024;
}

// The engine's parts (model file, weight copies, activations, KV cache: their sizes and what is
// resident of them), what the rest of the process holds, and its resident and peak totals.
std::vector<MemoryPart> memory_parts(const runtime::Engine& engine) {
  std::vector<MemoryPart> parts;
  std::vector<std::vector<ops::MemoryRegion>> by_part;
  std::vector<ops::MemoryRegion> file, anon;
  for (const ops::MemoryRegion& r : engine.memory_regions()) {
    auto it = std::find_if(parts.begin(), parts.end(), [&](const MemoryPart& p) { return p.part == r.part; });
    if (it == parts.end()) {
      it = parts.insert(parts.end(), MemoryPart{r.part, 0, 0});
      by_part.emplace_back();
    }
    *it->bytes += r.bytes;
    by_part[static_cast<std::size_t>(it - parts.begin())].push_back(r);
    (r.file ? file : anon).push_back(r);
  }
  for (std::size_t i = 0; i < parts.size(); ++i) parts[i].resident = ops::resident_bytes(by_part[i]);
  const std::size_t file_resident = ops::resident_bytes(file), anon_resident = ops::resident_bytes(anon);
  std::ifstream in("/proc/self/status");
  const std::string status = "\n" + std::string(std::istreambuf_iterator<char>(in), {});
  const std::size_t rss_anon = status_bytes(status, "RssAnon"), rss_file = status_bytes(status, "RssFile");
  parts.push_back({"other anonymous (heap, stacks, tokenizer)", std::nullopt,
                   rss_anon > anon_resident ? rss_anon - anon_resident : 0});
  parts.push_back({"code and other files", std::nullopt, rss_file > file_resident ? rss_file - file_resident : 0});
  parts.push_back({"process: resident now", std::nullopt, status_bytes(status, "VmRSS")});
  parts.push_back({"process: peak resident", std::nullopt, status_bytes(status, "VmHWM")});
  return parts;
}

void print_memory(const std::vector<MemoryPart>& parts) {
  auto mib = [](std::size_t b) { return fmt::format("{:.1f}", double(b) / double(1 << 20)); };
  Table table({{"memory"}, {"size MiB", Table::Align::right}, {"resident MiB", Table::Align::right}});
  for (const MemoryPart& p : parts) table.add_row({p.part, p.bytes ? mib(*p.bytes) : "-", mib(p.resident)});
  table.print(stdout);
}

int run_bench_model(BenchModelOptions o, const GlobalOptions& global) {
  const std::int64_t max_depth = *std::max_element(o.depths.begin(), o.depths.end());
  const std::int64_t max_batch = *std::max_element(o.batches.begin(), o.batches.end());
  // Each sequence holds whole blocks of the cache.
  const std::int64_t page = ops::KvCacheOptions{}.page_size;
  auto blocks_of = [&](std::int64_t tokens) { return (tokens + page - 1) / page * page; };
  const std::int64_t needed = std::max(blocks_of(max_depth + std::max(o.prompt_tokens, o.gen_tokens + 1)),
                                       max_batch * blocks_of(max_depth + o.gen_tokens + 1));
  o.engine.context = o.context_given ? std::max(o.engine.context, needed) : needed;
  int code = kExitOk;
  auto engine = load_engine(o.engine, global, &code);
  if (!engine) return code;
  // Measured before the runs, on the threads they use, while nothing else of ours runs.
  std::optional<double> read_gbps;
  if (o.limit) {
    if (!engine->ops().host_addressable()) {
      print_error("", Status::invalid("--limit", fmt::format("measures this host's memory bandwidth; the model runs "
                                                             "on {}",
                                                             engine->ops().device_name())));
      return kExitUsage;
    }
    read_gbps = harness::measure_peak(0).dram_read_gbps;
  }
  const std::int64_t limit = engine->config().context_length;
  if (max_depth + std::max(o.prompt_tokens, o.gen_tokens + 1) > limit) {
    print_error(
        "", Status::invalid("--depth", fmt::format("depth {} + {} tokens exceed the model's context of {}", max_depth,
                                                   std::max(o.prompt_tokens, o.gen_tokens + 1), limit)));
    return kExitUsage;
  }
  auto context = tiled_text(engine->tokenizer(), std::max<std::int64_t>(max_depth, 1));
  auto prompt = tiled_text(engine->tokenizer(), o.prompt_tokens);
  if (!context || !prompt) {
    print_error("benchmark text", context ? prompt.status() : context.status());
    return kExitFailure;
  }
  // The prompt must not repeat the context's tokens at the same offsets, or nothing changes; a
  // rotation keeps it real text.
  std::rotate(prompt->begin(), prompt->begin() + static_cast<std::ptrdiff_t>(prompt->size() / 3), prompt->end());

  std::vector<Measurement> results;
  for (std::int64_t depth : o.depths) {
    Measurement pp{fmt::format("pp{}", o.prompt_tokens), depth, o.prompt_tokens, {}};
    Measurement tg{fmt::format("tg{}", o.gen_tokens), depth, o.gen_tokens, {}, true};
    for (int rep = -1; rep < o.repetitions; ++rep) {  // rep -1 warms up caches and the thread pool
      double pp_s = 0, tg_s = 0;
      if (Status s = run_once(*engine, o, depth, *context, *prompt, &pp_s, &tg_s); !s) {
        print_error("benchmark run failed", s);
        return kExitFailure;
      }
      if (rep < 0) continue;
      pp.seconds.push_back(pp_s);
      tg.seconds.push_back(tg_s);
      if (!o.json) {
        fmt::print(stderr, "  depth {}: {} {:.1f} tok/s, {} {:.1f} tok/s\n", depth, pp.test,
                   double(o.prompt_tokens) / pp_s, tg.test, double(o.gen_tokens) / tg_s);
      }
    }
    results.push_back(std::move(pp));
    results.push_back(std::move(tg));
    for (std::int64_t batch : o.batches) {
      if (batch == 1) continue;
      Measurement btg{fmt::format("tg{} x{}", o.gen_tokens, batch), depth, o.gen_tokens * batch, {}};
      for (int rep = -1; rep < o.repetitions; ++rep) {
        double tg_s = 0;
        if (Status s = run_batched(*engine, o, depth, *context, *prompt, batch, &tg_s); !s) {
          print_error("benchmark run failed", s);
          return kExitFailure;
        }
        if (rep < 0) continue;
        btg.seconds.push_back(tg_s);
        if (!o.json) fmt::print(stderr, "  depth {}: {} {:.1f} tok/s\n", depth, btg.test, double(btg.tokens) / tg_s);
      }
      results.push_back(std::move(btg));
    }
  }

  const std::string backend = main_attention_backend(*engine);
  const int threads = parallel::ThreadPool::global().num_threads();
  const std::string model = engine->options().model_path;
  const std::string device(engine->ops().device_name());
  // 2 ops (multiply, add) per weight of every matrix product a token goes through.
  const double ops_per_token = 2.0 * double(engine->model().matmul_weights_per_token());
  auto matmul_gops = [&](double tokens_per_second) { return tokens_per_second * ops_per_token * 1e-9; };
  // A generation test's bytes per token at its mean context (the depth, then half the tokens), and
  // the rate the read bandwidth allows at that many; none for other tests or without --limit.
  struct Limit {
    double bytes_per_token, tokens_per_second;
  };
  const std::size_t kv_bytes = dtype_size(engine->options().cache.dtype);
  auto limit_of = [&](const Measurement& m) -> std::optional<Limit> {
    if (!read_gbps || !m.generation) return std::nullopt;
    const double bytes = engine->model().bytes_read_per_token(m.depth + 1 + o.gen_tokens / 2, kv_bytes);
    return Limit{bytes, *read_gbps * 1e9 / bytes};
  };
  const std::vector<MemoryPart> memory = o.memory ? memory_parts(*engine) : std::vector<MemoryPart>{};
  if (o.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const Measurement& m : results) {
      const auto [rate, sd] = rate_stats(m);
      out.push_back({{"model", model},
                     {"test", m.test},
                     {"depth", m.depth},
                     {"tokens", m.tokens},
                     {"threads", threads},
                     {"device", device},
                     {"attention", backend},
                     {"seconds", m.seconds},
                     {"tokens_per_second", rate},
                     {"tokens_per_second_stddev", sd},
                     {"matmul_gops", matmul_gops(rate)}});
      if (const std::optional<Limit> l = limit_of(m)) {
        out.back()["bytes_per_token"] = l->bytes_per_token;
        out.back()["read_gbps"] = *read_gbps;
        out.back()["bandwidth_limit_tokens_per_second"] = l->tokens_per_second;
        out.back()["fraction_of_limit"] = rate / l->tokens_per_second;
      }
    }
    if (o.memory) {
      nlohmann::json parts = nlohmann::json::array();
      for (const MemoryPart& p : memory) {
        nlohmann::json part = {{"part", p.part}, {"resident_bytes", p.resident}};
        if (p.bytes) part["bytes"] = *p.bytes;
        parts.push_back(std::move(part));
      }
      out = {{"results", out}, {"memory", parts}};
    }
    fmt::print("{}\n", out.dump(2));
    return kExitOk;
  }
  std::vector<Table::Column> columns = {{"model"},
                                        {"threads", Table::Align::right},
                                        {"device"},
                                        {"attention"},
                                        {"test"},
                                        {"tok/s", Table::Align::right},
                                        {"matmul GOP/s", Table::Align::right}};
  if (read_gbps) {
    for (const char* name : {"MB/token", "limit tok/s", "of limit"}) columns.push_back({name, Table::Align::right});
  }
  Table table(columns);
  for (const Measurement& m : results) {
    const auto [rate, sd] = rate_stats(m);
    std::vector<std::string> row = {std::filesystem::path(model).filename().string(),
                                    std::to_string(threads),
                                    device,
                                    backend,
                                    m.depth > 0 ? fmt::format("{} @ d{}", m.test, m.depth) : m.test,
                                    fmt::format("{:.1f} ± {:.1f}", rate, sd),
                                    fmt::format("{:.1f}", matmul_gops(rate))};
    if (const std::optional<Limit> l = limit_of(m)) {
      row.insert(row.end(),
                 {fmt::format("{:.1f}", l->bytes_per_token / 1e6), fmt::format("{:.0f}", l->tokens_per_second),
                  fmt::format("{:.0f}%", 100.0 * rate / l->tokens_per_second)});
    } else if (read_gbps) {
      row.insert(row.end(), {"-", "-", "-"});
    }
    table.add_row(row);
  }
  table.print(stdout);
  if (read_gbps) fmt::print("read bandwidth (bench peak's DRAM read): {:.1f} GB/s\n", *read_gbps);
  if (o.memory) {
    fmt::print("\n");
    print_memory(memory);
  }
  return kExitOk;
}

}  // namespace

std::function<int(const GlobalOptions&)> add_bench_model_subcommand(CLI::App* bench) {
  auto o = std::make_shared<BenchModelOptions>();
  CLI::App* sub = bench->add_subcommand(
      "model", "Prompt (pp) and generation (tg) tokens/s of a model, at empty context and after --depth tokens");
  add_engine_options(sub, o->engine);
  sub->add_option("-p,--prompt-tokens", o->prompt_tokens, "Prompt length for pp")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  sub->add_option("-n,--gen-tokens", o->gen_tokens, "Tokens to generate for tg")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  sub->add_option("-d,--depth", o->depths, "Context already present (repeatable)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  sub->add_option("-B,--batch", o->batches,
                  "Also generate with B sequences at once, one forward pass per step (a list: 1,4,16; 1: tg alone)")
      ->delimiter(',')
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  sub->add_option("-r,--repetitions", o->repetitions, "Timed runs per test (after one warm-up)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  sub->add_flag("--json", o->json,
                "Results as a JSON array on stdout (with --memory: an object of \"results\" and \"memory\")");
  sub->add_flag("--memory", o->memory,
                "Also report where memory went after the runs: model file, weight copies, activations, KV cache, "
                "the rest of the process, and its resident and peak totals");
  sub->add_flag("--limit", o->limit,
                "Also measure this host's read bandwidth and give each generation test its bytes per token, the "
                "rate that bandwidth allows, and the fraction of it reached");
  CLI::Option* context = sub->get_option("--context");
  return [o, context](const GlobalOptions& g) {
    o->context_given = context->count() > 0;
    return run_bench_model(*o, g);
  };
}

}  // namespace kallpa::cli
