// Included from two translation units (with odr-b.cpp) to catch non-inline definitions in headers.
#include <doctest/doctest.h>

#include <statedict/statedict.hpp>

int odr_b_value();

TEST_CASE("the library links when included from two translation units") {
  statedict::Tensor t = statedict::Tensor::from<float>({1.0F, 2.0F}, {2});
  CHECK(t.numel() == 2);
  CHECK(odr_b_value() == 3);
}
