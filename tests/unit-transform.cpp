// formats/transform.hpp: rename, filter/drop, cast, split, concat and the consistency check, on
// checkpoints written by the library and read back (torch.save and safetensors), ties, views,
// values and optimizer states included.
#include <doctest/doctest.h>

#include <statedict/formats/registry.hpp>
#include <statedict/formats/transform_regex.hpp>

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
  const fs::path d = fs::path(STATEDICT_TEST_TMP) / "unit-transform";
  fs::create_directories(d);
  return d / name;
}

using statedict_test::error_of;

Tensor iota(std::initializer_list<dim_t> shape, float from = 0) {
  Tensor t(dtype::F32, shape_t(shape));
  for (float& v : t.values<float>()) v = from++;
  return t;
}

/// Writes `tree` as a .pt and opens it: a described checkpoint whose tensors live in the file.
ShardedCheckpoint described(const Value& tree, const std::string& name) {
  const fs::path p = tmp(name + ".pt");
  torch::save(p, tree);
  return formats::open(p).checkpoint;
}

/// Writes `ck` as a .pt and loads it back as a tree.
Value round_trip(const ShardedCheckpoint& ck, const std::string& name) {
  const fs::path p = tmp(name + "-out.pt");
  formats::write_torch(ck, p);
  return torch::load(p);
}

std::vector<std::string> names_of(const ShardedCheckpoint& ck) {
  std::vector<std::string> n;
  for (const auto& t : ck.tensors) n.push_back(t.name);
  return n;
}

}  // namespace

TEST_CASE("strip_prefix on a DDP state dict: names, values and a tie follow, torch.load sees the new tree") {
  const Tensor emb = iota({4, 2}), b = iota({3}, 100);
  Dict sd;
  sd.set("module.embed.weight", emb.view());
  sd.set("module.head.weight", emb.view());  // tied
  sd.set("module.fc.bias", b.view());
  sd.set("epoch", 3);
  const ShardedCheckpoint ck = described(Value(sd), "ddp");
  const ShardedCheckpoint r = formats::rename(ck, formats::strip_prefix("module."));
  CHECK(names_of(r) == std::vector<std::string>{"embed.weight", "fc.bias"});
  const Value back = round_trip(r, "ddp");
  REQUIRE(back.is_dict());
  const Dict& d = back.as_dict();
  REQUIRE(d.size() == 4);
  CHECK(d.items()[0].first == Key("embed.weight"));
  CHECK(d.items()[1].first == Key("head.weight"));
  CHECK(d.items()[2].first == Key("fc.bias"));
  CHECK(d.at("epoch") == Value(3));
  CHECK(equal_bytes(d.at("embed.weight").as_tensor(), emb.view()));
  CHECK(d.at("head.weight").as_tensor().data() == d.at("embed.weight").as_tensor().data());  // still tied
  CHECK(equal_bytes(d.at("fc.bias").as_tensor(), b.view()));
}

TEST_CASE("rename moves the leaf within the deepest dict its new name keeps; empty dicts go") {
  const Tensor w = iota({2, 2}), v = iota({2}, 7);
  Dict inner;
  inner.set("module.w", w.view());
  inner.set("keep", v.view());
  Dict sd;
  sd.set("model", Value(inner));
  sd.set("step", 5);
  const ShardedCheckpoint ck = described(Value(sd), "nested");
  // model.module.w -> model.w stays in "model" under the key "w", in its place.
  const ShardedCheckpoint a = formats::rename(ck, formats::rename_regex("^model\\.module\\.(.*)$", "model.$1"));
  const Value ta = round_trip(a, "nested-a");
  REQUIRE(ta["model"].is_dict());
  CHECK(ta["model"].as_dict().items()[0].first == Key("w"));
  CHECK(ta["model"].as_dict().items()[1].first == Key("keep"));
  // Renaming everything in "model" out of it drops "model".
  const ShardedCheckpoint b = formats::rename(ck, formats::strip_prefix("model."));
  const Value tb = round_trip(b, "nested-b");
  CHECK_FALSE(tb.as_dict().contains("model"));
  CHECK(tb.as_dict().items()[0].first == Key("module.w"));
  CHECK(tb.as_dict().items()[1].first == Key("keep"));
  CHECK(tb["step"] == Value(5));
  // add_prefix moves whole top-level entries: their insides keep their structure.
  const ShardedCheckpoint c = formats::rename(ck, formats::add_prefix("x."));
  const Value tc = round_trip(c, "nested-c");
  REQUIRE(tc.as_dict().contains("x.model"));
  CHECK(tc["x.model"]["module.w"].is_tensor());
  CHECK(tc["x.step"] == Value(5));
}

