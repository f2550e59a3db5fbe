// statedict: DeepSpeed ZeRO stage 1, 2 and 3 checkpoints, described as one consolidated state.
// SPDX-License-Identifier: MIT
//
// `deepspeed::detect(dir)` finds a checkpoint (a `latest` file naming a tag folder, or a tag folder
// itself) and says which rule matched; `deepspeed::describe(dir, options)` reads the model-states
// and optim-states files (the pickles only: every tensor is a zero-copy view whose Placement is its
// byte offset in the file) and returns a ShardedCheckpoint holding what DeepSpeed's own
// `zero_to_fp32.py` outputs, in its order:
//   1. buffers (`buffer_names`, from `module`), cast to float as `.float()` does;
//   2. frozen parameters (`frozen_param_shapes` / `frozen_param_fragments`, stage >= 2; stage 3
//      fragments are partitions like trainable ones), in the model dtype;
//   3. trainable parameters from the fp32 master partitions, in `param_shapes` order;
//   4. tied names (`shared_params`), as alias nodes of the skeleton (one stored tensor);
//   5. with `options.with_optimizer`, the Adam state keyed by parameter name
//      (`optim.state.<name>.exp_avg|exp_avg_sq|step`) and `optim.param_groups` with the names of
//      each group's parameters; zero_to_fp32 cannot do this.
// No moment byte is touched without with_optimizer: the description lists none of them.
//
// The layout rules are shard/layout.hpp's (zero12_partitions, zero12_pieces,
// zero3_partitioned_param_info, zero3_pieces); the facts about the files are in
// docs/notes/zero-fsdp-layouts.md and docs/formats/deepspeed.md, with their sources
// (deepspeedai/DeepSpeed deepspeed/utils/zero_to_fp32.py, runtime/engine.py,
// runtime/zero/stage_1_and_2.py, runtime/zero/stage3.py).
//
// Every input is checked: structure, the file count against the partition count, the rank in each
// file name against its position, the stage on every file, each partition's size against the layout
// rule (stricter than zero_to_fp32, which only checks the totals), frozen fragment sizes, buffer
// names; a failure names the file, the group or parameter, the rank, and what was expected.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../core/dtype.hpp"
#include "../core/error.hpp"
#include "../core/shape.hpp"
#include "../core/tensor.hpp"
#include "../core/value.hpp"
#include "../io/file.hpp"
#include "../io/torch_file.hpp"
#include "../shard/checkpoint.hpp"
#include "../shard/layout.hpp"
#include "detail/files.hpp"
#include "format.hpp"
#include "optim_shard.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id ds_not_found        {700, error_kind::format,      "deepspeed.not_found"};
inline constexpr error_id ds_bad_tag          {701, error_kind::format,      "deepspeed.bad_tag"};
inline constexpr error_id ds_bad_model_states {702, error_kind::format,      "deepspeed.bad_model_states"};
inline constexpr error_id ds_bad_optim_states {703, error_kind::format,      "deepspeed.bad_optim_states"};
inline constexpr error_id ds_stage            {704, error_kind::format,      "deepspeed.stage"};
inline constexpr error_id ds_file_count       {705, error_kind::format,      "deepspeed.file_count"};
inline constexpr error_id ds_rank_order       {706, error_kind::format,      "deepspeed.rank_order"};
inline constexpr error_id ds_partition_size   {707, error_kind::format,      "deepspeed.partition_size"};
inline constexpr error_id ds_group_count      {708, error_kind::format,      "deepspeed.group_count"};
inline constexpr error_id ds_moe              {709, error_kind::unsupported, "deepspeed.moe"};
inline constexpr error_id ds_model_parallel   {710, error_kind::unsupported, "deepspeed.model_parallel"};
inline constexpr error_id ds_frozen           {711, error_kind::format,      "deepspeed.frozen"};
inline constexpr error_id ds_buffer           {712, error_kind::format,      "deepspeed.buffer"};
inline constexpr error_id ds_shared           {713, error_kind::format,      "deepspeed.shared_params"};
inline constexpr error_id ds_dtype            {714, error_kind::format,      "deepspeed.dtype"};
inline constexpr error_id ds_duplicate_name   {715, error_kind::format,      "deepspeed.duplicate_name"};
inline constexpr error_id ds_world_size       {716, error_kind::format,      "deepspeed.world_size"};
inline constexpr error_id ds_optim_state      {717, error_kind::format,      "deepspeed.optimizer_state"};
inline constexpr error_id ds_limit            {718, error_kind::limit,       "deepspeed.limit"};
inline constexpr error_id ds_bad_option       {719, error_kind::usage,       "deepspeed.bad_option"};
inline constexpr error_id ds_write_input      {725, error_kind::format,      "deepspeed.write_input"};
inline constexpr error_id ds_write_option     {726, error_kind::usage,       "deepspeed.write_option"};
inline constexpr error_id ds_fresh_optimizer  {727, error_kind::usage,       "deepspeed.fresh_optimizer"};
// clang-format on
}  // namespace errors

