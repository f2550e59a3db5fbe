// statedict: OLMo's "mapped" safetensors files: a nested state dict (model, or optimizer state with
// int parameter ids and param_groups, and any scalar) stored as one safetensors file. Read and
// written.
// SPDX-License-Identifier: MIT
//
// OLMo's olmo/safetensors_util.py walks the dict: a tensor leaf is stored under the name
// `urlsafe_b64(pickle((key_path, False)))`, any other leaf that is not a dict (numbers, strings,
// lists, tuples, None) is pickled into a 1-D U8 tensor stored under `urlsafe_b64(pickle((key_path,
// True)))`. `olmo_safetensors::describe` gives the nested tree back with its real keys (int keys stay
// ints), tensors zero-copy, pickled values unpickled by the safe unpickler (a value naming code to
// run is refused, never run; other classes are kept as data). Detection is by content: names that
// decode to such keys. `olmo_safetensors::write` (`convert --to olmo`) writes a file that OLMo's
// `safetensors_file_to_state_dict` turns back into the same nested dict: names and pickles as
// CPython writes them at protocol 4 (formats/detail/olmo_pickle.hpp), the reference safetensors
// layout, no `__metadata__`.
//
// Where OLMo's own loader is wrong, statedict refuses instead (docs/formats/olmo-safetensors.md):
// a key path stored twice (OLMo keeps the last), a path through a leaf (OLMo writes into a pickled
// list or replaces a None), an empty path, a pickled entry that is not 1-D U8, names that mix OLMo
// keys and plain names. A dict the file does not record (an empty one) is absent, as in OLMo.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>

#include "../core/dtype.hpp"
#include "../core/error.hpp"
#include "../core/flatten.hpp"
#include "../core/source.hpp"
#include "../core/value.hpp"
#include "../io/torch_file.hpp"
#include "../io/pickle_read.hpp"
#include "../io/safetensors.hpp"
#include "../shard/checkpoint.hpp"
#include "../shard/views.hpp"
#include "detail/describe_tree.hpp"
#include "detail/olmo_pickle.hpp"
#include "detail/safetensors_write.hpp"
#include "detail/torch_refs.hpp"
#include "format.hpp"
#include "safetensors.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id olmo_bad_name      {900, error_kind::format, "olmo.bad_name"};
inline constexpr error_id olmo_bad_key       {901, error_kind::format, "olmo.bad_key"};
inline constexpr error_id olmo_path_conflict {902, error_kind::format, "olmo.path_conflict"};
inline constexpr error_id olmo_pickled_value {903, error_kind::format, "olmo.pickled_value"};
inline constexpr error_id olmo_mixed_names   {904, error_kind::format, "olmo.mixed_names"};
inline constexpr error_id olmo_unwritable    {905, error_kind::usage,  "olmo.unwritable"};
inline constexpr error_id olmo_limit         {906, error_kind::limit,  "olmo.limit"};
// clang-format on
}  // namespace errors

