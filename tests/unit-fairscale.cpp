// fairscale FSDP rank files on hand-built Value trees: FSDP's chunk rule and the pieces of each
// name, file-family names, both metadata schemas consolidated (flat and non-flattened parameters,
// a pure-padding rank, an expert unit, ties, buffers), the optimizer state keyed by name, and
// metadata errors with their ids.
#include <doctest/doctest.h>

#include <statedict/exec/read.hpp>
#include <statedict/formats/fairscale.hpp>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace statedict;
namespace fd = statedict::fairscale::detail;

namespace {

struct Arena {
  std::shared_ptr<std::vector<std::byte>> buf = std::make_shared<std::vector<std::byte>>(std::size_t{1} << 14);
  std::size_t used = 0;
  std::shared_ptr<const ByteSource> source;
  explicit Arena(std::string name) { source = std::make_shared<MemorySource>(std::move(name), buf->data(), buf->size(), buf); }
  TensorView f32(std::vector<float> v) {
    used = (used + 63) / 64 * 64;
    const std::size_t n = v.size() * 4;
    REQUIRE(used + n <= buf->size());
    if (n) std::memcpy(buf->data() + used, v.data(), n);
    TensorView t = TensorView::contiguous(dtype::F32, shape_t{static_cast<dim_t>(v.size())}, buf->data() + used, buf);
    used += n;
    return t;
  }
};

Value tup(std::initializer_list<std::int64_t> v) {
  List l;
  for (auto x : v) l.emplace_back(x);
  return Value::tuple(std::move(l));
}
Value strs(std::initializer_list<const char*> v) {
  List l;
  for (auto x : v) l.emplace_back(x);
  return Value::list(std::move(l));
}
Value ints(std::initializer_list<std::int64_t> v) {
  List l;
  for (auto x : v) l.emplace_back(x);
  return Value::list(std::move(l));
}

Value flat(Value names, List shapes, Value numels, std::int64_t padding) {
  Dict d;
  d.set("names", std::move(names));
  d.set("shapes", Value::list(std::move(shapes)));
  d.set("numels", std::move(numels));
  d.set("padding", padding);
  return Value(std::move(d));
}

/// Two ranks: root unit (a [2], b [3] flat: 5 elements, rank 1 padded by 1; tie t -> a), unit
/// "layer" (w [2, 2] flat; bias [1] not flattened: rank 1 is pure padding), expert unit "moe"
/// (e [2], whole and different on each rank), buffer "version".
optim_shard::LoadedFile rank_file(std::uint32_t r, Arena& ar, std::int64_t step = 2) {
  Dict model;
  model.set("flat_param_0", r == 0 ? ar.f32({1, 2, 3}) : ar.f32({4, 5, 0}));
  model.set("layer.flat_param_0", r == 0 ? ar.f32({6, 7}) : ar.f32({8, 9}));
  model.set("layer.bias", r == 0 ? ar.f32({10}) : ar.f32({0}));
  model.set("moe.flat_param_0", r == 0 ? ar.f32({11, 12}) : ar.f32({13, 14}));
  model.set("version", ar.f32({3}));
  List units;
  {
    Dict u, params;
    u.set("fsdp_path", "");
    params.set("flat_param_0", flat(strs({"a", "b"}), {tup({2}), tup({3})}, ints({2, 3}), r == 0 ? 0 : 1));
    u.set("params", Value(std::move(params)));
    u.set("no_broadcast_optim_state", false);
    u.set("shared_param_info", Value::list({Value::tuple({Value("a"), Value("t")})}));
    units.emplace_back(std::move(u));
  }
  {
    Dict u, params;
    u.set("fsdp_path", "layer");
    params.set("flat_param_0", flat(strs({"w"}), {tup({2, 2})}, ints({4}), 0));
    params.set("bias", flat(strs({"bias"}), {tup({1})}, ints({1}), r == 0 ? 0 : 1));
    u.set("params", Value(std::move(params)));
    u.set("no_broadcast_optim_state", false);
    u.set("shared_param_info", Value::list());
    units.emplace_back(std::move(u));
  }
  {
    Dict u, params;
    u.set("fsdp_path", "moe");
    params.set("flat_param_0", flat(strs({"e"}), {tup({2})}, ints({2}), 0));
    u.set("params", Value(std::move(params)));
    u.set("no_broadcast_optim_state", true);
    u.set("shared_param_info", Value::list());
    units.emplace_back(std::move(u));
  }
  Dict md;
  md.set("param_metadata", Value::list(std::move(units)));
  md.set("buffer_names", strs({"version"}));
  Dict state;
  auto st = [&](std::vector<float> v) {
    Dict d;
    d.set("step", step);
    d.set("exp_avg", ar.f32(std::move(v)));
    return Value(std::move(d));
  };
  state.set(0, r == 0 ? st({1, 2, 3}) : st({4, 5, 0}));
  state.set(1, r == 0 ? st({6, 7}) : st({8, 9}));
  state.set(2, r == 0 ? st({10}) : st({0}));
  state.set(3, r == 0 ? st({11, 12}) : st({13, 14}));
  Dict group;
  group.set("lr", 0.1);
  group.set("betas", Value::tuple({Value(0.9), Value(0.95)}));
  group.set("params", ints({0, 1, 2, 3}));
  Dict osd;
  osd.set("state", Value(std::move(state)));
  osd.set("param_groups", Value::list({Value(std::move(group))}));
  osd.set("loss_scale", 4.0);
  Dict top;
  top.set("model", Value(std::move(model)));
  top.set("shard_metadata", Value(std::move(md)));
  top.set("last_optimizer_state", Value(std::move(osd)));
  return optim_shard::LoadedFile{"rank" + std::to_string(r), ar.source, Value(std::move(top)), nullptr};
}

std::vector<float> values(const ShardedCheckpoint& ck, const std::string& n) {
  const Tensor t = read_tensor(ck, n);
  std::vector<float> v(static_cast<std::size_t>(t.numel()));
  if (!v.empty()) std::memcpy(v.data(), t.data(), v.size() * 4);
  return v;
}

using statedict_test::error_of;

/// rank files 0 and 1, with `edit` applied to rank `r`'s tree (r = 2: to both)
std::vector<optim_shard::LoadedFile> pair(Arena& ar, std::uint32_t r = 0, const std::function<void(Dict&)>& edit = {}) {
  std::vector<optim_shard::LoadedFile> f{rank_file(0, ar), rank_file(1, ar)};
  if (edit)
    for (std::uint32_t k = 0; k < 2; ++k)
      if (r == k || r == 2) edit(f[k].tree.as_dict());
  return f;
}

Dict& unit(Dict& top, std::size_t u) { return top.at("shard_metadata").as_dict().at("param_metadata").as_list()[u].as_dict(); }

}  // namespace

