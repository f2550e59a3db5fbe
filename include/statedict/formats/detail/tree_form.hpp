// statedict: a described checkpoint as an editable tree, for the transforms of formats/transform.hpp.
// SPDX-License-Identifier: MIT
//
// tree_form unflattens the checkpoint's skeleton with a placeholder view standing for each tensor:
// a view into reserved, inaccessible address space (never read), each tensor at an address of its
// own. Ties stay ties (the same view twice) and views stay views into their base, so edits on the
// tree (moving a leaf, dropping one, putting a new tensor in) keep them right without special
// cases. result() flattens the edited tree: flatten's names and skeleton, and for each tensor the
// chunks of the tensor its placeholder stands for (a view into one becomes its elements).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/flatten.hpp"
#include "../../core/tensor.hpp"
#include "../../core/value.hpp"
#include "../../io/torch_file.hpp"
#include "../../shard/box.hpp"
#include "../../shard/checkpoint.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id select_view_sharded {792, error_kind::unsupported, "convert.select_view_sharded"};
// clang-format on
}  // namespace errors

namespace formats::detail {

/// Tensor `name`: the elements `v` selects of `base`'s row-major flat index, described in place
/// (base must be stored whole, contiguous, in one chunk: a torch.save or safetensors tensor).
inline TensorInfo view_of(const TensorInfo& base, const std::string& name, const ViewSpec& v) {
  const auto& c = base.chunks;
  const bool whole = c.size() == 1 && c[0].at.strides.empty() && c[0].at.stored == base.dtype && covers_whole(c[0].region, base.shape);
  if (!whole)
    throw_error(errors::select_view_sharded, "tensor " + quote(name),
                "is a view of " + quote(base.name) + ", which is stored in several pieces");
  TensorInfo t{name, base.dtype, v.shape, {}};
  Chunk ch;
  ch.region = full_box(t.shape);
  ch.at = c[0].at;
  ch.at.byte_offset = checked_add(c[0].at.byte_offset, checked_mul(static_cast<std::uint64_t>(v.offset), itemsize(base.dtype)));
  ch.at.strides = v.strides;
  t.chunks = {ch};
  return t;
}

class tree_form {
 public:
  explicit tree_form(const ShardedCheckpoint& ck) : format_(ck.format), sources_(ck.sources), metadata_(ck.metadata) {
    // One reservation for all of them, each tensor at its own 64-byte aligned place.
    std::vector<std::uint64_t> at(ck.tensors.size());
    std::uint64_t total = 0;
    for (std::size_t i = 0; i < ck.tensors.size(); ++i) {
      at[i] = total;
      const std::uint64_t n = std::max<std::uint64_t>(byte_size(ck.tensors[i].shape, itemsize(ck.tensors[i].dtype)), 1);
      total = checked_add(total, checked_add(n, 63, "checkpoint size") / 64 * 64, "checkpoint size");
    }
    auto space = std::make_shared<torch::detail::reservation>(total);
    NamedTensors named;
    named.reserve(ck.tensors.size());
    infos_.reserve(ck.tensors.size());
    slots_.reserve(ck.tensors.size());
    for (std::size_t i = 0; i < ck.tensors.size(); ++i) {
      const TensorInfo& t = ck.tensors[i];
      const std::byte* p = space->base() + at[i];
      slots_.push_back(slot{reinterpret_cast<std::uintptr_t>(p), std::max<std::uint64_t>(byte_size(t.shape, itemsize(t.dtype)), 1), i});
      infos_.push_back(t);
      views_.push_back(TensorView::contiguous(t.dtype, t.shape, p, space));
      named.emplace_back(t.name, views_.back());
    }
    tree_ = unflatten(named, ck.skeleton);
  }

  [[nodiscard]] Value& tree() noexcept { return tree_; }

