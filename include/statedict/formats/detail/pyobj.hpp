// statedict: reading pickled Python objects kept as opaque `Object` nodes (dataclasses, enums,
// torch.Size, dtypes) with checked field access and messages that say where and what.
// SPDX-License-Identifier: MIT
//
// Used by the DCP `.metadata` reader and the ShardedTensor rank-file reader. Nothing here executes
// anything: an object is its class name plus the arguments and BUILD state the pickle gave it.
//
// A dataclass pickled with protocol >= 2 is `NEWOBJ(cls, ())` followed by `BUILD(state)`, where the
// state is the instance `__dict__`, or `(dict_or_None, slots_dict)` for classes with `__slots__`,
// or whatever `__getstate__` returned (TensorProperties returns a tuple). `attributes()` merges the
// dict forms; classes with tuple states are read by position by their callers.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../../core/dtype.hpp"
#include "../../core/error.hpp"
#include "../../core/shape.hpp"
#include "../../core/value.hpp"

namespace statedict::inline v0::detail::pyobj {

/// "int", "str", "object torch.distributed.checkpoint.metadata.Metadata", ... for messages.
inline std::string kind_of(const Value& v) {
  if (v.is_object()) return "object " + quote(v.as_object().qualified());
  return std::string(to_string(v.kind()));
}

/// Where a field sits, for messages: the file and a dotted key path inside it.
struct Where {
  std::string file;  ///< already quoted file description ("file '/x/.metadata'")
  std::string key;   ///< dotted path of the field (unquoted; quoted when printed)

  [[nodiscard]] Where operator/(std::string_view k) const {
    Where w{file, key};
    if (!w.key.empty()) w.key += '.';
    w.key += k;
    return w;
  }
  [[nodiscard]] Where operator/(std::size_t i) const { return *this / std::string_view(std::to_string(i)); }
  [[nodiscard]] std::string text() const { return key.empty() ? file : file + ": key " + quote(key); }
};

/// Throws `id` at `w` with "expected X, found Y".
[[noreturn]] inline void expected(const error_id& id, const Where& w, std::string_view what, const Value& found) {
  throw_error(id, w.text(), "expected " + std::string(what) + ", found " + kind_of(found));
}

/// True when `v` is an object of one of the classes `qualified` ("module.Name").
inline bool is_class(const Value& v, std::initializer_list<std::string_view> qualified) {
  if (!v.is_object()) return false;
  const Object& o = v.as_object();
  for (std::string_view q : qualified) {
    if (q.size() == o.module.size() + 1 + o.name.size() && q.compare(0, o.module.size(), o.module) == 0 &&
        q[o.module.size()] == '.' && q.compare(o.module.size() + 1, std::string_view::npos, o.name) == 0)
      return true;
  }
  return false;
}

/// True when `v` is a reference to the global `module.name` itself (not a call of it).
inline bool is_global(const Value& v, std::string_view module, std::string_view name) {
  return v.is_object() && v.as_object().how == object_build::global && v.as_object().module == module &&
         v.as_object().name == name;
}

/// The attributes of an object, read in place: the dicts of an object built from a BUILD state
/// that is a dict, `(dict, slots)` or `(None, slots)`, a key of a later one (slots) taking
/// precedence over the same key of an earlier one. Refers into the object, which must outlive it.
class AttrView {
 public:
  AttrView() = default;
  /// The attributes of `o`, or nullopt when it has no dict-shaped state (no BUILD, or a
  /// `__getstate__` tuple).
  static std::optional<AttrView> of(const Object& o) {
    AttrView a;
    for (const Value& s : o.state) {
      if (s.is_dict()) {
        a.add(s.as_dict());
      } else if (s.is_tuple() && s.as_list().size() == 2 && (s.as_list()[0].is_none() || s.as_list()[0].is_dict()) &&
                 s.as_list()[1].is_dict()) {
        if (s.as_list()[0].is_dict()) a.add(s.as_list()[0].as_dict());
        a.add(s.as_list()[1].as_dict());
      } else {
        return std::nullopt;
      }
    }
    if (a.dicts_.empty()) return std::nullopt;
    return a;
  }
  [[nodiscard]] const Value* find(const Key& k) const {
    for (auto it = dicts_.rbegin(); it != dicts_.rend(); ++it)
      if (const Value* v = (*it)->find(k)) return v;
    return nullptr;
  }
  /// The dicts, in the order BUILD applied them.
  [[nodiscard]] const std::vector<const Dict*>& dicts() const noexcept { return dicts_; }

