// statedict: planning torch.save files: the pickle, the zip layout and where every storage goes,
// before a byte is written; PlannedWriter writes the framing around storages filled by positioned
// writes (the executor's path, formats/torch.hpp).
// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <tuple>
#include <unordered_map>
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
#include "crc32.hpp"
#include "file.hpp"
#include "pickle_read.hpp"
#include "pickle_write.hpp"
#include "zip.hpp"

#include "torch_file.hpp"

namespace statedict::inline v0 {
namespace torch {

// =============================================================================================
// Writing
//
// The file is what torch.save (PyTorch 2.x) writes: records `data.pkl`, `.format_version` ("1"),
// `.storage_alignment` ("64"), `byteorder` ("little"), `data/0` ... `data/N-1` (keys in order of
// first use, numerically ordered), `version` ("3\n"), under the folder `archive_name`, in a zip laid
// out like torch's (io/zip.hpp). The pickle (protocol 2) writes each tensor as
// `_rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())` with the persistent id
// `('storage', torch.<Dtype>Storage, key, 'cpu', numel)`; dtypes without a typed storage class
// (U16, U32, U64, F8_*) use `_rebuild_tensor_v3` with `torch.storage.UntypedStorage` and the dtype global,
// as PyTorch >= 2.1 does. Tensors whose memory overlaps (same dtype) share one storage covering the
// union of their byte ranges, so tied weights and views stay tied after torch.load; the same view
// twice is written once and referenced (torch.load gives the same object). Storages are written once.
// Every storage is written on 'cpu' (its bytes are in host memory, and the file then loads on a
// machine without the device it was saved from, no map_location needed): a bare storage read with
// another location ('cuda:0') is written back on 'cpu'.

struct save_options {
  /// Folder inside the zip. Empty: torch's rule, the file's basename without its extension
  /// ("model" for model.pt), or "archive" when there is no usable basename.
  std::string archive_name;
  /// Python attributes of dicts (state_dict()._metadata), by path; written as OrderedDict + BUILD.
  std::vector<pickle::Attributes> attributes;
  pickle::write_options pickle{};
  zip::write_options zip{};
};

/// torch's archive name for a path: the basename without its last extension
/// (caffe2/serialize/inline_container.cc basename()); "archive" when that is empty.
inline std::string archive_name_for(const std::filesystem::path& path) {
  const std::string s = path.string();
  std::size_t start = 0;
  for (std::size_t i = 0; i < s.size(); ++i)
    if (s[i] == '/' || s[i] == '\\') start = i + 1;
  std::size_t end = s.size();
  for (std::size_t i = s.size(); i > start; --i)
    if (s[i - 1] == '.') {
      end = i - 1;
      break;
    }
  std::string n = start < end ? s.substr(start, end - start) : std::string();
  return n.empty() ? std::string("archive") : n;
}

/// One storage of a planned file.
struct PlannedStorage {
  std::string key;                                ///< "0", "1", ...
  statedict::dtype dtype = statedict::dtype::U8;  ///< element type of its tensors
  bool untyped = false;                           ///< written as torch.storage.UntypedStorage (+ _rebuild_tensor_v3)
  /// The class its persistent id names when the tree held the storage itself as one of another
  /// class of the same elements (a quantized storage: torch.QInt8Storage); empty: the dtype's.
  std::string storage_class;
  std::uint64_t nbytes = 0;
  std::size_t record = 0;                         ///< index into SavePlan::records / layout.entries
  /// Bytes to copy (nbytes of them), or nullptr for a storage the caller fills (PlannedWriter).
  const std::byte* source = nullptr;
  keep_alive owner;
};

/// One tensor of a planned file: which storage, where in it.
struct PlannedTensor {
  std::string name;  ///< dotted path (empty for tensors inside kept objects, and for a bare root tensor)
  /// One of the tensors of the described checkpoint (plan_save(ShardedCheckpoint)): destination()
  /// places these, whatever their name.
  bool described = false;
  std::size_t storage = 0;
  std::uint64_t offset = 0;  ///< storage offset, in elements
  statedict::dtype dtype = statedict::dtype::F32;
  shape_t shape;
  shape_t strides;
};

/// Everything about a torch.save file before a byte is written: the pickle, the zip layout (so
/// every storage's byte range in the output is known up front), and where each tensor lives.
struct SavePlan {
  std::string archive_name;
  struct Record {
    std::string name;             ///< full entry name ("model/data/0")
    std::vector<std::byte> bytes;  ///< content of small records (empty for storages)
    std::optional<std::size_t> storage;  ///< set for data/<key> records
  };
  std::vector<Record> records;  ///< in file order, parallel to layout.entries
  std::vector<PlannedStorage> storages;
  std::vector<PlannedTensor> tensors;
  zip::Layout layout;

