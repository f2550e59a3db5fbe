// FSDP flat parameters (OLMo local sharded checkpoints) on hand-built Value trees: both metadata
// forms, alignment padding, names, order, optimizer state for use_orig_params True and False,
// trainer values, every validation error id with a mutated input, and detect().
#include <doctest/doctest.h>

#include <statedict/core/sha256.hpp>
#include <statedict/exec/digest.hpp>
#include <statedict/formats/fsdp.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace statedict;
namespace fsdp = statedict::fsdp;
namespace os = statedict::optim_shard;
namespace fs = std::filesystem;

namespace {

struct Arena {
  std::shared_ptr<std::vector<std::byte>> buf = std::make_shared<std::vector<std::byte>>(std::size_t{1} << 15);
  std::size_t used = 0;
  std::shared_ptr<const ByteSource> source;
  explicit Arena(std::string name) { source = std::make_shared<MemorySource>(std::move(name), buf->data(), buf->size(), buf); }
  template <class T>
  TensorView put(const std::vector<T>& v, shape_t shape, std::optional<dtype> as = std::nullopt) {
    used = (used + 63) / 64 * 64;
    const std::size_t n = v.size() * sizeof(T);
    REQUIRE(used + n <= buf->size());
    if (n) std::memcpy(buf->data() + used, v.data(), n);
    TensorView t = TensorView::contiguous(as.value_or(dtype_of<T>), std::move(shape), buf->data() + used, buf);
    used += n;
    return t;
  }
  TensorView f32(std::vector<float> v) {
    const auto n = static_cast<dim_t>(v.size());
    return put(v, {n});
  }
  TensorView scalar(float v) { return put(std::vector<float>{v}, {}); }
};

Value tup(std::initializer_list<std::int64_t> v) {
  List l;
  for (auto x : v) l.emplace_back(x);
  return Value::tuple(std::move(l));
}

Value info(bool in, std::int64_t off, std::int64_t n, std::int64_t s, std::int64_t e) {
  List a;
  a.emplace_back(in);
  if (in) {
    a.emplace_back(off);
    a.emplace_back(n);
    a.emplace_back(s);
    a.emplace_back(e);
  } else {
    for (int i = 0; i < 4; ++i) a.emplace_back(Value());
  }
  return Value(Object{"torch.distributed.fsdp._flat_param", "_ShardParamInfo", object_build::newobj, std::move(a), {}, {}});
}

std::string sha_f32(const std::vector<float>& v, shape_t shape) {
  Tensor t = Tensor::from(std::span<const float>(v), std::move(shape));
  return sha256_hex(t.view());
}

std::map<std::string, std::string> hashes(const ShardedCheckpoint& c) {
  auto h = sha256_tensors(c);
  return {h.begin(), h.end()};
}

using statedict_test::error_of;

enum class form { legacy, infos, aligned };

// Two ranks, two FSDP units:
//   root ""                            x [3] = 1 2 3, y [2,2] = 11..14
//   "_fsdp_wrapped_module.blk"         w [3] = 21 22 23  (output name "blk.w")
// Without alignment: root flat 7 -> shards of 4 (rank 1: 12 13 14 0, one padding); blk flat 3 ->
// shards of 2 (rank 1: 23 0). Aligned (use_orig_params, 16 bytes): root x, 1 padding (42), y ->
// 8 elements, shards [1 2 3 42] [11 12 13 14]; blk 3 elements + 1 end padding -> [21 22] [23 42].
struct Olmo {
  std::vector<std::unique_ptr<Arena>> arenas;
  fsdp::Inputs in;
  form f;

