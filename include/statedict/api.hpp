// statedict: the facade. The types and functions a program needs to open any checkpoint,
// transform it, read tensors from it, compare it and save it in any format. docs/library.md
// shows them at work; docs/reference.md lists every public function of the library.
// SPDX-License-Identifier: MIT
//
//   statedict::Opened in = statedict::open("ckpt/");              // any layout; metadata only
//   statedict::ShardedCheckpoint ck = statedict::formats::rename(in.checkpoint,
//                                         statedict::formats::strip_prefix("module."));
//   statedict::formats::cast(ck, statedict::dtype::BF16);
//   statedict::save(ck, "model.safetensors");                       // streamed, atomic
//   statedict::Tensor w = statedict::read_tensor(ck, "lm_head.weight");
//
// Header-only (the default), this header gives the types; <statedict/statedict.hpp> defines
// everything. With STATEDICT_SEPARATE_COMPILATION (core/config.hpp) it also declares the
// functions below, compiled once in statedict::compiled: a translation unit that includes only
// this header (or <statedict/statedict.hpp>) then compiles in a fraction of the time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/config.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/flat_state_dict.hpp"
#include "core/optim_options.hpp"
#include "core/shape.hpp"
#include "core/skeleton.hpp"
#include "core/source.hpp"
#include "core/tensor.hpp"
#include "core/value.hpp"
#include "exec/options.hpp"
#include "formats/format.hpp"
#include "formats/transform_types.hpp"
#include "shard/checkpoint.hpp"
#include "shard/plan_options.hpp"

