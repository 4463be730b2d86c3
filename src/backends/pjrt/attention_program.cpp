#include "backends/pjrt/attention_program.h"

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

namespace kallpa::pjrt {
namespace {

using Dims = std::vector<std::int64_t>;

std::string_view element(DType t) noexcept {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
  }
  return "f32";
}

std::string tensor(const Dims& dims, std::string_view elem) {
  std::string out = "tensor<";
  for (std::int64_t d : dims) out += fmt::format("{}x", d);
  out += elem;
  out += '>';
  return out;
}

std::string i64_array(const Dims& values) {
  return values.empty() ? std::string("array<i64>") : fmt::format("array<i64: {}>", fmt::join(values, ", "));
}

// A value: its SSA name and its type.
struct Value {
  std::string name;
  std::string type;
};

// Writes ops in MLIR's generic form, which every StableHLO parser reads whatever its version's
// pretty syntax, and hands out fresh SSA names (unique across nested regions too).
class Emitter {
 public:
  std::string text;

  Value op(std::string_view name, const std::vector<Value>& operands, std::string_view attrs, const std::string& type) {
    Value result{fmt::format("%v{}", next_++), type};
    emit(result.name, name, operands, attrs, {type});
    return result;
  }
  // An op with several results: returns their names as NAME#i.
  std::vector<Value> op_n(std::string_view name, const std::vector<Value>& operands, std::string_view attrs,
                          const std::vector<std::string>& types, std::string_view regions) {
    const std::string base = fmt::format("%v{}", next_++);
    line(fmt::format("{}:{} = \"{}\"({}) ({}) {} : ({}) -> ({})", base, types.size(), name, names(operands), regions,
                     attrs.empty() ? "" : fmt::format("{{{}}}", attrs), types_of(operands), fmt::join(types, ", ")));
    std::vector<Value> out;
    for (std::size_t i = 0; i < types.size(); ++i) out.push_back({fmt::format("{}#{}", base, i), types[i]});
    return out;
  }
  void ret(const std::vector<Value>& values) {
    line(fmt::format("\"stablehlo.return\"({}) : ({}) -> ()", names(values), types_of(values)));
  }
  Value fresh_arg(const std::string& type) { return {fmt::format("%a{}", next_++), type}; }
  void line(const std::string& s) {
    text.append(static_cast<std::size_t>(indent_) * 2, ' ');
    text += s;
    text += '\n';
  }
  void push() { ++indent_; }
  void pop() { --indent_; }

  static std::string names(const std::vector<Value>& values) {
    std::string out;
    for (const Value& v : values) out += (out.empty() ? "" : ", ") + v.name;
    return out;
  }
  static std::string types_of(const std::vector<Value>& values) {
    std::string out;
    for (const Value& v : values) out += (out.empty() ? "" : ", ") + v.type;
    return out;
  }

 private:
  void emit(const std::string& result, std::string_view name, const std::vector<Value>& operands,
            std::string_view attrs, const std::vector<std::string>& types) {
    line(fmt::format("{} = \"{}\"({}){} : ({}) -> {}", result, name, names(operands),
                     attrs.empty() ? "" : fmt::format(" {{{}}}", attrs), types_of(operands), types.front()));
  }
  int next_ = 0;
  int indent_ = 0;
};

// The ops of the attention program over one Emitter, each returning its result.
class Builder {
 public:
  explicit Builder(Emitter& e) : e_(e) {}