  explicit Olmo(form ff = form::infos, bool flat_optim = false) : f(ff) {
    const bool al = f == form::aligned;
    const std::vector<std::vector<float>> root = al ? std::vector<std::vector<float>>{{1, 2, 3, 42}, {11, 12, 13, 14}}
                                                    : std::vector<std::vector<float>>{{1, 2, 3, 11}, {12, 13, 14, 0}};
    const std::vector<std::vector<float>> blk = {{21, 22}, {23, al ? 42.0F : 0.0F}};
    for (int r = 0; r < 2; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      arenas.push_back(std::make_unique<Arena>("step/model/rank" + std::to_string(r) + ".pt"));
      Arena& A = *arenas.back();
      Dict h0, h1;
      h0.set("flat_param.data", A.f32(root[ur]));
      h1.set("flat_param.data", A.f32(blk[ur]));
      if (f == form::legacy) {
        h0.set("flat_param._fqns", Value::tuple({Value("x"), Value("y")}));
        h0.set("flat_param._shard_param_offsets",
               r == 0 ? Value::tuple({tup({0, 2}), tup({0, 0})}) : Value::tuple({tup({1, 3})}));
        h0.set("flat_param._shard_indices", r == 0 ? tup({0, 1}) : tup({1, 1}));
        h0.set("flat_param._numels", tup({3, 4}));
        h0.set("flat_param._shapes", Value::tuple({tup({3}), tup({2, 2})}));
        h0.set("flat_param._shard_numel_padded", r == 0 ? 0 : 1);
        h1.set("flat_param._fqns", Value::tuple({Value("w")}));
        h1.set("flat_param._shard_param_offsets", r == 0 ? Value::tuple({tup({0, 1})}) : Value::tuple({tup({2, 2})}));
        h1.set("flat_param._shard_indices", tup({0, 0}));
        h1.set("flat_param._numels", tup({3}));
        h1.set("flat_param._shapes", Value::tuple({tup({3})}));
        h1.set("flat_param._shard_numel_padded", r == 0 ? 0 : 1);
      } else {
        h0.set("flat_param._fqns", Value::list({Value("x"), Value("y")}));
        h0.set("flat_param._numels", tup({3, 4}));
        h0.set("flat_param._numels_with_padding", al ? tup({3, 1, 4}) : tup({3, 4}));
        h0.set("flat_param._shapes", Value::list({tup({3}), tup({2, 2})}));
        h0.set("flat_param._shard_numel_padded", al || r == 0 ? 0 : 1);
        if (al)
          h0.set("flat_param._shard_param_infos", r == 0 ? Value::tuple({info(true, 0, 3, 0, 2), info(false, 0, 0, 0, 0)})
                                                         : Value::tuple({info(false, 0, 0, 0, 0), info(true, 0, 4, 0, 3)}));
        else
          h0.set("flat_param._shard_param_infos", r == 0 ? Value::tuple({info(true, 0, 3, 0, 2), info(true, 3, 1, 0, 0)})
                                                         : Value::tuple({info(false, 0, 0, 0, 0), info(true, 0, 3, 1, 3)}));
        h1.set("flat_param._fqns", Value::list({Value("w")}));
        h1.set("flat_param._numels", tup({3}));
        h1.set("flat_param._numels_with_padding", al ? tup({3, 1}) : tup({3}));
        h1.set("flat_param._shapes", Value::list({tup({3})}));
        h1.set("flat_param._shard_numel_padded", al || r == 0 ? 0 : 1);
        h1.set("flat_param._shard_param_infos",
               r == 0 ? Value::tuple({info(true, 0, 2, 0, 1)}) : Value::tuple({info(true, 0, 1, 2, 2)}));
      }
      List modules;
      modules.emplace_back(Dict{{"handles", Value::list({Value(std::move(h0))})}, {"name", ""}});
      modules.emplace_back(Dict{{"handles", Value::list({Value(std::move(h1))})}, {"name", "_fsdp_wrapped_module.blk"}});
      in.model.push_back(os::LoadedFile{A.source->name(), A.source, Value(Dict{{"modules", Value::list(std::move(modules))}}), nullptr});

      arenas.push_back(std::make_unique<Arena>("step/optim/rank" + std::to_string(r) + ".pt"));
      Arena& O = *arenas.back();
      auto m = [](std::vector<float> v) {
        for (auto& x : v) x = (x == 0 || x == 42) ? 0 : x + 100;
        return v;
      };
      Dict state;
      List groups;
      if (!flat_optim) {
        // use_orig_params: state per original parameter, this rank's slice of it.
        if (r == 0) {
          state.set(0, Dict{{"step", O.scalar(2)}, {"exp_avg", O.f32({101, 102, 103})}});
          state.set(1, Dict{{"step", O.scalar(2)}, {"exp_avg", O.f32({121, 122})}});
          if (!al) state.set(2, Dict{{"step", O.scalar(2)}, {"exp_avg", O.f32({111})}});
          else state.set(2, Dict{{"step", O.scalar(2)}, {"exp_avg", O.f32({})}});
        } else {
          state.set(1, Dict{{"step", O.scalar(2)}, {"exp_avg", O.f32({123})}});
          state.set(2, Dict{{"step", O.scalar(2)}, {"exp_avg", al ? O.f32({111, 112, 113, 114}) : O.f32({112, 113, 114})}});
        }
        if (al && r == 0) state.erase(2);
        groups.emplace_back(Dict{{"params", Value::list({Value(0), Value(1)})},
                                 {"param_names", Value::list({Value("_fsdp_wrapped_module.x"),
                                                              Value("_fsdp_wrapped_module.blk._fsdp_wrapped_module.w")})},
                                 {"lr", 0.1}});
        groups.emplace_back(Dict{{"params", Value::list({Value(2)})},
                                 {"param_names", Value::list({Value("_fsdp_wrapped_module.y")})},
                                 {"lr", 0.2},
                                 {"weight_decay", 0.0}});
      } else {
        state.set(0, Dict{{"step", O.scalar(5)}, {"exp_avg", O.f32(m(root[ur]))}});
        state.set(1, Dict{{"step", O.scalar(5)}, {"exp_avg", O.f32(m(blk[ur]))}});
        groups.emplace_back(Dict{{"params", Value::list({Value(0), Value(1)})},
                                 {"param_names", Value::list({Value("_fsdp_wrapped_module._flat_param"),
                                                              Value("_fsdp_wrapped_module.blk._fsdp_wrapped_module._flat_param")})},
                                 {"lr", 0.1}});
      }
      in.optim.push_back(os::LoadedFile{O.source->name(), O.source,
                                        Value(Dict{{"state", std::move(state)}, {"param_groups", Value::list(std::move(groups))}}), nullptr});
      in.train.push_back(os::LoadedFile{"step/train/rank" + std::to_string(r) + ".pt", O.source,
                                        Value(Dict{{"epoch", 1}, {"global_step", 7}, {"rng", Dict{{"torch", O.f32({1})}}}}),
                                        nullptr});
    }
    in.metadata_world_size = 2;
  }
  Dict& handle(int r, int m) {
    return in.model[static_cast<std::size_t>(r)].tree.as_dict().at("modules").as_list()[static_cast<std::size_t>(m)].as_dict().at("handles").as_list()[0].as_dict();
  }
  Dict& optim(int r) { return in.optim[static_cast<std::size_t>(r)].tree.as_dict(); }
  Arena& model_arena(int r) { return *arenas[static_cast<std::size_t>(2 * r)]; }
  Arena& optim_arena(int r) { return *arenas[static_cast<std::size_t>(2 * r + 1)]; }
};

std::vector<std::string> names_of(const ShardedCheckpoint& c) {
  std::vector<std::string> v;
  for (const auto& t : c.tensors) v.push_back(t.name);
  return v;
}

}  // namespace

