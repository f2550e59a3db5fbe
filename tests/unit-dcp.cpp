// torch.distributed.checkpoint: metadata validation (one test per error id, on written and then
// mutated `.metadata` pickles), item location inside .distcp files, the writer's sharding rule,
// round trips through the writer for several world sizes in both the 1.13 and the 2.x layout
// (nested structure rebuilt from planner_data), detection, and the item archive reader's errors.
#include <doctest/doctest.h>

#include <statedict/core/flatten.hpp>
#include <statedict/core/sha256.hpp>
#include <statedict/exec/digest.hpp>
#include <statedict/formats/dcp.hpp>
#include <statedict/formats/torch.hpp>
#include <statedict/formats/safetensors.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace statedict;
namespace fs = std::filesystem;

namespace {

fs::path tmp_dir(const std::string& sub) { return statedict_test::fresh_path("unit-dcp", sub); }

using statedict_test::read_all;

using statedict_test::write_all;

/// A ShardedCheckpoint over in-memory tensors: flatten(tree), one source per tensor.
ShardedCheckpoint from_tree(const Value& tree) {
  FlatStateDict flat = flatten(tree);
  ShardedCheckpoint c;
  c.format = "memory";
  c.skeleton = flat.skeleton;
  for (const auto& [name, view] : flat.tensors) {
    Tensor t = Tensor::copy_of(view);
    const auto src = static_cast<std::uint32_t>(c.sources.size());
    c.sources.push_back(MemorySource::copy_of(name, std::span<const std::byte>(t.data(), static_cast<std::size_t>(t.nbytes()))));
    TensorInfo ti{name, view.dtype(), view.shape(), {}};
    if (view.numel() > 0) ti.chunks.push_back(Chunk{full_box(view.shape()), Placement{src, 0, {}, view.dtype()}});
    c.tensors.push_back(std::move(ti));
  }
  return c;
}

Tensor arange_f32(shape_t shape, float start = 0) {
  Tensor t(dtype::F32, shape);
  auto v = t.values<float>();
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = start + static_cast<float>(i);
  return t;
}

Tensor bf16_values(shape_t shape) {
  Tensor t(dtype::BF16, shape);
  auto v = t.values<bfloat16>();
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = bfloat16{bf16_from_f32(static_cast<float>(i) * 0.5f - 3.0f)};
  return t;
}

/// A small state dict: a nested model, a list of layers, optimizer-like state with int keys,
/// scalars, a 0-d tensor, a bool tensor, an empty tensor.
Value sample_tree() {
  Dict model;
  model.set("embed", arange_f32({7, 3}));
  model.set("proj", bf16_values({5, 4}));
  model.set("mask", Tensor::from<bool>({true, false, true}, {3}));
  model.set("empty", Tensor::zeros(dtype::F32, {0, 4}));
  List layers;
  for (int i = 0; i < 2; ++i) {
    Dict l;
    l.set("w", arange_f32({2, 2}, static_cast<float>(10 * i)));
    layers.push_back(Value(std::move(l)));
  }
  model.set("layers", Value::list(std::move(layers)));
  Dict state0;
  state0.set("exp_avg", arange_f32({7, 3}, 100));
  state0.set("step", Tensor::from<std::int64_t>({5}, {}));
  Dict state;
  state.set(0, Value(std::move(state0)));
  Dict group;
  group.set("lr", 0.001);
  group.set("betas", Value::tuple({Value(0.9), Value(0.95)}));
  group.set("params", Value::list({Value(0)}));
  Dict optim;
  optim.set("state", Value(std::move(state)));
  optim.set("param_groups", Value::list({Value(std::move(group))}));
  Dict root;
  root.set("model", Value(std::move(model)));
  root.set("optim", Value(std::move(optim)));
  root.set("step", 42);
  root.set("name", "run-\xce\xb1");
  return Value(std::move(root));
}

std::map<std::string, std::string> hashes(const ShardedCheckpoint& c) {
  std::map<std::string, std::string> m;
  for (auto& [n, h] : sha256_tensors(c)) m[n] = h;
  return m;
}

std::map<std::string, std::string> value_texts(const nlohmann::json& skeleton) {
  std::map<std::string, std::string> m;
  for (auto& [n, v] : skeleton_values(skeleton)) {
    std::string s;
    switch (v.kind()) {
      case value_kind::integer: s = "int " + std::to_string(v.as_int()); break;
      case value_kind::floating: s = "float " + std::to_string(v.as_double()); break;
      case value_kind::string: s = "str " + v.as_string(); break;
      case value_kind::boolean: s = v.as_bool() ? "True" : "False"; break;
      case value_kind::none: s = "None"; break;
      default: s = std::string(to_string(v.kind()));
    }
    m[n] = s;
  }
  return m;
}

using statedict_test::error_of;

// ---- .metadata as a Value, for mutation

Value load_md(const fs::path& dir) { return dcp::detail::load_metadata_value(dir, {}); }
void save_md(const fs::path& dir, const Value& v) { write_all(dir / ".metadata", pickle::dumps(v)); }

Dict& attrs(Value& v) { return v.as_object().state.at(0).as_dict(); }
Value& sdm(Value& md) { return attrs(md).at(Key("state_dict_metadata")); }
Value& entry(Value& md, const std::string& fqn) { return sdm(md).as_dict().at(Key(fqn)); }
List& chunks(Value& md, const std::string& fqn) { return attrs(entry(md, fqn)).at(Key("chunks")).as_list(); }
List& storage(Value& md) { return attrs(md).at(Key("storage_data")).as_object().items; }
/// The storage_data pair whose key has this fqn (and offsets, when given).
List& storage_pair(Value& md, const std::string& fqn, std::optional<shape_t> off = std::nullopt) {
  for (Value& kv : storage(md)) {
    Dict& k = attrs(kv.as_list()[0]);
    if (k.at(Key("fqn")).as_string() != fqn) continue;
    if (off) {
      const Value& o = k.at(Key("offset"));
      if (o.is_none()) continue;
      shape_t got;
      const Value& seq = o.is_object() ? o.as_object().args[0] : o;  // torch.Size reads as a tuple
      for (const Value& x : seq.as_list()) got.push_back(x.as_int());
      if (got != *off) continue;
    }
    return kv.as_list();
  }
  throw std::runtime_error("no storage entry for " + fqn);
}
Value size_obj(shape_t s) { return dcp::detail::torch_size(s); }

/// A written checkpoint to mutate: model.embed [7,3] over 3 ranks (3,3,1 rows) + values.
fs::path written(const std::string& name, dcp::class_names classes = dcp::class_names::torch_1_13, std::uint32_t world = 3) {
  const fs::path d = tmp_dir(name);
  dcp::write_options o;
  o.world_size = world;
  o.classes = classes;
  dcp::write(from_tree(sample_tree()), d, o);
  return d;
}

}  // namespace

