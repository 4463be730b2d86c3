#include "server/http_transport.h"

// Boost 1.74's asio/awaitable.hpp uses std::exchange without including <utility>.
#include <utility>

#include <atomic>
#include <chrono>
#include <future>
#include <list>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>

#include <fmt/format.h>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/string.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http.hpp>

#include "server/hangup_probe.h"

namespace kallpa::server {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using error_code = beast::error_code;

std::chrono::steady_clock::duration seconds(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}

// A read that ended because the client left or its deadline passed: nothing to answer.
bool ended_without_request(const error_code& ec) {
  return ec == beast::error::timeout || ec == http::error::end_of_stream || ec == http::error::partial_message ||
         ec == net::error::eof || ec == net::error::connection_reset || ec == net::error::operation_aborted;
}

constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
// After the last response on a connection: how long, and how much, the client's late bytes are
// read and dropped before the socket is closed, so that closing with unread data does not reset
// the connection before the client has read the response (a 431 sent mid-header, say).
constexpr double kLingerSeconds = 2.0;
constexpr std::size_t kLingerBytes = std::size_t{64} << 20;

}  // namespace

class Session;

struct HttpTransport::Impl {
  Impl(TransportOptions o, Handler h, ErrorWriter e, Logger l)
      : options(std::move(o)), handler(std::move(h)), error_writer(std::move(e)), logger(std::move(l)) {}

  void accept();
  void on_accept(const error_code& ec, tcp::socket socket);
  void release(const std::string& client, bool counted, std::list<std::weak_ptr<Session>>::iterator it);
  bool stopping() {
    std::lock_guard lock(mu);
    return stopping_;
  }

  TransportOptions options;
  Handler handler;
  ErrorWriter error_writer;
  Logger logger;

  net::io_context io{1};
  std::optional<net::executor_work_guard<net::io_context::executor_type>> guard{net::make_work_guard(io)};
  tcp::acceptor acceptor{io};
  net::steady_timer accept_retry{io};
  std::optional<net::thread_pool> workers;
  std::atomic<std::uint64_t> next_serial{1};

  std::mutex mu;  // guards the members below
  bool stopping_ = false;
  bool stopped_ = false;
  int open = 0;
  std::unordered_map<std::string, int> per_client;
  std::list<std::weak_ptr<Session>> sessions;
};

