// statedict: flat-partition state, consolidated and re-sharded. The machinery the DeepSpeed ZeRO and
// FSDP flat-parameter readers share: locating loaded tensors in their files, turning a parameter's
// pieces (layout::FlatPiece: rank, elements, offset in the rank's flat buffer) into chunks, and
// merging per-rank optimizer state into one state per parameter, as fairscale's FSDP does it; and the
// reverse, a full optimizer state keyed by parameter name sharded for a ZeRO or FSDP layout.
// SPDX-License-Identifier: MIT
//
// Optimizer state consolidation (fairscale/nn/data_parallel/fsdp_optim_utils.py
// build_unflat_state_dict / _unflatten_optim_state, and fully_sharded_data_parallel.py
// gather_full_optim_state_dict, as summarised in docs/notes/zero-fsdp-layouts.md section 10):
//   - a state tensor with dimensions (exp_avg, exp_avg_sq) is laid out exactly like the flat
//     parameter it belongs to, so each parameter's slice of it is placed with the weight's pieces;
//   - a 0-dim tensor (torch >= 1.12 `step`) and any non-tensor value (an int `step`) is constant
//     across ranks: it is checked equal on every rank that holds it and kept once. (fairscale keeps
//     0-dim tensors as a list of per-rank values; statedict keys state by parameter name and keeps
//     one value, OLMo's rule, and refuses ranks that disagree.)
//   - param_groups are kept (checked equal across ranks by the callers that have them per rank).
// The reverse: optim_shard::destination() lays a full state (`optim.state.<name>.<key>` tensors)
// out as a ZeRO-1/2, ZeRO-3 or FSDP flat layout, one buffer per (rank, state key), which the
// planner fills.
//
// Nothing here reads tensor bytes except 0-dim state (a few bytes per rank, to check they agree) and
// the small integer buffers a caller asks to convert (see SourceTable::add_owned).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../core/dtype.hpp"
#include "../core/error.hpp"
#include "../core/flatten.hpp"
#include "../core/shape.hpp"
#include "../core/source.hpp"
#include "../core/tensor.hpp"
#include "../core/value.hpp"
#include "../shard/checkpoint.hpp"
#include "../shard/layout.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id os_state_differs     {720, error_kind::format, "optim_shard.state_differs"};
inline constexpr error_id os_bad_state         {721, error_kind::format, "optim_shard.bad_state"};
inline constexpr error_id os_piece_outside     {722, error_kind::format, "optim_shard.piece_outside"};
inline constexpr error_id os_bad_layout        {723, error_kind::usage,  "optim_shard.bad_layout"};
inline constexpr error_id os_groups_differ     {724, error_kind::format, "optim_shard.groups_differ"};
// clang-format on
}  // namespace errors

namespace optim_shard {

// =============================================================================================
// Loaded files and checked access to their Value trees

/// One loaded torch.save file: its name (for messages), its bytes, and its content, whose tensors
/// are views into `source` (io/torch_file.hpp loads them that way from a mapped file).
struct LoadedFile {
  std::string name;
  std::shared_ptr<const ByteSource> source;
  Value tree;
  /// The address the views use for the source's byte 0 (nullptr: the source's mapping).
  const std::byte* base = nullptr;
};

/// Checked access to a Value tree: every failure is `id` with `where` as its context.
struct Access {
  const error_id& id;
  std::string where;

  [[noreturn]] void fail(const std::string& detail) const { throw_error(id, where, detail); }

  static std::string kind_name(const Value& v) { return std::string(to_string(v.kind())); }

