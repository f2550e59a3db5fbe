// Optimizer state dicts: re-keying between int ids and names, param_names, constant-state checks,
// and every error with its id.
#include <doctest/doctest.h>

#include <statedict/statedict.hpp>

#include <string>
#include <vector>

using namespace statedict;

namespace {

template <class F>
int thrown_id(F&& f) {
  try {
    f();
  } catch (const statedict::error& e) {
    return e.id();
  } catch (...) {
    return -1;
  }
  return 0;
}

template <class F>
std::string error_text(F&& f) {
  try {
    f();
  } catch (const statedict::error& e) {
    return e.what();
  }
  return "";
}

Value step(float s) { return Tensor::from<float>({s}, {}); }

Value adam_state(float s, float m) {
  Dict d;
  d.insert("step", step(s));
  d.insert("exp_avg", Tensor::from<float>({m, m}, {2}));
  d.insert("exp_avg_sq", Tensor::from<float>({m * m, m * m}, {2}));
  return Value(std::move(d));
}

Value group(double lr, double wd, std::vector<std::int64_t> ids) {
  Dict g;
  g.insert("lr", lr);
  g.insert("betas", Value::tuple({0.9, 0.999}));
  g.insert("eps", 1e-8);
  g.insert("weight_decay", wd);
  g.insert("amsgrad", false);
  g.insert("foreach", Value());
  List p;
  for (auto i : ids) p.emplace_back(i);
  g.insert("params", Value::list(std::move(p)));
  g.insert("maximize", false);  // a key after "params": positions are kept
  return Value(std::move(g));
}

/// Two groups, five params; param 2 has no state (it never had a gradient).
Value id_form() {
  Dict state;
  state.insert(0, adam_state(3, 0.1F));
  state.insert(1, adam_state(3, 0.2F));
  state.insert(4, adam_state(3, 0.5F));  // state order is PyTorch's, not id order
  state.insert(3, adam_state(3, 0.4F));
  Dict osd;
  osd.insert("state", std::move(state));
  osd.insert("param_groups", Value::list({group(1e-3, 0.01, {0, 1, 2}), group(5e-4, 0.0, {3, 4})}));
  return Value(std::move(osd));
}

const std::vector<std::string> names = {"a.weight", "b.weight", "frozen.weight", "a.bias", "b.bias"};

}  // namespace

TEST_CASE("by_name keys state and params by name, keeping everything else in place") {
  const Value osd = id_form();
  const Value named = optim::by_name(osd, names);
  const Dict& st = named["state"].as_dict();
  REQUIRE(st.size() == 4);
  CHECK(st.items()[0].first == Key("a.weight"));
  CHECK(st.items()[1].first == Key("b.weight"));
  CHECK(st.items()[2].first == Key("b.bias"));
  CHECK(st.items()[3].first == Key("a.bias"));
  CHECK(st.at("b.bias") == osd["state"][4]);
  const List& groups = named["param_groups"].as_list();
  REQUIRE(groups.size() == 2);
  CHECK(groups[0]["params"] == Value::list({"a.weight", "b.weight", "frozen.weight"}));
  CHECK(groups[1]["params"] == Value::list({"a.bias", "b.bias"}));
  for (std::size_t g = 0; g < 2; ++g) {
    const auto& want = osd["param_groups"].at(g).as_dict().items();
    const auto& got = groups[g].as_dict().items();
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      CHECK(got[i].first == want[i].first);  // same keys, same order
      if (got[i].first != Key("params")) CHECK(got[i].second == want[i].second);
    }
  }
  // Flattened, the names read like torch.distributed.checkpoint's.
  Dict root;
  root.insert("optim", named);
  const FlatStateDict f = flatten(Value(std::move(root)));
  CHECK(f.tensors.front().first == "optim.state.a.weight.step");
  CHECK(f.tensors.back().first == "optim.state.a.bias.exp_avg_sq");
}

