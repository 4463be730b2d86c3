// `kallpa devices`: where the engine can run (--device), each device available or not and why, and
// which attention backends serve it. The same names the engine takes; nothing here names an
// implementation of a device's ops.
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "kallpa/ops/ops.h"
#include "kallpa/registry.h"
#include "output.h"

namespace kallpa::cli {
namespace {

struct DevicesOptions {
  bool json = false;
};

int list_devices(const DevicesOptions& options) {
  struct Row {
    std::string device, status, attention;
  };
  std::vector<Row> rows;
  const std::vector<BackendInfo> backends = BackendRegistry::global().list();
  for (const char* name : {"cpu", "opencl", "cuda"}) {
    auto ops = ops::make_ops(name);
    Row row{ops ? std::string((*ops)->device_name()) : std::string(name),
            ops ? "available" : "unavailable: " + ops.status().message(), ""};
    const DeviceKind kind = ops ? (*ops)->device().kind : DeviceKind::cpu;
    if (ops) {
      for (const BackendInfo& info : backends) {
        if (info.backend->device_kind() != kind) continue;
        row.attention += (row.attention.empty() ? "" : ",") + std::string(info.backend->name());
      }
    }
    rows.push_back(std::move(row));
  }
  if (options.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const Row& r : rows) {
      out.push_back({{"device", r.device},
                     {"available", r.status == "available"},
                     {"status", r.status},
                     {"attention_backends", r.attention}});
    }
    fmt::print("{}\n", out.dump(2));
    return kExitOk;
  }
  Table table({{"device"}, {"engine ops"}, {"attention backends"}});
  for (const Row& r : rows) table.add_row({r.device, r.status, r.attention.empty() ? "-" : r.attention});
  table.print(stdout);
  return kExitOk;
}

}  // namespace

Command add_devices_command(CLI::App& app) {
  auto options = std::make_shared<DevicesOptions>();
  CLI::App* sub = app.add_subcommand("devices", "Where the engine can run (--device): each device and why not");
  sub->add_flag("--json", options->json, "Machine-readable output (a JSON array)");
  return {sub, [options](const GlobalOptions&) { return list_devices(*options); }};
}

}  // namespace kallpa::cli
