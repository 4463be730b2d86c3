// kallpa_chat_template_tool: renders chat templates with kallpa's Jinja engine from JSON, for the
// cross-check against Python's jinja2 (tests/tokenizer/crosscheck_templates.py).
//
//   kallpa_chat_template_tool --input INPUT.json  > OUTPUT.json
//
// INPUT.json: {"cases": [{"template": str, "messages": [{"role", "content"}...], "bos_token": str,
//              "eos_token": str, "add_generation_prompt": bool}...]}
// OUTPUT.json: {"jinja": bool, "results": [{"text": str} or {"error": str}...]}
// Errors reading the input go to stderr with exit code 1 (2 for usage).
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kallpa/tokenizer/chat_template.h"

namespace tk = kallpa::tokenizer;
using nlohmann::json;

namespace {

int run(int argc, char** argv) {
  if (argc != 3 || std::string(argv[1]) != "--input") {
    std::fprintf(stderr, "usage: kallpa_chat_template_tool --input INPUT.json\n");
    return 2;
  }
  std::ifstream in(argv[2], std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "kallpa_chat_template_tool: cannot open %s\n", argv[2]);
    return 1;
  }
  const json input = json::parse(in);
  json results = json::array();
  for (const json& c : input.at("cases")) {
    std::vector<tk::ChatMessage> messages;
    for (const json& m : c.at("messages")) {
      messages.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
    }
    auto tmpl = tk::ChatTemplate::parse(c.at("template").get<std::string>());
    if (!tmpl) {
      results.push_back({{"error", tmpl.status().to_string()}});
      continue;
    }
    tk::ChatTemplateInputs inputs;
    inputs.messages = messages;
    inputs.bos_token = c.value("bos_token", std::string());
    inputs.eos_token = c.value("eos_token", std::string());
    inputs.add_generation_prompt = c.value("add_generation_prompt", true);
    auto rendered = tmpl->render(inputs);
    if (!rendered) {
      results.push_back({{"error", rendered.status().to_string()}});
      continue;
    }
    results.push_back({{"text", rendered->text}});
  }
  const json out = {{"jinja", tk::jinja_available()}, {"results", results}};
  std::cout << out.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kallpa_chat_template_tool: %s\n", e.what());
    return 1;
  }
}
