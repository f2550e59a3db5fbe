// Fuzz target: zip end records, ZIP64 records and central directory (io/zip.hpp), then reading
// every entry with CRC verification.
// SPDX-License-Identifier: MIT
#include <statedict/io/zip.hpp>

#include "fuzz_common.hpp"

namespace zip = statedict::zip;

STATEDICT_FUZZ_TARGET(data, size) {
  zip::read_options o;
  o.limits.max_entries = 1 << 12;
  o.limits.max_central_directory_bytes = 1 << 20;
  o.limits.max_inflated_bytes = 1 << 24;  // deflated entries are inflated (io/inflate.hpp)
  o.verify_crc = true;
  try {
    const zip::Archive a = zip::Archive::open(fuzz::source_of(data, size), o);
    for (const auto& e : a.entries()) {
      if (a.find(e.name) == nullptr) __builtin_trap();  // every listed entry is found by name
      try {
        const statedict::Region r = a.read(e);
        if (r.size != e.size) __builtin_trap();
      } catch (const statedict::error& e) {
        fuzz::note(e);
      }
    }
  } catch (const statedict::error& e) {
    fuzz::note(e);
  }
  return 0;
}
