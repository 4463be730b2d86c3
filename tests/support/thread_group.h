// A process group (kallpa/process_group.h) whose ranks are threads of one process: the collectives
// of context-parallel generation without MPI, so that tests run them anywhere (and under the
// sanitizers). Each collective is two barrier phases: every rank publishes its input, each copies
// what it needs, and no rank leaves (and reuses its buffer) before every rank has copied.
#pragma once

#include <barrier>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kallpa/process_group.h"

namespace kallpa::testing {

class ThreadGroup {
 public:
  explicit ThreadGroup(int size) : barrier_(size), inputs_(static_cast<std::size_t>(size)) {
    for (int r = 0; r < size; ++r) ranks_.push_back(std::make_unique<Rank>(*this, r));
  }
  int size() const noexcept { return static_cast<int>(ranks_.size()); }
  ProcessGroup& rank(int r) { return *ranks_[static_cast<std::size_t>(r)]; }

 private:
  class Rank final : public ProcessGroup {
   public:
    Rank(ThreadGroup& group, int rank) : group_(group), rank_(rank) {}
    int rank() const noexcept override { return rank_; }
    int size() const noexcept override { return group_.size(); }
    std::string_view transport() const noexcept override { return "threads"; }
    double wait_seconds() const noexcept override { return 0.0; }

    Status agree(std::string_view what, std::string_view text) noexcept override {
      group_.publish(rank_, &text);
      int differs = -1;
      const auto& first = *static_cast<const std::string_view*>(group_.inputs_[0]);
      for (int k = 1; k < size() && differs < 0; ++k) {
        if (*static_cast<const std::string_view*>(group_.inputs_[static_cast<std::size_t>(k)]) != first) differs = k;
      }
      group_.barrier_.arrive_and_wait();
      if (differs < 0) return {};
      return Status::invalid(std::string(what), "rank " + std::to_string(differs) + "'s " + std::string(what) +
                                                    " differs from rank 0's; every rank must be started alike");
    }

    Status all_gather(const void* mine, std::size_t bytes, void* all) noexcept override {
      group_.publish(rank_, mine);
      for (int k = 0; k < size(); ++k) {
        std::memcpy(static_cast<std::byte*>(all) + static_cast<std::size_t>(k) * bytes,
                    group_.inputs_[static_cast<std::size_t>(k)], bytes);
      }
      group_.barrier_.arrive_and_wait();
      return {};
    }

    Status broadcast(void* data, std::size_t bytes, int root) noexcept override {
      group_.publish(rank_, data);
      if (rank_ != root) std::memcpy(data, group_.inputs_[static_cast<std::size_t>(root)], bytes);
      group_.barrier_.arrive_and_wait();
      return {};
    }

   private:
    ThreadGroup& group_;
    int rank_;
  };

  // Every rank's input is visible to every rank once this returns.
  void publish(int rank, const void* input) {
    inputs_[static_cast<std::size_t>(rank)] = input;
    barrier_.arrive_and_wait();
  }

  std::barrier<> barrier_;
  std::vector<const void*> inputs_;  // written by each rank before the first phase, read after it
  std::vector<std::unique_ptr<Rank>> ranks_;
};

}  // namespace kallpa::testing