  Value constant(std::string_view literal, const Dims& dims, std::string_view elem) {
    const std::string type = tensor(dims, elem);
    return e_.op("stablehlo.constant", {}, fmt::format("value = dense<{}> : {}", literal, type), type);
  }
  Value unary(std::string_view name, const Value& a) {
    return e_.op(fmt::format("stablehlo.{}", name), {a}, "", a.type);
  }
  Value binary(std::string_view name, const Value& a, const Value& b) {
    return e_.op(fmt::format("stablehlo.{}", name), {a, b}, "", a.type);
  }
  Value convert(const Value& a, const Dims& dims, std::string_view elem) {
    if (a.type == tensor(dims, elem)) return a;
    return e_.op("stablehlo.convert", {a}, "", tensor(dims, elem));
  }
  Value reshape(const Value& a, const Dims& dims, std::string_view elem) {
    return e_.op("stablehlo.reshape", {a}, "", tensor(dims, elem));
  }
  Value transpose(const Value& a, const Dims& perm, const Dims& dims, std::string_view elem) {
    return e_.op("stablehlo.transpose", {a}, fmt::format("permutation = {}", i64_array(perm)), tensor(dims, elem));
  }
  Value broadcast(const Value& a, const Dims& map, const Dims& dims, std::string_view elem) {
    return e_.op("stablehlo.broadcast_in_dim", {a}, fmt::format("broadcast_dimensions = {}", i64_array(map)),
                 tensor(dims, elem));
  }
  Value iota(std::int64_t dim, const Dims& dims) {
    return e_.op("stablehlo.iota", {}, fmt::format("iota_dimension = {} : i64", dim), tensor(dims, "i32"));
  }
  // direction: EQ, NE, LT, LE, GT, GE; kind: SIGNED for i32, FLOAT for f32.
  Value compare(std::string_view direction, const Value& a, const Value& b, const Dims& dims, std::string_view kind) {
    return e_.op("stablehlo.compare", {a, b},
                 fmt::format("comparison_direction = #stablehlo<comparison_direction {}>, compare_type = "
                             "#stablehlo<comparison_type {}>",
                             direction, kind),
                 tensor(dims, "i1"));
  }
  Value select(const Value& pred, const Value& a, const Value& b) {
    return e_.op("stablehlo.select", {pred, a, b}, "", a.type);
  }
  Value dot(const Value& a, const Value& b, const Dims& lhs_batch, const Dims& rhs_batch, const Dims& lhs_contract,
            const Dims& rhs_contract, const Dims& dims) {
    return e_.op("stablehlo.dot_general", {a, b},
                 fmt::format("dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = [{}], "
                             "rhs_batching_dimensions = [{}], lhs_contracting_dimensions = [{}], "
                             "rhs_contracting_dimensions = [{}]>",
                             fmt::join(lhs_batch, ", "), fmt::join(rhs_batch, ", "), fmt::join(lhs_contract, ", "),
                             fmt::join(rhs_contract, ", ")),
                 tensor(dims, "f32"));
  }
  // Reduces `a` over `dims_to_reduce` with the binary op `combiner` (maximum, add, or) from `init`.
  Value reduce(const Value& a, const Value& init, std::string_view combiner, const Dims& dims_to_reduce,
               const Dims& dims, std::string_view elem) {
    const std::string scalar = tensor({}, elem);
    const Value x = e_.fresh_arg(scalar), y = e_.fresh_arg(scalar);
    const std::string type = tensor(dims, elem);
    std::string body = fmt::format("{{\n^bb0({}: {}, {}: {}):\n", x.name, scalar, y.name, scalar);
    const std::string r = fmt::format("%r{}", x.name.substr(2));
    body += fmt::format("  {} = \"stablehlo.{}\"({}, {}) : ({}, {}) -> {}\n", r, combiner, x.name, y.name, scalar,
                        scalar, scalar);
    body += fmt::format("  \"stablehlo.return\"({}) : ({}) -> ()\n}}", r, scalar);
    return e_
        .op_n("stablehlo.reduce", {a, init}, fmt::format("dimensions = {}", i64_array(dims_to_reduce)), {type}, body)
        .front();
  }
  Value dynamic_slice(const Value& a, const std::vector<Value>& starts, const Dims& sizes, std::string_view elem) {
    std::vector<Value> operands{a};
    operands.insert(operands.end(), starts.begin(), starts.end());
    return e_.op("stablehlo.dynamic_slice", operands, fmt::format("slice_sizes = {}", i64_array(sizes)),
                 tensor(sizes, elem));
  }
  // Rows of `a` (first dimension) picked by `indices` [n, 1].
  Value gather_rows(const Value& a, const Value& indices, std::int64_t n, const Dims& a_dims, std::string_view elem) {
    Dims slice = a_dims;
    slice[0] = 1;
    Dims out = a_dims;
    out[0] = n;
    Dims offset_dims;
    for (std::size_t d = 1; d < a_dims.size(); ++d) offset_dims.push_back(static_cast<std::int64_t>(d));
    return e_.op("stablehlo.gather", {a, indices},
                 fmt::format("dimension_numbers = #stablehlo.gather<offset_dims = [{}], collapsed_slice_dims = [0], "
                             "start_index_map = [0], index_vector_dim = 1>, slice_sizes = {}, "
                             "indices_are_sorted = false",
                             fmt::join(offset_dims, ", "), i64_array(slice)),
                 tensor(out, elem));
  }

