// The server's HTTP transport (src/server/http_transport.h) on a loopback port, driven by raw
// sockets: limits, deadlines, keep-alive, HTTP/1.0 streams, hang-ups and half-closes, per-client
// connection bounds and an exclusive port; and the router and CORS rules above it.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "server/cors.h"
#include "server/http_transport.h"
#include "server/router.h"

namespace kallpa::server {
namespace {

using namespace std::chrono_literals;

// A connected client socket, closed on destruction.
class Client {
 public:
  explicit Client(int port) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ok_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  }
  ~Client() { close(); }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  bool connected() const { return ok_; }
  bool send(std::string_view data) {
    return ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(data.size());
  }
  void shutdown_write() { ::shutdown(fd_, SHUT_WR); }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  // Everything until the server closes (or `deadline` passes).
  std::string read_all(std::chrono::milliseconds deadline = 10s) {
    std::string out;
    const auto end = std::chrono::steady_clock::now() + deadline;
    while (std::chrono::steady_clock::now() < end) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      char buf[4096];
      const auto n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) break;
      out.append(buf, static_cast<std::size_t>(n));
    }
    return out;
  }
  // One response's head and body on a kept-alive connection (Content-Length bodies only).
  std::string read_response() {
    std::string out;
    for (int i = 0; i < 200; ++i) {
      const auto head_end = out.find("\r\n\r\n");
      if (head_end != std::string::npos) {
        const auto cl = out.find("Content-Length: ");
        const std::size_t length = cl == std::string::npos ? 0 : std::stoul(out.substr(cl + 16));
        if (out.size() >= head_end + 4 + length) return out;
      }
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      char buf[4096];
      const auto n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) break;
      out.append(buf, static_cast<std::size_t>(n));
    }
    return out;
  }
  // True while the server has neither closed nor reset the connection.
  bool open() const {
    char c = 0;
    const auto n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n > 0 || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
  }

 private:
  int fd_;
  bool ok_ = false;
};

// A transport serving a few test routes on a free port, run on its own thread.
class Served {
 public:
  explicit Served(TransportOptions o = {}) {
    o.host = "127.0.0.1";
    o.port = 0;
    transport_ = std::make_unique<HttpTransport>(
        o, [this](HttpRequest& req, HttpResponse& res) { handle(req, res); },
        [](const HttpRequest&, HttpResponse& res) { res.set_content("refused: " + res.body, "text/plain"); },
        [this](const HttpRequest&, const HttpResponse& res) {
          std::lock_guard lock(mu_);
          statuses_.push_back(res.status);
        });
    auto port = transport_->bind();
    EXPECT_TRUE(port.is_ok()) << port.status().to_string();
    port_ = port.is_ok() ? *port : 0;
    thread_ = std::thread([this] { transport_->run(); });
  }
  ~Served() {
    transport_->stop();
    thread_.join();
  }
  int port() const { return port_; }
  std::vector<int> statuses() {
    std::lock_guard lock(mu_);
    return statuses_;
  }
  std::atomic<int> slow_polls{0};
  std::atomic<bool> slow_saw_hangup{false};
  std::atomic<bool> slow_finished{false};

 private:
  void handle(HttpRequest& req, HttpResponse& res) {
    if (req.path == "/slow") {  // 2 s of "work", watching the client as completions.cpp does
      for (int i = 0; i < 40; ++i) {
        std::this_thread::sleep_for(50ms);
        ++slow_polls;
        if (req.client_gone()) {
          slow_saw_hangup = true;
          res.status = 499;
          return;
        }
      }
      slow_finished = true;
    }
    if (req.path == "/stream") {
      auto n = std::make_shared<int>(0);
      res.status = 200;
      res.set_chunked_content_provider("text/event-stream", [n](std::size_t, DataSink& sink) {
        const std::string event = "data: " + std::to_string(*n) + "\n\n";
        if (!sink.write(event.data(), event.size())) return false;
        if (++*n == 3) sink.done();
        return true;
      });
      return;
    }
    res.status = 200;
    res.set_content(req.method + " " + req.path + " " + std::to_string(req.body.size()), "text/plain");
  }

  std::unique_ptr<HttpTransport> transport_;
  std::thread thread_;
  int port_ = 0;
  std::mutex mu_;
  std::vector<int> statuses_;
};

bool starts_with(const std::string& s, std::string_view prefix) { return s.rfind(prefix, 0) == 0; }

TEST(HttpTransport, AnswersAndKeepsTheConnection) {
  Served s;
  Client c(s.port());
  ASSERT_TRUE(c.connected());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(c.send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"));
    const std::string r = c.read_response();
    EXPECT_TRUE(starts_with(r, "HTTP/1.1 200 OK\r\n")) << r;
    EXPECT_NE(r.find("\r\n\r\nPOST /echo 5"), std::string::npos) << r;
  }
  EXPECT_TRUE(c.open());
}