namespace deepspeed {

/// Caps on hostile input; each error names the field to raise.
struct limits {
  /// Data-parallel ranks (optim-states files).
  std::uint64_t max_ranks = std::uint64_t{1} << 16;
  /// Parameters, buffers and param groups listed in one checkpoint.
  std::uint64_t max_entries = std::uint64_t{1} << 24;
  /// Bytes of the `latest` file.
  std::uint64_t max_tag_bytes = 4096;
  /// Bytes of integer buffers converted to F32 while describing (zero_to_fp32's `.float()`), which
  /// is the only tensor data describe() reads besides 0-dim optimizer state.
  std::uint64_t max_converted_buffer_bytes = std::uint64_t{64} << 20;
  /// Limits of the torch.save reader.
  torch::limits torch{};
};

struct options {
  /// dtype of every output model tensor. Unset: zero_to_fp32's dtypes (trainable parameters as the
  /// master partitions, F32; buffers F32, as `.float()` makes them; frozen parameters in the model
  /// dtype, F16/BF16 in half-precision runs). F32, BF16 or F16: all model tensors, cast exactly by
  /// the executor (round to nearest even). Optimizer state keeps its stored dtype.
  std::optional<statedict::dtype> dtype;
  /// Also describe the optimizer state (Adam moments and step) keyed by parameter name, and the
  /// param groups.
  bool with_optimizer = false;
  /// Stage 1 (and stage 2 with `exclude_frozen_parameters`) saves no frozen parameters in the
  /// places zero_to_fp32 reads, so its output lacks them. With this set, frozen parameters are
  /// taken from `module` instead, where stage 1/2 keeps them whole in the model dtype (every
  /// `module` entry that is not a buffer, a trainable parameter or a tied name).
  bool frozen_from_module = false;
  /// With `dtype`: also give it to the buffers of integer origin (zero_to_fp32's `.float()` of an
  /// int64 or bool buffer), which `dtype` may not hold exactly; off, they stay F32. Either way
  /// their TensorInfo::converted_from says what they were.
  bool cast_integer_buffers = true;
  /// The tag folder to read; empty: the one `latest` names.
  std::string tag;
  /// At stage 3 every rank's model-states file repeats rank 0's param_shapes. Describing parses
  /// rank 0's and, of the others, only those it needs (their fragments of frozen parameters);
  /// with this set (open_options::check_replicas, `--check-replicas`) every one is parsed and its
  /// param_shapes and frozen_param_shapes checked against rank 0's.
  bool check_rank_files = false;
  read_mode mode = read_mode::mmap;
  deepspeed::limits limits{};
};

/// The optimizer a DeepSpeed checkpoint is written with when the input has no optimizer state
/// (weights only: a Hugging Face folder, a .safetensors file, a torch model state dict): a freshly
/// constructed `torch.optim.AdamW` / `torch.optim.Adam` with these hyperparameters, as the engine
/// saves it before its first step (empty per-parameter state, the param group's hyperparameters,
/// fp32 master partitions equal to the weights upcast). parse_fresh_optimizer() reads the
/// command line's `--fresh-optimizer adamw:lr=1e-4,betas=0.9/0.999,eps=1e-8,weight_decay=0.01`.
struct fresh_optimizer {
  enum class kind { adamw, adam };
  kind type = kind::adamw;
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  /// Unset: torch's default, 0.01 for AdamW and the integer 0 for Adam (as torch stores it).
  std::optional<double> weight_decay;
  bool amsgrad = false;
  bool maximize = false;
  /// Patterns (ECMAScript regex matching the whole name) of the parameters the engine does not
  /// train (`requires_grad=False`): written as frozen parameters, not in the param group.
  std::vector<std::string> frozen;
  /// Patterns of the module's floating buffers (`register_buffer`); tensors that are not floating
  /// are buffers without being named (a parameter is floating).
  std::vector<std::string> buffers;
};

/// Reads `adamw[:key=value,...]` or `adam[:...]`: keys lr, betas (two numbers, `/`-separated),
/// eps, weight_decay (non-negative finite numbers; betas in [0, 1)), amsgrad and maximize (true
/// or false). Throws ds_fresh_optimizer naming the part that is wrong.
inline fresh_optimizer parse_fresh_optimizer(std::string_view spec) {
  const std::string what = "--fresh-optimizer " + quote(std::string(spec));
  fresh_optimizer f;
  const auto colon = spec.find(':');
  const std::string_view name = spec.substr(0, colon);
  if (name == "adamw") f.type = fresh_optimizer::kind::adamw;
  else if (name == "adam") f.type = fresh_optimizer::kind::adam;
  else
    throw_error(errors::ds_fresh_optimizer, what,
                "names the optimizer " + quote(std::string(name)) + "; expected adamw or adam (torch.optim.AdamW / Adam)");
  if (colon == std::string_view::npos) return f;
  auto number = [&](std::string_view key, std::string_view text) {
    double d = 0;
    const char* end = text.data() + text.size();
    const auto [p, ec] = std::from_chars(text.data(), end, d);
    if (text.empty() || ec != std::errc() || p != end || !std::isfinite(d) || d < 0)
      throw_error(errors::ds_fresh_optimizer, what,
                  std::string(key) + "=" + quote(std::string(text)) + " is not a non-negative finite number");
    return d;
  };
  auto boolean = [&](std::string_view key, std::string_view text) {
    if (text == "true") return true;
    if (text == "false") return false;
    throw_error(errors::ds_fresh_optimizer, what, std::string(key) + "=" + quote(std::string(text)) + " is not true or false");
  };
  std::set<std::string> seen;
  std::string_view rest = spec.substr(colon + 1);
  for (;;) {
    const auto comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    const auto eq = item.find('=');
    if (eq == std::string_view::npos || eq == 0)
      throw_error(errors::ds_fresh_optimizer, what, quote(std::string(item)) + " is not key=value");
    const std::string key(item.substr(0, eq));
    const std::string_view value = item.substr(eq + 1);
    if (!seen.insert(key).second) throw_error(errors::ds_fresh_optimizer, what, "sets " + key + " twice");
    if (key == "lr") {
      f.lr = number(key, value);
    } else if (key == "eps") {
      f.eps = number(key, value);
    } else if (key == "weight_decay") {
      f.weight_decay = number(key, value);
    } else if (key == "betas") {
      const auto slash = value.find('/');
      if (slash == std::string_view::npos)
        throw_error(errors::ds_fresh_optimizer, what, "betas=" + quote(std::string(value)) + " is not two numbers BETA1/BETA2");
      f.beta1 = number("beta1", value.substr(0, slash));
      f.beta2 = number("beta2", value.substr(slash + 1));
      if (f.beta1 >= 1 || f.beta2 >= 1)
        throw_error(errors::ds_fresh_optimizer, what, "betas=" + quote(std::string(value)) + ": each beta must be in [0, 1), as torch requires");
    } else if (key == "amsgrad") {
      f.amsgrad = boolean(key, value);
    } else if (key == "maximize") {
      f.maximize = boolean(key, value);
    } else {
      throw_error(errors::ds_fresh_optimizer, what,
                  "has the key " + quote(key) + "; expected lr, betas, eps, weight_decay, amsgrad or maximize");
    }
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return f;
}

/// How write() lays a checkpoint out.
struct write_options {
  /// Data-parallel ranks to write for (save_options::world_size, --world-size).
  std::uint32_t world_size = 1;
  /// ZeRO stage; unset: the input's (deepspeed.zero_stage).
  std::optional<int> zero_stage;
  /// The engine's module dtype (BF16 for a bf16 run: file names get the bf16_ prefix, the module
  /// and frozen parameters are in it); unset: the input's, else F32.
  std::optional<statedict::dtype> model_dtype;
  /// The tag folder; empty: the input's tag, else global_step<global_steps>.
  std::string tag;
  /// DeepSpeed's universal checkpoint (ds_to_universal.py's layout, loaded with
  /// `"checkpoint": {"load_universal": true}` at any world size) instead of the rank files; its
  /// model-states files are those of `world_size` ranks.
  bool universal = false;
  /// For an input without optimizer state: the optimizer to write, freshly constructed (see
  /// fresh_optimizer). Unset, such an input is refused; set, an input with optimizer state is,
  /// and so is `universal` (a step-0 state is written as the rank files, for any world size).
  std::optional<deepspeed::fresh_optimizer> fresh;
  exec_options exec{};
  plan_options plan{};
};

/// What detect() found.
struct detection {
  bool found = false;
  /// The rule that matched ("'latest' names tag 'global_step2' ..."), or what was looked for and
  /// what was found when nothing matched.
  std::string rule;
  std::filesystem::path tag_dir;
  std::string tag;
  std::vector<std::filesystem::path> model_files;  ///< `*_model_states.pt`, natural order
  std::vector<std::filesystem::path> optim_files;  ///< `*_optim_states.pt`, natural order
  /// Mixture-of-experts files (`*expert_*_model_states.pt`, `expp_rank_*_optim_states.pt`).
  std::vector<std::filesystem::path> expert_files;
};

// =============================================================================================
// Detection

namespace detail {

struct listing {
  std::vector<std::filesystem::path> model, optim, expert;
};

inline listing list_tag_dir(const std::filesystem::path& dir) {
  listing l;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code ec2;
    if (!it->is_regular_file(ec2)) continue;
    const std::string n = it->path().filename().string();
    const bool expert_model = formats::detail::ends_with(n, "_model_states.pt") && n.find("expert_") != std::string::npos;
    const bool expert_optim = n.rfind("expp_rank_", 0) == 0 && formats::detail::ends_with(n, "_optim_states.pt");
    if (expert_model || expert_optim) l.expert.push_back(it->path());
    else if (formats::detail::ends_with(n, "_model_states.pt")) l.model.push_back(it->path());
    else if (formats::detail::ends_with(n, "_optim_states.pt")) l.optim.push_back(it->path());
  }
  auto by_name = [](const std::filesystem::path& a, const std::filesystem::path& b) {
    return formats::detail::natural_less(a.filename().string(), b.filename().string());
  };
  std::sort(l.model.begin(), l.model.end(), by_name);
  std::sort(l.optim.begin(), l.optim.end(), by_name);
  std::sort(l.expert.begin(), l.expert.end(), by_name);
  return l;
}

/// A tag as DeepSpeed writes it: one path component of printable text.
inline bool valid_tag(std::string_view t) {
  if (t.empty() || t == "." || t == "..") return false;
  for (char c : t)
    if (c == '/' || c == '\\' || static_cast<unsigned char>(c) < 0x20 || c == 0x7f) return false;
  return true;
}

inline std::string count_text(const listing& l) {
  return std::to_string(l.model.size()) + " *_model_states.pt and " + std::to_string(l.optim.size()) +
         " *_optim_states.pt file(s)";
}

}  // namespace detail

/// Looks at `dir`: a checkpoint root with `latest` naming a tag folder (zero_to_fp32's default), or
/// a tag folder itself; `tag` overrides `latest`. Content, not names alone, decides: the tag
/// folder must hold `*_model_states.pt` and `*_optim_states.pt` files that begin like torch.save
/// files. Throws errors::ds_bad_tag only for a `latest` file that cannot name a folder; otherwise
/// reports in `rule` what was looked for and found.
inline detection detect(const std::filesystem::path& dir, std::string_view tag = {}, const limits& lim = {}) {
  detection d;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    d.rule = "not a directory: " + quote(dir.string());
    return d;
  }
  std::string why;
  auto try_tag_dir = [&](const std::filesystem::path& td, const std::string& how) -> bool {
    if (!std::filesystem::is_directory(td, ec)) {
      why += how + ", but " + quote(td.string()) + " is not a directory; ";
      return false;
    }
    detail::listing l = detail::list_tag_dir(td);
    if (l.model.empty() || l.optim.empty()) {
      why += how + ", and " + quote(td.string()) + " holds " + detail::count_text(l) + " (both kinds needed); ";
      return false;
    }
    for (const auto* list : {&l.model, &l.optim})
      for (const auto& p : *list)
        if (!formats::detail::begins_like_torch_file(p)) {
          why += how + ", but " + quote(p.filename().string()) + " does not begin like a torch.save file; ";
          return false;
        }
    d.found = true;
    d.tag_dir = td;
    d.model_files = std::move(l.model);
    d.optim_files = std::move(l.optim);
    d.expert_files = std::move(l.expert);
    d.rule = how + ", whose folder holds " + std::to_string(d.model_files.size()) + " *_model_states.pt and " +
             std::to_string(d.optim_files.size()) + " *_optim_states.pt torch.save file(s)";
    if (!d.expert_files.empty()) d.rule += " and " + std::to_string(d.expert_files.size()) + " expert file(s)";
    return true;
  };
  if (!tag.empty()) {
    if (!detail::valid_tag(tag)) throw_error(errors::ds_bad_tag, "tag " + quote(tag), "not a folder name");
    d.tag = std::string(tag);
    if (try_tag_dir(dir / d.tag, "the tag " + quote(d.tag) + " was given")) return d;
  } else {
    const std::filesystem::path latest = dir / "latest";
    if (std::filesystem::is_regular_file(latest, ec)) {
      const auto size = std::filesystem::file_size(latest, ec);
      if (ec || size > lim.max_tag_bytes)
        throw_error(errors::ds_bad_tag, "file " + quote(latest.string()),
                    "is " + std::to_string(size) + " bytes, more than limits::max_tag_bytes (" +
                        std::to_string(lim.max_tag_bytes) + ") for a tag");
      std::ifstream f(latest, std::ios::binary);
      std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      std::string t = formats::detail::strip(text);  // zero_to_fp32: fd.read().strip()
      if (!detail::valid_tag(t))
        throw_error(errors::ds_bad_tag, "file " + quote(latest.string()),
                    "holds " + quote(t) + ", which is not a tag folder name (one path component)");
      d.tag = t;
      if (try_tag_dir(dir / t, "'latest' names tag " + quote(t))) return d;
    } else {
      why += "no 'latest' file; ";
    }
    d.tag.clear();
    if (try_tag_dir(dir, "the folder is a tag folder")) return d;
  }
  d.rule = "looked for a DeepSpeed checkpoint (a 'latest' file naming a tag folder, or a tag folder with "
           "*_model_states.pt and *_optim_states.pt torch.save files) in " +
           quote(dir.string()) + ": " + why.substr(0, why.size() >= 2 ? why.size() - 2 : 0);
  return d;
}

