// The server's request parsing and validation (OpenAI bodies), error shapes, SSE framing,
// response shapes and the Prometheus text rendering, without a socket.
#include <gtest/gtest.h>

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/access_log.h"
#include "server/api_error.h"
#include "server/metrics.h"
#include "server/openai_responses.h"
#include "server/request_parser.h"
#include "server/server_metrics.h"
#include "server/sse.h"

namespace kallpa::server {
namespace {

using nlohmann::json;

ParsedRequest parse(const json& body, Endpoint e = Endpoint::chat, std::int64_t max_tokens = 100) {
  return parse_completion_request(body.dump(), e, {.max_tokens = max_tokens, .max_choices = 8, .vocab_size = 1000});
}

CompletionRequest ok(const ParsedRequest& p) {
  if (const auto* e = std::get_if<ApiError>(&p)) ADD_FAILURE() << e->message;
  const auto* r = std::get_if<CompletionRequest>(&p);
  return r ? *r : CompletionRequest{};
}

ApiError error(const ParsedRequest& p) {
  const auto* e = std::get_if<ApiError>(&p);
  EXPECT_NE(e, nullptr) << "the request was accepted";
  return e ? *e : ApiError{};
}

const json kChat = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};

TEST(ServerRequest, ChatWithDefaults) {
  const CompletionRequest r = ok(parse(kChat));
  ASSERT_EQ(r.messages.size(), 1u);
  EXPECT_EQ(r.messages[0].role, "user");
  EXPECT_EQ(r.messages[0].content, "hi");
  EXPECT_EQ(r.max_tokens, 100);  // the server's limit is the default
  EXPECT_EQ(r.sampling.temperature, 1.0f);
  EXPECT_EQ(r.sampling.top_p, 1.0f);
  EXPECT_EQ(r.sampling.top_k, 0);
  EXPECT_EQ(r.sampling.min_p, 0.0f);
  EXPECT_FALSE(r.seed_given);
  EXPECT_FALSE(r.ignore_eos);
  EXPECT_FALSE(r.stream);
  EXPECT_EQ(r.n, 1);
  EXPECT_EQ(r.logprobs, -1);
  EXPECT_EQ(r.sampling.presence_penalty, 0.0f);
  EXPECT_EQ(r.sampling.frequency_penalty, 0.0f);
  EXPECT_TRUE(r.sampling.logit_bias.empty());
}

TEST(ServerRequest, ChatWithEveryOption) {
  json body = kChat;
  body["messages"] = {
      {{"role", "developer"}, {"content", "be brief"}},
      {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "a"}}, {{"type", "text"}, {"text", "b"}}}}}};
  body.update({{"model", "m"},
               {"max_completion_tokens", 7},
               {"temperature", 0},
               {"top_p", 0.5},
               {"seed", -3},
               {"stop", "END"},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}},
               {"n", 1},
               {"presence_penalty", 0},
               {"top_k", 5},
               {"ignore_eos", true},
               {"user", "ignored"},
               {"unknown_field", 1}});
  const CompletionRequest r = ok(parse(body));
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[1].content, "ab");
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_EQ(r.sampling.temperature, 0.0f);
  EXPECT_EQ(r.sampling.top_p, 0.5f);
  EXPECT_EQ(r.sampling.top_k, 5);
  EXPECT_TRUE(r.seed_given);
  EXPECT_EQ(r.sampling.seed, static_cast<std::uint64_t>(-3));
  EXPECT_EQ(r.stop, std::vector<std::string>{"END"});
  EXPECT_TRUE(r.ignore_eos);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
}

