// statedict: optimizer state dicts: re-key `state` between int parameter ids and parameter names.
// SPDX-License-Identifier: MIT
//
// `torch.optim.Optimizer.state_dict()` is
//
//   {"state": {0: {"step": tensor(3.), "exp_avg": ..., "exp_avg_sq": ...}, 1: {...}, ...},
//    "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), ..., "params": [0, 1]},
//                     {"lr": 0.001, ..., "params": [2, 3]}]}
//
// where the ids number the parameters in optimizer order (group 0's params, then group 1's, ...)
// from 0, and newer PyTorch adds "param_names" to each group when the optimizer was built from
// named parameters. `optim::by_name` turns this into the form torch.distributed.checkpoint uses:
// `state` keyed by parameter name and each group's "params" listing names; `optim::by_id` turns
// it back, numbering the parameters in optimizer order as PyTorch does. Every other key
// (hyper-parameters, "param_names", extra top-level keys) is kept as it is, in its place.
// by_name(by_id(x)) == x always; by_id(by_name(x)) == x when x's ids are PyTorch's (0, 1, ... in
// optimizer order), which every Optimizer.state_dict() satisfies.
#pragma once

#include "config.hpp"
#include "detail/defines_facade.hpp"

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "error.hpp"
#include "optim_options.hpp"
#include "flatten.hpp"
#include "tensor.hpp"
#include "value.hpp"