TEST_CASE("fairscale: FSDP's chunk rule and the pieces of each name") {
  CHECK(fd::chunk_rule(5, 2, 0) == std::make_pair<std::uint64_t, std::uint64_t>(3, 3));
  CHECK(fd::chunk_rule(5, 2, 1) == std::make_pair<std::uint64_t, std::uint64_t>(3, 2));
  CHECK(fd::chunk_rule(4, 3, 2) == std::make_pair<std::uint64_t, std::uint64_t>(2, 0));  // pure padding
  CHECK(fd::chunk_rule(0, 3, 1) == std::make_pair<std::uint64_t, std::uint64_t>(0, 0));
  fd::Backing b;
  b.names = {"a", "b"};
  b.numels = {2, 3};
  b.total = 5;
  const auto p = fd::pieces(b, 1, 2);  // b = flat [2, 5): rank 0 holds [2, 3), rank 1 [3, 5)
  REQUIRE(p.size() == 2);
  CHECK(p[0] == layout::FlatPiece{0, FlatRange{0, 1}, 2});
  CHECK(p[1] == layout::FlatPiece{1, FlatRange{1, 3}, 0});
  b.no_broadcast = true;
  CHECK(fd::pieces(b, 1, 2) == std::vector<layout::FlatPiece>{layout::FlatPiece{0, FlatRange{0, 3}, 2}});
}

