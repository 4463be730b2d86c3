#include "server/router.h"

namespace kallpa::server {

void Router::add(const char* method, const std::string& pattern, Handler handler) {
  Route r;
  r.method = method;
  r.pattern = pattern;
  r.is_regex = pattern.find_first_of("()[]*+?\\") != std::string::npos;
  if (r.is_regex) r.regex = std::regex(pattern);
  r.handler = std::move(handler);
  routes_.push_back(std::move(r));
}

Router::Outcome Router::dispatch(HttpRequest& req, HttpResponse& res, std::string* allowed) const {
  bool path_known = false;
  std::string methods;
  for (const Route& r : routes_) {
    std::smatch m;
    if (r.is_regex ? !std::regex_match(req.path, m, r.regex) : req.path != r.pattern) continue;
    path_known = true;
    if (r.method != req.method) {
      if (methods.find(r.method) == std::string::npos) methods += methods.empty() ? r.method : ", " + r.method;
      continue;
    }
    req.matches.clear();
    if (r.is_regex) {
      for (const auto& sub : m) req.matches.push_back(sub.str());
    } else {
      req.matches.push_back(req.path);
    }
    r.handler(req, res);
    return Outcome::handled;
  }
  if (allowed) *allowed = methods;
  return path_known ? Outcome::wrong_method : Outcome::no_route;
}

}  // namespace kallpa::server