namespace statedict::inline v0 {

/// Error ids of the optimizer helpers (220-239).
namespace errors {
// clang-format off
inline constexpr error_id optim_malformed        {220, error_kind::format, "optim.malformed"};         ///< not {"state": dict, "param_groups": [{"params": [...]}, ...]}
inline constexpr error_id optim_name_count       {221, error_kind::usage,  "optim.name_count"};        ///< as many names as parameters are needed
inline constexpr error_id optim_unknown_param    {222, error_kind::key,    "optim.unknown_param"};     ///< a state entry for a parameter no group lists
inline constexpr error_id optim_duplicate_param  {223, error_kind::key,    "optim.duplicate_param"};   ///< a parameter (id or name) listed twice
inline constexpr error_id optim_param_names      {224, error_kind::key,    "optim.param_names"};       ///< "param_names" disagree with the names given, or are partial
inline constexpr error_id optim_state_disagrees  {225, error_kind::format, "optim.state_disagrees"};   ///< per-parameter constant state (e.g. step) differs within a group
inline constexpr error_id optim_no_names         {226, error_kind::usage,  "optim.no_names"};          ///< no names given and no "param_names" in the groups
// clang-format on
}  // namespace errors

namespace optim {


namespace detail {

[[noreturn]] inline void malformed(std::string detail) { throw_error(errors::optim_malformed, "optimizer state", std::move(detail)); }

inline const Dict& top(const Value& osd) {
  if (!osd.is_dict()) malformed("is a " + std::string(to_string(osd.kind())) + ", not a dict");
  const Dict& d = osd.as_dict();
  const Value* s = d.find("state");
  const Value* g = d.find("param_groups");
  if (!s || !s->is_dict()) malformed("has no \"state\" dict");
  if (!g || !g->is_list()) malformed("has no \"param_groups\" list");
  return d;
}

/// The "params" list of every group, checked.
inline std::vector<const List*> group_params(const Value& osd) {
  std::vector<const List*> out;
  const List& groups = top(osd).at("param_groups").as_list();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const Value* p = groups[g].is_dict() ? groups[g].as_dict().find("params") : nullptr;
    if (!p || !p->is_list())
      malformed("param group " + std::to_string(g) + (groups[g].is_dict() ? " has no \"params\" list" : " is not a dict"));
    out.push_back(&p->as_list());
  }
  return out;
}

/// A short description of a state value for messages: numbers and one-element tensors by value.
inline std::string describe(const Value& v) {
  switch (v.kind()) {
    case value_kind::integer: return std::to_string(v.as_int());
    case value_kind::floating: {
      char buf[32];
      auto r = std::to_chars(buf, buf + sizeof buf, v.as_double());
      return std::string(buf, r.ptr);
    }
    case value_kind::boolean: return v.as_bool() ? "True" : "False";
    case value_kind::tensor: {
      const TensorView& t = v.as_tensor();
      std::string s = "tensor " + std::string(name(t.dtype())) + " " + to_string(t.shape());
      if (t.numel() == 1) {
        char buf[32];
        std::to_chars_result r{buf, {}};
        switch (t.dtype()) {
          case dtype::F32: r = std::to_chars(buf, buf + sizeof buf, t.load<float>(0)); break;
          case dtype::F64: r = std::to_chars(buf, buf + sizeof buf, t.load<double>(0)); break;
          case dtype::I64: r = std::to_chars(buf, buf + sizeof buf, t.load<std::int64_t>(0)); break;
          case dtype::I32: r = std::to_chars(buf, buf + sizeof buf, t.load<std::int32_t>(0)); break;
          default: break;
        }
        if (r.ptr != buf) s += " = " + std::string(buf, r.ptr);
      }
      return s;
    }
    default: return std::string(to_string(v.kind()));
  }
}

inline std::string param_label(const Value& p, std::span<const std::string> names, std::size_t pos) {
  if (pos < names.size()) return quote(names[pos]);
  return p.is_string() ? quote(p.as_string()) : p.is_int() ? std::to_string(p.as_int()) : "?";
}

}  // namespace detail

/// The "param_names" of every group, concatenated in optimizer order (newer PyTorch writes them);
/// empty when no group has them. Throws optim_param_names when only some groups have them or a
/// group's count differs from its "params".
inline std::vector<std::string> param_names(const Value& osd) {
  const auto params = detail::group_params(osd);
  const List& groups = osd["param_groups"].as_list();
  std::vector<std::string> out;
  std::size_t with = 0;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const Value* n = groups[g].as_dict().find("param_names");
    if (!n) continue;
    ++with;
    if (!n->is_sequence() || n->as_list().size() != params[g]->size())
      throw_error(errors::optim_param_names, "optimizer state",
                  "param group " + std::to_string(g) + " has " + std::to_string(params[g]->size()) +
                      " params but a \"param_names\" that is not a list of as many names");
    for (const Value& x : n->as_list()) {
      if (!x.is_string())
        throw_error(errors::optim_param_names, "optimizer state",
                    "param group " + std::to_string(g) + ": a \"param_names\" entry is a " + std::string(to_string(x.kind())));
      out.push_back(x.as_string());
    }
  }
  if (with != 0 && with != groups.size())
    throw_error(errors::optim_param_names, "optimizer state",
                std::to_string(with) + " of " + std::to_string(groups.size()) + " param groups have \"param_names\"");
  return out;
}

/// Checks that, within each param group, every parameter whose state has key `k` (for each k in
/// `keys`) has the same value there (compared exactly: tensors by dtype, shape and bytes). Works on
/// either form. `names`, when given, label parameters in messages (optimizer order). Throws
/// optim_state_disagrees naming the group, the key and the parameters that differ from the first.
inline void check_constant_state(const Value& osd, std::span<const std::string> keys, std::span<const std::string> names = {}) {
  const auto params = detail::group_params(osd);
  const Dict& state = osd["state"].as_dict();
  std::size_t pos = 0;
  for (std::size_t g = 0; g < params.size(); ++g) {
    const std::size_t first_pos = pos;
    for (const std::string& k : keys) {
      const Value* ref = nullptr;
      std::string ref_label;
      std::vector<std::string> differ;
      std::size_t agree = 0;
      for (std::size_t i = 0; i < params[g]->size(); ++i) {
        const Value& p = (*params[g])[i];
        if (!p.is_int() && !p.is_string()) detail::malformed("param group " + std::to_string(g) + " lists a " + std::string(to_string(p.kind())));
        const Value* s = state.find(p.is_int() ? Key(p.as_int()) : Key(p.as_string()));
        const Value* v = s && s->is_dict() ? s->as_dict().find(k) : nullptr;
        if (!v) continue;
        const std::string label = detail::param_label(p, names, first_pos + i);
        if (!ref) {
          ref = v;
          ref_label = label;
          ++agree;
        } else if (*v == *ref) {
          ++agree;
        } else {
          differ.push_back(label + " has " + detail::describe(*v));
        }
      }
      if (differ.empty()) continue;
      std::string msg = "param group " + std::to_string(g) + ": " + quote(k) + " is " + detail::describe(*ref) + " for " +
                        ref_label + (agree > 1 ? " and " + std::to_string(agree - 1) + " more" : "") + ", but ";
      for (std::size_t i = 0; i < differ.size() && i < 8; ++i) msg += (i ? ", " : "") + differ[i];
      if (differ.size() > 8) msg += ", and " + std::to_string(differ.size() - 8) + " more";
      throw_error(errors::optim_state_disagrees, "optimizer state", msg);
    }
    pos += params[g]->size();
  }
}

