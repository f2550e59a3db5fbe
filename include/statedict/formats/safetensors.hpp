// statedict: safetensors files as a format plug-in: detection, description, and the writers (a
// described checkpoint, or a list of tensors and byte ranges), all through the planner and the
// streaming executor.
// SPDX-License-Identifier: MIT
//
// The reader and the header layout are io/safetensors.hpp; this file writes. The output is
// byte-identical to the reference writer's (`serialize_to_file`) for the same tensors and
// metadata, appears atomically (temporary name, fsync, rename), and is streamed in bounded memory,
// casting floating tensors on the fly when asked.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../core/cast.hpp"
#include "../core/error.hpp"
#include "../core/flatten.hpp"
#include "../core/tensor.hpp"
#include "../exec/executor.hpp"
#include "../exec/sink.hpp"
#include "../io/file.hpp"
#include "../io/safetensors.hpp"
#include "../shard/box.hpp"
#include "../shard/checkpoint.hpp"
#include "../shard/plan.hpp"
#include "../shard/views.hpp"
#include "detail/safetensors_write.hpp"
#include "format.hpp"
#include "transform.hpp"
#include "hf.hpp"

namespace statedict::inline v0 {

namespace formats {

/// Writes one .safetensors file. Tensors the skeleton ties (aliases, views) are stored once.
inline void write_safetensors(const ShardedCheckpoint& ck, const std::filesystem::path& path, const save_options& opt = {}) {
  check_consistent(ck);
  (void)detail::write_safetensors_file(ck, detail::safetensors_metadata(ck, true), path, opt.exec, opt.plan);
}

}  // namespace formats

// ---------------------------------------------------------------------------------------------
// Writing tensors and byte ranges (no description needed)

namespace safetensors {

/// Writes a .safetensors file atomically (temporary name, fsync, rename), streaming every tensor
/// from its view or byte source through the executor (casting on the fly when asked).
inline write_result write(const std::filesystem::path& path, std::span<const Input> inputs, const write_options& opt = {}) {
  detail::prepared p = detail::prepare(inputs, opt);
  ShardedCheckpoint ck;
  ck.format = "memory";
  for (std::size_t k = 0; k < p.stored.size(); ++k) {
    const Input& in = inputs[p.stored[k]];
    TensorInfo& t = in.source ? add_stored(ck, in.name, in.dtype, in.shape, in.source, in.offset) : add_view(ck, in.name, in.view);
    t.dtype = p.specs[k].dtype;  // the executor casts from the stored dtype
  }
  write_result r;
  r.layout = formats::detail::write_safetensors_file(ck, p.metadata, path, opt.exec, plan_options{}, opt.lim);
  r.specs = std::move(p.specs);
  r.aliases = std::move(p.aliases);
  r.metadata = std::move(p.metadata);
  return r;
}

/// Inputs for every tensor of a ShardedCheckpoint whose elements lie in one contiguous,
/// row-major chunk of one source (what every safetensors file and HF shard is). Throws
/// errors::st_write_input for a tensor split over several chunks (formats::write_safetensors
/// writes those).
inline std::vector<Input> inputs_of(const ShardedCheckpoint& c) {
  std::vector<Input> out;
  out.reserve(c.tensors.size());
  for (const TensorInfo& t : c.tensors) {
    const bool whole = t.chunks.size() == 1 && t.chunks[0].at.strides.empty() && t.chunks[0].at.stored == t.dtype &&
                       covers_whole(t.chunks[0].region, t.shape);
    if (!whole)
      throw_error(errors::st_write_input, detail::where_tensor(t.name), "is not one contiguous chunk of one source");
    out.push_back(Input::from_source(t.name, t.dtype, t.shape, c.sources.at(t.chunks[0].at.source), t.chunks[0].at.byte_offset));
  }
  return out;
}

/// True when `state` is a plain dict {string name: tensor}, what a safetensors file holds without
/// a skeleton.
inline bool is_flat_tensor_dict(const Value& state) {
  if (!state.is_dict()) return false;
  for (const auto& [k, v] : state.as_dict())
    if (!k.is_string() || !v.is_tensor()) return false;
  return true;
}

/// Writes a whole state (model + optimizer + scalars + strings: any Value tree) into one file. A
/// plain {name: tensor} dict becomes a plain file (entries that are the same view are written once
/// and recorded as aliases); any other tree is flattened (core/flatten.hpp) and its skeleton stored
/// under "statedict.skeleton", next to the user's metadata. `read_state` gives back an equal tree.
inline write_result write_state(const std::filesystem::path& path, const Value& state, write_options opt = {}) {
  std::vector<Input> in;
  if (is_flat_tensor_dict(state)) {
    in.reserve(state.as_dict().size());
    for (const auto& [k, v] : state.as_dict()) in.push_back(Input::of(k.as_string(), v.as_tensor()));
    return write(path, in, opt);
  }
  FlatStateDict flat = flatten(state);
  in.reserve(flat.tensors.size());
  for (const auto& [n, v] : flat.tensors) in.push_back(Input::of(n, v));
  opt.skeleton = std::move(flat.skeleton).take_json();
  opt.dedupe_views = false;  // ties are alias nodes of the skeleton already
  return write(path, in, opt);
}

}  // namespace safetensors

// ---------------------------------------------------------------------------------------------
// The plug-in

namespace safetensors {

namespace detail {
/// A safetensors file starts with a little-endian header length that fits the file, followed by
/// a JSON object ('{', after optional spaces).
inline bool looks_like_file(std::span<const std::byte> head, std::uint64_t size, std::string& found) {
  if (size < 9 || head.size() < 9) {
    found = "the file has " + std::to_string(size) + " bytes, fewer than a safetensors header needs";
    return false;
  }
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | std::to_integer<std::uint64_t>(head[static_cast<std::size_t>(i)]);
  if (n > size - 8) {
    found = "the first 8 bytes (" + std::to_string(n) + " as a header length) exceed the file";
    return false;
  }
  for (std::uint64_t i = 8; i < 8 + n && i < 8 + 64 && i < head.size(); ++i) {
    const auto ch = std::to_integer<char>(head[static_cast<std::size_t>(i)]);
    if (ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r') continue;
    if (ch == '{') return true;
    break;
  }
  found = "no JSON object after the header length";
  return false;
}
}  // namespace detail

/// safetensors files: read zero-copy with the reference's validation, written byte-identical to
/// the reference writer. `--to safetensors` with an output not named *.safetensors writes a
/// Hugging Face directory (formats/hf.hpp).
class format final : public formats::Format {
 public:
  [[nodiscard]] std::string_view name() const noexcept override { return "safetensors"; }
  [[nodiscard]] std::string_view title() const noexcept override { return "safetensors"; }