namespace statedict::inline v0 {

/// A transformation of a description (formats/transform.hpp): rename, filter, split, ...
using transform_fn = std::function<ShardedCheckpoint(const ShardedCheckpoint&)>;

/// Everything convert() is asked to do.
struct convert_options {
  /// How the input is read: its format (detected when empty), dtype, optimizer state, limits.
  formats::open_options input;
  /// Applied in order to the description of the input.
  std::vector<transform_fn> transforms;
  /// How the output is written: its format (from the output's name when empty), shards, ranks,
  /// part, threads, memory budget.
  formats::save_options output;
};

/// What convert() did.
struct conversion {
  std::string input_format;        ///< the format the input was read as
  std::string rule;                ///< the detection rule that matched
  std::string output_format;       ///< the format written
  std::vector<std::string> files;  ///< the files written (names inside the output directory)
  std::size_t tensors = 0;         ///< tensors written
  std::uint64_t bytes = 0;         ///< their bytes, in their written dtypes
};

#ifdef STATEDICT_DECLARATIONS_ONLY
// ---------------------------------------------------------------------------------------------
// The functions of the facade, declared (their definitions: the headers named in each group).

namespace formats {
// formats/registry.hpp
STATEDICT_API std::vector<std::shared_ptr<const Format>> registered_formats();
STATEDICT_API void add_format(std::shared_ptr<const Format> f);
STATEDICT_API std::shared_ptr<const Format> find_format(std::string_view name);
STATEDICT_API Opened open(const std::filesystem::path& path, const open_options& opt = {});
STATEDICT_API std::shared_ptr<const Format> choose_output(const std::filesystem::path& out, const save_options& opt);
STATEDICT_API std::vector<std::string> save(const ShardedCheckpoint& ck, const std::filesystem::path& out, const save_options& opt = {});
// formats/transform.hpp
STATEDICT_API std::vector<Tie> tied_names(const Skeleton& skeleton);
STATEDICT_API void cast(ShardedCheckpoint& ck, dtype to, const cast_options& opt = {});
STATEDICT_API ShardedCheckpoint expand_ties(ShardedCheckpoint ck, const std::vector<Tie>& ties);
STATEDICT_API ShardedCheckpoint expand_ties(ShardedCheckpoint ck);
STATEDICT_API ShardedCheckpoint select(const ShardedCheckpoint& ck, const std::vector<std::string>& prefixes);
STATEDICT_API ShardedCheckpoint rename(const ShardedCheckpoint& ck, const name_map& f);
STATEDICT_API ShardedCheckpoint filter(const ShardedCheckpoint& ck, const std::function<bool(std::string_view)>& keep);
STATEDICT_API ShardedCheckpoint drop(const ShardedCheckpoint& ck, const std::function<bool(std::string_view)>& pred);
STATEDICT_API ShardedCheckpoint dequantize(const ShardedCheckpoint& ck, const dequantize_options& opt = {});
STATEDICT_API bool default_quantized(std::string_view name);
STATEDICT_API ShardedCheckpoint quantize(const ShardedCheckpoint& ck, const quantize_options& opt = {});
STATEDICT_API ShardedCheckpoint split(const ShardedCheckpoint& ck, std::string_view name, std::size_t dim, const std::vector<part>& parts);
STATEDICT_API ShardedCheckpoint concat(const ShardedCheckpoint& ck, const std::vector<std::string>& names, std::size_t dim,
                                       const std::string& to);
STATEDICT_API void check_consistent(const ShardedCheckpoint& ck);
}  // namespace formats

// core/flatten.hpp
STATEDICT_API FlatStateDict flatten(const Value& tree);
STATEDICT_API Value unflatten(const FlatStateDict& flat);
STATEDICT_API Value unflatten(const NamedTensors& tensors, const nlohmann::json& skeleton);
STATEDICT_API std::vector<std::pair<std::string, Value>> skeleton_values(const Skeleton& skeleton);
STATEDICT_API std::vector<std::pair<std::string, std::string>> skeleton_aliases(const Skeleton& skeleton);

namespace optim {
// core/optim.hpp
STATEDICT_API Value by_name(const Value& osd, std::span<const std::string> names = {}, const options& opt = {});
STATEDICT_API Value by_id(const Value& named, const options& opt = {});
STATEDICT_API FlatStateDict by_name(const FlatStateDict& osd, std::span<const std::string> names = {}, const options& opt = {});
STATEDICT_API FlatStateDict by_id(const FlatStateDict& named, const options& opt = {});
}  // namespace optim

// exec/read.hpp, exec/compare.hpp, exec/digest.hpp
STATEDICT_API void read_elements(const ShardedCheckpoint& ck, const TensorInfo& t, std::uint64_t begin, std::uint64_t end, dtype as,
                                 std::span<std::byte> out, const exec_options& opt = {});
STATEDICT_API const TensorInfo& tensor_named(const ShardedCheckpoint& ck, std::string_view name);
STATEDICT_API void read_rows(const ShardedCheckpoint& ck, std::string_view name, std::uint64_t row_begin, std::uint64_t row_end,
                             std::span<std::byte> out, std::optional<dtype> as = std::nullopt, const exec_options& opt = {});
STATEDICT_API Tensor read_tensor(const ShardedCheckpoint& ck, std::string_view name, std::optional<dtype> as = std::nullopt,
                                 const exec_options& opt = {});
STATEDICT_API comparison compare(const ShardedCheckpoint& A, const ShardedCheckpoint& B, const compare_options& opt = {});
STATEDICT_API std::vector<std::pair<std::string, std::string>> sha256_tensors(const ShardedCheckpoint& ckpt, const exec_options& opt = {},
                                                                              std::span<const std::string> names = {},
                                                                              const plan_options& popt = {});

// convert.hpp
STATEDICT_API conversion convert(const std::filesystem::path& in, const std::filesystem::path& out, const convert_options& opt = {});
STATEDICT_API Value load(const std::filesystem::path& path, const formats::open_options& opt = {});
STATEDICT_API std::vector<std::string> save(const Value& tree, const std::filesystem::path& out, const formats::save_options& opt = {});
#endif  // STATEDICT_DECLARATIONS_ONLY

}  // namespace statedict::inline v0

#ifdef STATEDICT_DECLARATIONS_ONLY
#include "detail/facade_names.hpp"
#endif
