#include "backends/pjrt/pjrt_runtime.h"

#include <dlfcn.h>

#include <cstddef>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>

#include <fmt/format.h>

#include "xla/pjrt/c/pjrt_c_api.h"

namespace kallpa::pjrt {
namespace {

// Every args struct starts zeroed with the size this build's header gives it; a plugin built on an
// older header reads the prefix it knows, a newer one treats the fields it has and we lack as unset.
template <typename T>
T make_args(std::size_t size) noexcept {
  T args{};
  args.struct_size = size;
  return args;
}
#define KALLPA_PJRT_ARGS(Type) make_args<Type>(Type##_STRUCT_SIZE)

// A PJRT_Program of StableHLO text. PJRT_Program.code is not const, so the text is copied and held
// here for as long as the compile call that reads `program` needs it.
struct MlirProgram {
  explicit MlirProgram(std::string_view mlir) : code(mlir) {
    static constexpr char kFormat[] = "mlir";
    program.code = code.data();
    program.code_size = code.size();
    program.format = kFormat;
    program.format_size = sizeof kFormat - 1;
  }
  MlirProgram(const MlirProgram&) = delete;
  MlirProgram& operator=(const MlirProgram&) = delete;

  std::string code;
  PJRT_Program program = KALLPA_PJRT_ARGS(PJRT_Program);
};

// The slots a normal run calls; a plugin whose table lacks one is refused at load time, before any
// slot is touched. Optional slots (memory statistics) are checked where they are used.
struct Slot {
  std::size_t offset;
  const char* name;
};
#define KALLPA_PJRT_SLOT(name) \
  Slot { offsetof(PJRT_Api, name), #name }
constexpr Slot kRequiredSlots[] = {
    KALLPA_PJRT_SLOT(PJRT_Error_Destroy),
    KALLPA_PJRT_SLOT(PJRT_Error_Message),
    KALLPA_PJRT_SLOT(PJRT_Error_GetCode),
    KALLPA_PJRT_SLOT(PJRT_Plugin_Initialize),
    KALLPA_PJRT_SLOT(PJRT_Event_Destroy),
    KALLPA_PJRT_SLOT(PJRT_Event_Await),
    KALLPA_PJRT_SLOT(PJRT_Client_Create),
    KALLPA_PJRT_SLOT(PJRT_Client_Destroy),
    KALLPA_PJRT_SLOT(PJRT_Client_PlatformName),
    KALLPA_PJRT_SLOT(PJRT_Client_AddressableDevices),
    KALLPA_PJRT_SLOT(PJRT_Client_Compile),
    KALLPA_PJRT_SLOT(PJRT_Client_BufferFromHostBuffer),
    KALLPA_PJRT_SLOT(PJRT_Device_GetDescription),
    KALLPA_PJRT_SLOT(PJRT_DeviceDescription_Kind),
    KALLPA_PJRT_SLOT(PJRT_Executable_Destroy),
    KALLPA_PJRT_SLOT(PJRT_Executable_NumOutputs),
    KALLPA_PJRT_SLOT(PJRT_LoadedExecutable_Destroy),
    KALLPA_PJRT_SLOT(PJRT_LoadedExecutable_GetExecutable),
    KALLPA_PJRT_SLOT(PJRT_LoadedExecutable_Execute),
    KALLPA_PJRT_SLOT(PJRT_Buffer_Destroy),
    KALLPA_PJRT_SLOT(PJRT_Buffer_ToHostBuffer),
};

PJRT_Buffer_Type buffer_type(ElementType t) noexcept {
  switch (t) {
    case ElementType::f32: return PJRT_Buffer_Type_F32;
    case ElementType::f16: return PJRT_Buffer_Type_F16;
    case ElementType::bf16: return PJRT_Buffer_Type_BF16;
    case ElementType::s32: return PJRT_Buffer_Type_S32;
  }
  return PJRT_Buffer_Type_INVALID;
}

// Waits for `event` (null: nothing to wait for), destroys it, and reports its error.
Status await_event(const Plugin& plugin, PJRT_Event* event, std::string_view call) {
  if (event == nullptr) return {};
  auto await = KALLPA_PJRT_ARGS(PJRT_Event_Await_Args);
  await.event = event;
  Status s = plugin.check(plugin.api().PJRT_Event_Await(&await), call);
  auto destroy = KALLPA_PJRT_ARGS(PJRT_Event_Destroy_Args);
  destroy.event = event;
  Status d = plugin.check(plugin.api().PJRT_Event_Destroy(&destroy), "PJRT_Event_Destroy");
  return s ? d : s;
}

}  // namespace

std::string Plugin::version_string() const { return fmt::format("{}.{}", major_, minor_); }

bool Plugin::has_slot(std::size_t offset) const noexcept {
  if (offset + sizeof(void*) > api_->struct_size) return false;
  void* slot = nullptr;
  std::memcpy(&slot, reinterpret_cast<const char*>(api_) + offset, sizeof slot);
  return slot != nullptr;
}

Status Plugin::check(PJRT_Error* error, std::string_view call) const {
  if (error == nullptr) return {};
  auto message = KALLPA_PJRT_ARGS(PJRT_Error_Message_Args);
  message.error = error;
  api_->PJRT_Error_Message(&message);
  std::string text = message.message != nullptr ? std::string(message.message, message.message_size) : "";
  auto code = KALLPA_PJRT_ARGS(PJRT_Error_GetCode_Args);
  code.error = error;
  const bool have_code = api_->PJRT_Error_GetCode(&code) == nullptr;
  auto destroy = KALLPA_PJRT_ARGS(PJRT_Error_Destroy_Args);
  destroy.error = error;
  api_->PJRT_Error_Destroy(&destroy);
  if (text.empty()) text = "(no message)";
  return Status(ErrorCode::backend_failure, std::string(call),
                have_code ? fmt::format("{} (PJRT error code {})", text, static_cast<int>(code.code)) : text);
}

Result<std::shared_ptr<Plugin>> Plugin::load(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return Status(ErrorCode::not_found, "pjrt plugin", fmt::format("'{}' is not a file", path));
  }
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return Status(ErrorCode::not_found, "pjrt plugin",
                  fmt::format("'{}' does not load as a shared library: {}", path, why != nullptr ? why : "?"));
  }
  using GetApi = const PJRT_Api* (*)();
  void* symbol = dlsym(handle, "GetPjrtApi");
  if (symbol == nullptr) {
    dlclose(handle);
    return Status(ErrorCode::not_found, "pjrt plugin",
                  fmt::format("'{}' is not a PJRT plugin: it exports no GetPjrtApi", path));
  }
  GetApi get_api = nullptr;
  static_assert(sizeof get_api == sizeof symbol);
  std::memcpy(&get_api, &symbol, sizeof symbol);
  const PJRT_Api* api = get_api();
  if (api == nullptr) {
    return Status(ErrorCode::unsupported, "pjrt plugin", fmt::format("'{}': GetPjrtApi returned no API table", path));
  }
  // The version sits right after struct_size and extension_start in every PJRT_Api ever shipped;
  // it is read before anything else, and the table's size before any slot.
  constexpr std::size_t kVersionEnd = offsetof(PJRT_Api, pjrt_api_version) + sizeof(PJRT_Api_Version);
  if (api->struct_size < kVersionEnd) {
    return Status(
        ErrorCode::unsupported, "pjrt plugin",
        fmt::format("'{}': its PJRT_Api table is {} bytes, too small to hold a version", path, api->struct_size));
  }
  const int major = api->pjrt_api_version.major_version, minor = api->pjrt_api_version.minor_version;
  if (major != kSupportedMajor || minor < kMinSupportedMinor || minor > kMaxSupportedMinor) {
    return Status(ErrorCode::unsupported, "pjrt plugin",
                  fmt::format("'{}' speaks PJRT API {}.{}; kallpa drives {}.{} to {}.{}", path, major, minor,
                              kSupportedMajor, kMinSupportedMinor, kSupportedMajor, kMaxSupportedMinor));
  }
  auto plugin = std::shared_ptr<Plugin>(new Plugin());
  plugin->api_ = api;
  plugin->path_ = path;
  plugin->major_ = major;
  plugin->minor_ = minor;
  for (const Slot& slot : kRequiredSlots) {
    if (!plugin->has_slot(slot.offset)) {
      return Status(ErrorCode::unsupported, "pjrt plugin",
                    fmt::format("'{}' (PJRT API {}.{}, table of {} bytes) lacks {}", path, major, minor,
                                api->struct_size, slot.name));
    }
  }
  auto init = KALLPA_PJRT_ARGS(PJRT_Plugin_Initialize_Args);
  if (Status s = plugin->check(api->PJRT_Plugin_Initialize(&init), "PJRT_Plugin_Initialize"); !s) return s;
  return plugin;
}

