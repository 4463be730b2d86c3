// kallpa's typed errors on their way to Python. Binding code throws StatusError for a Status that
// is not ok; the translator (module.cpp) raises it as the kallpa.Error subclass for its ErrorCode
// (python/kallpa/_errors.py), carrying the code, the field, the message and, where the binding knows
// it, the offending value.
#pragma once

#include <exception>
#include <optional>
#include <string>
#include <utility>

#include "kallpa/status.h"

namespace kallpa::python {

class StatusError : public std::exception {
 public:
  explicit StatusError(Status status, std::optional<std::string> value = std::nullopt)
      : status_(std::move(status)), value_(std::move(value)), what_(status_.to_string()) {}

  const Status& status() const noexcept { return status_; }
  const std::optional<std::string>& value() const noexcept { return value_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  Status status_;
  std::optional<std::string> value_;
  std::string what_;
};

// Throws StatusError when `status` is an error.
inline void check(const Status& status) {
  if (!status.is_ok()) throw StatusError(status);
}

// An invalid_argument naming `field` and the offending `value`.
[[noreturn]] inline void throw_invalid(std::string field, std::string message, std::string value) {
  throw StatusError(Status::invalid(std::move(field), std::move(message)), std::move(value));
}

}  // namespace kallpa::python
