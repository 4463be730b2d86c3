// Cross-origin requests from browsers (the Fetch standard's CORS protocol): which origins may
// call the API, the answer to an OPTIONS preflight, and the headers on every other response.
// No origin is allowed unless the server is told (ServerOptions::cors_origins; "*": any).
#pragma once

#include <string>
#include <vector>

#include "server/http_message.h"

namespace kallpa::server {

class Cors {
 public:
  explicit Cors(std::vector<std::string> origins) : origins_(std::move(origins)) {}

  // A preflight for a route that accepts `methods` ("GET" or "POST"): 204, with the grant when
  // the origin is allowed (without it the browser refuses the call, as it should).
  void preflight(const HttpRequest& req, const std::string& methods, HttpResponse& res) const;
  // Any other response to a request that names an allowed Origin.
  void decorate(const HttpRequest& req, HttpResponse& res) const;

 private:
  // The Access-Control-Allow-Origin value for this request, or "" when its origin is not allowed.
  std::string allow_origin(const HttpRequest& req) const;
  std::vector<std::string> origins_;
};

}  // namespace kallpa::server
