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

// Compilation modes. By default statedict is header-only: every function is inline. A program
// that would rather compile statedict once defines STATEDICT_SEPARATE_COMPILATION in every
// translation unit (CMake: link statedict::compiled) and includes only <statedict/statedict.hpp>
// or <statedict/api.hpp>, which then declare the facade (api.hpp) without defining it; one
// translation unit also defines STATEDICT_IMPLEMENTATION and gets every definition (the
// statedict::compiled library is that unit, src/statedict.cpp). STATEDICT_API marks the functions
// of the facade: inline in header-only mode, defined once otherwise.
#if defined(STATEDICT_SEPARATE_COMPILATION)
#define STATEDICT_API
#else
#define STATEDICT_API inline
#endif
// True in a translation unit that sees declarations of the facade only.
#if defined(STATEDICT_SEPARATE_COMPILATION) && !defined(STATEDICT_IMPLEMENTATION)
#define STATEDICT_DECLARATIONS_ONLY 1
#endif

#include <bit>
static_assert(std::endian::native == std::endian::little,
              "statedict assumes a little-endian host (every checkpoint format it reads is little-endian)");

namespace statedict::inline v0 {
inline constexpr const char* version_string = STATEDICT_VERSION_STRING;
}  // namespace statedict::inline v0
