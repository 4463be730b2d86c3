// The OpenAI request parser (/v1/chat/completions, /v1/completions): any body gives a request
// that keeps the server's limits, or a 4xx error in OpenAI's shape; never a crash, an escaping
// exception or a request the engine would refuse later. A chat request's prompt also renders.
#include <string_view>

#include "fuzz_target.h"
#include "kallpa/tokenizer/chat.h"
#include "server/request_parser.h"

namespace {

using kallpa::server::ApiError;
using kallpa::server::CompletionRequest;
using kallpa::server::Endpoint;

void check(std::string_view body, Endpoint endpoint) {
  const kallpa::server::RequestLimits limits{.max_tokens = 64};
  const auto parsed = kallpa::server::parse_completion_request(body, endpoint, limits);
  if (const auto* e = std::get_if<ApiError>(&parsed)) {
    FUZZ_CHECK(e->status >= 400 && e->status < 500, "a bad body is not a 4xx");
    FUZZ_CHECK(!e->message.empty(), "an error without a message");
    (void)e->to_json().dump();  // the error body renders
    return;
  }
  const auto& r = std::get<CompletionRequest>(parsed);
  FUZZ_CHECK(r.endpoint == endpoint, "the endpoint changed");
  FUZZ_CHECK(r.max_tokens >= 1 && r.max_tokens <= limits.max_tokens, "max_tokens escapes the limit");
  FUZZ_CHECK(r.sampling.validate().is_ok(), "accepted sampling parameters the sampler refuses");
  for (const auto& stop : r.stop) FUZZ_CHECK(!stop.empty(), "an empty stop string was accepted");
  if (endpoint == Endpoint::chat) {
    FUZZ_CHECK(!r.messages.empty(), "a chat request without messages was accepted");
    (void)kallpa::tokenizer::format_chatml(r.messages);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  check(body, Endpoint::chat);
  check(body, Endpoint::completions);
  return 0;
}
