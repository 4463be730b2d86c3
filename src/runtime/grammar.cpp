#include "kallpa/runtime/grammar.h"

#include <algorithm>
#include <exception>
#include <thread>
#include <utility>

#include <fmt/format.h>

#ifdef KALLPA_HAVE_XGRAMMAR
#include <dlpack/dlpack.h>
#include <xgrammar/xgrammar.h>
#endif

namespace kallpa::runtime {

std::size_t token_mask_words(std::int64_t vocab_size) noexcept {
  return static_cast<std::size_t>((std::max<std::int64_t>(0, vocab_size) + 31) / 32);
}

#ifdef KALLPA_HAVE_XGRAMMAR

namespace {

// The compiler caches compiled grammars by source; a server that sees many distinct schemas keeps
// at most this much of them.
constexpr std::int64_t kCompiledCacheBytes = std::int64_t{256} << 20;

// Compact separators and no free whitespace: a model given the freedom of JSON's whitespace can
// spend its whole token budget on newlines between two values.
constexpr bool kAnyWhitespace = false;

Status compile_error(const GrammarSpec& spec, const std::exception& e) {
  const char* field = spec.kind == GrammarKind::ebnf ? "grammar" : "schema";
  return Status::invalid(field, fmt::format("cannot be compiled: {}", e.what()));
}

}  // namespace

class CompiledGrammar {
 public:
  CompiledGrammar(xgrammar::CompiledGrammar grammar, std::vector<std::int32_t> eog, std::int64_t vocab)
      : grammar_(std::move(grammar)), eog_(std::move(eog)), vocab_(vocab) {}
  const xgrammar::CompiledGrammar& grammar() const noexcept { return grammar_; }
  const std::vector<std::int32_t>& eog() const noexcept { return eog_; }
  std::int64_t vocab_size() const noexcept { return vocab_; }

 private:
  xgrammar::CompiledGrammar grammar_;
  std::vector<std::int32_t> eog_;
  std::int64_t vocab_;
};

struct GrammarCompiler::Impl {
  Impl(xgrammar::TokenizerInfo info, std::vector<std::int32_t> eog_ids, std::int64_t vocab_size, int threads)
      : compiler(info, threads, /*cache_enabled=*/true, kCompiledCacheBytes),
        eog(std::move(eog_ids)),
        vocab(vocab_size) {}
  // xgrammar's compiler is documented thread-safe (its cache locks), but compile() is const here.
  mutable xgrammar::GrammarCompiler compiler;
  std::vector<std::int32_t> eog;
  std::int64_t vocab;
};

Result<std::unique_ptr<GrammarCompiler>> GrammarCompiler::create(const tokenizer::Tokenizer& tokenizer,
                                                                 std::int64_t vocab_size) {
  const auto tokens = static_cast<std::int64_t>(tokenizer.vocab_size());
  if (vocab_size < tokens || vocab_size > INT32_MAX) {
    return Status::invalid("vocab_size", fmt::format("is {}, must be in [{}, {}] (the tokenizer's vocabulary)",
                                                     vocab_size, tokens, INT32_MAX));
  }
  // The engine reads every token as the bytes it decodes to (RAW). An empty string marks a token
  // the grammar never allows: control tokens (<|im_start|>, ...), whose text is markup, not
  // output; the end-of-generation tokens are passed apart, as the tokens that end a grammar.
  std::vector<std::string> vocab(static_cast<std::size_t>(tokens));
  for (std::int64_t i = 0; i < tokens; ++i) {
    const auto id = static_cast<tokenizer::TokenId>(i);
    const tokenizer::TokenType type = tokenizer.token_type(id);
    if (type == tokenizer::TokenType::control || type == tokenizer::TokenType::unknown ||
        type == tokenizer::TokenType::unused || tokenizer.is_eog(id)) {
      continue;
    }
    vocab[static_cast<std::size_t>(i)] = tokenizer.token_bytes(id);
  }
  std::vector<std::int32_t> eog(tokenizer.eog_ids().begin(), tokenizer.eog_ids().end());
  if (eog.empty()) {
    return Status(ErrorCode::unsupported, "tokenizer",
                  "the model has no end-of-generation token, which structured output needs to end a grammar");
  }
  const int threads = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 8u));
  try {
    xgrammar::TokenizerInfo info(vocab, xgrammar::VocabType::RAW, static_cast<int>(vocab_size), eog);
    return std::unique_ptr<GrammarCompiler>(
        new GrammarCompiler(std::make_unique<Impl>(std::move(info), std::move(eog), vocab_size, threads)));
  } catch (const std::exception& e) {
    return Status(ErrorCode::internal, "tokenizer",
                  fmt::format("the grammar engine refused the vocabulary: {}", e.what()));
  }
}

