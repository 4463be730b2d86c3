// A C++ program on the installed SDK (kallpa::attention): loads the naive plugin by path, runs one
// problem through the dispatcher on it, and compares the result with the reference backend's.
//
//   ./kallpa_naive_host ./libkallpa_plugin_naive.so
#include <cmath>
#include <cstdio>
#include <vector>

#include <kallpa/dispatcher.h>
#include <kallpa/plugin.h>
#include <kallpa/registry.h>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s PLUGIN.so\n", argv[0]);
    return 2;
  }
  kallpa::BackendRegistry& registry = kallpa::BackendRegistry::global();
  const kallpa::PluginLoadReport loaded = kallpa::load_plugin(argv[1], registry);
  if (!loaded.status) {
    std::fprintf(stderr, "%s\n", loaded.status.to_string().c_str());
    return 1;
  }

  // A small causal GQA problem: q [1, 5, 4, 32], k/v [1, 9, 2, 32].
  const std::int64_t sq = 5, skv = 9, hq = 4, hkv = 2, d = 32;
  std::vector<float> q(sq * hq * d), k(skv * hkv * d), v(skv * hkv * d);
  for (std::size_t n = 0; n < q.size(); ++n) q[n] = std::sin(0.1f * static_cast<float>(n));
  for (std::size_t n = 0; n < k.size(); ++n) k[n] = std::cos(0.07f * static_cast<float>(n));
  for (std::size_t n = 0; n < v.size(); ++n) v[n] = std::sin(0.05f * static_cast<float>(n) + 1.0f);

  std::vector<float> outputs[2];
  const char* backends[2] = {loaded.backend.c_str(), "reference"};
  for (int b = 0; b < 2; ++b) {
    outputs[b].assign(sq * hq * d, 0.0f);
    kallpa::AttentionProblem p;
    p.q = kallpa::make_contiguous_view(q.data(), kallpa::DType::f32, {1, sq, hq, d});
    p.k = kallpa::make_contiguous_view(k.data(), kallpa::DType::f32, {1, skv, hkv, d});
    p.v = kallpa::make_contiguous_view(v.data(), kallpa::DType::f32, {1, skv, hkv, d});
    p.o = kallpa::make_contiguous_view(outputs[b].data(), kallpa::DType::f32, {1, sq, hq, d});
    p.causal = true;
    kallpa::DispatchOptions options;
    options.backends = {backends[b]};
    options.strict = true;
    kallpa::Dispatcher dispatcher(options);
    if (kallpa::Status s = dispatcher.run(p); !s) {
      std::fprintf(stderr, "%s: %s\n", backends[b], s.to_string().c_str());
      return 1;
    }
  }
  double worst = 0.0;
  for (std::size_t n = 0; n < outputs[0].size(); ++n) {
    worst = std::fmax(worst, std::fabs(static_cast<double>(outputs[0][n]) - outputs[1][n]));
  }
  const kallpa::BackendInfo info = *registry.info(loaded.backend);
  std::printf("%s (%s): max |difference| from reference %.3g\n", loaded.backend.c_str(),
              std::string(kallpa::health_name(info.health)).c_str(), worst);
  return worst <= 1e-5 && info.health == kallpa::Health::healthy ? 0 : 1;
}
