// Every supported member kind, both directions, with all warnings on.
#include <statedict/reflect.hpp>

#include <map>
#include <optional>
#include <tuple>

enum class E : short { a, b };
struct Leaf {
  bool b;
  char c;
  unsigned long long u;
  E e;
  float f;
  std::string s;
  statedict::Bytes y;
  statedict::Tensor t;
  statedict::TensorView v;
  statedict::Value any;
};
struct All {
  Leaf leaf;
  std::optional<Leaf> maybe;
  std::vector<Leaf> many;
  std::array<int, 3> three;
  std::pair<int, std::string> two;
  std::tuple<> none;
  std::map<std::string, int> by_name;
  std::map<unsigned char, int> by_byte;
};

int main() {
  statedict::Value v = statedict::to_value(All{});
  return statedict::from_value<All>(v).three.size() == 3 ? 0 : 1;
}
