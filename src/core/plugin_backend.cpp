#include "core/plugin_backend.h"

#include <dlfcn.h>

#include <cstring>
#include <exception>
#include <fstream>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace kallpa::detail {
namespace {

// A message the plugin wrote into a buffer it was told the size of; never trusted to terminate.
std::string read_message(const char* buffer, std::size_t capacity, std::string_view fallback) {
  const std::size_t n = strnlen(buffer, capacity);
  if (n == 0) return std::string(fallback);
  return std::string(buffer, n);
}

ErrorCode error_code_from_c(std::int32_t code) noexcept {
  switch (code) {
    case KALLPA_PLUGIN_INVALID_ARGUMENT: return ErrorCode::invalid_argument;
    case KALLPA_PLUGIN_UNSUPPORTED: return ErrorCode::unsupported;
    case KALLPA_PLUGIN_OUT_OF_MEMORY: return ErrorCode::out_of_memory;
    case KALLPA_PLUGIN_INTERNAL: return ErrorCode::internal;
    default: return ErrorCode::backend_failure;
  }
}

kallpa_tensor to_c(const TensorView& t) noexcept {
  kallpa_tensor c{};
  c.data = t.data;
  c.rank = t.rank;
  for (int d = 0; d < kMaxRank; ++d) {
    c.shape[d] = t.shape[static_cast<std::size_t>(d)];
    c.stride[d] = t.stride[static_cast<std::size_t>(d)];
  }
  c.dtype = static_cast<std::int32_t>(t.dtype);
  c.device_kind = static_cast<std::int32_t>(t.device.kind);
  c.device_index = t.device.index;
  return c;
}

}  // namespace

LibraryHandle::~LibraryHandle() {
  if (handle != nullptr) dlclose(handle);
}

kallpa_signature to_c(const ProblemSignature& s) noexcept {
  kallpa_signature c{};
  c.struct_size = sizeof(kallpa_signature);
  c.device_kind = static_cast<std::int32_t>(s.device.kind);
  c.device_index = s.device.index;
  c.q_dtype = static_cast<std::int32_t>(s.q_dtype);
  c.kv_dtype = static_cast<std::int32_t>(s.kv_dtype);
  c.o_dtype = static_cast<std::int32_t>(s.o_dtype);
  c.q_layout = static_cast<std::int32_t>(s.q_layout);
  c.kv_layout = static_cast<std::int32_t>(s.kv_layout);
  c.hq = s.hq;
  c.hkv = s.hkv;
  c.head_dim = s.head_dim;
  c.head_dim_v = s.head_dim_v;
  c.page_size = s.page_size;
  c.causal = s.causal;
  c.window = s.window;
  c.softcap = s.softcap;
  c.alibi = s.alibi;
  c.lse = s.lse;
  c.unit_stride_last_dim = s.unit_stride_last_dim;
  return c;
}

kallpa_problem to_c(const ValidatedProblem& vp, const kallpa_signature& signature) noexcept {
  const AttentionProblem& p = vp.problem();
  kallpa_problem c{};
  c.struct_size = sizeof(kallpa_problem);
  c.signature = &signature;
  c.q = to_c(p.q);
  c.k = to_c(p.k);
  c.v = to_c(p.v);
  c.o = to_c(p.o);
  c.lse = to_c(p.lse);
  c.batch = vp.batch();
  c.cu_seqlens_q = p.cu_seqlens_q;
  c.cu_seqlens_k = p.cu_seqlens_k;
  c.block_table = p.block_table;
  c.block_table_stride = p.block_table_stride != 0 ? p.block_table_stride : p.max_blocks_per_seq;
  c.max_blocks_per_seq = p.max_blocks_per_seq;
  c.seqlens_k = p.seqlens_k;
  c.scale = vp.scale();
  c.softcap = p.softcap;
  c.causal = p.causal;
  // The validated bounds: capped where a window hides nothing more, so that a plugin's own
  // p_i +- window arithmetic cannot overflow.
  c.window_left = vp.window_left();
  c.window_right = vp.window_right();
  c.alibi_slopes = p.alibi_slopes;
  return c;
}

// No hashing library is in the tree, and telling builds apart needs no cryptographic strength.
std::string plugin_identity(std::string_view name, std::string_view version, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return fmt::format("{}@{}#fnv1a64:unreadable", name, version);
  std::uint64_t h = 0xcbf29ce484222325ull;
  char buffer[1 << 16];
  while (in) {
    in.read(buffer, sizeof buffer);
    for (std::streamsize n = 0; n < in.gcount(); ++n) {
      h ^= static_cast<unsigned char>(buffer[n]);
      h *= 0x100000001b3ull;
    }
  }
  return fmt::format("{}@{}#fnv1a64:{:016x}", name, version, h);
}

PluginBackend::PluginBackend(std::shared_ptr<LibraryHandle> library, const kallpa_plugin_table& table, std::string path)
    : library_(std::move(library)),
      table_(table),
      path_(std::move(path)),
      name_(table.name),
      version_(table.version != nullptr ? table.version : ""),
      description_(table.description != nullptr ? table.description : ""),
      device_(static_cast<DeviceKind>(table.device_kind)) {
  if (description_.empty()) description_ = fmt::format("plugin {}", path_);
  identity_ = plugin_identity(name_, version_, path_);
}

PluginBackend::~PluginBackend() {
  if (table_.destroy == nullptr) return;
  try {
    table_.destroy(table_.state);
  } catch (...) {
    spdlog::error("kallpa: plugin '{}' ({}) threw from destroy", name_, path_);
  }
}

Support PluginBackend::supports(const ProblemSignature& signature) const noexcept {
  const kallpa_signature c = to_c(signature);
  char why[512] = {};
  try {
    if (table_.supports(table_.state, &c, why, sizeof why) != 0) return Support::yes();
  } catch (const std::exception& e) {
    return Support::no(fmt::format("plugin threw from supports(): {}", e.what()));
  } catch (...) {
    return Support::no("plugin threw from supports()");
  }
  return Support::no(read_message(why, sizeof why, "unsupported (the plugin gave no reason)"));
}

std::size_t PluginBackend::workspace_size(const ValidatedProblem& problem) const noexcept {
  if (table_.workspace_size == nullptr) return 0;
  const kallpa_signature sig = to_c(problem.signature());
  const kallpa_problem c = to_c(problem, sig);
  try {
    return table_.workspace_size(table_.state, &c);
  } catch (...) {
    // run() then gets no workspace and reports its own failure.
    return 0;
  }
}

Status PluginBackend::run(const ValidatedProblem& problem, Workspace workspace) noexcept {
  const kallpa_signature sig = to_c(problem.signature());
  const kallpa_problem c = to_c(problem, sig);
  char error[512] = {};
  std::int32_t code = KALLPA_PLUGIN_OK;
  try {
    code = table_.run(table_.state, &c, workspace.data, workspace.bytes, error, sizeof error);
  } catch (const std::exception& e) {
    return Status(ErrorCode::backend_failure, name_, fmt::format("plugin threw from run(): {}", e.what()));
  } catch (...) {
    return Status(ErrorCode::backend_failure, name_, "plugin threw from run() (not a std::exception)");
  }
  if (code == KALLPA_PLUGIN_OK) return {};
  return Status(error_code_from_c(code), name_,
                read_message(error, sizeof error, fmt::format("run() returned error code {} without a message", code)));
}

}  // namespace kallpa::detail
