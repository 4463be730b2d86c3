#include "server/hangup_probe.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <string_view>

namespace kallpa::server {

bool HangupProbe::client_gone() {
  if (gone_) return true;
  pollfd p{fd_, static_cast<short>(POLLIN | POLLRDHUP), 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if ((p.revents & (POLLERR | POLLHUP | POLLNVAL)) != 0) return gone_ = true;  // reset, or both sides shut
  if (probed_) return false;  // half-closed and still reading: nothing new until the reset would come
  char c = 0;
  const auto n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n > 0) return false;  // the next pipelined request, not an end
  if (n < 0) return gone_ = (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
  if (!http11_) return gone_ = true;
  constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
  probed_ = true;
  if (::send(fd_, kContinue.data(), kContinue.size(), MSG_NOSIGNAL | MSG_DONTWAIT) !=
      static_cast<ssize_t>(kContinue.size())) {
    return gone_ = true;
  }
  return false;
}

}  // namespace kallpa::server
