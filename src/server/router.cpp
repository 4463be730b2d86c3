#include "server/router.h"

#include <string>
#include <string_view>

namespace kallpa::server {
namespace {

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// A captured path segment as the client meant it: clients percent-encode what a path may not hold
// (the openai client sends a model id "A B" as "A%20B", RFC 3986 2.1). A '%' not followed by two
// hex digits stays as it is.
std::string percent_decoded(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && hex_digit(s[i + 1]) >= 0 && hex_digit(s[i + 2]) >= 0) {
      out.push_back(static_cast<char>(hex_digit(s[i + 1]) * 16 + hex_digit(s[i + 2])));
      i += 2;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

}  // namespace

void Router::add(const char* method, const std::string& pattern, Handler handler) {
  Route r;
  r.method = method;
  r.is_prefix = !pattern.empty() && pattern.back() == '*';
  r.pattern = r.is_prefix ? pattern.substr(0, pattern.size() - 1) : pattern;
  r.handler = std::move(handler);
  routes_.push_back(std::move(r));
}

Router::Outcome Router::dispatch(HttpRequest& req, HttpResponse& res, std::string* allowed) const {
  bool path_known = false;
  std::string methods;
  for (const Route& r : routes_) {
    const bool match =
        r.is_prefix ? req.path.size() > r.pattern.size() && req.path.rfind(r.pattern, 0) == 0 : req.path == r.pattern;
    if (!match) continue;
    path_known = true;
    if (r.method != req.method) {
      if (methods.find(r.method) == std::string::npos) methods += methods.empty() ? r.method : ", " + r.method;
      continue;
    }
    req.matches = {req.path};
    if (r.is_prefix) req.matches.push_back(percent_decoded(std::string_view(req.path).substr(r.pattern.size())));
    r.handler(req, res);
    if (res.status < 0) res.status = 200;  // a route that only set a body or a stream
    return Outcome::handled;
  }
  if (allowed) *allowed = methods;
  return path_known ? Outcome::wrong_method : Outcome::no_route;
}

}  // namespace kallpa::server
