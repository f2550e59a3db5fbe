// ShardedTensor rank files: synthetic `rank<N>.pt` files pickled the way torch 1.13 pickles
// ShardedTensors (_rebuild_from_type_v2 of _rebuild_wrapper_subclass with the local shards and
// the global ShardedTensorMetadata as state), written with io/torch_file.hpp, then described;
// one test per error id on mutated trees.
#include <doctest/doctest.h>

#include <statedict/core/flatten.hpp>
#include <statedict/core/sha256.hpp>
#include <statedict/exec/digest.hpp>
#include <statedict/formats/sharded_tensor.hpp>
#include <statedict/io/torch_file.hpp>
#include <statedict/shard/layout.hpp>
#include <statedict/formats/torch.hpp>

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

/// torch::save with every object pickled as it is (as PyTorch would write these trees), not as
/// the data statedict's outputs carry.
void save_as_written(const fs::path& path, const Value& tree) {
  torch::save_options so;
  so.pickle.objects = pickle::write_options::objects_policy::as_written;
  torch::save(path, tree, so);
}

fs::path tmp_dir(const std::string& sub) { return statedict_test::fresh_dir("unit-sharded-tensor", sub); }

using statedict_test::error_of;

Value global(const std::string& m, const std::string& n) { return Value(Object{m, n, object_build::global, {}, {}, {}}); }
Value call(const std::string& m, const std::string& n, List args) { return Value(Object{m, n, object_build::reduce, std::move(args), {}, {}}); }
Value newobj(const std::string& m, const std::string& n, Value state) {
  Object o{m, n, object_build::newobj, {}, {}, {}};
  o.state.push_back(std::move(state));
  return Value(std::move(o));
}
Value slots(Dict d) { return Value::tuple({Value(), Value(std::move(d))}); }
Value ints(const shape_t& s, bool tuple) {
  List l;
  for (dim_t d : s) l.emplace_back(d);
  return tuple ? Value::tuple(std::move(l)) : Value::list(std::move(l));
}
Value device() { return call("torch", "device", {Value("cpu")}); }

const std::string st_api = "torch.distributed._shard.sharded_tensor.api";
const std::string st_md = "torch.distributed._shard.sharded_tensor.metadata";

Value remote(std::uint64_t rank) {
  Dict d;
  d.set("_worker_name", Value());
  d.set("_rank", static_cast<std::int64_t>(rank));
  d.set("_device", device());
  return newobj("torch.distributed.remote_device", "_remote_device", Value(std::move(d)));
}

Value shard_md(const Box& b, std::uint64_t rank) {
  Dict d;
  d.set("shard_offsets", ints(b.offsets, false));
  d.set("shard_sizes", ints(b.sizes, false));
  d.set("placement", remote(rank));
  return newobj("torch.distributed._shard.metadata", "ShardMetadata", slots(std::move(d)));
}

Value properties(dtype t) {
  Value mem = call("builtins", "getattr", {global(st_md, "MEM_FORMAT_ENCODING"), Value("TORCH_CONTIGUOUS_FORMAT")});
  Value layout = call("torch.serialization", "_get_layout", {Value("torch.strided")});
  return newobj(st_md, "TensorProperties",
                Value::tuple({global("torch", std::string(info(t).torch_name)), layout, Value(false), mem, Value(false)}));
}

/// The elements of box `b` of `t`, as a contiguous tensor.
Tensor slice(const Tensor& t, const Box& b) {
  Tensor out(t.dtype(), b.sizes);
  const std::size_t is = itemsize(t.dtype());
  for (std::uint64_t e = 0; e < out.numel(); ++e) {
    shape_t idx = multi_index(b.sizes, e);
    for (std::size_t d = 0; d < idx.size(); ++d) idx[d] += b.offsets[d];
    std::memcpy(out.data() + e * is, t.data() + linear_index(t.shape(), idx) * is, is);
  }
  return out;
}

struct Spec {
  Tensor global;
  std::size_t dim = 0;
  std::vector<std::uint32_t> order;  ///< placement order (empty: 0..W-1)
  dtype wrapper_dtype_override = dtype::U8;  ///< U8: use the real dtype
};

