#include "kallpa/dispatcher.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <random>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/output_check.h"
#include "core/row_check.h"
#include "kallpa/device.h"
#include "kallpa/plugin.h"

namespace kallpa {
namespace {

// 64-byte aligned scratch that only grows.
class ScratchBuffer {
 public:
  ScratchBuffer() = default;
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  ~ScratchBuffer() { std::free(data_); }

  void* reserve(std::size_t bytes) noexcept {
    if (bytes <= capacity_) return data_;
    const std::size_t rounded = (bytes + 63) / 64 * 64;
    void* fresh = std::aligned_alloc(64, rounded);
    if (fresh == nullptr) return nullptr;
    std::free(data_);
    data_ = fresh;
    capacity_ = rounded;
    return data_;
  }

 private:
  void* data_ = nullptr;
  std::size_t capacity_ = 0;
};

}  // namespace

Result<std::vector<std::string>> DispatchOptions::parse_backend_list(std::string_view text) {
  std::vector<std::string> names;
  std::size_t pos = 0;
  while (true) {
    const std::size_t comma = std::min(text.find(',', pos), text.size());
    std::string_view item = text.substr(pos, comma - pos);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (item.empty()) {
      return Status(ErrorCode::parse_error, "backends",
                    fmt::format("empty backend name at offset {} in '{}'", pos, text));
    }
    names.emplace_back(item);
    if (comma == text.size()) break;
    pos = comma + 1;
  }
  return names;
}

namespace {

// Reads a 0/1/true/false variable into *out when it is set and not empty.
Status env_flag(const char* variable, bool* out) {
  const char* text = std::getenv(variable);
  if (text == nullptr || *text == '\0') return {};
  const std::string_view v(text);
  if (v == "1" || v == "true") {
    *out = true;
  } else if (v == "0" || v == "false") {
    *out = false;
  } else {
    return Status(ErrorCode::parse_error, variable, fmt::format("'{}' is not 0/1/true/false", v));
  }
  return {};
}

}  // namespace

Result<DispatchOptions> DispatchOptions::from_env() {
  DispatchOptions options;
  if (const char* list = std::getenv("KALLPA_ATTENTION"); list != nullptr && *list != '\0') {
    auto names = parse_backend_list(list);
    if (!names) return Status(ErrorCode::parse_error, "KALLPA_ATTENTION", names.status().message());
    options.backends = std::move(*names);
  }
  if (Status s = env_flag("KALLPA_ATTENTION_STRICT", &options.strict); !s) return s;
  if (Status s = env_flag("KALLPA_PARANOID", &options.paranoid); !s) return s;
  if (const char* text = std::getenv("KALLPA_QUARANTINE_AFTER"); text != nullptr && *text != '\0') {
    char* end = nullptr;
    const long n = std::strtol(text, &end, 10);
    if (*end != '\0' || n < 0 || n > 1000000) {
      return Status(ErrorCode::parse_error, "KALLPA_QUARANTINE_AFTER",
                    fmt::format("'{}' is not a count of failures (an integer >= 0)", text));
    }
    options.quarantine_after = static_cast<int>(n);
  }
  if (Status s = env_flag("KALLPA_FIRST_USE_CHECK", &options.first_use_check); !s) return s;
  if (const char* text = std::getenv("KALLPA_VERIFY_RATE"); text != nullptr && *text != '\0') {
    auto rate = parse_rate(text);
    if (!rate) return Status(ErrorCode::parse_error, "KALLPA_VERIFY_RATE", rate.status().message());
    options.verify_rate = *rate;
  }
  return options;
}

Result<double> DispatchOptions::parse_rate(std::string_view text) {
  const std::string s(text);
  auto number = [](const std::string& t, double* out) {
    char* end = nullptr;
    *out = std::strtod(t.c_str(), &end);
    return !t.empty() && end != nullptr && *end == '\0' && std::isfinite(*out);
  };
  double rate = 0.0;
  if (const std::size_t slash = s.find('/'); slash != std::string::npos) {
    double num = 0.0, den = 0.0;
    if (!number(s.substr(0, slash), &num) || !number(s.substr(slash + 1), &den) || num != 1.0 || den < 1.0) {
      return Status(ErrorCode::parse_error, "verify_rate", fmt::format("'{}' is not 1/N with N >= 1", s));
    }
    rate = 1.0 / den;
  } else if (!number(s, &rate) || rate < 0.0 || rate > 1.0) {
    return Status(ErrorCode::parse_error, "verify_rate",
                  fmt::format("'{}' is not a fraction of calls in [0, 1] or 1/N", s));
  }
  return rate;
}

Dispatcher::Dispatcher(DispatchOptions options, BackendRegistry* registry)
    : options_(std::move(options)),
      registry_(registry),
      observers_(std::make_shared<const std::vector<std::shared_ptr<DispatchObserver>>>()) {
  if (registry_ == &BackendRegistry::global()) load_env_plugins();
  verify_seed_ = options_.verify_seed != 0 ? options_.verify_seed
                                           : (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  const double rate = std::clamp(options_.verify_rate, 0.0, 1.0);
  // rate 1 must check every call: the largest draw is 2^64 - 1.
  verify_threshold_ = rate >= 1.0 ? ~std::uint64_t{0} : static_cast<std::uint64_t>(std::ldexp(rate, 64));
}

void Dispatcher::add_observer(std::shared_ptr<DispatchObserver> observer) {
  // Copy-on-write, so that dispatching threads read the list without taking this lock for long.
  std::lock_guard lock(observers_mu_);
  auto next = std::make_shared<std::vector<std::shared_ptr<DispatchObserver>>>(*observers_);
  next->push_back(std::move(observer));
  observers_ = std::move(next);
}

void Dispatcher::notify(const DispatchEvent& event) const noexcept {
  std::shared_ptr<const std::vector<std::shared_ptr<DispatchObserver>>> observers;
  {
    std::lock_guard lock(observers_mu_);
    observers = observers_;
  }
  for (const auto& o : *observers) o->on_dispatch(event);
}

void Dispatcher::warn_once(const std::string& key, const std::string& message) {
  {
    std::lock_guard lock(warned_mu_);
    if (std::find(warned_.begin(), warned_.end(), key) != warned_.end()) return;
    warned_.push_back(key);
  }
  spdlog::warn("kallpa: {}", message);
}

Result<std::vector<AttentionBackend*>> Dispatcher::compute_candidates(const ProblemSignature& sig) const {
  registry_->ensure_checked(sig.device.kind);
  const std::vector<BackendInfo> all = registry_->list();
  std::vector<AttentionBackend*> chosen;
  std::vector<std::string> reasons;

  auto consider = [&](const BackendInfo& info) {
    AttentionBackend& b = *info.backend;
    if (std::find(chosen.begin(), chosen.end(), &b) != chosen.end()) return;
    if (info.health == Health::quarantined) {
      reasons.push_back(fmt::format("{}: quarantined ({})", b.name(), info.health_reason));
      return;
    }
    if (b.device_kind() != sig.device.kind) {
      reasons.push_back(fmt::format("{}: runs on {}, the tensors are on {}", b.name(),
                                    device_kind_name(b.device_kind()), sig.device.to_string()));
      return;
    }
    // Same kind, another device of it (opencl:0 vs opencl:1): only a backend that names its
    // device through device_memory() can be told apart here; others decide in supports().
    if (const DeviceMemory* m = b.device_memory(); m != nullptr && !(m->device() == sig.device)) {
      reasons.push_back(fmt::format("{}: runs on {}, the tensors are on {}", b.name(), m->device().to_string(),
                                    sig.device.to_string()));
      return;
    }
    Support s = b.supports(sig);
    if (!s.ok) {
      reasons.push_back(fmt::format("{}: {}", b.name(), s.why_not));
      return;
    }
    chosen.push_back(&b);
  };

  for (const std::string& name : options_.backends) {
    auto it = std::find_if(all.begin(), all.end(), [&](const BackendInfo& i) { return i.backend->name() == name; });
    if (it == all.end()) {
      if (options_.strict) {
        return Status(ErrorCode::not_found, "attention", fmt::format("no backend named '{}' (strict mode)", name));
      }
      reasons.push_back(fmt::format("{}: no such backend", name));
      continue;
    }
    consider(*it);
  }
  if (!options_.strict || options_.backends.empty()) {
    // Automatic order; after an explicit list these are the fallbacks.
    for (const BackendInfo& info : all) consider(info);
  }
  if (chosen.empty()) {
    std::string why = fmt::format("no {}backend can run [{}]",
                                  options_.strict && !options_.backends.empty() ? "chosen " : "", sig.to_string());
    for (const std::string& r : reasons) why += "; " + r;
    return Status(ErrorCode::unsupported, "attention", std::move(why));
  }
  return chosen;
}

Result<Dispatcher::Candidates> Dispatcher::lookup(const ProblemSignature& sig) {
  const std::uint64_t generation = registry_->generation();
  {
    std::shared_lock lock(cache_mu_);
    if (cache_generation_ == generation) {
      auto it = cache_.find(sig);
      if (it != cache_.end()) return it->second;
    }
  }
  auto computed = compute_candidates(sig);
  if (!computed) return computed.status();
  auto shared = std::make_shared<const std::vector<AttentionBackend*>>(std::move(*computed));
  std::unique_lock lock(cache_mu_);
  if (generation > cache_generation_) {
    cache_.clear();
    cache_generation_ = generation;
  }
  if (generation == cache_generation_) cache_.insert_or_assign(sig, shared);
  return Candidates(shared);
}

Result<std::vector<AttentionBackend*>> Dispatcher::candidates(const ProblemSignature& sig) {
  auto found = lookup(sig);
  if (!found) return found.status();
  return std::vector<AttentionBackend*>(**found);
}

Status Dispatcher::run(const AttentionProblem& problem) {
  auto validated = validate(problem);
  if (!validated) return validated.status();
  return run(*validated);
}

namespace {

std::uint64_t mix(std::uint64_t z) noexcept {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Rows a first-use check compares: enough to see a bug that hits a part of the output, few enough
// that a check costs about one call of a fast backend. A shadow check samples fewer, more often.
constexpr std::size_t kFirstUseRows = 8;
constexpr std::size_t kShadowRows = 4;

}  // namespace

Status Dispatcher::run(const ValidatedProblem& problem) {
  auto found = lookup(problem.signature());
  if (!found) return found.status();
  const std::vector<AttentionBackend*>& candidates = **found;

  // Scratch memory is reused per thread, so a warm call allocates nothing.
  thread_local ScratchBuffer scratch;
  // Shadow verification draws once per call.
  const std::uint64_t draw =
      verify_threshold_ != 0 ? mix(verify_seed_ ^ draws_.fetch_add(1, std::memory_order_relaxed)) : 0;
  const bool shadow = verify_threshold_ != 0 && (verify_threshold_ == ~std::uint64_t{0} || draw < verify_threshold_);
  const SizeBucket bucket = size_bucket(problem);
  Status last;
  std::size_t tried = 0;
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    AttentionBackend& backend = *candidates[i];
    const bool oracle = backend.oracle() != nullptr;
    const BucketTrust trust =
        options_.first_use_check && !oracle ? registry_->bucket_trust(backend, bucket) : BucketTrust::verified;
    if (trust == BucketTrust::quarantined) {
      // Its first call in this bucket was wrong: the next candidate serves the bucket.
      last = Status(ErrorCode::backend_failure, std::string(backend.name()),
                    fmt::format("quarantined for size bucket {}", bucket.to_string()));
      if (options_.strict) return last;
      continue;
    }
    const std::size_t bytes = backend.workspace_size(problem);
    Status status;
    bool backend_at_fault = true;
    const auto start = std::chrono::steady_clock::now();
    if (void* memory = scratch.reserve(bytes); bytes > 0 && memory == nullptr) {
      status = Status(ErrorCode::out_of_memory, "workspace",
                      fmt::format("could not allocate {} bytes for {}", bytes, backend.name()));
      backend_at_fault = false;
    } else {
      status = backend.run(problem, Workspace{memory, bytes});
    }
    const auto elapsed = std::chrono::steady_clock::now() - start;  // the backend's time only
    if (status && backend_at_fault && options_.paranoid) status = detail::check_outputs_finite(problem);
    DispatchEvent event;
    event.backend = backend.name();
    event.signature = &problem.signature();
    event.duration = std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed);
    event.outcome = status ? Outcome::ok : Outcome::failed;
    event.fallback = tried++ > 0;
    event.error = status ? nullptr : &status;
    notify(event);

    bool quarantined_now = false;
    if (status && !oracle) {
      const bool first_use = trust == BucketTrust::unverified;
      if (first_use || shadow) {
        const VerifyKind kind = first_use ? VerifyKind::first_use : VerifyKind::shadow;
        const auto check_start = std::chrono::steady_clock::now();
        const detail::RowCheck check = detail::check_rows(
            problem, registry_->oracle(),
            detail::sample_rows(problem, first_use ? kFirstUseRows : kShadowRows, first_use, mix(draw ^ i)));
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - check_start).count();
        const VerifyOutcome outcome = check.verdict == detail::RowCheck::Verdict::passed ? VerifyOutcome::passed
                                      : check.verdict == detail::RowCheck::Verdict::mismatch
                                          ? VerifyOutcome::mismatch
                                          : VerifyOutcome::unverifiable;
        registry_->record_verification(backend, kind, outcome, seconds);
        if (outcome == VerifyOutcome::unverifiable) {
          if (first_use) registry_->set_bucket_trust(backend, bucket, BucketTrust::unverifiable, check.detail);
          // Counted (VerificationCounters::unverifiable, /metrics); a device backend is
          // unverifiable in every bucket and at every shadow draw, which is no news worth a warning.
          spdlog::debug("kallpa: backend '{}' cannot be verified on [{}]: {}", backend.name(),
                        problem.signature().to_string(), check.detail);
        } else if (outcome == VerifyOutcome::passed) {
          if (first_use) registry_->set_bucket_trust(backend, bucket, BucketTrust::verified);
        } else {
          std::string rows;
          for (const OutputRow& r : check.rows)
            rows += fmt::format("{}({},{},{})", rows.empty() ? "" : " ", r.sequence, r.query, r.head);
          const std::string reason =
              fmt::format("{} check in size bucket {} on [{}], rows (sequence,query,head) {}: {}",
                          first_use ? "first-use" : "shadow", bucket.to_string(), problem.signature().to_string(), rows,
                          check.detail);
          if (first_use) {
            registry_->set_bucket_trust(backend, bucket, BucketTrust::quarantined, reason);
          } else {
            registry_->quarantine(backend.name(), "shadow_check", reason);
          }
          status = Status(ErrorCode::backend_failure, "verification", reason);
          quarantined_now = true;
        }
      }
    }
    if (status) return status;

    if (backend_at_fault && !quarantined_now) {
      registry_->record_failure(backend.name(), status, options_.quarantine_after);
    }
    warn_once(fmt::format("{}/{}", backend.name(), error_code_name(status.code())),
              fmt::format("backend '{}' failed on [{}]: {}{}", backend.name(), problem.signature().to_string(),
                          status.to_string(),
                          options_.strict             ? " (strict mode: no fallback)"
                          : i + 1 < candidates.size() ? fmt::format("; falling back to '{}'", candidates[i + 1]->name())
                                                      : std::string("; no candidate left")));
    last = Status(ErrorCode::backend_failure, std::string(backend.name()), status.to_string());
    if (options_.strict) return last;
  }
  return last;
}

