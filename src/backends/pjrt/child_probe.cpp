#include "backends/pjrt/child_probe.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

namespace kallpa::pjrt {
namespace {

constexpr int kErrorExit = 3;  // the child's fn returned an error (message on the pipe)
constexpr std::string_view kErrorTag = "kallpa-pjrt-probe-error: ";
constexpr std::size_t kKeepBytes = 16 * 1024;  // of the child's output, the tail
constexpr std::size_t kLastLines = 8;

void write_all(int fd, std::string_view text) noexcept {
  while (!text.empty()) {
    const ssize_t n = ::write(fd, text.data(), text.size());
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return;
    }
    text.remove_prefix(static_cast<std::size_t>(n));
  }
}

// The last few non-empty lines of `text`, joined by " | ".
std::string last_lines(std::string_view text) {
  std::vector<std::string_view> lines;
  while (!text.empty()) {
    const std::size_t end = text.find('\n');
    std::string_view line = text.substr(0, end);
    if (!line.empty()) lines.push_back(line);
    if (end == std::string_view::npos) break;
    text.remove_prefix(end + 1);
  }
  const std::size_t from = lines.size() > kLastLines ? lines.size() - kLastLines : 0;
  std::string out;
  for (std::size_t i = from; i < lines.size(); ++i) {
    if (!out.empty()) out += " | ";
    out += lines[i];
  }
  return out;
}

}  // namespace

ChildOutcome run_in_child(const std::function<Status()>& fn, double timeout_seconds) {
  ChildOutcome outcome;
  int fds[2];
  if (::pipe(fds) != 0) {
    outcome.kind = ChildOutcome::Kind::error;
    outcome.status = Status(ErrorCode::internal, "pjrt probe", fmt::format("pipe: {}", std::strerror(errno)));
    return outcome;
  }
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    outcome.kind = ChildOutcome::Kind::error;
    outcome.status = Status(ErrorCode::internal, "pjrt probe", fmt::format("fork: {}", std::strerror(errno)));
    return outcome;
  }
  if (pid == 0) {
    ::close(fds[0]);
    ::dup2(fds[1], STDERR_FILENO);
    ::dup2(fds[1], STDOUT_FILENO);
    int code = 0;
    try {
      const Status s = fn();
      if (!s) {
        write_all(fds[1], fmt::format("\n{}{}\n", kErrorTag, s.to_string()));
        code = kErrorExit;
      }
    } catch (const std::exception& e) {
      write_all(fds[1], fmt::format("\n{}{}\n", kErrorTag, e.what()));
      code = kErrorExit;
    }
    ::_exit(code);
  }
  ::close(fds[1]);

  std::string output;
  bool timed_out = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(left.count(), 1000)));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    char buf[4096];
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // EOF: the child has exited (or closed its output)
    output.append(buf, static_cast<std::size_t>(n));
    if (output.size() > 2 * kKeepBytes) output.erase(0, output.size() - kKeepBytes);
  }
  ::close(fds[0]);
  if (timed_out) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }

  const std::string words = last_lines(output);
  const auto with_words = [&](std::string how) {
    return words.empty() ? how + " (it wrote nothing)" : how + "; its last words: " + words;
  };
  if (timed_out) {
    outcome.kind = ChildOutcome::Kind::crashed;
    outcome.reason = with_words(fmt::format("did not finish within {:g} s and was killed", timeout_seconds));
  } else if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    outcome.kind = ChildOutcome::Kind::crashed;
    outcome.reason = with_words(fmt::format("was killed by signal {} ({})", sig, strsignal(sig)));
  } else if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    outcome.kind = ChildOutcome::Kind::ok;
  } else if (WIFEXITED(status) && WEXITSTATUS(status) == kErrorExit) {
    outcome.kind = ChildOutcome::Kind::error;
    const std::size_t at = output.rfind(kErrorTag);
    std::string message = at == std::string::npos ? words : output.substr(at + kErrorTag.size());
    while (!message.empty() && message.back() == '\n') message.pop_back();
    outcome.status = Status(ErrorCode::backend_failure, "pjrt probe", message);
  } else {
    outcome.kind = ChildOutcome::Kind::crashed;
    outcome.reason = with_words(fmt::format("exited with status {}", WIFEXITED(status) ? WEXITSTATUS(status) : -1));
  }
  return outcome;
}

}  // namespace kallpa::pjrt
