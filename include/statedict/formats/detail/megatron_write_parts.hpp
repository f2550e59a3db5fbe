// statedict: the pieces of the Megatron-LM legacy writer (megatron_write.hpp): its options, the
// vocabulary re-pad as placements, and the TP split of one tensor into rank pieces.
// SPDX-License-Identifier: MIT
//
// What is written (tools/checkpoint/saver_megatron.py, core_v0.8.0; megatron.md section 2):
// checkpoint_version 3.0, today's spelling, `_extra_state: None` after each parallel linear,
// position embeddings on the first stage, the final norm and output layer on the last,
// `word_embeddings_for_head` on the last stage for tied embeddings with PP > 1; `args` with the new
// parallel sizes and padded_vocab_size; iteration, opt_param_scheduler / lr_scheduler and the other
// run-wide values carried as they are. No optimizer and no RNG state (per rank, not re-shardable
// here): load with --no-load-optim --no-load-rng (or --finetune), as after Megatron's own saver.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/flatten.hpp"
#include "../../core/value.hpp"
#include "../../exec/executor.hpp"
#include "../../exec/sink.hpp"
#include "../../io/torch_save.hpp"
#include "../../io/zip.hpp"
#include "../../shard/box.hpp"
#include "../../shard/checkpoint.hpp"
#include "../../shard/plan.hpp"
#include "../format.hpp"
#include "megatron_legacy.hpp"
#include "megatron_place.hpp"
#include "megatron_rules.hpp"
#include "write_files.hpp"

