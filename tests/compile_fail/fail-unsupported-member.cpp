// A standard type with no mapping, two levels down.
// expect-error: this type has no mapping to a Value
#include <statedict/reflect.hpp>

#include <set>

struct Inner {
  std::set<int> frozen_ids;
};
struct Outer {
  double lr;
  Inner inner;
};

int main() {
  statedict::Value v = statedict::to_value(Outer{});
  (void)statedict::from_value<Outer>(v);
}
