// Whether the client of a connection that is waiting for its response has hung up, told apart
// from a client that only half-closed (shutdown(SHUT_WR) after its request, still reading).
//
// Both send a FIN, so reading shows the same end of stream. What differs is the other side's
// socket: a closed one answers data with a reset. On the first end of stream the probe therefore
// writes an interim "100 Continue" (which an HTTP/1.1 client must skip, RFC 9110 15.2); a reset
// then shows as an error on the socket at a later poll. An HTTP/1.0 client may not be sent a 1xx
// response, so for it an end of stream counts as a hang-up.
#pragma once

namespace kallpa::server {

class HangupProbe {
 public:
  HangupProbe(int fd, bool http11) : fd_(fd), http11_(http11) {}
  // Non-blocking. Only while nothing else reads or writes the socket.
  bool client_gone();

 private:
  int fd_;
  bool http11_;
  bool probed_ = false;
  bool gone_ = false;
};

}  // namespace kallpa::server