// =============================================================================================

TEST_CASE("writer sharding rule: dim-0 torch.chunk for tensors with at least M rows, else rank 0") {
  using B = std::vector<std::pair<std::uint32_t, Box>>;
  CHECK(dcp::chunks_for(shape_t{7, 3}, 3) ==
        B{{0, Box{{0, 0}, {3, 3}}}, {1, Box{{3, 0}, {3, 3}}}, {2, Box{{6, 0}, {1, 3}}}});
  // torch.chunk leaves trailing ranks empty (5 rows over 4 ranks: 2, 2, 1, 0), as ChunkShardingSpec
  CHECK(dcp::chunks_for(shape_t{5}, 4) == B{{0, Box{{0}, {2}}}, {1, Box{{2}, {2}}}, {2, Box{{4}, {1}}}});
  CHECK(dcp::chunks_for(shape_t{2, 9}, 3) == B{{0, Box{{0, 0}, {2, 9}}}});  // fewer rows than ranks
  CHECK(dcp::chunks_for(shape_t{}, 2) == B{{0, Box{{}, {}}}});              // 0-d
  CHECK(dcp::chunks_for(shape_t{4, 0}, 2) == B{{0, Box{{0, 0}, {4, 0}}}});   // empty
  CHECK(dcp::chunks_for(shape_t{9}, 1) == B{{0, Box{{0}, {9}}}});
  CHECK(dcp::shard_dim(shape_t{3, 1}, 3) == std::optional<std::size_t>(0));
  CHECK_FALSE(dcp::shard_dim(shape_t{3, 1}, 4).has_value());
}

TEST_CASE("round trip through the writer: every world size, both layouts, bit-exact tensors and equal values") {
  const Value tree = sample_tree();
  const ShardedCheckpoint src = from_tree(tree);
  const auto want = hashes(src);
  const auto want_values = value_texts(src.skeleton);
  for (auto classes : {dcp::class_names::torch_1_13, dcp::class_names::torch_2}) {
    for (std::uint32_t world : {1U, 2U, 3U, 5U, 8U}) {
      CAPTURE(world);
      CAPTURE(static_cast<int>(classes));
      const fs::path d = tmp_dir("rt");
      dcp::write_options o;
      o.world_size = world;
      o.classes = classes;
      dcp::write(src, d, o);
      for (std::uint32_t r = 0; r < world; ++r) CHECK(fs::exists(d / ("__" + std::to_string(r) + "_0.distcp")));
      const auto det = dcp::detect(d);
      CHECK(det.found);
      CHECK(det.rule.find(classes == dcp::class_names::torch_2 ? "2.x" : "1.13") != std::string::npos);
      const ShardedCheckpoint back = dcp::describe(d);
      CHECK(back.format == "dcp");
      CHECK(hashes(back) == want);
      CHECK(value_texts(back.skeleton) == want_values);
      // model.embed has 7 rows: chunked when 7 >= M
      const TensorInfo* e = back.find("model.embed");
      REQUIRE(e);
      CHECK(e->chunks.size() == dcp::chunks_for(shape_t{7, 3}, world).size());
      if (classes == dcp::class_names::torch_2) {
        // planner_data rebuilt the nesting
        CHECK(back.skeleton.json()["root"]["dict"][0][0] == "model");
        const auto md = dcp::read_metadata(d);
        REQUIRE(md.flatten_mapping.has_value());
        CHECK(md.classes == dcp::class_names::torch_2);
      } else {
        // 1.13: the flat keys of the state dict are the top-level keys
        CHECK(back.skeleton.json()["root"]["dict"][0][0] == "model.embed");
      }
    }
  }
}

