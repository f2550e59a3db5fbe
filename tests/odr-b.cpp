#include <statedict/statedict.hpp>

int odr_b_value() {
  statedict::Value v = statedict::Value::list({1, 2, 3});
  return static_cast<int>(v.as_list().size());
}
