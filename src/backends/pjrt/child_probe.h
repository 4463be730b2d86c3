// Runs a piece of first contact with an unknown PJRT plugin in a child process. XLA aborts the
// whole process on some inputs it rejects (a CHECK failure, not an error), and some plugins hang
// (libtpu waiting on a cloud metadata server); in a child, either costs the child, and the host
// learns what happened and the child's last words on stderr.
#pragma once

#include <functional>
#include <string>

#include "kallpa/status.h"

namespace kallpa::pjrt {

struct ChildOutcome {
  enum class Kind {
    ok,       // the function returned ok
    error,    // it returned an error: `status`
    crashed,  // the child died (signal, unexpected exit) or overran the time limit: `reason`
  };
  Kind kind = Kind::ok;
  Status status;
  std::string reason;  // crashed: how it ended, then its last lines on stderr and stdout
};

// Forks; the child runs `fn` with stderr and stdout captured and leaves with _exit (no atexit
// handlers of the plugin run). The parent waits up to `timeout_seconds`, then kills the child.
ChildOutcome run_in_child(const std::function<Status()>& fn, double timeout_seconds);

}  // namespace kallpa::pjrt