  const Dict& dict(const Value& v, std::string_view what) const {
    if (!v.is_dict()) fail(std::string(what) + " is a " + kind_name(v) + ", expected a dict");
    return v.as_dict();
  }
  const List& list(const Value& v, std::string_view what) const {
    if (!v.is_sequence()) fail(std::string(what) + " is a " + kind_name(v) + ", expected a list");
    return v.as_list();
  }
  const Value& at(const Dict& d, const Key& k, std::string_view what) const {
    const Value* v = d.find(k);
    if (!v) fail(std::string(what) + " has no key " + (k.is_int() ? k.str() : quote(k.str())));
    return *v;
  }
  /// The value at k, or nullptr when absent or None.
  static const Value* opt(const Dict& d, const Key& k) {
    const Value* v = d.find(k);
    return (v && !v->is_none()) ? v : nullptr;
  }
  std::int64_t integer(const Value& v, std::string_view what) const {
    if (!v.is_int()) fail(std::string(what) + " is a " + kind_name(v) + ", expected an int");
    return v.as_int();
  }
  const std::string& string(const Value& v, std::string_view what) const {
    if (!v.is_string()) fail(std::string(what) + " is a " + kind_name(v) + ", expected a str");
    return v.as_string();
  }
  const TensorView& tensor(const Value& v, std::string_view what) const {
    if (!v.is_tensor()) fail(std::string(what) + " is a " + kind_name(v) + ", expected a tensor");
    return v.as_tensor();
  }
  /// A shape: torch.Size (unpickled as a tuple), a plain tuple (DeepSpeed's debloated saves) or a
  /// list of non-negative ints.
  shape_t shape(const Value& v, std::string_view what) const {
    if (!v.is_sequence()) fail(std::string(what) + " is a " + kind_name(v) + ", expected a shape (torch.Size or tuple)");
    shape_t s;
    for (const Value& d : v.as_list()) {
      if (!d.is_int() || d.as_int() < 0) fail(std::string(what) + " is not a shape of non-negative ints");
      s.push_back(d.as_int());
    }
    try {
      (void)numel(s);
    } catch (const error& e) {
      fail(std::string(what) + ": " + e.detail());
    }
    return s;
  }
};

// =============================================================================================
// Skeletons of consolidated checkpoints

/// Builds the flatten skeleton (core/flatten.hpp) of a consolidated state: nested string-keyed
/// dicts whose leaves are tensor nodes (the description's tensors), alias nodes, or any non-tensor
/// Value. Keys keep their insertion order.
class SkeletonBuilder {
 public:
  /// A tensor node for `t`, at `path` (dicts created as needed).
  void tensor(std::span<const std::string> path, const TensorInfo& t) {
    nlohmann::json j(nlohmann::json::value_t::object);
    auto& o = j.get_ref<nlohmann::json::object_t&>();
    o.emplace("tensor", t.name);
    o.emplace("dtype", std::string(statedict::name(t.dtype)));
    nlohmann::json::array_t sh;
    for (dim_t d : t.shape) sh.emplace_back(d);
    o.emplace("shape", std::move(sh));
    leaf(path, std::move(j));
  }
  /// An alias node: `path` is the same tensor as the tensor named `target`.
  void alias(std::span<const std::string> path, const std::string& target) {
    nlohmann::json j(nlohmann::json::value_t::object);
    j.get_ref<nlohmann::json::object_t&>().emplace("alias", target);
    leaf(path, std::move(j));
  }
  /// A non-tensor value (any tree without tensors) at `path`.
  void value(std::span<const std::string> path, const Value& v) {
    FlatStateDict f = flatten(v);
    if (!f.tensors.empty())
      throw_error(errors::os_bad_layout, "skeleton", "a value at " + quote(join(path)) + " holds tensors");
    leaf(path, f.skeleton.json().at("root"));
  }
  /// The skeleton document.
  [[nodiscard]] nlohmann::json build() const {
    nlohmann::json doc(nlohmann::json::value_t::object);
    doc.get_ref<nlohmann::json::object_t&>().emplace("statedict_skeleton", 1);
    doc.get_ref<nlohmann::json::object_t&>().emplace("root", build(0));
    return doc;
  }

