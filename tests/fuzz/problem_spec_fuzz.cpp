// parse_problem_spec (`--spec` of kallpa bench/conformance): any text gives a spec or a typed
// error naming the field, and an accepted spec round-trips through to_string().
#include <string_view>

#include "fuzz_target.h"
#include "kallpa/problem_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto spec = kallpa::parse_problem_spec(text);
  if (!spec) {
    FUZZ_CHECK(!spec.status().message().empty() || !spec.status().field().empty(), "an error says nothing");
    return 0;
  }
  const std::string canonical = spec->to_string();
  auto again = kallpa::parse_problem_spec(canonical);
  FUZZ_CHECK(again.is_ok(), "the canonical text of an accepted spec is refused");
  FUZZ_CHECK(again->to_string() == canonical, "to_string() does not round-trip");
  return 0;
}
