// statedict: writing an output of several files (Hugging Face shards, DCP rank files) from one plan:
// the whole directory atomically, or one part of it from one of several processes, then the index.
// SPDX-License-Identifier: MIT
//
// Every file is a destination of one Destination; the executor streams the planned bytes into all
// of them in bounded memory. A writer adds what only it knows through two callbacks: `prepare`
// before the bytes (a header, the byte regions to checksum) and `finish` after them (zip framing
// that needs the checksums). Without a part the directory appears complete or not at all
// (io/file.hpp OutputDir) and the index is written last inside it; with save_options::part only
// that part's files are written, each atomically, straight into the directory; with
// save_options::index_only only the index, after checking that every planned file exists with its
// planned size. The directory is complete when its index exists (docs/slurm.md).
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/flatten.hpp"
#include "../../exec/executor.hpp"
#include "../../exec/sink.hpp"
#include "../../io/file.hpp"
#include "../../io/torch_save.hpp"
#include "../../io/zip.hpp"
#include "../../shard/checkpoint.hpp"
#include "../../shard/plan.hpp"
#include "../format.hpp"

namespace statedict::inline v0::formats::detail {

struct file_set {
  /// The files (dst.names, relative to the directory) and where each tensor element goes.
  Destination dst;
  /// Called for each file this process writes, before the executor runs.
  std::function<void(std::size_t file, OutputFile&, FileSink&)> prepare;
  /// Called for each file this process writes, after the executor ran, before it is committed.
  std::function<void(std::size_t file, OutputFile&, FileSink&)> finish;
  /// The index: its file name (empty: none) and its bytes (made when needed).
  std::string index_name;
  std::function<std::vector<std::byte>()> index_bytes;
  /// For messages: "DCP checkpoint", "rank file"; the error id of a failed index check.
  std::string what, file_kind;
  const error_id* part_error = &errors::bad_part;
};

/// Writes `files` from `src` into `dir` (see the top of this file); returns the names written.
inline std::vector<std::string> write_file_set(const ShardedCheckpoint& src, const file_set& files, const std::filesystem::path& dir,
                                               const save_options& opt) {
  const auto write_index = [&](auto&& create) {
    if (files.index_name.empty()) return;
    OutputFile f = create(files.index_name);
    f.write(files.index_bytes());
    f.commit();
  };
  const std::size_t n = files.dst.names.size();
  if (opt.index_only) {
    std::filesystem::create_directories(dir);
    std::vector<PlannedFile> planned;
    for (std::size_t k = 0; k < n; ++k) planned.push_back({files.dst.names[k], k < files.dst.sizes.size() ? files.dst.sizes[k] : 0});
    check_parts_written(dir, planned, *files.part_error, files.what, files.file_kind);
    write_index([&](const std::string& name) { return OutputFile::create(dir / name); });
    return {files.index_name};
  }
  statedict::detail::report_progress(opt.exec, progress_phase::planning);
  Plan plan = make_plan(src, files.dst, opt.plan);
  std::vector<bool> mine(n, true);
  if (opt.part) {
    const auto parts = assign_parts(plan, opt.part->count);
    for (std::size_t d = 0; d < n; ++d) mine[d] = parts[d] == opt.part->index;
    plan = select_part(plan, *opt.part);
  }
  std::optional<OutputDir> out;
  if (!opt.part) out.emplace(OutputDir::create(dir));
  else std::filesystem::create_directories(dir);
  std::vector<std::unique_ptr<OutputFile>> outs(n);
  std::vector<std::unique_ptr<FileSink>> sinks(n);
  std::vector<Sink*> ptrs(n, nullptr);
  for (std::size_t d = 0; d < n; ++d) {
    if (!mine[d]) continue;
    const std::string& name = files.dst.names[d];
    outs[d] = std::make_unique<OutputFile>(out ? out->create_file(name) : OutputFile::create(dir / name));
    sinks[d] = std::make_unique<FileSink>(*outs[d]);
    if (opt.exec.direct_io) (void)sinks[d]->use_direct_io();
    if (files.prepare) files.prepare(d, *outs[d], *sinks[d]);
    ptrs[d] = sinks[d].get();
  }
  (void)execute(plan, src, ptrs, opt.exec);
  const std::uint64_t bytes = plan.bytes();
  std::vector<std::string> written;
  for (std::size_t d = 0; d < n; ++d) {
    if (!outs[d]) continue;
    if (files.finish) files.finish(d, *outs[d], *sinks[d]);
    statedict::detail::report_progress(opt.exec, progress_phase::syncing, bytes, bytes, files.dst.names[d]);
    outs[d]->commit();
    written.push_back(files.dst.names[d]);
  }
  if (!out) return written;  // a part: the index step writes the index
  write_index([&](const std::string& name) { return out->create_file(name); });
  if (!files.index_name.empty()) written.push_back(files.index_name);
  statedict::detail::report_progress(opt.exec, progress_phase::syncing, bytes, bytes, files.index_name);
  out->commit();
  return written;
}

/// The tree of `ck` with its tensors as placeholders (address space reserved, never read): what a
/// writer that lays out files of its own reads the checkpoint's non-tensor values from.
inline Value source_tree(const ShardedCheckpoint& ck, std::shared_ptr<torch::detail::reservation>& space) {
  std::uint64_t total = 16;
  std::vector<std::uint64_t> at;
  for (const TensorInfo& t : ck.tensors) {
    at.push_back(total);
    total = checked_add(total, checked_add(byte_size(t.shape, itemsize(t.dtype)), 79, "reservation") / 64 * 64, "reservation");
  }
  space = std::make_shared<torch::detail::reservation>(total);
  NamedTensors named;
  for (std::size_t i = 0; i < ck.tensors.size(); ++i)
    named.emplace_back(ck.tensors[i].name, TensorView::contiguous(ck.tensors[i].dtype, ck.tensors[i].shape, space->base() + at[i], space));
  return unflatten(named, ck.skeleton);
}

/// Writes the zip framing of a planned torch.save file around its storages, whose bytes the
/// executor wrote (their CRCs from the sink, which tracked the storages' byte ranges).
inline void write_torch_framing(const torch::SavePlan& plan, OutputFile& file, const FileSink& sink) {
  WriteCoalescer f(file);
  const auto& regs = sink.crc_regions();
  const auto& L = plan.layout;
  std::vector<std::uint32_t> crcs(plan.records.size(), 0);
  for (std::size_t e = 0; e < plan.records.size(); ++e) {
    const auto& rec = plan.records[e];
    if (!rec.storage) {
      crcs[e] = zip::crc32(rec.bytes);
    } else if (plan.storages[*rec.storage].nbytes > 0) {
      const std::uint64_t data = L.entries[e].data_offset;
      const auto pos = std::lower_bound(regs.begin(), regs.end(), data, [](const FlatRange& a, std::uint64_t x) { return a.begin < x; });
      crcs[e] = sink.crc32(static_cast<std::size_t>(pos - regs.begin()));
    }
    f.write(L.entries[e].header_offset, zip::local_header_bytes(L.entries[e], L.options));
    if (!rec.storage) f.write(L.entries[e].data_offset, rec.bytes);
    f.write(L.entries[e].descriptor_offset, zip::descriptor_bytes(L.entries[e], crcs[e]));
  }
  f.write(L.central_offset, zip::tail_bytes(L, crcs));
  f.flush();
}

/// Makes `files` write the planned torch.save files `plans` (names relative to the directory, in
/// this order as its destinations): each file's storages are checksummed by its sink while the
/// executor writes them, and its zip framing is written after them. The plans must outlive the write.
inline void add_torch_files(file_set& files, const std::vector<std::pair<std::string, const torch::SavePlan*>>& plans) {
  auto crc = std::make_shared<std::vector<std::vector<FlatRange>>>(plans.size());
  std::vector<const torch::SavePlan*> ps;
  for (std::size_t k = 0; k < plans.size(); ++k) {
    const torch::SavePlan& sp = *plans[k].second;
    ps.push_back(&sp);
    files.dst.names.push_back(plans[k].first);
    files.dst.sizes.push_back(sp.file_size());
    for (const FlatRange& r : sp.storage_ranges())
      if (r.size() > 0) (*crc)[k].push_back(r);
    std::sort((*crc)[k].begin(), (*crc)[k].end(), [](const FlatRange& a, const FlatRange& b) { return a.begin < b.begin; });
  }
  files.prepare = [crc](std::size_t k, OutputFile&, FileSink& sink) { sink.track_crc32((*crc)[k]); };
  files.finish = [ps](std::size_t k, OutputFile& f, FileSink& sink) { write_torch_framing(*ps[k], f, sink); };
}

/// The index of `files`: the file `name` holding `text`.
inline void text_index(file_set& files, std::string name, std::string text) {
  files.index_name = std::move(name);
  files.index_bytes = [text = std::move(text)] {
    const auto* b = reinterpret_cast<const std::byte*>(text.data());
    return std::vector<std::byte>(b, b + text.size());
  };
}

}  // namespace statedict::inline v0::formats::detail