  [[nodiscard]] std::uint64_t file_size() const noexcept { return layout.total_size; }
  /// Byte range [first, first + nbytes) of storage `i` in the output file.
  [[nodiscard]] std::uint64_t storage_offset(std::size_t i) const { return layout.entries[storages[i].record].data_offset; }

  /// Where every described tensor's elements go in the output: the planner's destination layout
  /// (shard/plan.hpp make_plan), one destination (the output file, `file_size()` bytes) and one
  /// chunk per tensor at its byte offset, contiguous. Tensors the skeleton makes views or aliases
  /// of another are not listed: their bytes are their base's.
  [[nodiscard]] Destination destination(std::string name = "torch file") const {
    Destination d;
    d.names.push_back(std::move(name));
    d.sizes.push_back(file_size());
    for (const PlannedTensor& t : tensors) {
      if (!t.described) continue;
      TensorInfo ti;
      ti.name = t.name;
      ti.dtype = t.dtype;
      ti.shape = t.shape;
      Chunk c;
      c.region = Box{shape_t(t.shape.size(), 0), t.shape};
      c.at.source = 0;
      c.at.byte_offset = storage_offset(t.storage) + t.offset * itemsize(t.dtype);
      c.at.strides = is_contiguous(t.shape, t.strides) ? shape_t{} : t.strides;
      c.at.stored = t.dtype;
      ti.chunks.push_back(std::move(c));
      d.tensors.push_back(std::move(ti));
    }
    return d;
  }

