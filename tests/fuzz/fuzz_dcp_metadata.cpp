// Fuzz target: a DCP `.metadata` pickle (formats/dcp.hpp): unpickled as the reader does (unknown
// classes kept as objects), then validated by parse_metadata; also the content sniffing of
// dcp::detect on a directory holding it.
// SPDX-License-Identifier: MIT
#include <statedict/formats/dcp.hpp>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

namespace dcp = statedict::dcp;
namespace pickle = statedict::pickle;

STATEDICT_FUZZ_TARGET(data, size) {
  dcp::limits lim;
  lim.pickle = fuzz::pickle_limits();
  lim.max_entries = 1 << 14;
  lim.max_chunks = 1 << 14;
  lim.max_files = 1 << 10;
  pickle::options po;
  po.limits = lim.pickle;
  po.keep_unknown_objects = true;
  try {
    const statedict::Value v = pickle::load(fuzz::bytes_of(data, size), po).value;
    (void)dcp::parse_metadata(v, lim);
  } catch (const statedict::error& e) {
    fuzz::note(e);
  }
  static const auto dir = fuzz::fresh_dir("dcp");
  if (fuzz::write_file(dir / ".metadata", fuzz::bytes_of(data, size))) (void)dcp::detect(dir);
  return 0;
}