// One connection, from accept to close. Its socket I/O runs on the event loop; between a fully
// read request and the end of its response it is on a worker, which writes through the loop.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(HttpTransport::Impl& t, tcp::socket socket, std::string client)
      : t_(t), stream_(std::move(socket)), buffer_(t.options.max_header_bytes + 65536), client_(std::move(client)) {}

  ~Session() { t_.release(client_, counted_, registration_); }

  void start(std::list<std::weak_ptr<Session>>::iterator registration, int refuse_status) {
    registration_ = registration;
    counted_ = refuse_status == 0;
    if (refuse_status != 0) {
      refuse(refuse_status, refuse_status == 429 ? fmt::format("more than {} connections from {}",
                                                               t_.options.max_connections_per_client, client_)
                                                 : fmt::format("more than {} connections", t_.options.max_connections));
      return;
    }
    wait_request();
  }

  // On the event loop, at stop(): every pending and later read or write ends.
  void abort() {
    error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.socket().cancel(ec);
  }

 private:
  // Idle: until the first byte of the next request (a new connection: the header deadline).
  void wait_request() {
    if (t_.stopping()) return abort();
    if (buffer_.size() > 0) return read_header();
    stream_.expires_after(seconds(first_ ? t_.options.header_timeout_seconds : t_.options.keep_alive_timeout_seconds));
    stream_.async_read_some(buffer_.prepare(4096), [self = shared_from_this()](const error_code& ec, std::size_t n) {
      if (ec) return self->close();
      self->buffer_.commit(n);
      self->read_header();
    });
  }

  void read_header() {
    parser_.emplace();
    parser_->header_limit(static_cast<std::uint32_t>(t_.options.max_header_bytes));
    parser_->body_limit(t_.options.max_body_bytes);
    stream_.expires_after(seconds(t_.options.header_timeout_seconds));
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = shared_from_this()](const error_code& ec, std::size_t) { self->on_header(ec); });
  }

  void on_header(const error_code& ec) {
    if (ec == http::error::header_limit || ec == http::error::buffer_overflow) {
      return refuse(431, fmt::format("the request header exceeds {} bytes", t_.options.max_header_bytes));
    }
    if (ec == http::error::body_limit) {
      return refuse(413, fmt::format("the request body exceeds {} bytes", t_.options.max_body_bytes));
    }
    if (ended_without_request(ec)) return close();
    if (ec) return refuse(400, fmt::format("malformed request: {}", ec.message()));
    const auto& m = parser_->get();
    const auto fields = static_cast<std::size_t>(std::distance(m.begin(), m.end()));
    if (fields > t_.options.max_header_fields) {
      return refuse(431, fmt::format("the request has {} header fields; at most {} are accepted", fields,
                                     t_.options.max_header_fields));
    }
    if (m.version() >= 11 && beast::iequals(m[http::field::expect], "100-continue") && !parser_->is_done()) {
      stream_.expires_after(seconds(t_.options.write_timeout_seconds));
      net::async_write(stream_, net::buffer(kContinue.data(), kContinue.size()),
                       [self = shared_from_this()](const error_code& e, std::size_t) {
                         if (e) return self->close();
                         self->read_body();
                       });
      return;
    }
    read_body();
  }

  void read_body() {
    if (parser_->is_done()) return dispatch();
    stream_.expires_after(seconds(t_.options.body_timeout_seconds));
    http::async_read(stream_, buffer_, *parser_, [self = shared_from_this()](const error_code& ec, std::size_t) {
      if (ec == http::error::body_limit) {
        return self->refuse(413, fmt::format("the request body exceeds {} bytes", self->t_.options.max_body_bytes));
      }
      if (ended_without_request(ec)) return self->close();
      if (ec) return self->refuse(400, fmt::format("malformed request body: {}", ec.message()));
      self->dispatch();
    });
  }

  void fill_request() {
    auto& m = parser_->get();
    req_ = HttpRequest{};
    req_.serial = t_.next_serial.fetch_add(1);
    req_.method = std::string(m.method_string());
    req_.target = std::string(m.target());
    req_.path = req_.target.substr(0, req_.target.find('?'));
    req_.version = static_cast<int>(m.version());
    for (const auto& f : m) req_.headers.emplace_back(std::string(f.name_string()), std::string(f.value()));
    req_.body = std::move(m.body());
    req_.remote_addr = client_;
    keep_alive_ = m.keep_alive();
  }

  void dispatch() {
    fill_request();
    parser_.reset();
    stream_.expires_never();
    if (t_.stopping()) return abort();
    net::post(*t_.workers, [self = shared_from_this()] { self->serve(); });
  }

  // On a worker: the route, then the response.
  void serve() {
    HangupProbe probe(stream_.socket().native_handle(), req_.version >= 11);
    req_.client_gone = [&probe] { return probe.client_gone(); };
    res_ = HttpResponse{};
    try {
      t_.handler(req_, res_);
    } catch (const std::exception& e) {
      res_ = HttpResponse{};
      res_.status = 500;
      res_.set_content(fmt::format("internal error: {}", e.what()), "text/plain");
    }
    req_.client_gone = nullptr;
    if (res_.status < 0) res_.status = 500;
    const bool ok = res_.provider ? write_stream() : write_whole();
    t_.logger(req_, res_);
    // The response's state (a stream's provider holds its generation) ends with the response.
    res_ = HttpResponse{};
    req_ = HttpRequest{};
    net::post(stream_.get_executor(), [self = shared_from_this(), ok] {
      if (ok && self->keep_alive_) {
        self->first_ = false;
        self->wait_request();
      } else {
        self->close();
      }
    });
  }

  template <class Fields>
  void copy_headers(Fields& out, const HttpResponse& res) const {
    for (const auto& [k, v] : res.headers) out.set(k, v);
    if (!res.content_type.empty()) out.set(http::field::content_type, res.content_type);
  }

  bool write_whole() {
    http::response<http::string_body> msg{static_cast<http::status>(res_.status), static_cast<unsigned>(req_.version)};
    copy_headers(msg, res_);
    msg.body() = std::move(res_.body);
    msg.keep_alive(keep_alive_);
    try {
      msg.prepare_payload();  // throws for a body on a status that may have none (1xx, 204, 304)
    } catch (const std::exception&) {
      msg.body().clear();
      msg.prepare_payload();
    }
    std::ostringstream os;
    os << msg;
    const std::string bytes = os.str();
    return write(net::buffer(bytes));
  }

  // Chunked for HTTP/1.1; for HTTP/1.0, which has no chunks, the body ends where the connection does.
  bool write_stream() {
    const bool chunked = req_.version >= 11;
    http::response<http::empty_body> head{static_cast<http::status>(res_.status), static_cast<unsigned>(req_.version)};
    copy_headers(head, res_);
    if (chunked) {
      head.chunked(true);
    } else {
      keep_alive_ = false;
    }
    head.keep_alive(keep_alive_);
    std::ostringstream os;
    os << head.base();
    const std::string bytes = os.str();
    bool ok = write(net::buffer(bytes));
    bool finished = false;
    std::size_t offset = 0;
    DataSink sink;
    sink.write = [&](const char* data, std::size_t size) {
      if (!ok) return false;
      if (size == 0) return true;
      ok = chunked ? write(http::make_chunk(net::const_buffer(data, size))) : write(net::const_buffer(data, size));
      if (ok) offset += size;
      return ok;
    };
    sink.done = [&] {
      finished = true;
      if (ok && chunked) ok = write(http::make_chunk_last());
    };
    while (ok && !finished) {
      if (!res_.provider(offset, sink)) break;
    }
    if (res_.releaser) res_.releaser(ok && finished);
    if (!(ok && finished)) keep_alive_ = false;
    return ok && finished;
  }

  // From a worker: one write on the event loop, under the write deadline; false when it failed.
  template <class Buffers>
  bool write(const Buffers& buffers) {
    auto done = std::make_shared<std::promise<error_code>>();
    auto result = done->get_future();
    net::post(stream_.get_executor(), [self = shared_from_this(), &buffers, done] {
      self->stream_.expires_after(seconds(self->t_.options.write_timeout_seconds));
      net::async_write(self->stream_, buffers, [done](const error_code& ec, std::size_t) { done->set_value(ec); });
    });
    try {
      return !result.get();
    } catch (const std::future_error&) {
      return false;  // the event loop ended first
    }
  }

  // An error the transport answers itself, then the connection closes.
  void refuse(int status, std::string message) {
    HttpRequest req;
    req.serial = t_.next_serial.fetch_add(1);
    req.remote_addr = client_;
    if (parser_ && parser_->is_header_done()) {
      req.method = std::string(parser_->get().method_string());
      req.target = std::string(parser_->get().target());
      req.path = req.target.substr(0, req.target.find('?'));
    }
    auto res = std::make_shared<HttpResponse>();
    res->status = status;
    res->set_content(std::move(message), "text/plain");
    t_.error_writer(req, *res);
    http::response<http::string_body> msg{static_cast<http::status>(status), 11};
    copy_headers(msg, *res);
    msg.body() = res->body;
    msg.keep_alive(false);
    msg.prepare_payload();
    std::ostringstream os;
    os << msg;
    auto bytes = std::make_shared<std::string>(os.str());
    parser_.reset();
    stream_.expires_after(seconds(t_.options.write_timeout_seconds));
    net::async_write(stream_, net::buffer(*bytes),
                     [self = shared_from_this(), bytes, req = std::move(req), res](const error_code&, std::size_t) {
                       self->t_.logger(req, *res);
                       self->close();
                     });
  }

  // Ends the connection: no more sending, then the client's late bytes are dropped until it closes.
  void close() {
    error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    if (ec) return;
    buffer_.clear();
    linger_deadline_ = std::chrono::steady_clock::now() + seconds(kLingerSeconds);
    drain();
  }

  void drain() {
    if (lingered_ > kLingerBytes || std::chrono::steady_clock::now() >= linger_deadline_) return;
    stream_.expires_at(linger_deadline_);
    stream_.async_read_some(net::buffer(discard_), [self = shared_from_this()](const error_code& ec, std::size_t n) {
      self->lingered_ += n;
      if (!ec) self->drain();
    });
  }

  HttpTransport::Impl& t_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::string client_;
  std::list<std::weak_ptr<Session>>::iterator registration_;
  bool counted_ = false;  // against its client's bound (a refused connection is not)
  std::optional<http::request_parser<http::string_body>> parser_;
  bool first_ = true;
  bool keep_alive_ = false;
  HttpRequest req_;
  HttpResponse res_;
  std::chrono::steady_clock::time_point linger_deadline_;
  std::size_t lingered_ = 0;
  char discard_[16384] = {};
};

