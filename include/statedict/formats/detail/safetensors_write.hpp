// statedict: laying out and streaming safetensors files from a description: the pieces the
// safetensors, Hugging Face and tree writers share.
// SPDX-License-Identifier: MIT
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

#include "../../core/cast.hpp"
#include "../../core/error.hpp"
#include "../../core/flatten.hpp"
#include "../../core/tensor.hpp"
#include "../../exec/executor.hpp"
#include "../../exec/sink.hpp"
#include "../../io/file.hpp"
#include "../../io/safetensors.hpp"
#include "../../shard/box.hpp"
#include "../../shard/checkpoint.hpp"
#include "../../shard/plan.hpp"
#include "../../shard/views.hpp"
#include "../format.hpp"

namespace statedict::inline v0 {

namespace formats::detail {

/// One destination chunk holding all of tensor `t` at `offset` of destination `dest`, row-major.
inline TensorInfo whole_at(const TensorInfo& t, std::uint32_t dest, std::uint64_t offset) {
  TensorInfo d{t.name, t.dtype, t.shape, {}};
  d.chunks.push_back(Chunk{full_box(t.shape), Placement{dest, offset, {}, t.dtype}});
  return d;
}

inline std::vector<safetensors::TensorSpec> specs_of(std::span<const TensorInfo> tensors) {
  std::vector<safetensors::TensorSpec> s;
  s.reserve(tensors.size());
  for (const TensorInfo& t : tensors) s.push_back({t.name, t.dtype, t.shape});
  return s;
}

/// The destination of one safetensors file laid out as `lay` for `tensors` (destination 0).
inline Destination safetensors_destination(std::span<const TensorInfo> tensors, const safetensors::Layout& lay, std::string name) {
  Destination dst;
  dst.names.push_back(std::move(name));
  dst.sizes.push_back(lay.file_size);
  dst.tensors.reserve(lay.entries.size());
  for (const safetensors::LayoutEntry& e : lay.entries) dst.tensors.push_back(whole_at(tensors[e.index], 0, lay.data_start() + e.begin));
  return dst;
}

/// Writes every tensor of `ck` (each in its logical dtype; the executor casts from the stored
/// one) into a new safetensors file at `path` with this `__metadata__`, atomically.
inline safetensors::Layout write_safetensors_file(const ShardedCheckpoint& ck, const std::optional<std::map<std::string, std::string>>& metadata,
                                                  const std::filesystem::path& path, const exec_options& exec, const plan_options& popt,
                                                  const safetensors::limits& lim = {}) {
  safetensors::Layout lay = safetensors::layout(specs_of(ck.tensors), metadata, lim);
  const Destination dst = safetensors_destination(ck.tensors, lay, path.filename().string());
  statedict::detail::report_progress(exec, progress_phase::planning);
  const Plan plan = make_plan(ck, dst, popt);
  OutputFile out = OutputFile::create(path);
  try {
    out.write(lay.header);
    FileSink sink(out);
    if (exec.direct_io) (void)sink.use_direct_io();
    std::vector<Sink*> sinks{&sink};
    (void)execute(plan, ck, sinks, exec);
  } catch (error& e) {
    e.add_context("file " + quote(path.string()));
    throw;
  }
  statedict::detail::report_progress(exec, progress_phase::syncing, plan.bytes(), plan.bytes(), dst.names[0]);
  out.commit();
  return lay;
}

/// The safetensors `__metadata__` of a described checkpoint: its string metadata (which carries
/// e.g. a torch file's module attributes, so they come back when converted again), "format": "pt"
/// unless it has a format, and the skeleton when the tree is not a flat dict of its tensors.
inline std::map<std::string, std::string> safetensors_metadata(const ShardedCheckpoint& ck, bool with_skeleton) {
  std::map<std::string, std::string> md;
  for (const auto& [k, v] : ck.metadata)
    if (k != safetensors::aliases_key && k != safetensors::skeleton_key) md[k] = v;
  md.emplace("format", "pt");
  if (with_skeleton && !ck.skeleton.is_null()) md[std::string(safetensors::skeleton_key)] = ck.skeleton.dump();
  return md;
}

/// Refuses a save option the format does not take.
inline void refuse_option(bool given, std::string_view option, std::string_view format, std::string_view why) {
  if (given) throw_error(errors::bad_save_option, std::string(option), "does not apply to " + std::string(format) + " output: " + std::string(why));
}

}  // namespace formats::detail

namespace safetensors {

/// One tensor to write: either a view, or contiguous row-major bytes in a byte source (a mapped or
/// pread file).
struct Input {
  std::string name;
  statedict::dtype dtype = statedict::dtype::F32;  ///< dtype of the data as given
  shape_t shape;
  TensorView view;                                 ///< the data, when `source` is null
  std::shared_ptr<const ByteSource> source;        ///< or: the bytes at `offset` in this source
  std::uint64_t offset = 0;

