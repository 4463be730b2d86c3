// Tool calling in the server, without a model: tools / tool_choice / parallel_tool_calls and the
// tool messages parsed and validated (400s name the field); the reply's JSON schema, compiled by
// the grammar engine and stepped through on a byte vocabulary (a call of a known tool with valid
// arguments passes, anything else is refused); the prompt's messages for templates with and without
// tool support; replies read back into tool_calls; the response and stream shapes; and the chat
// templates' tool support found by probing, with `tools` and tool_calls reaching the template.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kallpa/runtime/grammar.h"
#include "kallpa/tokenizer/chat_template.h"
#include "server/openai_responses.h"
#include "server/request_parser.h"
#include "server/tool_calls.h"
#include "support/byte_tokenizer.h"

namespace kallpa::server {
namespace {

using nlohmann::json;
using tokenizer::ChatMessage;
using tokenizer::ChatToolCall;
using tokenizer::ChatToolSupport;

ParsedRequest parse(const json& body) {
  return parse_completion_request(body.dump(), Endpoint::chat,
                                  {.max_tokens = 100, .max_choices = 8, .vocab_size = 1000});
}

CompletionRequest ok(const ParsedRequest& p) {
  if (const auto* e = std::get_if<ApiError>(&p)) ADD_FAILURE() << e->param << ": " << e->message;
  const auto* r = std::get_if<CompletionRequest>(&p);
  return r ? *r : CompletionRequest{};
}

const json kWeather = {{"type", "function"},
                       {"function",
                        {{"name", "get_weather"},
                         {"description", "The weather in a city."},
                         {"parameters",
                          {{"type", "object"},
                           {"properties", {{"city", {{"type", "string"}}}, {"unit", {{"enum", {"C", "F"}}}}}},
                           {"required", {"city"}}}}}}};
const json kTime = {{"type", "function"}, {"function", {{"name", "get_time"}}}};

json chat_with(json extra) {
  json body = {{"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}}};
  for (auto& [k, v] : extra.items()) body[k] = v;
  return body;
}

TEST(ToolRequest, ParsesToolsAndTheChoice) {
  CompletionRequest r = ok(parse(chat_with({{"tools", {kWeather, kTime}}})));
  ASSERT_EQ(r.tools.tools.size(), 2u);
  EXPECT_EQ(r.tools.tools[0].name, "get_weather");
  EXPECT_EQ(r.tools.tools[0].description, "The weather in a city.");
  EXPECT_EQ(r.tools.choice, ToolChoice::automatic) << "auto is the default with tools";
  EXPECT_TRUE(r.tools.parallel);
  EXPECT_TRUE(r.tools.offered());
  EXPECT_EQ(json::parse(r.tools.tools[1].parameters), json::parse(R"({"type":"object","properties":{}})"))
      << "a function without parameters takes an empty object";
  // The schema keeps the client's key order (properties are generated in it).
  const std::string body =
      R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function",)"
      R"("function":{"name":"f","parameters":{"type":"object","properties":{"zeta":{},"alpha":{}}}}}]})";
  auto ordered = parse_completion_request(body, Endpoint::chat, {.max_tokens = 10});
  EXPECT_LT(ok(ordered).tools.tools[0].parameters.find("zeta"), ok(ordered).tools.tools[0].parameters.find("alpha"));

  EXPECT_EQ(ok(parse(chat_with({{"tools", {kWeather}}, {"tool_choice", "none"}}))).tools.choice, ToolChoice::none);
  EXPECT_FALSE(ok(parse(chat_with({{"tools", {kWeather}}, {"tool_choice", "none"}}))).tools.offered());
  EXPECT_EQ(ok(parse(chat_with({{"tools", {kWeather}}, {"tool_choice", "required"}}))).tools.choice,
            ToolChoice::required);
  r = ok(parse(chat_with(
      {{"tools", {kWeather, kTime}}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_time"}}}}}})));
  EXPECT_EQ(r.tools.choice, ToolChoice::function);
  EXPECT_EQ(r.tools.function, "get_time");
  EXPECT_FALSE(ok(parse(chat_with({{"tools", {kWeather}}, {"parallel_tool_calls", false}}))).tools.parallel);
  EXPECT_FALSE(ok(parse(chat_with({{"tool_choice", "none"}}))).tools.offered()) << "none without tools is fine";
  EXPECT_FALSE(ok(parse(chat_with({{"parallel_tool_calls", true}}))).tools.offered());
}

TEST(ToolRequest, BadToolsNameTheField) {
  json no_name = kWeather;
  no_name["function"].erase("name");
  json bad_name = kWeather;
  bad_name["function"]["name"] = "get weather";
  json bad_params = kWeather;
  bad_params["function"]["parameters"] = "object";
  json custom = {{"type", "custom"}, {"custom", {{"name", "x"}}}};
  struct Case {
    json extra;
    std::string param, code;
  };
  const std::vector<Case> cases = {
      {{{"tools", "x"}}, "tools", "invalid_type"},
      {{{"tools", json::array()}}, "tools", "invalid_value"},
      {{{"tools", {5}}}, "tools[0]", "invalid_type"},
      {{{"tools", {kWeather, no_name}}}, "tools[1].function.name", "missing_required_parameter"},
      {{{"tools", {bad_name}}}, "tools[0].function.name", "invalid_value"},
      {{{"tools", {kWeather, kWeather}}}, "tools[1].function.name", "invalid_value"},
      {{{"tools", {bad_params}}}, "tools[0].function.parameters", "invalid_type"},
      {{{"tools", {custom}}}, "tools[0].type", "unsupported_value"},
      {{{"tools", {{{"type", "function"}}}}}, "tools[0].function", "missing_required_parameter"},
      {{{"tools", {kWeather}}, {"tool_choice", "always"}}, "tool_choice", "invalid_value"},
      {{{"tools", {kWeather}}, {"tool_choice", 1}}, "tool_choice", "invalid_type"},
      {{{"tools", {kWeather}}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "nope"}}}}}},
       "tool_choice.function.name",
       "invalid_value"},
      {{{"tools", {kWeather}}, {"tool_choice", {{"type", "function"}}}},
       "tool_choice.function",
       "missing_required_parameter"},
      {{{"tool_choice", "required"}}, "tool_choice", "invalid_value"},
      {{{"tools", {kWeather}}, {"parallel_tool_calls", "yes"}}, "parallel_tool_calls", "invalid_type"},
      {{{"functions", {kWeather["function"]}}}, "functions", "unsupported_value"},
      {{{"function_call", "auto"}}, "function_call", "unsupported_value"},
  };
  for (const Case& c : cases) {
    const auto p = parse(chat_with(c.extra));
    const auto* e = std::get_if<ApiError>(&p);
    ASSERT_NE(e, nullptr) << c.extra.dump();
    EXPECT_EQ(e->status, 400) << c.extra.dump();
    EXPECT_EQ(e->param, c.param) << c.extra.dump() << ": " << e->message;
    EXPECT_EQ(e->code, c.code) << c.extra.dump() << ": " << e->message;
  }
}

const json kCallMessage = {{"role", "assistant"},
                           {"content", nullptr},
                           {"tool_calls",
                            {{{"id", "call_1"},
                              {"type", "function"},
                              {"function", {{"name", "get_weather"}, {"arguments", R"({"city":"Paris"})"}}}}}}};

TEST(ToolRequest, ParsesToolMessagesAndAssistantCalls) {
  json body = chat_with({{"tools", {kWeather}}});
  body["messages"].push_back(kCallMessage);
  body["messages"].push_back({{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "18 C, sunny"}});
  const CompletionRequest r = ok(parse(body));
  ASSERT_EQ(r.messages.size(), 3u);
  ASSERT_EQ(r.messages[1].tool_calls.size(), 1u);
  EXPECT_EQ(r.messages[1].content, "");
  EXPECT_EQ(r.messages[1].tool_calls[0].id, "call_1");
  EXPECT_EQ(r.messages[1].tool_calls[0].name, "get_weather");
  EXPECT_EQ(r.messages[1].tool_calls[0].arguments, R"({"city":"Paris"})");
  EXPECT_EQ(r.messages[2].role, "tool");
  EXPECT_EQ(r.messages[2].tool_call_id, "call_1");
  EXPECT_EQ(r.messages[2].name, "get_weather") << "the function's name, from the call it answers";
  EXPECT_EQ(r.messages[2].content, "18 C, sunny");

  auto error_of = [](const json& b) {
    const auto p = parse(b);
    const auto* e = std::get_if<ApiError>(&p);
    return e ? e->param + " " + e->code : std::string("accepted");
  };
  json orphan = chat_with({});
  orphan["messages"].push_back({{"role", "tool"}, {"tool_call_id", "call_9"}, {"content", "x"}});
  EXPECT_EQ(error_of(orphan), "messages[1].tool_call_id invalid_value");
  json no_id = chat_with({});
  no_id["messages"].push_back(kCallMessage);
  no_id["messages"].push_back({{"role", "tool"}, {"content", "x"}});
  EXPECT_EQ(error_of(no_id), "messages[2].tool_call_id missing_required_parameter");
  json no_content = chat_with({});
  no_content["messages"].push_back({{"role", "assistant"}, {"content", nullptr}});
  EXPECT_EQ(error_of(no_content), "messages[1].content missing_required_parameter");
  json bad_call = chat_with({});
  bad_call["messages"].push_back(kCallMessage);
  bad_call["messages"][1]["tool_calls"][0]["function"]["arguments"] = 5;
  EXPECT_EQ(error_of(bad_call), "messages[1].tool_calls[0].function.arguments invalid_type");
  json function_role = chat_with({});
  function_role["messages"].push_back({{"role", "function"}, {"name", "f"}, {"content", "x"}});
  EXPECT_EQ(error_of(function_role), "messages[1].role invalid_value");
}

ToolRequest weather_and_time(ToolChoice choice, bool parallel = true) {
  const CompletionRequest r = ok(parse(chat_with({{"tools", {kWeather, kTime}}})));
  ToolRequest t = r.tools;
  t.choice = choice;
  t.parallel = parallel;
  if (choice == ToolChoice::function) t.function = "get_weather";
  return t;
}

// A user question, the assistant's get_weather call and the tool's result (named after the tool
// when `result_names_tool`), rendered by `t` with the weather-and-time tools offered.
Result<tokenizer::RenderedChat> render_weather_exchange(const tokenizer::ChatTemplate& t,
                                                        const std::string& result_text, bool result_names_tool) {
  ChatMessage call("assistant", "");
  call.tool_calls = {{"call_1", "get_weather", R"({"city":"Paris"})"}};
  ChatMessage result("tool", result_text);
  result.tool_call_id = "call_1";
  if (result_names_tool) result.name = "get_weather";
  const std::vector<ChatMessage> chat = {ChatMessage("user", "Weather?"), call, result};
  tokenizer::ChatTemplateInputs in;
  in.messages = chat;
  in.tools_json = tools_template_json(weather_and_time(ToolChoice::automatic));
  return t.render(in);
}

// Whether the grammar of `schema` takes `text` whole (every byte allowed, then the end). The
// engine writes JSON with ", " and ": " between items (docs/structured-output.md).
bool grammar_takes(const std::string& schema, const std::string& text) {
  const tokenizer::Tokenizer tok = test::byte_tokenizer();
  auto compiler = runtime::GrammarCompiler::create(tok, static_cast<std::int64_t>(tok.vocab_size()));
  if (!compiler) {
    ADD_FAILURE() << compiler.status().to_string();
    return false;
  }
  auto grammar = (*compiler)->compile({runtime::GrammarKind::json_schema, schema, true});
  if (!grammar) {
    ADD_FAILURE() << grammar.status().to_string();
    return false;
  }
  runtime::GrammarMatcher m(*grammar);
  for (char c : text) {
    if (!m.accept(test::byte_token(c))) return false;
  }
  return m.accept(2).is_ok();  // <|im_end|>, the end of generation: only once the JSON is complete
}

TEST(ToolReplySchema, TakesValidCallsOnly) {
  if (!runtime::GrammarCompiler::create(test::byte_tokenizer(), 259)) GTEST_SKIP() << "built without xgrammar";
  const std::string required = tool_reply_schema(weather_and_time(ToolChoice::required), std::nullopt);
  EXPECT_TRUE(grammar_takes(required, R"({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]})"));
  EXPECT_TRUE(grammar_takes(required, R"({"tool_calls": [{"name": "get_time", "arguments": {}}]})"));
  EXPECT_TRUE(grammar_takes(
      required,
      R"({"tool_calls": [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Lima", "unit": "C"}}]})"))
      << "parallel calls";
  EXPECT_FALSE(grammar_takes(required, R"({"tool_calls": [{"name": "get_wether", "arguments": {"city": "Paris"}}]})"))
      << "an unknown function";
  EXPECT_FALSE(grammar_takes(required, R"({"tool_calls": [{"name": "get_weather", "arguments": {}}]})"))
      << "a required argument missing";
  EXPECT_FALSE(grammar_takes(
      required, R"({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "K"}}]})"))
      << "an argument outside its enum";
  EXPECT_FALSE(grammar_takes(required, R"({"tool_calls": []})")) << "at least one call";
  EXPECT_FALSE(grammar_takes(required, R"({"response": "hi"})")) << "required: no plain answer";