TEST(HttpTransport, IdleConnectionClosesAtTheKeepAliveTimeout) {
  Served s({.keep_alive_timeout_seconds = 0.3});
  Client c(s.port());
  ASSERT_TRUE(c.send("GET /a HTTP/1.1\r\nHost: x\r\n\r\n"));
  EXPECT_TRUE(starts_with(c.read_response(), "HTTP/1.1 200 "));
  EXPECT_EQ(c.read_all(5s), "");  // then the server closes it
  EXPECT_FALSE(c.open());
}

TEST(HttpTransport, TooManyHeaderFieldsGet431) {
  Served s({.max_header_fields = 10});
  Client c(s.port());
  std::string req = "GET /a HTTP/1.1\r\nHost: x\r\n";
  for (int i = 0; i < 12; ++i) req += "X-F" + std::to_string(i) + ": v\r\n";
  ASSERT_TRUE(c.send(req + "\r\n"));
  const std::string r = c.read_all();
  EXPECT_TRUE(starts_with(r, "HTTP/1.1 431 ")) << r;
  EXPECT_NE(r.find("refused: the request has 13 header fields"), std::string::npos) << r;
}

TEST(HttpTransport, OversizedHeaderGets431WhileStillSending) {
  Served s({.max_header_bytes = 4096});
  Client c(s.port());
  ASSERT_TRUE(c.send("GET /a HTTP/1.1\r\nHost: x\r\n"));
  // 1 MB of header fields: the answer comes once 4 KiB are in; the rest is read and dropped.
  const std::string fields(1000, 'v');
  for (int i = 0; i < 1000; ++i) c.send("X-Big: " + fields + "\r\n");
  const std::string r = c.read_all();
  EXPECT_TRUE(starts_with(r, "HTTP/1.1 431 ")) << r.substr(0, 200);
  EXPECT_EQ(s.statuses(), std::vector<int>{431});
}

TEST(HttpTransport, OversizedBodyGets413) {
  Served s({.max_body_bytes = 100});
  Client c(s.port());
  ASSERT_TRUE(c.send("POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 101\r\n\r\n" + std::string(101, 'x')));
  EXPECT_TRUE(starts_with(c.read_all(), "HTTP/1.1 413 "));
}

