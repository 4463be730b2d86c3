// Where the tests find the fault-injection plugins of tests/plugins (fault_plugin.cpp). The test
// programs that load them define KALLPA_TEST_PLUGIN_DIR (tests/plugins/CMakeLists.txt).
#pragma once

#include <string>

#ifndef KALLPA_TEST_PLUGIN_DIR
#error "tests/plugins/CMakeLists.txt defines KALLPA_TEST_PLUGIN_DIR"
#endif

namespace kallpa::testing {

// The library of fault `name` ("good", "segv", ...).
inline std::string fault_plugin(const std::string& name) {
  return std::string(KALLPA_TEST_PLUGIN_DIR) + "/fault-" + name + ".so";
}

inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace kallpa::testing
