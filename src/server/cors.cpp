#include "server/cors.h"

#include <algorithm>

namespace kallpa::server {

std::string Cors::allow_origin(const HttpRequest& req) const {
  const std::string origin = req.get_header_value("Origin");
  if (origin.empty()) return {};
  if (std::find(origins_.begin(), origins_.end(), "*") != origins_.end()) return "*";
  return std::find(origins_.begin(), origins_.end(), origin) != origins_.end() ? origin : std::string();
}

void Cors::preflight(const HttpRequest& req, const std::string& methods, HttpResponse& res) const {
  res.status = 204;
  res.set_header("Allow", methods + ", OPTIONS");
  const std::string allowed = allow_origin(req);
  if (allowed.empty()) return;
  res.set_header("Access-Control-Allow-Origin", allowed);
  res.set_header("Access-Control-Allow-Methods", methods + ", OPTIONS");
  const std::string asked = req.get_header_value("Access-Control-Request-Headers");
  res.set_header("Access-Control-Allow-Headers", asked.empty() ? "Authorization, Content-Type, X-Request-Id" : asked);
  res.set_header("Access-Control-Max-Age", "600");
  if (allowed != "*") res.set_header("Vary", "Origin");
}

void Cors::decorate(const HttpRequest& req, HttpResponse& res) const {
  const std::string allowed = allow_origin(req);
  if (allowed.empty()) return;
  res.set_header("Access-Control-Allow-Origin", allowed);
  res.set_header("Access-Control-Expose-Headers", "X-Request-Id, Retry-After");
  if (allowed != "*") res.set_header("Vary", "Origin");
}

}  // namespace kallpa::server
