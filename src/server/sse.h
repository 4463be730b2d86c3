// Server-Sent Events framing for streamed completions: one `data:` event per JSON chunk, a
// comment line as keep-alive, and OpenAI's `data: [DONE]` terminator.
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace kallpa::server {

inline constexpr std::string_view kSseContentType = "text/event-stream";
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";
// Ignored by SSE clients; writing it is how an idle stream notices that its client went away.
inline constexpr std::string_view kSseKeepAlive = ": keep-alive\n\n";

// "data: <json>\n\n". JSON is one line, so one data line is enough.
std::string sse_event(const nlohmann::json& data);

// JSON text for the wire: invalid UTF-8, should any reach here, becomes U+FFFD instead of throwing.
std::string dump_json(const nlohmann::json& value);

}  // namespace kallpa::server
