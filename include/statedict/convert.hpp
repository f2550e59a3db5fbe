// statedict: the facade's conveniences: convert (open, transform, save in one call), load (any
// checkpoint as a tree) and save (any tree as a checkpoint). api.hpp has the types.
//
//   statedict::convert_options o;
//   o.input.dtype = statedict::dtype::BF16;                        // how IN is read
//   o.transforms.push_back(statedict::renamed(statedict::formats::strip_prefix("module.")));
//   o.output.max_shard_size = 5'000'000'000;                       // how OUT is written
//   statedict::convert("ckpt/", "hf/", o);                         // a Hugging Face directory
//
// or step by step: statedict::open (formats/registry.hpp), the transforms of
// formats/transform.hpp, statedict::save. Nothing is read but headers and metadata until save()
// streams the bytes, in bounded memory, into files that appear atomically.
// SPDX-License-Identifier: MIT
#pragma once

#include "core/config.hpp"
#include "core/detail/defines_facade.hpp"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "api.hpp"
#include "exec/read.hpp"
#include "shard/views.hpp"
#include "formats/format.hpp"
#include "formats/registry.hpp"
#include "formats/transform.hpp"
#include "shard/checkpoint.hpp"

namespace statedict::inline v0 {

/// Converts the checkpoint at `in` into `out`: open, transform, save. The output's format and
/// options are checked before the input is read.
STATEDICT_API conversion convert(const std::filesystem::path& in, const std::filesystem::path& out, const convert_options& opt = {}) {
  const auto writer = formats::choose_output(out, opt.output);
  detail::report_progress(opt.output.exec, progress_phase::reading, 0, 0, in.string());
  formats::Opened opened = formats::open(in, opt.input);
  ShardedCheckpoint ck = std::move(opened.checkpoint);
  for (const transform_fn& t : opt.transforms) ck = t(ck);
  conversion r;
  r.input_format = std::string(opened.format->name());
  r.rule = std::move(opened.rule);
  r.output_format = std::string(writer->name());
  r.tensors = ck.tensors.size();
  for (const TensorInfo& t : ck.tensors) r.bytes += byte_size(t.shape, itemsize(t.dtype));
  if (const auto parent = out.parent_path(); !parent.empty()) std::filesystem::create_directories(parent);
  r.files = writer->save(ck, out, opt.output);
  return r;
}

/// The checkpoint at `path` (any format) as its tree, as torch.load gives it: tensors held in one
/// contiguous piece of a mapped file are views into the mapping (no copy); the others (sharded,
/// strided, pread, cast) are read into tensors of their own.
STATEDICT_API Value load(const std::filesystem::path& path, const formats::open_options& opt = {}) {
  formats::Opened in = formats::open(path, opt);
  const ShardedCheckpoint& ck = in.checkpoint;
  NamedTensors named;
  named.reserve(ck.tensors.size());
  for (const TensorInfo& t : ck.tensors) {
    const Chunk* c = t.chunks.size() == 1 ? &t.chunks[0] : nullptr;
    const ByteSource* src = c && c->at.source < ck.sources.size() ? ck.sources[c->at.source].get() : nullptr;
    if (c && src && src->data() && c->at.strides.empty() && c->at.stored == t.dtype && covers_whole(c->region, t.shape) &&
        c->at.byte_offset <= src->size() && byte_size(t.shape, itemsize(t.dtype)) <= src->size() - c->at.byte_offset) {
      named.emplace_back(t.name, TensorView::contiguous(t.dtype, t.shape, src->data() + c->at.byte_offset, src->owner()));
      continue;
    }
    named.emplace_back(t.name, read_tensor(ck, t.name).view());  // the view keeps the tensor alive
  }
  return unflatten(named, ck.skeleton);
}

/// Writes any tree of tensors and values (a state dict, an optimizer state, ...) as a checkpoint
/// at `out` in any format (save_options::format, or from the name): the tree is flattened and its
/// tensors streamed from their memory.
STATEDICT_API std::vector<std::string> save(const Value& tree, const std::filesystem::path& out, const formats::save_options& opt = {}) {
  FlatStateDict flat = flatten(tree);
  ShardedCheckpoint ck = describe_views(flat.tensors);
  // A plain {name: tensor} dict of distinct tensors needs no skeleton (a flat safetensors file).
  const bool plain = safetensors::is_flat_tensor_dict(tree) && tree.as_dict().size() == flat.tensors.size();
  if (!plain) ck.skeleton = std::move(flat.skeleton);
  return formats::save(ck, out, opt);
}

}  // namespace statedict::inline v0

#include "detail/facade_names.hpp"
