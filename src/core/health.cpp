// Canary health checks (health.h): the conformance suite's canary cases on a batch of backends.
#include "kallpa/health.h"

#include <cstdlib>
#include <string_view>

#include <fmt/format.h>

#include "kallpa/conformance.h"

namespace kallpa {

std::vector<HealthReport> run_canaries(const std::vector<AttentionBackend*>& backends) {
  std::vector<HealthReport> reports(backends.size());
  std::vector<AttentionBackend*> host;  // the canaries' memory is host memory
  std::vector<std::size_t> slot;
  for (std::size_t n = 0; n < backends.size(); ++n) {
    if (backends[n]->device_kind() == DeviceKind::cpu) {
      host.push_back(backends[n]);
      slot.push_back(n);
    } else {
      reports[n].reason = fmt::format("no canary for {} backends (the canaries live in host memory)",
                                      device_kind_name(backends[n]->device_kind()));
    }
  }
  if (host.empty()) return reports;

  const std::vector<conformance::Case> cases = conformance::canary_cases();
  const std::vector<conformance::Report> results = conformance::run_suites(host, cases);
  for (std::size_t n = 0; n < host.size(); ++n) {
    HealthReport& r = reports[slot[n]];
    for (const conformance::CaseResult& c : results[n].results) {
      if (c.skipped) {
        ++r.cases_skipped;
        continue;
      }
      ++r.cases_run;
      if (!c.passed && r.health != Health::quarantined) {
        r.health = Health::quarantined;
        r.reason = fmt::format("canary '{}': {}", c.case_name, c.failure);
      }
    }
    if (r.health == Health::quarantined) continue;
    if (r.cases_run == 0) {
      r.reason = fmt::format("none of the {} canary cases is supported", cases.size());
    } else {
      r.health = Health::healthy;
    }
  }
  return reports;
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