void HttpTransport::Impl::accept() {
  acceptor.async_accept([this](const error_code& ec, tcp::socket socket) { on_accept(ec, std::move(socket)); });
}

void HttpTransport::Impl::on_accept(const error_code& ec, tcp::socket socket) {
  if (!acceptor.is_open() || ec == net::error::operation_aborted) return;
  if (ec) {
    // Out of descriptors, say: try again shortly instead of spinning.
    accept_retry.expires_after(std::chrono::milliseconds(50));
    accept_retry.async_wait([this](const error_code& e) {
      if (!e) accept();
    });
    return;
  }
  error_code addr_ec;
  const auto remote = socket.remote_endpoint(addr_ec);
  if (addr_ec) return accept();  // gone already
  std::string client = remote.address().to_string();
  int refuse = 0;
  std::list<std::weak_ptr<Session>>::iterator registration;
  auto session = std::make_shared<Session>(*this, std::move(socket), client);
  {
    std::lock_guard lock(mu);
    if (open >= options.max_connections) {
      refuse = 503;
    } else if (per_client[client] >= options.max_connections_per_client) {
      refuse = 429;
    }
    ++open;
    if (refuse == 0) ++per_client[client];
    registration = sessions.insert(sessions.end(), session);
  }
  session->start(registration, refuse);
  accept();
}