TEST(ServerRequest, SamplingSurface) {
  json body = kChat;
  body.update({{"n", 3},
               {"logprobs", true},
               {"top_logprobs", 5},
               {"presence_penalty", 0.5},
               {"frequency_penalty", -1.5},
               {"logit_bias", {{"7", -100}, {"999", 2.5}}},
               {"response_format", {{"type", "text"}}}});
  const CompletionRequest r = ok(parse(body));
  EXPECT_EQ(r.n, 3);
  EXPECT_EQ(r.logprobs, 5);
  EXPECT_EQ(r.sampling.presence_penalty, 0.5f);
  EXPECT_EQ(r.sampling.frequency_penalty, -1.5f);
  EXPECT_EQ(r.sampling.logit_bias, (std::vector<std::pair<std::int32_t, float>>{{7, -100.0f}, {999, 2.5f}}));
  // logprobs alone means no alternatives; false means none at all.
  json plain = kChat;
  plain["logprobs"] = true;
  EXPECT_EQ(ok(parse(plain)).logprobs, 0);
  plain["logprobs"] = false;
  EXPECT_EQ(ok(parse(plain)).logprobs, -1);
  // Completions: the legacy integer logprobs, echo.
  const CompletionRequest c =
      ok(parse({{"prompt", "x"}, {"logprobs", 2}, {"echo", false}, {"n", 2}}, Endpoint::completions));
  EXPECT_EQ(c.logprobs, 2);
  EXPECT_EQ(c.n, 2);
  EXPECT_TRUE(ok(parse({{"prompt", "x"}, {"echo", true}}, Endpoint::completions)).echo);
}

TEST(ServerRequest, CompletionPromptForms) {
  EXPECT_EQ(ok(parse({{"prompt", "abc"}}, Endpoint::completions)).prompts.at(0).text, "abc");
  EXPECT_EQ(ok(parse({{"prompt", {"abc"}}}, Endpoint::completions)).prompts.at(0).text, "abc");
  const CompletionRequest ids = ok(parse({{"prompt", {5, 6, 7}}}, Endpoint::completions));
  ASSERT_EQ(ids.prompts.size(), 1u);
  EXPECT_TRUE(ids.prompts[0].is_tokens);
  EXPECT_EQ(ids.prompts[0].tokens, (std::vector<std::int32_t>{5, 6, 7}));
  EXPECT_EQ(ok(parse({{"prompt", {{8, 9}}}}, Endpoint::completions)).prompts.at(0).tokens,
            (std::vector<std::int32_t>{8, 9}));
  // Several prompts, in order, each its own choices.
  const CompletionRequest texts = ok(parse({{"prompt", {"a", "b", "c"}}}, Endpoint::completions));
  ASSERT_EQ(texts.prompts.size(), 3u);
  EXPECT_EQ(texts.prompts[2].text, "c");
  const CompletionRequest lists = ok(parse({{"prompt", {{1, 2}, {3}}}}, Endpoint::completions));
  ASSERT_EQ(lists.prompts.size(), 2u);
  EXPECT_EQ(lists.prompts[1].tokens, (std::vector<std::int32_t>{3}));
  const CompletionRequest stops = ok(parse({{"prompt", "x"}, {"stop", {"a", "b"}}}, Endpoint::completions));
  EXPECT_EQ(stops.stop, (std::vector<std::string>{"a", "b"}));
}

struct BadCase {
  json body;
  Endpoint endpoint;
  std::string param, code;
};

