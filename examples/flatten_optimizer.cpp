// Flattens a nested training checkpoint (model with a tied weight + AdamW state with int param ids
// and two param groups + a few scalars) into named tensors and a JSON skeleton, prints them, and
// checks that unflatten gives the same tree back.
//
//   build/bin/flatten_optimizer
#include <statedict/statedict.hpp>

#include <cstdio>
#include <string>
#include <vector>

using namespace statedict;

namespace {

Tensor filled(shape_t shape, float start) {
  Tensor t(dtype::F32, std::move(shape));
  float x = start;
  for (float& v : t.values<float>()) v = x++ / 8.0F;
  return t;
}

Value adam(float step, const Tensor& like) {
  Dict s;
  s.insert("step", Tensor::from<float>({step}, {}));
  s.insert("exp_avg", filled(like.shape(), 0.5F));
  s.insert("exp_avg_sq", filled(like.shape(), 0.25F));
  return Value(std::move(s));
}

Value group(double lr, double weight_decay, List params) {
  Dict g;
  g.insert("lr", lr);
  g.insert("betas", Value::tuple({0.9, 0.95}));
  g.insert("weight_decay", weight_decay);
  g.insert("params", Value::list(std::move(params)));
  return Value(std::move(g));
}

std::string text(const Value& v) {
  switch (v.kind()) {
    case value_kind::none: return "None";
    case value_kind::boolean: return v.as_bool() ? "True" : "False";
    case value_kind::integer: return std::to_string(v.as_int());
    case value_kind::floating: return nlohmann::json(v.as_double()).dump();  // shortest exact form
    case value_kind::string: return "'" + v.as_string() + "'";
    default: return std::string(to_string(v.kind()));
  }
}

std::string dims(const shape_t& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

int main() {
  const Tensor embed = filled({8, 4}, 0), fc_w = filled({4, 4}, 1), fc_b = filled({4}, 2);
  Dict model;
  model.insert("embed.weight", embed);
  model.insert("fc.weight", fc_w);
  model.insert("fc.bias", fc_b);
  model.insert("lm_head.weight", embed);  // tied to the embedding: the very same tensor

  Dict state;  // AdamW state keyed by int param id, as Optimizer.state_dict() writes it
  state.insert(0, adam(3, embed));
  state.insert(1, adam(3, fc_w));
  state.insert(2, adam(3, fc_b));
  Dict optim;
  optim.insert("state", std::move(state));
  optim.insert("param_groups", Value::list({group(1e-3, 0.01, {0, 1}), group(1e-3, 0.0, {2})}));

  Dict ckpt;
  ckpt.insert("model", std::move(model));
  ckpt.insert("optimizer", std::move(optim));
  ckpt.insert("epoch", 3);
  ckpt.insert("best_loss", 1.25);
  ckpt.insert("arch", "tiny-gpt");
  const Value tree(std::move(ckpt));

  const FlatStateDict flat = flatten(tree);
  std::printf("tensors (%zu stored):\n", flat.tensors.size());
  for (const auto& [name, t] : flat.tensors)
    std::printf("  %-38s %-4s %s\n", name.c_str(), std::string(statedict::name(t.dtype())).c_str(), dims(t.shape()).c_str());
  std::printf("aliases:\n");
  for (const auto& [name, target] : skeleton_aliases(flat.skeleton)) std::printf("  %s -> %s\n", name.c_str(), target.c_str());
  std::printf("values:\n");
  for (const auto& [name, v] : skeleton_values(flat.skeleton)) std::printf("  %-38s %s\n", name.c_str(), text(v).c_str());
  const std::string skel = skeleton_dump(flat.skeleton);  // = flat.skeleton.dump(), without recursion
  std::printf("skeleton (%zu bytes of JSON):\n  %s\n", skel.size(), skel.c_str());

  // Back from the text, as a reader of a file would do it.
  const Value back = unflatten(flat.tensors, nlohmann::json::parse(skel));
  const bool tied = &back["model"]["lm_head.weight"].as_tensor() != &back["model"]["embed.weight"].as_tensor() &&
                    same_view(back["model"]["lm_head.weight"].as_tensor(), back["model"]["embed.weight"].as_tensor());
  std::printf("round trip: %s; tied weight shares memory again: %s\n", back == tree ? "exact" : "DIFFERENT", tied ? "yes" : "no");

  // The optimizer state keyed by parameter name, as torch.distributed.checkpoint stores it.
  const std::vector<std::string> names = {"model.embed.weight", "model.fc.weight", "model.fc.bias"};
  const Value by_name = optim::by_name(tree["optimizer"], names, {{"step"}});
  std::printf("optimizer state by name: %s ...; back to ids: %s\n",
              flatten(by_name).tensors.front().first.c_str(), optim::by_id(by_name) == tree["optimizer"] ? "exact" : "DIFFERENT");
  return back == tree ? 0 : 1;
}
