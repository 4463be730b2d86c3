// A small metrics registry rendered in the Prometheus text exposition format (version 0.0.4):
// counter, gauge and histogram families, each with fixed label names. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace kallpa::server {

enum class MetricType { counter, gauge, histogram };

using LabelValues = std::vector<std::string>;  // in the family's label-name order

class MetricFamily {
 public:
  MetricFamily(std::string name, std::string help, MetricType type, std::vector<std::string> label_names,
               std::vector<double> buckets = {});

  const std::string& name() const noexcept { return name_; }
  void inc(const LabelValues& labels, double by = 1.0);  // counter
  void set(const LabelValues& labels, double value);     // gauge, or a counter kept elsewhere
  void observe(const LabelValues& labels, double x);     // histogram
  // A histogram kept elsewhere: per-bucket (not cumulative) counts, one per bucket bound plus a
  // last one for +Inf, and the sum of the observations.
  void set_histogram(const LabelValues& labels, const std::vector<std::uint64_t>& counts, double sum);
  void render(std::string& out) const;

 private:
  struct Series {
    double value = 0.0;                 // counter, gauge; histogram: sum
    std::vector<std::uint64_t> counts;  // histogram: per bucket, +Inf last
  };
  Series& series(const LabelValues& labels);  // under mu_

  std::string name_, help_;
  MetricType type_;
  std::vector<std::string> label_names_;
  std::vector<double> buckets_;
  mutable std::mutex mu_;
  std::map<LabelValues, Series> series_;
};

class MetricsRegistry {
 public:
  // Families render in the order they were added. The registry owns them; adding one while
  // another thread renders is safe (families published by backends appear on first scrape).
  MetricFamily& add(std::string name, std::string help, MetricType type, std::vector<std::string> label_names = {},
                    std::vector<double> buckets = {});
  std::string render() const;

 private:
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<MetricFamily>> families_;  // under mu_
};

// Label values escaped as the text format requires (backslash, double quote, newline).
std::string escape_label_value(const std::string& value);

}  // namespace kallpa::server