/// A ShardedTensor as rank `rank` of `world` pickles it (ChunkShardingSpec along spec.dim).
Value sharded(const Spec& s, std::uint32_t world, std::uint32_t rank) {
  std::vector<std::uint32_t> order = s.order;
  if (order.empty())
    for (std::uint32_t r = 0; r < world; ++r) order.push_back(r);
  List shards_md, local;
  for (std::uint32_t i = 0; i < order.size(); ++i) {
    Box b = layout::split_box(s.global.shape(), s.dim, world, i, layout::split_rule::chunk);
    if (is_empty(b)) continue;
    shards_md.push_back(shard_md(b, order[i]));
    if (order[i] == rank) {
      Dict sh;
      sh.set("tensor", slice(s.global, b));
      sh.set("metadata", shard_md(b, order[i]));
      local.push_back(newobj("torch.distributed._shard.sharded_tensor.shard", "Shard", slots(std::move(sh))));
    }
  }
  Dict md;
  md.set("shards_metadata", Value::list(std::move(shards_md)));
  md.set("size", call("torch", "Size", {ints(s.global.shape(), true)}));
  md.set("tensor_properties", properties(s.global.dtype()));
  const dtype wd = s.wrapper_dtype_override == dtype::U8 ? s.global.dtype() : s.wrapper_dtype_override;
  Value args = Value::tuple({global(st_api, "ShardedTensor"), global("torch", std::string(info(wd).torch_name)),
                             ints(s.global.shape(), true), ints(contiguous_strides(s.global.shape()), true), Value(0),
                             call("torch.serialization", "_get_layout", {Value("torch.strided")}), device(), Value(false)});
  Dict pg;
  pg.set("local_rank", static_cast<std::int64_t>(rank));
  pg.set("global_rank", static_cast<std::int64_t>(rank));
  pg.set("local_world_size", static_cast<std::int64_t>(world));
  pg.set("global_world_size", static_cast<std::int64_t>(world));
  Dict spec;
  spec.set("dim", static_cast<std::int64_t>(s.dim));
  spec.set("placements", Value::list());
  Value state = Value::tuple({Value::list(std::move(local)), newobj(st_md, "ShardedTensorMetadata", Value(std::move(md))),
                              newobj(st_api, "ShardedTensor.ProcessGroupState", Value(std::move(pg))),
                              newobj("torch.distributed._shard.sharding_spec.chunk_sharding_spec", "ChunkShardingSpec", Value(std::move(spec))),
                              Value(false)});
  return call("torch._tensor", "_rebuild_from_type_v2",
              {global("torch._utils", "_rebuild_wrapper_subclass"), global(st_api, "ShardedTensor"), args, state});
}

Tensor arange(dtype t, shape_t shape, float start = 0) {
  Tensor f(dtype::F32, shape);
  auto v = f.values<float>();
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = start + static_cast<float>(i);
  return Tensor::copy_of(f.view(), t);
}

struct Model {
  Spec embed{arange(dtype::F32, {5, 3}), 0, {}, dtype::U8};
  Spec proj{arange(dtype::BF16, {4, 7}, 100), 1, {}, dtype::U8};
  Spec rev{arange(dtype::F32, {6, 2}, 50), 0, {}, dtype::U8};
  Tensor bias = arange(dtype::F32, {3}, 7);
};

/// The tree rank `rank` saves: OLMo-style {"model": {...}, "optim": {...}, "step": 3}.
Value rank_tree(const Model& m, std::uint32_t world, std::uint32_t rank) {
  Spec rev = m.rev;
  for (std::uint32_t r = world; r-- > 0;) rev.order.push_back(r);
  Dict model;
  model.set("embed.weight", sharded(m.embed, world, rank));
  model.set("proj.weight", sharded(m.proj, world, rank));
  model.set("rev", sharded(rev, world, rank));
  model.set("bias", m.bias);
  Dict st;
  st.set("step", Tensor::from<float>({3.0f}, {}));
  st.set("exp_avg", sharded(Spec{arange(dtype::F32, {5, 3}, 1000), 0, {}, dtype::U8}, world, rank));
  Dict state;
  state.set("embed.weight", Value(std::move(st)));
  Dict group;
  group.set("lr", 0.001);
  group.set("params", Value::list({Value("embed.weight")}));
  Dict optim;
  optim.set("state", Value(std::move(state)));
  optim.set("param_groups", Value::list({Value(std::move(group))}));
  Dict root;
  root.set("model", Value(std::move(model)));
  root.set("optim", Value(std::move(optim)));
  root.set("step", 3);
  return Value(std::move(root));
}