TEST_CASE("writing in parts: K processes each write their rank files, the index step checks them and writes .metadata") {
  const ShardedCheckpoint src = from_tree(sample_tree());
  const fs::path whole = tmp_dir("parts-whole");
  dcp::write_options o;
  o.world_size = 5;
  dcp::write(src, whole, o);
  const fs::path d = tmp_dir("parts");
  dcp::write_options idx = o;
  idx.index_only = true;
  // The index before the parts: refused, naming the missing rank file; nothing written.
  CHECK(error_of([&] { dcp::write(src, d, idx); }) == errors::dcp_write_part.id);
  CHECK_FALSE(fs::exists(d / ".metadata"));
  for (std::uint32_t k = 0; k < 3; ++k) {
    dcp::write_options p = o;
    p.part = PartSpec{k, 3};
    dcp::write(src, d, p);
    CHECK_FALSE(fs::exists(d / ".metadata"));  // a part never writes the index
  }
  dcp::write(src, d, idx);
  for (const auto& e : fs::directory_iterator(whole)) {
    const auto name = e.path().filename().string();
    CAPTURE(name);
    REQUIRE(fs::exists(d / name));
    CHECK(read_all(d / name) == read_all(e.path()));  // byte-identical to one process's output
  }
  CHECK(hashes(dcp::describe(d)) == hashes(src));
  // A rank file of the wrong size (written with other options) stops the index step.
  fs::resize_file(d / "__4_0.distcp", fs::file_size(d / "__4_0.distcp") + 1);
  fs::remove(d / ".metadata");
  CHECK(error_of([&] { dcp::write(src, d, idx); }) == errors::dcp_write_part.id);
}

TEST_CASE("2.x planner_data: the nested tree is rebuilt with DCP's path rule (dict keys as str, list indices as int)") {
  const fs::path d = written("v2", dcp::class_names::torch_2, 2);
  const auto md = dcp::read_metadata(d);
  REQUIRE(md.flatten_mapping);
  std::map<std::string, Path> m(md.flatten_mapping->begin(), md.flatten_mapping->end());
  // the int optimizer key 0 becomes "0" (str(k)); list indices stay ints; a list of ints is a leaf
  CHECK(m.at("optim.state.0.exp_avg") == Path{Key("optim"), Key("state"), Key("0"), Key("exp_avg")});
  CHECK(m.at("model.layers.1.w") == Path{Key("model"), Key("layers"), Key(1), Key("w")});
  CHECK(m.at("optim.param_groups.0.params") == Path{Key("optim"), Key("param_groups"), Key(0), Key("params")});
  CHECK(m.at("optim.param_groups.0.betas") == Path{Key("optim"), Key("param_groups"), Key(0), Key("betas")});
  const ShardedCheckpoint back = dcp::describe(d);
  const auto names = [&] {
    std::vector<std::string> v;
    for (const auto& t : back.tensors) v.push_back(t.name);
    return v;
  }();
  CHECK(names == std::vector<std::string>{"model.embed", "model.proj", "model.mask", "model.empty", "model.layers.0.w",
                                          "model.layers.1.w", "optim.state.0.exp_avg", "optim.state.0.step"});
  const auto vals = value_texts(back.skeleton);
  CHECK(vals.at("optim.param_groups.0.lr") == "float 0.001000");
  CHECK(vals.at("optim.param_groups.0.betas.1") == "float 0.950000");
  CHECK(vals.at("optim.param_groups.0.params.0") == "int 0");
  // the tree has lists where the original had lists
  const auto& root = back.skeleton.json()["root"]["dict"];
  CHECK(root[0][1]["dict"][4][1].contains("list"));  // model.layers
}

TEST_CASE("1.13 key rule: tensor-free subtrees are one bytes item; keys are dotted paths") {
  const fs::path d = written("keys113", dcp::class_names::torch_1_13, 2);
  const auto md = dcp::read_metadata(d);
  std::vector<std::string> keys;
  for (const auto& e : md.entries) keys.push_back(e.fqn + (e.tensor ? "" : " (bytes)"));
  CHECK(keys == std::vector<std::string>{"model.embed", "model.proj", "model.mask", "model.empty", "model.layers.0.w",
                                         "model.layers.1.w", "optim.state.0.exp_avg", "optim.state.0.step",
                                         "optim.param_groups (bytes)", "step (bytes)", "name (bytes)"});
  CHECK_FALSE(md.flatten_mapping);
  CHECK(md.classes == dcp::class_names::torch_1_13);
  // every chunk has a storage entry pointing into an existing rank file
  for (const auto& e : md.entries)
    if (e.tensor)
      for (const auto& c : e.tensor->chunks) CHECK(md.find({e.fqn, c.offsets}));
}

