// With the extractor turned off, described structs still reflect (and the harness can pass).
#define STATEDICT_REFLECT_NO_NAME_EXTRACTOR
#include <statedict/reflect.hpp>

#include <boost/describe/class.hpp>

struct Described {
  int a;
  std::vector<double> b;
};
BOOST_DESCRIBE_STRUCT(Described, (), (a, b))

int main() {
  statedict::Value v = statedict::to_value(Described{1, {2.0}});
  return statedict::from_value<Described>(v).a == 1 ? 0 : 1;
}