TEST_CASE("fsdp: every metadata form unshards to the same parameters") {
  for (form f : {form::legacy, form::infos, form::aligned}) {
    CAPTURE(static_cast<int>(f));
    Olmo o(f);
    const ShardedCheckpoint c = fsdp::describe(o.in);
    CHECK(c.format == "olmo_local_sharded");
    // First appearance, rank 0 first: x, y (root), blk.w; aligned, y is only on rank 1.
    CHECK(names_of(c) == (f == form::aligned ? std::vector<std::string>{"x", "blk.w", "y"}
                                             : std::vector<std::string>{"x", "y", "blk.w"}));
    CHECK(c.metadata.at("fsdp.form") == (f == form::legacy ? "torch<=2.0" : "torch>=2.1"));
    const auto h = hashes(c);
    CHECK(h.at("x") == sha_f32({1, 2, 3}, {3}));
    CHECK(h.at("y") == sha_f32({11, 12, 13, 14}, {2, 2}));
    CHECK(h.at("blk.w") == sha_f32({21, 22, 23}, {3}));
    CHECK(c.find("y")->shape == shape_t{2, 2});
  }
  Olmo o;
  fsdp::options opt;
  opt.dtype = dtype::F16;
  for (const auto& t : fsdp::describe(o.in, opt).tensors) CHECK(t.dtype == dtype::F16);
}