TEST_CASE("metadata validation: each malformed field gives its error id") {
  const fs::path d = written("md");
  const Value good = load_md(d);
  const auto parse = [](const Value& v) { return error_of([&] { (void)dcp::parse_metadata(v); }); };
  CHECK(parse(good) == 0);
  auto mutated = [&](const std::function<void(Value&)>& f) {
    Value v = copy_tree(good);
    f(v);
    return parse(v);
  };
  CHECK(parse(Value(Dict{})) == errors::dcp_bad_metadata_class.id);
  CHECK(parse(dcp::detail::new_object("torch.distributed.checkpoint.metadata", "NotMetadata", Value(Dict{}))) ==
        errors::dcp_bad_metadata_class.id);
  CHECK(mutated([](Value& v) { attrs(v).erase(Key("state_dict_metadata")); }) == errors::dcp_bad_field.id);
  CHECK(mutated([](Value& v) { sdm(v) = Value::list(); }) == errors::dcp_bad_field.id);
  CHECK(mutated([](Value& v) { attrs(entry(v, "model.embed")).set("chunks", 3); }) == errors::dcp_bad_field.id);
  CHECK(mutated([](Value& v) { attrs(entry(v, "model.embed")).set("size", "7x3"); }) == errors::dcp_bad_field.id);
  CHECK(mutated([](Value& v) { entry(v, "step") = dcp::detail::new_object("x.y", "Z", std::nullopt); }) ==
        errors::dcp_unknown_storage_md.id);
  CHECK(mutated([](Value& v) {
          auto& props = attrs(entry(v, "model.embed")).at(Key("properties")).as_object().state[0].as_list();
          props[0] = dcp::detail::global("torch", "qint8");
        }) == errors::dcp_bad_dtype.id);
  CHECK(mutated([](Value& v) {
          auto& props = attrs(entry(v, "model.embed")).at(Key("properties")).as_object().state[0].as_list();
          props[0] = Value("float32");
        }) == errors::dcp_bad_field.id);
  CHECK(mutated([](Value& v) {
          auto& props = attrs(entry(v, "model.embed")).at(Key("properties")).as_object().state[0].as_list();
          Object lay{"torch.serialization", "_get_layout", object_build::reduce, {Value("torch.sparse_coo")}, {}, {}};
          props[1] = Value(std::move(lay));
        }) == errors::dcp_unsupported_layout.id);
  CHECK(mutated([](Value& v) { attrs(entry(v, "model.embed")).set("size", size_obj(shape_t(65, 1))); }) ==
        errors::dcp_too_many_dims.id);
  CHECK(mutated([](Value& v) { attrs(entry(v, "model.embed")).set("size", size_obj({-7, 3})); }) == errors::dcp_negative.id);
  CHECK(mutated([](Value& v) { attrs(chunks(v, "model.embed")[0]).set("sizes", size_obj({3})); }) == errors::dcp_chunk_rank.id);
  CHECK(mutated([](Value& v) { attrs(chunks(v, "model.embed")[2]).set("sizes", size_obj({2, 3})); }) ==
        errors::dcp_chunk_outside.id);
  CHECK(mutated([](Value& v) { attrs(chunks(v, "model.embed")[2]).set("offsets", size_obj({9, 0})); }) != 0);
  CHECK(mutated([](Value& v) { attrs(chunks(v, "model.embed")[1]).set("offsets", size_obj({-1, 0})); }) == errors::dcp_negative.id);
  CHECK(mutated([](Value& v) { storage_pair(v, "step")[0] = Value("step"); }) == errors::dcp_bad_storage_key.id);
  CHECK(mutated([](Value& v) { attrs(storage_pair(v, "step")[0]).set("fqn", 3); }) == errors::dcp_bad_storage_key.id);
  CHECK(mutated([](Value& v) { attrs(storage_pair(v, "step")[1]).set("length", "431"); }) == errors::dcp_bad_storage_info.id);
  CHECK(mutated([](Value& v) { attrs(storage_pair(v, "step")[1]).set("offset", -1); }) == errors::dcp_negative.id);
  CHECK(mutated([](Value& v) {
          Dict& s = attrs(storage_pair(v, "step")[1]);
          s.set("offset", std::int64_t{1} << 62);
          s.set("length", std::int64_t{1} << 62);
        }) == errors::dcp_bad_storage_info.id);
  for (const char* bad : {"../x.distcp", "/etc/passwd", "a/../../b", "", "a//b", "./a"})
    CHECK(mutated([&](Value& v) { attrs(storage_pair(v, "step")[1]).set("relative_path", bad); }) ==
          errors::dcp_bad_relative_path.id);
  CHECK(mutated([](Value& v) {
          attrs(storage_pair(v, "step")[1]).set("transform_descriptors", Value::list({Value("zstd")}));
        }) == errors::dcp_transformed_item.id);
  CHECK(mutated([](Value& v) {
          attrs(storage_pair(v, "step")[1]).set("transform_descriptors", Value::list());
        }) == 0);  // an empty transform list is plain bytes
  CHECK(mutated([](Value& v) {
          auto& items = storage(v);
          for (std::size_t i = 0; i < items.size(); ++i)
            if (attrs(items[i].as_list()[0]).at(Key("fqn")).as_string() == "model.proj") {
              items.erase(items.begin() + static_cast<std::ptrdiff_t>(i));
              break;
            }
        }) == errors::dcp_missing_storage.id);
  CHECK(mutated([](Value& v) {
          auto& items = storage(v);
          for (std::size_t i = 0; i < items.size(); ++i)
            if (attrs(items[i].as_list()[0]).at(Key("fqn")).as_string() == "name") {
              items.erase(items.begin() + static_cast<std::ptrdiff_t>(i));
              break;
            }
        }) == errors::dcp_missing_storage.id);
  CHECK(mutated([](Value& v) { storage(v).push_back(storage(v).front()); }) == errors::dcp_duplicate_storage.id);
  CHECK(mutated([](Value& v) { attrs(v).set("storage_data", Value::list()); }) == errors::dcp_bad_field.id);
  CHECK(mutated([](Value& v) {
          Dict pd;
          pd.set("model.embed", Value::tuple({Value("model"), Value(1.5)}));
          attrs(v).set("planner_data", Value(std::move(pd)));
        }) == errors::dcp_bad_planner_data.id);
  CHECK(mutated([](Value& v) {
          Dict pd;
          pd.set("model.embed", Value::tuple());
          attrs(v).set("planner_data", Value(std::move(pd)));
        }) == errors::dcp_bad_planner_data.id);
  CHECK(mutated([](Value& v) { attrs(v).set("planner_data", Value("custom planner state")); }) == 0);  // not ours: ignored
  CHECK(mutated([](Value& v) { attrs(v).set("version", 1); }) == errors::dcp_bad_field.id);
  // limits
  dcp::limits small;
  small.max_entries = 5;
  CHECK(error_of([&] { (void)dcp::parse_metadata(good, small); }) == errors::dcp_too_many_entries.id);
  small = {};
  small.max_chunks = 4;
  CHECK(error_of([&] { (void)dcp::parse_metadata(good, small); }) == errors::dcp_too_many_chunks.id);
  small = {};
  small.max_dims = 1;
  CHECK(error_of([&] { (void)dcp::parse_metadata(good, small); }) == errors::dcp_too_many_dims.id);
}

