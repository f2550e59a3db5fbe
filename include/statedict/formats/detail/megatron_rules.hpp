// statedict: Megatron-LM checkpoints, the shared pieces (formats/megatron.hpp is the public header):
// error ids, caps, the tensor-parallel partition rules as data (name pattern -> split), the legacy
// key spellings normalised to today's, and the model facts read from the pickled `args`.
// SPDX-License-Identifier: MIT
//
// Sources (tests/python/layouts/megatron.md has each fact with its place in Megatron-LM):
//   partition rules   tools/checkpoint/loader_megatron.py and saver_megatron.py (core_v0.8.0)
//   old spellings     megatron/legacy/model/language_model.py load_state_dict (transformer ->
//                     encoder, .attention. -> .self_attention.), transformer.py
//                     ParallelTransformer.load_state_dict (layernorm -> norm)
//   args              megatron/training/checkpointing.py load_args_from_checkpoint,
//                     check_checkpoint_args (model_parallel_size before checkpoint_version 3.0)
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../../core/dtype.hpp"
#include "../../core/error.hpp"
#include "../../core/value.hpp"
#include "../../io/torch_file.hpp"
#include "dcp_metadata.hpp"
#include "pyobj.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id mg_not_found        {950, error_kind::format,      "megatron.not_found"};
inline constexpr error_id mg_bad_tracker      {951, error_kind::format,      "megatron.bad_tracker"};
inline constexpr error_id mg_rank_dirs        {952, error_kind::format,      "megatron.rank_dirs"};
inline constexpr error_id mg_bad_args         {953, error_kind::format,      "megatron.bad_args"};
inline constexpr error_id mg_bad_rank_file    {954, error_kind::format,      "megatron.bad_rank_file"};
inline constexpr error_id mg_unsupported      {955, error_kind::unsupported, "megatron.unsupported"};
inline constexpr error_id mg_shape            {956, error_kind::shape,       "megatron.shape"};
inline constexpr error_id mg_unknown_differs  {957, error_kind::format,      "megatron.unknown_param_differs"};
inline constexpr error_id mg_duplicate        {958, error_kind::key,         "megatron.duplicate"};
inline constexpr error_id mg_missing          {959, error_kind::key,         "megatron.missing"};
inline constexpr error_id mg_qkv_order        {960, error_kind::unsupported, "megatron.qkv_order"};
inline constexpr error_id mg_vocab            {961, error_kind::usage,       "megatron.vocab_size"};
inline constexpr error_id mg_limit            {962, error_kind::limit,       "megatron.limit"};
inline constexpr error_id mg_bad_rule         {963, error_kind::usage,       "megatron.bad_rule"};
inline constexpr error_id mg_optimizer        {964, error_kind::format,      "megatron.optimizer"};
inline constexpr error_id mg_distrib_optim    {965, error_kind::format,      "megatron.distrib_optim"};
inline constexpr error_id mg_groups_differ    {966, error_kind::format,      "megatron.param_groups_differ"};
inline constexpr error_id mg_state_differs    {967, error_kind::format,      "megatron.state_differs"};
inline constexpr error_id mg_torch_dist       {968, error_kind::format,      "megatron.torch_dist"};
inline constexpr error_id mg_write_option     {970, error_kind::usage,       "megatron.write_option"};
inline constexpr error_id mg_write_input      {971, error_kind::usage,       "megatron.write_input"};
inline constexpr error_id mg_write_split      {972, error_kind::usage,       "megatron.write_split"};
// clang-format on
}  // namespace errors