  const std::string automatic = tool_reply_schema(weather_and_time(ToolChoice::automatic), std::nullopt);
  EXPECT_TRUE(grammar_takes(automatic, R"({"response": "It is sunny."})"));
  EXPECT_TRUE(grammar_takes(automatic, R"({"tool_calls": [{"name": "get_time", "arguments": {}}]})"));
  EXPECT_FALSE(grammar_takes(automatic, R"(It is sunny.)"));

  const std::string named = tool_reply_schema(weather_and_time(ToolChoice::function), std::nullopt);
  EXPECT_TRUE(grammar_takes(named, R"({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]})"));
  EXPECT_FALSE(grammar_takes(named, R"({"tool_calls": [{"name": "get_time", "arguments": {}}]})"))
      << "another function";

  const std::string single = tool_reply_schema(weather_and_time(ToolChoice::required, false), std::nullopt);
  EXPECT_TRUE(grammar_takes(single, R"({"tool_calls": [{"name": "get_time", "arguments": {}}]})"));
  EXPECT_FALSE(grammar_takes(
      single, R"({"tool_calls": [{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]})"))
      << "parallel_tool_calls false: one call";

  // response_format shapes the plain answer of auto.
  const runtime::GrammarSpec format{runtime::GrammarKind::json_schema,
                                    R"({"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]})",
                                    false};
  const std::string with_format = tool_reply_schema(weather_and_time(ToolChoice::automatic), format);
  EXPECT_TRUE(grammar_takes(with_format, R"({"response": {"n": 3}})"));
  EXPECT_FALSE(grammar_takes(with_format, R"({"response": "three"})"));
}

