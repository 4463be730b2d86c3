// First contact in a child process: what the host learns when the child succeeds, returns an
// error, aborts (as XLA's CHECK failures do) or hangs.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "backends/pjrt/child_probe.h"

namespace kallpa::pjrt {
namespace {

TEST(ChildProbe, SuccessIsOk) {
  const ChildOutcome o = run_in_child([] { return Status::ok(); }, 30.0);
  EXPECT_EQ(o.kind, ChildOutcome::Kind::ok) << o.reason;
}

TEST(ChildProbe, AnErrorComesBackAsTheStatusText) {
  const ChildOutcome o = run_in_child(
      [] {
        std::fputs("some chatter first\n", stderr);
        return Status(ErrorCode::unsupported, "pjrt plugin", "speaks PJRT API 0.50");
      },
      30.0);
  ASSERT_EQ(o.kind, ChildOutcome::Kind::error) << o.reason;
  EXPECT_EQ(o.status.code(), ErrorCode::backend_failure);
  EXPECT_EQ(o.status.message(), "unsupported: pjrt plugin: speaks PJRT API 0.50");
}

TEST(ChildProbe, AnAbortIsACrashWithTheLastWords) {
  const ChildOutcome o = run_in_child(
      [] {
        std::fputs("F0000 compiler.cc:12] Check failed: shape is valid\n", stderr);
        std::abort();
        return Status::ok();
      },
      30.0);
  ASSERT_EQ(o.kind, ChildOutcome::Kind::crashed);
  EXPECT_NE(o.reason.find("killed by signal 6"), std::string::npos) << o.reason;
  EXPECT_NE(o.reason.find("Check failed: shape is valid"), std::string::npos) << o.reason;
}

TEST(ChildProbe, AnUnexpectedExitIsACrash) {
  const ChildOutcome o = run_in_child(
      [] {
        std::_Exit(9);
        return Status::ok();
      },
      30.0);
  ASSERT_EQ(o.kind, ChildOutcome::Kind::crashed);
  EXPECT_NE(o.reason.find("exited with status 9"), std::string::npos) << o.reason;
  EXPECT_NE(o.reason.find("it wrote nothing"), std::string::npos) << o.reason;
}

TEST(ChildProbe, AHangIsKilledAtTheTimeLimit) {
  const ChildOutcome o = run_in_child(
      [] {
        std::fputs("querying the metadata server\n", stderr);
        for (;;) pause();
        return Status::ok();
      },
      0.5);
  ASSERT_EQ(o.kind, ChildOutcome::Kind::crashed);
  EXPECT_NE(o.reason.find("did not finish within 0.5 s and was killed"), std::string::npos) << o.reason;
  EXPECT_NE(o.reason.find("querying the metadata server"), std::string::npos) << o.reason;
}

}  // namespace
}  // namespace kallpa::pjrt