  /// A placeholder standing for tensor `t` (a new tensor to put in the tree).
  TensorView add(TensorInfo t) {
    const std::uint64_t bytes = std::max<std::uint64_t>(byte_size(t.shape, itemsize(t.dtype)), 1);
    auto space = std::make_shared<torch::detail::reservation>(bytes);
    TensorView v = TensorView::contiguous(t.dtype, t.shape, space->base(), space);
    slots_.push_back(slot{reinterpret_cast<std::uintptr_t>(space->base()), bytes, infos_.size()});
    infos_.push_back(std::move(t));
    views_.push_back(v);
    sorted_ = false;
    return v;
  }

  /// The placeholder of the checkpoint's tensor `name` (as given to the constructor), or nullptr.
  [[nodiscard]] const TensorView* placeholder(std::string_view name) const {
    for (std::size_t i = 0; i < infos_.size(); ++i)
      if (infos_[i].name == name) return &views_[i];
    return nullptr;
  }

  /// The tensor a placeholder stands for, or nullptr.
  [[nodiscard]] const TensorInfo* info_of(const TensorView& v) {
    const slot* s = find(v);
    return s ? &infos_[s->index] : nullptr;
  }

  /// The checkpoint the tree describes now (see the top of this file). A tree that is a plain
  /// dict of distinct tensors under string keys gets the null skeleton, as such a checkpoint had.
  [[nodiscard]] ShardedCheckpoint result() {
    FlatStateDict flat = flatten(tree_);
    ShardedCheckpoint out;
    out.format = format_;
    out.sources = sources_;
    out.metadata = metadata_;
    out.tensors.reserve(flat.tensors.size());
    for (auto& [name, v] : flat.tensors) {
      const slot* s = find(v);
      if (!s) throw_error(errors::value_kind, "tensor " + quote(name), "is not a tensor of the checkpoint");
      const TensorInfo& base = infos_[s->index];
      const auto offset = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(v.data()) - s->begin);
      if (offset == 0 && v.dtype() == base.dtype && v.shape() == base.shape && v.is_contiguous()) {
        TensorInfo t = base;
        t.name = std::move(name);
        out.tensors.push_back(std::move(t));
      } else {
        out.tensors.push_back(view_of(base, name, ViewSpec{v.dtype(), static_cast<dim_t>(offset / v.itemsize()), v.shape(), v.strides()}));
      }
    }
    if (!plain_dict(flat)) out.skeleton = std::move(flat.skeleton);
    return out;
  }

 private:
  struct slot {
    std::uintptr_t begin;
    std::uint64_t size;
    std::size_t index;
  };

  const slot* find(const TensorView& v) {
    if (!sorted_) {
      std::sort(slots_.begin(), slots_.end(), [](const slot& a, const slot& b) { return a.begin < b.begin; });
      sorted_ = true;
    }
    const auto a = reinterpret_cast<std::uintptr_t>(v.data());
    auto it = std::upper_bound(slots_.begin(), slots_.end(), a, [](std::uintptr_t x, const slot& s) { return x < s.begin; });
    if (it == slots_.begin()) return nullptr;
    --it;
    return a - it->begin < it->size ? &*it : nullptr;
  }

  /// True when the tree is {string key: tensor} with each tensor once, named by its key.
  bool plain_dict(const FlatStateDict& flat) const {
    if (!tree_.is_dict() || tree_.as_dict().size() != flat.tensors.size()) return false;
    std::size_t i = 0;
    for (const auto& [k, v] : tree_.as_dict()) {
      if (!k.is_string() || !v.is_tensor() || flat.tensors[i].first != k.as_string()) return false;
      ++i;
    }
    return true;
  }

  std::string format_;
  std::vector<std::shared_ptr<const ByteSource>> sources_;
  std::map<std::string, std::string> metadata_;
  std::vector<TensorInfo> infos_;
  std::vector<TensorView> views_;  ///< parallel to infos_
  std::vector<slot> slots_;
  bool sorted_ = true;
  Value tree_;
};

}  // namespace formats::detail
}  // namespace statedict::inline v0
