#include "server/api_error.h"

namespace kallpa::server {

nlohmann::json ApiError::to_json() const {
  nlohmann::json e = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = param;
  if (!code.empty()) e["code"] = code;
  return {{"error", e}};
}

ApiError bad_request(std::string param, std::string message, std::string code) {
  ApiError e;
  e.status = 400;
  e.param = std::move(param);
  e.message = std::move(message);
  e.code = std::move(code);
  return e;
}

ApiError from_status(const Status& status) {
  const std::string message = status.field().empty() ? status.message() : status.field() + ": " + status.message();
  ApiError e;
  e.message = message;
  if (status.field() == "queue") {
    e.status = 429;
    e.type = "rate_limit_error";
    e.code = "queue_full";
    e.retry_after_seconds = 1;
  } else if (status.field() == "kv_cache") {
    // The request can never fit this server's cache: asking again will not help, fewer tokens will.
    e.status = 400;
    e.code = "context_length_exceeded";
    e.param = "max_tokens";
  } else if (status.field() == "scheduler") {
    e.status = 503;
    e.type = "server_error";
    e.code = "shutting_down";
    e.retry_after_seconds = 5;
  } else if (status.code() == ErrorCode::invalid_argument || status.code() == ErrorCode::parse_error) {
    e.status = 400;
    e.code = "invalid_value";
    e.param = status.field();
  } else {
    e.status = 500;
    e.type = "server_error";
    e.code = std::string(error_code_name(status.code()));
  }
  return e;
}

}  // namespace kallpa::server