 private:
  struct node {
    std::optional<nlohmann::json> leaf;
    std::vector<std::pair<std::string, std::size_t>> children;
  };
  static std::string join(std::span<const std::string> path) {
    std::string s;
    for (const auto& k : path) s += (s.empty() ? "" : ".") + k;
    return s;
  }
  void leaf(std::span<const std::string> path, nlohmann::json j) {
    if (path.empty()) throw_error(errors::os_bad_layout, "skeleton", "empty path");
    std::size_t at = 0;
    for (std::size_t i = 0; i < path.size(); ++i) {
      if (nodes_[at].leaf)
        throw_error(errors::os_bad_layout, "skeleton", quote(join(path.subspan(0, i))) + " is a leaf and a dict");
      std::size_t next = 0;
      for (const auto& [k, c] : nodes_[at].children)
        if (k == path[i]) next = c;
      if (next == 0) {
        nodes_.push_back(node{});
        next = nodes_.size() - 1;
        nodes_[at].children.emplace_back(path[i], next);
      } else if (i + 1 == path.size()) {
        throw_error(errors::os_bad_layout, "skeleton", quote(join(path)) + " is set twice");
      }
      at = next;
    }
    if (!nodes_[at].children.empty())
      throw_error(errors::os_bad_layout, "skeleton", quote(join(path)) + " is a dict and a leaf");
    nodes_[at].leaf = std::move(j);
  }
  [[nodiscard]] nlohmann::json build(std::size_t i) const {
    if (nodes_[i].leaf) return *nodes_[i].leaf;
    nlohmann::json::array_t pairs;
    for (const auto& [k, c] : nodes_[i].children) {
      nlohmann::json pair = nlohmann::json::array_t(2);
      pair[0] = detail::encode_string(k);
      pair[1] = build(c);
      pairs.push_back(std::move(pair));
    }
    nlohmann::json d(nlohmann::json::value_t::object);
    d.get_ref<nlohmann::json::object_t&>().emplace("dict", std::move(pairs));
    return d;
  }
  std::vector<node> nodes_{1};
};

// =============================================================================================
// Sources: where loaded tensors live

/// The byte sources of a description being built, and the Placement of any loaded tensor view.
/// A view that lies inside a registered source's bytes (a tensor of a mapped torch.save file) is
/// placed at its offset there, with no copy and no read; any other view (a loader that had to
/// inflate a compressed record) becomes a source of its own, kept alive by the view's owner.
class SourceTable {
 public:
  /// Registers a source; returns its index. `base` is the address that stands for the source's
  /// byte 0 in the views loaded from it: its mapping (the default), or the reserved address range
  /// a lazy reader placed the views in.
  std::uint32_t add(std::shared_ptr<const ByteSource> s, const std::byte* base = nullptr) {
    if (base == nullptr) base = s->data();
    const auto index = static_cast<std::uint32_t>(sources_.size());
    entries_.push_back(entry{base, s->size()});
    if (base != nullptr) by_base_.emplace(reinterpret_cast<std::uintptr_t>(base), index);  // the first one at a base wins
    sources_.push_back(std::move(s));
    return index;
  }

  /// Registers bytes computed at describe time (small converted buffers); returns its index.
  std::uint32_t add_owned(std::string name, std::vector<std::byte> bytes) {
    auto buf = std::make_shared<std::vector<std::byte>>(std::move(bytes));
    const std::byte* p = buf->data();
    const std::uint64_t n = buf->size();
    return add(std::make_shared<MemorySource>(std::move(name), p, n, std::move(buf)));
  }

  /// Where `v`'s element 0 is, with its strides (empty when contiguous). `what` names the tensor
  /// for messages.
  Placement locate(const TensorView& v, std::string_view what) {
    Placement at;
    at.stored = v.dtype();
    if (!v.is_contiguous()) at.strides = v.strides();
    if (v.numel() == 0) return at;
    const std::uint64_t extent = v.extent_bytes();
    const auto p = reinterpret_cast<std::uintptr_t>(v.data());
    auto holds = [&](std::size_t i) {
      const auto b = reinterpret_cast<std::uintptr_t>(entries_[i].base);
      const std::uint64_t size = entries_[i].size;
      return entries_[i].base != nullptr && p >= b && p - b <= size && extent <= size - (p - b);
    };
    // The source with the greatest base at or below the view: sources are mapped files, lazily
    // reserved ranges and owned buffers, which do not overlap (where two would, both hold the
    // same bytes). Rank files of a many-rank checkpoint register thousands of sources, each
    // located once per chunk; the scan below is for views in no registered source's range.
    if (auto it = by_base_.upper_bound(p); it != by_base_.begin() && holds(std::prev(it)->second)) {
      const std::uint32_t i = std::prev(it)->second;
      at.source = i;
      at.byte_offset = p - reinterpret_cast<std::uintptr_t>(entries_[i].base);
      return at;
    }
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      if (holds(i)) {
        at.source = static_cast<std::uint32_t>(i);
        at.byte_offset = p - reinterpret_cast<std::uintptr_t>(entries_[i].base);
        return at;
      }
    }
    at.source = add(std::make_shared<MemorySource>(std::string(what), v.data(), extent, v.owner()));
    at.byte_offset = 0;
    return at;
  }

