// statedict: the choices of the optimizer helpers of core/optim.hpp.
// SPDX-License-Identifier: MIT
#pragma once

#include <string>
#include <vector>

namespace statedict::inline v0::optim {

struct options {
  /// State keys whose value must be the same for every parameter of a group that has one (e.g.
  /// {"step"}: PyTorch steps all parameters of a group together, so different steps mean state
  /// from different runs was mixed, or a parameter joined late). Not checked when empty.
  std::vector<std::string> constant_keys;
};

}  // namespace statedict::inline v0::optim