TEST(HttpTransport, TricklingHeadersHoldNoWorkerAndMeetTheirDeadline) {
  // One worker only: if a trickling connection held it, the normal request would wait.
  Served s({.worker_threads = 1, .header_timeout_seconds = 1.0});
  std::vector<std::unique_ptr<Client>> slow;
  for (int i = 0; i < 50; ++i) {
    slow.push_back(std::make_unique<Client>(s.port()));
    ASSERT_TRUE(slow.back()->send("POST /v1/chat/comp"));
  }
  Client c(s.port());
  ASSERT_TRUE(c.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n"));
  EXPECT_TRUE(starts_with(c.read_response(), "HTTP/1.1 200 "));
  for (auto& t : slow) EXPECT_TRUE(t->open());
  for (auto& t : slow) {
    t->send("l");
    EXPECT_EQ(t->read_all(5s), "");  // closed at the header deadline, without an answer
  }
}

TEST(HttpTransport, Http10StreamIsCloseDelimited) {
  Served s;
  Client c(s.port());
  ASSERT_TRUE(c.send("GET /stream HTTP/1.0\r\n\r\n"));
  const std::string r = c.read_all();
  EXPECT_TRUE(starts_with(r, "HTTP/1.0 200 OK\r\n")) << r;
  EXPECT_EQ(r.find("chunked"), std::string::npos) << r;
  EXPECT_NE(r.find("\r\n\r\ndata: 0\n\ndata: 1\n\ndata: 2\n\n"), std::string::npos) << r;

  Client c11(s.port());
  ASSERT_TRUE(c11.send("GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
  const std::string r11 = c11.read_all();
  EXPECT_NE(r11.find("Transfer-Encoding: chunked"), std::string::npos) << r11;
  EXPECT_NE(r11.find("9\r\ndata: 2\n\n\r\n0\r\n\r\n"), std::string::npos) << r11;
}

TEST(HttpTransport, HalfClosedClientGetsItsAnswer) {
  Served s;
  Client c(s.port());
  ASSERT_TRUE(c.send("GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"));
  c.shutdown_write();
  const std::string r = c.read_all();
  // The interim response that told the half-close from a hang-up, then the answer.
  EXPECT_TRUE(starts_with(r, "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")) << r;
  EXPECT_TRUE(s.slow_finished.load());
  EXPECT_FALSE(s.slow_saw_hangup.load());
}

TEST(HttpTransport, HangUpIsSeenWhileTheAnswerIsComputed) {
  Served s;
  {
    Client c(s.port());
    ASSERT_TRUE(c.send("GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"));
    while (s.slow_polls.load() < 2) std::this_thread::sleep_for(10ms);
  }  // closed
  for (int i = 0; i < 400 && !s.slow_saw_hangup.load() && !s.slow_finished.load(); ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(s.slow_saw_hangup.load());
  EXPECT_FALSE(s.slow_finished.load());
}

TEST(HttpTransport, BoundsConnectionsPerClient) {
  Served s({.max_connections_per_client = 3});
  std::vector<std::unique_ptr<Client>> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(std::make_unique<Client>(s.port()));
    ASSERT_TRUE(held.back()->send("GET /a HTTP/1.1\r\nHost: x\r\n\r\n"));
    EXPECT_TRUE(starts_with(held.back()->read_response(), "HTTP/1.1 200 "));
  }
  Client fourth(s.port());
  fourth.send("GET /a HTTP/1.1\r\nHost: x\r\n\r\n");
  const std::string r = fourth.read_all();
  EXPECT_TRUE(starts_with(r, "HTTP/1.1 429 ")) << r;
  EXPECT_NE(r.find("more than 3 connections from 127.0.0.1"), std::string::npos) << r;
  held.pop_back();
  std::string again;
  for (int i = 0; i < 100 && !starts_with(again, "HTTP/1.1 200 "); ++i) {
    std::this_thread::sleep_for(20ms);  // until the server has seen the close
    Client next(s.port());
    next.send("GET /a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    again = next.read_all();
  }
  EXPECT_TRUE(starts_with(again, "HTTP/1.1 200 ")) << again;
}

TEST(HttpTransport, SecondListenerOnAPortFails) {
  Served s;
  HttpTransport second(
      {.host = "127.0.0.1", .port = s.port()}, [](HttpRequest&, HttpResponse&) {},
      [](const HttpRequest&, HttpResponse&) {}, [](const HttpRequest&, const HttpResponse&) {});
  auto r = second.bind();
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().to_string().find("Address already in use"), std::string::npos) << r.status().to_string();
}

TEST(HttpTransport, StopBeforeRunReturnsAtOnce) {
  HttpTransport t(
      {.host = "127.0.0.1", .port = 0}, [](HttpRequest&, HttpResponse&) {}, [](const HttpRequest&, HttpResponse&) {},
      [](const HttpRequest&, const HttpResponse&) {});
  ASSERT_TRUE(t.bind().is_ok());
  t.stop();
  t.run();  // returns: stopped already
}

TEST(Router, ExactPrefixAndWrongMethod) {
  Router r;
  std::string seen;
  r.Get("/a", [&](const HttpRequest&, HttpResponse&) { seen = "get a"; });
  r.Post("/a", [&](const HttpRequest&, HttpResponse&) { seen = "post a"; });
  r.Get("/m/*", [&](const HttpRequest& req, HttpResponse&) { seen = "m " + req.matches[1]; });
  HttpRequest req;
  HttpResponse res;
  req.method = "POST";
  req.path = "/a";
  EXPECT_EQ(r.dispatch(req, res), Router::Outcome::handled);
  EXPECT_EQ(seen, "post a");
  req.method = "GET";
  req.path = "/m/x/y";
  EXPECT_EQ(r.dispatch(req, res), Router::Outcome::handled);
  EXPECT_EQ(seen, "m x/y");
  req.path = "/m/A%20b%2fc%zz%4";  // a capture is percent-decoded; a '%' without two hex digits stays
  EXPECT_EQ(r.dispatch(req, res), Router::Outcome::handled);
  EXPECT_EQ(seen, "m A b/c%zz%4");
  req.path = "/m/";  // the prefix alone names nothing
  EXPECT_EQ(r.dispatch(req, res), Router::Outcome::no_route);
  std::string allowed;
  req.method = "DELETE";
  req.path = "/a";
  EXPECT_EQ(r.dispatch(req, res, &allowed), Router::Outcome::wrong_method);
  EXPECT_EQ(allowed, "GET, POST");
}

TEST(Cors, GrantsOnlyConfiguredOrigins) {
  const Cors cors({"https://app.example"});
  HttpRequest req;
  req.headers = {{"origin", "https://app.example"}, {"Access-Control-Request-Headers", "authorization"}};
  HttpResponse pre;
  cors.preflight(req, "POST", pre);
  EXPECT_EQ(pre.status, 204);
  EXPECT_EQ(pre.get_header_value("Access-Control-Allow-Origin"), "https://app.example");
  EXPECT_EQ(pre.get_header_value("Access-Control-Allow-Methods"), "POST, OPTIONS");
  EXPECT_EQ(pre.get_header_value("Access-Control-Allow-Headers"), "authorization");
  EXPECT_EQ(pre.get_header_value("Vary"), "Origin");

  req.headers = {{"Origin", "https://other.example"}};
  HttpResponse refused;
  cors.preflight(req, "POST", refused);
  EXPECT_EQ(refused.status, 204);
  EXPECT_EQ(refused.get_header_value("Access-Control-Allow-Origin"), "");
  HttpResponse plain;
  cors.decorate(req, plain);
  EXPECT_TRUE(plain.headers.empty());

  HttpResponse any;
  Cors({"*"}).decorate(req, any);
  EXPECT_EQ(any.get_header_value("access-control-allow-origin"), "*");
}

}  // namespace
}  // namespace kallpa::server
