// statedict: ColossalAI checkpoints (HybridParallelCheckpointIO) as a format plug-in: read in both
// layouts, written in the distributed one.
// SPDX-License-Identifier: MIT
//
// - The distributed model layout (gather_dtensor=False, ColossalAI PR 6181): per tensor-parallel /
//   pipeline rank a `pytorch_model-meta-dist-XXXXX(.index).json` of boxes and the rank's weight
//   files. Described as whole parameters, each a tensor whose chunks are the ranks' boxes, the
//   cover proven (formats/detail/colossalai_dist.hpp). Written for M ranks with
//   `convert --to colossalai --world-size M` (formats/detail/colossalai_write.hpp; the split dim
//   per tensor can be stated with `settings.set<colossalai::save_settings>()`).
// - The released layout (gather_dtensor=True): whole tensors in shards with an index, and, with
//   `--with-optimizer`, the optimizer shards keyed by parameter id named by the parameter order
//   (formats/detail/colossalai_hybrid.hpp), also in ColossalChat's `modeling/` + `optimizer/`.
// Facts, sources and where ColossalAI's own loader goes wrong: docs/formats/colossalai.md.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "../core/error.hpp"
#include "../shard/checkpoint.hpp"
#include "detail/colossalai_dist.hpp"
#include "detail/colossalai_files.hpp"
#include "detail/colossalai_hybrid.hpp"
#include "detail/colossalai_write.hpp"
#include "format.hpp"

namespace statedict::inline v0::colossalai {

/// What detect() found.
struct detection {
  enum class layout : std::uint8_t { none, distributed, released };
  layout found = layout::none;
  /// The rule that matched, or what was looked for.
  std::string rule;
};

/// Says from content whether `dir` is a ColossalAI checkpoint: metadata files of the distributed
/// layout, or a model index (in `dir` or `dir/modeling`) whose shard files carry ColossalAI's names
/// (`pytorch_model-00001.bin`, `model-stage-00001-shard-00001.safetensors`, ...; Hugging Face
/// names its shards `-of-`). Reads at most the index; never throws for a folder that is not one.
inline detection detect(const std::filesystem::path& dir, const limits& lim = {}) {
  detection d;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return d;
  const auto metas = detail::dist_meta_files(dir);
  if (!metas.empty()) {
    d.found = detection::layout::distributed;
    d.rule = "ColossalAI distributed layout: " + std::to_string(metas.size()) + " pytorch_model-meta-dist-XXXXX(.index).json file(s)";
    return d;
  }
  const auto h = detail::hybrid_dirs(dir);
  if (!h.model_index) {
    d.rule = "looked for pytorch_model-meta-dist-XXXXX.json files or a ColossalAI model index (pytorch_model.bin.index.json, "
             "model.safetensors.index.json, in the folder or in modeling/): found neither";
    return d;
  }
  try {
    const auto ix = detail::read_index(*h.model_index, lim);
    bool ours = !ix.weight_map.empty();
    for (const auto& [n, f] : ix.weight_map) ours = ours && detail::is_hybrid_shard_name(f);
    if (!ours) {
      d.rule = "the shard files of " + quote(h.model_index->string()) + " do not carry ColossalAI's names";
      return d;
    }
  } catch (const error& e) {
    d.rule = "looked for a ColossalAI model index: " + std::string(e.what());
    return d;
  }
  d.found = detection::layout::released;
  d.rule = "ColossalAI released layout: " + quote(h.model_index->lexically_relative(dir).string()) + " over ColossalAI-named shards";
  if (h.optim_index) d.rule += ", optimizer index " + quote(h.optim_index->lexically_relative(dir).string());
  return d;
}

/// Describes the ColossalAI checkpoint at `dir` (either layout). Format "colossalai_dist" or
/// "colossalai_hybrid".
inline ShardedCheckpoint describe(const std::filesystem::path& dir, const options& opt = {}) {
  const detection d = detect(dir, opt.limits);
  if (d.found == detection::layout::distributed) return detail::describe_dist(dir, opt);
  if (d.found == detection::layout::released) return detail::describe_hybrid(dir, opt);
  throw_error(errors::colossalai_not_found, "directory " + quote(dir.string()), d.rule);
}

// ---------------------------------------------------------------------------------------------
// The plug-in

/// ColossalAI checkpoints: the distributed layout (read, and written with --world-size M) and the
/// released layout with its optimizer (read).
class format final : public formats::Format {
 public:
  [[nodiscard]] std::string_view name() const noexcept override { return "colossalai"; }
  [[nodiscard]] std::string_view title() const noexcept override { return "ColossalAI"; }

  [[nodiscard]] formats::Detection detect(const formats::Input& in, const formats::open_options& opt) const override {
    if (!in.is_directory()) return formats::Detection::not_applicable();
    detection d = colossalai::detect(in.path(), opt.settings.get<options>().limits);
    return d.found != detection::layout::none ? formats::Detection::match(std::move(d.rule)) : formats::Detection::miss(std::move(d.rule));
  }
  [[nodiscard]] ShardedCheckpoint describe(const formats::Input& in, const formats::open_options& opt) const override {
    options o = opt.settings.get<options>();
    o.mode = opt.mode;
    o.with_optimizer = o.with_optimizer || opt.with_optimizer;
    return colossalai::describe(in.path(), o);
  }

  [[nodiscard]] bool can_write() const noexcept override { return true; }
  void check_output(const std::filesystem::path&, const formats::save_options& opt) const override {
    if (opt.world_size && (*opt.world_size == 0 || *opt.world_size > (1U << 16)))
      throw_error(errors::colossalai_bad_option, "--world-size " + std::to_string(*opt.world_size), "expected 1 to 65536 ranks");
  }
  std::vector<std::string> save(const ShardedCheckpoint& ck, const std::filesystem::path& out, const formats::save_options& opt) const override {
    auto files = colossalai::write(ck, out, opt);
    std::erase(files, std::string());
    return files;
  }
};

}  // namespace statedict::inline v0::colossalai
