#include "server/metrics.h"

#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

namespace kallpa::server {
namespace {

std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

std::string label_set(const std::vector<std::string>& names, const LabelValues& values, const std::string& extra = {}) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (!out.empty()) out += ',';
    out += fmt::format("{}=\"{}\"", names[i], escape_label_value(values[i]));
  }
  if (!extra.empty()) {
    if (!out.empty()) out += ',';
    out += extra;
  }
  return out.empty() ? out : "{" + out + "}";
}

std::string_view type_name(MetricType t) {
  switch (t) {
    case MetricType::counter: return "counter";
    case MetricType::gauge: return "gauge";
    case MetricType::histogram: return "histogram";
  }
  return "untyped";
}

}  // namespace

std::string escape_label_value(const std::string& value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

MetricFamily::MetricFamily(std::string name, std::string help, MetricType type, std::vector<std::string> label_names,
                           std::vector<double> buckets)
    : name_(std::move(name)),
      help_(std::move(help)),
      type_(type),
      label_names_(std::move(label_names)),
      buckets_(std::move(buckets)) {}

MetricFamily::Series& MetricFamily::series(const LabelValues& labels) {
  if (labels.size() != label_names_.size()) {
    // A programming error in the caller, not an input error: fail loudly.
    throw std::logic_error(
        fmt::format("metric {}: {} label values for {} labels", name_, labels.size(), label_names_.size()));
  }
  Series& s = series_[labels];
  if (type_ == MetricType::histogram && s.counts.empty()) s.counts.assign(buckets_.size() + 1, 0);
  return s;
}

void MetricFamily::inc(const LabelValues& labels, double by) {
  std::lock_guard lock(mu_);
  series(labels).value += by;
}

void MetricFamily::set(const LabelValues& labels, double value) {
  std::lock_guard lock(mu_);
  series(labels).value = value;
}

void MetricFamily::observe(const LabelValues& labels, double x) {
  std::lock_guard lock(mu_);
  Series& s = series(labels);
  std::size_t b = 0;
  while (b < buckets_.size() && x > buckets_[b]) ++b;
  ++s.counts[b];
  s.value += x;
}

void MetricFamily::set_histogram(const LabelValues& labels, const std::vector<std::uint64_t>& counts, double sum) {
  std::lock_guard lock(mu_);
  Series& s = series(labels);
  for (std::size_t b = 0; b < s.counts.size(); ++b) s.counts[b] = b < counts.size() ? counts[b] : 0;
  s.value = sum;
}

void MetricFamily::render(std::string& out) const {
  std::lock_guard lock(mu_);
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name_, help_, name_, type_name(type_));
  for (const auto& [labels, s] : series_) {
    if (type_ != MetricType::histogram) {
      out += fmt::format("{}{} {}\n", name_, label_set(label_names_, labels), format_value(s.value));
      continue;
    }
    std::uint64_t cumulative = 0;
    for (std::size_t b = 0; b <= buckets_.size(); ++b) {
      cumulative += s.counts[b];
      const std::string le = b < buckets_.size() ? format_value(buckets_[b]) : "+Inf";
      out += fmt::format("{}_bucket{} {}\n", name_, label_set(label_names_, labels, "le=\"" + le + "\""), cumulative);
    }
    out += fmt::format("{}_sum{} {}\n", name_, label_set(label_names_, labels), format_value(s.value));
    out += fmt::format("{}_count{} {}\n", name_, label_set(label_names_, labels), cumulative);
  }
}

MetricFamily& MetricsRegistry::add(std::string name, std::string help, MetricType type,
                                   std::vector<std::string> label_names, std::vector<double> buckets) {
  std::lock_guard lock(mu_);
  families_.push_back(std::make_unique<MetricFamily>(std::move(name), std::move(help), type, std::move(label_names),
                                                     std::move(buckets)));
  return *families_.back();
}

std::string MetricsRegistry::render() const {
  std::string out;
  std::lock_guard lock(mu_);
  for (const auto& f : families_) f->render(out);
  return out;
}

}  // namespace kallpa::server
