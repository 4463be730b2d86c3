// A fake PJRT plugin for the pjrt backend's tests: the smallest PJRT_Api table that takes the
// backend through its whole call sequence (initialise, client, device, compile, upload, execute,
// download) without XLA. Built several times with different FAKE_* definitions:
//
//   FAKE_MAJOR, FAKE_MINOR   the API version the table reports (default: the header's)
//   FAKE_TABLE_END           the slot the table stops before (a table from an older header)
//   FAKE_NO_ENTRY            no GetPjrtApi at all (a shared library that is not a PJRT plugin)
//
// At run time, KALLPA_FAKE_PJRT_FAIL=<PJRT call name> makes that call return an error, and
// KALLPA_FAKE_PJRT_ABORT_COMPILE=1 makes compiling abort the process after a last line on stderr,
// as XLA's CHECK failures do.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "xla/pjrt/c/pjrt_c_api.h"

struct PJRT_Error {
  std::string message;
  PJRT_Error_Code code;
};
struct PJRT_Client {
  int unused;
};
struct PJRT_Device {
  int unused;
};
struct PJRT_DeviceDescription {
  int unused;
};
struct PJRT_LoadedExecutable {
  int unused;
};
struct PJRT_Executable {
  int unused;
};
struct PJRT_Buffer {
  int unused;
};

#ifndef FAKE_MAJOR
#define FAKE_MAJOR PJRT_API_MAJOR
#endif
#ifndef FAKE_MINOR
#define FAKE_MINOR PJRT_API_MINOR
#endif

