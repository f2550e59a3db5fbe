// The facade (api.hpp, convert.hpp) and the conveniences a program using the library meets first:
// convert / load / save, random reads of one tensor from a sharded checkpoint, FlatStateDict's
// hashed find through ties, dotted lookups on a Value, accessors of temporary Values, optimizer
// re-keying on a flat dict.
#include <doctest/doctest.h>

#include <statedict/statedict.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace statedict;
namespace fs = std::filesystem;

namespace {

fs::path tmp(const std::string& name) {
  const fs::path d = fs::path(STATEDICT_TEST_TMP) / "unit-facade";
  fs::create_directories(d);
  return d / name;
}

using statedict_test::error_of;

Tensor iota(std::initializer_list<dim_t> shape, float from = 0) {
  Tensor t(dtype::F32, shape_t(shape));
  for (float& v : t.values<float>()) v = from++;
  return t;
}

/// A DCP checkpoint for 3 ranks of {"w": [7, 5], "b": [5], "step": 9}: "w" in three row chunks.
fs::path dcp3() {
  const fs::path d = tmp("dcp3");
  fs::remove_all(d);
  Dict sd;
  sd.set("w", iota({7, 5}).view());
  sd.set("b", iota({5}, 100).view());
  sd.set("step", 9);
  save_options o;
  o.world_size = 3;
  (void)statedict::save(Value(sd), d, o);
  return d;
}

}  // namespace

TEST_CASE("convert: open, transform, save in one call; load and save trees in any format") {
  const fs::path in = tmp("in.pt");
  Dict sd;
  sd.set("module.w", iota({3, 2}).view());
  sd.set("module.b", iota({2}, 10).view());
  sd.set("epoch", 2);
  (void)statedict::save(Value(sd), in);
  convert_options o;
  o.input.dtype = dtype::BF16;
  o.transforms.push_back(renamed(formats::strip_prefix("module.")));
  const fs::path out = tmp("out.safetensors");
  const conversion c = convert(in, out, o);
  CHECK(c.input_format == "torch");
  CHECK(c.output_format == "safetensors");
  CHECK(c.tensors == 2);
  CHECK(c.bytes == 6 * 2 + 2 * 2);
  const Value back = load(out);
  CHECK(back["w"].as_tensor().dtype() == dtype::BF16);
  CHECK(equal_bytes(back["w"].as_tensor(), contiguous(iota({3, 2}).view(), dtype::BF16).view()));
  CHECK(back["epoch"] == Value(2));
  // An output format that cannot be told from the name is refused before the input is read.
  CHECK_THROWS_AS((void)convert(tmp("missing.pt"), tmp("noext"), {}), usage_error);
}

TEST_CASE("read_tensor / read_rows: one tensor of a sharded checkpoint, without the rest") {
  const fs::path d = dcp3();
  const Opened in = statedict::open(d);
  REQUIRE(in.checkpoint.find("w")->chunks.size() == 3);
  const Tensor w = read_tensor(in.checkpoint, "w");
  CHECK(equal_bytes(w.view(), iota({7, 5}).view()));
  // Rows 2..5 straddle two ranks' chunks, into a caller buffer, as F64.
  std::vector<double> rows(3 * 5);
  read_rows(in.checkpoint, "w", 2, 5, std::as_writable_bytes(std::span<double>(rows)), dtype::F64);
  for (std::size_t i = 0; i < rows.size(); ++i) CHECK(rows[i] == static_cast<double>(10 + i));
  CHECK_THROWS_AS(read_rows(in.checkpoint, "w", 4, 9, std::as_writable_bytes(std::span<double>(rows))), usage_error);
  CHECK_THROWS_AS((void)read_tensor(in.checkpoint, "nope"), key_error);
  // load gives the whole tree, the sharded tensor read into memory.
  const Value all = load(d);
  CHECK(equal_bytes(all["w"].as_tensor(), iota({7, 5}).view()));
  CHECK(all["step"] == Value(9));
}

