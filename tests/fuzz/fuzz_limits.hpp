// statedict fuzz targets: reader caps low enough that a legitimate cap is reached long before
// libFuzzer's -rss_limit_mb=2048 / -malloc_limit_mb (defaults are sized for real checkpoints).
// SPDX-License-Identifier: MIT
#pragma once

#include <statedict/io/pickle_read.hpp>
#include <statedict/io/torch_file.hpp>
#include <statedict/io/zip.hpp>

namespace fuzz {

inline statedict::pickle::limits pickle_limits() {
  statedict::pickle::limits l;
  l.max_depth = 200;
  l.max_memo = 1 << 16;
  l.max_nodes = 1 << 16;
  l.max_stack = 1 << 16;
  l.max_string_bytes = 1 << 20;
  l.max_long_bytes = 1 << 12;
  return l;
}

inline statedict::zip::limits zip_limits() {
  statedict::zip::limits l;
  l.max_entries = 1 << 12;
  l.max_central_directory_bytes = 1 << 20;
  l.max_inflated_bytes = 1 << 24;
  return l;
}

inline statedict::torch::limits torch_limits() {
  statedict::torch::limits l;
  l.pickle = pickle_limits();
  l.zip = zip_limits();
  return l;
}

}  // namespace fuzz
