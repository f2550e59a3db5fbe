// expect-error: a union cannot be reflected
#include <statedict/reflect.hpp>

union Bits {
  float f;
  int i;
};
struct Holder {
  Bits bits;
};

int main() { (void)statedict::to_value(Holder{}); }
