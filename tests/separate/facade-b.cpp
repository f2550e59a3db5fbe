// The second translation unit of the separate-compilation test (see facade-a.cpp).
#include <statedict/statedict.hpp>

#include <filesystem>

std::filesystem::path write_model(const std::filesystem::path& dir) {
  statedict::Dict layer;
  layer.set("weight", statedict::Tensor::from<float>({0.0F, 1.0F, 2.0F, 3.0F, 4.0F, 5.0F}, {2, 3}));
  layer.set("bias", statedict::Tensor::from<float>({1.0F, -1.0F}, {2}));
  statedict::Dict root;
  root.set("module", statedict::Dict{{"layer", statedict::Value(std::move(layer))}});
  const std::filesystem::path out = dir / "model.pt";
  statedict::save(statedict::Value(std::move(root)), out);
  return out;
}