/// Re-keys an optimizer state dict from int param ids to parameter names: `state` keyed by name,
/// each group's "params" listing names, everything else unchanged and in place. `names` are the
/// parameter names in optimizer order (the concatenation of the groups' "params"); when empty, the
/// groups' "param_names" are used. State for a parameter no group lists is an error.
STATEDICT_API Value by_name(const Value& osd, std::span<const std::string> names = {}, const options& opt = {}) {
  const auto params = detail::group_params(osd);
  std::vector<std::string> from_groups = param_names(osd);
  std::size_t count = 0;
  for (const List* l : params) count += l->size();
  if (names.empty()) {
    if (from_groups.empty() && count != 0)
      throw_error(errors::optim_no_names, "optimizer state",
                  "no parameter names given and the param groups have no \"param_names\"");
    names = from_groups;
  } else if (!from_groups.empty() && !std::equal(names.begin(), names.end(), from_groups.begin(), from_groups.end())) {
    throw_error(errors::optim_param_names, "optimizer state", "the names given differ from the groups' \"param_names\"");
  }
  if (names.size() != count)
    throw_error(errors::optim_name_count, "optimizer state",
                std::to_string(names.size()) + " names for " + std::to_string(count) + " parameters");
  std::unordered_map<std::int64_t, std::size_t> pos_of_id;
  std::unordered_map<std::string_view, std::size_t> pos_of_name;
  pos_of_id.reserve(count);
  pos_of_name.reserve(count);
  std::size_t pos = 0;
  for (std::size_t g = 0; g < params.size(); ++g)
    for (const Value& p : *params[g]) {
      if (!p.is_int())
        detail::malformed("param group " + std::to_string(g) + " lists a " + std::string(to_string(p.kind())) +
                          " in \"params\"; ids are ints (already by name?)");
      if (!pos_of_id.emplace(p.as_int(), pos).second)
        throw_error(errors::optim_duplicate_param, "optimizer state", "param id " + std::to_string(p.as_int()) + " is listed twice");
      if (!pos_of_name.emplace(names[pos], pos).second)
        throw_error(errors::optim_duplicate_param, "optimizer state", "the parameter name " + quote(names[pos]) + " is given twice");
      ++pos;
    }
  if (!opt.constant_keys.empty()) check_constant_state(osd, opt.constant_keys, names);

  Dict out;
  out.reserve(osd.as_dict().size());
  for (const auto& [k, v] : osd.as_dict()) {
    if (k == Key("state")) {
      Dict st;
      st.reserve(v.as_dict().size());
      for (const auto& [id, s] : v.as_dict()) {
        if (!id.is_int()) detail::malformed("state key " + quote(id.as_string()) + " is a string; ids are ints (already by name?)");
        auto it = pos_of_id.find(id.as_int());
        if (it == pos_of_id.end())
          throw_error(errors::optim_unknown_param, "optimizer state",
                      "state for param id " + std::to_string(id.as_int()) + ", which no param group lists");
        st.append_unchecked(names[it->second], s);  // names are unique, checked above
      }
      out.append_unchecked(k, Value(std::move(st)));
    } else if (k == Key("param_groups")) {
      List groups;
      groups.reserve(params.size());
      std::size_t at = 0;
      for (const Value& g : v.as_list()) {
        Dict gd;
        gd.reserve(g.as_dict().size());
        for (const auto& [gk, gv] : g.as_dict()) {
          if (gk == Key("params")) {
            List l;
            l.reserve(gv.as_list().size());
            for (std::size_t i = 0; i < gv.as_list().size(); ++i) l.emplace_back(names[at++]);
            gd.append_unchecked(gk, Value::list(std::move(l)));
          } else {
            gd.append_unchecked(gk, gv);
          }
        }
        groups.emplace_back(std::move(gd));
      }
      out.append_unchecked(k, Value::list(std::move(groups)));
    } else {
      out.append_unchecked(k, v);
    }
  }
  return Value(std::move(out));
}