  /// A contiguous copy of `v`'s elements, read through its source (never through the view's
  /// pointer, which may point into reserved address space when the file was read lazily). Only
  /// for the few small tensors describing needs the values of (0-dim state, converted buffers).
  Tensor materialize(const TensorView& v, std::string_view what) {
    const Placement at = locate(v, what);
    const std::uint64_t extent = v.extent_bytes();
    auto buf = std::make_shared<std::vector<std::byte>>(static_cast<std::size_t>(extent));
    if (extent) sources_[at.source]->read(at.byte_offset, *buf);
    const TensorView local(v.dtype(), v.shape(), v.strides(), extent ? buf->data() : nullptr, buf);
    return Tensor::copy_of(local);
  }

  /// Reads `n` bytes starting `first_byte` bytes after `v`'s element 0 through its source.
  std::vector<std::byte> read_bytes(const TensorView& v, std::uint64_t first_byte, std::uint64_t n, std::string_view what) {
    const Placement at = locate(v, what);
    std::vector<std::byte> out(static_cast<std::size_t>(n));
    if (n) sources_[at.source]->read(checked_add(at.byte_offset, first_byte, "offset"), out);
    return out;
  }

  [[nodiscard]] const std::vector<std::shared_ptr<const ByteSource>>& sources() const noexcept { return sources_; }
  std::vector<std::shared_ptr<const ByteSource>> take() {
    entries_.clear();
    by_base_.clear();
    return std::move(sources_);
  }

 private:
  struct entry {
    const std::byte* base;
    std::uint64_t size;
  };
  std::vector<std::shared_ptr<const ByteSource>> sources_;
  std::vector<entry> entries_;
  std::map<std::uintptr_t, std::uint32_t> by_base_;
};

/// A chunk holding all of `v` (a whole tensor stored as-is) as one box.
inline Chunk whole_chunk(const TensorView& v, SourceTable& table, std::string_view what) {
  return Chunk{full_box(v.shape()), table.locate(v, what)};
}

// =============================================================================================
// Flat buffers and pieces

/// One tensor of a rank's flat buffer. A rank's buffer is the concatenation of its segments
/// (ZeRO-3 sub-groups; one segment elsewhere). `numel` is the segment's length in that
/// concatenation; the tensor may be shorter (padding cut off, as ZeRO-1/2 saves its partitions)
/// but never longer.
struct Segment {
  const TensorView* view = nullptr;  ///< nullptr: the rank has no tensor here (no optimizer state)
  std::uint64_t numel = 0;
  std::string where;  ///< for messages: "file 'x': optimizer_state_dict.fp32_flat_groups.2"
};

/// The segments of one rank's flat buffer, in order.
using RankBuffer = std::vector<Segment>;