void HttpTransport::Impl::release(const std::string& client, bool counted,
                                  std::list<std::weak_ptr<Session>>::iterator it) {
  std::lock_guard lock(mu);
  --open;
  if (auto c = per_client.find(client); counted && c != per_client.end() && --c->second <= 0) per_client.erase(c);
  sessions.erase(it);
}

HttpTransport::HttpTransport(TransportOptions options, Handler handler, ErrorWriter error_writer, Logger logger)
    : impl_(
          std::make_unique<Impl>(std::move(options), std::move(handler), std::move(error_writer), std::move(logger))) {
  impl_->workers.emplace(static_cast<std::size_t>(std::max(1, impl_->options.worker_threads)));
}

HttpTransport::~HttpTransport() { stop(); }

Result<int> HttpTransport::bind() {
  Impl& t = *impl_;
  error_code ec;
  const auto address = net::ip::make_address(t.options.host, ec);
  if (ec) {
    return Status(ErrorCode::invalid_argument, "host", fmt::format("'{}' is not an IP address", t.options.host));
  }
  const tcp::endpoint endpoint(address, static_cast<unsigned short>(t.options.port));
  const auto fail = [&](std::string_view step) {
    return Status(
        ErrorCode::invalid_argument, "port",
        fmt::format("cannot listen on {}:{}: {} failed: {}{}", t.options.host, t.options.port, step, ec.message(),
                    ec == net::error::address_in_use ? " (another process listens on this port)" : ""));
  };
  t.acceptor.open(endpoint.protocol(), ec);
  if (ec) return fail("socket");
  // SO_REUSEADDR lets a restarted server bind while old connections are in TIME_WAIT; on Linux it
  // never lets two sockets listen on one port (SO_REUSEPORT would, and is not set).
  t.acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  t.acceptor.bind(endpoint, ec);
  if (ec) return fail("bind");
  t.acceptor.listen(t.options.backlog, ec);
  if (ec) return fail("listen");
  return static_cast<int>(t.acceptor.local_endpoint().port());
}

void HttpTransport::run() {
  Impl& t = *impl_;
  {
    std::lock_guard lock(t.mu);
    if (t.stopping_) return;
  }
  t.accept();
  t.io.run();
}

void HttpTransport::stop() {
  Impl& t = *impl_;
  {
    std::lock_guard lock(t.mu);
    if (t.stopped_) return;
    t.stopped_ = true;
    t.stopping_ = true;
  }
  net::post(t.io, [&t] {
    error_code ec;
    t.acceptor.close(ec);
    t.accept_retry.cancel();
    std::vector<std::shared_ptr<Session>> live;
    {
      std::lock_guard lock(t.mu);
      for (auto& w : t.sessions) {
        if (auto s = w.lock()) live.push_back(std::move(s));
      }
    }
    for (auto& s : live) s->abort();
  });
  t.workers->join();
  net::post(t.io, [&t] { t.guard.reset(); });
}

}  // namespace kallpa::server