TEST_CASE("FlatStateDict::find: by hash, through aliases and views; find_dotted on a Value") {
  const Tensor base = iota({6});
  Dict sd;
  sd.set("emb", base.view());
  sd.set("lm_head", base.view());
  sd.set("half", base.view().narrow(0, 3, 3));
  Dict inner;
  inner.set("x.y", 4);
  sd.set("cfg", Value(inner));
  const Value tree(sd);
  const FlatStateDict flat = flatten(tree);
  REQUIRE(flat.tensors.size() == 1);
  CHECK(flat.find("emb")->data() == base.data());
  CHECK(flat.find("lm_head")->data() == base.data());                    // an alias
  CHECK(equal_bytes(*flat.find("half"), base.view().narrow(0, 3, 3)));     // a view
  CHECK_FALSE(flat.find("nope"));
  const FlatStateDict copy = flat;  // copies index afresh
  CHECK(copy.find("lm_head"));
  REQUIRE(find_dotted(tree, "cfg.x.y"));
  CHECK(*find_dotted(tree, "cfg.x.y") == Value(4));
  CHECK(find_dotted(tree, "cfg.x") == nullptr);
}

TEST_CASE("FlatStateDict::replace: a tensor of another shape; its aliases follow, views refuse") {
  const Tensor base = iota({6});
  Dict sd;
  sd.set("emb", base.view());
  sd.set("lm_head", base.view());
  sd.set("step", 3);
  FlatStateDict flat = flatten(Value(sd));
  const Tensor grown = iota({8});
  flat.replace("emb", grown.view());
  CHECK(flat.find("lm_head")->shape() == shape_t{8});  // the alias sees the new tensor
  const Value back = unflatten(flat);                    // the skeleton agrees with the tensor map
  CHECK(back["emb"].as_tensor().shape() == shape_t{8});
  CHECK(back["lm_head"].as_tensor().data() == grown.data());
  CHECK(back["step"] == Value(3));
  CHECK(error_of([&] { flat.replace("lm_head", grown.view()); }) == errors::flat_missing_tensor.id);  // a tie

  Dict with_view;
  with_view.set("w", base.view());
  with_view.set("half", base.view().narrow(0, 3, 3));
  FlatStateDict v = flatten(Value(with_view));
  CHECK(error_of([&] { v.replace("w", grown.view()); }) == errors::flat_tensor_shape.id);
  v.replace("w", iota({6}).view());  // same dtype and shape: allowed, the view reads the new one
  CHECK(equal_bytes(*v.find("half"), iota({6}).view().narrow(0, 3, 3)));
}

TEST_CASE("accessors of a temporary Value return its parts, alive") {
  const fs::path p = tmp("rvalue.pt");
  Dict sd;
  sd.set("a", iota({2}).view());
  sd.set("b", Value::list({1, 2, 3}));
  (void)statedict::save(Value(sd), p);
  std::size_t n = 0;
  for (const auto& [k, v] : torch::load(p).as_dict()) n += v.is_tensor() ? 1 : v.as_list().size();  // no dangling dict
  CHECK(n == 4);
  std::int64_t sum = 0;
  for (const Value& x : torch::load(p)["b"].as_list()) sum += x.as_int();
  CHECK(sum == 6);
  static_assert(!std::is_reference_v<decltype(Value().as_dict())>, "a temporary's dict is returned by value");
}

TEST_CASE("optim::by_name / by_id on a flattened optimizer state") {
  Dict s0;
  s0.set("exp_avg", iota({2}).view());
  s0.set("step", 3);
  Dict state;
  state.set(0, Value(s0));
  Dict group;
  group.set("lr", 0.1);
  group.set("params", Value::list({0}));
  Dict osd;
  osd.set("state", Value(state));
  osd.set("param_groups", Value::list({Value(group)}));
  const FlatStateDict flat = flatten(Value(osd));
  const std::vector<std::string> names{"fc.weight"};
  const FlatStateDict named = optim::by_name(flat, names);
  REQUIRE(named.find("state.fc.weight.exp_avg"));
  CHECK(named.find("state.fc.weight.exp_avg")->data() == flat.find("state.0.exp_avg")->data());  // the same view
  const FlatStateDict back = optim::by_id(named);
  CHECK(unflatten(back) == Value(osd));
}
