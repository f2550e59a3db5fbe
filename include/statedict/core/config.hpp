// statedict: read, transform, shard and consolidate ML checkpoints without a framework.
// SPDX-License-Identifier: MIT
//
// Version and ABI namespace. Every public declaration lives in `statedict::inline v0`, so two
// incompatible versions linked into one program do not collide (ODR), while users keep writing
// `statedict::`.
#pragma once

#define STATEDICT_VERSION_MAJOR 0
#define STATEDICT_VERSION_MINOR 1
#define STATEDICT_VERSION_PATCH 0
#define STATEDICT_VERSION_STRING "0.1.0"

#if __cplusplus < 202002L && !(defined(_MSVC_LANG) && _MSVC_LANG >= 202002L)
#error "statedict needs C++20"
#endif

#include <bit>
static_assert(std::endian::native == std::endian::little,
              "statedict assumes a little-endian host (every checkpoint format it reads is little-endian)");

namespace statedict::inline v0 {
inline constexpr const char* version_string = STATEDICT_VERSION_STRING;
}  // namespace statedict::inline v0
