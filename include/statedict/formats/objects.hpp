// statedict: objects as data in outputs. A checkpoint read from a file that pickled objects
// (argparse.Namespace args, config classes, enums, whole nn.Modules) holds them as object nodes
// of its skeleton; before it is written, each object whose class torch.load(weights_only=True)
// would not accept becomes its data, so that no output of statedict can run code when loaded.
// SPDX-License-Identifier: MIT
//
// The rule is io/pickle_write.hpp's (the pickler applies it to every tree it writes; this header
// applies it to skeletons, which safetensors, Hugging Face and DCP outputs store):
//   {"object": {module, name, how: reduce|newobj, args: [], state: [{"dict": [[str, NODE]...]}], items: []}}
//        -> {"dict": [[str, NODE]...], "class": "module.name"}       (the attributes: vars(obj))
//   {"object": {module, name, how: reduce|newobj, args, state, items}} otherwise
//        -> {"dict": [["args", {"tuple": args}], ["state", STATE], ["items", {"list": items}]],
//            "class": "module.name"}   (only the parts it has; STATE is the state, or a tuple of them)
//   {"object": {module, name, how: global, ...}} -> "module.name"
// "class" is a member readers ignore (docs/flatten.md): unflatten gives the plain dict, and the
// skeleton still says where it came from. Tensor nodes keep their names. Classes in
// `keep_classes`, and those torch's weights_only list has (torch.device, storages, the rebuild
// functions of sparse and quantized tensors), stay objects.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../core/detail/text.hpp"
#include "../core/skeleton.hpp"
#include "../io/pickle_write.hpp"
#include "../shard/checkpoint.hpp"

