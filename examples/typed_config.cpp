// A checkpoint with a typed training config beside its weights: the config is a plain C++ struct,
// written as the nested dict PyTorch users expect (reflect.hpp, no field listed by hand) and read
// back into the struct with every field checked; the BF16 weights are seen as float through a lazy
// xtensor expression, each element converted when it is read, without a float copy of the tensor.
//
//   build/bin/typed_config /tmp/run.pt
#include <statedict/interop/xtensor.hpp>
#include <statedict/reflect.hpp>
#include <statedict/statedict.hpp>

#include <xtensor/xreducer.hpp>

#include <array>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace sd = statedict;

struct Optimizer {
  std::string name;
  double lr;
  std::array<double, 2> betas;
  std::optional<double> weight_decay;
};

struct TrainConfig {
  std::string model;
  int layers;
  std::vector<int> hidden;
  Optimizer optimizer;
  std::map<std::string, sd::TensorView> weights;
};

int main(int argc, char** argv) try {
  const std::string path = argc > 1 ? argv[1] : "typed_config.pt";

  sd::Tensor w(sd::dtype::BF16, {3, 4});
  const sd::Tensor f = sd::Tensor::from<float>({0.5F, -1, 2, 3.25F, 4, 5, -6, 7, 8, 9.5F, 10, 11}, {3, 4});
  sd::copy(f.view(), w.span());  // float -> bfloat16 (exact here)

  const TrainConfig cfg{"tiny", 2, {16, 32}, {"adamw", 3e-4, {0.9, 0.95}, std::nullopt}, {{"fc.weight", w.view()}}};
  sd::save(sd::to_value(cfg), path);  // {"model": "tiny", ..., "optimizer": {...}, "weights": {...}}

  const TrainConfig back = sd::from_value<TrainConfig>(sd::load(path));
  const auto x = sd::xt_as_float(back.weights.at("fc.weight"));  // lazy: reads BF16, yields float
  const float total = xt::sum(x)();
  std::printf("%s: %d layers, %s lr %g betas (%g, %g), weight_decay %s; fc.weight[1, 2] = %g, sum = %g\n",
              back.model.c_str(), back.layers, back.optimizer.name.c_str(), back.optimizer.lr, back.optimizer.betas[0],
              back.optimizer.betas[1], back.optimizer.weight_decay ? "set" : "None", static_cast<double>(x(1, 2)),
              static_cast<double>(total));
  return total == 53.25F && x(1, 2) == -6.0F ? 0 : 1;
} catch (const sd::error& e) {
  std::fprintf(stderr, "typed_config: %s\n", e.what());
  return 1;
}