TEST(ToolMessages, OfferTheToolsInTheSystemMessage) {
  const ToolRequest t = weather_and_time(ToolChoice::automatic);
  const std::vector<ChatMessage> chat = {ChatMessage("user", "Weather in Paris?")};
  const ChatToolSupport none{
      .tools = false, .tool_calls = false, .tool_responses = false, .object_arguments = false, .system_role = true};
  std::vector<ChatMessage> out = tool_chat_messages(chat, t, none);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].role, "system");
  EXPECT_NE(out[0].content.find(R"({"tool_calls": [)"), std::string::npos) << out[0].content;
  EXPECT_NE(out[0].content.find(R"({"response": )"), std::string::npos) << "auto offers a plain answer";
  EXPECT_NE(out[0].content.find(R"("name":"get_weather")"), std::string::npos) << "the definitions, for a template "
                                                                                  "that does not render them";
  // An existing system message gets the text appended; a template that renders tools gets no
  // definitions in it; required offers no plain answer.
  const std::vector<ChatMessage> with_system = {ChatMessage("system", "Be brief."), chat[0]};
  ChatToolSupport native = none;
  native.tools = true;
  out = tool_chat_messages(with_system, weather_and_time(ToolChoice::required), native);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].content.rfind("Be brief.\n\n", 0), 0u) << out[0].content;
  EXPECT_EQ(out[0].content.find("get_weather"), std::string::npos) << out[0].content;
  EXPECT_EQ(out[0].content.find(R"({"response")"), std::string::npos) << out[0].content;
  // Without a system role the text opens the first user message.
  ChatToolSupport no_system = none;
  no_system.system_role = false;
  out = tool_chat_messages(chat, t, no_system);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].role, "user");
  EXPECT_NE(out[0].content.find("Weather in Paris?"), std::string::npos);
  EXPECT_NE(out[0].content.find("tool_calls"), std::string::npos);
  // tool_choice none: nothing is offered.
  out = tool_chat_messages(chat, weather_and_time(ToolChoice::none), none);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].content, "Weather in Paris?");
}