namespace {

PJRT_Client client;
PJRT_Device device;
PJRT_Device* devices[] = {&device};
PJRT_DeviceDescription description;
PJRT_LoadedExecutable loaded;
PJRT_Executable executable;
PJRT_Buffer buffer;
constexpr float kOutput = 42.0f;

PJRT_Error* fail_if(const char* call) {
  const char* f = std::getenv("KALLPA_FAKE_PJRT_FAIL");
  if (f != nullptr && std::strcmp(f, call) == 0) {
    return new PJRT_Error{std::string("fake failure in ") + call, PJRT_Error_Code_INTERNAL};
  }
  return nullptr;
}

void error_destroy(PJRT_Error_Destroy_Args* a) { delete a->error; }
void error_message(PJRT_Error_Message_Args* a) {
  a->message = a->error->message.c_str();
  a->message_size = a->error->message.size();
}
PJRT_Error* error_code(PJRT_Error_GetCode_Args* a) {
  a->code = a->error->code;
  return nullptr;
}
PJRT_Error* initialize(PJRT_Plugin_Initialize_Args*) { return fail_if("PJRT_Plugin_Initialize"); }
PJRT_Error* event_destroy(PJRT_Event_Destroy_Args*) { return nullptr; }
PJRT_Error* event_await(PJRT_Event_Await_Args*) { return nullptr; }
PJRT_Error* client_create(PJRT_Client_Create_Args* a) {
  if (PJRT_Error* e = fail_if("PJRT_Client_Create")) return e;
  a->client = &client;
  return nullptr;
}
PJRT_Error* client_destroy(PJRT_Client_Destroy_Args*) { return nullptr; }
PJRT_Error* platform_name(PJRT_Client_PlatformName_Args* a) {
  if (PJRT_Error* e = fail_if("PJRT_Client_PlatformName")) return e;
  a->platform_name = "fake";
  a->platform_name_size = 4;
  return nullptr;
}
PJRT_Error* addressable_devices(PJRT_Client_AddressableDevices_Args* a) {
  if (PJRT_Error* e = fail_if("PJRT_Client_AddressableDevices")) return e;
  a->addressable_devices = devices;
  a->num_addressable_devices = 1;
  return nullptr;
}
PJRT_Error* get_description(PJRT_Device_GetDescription_Args* a) {
  if (PJRT_Error* e = fail_if("PJRT_Device_GetDescription")) return e;
  a->device_description = &description;
  return nullptr;
}
PJRT_Error* description_kind(PJRT_DeviceDescription_Kind_Args* a) {
  if (PJRT_Error* e = fail_if("PJRT_DeviceDescription_Kind")) return e;
  a->device_kind = "fake device";
  a->device_kind_size = 11;
  return nullptr;
}
PJRT_Error* compile(PJRT_Client_Compile_Args* a) {
  if (std::getenv("KALLPA_FAKE_PJRT_ABORT_COMPILE") != nullptr) {
    std::fprintf(stderr, "F0000 fake_compiler.cc:1] Check failed: the fake compiler aborts\n");
    std::fflush(stderr);
    std::abort();
  }
  if (PJRT_Error* e = fail_if("PJRT_Client_Compile")) return e;
  a->executable = &loaded;
  return nullptr;
}
PJRT_Error* get_executable(PJRT_LoadedExecutable_GetExecutable_Args* a) {
  if (PJRT_Error* e = fail_if("PJRT_LoadedExecutable_GetExecutable")) return e;
  a->executable = &executable;
  return nullptr;
}
PJRT_Error* num_outputs(PJRT_Executable_NumOutputs_Args* a) {
  if (PJRT_Error* e = fail_if("PJRT_Executable_NumOutputs")) return e;
  a->num_outputs = 1;
  return nullptr;
}
PJRT_Error* executable_destroy(PJRT_Executable_Destroy_Args*) { return nullptr; }
PJRT_Error* loaded_destroy(PJRT_LoadedExecutable_Destroy_Args*) { return nullptr; }
PJRT_Error* execute(PJRT_LoadedExecutable_Execute_Args* a) {
  if (PJRT_Error* e = fail_if("PJRT_LoadedExecutable_Execute")) return e;
  a->output_lists[0][0] = &buffer;
  if (a->device_complete_events != nullptr) a->device_complete_events[0] = nullptr;
  return nullptr;
}
PJRT_Error* from_host(PJRT_Client_BufferFromHostBuffer_Args* a) {
  if (PJRT_Error* e = fail_if("PJRT_Client_BufferFromHostBuffer")) return e;
  a->buffer = &buffer;
  a->done_with_host_buffer = nullptr;
  return nullptr;
}
PJRT_Error* buffer_destroy(PJRT_Buffer_Destroy_Args*) { return nullptr; }
PJRT_Error* to_host(PJRT_Buffer_ToHostBuffer_Args* a) {
  if (PJRT_Error* e = fail_if("PJRT_Buffer_ToHostBuffer")) return e;
  if (a->dst == nullptr) {
    a->dst_size = sizeof kOutput;
  } else {
    std::memcpy(a->dst, &kOutput, sizeof kOutput);
  }
  a->event = nullptr;
  return nullptr;
}

PJRT_Api make_api() {
  PJRT_Api api{};
#ifdef FAKE_TABLE_END
  api.struct_size = offsetof(PJRT_Api, FAKE_TABLE_END);
#else
  api.struct_size = PJRT_Api_STRUCT_SIZE;
#endif
  api.pjrt_api_version.struct_size = PJRT_Api_Version_STRUCT_SIZE;
  api.pjrt_api_version.major_version = FAKE_MAJOR;
  api.pjrt_api_version.minor_version = FAKE_MINOR;
  api.PJRT_Error_Destroy = error_destroy;
  api.PJRT_Error_Message = error_message;
  api.PJRT_Error_GetCode = error_code;
  api.PJRT_Plugin_Initialize = initialize;
  api.PJRT_Event_Destroy = event_destroy;
  api.PJRT_Event_Await = event_await;
  api.PJRT_Client_Create = client_create;
  api.PJRT_Client_Destroy = client_destroy;
  api.PJRT_Client_PlatformName = platform_name;
  api.PJRT_Client_AddressableDevices = addressable_devices;
  api.PJRT_Device_GetDescription = get_description;
  api.PJRT_DeviceDescription_Kind = description_kind;
  api.PJRT_Client_Compile = compile;
  api.PJRT_LoadedExecutable_GetExecutable = get_executable;
  api.PJRT_Executable_NumOutputs = num_outputs;
  api.PJRT_Executable_Destroy = executable_destroy;
  api.PJRT_LoadedExecutable_Destroy = loaded_destroy;
  api.PJRT_LoadedExecutable_Execute = execute;
  api.PJRT_Client_BufferFromHostBuffer = from_host;
  api.PJRT_Buffer_Destroy = buffer_destroy;
  api.PJRT_Buffer_ToHostBuffer = to_host;
  return api;
}

}  // namespace

// Without FAKE_NO_ENTRY the entry point PJRT defines; with it, the same table under another name.
#ifdef FAKE_NO_ENTRY
#define FAKE_ENTRY NotAPjrtEntryPoint
#else
#define FAKE_ENTRY GetPjrtApi
#endif
extern "C" __attribute__((visibility("default"))) const PJRT_Api* FAKE_ENTRY() {
  static const PJRT_Api api = make_api();
  return &api;
}
