// statedict: raw DEFLATE streams (zip compression method 8) inflated with zlib.
// SPDX-License-Identifier: MIT
//
// torch.save stores every record uncompressed, but an archive rewritten by another zip tool (or
// by Python's zipfile with ZIP_DEFLATED) has deflated records, and torch.load reads them. Such a
// record cannot be a view of the file: it is inflated into memory, into a buffer of exactly the
// size the central directory declares (io/zip.hpp caps the total with
// zip::limits::max_inflated_bytes before anything is allocated). The input is hostile: a stream
// that is corrupt, ends early, or would inflate to more or fewer bytes than declared is an error
// naming the entry; nothing is written past the buffer.
#pragma once

#include <zlib.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <string>

#include "../core/error.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id zip_bad_deflate {417, error_kind::format, "zip.bad_deflate"};    // corrupt or truncated stream, wrong size
inline constexpr error_id zip_inflate_limit{418, error_kind::limit, "zip.inflate_limit"};  // zip::limits::max_inflated_bytes
// clang-format on
}  // namespace errors

namespace zip {

/// Inflates the raw DEFLATE stream `in` (no zlib or gzip header, as zip stores it) into `out`,
/// which it must fill exactly: a stream that ends before `out` is full, holds more, is corrupt,
/// or runs past the end of `in` is errors::zip_bad_deflate, with `where` as the context.
inline void inflate_raw(std::span<const std::byte> in, std::span<std::byte> out, const std::string& where) {
  z_stream zs{};
  if (inflateInit2(&zs, -MAX_WBITS) != Z_OK) throw std::bad_alloc();
  struct closer {
    z_stream* z;
    ~closer() { inflateEnd(z); }
  } close_it{&zs};
  constexpr std::size_t step = std::size_t{1} << 30;  // zlib counts in uInt: feed it at most 1 GiB at a time
  std::size_t in_done = 0, out_done = 0;
  for (;;) {
    if (zs.avail_in == 0 && in_done < in.size()) {
      const std::size_t k = std::min(step, in.size() - in_done);
      // zlib's next_in is not const-qualified before 1.2.12's Z_CONST builds; it only reads it.
      zs.next_in = reinterpret_cast<Bytef*>(const_cast<std::byte*>(in.data() + in_done));
      zs.avail_in = static_cast<uInt>(k);
      in_done += k;
    }
    if (zs.avail_out == 0 && out_done < out.size()) {
      const std::size_t k = std::min(step, out.size() - out_done);
      zs.next_out = reinterpret_cast<Bytef*>(out.data() + out_done);
      zs.avail_out = static_cast<uInt>(k);
      out_done += k;
    }
    const uInt in_before = zs.avail_in, out_before = zs.avail_out;
    // With no room left, a 1-byte scratch buffer tells a stream that has more (an error) from one
    // whose end-of-stream block is all that remains.
    unsigned char spill = 0;
    const bool full = zs.avail_out == 0;
    if (full) {
      zs.next_out = &spill;
      zs.avail_out = 1;
    }
    const int rc = inflate(&zs, Z_NO_FLUSH);
    if (full && zs.avail_out == 0)
      throw_error(errors::zip_bad_deflate, where, "inflates to more than its declared " + std::to_string(out.size()) + " bytes");
    if (full) zs.avail_out = 0;
    if (rc == Z_STREAM_END) {
      const std::uint64_t produced = zs.total_out;
      if (produced != out.size() || zs.avail_out != 0)
        throw_error(errors::zip_bad_deflate, where,
                    "inflates to " + std::to_string(produced) + " bytes, its declared size is " + std::to_string(out.size()));
      return;
    }
    if (rc == Z_MEM_ERROR) throw std::bad_alloc();
    if (rc == Z_NEED_DICT || rc == Z_DATA_ERROR || rc == Z_STREAM_ERROR)
      throw_error(errors::zip_bad_deflate, where,
                  std::string("corrupt DEFLATE stream (") + (zs.msg != nullptr ? zs.msg : "zlib error") + ")");
    const bool no_progress = zs.avail_in == in_before && (full || zs.avail_out == out_before);
    if (rc == Z_BUF_ERROR || no_progress) {
      if (zs.avail_in == 0 && in_done == in.size())
        throw_error(errors::zip_bad_deflate, where, "the DEFLATE stream ends before its end-of-stream block");
      const bool can_feed = zs.avail_in == 0 && in_done < in.size();
      const bool can_drain = !full && zs.avail_out == 0 && out_done < out.size();
      if (!can_feed && !can_drain) throw_error(errors::zip_bad_deflate, where, "the DEFLATE stream makes no progress");
    }
  }
}

}  // namespace zip
}  // namespace statedict::inline v0
