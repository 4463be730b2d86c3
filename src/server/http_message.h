// One HTTP request and its response as the routes see them: plain data, filled in by the
// transport (http_transport.h) from the wire and written back by it. Nothing here does I/O.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kallpa::server {

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

// Header names compare case-insensitively (RFC 9110 5.1).
bool same_header_name(std::string_view a, std::string_view b);

struct HttpRequest {
  std::uint64_t serial = 0;  // unique per request in this process, for per-request state
  std::string method;
  std::string path;    // the target without its query
  std::string target;  // as sent
  int version = 11;    // 10: HTTP/1.0, 11: HTTP/1.1
  HttpHeaders headers;
  std::string body;
  std::string remote_addr;
  std::vector<std::string> matches;  // a pattern route's captures, [0] the whole path
  // True once the client has hung up (polled while a response is being computed); false when the
  // client is still there or has only half-closed its side.
  std::function<bool()> client_gone;

  std::string get_header_value(std::string_view name) const;
  bool has_header(std::string_view name) const;
};

// What a streamed response's provider writes through. write() returns false once the client is gone.
struct DataSink {
  std::function<bool(const char* data, std::size_t size)> write;
  std::function<void()> done;
};
// Called until it returns false or calls done(); offset is the number of bytes written so far.
using ContentProvider = std::function<bool(std::size_t offset, DataSink& sink)>;
// Called once the stream is over: true when it finished (done()), false when it was abandoned.
using ContentReleaser = std::function<void(bool finished)>;

struct HttpResponse {
  int status = -1;  // -1: no route answered
  HttpHeaders headers;
  std::string body;
  std::string content_type;
  ContentProvider provider;  // set: a streamed response of unknown length
  ContentReleaser releaser;

  void set_header(std::string_view name, std::string value);
  std::string get_header_value(std::string_view name) const;
  void set_content(std::string content, std::string_view type);
  void set_chunked_content_provider(std::string_view type, ContentProvider p, ContentReleaser r = {});
};

}  // namespace kallpa::server