namespace statedict::inline v0::megatron {

/// How write() lays the checkpoint out.
struct write_options {
  /// Tensor- and pipeline-parallel sizes (unset: 1); virtual pipeline chunks per stage (unset: none).
  std::optional<std::uint64_t> tp, pp, vpp;
  /// Re-pad the vocabulary: to the multiple of make_vocab_size_divisible_by x TP at or above this
  /// true size (rows cut, or added as copies of the last stored row as Megatron's saver does);
  /// unset: the rows as they are (TP must divide them).
  std::optional<std::uint64_t> true_vocab_size;
  /// unset: args.make_vocab_size_divisible_by, else 128 (Megatron's default).
  std::optional<std::uint64_t> make_vocab_size_divisible_by;
  /// Partition rules tried before the built-in ones.
  std::vector<rule> rules;
  bool default_rules = true;
  exec_options exec{};
  plan_options plan{};
};

/// Throws errors::mg_write_option for sizes out of range.
inline void check(const write_options& o) {
  for (const auto& [v, what] : {std::pair{o.tp, "--tp"}, std::pair{o.pp, "--pp"}, std::pair{o.vpp, "--vpp"}})
    if (v && (*v == 0 || *v > (1U << 16))) throw_error(errors::mg_write_option, what, std::to_string(*v) + " is not from 1 to 65536");
  if (o.true_vocab_size && *o.true_vocab_size == 0) throw_error(errors::mg_write_option, "--true-vocab-size", "must be at least 1");
  if (o.make_vocab_size_divisible_by && *o.make_vocab_size_divisible_by == 0)
    throw_error(errors::mg_write_option, "make_vocab_size_divisible_by", "must be at least 1");
}

namespace detail {

/// One tensor to write: its rule and where it goes.
struct out_tensor {
  std::size_t index = 0;  ///< in the (working) source
  split how = split::replicated;
  enum class where : std::uint8_t { first, layer, last } place = where::layer;
  std::uint64_t layer = 0;
  std::string key;  ///< key under its container (encoder: "layers.<local>.<rest>" after localising)
  std::string group;  ///< embedding sub-dict / "encoder" / "output_layer"
};

/// A rank file being planned: its tree with placeholder pieces, and which piece is which.
struct rank_plan {
  std::string name;  ///< relative path
  Value tree;
  struct slot {
    std::size_t tensor;  ///< out_tensor index
    const std::byte* data;
    std::uint64_t r;  ///< TP rank
  };
  std::vector<slot> slots;
  torch::SavePlan plan;
};

/// Rows of the vocabulary after re-padding, and the working copy of the source it needs.
inline std::uint64_t repad_rows(std::uint64_t rows, const write_options& o, std::uint64_t tp, const Value* divisor, const std::string& name) {
  if (!o.true_vocab_size) {
    if (rows % tp != 0)
      throw_error(errors::mg_write_split, "tensor " + quote(name), std::to_string(rows) + " vocabulary rows do not split over TP " + std::to_string(tp) +
                                                                       ": give the true vocabulary size (--true-vocab-size) to re-pad");
    return rows;
  }
  if (*o.true_vocab_size > rows)
    throw_error(errors::mg_vocab, "tensor " + quote(name), "the true vocabulary size " + std::to_string(*o.true_vocab_size) + " exceeds its " +
                                                               std::to_string(rows) + " rows");
  std::uint64_t div = o.make_vocab_size_divisible_by.value_or(divisor && divisor->is_int() && divisor->as_int() > 0 ? static_cast<std::uint64_t>(divisor->as_int()) : 128);
  if (div > (std::uint64_t{1} << 20))
    throw_error(errors::mg_write_input, "make_vocab_size_divisible_by " + std::to_string(div), "is larger than 2^20: a re-padded vocabulary would be mostly padding");
  div *= tp;
  return checked_mul((*o.true_vocab_size + div - 1) / div, div, "vocabulary rows");
}

/// `t` with `rows` rows: chunks cut, or the last row repeated into the new rows (a stride-0 chunk
/// over the stored last row: nothing is copied while describing).
inline void resize_rows(TensorInfo& t, std::uint64_t rows) {
  const auto old = static_cast<std::uint64_t>(t.shape[0]);
  if (rows == old) return;
  std::vector<Chunk> out;
  for (Chunk& c : t.chunks) {
    if (!std::holds_alternative<Box>(c.region))
      throw_error(errors::mg_write_input, "tensor " + quote(t.name), "is described by flat ranges; a vocabulary re-pad needs boxes");
    Box& b = std::get<Box>(c.region);
    const auto off = static_cast<std::uint64_t>(b.offsets[0]), n = static_cast<std::uint64_t>(b.sizes[0]);
    if (rows > old && off <= old - 1 && old - 1 < off + n) {
      const std::vector<std::uint64_t> st = storage_strides(c, "tensor " + quote(t.name));
      Chunk g = c;
      Box& gb = std::get<Box>(g.region);
      gb.offsets[0] = static_cast<dim_t>(old);
      gb.sizes[0] = static_cast<dim_t>(rows - old);
      g.at.byte_offset = checked_add(c.at.byte_offset, checked_mul(checked_mul(old - 1 - off, st[0], "offset"), itemsize(c.at.stored), "offset"), "offset");
      g.at.strides.clear();
      for (std::uint64_t s : st) g.at.strides.push_back(static_cast<dim_t>(s));
      g.at.strides[0] = 0;
      out.push_back(std::move(g));
    }
    if (off >= rows) continue;
    b.sizes[0] = static_cast<dim_t>(std::min(n, rows - off));
    out.push_back(std::move(c));
  }
  t.shape[0] = static_cast<dim_t>(rows);
  t.chunks = std::move(out);
}

/// The piece shape of TP rank r and its boxes in the full tensor (pairs of: box, first row of the
/// piece it fills).
inline std::pair<shape_t, std::vector<std::pair<Box, std::uint64_t>>> split_piece(const TensorInfo& t, split how, std::uint64_t r, std::uint64_t tp,
                                                                                  const facts& f) {
  const std::string who = "tensor " + quote(t.name);
  auto part = [&](std::size_t dim) {
    if (t.shape.size() <= dim)
      throw_error(errors::mg_write_split, who, "a " + std::string(to_string(how)) + " tensor needs " + std::to_string(dim + 1) + " dimension(s), it has shape " + to_string(t.shape));
    const auto n = static_cast<std::uint64_t>(t.shape[dim]);
    if (n % tp != 0) throw_error(errors::mg_write_split, who, "dimension " + std::to_string(dim) + " of " + to_string(t.shape) + " does not split over TP " + std::to_string(tp));
    return n / tp;
  };
  shape_t piece = t.shape;
  Box box = full_box(t.shape);
  switch (how) {
    case split::replicated: return {piece, {{box, 0}}};
    case split::row: {
      const std::uint64_t n = part(1);
      piece[1] = box.sizes[1] = static_cast<dim_t>(n);
      box.offsets[1] = static_cast<dim_t>(r * n);
      return {piece, {{box, 0}}};
    }
    case split::qkv:
      if (f.groups % tp != 0 || f.heads % tp != 0 || static_cast<std::uint64_t>(t.shape.empty() ? 0 : t.shape[0]) != (f.heads + 2 * f.groups) * f.kv_channels)
        throw_error(errors::mg_write_split, who, "QKV of " + to_string(t.shape) + " does not split into whole query groups (" + std::to_string(f.heads) + " heads, " +
                                                      std::to_string(f.groups) + " groups of " + std::to_string(f.kv_channels) + ") over TP " + std::to_string(tp));
      [[fallthrough]];
    case split::column:
    case split::vocab: {
      const std::uint64_t n = part(0);
      piece[0] = box.sizes[0] = static_cast<dim_t>(n);
      box.offsets[0] = static_cast<dim_t>(r * n);
      return {piece, {{box, 0}}};
    }
    case split::glu: {
      const std::uint64_t full = part(0) * tp;
      if (full % (2 * tp) != 0) throw_error(errors::mg_write_split, who, "[W; V] of " + std::to_string(full) + " rows does not split into halves over TP " + std::to_string(tp));
      const std::uint64_t h = full / 2 / tp;
      piece[0] = static_cast<dim_t>(2 * h);
      Box w = box, v = box;
      w.sizes[0] = v.sizes[0] = static_cast<dim_t>(h);
      w.offsets[0] = static_cast<dim_t>(r * h);
      v.offsets[0] = static_cast<dim_t>(full / 2 + r * h);
      return {piece, {{w, 0}, {v, h}}};
    }
    case split::fc1: break;
  }
  throw_error(errors::mg_bad_rule, who, "rule fc1 reached the writer unresolved");
}

}  // namespace detail
}  // namespace statedict::inline v0::megatron
