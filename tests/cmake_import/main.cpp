#include <statedict/statedict.hpp>

int main() {
  statedict::Value v = statedict::Dict{{"w", statedict::Tensor::from<float>({1, 2}, {2})}, {"step", 3}};
  return v["step"].as_int() == 3 && v["w"].as_tensor().numel() == 2 ? 0 : 1;
}