namespace olmo_safetensors {

/// Caps on hostile input; each error names the field to raise.
struct limits {
  /// Limits of the safetensors header parser.
  safetensors::limits safetensors{};
  /// Limits of the unpickler, for names and values.
  pickle::limits pickle{};
  /// Elements of one key path.
  std::size_t max_key_depth = 1000;
  /// Bytes of one pickled value (read into memory to unpickle).
  std::uint64_t max_value_bytes = std::uint64_t{1} << 30;
};

struct options {
  olmo_safetensors::limits limits{};
};

/// One entry of the file: its stored name, the key path it decodes to, whether it is pickled.
struct Entry {
  std::string name;
  Path keys;
  bool pickled = false;
  std::size_t index = 0;  ///< position in safetensors::File::entries() (file offset order)
};

namespace detail {

namespace ol = formats::detail::olmo;

inline std::string where_file(const safetensors::File& f) { return "file " + quote(f.name()); }
inline std::string where_entry(const safetensors::File& f, const Path& keys) {
  return where_file(f) + ": key path " + quote(dotted(keys));
}

/// How many names of `f` decode to OLMo keys, and the first name that does not (for detection).
struct name_census {
  std::size_t decoded = 0;
  std::size_t total = 0;
  std::string first_bad;
};
inline name_census census(const safetensors::File& f, const limits& lim) {
  name_census c;
  for (const auto& e : f.entries()) {
    ++c.total;
    if (std::holds_alternative<ol::DecodedKey>(ol::decode_key(e.name, lim.pickle, lim.max_key_depth))) ++c.decoded;
    else if (c.first_bad.empty()) c.first_bad = e.name;
  }
  return c;
}

/// Whether any string of the safetensors header of `src` begins like urlsafe base64 of a pickle
/// ("gA", the PROTO opcode): a scan of the header bytes, no JSON parsed. False rules the file out;
/// true (or a header that does not fit the file: the reader explains) means it is worth decoding.
inline bool may_hold_keys(const ByteSource& src, const safetensors::limits& lim) {
  if (src.size() < 8) return false;
  std::byte len[8];
  src.read(0, len);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | std::to_integer<std::uint64_t>(len[static_cast<std::size_t>(i)]);
  if (n > src.size() - 8 || n > lim.max_header_bytes) return true;
  std::string_view text;
  std::vector<char> copy;
  if (const std::byte* d = src.data()) {
    text = std::string_view(reinterpret_cast<const char*>(d) + 8, static_cast<std::size_t>(n));
  } else {
    copy.resize(static_cast<std::size_t>(n));
    src.read(8, std::as_writable_bytes(std::span<char>(copy.data(), copy.size())));
    text = std::string_view(copy.data(), copy.size());
  }
  return text.find("\"gA") != std::string_view::npos;
}

/// Places `leaf` at `keys` in `root`, creating dicts; refuses what OLMo would overwrite or corrupt.
inline void place(Value& root, const Path& keys, Value leaf, const std::string& where) {
  Value* cur = &root;
  for (std::size_t i = 0; i + 1 < keys.size(); ++i) {
    Dict& d = cur->as_dict();
    Value* next = d.find(keys[i]);
    if (!next) {
      next = &d.append_unchecked(keys[i], Value(Dict{}));
    } else if (!next->is_dict()) {
      Path head(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      throw_error(errors::olmo_path_conflict, where,
                  "goes through " + quote(dotted(head)) + ", which is a stored value, not a dict");
    }
    cur = next;
  }
  Dict& d = cur->as_dict();
  if (const Value* ex = d.find(keys.back()))
    throw_error(errors::olmo_path_conflict, where,
                ex->is_dict() ? std::string("is a dict of other entries and also an entry of its own")
                              : std::string("is stored twice (two names decode to this key path)"));
  d.append_unchecked(keys.back(), std::move(leaf));
}

/// Unpickles the pickled value of entry `e` (1-D U8, at most limits::max_value_bytes).
inline Value unpickle_value(const safetensors::File& f, const safetensors::TensorEntry& e, const Path& keys, const limits& lim) {
  const std::string where = where_entry(f, keys);
  if (e.dtype_name != "U8" || e.shape.size() != 1)
    throw_error(errors::olmo_pickled_value, where,
                "a pickled value must be a 1-D U8 tensor, found " + std::string(e.dtype_name) + " of shape " + to_string(e.shape));
  if (e.nbytes() > lim.max_value_bytes)
    throw_error(errors::olmo_limit, where,
                "pickled value of " + std::to_string(e.nbytes()) + " bytes, more than limits::max_value_bytes");
  std::vector<std::byte> bytes(static_cast<std::size_t>(e.nbytes()));
  if (!bytes.empty()) f.source()->read(checked_add(f.data_offset(), e.begin, "offset"), bytes);
  pickle::options po;
  po.limits = lim.pickle;
  po.keep_unknown_objects = true;  // numpy scalars, config objects: kept as data, never called
  pickle::Result r;
  try {
    r = pickle::load(bytes, po);
  } catch (error& err) {
    err.add_context(where);
    throw;
  }
  if (r.consumed != bytes.size())
    throw_error(errors::olmo_pickled_value, where,
                "the pickle ends " + std::to_string(bytes.size() - r.consumed) + " bytes before the tensor does");
  if (r.value.is_dict())
    throw_error(errors::olmo_pickled_value, where, "holds a pickled dict (OLMo walks dicts into entries, it never pickles one)");
  return std::move(r.value);
}

}  // namespace detail

/// Every entry of `f` with its decoded key path, in file offset order. Throws errors::olmo_bad_key
/// for a name that is base64 of something other than an OLMo key, olmo_mixed_names when some names
/// decode and others are not base64 at all, olmo_bad_name when no name decodes.
inline std::vector<Entry> entries(const safetensors::File& f, const limits& lim = {}) {
  namespace ol = formats::detail::olmo;
  std::vector<Entry> out;
  const std::string* plain = nullptr;
  for (std::size_t i = 0; i < f.entries().size(); ++i) {
    const auto& e = f.entries()[i];
    auto d = ol::decode_key(e.name, lim.pickle, lim.max_key_depth);
    if (auto* k = std::get_if<ol::DecodedKey>(&d)) {
      out.push_back(Entry{e.name, std::move(k->keys), k->pickled, i});
      continue;
    }
    const auto& p = std::get<ol::KeyProblem>(d);
    if (p.base64) throw_error(errors::olmo_bad_key, detail::where_file(f) + ": tensor " + quote(e.name), p.detail);
    if (!plain) plain = &e.name;
  }
  if (plain && out.empty())
    throw_error(errors::olmo_bad_name, detail::where_file(f),
                "no tensor name is an OLMo key (urlsafe base64 of a pickled (key path, value_is_pickled)); " + quote(*plain) +
                    " is not: read it as plain safetensors");
  if (plain)
    throw_error(errors::olmo_mixed_names, detail::where_file(f) + ": tensor " + quote(*plain),
                "is a plain name, but " + std::to_string(out.size()) + " other names are OLMo keys (" +
                    quote(dotted(out.front().keys)) + ", ...): the file is neither OLMo's layout nor plain safetensors");
  return out;
}

/// Describes an OLMo mapped safetensors file: the nested tree with real keys, tensors in the file
/// (no byte read), pickled values unpickled into the skeleton. Format "olmo_safetensors"; entries in
/// file offset order (what safetensors >= 0.6 gives OLMo's loader).
inline ShardedCheckpoint describe(const safetensors::File& f, const options& opt = {}) {
  namespace tr = statedict::detail::torch_refs;
  const limits& lim = opt.limits;
  const std::vector<Entry> es = entries(f, lim);
  const ShardedCheckpoint plain = f.describe();  // one whole chunk per stored tensor, file order
  std::vector<TensorInfo> described;
  Value root{Dict{}};
  for (const Entry& e : es) {
    const std::string where = detail::where_entry(f, e.keys);
    Value leaf;
    if (e.pickled) {
      leaf = detail::unpickle_value(f, f.entries()[e.index], e.keys, lim);
    } else {
      described.push_back(plain.tensors[e.index]);
      leaf = tr::make_ref(described.size() - 1);
    }
    detail::place(root, e.keys, std::move(leaf), where);
  }
  auto fin = statedict::detail::describe_tree::finish(root, described);
  ShardedCheckpoint ck;
  ck.format = "olmo_safetensors";
  ck.sources = plain.sources;
  ck.tensors = std::move(fin.tensors);
  ck.skeleton = std::move(fin.skeleton);
  ck.metadata = plain.metadata;
  return ck;
}

inline ShardedCheckpoint describe(const std::filesystem::path& path, const options& opt = {}, read_mode mode = read_mode::mmap) {
  return describe(safetensors::File::open(path, safetensors::open_options{mode, opt.limits.safetensors}), opt);
}

// ---------------------------------------------------------------------------------------------
// Writing

namespace detail {

/// One entry to write: a tensor of the checkpoint, or a pickled value.
struct out_entry {
  Path keys;
  std::optional<std::size_t> tensor;  ///< index into the checkpoint's tensors
  std::vector<std::byte> pickle;      ///< the pickled value otherwise
};

/// Walks `d` as OLMo's flatten_dict does: dicts are walked (an empty one gives nothing), tensors
/// are entries, anything else is pickled whole.
template <class TensorIndex>
void walk(const Dict& d, Path& path, std::vector<out_entry>& out, TensorIndex&& tensor_index, std::size_t depth) {
  if (depth > 1000) throw_error(errors::olmo_unwritable, "key path " + quote(dotted(path)), "dicts nested deeper than 1000 levels");
  for (const auto& [k, v] : d) {
    path.push_back(k);
    if (v.is_dict()) {
      walk(v.as_dict(), path, out, tensor_index, depth + 1);
    } else if (v.is_tensor()) {
      out.push_back(out_entry{path, tensor_index(v.as_tensor(), path), {}});
    } else {
      formats::detail::olmo::P4Writer w(errors::olmo_unwritable, "value at " + quote(dotted(path)));
      out.push_back(out_entry{path, std::nullopt, w.dumps(v)});
    }
    path.pop_back();
  }
}

}  // namespace detail

/// Writes `ck` as an OLMo mapped safetensors file at `path`, atomically: each tensor under its key
/// path's name, each other leaf pickled, the reference safetensors layout without `__metadata__`.
/// Throws errors::olmo_unwritable for what the layout cannot hold: a tree that is not a dict, tied
/// tensors or views (safetensors stores no tensor twice), a tensor inside a non-dict value.
inline void write(const ShardedCheckpoint& ck, const std::filesystem::path& path, const exec_options& exec = {},
                  const plan_options& popt = {}) {
  // The tree the description stands for, with placeholder views (reserved address space, never read).
  const std::size_t n = ck.tensors.size();
  std::vector<std::uint64_t> start(n);
  std::uint64_t total = 16;
  for (std::size_t i = 0; i < n; ++i) {
    start[i] = total;
    total = checked_add(total, checked_add(byte_size(ck.tensors[i].shape, itemsize(ck.tensors[i].dtype)), 31, "reservation") / 16 * 16,
                        "reservation");
  }
  auto space = std::make_shared<torch::detail::reservation>(total);
  NamedTensors named;
  named.reserve(n);
  for (std::size_t i = 0; i < n; ++i)
    named.emplace_back(ck.tensors[i].name, TensorView::contiguous(ck.tensors[i].dtype, ck.tensors[i].shape, space->base() + start[i], space));
  const Value tree = unflatten(named, ck.skeleton);
  if (!tree.is_dict())
    throw_error(errors::olmo_unwritable, "output " + quote(path.string()),
                "the checkpoint is a " + std::string(to_string(tree.kind())) + ", and an OLMo file holds a dict");

  std::vector<std::optional<Path>> used(n);
  auto tensor_index = [&](const TensorView& v, const Path& at) -> std::size_t {
    const auto off = static_cast<std::uint64_t>(v.data() - space->base());
    const auto it = std::lower_bound(start.begin(), start.end(), off);
    const auto i = static_cast<std::size_t>(it - start.begin());
    if (it == start.end() || *it != off || v.dtype() != ck.tensors[i].dtype || v.shape() != ck.tensors[i].shape || !v.is_contiguous())
      throw_error(errors::olmo_unwritable, "key path " + quote(dotted(at)),
                  "is a view into another tensor's elements; safetensors stores every tensor on its own");
    if (used[i])
      throw_error(errors::olmo_unwritable, "key path " + quote(dotted(at)),
                  "is the same tensor as " + quote(dotted(*used[i])) + " (tied); safetensors cannot store a tensor twice");
    used[i] = at;
    return i;
  };
  std::vector<detail::out_entry> entries;
  Path p;
  detail::walk(tree.as_dict(), p, entries, tensor_index, 0);

  // The tensors as stored: the checkpoint's under their names, the pickles from memory.
  ShardedCheckpoint src;
  src.format = ck.format;
  src.sources = ck.sources;
  std::unordered_set<std::string> names;
  for (auto& e : entries) {
    std::string name = formats::detail::olmo::encode_key(e.keys, !e.tensor, errors::olmo_unwritable);
    if (!names.insert(name).second)
      throw_error(errors::olmo_unwritable, "key path " + quote(dotted(e.keys)), "its name is written twice");
    if (e.tensor) {
      TensorInfo t = ck.tensors[*e.tensor];
      t.name = std::move(name);
      src.tensors.push_back(std::move(t));
    } else {
      auto buf = std::make_shared<std::vector<std::byte>>(std::move(e.pickle));
      const auto len = static_cast<dim_t>(buf->size());
      auto mem = std::make_shared<MemorySource>("pickle of " + dotted(e.keys), buf->data(), buf->size(), buf);
      (void)add_stored(src, std::move(name), dtype::U8, shape_t{len}, std::move(mem), 0);
    }
  }
  (void)formats::detail::write_safetensors_file(src, std::nullopt, path, exec, popt);
}

// ---------------------------------------------------------------------------------------------
// The plug-in

/// OLMo mapped safetensors files: detected when tensor names decode to OLMo's key pickles; written
/// with `--to olmo`.
class format final : public formats::Format {
 public:
  [[nodiscard]] std::string_view name() const noexcept override { return "olmo"; }
  [[nodiscard]] std::string_view title() const noexcept override { return "OLMo mapped safetensors"; }