  [[nodiscard]] formats::Detection detect(const formats::Input& in, const formats::open_options&) const override {
    if (in.is_directory()) return formats::Detection::not_applicable();
    std::string found;
    if (detail::looks_like_file(in.head(), in.file()->size(), found))
      return formats::Detection::match("safetensors: little-endian header length followed by a JSON object");
    // Named like one, or a header length followed by a JSON object whatever the length says: a
    // damaged safetensors file (truncated, or its length lies), which the reader explains.
    const auto h = in.head();
    if (formats::detail::ends_with(in.filename(), ".safetensors") || (h.size() >= 9 && std::to_integer<char>(h[8]) == '{'))
      return formats::Detection::named_like(found);
    return formats::Detection::miss(found);
  }
  [[nodiscard]] ShardedCheckpoint describe(const formats::Input& in, const formats::open_options& opt) const override {
    return File::open(in.file(), opt.settings.get<open_options>().lim).describe();
  }

  [[nodiscard]] bool can_write() const noexcept override { return true; }
  [[nodiscard]] formats::output_claim claims_output(const std::filesystem::path& out, const formats::save_options&) const override {
    return formats::detail::has_extension(out, ".safetensors") ? formats::output_claim::by_name : formats::output_claim::none;
  }
  void check_output(const std::filesystem::path& out, const formats::save_options& opt) const override {
    formats::detail::refuse_option(opt.world_size.has_value(), "--world-size", "safetensors", "it is for DCP output");
    if (claims_output(out, opt) != formats::output_claim::by_name) return;  // a Hugging Face directory
    formats::detail::refuse_option(opt.max_shard_size.has_value(), "--max-shard-size", "a single .safetensors file",
                                   "it writes a directory of shards: name the output without .safetensors");
    formats::detail::refuse_option(opt.part.has_value() || opt.index_only, "--part", "a single file",
                                   "parts split outputs of several files (Hugging Face shards, DCP)");
  }
  std::vector<std::string> save(const ShardedCheckpoint& ck, const std::filesystem::path& out, const formats::save_options& opt) const override {
    if (claims_output(out, opt) != formats::output_claim::by_name) return formats::write_hf(ck, out, opt);
    formats::write_safetensors(ck, out, opt);
    return {out.filename().string()};
  }
};

}  // namespace safetensors
}  // namespace statedict::inline v0