TEST_CASE("data files: missing, too short, not an archive, wrong content, holes and overlaps") {
  const fs::path d = written("files");
  const Value good = load_md(d);
  auto describe_with = [&](const std::function<void(Value&)>& f, dcp::options o = {}) {
    Value v = copy_tree(good);
    f(v);
    save_md(d, v);
    const int id = error_of([&] { (void)dcp::describe(d, o); });
    save_md(d, good);
    return id;
  };
  CHECK(describe_with([](Value&) {}) == 0);
  CHECK(describe_with([](Value& v) { attrs(storage_pair(v, "step")[1]).set("relative_path", "__9_0.distcp"); }) ==
        errors::dcp_missing_file.id);
  CHECK(describe_with([](Value& v) {
          Dict& s = attrs(storage_pair(v, "step")[1]);
          s.set("offset", s.at(Key("offset")).as_int() + 100000);
        }) == errors::dcp_item_outside_file.id);
  CHECK(describe_with([](Value& v) {
          Dict& s = attrs(storage_pair(v, "step")[1]);
          s.set("offset", s.at(Key("offset")).as_int() + 1);
          s.set("length", s.at(Key("length")).as_int() - 1);
        }) == errors::dcp_item_not_archive.id);
  CHECK(describe_with([](Value& v) {
          Dict& s = attrs(storage_pair(v, "step")[1]);
          s.set("length", 3);
        }) == errors::dcp_item_not_archive.id);
  CHECK(describe_with([](Value& v) {
          // a tensor chunk pointing at a bytes item
          storage_pair(v, "model.mask", shape_t{0})[1] = copy_tree(storage_pair(v, "step")[1]);
        }) == errors::dcp_item_not_tensor.id);
  CHECK(describe_with([](Value& v) {
          auto& props = attrs(entry(v, "model.embed")).at(Key("properties")).as_object().state[0].as_list();
          props[0] = dcp::detail::global("torch", "float64");
        }) == errors::dcp_item_dtype.id);
  CHECK(describe_with([](Value& v) {
          // tensor 8 rows; the last chunk claims 2 rows, its item holds 1
          attrs(entry(v, "model.embed")).set("size", size_obj({8, 3}));
          attrs(chunks(v, "model.embed")[2]).set("sizes", size_obj({2, 3}));
        }) == errors::dcp_item_shape.id);
  CHECK(describe_with([](Value& v) {
          // a hole: drop the middle chunk (its storage entry may stay)
          auto& c = chunks(v, "model.embed");
          c.erase(c.begin() + 1);
        }) == errors::dcp_incomplete_tensor.id);
  CHECK(describe_with([](Value& v) {
          // an overlap: the middle chunk moved up one row (sizes kept), its storage re-keyed
          attrs(chunks(v, "model.embed")[1]).set("offsets", size_obj({2, 0}));
          attrs(storage_pair(v, "model.embed", shape_t{3, 0})[0]).set("offset", size_obj({2, 0}));
        }) == errors::dcp_overlapping_chunks.id);
  CHECK(describe_with([](Value& v) {
          // two entries placed at the same path
          Dict pd;
          pd.set("step", Value::tuple({Value("name")}));
          attrs(v).set("planner_data", Value(std::move(pd)));
        }) == errors::dcp_name_conflict.id);
  dcp::options few;
  few.limits.max_files = 2;
  CHECK(describe_with([](Value&) {}, few) == errors::dcp_too_many_files.id);
  few = {};
  few.limits.max_metadata_bytes = 100;
  CHECK(describe_with([](Value&) {}, few) == errors::dcp_metadata_too_large.id);
  few = {};
  few.limits.max_item_pickle_bytes = 8;
  CHECK(describe_with([](Value&) {}, few) == errors::tr_pickle_too_large.id);
  // replicated chunks (dedup off in 2.x) are read once: duplicate the chunk list entries
  CHECK(describe_with([](Value& v) {
          auto& c = chunks(v, "model.embed");
          c.push_back(copy_tree(c[0]));
        }) == 0);
  fs::remove(d / ".metadata");
  CHECK(error_of([&] { (void)dcp::describe(d); }) == errors::dcp_no_metadata.id);
  CHECK_FALSE(dcp::detect(d).found);
}

