// expect-error: a std::string_view member does not own its text
#include <statedict/reflect.hpp>

#include <string_view>

struct Meta {
  std::string_view name;
};

int main() { (void)statedict::from_value<Meta>(statedict::Value()); }