TEST(ToolMessages, WriteCallsAndResultsForTemplatesWithoutThem) {
  ChatMessage call("assistant", "");
  call.tool_calls = {{"call_1", "get_weather", R"({"city":"Paris"})"}, {"call_2", "get_time", "{}"}};
  ChatMessage r1("tool", "18 C");
  r1.tool_call_id = "call_1";
  r1.name = "get_weather";
  ChatMessage r2("tool", "noon");
  r2.tool_call_id = "call_2";
  r2.name = "get_time";
  const std::vector<ChatMessage> chat = {ChatMessage("user", "Weather and time?"), call, r1, r2,
                                         ChatMessage("user", "Thanks. Summarise.")};
  const ChatToolSupport none{
      .tools = false, .tool_calls = false, .tool_responses = false, .object_arguments = false, .system_role = true};
  std::vector<ChatMessage> with_text = chat;
  with_text[1].content = "Let me look.";
  EXPECT_EQ(tool_chat_messages(with_text, weather_and_time(ToolChoice::none), none)[1].content.rfind(
                "Let me look.\n\n{\"tool_calls\"", 0),
            0u)
      << "text beside the calls stays";
  const std::vector<ChatMessage> out = tool_chat_messages(chat, weather_and_time(ToolChoice::none), none);
  ASSERT_EQ(out.size(), 3u) << "user, assistant, user: the roles alternate";
  EXPECT_EQ(out[1].role, "assistant");
  EXPECT_TRUE(out[1].tool_calls.empty());
  EXPECT_EQ(json::parse(out[1].content),
            json::parse(R"({"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}},)"
                        R"({"name":"get_time","arguments":{}}]})"))
      << "the calls in the reply shape";
  EXPECT_EQ(out[2].role, "user");
  const std::string results = out[2].content.substr(0, out[2].content.find("\n\n"));
  EXPECT_EQ(json::parse(results), json::parse(R"({"tool_results":[{"name":"get_weather","tool_call_id":"call_1",)"
                                              R"("content":"18 C"},{"name":"get_time","tool_call_id":"call_2",)"
                                              R"("content":"noon"}]})"));
  EXPECT_NE(out[2].content.find("Thanks. Summarise."), std::string::npos) << "the next user turn joins the results";
  // A template that renders them gets the messages as they are.
  const ChatToolSupport all{
      .tools = true, .tool_calls = true, .tool_responses = true, .object_arguments = true, .system_role = true};
  const std::vector<ChatMessage> same = tool_chat_messages(chat, weather_and_time(ToolChoice::none), all);
  ASSERT_EQ(same.size(), chat.size());
  EXPECT_EQ(same[1].tool_calls.size(), 2u);
  EXPECT_EQ(same[2].role, "tool");
}