/// Chunks of one parameter: each piece (rank r, elements [begin, end) of the parameter, at element
/// `offset` of rank r's buffer) is resolved against `buffers[r]`, split where it crosses a segment
/// boundary. Throws errors::os_piece_outside, naming `what`, the rank and the segment, when a
/// piece reaches past a buffer or past the tensor that holds it, or the tensor is not 1-d.
inline std::vector<Chunk> place(std::span<const layout::FlatPiece> pieces, std::span<const RankBuffer> buffers,
                                SourceTable& table, std::string_view what) {
  std::vector<Chunk> out;
  for (const layout::FlatPiece& p : pieces) {
    if (p.range.size() == 0) continue;
    if (p.rank >= buffers.size())
      throw_error(errors::os_piece_outside, std::string(what),
                  "a piece is on rank " + std::to_string(p.rank) + " but there are " + std::to_string(buffers.size()) +
                      " ranks");
    const RankBuffer& buf = buffers[p.rank];
    std::uint64_t pos = p.offset;             // position in the rank's concatenated buffer
    std::uint64_t done = 0;                   // elements of the piece placed so far
    std::uint64_t seg_start = 0;
    for (std::size_t s = 0; s < buf.size() && done < p.range.size(); ++s) {
      const Segment& seg = buf[s];
      const std::uint64_t seg_end = checked_add(seg_start, seg.numel, "flat buffer size");
      if (pos < seg_end) {
        const std::uint64_t in_seg = pos - seg_start;
        const std::uint64_t n = std::min(p.range.size() - done, seg_end - pos);
        if (seg.view == nullptr)
          throw_error(errors::os_piece_outside, std::string(what),
                      "rank " + std::to_string(p.rank) + " holds elements [" + std::to_string(p.range.begin + done) +
                          ", " + std::to_string(p.range.begin + done + n) + ") in " + seg.where +
                          ", which is missing");
        const TensorView& v = *seg.view;
        if (v.rank() != 1)
          throw_error(errors::os_piece_outside, std::string(what),
                      seg.where + " has shape " + to_string(v.shape()) + "; expected a 1-d flat tensor");
        if (v.numel() > seg.numel)
          throw_error(errors::os_piece_outside, std::string(what),
                      seg.where + " has " + std::to_string(v.numel()) + " elements, more than the " +
                          std::to_string(seg.numel) + " the layout gives it");
        if (in_seg + n > v.numel())
          throw_error(errors::os_piece_outside, std::string(what),
                      "rank " + std::to_string(p.rank) + " holds elements [" + std::to_string(p.range.begin + done) +
                          ", " + std::to_string(p.range.begin + done + n) + ") at elements [" + std::to_string(in_seg) +
                          ", " + std::to_string(in_seg + n) + ") of " + seg.where + ", which has only " +
                          std::to_string(v.numel()));
        Placement at = table.locate(v, seg.where);
        const std::uint64_t stride = static_cast<std::uint64_t>(v.strides()[0]);
        at.byte_offset = checked_add(at.byte_offset, checked_mul(checked_mul(in_seg, stride, "offset"), v.itemsize(), "offset"),
                                     "offset");
        at.strides = stride == 1 ? shape_t{} : shape_t{static_cast<dim_t>(stride)};
        out.push_back(Chunk{FlatRange{p.range.begin + done, p.range.begin + done + n}, std::move(at)});
        done += n;
        pos += n;
      }
      seg_start = seg_end;
    }
    if (done < p.range.size())
      throw_error(errors::os_piece_outside, std::string(what),
                  "rank " + std::to_string(p.rank) + " should hold elements [" + std::to_string(p.range.begin + done) +
                      ", " + std::to_string(p.range.end) + ") at element " + std::to_string(pos) +
                      " of its flat buffer, which has " + std::to_string(seg_start) + " elements");
  }
  return out;
}

/// Checks that `chunks` (flat ranges) cover [0, numel) exactly once; throws `id` naming `what`.
inline void check_flat_cover(std::span<const Chunk> chunks, std::uint64_t numel, const error_id& id, std::string_view what) {
  std::vector<FlatRange> r;
  r.reserve(chunks.size());
  for (const Chunk& c : chunks) r.push_back(std::get<FlatRange>(c.region));
  std::sort(r.begin(), r.end(), [](const FlatRange& a, const FlatRange& b) { return a.begin < b.begin; });
  std::uint64_t pos = 0;
  for (const FlatRange& x : r) {
    if (x.begin > pos)
      throw_error(id, std::string(what), "elements [" + std::to_string(pos) + ", " + std::to_string(x.begin) + ") of " +
                                             std::to_string(numel) + " are held by no rank");
    if (x.begin < pos)
      throw_error(id, std::string(what), "element " + std::to_string(x.begin) + " is held by two ranks");
    pos = x.end;
  }
  if (pos != numel)
    throw_error(id, std::string(what), "elements [" + std::to_string(pos) + ", " + std::to_string(numel) + ") of " +
                                           std::to_string(numel) + " are held by no rank");
}

// =============================================================================================
// Optimizer state: merging per-rank state into one state per parameter

/// One parameter whose optimizer state is consolidated.
struct ParamState {
  std::string name;  ///< the parameter's name; state tensors are named `<prefix><name>.<key>`
  shape_t shape;
  std::size_t family = 0;  ///< which flat buffer family (ZeRO group, FSDP flat param) its pieces index
  std::vector<layout::FlatPiece> pieces;
  /// Segment (of each rank's buffer in `family`) whose constant state (step) belongs to this
  /// parameter: its ZeRO-3 sub-group; 0 elsewhere.
  std::size_t scalar_segment = 0;
};

/// One rank's optimizer state for one segment of a flat buffer: the torch optimizer's per-param
/// state dict ({"step": ..., "exp_avg": [n], ...}), or nullptr when the rank has none (a rank whose
/// shard of that parameter is empty, a never-stepped optimizer).
struct StateSegment {
  const Dict* state = nullptr;
  std::uint64_t numel = 0;  ///< the segment's length in the rank's flat buffer
  std::string where;
};

/// [family][rank] -> segments of that rank's buffer.
using StateFamilies = std::vector<std::vector<std::vector<StateSegment>>>;

