// A checkpoint as a tree (torch.load's view of it) and as a flat map of names to tensors, the
// optimizer state keyed by parameter name instead of by number.
#include <statedict/core/visit.hpp>
#include <statedict/statedict.hpp>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

namespace sd = statedict;

int main() {
  const std::filesystem::path path = std::filesystem::temp_directory_path() / "statedict-doc-flat.pt";
  const sd::Tensor w = sd::Tensor::from<float>({1, 2, 3, 4}, {2, 2});
  sd::Dict state{{0, sd::Dict{{"step", sd::Tensor::from<float>({3}, {})}, {"exp_avg", sd::Tensor::zeros(sd::dtype::F32, {2, 2})}}}};
  sd::Dict group{{"lr", 0.001}, {"params", sd::Value::list({0})}};
  sd::save(sd::Dict{{"model", sd::Dict{{"fc.weight", w}, {"out.weight", w}}},
                    {"optim", sd::Dict{{"state", sd::Value(std::move(state))}, {"param_groups", sd::Value::list({sd::Value(std::move(group))})}}}},
           path);

  const sd::Value ckpt = sd::load(path);  // tensors are views into the mapped file
  const sd::Value* lr = sd::find_dotted(ckpt, "optim.param_groups.0.lr");
  std::printf("lr = %g\n", lr->as_double());

  // Flat: names to tensors, plus the skeleton (everything else). find() resolves ties.
  const sd::FlatStateDict model = sd::flatten(ckpt["model"]);
  std::printf("out.weight is fc.weight: %s\n", model.find("out.weight")->data() == model.find("fc.weight")->data() ? "yes" : "no");

  // The optimizer state by parameter name, flat, and back to numbers.
  const std::vector<std::string> params = {"fc.weight"};
  const sd::FlatStateDict named = sd::optim::by_name(sd::flatten(ckpt["optim"]), params);
  for (const auto& [name, t] : named.tensors) std::printf("  %s %s\n", name.c_str(), sd::to_string(t.shape()).c_str());
  const bool back = sd::unflatten(sd::optim::by_id(named)) == ckpt["optim"];
  std::printf("by_id(by_name(optim)) == optim: %s\n", back ? "yes" : "no");
  std::filesystem::remove(path);
  return back && lr->as_double() == 0.001 ? 0 : 1;
}
