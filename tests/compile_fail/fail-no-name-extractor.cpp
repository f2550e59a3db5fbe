// With the extractor turned off, an undescribed aggregate has no field names.
// expect-error: Fix: describe it with BOOST_DESCRIBE_STRUCT
#define STATEDICT_REFLECT_NO_NAME_EXTRACTOR
#include <statedict/reflect.hpp>

struct Plain {
  int a;
};

int main() { (void)statedict::to_value(Plain{1}); }