namespace megatron {

/// Caps on hostile input; each error names the field to raise.
struct limits {
  /// Model-parallel rank folders (TP x PP) and the TP, PP and virtual-PP sizes args may claim.
  std::uint64_t max_ranks = std::uint64_t{1} << 16;
  /// Layers args may claim (num_layers), and model chunks of one rank file.
  std::uint64_t max_layers = std::uint64_t{1} << 20;
  /// Attention heads and query groups args may claim.
  std::uint64_t max_heads = std::uint64_t{1} << 20;
  /// Tensors over all rank files (parameters and optimizer state).
  std::uint64_t max_tensors = std::uint64_t{1} << 24;
  /// Chunks of the description (QKV rows converted from checkpoint_version 0 / 1.0 take one chunk
  /// per head and per Q/K/V row block on each rank).
  std::uint64_t max_chunks = std::uint64_t{1} << 26;
  /// Bytes of latest_checkpointed_iteration.txt and of metadata.json.
  std::uint64_t max_small_file_bytes = std::uint64_t{1} << 20;
  /// Bytes of a parameter whose TP rule is unknown compared across TP ranks while describing.
  std::uint64_t max_compare_bytes = std::uint64_t{1} << 34;
  /// The torch.save reader (rank files, distrib_optim.pt, common.pt).
  torch::limits torch{};
  /// The DCP reader (torch_dist).
  dcp::limits dcp{};
};

// =============================================================================================
// Partition rules as data

/// How a parameter is split over the tensor-parallel ranks (TP rank r of tp).
enum class split : std::uint8_t {
  replicated,  ///< every rank holds all of it: TP rank 0's is read, the others are replicas
  column,      ///< rank r holds rows [r*n, (r+1)*n) (dim 0): column-parallel weights, their biases
  row,         ///< rank r holds columns [r*n, (r+1)*n) (dim 1): row-parallel weights
  vocab,       ///< like column, over the padded vocabulary (embeddings, output layer)
  qkv,         ///< like column, whole query groups per rank; checkpoint_version 0 / 1.0 row orders converted
  fc1,         ///< glu when args.swiglu, else column (dense_h_to_4h / linear_fc1)
  glu,         ///< rank r holds [W_r; V_r]: the full tensor is [W_0..W_{tp-1}; V_0..V_{tp-1}]
};

inline constexpr std::string_view split_names[] = {"replicated", "column", "row", "vocab", "qkv", "fc1", "glu"};

constexpr std::string_view to_string(split s) noexcept { return split_names[static_cast<std::size_t>(s)]; }

inline std::optional<split> parse_split(std::string_view s) {
  for (std::size_t i = 0; i < std::size(split_names); ++i)
    if (split_names[i] == s) return static_cast<split>(i);
  return std::nullopt;
}

/// A rule: parameters whose canonical name matches `pattern` (`*` matches any run of characters,
/// dots included; everything else matches itself) are split by `how`.
struct rule {
  std::string pattern;
  split how = split::replicated;
  friend bool operator==(const rule&, const rule&) = default;
};

/// The rules of Megatron's tools/checkpoint loader and saver for the legacy GPT model, over the
/// canonical names (today's spelling, global layer numbers). The first matching rule wins.
inline std::vector<rule> default_rules() {
  return {
      {"*word_embeddings.weight", split::vocab},
      {"*output_layer.weight", split::vocab},
      {"*position_embeddings.weight", split::replicated},
      {"*.query_key_value.weight", split::qkv},
      {"*.query_key_value.bias", split::qkv},
      {"*.self_attention.dense.weight", split::row},
      {"*.self_attention.dense.bias", split::replicated},
      {"*.mlp.dense_h_to_4h.weight", split::fc1},
      {"*.mlp.dense_h_to_4h.bias", split::fc1},
      {"*.mlp.dense_4h_to_h.weight", split::row},
      {"*.mlp.dense_4h_to_h.bias", split::replicated},
      {"*norm.weight", split::replicated},
      {"*norm.bias", split::replicated},
  };
}

/// Glob match: `*` is any run of characters (dots included). Linear in name length per star
/// (the classic greedy matcher with one backtrack point), so hostile names cost nothing.
inline bool matches(std::string_view pattern, std::string_view name) {
  std::size_t p = 0, n = 0, star = std::string_view::npos, mark = 0;
  while (n < name.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = n;
    } else if (p < pattern.size() && pattern[p] == name[n]) {
      ++p;
      ++n;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      n = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

/// "PATTERN=KIND" (the CLI's --megatron-rule) as a rule; throws errors::mg_bad_rule.
inline rule parse_rule(std::string_view text) {
  const auto eq = text.rfind('=');
  if (eq == std::string_view::npos || eq == 0)
    throw_error(errors::mg_bad_rule, "rule " + quote(text), "expected PATTERN=KIND, e.g. '*.my_proj.weight=row'");
  const auto how = parse_split(text.substr(eq + 1));
  if (!how) {
    std::string kinds;
    for (auto k : split_names) kinds += (kinds.empty() ? "" : ", ") + std::string(k);
    throw_error(errors::mg_bad_rule, "rule " + quote(text), "unknown kind " + quote(text.substr(eq + 1)) + " (one of: " + kinds + ")");
  }
  return rule{std::string(text.substr(0, eq)), *how};
}

/// The rule for `name`: the first of `first` that matches, then the first default rule (unless
/// `defaults` is false); nullopt when none does.
inline std::optional<split> rule_for(std::string_view name, const std::vector<rule>& first, bool defaults) {
  for (const rule& r : first)
    if (matches(r.pattern, name)) return r.how;
  if (defaults) {
    static const std::vector<rule> builtin = default_rules();
    for (const rule& r : builtin)
      if (matches(r.pattern, name)) return r.how;
  }
  return std::nullopt;
}

namespace detail {

/// A checkpoint_version as Megatron writes it ("0", "1.0", "3.0"; others with up to 6 digits).
inline std::string version_text(double v) {
  char b[32];
  std::snprintf(b, sizeof b, v == static_cast<double>(static_cast<std::int64_t>(v)) && v < 1e15 && v > -1e15 ? "%.1f" : "%.6g", v);
  return v == 0 ? std::string("0") : std::string(b);
}

// =============================================================================================
// Names

inline void replace_all(std::string& s, std::string_view from, std::string_view to) {
  for (std::size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
}

/// A key below `language_model` (dotted through nested dicts) in today's spelling, or nullopt for
/// a key the GPT model does not have. `transformer` is the encoder's old name; embedding keys once
/// sat without the `embedding` level; encoder keys once said `.attention.` and `layernorm`
/// (TE's fused `layernorm_qkv` / `layernorm_mlp` keep it).
inline std::string normalise_lm_key(std::string key) {
  if (key.rfind("transformer.", 0) == 0) key = "encoder." + key.substr(12);
  const std::string first = key.substr(0, key.find('.'));
  if (first != "embedding" && first.find("_embeddings") != std::string::npos) key = "embedding." + key;
  if (key.rfind("encoder.", 0) == 0) {
    std::string rest = "." + key.substr(8);
    replace_all(rest, ".attention.", ".self_attention.");
    if (rest.find("layernorm_qkv") == std::string::npos && rest.find("layernorm_mlp") == std::string::npos)
      replace_all(rest, "layernorm", "norm");
    key = "encoder" + rest;
  }
  return key;
}

/// `layers.<N>.<rest>` -> (N, rest); nullopt when the key is not a layer key.
inline std::optional<std::pair<std::uint64_t, std::string>> layer_of(std::string_view key, std::string_view prefix) {
  if (key.substr(0, prefix.size()) != prefix) return std::nullopt;
  const std::string_view tail = key.substr(prefix.size());
  const auto dot = tail.find('.');
  if (dot == std::string_view::npos || dot == 0 || dot > 9) return std::nullopt;
  std::uint64_t n = 0;
  for (std::size_t i = 0; i < dot; ++i) {
    if (tail[i] < '0' || tail[i] > '9') return std::nullopt;
    n = n * 10 + static_cast<std::uint64_t>(tail[i] - '0');
  }
  if (dot > 1 && tail[0] == '0') return std::nullopt;
  return std::make_pair(n, std::string(tail.substr(dot + 1)));
}

// =============================================================================================
// Facts from args

/// The model and parallel sizes a checkpoint's `args` (argparse.Namespace) records.
struct facts {
  std::uint64_t tp = 1, pp = 1, vpp = 1;
  bool virtual_pp = false;  ///< args.virtual_pipeline_model_parallel_size is set
  std::uint64_t num_layers = 0, hidden = 0, heads = 0, groups = 0, kv_channels = 0;
  bool swiglu = false, untied = false;
  double checkpoint_version = 0;
  std::optional<std::uint64_t> padded_vocab_size;
  std::optional<statedict::dtype> params_dtype;
  bool distributed_optimizer = false;
  std::uint64_t dp = 1;
  std::optional<std::uint64_t> bucket_size;  ///< the DDP bucket size of distrib_optim.pt's buffers
};

namespace po = statedict::detail::pyobj;

/// Reads `args`: an argparse.Namespace (NEWOBJ + BUILD of its __dict__), or the dict of its
/// attributes (how a Namespace is written as data: formats/objects.hpp). `where` names the file.
class args_reader {
 public:
  args_reader(const Value& args, std::string where) : where_(std::move(where)) {
    if (args.is_dict()) {
      attrs_ = args.as_dict();
      return;
    }
    if (!po::is_class(args, {"argparse.Namespace"}))
      throw_error(errors::mg_bad_args, where_, "'args' is " + po::kind_of(args) + ", expected an argparse.Namespace (or the dict of its attributes)");
    auto a = po::attributes(args.as_object());
    if (!a) throw_error(errors::mg_bad_args, where_, "'args' has no attribute dict (BUILD state)");
    attrs_ = std::move(*a);
  }
  [[nodiscard]] const Value* get(std::string_view k) const {
    const Value* v = attrs_.find(Key(std::string(k)));
    return v && !v->is_none() ? v : nullptr;
  }
  /// A positive int at most `max`; nullopt when absent or None.
  [[nodiscard]] std::optional<std::uint64_t> count(std::string_view k, std::uint64_t max, std::string_view cap) const {
    const Value* v = get(k);
    if (!v) return std::nullopt;
    if (!v->is_int() || v->as_int() <= 0)
      throw_error(errors::mg_bad_args, where_, "args." + std::string(k) + " is " + po::kind_of(*v) +
                                                   (v->is_int() ? " " + std::to_string(v->as_int()) : "") + ", expected a positive int");
    if (static_cast<std::uint64_t>(v->as_int()) > max)
      throw_error(errors::mg_limit, where_, "args." + std::string(k) + " = " + std::to_string(v->as_int()) + " exceeds limits::" + std::string(cap));
    return static_cast<std::uint64_t>(v->as_int());
  }
  [[nodiscard]] std::uint64_t required(std::string_view k, std::uint64_t max, std::string_view cap) const {
    auto c = count(k, max, cap);
    if (!c) throw_error(errors::mg_bad_args, where_, "args has no " + std::string(k));
    return *c;
  }
  [[nodiscard]] bool flag(std::string_view k) const {
    const Value* v = get(k);
    if (!v) return false;
    if (!v->is_bool()) throw_error(errors::mg_bad_args, where_, "args." + std::string(k) + " is " + po::kind_of(*v) + ", expected a bool");
    return v->as_bool();
  }
  [[nodiscard]] const std::string& where() const noexcept { return where_; }

 private:
  std::string where_;
  Dict attrs_;
};

/// The facts of `args` for a file of `checkpoint_version`, checked against `lim`.
inline facts read_facts(const Value& args, double checkpoint_version, const limits& lim, const std::string& where) {
  const args_reader a(args, where);
  facts f;
  f.checkpoint_version = checkpoint_version;
  // Before checkpoint_version 3.0 the TP size was args.model_parallel_size.
  std::optional<std::uint64_t> tp = checkpoint_version >= 3.0 ? a.count("tensor_model_parallel_size", lim.max_ranks, "max_ranks")
                                                               : a.count("model_parallel_size", lim.max_ranks, "max_ranks");
  if (!tp && checkpoint_version < 3.0) tp = a.count("tensor_model_parallel_size", lim.max_ranks, "max_ranks");
  f.tp = tp.value_or(1);
  f.pp = a.count("pipeline_model_parallel_size", lim.max_ranks, "max_ranks").value_or(1);
  if (auto v = a.count("virtual_pipeline_model_parallel_size", lim.max_layers, "max_layers")) {
    f.vpp = *v;
    f.virtual_pp = true;
  }
  if (checked_mul(f.tp, f.pp, "TP x PP") > lim.max_ranks)
    throw_error(errors::mg_limit, where, "TP " + std::to_string(f.tp) + " x PP " + std::to_string(f.pp) + " ranks exceed limits::max_ranks");
  f.num_layers = a.required("num_layers", lim.max_layers, "max_layers");
  f.heads = a.required("num_attention_heads", lim.max_heads, "max_heads");
  f.hidden = a.count("hidden_size", std::uint64_t{1} << 40, "max_layers").value_or(0);
  f.groups = a.flag("group_query_attention") ? a.required("num_query_groups", lim.max_heads, "max_heads") : f.heads;
  if (auto kv = a.count("kv_channels", std::uint64_t{1} << 32, "max_heads")) {
    f.kv_channels = *kv;
  } else {
    if (f.hidden == 0 || f.hidden % f.heads != 0)
      throw_error(errors::mg_bad_args, where, "args.kv_channels is None and hidden_size " + std::to_string(f.hidden) +
                                                  " is not a multiple of num_attention_heads " + std::to_string(f.heads));
    f.kv_channels = f.hidden / f.heads;
  }
  if (f.heads % f.groups != 0)
    throw_error(errors::mg_bad_args, where, "num_attention_heads " + std::to_string(f.heads) + " is not a multiple of num_query_groups " +
                                                std::to_string(f.groups));
  f.swiglu = a.flag("swiglu");
  f.untied = a.flag("untie_embeddings_and_output_weights");
  f.padded_vocab_size = a.count("padded_vocab_size", max_size, "max_tensors");
  if (const Value* d = a.get("params_dtype")) {
    if (!d->is_object() || d->as_object().how != object_build::global || d->as_object().module != "torch")
      throw_error(errors::mg_bad_args, where, "args.params_dtype is " + po::kind_of(*d) + ", expected a torch dtype");
    f.params_dtype = dtype_from_torch_name(d->as_object().name);
  }
  f.distributed_optimizer = a.flag("use_distributed_optimizer");
  if (auto dp = a.count("data_parallel_size", lim.max_ranks << 16, "max_ranks")) {
    f.dp = *dp;
  } else if (auto ws = a.count("world_size", lim.max_ranks << 16, "max_ranks")) {
    f.dp = std::max<std::uint64_t>(1, *ws / (f.tp * f.pp));
  }
  if (a.flag("overlap_grad_reduce"))
    f.bucket_size = a.count("ddp_bucket_size", max_size, "max_tensors").value_or(std::max<std::uint64_t>(40000000, 1000000 * f.dp));
  return f;
}

}  // namespace detail
}  // namespace megatron
}  // namespace statedict::inline v0