Result<std::shared_ptr<const CompiledGrammar>> GrammarCompiler::compile(const GrammarSpec& spec) const {
  try {
    xgrammar::CompiledGrammar compiled = [&] {
      switch (spec.kind) {
        case GrammarKind::json:
          return impl_->compiler.CompileJSONSchema(R"({"type": "object"})", kAnyWhitespace, std::nullopt, std::nullopt,
                                                   /*strict_mode=*/false);
        case GrammarKind::json_schema:
          return impl_->compiler.CompileJSONSchema(spec.source, kAnyWhitespace, std::nullopt, std::nullopt,
                                                   spec.strict);
        case GrammarKind::ebnf: break;
      }
      return impl_->compiler.CompileGrammar(spec.source, "root");
    }();
    return std::shared_ptr<const CompiledGrammar>(
        std::make_shared<CompiledGrammar>(std::move(compiled), impl_->eog, impl_->vocab));
  } catch (const std::exception& e) {
    return compile_error(spec, e);
  }
}

struct GrammarMatcher::Impl {
  explicit Impl(std::shared_ptr<const CompiledGrammar> g)
      : grammar(std::move(g)), matcher(grammar->grammar()), mask(token_mask_words(grammar->vocab_size())) {
    shape = static_cast<std::int64_t>(mask.size());
    tensor.data = mask.data();
    tensor.device = DLDevice{kDLCPU, 0};
    tensor.ndim = 1;
    tensor.dtype = DLDataType{kDLInt, 32, 1};
    tensor.shape = &shape;
    tensor.strides = nullptr;
    tensor.byte_offset = 0;
  }
  void fill() {
    if (mask_valid) return;
    matcher.FillNextTokenBitmask(&tensor);
    mask_valid = true;
  }

  std::shared_ptr<const CompiledGrammar> grammar;
  xgrammar::GrammarMatcher matcher;
  std::vector<std::uint32_t> mask;
  std::int64_t shape = 0;
  DLTensor tensor{};
  bool mask_valid = false;  // mask is the current state's (accept() invalidates it)
};

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar)
    : impl_(std::make_unique<Impl>(std::move(grammar))) {}

std::span<const std::uint32_t> GrammarMatcher::next_mask() {
  if (impl_->matcher.IsTerminated()) {
    // Nothing may follow an end-of-generation token.
    std::fill(impl_->mask.begin(), impl_->mask.end(), 0u);
    impl_->mask_valid = false;
  } else {
    impl_->fill();
  }
  return impl_->mask;
}

Status GrammarMatcher::accept(std::int32_t token) {
  if (impl_->matcher.IsTerminated()) {
    return Status::invalid("grammar", fmt::format("token {} follows the end of the grammar", token));
  }
  if (token < 0 || token >= impl_->grammar->vocab_size()) {
    return Status::invalid("grammar", fmt::format("token {} is outside the vocabulary", token));
  }
  impl_->mask_valid = false;
  if (!impl_->matcher.AcceptToken(token)) {
    return Status::invalid("grammar", fmt::format("token {} is not allowed by the grammar here", token));
  }
  return {};
}

bool GrammarMatcher::finished() {
  if (impl_->matcher.IsTerminated()) return true;
  if (!impl_->matcher.IsCompleted()) return false;
  // Complete, but it may go on (a number's next digit, an array's next element): finished only
  // when nothing but an end-of-generation token is allowed.
  impl_->fill();
  std::vector<std::uint32_t> rest = impl_->mask;
  for (std::int32_t id : impl_->grammar->eog()) rest[static_cast<std::size_t>(id) / 32] &= ~(1u << (id % 32));
  return std::all_of(rest.begin(), rest.end(), [](std::uint32_t w) { return w == 0; });
}

#else  // built without the grammar engine

class CompiledGrammar {};

struct GrammarCompiler::Impl {
  std::int64_t vocab = 0;
};

Result<std::unique_ptr<GrammarCompiler>> GrammarCompiler::create(const tokenizer::Tokenizer&, std::int64_t) {
  return Status(ErrorCode::unsupported, "grammar",
                "structured output needs the grammar engine: run scripts/fetch_xgrammar.sh and rebuild");
}

Result<std::shared_ptr<const CompiledGrammar>> GrammarCompiler::compile(const GrammarSpec&) const {
  return Status(ErrorCode::unsupported, "grammar", "kallpa was built without the grammar engine");
}

struct GrammarMatcher::Impl {};

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar>) : impl_(std::make_unique<Impl>()) {}
std::span<const std::uint32_t> GrammarMatcher::next_mask() { return {}; }
Status GrammarMatcher::accept(std::int32_t) { return Status(ErrorCode::unsupported, "grammar", "no grammar engine"); }
bool GrammarMatcher::finished() { return true; }

#endif

GrammarCompiler::GrammarCompiler(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GrammarCompiler::~GrammarCompiler() = default;
std::int64_t GrammarCompiler::vocab_size() const noexcept { return impl_->vocab; }

GrammarMatcher::~GrammarMatcher() = default;
GrammarMatcher::GrammarMatcher(GrammarMatcher&&) noexcept = default;
GrammarMatcher& GrammarMatcher::operator=(GrammarMatcher&&) noexcept = default;

}  // namespace kallpa::runtime
