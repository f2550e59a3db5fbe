// statedict: torch.save files as a format plug-in, and their writers (a described checkpoint, or
// a Value tree of tensors), both through the planner and the streaming executor.
// SPDX-License-Identifier: MIT
//
// Reading and the file plan (pickle, zip layout, where each storage goes) are io/torch_file.hpp.
// Writing fills the storages of a SavePlan with the executor (any thread count, bounded memory,
// CRCs computed as the bytes go by) and lets PlannedWriter write the zip framing around them and
// commit the file atomically.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "../core/value.hpp"
#include "../exec/executor.hpp"
#include "../exec/sink.hpp"
#include "../io/file.hpp"
#include "../io/torch_file.hpp"
#include "../io/torch_save.hpp"
#include "../shard/checkpoint.hpp"
#include "../shard/plan.hpp"
#include "../shard/views.hpp"
#include "detail/files.hpp"
#include "detail/safetensors_write.hpp"
#include "format.hpp"
#include "transform.hpp"

namespace statedict::inline v0 {

namespace torch {

namespace detail {
/// Streams `src` into the storages of `sp` (where `dst` says each of src's tensors goes) and
/// completes the file at `path`.
inline void write_planned(SavePlan sp, const ShardedCheckpoint& src, const Destination& dst, const std::filesystem::path& path,
                          const exec_options& exec, const plan_options& popt) {
  std::vector<FlatRange> regions = sp.storage_ranges();
  std::sort(regions.begin(), regions.end(), [](const FlatRange& a, const FlatRange& b) { return a.begin < b.begin; });
  statedict::detail::report_progress(exec, progress_phase::planning);
  const Plan plan = make_plan(src, dst, popt);
  PlannedWriter w(path, std::move(sp));
  try {
    FileSink sink(w.file());
    if (exec.direct_io) (void)sink.use_direct_io();
    sink.track_crc32(regions);
    std::vector<Sink*> sinks{&sink};
    (void)execute(plan, src, sinks, exec);
    for (std::size_t i = 0; i < regions.size(); ++i)
      if (regions[i].size()) w.report_file_crc(regions[i].begin, regions[i].size(), sink.crc32(i));
    statedict::detail::report_progress(exec, progress_phase::syncing, plan.bytes(), plan.bytes(), path.filename().string());
    w.finish();
  } catch (error& e) {
    e.add_context("file " + quote(path.string()));
    throw;
  }
}
}  // namespace detail

/// Writes `tree` as a torch.save file at `path`, atomically (temporary name, fsync, rename),
/// streaming every storage through the executor: no buffer holds more than the pickle and the
/// executor's blocks.
inline void save(const std::filesystem::path& path, const Value& tree, save_options opts = {}, const exec_options& exec = {}) {
  if (opts.archive_name.empty()) opts.archive_name = archive_name_for(path.filename());
  SavePlan sp = plan_save(tree, opts);
  // Each storage is one byte tensor, copied from where its tensors' memory is.
  ShardedCheckpoint src;
  src.format = "memory";
  Destination dst;
  dst.names.push_back(path.filename().string());
  dst.sizes.push_back(sp.file_size());
  for (std::size_t i = 0; i < sp.storages.size(); ++i) {
    const PlannedStorage& s = sp.storages[i];
    if (s.nbytes == 0) continue;
    if (!s.source) throw_error(errors::pt_unwritable, "storage " + quote(s.key), "has no source bytes");
    std::string name = "storage " + s.key;
    const TensorInfo& t = add_stored(src, name, dtype::U8, shape_t{static_cast<dim_t>(s.nbytes)},
                                     std::make_shared<MemorySource>(name, s.source, s.nbytes, s.owner), 0);
    dst.tensors.push_back(formats::detail::whole_at(t, 0, sp.storage_offset(i)));
  }
  detail::write_planned(std::move(sp), src, dst, path, exec, plan_options{});
}

/// Writes a File read earlier (its attributes included) to `path`.
inline void save(const std::filesystem::path& path, const File& file, save_options opts = {}, const exec_options& exec = {}) {
  if (opts.attributes.empty()) opts.attributes = file.attributes;
  save(path, file.value, std::move(opts), exec);
}

}  // namespace torch

namespace formats {

/// Writes a torch.save file that torch.load reads back as the checkpoint's tree (its skeleton;
/// a flat dict when it has none). Storage CRCs are computed as the bytes are written.
inline void write_torch(const ShardedCheckpoint& ck, const std::filesystem::path& path, const save_options& opt = {}) {
  check_consistent(ck);
  torch::save_options so;
  so.archive_name = torch::archive_name_for(path.filename());
  so.pickle.keep_classes = opt.keep_classes;  // every other object is pickled as its data
  torch::SavePlan sp = torch::plan_save(ck, so);
  const Destination dst = sp.destination(path.filename().string());
  torch::detail::write_planned(std::move(sp), ck, dst, path, opt.exec, opt.plan);
}

}  // namespace formats

namespace torch {

/// torch.save files (zip, and the legacy format before 1.6): read zero-copy, never running pickled
/// code; written so that torch.load (also with weights_only=True) reads them back.
class format final : public formats::Format {
 public:
  [[nodiscard]] std::string_view name() const noexcept override { return "torch"; }
  [[nodiscard]] std::string_view title() const noexcept override { return "torch.save"; }

  [[nodiscard]] formats::Detection detect(const formats::Input& in, const formats::open_options&) const override {
    if (in.is_directory()) return formats::Detection::not_applicable();
    switch (kind_of(in.head(), in.file()->size())) {
      case file_kind::zip: return formats::Detection::match("torch.save: zip archive");
      case file_kind::legacy:
      case file_kind::legacy_tar: return formats::Detection::match("torch.save: legacy (pre-1.6) format");
      case file_kind::unknown: break;
    }
    return formats::Detection::miss("neither a zip archive (PK\\x03\\x04) nor the legacy magic number pickled at protocol 0-5");
  }
  [[nodiscard]] ShardedCheckpoint describe(const formats::Input& in, const formats::open_options& opt) const override {
    load_options o = opt.settings.get<load_options>();
    o.mode = opt.mode;
    return torch::describe(in.file(), o);
  }

  [[nodiscard]] bool can_write() const noexcept override { return true; }
  [[nodiscard]] formats::output_claim claims_output(const std::filesystem::path& out, const formats::save_options&) const override {
    for (const char* ext : {".pt", ".pth", ".bin", ".ckpt"})
      if (formats::detail::has_extension(out, ext)) return formats::output_claim::by_name;
    return formats::output_claim::none;
  }
  void check_output(const std::filesystem::path&, const formats::save_options& opt) const override {
    formats::detail::refuse_option(opt.max_shard_size.has_value(), "--max-shard-size", "a torch.save file", "it is one file");
    formats::detail::refuse_option(opt.world_size.has_value(), "--world-size", "a torch.save file", "it is for DCP output");
    formats::detail::refuse_option(opt.part.has_value() || opt.index_only, "--part", "a single file",
                                   "parts split outputs of several files (Hugging Face shards, DCP)");
  }
  std::vector<std::string> save(const ShardedCheckpoint& ck, const std::filesystem::path& out, const formats::save_options& opt) const override {
    formats::write_torch(ck, out, opt);
    return {out.filename().string()};
  }
};

}  // namespace torch
}  // namespace statedict::inline v0
