#include "server/router.h"

namespace kallpa::server {

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
    if (r.is_prefix) req.matches.push_back(req.path.substr(r.pattern.size()));
    r.handler(req, res);
    if (res.status < 0) res.status = 200;  // a route that only set a body or a stream
    return Outcome::handled;
  }
  if (allowed) *allowed = methods;
  return path_known ? Outcome::wrong_method : Outcome::no_route;
}

}  // namespace kallpa::server