  [[nodiscard]] formats::Detection detect(const formats::Input& in, const formats::open_options& opt) const override {
    if (in.is_directory()) return formats::Detection::not_applicable();
    std::string found;
    if (!safetensors::detail::looks_like_file(in.head(), in.file()->size(), found)) return formats::Detection::not_applicable();
    const limits& lim = opt.settings.get<options>().limits;
    if (!detail::may_hold_keys(*in.file(), lim.safetensors))
      return formats::Detection::miss("no tensor name begins like urlsafe base64 of a pickle");
    std::optional<safetensors::File> f;
    try {
      f = safetensors::File::open(in.file(), lim.safetensors);
    } catch (const error&) {
      return formats::Detection::not_applicable();  // the safetensors reader explains what is wrong
    }
    const detail::name_census c = detail::census(*f, lim);
    if (c.decoded == 0) return formats::Detection::miss("no tensor name is urlsafe base64 of a pickled (key path, value_is_pickled)");
    // Any decodable name claims the file: a mix is refused by describe(), not read as plain names.
    return formats::Detection::match("OLMo mapped safetensors: " + std::to_string(c.decoded) + " of " + std::to_string(c.total) +
                                     " tensor names are urlsafe base64 of a pickled (key path, value_is_pickled)");
  }
  [[nodiscard]] ShardedCheckpoint describe(const formats::Input& in, const formats::open_options& opt) const override {
    const options& o = opt.settings.get<options>();
    return olmo_safetensors::describe(safetensors::File::open(in.file(), o.limits.safetensors), o);
  }

  [[nodiscard]] bool can_write() const noexcept override { return true; }
  void check_output(const std::filesystem::path&, const formats::save_options& opt) const override {
    formats::detail::refuse_option(opt.world_size.has_value(), "--world-size", "an OLMo mapped safetensors file", "it is one file");
    formats::detail::refuse_option(opt.max_shard_size.has_value(), "--max-shard-size", "an OLMo mapped safetensors file", "it is one file");
    formats::detail::refuse_option(opt.part.has_value() || opt.index_only, "--part", "a single file",
                                   "parts split outputs of several files (Hugging Face shards, DCP, ColossalAI)");
  }
  std::vector<std::string> save(const ShardedCheckpoint& ck, const std::filesystem::path& out, const formats::save_options& opt) const override {
    write(ck, out, opt.exec, opt.plan);
    return {out.filename().string()};
  }
};

}  // namespace olmo_safetensors
}  // namespace statedict::inline v0