TEST_CASE("fairscale: rank file names") {
  CHECK(fd::shard_name("checkpoint_last-shard3.pt") == std::make_pair(std::string("checkpoint_last"), std::uint64_t{3}));
  CHECK(fd::shard_name("checkpoint_last-model_part-0-shard0.pt") ==
        std::make_pair(std::string("checkpoint_last-model_part-0"), std::uint64_t{0}));
  CHECK_FALSE(fd::shard_name("checkpoint_last-rank-1-shard0.pt"));  // an expert file
  CHECK_FALSE(fd::shard_name("checkpoint_last-shard01.pt"));
  CHECK_FALSE(fd::shard_name("checkpoint_last.pt"));
}

TEST_CASE("fairscale: two ranks consolidate into named parameters, ties, experts and buffers") {
  Arena ar("arena");
  const ShardedCheckpoint ck = fairscale::describe(pair(ar));
  CHECK(ck.format == "fairscale_fsdp");
  CHECK(values(ck, "a") == std::vector<float>{1, 2});
  CHECK(values(ck, "b") == std::vector<float>{3, 4, 5});
  CHECK(values(ck, "layer.w") == std::vector<float>{6, 7, 8, 9});
  CHECK(ck.find("layer.w")->shape == shape_t{2, 2});
  CHECK(values(ck, "layer.bias") == std::vector<float>{10});
  CHECK(values(ck, "moe.e") == std::vector<float>{11, 12});  // rank 0's expert
  CHECK(values(ck, "version") == std::vector<float>{3});
  const auto aliases = skeleton_aliases(ck.skeleton.json());
  REQUIRE(aliases.size() == 1);
  CHECK(aliases[0] == std::make_pair(std::string("t"), std::string("a")));
}

TEST_CASE("fairscale: the optimizer state keyed by name, steps and other keys checked on every rank") {
  Arena ar("arena");
  fairscale::options o;
  o.with_optimizer = true;
  const ShardedCheckpoint ck = fairscale::describe(pair(ar), o);
  CHECK(values(ck, "optim.state.a.exp_avg") == std::vector<float>{1, 2});
  CHECK(values(ck, "optim.state.b.exp_avg") == std::vector<float>{3, 4, 5});
  CHECK(values(ck, "optim.state.layer.bias.exp_avg") == std::vector<float>{10});
  CHECK(values(ck, "optim.state.moe.e.exp_avg") == std::vector<float>{11, 12});
  std::map<std::string, Value> vals;
  for (auto& [n, v] : skeleton_values(ck.skeleton)) vals.emplace(n, v);
  CHECK(vals.at("optim.state.a.step") == Value(2));
  CHECK(vals.at("optim.loss_scale") == Value(4.0));
  CHECK(vals.at("optim.param_groups.0.params.0") == Value("a"));
  CHECK(vals.at("optim.param_groups.0.params.1") == Value("b"));
  CHECK(vals.at("optim.param_groups.0.params.4") == Value("moe.e"));
  CHECK(vals.at("optim.param_groups.0.betas.1") == Value(0.95));
  CHECK_FALSE(vals.count("optim.state.t.step"));  // a tied name has no state of its own
  Arena b("b");
  auto files = pair(b, 1, [](Dict& top) {
    top.at("last_optimizer_state").as_dict().at("state").as_dict().at(Key(1)).as_dict().set("step", 3);
  });
  CHECK(error_of([&] { (void)fairscale::describe(std::move(files), o); }) == errors::os_state_differs.id);
}