TEST(ToolReply, ReadsCallsAnswersAndCutReplies) {
  ToolReply r = read_tool_reply(R"({"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris","days":2}},)"
                                R"({"name":"get_time","arguments":{}}]})");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_TRUE(r.content_null);
  EXPECT_EQ(r.calls[0].name, "get_weather");
  EXPECT_EQ(r.calls[0].arguments, R"({"city":"Paris","days":2})") << "compact, in the model's order";
  EXPECT_EQ(r.calls[1].arguments, "{}");
  EXPECT_EQ(r.calls[0].id.rfind("call_", 0), 0u);
  EXPECT_EQ(r.calls[0].id.size(), 29u);
  EXPECT_NE(r.calls[0].id, r.calls[1].id);
  r = read_tool_reply(R"({"response":"Sunny."})");
  EXPECT_TRUE(r.calls.empty());
  EXPECT_FALSE(r.content_null);
  EXPECT_EQ(r.content, "Sunny.");
  r = read_tool_reply(R"({"response":{"n":3}})");
  EXPECT_EQ(r.content, R"({"n":3})") << "a JSON answer (response_format) as its text";
  r = read_tool_reply(R"({"tool_calls":[{"name":"get_weather","argu)");
  EXPECT_TRUE(r.calls.empty()) << "cut by max_tokens: the text as it is";
  EXPECT_EQ(r.content, R"({"tool_calls":[{"name":"get_weather","argu)");
  r = read_tool_reply(R"({"response": "It is su)");
  EXPECT_EQ(r.content, "It is su") << "an answer cut by max_tokens: the answer so far";
  std::set<std::string> ids;
  for (int i = 0; i < 1000; ++i) ids.insert(new_tool_call_id());
  EXPECT_EQ(ids.size(), 1000u);
}