/// A consolidated optimizer state: the tensors (`optim.state.<name>.<key>`, in parameter order,
/// keys in the order the state dicts list them) and the non-tensor state values (`name.key` ->
/// value) in the same order.
struct MergedState {
  std::vector<TensorInfo> tensors;
  std::vector<std::pair<std::string, Value>> values;
};

namespace detail {
inline bool same_scalar(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.numel() == b.numel() && equal_bytes(a.view(), b.view());
}
inline std::string scalar_text(const TensorView& v) {
  if (v.numel() != 1) return "a tensor of shape " + to_string(v.shape());
  std::string s = std::string(name(v.dtype())) + " ";
  switch (v.dtype()) {
    case dtype::F32: return s + std::to_string(v.load<float>(0));
    case dtype::F64: return s + std::to_string(v.load<double>(0));
    case dtype::I64: return s + std::to_string(v.load<std::int64_t>(0));
    case dtype::I32: return s + std::to_string(v.load<std::int32_t>(0));
    default: return s + "value";
  }
}
inline std::string value_text(const Value& v) {
  switch (v.kind()) {
    case value_kind::integer: return std::to_string(v.as_int());
    case value_kind::floating: return std::to_string(v.as_double());
    case value_kind::boolean: return v.as_bool() ? "True" : "False";
    case value_kind::string: return quote(v.as_string());
    case value_kind::none: return "None";
    default: return "a " + std::string(to_string(v.kind()));
  }
}
}  // namespace detail

/// Merges the state of `params` (see the rules at the top of this file). `families[f][r]` are rank
/// r's state segments of family f, laid out like the flat buffers the pieces index. Tensor state of
/// rank > 0 is placed with the pieces; constant state is taken from the lowest rank holding the
/// parameter's scalar segment and checked equal on the others (errors::os_state_differs).
inline MergedState merge_state(std::span<const ParamState> params, const StateFamilies& families, SourceTable& table,
                               std::string_view prefix = "optim.state.") {
  MergedState out;
  for (const ParamState& p : params) {
    const std::string base = std::string(prefix) + p.name;
    if (p.family >= families.size())
      throw_error(errors::os_bad_layout, base, "parameter refers to state family " + std::to_string(p.family) + " of " +
                                                   std::to_string(families.size()));
    const auto& fam = families[p.family];
    // The key list: from the first rank whose scalar segment has state.
    const Dict* first = nullptr;
    std::size_t first_rank = 0;
    for (std::size_t r = 0; r < fam.size(); ++r) {
      if (p.scalar_segment < fam[r].size() && fam[r][p.scalar_segment].state) {
        first = fam[r][p.scalar_segment].state;
        first_rank = r;
        break;
      }
    }
    if (!first) continue;  // no rank has state for it: the optimizer never stepped it
    for (const auto& [key, v0] : *first) {
      const std::string kname = key.str();
      const std::string tname = base + "." + kname;
      const bool flat = v0.is_tensor() && v0.as_tensor().rank() > 0;
      if (flat) {
        // Per rank, the tensor under `key` in each segment forms that rank's buffer for this key.
        std::vector<RankBuffer> bufs(fam.size());
        for (std::size_t r = 0; r < fam.size(); ++r) {
          for (const StateSegment& s : fam[r]) {
            Segment seg{nullptr, s.numel, s.where + "[" + quote(kname) + "]"};
            if (s.state) {
              const Value* v = s.state->find(key);
              if (v && !v->is_tensor())
                throw_error(errors::os_bad_state, tname, s.where + "[" + quote(kname) + "] is a " +
                                                            std::string(to_string(v->kind())) + ", expected a tensor");
              if (v) seg.view = &v->as_tensor();
            }
            bufs[r].push_back(std::move(seg));
          }
        }
        TensorInfo t;
        t.name = tname;
        t.shape = p.shape;
        t.dtype = v0.as_tensor().dtype();
        t.chunks = place(p.pieces, bufs, table, tname);
        for (const Chunk& c : t.chunks)
          if (c.at.stored != t.dtype)
            throw_error(errors::os_bad_state, tname, "stored as " + std::string(name(c.at.stored)) + " on one rank and " +
                                                         std::string(name(t.dtype)) + " on another");
        check_flat_cover(t.chunks, numel(t.shape), errors::os_bad_state, tname);
        out.tensors.push_back(std::move(t));
        continue;
      }
      // Constant state: equal wherever present (its few bytes are read to compare).
      std::optional<Tensor> t0;
      if (v0.is_tensor()) t0 = table.materialize(v0.as_tensor(), tname);
      for (std::size_t r = first_rank + 1; r < fam.size(); ++r) {
        if (p.scalar_segment >= fam[r].size()) continue;
        const StateSegment& s = fam[r][p.scalar_segment];
        if (!s.state) continue;
        const Value* v = s.state->find(key);
        if (!v) continue;
        std::optional<Tensor> tr;
        if (v->is_tensor()) tr = table.materialize(v->as_tensor(), tname);
        const bool same = t0 ? (tr && detail::same_scalar(*t0, *tr)) : (*v == v0);
        if (!same)
          throw_error(errors::os_state_differs, tname,
                      "rank " + std::to_string(first_rank) + " has " +
                          (t0 ? detail::scalar_text(t0->view()) : detail::value_text(v0)) + ", rank " +
                          std::to_string(r) + " has " + (tr ? detail::scalar_text(tr->view()) : detail::value_text(*v)) +
                          " (constant state must be equal on every rank)");
      }
      if (v0.is_tensor()) {
        const std::string where = fam[first_rank][p.scalar_segment].where + "[" + quote(kname) + "]";
        TensorInfo t;
        t.name = tname;
        t.dtype = v0.as_tensor().dtype();
        t.shape = v0.as_tensor().shape();
        t.chunks.push_back(whole_chunk(v0.as_tensor(), table, where));
        out.tensors.push_back(std::move(t));
      } else {
        out.values.emplace_back(p.name + "." + kname, v0);
      }
    }
  }
  return out;
}