 private:
  Emitter& e_;
};

constexpr std::string_view kNegInf = "0xFF800000";  // f32 -inf
constexpr std::int64_t kMaxExtent = std::int64_t{1} << 30;

}  // namespace

std::string ProgramSpec::key() const {
  return fmt::format("{}{}>{} b{} s{} h{}/{} d{}/{} n{}{} c{}{}{}{}{}{}", element(in_dtype),
                     kv_dtype == in_dtype ? std::string() : fmt::format("/kv:{}", element(kv_dtype)),
                     element(out_dtype), batch, seq_q, hq, hkv, head_dim, head_dim_v, seq_k,
                     paged ? fmt::format(" paged{}x{}", num_blocks, page_size) : "", chunk, causal ? " causal" : "",
                     window ? " window" : "", softcap ? " softcap" : "", alibi ? " alibi" : "", lse ? " lse" : "");
}

Status check_spec(const ProgramSpec& s) {
  const struct {
    const char* name;
    std::int64_t value;
  } extents[] = {{"batch", s.batch},       {"seq_q", s.seq_q},           {"hq", s.hq},       {"hkv", s.hkv},
                 {"head_dim", s.head_dim}, {"head_dim_v", s.head_dim_v}, {"seq_k", s.seq_k}, {"chunk", s.chunk}};
  for (const auto& e : extents) {
    if (e.value < 1 || e.value > kMaxExtent) {
      return Status::invalid(e.name, fmt::format("{} is out of [1, 2^30]", e.value));
    }
  }
  if (s.hq % s.hkv != 0) return Status::invalid("hq", fmt::format("{} is not a multiple of hkv {}", s.hq, s.hkv));
  if (s.seq_k % s.chunk != 0) {
    return Status::invalid("chunk", fmt::format("{} does not divide seq_k {}", s.chunk, s.seq_k));
  }
  if (s.paged) {
    if (s.page_size < 1 || s.num_blocks < 1 || s.page_size > kMaxExtent || s.num_blocks > kMaxExtent) {
      return Status::invalid("page_size", fmt::format("paged KV needs page_size ({}) and num_blocks ({}) >= 1",
                                                      s.page_size, s.num_blocks));
    }
    if (s.chunk % s.page_size != 0 || s.seq_k % s.page_size != 0) {
      return Status::invalid("chunk", fmt::format("chunk {} and seq_k {} must be multiples of the page size {}",
                                                  s.chunk, s.seq_k, s.page_size));
    }
  }
  return {};
}