void write_ranks(const fs::path& dir, std::uint32_t world, const std::function<Value(std::uint32_t)>& tree_of) {
  for (std::uint32_t r = 0; r < world; ++r) save_as_written(dir / ("rank" + std::to_string(r) + ".pt"), tree_of(r));
}

std::map<std::string, std::string> hashes(const ShardedCheckpoint& c) {
  std::map<std::string, std::string> m;
  for (auto& [n, h] : sha256_tensors(c)) m[n] = h;
  return m;
}

/// Mutable access to the ShardedTensor call at model.<name> in a rank tree.
List& st_args(Value& tree, const std::string& name) { return tree["model"][name].as_object().args; }
List& st_state(Value& tree, const std::string& name) { return st_args(tree, name)[3].as_list(); }
Dict& st_meta(Value& tree, const std::string& name) { return st_state(tree, name)[1].as_object().state[0].as_dict(); }

}  // namespace

TEST_CASE("rank files describe the global tensors; chunks point into the rank files; values from rank 0") {
  const Model m;
  for (std::uint32_t world : {1U, 2U, 3U, 4U}) {
    CAPTURE(world);
    const fs::path d = tmp_dir("ok");
    write_ranks(d, world, [&](std::uint32_t r) { return rank_tree(m, world, r); });
    const auto det = sharded_tensor::detect(d);
    CHECK(det.found);
    CHECK(det.world_size == world);
    sharded_tensor::options o;
    o.check_replicas = true;
    const ShardedCheckpoint c = sharded_tensor::describe(d, o);
    CHECK(c.format == "sharded_tensor_ranks");
    CHECK(c.sources.size() == world);
    std::vector<std::string> names;
    for (const auto& t : c.tensors) names.push_back(t.name);
    CHECK(names == std::vector<std::string>{"model.embed.weight", "model.proj.weight", "model.rev", "model.bias",
                                            "optim.state.embed.weight.step", "optim.state.embed.weight.exp_avg"});
    const auto h = hashes(c);
    CHECK(h.at("model.embed.weight") == sha256_hex(m.embed.global.view()));
    CHECK(h.at("model.proj.weight") == sha256_hex(m.proj.global.view()));
    CHECK(h.at("model.rev") == sha256_hex(m.rev.global.view()));
    CHECK(h.at("model.bias") == sha256_hex(m.bias.view()));
    CHECK(c.find("model.proj.weight")->dtype == dtype::BF16);
    // chunks: one per non-empty shard, on the file of its placement
    const TensorInfo* rev = c.find("model.rev");
    std::size_t parts = 0;
    for (std::uint32_t i = 0; i < world; ++i) parts += is_empty(layout::split_box(shape_t{6, 2}, 0, world, i)) ? 0U : 1U;
    CHECK(rev->chunks.size() == parts);
    if (world == 4) {
      // 6 rows over 4: 2, 2, 2, 0; placements reversed: rank 3 holds rows 0-1
      CHECK(std::get<Box>(rev->chunks[0].region).offsets == shape_t{0, 0});
      CHECK(rev->chunks[0].at.source == 3);
    }
    std::map<std::string, std::string> values;
    for (auto& [n, v] : skeleton_values(c.skeleton)) values[n] = v.is_string() ? v.as_string() : std::string(to_string(v.kind()));
    CHECK(values.at("step") == "int");
    CHECK(values.at("optim.param_groups.0.params.0") == "embed.weight");
  }
}