/// Compares the param_groups of every rank with rank 0's (ignoring keys in `ignore`); throws
/// errors::os_groups_differ naming the first rank, group and key that differ.
inline void check_groups_equal(std::span<const Value* const> groups, std::span<const std::string> where,
                               std::span<const std::string_view> ignore = {}) {
  if (groups.empty() || !groups[0]) return;
  auto skip = [&](const Key& k) {
    return k.is_string() && std::find(ignore.begin(), ignore.end(), std::string_view(k.as_string())) != ignore.end();
  };
  const List& g0 = groups[0]->as_list();
  for (std::size_t r = 1; r < groups.size(); ++r) {
    if (!groups[r]) continue;
    const List& gr = groups[r]->as_list();
    if (gr.size() != g0.size())
      throw_error(errors::os_groups_differ, where[r], std::to_string(gr.size()) + " param groups, rank 0 has " +
                                                          std::to_string(g0.size()));
    for (std::size_t g = 0; g < g0.size(); ++g) {
      if (!g0[g].is_dict() || !gr[g].is_dict()) {
        if (!(g0[g] == gr[g]))
          throw_error(errors::os_groups_differ, where[r], "param group " + std::to_string(g) + " differs from rank 0's");
        continue;
      }
      for (const auto& [k, v] : g0[g].as_dict()) {
        if (skip(k)) continue;
        const Value* o = gr[g].as_dict().find(k);
        if (!o || !(*o == v))
          throw_error(errors::os_groups_differ, where[r],
                      "param_groups." + std::to_string(g) + "." + k.str() + " is " + (o ? detail::value_text(*o) : "missing") +
                          ", rank 0 has " + detail::value_text(v));
      }
      for (const auto& [k, v] : gr[g].as_dict())
        if (!skip(k) && !g0[g].as_dict().contains(k))
          throw_error(errors::os_groups_differ, where[r],
                      "param_groups." + std::to_string(g) + "." + k.str() + " is not in rank 0's group");
    }
  }
}

// =============================================================================================
// The reverse: a full optimizer state sharded for a layout

/// Which flat layout to shard for.
enum class layout_kind : std::uint8_t {
  zero12,      ///< DeepSpeed ZeRO-1/2: one flat buffer per group, padded to 2 * world, split evenly
  zero3,       ///< DeepSpeed ZeRO-3: every parameter split ceil(n / world) per rank
  fsdp,        ///< FSDP FlatParameter without alignment (torch <= 2.0, use_orig_params=False)
  fsdp_aligned ///< FSDP FlatParameter with use_orig_params alignment padding (torch >= 2.1)
};

