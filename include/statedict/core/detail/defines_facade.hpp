// statedict: included (without an include guard) by every header that defines functions of the
// facade (api.hpp). With STATEDICT_SEPARATE_COMPILATION those definitions live in
// statedict::compiled, so such a header is a mistake outside its one implementation unit; the
// first one included says so, once.
// SPDX-License-Identifier: MIT
#include "../config.hpp"
#if defined(STATEDICT_DECLARATIONS_ONLY) && !defined(STATEDICT_DETAIL_DEFINES_FACADE_REPORTED)
#define STATEDICT_DETAIL_DEFINES_FACADE_REPORTED
#error "this header defines functions of the facade: with STATEDICT_SEPARATE_COMPILATION, include <statedict/statedict.hpp> (declarations) and link statedict::compiled"
#endif
