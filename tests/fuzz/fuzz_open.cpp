// Fuzz target: formats::open (formats/open.hpp), the content-based detection of every format:
// a multi-file input (fuzz_common.hpp) written to a scratch directory, opened as a directory and,
// when the first file is a regular file, as that file. formats::open has no limits parameter, so
// this runs with every reader's default caps.
// Flags: bit 0 with_optimizer, bit 1 check_replicas, bit 2 pread.
// SPDX-License-Identifier: MIT
#include <statedict/formats/open.hpp>

#include "fuzz_common.hpp"

namespace formats = statedict::formats;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto files = fuzz::split_files(data, size);
  if (!files) return 0;
  const auto dir = fuzz::materialise(*files);
  if (!dir) return 0;
  formats::open_options o;
  o.with_optimizer = (files->flags & 1) != 0;
  o.check_replicas = (files->flags & 2) != 0;
  o.mode = (files->flags & 4) ? statedict::read_mode::pread : statedict::read_mode::mmap;
  try {
    (void)formats::open(*dir, o);
  } catch (const statedict::error& e) {
    fuzz::note(e);
  }
  if (!files->files.empty()) {
    const auto first = *dir / files->files[0].name;
    std::error_code ec;
    if (std::filesystem::is_regular_file(first, ec)) {
      try {
        (void)formats::open(first, o);
      } catch (const statedict::error& e) {
        fuzz::note(e);
      }
    }
  }
  return 0;
}
