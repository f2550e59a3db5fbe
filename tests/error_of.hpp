// Shared by the tests: the id of the statedict::error a call throws, 0 when it throws none; its
// message goes to the test log (and to `*what` when asked for).
#pragma once

#include <doctest/doctest.h>

#include <statedict/core/error.hpp>

#include <functional>
#include <string>

namespace statedict_test {

inline int error_of(const std::function<void()>& f, std::string* what = nullptr) {
  try {
    f();
  } catch (const statedict::error& e) {
    MESSAGE(std::string(e.what()));
    if (what) *what = e.what();
    return e.id();
  }
  return 0;
}

}  // namespace statedict_test
