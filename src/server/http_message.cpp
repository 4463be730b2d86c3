#include "server/http_message.h"

#include <algorithm>

namespace kallpa::server {
namespace {

char lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }

const std::string* find_header(const HttpHeaders& headers, std::string_view name) {
  for (const auto& [k, v] : headers) {
    if (same_header_name(k, name)) return &v;
  }
  return nullptr;
}

}  // namespace

bool same_header_name(std::string_view a, std::string_view b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](char x, char y) { return lower(x) == lower(y); });
}

std::string HttpRequest::get_header_value(std::string_view name) const {
  const std::string* v = find_header(headers, name);
  return v ? *v : std::string();
}

bool HttpRequest::has_header(std::string_view name) const { return find_header(headers, name) != nullptr; }

void HttpResponse::set_header(std::string_view name, std::string value) {
  for (auto& [k, v] : headers) {
    if (same_header_name(k, name)) {
      v = std::move(value);
      return;
    }
  }
  headers.emplace_back(std::string(name), std::move(value));
}

std::string HttpResponse::get_header_value(std::string_view name) const {
  const std::string* v = find_header(headers, name);
  return v ? *v : std::string();
}

void HttpResponse::set_content(std::string content, std::string_view type) {
  body = std::move(content);
  content_type = type;
  provider = nullptr;
}

void HttpResponse::set_chunked_content_provider(std::string_view type, ContentProvider p, ContentReleaser r) {
  body.clear();
  content_type = type;
  provider = std::move(p);
  releaser = std::move(r);
}

}  // namespace kallpa::server
