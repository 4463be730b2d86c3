// How a rank waits between two polls of a transfer that has not finished (MPI_Test, a CUDA stream's
// query). The first moments of a wait yield rather than sleep: a short message (a decode step's
// partial result) is usually a few microseconds away, and a sleep costs at least the timer slack.
// After that a rank sleeps, since one that spins would take the core its peers compute on when
// ranks share a machine; but never long, as MPI moves a large message's fragments only while some
// call (the poll) drives its progress.
#pragma once

#include <chrono>
#include <thread>

namespace kallpa::ring {

class PollPause {
 public:
  using clock = std::chrono::steady_clock;
  explicit PollPause(clock::time_point start) : start_(start) {}

  void operator()(clock::time_point now) {
    if (now - start_ < std::chrono::microseconds(1000)) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    if (sleep_ < std::chrono::microseconds(50)) sleep_ *= 2;
  }

 private:
  clock::time_point start_;
  std::chrono::microseconds sleep_{5};
};

}  // namespace kallpa::ring