TEST_CASE("fairscale: metadata errors") {
  fairscale::options o;
  auto bad = [&](const std::function<void(Dict&)>& edit, std::uint32_t r = 1) {
    Arena ar("arena");
    return error_of([&] { (void)fairscale::describe(pair(ar, r, edit), o); });
  };
  CHECK(bad([](Dict& t) { unit(t, 0).erase("fsdp_path"); }, 0) == errors::fairscale_bad_metadata.id);
  CHECK(bad([](Dict& t) { unit(t, 0).erase("params"); }, 0) == errors::fairscale_bad_metadata.id);
  CHECK(bad([](Dict& t) { unit(t, 1).at("params").as_dict().at("flat_param_0").as_dict().set("numels", ints({5})); }, 0) ==
        errors::fairscale_numel.id);
  CHECK(bad([](Dict& t) { unit(t, 1).at("params").as_dict().at("flat_param_0").as_dict().set("padding", 1); }) ==
        errors::fairscale_padding.id);
  CHECK(bad([](Dict& t) { unit(t, 1).set("fsdp_path", "other"); }) == errors::fairscale_ranks_differ.id);
  CHECK(bad([](Dict& t) { t.at("model").as_dict().erase("layer.flat_param_0"); }) == errors::fairscale_missing_key.id);
  CHECK(bad([](Dict& t) { t.erase("shard_metadata"); }) == errors::fairscale_bad_file.id);
  auto tie = [](const char* src, const char* dst) {
    return [=](Dict& t) { unit(t, 0).set("shared_param_info", Value::list({Value::tuple({Value(src), Value(dst)})})); };
  };
  CHECK(bad(tie("zz", "t"), 0) == errors::fairscale_ranks_differ.id);
  CHECK(bad(tie("zz", "t"), 2) == errors::fairscale_bad_tie.id);  // no such source
  CHECK(bad(tie("a", "b"), 2) == errors::fairscale_bad_tie.id);   // the destination is a parameter
  CHECK(bad([](Dict& t) { t.at("model").as_dict().erase("version"); }, 0) == errors::fairscale_missing_key.id);
  CHECK(bad([](Dict& t) { t.at("model").as_dict().set("layer.flat_param_0", Value(1)); }) == errors::fairscale_padding.id);
  o.limits.max_entries = 1;
  CHECK(bad([](Dict&) {}) == errors::fairscale_limit.id);
}

TEST_CASE("fairscale: the 0.3.7 schema (is_flat, flat_param, no ties)") {
  Arena ar("arena");
  std::vector<optim_shard::LoadedFile> files;
  for (std::uint32_t r = 0; r < 2; ++r) {
    Dict model;
    model.set("flat_param", r == 0 ? ar.f32({1, 2, 3}) : ar.f32({4, 5, 0}));
    Dict u;
    u.set("fsdp_path", "");
    u.set("is_flat", true);
    u.set("num_padded", ints({r == 0 ? 0 : 1}));
    u.set("param_names", strs({"a", "b"}));
    u.set("param_shapes", Value::tuple({tup({2}), tup({3})}));
    u.set("param_numels", Value::tuple({Value(2), Value(3)}));
    u.set("no_broadcast_optim_state", false);
    Dict md;
    md.set("param_metadata", Value::list({Value(std::move(u))}));
    md.set("buffer_names", Value::list());
    Dict top;
    top.set("model", Value(std::move(model)));
    top.set("fsdp_metadata", Value(std::move(md)));
    files.push_back(optim_shard::LoadedFile{"rank" + std::to_string(r), ar.source, Value(std::move(top)), nullptr});
  }
  const ShardedCheckpoint ck = fairscale::describe(std::move(files));
  CHECK(ck.format == "fairscale_fsdp_v03");
  CHECK(values(ck, "a") == std::vector<float>{1, 2});
  CHECK(values(ck, "b") == std::vector<float>{3, 4, 5});
  CHECK(ck.metadata.at("fairscale.writer") == "fairseq (fsdp_metadata)");
}