TEST_CASE("an optimizer state keyed by parameter names is re-keyed with the parameters") {
  const Tensor w = iota({2}), m = iota({2}, 10), s2 = iota({2}, 20);
  Dict state_w;
  state_w.set("exp_avg", m.view());
  state_w.set("exp_avg_sq", s2.view());
  state_w.set("step", 4);
  Dict state;
  state.set("module.w", Value(state_w));
  Dict group;
  group.set("lr", 0.5);
  group.set("params", Value::list({Value("module.w")}));
  Dict optim;
  optim.set("state", Value(state));
  optim.set("param_groups", Value::list({Value(group)}));
  Dict sd;
  sd.set("module.w", w.view());
  sd.set("optim", Value(optim));
  const ShardedCheckpoint ck = described(Value(sd), "optim");
  const ShardedCheckpoint r = formats::rename(ck, formats::strip_prefix("module."));
  const Value t = round_trip(r, "optim");
  CHECK(t["w"].is_tensor());
  REQUIRE(t["optim"]["state"].as_dict().contains("w"));
  CHECK(equal_bytes(t["optim"]["state"]["w"]["exp_avg"].as_tensor(), m.view()));
  CHECK(t["optim"]["state"]["w"]["step"] == Value(4));
  CHECK(t["optim"]["param_groups"].at(0)["params"].at(0) == Value("w"));
  CHECK(t["optim"]["param_groups"].at(0)["lr"] == Value(0.5));
}

TEST_CASE("rename refuses two names onto one and a list element renamed alone") {
  Dict sd;
  sd.set("a", iota({1}).view());
  sd.set("b", iota({1}).view());
  sd.set("l", Value::list({Value(iota({1}).view()), Value(iota({1}).view())}));
  const ShardedCheckpoint ck = described(Value(sd), "refuse");
  CHECK(error_of([&] { (void)formats::rename(ck, formats::rename_map({{"a", "b"}})); }) == errors::rename_collision.id);
  CHECK(error_of([&] { (void)formats::rename(ck, formats::rename_map({{"l.0", "l.zero"}})); }) == errors::rename_not_dict.id);
  // The list renamed as a whole moves.
  const ShardedCheckpoint ok = formats::rename(ck, formats::rename_prefix("l", "list"));
  CHECK(names_of(ok) == std::vector<std::string>{"a", "b", "list.0", "list.1"});
}

TEST_CASE("filter and drop: a tie whose tensor is dropped becomes the tensor; views survive renames") {
  const Tensor base = iota({6});
  Dict sd;
  sd.set("emb", base.view());
  sd.set("head", base.view());                    // an alias of emb
  sd.set("part", base.view().narrow(0, 2, 3));    // a view of emb
  sd.set("other", iota({2}, 50).view());
  const ShardedCheckpoint ck = described(Value(sd), "ties");
  const ShardedCheckpoint d = formats::drop(ck, formats::regex_matches("emb"));
  const Value t = round_trip(d, "ties-drop");
  CHECK_FALSE(t.as_dict().contains("emb"));
  CHECK(equal_bytes(t["head"].as_tensor(), base.view()));
  CHECK(equal_bytes(t["part"].as_tensor(), base.view().narrow(0, 2, 3)));
  const ShardedCheckpoint only = formats::filter(ck, [](std::string_view n) { return n == "other"; });
  CHECK(names_of(only) == std::vector<std::string>{"other"});
  // A rename keeps the view a view of its renamed base.
  const ShardedCheckpoint r = formats::rename(ck, formats::add_prefix("m."));
  const Value tr = round_trip(r, "ties-rename");
  CHECK(tr["m.part"].as_tensor().data() == tr["m.emb"].as_tensor().data() + 2 * 4);
  CHECK(tr["m.head"].as_tensor().data() == tr["m.emb"].as_tensor().data());
}

TEST_CASE("drop: a list element before a kept one becomes None, so kept ones keep their index; trailing ones go") {
  Dict sd;
  Dict holder;
  holder.set("x", iota({1}, 5).view());
  sd.set("seq", Value::list({Value(iota({2}).view()), Value(std::move(holder)), Value(iota({3}, 10).view()), Value(iota({1}).view())}));
  const ShardedCheckpoint ck = described(Value(sd), "seq");
  const Value t = round_trip(formats::drop(ck, formats::regex_matches(R"(seq\.(0|1\.x|3))")), "seq-drop");
  REQUIRE(t["seq"].as_list().size() == 3);
  CHECK(t["seq"].as_list()[0].is_none());
  CHECK(t["seq"].as_list()[1].is_none());  // the dict its only tensor left went
  CHECK(equal_bytes(t["seq"].as_list()[2].as_tensor(), iota({3}, 10).view()));
}