namespace {

// Memory statistics of an unloaded executable, which this destroys.
Result<MemoryStats> stats_and_destroy(const Plugin& plugin, PJRT_Executable* executable) {
  const PJRT_Api& api = plugin.api();
  auto stats = KALLPA_PJRT_ARGS(PJRT_Executable_GetCompiledMemoryStats_Args);
  stats.executable = executable;
  Status s = plugin.check(api.PJRT_Executable_GetCompiledMemoryStats(&stats), "PJRT_Executable_GetCompiledMemoryStats");
  auto destroy = KALLPA_PJRT_ARGS(PJRT_Executable_Destroy_Args);
  destroy.executable = executable;
  (void)plugin.check(api.PJRT_Executable_Destroy(&destroy), "PJRT_Executable_Destroy");
  if (!s) return s;
  MemoryStats out;
  out.argument_bytes = stats.argument_size_in_bytes;
  out.output_bytes = stats.output_size_in_bytes;
  out.temp_bytes = stats.temp_size_in_bytes;
  out.generated_code_bytes = stats.generated_code_size_in_bytes;
  return out;
}

}  // namespace

Result<MemoryStats> Plugin::compile_for_topology(std::string_view topology, std::string_view mlir) const {
  for (const Slot& slot :
       {KALLPA_PJRT_SLOT(PJRT_TopologyDescription_Create), KALLPA_PJRT_SLOT(PJRT_TopologyDescription_Destroy),
        KALLPA_PJRT_SLOT(PJRT_Compile), KALLPA_PJRT_SLOT(PJRT_Executable_GetCompiledMemoryStats)}) {
    if (!has_slot(slot.offset)) {
      return Status(ErrorCode::unsupported, slot.name,
                    fmt::format("'{}' (PJRT API {}) cannot compile ahead of time: it lacks {}", path_, version_string(),
                                slot.name));
    }
  }
  const std::string name(topology);
  auto create = KALLPA_PJRT_ARGS(PJRT_TopologyDescription_Create_Args);
  create.topology_name = name.c_str();
  create.topology_name_size = name.size();
  if (Status s = check(api_->PJRT_TopologyDescription_Create(&create), "PJRT_TopologyDescription_Create"); !s) {
    return s;
  }
  MlirProgram program(mlir);
  auto compile = KALLPA_PJRT_ARGS(PJRT_Compile_Args);
  compile.topology = create.topology;
  compile.program = &program.program;
  compile.compile_options = kCompileOptions;
  compile.compile_options_size = sizeof kCompileOptions;
  Status s = check(api_->PJRT_Compile(&compile), "PJRT_Compile");
  Result<MemoryStats> stats = s ? stats_and_destroy(*this, compile.executable) : Result<MemoryStats>(s);
  auto destroy = KALLPA_PJRT_ARGS(PJRT_TopologyDescription_Destroy_Args);
  destroy.topology = create.topology;
  (void)check(api_->PJRT_TopologyDescription_Destroy(&destroy), "PJRT_TopologyDescription_Destroy");
  return stats;
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    reset();
    plugin_ = std::move(other.plugin_);
    buffer_ = std::exchange(other.buffer_, nullptr);
  }
  return *this;
}

