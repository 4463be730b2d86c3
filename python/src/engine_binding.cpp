#include "engine_binding.h"

#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kallpa/runtime/engine.h"
#include "kallpa/tokenizer/chat.h"
#include "status_error.h"

namespace kallpa::python {
namespace {

namespace nb = nanobind;

// What one generate() call takes: the engine's own sampling parameters and generation options
// (their defaults are the engine's), of which Python sets the fields bound below.
struct GenerateArgs : runtime::SamplingParams, runtime::GenerateOptions {};

// A loaded model. Generation runs one at a time per model (the engine's KV cache and its scratch
// are shared by its sessions); a second caller waits with the GIL released.
class Model {
 public:
  Model(const std::string& path, const std::string& device, const std::optional<std::vector<std::string>>& attention,
        bool strict_device) {
    runtime::EngineOptions options;
    options.model_path = path;
    options.device = device;
    options.strict_device = strict_device;
    Result<DispatchOptions> dispatch = DispatchOptions::from_env();
    check(dispatch.status());
    options.attention = std::move(*dispatch);
    if (attention) options.attention.backends = *attention;
    Result<std::unique_ptr<runtime::Engine>> engine = [&] {
      nb::gil_scoped_release release;
      return runtime::Engine::load(options);
    }();
    check(engine.status());
    engine_ = std::move(*engine);
  }

  std::vector<std::int32_t> tokenize(std::string_view text, bool add_special, bool parse_special) const {
    Result<std::vector<std::int32_t>> ids =
        engine_->tokenizer().encode(text, {.add_special = add_special, .parse_special = parse_special});
    check(ids.status());
    return std::move(*ids);
  }

  nb::bytes detokenize_bytes(const std::vector<std::int32_t>& ids, bool skip_special) const {
    Result<std::string> text = engine_->tokenizer().decode_bytes(ids, {.skip_special = skip_special});
    check(text.status());
    return nb::bytes(text->data(), text->size());
  }

  std::string detokenize(const std::vector<std::int32_t>& ids, bool skip_special) const {
    Result<std::string> text = engine_->tokenizer().decode(ids, {.skip_special = skip_special});
    check(text.status());
    return std::move(*text);
  }

  // The prompt of one conversation in the model's chat template (messages as (role, content)).
  std::vector<std::int32_t> chat_tokens(const std::vector<std::pair<std::string, std::string>>& messages,
                                        bool add_generation_prompt) const {
    std::vector<tokenizer::ChatMessage> chat;
    for (const auto& [role, content] : messages) chat.push_back({role, content});
    tokenizer::ChatMlOptions options = engine_->chat_options();
    options.add_generation_prompt = add_generation_prompt;
    Result<std::vector<std::int32_t>> ids = tokenizer::encode_chatml(engine_->tokenizer(), chat, options);
    check(ids.status());
    return std::move(*ids);
  }

  // Generates after `prompt`; `on_text` (may be None) receives each piece of final text, called
  // with the GIL held. An exception it raises ends the generation and propagates.
  nb::dict generate(const std::vector<std::int32_t>& prompt, const GenerateArgs& args,
                    const std::optional<nb::callable>& on_text) {
    const runtime::SamplingParams& sampling = args;
    check(sampling.validate());
    runtime::GenerateOptions options = args;
    if (options.max_tokens < 0) {
      throw_invalid("max_tokens", "must be >= 0", std::to_string(options.max_tokens));
    }
    std::function<void(std::string_view)> callback;
    if (on_text) {
      callback = [&on_text](std::string_view text) {
        nb::gil_scoped_acquire acquire;
        (*on_text)(nb::str(text.data(), text.size()));
      };
    }
    Result<runtime::GenerateResult> result = runtime::GenerateResult{};
    {
      nb::gil_scoped_release release;
      std::lock_guard lock(mu_);
      runtime::Session session(*engine_, sampling);
      result = runtime::generate(session, prompt, options, callback);
    }
    check(result.status());
    nb::dict out;
    out["text"] = result->text;
    out["prompt_tokens"] = result->prompt_tokens;
    out["generated_tokens"] = result->generated_tokens;
    out["finish_reason"] = result->finish_reason;
    out["prefill_seconds"] = result->prefill_seconds;
    out["decode_seconds"] = result->decode_seconds;
    return out;
  }

  nb::dict config() const {
    const model::ModelConfig& c = engine_->config();
    nb::dict out;
    out["architecture"] = c.architecture;
    out["name"] = c.name;
    out["context_length"] = c.context_length;
    out["n_embd"] = c.n_embd;
    out["n_layer"] = c.n_layer;
    out["n_head"] = c.n_head;
    out["n_head_kv"] = c.n_head_kv;
    out["head_dim"] = c.head_dim;
    out["vocab_size"] = c.vocab_size;
    return out;
  }

  std::optional<std::int32_t> eos_id() const { return engine_->tokenizer().eos_id(); }

 private:
  std::unique_ptr<runtime::Engine> engine_;
  std::mutex mu_;
};

}  // namespace

void bind_engine(nb::module_& m) {
  nb::class_<GenerateArgs>(m, "_GenerateArgs")
      .def(nb::init<>())
      .def_rw("max_tokens", &GenerateArgs::max_tokens)
      .def_rw("temperature", &GenerateArgs::temperature)
      .def_rw("top_k", &GenerateArgs::top_k)
      .def_rw("top_p", &GenerateArgs::top_p)
      .def_rw("min_p", &GenerateArgs::min_p)
      .def_rw("repetition_penalty", &GenerateArgs::repetition_penalty)
      .def_rw("seed", &GenerateArgs::seed)
      .def_rw("stop", &GenerateArgs::stop)
      .def_rw("stop_at_eos", &GenerateArgs::stop_at_eos);

  nb::class_<Model>(m, "_Model")
      .def(nb::init<const std::string&, const std::string&, const std::optional<std::vector<std::string>>&, bool>(),
           nb::arg("path"), nb::arg("device"), nb::arg("attention").none(), nb::arg("strict_device"))
      .def("tokenize", &Model::tokenize, nb::arg("text"), nb::arg("add_special"), nb::arg("parse_special"))
      .def("detokenize", &Model::detokenize, nb::arg("ids"), nb::arg("skip_special"))
      .def("detokenize_bytes", &Model::detokenize_bytes, nb::arg("ids"), nb::arg("skip_special"))
      .def("chat_tokens", &Model::chat_tokens, nb::arg("messages"), nb::arg("add_generation_prompt"))
      .def("generate", &Model::generate, nb::arg("prompt"), nb::arg("args"), nb::arg("on_text").none())
      .def("config", &Model::config)
      .def("eos_id", &Model::eos_id);
}

}  // namespace kallpa::python
