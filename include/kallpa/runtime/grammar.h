// Structured output: generation constrained by a grammar (any JSON, a JSON schema, or an EBNF
// grammar), by xgrammar's engine (docs/structured-output.md).
//
// Per model, once: a GrammarCompiler takes the vocabulary as the engine needs it (every token's
// decoded bytes, the end-of-generation tokens as the ones that end a grammar, control tokens as
// never allowed) and compiles grammars against it; the engine precomputes, per grammar state, which
// tokens can follow, so a step costs little. Per request: a GrammarMatcher, fed each accepted
// token, gives the next step's allowed tokens as a bitmask that Sampler::sample applies to the
// logits (masked tokens get -inf, so greedy and sampled draws alike only pick allowed tokens).
//
//   auto compiler = GrammarCompiler::create(engine.tokenizer(), engine.config().vocab_size);
//   auto grammar = (*compiler)->compile({.kind = GrammarKind::json_schema, .source = schema});
//   GrammarMatcher matcher(*grammar);
//   token = sampler.sample(logits, recent, matcher.next_mask());
//   matcher.accept(token);  // ... until matcher.finished()
//
// Thread safety: a GrammarCompiler and its compiled grammars may be used from any thread at once;
// a GrammarMatcher belongs to one request, one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kallpa/status.h"
#include "kallpa/tokenizer/tokenizer.h"

namespace kallpa::runtime {

enum class GrammarKind {
  json,         // any JSON value whose top level is an object (OpenAI's json_object)
  json_schema,  // source: a JSON schema (draft 2020-12 keywords the engine supports)
  ebnf,         // source: an EBNF grammar in xgrammar's dialect (GBNF-like), root rule "root"
};

struct GrammarSpec {
  GrammarKind kind = GrammarKind::json;
  std::string source;
  // json_schema: objects take no properties beyond those listed unless the schema says otherwise
  // (OpenAI's strict mode); false follows JSON Schema's default, where they may.
  bool strict = true;
};

// One compiled grammar: immutable, shared by every request that uses it.
class CompiledGrammar;

class GrammarCompiler {
 public:
  // Prepares `tokenizer`'s vocabulary for logits of `vocab_size` entries (ids past the
  // tokenizer's own vocabulary are never allowed). unsupported when kallpa was built without the
  // grammar engine (scripts/fetch_xgrammar.sh).
  static Result<std::unique_ptr<GrammarCompiler>> create(const tokenizer::Tokenizer& tokenizer,
                                                         std::int64_t vocab_size);
  ~GrammarCompiler();
  GrammarCompiler(const GrammarCompiler&) = delete;
  GrammarCompiler& operator=(const GrammarCompiler&) = delete;

  // Compiles `spec` (cached: the same spec again costs a lookup). invalid_argument with field
  // "schema" (or "grammar") and the engine's message naming the part it cannot compile.
  Result<std::shared_ptr<const CompiledGrammar>> compile(const GrammarSpec& spec) const;

  std::int64_t vocab_size() const noexcept;

 private:
  struct Impl;
  explicit GrammarCompiler(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Words of a token bitmask over `vocab_size` tokens: bit (id % 32) of word id / 32 is set when
// token id is allowed.
std::size_t token_mask_words(std::int64_t vocab_size) noexcept;

class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar);
  ~GrammarMatcher();
  GrammarMatcher(GrammarMatcher&&) noexcept;
  GrammarMatcher& operator=(GrammarMatcher&&) noexcept;

  // The tokens allowed next (token_mask_words(vocab_size) words), valid until the next call of
  // any member. After the grammar completes, only end-of-generation tokens are allowed.
  std::span<const std::uint32_t> next_mask();
  // Advances by one generated token. invalid_argument (field "grammar") when the grammar does not
  // allow it here, or after finished().
  Status accept(std::int32_t token);
  // Whether an end-of-generation token has been accepted, or the grammar is complete and allows
  // nothing else: generation is over.
  bool finished();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kallpa::runtime
