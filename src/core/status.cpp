#include "kallpa/status.h"

namespace kallpa {

std::string_view error_code_name(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::ok: return "ok";
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::unsupported: return "unsupported";
    case ErrorCode::backend_failure: return "backend_failure";
    case ErrorCode::not_found: return "not_found";
    case ErrorCode::parse_error: return "parse_error";
    case ErrorCode::out_of_memory: return "out_of_memory";
    case ErrorCode::internal: return "internal";
    case ErrorCode::backend_lost: return "backend_lost";
  }
  return "unknown";
}

std::string Status::to_string() const {
  std::string out(error_code_name(code_));
  if (!field_.empty()) {
    out += ": ";
    out += field_;
  }
  if (!message_.empty()) {
    out += ": ";
    out += message_;
  }
  return out;
}

}  // namespace kallpa
