#include "kallpa/tokenizer/chat_template.h"

#include <exception>
#include <optional>

#include "tokenizer/utf8.h"

#ifdef KALLPA_HAVE_JINJA
#include "jinja/lexer.h"
#include "jinja/parser.h"
#include "jinja/runtime.h"
#include "jinja/value.h"
#include "json.h"
#endif

namespace kallpa::tokenizer {

namespace {

constexpr const char* kField = "tokenizer.chat_template";

// Appends text to a rendered chat, marking it as message text when it is.
void append(RenderedChat& out, std::string_view text, bool from_message) {
  if (text.empty()) return;
  const std::size_t begin = out.text.size();
  out.text.append(text);
  if (!from_message) return;
  if (!out.from_messages.empty() && out.from_messages.back().end == begin) {
    out.from_messages.back().end = out.text.size();
  } else {
    out.from_messages.push_back({begin, out.text.size()});
  }
}

std::string_view trim(std::string_view s) {
  constexpr std::string_view ws = " \t\n\r\f\v";
  const std::size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

}  // namespace

#ifdef KALLPA_HAVE_JINJA

bool jinja_available() noexcept { return true; }

struct ChatTemplate::Impl {
  std::string source;
  jinja::program program;
  ChatToolSupport tools;
};

namespace {

// One message as transformers hands it to a template: role and content; an assistant's
// tool_calls [{id, type, function: {name, arguments}}], with the arguments parsed into an object
// when the template reads them so (arguments that are not a JSON object stay text); a tool
// message's tool_call_id and name. (JSON goes through the engine's own common_json: this file
// builds with the engine's throwing assert, which nlohmann's noexcept code must not see.)
common_json message_json(const ChatMessage& m, bool object_arguments) {
  common_json obj = common_json::object();
  obj["role"] = m.role;
  obj["content"] = m.content;
  if (!m.tool_calls.empty()) {
    common_json calls = common_json::array();
    for (const ChatToolCall& c : m.tool_calls) {
      common_json function = common_json::object();
      function["name"] = c.name;
      common_json args = object_arguments ? common_json::parse_no_throw(c.arguments) : common_json();
      function["arguments"] = !args.is_discarded() && args.is_object() ? args : common_json(c.arguments);
      common_json call = common_json::object();
      call["id"] = c.id;
      call["type"] = "function";
      call["function"] = function;
      calls.push_back(call);
    }
    obj["tool_calls"] = calls;
  }
  if (!m.tool_call_id.empty()) obj["tool_call_id"] = m.tool_call_id;
  if (!m.name.empty()) obj["name"] = m.name;
  return obj;
}

// One template (its source and parsed program) rendered with these inputs.
struct TemplateCode {
  const std::string& source;
  const jinja::program& program;
};

RenderedChat run_template(TemplateCode code, const ChatTemplateInputs& inputs, bool object_arguments) {
  jinja::context ctx(code.source);
  // Everything that came from the request is marked as message text, so that a special token's
  // text inside it stays text.
  common_json request = common_json::object();
  common_json messages = common_json::array();
  for (const ChatMessage& m : inputs.messages) messages.push_back(message_json(m, object_arguments));
  request["messages"] = messages;
  if (!inputs.tools_json.empty()) request["tools"] = common_json::parse(inputs.tools_json);  // throws: reported
  jinja::global_from_json(ctx, request, /*mark_input=*/true);
  ctx.set_val("bos_token", jinja::mk_val<jinja::value_string>(inputs.bos_token));
  ctx.set_val("eos_token", jinja::mk_val<jinja::value_string>(inputs.eos_token));
  ctx.set_val("add_generation_prompt", jinja::mk_val<jinja::value_bool>(inputs.add_generation_prompt));
  jinja::runtime runtime(ctx);
  const jinja::value results = runtime.execute(code.program);
  const jinja::value_string parts = jinja::runtime::gather_string_parts(results);
  RenderedChat out;
  for (const jinja::string_part& p : parts->val_str.parts) append(out, p.val, p.is_input);
  return out;
}

// The text these inputs render to; nullopt when the template raises.
std::optional<std::string> try_render(TemplateCode impl, std::span<const ChatMessage> messages,
                                      const std::string& tools_json, bool object_arguments) {
  ChatTemplateInputs in;
  in.messages = messages;
  in.tools_json = tools_json;
  try {
    return run_template(impl, in, object_arguments).text;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

bool contains(const std::optional<std::string>& text, std::string_view marker) {
  return text && text->find(marker) != std::string::npos;
}

ChatToolSupport probe_tool_support(TemplateCode impl) {
  const std::string tools = R"([{"type":"function","function":{"name":"kallpa_probe_tool","description":"A probe.",)"
                            R"("parameters":{"type":"object","properties":{"kallpa_probe_arg":{"type":"string"}}}}}])";
  ChatMessage user("user", "Hello.");
  ChatMessage call("assistant", "");
  call.tool_calls.push_back({"call_kallpa_probe", "kallpa_probe_call", R"({"kallpa_probe_key":"v"})"});
  ChatMessage result("tool", "kallpa_probe_result");
  result.tool_call_id = "call_kallpa_probe";
  result.name = "kallpa_probe_call";
  const std::vector<ChatMessage> with_call = {user, call};
  const std::vector<ChatMessage> with_result = {user, call, result, ChatMessage("assistant", "Done.")};
  const std::vector<ChatMessage> with_system = {ChatMessage("system", "kallpa_probe_system"), user};
  ChatToolSupport s;
  s.tools = contains(try_render(impl, std::span(&user, 1), tools, false), "kallpa_probe_tool");
  const auto as_object = try_render(impl, with_call, tools, true);
  const auto as_text = try_render(impl, with_call, tools, false);
  s.tool_calls = contains(as_object, "kallpa_probe_call") || contains(as_text, "kallpa_probe_call");
  // Objects (transformers' convention) when the template writes them as JSON (`| tojson`): the key
  // in double quotes, not escaped as inside a JSON string; otherwise the client's JSON text.
  s.object_arguments =
      s.tool_calls && contains(as_object, "\"kallpa_probe_key\"") && !contains(as_object, "\\\"kallpa_probe_key");
  s.tool_responses = contains(try_render(impl, with_result, tools, s.object_arguments), "kallpa_probe_result");
  s.system_role = contains(try_render(impl, with_system, "", false), "kallpa_probe_system");
  return s;
}

// The engine parses and evaluates recursively, so a template nested deep enough overflows the
// stack (about 10,000 levels of brackets, blocks or chained operators do). Real templates stay
// far below these limits; a file that exceeds them is refused before the parser sees it.
constexpr int kMaxNesting = 128;             // brackets, and {% if/for/macro/... %} blocks
constexpr std::size_t kMaxTagTokens = 2048;  // tokens inside one {{ }} or {% %}

// Whether the `set` at tokens[i] opens a block ({% set x %}...{% endset %}): no `=` before its %}.
bool is_block_set(const std::vector<jinja::token>& tokens, std::size_t i) {
  for (std::size_t j = i + 1; j < tokens.size() && tokens[j].t != jinja::token::close_statement; ++j) {
    if (tokens[j].t == jinja::token::equals) return false;
  }
  return true;
}

Status check_nesting(const std::vector<jinja::token>& tokens) {
  int brackets = 0, blocks = 0;
  std::size_t in_tag = 0;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const jinja::token& t = tokens[i];
    switch (t.t) {
      case jinja::token::open_paren:
      case jinja::token::open_square_bracket:
      case jinja::token::open_curly_bracket: ++brackets; break;
      case jinja::token::close_paren:
      case jinja::token::close_square_bracket:
      case jinja::token::close_curly_bracket: --brackets; break;
      case jinja::token::open_statement:
      case jinja::token::open_expression: in_tag = 0; break;
      case jinja::token::identifier:
        if (i > 0 && tokens[i - 1].t == jinja::token::open_statement) {
          const std::string& w = t.value;
          if (w == "if" || w == "for" || w == "macro" || w == "call" || w == "filter" || w == "generation" ||
              (w == "set" && is_block_set(tokens, i))) {
            ++blocks;
          }
          if (w.starts_with("end")) --blocks;
        }
        break;
      default: break;
    }
    if (++in_tag > kMaxTagTokens || brackets > kMaxNesting || blocks > kMaxNesting) {
      return Status(ErrorCode::unsupported, kField,
                    "the template nests deeper than kallpa renders (more than " + std::to_string(kMaxNesting) +
                        " levels of brackets or blocks, or " + std::to_string(kMaxTagTokens) +
                        " tokens in one tag), near byte " + std::to_string(t.pos));
    }
  }
  return {};
}

}  // namespace

Result<ChatTemplate> ChatTemplate::parse(std::string source) {
  try {
    jinja::lexer lexer;
    const jinja::lexer_result tokens = lexer.tokenize(source);
    if (Status st = check_nesting(tokens.tokens); !st) return st;
    auto impl = std::make_unique<Impl>();
    impl->program = jinja::parse_from_tokens(tokens);
    impl->source = std::move(source);
    impl->tools = probe_tool_support({impl->source, impl->program});
    return ChatTemplate(std::move(impl));
  } catch (const std::exception& e) {
    return Status::invalid(kField, std::string("not a valid Jinja template: ") + e.what());
  }
}

Result<RenderedChat> ChatTemplate::render(const ChatTemplateInputs& inputs) const {
  try {
    return run_template({impl_->source, impl_->program}, inputs, impl_->tools.object_arguments);
  } catch (const std::exception& e) {
    return Status::invalid(kField, std::string("rendering failed: ") + e.what());
  }
}

#else

bool jinja_available() noexcept { return false; }

struct ChatTemplate::Impl {
  std::string source;
  ChatToolSupport tools;
};

Result<ChatTemplate> ChatTemplate::parse(std::string) {
  return Status(ErrorCode::unsupported, kField,
                "this build has no Jinja engine (run scripts/fetch_jinja.sh and reconfigure)");
}

Result<RenderedChat> ChatTemplate::render(const ChatTemplateInputs&) const {
  return Status(ErrorCode::unsupported, kField, "this build has no Jinja engine");
}

#endif

ChatTemplate::ChatTemplate(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;
ChatTemplate::~ChatTemplate() = default;
const std::string& ChatTemplate::source() const noexcept { return impl_->source; }
const ChatToolSupport& ChatTemplate::tool_support() const noexcept { return impl_->tools; }

RenderedChat render_gemma(std::span<const ChatMessage> messages, bool add_generation_prompt,
                          std::string_view bos_token) {
  RenderedChat out;
  append(out, bos_token, false);
  std::span<const ChatMessage> turns = messages;
  std::string_view system;
  if (!turns.empty() && turns.front().role == "system") {
    system = turns.front().content;
    turns = turns.subspan(1);
  }
  bool first = true;
  for (const ChatMessage& m : turns) {
    append(out, "<start_of_turn>", false);
    append(out, m.role == "assistant" ? std::string_view("model") : std::string_view(m.role), m.role != "assistant");
    append(out, "\n", false);
    if (first && !system.empty()) {
      append(out, system, true);
      append(out, "\n\n", false);
    }
    first = false;
    append(out, trim(m.content), true);
    append(out, "<end_of_turn>\n", false);
  }
  if (add_generation_prompt) append(out, "<start_of_turn>model\n", false);
  return out;
}

RenderedChat render_chatml(std::span<const ChatMessage> messages, const ChatMlOptions& options) {
  RenderedChat out;
  auto turn = [&out](std::string_view role, std::string_view content, bool from_message) {
    append(out, "<|im_start|>", false);
    append(out, role, from_message);
    append(out, "\n", false);
    append(out, content, from_message);
    append(out, "<|im_end|>\n", false);
  };
  if (options.default_system_prompt && !messages.empty() && messages.front().role != "system") {
    turn("system", *options.default_system_prompt, false);
  }
  for (const ChatMessage& m : messages) turn(m.role, m.content, true);
  if (options.add_generation_prompt) append(out, "<|im_start|>assistant\n", false);
  return out;
}

namespace {

std::string special_text(const Tokenizer& tokenizer, std::optional<TokenId> id) {
  return id ? tokenizer.token_text(*id) : std::string();
}

}  // namespace

Result<RenderedChat> render_chat(const Tokenizer& tokenizer, const ChatFormat& format,
                                 std::span<const ChatMessage> messages, bool add_generation_prompt,
                                 std::string_view tools_json) {
  // Messages are made valid UTF-8 first, so that the marked ranges stay where the text is.
  std::vector<ChatMessage> clean(messages.begin(), messages.end());
  auto sanitize = [](std::string& s) {
    if (!detail::first_invalid_utf8(s)) return;
    std::string fixed;
    detail::utf8_sanitize(s, fixed, /*final=*/true);
    s = std::move(fixed);
  };
  for (ChatMessage& m : clean) {
    for (std::string* s : {&m.role, &m.content, &m.tool_call_id, &m.name}) sanitize(*s);
    for (ChatToolCall& c : m.tool_calls) {
      for (std::string* s : {&c.id, &c.name, &c.arguments}) sanitize(*s);
    }
  }
  switch (format.kind) {
    case ChatFormatKind::file_template: {
      if (!format.file_template) return Status::invalid(kField, "the chat format has no template");
      ChatTemplateInputs in;
      in.messages = clean;
      in.add_generation_prompt = add_generation_prompt;
      in.bos_token = special_text(tokenizer, tokenizer.bos_id());
      in.eos_token = special_text(tokenizer, tokenizer.eos_id());
      in.tools_json = std::string(tools_json);
      return format.file_template->render(in);
    }
    case ChatFormatKind::gemma:
      return render_gemma(clean, add_generation_prompt, special_text(tokenizer, tokenizer.bos_id()));
    case ChatFormatKind::chatml: {
      ChatMlOptions o = format.chatml;
      o.add_generation_prompt = add_generation_prompt;
      return render_chatml(clean, o);
    }
  }
  return Status::invalid(kField, "unknown chat format");
}

Result<std::vector<TokenId>> encode_chat(const Tokenizer& tokenizer, const ChatFormat& format,
                                         std::span<const ChatMessage> messages, bool add_generation_prompt,
                                         std::string_view tools_json) {
  auto rendered = render_chat(tokenizer, format, messages, add_generation_prompt, tools_json);
  if (!rendered) return rendered.status();
  EncodeOptions opts;
  opts.add_special = false;
  auto ids = tokenizer.encode(rendered->text, opts, rendered->from_messages);
  if (!ids) return ids.status();
  const auto bos = tokenizer.bos_id();
  if (tokenizer.add_bos() && bos && (ids->empty() || ids->front() != *bos)) ids->insert(ids->begin(), *bos);
  return ids;
}

ChatFormat choose_chat_format(const Tokenizer& tokenizer, std::string_view architecture,
                              std::string_view template_source) {
  ChatFormat f;
  std::string why;
  if (!template_source.empty()) {
    auto parsed = ChatTemplate::parse(std::string(template_source));
    if (parsed) {
      f.kind = ChatFormatKind::file_template;
      f.file_template = std::make_shared<const ChatTemplate>(std::move(*parsed));
      f.tools = f.file_template->tool_support();
      f.description = f.tools.tools ? "the file's tokenizer.chat_template (it renders tools)"
                                    : "the file's tokenizer.chat_template";
      return f;
    }
    why = "the file's chat template cannot be used: " + parsed.status().message();
  } else {
    why = "the file has no chat template";
  }
  if (architecture.starts_with("gemma") || tokenizer.token_id("<start_of_turn>")) {
    f.kind = ChatFormatKind::gemma;
    f.description = "built-in Gemma turns (" + why + ")";
  } else {
    f.kind = ChatFormatKind::chatml;
    if (!template_source.empty()) {
      if (auto o = chatml_options_from_template(template_source); o) f.chatml = *o;
    }
    f.description = "built-in ChatML (" + why + ")";
  }
  return f;
}

}  // namespace kallpa::tokenizer
