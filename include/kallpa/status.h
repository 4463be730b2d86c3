// Typed errors. Nothing in kallpa throws across a backend boundary: every fallible call returns a
// Status (or Result<T>) that names the code, the offending field and a human-readable message.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace kallpa {

enum class ErrorCode {
  ok = 0,
  invalid_argument,  // a problem or option that violates the contract
  unsupported,       // valid, but no (chosen) backend can run it
  backend_failure,   // a backend's run() reported an error
  not_found,         // a named backend or file that does not exist
  parse_error,       // malformed text input (a spec, JSON, ...)
  out_of_memory,
  internal,
  // The backend's process died (signal, abort), overran its watchdog deadline, wrote outside its
  // outputs (a guard page) or outgrew its memory limit; or, for a backend spread over processes
  // (the ring), a peer process died or missed its deadline. The registry quarantines such a
  // backend at its first occurrence, as a second call could not be trusted either.
  backend_lost,
};

std::string_view error_code_name(ErrorCode code) noexcept;

class Status {
 public:
  Status() = default;  // ok
  Status(ErrorCode code, std::string field, std::string message)
      : code_(code), field_(std::move(field)), message_(std::move(message)) {}

  static Status ok() { return {}; }
  static Status invalid(std::string field, std::string message) {
    return {ErrorCode::invalid_argument, std::move(field), std::move(message)};
  }

  bool is_ok() const noexcept { return code_ == ErrorCode::ok; }
  explicit operator bool() const noexcept { return is_ok(); }
  ErrorCode code() const noexcept { return code_; }
  const std::string& field() const noexcept { return field_; }
  const std::string& message() const noexcept { return message_; }
  // "invalid_argument: q.shape[3]: head dim 0 must be >= 1"
  std::string to_string() const;

 private:
  ErrorCode code_ = ErrorCode::ok;
  std::string field_;
  std::string message_;
};

template <typename T>
class Result {
 public:
  Result(T value) : v_(std::move(value)) {}       // NOLINT(google-explicit-constructor)
  Result(Status error) : v_(std::move(error)) {}  // NOLINT(google-explicit-constructor)

  bool is_ok() const noexcept { return std::holds_alternative<T>(v_); }
  explicit operator bool() const noexcept { return is_ok(); }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() { return value(); }
  const T& operator*() const { return value(); }
  Status status() const { return is_ok() ? Status{} : std::get<Status>(v_); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace kallpa