std::vector<Verdict> Dispatcher::explain(const ProblemSignature& sig) const {
  auto order = compute_candidates(sig);
  std::vector<Verdict> out;
  for (const BackendInfo& info : registry_->list()) {
    Verdict v;
    v.backend = std::string(info.backend->name());
    v.health = info.health;
    const Support s = info.backend->supports(sig);
    v.supported = s.ok;
    if (order) {
      auto it = std::find(order->begin(), order->end(), info.backend);
      if (it != order->end()) v.rank = static_cast<int>(it - order->begin());
    }
    v.selected = v.rank == 0;
    if (!s.ok) {
      v.reason = s.why_not;
    } else if (info.health == Health::quarantined) {
      v.reason = fmt::format("quarantined: {}", info.health_reason);
    } else if (info.backend->device_kind() != sig.device.kind) {
      v.reason = fmt::format("runs on {}, the problem is on {}", device_kind_name(info.backend->device_kind()),
                             sig.device.to_string());
    } else if (v.rank < 0) {
      v.reason = "not in the explicit backend list (strict mode)";
    } else if (v.rank > 0) {
      v.reason = fmt::format("supported; fallback #{} after {}", v.rank, (*order)[0]->name());
    } else {
      v.reason = options_.backends.empty() ? "selected: highest priority that supports the problem"
                                           : "selected: first supported in the explicit list";
    }
    out.push_back(std::move(v));
  }
  return out;
}

}  // namespace kallpa
