// A raw pointer member: both directions used, still one error.
// expect-error: a pointer member cannot go into a state dict
#include <statedict/reflect.hpp>

struct Model {
  int layers;
  const float* weights;
};

int main() {
  statedict::Value v = statedict::to_value(Model{2, nullptr});
  (void)statedict::from_value<Model>(v);
}