TEST_CASE("a bytes item holding tensors (a nested dict saved whole by torch 1.13) gives tensors into the item") {
  const fs::path d = written("blob", dcp::class_names::torch_1_13, 2);
  Value md = load_md(d);
  // Replace the bytes item "name" by a torch.save of {"a": tensor, "b": 3} appended to rank 0's file.
  Dict blob;
  blob.set("a", arange_f32({2, 3}, 7));
  blob.set("b", 3);
  const fs::path tmp = tmp_dir("blob_item") ;
  fs::create_directories(tmp);
  torch::save_options so;
  so.archive_name = "archive";
  torch::save(tmp / "item.pt", Value(std::move(blob)), so);
  const std::string item = read_all(tmp / "item.pt");
  const std::string rank0 = read_all(d / "__0_0.distcp");
  {
    std::ofstream f(d / "__0_0.distcp", std::ios::binary | std::ios::app);
    f << item;
  }
  Dict& info = attrs(storage_pair(md, "name")[1]);
  info.set("offset", static_cast<std::int64_t>(rank0.size()));
  info.set("length", static_cast<std::int64_t>(item.size()));
  save_md(d, md);
  const ShardedCheckpoint back = dcp::describe(d);
  const TensorInfo* a = back.find("name.a");
  REQUIRE(a);
  CHECK(a->shape == shape_t{2, 3});
  const auto h = hashes(back);
  CHECK(h.at("name.a") == sha256_hex(arange_f32({2, 3}, 7).view()));
  CHECK(value_texts(back.skeleton).at("name.b") == "int 3");
}

TEST_CASE("writer: bad world size, unsupported trees, key conflicts; the directory appears whole or not at all") {
  const fs::path d = tmp_dir("wbad");
  dcp::write_options o;
  o.world_size = 0;
  CHECK(error_of([&] { dcp::write(from_tree(sample_tree()), d, o); }) == errors::dcp_bad_world_size.id);
  CHECK_FALSE(fs::exists(d));
  o.world_size = 2;
  {
    Dict r;
    r.set("a.b", arange_f32({2}));
    Dict a;
    a.set("b", arange_f32({2}));
    r.set("a", Value(std::move(a)));
    CHECK(error_of([&] { dcp::write(from_tree(Value(std::move(r))), d, o); }) == errors::dcp_write_key_conflict.id);
  }
  {
    Dict r;
    r.set("t", Value::tuple({Value(arange_f32({2})), Value(1)}));
    o.classes = dcp::class_names::torch_2;  // 2.x: tuples are leaves; a tensor inside cannot be an item
    CHECK(error_of([&] { dcp::write(from_tree(Value(std::move(r))), d, o); }) == errors::dcp_write_unsupported.id);
    o.classes = dcp::class_names::torch_1_13;
  }
  {
    Dict r;
    Object obj{"my.mod", "Thing", object_build::reduce, {Value(arange_f32({2}))}, {}, {}};
    r.set("o", Value(std::move(obj)));
    CHECK(error_of([&] { dcp::write(from_tree(Value(std::move(r))), d, o); }) == errors::dcp_write_unsupported.id);
  }
  {
    Dict r;
    r.set("u", Tensor::zeros(dtype::U16, {4}));
    CHECK(error_of([&] { dcp::write(from_tree(Value(std::move(r))), d, o); }) == errors::dcp_write_unsupported.id);
    o.classes = dcp::class_names::torch_2;  // 2.x writes it through _rebuild_tensor_v3
    dcp::write(from_tree(Value(Dict{{"u", Value(Tensor::zeros(dtype::U16, {4}))}})), d, o);
    CHECK(dcp::describe(d).find("u")->dtype == dtype::U16);
    o.classes = dcp::class_names::torch_1_13;
  }
  {
    // a view into another tensor (skeleton view_of node)
    Tensor base = arange_f32({4, 4});
    TensorView row(dtype::F32, {4}, {1}, base.data() + 16, {});
    Dict r;
    r.set("base", base);
    r.set("row", row);
    const ShardedCheckpoint c = from_tree(Value(std::move(r)));
    REQUIRE(c.tensors.size() == 1);  // "row" is a view_of node of the skeleton
    CHECK(error_of([&] { dcp::write(c, d, o); }) == errors::dcp_write_unsupported.id);
  }
  {
    // the same tensor under two keys (an alias) is written twice and reads back twice
    Tensor t = arange_f32({3, 2});
    Dict r;
    r.set("w", t);
    r.set("tied", t);
    const ShardedCheckpoint c = from_tree(Value(std::move(r)));
    fs::remove_all(d);
    dcp::write(c, d, o);
    const auto h = hashes(dcp::describe(d));
    CHECK(h.at("w") == h.at("tied"));
  }
  // replacing an existing checkpoint directory
  dcp::write(from_tree(sample_tree()), d, o);
  CHECK(dcp::describe(d).find("model.embed"));
  CHECK(error_of([&] { dcp::write(from_tree(Value(Dict{{"x", Value(Value::list())}})), d, o); }) == 0);
  CHECK(dcp::describe(d).tensors.empty());
}

TEST_CASE("detect: the rule that matched, or what was looked for and found") {
  const fs::path d = tmp_dir("detect");
  fs::create_directories(d);
  auto det = dcp::detect(d);
  CHECK_FALSE(det.found);
  CHECK(det.rule.find("no .metadata") != std::string::npos);
  write_all(d / ".metadata", std::as_bytes(std::span<const char>("not a pickle", 12)));
  det = dcp::detect(d);
  CHECK_FALSE(det.found);
  CHECK(det.rule.find("not a pickle") != std::string::npos);
  save_md(d, Value(Dict{{"a", Value(1)}}));
  det = dcp::detect(d);
  CHECK_FALSE(det.found);
  CHECK(det.rule.find("without a DCP Metadata class") != std::string::npos);
  CHECK_FALSE(dcp::detect(d / "missing").found);
  const fs::path w = written("detect_w");
  det = dcp::detect(w);
  CHECK(det.found);
  CHECK(det.rule.find("torch.distributed._shard.checkpoint") != std::string::npos);
}

// ---- the item archive reader (formats/detail/torch_refs.hpp)