TEST_CASE("rank file errors: one id each") {
  const Model m;
  const std::uint32_t world = 2;
  auto run = [&](const std::function<void(Value&, std::uint32_t)>& mutate, sharded_tensor::options o = {}) {
    const fs::path d = tmp_dir("err");
    write_ranks(d, world, [&](std::uint32_t r) {
      Value t = rank_tree(m, world, r);
      mutate(t, r);
      return t;
    });
    return error_of([&] { (void)sharded_tensor::describe(d, o); });
  };
  CHECK(run([](Value&, std::uint32_t) {}) == 0);
  {
    const fs::path d = tmp_dir("none");
    CHECK(error_of([&] { (void)sharded_tensor::describe(d); }) == errors::st_no_rank_files.id);
    CHECK_FALSE(sharded_tensor::detect(d).found);
    save_as_written(d / "rank0.pt", rank_tree(m, 3, 0));
    save_as_written(d / "rank2.pt", rank_tree(m, 3, 2));
    CHECK(error_of([&] { (void)sharded_tensor::describe(d); }) == errors::st_bad_rank_set.id);
    sharded_tensor::options o;
    o.limits.max_ranks = 1;
    CHECK(error_of([&] { (void)sharded_tensor::describe(d, o); }) == errors::st_too_many_ranks.id);
    // a rank file without ShardedTensors is not this format
    const fs::path p = tmp_dir("plain");
    torch::save(p / "rank0.pt", Value(Dict{{"w", Value(arange(dtype::F32, {2}))}}));
    CHECK_FALSE(sharded_tensor::detect(p).found);
  }
  // the ShardedTensor object itself
  CHECK(run([](Value& t, std::uint32_t) { st_args(t, "embed.weight")[2] = Value(3); }) == errors::st_bad_object.id);
  CHECK(run([](Value& t, std::uint32_t) { st_state(t, "embed.weight")[1] = Value(Dict{}); }) == errors::st_bad_object.id);
  CHECK(run([](Value& t, std::uint32_t) { st_meta(t, "embed.weight").erase(Key("shards_metadata")); }) == errors::st_bad_object.id);
  CHECK(run([](Value& t, std::uint32_t) {
          auto& sm = st_meta(t, "embed.weight").at(Key("shards_metadata")).as_list();
          sm[0].as_object().state[0].as_list()[1].as_dict().at(Key("placement")).as_object().state[0].as_dict().set("_rank", Value());
        }) == errors::st_bad_object.id);
  CHECK(run([](Value& t, std::uint32_t) {
          st_meta(t, "embed.weight").set("size", call("torch", "Size", {ints({5, -3}, true)}));
        }) == errors::st_bad_object.id);
  // dtypes: the wrapper argument, the metadata and the shards must agree
  CHECK(run([](Value& t, std::uint32_t) { st_args(t, "embed.weight")[2].as_list()[1] = global("torch", "bfloat16"); }) ==
        errors::st_dtype_mismatch.id);
  CHECK(run([](Value& t, std::uint32_t) {
          st_meta(t, "proj.weight").set("tensor_properties", properties(dtype::F32));
          st_args(t, "proj.weight")[2].as_list()[1] = global("torch", "float32");
        }) == errors::st_dtype_mismatch.id);  // the shards are still bf16
  // ranks that disagree
  CHECK(run([](Value& t, std::uint32_t r) {
          if (r == 1) t["model"].as_dict().set("extra", 1);
        }) == errors::st_rank_disagreement.id);
  CHECK(run([](Value& t, std::uint32_t r) {
          if (r == 1) st_meta(t, "embed.weight").at(Key("shards_metadata")).as_list().pop_back();
        }) != 0);
  CHECK(run([](Value& t, std::uint32_t r) {
          if (r == 1) {
            auto& sm = st_meta(t, "embed.weight").at(Key("shards_metadata")).as_list();
            std::swap(sm[0], sm[1]);
          }
        }) == errors::st_rank_disagreement.id);
  // local shards that do not match their metadata
  CHECK(run([](Value& t, std::uint32_t r) {
          if (r != 1) return;
          auto& local = st_state(t, "embed.weight")[0].as_list();
          local[0].as_object().state[0].as_list()[1].as_dict().set("metadata", shard_md(Box{{3, 0}, {2, 3}}, 0));
        }) == errors::st_shard_mismatch.id);
  CHECK(run([](Value& t, std::uint32_t r) {
          if (r != 1) return;
          auto& local = st_state(t, "embed.weight")[0].as_list();
          local[0].as_object().state[0].as_list()[1].as_dict().set("tensor", arange(dtype::F32, {1, 3}));
        }) == errors::st_shard_mismatch.id);
  CHECK(run([](Value& t, std::uint32_t r) {
          if (r != 1) return;
          auto& local = st_state(t, "embed.weight")[0].as_list();
          local.push_back(copy_tree(local[0]));
        }) == errors::st_shard_mismatch.id);
  // a shard nobody holds, a hole, an overlap
  CHECK(run([](Value& t, std::uint32_t r) {
          if (r == 1) st_state(t, "embed.weight")[0].as_list().clear();
        }) == errors::st_incomplete.id);
  CHECK(run([](Value& t, std::uint32_t) {
          auto& sm = st_meta(t, "embed.weight").at(Key("shards_metadata")).as_list();
          sm[1] = shard_md(Box{{4, 0}, {1, 3}}, 1);  // rows 3 uncovered
        }) != 0);
  CHECK(run([](Value& t, std::uint32_t) {
          auto& sm = st_meta(t, "embed.weight").at(Key("shards_metadata")).as_list();
          sm[1] = shard_md(Box{{3, 0}, {2, 4}}, 1);  // outside the tensor
        }) == errors::st_incomplete.id);
  CHECK(run([](Value& t, std::uint32_t r) {
          auto& sm = st_meta(t, "embed.weight").at(Key("shards_metadata")).as_list();
          sm[1] = shard_md(Box{{5, 0}, {0, 3}}, 1);  // an empty shard: rows 3-4 are in no shard
          if (r == 1) st_state(t, "embed.weight")[0].as_list().clear();
        }) == errors::st_incomplete.id);
  // replicas, compared only when asked
  sharded_tensor::options check;
  check.check_replicas = true;
  auto step_differs = [](Value& t, std::uint32_t r) {
    if (r == 1) t.as_dict().set("step", 4);
  };
  CHECK(run(step_differs) == 0);
  CHECK(run(step_differs, check) == errors::st_replica_mismatch.id);
  auto bias_differs = [](Value& t, std::uint32_t r) {
    if (r == 1) t["model"].as_dict().set("bias", arange(dtype::F32, {3}, 8));
  };
  CHECK(run(bias_differs) == 0);
  CHECK(run(bias_differs, check) == errors::st_replica_mismatch.id);
}