void Buffer::reset() noexcept {
  if (buffer_ != nullptr) {
    auto args = KALLPA_PJRT_ARGS(PJRT_Buffer_Destroy_Args);
    args.buffer = buffer_;
    (void)plugin_->check(plugin_->api().PJRT_Buffer_Destroy(&args), "PJRT_Buffer_Destroy");
    buffer_ = nullptr;
  }
}

Status Buffer::to_host(void* dst, std::size_t bytes) const {
  auto size = KALLPA_PJRT_ARGS(PJRT_Buffer_ToHostBuffer_Args);
  size.src = buffer_;
  if (Status s = plugin_->check(plugin_->api().PJRT_Buffer_ToHostBuffer(&size), "PJRT_Buffer_ToHostBuffer"); !s) {
    return s;
  }
  if (size.dst_size != bytes) {
    return Status(ErrorCode::internal, "PJRT_Buffer_ToHostBuffer",
                  fmt::format("the device buffer holds {} bytes; {} were expected", size.dst_size, bytes));
  }
  auto copy = KALLPA_PJRT_ARGS(PJRT_Buffer_ToHostBuffer_Args);
  copy.src = buffer_;
  copy.dst = dst;
  copy.dst_size = bytes;
  if (Status s = plugin_->check(plugin_->api().PJRT_Buffer_ToHostBuffer(&copy), "PJRT_Buffer_ToHostBuffer"); !s) {
    return s;
  }
  return await_event(*plugin_, copy.event, "PJRT_Buffer_ToHostBuffer");
}