TEST_CASE("fsdp: optimizer state keyed by name, use_orig_params True and False") {
  for (form f : {form::infos, form::aligned, form::legacy}) {
    for (bool flat : {false, true}) {
      if (flat && f == form::aligned) continue;  // use_orig_params=False has no alignment padding
      CAPTURE(static_cast<int>(f));
      CAPTURE(flat);
      Olmo o(f, flat);
      fsdp::options opt;
      opt.with_optimizer = true;
      opt.with_train_state = true;
      const ShardedCheckpoint c = fsdp::describe(o.in, opt);
      const auto h = hashes(c);
      CHECK(h.at("optim.state.x.exp_avg") == sha_f32({101, 102, 103}, {3}));
      CHECK(h.at("optim.state.y.exp_avg") == sha_f32({111, 112, 113, 114}, {2, 2}));
      CHECK(h.at("optim.state.blk.w.exp_avg") == sha_f32({121, 122, 123}, {3}));
      CHECK(h.at("optim.state.y.step") == sha_f32({flat ? 5.0F : 2.0F}, {}));
      std::map<std::string, Value> vals;
      for (auto& [k, v] : skeleton_values(c.skeleton)) vals.emplace(k, v);
      CHECK(vals.at("optim.param_groups.0.params.0") == Value("x"));
      if (flat) {
        CHECK(vals.at("optim.param_groups.0.params.1") == Value("y"));
        CHECK(vals.at("optim.param_groups.0.params.2") == Value("blk.w"));
      } else {
        CHECK(vals.at("optim.param_groups.0.params.1") == Value("blk.w"));
        CHECK(vals.at("optim.param_groups.1.params.0") == Value("y"));
        CHECK(vals.at("optim.param_groups.1.weight_decay") == Value(0.0));
      }
      CHECK(vals.count("optim.param_groups.0.param_names.0") == 0);
      CHECK(vals.at("train.global_step") == Value(7));
      CHECK(vals.count("train.rng.torch") == 0);
    }
  }
}