TEST(ToolReply, AnswerSoFarDecodesTheCompletePart) {
  EXPECT_EQ(answer_so_far(R"({"response": "Hel)"), "Hel");
  EXPECT_EQ(answer_so_far(R"({"response": "done"})"), "done");
  EXPECT_EQ(answer_so_far(R"({"response": ")"), "");
  EXPECT_EQ(answer_so_far(R"({"response": "a\nb\"c)"), "a\nb\"c") << "escapes decoded";
  EXPECT_EQ(answer_so_far(R"({"response": "a\)"), "a") << "an escape cut short waits";
  EXPECT_EQ(answer_so_far(R"({"response": "a\u00e9)"), "a\u00e9");
  EXPECT_EQ(answer_so_far(R"({"response": "a\u00)"), "a");
  EXPECT_EQ(answer_so_far(R"({"response": "a\ud83d\ude00)"), "a\U0001F600") << "a surrogate pair";
  EXPECT_EQ(answer_so_far(R"({"response": "a\ud83d)"), "a") << "a high surrogate waits for the low one";
  EXPECT_EQ(answer_so_far(R"({"response": "a\ud83d\ude)"), "a");
  EXPECT_EQ(answer_so_far("{\"response\": \"a\xc3"), "a") << "a UTF-8 sequence cut short waits";
  EXPECT_EQ(answer_so_far("{\"response\": \"a\xc3\xa9"), "a\u00e9");
  EXPECT_EQ(answer_so_far(R"({"tool_calls": [)"), std::nullopt);
  EXPECT_EQ(answer_so_far(R"({"response": {"n")"), std::nullopt) << "a JSON answer waits for the end";
  EXPECT_EQ(answer_so_far(R"({"resp)"), std::nullopt);
  EXPECT_EQ(answer_so_far(""), std::nullopt);
}

TEST(ToolResponses, ShapesOfMessagesAndStreamChunks) {
  ResponseMeta meta{Endpoint::chat, "chatcmpl-1", "m", 7};
  const std::vector<ChatToolCall> calls = {{"call_a", "get_weather", R"({"city":"Paris"})"}};
  ChoiceBody c{0, "", "tool_calls", nullptr};
  c.tool_calls = &calls;
  c.content_null = true;
  const json body = completion_body(meta, {c}, Usage{5, 3, 0});
  const json& message = body["choices"][0]["message"];
  EXPECT_TRUE(message["content"].is_null());
  EXPECT_EQ(body["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_EQ(message["tool_calls"],
            json::parse(R"([{"id":"call_a","type":"function",)"
                        R"("function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}])"));
  const std::vector<json> chunks = tool_call_chunks(meta, 2, 0, calls[0]);
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0]["choices"][0]["index"], 2);
  EXPECT_EQ(
      chunks[0]["choices"][0]["delta"]["tool_calls"],
      json::parse(R"([{"index":0,"id":"call_a","type":"function","function":{"name":"get_weather","arguments":""}}])"));
  EXPECT_EQ(chunks[1]["choices"][0]["delta"]["tool_calls"],
            json::parse(R"([{"index":0,"function":{"arguments":"{\"city\":\"Paris\"}"}}])"));
  EXPECT_TRUE(chunks[1]["choices"][0]["finish_reason"].is_null());
}

#define REQUIRE_JINJA() \
  if (!tokenizer::jinja_available()) GTEST_SKIP() << "built without the Jinja engine (scripts/fetch_jinja.sh)"

// A template in the manner of Hermes / Qwen 2.5: tools in the system turn, calls as
// <tool_call> JSON with the arguments as an object, results in <tool_response>.
const char* kToolTemplate =
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function | tojson }}{% endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

// ChatML as SmolLM2's template writes it: no tools.
const char* kChatMlTemplate =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

TEST(ChatTemplateTools, ProbesWhatATemplateRenders) {
  REQUIRE_JINJA();
  auto tool_template = tokenizer::ChatTemplate::parse(kToolTemplate);
  ASSERT_TRUE(tool_template.is_ok()) << tool_template.status().to_string();
  const ChatToolSupport& s = tool_template->tool_support();
  EXPECT_TRUE(s.tools);
  EXPECT_TRUE(s.tool_calls);
  EXPECT_TRUE(s.tool_responses);
  EXPECT_TRUE(s.object_arguments) << "it writes arguments with tojson";
  EXPECT_TRUE(s.system_role);

  auto chatml = tokenizer::ChatTemplate::parse(kChatMlTemplate);
  ASSERT_TRUE(chatml.is_ok());
  EXPECT_FALSE(chatml->tool_support().tools);
  EXPECT_FALSE(chatml->tool_support().tool_calls);
  EXPECT_TRUE(chatml->tool_support().tool_responses) << "it writes any role's content, the tool role's too";
  EXPECT_TRUE(chatml->tool_support().system_role);

  // Gemma-like: raises on roles other than user/assistant alternating, drops system.
  auto strict = tokenizer::ChatTemplate::parse(
      "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('roles') }}{% endif %}"
      "{{ m.content }}{% endfor %}");
  ASSERT_TRUE(strict.is_ok());
  EXPECT_FALSE(strict->tool_support().tool_responses);
  EXPECT_FALSE(strict->tool_support().system_role);
}

TEST(ChatTemplateTools, PassesToolsAndCallsToTheTemplate) {
  REQUIRE_JINJA();
  auto t = tokenizer::ChatTemplate::parse(kToolTemplate);
  ASSERT_TRUE(t.is_ok());
  auto r = render_weather_exchange(*t, "18 C <|im_end|>", /*result_names_tool=*/false);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_NE(r->text.find(R"(Tools: {"name": "get_weather", "description": "The weather in a city.", )"),
            std::string::npos)
      << r->text;
  EXPECT_NE(r->text.find(R"(<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>)"),
            std::string::npos)
      << r->text;
  EXPECT_NE(r->text.find("<tool_response>18 C <|im_end|></tool_response>"), std::string::npos) << r->text;
  // The tool's text is message text: its "<|im_end|>" is not read as the control token.
  const std::size_t at = r->text.find("18 C <|im_end|>");
  bool marked = false;
  for (const tokenizer::TextRange& m : r->from_messages) marked |= m.begin <= at && at + 15 <= m.end;
  EXPECT_TRUE(marked);
}

// The templates that come with llama.cpp's Jinja engine (third_party/llama-jinja/templates, from
// the models' tokenizer_config.json): "" when the engine was not fetched.
std::string vendored_template(const std::string& name) {
  const auto path = std::filesystem::path(__FILE__).parent_path().parent_path() / "third_party" / "llama-jinja" /
                    "templates" / (name + ".jinja");
  std::ifstream in(path);
  if (!in) return {};
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(ChatTemplateTools, RealTemplatesWithAndWithoutTools) {
  REQUIRE_JINJA();
  struct Expected {
    const char* name;
    bool tools, tool_calls, tool_responses, object_arguments;
  };
  const Expected cases[] = {
      {"Qwen-Qwen2.5-7B-Instruct", true, true, true, true},
      {"NousResearch-Hermes-3-Llama-3.1-8B-tool_use", true, true, true, true},
      {"meta-llama-Llama-3.1-8B-Instruct", true, true, true, true},
      {"google-gemma-2-2b-it", false, false, false, false},
  };
  int found = 0;
  for (const Expected& e : cases) {
    const std::string source = vendored_template(e.name);
    if (source.empty()) continue;
    ++found;
    auto t = tokenizer::ChatTemplate::parse(source);
    ASSERT_TRUE(t.is_ok()) << e.name << ": " << t.status().to_string();
    const ChatToolSupport& s = t->tool_support();
    EXPECT_EQ(s.tools, e.tools) << e.name;
    EXPECT_EQ(s.tool_calls, e.tool_calls) << e.name;
    EXPECT_EQ(s.tool_responses, e.tool_responses) << e.name;
    EXPECT_EQ(s.object_arguments, e.object_arguments) << e.name;
  }
  if (found == 0) GTEST_SKIP() << "third_party/llama-jinja/templates not found (scripts/fetch_jinja.sh)";
  // Qwen 2.5 renders a whole exchange natively: the tools in its system turn, the call in
  // <tool_call> with its arguments as JSON, the result in <tool_response>.
  const std::string qwen = vendored_template("Qwen-Qwen2.5-7B-Instruct");
  if (qwen.empty()) return;
  auto t = tokenizer::ChatTemplate::parse(qwen);
  ASSERT_TRUE(t.is_ok());
  auto r = render_weather_exchange(*t, "18 C", /*result_names_tool=*/true);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_NE(r->text.find(R"("name": "get_weather")"), std::string::npos) << r->text;
  EXPECT_NE(r->text.find(R"("arguments": {"city": "Paris"})"), std::string::npos) << r->text;
  EXPECT_NE(r->text.find("<tool_response>\n18 C\n</tool_response>"), std::string::npos) << r->text;
}

}  // namespace
}  // namespace kallpa::server
