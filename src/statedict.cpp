// statedict compiled once: the definitions of the facade (api.hpp) for programs built with
// STATEDICT_SEPARATE_COMPILATION (the CMake target statedict::compiled). Every other translation
// unit of such a program includes <statedict/statedict.hpp> and sees declarations only.
// SPDX-License-Identifier: MIT
#define STATEDICT_IMPLEMENTATION
#include <statedict/statedict.hpp>