TEST_CASE("fsdp: validation errors name what was expected") {
  auto id = [](const std::function<void(Olmo&)>& mutate, form f = form::infos, bool optim = false) {
    Olmo o(f);
    mutate(o);
    fsdp::options opt;
    opt.with_optimizer = optim;
    return error_of([&] { (void)fsdp::describe(o.in, opt); });
  };
  CHECK(id([](Olmo&) {}) == 0);
  CHECK(id([](Olmo&) {}, form::legacy, true) == 0);
  CHECK(id([](Olmo&) {}, form::aligned, true) == 0);
  // 761: not a model file
  CHECK(id([](Olmo& o) { o.in.model[1].tree = Value(Dict{{"model", 1}}); }) == 761);
  CHECK(id([](Olmo& o) { o.handle(0, 0).erase("flat_param._shapes"); }) == 761);
  CHECK(id([](Olmo& o) { o.handle(1, 0).set("flat_param.data", 3); }) == 761);
  // 762: world sizes
  CHECK(id([](Olmo& o) { o.in.metadata_world_size = 3; }) == 762);
  CHECK(id([](Olmo& o) { o.in.optim.pop_back(); }, form::infos, true) == 762);
  // 763: metadata that does not follow the rule
  CHECK(id([](Olmo& o) {
          o.handle(1, 0).set("flat_param._shard_param_infos", Value::tuple({info(false, 0, 0, 0, 0), info(true, 0, 3, 0, 2)}));
        }) == 763);
  CHECK(id([](Olmo& o) { o.handle(0, 1).set("flat_param._shard_param_offsets", Value::tuple({tup({0, 2})})); }, form::legacy) == 763);
  CHECK(id([](Olmo& o) { o.handle(1, 0).set("flat_param._shard_indices", tup({0, 1})); }, form::legacy) == 763);
  CHECK(id([](Olmo& o) { o.handle(0, 0).set("flat_param._numels", tup({3, 5})); }) == 763);
  CHECK(id([](Olmo& o) { o.handle(0, 0).set("flat_param._numels_with_padding", tup({3, 2, 4})); }) == 763);
  CHECK(id([](Olmo& o) { o.handle(1, 1).set("flat_param._shard_numel_padded", 0); }) == 763);
  CHECK(id([](Olmo& o) { o.handle(0, 0).set("flat_param._fqns", Value::list({Value("x")})); }) == 763);
  // 764: shard size
  CHECK(id([](Olmo& o) { o.handle(1, 1).set("flat_param.data", o.model_arena(1).f32({23, 0, 0})); }) == 764);
  // 765: right padding that is not zero (OLMo's check); alignment padding (42) is fine
  CHECK(id([](Olmo& o) { o.handle(1, 0).set("flat_param.data", o.model_arena(1).f32({12, 13, 14, 9})); }) == 765);
  CHECK(id([](Olmo& o) { o.handle(1, 0).set("flat_param.data", o.model_arena(1).f32({12, 13, 14, -0.0F})); }) == 0);
  // 766: ranks that disagree
  CHECK(id([](Olmo& o) { o.handle(1, 1).set("flat_param._fqns", Value::list({Value("v")})); }) == 766);
  CHECK(id([](Olmo& o) { o.in.model[1].tree.as_dict().at("modules").as_list().pop_back(); }) == 766);
  CHECK(id([](Olmo& o) { o.handle(1, 1).set("flat_param.data", o.model_arena(1).put(std::vector<double>{23, 0}, {2})); }) == 766);
  // 767: not an optimizer state dict
  CHECK(id([](Olmo& o) { o.optim(1).erase("state"); }, form::infos, true) == 767);
  // 768: names the optimizer state cannot be matched to
  CHECK(id([](Olmo& o) {
          for (int r = 0; r < 2; ++r) o.optim(r).at("param_groups").as_list()[1].as_dict().set("param_names", Value::list({Value("z")}));
        },
           form::infos, true) == 768);
  CHECK(id([](Olmo& o) {
          for (int r = 0; r < 2; ++r) o.optim(r).at("param_groups").as_list()[1].as_dict().erase("param_names");
        },
           form::infos, true) == 768);
  CHECK(id([](Olmo& o) { o.optim(1).at("state").as_dict().set(9, Dict{}); }, form::infos, true) == 768);
  // 769: two units naming the same parameter
  CHECK(id([](Olmo& o) {
          for (int r = 0; r < 2; ++r) o.handle(r, 1).set("flat_param._fqns", Value::list({Value("x")}));
          for (int r = 0; r < 2; ++r)
            o.in.model[static_cast<std::size_t>(r)].tree.as_dict().at("modules").as_list()[1].as_dict().set("name", "");
        }) == 769);
  // 770: no names at all (torch 1.13 saved by OLMo's field list)
  CHECK(id([](Olmo& o) {
          for (int r = 0; r < 2; ++r) o.handle(r, 0).erase("flat_param._fqns");
        }) == 770);
  // 771: dtypes
  CHECK(id([](Olmo& o) { o.handle(0, 1).set("flat_param.data", o.model_arena(0).put(std::vector<std::int32_t>{21, 22}, {2})); }) == 771);
  // 772: limits
  {
    Olmo o;
    fsdp::options opt;
    opt.limits.max_ranks = 1;
    CHECK(error_of([&] { (void)fsdp::describe(o.in, opt); }) == 772);
  }
  // 773: options
  {
    Olmo o;
    fsdp::options opt;
    opt.dtype = dtype::I8;
    CHECK(error_of([&] { (void)fsdp::describe(o.in, opt); }) == 773);
  }
  // 774: state on a rank whose shard holds none of the parameter
  CHECK(id([](Olmo& o) {
          o.optim(1).at("state").as_dict().set(0, Dict{{"step", o.optim_arena(1).scalar(2)}, {"exp_avg", o.optim_arena(1).f32({1})}});
        },
           form::infos, true) == 774);
  // 720 / 722 / 724 (optim_shard): step differs, a slice of the wrong size, groups differ
  CHECK(id([](Olmo& o) { o.optim(1).at("state").as_dict().at(2).as_dict().set("step", o.optim_arena(1).scalar(3)); }, form::infos,
           true) == 720);
  CHECK(id([](Olmo& o) { o.optim(1).at("state").as_dict().at(2).as_dict().set("exp_avg", o.optim_arena(1).f32({1, 2})); },
           form::infos, true) == 722);
  CHECK(id([](Olmo& o) { o.optim(1).at("param_groups").as_list()[0].as_dict().set("lr", 0.3); }, form::infos, true) == 724);
}