// =============================================================================================
// Describing loaded files

/// The files of one tag folder, loaded (tests build them by hand; describe(dir) loads them with
/// io/torch_file.hpp).
struct Inputs {
  std::vector<optim_shard::LoadedFile> model;  ///< `*_model_states.pt`, natural order
  std::vector<optim_shard::LoadedFile> optim;  ///< `*_optim_states.pt`, natural order
  /// Model-states files loaded on demand: when `load_model` is set, `model_names` lists every
  /// model-states file (natural order), `model` holds only the first, and describing calls
  /// `load_model(i)` for a file it needs, parses it and drops it before loading the next.
  std::vector<std::string> model_names;
  std::function<optim_shard::LoadedFile(std::size_t)> load_model;
  std::vector<std::string> expert_files;       ///< names of MoE expert files, if any
  std::string tag;
};

}  // namespace deepspeed
}  // namespace statedict::inline v0

// Parsing the rank files and placing every tensor, which need the types above.
#include "detail/deepspeed_describe.hpp"
#include "detail/deepspeed_write.hpp"

namespace statedict::inline v0 {
namespace deepspeed {

/// Describes loaded files (see Inputs). The result's format is "deepspeed_zero1", "_zero2" or
/// "_zero3"; its metadata holds "deepspeed.version", "deepspeed.tag", "deepspeed.world_size".
inline ShardedCheckpoint describe(const Inputs& in, const options& opt = {}) {
  using namespace detail;
  if (opt.dtype && !is_floating(*opt.dtype))
    throw_error(errors::ds_bad_option, "options.dtype", std::string(statedict::name(*opt.dtype)) + " is not a floating dtype");
  if (!in.expert_files.empty())
    throw_error(errors::ds_moe, "file " + quote(in.expert_files[0]),
                "a mixture-of-experts checkpoint: expert weights are saved per expert and the expert "
                "groups' fp32 partitions are not described by param_shapes, so they cannot be mapped "
                "to names (docs/formats/deepspeed.md, 'Mixture of experts')");
  if (in.optim.empty()) throw_error(errors::ds_file_count, "tag " + quote(in.tag), "no *_optim_states.pt file");
  if (in.model.empty()) throw_error(errors::ds_file_count, "tag " + quote(in.tag), "no *_model_states.pt file");
  if (in.optim.size() > opt.limits.max_ranks)
    throw_error(errors::ds_limit, "tag " + quote(in.tag), std::to_string(in.optim.size()) +
                                                              " optim files, more than limits::max_ranks");
  std::vector<optim_file> optims;
  for (const auto& f : in.optim) optims.push_back(parse_optim(f));
  const int stage = optims[0].stage;
  std::int64_t W64 = 0;
  for (std::int64_t c : optims[0].partition_count) W64 = std::max(W64, c);  // zero_to_fp32: max()
  for (std::size_t i = 0; i < optims.size(); ++i) {
    const optim_file& o = optims[i];
    if (o.stage != stage)
      throw_error(errors::ds_stage, file_ctx(*o.file), "zero_stage is " + std::to_string(o.stage) + ", " +
                                                          quote(base_name(optims[0].file->name)) + " says " +
                                                          std::to_string(stage));
    if (o.bf16_optimizer != optims[0].bf16_optimizer)
      throw_error(errors::ds_stage, file_ctx(*o.file), std::string(o.bf16_optimizer ? "is" : "is not") +
                                                          " a BF16_Optimizer file (no zero_stage), unlike " +
                                                          quote(base_name(optims[0].file->name)));
    if (o.partition_count != optims[0].partition_count)
      throw_error(errors::ds_world_size, file_ctx(*o.file), "partition_count differs from the first file's");
    for (std::int64_t c : o.partition_count)
      if (c != W64)
        throw_error(errors::ds_moe, file_ctx(*o.file),
                    "partition_count " + std::to_string(c) + " differs from the data-parallel world size " +
                        std::to_string(W64) +
                        ": an expert (MoE) param group partitioned over its expert-data-parallel group, whose "
                        "ranks hold different experts that param_shapes does not name");
  }
  if (static_cast<std::uint64_t>(W64) > opt.limits.max_ranks)
    throw_error(errors::ds_limit, file_ctx(*optims[0].file), "partition_count " + std::to_string(W64) +
                                                                  " exceeds limits::max_ranks");
  const auto W = static_cast<std::uint32_t>(W64);
  // zero_to_fp32 parse_optim_states: "Expected {world_size} of '*_optim_states.pt' under ..."
  if (optims.size() != W)
    throw_error(errors::ds_file_count, "tag " + quote(in.tag),
                std::to_string(optims.size()) + " *_optim_states.pt files, but partition_count says " +
                    std::to_string(W) + " data-parallel ranks (one file each)");
  for (std::size_t i = 0; i < optims.size(); ++i)
    if (auto rn = parse_rank_name(base_name(optims[i].file->name))) {
      if (rn->dp != i)
        throw_error(errors::ds_rank_order, file_ctx(*optims[i].file),
                    "is file " + std::to_string(i) + " in natural order but names dp rank " + std::to_string(rn->dp) +
                        " (expected zero_pp_rank_0 .. zero_pp_rank_" + std::to_string(W - 1) + ")");
      if (std::stoull("0" + rn->mp) != 0)
        throw_error(errors::ds_model_parallel, file_ctx(*optims[i].file), "is for model-parallel rank " + rn->mp +
                                                                              "; only mp_rank_00 checkpoints are consolidated");
    }

  const std::size_t n_models = in.load_model ? in.model_names.size() : in.model.size();
  auto model_name = [&](std::size_t i) -> const std::string& { return in.load_model ? in.model_names[i] : in.model[i].name; };
  const model_file m0 = parse_model(in.model[0], opt.limits);
  if (stage <= 2 && n_models != 1)
    throw_error(errors::ds_file_count, "tag " + quote(in.tag),
                std::to_string(n_models) + " *_model_states.pt files; stage " + std::to_string(stage) +
                    " writes one (mp_rank_00_model_states.pt, by data-parallel rank 0)");
  if (stage == 3) {
    if (n_models != W)
      throw_error(errors::ds_file_count, "tag " + quote(in.tag),
                  std::to_string(n_models) + " *_model_states.pt files; stage 3 writes one per data-parallel rank (" +
                      std::to_string(W) + ")");
    for (std::size_t i = 0; i < n_models; ++i)
      if (auto rn = parse_rank_name(base_name(model_name(i))); rn && rn->dp != i)
        throw_error(errors::ds_rank_order, "file " + quote(model_name(i)),
                    "is model file " + std::to_string(i) + " in natural order but names dp rank " + std::to_string(rn->dp));
  }
  if (const Value* dp = Access::opt(*m0.top, "dp_world_size"); dp && dp->is_int() && dp->as_int() != W64)
    throw_error(errors::ds_world_size, file_ctx(*m0.file),
                "dp_world_size is " + std::to_string(dp->as_int()) + " but the optimizer is partitioned over " +
                    std::to_string(W) + " ranks");

  builder b(opt);
  for (const auto& f : in.optim) b.table.add(f.source, f.base);
  b.table.add(in.model[0].source, in.model[0].base);

  add_buffers(b, m0);
  if (stage <= 2) {
    add_frozen12(b, m0);
    if (opt.frozen_from_module && m0.frozen_shapes.empty()) add_frozen_from_module(b, m0);
  } else {
    // Ranks 1.. are parsed one at a time, and only when they hold what the description needs
    // (their fragments of frozen parameters), when the caller asks for the repeated
    // param_shapes to be checked, or when they were loaded already.
    frozen3 frozen(b, m0, W);
    frozen.add_rank(m0, 0);
    if (!m0.frozen_shapes.empty() || opt.check_rank_files || !in.load_model)
      for (std::uint32_t r = 1; r < W; ++r) {
        std::optional<optim_shard::LoadedFile> loaded;
        if (in.load_model) loaded.emplace(in.load_model(r));
        const optim_shard::LoadedFile& f = loaded ? *loaded : in.model[r];
        const model_file m = parse_model(f, opt.limits);
        if (m.param_shapes != m0.param_shapes || m.frozen_shapes != m0.frozen_shapes)
          throw_error(errors::ds_bad_model_states, file_ctx(f), "param_shapes or frozen_param_shapes differ from rank 0's");
        if (m0.frozen_shapes.empty()) continue;
        const std::uint32_t source = b.table.add(f.source, f.base);
        frozen.add_rank(m, r);
        if (loaded) b.table.retire(source);  // its views go with it (pread: their addresses are reused)
      }
    frozen.finish();
  }
  const trainable tr = stage <= 2 ? add_trainable12(b, m0, optims, W) : add_trainable3(b, m0, optims, W);
  add_aliases(b, m0);
  if (opt.with_optimizer) {
    if (stage <= 2) add_optimizer12(b, tr, optims, W);
    else add_optimizer3(b, tr, m0, optims, W);
  }

  b.ckpt.format = "deepspeed_zero" + std::to_string(stage);
  b.ckpt.skeleton = b.skel.build();
  b.ckpt.sources = b.table.take();
  b.ckpt.metadata["deepspeed.zero_stage"] = std::to_string(stage);
  b.ckpt.metadata["deepspeed.world_size"] = std::to_string(W);
  if (optims[0].bf16_optimizer) b.ckpt.metadata["deepspeed.optimizer"] = "BF16_Optimizer";
  if (!in.tag.empty()) b.ckpt.metadata["deepspeed.tag"] = in.tag;
  if (const Value* v = Access::opt(*m0.top, "ds_version"); v && v->is_string()) b.ckpt.metadata["deepspeed.version"] = v->as_string();
  if (opt.with_optimizer) b.ckpt.metadata["deepspeed.engine"] = engine_state(m0, optims[0]);
  return std::move(b.ckpt);
}

/// Detects and describes the checkpoint at `dir` (see detect()): loads every model-states and
/// optim-states file with io/torch_file.hpp (pickles only; tensors stay in the files) and
/// describes them. Throws errors::ds_not_found with what was looked for when `dir` is not one.
inline ShardedCheckpoint describe(const std::filesystem::path& dir, const options& opt = {}) {
  const detection d = detect(dir, opt.tag, opt.limits);
  if (!d.found) throw_error(errors::ds_not_found, "directory " + quote(dir.string()), d.rule);
  Inputs in;
  in.tag = d.tag;
  for (const auto& p : d.expert_files) in.expert_files.push_back(p.string());
  if (!in.expert_files.empty()) return describe(in, opt);
  const std::string context = "DeepSpeed checkpoint " + quote(d.tag_dir.string());
  auto load = [&](const std::filesystem::path& p) { return formats::detail::load_rank_file(p, opt.mode, opt.limits.torch, context); };
  if (d.optim_files.size() > opt.limits.max_ranks)
    throw_error(errors::ds_limit, "directory " + quote(d.tag_dir.string()),
                std::to_string(d.optim_files.size()) + " optim files, more than limits::max_ranks");
  for (const auto& p : d.optim_files) in.optim.push_back(load(p));
  // Model-states files: the first now, the others when describe() needs them (one at a time).
  if (!d.model_files.empty()) in.model.push_back(load(d.model_files[0]));
  for (const auto& p : d.model_files) in.model_names.push_back(p.string());
  in.load_model = [&](std::size_t i) { return load(d.model_files.at(i)); };
  return describe(in, opt);
}

// =============================================================================================
// The plug-in

/// DeepSpeed ZeRO 1/2/3 checkpoints (a `latest` file naming a tag folder, or a tag folder):
/// consolidated as zero_to_fp32 does, without loading any tensor data.
class format final : public formats::Format {
 public:
  [[nodiscard]] std::string_view name() const noexcept override { return "deepspeed"; }
  [[nodiscard]] std::string_view title() const noexcept override { return "DeepSpeed"; }