TEST_CASE("hostile bytes: random corruption of a rank file gives statedict errors only") {
  const Model m;
  const fs::path d = tmp_dir("fuzz");
  write_ranks(d, 2, [&](std::uint32_t r) { return rank_tree(m, 2, r); });
  std::string orig;
  {
    std::ifstream f(d / "rank1.pt", std::ios::binary);
    orig.assign(std::istreambuf_iterator<char>(f), {});
  }
  std::uint64_t seed = 0x2545F4914F6CDD1DULL;
  auto next = [&] {
    seed ^= seed << 13;
    seed ^= seed >> 7;
    seed ^= seed << 17;
    return seed;
  };
  auto put = [&](const std::string& s) {
    std::ofstream f(d / "rank1.pt", std::ios::binary | std::ios::trunc);
    f << s;
  };
  int failures = 0;
  for (int i = 0; i < 200; ++i) {
    std::string s = orig;
    for (int k = 0; k < 1 + static_cast<int>(next() % 3); ++k) s[static_cast<std::size_t>(next() % s.size())] = static_cast<char>(next() & 0xff);
    put(s);
    try {
      sharded_tensor::options o;
      o.check_replicas = true;
      (void)sha256_tensors(sharded_tensor::describe(d, o));
    } catch (const error&) {
      ++failures;
    }
  }
  put(orig);
  MESSAGE("corrupted rank files rejected: " << failures << " of 200");
  CHECK(failures > 0);
}

TEST_CASE("describe_tree: a kept object whose module and name are not UTF-8 stays a value beside the tensors") {
  // Found by fuzzing formats::open: flatten writes such names as {"str_bytes": ...} objects, and
  // the search for tensor placeholders read them as strings (an escaping nlohmann type_error).
  Dict d;
  d.insert("meta", Value(Object{std::string("\xff\xfe"), std::string("x\xff"), object_build::reduce, {}, {}, {}}));
  d.insert("w", detail::torch_refs::make_ref(0));
  const std::vector<TensorInfo> described{{"", dtype::F32, {2}, {}}};
  const auto r = detail::describe_tree::finish(Value(std::move(d)), described);
  REQUIRE(r.tensors.size() == 1);
  CHECK(r.tensors[0].name == "w");
  const auto& items = r.skeleton["root"]["dict"];
  CHECK(items[0][1]["object"]["module"].is_object());
  CHECK(items[1][1]["tensor"] == "w");
}
