// Fuzz target: raw DEFLATE streams (io/inflate.hpp), as zip stores a deflated record. The input is
// a 3-byte little-endian declared size (at most 16 MiB), then the stream. inflate_raw must fill
// exactly that many bytes or throw zip.bad_deflate; a stream it accepts must be refused when one
// more byte is declared, and when it is cut one byte short (the end-of-stream block is missing).
// SPDX-License-Identifier: MIT
#include <statedict/io/inflate.hpp>

#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "fuzz_common.hpp"

STATEDICT_FUZZ_TARGET(data, size) {
  if (size < 3) return 0;
  const std::size_t declared = static_cast<std::size_t>(data[0]) | static_cast<std::size_t>(data[1]) << 8 |
                               static_cast<std::size_t>(data[2]) << 16;
  const auto stream = fuzz::bytes_of(data + 3, size - 3);
  std::vector<std::byte> out(declared);
  bool ok = false;
  try {
    statedict::zip::inflate_raw(stream, out, "fuzz");
    ok = true;
  } catch (const statedict::error& e) {
    if (e.id() != statedict::errors::zip_bad_deflate.id) std::abort();
    fuzz::note(e);
  }
  if (!ok) return 0;
  std::vector<std::byte> longer(declared + 1);
  try {
    statedict::zip::inflate_raw(stream, longer, "fuzz");
    std::abort();  // the same stream cannot fill one byte more
  } catch (const statedict::error& e) {
    fuzz::note(e);
  }
  if (!stream.empty()) {
    std::vector<std::byte> again(declared);
    try {
      statedict::zip::inflate_raw(stream.first(stream.size() - 1), again, "fuzz");
      // A stream may end with bytes zlib never reads (after its final block): then the cut one
      // still inflates, and must give the same bytes.
      if (again != out) std::abort();
    } catch (const statedict::error& e) {
      fuzz::note(e);
    }
  }
  return 0;
}