  /// The byte range of every storage in the output file, in storage order: what a FileSink
  /// checksums (`FileSink::track_crc32`) so that the writer needs no second pass over the data.
  [[nodiscard]] std::vector<FlatRange> storage_ranges() const {
    std::vector<FlatRange> r;
    for (std::size_t i = 0; i < storages.size(); ++i) r.push_back({storage_offset(i), storage_offset(i) + storages[i].nbytes});
    return r;
  }
};

namespace detail {

struct tensor_ref {
  const TensorView* view;
  std::string name;
};

/// Every tensor in the tree (also inside objects), with its dotted name where it has one.
inline std::vector<tensor_ref> collect_tensors(const Value& root) {
  std::vector<tensor_ref> out;
  struct item {
    const Value* v;
    std::string name;
    bool named;
  };
  std::vector<item> work{{&root, std::string(), true}};
  auto child = [](const item& parent, const std::string& key) {
    return parent.name.empty() ? key : parent.name + "." + key;
  };
  while (!work.empty()) {
    item it = std::move(work.back());
    work.pop_back();
    const Value& v = *it.v;
    switch (v.kind()) {
      case value_kind::tensor: out.push_back({&v.as_tensor(), it.named ? it.name : std::string()}); break;
      case value_kind::list:
      case value_kind::tuple: {
        const List& l = v.as_list();
        for (std::size_t i = l.size(); i-- > 0;) work.push_back({&l[i], child(it, std::to_string(i)), it.named});
        break;
      }
      case value_kind::dict: {
        const auto& items = v.as_dict().items();
        for (std::size_t i = items.size(); i-- > 0;) work.push_back({&items[i].second, child(it, items[i].first.str()), it.named});
        break;
      }
      case value_kind::object: {
        const Object& o = v.as_object();
        for (const List* l : {&o.items, &o.state, &o.args})
          for (std::size_t i = l->size(); i-- > 0;) work.push_back({&(*l)[i], std::string(), false});
        break;
      }
      default: break;
    }
  }
  return out;
}

/// Storage groups: views of one dtype whose byte ranges overlap share one storage spanning the
/// union of their ranges (each view then starts a whole number of elements into it).
struct grouping {
  struct group {
    statedict::dtype dtype;
    const std::byte* lo;
    const std::byte* hi;
    keep_alive owner;
    std::optional<std::size_t> storage;  ///< assigned when the pickle first uses it
  };
  std::vector<group> groups;
  std::unordered_map<const TensorView*, std::size_t> group_of;
};

inline grouping group_views(const std::vector<tensor_ref>& refs) {
  grouping g;
  std::vector<const TensorView*> sized;
  for (const auto& r : refs) {
    if (r.view->numel() == 0) {
      g.groups.push_back({r.view->dtype(), r.view->data(), r.view->data(), r.view->owner(), std::nullopt});
      g.group_of[r.view] = g.groups.size() - 1;
    } else {
      sized.push_back(r.view);
    }
  }
  std::sort(sized.begin(), sized.end(), [](const TensorView* a, const TensorView* b) {
    if (a->dtype() != b->dtype()) return a->dtype() < b->dtype();
    return std::less<const std::byte*>()(a->data(), b->data());
  });
  std::optional<std::size_t> cur;
  for (const TensorView* v : sized) {
    const std::byte* lo = v->data();
    const std::byte* hi = lo + v->extent_bytes();
    if (cur) {
      grouping::group& c = g.groups[*cur];
      if (c.dtype == v->dtype() && std::less<const std::byte*>()(lo, c.hi)) {
        if (static_cast<std::uint64_t>(lo - c.lo) % v->itemsize() == 0) {
          if (std::less<const std::byte*>()(c.hi, hi)) c.hi = hi;
          g.group_of[v] = *cur;
          continue;
        }
        // Overlapping at a byte offset that is not a whole element: a storage of its own.
        g.groups.push_back({v->dtype(), lo, hi, v->owner(), std::nullopt});
        g.group_of[v] = g.groups.size() - 1;
        continue;
      }
    }
    g.groups.push_back({v->dtype(), lo, hi, v->owner(), std::nullopt});
    cur = g.groups.size() - 1;
    g.group_of[v] = *cur;
  }
  return g;
}

inline std::string view_identity(const TensorView& v) {
  std::string k = "t:" + std::to_string(reinterpret_cast<std::uintptr_t>(v.data())) + ":" + std::string(name(v.dtype())) + ":" +
                  to_string(v.shape()) + to_string(v.strides());
  return k;
}

}  // namespace detail

/// Plans a torch.save file for `tree`: the pickle bytes, storages, zip layout and tensor placements.
/// Nothing is written; `tree` must outlive the plan (storages point into its tensors' memory).
inline SavePlan plan_save(const Value& tree, const save_options& opts) {
  SavePlan plan;
  plan.archive_name = opts.archive_name.empty() ? std::string("archive") : opts.archive_name;
  if (plan.archive_name.find('/') != std::string::npos || plan.archive_name.find('\0') != std::string::npos)
    throw_error(errors::pt_bad_name, "archive name " + quote(plan.archive_name) + " contains '/' or NUL");
  // Dict attributes are plain data (state_dict()._metadata); the reader keeps a dict whose
  // attributes hold tensors as an OrderedDict object, which is written with its tensors.
  for (const pickle::Attributes& a : opts.attributes)
    for (const auto& kv : a.attributes.items())
      if (!detail::collect_tensors(kv.second).empty())
        throw_error(errors::pt_unwritable, "attribute " + quote(kv.first.str()) + " of the dict at " + quote(dotted(a.path)),
                    "holds a tensor; dict attributes must be plain data (a dict with tensor attributes is an "
                    "OrderedDict object in the tree)");
  const std::vector<detail::tensor_ref> refs = detail::collect_tensors(tree);
  detail::grouping g = detail::group_views(refs);
  std::unordered_map<const TensorView*, const std::string*> names;
  for (const auto& r : refs)
    if (!r.name.empty()) names.emplace(r.view, &r.name);

  auto storage_of = [&](const TensorView& v) -> std::size_t {
    detail::grouping::group& grp = g.groups[g.group_of.at(&v)];
    if (!grp.storage) {
      PlannedStorage s;
      s.key = std::to_string(plan.storages.size());
      s.dtype = grp.dtype;
      s.untyped = info(grp.dtype).storage_name.empty();
      s.nbytes = static_cast<std::uint64_t>(grp.hi - grp.lo);
      s.source = grp.lo;
      s.owner = grp.owner;
      plan.storages.push_back(std::move(s));
      grp.storage = plan.storages.size() - 1;
    }
    return *grp.storage;
  };

  std::vector<std::byte> pkl;
  pickle::Writer w(pkl, opts.pickle);
  w.attributes = &opts.attributes;
  // Writes the persistent id of storage `si` (MARK 'storage' class key 'cpu' numel TUPLE BINPERSID).
  auto persistent_id = [&](std::size_t si) {
    const PlannedStorage& s = plan.storages[si];
    w.mark();
    w.str("storage");
    // As torch.save writes them: typed classes from module `torch` (a quantized storage by the
    // class the tree held it as), the untyped one from `torch.storage` (torch 2.x's weights_only
    // allow-list has `torch.storage.UntypedStorage`, not `torch.UntypedStorage`).
    if (!s.storage_class.empty()) w.global("torch", s.storage_class);
    else if (s.untyped) w.global("torch.storage", "UntypedStorage");
    else w.global("torch", info(s.dtype).storage_name);
    w.str(s.key);
    w.str("cpu");
    w.integer(static_cast<std::int64_t>(s.untyped ? s.nbytes : s.nbytes / itemsize(s.dtype)));
    w.op('t');
    w.memoize();
    w.op('Q');
  };
  w.custom = [&](pickle::Writer& wr, const Value& v) -> bool {
    if (v.is_tensor()) {
      const TensorView& t = v.as_tensor();
      const std::string id = detail::view_identity(t);
      if (t.numel() > 0 && wr.get_memo(id)) return true;
      if (info(t.dtype()).torch_name.empty())
        throw_error(errors::pt_unwritable, "tensor" + (names.count(&t) ? " " + quote(*names.at(&t)) : std::string()),
                    "dtype " + std::string(name(t.dtype())) + " has no PyTorch dtype (a safetensors-only type): torch.save files cannot hold it");
      const std::size_t si = storage_of(t);
      const PlannedStorage& s = plan.storages[si];
      const std::uint64_t off = t.numel() == 0 ? 0 : static_cast<std::uint64_t>(t.data() - g.groups[g.group_of.at(&t)].lo) / t.itemsize();
      PlannedTensor pt;
      if (auto it = names.find(&t); it != names.end()) pt.name = *it->second;
      pt.storage = si;
      pt.offset = off;
      pt.dtype = t.dtype();
      pt.shape = t.shape();
      pt.strides = t.strides();
      plan.tensors.push_back(std::move(pt));
      wr.global("torch._utils", s.untyped ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2");
      wr.mark();
      persistent_id(si);
      wr.integer(static_cast<std::int64_t>(off));
      for (const shape_t* dims : {&t.shape(), &t.strides()}) {
        wr.begin_tuple(dims->size());
        for (dim_t d : *dims) wr.integer(d);
        wr.end_tuple(dims->size());
      }
      wr.boolean(false);
      wr.global("collections", "OrderedDict");
      wr.op(')');
      wr.reduce();
      if (s.untyped) wr.global("torch", info(t.dtype()).torch_name);
      wr.op('t');
      wr.memoize();
      wr.reduce();
      if (t.numel() > 0) wr.put_memo(id);
      return true;
    }
    if (v.is_object() && detail::is_storage_object(v.as_object())) {
      const Object& o = v.as_object();
      const TensorView& bytes = o.args[0].as_tensor();
      const std::size_t si = storage_of(bytes);
      // A quantized storage (its bytes are the integer representation) keeps its class, which
      // _rebuild_qtensor reads the quantized dtype from.
      if (o.module == "torch" && o.name.size() > 1 && o.name[0] == 'Q' && !plan.storages[si].untyped)
        plan.storages[si].storage_class = o.name;
      persistent_id(si);
      return true;
    }
    return false;
  };
  w.dump(tree);

  const std::string p = plan.archive_name + "/";
  auto small = [&](std::string name, std::string_view content) {
    SavePlan::Record r;
    r.name = p + name;
    for (char c : content) r.bytes.push_back(static_cast<std::byte>(c));
    plan.records.push_back(std::move(r));
  };
  plan.records.push_back({p + "data.pkl", std::move(pkl), std::nullopt});
  small(".format_version", "1");
  small(".storage_alignment", std::to_string(opts.zip.alignment));
  small("byteorder", "little");
  for (std::size_t i = 0; i < plan.storages.size(); ++i) {
    plan.storages[i].record = plan.records.size();
    plan.records.push_back({p + "data/" + plan.storages[i].key, {}, i});
  }
  small("version", "3\n");
  std::vector<zip::EntrySpec> specs;
  specs.reserve(plan.records.size());
  for (const auto& r : plan.records)
    specs.push_back({r.name, r.storage ? plan.storages[*r.storage].nbytes : static_cast<std::uint64_t>(r.bytes.size())});
  plan.layout = zip::plan(specs, opts.zip);
  return plan;
}

/// Plans writing a described checkpoint (any format: a consolidated DCP, safetensors, another
/// torch file) as a torch.save file. The tree comes from `ck.skeleton` (unflatten; a null skeleton
/// is a flat dict), dict attributes from metadata["torch.attributes"] unless `opts` has some. Each
/// logical tensor gets a contiguous storage of its own (views and aliases recorded in the skeleton
/// share their base's). Nothing is read: every storage is left for the caller to fill with a
/// PlannedWriter, and `destination()` says where each of ck's tensors goes in the output.
inline SavePlan plan_save(const ShardedCheckpoint& ck, save_options opts) {
  // Placeholder tensors in reserved address space, 64 bytes apart at least, never touched.
  std::vector<std::uint64_t> at(ck.tensors.size());
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < ck.tensors.size(); ++i) {
    at[i] = total;
    const std::uint64_t n = byte_size(ck.tensors[i].shape, itemsize(ck.tensors[i].dtype));
    total = checked_add(total, (std::max<std::uint64_t>(n, 1) + 63) / 64 * 64, "checkpoint size");
  }
  auto res = std::make_shared<detail::reservation>(total);
  NamedTensors named;
  named.reserve(ck.tensors.size());
  for (std::size_t i = 0; i < ck.tensors.size(); ++i)
    named.emplace_back(ck.tensors[i].name, TensorView::contiguous(ck.tensors[i].dtype, ck.tensors[i].shape, res->base() + at[i], res));
  const Value tree = unflatten(named, ck.skeleton);
  if (opts.attributes.empty())
    if (auto it = ck.metadata.find(std::string(attributes_metadata_key)); it != ck.metadata.end())
      opts.attributes = decode_attributes(it->second);
  if (opts.archive_name.empty())
    if (auto it = ck.metadata.find("torch.archive_name"); it != ck.metadata.end()) opts.archive_name = it->second;
  SavePlan plan = plan_save(tree, opts);
  // Each of ck's tensors: the storage that holds its placeholder, and where in it.
  std::vector<std::pair<const std::byte*, std::size_t>> starts;
  for (std::size_t i = 0; i < plan.storages.size(); ++i) starts.emplace_back(plan.storages[i].source, i);
  std::sort(starts.begin(), starts.end(), [](const auto& a, const auto& b) { return std::less<const std::byte*>()(a.first, b.first); });
  plan.tensors.clear();
  for (std::size_t i = 0; i < named.size(); ++i) {
    const std::byte* p = named[i].second.data();
    auto it = std::upper_bound(starts.begin(), starts.end(), p,
                               [](const std::byte* x, const auto& e) { return std::less<const std::byte*>()(x, e.first); });
    const bool found = it != starts.begin() && static_cast<std::uint64_t>(p - std::prev(it)->first) <= plan.storages[std::prev(it)->second].nbytes;
    if (!found) throw_error(errors::pt_unwritable, "tensor " + quote(named[i].first), "has no storage in the planned file");
    --it;
    PlannedTensor t;
    t.name = named[i].first;
    t.described = true;
    t.storage = it->second;
    t.offset = static_cast<std::uint64_t>(p - it->first) / itemsize(named[i].second.dtype());
    t.dtype = named[i].second.dtype();
    t.shape = named[i].second.shape();
    t.strides = named[i].second.strides();
    plan.tensors.push_back(std::move(t));
  }
  for (PlannedStorage& s : plan.storages) {
    s.source = nullptr;
    s.owner.reset();
  }
  return plan;
}

/// A torch.save file filled by positioned writes, in any order and from several threads: the
/// executor's path. Callers write storage bytes (`write`, or their own pwrite at
/// `plan().storage_offset(i)` followed by `report_crc`); `finish()` completes CRCs, writes the zip
/// framing around the storages (local headers, small records, data descriptors, central
/// directory; adjacent pieces as one write) and commits atomically.
///
/// CRCs: each `write` checksums the bytes it writes (CLMUL CRC-32 runs at ~10 GB/s, faster than
/// any disk) and records the piece; pieces are combined with crc32_combine in finish(). Storages
/// whose pieces do not tile them exactly (filled by raw pwrite without report_crc) are read back
/// from the file once in finish().
class PlannedWriter {
 public:
  PlannedWriter(const std::filesystem::path& path, SavePlan plan)
      : plan_(std::move(plan)), out_(OutputFile::create(path)), pieces_(plan_.storages.size()) {
    crcs_.resize(plan_.records.size(), 0);
    for (std::size_t i = 0; i < plan_.storages.size(); ++i) by_offset_.emplace_back(plan_.storage_offset(i), i);
    for (std::size_t i = 0; i < plan_.records.size(); ++i)
      if (!plan_.records[i].storage) crcs_[i] = zip::crc32(plan_.records[i].bytes);
  }