Executable::~Executable() {
  if (exe_ != nullptr) {
    auto args = KALLPA_PJRT_ARGS(PJRT_LoadedExecutable_Destroy_Args);
    args.executable = exe_;
    (void)plugin_->check(plugin_->api().PJRT_LoadedExecutable_Destroy(&args), "PJRT_LoadedExecutable_Destroy");
  }
}

Result<std::vector<Buffer>> Executable::execute(PJRT_Device* device, const std::vector<PJRT_Buffer*>& args) const {
  const PJRT_Api& api = plugin_->api();
  auto options = KALLPA_PJRT_ARGS(PJRT_ExecuteOptions);
  std::vector<PJRT_Buffer*> outputs(num_outputs_, nullptr);
  PJRT_Buffer* const* argument_list = args.data();
  PJRT_Buffer** output_list = outputs.data();
  PJRT_Event* complete = nullptr;
  auto run = KALLPA_PJRT_ARGS(PJRT_LoadedExecutable_Execute_Args);
  run.executable = exe_;
  run.options = &options;
  run.argument_lists = &argument_list;
  run.num_devices = 1;
  run.num_args = args.size();
  run.output_lists = &output_list;
  run.device_complete_events = &complete;
  run.execute_device = device;
  Status s = plugin_->check(api.PJRT_LoadedExecutable_Execute(&run), "PJRT_LoadedExecutable_Execute");
  std::vector<Buffer> result;
  result.reserve(outputs.size());
  for (PJRT_Buffer* b : outputs) result.emplace_back(plugin_, b);  // owned, even on failure
  if (!s) return s;
  if (Status e = await_event(*plugin_, complete, "PJRT_LoadedExecutable_Execute"); !e) return e;
  for (const Buffer& b : result) {
    if (b.get() == nullptr) return Status(ErrorCode::internal, "PJRT_LoadedExecutable_Execute", "an output is missing");
  }
  return result;
}

Result<MemoryStats> Executable::memory_stats() const {
  if (!plugin_->has_slot(offsetof(PJRT_Api, PJRT_Executable_GetCompiledMemoryStats))) {
    return Status(ErrorCode::unsupported, "PJRT_Executable_GetCompiledMemoryStats",
                  fmt::format("the plugin (PJRT API {}) does not report compiled memory", plugin_->version_string()));
  }
  const PJRT_Api& api = plugin_->api();
  auto get = KALLPA_PJRT_ARGS(PJRT_LoadedExecutable_GetExecutable_Args);
  get.loaded_executable = exe_;
  if (Status s = plugin_->check(api.PJRT_LoadedExecutable_GetExecutable(&get), "PJRT_LoadedExecutable_GetExecutable");
      !s) {
    return s;
  }
  return stats_and_destroy(*plugin_, get.executable);
}

