// Optimizer re-keying against real PyTorch: AdamW with two param groups, state dicts written by
// tests/python/gen_optimizer_json.py (PyTorch 1.13). PyTorch's own answer for the by-name form is
// built there from parameter identity, so it does not share our positional rule.
#include <doctest/doctest.h>

#include <statedict/statedict.hpp>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

using namespace statedict;
using nlohmann::json;

namespace {

const json& fixture() {
  static const json j = [] {
    const std::string path = std::string(STATEDICT_FIXTURE_DIR) + "/gen_optimizer_json/optimizer.json";
    std::ifstream in(path);
    REQUIRE_MESSAGE(in.good(), "missing fixture " << path << " (run tests/python/generate_all.sh)");
    std::stringstream ss;
    ss << in.rdbuf();
    return json::parse(ss.str());
  }();
  return j;
}

/// A DOC of the fixture ({"skeleton", "tensors": {NAME: {dtype, shape, data}}}) as a Value tree,
/// through unflatten: the Python-written skeleton is read by the C++ reader.
struct Loaded {
  std::map<std::string, Tensor> tensors;
  Value tree;
};

Loaded load(const json& doc) {
  Loaded out;
  for (const auto& [name, t] : doc.at("tensors").items()) {
    const auto dt = dtype_from_name(t.at("dtype").get<std::string>());
    REQUIRE(dt.has_value());
    Tensor x(*dt, t.at("shape").get<shape_t>());
    std::vector<std::uint8_t> raw;
    REQUIRE(detail::base64_decode(t.at("data").get<std::string>(), raw));
    REQUIRE(raw.size() == x.nbytes());
    if (!raw.empty()) std::memcpy(x.data(), raw.data(), raw.size());
    out.tensors.emplace(name, x);
  }
  out.tree = unflatten(out.tensors, doc.at("skeleton"));
  return out;
}

std::vector<std::string> strings(const json& j) { return j.get<std::vector<std::string>>(); }

}  // namespace

TEST_CASE("a real AdamW state dict with two param groups re-keys to what PyTorch names") {
  const json& c = fixture().at("cases").at("adamw_two_groups");
  const Loaded ids = load(c.at("id_form"));
  const Loaded by_name = load(c.at("name_form"));
  const std::vector<std::string> names = strings(c.at("names"));

  const Value named = optim::by_name(ids.tree, names, {{"step"}});
  CHECK(named == by_name.tree);
  CHECK(optim::by_id(named) == ids.tree);
  CHECK(optim::by_id(by_name.tree, {{"step"}}) == ids.tree);

  // What PyTorch reported, checked piece by piece.
  const Dict& st = named["state"].as_dict();
  for (const auto& n : strings(c.at("stateless"))) CHECK_FALSE(st.contains(n));
  CHECK(st.size() + c.at("stateless").size() == names.size());
  CHECK(st.at("fc1.weight")["exp_avg"].as_tensor().shape() == shape_t{8, 4});
  CHECK(st.at("embed.weight")["step"].as_tensor().load<float>(0) == 3.0F);
  const List& groups = named["param_groups"].as_list();
  REQUIRE(groups.size() == 2);
  CHECK(groups[0]["weight_decay"].as_double() == 0.01);
  CHECK(groups[1]["weight_decay"].as_double() == 0.0);
  CHECK(groups[1]["lr"].as_double() == 5e-4);
  CHECK(groups[0]["betas"] == Value::tuple({0.9, 0.95}));
  CHECK(groups[0]["foreach"].is_none());
  CHECK(groups[0]["amsgrad"].is_bool());
  std::size_t listed = groups[0]["params"].as_list().size() + groups[1]["params"].as_list().size();
  CHECK(listed == names.size());
  CHECK(groups[1]["params"].at(0).as_string() == "fc1.bias");
  // The two param groups split the model's parameters, in another order than the model's.
  CHECK(strings(c.at("model_names")) != names);

  // The real state dict round-trips through flatten / unflatten in both forms, names readable.
  for (const Value* v : {&ids.tree, &named}) {
    const FlatStateDict f = flatten(*v);
    CHECK(unflatten(f.tensors, json::parse(f.skeleton.dump())) == *v);
  }
  const FlatStateDict f = flatten(named);
  CHECK(f.tensors.front().first == "state.embed.weight.step");
  bool saw = false;
  for (const auto& [n, v] : skeleton_values(f.skeleton)) saw = saw || (n == "param_groups.1.lr" && v == Value(5e-4));
  CHECK(saw);
}

TEST_CASE("a parameter that joined late has another step: the check names it") {
  const json& c = fixture().at("cases").at("adamw_late_param");
  const Loaded ids = load(c.at("id_form"));
  const std::vector<std::string> names = strings(c.at("names"));
  const json& first = c.at("disagree").at(0);
  CHECK(first.at("group") == 0);
  try {
    (void)optim::by_name(ids.tree, names, {{"step"}});
    FAIL("expected optim_state_disagrees");
  } catch (const statedict::error& e) {
    CHECK(e.code() == errors::optim_state_disagrees);
    const std::string what = e.what();
    CHECK(what.find("param group 0: 'step'") != std::string::npos);
    for (const auto& n : strings(first.at("params"))) CHECK(what.find(" but '" + n + "' has tensor F32 [] = 2") != std::string::npos);
  }
  // Without the check, re-keying still matches PyTorch's by-name form.
  const Loaded by_name = load(c.at("name_form"));
  CHECK(optim::by_name(ids.tree, names) == by_name.tree);
  CHECK(optim::by_id(by_name.tree) == ids.tree);
}
