// The HTTP/1.x transport under `kallpa serve`: Boost.Beast over one Asio event loop for every
// socket's I/O, and a pool of worker threads for the routes (docs/server.md, "Transport").
//
// A connection costs the event loop a few KiB and no thread while it connects, idles, sends its
// header or its body, or reads a response; a worker runs only from a fully read request to the end
// of its response (a stream included). Each phase has its own deadline, the header its byte and
// field limits (431), the body its byte limit (413), and each client address a bound on its open
// connections (429). The listening socket has SO_REUSEADDR and never SO_REUSEPORT, so a second
// server on the same port fails at bind().
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "kallpa/status.h"
#include "server/http_message.h"

namespace kallpa::server {

struct TransportOptions {
  std::string host = "127.0.0.1";
  int port = 8080;  // 0: any free port
  int backlog = 1024;
  int worker_threads = 16;
  double header_timeout_seconds = 10.0;      // from a request's first byte to the end of its header
  double body_timeout_seconds = 30.0;        // from the end of the header to the end of the body
  double keep_alive_timeout_seconds = 15.0;  // idle between requests on one connection
  double write_timeout_seconds = 30.0;       // for each write of a response to complete
  std::size_t max_header_bytes = 16 * 1024;  // request line and header fields together
  std::size_t max_header_fields = 100;
  std::size_t max_body_bytes = 1 << 20;
  int max_connections_per_client = 64;  // open connections from one client address
  int max_connections = 4096;           // open connections in all
};

class HttpTransport {
 public:
  // Runs on a worker thread; an exception is the route's to catch.
  using Handler = std::function<void(HttpRequest&, HttpResponse&)>;
  // Writes the body of an error the transport answers itself: res.status is set (400, 413, 429,
  // 431, 503) and res.body says why in plain text. Runs on the event loop, so it must be quick.
  using ErrorWriter = std::function<void(const HttpRequest&, HttpResponse&)>;
  // After a response has been written, or abandoned; on any thread.
  using Logger = std::function<void(const HttpRequest&, const HttpResponse&)>;

  HttpTransport(TransportOptions options, Handler handler, ErrorWriter error_writer, Logger logger);
  ~HttpTransport();
  HttpTransport(const HttpTransport&) = delete;
  HttpTransport& operator=(const HttpTransport&) = delete;

  // Opens the listening socket; returns the port. The error names the address and why.
  Result<int> bind();
  // Serves until stop(); returns once every connection is closed and every worker idle.
  void run();
  // From any thread but the event loop's and the workers': closes the listener and every
  // connection (a stream being written ends), waits for the workers, and makes run() return.
  void stop();

  struct Impl;  // named by http_transport.cpp's connections; defined there

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kallpa::server