  static Input of(std::string tensor_name, TensorView v) {
    Input in;
    in.name = std::move(tensor_name);
    in.dtype = v.dtype();
    in.shape = v.shape();
    in.view = std::move(v);
    return in;
  }
  static Input from_source(std::string tensor_name, statedict::dtype t, shape_t dims, std::shared_ptr<const ByteSource> src,
                           std::uint64_t at) {
    Input in;
    in.name = std::move(tensor_name);
    in.dtype = t;
    in.shape = std::move(dims);
    in.source = std::move(src);
    in.offset = at;
    return in;
  }
};

struct write_options {
  /// Cast floating-point tensors to this dtype (F32, BF16, F16, ...); other tensors keep theirs.
  std::optional<statedict::dtype> cast;
  /// The user's `__metadata__` (nullopt: none). Keys "statedict.*" are reserved.
  std::optional<std::map<std::string, std::string>> metadata;
  /// Further names for written tensors: (alias, stored name). Recorded under "statedict.aliases".
  std::vector<std::pair<std::string, std::string>> aliases;
  /// Inputs that are the very same view as an earlier input are written once and recorded as
  /// aliases of it (tied weights). Not done when a skeleton is given (its alias nodes record ties).
  bool dedupe_views = true;
  /// A flatten skeleton to store under "statedict.skeleton" (null: none).
  nlohmann::json skeleton;
  /// How the bytes are copied (threads, memory budget, copy paths).
  exec_options exec{};
  limits lim{};
};

/// What write() did.
struct write_result {
  Layout layout;
  std::vector<TensorSpec> specs;  ///< the stored tensors (after dedupe and cast), as given to layout()
  std::vector<std::pair<std::string, std::string>> aliases;
  std::optional<std::map<std::string, std::string>> metadata;  ///< the `__metadata__` written
};

namespace detail {

/// The output dtype of an input under `cast`.
inline statedict::dtype out_dtype(statedict::dtype t, const std::optional<statedict::dtype>& cast) {
  return cast && is_floating(t) ? *cast : t;
}

struct prepared {
  std::vector<std::size_t> stored;  // indices of inputs to store
  std::vector<TensorSpec> specs;    // their output specs, same order
  std::vector<std::pair<std::string, std::string>> aliases;
  std::optional<std::map<std::string, std::string>> metadata;
};

inline prepared prepare(std::span<const Input> inputs, const write_options& opt) {
  prepared p;
  if (opt.cast && !is_floating(*opt.cast))
    throw_error(errors::st_write_input, "cast to " + std::string(name(*opt.cast)), "only floating dtypes are cast targets");
  p.aliases = opt.aliases;
  std::unordered_map<const std::byte*, std::vector<std::size_t>> by_ptr;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const Input& in = inputs[i];
    if (in.source == nullptr && (in.view.dtype() != in.dtype || in.view.shape() != in.shape))
      throw_error(errors::st_write_input, safetensors::detail::where_tensor(in.name), "dtype/shape differ from its view's");
    // With a skeleton, ties are the skeleton's business (its alias nodes): store what is given.
    if (opt.dedupe_views && opt.skeleton.is_null() && in.source == nullptr && in.view.numel() != 0) {
      auto& seen = by_ptr[in.view.data()];
      bool dup = false;
      for (std::size_t j : seen)
        if (same_view(inputs[j].view, in.view)) {
          p.aliases.emplace_back(in.name, inputs[j].name);
          dup = true;
          break;
        }
      if (dup) continue;
      seen.push_back(i);
    }
    if (opt.cast) check_cast(in.dtype, out_dtype(in.dtype, opt.cast));
    p.stored.push_back(i);
    p.specs.push_back(TensorSpec{in.name, out_dtype(in.dtype, opt.cast), in.shape});
  }
  p.metadata = opt.metadata;
  if (p.metadata)
    for (const auto& [k, v] : *p.metadata)
      if (k == aliases_key || k == skeleton_key)
        throw_error(errors::st_write_metadata, "__metadata__ key " + quote(k), "reserved for statedict");
  if (!p.aliases.empty()) {
    std::unordered_set<std::string_view> stored;
    for (const auto& s : p.specs) stored.insert(s.name);
    nlohmann::ordered_json j = nlohmann::ordered_json::object();
    for (const auto& [alias, target] : p.aliases) {
      if (!stored.count(target))
        throw_error(errors::st_write_input, "alias " + quote(alias), "refers to " + quote(target) + ", which is not written");
      if (stored.count(alias) || j.contains(alias))
        throw_error(errors::st_write_name, "alias " + quote(alias), "the name appears twice");
      if (!safetensors::detail::valid_utf8(alias)) throw_error(errors::st_write_name, "alias " + quote(alias), "the name is not UTF-8");
      j[alias] = target;
    }
    if (!p.metadata) p.metadata.emplace();
    p.metadata->emplace(std::string(aliases_key), j.dump());
  }
  if (!opt.skeleton.is_null()) {
    if (!p.metadata) p.metadata.emplace();
    if (opt.cast) {
      nlohmann::json sk = opt.skeleton;
      safetensors::detail::cast_skeleton(sk, *opt.cast);
      p.metadata->emplace(std::string(skeleton_key), sk.dump());
    } else {
      p.metadata->emplace(std::string(skeleton_key), opt.skeleton.dump());
    }
  }
  return p;
}

}  // namespace detail

}  // namespace safetensors

}  // namespace statedict::inline v0