namespace {
std::vector<std::byte> text_bytes(std::string_view t) {
  std::vector<std::byte> out(t.size());
  if (!t.empty()) std::memcpy(out.data(), t.data(), t.size());
  return out;
}

/// A stored zip archive with the given entries, laid out as torch writes it, with the `version`
/// record torch.save writes last (unless `with_version` is false or no entry has a folder).
std::shared_ptr<const ByteSource> archive(std::vector<std::pair<std::string, std::vector<std::byte>>> entries,
                                          bool with_version = true) {
  if (with_version && !entries.empty())
    if (const auto slash = entries.front().first.find('/'); slash != std::string::npos)
      entries.emplace_back(entries.front().first.substr(0, slash + 1) + "version", text_bytes("3\n"));
  std::vector<zip::EntrySpec> specs;
  for (const auto& [n, b] : entries) specs.push_back({n, b.size()});
  const zip::Layout L = zip::plan(specs);
  std::vector<std::byte> out(static_cast<std::size_t>(L.total_size));
  std::vector<std::uint32_t> crcs;
  auto put = [&](std::uint64_t at, std::span<const std::byte> b) { std::copy(b.begin(), b.end(), out.begin() + static_cast<std::ptrdiff_t>(at)); };
  for (std::size_t i = 0; i < entries.size(); ++i) {
    put(L.entries[i].header_offset, zip::local_header_bytes(L.entries[i], L.options));
    put(L.entries[i].data_offset, entries[i].second);
    crcs.push_back(zip::crc32(entries[i].second));
    put(L.entries[i].descriptor_offset, zip::descriptor_bytes(L.entries[i], crcs.back()));
  }
  put(L.central_offset, zip::tail_bytes(L, crcs));
  return MemorySource::copy_of("item", out);
}

/// data.pkl of `_rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())` with a
/// persistent id (storage class, key, numel); `rebuild` may name another function.
std::vector<std::byte> tensor_pickle(const std::string& storage_cls, const std::string& key, std::int64_t numel,
                                     std::int64_t offset, shape_t size, shape_t stride,
                                     const std::string& rebuild = "_rebuild_tensor_v2") {
  std::vector<std::byte> out;
  pickle::Writer w(out);
  w.op(0x80);
  w.op(2);
  w.global("torch._utils", rebuild);
  w.mark();
  w.mark();
  w.str("storage");
  w.global("torch", storage_cls);
  w.str(key);
  w.str("cpu");
  w.integer(numel);
  w.op('t');
  w.op('Q');
  w.integer(offset);
  for (const shape_t* dims : {&size, &stride}) {
    w.mark();
    for (dim_t d : *dims) w.integer(d);
    w.op('t');
  }
  w.boolean(false);
  w.global("collections", "OrderedDict");
  w.op(')');
  w.reduce();
  w.op('t');
  w.reduce();
  w.op('.');
  return out;
}

std::vector<std::byte> bytes_of(std::size_t n) { return std::vector<std::byte>(n, std::byte{0x11}); }

int load_error(const std::shared_ptr<const ByteSource>& src) {
  return error_of([&] { (void)detail::torch_refs::load(src); });
}
}  // namespace