Result<std::unique_ptr<Client>> Client::create(std::shared_ptr<const Plugin> plugin, int device_index) {
  const PJRT_Api& api = plugin->api();
  auto create = KALLPA_PJRT_ARGS(PJRT_Client_Create_Args);
  if (Status s = plugin->check(api.PJRT_Client_Create(&create), "PJRT_Client_Create"); !s) return s;
  auto client = std::unique_ptr<Client>(new Client());
  client->plugin_ = std::move(plugin);
  client->client_ = create.client;
  const Plugin& p = *client->plugin_;

  auto name = KALLPA_PJRT_ARGS(PJRT_Client_PlatformName_Args);
  name.client = client->client_;
  if (Status s = p.check(api.PJRT_Client_PlatformName(&name), "PJRT_Client_PlatformName"); !s) return s;
  client->platform_.assign(name.platform_name != nullptr ? name.platform_name : "", name.platform_name_size);

  auto devices = KALLPA_PJRT_ARGS(PJRT_Client_AddressableDevices_Args);
  devices.client = client->client_;
  if (Status s = p.check(api.PJRT_Client_AddressableDevices(&devices), "PJRT_Client_AddressableDevices"); !s) {
    return s;
  }
  client->device_count_ = devices.num_addressable_devices;
  if (device_index < 0 || static_cast<std::size_t>(device_index) >= devices.num_addressable_devices) {
    return Status(ErrorCode::not_found, "KALLPA_PJRT_DEVICE",
                  fmt::format("device {} does not exist: the '{}' client has {} addressable device(s)", device_index,
                              client->platform_, devices.num_addressable_devices));
  }
  client->device_ = devices.addressable_devices[device_index];

  auto describe = KALLPA_PJRT_ARGS(PJRT_Device_GetDescription_Args);
  describe.device = client->device_;
  if (Status s = p.check(api.PJRT_Device_GetDescription(&describe), "PJRT_Device_GetDescription"); !s) return s;
  auto kind = KALLPA_PJRT_ARGS(PJRT_DeviceDescription_Kind_Args);
  kind.device_description = describe.device_description;
  if (Status s = p.check(api.PJRT_DeviceDescription_Kind(&kind), "PJRT_DeviceDescription_Kind"); !s) return s;
  client->device_kind_.assign(kind.device_kind != nullptr ? kind.device_kind : "", kind.device_kind_size);
  return client;
}

Client::~Client() {
  if (client_ != nullptr) {
    auto args = KALLPA_PJRT_ARGS(PJRT_Client_Destroy_Args);
    args.client = client_;
    (void)plugin_->check(plugin_->api().PJRT_Client_Destroy(&args), "PJRT_Client_Destroy");
  }
}

Result<std::unique_ptr<Executable>> Client::compile(std::string_view mlir) const {
  const PJRT_Api& api = plugin_->api();
  MlirProgram program(mlir);
  auto compile = KALLPA_PJRT_ARGS(PJRT_Client_Compile_Args);
  compile.client = client_;
  compile.program = &program.program;
  compile.compile_options = kCompileOptions;
  compile.compile_options_size = sizeof kCompileOptions;
  if (Status s = plugin_->check(api.PJRT_Client_Compile(&compile), "PJRT_Client_Compile"); !s) return s;
  auto exe = std::make_unique<Executable>(plugin_, compile.executable, 0);

  auto get = KALLPA_PJRT_ARGS(PJRT_LoadedExecutable_GetExecutable_Args);
  get.loaded_executable = compile.executable;
  if (Status s = plugin_->check(api.PJRT_LoadedExecutable_GetExecutable(&get), "PJRT_LoadedExecutable_GetExecutable");
      !s) {
    return s;
  }
  auto outputs = KALLPA_PJRT_ARGS(PJRT_Executable_NumOutputs_Args);
  outputs.executable = get.executable;
  Status s = plugin_->check(api.PJRT_Executable_NumOutputs(&outputs), "PJRT_Executable_NumOutputs");
  auto destroy = KALLPA_PJRT_ARGS(PJRT_Executable_Destroy_Args);
  destroy.executable = get.executable;
  (void)plugin_->check(api.PJRT_Executable_Destroy(&destroy), "PJRT_Executable_Destroy");
  if (!s) return s;
  return std::make_unique<Executable>(plugin_, std::exchange(exe->exe_, nullptr), outputs.num_outputs);
}

Result<Buffer> Client::upload(const void* data, ElementType type, const std::vector<std::int64_t>& dims) const {
  auto args = KALLPA_PJRT_ARGS(PJRT_Client_BufferFromHostBuffer_Args);
  args.client = client_;
  args.data = data;
  args.type = buffer_type(type);
  args.dims = dims.data();
  args.num_dims = dims.size();
  args.host_buffer_semantics = PJRT_HostBufferSemantics_kImmutableOnlyDuringCall;
  args.device = device_;
  if (Status s =
          plugin_->check(plugin_->api().PJRT_Client_BufferFromHostBuffer(&args), "PJRT_Client_BufferFromHostBuffer");
      !s) {
    return s;
  }
  Buffer buffer(plugin_, args.buffer);
  if (Status s = await_event(*plugin_, args.done_with_host_buffer, "PJRT_Client_BufferFromHostBuffer"); !s) return s;
  return buffer;
}

}  // namespace kallpa::pjrt