 private:
  void add(const Dict& d) { dicts_.push_back(&d); }
  std::vector<const Dict*> dicts_;
};

/// The attributes of an object (AttrView::of) copied into one Dict, later dicts' keys last.
inline std::optional<Dict> attributes(const Object& o) {
  const auto view = AttrView::of(o);
  if (!view) return std::nullopt;
  Dict out;
  for (const Dict* d : view->dicts())
    for (const auto& [k, v] : *d) out.set(k, v);
  return out;
}

/// The attributes of an object of an expected class, in place; throws `id` when it has none.
inline AttrView require_attributes(const error_id& id, const Where& w, const Value& v, std::string_view what) {
  auto a = AttrView::of(v.as_object());
  if (!a) throw_error(id, w.text(), std::string(what) + " object has no attribute state (BUILD with a dict)");
  return *a;
}

/// A field of an object's attributes (a Dict or an AttrView); throws `id` when missing.
template <class Attrs>
const Value& field(const error_id& id, const Where& w, const Attrs& attrs, std::string_view name) {
  const Value* v = attrs.find(Key(std::string(name)));
  if (!v) throw_error(id, (w / name).text(), "missing field " + quote(name));
  return *v;
}

/// An optional field: nullptr when missing.
template <class Attrs>
const Value* optional_field(const Attrs& attrs, std::string_view name) {
  return attrs.find(Key(std::string(name)));
}

inline const std::string& as_str(const error_id& id, const Where& w, const Value& v) {
  if (!v.is_string()) expected(id, w, "a str", v);
  return v.as_string();
}

inline std::int64_t as_int(const error_id& id, const Where& w, const Value& v) {
  if (!v.is_int()) expected(id, w, "an int", v);
  return v.as_int();
}

/// A non-negative int (offsets, lengths, ranks).
inline std::uint64_t as_count(const error_id& id, const error_id& negative_id, const Where& w, const Value& v) {
  const std::int64_t i = as_int(id, w, v);
  if (i < 0) throw_error(negative_id, w.text(), "expected a non-negative int, found " + std::to_string(i));
  return static_cast<std::uint64_t>(i);
}

inline bool as_bool(const error_id& id, const Where& w, const Value& v) {
  if (!v.is_bool()) expected(id, w, "a bool", v);
  return v.as_bool();
}

/// A sequence of ints (torch.Size is read as a tuple of ints; lists are accepted too). At most
/// `max_rank` items (`rank_id` otherwise); items need not be non-negative (callers check).
inline shape_t as_ints(const error_id& id, const error_id& rank_id, std::size_t max_rank, const Where& w,
                       const Value& v) {
  // The unpickler reads torch.Size((...)) as a tuple; a tree built by hand may hold the call.
  const Value* seq = &v;
  if (v.is_object() && v.as_object().qualified() == "torch.Size" && v.as_object().how == object_build::reduce &&
      v.as_object().args.size() == 1 && v.as_object().state.empty() && v.as_object().items.empty())
    seq = &v.as_object().args[0];
  if (!seq->is_sequence()) expected(id, w, "a torch.Size (tuple of ints)", v);
  const List& l = seq->as_list();
  if (l.size() > max_rank)
    throw_error(rank_id, w.text(), std::to_string(l.size()) + " dimensions exceed the limit of " + std::to_string(max_rank));
  shape_t out;
  out.reserve(l.size());
  for (std::size_t i = 0; i < l.size(); ++i) {
    if (!l[i].is_int()) expected(id, w / i, "an int", l[i]);
    out.push_back(l[i].as_int());
  }
  return out;
}

/// A `torch.<dtype>` global (`GLOBAL torch float32`) as a statedict dtype; nullopt for a torch
/// dtype statedict does not handle (the name is reported by the caller); throws `id` when `v` is
/// not a torch dtype global at all.
inline std::optional<dtype> torch_dtype(const error_id& id, const Where& w, const Value& v, std::string* name = nullptr) {
  if (!v.is_object() || v.as_object().how != object_build::global || v.as_object().module != "torch")
    expected(id, w, "a torch dtype (global torch.<dtype>)", v);
  if (name) *name = v.as_object().name;
  return dtype_from_torch_name(v.as_object().name);
}

}  // namespace statedict::inline v0::detail::pyobj
