// statedict: FlatStateDict, what flatten() returns: the tensors by name and the skeleton.
// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "config.hpp"
#include "error.hpp"
#include "hash_index.hpp"
#include "skeleton.hpp"
#include "tensor.hpp"

namespace statedict::inline v0 {

namespace detail {
/// A name a skeleton ties to a stored tensor: an alias of it (no view) or a view into it.
struct skeleton_tie {
  std::string name, target;
  std::optional<ViewSpec> view;
};
/// The ties of a skeleton (core/flatten.hpp).
STATEDICT_API std::vector<skeleton_tie> skeleton_ties(const Skeleton& skeleton);
}  // namespace detail

/// What `flatten` returns: the tensors (unique names, tree pre-order) and the skeleton.
struct FlatStateDict {
  NamedTensors tensors;
  Skeleton skeleton;

  FlatStateDict() = default;
  FlatStateDict(NamedTensors t, Skeleton s) : tensors(std::move(t)), skeleton(std::move(s)) {}
  FlatStateDict(const FlatStateDict& o) : tensors(o.tensors), skeleton(o.skeleton) {}
  FlatStateDict(FlatStateDict&& o) noexcept : tensors(std::move(o.tensors)), skeleton(std::move(o.skeleton)) {}
  FlatStateDict& operator=(const FlatStateDict& o) {
    if (this != &o) *this = FlatStateDict(o);
    return *this;
  }
  FlatStateDict& operator=(FlatStateDict&& o) noexcept {
    tensors = std::move(o.tensors);
    skeleton = std::move(o.skeleton);
    reset_index();
    return *this;
  }
  ~FlatStateDict() { reset_index(); }

  /// The tensor named `name`: a stored one, or a name the skeleton ties to one (an alias gives the
  /// same view, a view_of node the view into its base). nullopt when there is none. Found by hash
  /// (the index is built on the first call, safely from several threads, and again when the
  /// number of tensors changed; after renaming entries in place call reset_index()).
  [[nodiscard]] std::optional<TensorView> find(std::string_view name) const {
    const lookup& ix = index();
    const std::uint32_t i = ix.names.find(hash_of(name), [&](std::uint32_t p) { return tensors[p].first == name; });
    if (i != detail::hash_index::npos) return tensors[i].second;
    for (const auto& tie : ix.ties) {
      if (tie.name != name) continue;
      const std::uint32_t b = ix.names.find(hash_of(tie.target), [&](std::uint32_t p) { return tensors[p].first == tie.target; });
      if (b == detail::hash_index::npos) return std::nullopt;
      if (!tie.view) return tensors[b].second;
      return view_into(tensors[b].second, *tie.view);
    }
    return std::nullopt;
  }
  /// Drops the index find() builds (after changing `tensors` or `skeleton` in place).
  void reset_index() const noexcept { delete cache_.exchange(nullptr); }

  /// Puts `t` in place of the stored tensor `name`, of any dtype and shape (a grown embedding):
  /// its skeleton node follows, and the names tied to it as aliases see the new tensor. Throws
  /// errors::flat_missing_tensor when `name` is not a stored tensor of this dict (a tie: replace
  /// its target), errors::flat_tensor_shape when a view_of node reads into it and the dtype or
  /// shape changes (the view would read other elements).
  void replace(std::string_view name, TensorView t) {
    auto it = std::find_if(tensors.begin(), tensors.end(), [&](const auto& e) { return e.first == name; });
    if (it == tensors.end())
      throw_error(errors::flat_missing_tensor, "tensor " + quote(name), "is not a stored tensor of the flat dict (a tie is replaced through its target)");
    const bool same = it->second.dtype() == t.dtype() && it->second.shape() == t.shape();
    if (!skeleton.is_null() && !same) {
      nlohmann::json& root = skeleton.mutable_json();
      std::vector<nlohmann::json*> work{&root};
      while (!work.empty()) {
        nlohmann::json& n = *work.back();
        work.pop_back();
        if (n.is_array()) {
          for (auto& c : n) work.push_back(&c);
          continue;
        }
        if (!n.is_object()) continue;
        if (const auto v = n.find("view_of"); v != n.end() && v->is_string() && *v == name)
          throw_error(errors::flat_tensor_shape, "tensor " + quote(name),
                      "has a view into it in the skeleton: its dtype and shape cannot change");
        if (const auto tn = n.find("tensor"); tn != n.end() && tn->is_string() && *tn == name) {
          n["dtype"] = std::string(statedict::name(t.dtype()));
          nlohmann::json dims = nlohmann::json::array();
          for (const auto d : t.shape()) dims.push_back(d);
          n["shape"] = std::move(dims);
          continue;
        }
        for (auto& c : n) work.push_back(&c);
      }
    }
    it->second = std::move(t);
    reset_index();
  }

 private:
  struct lookup {
    std::size_t size = 0;
    detail::hash_index names;
    std::vector<detail::skeleton_tie> ties;
  };
  static std::uint32_t hash_of(std::string_view s) noexcept { return detail::hash_index::mix(std::hash<std::string_view>{}(s)); }

  const lookup& index() const {
    lookup* p = cache_.load(std::memory_order_acquire);
    if (p && p->size == tensors.size()) return *p;
    auto fresh = std::make_unique<lookup>();
    fresh->size = tensors.size();
    fresh->names.reserve(tensors.size());
    for (std::size_t i = 0; i < tensors.size(); ++i) fresh->names.add(hash_of(tensors[i].first), i);
    if (!skeleton.is_null()) fresh->ties = detail::skeleton_ties(skeleton);
    if (cache_.compare_exchange_strong(p, fresh.get(), std::memory_order_acq_rel, std::memory_order_acquire)) {
      delete p;  // a stale index (tensors changed size)
      return *fresh.release();
    }
    return *p;  // another thread built it first
  }

  mutable std::atomic<lookup*> cache_{nullptr};
};

}  // namespace statedict::inline v0

// skeleton_ties and flatten itself.
#ifndef STATEDICT_DECLARATIONS_ONLY
#include "flatten.hpp"
#endif