std::string attention_program(const ProgramSpec& s) {
  const std::int64_t B = s.batch, S = s.seq_q, H = s.hq, K = s.hkv, G = s.hq / s.hkv, D = s.head_dim, E = s.head_dim_v,
                     N = s.seq_k, C = s.chunk, M = G * S;
  const std::string_view T = element(s.in_dtype), KT = element(s.kv_dtype), O = element(s.out_dtype);
  const std::int64_t P = s.page_size, NB = s.num_blocks, MB = s.max_blocks(), CB = s.paged ? C / P : 0;

  Emitter e;
  Builder b(e);

  // Arguments.
  std::vector<Value> args;
  auto arg = [&](const std::string& type) {
    args.push_back({fmt::format("%arg{}", args.size()), type});
    return args.back();
  };
  const Value q = arg(tensor({B, S, H, D}, T));
  const Value k = arg(s.paged ? tensor({NB, P, K, D}, KT) : tensor({B, N, K, D}, KT));
  const Value v = arg(s.paged ? tensor({NB, P, K, E}, KT) : tensor({B, N, K, E}, KT));
  const Value seqlen_q = arg(tensor({B}, "i32"));
  const Value seqlen_k = arg(tensor({B}, "i32"));
  const Value scale = arg(tensor({}, "f32"));
  const Value softcap = arg(tensor({}, "f32"));
  const Value window_left = arg(tensor({}, "i32"));
  const Value window_right = arg(tensor({}, "i32"));
  Value table, slopes;
  if (s.paged) table = arg(tensor({B, MB}, "i32"));
  if (s.alibi) slopes = arg(tensor({H}, "f32"));

  std::vector<std::string> result_types{tensor({B, S, H, E}, O)};
  if (s.lse) result_types.push_back(tensor({B, H, S}, "f32"));

  std::string signature;
  for (const Value& a : args) signature += (signature.empty() ? "" : ", ") + a.name + ": " + a.type;
  e.line("module @kallpa_attention {");
  e.push();
  e.line(fmt::format("func.func public @main({}) -> ({}) {{", signature, fmt::join(result_types, ", ")));
  e.push();

  // Query heads grouped under their KV head: [B, Hkv, G*S, D] in f32 (query head h = kv * G + g).
  const Value q32 = b.convert(q, {B, S, H, D}, "f32");
  const Value q5 = b.reshape(q32, {B, S, K, G, D}, "f32");
  const Value qt = b.transpose(q5, {0, 2, 3, 1, 4}, {B, K, G, S, D}, "f32");
  const Value qm = b.reshape(qt, {B, K, M, D}, "f32");

  const Dims row{B, K, G, S};
  const Dims score{B, K, G, S, C};
  const Value zero_i = b.constant("0", {}, "i32");
  const Value m0 = b.constant(kNegInf, row, "f32");
  const Value l0 = b.constant("0.0", row, "f32");
  const Value acc0 = b.constant("0.0", {B, K, G, S, E}, "f32");

  // The loop carries its counter, the running (max, sum, accumulator) and, unchanged, every input
  // the body reads: the body names nothing from outside its region.
  std::vector<Value> carried{zero_i,   m0,       l0,    acc0,    qm,          k,           v,
                             seqlen_q, seqlen_k, scale, softcap, window_left, window_right};
  if (s.paged) carried.push_back(table);
  if (s.alibi) carried.push_back(slopes);
  std::vector<std::string> carried_types;
  for (const Value& c : carried) carried_types.push_back(c.type);

  // Region arguments: the same types, fresh names.
  auto region_args = [&](std::vector<Value>& out) {
    std::string header;
    out.clear();
    for (const std::string& t : carried_types) {
      out.push_back(e.fresh_arg(t));
      header += (header.empty() ? "" : ", ") + out.back().name + ": " + t;
    }
    return header;
  };

  // The regions share the function's name counter: each is written with `e` itself, then cut out
  // of its text and handed to the while op.
  const std::size_t mark = e.text.size();
  std::vector<Value> ca;
  const std::string cond_header = region_args(ca);
  e.line(fmt::format("^bb0({}):", cond_header));
  e.push();
  const Value steps = b.constant(fmt::format("{}", N / C), {}, "i32");
  const Value more = b.compare("LT", ca[0], steps, {}, "SIGNED");
  e.ret({more});
  e.pop();
  const std::string cond_text = e.text.substr(mark);
  e.text.resize(mark);

  std::vector<Value> ba;
  const std::string body_header = region_args(ba);
  e.line(fmt::format("^bb0({}):", body_header));
  e.push();
  {
    const Value &i = ba[0], &m = ba[1], &l = ba[2], &acc = ba[3], &bq = ba[4], &bk = ba[5], &bv = ba[6], &bsq = ba[7],
                &bskv = ba[8], &bscale = ba[9], &bcap = ba[10], &bwl = ba[11], &bwr = ba[12];
    const Value c_chunk = b.constant(fmt::format("{}", C), {}, "i32");
    const Value start = b.binary("multiply", i, c_chunk);
    const Value z = b.constant("0", {}, "i32");

    // This step's keys and values: [B, C, Hkv, D|Dv].
    Value kc, vc;
    if (s.paged) {
      const Value& btable = ba[13];
      const Value c_blocks = b.constant(fmt::format("{}", CB), {}, "i32");
      const Value bstart = b.binary("multiply", i, c_blocks);
      const Value rows = b.dynamic_slice(btable, {z, bstart}, {B, CB}, "i32");
      const Value idx = b.reshape(rows, {B * CB, 1}, "i32");
      const Value kg = b.gather_rows(bk, idx, B * CB, {NB, P, K, D}, KT);
      const Value vg = b.gather_rows(bv, idx, B * CB, {NB, P, K, E}, KT);
      kc = b.reshape(kg, {B, C, K, D}, KT);
      vc = b.reshape(vg, {B, C, K, E}, KT);
    } else {
      kc = b.dynamic_slice(bk, {z, start, z, z}, {B, C, K, D}, KT);
      vc = b.dynamic_slice(bv, {z, start, z, z}, {B, C, K, E}, KT);
    }
    const Value kc32 = b.convert(kc, {B, C, K, D}, "f32");
    const Value vc32 = b.convert(vc, {B, C, K, E}, "f32");

    // Scores [B, Hkv, G, S, C] = scale * q k^T, then softcap.
    const Value sm = b.dot(bq, kc32, {0, 1}, {0, 2}, {3}, {3}, {B, K, M, C});
    Value sc = b.reshape(sm, score, "f32");
    sc = b.binary("multiply", sc, b.broadcast(bscale, {}, score, "f32"));
    if (s.softcap) {
      const Value cap = b.broadcast(bcap, {}, score, "f32");
      sc = b.binary("multiply", cap, b.unary("tanh", b.binary("divide", sc, cap)));
    }

    // Positions over [B, S, C]: query i of a sequence sits at key position p = i + Skv - Sq.
    const Dims pos{B, S, C};
    const Value qi = b.iota(1, pos);
    const Value kj = b.binary("add", b.iota(2, pos), b.broadcast(start, {}, pos, "i32"));
    const Value sqb = b.broadcast(bsq, {0}, pos, "i32");
    const Value skvb = b.broadcast(bskv, {0}, pos, "i32");
    const Value p = b.binary("subtract", b.binary("add", qi, skvb), sqb);
    Value visible = b.binary("and", b.compare("LT", qi, sqb, pos, "SIGNED"), b.compare("LT", kj, skvb, pos, "SIGNED"));
    if (s.causal) visible = b.binary("and", visible, b.compare("LE", kj, p, pos, "SIGNED"));
    if (s.window) {
      const Value lo = b.binary("subtract", p, b.broadcast(bwl, {}, pos, "i32"));
      const Value hi = b.binary("add", p, b.broadcast(bwr, {}, pos, "i32"));
      visible = b.binary("and", visible, b.compare("GE", kj, lo, pos, "SIGNED"));
      visible = b.binary("and", visible, b.compare("LE", kj, hi, pos, "SIGNED"));
    }
    if (s.alibi) {
      const Value& bslopes = ba[s.paged ? 14 : 13];
      const Value dist = b.convert(b.unary("abs", b.binary("subtract", p, kj)), pos, "f32");
      const Value slope = b.broadcast(b.reshape(bslopes, {K, G}, "f32"), {1, 2}, score, "f32");
      sc = b.binary("subtract", sc, b.binary("multiply", slope, b.broadcast(dist, {0, 3, 4}, score, "f32")));
    }

    // Online softmax step: masked scores are -inf; a row that has seen no finite score keeps
    // max -inf and is shifted by 0 instead, so that exp never sees -inf - -inf.
    const Value neg_inf = b.constant(kNegInf, score, "f32");
    const Value masked = b.select(b.broadcast(visible, {0, 3, 4}, score, "i1"), sc, neg_inf);
    const Value chunk_max = b.reduce(masked, b.constant(kNegInf, {}, "f32"), "maximum", {4}, row, "f32");
    const Value m_new = b.binary("maximum", m, chunk_max);
    const Value unseen = b.compare("EQ", m_new, b.constant(kNegInf, row, "f32"), row, "FLOAT");
    const Value shift = b.select(unseen, b.constant("0.0", row, "f32"), m_new);
    const Value pexp =
        b.unary("exponential", b.binary("subtract", masked, b.broadcast(shift, {0, 1, 2, 3}, score, "f32")));
    const Value alpha = b.unary("exponential", b.binary("subtract", m, shift));
    const Value l_new = b.binary("add", b.binary("multiply", alpha, l),
                                 b.reduce(pexp, b.constant("0.0", {}, "f32"), "add", {4}, row, "f32"));

    // Values no query row of the sequence can see are selected out before the product: a zero
    // weight times a NaN stored there would still be NaN.
    const Value seen = b.reduce(visible, b.constant("false", {}, "i1"), "or", {1}, {B, C}, "i1");
    const Value v_seen =
        b.select(b.broadcast(seen, {0, 1}, {B, C, K, E}, "i1"), vc32, b.constant("0.0", {B, C, K, E}, "f32"));
    const Value pm = b.reshape(pexp, {B, K, M, C}, "f32");
    const Value pv = b.reshape(b.dot(pm, v_seen, {0, 1}, {0, 2}, {3}, {1}, {B, K, M, E}), {B, K, G, S, E}, "f32");
    const Value acc_new =
        b.binary("add", b.binary("multiply", b.broadcast(alpha, {0, 1, 2, 3}, {B, K, G, S, E}, "f32"), acc), pv);
    const Value next = b.binary("add", i, b.constant("1", {}, "i32"));

    std::vector<Value> out{next, m_new, l_new, acc_new};
    out.insert(out.end(), ba.begin() + 4, ba.end());
    e.ret(out);
  }
  e.pop();
  const std::string body_text = e.text.substr(mark);
  e.text.resize(mark);

  std::string regions = "{\n" + cond_text + "}, {\n" + body_text + "}";
  const std::vector<Value> loop = e.op_n("stablehlo.while", carried, "", carried_types, regions);
  const Value &m = loop[1], &l = loop[2], &acc = loop[3];

  // Rows that saw no key: o = 0 and lse = -inf. Such a row has max -inf and a sum of exactly 0; a
  // row with a NaN score has a NaN sum (some compilers' max skips NaN, so the max alone cannot tell).
  const Value unseen = b.binary("and", b.compare("EQ", m, b.constant(kNegInf, row, "f32"), row, "FLOAT"),
                                b.compare("EQ", l, b.constant("0.0", row, "f32"), row, "FLOAT"));
  const Value l_safe = b.select(unseen, b.constant("1.0", row, "f32"), l);
  const Dims acc_dims{B, K, G, S, E};
  const Value o5 = b.select(b.broadcast(unseen, {0, 1, 2, 3}, acc_dims, "i1"), b.constant("0.0", acc_dims, "f32"),
                            b.binary("divide", acc, b.broadcast(l_safe, {0, 1, 2, 3}, acc_dims, "f32")));
  const Value ot = b.transpose(o5, {0, 3, 1, 2, 4}, {B, S, K, G, E}, "f32");
  const Value o32 = b.reshape(ot, {B, S, H, E}, "f32");
  const Value o = s.out_dtype == DType::f32 ? o32 : b.convert(o32, {B, S, H, E}, O);
  std::vector<Value> results{o};
  if (s.lse) {
    const Value lse_rows =
        b.select(unseen, b.constant(kNegInf, row, "f32"), b.binary("add", m, b.unary("log", l_safe)));
    results.push_back(b.reshape(lse_rows, {B, H, S}, "f32"));
  }
  e.line(fmt::format("\"func.return\"({}) : ({}) -> ()", Emitter::names(results), Emitter::types_of(results)));
  e.pop();
  e.line("}");
  e.pop();
  e.line("}");
  return e.text;
}