TEST_CASE("split and concat are placements: parts read the same bytes, joined again they equal the tensor") {
  const Tensor qkv = iota({6, 4});
  Dict sd;
  sd.set("attn.qkv.weight", qkv.view());
  sd.set("attn.out.weight", iota({4, 2}, 100).view());
  const ShardedCheckpoint ck = described(Value(sd), "qkv");
  const ShardedCheckpoint s =
      formats::split(ck, "attn.qkv.weight", 0, {{"attn.q.weight", 2}, {"attn.k.weight", 2}, {"attn.v.weight", 2}});
  CHECK(names_of(s) == std::vector<std::string>{"attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.out.weight"});
  const Value ts = round_trip(s, "qkv-split");
  CHECK(equal_bytes(ts["attn.k.weight"].as_tensor(), qkv.view().narrow(0, 2, 2)));
  // Along dim 1, columns.
  const ShardedCheckpoint cols = formats::split(ck, "attn.qkv.weight", 1, {{"left", 1}, {"right", 3}});
  const Value tc = round_trip(cols, "qkv-cols");
  CHECK(equal_bytes(tc["right"].as_tensor(), qkv.view().narrow(1, 1, 3)));
  // Joined again, through safetensors as well.
  const ShardedCheckpoint j = formats::concat(s, {"attn.q.weight", "attn.k.weight", "attn.v.weight"}, 0, "attn.qkv.weight");
  CHECK(names_of(j) == std::vector<std::string>{"attn.qkv.weight", "attn.out.weight"});
  const fs::path st = tmp("qkv-joined.safetensors");
  formats::write_safetensors(j, st);
  CHECK(equal_bytes(safetensors::File::open(st).view("attn.qkv.weight"), qkv.view()));
  // Wrong sizes, dtypes and tied tensors are refused.
  CHECK(error_of([&] { (void)formats::split(ck, "attn.qkv.weight", 0, {{"a", 5}}); }) == errors::transform_parts.id);
  CHECK(error_of([&] { (void)formats::concat(ck, {"attn.qkv.weight", "attn.out.weight"}, 0, "x"); }) == errors::transform_parts.id);
  Dict tied;
  tied.set("a", qkv.view());
  tied.set("b", qkv.view());
  const ShardedCheckpoint tk = described(Value(tied), "tied-split");
  CHECK(error_of([&] { (void)formats::split(tk, "a", 0, {{"x", 3}, {"y", 3}}); }) == errors::transform_tied.id);
}

TEST_CASE("cast: floating tensors only; integer-origin buffers on request") {
  Dict sd;
  sd.set("w", iota({2}).view());
  sd.set("ids", Tensor::from<std::int64_t>({1, 2}, {2}).view());
  ShardedCheckpoint ck = described(Value(sd), "cast");
  ck.tensors[0].converted_from = dtype::I64;  // as DeepSpeed marks its converted buffers
  ShardedCheckpoint a = ck;
  formats::cast(a, dtype::BF16);
  CHECK(a.find("w")->dtype == dtype::F32);  // of integer origin: kept
  CHECK(a.find("ids")->dtype == dtype::I64);
  formats::check_consistent(a);
  ShardedCheckpoint b = ck;
  formats::cast_options integer_origin;
  integer_origin.integer_origin = true;
  formats::cast(b, dtype::BF16, integer_origin);
  CHECK(b.find("w")->dtype == dtype::BF16);
  formats::check_consistent(b);
  const Value t = round_trip(b, "cast");
  CHECK(t["w"].as_tensor().dtype() == dtype::BF16);
}

TEST_CASE("a skeleton that no longer matches the tensors is refused before a byte is written") {
  Dict sd;
  sd.set("a", iota({2}).view());
  sd.set("b", Value::list({1, 2}));  // not a flat dict: the checkpoint keeps a skeleton
  ShardedCheckpoint ck = described(Value(sd), "stale");
  REQUIRE_FALSE(ck.skeleton.is_null());
  ck.tensors[0].name = "renamed";  // what renaming by hand does
  ck.reindex();
  const fs::path out = tmp("stale.safetensors");
  CHECK(error_of([&] { formats::write_safetensors(ck, out); }) == errors::stale_skeleton.id);
  CHECK_FALSE(fs::exists(out));
  CHECK(error_of([&] { formats::write_torch(ck, tmp("stale.pt")); }) == errors::stale_skeleton.id);
}