TEST_CASE("fsdp: detect from content") {
  const fs::path root = fs::path(STATEDICT_TEST_TMP) / "fsdp-detect";
  fs::remove_all(root);
  auto write = [](const fs::path& p, const std::string& s) {
    fs::create_directories(p.parent_path());
    std::ofstream f(p, std::ios::binary);
    f << s;
  };
  fsdp::detection d = fsdp::detect(root / "step9");
  CHECK_FALSE(d.found);
  CHECK(error_of([&] { (void)fsdp::describe(root / "step9"); }) == 760);
  const std::string zip("PK\x03\x04", 4);
  write(root / "step9" / "model" / "rank0.pt", zip);
  write(root / "step9" / "model" / "rank2.pt", zip);
  d = fsdp::detect(root / "step9");
  CHECK_FALSE(d.found);
  CHECK(d.rule.find("no rank1.pt") != std::string::npos);
  write(root / "step9" / "model" / "rank1.pt", "not torch");
  d = fsdp::detect(root / "step9");
  CHECK_FALSE(d.found);
  CHECK(d.rule.find("does not begin like a torch.save file") != std::string::npos);
  write(root / "step9" / "model" / "rank1.pt", zip);
  write(root / "step9" / "optim" / "rank0.pt", zip);
  write(root / "step9" / "metadata.yaml", "# OLMo\nworld_size: 3\n");
  d = fsdp::detect(root / "step9");
  REQUIRE(d.found);
  CHECK(d.world_size == 3);
  CHECK(d.metadata_world_size == std::optional<std::uint64_t>(3));
  CHECK(d.optim_files.size() == 1);
  CHECK(d.rule.find("world_size: 3") != std::string::npos);
  fs::remove_all(root);
}

