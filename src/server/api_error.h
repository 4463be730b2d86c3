// Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with an HTTP status.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "kallpa/status.h"

namespace kallpa::server {

struct ApiError {
  int status = 400;
  std::string type = "invalid_request_error";  // invalid_request_error, authentication_error, server_error, ...
  std::string code;                            // machine-readable; "" renders as null
  std::string param;                           // the offending request field; "" renders as null
  std::string message;
  int retry_after_seconds = 0;  // > 0: the response carries Retry-After

  nlohmann::json to_json() const;
};

ApiError bad_request(std::string param, std::string message, std::string code = "invalid_value");
// A typed error from the engine or scheduler, mapped to the status a client can act on.
ApiError from_status(const Status& status);

}  // namespace kallpa::server