TEST_CASE("by_id numbers parameters in optimizer order; round trips are exact") {
  const Value osd = id_form();
  const Value named = optim::by_name(osd, names);
  CHECK(optim::by_id(named) == osd);
  CHECK(optim::by_name(optim::by_id(named), names) == named);
  // Ids that are not PyTorch's positions are renumbered (documented): the meaning is kept.
  Dict state;
  state.insert(20, adam_state(1, 1));
  Dict odd;
  odd.insert("state", std::move(state));
  odd.insert("param_groups", Value::list({group(1, 0, {10, 20})}));
  const Value renamed = optim::by_name(Value(odd), std::vector<std::string>{"x", "y"});
  CHECK(renamed["state"].as_dict().items()[0].first == Key("y"));
  const Value back = optim::by_id(renamed);
  CHECK(back["param_groups"].at(0)["params"] == Value::list({0, 1}));
  CHECK(back["state"].as_dict().items()[0].first == Key(1));
  CHECK(optim::by_name(back, std::vector<std::string>{"x", "y"}) == renamed);
}

TEST_CASE("extra top-level keys are kept; an optimizer without parameters works") {
  Value osd = id_form();
  osd.as_dict().insert("extra", "kept");
  CHECK(optim::by_name(osd, names)["extra"].as_string() == "kept");
  Dict empty;
  empty.insert("state", Dict{});
  empty.insert("param_groups", Value::list());
  CHECK(optim::by_name(Value(empty)) == Value(empty));
  CHECK(optim::by_id(Value(empty)) == Value(empty));
}

TEST_CASE("param_names in the groups (newer PyTorch) supply the names") {
  Value osd = id_form();
  auto& groups = osd.as_dict().at("param_groups").as_list();
  groups[0].as_dict().insert("param_names", Value::list({"a.weight", "b.weight", "frozen.weight"}));
  groups[1].as_dict().insert("param_names", Value::list({"a.bias", "b.bias"}));
  CHECK(optim::param_names(osd) == names);
  const Value named = optim::by_name(osd);
  CHECK(named["state"].as_dict().contains("b.bias"));
  CHECK(named["param_groups"].at(0)["param_names"] == osd["param_groups"].at(0)["param_names"]);
  CHECK(optim::by_name(osd, names) == named);
  CHECK(optim::by_id(named) == osd);
  const std::vector<std::string> other = {"x", "b.weight", "frozen.weight", "a.bias", "b.bias"};
  CHECK(thrown_id([&] { (void)optim::by_name(osd, other); }) == 224);
  groups[1].as_dict().erase("param_names");
  CHECK(thrown_id([&] { (void)optim::param_names(osd); }) == 224);
  groups[1].as_dict().insert("param_names", Value::list({"a.bias"}));
  CHECK(thrown_id([&] { (void)optim::param_names(osd); }) == 224);
  groups[1].as_dict().set("param_names", Value::list({"a.bias", 5}));
  CHECK(thrown_id([&] { (void)optim::param_names(osd); }) == 224);
  CHECK(optim::param_names(id_form()).empty());
}