  [[nodiscard]] formats::Detection detect(const formats::Input& in, const formats::open_options& opt) const override {
    if (!in.is_directory()) return formats::Detection::not_applicable();
    const options& o = opt.settings.get<options>();
    detection d = deepspeed::detect(in.path(), o.tag, o.limits);
    return d.found ? formats::Detection::match(std::move(d.rule)) : formats::Detection::miss(std::move(d.rule));
  }
  [[nodiscard]] ShardedCheckpoint describe(const formats::Input& in, const formats::open_options& opt) const override {
    options o = opt.settings.get<options>();
    o.dtype = opt.dtype;
    o.cast_integer_buffers = opt.cast_integer_origin;
    o.with_optimizer = opt.with_optimizer;
    o.check_rank_files = o.check_rank_files || opt.check_replicas;
    o.mode = opt.mode;
    return deepspeed::describe(in.path(), o);
  }
  [[nodiscard]] bool applies_dtype() const noexcept override { return true; }

  [[nodiscard]] bool can_write() const noexcept override { return true; }
  void check_output(const std::filesystem::path& out, const formats::save_options& opt) const override {
    if (!opt.world_size)
      throw_error(errors::ds_write_option, "output " + quote(out.string()), "DeepSpeed output needs the data-parallel world size (--world-size M)");
    if (*opt.world_size == 0 || *opt.world_size > (1U << 16))
      throw_error(errors::ds_write_option, "--world-size " + std::to_string(*opt.world_size), "expected 1 to 65536 data-parallel ranks");
    if (opt.max_shard_size)
      throw_error(errors::bad_save_option, "--max-shard-size", "does not apply to DeepSpeed output: each rank's state is one file");
    if (opt.part || opt.index_only)
      throw_error(errors::bad_save_option, "--part", "does not apply to DeepSpeed output: its rank files are written by one process");
  }
  std::vector<std::string> save(const ShardedCheckpoint& ck, const std::filesystem::path& out, const formats::save_options& opt) const override {
    check_output(out, opt);
    write_options o = opt.settings.get<write_options>();
    o.world_size = *opt.world_size;
    o.exec = opt.exec;
    o.plan = opt.plan;
    return deepspeed::write(ck, out, o);
  }
};

/// DeepSpeed's universal checkpoint, written (`--to deepspeed-universal`): what ds_to_universal.py
/// makes of a ZeRO checkpoint, for the engine's `load_universal` at any world size.
class universal_format final : public formats::Format {
 public:
  [[nodiscard]] std::string_view name() const noexcept override { return "deepspeed-universal"; }
  [[nodiscard]] std::string_view title() const noexcept override { return "DeepSpeed universal"; }
  [[nodiscard]] formats::Detection detect(const formats::Input&, const formats::open_options&) const override {
    return formats::Detection::not_applicable();
  }
  [[nodiscard]] ShardedCheckpoint describe(const formats::Input& in, const formats::open_options&) const override {
    throw_error(errors::cannot_write, "input " + quote(in.path().string()), "DeepSpeed universal checkpoints are written, not read");
  }
  [[nodiscard]] bool can_write() const noexcept override { return true; }
  void check_output(const std::filesystem::path&, const formats::save_options& opt) const override {
    if (opt.world_size && (*opt.world_size == 0 || *opt.world_size > (1U << 16)))
      throw_error(errors::ds_write_option, "--world-size " + std::to_string(*opt.world_size), "expected 1 to 65536 data-parallel ranks");
    if (opt.max_shard_size) throw_error(errors::bad_save_option, "--max-shard-size", "does not apply to DeepSpeed output");
    if (opt.part || opt.index_only) throw_error(errors::bad_save_option, "--part", "does not apply to DeepSpeed output");
  }
  std::vector<std::string> save(const ShardedCheckpoint& ck, const std::filesystem::path& out, const formats::save_options& opt) const override {
    check_output(out, opt);
    write_options o = opt.settings.get<write_options>();
    o.universal = true;
    // The model-states files are the input's world size's (ds_to_universal copies them), unless asked.
    o.world_size = 1;
    if (opt.world_size) o.world_size = *opt.world_size;
    else if (auto it = ck.metadata.find("deepspeed.world_size"); it != ck.metadata.end()) o.world_size = static_cast<std::uint32_t>(std::stoul("0" + it->second));
    o.exec = opt.exec;
    o.plan = opt.plan;
    return deepspeed::write(ck, out, o);
  }
};

}  // namespace deepspeed
}  // namespace statedict::inline v0