/// What to shard: parameter groups (names, in flat order: param_shapes order for ZeRO, flattening
/// order for FSDP), the state keys laid out like the parameters, and the constant keys.
struct ShardSpec {
  layout_kind kind = layout_kind::zero12;
  std::uint32_t world = 1;
  std::vector<std::vector<std::string>> groups;
  std::vector<std::string> flat_keys{"exp_avg", "exp_avg_sq"};
  /// 0-dim state replicated per group on every rank (taken from the group's first parameter).
  std::vector<std::string> scalar_keys{"step"};
  std::string prefix = "optim.state.";
};

/// Destination name of rank r's buffer for `key`: "rank<r>.<key>".
inline std::string buffer_name(std::uint32_t rank, std::string_view key) {
  return "rank" + std::to_string(rank) + "." + std::string(key);
}

/// Lays out `full` (tensors named `<prefix><param>.<key>`, e.g. a consolidated checkpoint's
/// optimizer tensors) as the per-rank flat buffers of `spec`: destination `k * world + r` is rank
/// r's buffer for flat key k (buffer_name), each group's partition in group order, padding left
/// to the sink (zero); then, per scalar key s, destination `(K + s) * world + r` holds each group's
/// scalar (from its first parameter) at position g. Throws errors::os_bad_layout when a tensor is
/// missing or a scalar is not 0-dim.
inline Destination destination(std::span<const TensorInfo> full, const ShardSpec& spec) {
  if (spec.world == 0) throw_error(errors::os_bad_layout, "optimizer sharding", "world size must be at least 1");
  auto find = [&](const std::string& n) -> const TensorInfo& {
    for (const TensorInfo& t : full)
      if (t.name == n) return t;
    throw_error(errors::os_bad_layout, "optimizer sharding", "no tensor " + quote(n) + " in the full state");
  };
  Destination out;
  const std::uint32_t W = spec.world;
  for (const std::string& key : spec.flat_keys) {
    std::vector<TensorInfo> specs;
    std::vector<std::vector<std::size_t>> groups;
    for (const auto& g : spec.groups) {
      std::vector<std::size_t> idx;
      for (const std::string& p : g) {
        const TensorInfo& t = find(spec.prefix + p + "." + key);
        idx.push_back(specs.size());
        specs.push_back(TensorInfo{t.name, t.dtype, t.shape, {}});
      }
      groups.push_back(std::move(idx));
    }
    Destination d;
    switch (spec.kind) {
      case layout_kind::zero12: d = layout::zero12(specs, groups, W); break;
      case layout_kind::zero3: d = layout::zero3(specs, groups, W); break;
      case layout_kind::fsdp: d = layout::fsdp(specs, groups, W, false); break;
      case layout_kind::fsdp_aligned: d = layout::fsdp(specs, groups, W, true); break;
    }
    const auto base = static_cast<std::uint32_t>(out.names.size());
    for (std::uint32_t r = 0; r < W; ++r) {
      out.names.push_back(buffer_name(r, key));
      out.sizes.push_back(r < d.sizes.size() ? d.sizes[r] : 0);
    }
    for (TensorInfo& t : d.tensors) {
      for (Chunk& c : t.chunks) c.at.source += base;
      out.tensors.push_back(std::move(t));
    }
  }
  for (const std::string& key : spec.scalar_keys) {
    const auto base = static_cast<std::uint32_t>(out.names.size());
    std::vector<std::uint64_t> size(W, 0);
    std::vector<TensorInfo> scalars;
    for (std::size_t g = 0; g < spec.groups.size(); ++g) {
      if (spec.groups[g].empty()) continue;
      const TensorInfo& t = find(spec.prefix + spec.groups[g][0] + "." + key);
      if (!t.shape.empty())
        throw_error(errors::os_bad_layout, t.name, "constant state must be 0-dim, found shape " + to_string(t.shape));
      TensorInfo d{t.name, t.dtype, t.shape, {}};
      for (std::uint32_t r = 0; r < W; ++r) {
        d.chunks.push_back(Chunk{Box{{}, {}}, Placement{base + r, size[r], {}, t.dtype}});
        size[r] += itemsize(t.dtype);
      }
      scalars.push_back(std::move(d));
    }
    for (std::uint32_t r = 0; r < W; ++r) {
      out.names.push_back(buffer_name(r, key));
      out.sizes.push_back(size[r]);
    }
    for (TensorInfo& t : scalars) out.tensors.push_back(std::move(t));
  }
  return out;
}

}  // namespace optim_shard
}  // namespace statedict::inline v0