TEST_CASE("optim_shard: a full state sharded for a layout and consolidated back") {
  // ZeRO-1/2 destination for two groups over 2 ranks: a [2,3] + b [5] (12 padded, 6 per rank),
  // c [4] (2 per rank); step replicated per group.
  std::vector<TensorInfo> full;
  auto add = [&](const std::string& n, shape_t s) { full.push_back(TensorInfo{n, dtype::F32, std::move(s), {}}); };
  for (const char* p : {"a", "b", "c"}) {
    const shape_t s = std::string(p) == "a" ? shape_t{2, 3} : std::string(p) == "b" ? shape_t{5} : shape_t{4};
    add(std::string("optim.state.") + p + ".exp_avg", s);
    add(std::string("optim.state.") + p + ".exp_avg_sq", s);
    add(std::string("optim.state.") + p + ".step", {});
  }
  os::ShardSpec spec;
  spec.kind = os::layout_kind::zero12;
  spec.world = 2;
  spec.groups = {{"a", "b"}, {"c"}};
  const Destination d = os::destination(full, spec);
  CHECK(d.names == std::vector<std::string>{"rank0.exp_avg", "rank1.exp_avg", "rank0.exp_avg_sq", "rank1.exp_avg_sq",
                                            "rank0.step", "rank1.step"});
  CHECK(d.sizes == std::vector<std::uint64_t>{32, 32, 32, 32, 8, 8});
  // b's exp_avg: elements 0..4 on rank 1 at byte 0 (a fills rank 0's 6).
  const TensorInfo* b = nullptr;
  for (const auto& t : d.tensors)
    if (t.name == "optim.state.b.exp_avg") b = &t;
  REQUIRE(b);
  REQUIRE(b->chunks.size() == 1);
  CHECK(b->chunks[0].at.source == 1);
  CHECK(b->chunks[0].at.byte_offset == 0);
  CHECK(std::get<FlatRange>(b->chunks[0].region) == FlatRange{0, 5});

  // Round trip: fill the destination from a full state in memory, then read the rank buffers back
  // as ZeRO-2 optimizer state with merge_state and compare.
  std::vector<float> vals(64);
  std::iota(vals.begin(), vals.end(), 1.0F);
  auto mem = std::make_shared<std::vector<std::byte>>(4096);
  std::size_t off = 0;
  ShardedCheckpoint src;
  src.sources.push_back(std::make_shared<MemorySource>("full", mem->data(), mem->size(), mem));
  std::map<std::string, std::vector<float>> expect;
  std::size_t k = 0;
  for (const auto& t : full) {
    std::vector<float> v(numel(t.shape));
    for (auto& x : v) {
      x = vals[k % vals.size()] + static_cast<float>(k);
      ++k;
    }
    std::memcpy(mem->data() + off, v.data(), v.size() * 4);
    TensorInfo s = t;
    s.chunks.push_back(Chunk{full_box(t.shape), Placement{0, off, {}, dtype::F32}});
    src.tensors.push_back(s);
    expect[t.name] = v;
    off += v.size() * 4;
  }
  const Plan plan = make_plan(src, d);
  std::vector<std::unique_ptr<MemorySink>> sinks;
  std::vector<Sink*> ptrs;
  for (std::size_t i = 0; i < d.names.size(); ++i) {
    sinks.push_back(std::make_unique<MemorySink>(d.names[i], d.sizes[i]));
    ptrs.push_back(sinks.back().get());
  }
  (void)execute(plan, src, ptrs);
  std::vector<std::shared_ptr<std::vector<std::byte>>> bufs;
  for (const auto& sk : sinks) bufs.push_back(std::make_shared<std::vector<std::byte>>(sk->buffer()));

  // The rank buffers as a rank's optimizer state for each group.
  os::SourceTable table;
  std::vector<std::shared_ptr<const ByteSource>> srcs;
  for (std::size_t i = 0; i < bufs.size(); ++i) {
    srcs.push_back(std::make_shared<MemorySource>(d.names[i], bufs[i]->data(), bufs[i]->size(), bufs[i]));
    table.add(srcs.back());
  }
  auto view = [&](std::size_t buf, std::uint64_t first, std::uint64_t n) {
    return TensorView::contiguous(dtype::F32, n ? shape_t{static_cast<dim_t>(n)} : shape_t{}, bufs[buf]->data() + first * 4, bufs[buf]);
  };
  // Per rank r, group g: exp_avg = buffer r elements [6g', ...): group 0 at 0 (6), group 1 at 6 (2).
  std::vector<std::vector<Dict>> st(2, std::vector<Dict>(2));
  for (std::size_t r = 0; r < 2; ++r) {
    st[0][r] = Dict{{"step", view(4 + r, 0, 0)}, {"exp_avg", view(r, 0, 6)}, {"exp_avg_sq", view(2 + r, 0, 6)}};
    st[1][r] = Dict{{"step", view(4 + r, 1, 0)}, {"exp_avg", view(r, 6, 2)}, {"exp_avg_sq", view(2 + r, 6, 2)}};
  }
  os::StateFamilies fams(2, std::vector<std::vector<os::StateSegment>>(2));
  for (std::size_t g = 0; g < 2; ++g)
    for (std::size_t r = 0; r < 2; ++r) fams[g][r].push_back(os::StateSegment{&st[g][r], g == 0 ? 6U : 2U, "rank " + std::to_string(r)});
  const std::uint64_t n0[] = {6, 5}, n1[] = {4};
  const auto p0 = layout::zero12_pieces(n0, 2), p1 = layout::zero12_pieces(n1, 2);
  std::vector<os::ParamState> params{{"a", {2, 3}, 0, p0[0], 0}, {"b", {5}, 0, p0[1], 0}, {"c", {4}, 1, p1[0], 0}};
  ShardedCheckpoint back;
  auto merged = os::merge_state(params, fams, table);
  back.tensors = std::move(merged.tensors);
  back.sources = table.take();
  const auto h = hashes(back);
  for (const auto& [name, v] : expect) {
    const std::string captured_name = name;
    CAPTURE(captured_name);
    const TensorInfo* t = back.find(name);
    if (name.find(".step") != std::string::npos && (name.find(".b.") != std::string::npos)) {
      // b shares group 0's step with a: the destination stores the group's first parameter's.
      CHECK(h.at(name) == sha_f32(expect.at("optim.state.a.step"), {}));
      continue;
    }
    REQUIRE(t);
    CHECK(h.at(name) == sha_f32(v, t->shape));
  }
  // Missing tensors are named.
  spec.groups = {{"a", "zz"}};
  CHECK(error_of([&] { (void)os::destination(full, spec); }) == 723);
}