/// Re-keys a by-name optimizer state dict back to int param ids, numbering the parameters in
/// optimizer order from 0 as PyTorch does; "params" become those ids, `state` is keyed by them.
STATEDICT_API Value by_id(const Value& named, const options& opt = {}) {
  const auto params = detail::group_params(named);
  std::unordered_map<std::string_view, std::int64_t> id_of;
  std::int64_t next = 0;
  for (std::size_t g = 0; g < params.size(); ++g)
    for (const Value& p : *params[g]) {
      if (!p.is_string())
        detail::malformed("param group " + std::to_string(g) + " lists a " + std::string(to_string(p.kind())) +
                          " in \"params\"; names are strings (already by id?)");
      if (!id_of.emplace(p.as_string(), next++).second)
        throw_error(errors::optim_duplicate_param, "optimizer state", "the parameter " + quote(p.as_string()) + " is listed twice");
    }
  if (!opt.constant_keys.empty()) check_constant_state(named, opt.constant_keys);

  Dict out;
  out.reserve(named.as_dict().size());
  for (const auto& [k, v] : named.as_dict()) {
    if (k == Key("state")) {
      Dict st;
      st.reserve(v.as_dict().size());
      for (const auto& [name, s] : v.as_dict()) {
        if (!name.is_string()) detail::malformed("state key " + name.str() + " is an int; names are strings (already by id?)");
        auto it = id_of.find(name.as_string());
        if (it == id_of.end())
          throw_error(errors::optim_unknown_param, "optimizer state",
                      "state for parameter " + quote(name.as_string()) + ", which no param group lists");
        st.append_unchecked(it->second, s);  // ids are unique
      }
      out.append_unchecked(k, Value(std::move(st)));
    } else if (k == Key("param_groups")) {
      List groups;
      groups.reserve(params.size());
      for (const Value& g : v.as_list()) {
        Dict gd;
        gd.reserve(g.as_dict().size());
        for (const auto& [gk, gv] : g.as_dict()) {
          if (gk == Key("params")) {
            List l;
            l.reserve(gv.as_list().size());
            for (const Value& p : gv.as_list()) l.emplace_back(id_of.at(p.as_string()));
            gd.append_unchecked(gk, Value::list(std::move(l)));
          } else {
            gd.append_unchecked(gk, gv);
          }
        }
        groups.emplace_back(std::move(gd));
      }
      out.append_unchecked(k, Value::list(std::move(groups)));
    } else {
      out.append_unchecked(k, v);
    }
  }
  return Value(std::move(out));
}

/// by_name for a flattened optimizer state (`flatten(optimizer.state_dict())`): the same
/// re-keying, flat in and out ("state.0.exp_avg" becomes "state.fc.weight.exp_avg"). The tensors
/// are the same views: nothing is copied.
STATEDICT_API FlatStateDict by_name(const FlatStateDict& osd, std::span<const std::string> names = {}, const options& opt = {}) {
  return flatten(by_name(unflatten(osd), names, opt));
}

/// by_id for a flattened optimizer state keyed by names.
STATEDICT_API FlatStateDict by_id(const FlatStateDict& named, const options& opt = {}) { return flatten(by_id(unflatten(named), opt)); }

}  // namespace optim
}  // namespace statedict::inline v0