TEST_CASE("item archives: located tensors and each error of the reference reader") {
  namespace tr = detail::torch_refs;
  {
    // a strided view into a larger storage: offset and strides kept, bounds checked
    auto src = archive({{"archive/data.pkl", tensor_pickle("FloatStorage", "0", 12, 2, {2, 3}, {1, 2})},
                        {"archive/data/0", bytes_of(48)}});
    const tr::Tree t = tr::load(src);
    REQUIRE(tr::is_ref(t.value));
    const tr::TensorRef& r = t.tensors[tr::ref_index(t.value)];
    CHECK(r.dtype == dtype::F32);
    CHECK(r.sizes == shape_t{2, 3});
    CHECK(r.strides == shape_t{1, 2});
    CHECK(r.byte_offset() == r.record_offset + 8);
    CHECK(r.record_offset % 64 == 0);
  }
  {
    // what torch.load refuses in an archive, beyond its pickle (DCP's reader runs it on each one)
    const auto pkl = tensor_pickle("FloatStorage", "0", 12, 0, {12}, {1});
    CHECK(load_error(archive({{"archive/data.pkl", pkl}, {"archive/data/0", bytes_of(48)}}, false)) == errors::tr_bad_archive.id);
    for (const char* v : {"0\n", "11\n", "x\n", ""})
      CHECK(load_error(archive({{"archive/data.pkl", pkl}, {"archive/data/0", bytes_of(48)}, {"archive/version", text_bytes(v)}},
                               false)) == errors::tr_bad_archive.id);
    CHECK(load_error(archive({{"archive/data.pkl", pkl}, {"archive/data/0", bytes_of(48)}, {"other/extra", bytes_of(1)}})) ==
          errors::tr_bad_archive.id);
    CHECK(load_error(archive({{"archive/data.pkl", pkl}, {"archive/data/0", bytes_of(52)}})) == errors::tr_bad_archive.id);
    CHECK(load_error(archive({{"archive/data.pkl", pkl}, {"archive/data/0", bytes_of(48)}, {"archive/byteorder", text_bytes("big")}})) ==
          errors::tr_unsupported.id);
    CHECK(load_error(archive({{"archive/data.pkl", pkl}, {"archive/data/0", bytes_of(48)}, {"archive/byteorder", text_bytes("middle")}})) ==
          errors::tr_bad_archive.id);
    // the same archive with what torch writes is read
    CHECK(load_error(archive({{"archive/data.pkl", pkl}, {"archive/data/0", bytes_of(48)}, {"archive/byteorder", text_bytes("little")}})) == 0);
    CHECK(load_error(archive({{"archive/data.pkl", pkl}, {"archive/data/0", bytes_of(48)}, {"archive/.data/version", text_bytes("3\n")}},
                             false)) == 0);
  }
  CHECK(load_error(archive({{"archive/other", bytes_of(3)}})) == errors::tr_no_data_pkl.id);
  CHECK(load_error(archive({{"noslash", bytes_of(3)}})) == errors::tr_no_data_pkl.id);
  CHECK(load_error(archive({{"archive/data.pkl", tensor_pickle("FloatStorage", "1", 12, 0, {12}, {1})},
                            {"archive/data/0", bytes_of(48)}})) == errors::tr_missing_record.id);
  CHECK(load_error(archive({{"archive/data.pkl", tensor_pickle("FloatStorage", "0", 13, 0, {12}, {1})},
                            {"archive/data/0", bytes_of(48)}})) == errors::tr_out_of_record.id);
  CHECK(load_error(archive({{"archive/data.pkl", tensor_pickle("FloatStorage", "0", 12, 1, {12}, {1})},
                            {"archive/data/0", bytes_of(48)}})) == errors::tr_out_of_record.id);
  CHECK(load_error(archive({{"archive/data.pkl", tensor_pickle("FloatStorage", "0", 12, 0, {3, 4}, {4, 4})},
                            {"archive/data/0", bytes_of(48)}})) == errors::tr_out_of_record.id);
  CHECK(load_error(archive({{"archive/data.pkl", tensor_pickle("FloatStorage", "../0", 12, 0, {12}, {1})},
                            {"archive/data/0", bytes_of(48)}})) == errors::tr_bad_storage_id.id);
  CHECK(load_error(archive({{"archive/data.pkl", tensor_pickle("QInt8Storage", "0", 12, 0, {12}, {1})},
                            {"archive/data/0", bytes_of(48)}})) == errors::tr_unsupported.id);
  CHECK(load_error(archive({{"archive/data.pkl", tensor_pickle("FloatStorage", "0", 12, 0, {12}, {1, 1})},
                            {"archive/data/0", bytes_of(48)}})) == errors::tr_bad_rebuild_args.id);
  CHECK(load_error(archive({{"archive/data.pkl", tensor_pickle("FloatStorage", "0", 12, 0, {-1}, {1})},
                            {"archive/data/0", bytes_of(48)}})) == errors::tr_bad_rebuild_args.id);
  CHECK(load_error(archive({{"archive/data.pkl", tensor_pickle("FloatStorage", "0", 12, 0, {12}, {1}, "_rebuild_qtensor")},
                            {"archive/data/0", bytes_of(48)}})) == errors::tr_unsupported.id);
  {
    // a pickle cannot forge a placeholder: calling the reserved global is refused
    std::vector<std::byte> p;
    pickle::Writer w(p);
    w.op(0x80);
    w.op(2);
    w.global(std::string(tr::ref_module), std::string(tr::ref_name));
    w.mark();
    w.integer(0);
    w.op('t');
    w.reduce();
    w.op('.');
    CHECK(load_error(archive({{"archive/data.pkl", p}})) == errors::tr_bad_rebuild_args.id);
  }
  {
    // a persistent id that is not a storage
    std::vector<std::byte> p;
    pickle::Writer w(p);
    w.op(0x80);
    w.op(2);
    w.str("nope");
    w.op('Q');
    w.op('.');
    CHECK(load_error(archive({{"archive/data.pkl", p}})) == errors::tr_bad_storage_id.id);
  }
}

TEST_CASE("hostile bytes: random corruption of .metadata and of a data file gives statedict errors only") {
  const fs::path d = written("fuzz", dcp::class_names::torch_1_13, 2);
  const std::string md = read_all(d / ".metadata");
  const std::string data = read_all(d / "__1_0.distcp");
  std::uint64_t seed = 0x9e3779b97f4a7c15ULL;
  auto next = [&] {
    seed ^= seed << 13;
    seed ^= seed >> 7;
    seed ^= seed << 17;
    return seed;
  };
  auto corrupt = [&](const std::string& orig, const fs::path& file) {
    std::string s = orig;
    const int flips = 1 + static_cast<int>(next() % 4);
    for (int k = 0; k < flips; ++k) s[static_cast<std::size_t>(next() % s.size())] = static_cast<char>(next() & 0xff);
    if (next() % 8 == 0) s.resize(static_cast<std::size_t>(next() % s.size()));
    write_all(file, std::as_bytes(std::span<const char>(s.data(), s.size())));
  };
  int failures = 0, successes = 0;
  for (int i = 0; i < 300; ++i) {
    const bool meta = i % 2 == 0;
    corrupt(meta ? md : data, meta ? d / ".metadata" : d / "__1_0.distcp");
    try {
      const ShardedCheckpoint c = dcp::describe(d);
      (void)sha256_tensors(c);  // reading what the description points at must stay in bounds
      ++successes;
    } catch (const error&) {
      ++failures;
    }
    write_all(d / (meta ? ".metadata" : "__1_0.distcp"),
              std::as_bytes(std::span<const char>((meta ? md : data).data(), (meta ? md : data).size())));
  }
  MESSAGE("corrupted inputs: " << failures << " rejected, " << successes << " still valid");
  CHECK(failures > 0);
}