TEST_CASE("constant state is checked per group when asked, naming the params that differ") {
  Value osd = id_form();
  CHECK_NOTHROW(optim::check_constant_state(osd, std::vector<std::string>{"step"}));
  CHECK_NOTHROW(optim::by_name(osd, names, {{"step"}}));
  // Groups are checked separately: group 1 may be at another step than group 0.
  osd.as_dict().at("state").as_dict().at(3).as_dict().set("step", step(7));
  osd.as_dict().at("state").as_dict().at(4).as_dict().set("step", step(7));
  CHECK_NOTHROW(optim::check_constant_state(osd, std::vector<std::string>{"step"}));
  // Within group 0, b.weight joined late.
  osd.as_dict().at("state").as_dict().at(1).as_dict().set("step", step(2));
  const std::string msg = error_text([&] { (void)optim::by_name(osd, names, {{"step"}}); });
  CHECK(msg == "[statedict.format_error.225] optimizer state: param group 0: 'step' is tensor F32 [] = 3 for "
               "'a.weight', but 'b.weight' has tensor F32 [] = 2");
  CHECK(thrown_id([&] { (void)optim::by_name(osd, names); }) == 0);  // not asked: not checked
  // On the by-id form without names, params are labelled by id; numbers compare exactly.
  Value ints = id_form();
  for (auto& [k, v] : ints.as_dict().at("state").as_dict()) v.as_dict().set("step", 5);
  ints.as_dict().at("state").as_dict().at(0).as_dict().set("step", 5.0);  // float 5.0 is not int 5
  const std::string m2 = error_text([&] { optim::check_constant_state(ints, std::vector<std::string>{"step"}); });
  CHECK(m2 == "[statedict.format_error.225] optimizer state: param group 0: 'step' is 5 for 0, but 1 has 5");
  // The by-name form is checked the same way, labelled by name.
  Value named = optim::by_name(id_form(), names);
  CHECK_NOTHROW(optim::by_id(named, {{"step"}}));
  named.as_dict().at("state").as_dict().at("a.bias").as_dict().set("step", step(1));
  const std::string m3 = error_text([&] { (void)optim::by_id(named, {{"step"}}); });
  CHECK(m3 == "[statedict.format_error.225] optimizer state: param group 1: 'step' is tensor F32 [] = 1 for "
              "'a.bias', but 'b.bias' has tensor F32 [] = 3");
}

TEST_CASE("malformed optimizer state and wrong names are errors with their ids") {
  const Value osd = id_form();
  CHECK(thrown_id([&] { (void)optim::by_name(Value(1), names); }) == 220);
  Dict no_state;
  no_state.insert("param_groups", Value::list());
  CHECK(thrown_id([&] { (void)optim::by_name(Value(no_state), names); }) == 220);
  Dict bad_groups;
  bad_groups.insert("state", Dict{});
  bad_groups.insert("param_groups", Value::list({Value(3)}));
  CHECK(thrown_id([&] { (void)optim::by_name(Value(bad_groups), names); }) == 220);
  Dict no_params;
  no_params.insert("state", Dict{});
  no_params.insert("param_groups", Value::list({Value(Dict{})}));
  CHECK(thrown_id([&] { (void)optim::by_name(Value(no_params), names); }) == 220);
  const Value named = optim::by_name(osd, names);
  CHECK(thrown_id([&] { (void)optim::by_name(named, names); }) == 220);  // already by name
  CHECK(thrown_id([&] { (void)optim::by_id(osd); }) == 220);            // already by id
  CHECK(thrown_id([&] { (void)optim::by_name(osd, std::vector<std::string>{"a", "b"}); }) == 221);
  CHECK(thrown_id([&] { (void)optim::by_name(osd); }) == 226);
  const std::vector<std::string> twice = {"a", "b", "c", "a", "e"};
  CHECK(thrown_id([&] { (void)optim::by_name(osd, twice); }) == 223);
  Value dup_id = id_form();
  dup_id.as_dict().at("param_groups").as_list()[1].as_dict().set("params", Value::list({0, 4}));
  CHECK(thrown_id([&] { (void)optim::by_name(dup_id, names); }) == 223);
  Value stray = id_form();
  stray.as_dict().at("state").as_dict().insert(9, adam_state(3, 1));
  const std::string msg = error_text([&] { (void)optim::by_name(stray, names); });
  CHECK(msg == "[statedict.key_error.222] optimizer state: state for param id 9, which no param group lists");
  Value stray_name = named;
  stray_name.as_dict().at("state").as_dict().insert("ghost", adam_state(3, 1));
  CHECK(thrown_id([&] { (void)optim::by_id(stray_name); }) == 222);
  Value twice_named = named;
  twice_named.as_dict().at("param_groups").as_list()[1].as_dict().set("params", Value::list({"a.weight", "b.bias"}));
  CHECK(thrown_id([&] { (void)optim::by_id(twice_named); }) == 223);
}