  [[nodiscard]] const SavePlan& plan() const noexcept { return plan_; }
  [[nodiscard]] OutputFile& file() noexcept { return out_; }

  /// Writes `bytes` at `offset` inside storage `storage` and records their CRC. Thread-safe.
  void write(std::size_t storage, std::uint64_t offset, std::span<const std::byte> bytes) {
    check(storage, offset, bytes.size());
    out_.pwrite(plan_.storage_offset(storage) + offset, bytes);
    report_crc(storage, offset, bytes.size(), zip::crc32(bytes));
  }
  /// Records the CRC-32 of bytes [offset, offset + length) of a storage written by the caller.
  void report_crc(std::size_t storage, std::uint64_t offset, std::uint64_t length, std::uint32_t crc) {
    check(storage, offset, length);
    std::lock_guard<std::mutex> lock(mu_);
    pieces_[storage].add(offset, length, crc);
  }
  /// Records the CRC-32 of output bytes [file_offset, file_offset + length), which must lie inside
  /// one storage (what an executor that writes destination chunks by file offset reports).
  void report_file_crc(std::uint64_t file_offset, std::uint64_t length, std::uint32_t crc) {
    const auto it = std::upper_bound(by_offset_.begin(), by_offset_.end(), file_offset,
                                     [](std::uint64_t x, const auto& e) { return x < e.first; });
    if (it == by_offset_.begin())
      throw_error(errors::pt_unwritable, "no storage at output offset " + std::to_string(file_offset));
    const std::size_t si = std::prev(it)->second;
    report_crc(si, file_offset - plan_.storage_offset(si), length, crc);
  }
  /// Completes the archive and gives it its final name.
  void finish() {
    out_.resize(plan_.layout.total_size);  // storages nobody wrote read back as zeros
    for (std::size_t i = 0; i < plan_.storages.size(); ++i) {
      const PlannedStorage& s = plan_.storages[i];
      std::uint32_t c = 0;
      if (pieces_[i].complete(s.nbytes)) c = pieces_[i].combined();
      else c = crc_from_file(plan_.storage_offset(i), s.nbytes);
      crcs_[s.record] = c;
    }
    WriteCoalescer framing(out_);
    for (std::size_t i = 0; i < plan_.records.size(); ++i) {
      const auto& e = plan_.layout.entries[i];
      framing.write(e.header_offset, zip::local_header_bytes(e, plan_.layout.options));
      if (!plan_.records[i].storage) framing.write(e.data_offset, plan_.records[i].bytes);
      framing.write(e.descriptor_offset, zip::descriptor_bytes(e, crcs_[i]));
    }
    framing.write(plan_.layout.central_offset, zip::tail_bytes(plan_.layout, crcs_));
    framing.flush();
    out_.commit();
  }