TEST(ServerRequest, BadInputsNameTheFieldAndKind) {
  auto with = [](const char* key, json value) {
    json b = kChat;
    b[key] = std::move(value);
    return b;
  };
  const std::vector<BadCase> cases = {
      {json::array(), Endpoint::chat, "body", "invalid_type"},
      {json::object(), Endpoint::chat, "messages", "missing_required_parameter"},
      {{{"messages", "hi"}}, Endpoint::chat, "messages", "invalid_type"},
      {{{"messages", json::array()}}, Endpoint::chat, "messages", "invalid_value"},
      {{{"messages", {1}}}, Endpoint::chat, "messages[0]", "invalid_type"},
      {{{"messages", {{{"content", "x"}}}}}, Endpoint::chat, "messages[0].role", "missing_required_parameter"},
      {{{"messages", {{{"role", "bot"}, {"content", "x"}}}}}, Endpoint::chat, "messages[0].role", "invalid_value"},
      {{{"messages", {{{"role", "user"}}}}}, Endpoint::chat, "messages[0].content", "missing_required_parameter"},
      {{{"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}}}}}}}},
       Endpoint::chat,
       "messages[0].content[0].type",
       "unsupported_value"},
      {with("max_tokens", "5"), Endpoint::chat, "max_tokens", "invalid_type"},
      {with("max_tokens", 0), Endpoint::chat, "max_tokens", "invalid_value"},
      {with("max_tokens", 101), Endpoint::chat, "max_tokens", "invalid_value"},
      {with("temperature", -0.1), Endpoint::chat, "temperature", "invalid_value"},
      {with("temperature", true), Endpoint::chat, "temperature", "invalid_type"},
      {with("top_p", 1.5), Endpoint::chat, "top_p", "invalid_value"},
      {with("seed", 1.5), Endpoint::chat, "seed", "invalid_type"},
      {with("stop", json::array({1})), Endpoint::chat, "stop[0]", "invalid_type"},
      {with("stop", json::array({"a", "b", "c", "d", "e"})), Endpoint::chat, "stop", "invalid_value"},
      {with("stop", ""), Endpoint::chat, "stop", "invalid_value"},
      {with("stream", 1), Endpoint::chat, "stream", "invalid_type"},
      {with("ignore_eos", "yes"), Endpoint::chat, "ignore_eos", "invalid_type"},
      {with("stream_options", {{"include_usage", true}}), Endpoint::chat, "stream_options", "invalid_value"},
      {with("n", 9), Endpoint::chat, "n", "invalid_value"},
      {with("n", 0), Endpoint::chat, "n", "invalid_value"},
      {with("presence_penalty", 2.5), Endpoint::chat, "presence_penalty", "invalid_value"},
      {with("frequency_penalty", "x"), Endpoint::chat, "frequency_penalty", "invalid_type"},
      {with("logit_bias", {{"5", 101}}), Endpoint::chat, "logit_bias", "invalid_value"},
      {with("logit_bias", {{"1000", 1}}), Endpoint::chat, "logit_bias", "invalid_value"},
      {with("logit_bias", {{"-1", 1}}), Endpoint::chat, "logit_bias", "invalid_value"},
      {with("logit_bias", {{"five", 1}}), Endpoint::chat, "logit_bias", "invalid_value"},
      {with("logit_bias", {{"5", "1"}}), Endpoint::chat, "logit_bias.5", "invalid_type"},
      {with("logit_bias", json::array()), Endpoint::chat, "logit_bias", "invalid_type"},
      {with("logprobs", 1), Endpoint::chat, "logprobs", "invalid_type"},
      {with("top_logprobs", 2), Endpoint::chat, "top_logprobs", "invalid_value"},
      {with("response_format", {{"type", "xml"}}), Endpoint::chat, "response_format.type", "invalid_value"},
      {with("response_format", "text"), Endpoint::chat, "response_format", "invalid_type"},
      {with("tools", json::array()), Endpoint::chat, "tools", "invalid_value"},
      {with("functions", json::array()), Endpoint::chat, "functions", "unsupported_value"},
      {json::object(), Endpoint::completions, "prompt", "missing_required_parameter"},
      {{{"prompt", 5}}, Endpoint::completions, "prompt", "invalid_type"},
      {{{"prompt", json::array()}}, Endpoint::completions, "prompt", "invalid_value"},
      {{{"prompt", {"a", 1}}}, Endpoint::completions, "prompt[1]", "invalid_type"},
      {{{"prompt", {{1}, "a"}}}, Endpoint::completions, "prompt[1]", "invalid_type"},
      {{{"prompt", {{1}, {-2}}}}, Endpoint::completions, "prompt[1][0]", "invalid_value"},
      {{{"prompt", {"a", "b", "c"}}, {"n", 3}}, Endpoint::completions, "n", "invalid_value"},
      {{{"prompt", {1, "a"}}}, Endpoint::completions, "prompt[1]", "invalid_type"},
      {{{"prompt", {-1}}}, Endpoint::completions, "prompt[0]", "invalid_value"},
      {{{"prompt", "x"}, {"echo", true}, {"logprobs", 1}}, Endpoint::completions, "echo", "unsupported_value"},
      {{{"prompt", "x"}, {"logprobs", 21}}, Endpoint::completions, "logprobs", "invalid_value"},
      {{{"prompt", "x"}, {"logprobs", true}}, Endpoint::completions, "logprobs", "invalid_type"},
  };
  for (const BadCase& c : cases) {
    const ApiError e = error(parse(c.body, c.endpoint));
    EXPECT_EQ(e.status, 400) << c.body.dump();
    EXPECT_EQ(e.param, c.param) << c.body.dump() << ": " << e.message;
    EXPECT_EQ(e.code, c.code) << c.body.dump() << ": " << e.message;
    EXPECT_FALSE(e.message.empty());
  }
}

TEST(ServerRequest, MalformedJsonSaysWhere) {
  const ApiError e = error(parse_completion_request("{\"messages\": [}", Endpoint::chat, {}));
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.code, "invalid_json");
  EXPECT_NE(e.message.find("byte"), std::string::npos) << e.message;
  EXPECT_EQ(error(parse_completion_request("", Endpoint::chat, {})).code, "invalid_json");
  // A number past double's range is a JSON error too, not a 500 (found by tests/fuzz/request_fuzz).
  const ApiError overflow =
      error(parse_completion_request(R"({"prompt": "hi", "max_tokens": 1E666})", Endpoint::completions, {}));
  EXPECT_EQ(overflow.status, 400);
  EXPECT_EQ(overflow.code, "invalid_json");
  EXPECT_NE(overflow.message.find("1E666"), std::string::npos) << overflow.message;
}

TEST(ServerErrors, OpenAiShapeAndStatusMapping) {
  const json j = bad_request("max_tokens", "too big").to_json();
  EXPECT_EQ(j["error"]["param"], "max_tokens");
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  EXPECT_EQ(j["error"]["code"], "invalid_value");
  EXPECT_TRUE(ApiError{}.to_json()["error"]["param"].is_null());

  const ApiError queue = from_status(Status(ErrorCode::out_of_memory, "queue", "full"));
  EXPECT_EQ(queue.status, 429);
  EXPECT_GT(queue.retry_after_seconds, 0);
  EXPECT_EQ(from_status(Status(ErrorCode::out_of_memory, "kv_cache", "too big")).status, 400);
  const ApiError closing = from_status(Status(ErrorCode::unsupported, "scheduler", "shutting down"));
  EXPECT_EQ(closing.status, 503);
  EXPECT_GT(closing.retry_after_seconds, 0);
  EXPECT_EQ(from_status(Status::invalid("prompt", "empty")).status, 400);
  EXPECT_EQ(from_status(Status(ErrorCode::backend_failure, "attention", "x")).status, 500);
}

TEST(ServerResponses, ShapesOfBodiesAndChunks) {
  ResponseMeta chat{Endpoint::chat, "chatcmpl-1", "m", 5};
  const json body = completion_body(chat, {{0, "hello", "stop"}, {1, "bye", "length"}}, {3, 2});
  EXPECT_EQ(body["object"], "chat.completion");
  EXPECT_EQ(body["choices"][0]["message"]["content"], "hello");
  EXPECT_EQ(body["choices"][1]["index"], 1);
  EXPECT_EQ(body["choices"][1]["finish_reason"], "length");
  EXPECT_TRUE(body["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(body["usage"]["total_tokens"], 5);
  const json first = stream_chunk(chat, 0, "", "", true);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  EXPECT_EQ(stream_chunk(chat, 0, "", "length")["choices"][0]["delta"], json::object());
  EXPECT_EQ(stream_chunk(chat, 3, "x", "")["choices"][0]["index"], 3);
  EXPECT_TRUE(usage_chunk(chat, {1, 1})["choices"].empty());
  ResponseMeta text{Endpoint::completions, "cmpl-1", "m", 5};
  EXPECT_EQ(stream_chunk(text, 0, "x", "")["choices"][0]["text"], "x");
  EXPECT_EQ(completion_body(text, {{0, "y", "length"}}, {})["object"], "text_completion");
}

TEST(ServerResponses, LogprobShapes) {
  // " Paris" then a token that is half of a UTF-8 sequence, and one the model rules out (-inf).
  const std::vector<LogprobEntry> entries = {{" Paris", -0.25f, {{" Paris", -0.25f}, {" Lyon", -2.0f}}},
                                             {"\xe2", -1.0f, {}},
                                             {"x", -std::numeric_limits<float>::infinity(), {}}};
  const json chat = logprobs_json(Endpoint::chat, entries, 0);
  ASSERT_EQ(chat["content"].size(), 3u);
  EXPECT_EQ(chat["content"][0]["token"], " Paris");
  EXPECT_EQ(chat["content"][0]["logprob"], -0.25);
  EXPECT_EQ(chat["content"][0]["bytes"], json({32, 80, 97, 114, 105, 115}));
  EXPECT_EQ(chat["content"][0]["top_logprobs"][1]["token"], " Lyon");
  EXPECT_EQ(chat["content"][0]["top_logprobs"][1]["logprob"], -2.0);
  EXPECT_EQ(chat["content"][1]["bytes"], json({0xe2}));
  EXPECT_EQ(chat["content"][2]["logprob"], -9999.0);
  EXPECT_TRUE(chat["refusal"].is_null());
  // The body still dumps (the partial sequence is replaced in the token string, kept in bytes).
  EXPECT_NE(dump_json(chat).find("\"bytes\":[226]"), std::string::npos) << dump_json(chat);

  const json legacy = logprobs_json(Endpoint::completions, entries, 10);
  EXPECT_EQ(legacy["tokens"][0], " Paris");
  EXPECT_EQ(legacy["token_logprobs"][0], -0.25);
  EXPECT_EQ(legacy["top_logprobs"][0][" Lyon"], -2.0);
  EXPECT_EQ(legacy["top_logprobs"][1], json::object());
  EXPECT_EQ(legacy["text_offset"], json({10, 16, 17}));
}

TEST(ServerSse, FramingAndInvalidUtf8) {
  EXPECT_EQ(sse_event(json{{"a", 1}}), "data: {\"a\":1}\n\n");
  EXPECT_EQ(std::string(kSseDone), "data: [DONE]\n\n");
  // Text never reaches here invalid (the stream decoder emits whole code points), but if it did,
  // the event must still be well-formed.
  const std::string bad = sse_event(json{{"t", std::string("\xff")}});
  EXPECT_EQ(bad, "data: {\"t\":\"\xEF\xBF\xBD\"}\n\n");
}

TEST(ServerMetricsText, CountersGaugesHistogramsAndEscaping) {
  MetricsRegistry r;
  MetricFamily& c = r.add("x_requests_total", "Requests.", MetricType::counter, {"route"});
  MetricFamily& h = r.add("x_latency_seconds", "Latency.", MetricType::histogram, {}, {0.1, 1});
  MetricFamily& g = r.add("x_depth", "Depth.", MetricType::gauge);
  c.inc({"/a\"b"});
  c.inc({"/a\"b"}, 2);
  h.observe({}, 0.05);
  h.observe({}, 0.5);
  h.observe({}, 5);
  g.set({}, 7);
  const std::string text = r.render();
  EXPECT_NE(text.find("# TYPE x_requests_total counter\nx_requests_total{route=\"/a\\\"b\"} 3\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("x_latency_seconds_bucket{le=\"0.1\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("x_latency_seconds_bucket{le=\"1\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("x_latency_seconds_bucket{le=\"+Inf\"} 3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("x_latency_seconds_sum 5.55\n"), std::string::npos) << text;
  EXPECT_NE(text.find("x_latency_seconds_count 3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("x_depth 7\n"), std::string::npos) << text;
  EXPECT_EQ(escape_label_value("a\\b\nc"), "a\\\\b\\nc");
}

// A backend that publishes counters: a good counter, a gauge, and the mistakes the server must
// survive (a name that breaks the text format, one already ending in _total).
class CountingBackend final : public AttentionBackend {
 public:
  CountingBackend(std::string name, BackendCounter::Kind shared_kind) : name_(std::move(name)), kind_(shared_kind) {}
  std::string_view name() const noexcept override { return name_; }
  std::string_view version() const noexcept override { return "1"; }
  DeviceKind device_kind() const noexcept override { return DeviceKind::cpu; }
  int priority() const noexcept override { return 0; }
  Support supports(const ProblemSignature&) const noexcept override { return Support::no("a test double"); }
  Status run(const ValidatedProblem&, Workspace) noexcept override { return {}; }
  std::vector<BackendCounter> counters() const override {
    using K = BackendCounter::Kind;
    return {{"widgets", "Widgets made.\nTwo lines.", K::counter, widgets},
            {"shared", "Published by both test backends.", kind_, 1.0},
            {"Bad-Name", "Not a metric name.", K::counter, 1.0},
            {"doubled_total", "Would render _total twice.", K::counter, 1.0},
            {"held", "Things held.", K::gauge, 3.0}};
  }
  double widgets = 0.0;

 private:
  std::string name_;
  BackendCounter::Kind kind_;
};

TEST(ServerMetricsText, BackendCountersRenderWithABackendLabel) {
  BackendRegistry registry;
  auto a = std::make_unique<CountingBackend>("alpha", BackendCounter::Kind::counter);
  auto b = std::make_unique<CountingBackend>("beta", BackendCounter::Kind::gauge);
  CountingBackend* alpha = a.get();
  ASSERT_TRUE(registry.add(std::move(a)));
  ASSERT_TRUE(registry.add(std::move(b)));
  ServerMetrics metrics;
  const runtime::SchedulerStats scheduler;
  const StatsObserver attention;
  alpha->widgets = 5;
  std::string text = metrics.render(scheduler, attention, {}, registry);
  EXPECT_NE(text.find("# HELP kallpa_backend_widgets_total Widgets made.\\nTwo lines.\n"
                      "# TYPE kallpa_backend_widgets_total counter\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("kallpa_backend_widgets_total{backend=\"alpha\"} 5\n"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE kallpa_backend_held gauge\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kallpa_backend_held{backend=\"beta\"} 3\n"), std::string::npos) << text;
  // Invalid names are dropped, the rest of the scrape stands.
  EXPECT_EQ(text.find("Bad-Name"), std::string::npos) << text;
  EXPECT_EQ(text.find("doubled_total"), std::string::npos) << text;
  // One family per name: the kind first seen wins, the other backend's series is dropped.
  EXPECT_NE(text.find("kallpa_backend_shared_total{backend=\"alpha\"} 1\n") == std::string::npos,
            text.find("kallpa_backend_shared{backend=\"beta\"} 1\n") == std::string::npos)
      << text;
  // Values move between scrapes; families are not added twice.
  alpha->widgets = 7;
  text = metrics.render(scheduler, attention, {}, registry);
  EXPECT_NE(text.find("kallpa_backend_widgets_total{backend=\"alpha\"} 7\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("# TYPE kallpa_backend_widgets_total"), text.rfind("# TYPE kallpa_backend_widgets_total"));
}

TEST(ServerMetricsText, PjrtCountersAreExported) {
  // The built-in pjrt backend publishes its executable cache counters whether or not a plugin is
  // loaded (zeros until it runs), so /metrics always carries them when pjrt is built.
  if (BackendRegistry::global().find("pjrt") == nullptr) GTEST_SKIP() << "the pjrt backend is not built here";
  ServerMetrics metrics;
  const std::string text = metrics.render(runtime::SchedulerStats{}, StatsObserver{}, {}, BackendRegistry::global());
  for (const char* series :
       {"kallpa_backend_compiles_total{backend=\"pjrt\"} ", "kallpa_backend_compile_failures_total{backend=\"pjrt\"} ",
        "kallpa_backend_compile_seconds_total{backend=\"pjrt\"} ", "kallpa_backend_cache_hits_total{backend=\"pjrt\"} ",
        "kallpa_backend_executions_total{backend=\"pjrt\"} ", "kallpa_backend_cached_executables{backend=\"pjrt\"} ",
        "kallpa_backend_bytes_to_device_total{backend=\"pjrt\"} ",
        "kallpa_backend_bytes_from_device_total{backend=\"pjrt\"} "}) {
    EXPECT_NE(text.find(series), std::string::npos) << series << " missing from\n" << text;
  }
}

TEST(BackendCounters, NamesAreCheckedInTheCore) {
  EXPECT_TRUE(valid_counter_name("compiles"));
  EXPECT_TRUE(valid_counter_name("bytes_to_device2"));
  EXPECT_FALSE(valid_counter_name(""));
  EXPECT_FALSE(valid_counter_name("2fast"));
  EXPECT_FALSE(valid_counter_name("Compiles"));
  EXPECT_FALSE(valid_counter_name("a-b"));
  EXPECT_FALSE(valid_counter_name("hits_total"));
}

TEST(ServerAccessLog, OneJsonLinePerRequest) {
  AccessLogEntry e;
  e.id = "req-1";
  e.method = "POST";
  e.path = e.route = "/v1/completions";
  e.status = 200;
  e.prompt_tokens = 4;
  e.completion_tokens = 9;
  e.finish_reason = "length";
  e.latency_seconds = 0.25;
  const std::string line = format_access_log(e);
  EXPECT_EQ(line.find('\n'), std::string::npos);
  const json j = json::parse(line);
  EXPECT_EQ(j["id"], "req-1");
  EXPECT_EQ(j["status"], 200);
  EXPECT_EQ(j["completion_tokens"], 9);
  EXPECT_EQ(j["latency_ms"], 250.0);
  AccessLogEntry plain;
  plain.path = "/health";
  EXPECT_FALSE(json::parse(format_access_log(plain)).contains("prompt_tokens"));
}

}  // namespace
}  // namespace kallpa::server
