// The server's routes: a method and a path, tried in the order they were added. A path is exact, or
// ends in `*`: a prefix, and the rest of the path (at least one character) lands in
// HttpRequest::matches[1]. (No regular expressions: <regex> alone costs seconds of compile time.)
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "server/http_message.h"

namespace kallpa::server {

class Router {
 public:
  using Handler = std::function<void(const HttpRequest&, HttpResponse&)>;

  void Get(const std::string& pattern, Handler handler) { add("GET", pattern, std::move(handler)); }
  void Post(const std::string& pattern, Handler handler) { add("POST", pattern, std::move(handler)); }

  enum class Outcome { handled, no_route, wrong_method };
  // Runs the route for req. wrong_method: the path has routes, none for this method; *allowed
  // then lists their methods ("GET, POST").
  Outcome dispatch(HttpRequest& req, HttpResponse& res, std::string* allowed = nullptr) const;

 private:
  struct Route {
    std::string method;
    std::string pattern;  // a prefix when is_prefix
    bool is_prefix = false;
    Handler handler;
  };
  void add(const char* method, const std::string& pattern, Handler handler);
  std::vector<Route> routes_;
};

}  // namespace kallpa::server