namespace statedict::inline v0::formats {

/// What objects_as_data did with one class.
struct ObjectNote {
  std::string cls;                ///< "argparse.Namespace"
  std::uint64_t instances = 0;    ///< objects written as data
  std::uint64_t references = 0;   ///< references to the class itself, written as its name
  bool all_attributes = true;     ///< every instance became the dict of its attributes
  /// One line saying what was done ("argparse.Namespace: 1 object written as the dict of its
  /// attributes").
  [[nodiscard]] std::string describe() const {
    std::string s = cls + ": ";
    if (instances) {
      s += std::to_string(instances) + (instances == 1 ? " object" : " objects") + " written as " +
           (all_attributes ? "the dict of its attributes" : "a dict of its args, state and items");
    }
    if (references) {
      s += std::string(instances ? "; " : "") + std::to_string(references) + (references == 1 ? " reference" : " references") +
           " to the class written as its name";
    }
    return s;
  }
};

namespace detail {

/// A skeleton string (JSON string or {"str_bytes": base64}) as its bytes; false if it is neither.
inline bool skeleton_text(const nlohmann::json& j, std::string& out) {
  if (j.is_string()) {
    out = j.get<std::string>();
    return true;
  }
  if (j.is_object() && j.size() == 1 && j.contains("str_bytes") && j["str_bytes"].is_string()) {
    std::vector<std::uint8_t> raw;
    if (!statedict::detail::base64_decode(j["str_bytes"].get<std::string>(), raw)) return false;
    out.assign(raw.begin(), raw.end());
    return true;
  }
  return false;
}

/// A str node of `s`: a JSON string, or {"str_bytes"} when it is not UTF-8.
inline nlohmann::json skeleton_str(const std::string& s) {
  if (statedict::detail::first_invalid_utf8(s, statedict::detail::utf8_surrogates::allowed) == std::string::npos) return s;
  return nlohmann::json{{"str_bytes", statedict::detail::base64_encode(s)}};
}

/// Whether a skeleton dict node's keys are all strings (attribute names).
inline bool str_keyed(const nlohmann::json& node) {
  if (!node.is_object() || node.size() < 1 || !node.contains("dict") || !node["dict"].is_array()) return false;
  for (const auto& kv : node["dict"]) {
    if (!kv.is_array() || kv.size() != 2) return false;
    std::string ignored;
    if (!skeleton_text(kv[0], ignored)) return false;
  }
  return true;
}

/// The data node of the object node body `o` (module, name, how, args, state, items), or
/// nothing when `o` is not a well-formed object body or may stay an object.
inline bool object_data(nlohmann::json& node, const std::vector<std::string>& keep, std::map<std::string, ObjectNote>& notes) {
  nlohmann::json& o = node["object"];
  std::string module, name;
  if (!o.is_object() || !o.contains("module") || !o.contains("name") || !o.contains("how") || !skeleton_text(o["module"], module) ||
      !skeleton_text(o["name"], name) || !o["how"].is_string())
    return false;
  for (const char* part : {"args", "state", "items"})
    if (!o.contains(part) || !o[part].is_array()) return false;
  const std::string q = module + "." + name;
  if (pickle::writable_as_itself(q, keep)) return false;
  // Python's own values that the reader keeps as objects (ints beyond int64, sets, dicts with
  // attributes): the pickle writer writes them as those values, never as a call of a class.
  if (o["how"] == "reduce" && (q == "builtins.int" || q == "builtins.set" || q == "builtins.frozenset" || q == "builtins.dict" ||
                               q == "collections.OrderedDict"))
    return false;
  ObjectNote& note = notes[q];
  note.cls = q;
  if (o["how"] == "global") {
    ++note.references;
    node = skeleton_str(q);
    return true;
  }
  ++note.instances;
  nlohmann::json args = std::move(o["args"]), state = std::move(o["state"]), items = std::move(o["items"]);
  nlohmann::json out(nlohmann::json::value_t::object);
  if (args.empty() && items.empty() && state.size() == 1 && str_keyed(state[0])) {
    out["dict"] = std::move(state[0]["dict"]);
  } else {
    note.all_attributes = false;
    nlohmann::json pairs = nlohmann::json::array();
    if (!args.empty()) pairs.push_back(nlohmann::json::array({"args", nlohmann::json{{"tuple", std::move(args)}}}));
    if (!state.empty())
      pairs.push_back(nlohmann::json::array({"state", state.size() == 1 ? std::move(state[0]) : nlohmann::json{{"tuple", std::move(state)}}}));
    if (!items.empty()) pairs.push_back(nlohmann::json::array({"items", nlohmann::json{{"list", std::move(items)}}}));
    out["dict"] = std::move(pairs);
  }
  out["class"] = skeleton_str(q);
  node = std::move(out);
  return true;
}

/// Whether a skeleton has an object node anywhere (from its compact form when it has one).
inline bool holds_objects(const Skeleton& s) {
  if (s.is_null()) return false;
  if (const auto* tape = s.tape()) {
    for (const auto& n : tape->nodes)
      if (n.kind == statedict::detail::snode::object) return true;
    return false;
  }
  // A document: walked (nodes are {"dict": [[key, node]...]}, {"list": [...]}, {"tuple": [...]},
  // {"object": {...}} or leaves) until the first object node.
  std::vector<const nlohmann::json*> work;
  const nlohmann::json& doc = s.json();
  if (doc.is_object())
    if (const auto r = doc.find("root"); r != doc.end()) work.push_back(&*r);
  while (!work.empty()) {
    const nlohmann::json& n = *work.back();
    work.pop_back();
    if (!n.is_object()) continue;
    if (n.size() == 1 && n.contains("object")) return true;
    if (const auto it = n.find("dict"); it != n.end() && it->is_array()) {
      for (const auto& kv : *it)
        if (kv.is_array() && kv.size() == 2) work.push_back(&kv[1]);
    } else {
      for (const char* key : {"list", "tuple"})
        if (const auto c = n.find(key); c != n.end() && c->is_array())
          for (const auto& x : *c) work.push_back(&x);
    }
  }
  return false;
}

}  // namespace detail

/// Rewrites the object nodes of `skeleton` as their data (see the top of this file) and says, per
/// class, what it did. Iterative: a skeleton of any depth.
inline std::vector<ObjectNote> objects_as_data(nlohmann::json& skeleton, const std::vector<std::string>& keep_classes) {
  std::map<std::string, ObjectNote> notes;
  std::vector<nlohmann::json*> work;
  if (skeleton.is_object() && skeleton.contains("root")) work.push_back(&skeleton["root"]);
  while (!work.empty()) {
    nlohmann::json& n = *work.back();
    work.pop_back();
    if (!n.is_object()) continue;
    if (n.size() == 1 && n.contains("object")) (void)detail::object_data(n, keep_classes, notes);
    if (!n.is_object()) continue;  // a class reference became its name
    const auto children = [&](const char* key) {
      if (const auto it = n.find(key); it != n.end() && it->is_array())
        for (auto c = it->rbegin(); c != it->rend(); ++c) work.push_back(&*c);
    };
    if (const auto it = n.find("dict"); it != n.end() && it->is_array()) {
      for (auto kv = it->rbegin(); kv != it->rend(); ++kv)
        if (kv->is_array() && kv->size() == 2) work.push_back(&(*kv)[1]);
    } else if (n.contains("list")) {
      children("list");
    } else if (n.contains("tuple")) {
      children("tuple");
    } else if (const auto ob = n.find("object"); ob != n.end() && ob->is_object()) {
      nlohmann::json& body = *ob;
      for (const char* part : {"items", "state", "args"})
        if (const auto p = body.find(part); p != body.end() && p->is_array())
          for (auto c = p->rbegin(); c != p->rend(); ++c) work.push_back(&*c);
    }
  }
  std::vector<ObjectNote> out;
  out.reserve(notes.size());
  for (auto& [k, v] : notes) out.push_back(std::move(v));
  return out;
}

/// The same for a checkpoint's skeleton; a skeleton without objects is left as it is (its
/// compact form kept).
inline std::vector<ObjectNote> objects_as_data(ShardedCheckpoint& ck, const std::vector<std::string>& keep_classes) {
  if (!detail::holds_objects(ck.skeleton)) return {};
  return objects_as_data(ck.skeleton.mutable_json(), keep_classes);
}

}  // namespace statedict::inline v0::formats