std::string PageUpdateSpec::key() const {
  return fmt::format("page-update {} blocks{}x{} h{} d{}/{} n{}", element(kv_dtype), num_blocks, page_size, hkv,
                     head_dim, head_dim_v, pages);
}

std::string PageUpdateSpec::zeros_key() const {
  return fmt::format("pool-zeros {} blocks{}x{} h{} d{}/{}", element(kv_dtype), num_blocks, page_size, hkv, head_dim,
                     head_dim_v);
}

Status check_spec(const PageUpdateSpec& s) {
  const struct {
    const char* name;
    std::int64_t value;
  } extents[] = {{"num_blocks", s.num_blocks}, {"page_size", s.page_size},   {"hkv", s.hkv},
                 {"head_dim", s.head_dim},     {"head_dim_v", s.head_dim_v}, {"pages", s.pages}};
  for (const auto& e : extents) {
    if (e.value < 1 || e.value > kMaxExtent) {
      return Status::invalid(e.name, fmt::format("{} is out of [1, 2^30]", e.value));
    }
  }
  return {};
}

std::string page_update_program(const PageUpdateSpec& s) {
  const std::int64_t NB = s.num_blocks, P = s.page_size, K = s.hkv, D = s.head_dim, E = s.head_dim_v, n = s.pages;
  const std::string_view T = element(s.kv_dtype);
  const std::string k_pool = tensor({NB, P, K, D}, T), v_pool = tensor({NB, P, K, E}, T);
  const Value kp{"%arg0", k_pool}, vp{"%arg1", v_pool}, kn{"%arg2", tensor({n, P, K, D}, T)},
      vn{"%arg3", tensor({n, P, K, E}, T)}, index{"%arg4", tensor({n, 1}, "i32")};

  Emitter e;
  e.line("module @kallpa_page_update {");
  e.push();
  // tf.aliasing_output donates each pool to its result: where the plugin honours it, the scatter
  // writes the mirror in place; where it does not, the update costs one device-side copy.
  e.line(fmt::format(
      "func.func public @main({}: {} {{tf.aliasing_output = 0 : i32}}, {}: {} {{tf.aliasing_output = 1 "
      ": i32}}, {}: {}, {}: {}, {}: {}) -> ({}, {}) {{",
      kp.name, kp.type, vp.name, vp.type, kn.name, kn.type, vn.name, vn.type, index.name, index.type, k_pool, v_pool));
  e.push();
  const auto scatter = [&](const Value& pool, const Value& pages) {
    const std::string scalar = tensor({}, T);
    const Value x = e.fresh_arg(scalar), y = e.fresh_arg(scalar);
    // The update replaces what the pool held.
    const std::string body = fmt::format("{{\n^bb0({}: {}, {}: {}):\n  \"stablehlo.return\"({}) : ({}) -> ()\n}}",
                                         x.name, scalar, y.name, scalar, y.name, scalar);
    return e
        .op_n("stablehlo.scatter", {pool, index, pages},
              "scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [1, 2, 3], inserted_window_dims = "
              "[0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, indices_are_sorted = false, "
              "unique_indices = false",
              {pool.type}, body)
        .front();
  };
  const Value k_out = scatter(kp, kn);
  const Value v_out = scatter(vp, vn);
  e.line(fmt::format("\"func.return\"({}) : ({}) -> ()", Emitter::names({k_out, v_out}),
                     Emitter::types_of({k_out, v_out})));
  e.pop();
  e.line("}");
  e.pop();
  e.line("}");
  return e.text;
}

std::string pool_zeros_program(const PageUpdateSpec& s) {
  const std::string_view T = element(s.kv_dtype);
  const Dims k_dims{s.num_blocks, s.page_size, s.hkv, s.head_dim},
      v_dims{s.num_blocks, s.page_size, s.hkv, s.head_dim_v};
  Emitter e;
  Builder b(e);
  e.line("module @kallpa_pool_zeros {");
  e.push();
  e.line(fmt::format("func.func public @main() -> ({}, {}) {{", tensor(k_dims, T), tensor(v_dims, T)));
  e.push();
  const Value zero = b.constant("0.0", {}, T);
  const Value k = b.broadcast(zero, {}, k_dims, T);
  const Value v = b.broadcast(zero, {}, v_dims, T);
  e.line(fmt::format("\"func.return\"({}) : ({}) -> ()", Emitter::names({k, v}), Emitter::types_of({k, v})));
  e.pop();
  e.line("}");
  e.pop();
  e.line("}");
  return e.text;
}

}  // namespace kallpa::pjrt
