#include "kallpa/tokenizer/chat.h"

#include "kallpa/tokenizer/chat_template.h"

namespace kallpa::tokenizer {
namespace {

constexpr std::string_view kImStart = "<|im_start|>";
constexpr std::string_view kImEnd = "<|im_end|>";

bool needs_default_system(std::span<const ChatMessage> messages, const ChatMlOptions& options) {
  return options.default_system_prompt && !messages.empty() && messages.front().role != "system";
}

}  // namespace

std::string format_chatml(std::span<const ChatMessage> messages, const ChatMlOptions& options) {
  return render_chatml(messages, options).text;
}

Result<std::vector<TokenId>> encode_chatml(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                                           const ChatMlOptions& options) {
  const auto start = tokenizer.token_id(kImStart), end = tokenizer.token_id(kImEnd);
  if (!start || !end) {
    return Status(ErrorCode::not_found, "tokenizer.ggml.tokens",
                  "the vocabulary has no " + std::string(!start ? kImStart : kImEnd) + " token (not a ChatML model)");
  }
  EncodeOptions text_opts;
  text_opts.add_special = false;
  text_opts.parse_special = false;
  std::vector<TokenId> ids;
  auto append = [&](std::string_view text) -> Status {
    auto r = tokenizer.encode(text, text_opts);
    if (!r) return r.status();
    ids.insert(ids.end(), r->begin(), r->end());
    return {};
  };
  auto turn = [&](std::string_view role, std::string_view content) -> Status {
    ids.push_back(*start);
    std::string text;
    text.reserve(role.size() + 1 + content.size());
    text.append(role).append("\n").append(content);
    if (Status st = append(text); !st) return st;
    ids.push_back(*end);
    return append("\n");
  };
  if (needs_default_system(messages, options)) {
    if (Status st = turn("system", *options.default_system_prompt); !st) return st;
  }
  for (const ChatMessage& m : messages) {
    if (Status st = turn(m.role, m.content); !st) return st;
  }
  if (options.add_generation_prompt) {
    ids.push_back(*start);
    if (Status st = append("assistant\n"); !st) return st;
  }
  return ids;
}

Result<ChatMlOptions> chatml_options_from_template(std::string_view tmpl) {
  if (tmpl.find(kImStart) == std::string_view::npos || tmpl.find(kImEnd) == std::string_view::npos) {
    return Status(ErrorCode::unsupported, "tokenizer.chat_template",
                  "not a ChatML template (no <|im_start|>/<|im_end|>); only ChatML is supported");
  }
  ChatMlOptions opts;
  opts.default_system_prompt.reset();
  // A hard-coded system turn: <|im_start|>system, a newline (literal or "\n" escape), literal text
  // (no quotes, no Jinja expressions) up to <|im_end|>.
  const std::string_view head = "<|im_start|>system";
  for (std::size_t pos = tmpl.find(head); pos != std::string_view::npos; pos = tmpl.find(head, pos + 1)) {
    std::size_t b = pos + head.size();
    if (tmpl.substr(b, 1) == "\n") {
      b += 1;
    } else if (tmpl.substr(b, 2) == "\\n") {
      b += 2;
    } else {
      continue;
    }
    const std::size_t e = tmpl.find(kImEnd, b);
    if (e == std::string_view::npos) break;
    const std::string_view text = tmpl.substr(b, e - b);
    if (text.find_first_of("'\"") != std::string_view::npos || text.find("{{") != std::string_view::npos ||
        text.find("{%") != std::string_view::npos) {
      continue;
    }
    std::string prompt;
    for (std::size_t i = 0; i < text.size(); ++i) {  // undo "\n" escapes
      if (text[i] == '\\' && i + 1 < text.size() && text[i + 1] == 'n') {
        prompt.push_back('\n');
        ++i;
      } else {
        prompt.push_back(text[i]);
      }
    }
    opts.default_system_prompt = std::move(prompt);
    break;
  }
  return opts;
}

}  // namespace kallpa::tokenizer