 private:
  void check(std::size_t storage, std::uint64_t offset, std::uint64_t length) const {
    if (storage >= plan_.storages.size() || offset > plan_.storages[storage].nbytes ||
        length > plan_.storages[storage].nbytes - offset)
      throw_error(errors::pt_unwritable, "write of " + std::to_string(length) + " bytes at offset " + std::to_string(offset) +
                                             " outside storage " + std::to_string(storage));
  }
  std::uint32_t crc_from_file(std::uint64_t offset, std::uint64_t length) const {
    auto in = InputFile::open(out_.temp_path(), read_mode::pread);
    std::vector<std::byte> buf(static_cast<std::size_t>(std::min<std::uint64_t>(length, std::uint64_t{4} << 20)));
    std::uint32_t c = 0;
    for (std::uint64_t done = 0; done < length;) {
      const std::uint64_t n = std::min<std::uint64_t>(buf.size(), length - done);
      in->read(offset + done, std::span<std::byte>(buf.data(), static_cast<std::size_t>(n)));
      c = zip::crc32(std::span<const std::byte>(buf.data(), static_cast<std::size_t>(n)), c);
      done += n;
    }
    return c;
  }

  SavePlan plan_;
  OutputFile out_;
  std::vector<zip::CrcPieces> pieces_;
  std::vector<std::uint32_t> crcs_;
  std::vector<std::pair<std::uint64_t, std::size_t>> by_offset_;  ///< storage start in the file -> index (ascending)
  std::mutex mu_;
};

}  // namespace torch
}  // namespace statedict::inline v0
