// Canary health checks (health.h): the conformance suite's canary cases on a batch of backends.
#include "kallpa/health.h"

#include <cstdlib>
#include <string_view>

#include <fmt/format.h>

#include "kallpa/conformance.h"
#include "kallpa/device.h"

namespace kallpa {

namespace {

std::vector<HealthReport> run_cases(const std::vector<AttentionBackend*>& backends,
                                    const std::vector<conformance::Case>& cases, std::string_view what) {
  std::vector<HealthReport> reports(backends.size());
  // The oracle is whichever registered backend says it is one; the core names no backend.
  const AttentionOracle* oracle = BackendRegistry::global().oracle();
  if (oracle == nullptr) {
    for (HealthReport& r : reports) r.reason = "no oracle registered to judge the canaries against";
    return reports;
  }
  // The canaries are built in host memory; the suite stages them onto a device backend's device
  // through its device_memory(). A device backend without one cannot be checked: unavailable (its
  // supports() says why) or not staged-capable.
  std::vector<AttentionBackend*> runnable;
  std::vector<std::size_t> slot;
  for (std::size_t n = 0; n < backends.size(); ++n) {
    AttentionBackend& b = *backends[n];
    if (b.device_kind() == DeviceKind::cpu || b.device_memory() != nullptr) {
      runnable.push_back(&b);
      slot.push_back(n);
      continue;
    }
    ProblemSignature on_device;
    on_device.device = Device{b.device_kind(), 0};
    const Support s = b.supports(on_device);
    reports[n].reason = !s.ok ? fmt::format("unavailable: {}", s.why_not)
                              : fmt::format("no canary for {} backends without device memory to stage them onto",
                                            device_kind_name(b.device_kind()));
  }
  if (runnable.empty()) return reports;

  const std::vector<conformance::Report> results = conformance::run_suites(runnable, cases, {}, oracle);
  for (std::size_t n = 0; n < runnable.size(); ++n) {
    HealthReport& r = reports[slot[n]];
    for (const conformance::CaseResult& c : results[n].results) {
      if (c.skipped) {
        ++r.cases_skipped;
        continue;
      }
      ++r.cases_run;
      if (!c.passed && r.health != Health::quarantined) {
        r.health = Health::quarantined;
        r.reason = fmt::format("{} '{}': {}", what, c.case_name, c.failure);
      }
    }
    if (r.health == Health::quarantined) continue;
    if (r.cases_run == 0) {
      r.reason = fmt::format("none of the {} {} cases is supported", cases.size(), what);
      if (!results[n].results.empty()) r.reason += fmt::format(" ({})", results[n].results.front().skip_reason);
    } else {
      r.health = Health::healthy;
    }
  }
  return reports;
}

}  // namespace

std::vector<HealthReport> run_canaries(const std::vector<AttentionBackend*>& backends) {
  return run_cases(backends, conformance::canary_cases(), "canary");
}

std::vector<HealthReport> run_fuller_check(const std::vector<AttentionBackend*>& backends) {
  return run_cases(backends, conformance::generate_cases(conformance::Tier::normal), "conformance");
}

HealthCheck skipped_health_check(std::string why) {
  return [why = std::move(why)](const std::vector<AttentionBackend*>& backends) {
    return std::vector<HealthReport>(backends.size(),
                                     HealthReport{Health::unchecked, fmt::format("health check skipped by {}", why)});
  };
}

HealthCheck default_health_check() {
  return [](const std::vector<AttentionBackend*>& backends) {
    if (const char* v = std::getenv("KALLPA_SKIP_HEALTH_CHECK"); v != nullptr) {
      const std::string_view value(v);
      if (value == "1" || value == "true") return skipped_health_check("KALLPA_SKIP_HEALTH_CHECK=1")(backends);
    }
    return run_canaries(backends);
  };
}

}  // namespace kallpa
