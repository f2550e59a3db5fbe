// statedict: directories of ShardedTensor rank files (`rank<N>.pt`, OLMo's legacy sharded
// checkpointer): detect and describe.
// SPDX-License-Identifier: MIT
//
// Each rank torch.save()s the same nested state dict; sharded parameters are ShardedTensor objects
// (torch.distributed._shard.sharded_tensor), pickled as
//   torch._tensor._rebuild_from_type_v2(torch._utils._rebuild_wrapper_subclass, ShardedTensor,
//       (ShardedTensor, dtype, size, stride, storage_offset, layout, device, requires_grad),
//       (local_shards, ShardedTensorMetadata, ProcessGroupState, sharding_spec, init_rrefs))
// with `local_shards` a list of Shard(tensor, ShardMetadata(shard_offsets, shard_sizes, placement))
// and ShardedTensorMetadata(shards_metadata, size, tensor_properties) the global view (identical on
// every rank). Every rank file is read with the safe unpickler (unknown classes kept as opaque
// objects, never executed) and no tensor data is read: each global tensor's chunks point at its
// local shards' storage records inside the rank files. Plain tensors and non-tensor values come from
// rank 0; `options::check_replicas` compares them across ranks.
//
// The dtype: torch 1.13's loader ignores the pickled wrapper dtype (a loaded bf16 ShardedTensor
// reports float32), so it is taken from the metadata's tensor_properties and checked against the
// wrapper argument and every local shard. docs/formats/sharded-tensor.md has the details.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "../core/dtype.hpp"
#include "../core/error.hpp"
#include "../core/shape.hpp"
#include "../core/source.hpp"
#include "../core/tensor.hpp"
#include "../core/value.hpp"
#include "../core/visit.hpp"
#include "../io/file.hpp"
#include "../io/zip.hpp"
#include "../shard/box.hpp"
#include "../shard/checkpoint.hpp"
#include "../shard/cover.hpp"
#include "detail/describe_tree.hpp"
#include "detail/files.hpp"
#include "format.hpp"
#include "detail/pyobj.hpp"
#include "detail/torch_refs.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id st_no_rank_files     {780, error_kind::format, "sharded_tensor.no_rank_files"};
inline constexpr error_id st_bad_rank_set      {781, error_kind::format, "sharded_tensor.bad_rank_set"};
inline constexpr error_id st_bad_object        {782, error_kind::format, "sharded_tensor.bad_object"};
inline constexpr error_id st_dtype_mismatch    {783, error_kind::format, "sharded_tensor.dtype_mismatch"};
inline constexpr error_id st_rank_disagreement {784, error_kind::format, "sharded_tensor.rank_disagreement"};
inline constexpr error_id st_shard_mismatch    {785, error_kind::format, "sharded_tensor.shard_mismatch"};
inline constexpr error_id st_incomplete        {786, error_kind::format, "sharded_tensor.incomplete"};
inline constexpr error_id st_replica_mismatch  {787, error_kind::format, "sharded_tensor.replica_mismatch"};
inline constexpr error_id st_too_many_ranks    {788, error_kind::limit,  "sharded_tensor.too_many_ranks"};
// clang-format on
}  // namespace errors

