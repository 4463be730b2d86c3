// Health checks: before a backend can be selected it runs a small fixed set of canary cases from
// the conformance suite against the double-precision reference. Wrong numbers, NaN where the
// contract says 0, a write outside its outputs, or an error quarantine it: never selected, listed
// with the case and the failure, logged once, counted. This is what keeps a kernel broken by a
// library update from serving garbage.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "kallpa/backend.h"
#include "kallpa/registry.h"

namespace kallpa {

// Checks a batch of backends (one report each, in order). Canary inputs and their reference are
// built once and shared by the batch.
using HealthCheck = std::function<std::vector<HealthReport>(const std::vector<AttentionBackend*>&)>;

// The canary check (conformance::canary_cases() through conformance::run_suites), judged against
// the global registry's oracle (BackendRegistry::oracle()); with no oracle registered every backend
// stays unchecked, saying so. A device backend's canaries are staged onto its device through
// device_memory() (device.h); one without device memory stays unchecked, as "unavailable: WHY"
// when its supports() refuses its device.
std::vector<HealthReport> run_canaries(const std::vector<AttentionBackend*>& backends);

// The fuller check a build held by the quarantine journal must pass before it is trusted again
// (registry.h, set_recheck): the conformance suite's default matrix, judged like run_canaries.
std::vector<HealthReport> run_fuller_check(const std::vector<AttentionBackend*>& backends);

// A check that runs nothing: every backend stays unchecked with reason "health check skipped by
// WHY"; used for --no-health-check and KALLPA_SKIP_HEALTH_CHECK=1.
HealthCheck skipped_health_check(std::string why);

// The global registry's check: run_canaries, or skipped when KALLPA_SKIP_HEALTH_CHECK is 1/true
// (read when the check runs).
HealthCheck default_health_check();

}  // namespace kallpa
