// statedict: the facade's names in statedict:: (statedict::open, statedict::save, the transform
// makers), once the functions are declared (api.hpp) or defined (convert.hpp).
// SPDX-License-Identifier: MIT
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../api.hpp"

namespace statedict::inline v0 {

// The facade's names in statedict:: (statedict::open, statedict::save, ...).
using formats::open;
using formats::open_options;
using formats::Opened;
using formats::save;
using formats::save_options;

/// The transform that renames by `f` (formats::rename).
inline transform_fn renamed(formats::name_map f) {
  return [f = std::move(f)](const ShardedCheckpoint& ck) { return formats::rename(ck, f); };
}
/// The transform that keeps the names `keep` accepts (formats::filter).
inline transform_fn filtered(std::function<bool(std::string_view)> keep) {
  return [keep = std::move(keep)](const ShardedCheckpoint& ck) { return formats::filter(ck, keep); };
}
/// The transform that keeps the dotted-name prefixes given (formats::select, `--only`).
inline transform_fn selected(std::vector<std::string> prefixes) {
  return [p = std::move(prefixes)](const ShardedCheckpoint& ck) { return formats::select(ck, p); };
}

}  // namespace statedict::inline v0