namespace sharded_tensor {

/// Caps on hostile rank files.
struct limits {
  /// Rank files in one directory.
  std::uint64_t max_ranks = 1U << 16;
  /// Dimensions of one tensor.
  std::size_t max_dims = 64;
  /// Shards listed in one ShardedTensor's metadata.
  std::uint64_t max_shards = 1U << 20;
  /// The unpickler's caps for each rank file's `data.pkl`.
  pickle::limits pickle{};
  /// Bytes of one rank file's `data.pkl` read into memory.
  std::uint64_t max_pickle_bytes = std::uint64_t{1} << 30;
};

struct options {
  sharded_tensor::limits limits{};
  read_mode mode = read_mode::mmap;
  /// Compare the non-tensor values and the plain (replicated) tensors of every rank with rank 0's,
  /// reading the tensors' bytes; a difference is errors::st_replica_mismatch. Off by default: the
  /// structure (names, kinds, global metadata) is always checked, values and bytes only with this.
  bool check_replicas = false;
};

/// What detect() found (the same shape as the other formats' detection).
struct detection {
  bool found = false;
  /// The rule that matched, or what was looked for and what was found instead.
  std::string rule;
  std::uint32_t world_size = 0;  ///< rank files found
};

namespace detail {
namespace po = statedict::detail::pyobj;
namespace tr = statedict::detail::torch_refs;

inline constexpr std::string_view st_module = "torch.distributed._shard.sharded_tensor.api";

using formats::detail::rank_files;

/// True when `v` is a pickled ShardedTensor (_rebuild_from_type_v2 of _rebuild_wrapper_subclass).
inline bool is_sharded_tensor(const Value& v) {
  if (!po::is_class(v, {"torch._tensor._rebuild_from_type_v2"})) return false;
  const List& a = v.as_object().args;
  return a.size() == 4 && po::is_global(a[1], st_module, "ShardedTensor");
}

/// One shard of a ShardedTensor's global metadata.
struct ShardMeta {
  shape_t offsets;
  shape_t sizes;
  std::uint64_t rank = 0;
  friend bool operator==(const ShardMeta&, const ShardMeta&) = default;
};

/// A ShardedTensor as one rank saw it.
struct Parsed {
  statedict::dtype dtype = statedict::dtype::F32;
  shape_t size;
  std::vector<ShardMeta> shards;  ///< global metadata, in placement order
  /// Local shards: (index into `shards`, tensor reference index in the rank's tree).
  std::vector<std::pair<std::size_t, std::size_t>> local;
};

inline shape_t dims(const po::Where& w, const Value& v, const limits& lim) {
  shape_t s = po::as_ints(errors::st_bad_object, errors::st_bad_object, lim.max_dims, w, v);
  for (dim_t d : s)
    if (d < 0) throw_error(errors::st_bad_object, w.text(), "negative value in " + to_string(s));
  return s;
}

inline ShardMeta shard_meta(const po::Where& w, const Value& v, const limits& lim) {
  if (!po::is_class(v, {"torch.distributed._shard.metadata.ShardMetadata"}))
    po::expected(errors::st_bad_object, w, "a ShardMetadata object", v);
  const po::AttrView a = po::require_attributes(errors::st_bad_object, w, v, "ShardMetadata");
  ShardMeta m;
  m.offsets = dims(w / "shard_offsets", po::field(errors::st_bad_object, w, a, "shard_offsets"), lim);
  m.sizes = dims(w / "shard_sizes", po::field(errors::st_bad_object, w, a, "shard_sizes"), lim);
  const Value& pl = po::field(errors::st_bad_object, w, a, "placement");
  const po::Where pw = w / "placement";
  if (!po::is_class(pl, {"torch.distributed.remote_device._remote_device"}))
    po::expected(errors::st_bad_object, pw, "a _remote_device object", pl);
  const po::AttrView pa = po::require_attributes(errors::st_bad_object, pw, pl, "_remote_device");
  const Value& rank = po::field(errors::st_bad_object, pw, pa, "_rank");
  if (rank.is_none())
    throw_error(errors::st_bad_object, (pw / "_rank").text(), "placement by worker name is not supported (no rank)");
  m.rank = po::as_count(errors::st_bad_object, errors::st_bad_object, pw / "_rank", rank);
  return m;
}

/// The dtype of TensorProperties (state tuple or attribute dict).
inline std::optional<dtype> properties_dtype(const po::Where& w, const Value& v, std::string& tname) {
  if (!po::is_class(v, {"torch.distributed._shard.sharded_tensor.metadata.TensorProperties"}))
    po::expected(errors::st_bad_object, w, "a TensorProperties object", v);
  const Object& o = v.as_object();
  if (o.state.size() == 1 && o.state[0].is_tuple() && !o.state[0].as_list().empty())
    return po::torch_dtype(errors::st_bad_object, w / "dtype", o.state[0].as_list()[0], &tname);
  const po::AttrView a = po::require_attributes(errors::st_bad_object, w, v, "TensorProperties");
  return po::torch_dtype(errors::st_bad_object, w / "dtype", po::field(errors::st_bad_object, w, a, "dtype"), &tname);
}

inline Parsed parse(const po::Where& w, const Value& v, const tr::Tree& tree, std::uint64_t file_rank, const limits& lim) {
  const List& a = v.as_object().args;
  if (!po::is_global(a[0], "torch._utils", "_rebuild_wrapper_subclass"))
    po::expected(errors::st_bad_object, w, "a ShardedTensor rebuilt by torch._utils._rebuild_wrapper_subclass", a[0]);
  if (!a[2].is_sequence() || a[2].as_list().size() < 3)
    po::expected(errors::st_bad_object, w / "args", "the wrapper's (cls, dtype, size, ...) tuple", a[2]);
  const List& wa = a[2].as_list();
  std::string wname;
  const auto wdtype = po::torch_dtype(errors::st_bad_object, w / "args" / std::size_t{1}, wa[1], &wname);
  const shape_t wsize = dims(w / "args" / std::size_t{2}, wa[2], lim);
  if (!a[3].is_tuple() || a[3].as_list().size() < 2)
    po::expected(errors::st_bad_object, w / "state", "the ShardedTensor state (local_shards, metadata, ...)", a[3]);
  const List& st = a[3].as_list();
  const Value& md = st[1];
  const po::Where mw = w / "state" / "metadata";
  if (!po::is_class(md, {"torch.distributed._shard.sharded_tensor.metadata.ShardedTensorMetadata"}))
    po::expected(errors::st_bad_object, mw, "a ShardedTensorMetadata object", md);
  const po::AttrView ma = po::require_attributes(errors::st_bad_object, mw, md, "ShardedTensorMetadata");
  Parsed p;
  p.size = dims(mw / "size", po::field(errors::st_bad_object, mw, ma, "size"), lim);
  (void)numel(p.size);
  std::string tname;
  const auto mdtype = properties_dtype(mw / "tensor_properties", po::field(errors::st_bad_object, mw, ma, "tensor_properties"), tname);
  if (!mdtype) throw_error(errors::st_bad_object, (mw / "tensor_properties").text(), "dtype torch." + tname + " is not supported");
  p.dtype = *mdtype;
  if (!wdtype || *wdtype != p.dtype)
    throw_error(errors::st_dtype_mismatch, w.text(),
                "the wrapper says torch." + wname + ", the metadata's tensor_properties say " + std::string(name(p.dtype)));
  if (wsize != p.size)
    throw_error(errors::st_bad_object, w.text(), "the wrapper's size " + to_string(wsize) + " differs from the metadata's " + to_string(p.size));
  const Value& sm = po::field(errors::st_bad_object, mw, ma, "shards_metadata");
  if (!sm.is_list()) po::expected(errors::st_bad_object, mw / "shards_metadata", "a list of ShardMetadata", sm);
  if (sm.as_list().size() > lim.max_shards)
    throw_error(errors::st_bad_object, (mw / "shards_metadata").text(),
                std::to_string(sm.as_list().size()) + " shards exceed limits.max_shards");
  const Box whole = full_box(p.size);
  for (std::size_t i = 0; i < sm.as_list().size(); ++i) {
    const po::Where sw = mw / "shards_metadata" / i;
    ShardMeta m = shard_meta(sw, sm.as_list()[i], lim);
    if (m.offsets.size() != p.size.size() || m.sizes.size() != p.size.size() || !contains(whole, Box{m.offsets, m.sizes}))
      throw_error(errors::st_incomplete, sw.text(),
                  "shard at offsets " + to_string(m.offsets) + " with sizes " + to_string(m.sizes) +
                      " is not inside the tensor's size " + to_string(p.size));
    p.shards.push_back(std::move(m));
  }
  // Local shards
  const Value& ls = st[0];
  if (!ls.is_list()) po::expected(errors::st_bad_object, w / "state" / "local_shards", "a list of Shard", ls);
  for (std::size_t i = 0; i < ls.as_list().size(); ++i) {
    const po::Where sw = w / "state" / "local_shards" / i;
    const Value& s = ls.as_list()[i];
    if (!po::is_class(s, {"torch.distributed._shard.sharded_tensor.shard.Shard"}))
      po::expected(errors::st_bad_object, sw, "a Shard object", s);
    const po::AttrView sa = po::require_attributes(errors::st_bad_object, sw, s, "Shard");
    const Value& t = po::field(errors::st_bad_object, sw, sa, "tensor");
    if (!tr::is_ref(t)) po::expected(errors::st_bad_object, sw / "tensor", "a saved tensor", t);
    ShardMeta m = shard_meta(sw / "metadata", po::field(errors::st_bad_object, sw, sa, "metadata"), lim);
    if (m.rank != file_rank)
      throw_error(errors::st_shard_mismatch, sw.text(),
                  "local shard placed on rank " + std::to_string(m.rank) + " is in the file of rank " + std::to_string(file_rank));
    auto it = std::find(p.shards.begin(), p.shards.end(), m);
    if (it == p.shards.end())
      throw_error(errors::st_shard_mismatch, sw.text(),
                  "local shard at offsets " + to_string(m.offsets) + " with sizes " + to_string(m.sizes) +
                      " is not in the global shards_metadata");
    const tr::TensorRef& r = tree.tensors[tr::ref_index(t)];
    if (r.dtype != p.dtype)
      throw_error(errors::st_dtype_mismatch, (sw / "tensor").text(),
                  "local shard is " + std::string(name(r.dtype)) + ", the metadata says " + std::string(name(p.dtype)));
    if (r.sizes != m.sizes)
      throw_error(errors::st_shard_mismatch, (sw / "tensor").text(),
                  "local shard tensor has size " + to_string(r.sizes) + ", its metadata says " + to_string(m.sizes));
    const auto idx = static_cast<std::size_t>(it - p.shards.begin());
    for (const auto& l : p.local)
      if (l.first == idx) throw_error(errors::st_shard_mismatch, sw.text(), "the same shard appears twice");
    p.local.emplace_back(idx, tr::ref_index(t));
  }
  return p;
}

/// Kind signature of a tree for cross-rank comparison: containers and leaf kinds by path, with
/// sharded tensors and plain tensors marked.
inline void check_same_structure(const Value& a, const Value& b, std::uint64_t rank, const std::string& where) {
  std::vector<std::pair<std::string, std::string>> sa, sb;
  auto sig = [](const Value& root, std::vector<std::pair<std::string, std::string>>& out) {
    visit(root, [&](const Path& p, const Value& v) {
      std::string k;
      if (tr::is_ref(v)) k = "tensor";
      else if (is_sharded_tensor(v)) k = "ShardedTensor";
      else k = po::kind_of(v);
      out.emplace_back(dotted(p), std::move(k));
      return (tr::is_ref(v) || is_sharded_tensor(v)) ? visit_control::skip : visit_control::descend;
    });
  };
  sig(a, sa);
  sig(b, sb);
  const std::size_t n = std::min(sa.size(), sb.size());
  for (std::size_t i = 0; i < n; ++i)
    if (sa[i] != sb[i])
      throw_error(errors::st_rank_disagreement, where,
                  "rank 0 has " + sa[i].second + " at " + quote(sa[i].first) + ", rank " + std::to_string(rank) +
                      " has " + sb[i].second + " at " + quote(sb[i].first));
  if (sa.size() != sb.size())
    throw_error(errors::st_rank_disagreement, where,
                "rank 0 and rank " + std::to_string(rank) + " hold different numbers of entries (" +
                    std::to_string(sa.size()) + " and " + std::to_string(sb.size()) + ")");
}

/// Reads the elements of a tensor reference, row-major (for replica comparison).
inline std::vector<std::byte> gather(const ByteSource& src, const tr::TensorRef& r) {
  const std::size_t is = itemsize(r.dtype);
  const std::uint64_t n = numel(r.sizes);
  std::vector<std::byte> out(static_cast<std::size_t>(checked_mul(n, is, "tensor bytes")));
  if (n == 0) return out;
  const std::uint64_t base = r.byte_offset();
  if (is_contiguous(r.sizes, r.strides)) {
    src.read(base, out);
    return out;
  }
  shape_t idx(r.sizes.size(), 0);
  for (std::uint64_t e = 0; e < n; ++e) {
    std::uint64_t off = 0;
    for (std::size_t d = 0; d < idx.size(); ++d) off += static_cast<std::uint64_t>(idx[d] * r.strides[d]);
    src.read(base + off * is, std::span<std::byte>(out.data() + e * is, is));
    for (std::size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < r.sizes[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

}  // namespace detail

/// Says from content whether `dir` holds ShardedTensor rank files: `rank0.pt` .. `rank<W-1>.pt`
/// where `rank0.pt` is a torch.save zip archive whose `data.pkl` names the ShardedTensor class.
/// Never throws for other directories. `rule` names the rule that matched, or says what was looked
/// for and what was found.
inline detection detect(const std::filesystem::path& dir) {
  detection d;
  const std::string wanted = "sharded_tensor_ranks: wanted rank0.pt .. rank<W-1>.pt holding ShardedTensor objects; found ";
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    d.rule = wanted + "no directory";
    return d;
  }
  const auto files = detail::rank_files(dir);
  bool consecutive = true;
  for (std::size_t i = 0; i < files.size(); ++i) consecutive = consecutive && files[i].first == i;
  if (files.empty() || !consecutive) {
    d.rule = wanted + std::to_string(files.size()) + " rank<N>.pt file(s)" + (files.empty() ? "" : ", not numbered 0 .. W-1");
    return d;
  }
  const std::string n = std::to_string(files.size()) + " rank file(s)";
  try {
    auto f = InputFile::open(files.front().second, read_mode::pread);
    const zip::Archive ar = zip::Archive::open(f);
    const std::string first = ar.entries().empty() ? std::string() : ar.entries().front().name;
    const zip::Entry* pkl = ar.find(first.substr(0, first.find('/') + 1) + "data.pkl");
    if (!pkl) {
      d.rule = wanted + n + "; rank0.pt is a zip archive without data.pkl";
      return d;
    }
    const Region r = ar.read(*pkl);
    const std::string_view text(reinterpret_cast<const char*>(r.data), static_cast<std::size_t>(r.size));
    if (text.find("torch.distributed._shard.sharded_tensor.api\nShardedTensor\n") != std::string_view::npos) {
      d.found = true;
      d.world_size = static_cast<std::uint32_t>(files.size());
      d.rule = "sharded_tensor_ranks: rank0.pt is a torch.save archive whose pickle holds ShardedTensor objects (" + n + ")";
    } else {
      d.rule = wanted + n + "; rank0.pt's pickle does not name torch.distributed._shard.sharded_tensor.api.ShardedTensor";
    }
  } catch (const error& e) {
    d.rule = wanted + n + "; rank0.pt is not a readable torch.save archive (" + std::string(e.what()) + ")";
  }
  return d;
}

/// Reads every rank file of `dir` and describes the global tensors (see the top of this file).
inline ShardedCheckpoint describe(const std::filesystem::path& dir, const options& opt = {}) {
  namespace po = statedict::detail::pyobj;
  namespace tr = statedict::detail::torch_refs;
  const auto files = detail::rank_files(dir);
  const std::string dwhere = "directory " + quote(dir.string());
  if (files.empty()) throw_error(errors::st_no_rank_files, dwhere, "no rank<N>.pt files");
  if (files.size() > opt.limits.max_ranks)
    throw_error(errors::st_too_many_ranks, dwhere,
                std::to_string(files.size()) + " rank files exceed limits.max_ranks (" + std::to_string(opt.limits.max_ranks) + ")");
  for (std::size_t i = 0; i < files.size(); ++i)
    if (files[i].first != i)
      throw_error(errors::st_bad_rank_set, dwhere,
                  "rank files must be rank0.pt .. rank" + std::to_string(files.size() - 1) + ".pt; rank" +
                      std::to_string(i) + ".pt is missing");
  const auto world = static_cast<std::uint32_t>(files.size());

  ShardedCheckpoint ck;
  std::vector<TensorInfo> tensors;  // unnamed, indexed by the placeholders of `tree`
  ck.format = "sharded_tensor_ranks";
  ck.metadata["sharded_tensor.world_size"] = std::to_string(world);

  tr::load_options lo;
  lo.pickle = opt.limits.pickle;
  lo.max_pickle_bytes = opt.limits.max_pickle_bytes;
  std::vector<tr::Tree> trees;
  trees.reserve(world);
  for (const auto& [rank, path] : files) {
    auto f = InputFile::open(path, opt.mode);
    ck.sources.push_back(f);
    try {
      trees.push_back(tr::load(f, lo));
    } catch (error& e) {
      e.add_context("file " + quote(path.string()));
      throw;
    }
  }
  for (std::uint32_t r = 1; r < world; ++r)
    detail::check_same_structure(trees[0].value, trees[r].value, r, dwhere);

  // Sharded tensors: rank 0's tree gives the names; each rank's copy gives its local shards.
  struct Found {
    Path path;
    std::vector<detail::Parsed> per_rank;
  };
  std::vector<Found> found;
  visit(trees[0].value, [&](const Path& p, const Value& v) {
    if (!detail::is_sharded_tensor(v)) return visit_control::descend;
    found.push_back(Found{p, {}});
    return visit_control::skip;
  });
  for (Found& f : found) {
    for (std::uint32_t r = 0; r < world; ++r) {
      const po::Where w{"file " + quote(files[r].second.string()), dotted(f.path)};
      const Value* v = find_path(trees[r].value, f.path);
      f.per_rank.push_back(detail::parse(w, *v, trees[r], r, opt.limits));
    }
  }

  // Rank 0's tree, with every tensor a placeholder indexing `tensors`.
  std::size_t next_found = 0;
  Value tree = transform(trees[0].value, [&](const Path& p, const Value& v) -> std::optional<Value> {
    if (detail::is_sharded_tensor(v)) {
      const Found& f = found[next_found++];
      const detail::Parsed& p0 = f.per_rank[0];
      const std::string tensor_name = dotted(p);
      const std::string where = dwhere + ": ShardedTensor " + quote(tensor_name);
      for (std::uint32_t r = 1; r < world; ++r) {
        const detail::Parsed& pr = f.per_rank[r];
        if (pr.dtype != p0.dtype || pr.size != p0.size || pr.shards != p0.shards)
          throw_error(errors::st_rank_disagreement, where,
                      "rank " + std::to_string(r) + "'s global metadata (dtype, size or shards) differs from rank 0's");
      }
      TensorInfo ti;
      ti.name = tensor_name;
      ti.dtype = p0.dtype;
      ti.shape = p0.size;
      std::vector<Box> boxes;
      for (std::size_t s = 0; s < p0.shards.size(); ++s) {
        const detail::ShardMeta& m = p0.shards[s];
        boxes.push_back(Box{m.offsets, m.sizes});
        if (m.rank >= world)
          throw_error(errors::st_incomplete, where,
                      "shard at " + to_string(m.offsets) + " is placed on rank " + std::to_string(m.rank) + " but only " +
                          std::to_string(world) + " rank files exist");
        const detail::Parsed& holder = f.per_rank[m.rank];
        auto it = std::find_if(holder.local.begin(), holder.local.end(), [&](const auto& l) { return l.first == s; });
        if (it == holder.local.end()) {
          if (numel(m.sizes) == 0) continue;
          throw_error(errors::st_incomplete, where,
                      "shard at " + to_string(m.offsets) + " placed on rank " + std::to_string(m.rank) +
                          " is not among that rank file's local shards");
        }
        if (numel(m.sizes) == 0) continue;
        const tr::TensorRef& r = trees[m.rank].tensors[it->second];
        Placement at;
        at.source = static_cast<std::uint32_t>(m.rank);
        at.byte_offset = r.byte_offset();
        at.stored = r.dtype;
        if (!is_contiguous(r.sizes, r.strides)) at.strides = r.strides;
        ti.chunks.push_back(Chunk{Box{m.offsets, m.sizes}, std::move(at)});
      }
      if (numel(ti.shape) > 0) {
        if (auto issue = cover(full_box(ti.shape), boxes, false)) {
          if (issue->what == CoverIssue::kind::hole)
            throw_error(errors::st_incomplete, where, "element " + to_string(issue->index) + " is in no shard");
          throw_error(errors::st_incomplete, where,
                      "shards at " + to_string(boxes[issue->first].offsets) + " and " + to_string(boxes[issue->second].offsets) +
                          " overlap at element " + to_string(issue->index));
        }
      }
      tensors.push_back(std::move(ti));
      return tr::make_ref(tensors.size() - 1);
    }
    if (tr::is_ref(v)) {
      const tr::TensorRef& r = trees[0].tensors[tr::ref_index(v)];
      TensorInfo ti;
      ti.name = dotted(p);
      ti.dtype = r.dtype;
      ti.shape = r.sizes;
      if (numel(r.sizes) > 0) {
        Placement at;
        at.source = 0;
        at.byte_offset = r.byte_offset();
        at.stored = r.dtype;
        if (!is_contiguous(r.sizes, r.strides)) at.strides = r.strides;
        ti.chunks.push_back(Chunk{full_box(r.sizes), std::move(at)});
      }
      tensors.push_back(std::move(ti));
      return tr::make_ref(tensors.size() - 1);
    }
    return std::nullopt;
  });

  if (opt.check_replicas) {
    for (std::uint32_t rk = 1; rk < world; ++rk) {
      // Non-tensor leaves equal, plain tensors byte-equal.
      std::vector<const Value*> a, b;
      std::vector<Path> paths;
      auto leaves = [](const Value& root, std::vector<const Value*>& out, std::vector<Path>* ps) {
        visit(root, [&](const Path& p, const Value& v) {
          if (detail::is_sharded_tensor(v)) return visit_control::skip;
          if (!tr::is_ref(v) && v.is_container()) return visit_control::descend;
          out.push_back(&v);
          if (ps) ps->push_back(p);
          return visit_control::skip;
        });
      };
      leaves(trees[0].value, a, &paths);
      leaves(trees[rk].value, b, nullptr);
      for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
        const std::string where = dwhere + ": rank " + std::to_string(rk) + ": key " + quote(dotted(paths[i]));
        if (tr::is_ref(*a[i])) {
          const auto& ra = trees[0].tensors[tr::ref_index(*a[i])];
          const auto& rb = trees[rk].tensors[tr::ref_index(*b[i])];
          if (ra.dtype != rb.dtype || ra.sizes != rb.sizes ||
              detail::gather(*ck.sources[0], ra) != detail::gather(*ck.sources[rk], rb))
            throw_error(errors::st_replica_mismatch, where, "replicated tensor differs from rank 0's");
        } else if (!(*a[i] == *b[i])) {
          throw_error(errors::st_replica_mismatch, where, "value differs from rank 0's");
        }
      }
    }
  }
  auto fin = statedict::detail::describe_tree::finish(tree, tensors);
  ck.tensors = std::move(fin.tensors);
  ck.skeleton = std::move(fin.skeleton);
  return ck;
}

// ---------------------------------------------------------------------------------------------
// The plug-in

/// Directories of `rank<N>.pt` files holding ShardedTensors (OLMo's legacy sharded checkpointer).
class format final : public formats::Format {
 public:
  [[nodiscard]] std::string_view name() const noexcept override { return "sharded_tensor_ranks"; }
  [[nodiscard]] std::string_view title() const noexcept override { return "ShardedTensor rank files"; }

  [[nodiscard]] formats::Detection detect(const formats::Input& in, const formats::open_options&) const override {
    if (!in.is_directory()) return formats::Detection::not_applicable();
    detection d = sharded_tensor::detect(in.path());
    return d.found ? formats::Detection::match(std::move(d.rule)) : formats::Detection::miss(std::move(d.rule));
  }
  [[nodiscard]] ShardedCheckpoint describe(const formats::Input& in, const formats::open_options& opt) const override {
    options o = opt.settings.get<options>();
    o.mode = opt.mode;
    o.check_replicas = o.check_replicas || opt.check_replicas;
    return sharded_tensor::describe(in.path(), o);
  }
};

}  // namespace sharded_tensor
}  // namespace statedict::inline v0
