// The messages between an isolated plugin's proxy (isolated_backend.cpp) and its host process
// (tools/kallpa-plugin-host). Both are built from the same tree, so the structs travel as bytes
// over a SOCK_SEQPACKET socket (one message per send, EOF when the peer dies); tensors travel in a
// shared memory arena (a memfd both map) at the offsets named here. The host is started with the
// socket as fd 3 and the arena as fd 4.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kallpa/attention.h"

namespace kallpa::detail::wire {

inline constexpr std::uint32_t kProtocol = 1;
inline constexpr int kSocketFd = 3;
inline constexpr int kArenaFd = 4;
inline constexpr std::size_t kMessageBytes = 1024;  // error messages and reasons, NUL-terminated

enum class Op : std::uint32_t { supports = 1, run = 2 };
enum class ReplyKind : std::uint32_t { result = 0, guard_fault = 1 };
// Which buffer a guard page belongs to (GuardFault::buffer).
enum class Buffer : std::int32_t { o = 0, lse = 1, workspace = 2 };

// Sent once by the host when it has loaded the plugin (code 0) or failed to (message says why).
struct Hello {
  std::uint32_t protocol = kProtocol;
  std::int32_t code = 0;  // ErrorCode
  char message[kMessageBytes] = {};
  char name[72] = {};
  char version[128] = {};
  char description[256] = {};
  std::int32_t priority = 0;
};

struct SupportsRequest {
  Op op = Op::supports;
  ProblemSignature signature;
};

struct Tensor {
  std::int64_t offset = -1;  // in the arena; -1: absent
  std::int64_t shape[kMaxRank] = {};
  std::int64_t stride[kMaxRank] = {};
  std::int32_t rank = 0;
  std::int32_t dtype = 0;
};

// A guarded output: its bytes are [begin, end); the pages at guard_before and at end (page-aligned,
// one page each) are its guards.
struct Region {
  std::int64_t guard_before = 0, begin = 0, end = 0;
};

struct RunRequest {
  Op op = Op::run;
  std::uint32_t guard_pages = 0;  // 1: protect the guards of o and lse for this call
  std::uint64_t arena_bytes = 0;  // the arena's size now (the host remaps when it grew)
  std::int32_t q_layout = 0, kv_layout = 0;
  Tensor q, k, v, o, lse;
  std::int32_t batch = 0;
  std::int32_t max_blocks_per_seq = 0;
  std::int64_t block_table_stride = 0;
  // Arena offsets of the index arrays; -1: absent.
  std::int64_t cu_seqlens_q = -1, cu_seqlens_k = -1, block_table = -1, seqlens_k = -1, alibi_slopes = -1;
  float scale = 1.0f, softcap = 0.0f;
  std::int32_t causal = 0;
  std::int64_t window_left = -1, window_right = -1;
  Region o_region, lse_region;  // lse_region empty when lse is absent
};

struct Reply {
  ReplyKind kind = ReplyKind::result;
  std::int32_t code = 0;             // ErrorCode (result)
  std::uint64_t anon_rss_bytes = 0;  // the host's own resident memory after the call
  char message[kMessageBytes] = {};  // error, or supports()'s reason
};

// Sent by the host's SIGSEGV handler when a write hits a guard page, just before it dies.
struct GuardFault {
  ReplyKind kind = ReplyKind::guard_fault;
  Buffer buffer = Buffer::o;
  std::int64_t bytes_past = 0;  // > 0: the faulting byte is that far past the end (1 = the first byte after)
                                // <= 0: it is -bytes_past + 1 bytes before the start
};

static_assert(std::is_trivially_copyable_v<Hello> && std::is_trivially_copyable_v<SupportsRequest> &&
              std::is_trivially_copyable_v<RunRequest> && std::is_trivially_copyable_v<Reply> &&
              std::is_trivially_copyable_v<GuardFault>);

// Copies the elements of `from` to the same logical positions of `to` (same shape and dtype, any
// strides), touching nothing between them.
void copy_elements(const TensorView& from, const TensorView& to) noexcept;

// The system's page size: both sides lay the arena's guard pages out by it.
std::int64_t page_bytes() noexcept;

// A tensor as the wire describes it, at `offset` in the arena, and the view it names again on the
// other side (an absent tensor, offset -1, gives an empty view).
Tensor describe(const TensorView& t, std::int64_t offset) noexcept;
TensorView view_in_arena(const Tensor& t, unsigned char* arena_base) noexcept;

}  // namespace kallpa::detail::wire
