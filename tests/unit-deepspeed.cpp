// DeepSpeed ZeRO reader on hand-built Value trees: the consolidation rules of stage 1/2 and 3
// (partitions, padding, frozen parameters, buffers, tied names, optimizer state), every validation
// error id with a mutated input, the byte ranges a description touches, and detect().
#include <doctest/doctest.h>

#include <statedict/core/sha256.hpp>
#include <statedict/exec/digest.hpp>
#include <statedict/formats/deepspeed.hpp>
#include <statedict/formats/registry.hpp>
#include <statedict/formats/torch.hpp>
#include <statedict/io/torch_file.hpp>
#include <statedict/shard/views.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace statedict;
namespace ds = statedict::deepspeed;
namespace os = statedict::optim_shard;
namespace fs = std::filesystem;

namespace {

/// Bytes that hand-built tensors live in, exposed as one ByteSource (like a mapped file).
struct Arena {
  std::shared_ptr<std::vector<std::byte>> buf = std::make_shared<std::vector<std::byte>>(std::size_t{1} << 16);
  std::size_t used = 0;
  std::shared_ptr<const ByteSource> source;
  /// Byte ranges [begin, end) of tensors marked as optimizer moments.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> moments;

  explicit Arena(std::string name) { source = std::make_shared<MemorySource>(std::move(name), buf->data(), buf->size(), buf); }

  template <class T>
  TensorView put(const std::vector<T>& v, shape_t shape, bool moment = false, std::optional<dtype> as = std::nullopt) {
    used = (used + 63) / 64 * 64;
    const std::size_t n = v.size() * sizeof(T);
    REQUIRE(used + n <= buf->size());
    if (n) std::memcpy(buf->data() + used, v.data(), n);
    TensorView t = TensorView::contiguous(as.value_or(dtype_of<T>), std::move(shape), buf->data() + used, buf);
    if (moment) moments.emplace_back(used, used + n);
    used += n;
    return t;
  }
  TensorView f32(std::vector<float> v, bool moment = false) {
    const auto n = static_cast<dim_t>(v.size());
    return put(v, {n}, moment);
  }
  TensorView scalar(float v) { return put(std::vector<float>{v}, {}); }
};

std::vector<float> iota(float from, std::size_t n) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), from);
  return v;
}

Value shape_of(std::initializer_list<std::int64_t> dims) {
  List l;
  for (auto d : dims) l.emplace_back(d);
  return Value::tuple(std::move(l));
}

Value stage_enum(int s) {
  Object o{"deepspeed.runtime.zero.config", "ZeroStageEnum", object_build::reduce, {Value(s)}, {}, {}};
  return Value(std::move(o));
}

Value strings(std::initializer_list<const char*> names) {
  List l;
  for (auto n : names) l.emplace_back(n);
  return Value::list(std::move(l));
}

/// The SHA-256 of a row-major F32 tensor holding `v`.
std::string sha_f32(const std::vector<float>& v, shape_t shape) {
  Tensor t = Tensor::from(std::span<const float>(v), std::move(shape));
  return sha256_hex(t.view());
}

std::map<std::string, std::string> hashes(const ShardedCheckpoint& c) {
  auto h = sha256_tensors(c);
  return {h.begin(), h.end()};
}

using statedict_test::error_of;

// ---------------------------------------------------------------------------------------------
// A ZeRO-2 checkpoint over 2 ranks:
//   group 0: a [2,3] = 1..6, b [5] = 11..15   -> 11 elements, padded to 12, partitions of 6
//   group 1: c [4] = 21..24                    -> 4 elements, partitions of 2
//   buffers bn.mean F32 [2], bn.count I64 [] = 7; frozen f [2] F16; head = tied name of a.
// Moments: exp_avg = weight + 100, exp_avg_sq = weight + 1000 (zero on padding); step 2.

struct Zero12 {
  Arena model_arena{"mp_rank_00_model_states.pt"};
  std::vector<std::unique_ptr<Arena>> optim_arenas;
  ds::Inputs in;
  int stage = 2;

  explicit Zero12(int st = 2, bool elastic = false) : stage(st) {
    Dict module;
    module.set("bn.mean", model_arena.f32({0.5F, 1.5F}));
    module.set("bn.count", model_arena.put(std::vector<std::int64_t>{7}, {}));
    module.set("a", model_arena.put(iota(1, 6), {2, 3}));
    module.set("b", model_arena.f32(iota(11, 5)));
    module.set("c", model_arena.f32(iota(21, 4)));
    const std::vector<std::uint16_t> f16{0x3c00, 0x4000};  // 1.0, 2.0
    module.set("f", model_arena.put(f16, {2}, false, dtype::F16));
    module.set("head", module.at("a"));
    Dict shapes0, shapes1, fshapes, frags;
    shapes0.set("a", shape_of({2, 3}));
    shapes0.set("b", shape_of({5}));
    shapes1.set("c", shape_of({4}));
    fshapes.set("f", shape_of({2}));
    frags.set("f", model_arena.put(f16, {2}, false, dtype::F16));
    Dict shared;
    shared.set("head", "a");
    Dict top;
    top.set("module", std::move(module));
    top.set("buffer_names", strings({"bn.mean", "bn.count"}));
    top.set("optimizer", Value());
    top.set("param_shapes", Value::list({Value(std::move(shapes0)), Value(std::move(shapes1))}));
    top.set("frozen_param_shapes", stage >= 2 ? Value(std::move(fshapes)) : Value());
    top.set("shared_params", std::move(shared));
    top.set("frozen_param_fragments", stage >= 2 ? Value(std::move(frags)) : Value());
    top.set("dp_world_size", 2);
    top.set("mp_world_size", 1);
    top.set("ds_version", "0.16.4");
    in.model.push_back(os::LoadedFile{"tag/mp_rank_00_model_states.pt", model_arena.source, Value(std::move(top)), nullptr});

    const std::vector<std::vector<float>> g0 = {iota(1, 6), {11, 12, 13, 14, 15}};
    const std::vector<std::vector<float>> g1 = {{21, 22}, {23, 24}};
    const std::vector<std::int64_t> pad0 = {0, 1}, pad1 = {0, 0};
    for (int r = 0; r < 2; ++r) {
      const std::string name = "tag/zero_pp_rank_" + std::to_string(r) + "_mp_rank_00_optim_states.pt";
      optim_arenas.push_back(std::make_unique<Arena>(name));
      Arena& A = *optim_arenas.back();
      auto plus = [](std::vector<float> v, float d, std::size_t n) {
        for (auto& x : v) x += d;
        v.resize(n, 0.0F);
        return v;
      };
      const auto ur = static_cast<std::size_t>(r);
      Dict osd;
      osd.set("loss_scaler", Value(Object{"deepspeed.runtime.fp16.loss_scaler", "LossScaler", object_build::newobj, {}, {}, {}}));
      osd.set("dynamic_loss_scale", false);
      osd.set("overflow", false);
      osd.set("clip_grad", 0.0);
      if (elastic) {
        List base;
        const std::size_t lean0 = g0[ur].size(), lean1 = g1[ur].size();
        base.emplace_back(Dict{{"step", A.scalar(2)}, {"exp_avg", A.f32(plus(g0[ur], 100, lean0), true)},
                               {"exp_avg_sq", A.f32(plus(g0[ur], 1000, lean0), true)}});
        base.emplace_back(Dict{{"step", A.scalar(2)}, {"exp_avg", A.f32(plus(g1[ur], 100, lean1), true)},
                               {"exp_avg_sq", A.f32(plus(g1[ur], 1000, lean1), true)}});
        osd.set("base_optimizer_state", Value::list(std::move(base)));
      } else {
        Dict state;
        state.set(0, Dict{{"step", A.scalar(2)}, {"exp_avg", A.f32(plus(g0[ur], 100, 6), true)},
                          {"exp_avg_sq", A.f32(plus(g0[ur], 1000, 6), true)}});
        state.set(1, Dict{{"step", A.scalar(2)}, {"exp_avg", A.f32(plus(g1[ur], 100, 2), true)},
                          {"exp_avg_sq", A.f32(plus(g1[ur], 1000, 2), true)}});
        List groups;
        groups.emplace_back(Dict{{"lr", 0.1}, {"betas", Value::tuple({Value(0.9), Value(0.99)})}, {"params", Value::list({Value(0)})}});
        groups.emplace_back(Dict{{"lr", 0.2}, {"betas", Value::tuple({Value(0.9), Value(0.99)})}, {"params", Value::list({Value(1)})}});
        osd.set("base_optimizer_state", Dict{{"state", std::move(state)}, {"param_groups", Value::list(std::move(groups))}});
      }
      osd.set("single_partition_of_fp32_groups", Value::list({Value(A.f32(g0[ur])), Value(A.f32(g1[ur]))}));
      osd.set("zero_stage", stage_enum(stage));
      osd.set("group_paddings", Value::list({Value(pad0[ur]), Value(pad1[ur])}));
      osd.set("partition_count", Value::list({Value(2), Value(2)}));
      osd.set("ds_version", "0.16.4");
      in.optim.push_back(os::LoadedFile{name, A.source, Value(Dict{{"optimizer_state_dict", std::move(osd)}}), nullptr});
    }
    in.tag = "tag";
  }
  Dict& model() { return in.model[0].tree.as_dict(); }
  Dict& osd(int r) { return in.optim[static_cast<std::size_t>(r)].tree.as_dict().at("optimizer_state_dict").as_dict(); }
  ShardedCheckpoint describe(const ds::options& o = {}) const { return ds::describe(in, o); }
};

// ---------------------------------------------------------------------------------------------
// A ZeRO-3 checkpoint over 2 ranks, 3 sub-groups:
//   group 0: a [5] = 1..5 (sub-group 0), b [3] = 11..13 (sub-group 1); group 1: c [2] = 21, 22.
//   pn: a 3, b 2, c 1. Rank 0 flats [1 2 3] [11 12] [21]; rank 1 [4 5 777] [13 777] [22].
//   frozen f [3] = 31..33 in F32: fragments [31 32] and [33 777].

struct Zero3 {
  std::vector<std::unique_ptr<Arena>> model_arenas, optim_arenas;
  ds::Inputs in;

  Zero3() {
    const std::vector<std::vector<std::vector<float>>> flats = {{{1, 2, 3}, {11, 12}, {21}}, {{4, 5, 777}, {13, 777}, {22}}};
    const std::vector<std::vector<float>> frozen = {{31, 32}, {33, 777}};
    for (int r = 0; r < 2; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      const std::string mname = "tag/zero_pp_rank_" + std::to_string(r) + "_mp_rank_00_model_states.pt";
      model_arenas.push_back(std::make_unique<Arena>(mname));
      Arena& M = *model_arenas.back();
      Dict module;
      for (const char* n : {"a", "b", "c", "f"}) module.set(n, M.put(std::vector<float>{}, {0}));
      module.set("scale", M.f32({3.0F}));
      Dict s0, s1, s2, fshapes, frags;
      s0.set("a", shape_of({5}));
      s1.set("b", shape_of({3}));
      s2.set("c", shape_of({2}));
      fshapes.set("f", shape_of({3}));
      frags.set("f", M.f32(frozen[ur]));
      Dict top;
      top.set("module", std::move(module));
      top.set("buffer_names", strings({"scale"}));
      top.set("param_shapes", Value::list({Value(std::move(s0)), Value(std::move(s1)), Value(std::move(s2))}));
      top.set("frozen_param_shapes", std::move(fshapes));
      top.set("shared_params", Dict{});
      top.set("frozen_param_fragments", std::move(frags));
      top.set("dp_world_size", 2);
      in.model.push_back(os::LoadedFile{mname, M.source, Value(std::move(top)), nullptr});

      const std::string oname = "tag/zero_pp_rank_" + std::to_string(r) + "_mp_rank_00_optim_states.pt";
      optim_arenas.push_back(std::make_unique<Arena>(oname));
      Arena& A = *optim_arenas.back();
      List fl;
      Dict state;
      for (std::size_t k = 0; k < 3; ++k) {
        fl.emplace_back(A.f32(flats[ur][k]));
        std::vector<float> m1 = flats[ur][k], m2 = flats[ur][k];
        for (auto& x : m1) x = x == 777 ? 0 : x + 100;
        for (auto& x : m2) x = x == 777 ? 0 : x + 1000;
        state.set(static_cast<std::int64_t>(k), Dict{{"step", A.scalar(3)}, {"exp_avg", A.f32(m1, true)}, {"exp_avg_sq", A.f32(m2, true)}});
      }
      List groups;
      groups.emplace_back(Dict{{"lr", 0.1}, {"params", Value::list({Value(0), Value(1)})}});
      groups.emplace_back(Dict{{"lr", 0.2}, {"params", Value::list({Value(2)})}});
      Dict osd;
      osd.set("zero_stage", Value(Object{"builtins", "getattr", object_build::reduce,
                                         {Value(Object{"deepspeed.runtime.zero.config", "ZeroStageEnum", object_build::global, {}, {}, {}}),
                                          Value("weights")},
                                         {},
                                         {}}));
      osd.set("partition_count", 2);
      osd.set("optimizer_state_dict", Dict{{"state", std::move(state)}, {"param_groups", Value::list(std::move(groups))}});
      osd.set("fp32_flat_groups", Value::list(std::move(fl)));
      in.optim.push_back(os::LoadedFile{oname, A.source, Value(Dict{{"optimizer_state_dict", std::move(osd)}}), nullptr});
    }
    in.tag = "tag";
  }
  Dict& model(int r) { return in.model[static_cast<std::size_t>(r)].tree.as_dict(); }
  Dict& osd(int r) { return in.optim[static_cast<std::size_t>(r)].tree.as_dict().at("optimizer_state_dict").as_dict(); }
};

std::vector<std::string> names_of(const ShardedCheckpoint& c) {
  std::vector<std::string> v;
  for (const auto& t : c.tensors) v.push_back(t.name);
  return v;
}

/// A ByteSource that forwards reads and records them, with no mapping (so every byte the executor
/// touches goes through read()).
class CountingSource final : public ByteSource {
 public:
  explicit CountingSource(std::shared_ptr<const ByteSource> base) : base_(std::move(base)) {}
  [[nodiscard]] const std::string& name() const noexcept override { return base_->name(); }
  [[nodiscard]] std::uint64_t size() const noexcept override { return base_->size(); }
  [[nodiscard]] keep_alive owner() const override { return base_->owner(); }
  void read(std::uint64_t offset, std::span<std::byte> dst) const override {
    {
      std::lock_guard<std::mutex> lock(m_);
      reads_.emplace_back(offset, offset + dst.size());
    }
    base_->read(offset, dst);
  }
  [[nodiscard]] std::vector<std::pair<std::uint64_t, std::uint64_t>> reads() const {
    std::lock_guard<std::mutex> lock(m_);
    return reads_;
  }

 private:
  std::shared_ptr<const ByteSource> base_;
  mutable std::mutex m_;
  mutable std::vector<std::pair<std::uint64_t, std::uint64_t>> reads_;
};

bool intersects(std::uint64_t a0, std::uint64_t a1, std::uint64_t b0, std::uint64_t b1) { return a0 < b1 && b0 < a1; }

}  // namespace

TEST_CASE("deepspeed: natural order and rank names") {
  CHECK(formats::detail::natural_less("zero_pp_rank_2_mp", "zero_pp_rank_10_mp"));
  CHECK_FALSE(formats::detail::natural_less("zero_pp_rank_10_mp", "zero_pp_rank_2_mp"));
  CHECK(formats::detail::natural_less("a", "b"));
  CHECK(formats::detail::natural_less("x1", "x1a"));
  auto rn = ds::detail::parse_rank_name("bf16_zero_pp_rank_12_mp_rank_00_optim_states.pt");
  REQUIRE(rn);
  CHECK(rn->dp == 12);
  CHECK(rn->mp == "00");
  CHECK_FALSE(ds::detail::parse_rank_name("mp_rank_00_model_states.pt"));
}

TEST_CASE("deepspeed: stage 2 consolidates like zero_to_fp32") {
  Zero12 z;
  const ShardedCheckpoint c = z.describe();
  CHECK(c.format == "deepspeed_zero2");
  // zero_to_fp32 order: buffers, frozen, trainable (param_shapes order); tied names as aliases.
  CHECK(names_of(c) == std::vector<std::string>{"bn.mean", "bn.count", "f", "a", "b", "c"});
  CHECK(c.find("bn.count")->dtype == dtype::F32);  // .float()
  CHECK(c.find("f")->dtype == dtype::F16);         // frozen: model dtype, no cast
  CHECK(c.find("a")->dtype == dtype::F32);
  CHECK(c.find("a")->shape == shape_t{2, 3});
  CHECK(c.metadata.at("deepspeed.world_size") == "2");
  CHECK(c.metadata.at("deepspeed.version") == "0.16.4");
  const auto al = skeleton_aliases(c.skeleton);
  REQUIRE(al.size() == 1);
  CHECK(al[0] == std::pair<std::string, std::string>{"head", "a"});

  const auto h = hashes(c);
  CHECK(h.at("a") == sha_f32(iota(1, 6), {2, 3}));
  CHECK(h.at("b") == sha_f32(iota(11, 5), {5}));
  CHECK(h.at("c") == sha_f32(iota(21, 4), {4}));
  CHECK(h.at("bn.mean") == sha_f32({0.5F, 1.5F}, {2}));
  CHECK(h.at("bn.count") == sha_f32({7.0F}, {}));
  // b straddles nothing but c is split over both ranks: two chunks.
  CHECK(c.find("c")->chunks.size() == 2);
  CHECK(c.find("a")->chunks.size() == 1);
}

TEST_CASE("deepspeed: dtype option, stage 1 frozen rules") {
  Zero12 z;
  ds::options o;
  o.dtype = dtype::BF16;
  const ShardedCheckpoint c = z.describe(o);
  for (const auto& t : c.tensors) CHECK(t.dtype == dtype::BF16);
  o.dtype = dtype::I32;
  CHECK(error_of([&] { (void)z.describe(o); }) == 719);

  Zero12 s1(1);
  CHECK(names_of(s1.describe()) == std::vector<std::string>{"bn.mean", "bn.count", "a", "b", "c"});  // zero_to_fp32: no frozen
  ds::options fm;
  fm.frozen_from_module = true;
  const ShardedCheckpoint c1 = s1.describe(fm);
  CHECK(names_of(c1) == std::vector<std::string>{"bn.mean", "bn.count", "f", "a", "b", "c"});
  CHECK(c1.find("f")->dtype == dtype::F16);
  CHECK(hashes(c1).at("f") == hashes(z.describe()).at("f"));
}

TEST_CASE("deepspeed: stage 1/2 optimizer state keyed by name") {
  for (bool elastic : {false, true}) {
    CAPTURE(elastic);
    Zero12 z(2, elastic);
    ds::options o;
    o.with_optimizer = true;
    const ShardedCheckpoint c = z.describe(o);
    const auto h = hashes(c);
    auto plus = [](std::vector<float> v, float d) {
      for (auto& x : v) x += d;
      return v;
    };
    CHECK(h.at("optim.state.a.exp_avg") == sha_f32(plus(iota(1, 6), 100), {2, 3}));
    CHECK(h.at("optim.state.b.exp_avg_sq") == sha_f32(plus(iota(11, 5), 1000), {5}));
    CHECK(h.at("optim.state.c.exp_avg") == sha_f32(plus(iota(21, 4), 100), {4}));
    CHECK(h.at("optim.state.c.step") == sha_f32({2.0F}, {}));
    CHECK(c.find("optim.state.a.step")->shape.empty());
    std::map<std::string, Value> vals;
    for (auto& [k, v] : skeleton_values(c.skeleton)) vals.emplace(k, v);
    CHECK(vals.at("optim.param_groups.0.params.0") == Value("a"));
    CHECK(vals.at("optim.param_groups.0.params.1") == Value("b"));
    CHECK(vals.at("optim.param_groups.1.params.0") == Value("c"));
    CHECK(vals.count("optim.param_groups.0.lr") == (elastic ? 0U : 1U));
    if (!elastic) CHECK(vals.at("optim.param_groups.0.betas.1") == Value(0.99));
  }
}

TEST_CASE("deepspeed: without with_optimizer no moment byte is described or read") {
  for (bool elastic : {false, true}) {
    Zero12 z(2, elastic);
    ShardedCheckpoint c = z.describe();
    // 1. No chunk points into a moment tensor.
    for (const auto& t : c.tensors)
      for (const auto& ch : t.chunks) {
        const auto& src = c.sources[ch.at.source];
        for (const auto& a : z.optim_arenas)
          if (src.get() == a->source.get()) {
            const std::uint64_t n = region_numel(ch.region) * itemsize(ch.at.stored);
            for (const auto& [b, e] : a->moments) CHECK_FALSE(intersects(ch.at.byte_offset, ch.at.byte_offset + n, b, e));
          }
      }
    // 2. Running the plan reads no moment byte (sources without a mapping: every byte is a read()).
    std::vector<std::shared_ptr<CountingSource>> counted;
    for (auto& s : c.sources) {
      counted.push_back(std::make_shared<CountingSource>(s));
      s = counted.back();
    }
    (void)sha256_tensors(c);
    std::uint64_t total = 0;
    for (std::size_t i = 0; i < counted.size(); ++i)
      for (const auto& [b, e] : counted[i]->reads()) {
        total += e - b;
        for (const auto& a : z.optim_arenas)
          if (counted[i]->name() == a->source->name())
            for (const auto& [mb, me] : a->moments) CHECK_FALSE(intersects(b, e, mb, me));
      }
    CHECK(total > 0);
    // With the optimizer, the moments are read.
    ds::options o;
    o.with_optimizer = true;
    ShardedCheckpoint co = z.describe(o);
    bool touched = false;
    for (const auto& t : co.tensors)
      for (const auto& ch : t.chunks)
        for (const auto& a : z.optim_arenas)
          if (co.sources[ch.at.source].get() == a->source.get())
            for (const auto& [b, e] : a->moments) touched = touched || intersects(ch.at.byte_offset, ch.at.byte_offset + 4, b, e);
    CHECK(touched);
  }
}

TEST_CASE("deepspeed: stage 3 partitions, sub-groups, frozen fragments, optimizer") {
  Zero3 z;
  ds::options o;
  o.with_optimizer = true;
  const ShardedCheckpoint c = ds::describe(z.in, o);
  CHECK(c.format == "deepspeed_zero3");
  CHECK(names_of(c) == std::vector<std::string>{"scale", "f", "a", "b", "c", "optim.state.a.step", "optim.state.a.exp_avg",
                                                "optim.state.a.exp_avg_sq", "optim.state.b.step", "optim.state.b.exp_avg",
                                                "optim.state.b.exp_avg_sq", "optim.state.c.step", "optim.state.c.exp_avg",
                                                "optim.state.c.exp_avg_sq"});
  const auto h = hashes(c);
  CHECK(h.at("a") == sha_f32({1, 2, 3, 4, 5}, {5}));
  CHECK(h.at("b") == sha_f32({11, 12, 13}, {3}));
  CHECK(h.at("c") == sha_f32({21, 22}, {2}));
  CHECK(h.at("f") == sha_f32({31, 32, 33}, {3}));
  CHECK(h.at("optim.state.b.exp_avg") == sha_f32({111, 112, 113}, {3}));
  CHECK(h.at("optim.state.a.exp_avg_sq") == sha_f32({1001, 1002, 1003, 1004, 1005}, {5}));
  CHECK(h.at("optim.state.c.step") == sha_f32({3}, {}));
  std::map<std::string, Value> vals;
  for (auto& [k, v] : skeleton_values(c.skeleton)) vals.emplace(k, v);
  CHECK(vals.at("optim.param_groups.0.params.1") == Value("b"));
  CHECK(vals.at("optim.param_groups.1.params.0") == Value("c"));
  CHECK(vals.at("optim.param_groups.1.lr") == Value(0.2));
}

TEST_CASE("deepspeed: a parameter crossing a sub-group boundary is split") {
  // zero_to_fp32 reads the rank's sub-group flats as one concatenation (GatheredTensor), so a
  // parameter may span two of them; here sub-group sizes 2 + 2 hold a's 3-element partition + c's 1.
  Zero3 z;
  for (int r = 0; r < 2; ++r) {
    auto& osd = z.osd(r);
    Arena& A = *z.optim_arenas[static_cast<std::size_t>(r)];
    std::vector<float> all = r == 0 ? std::vector<float>{1, 2, 3, 11, 12, 21} : std::vector<float>{4, 5, 777, 13, 777, 22};
    osd.set("fp32_flat_groups", Value::list({Value(A.f32({all[0], all[1]})), Value(A.f32({all[2], all[3], all[4]})),
                                             Value(A.f32({all[5]}))}));
  }
  const ShardedCheckpoint c = ds::describe(z.in);
  CHECK(c.find("a")->chunks.size() == 3);  // rank 0: 2 + 1 elements; rank 1: 2
  const auto h = hashes(c);
  CHECK(h.at("a") == sha_f32({1, 2, 3, 4, 5}, {5}));
  CHECK(h.at("b") == sha_f32({11, 12, 13}, {3}));
}

TEST_CASE("deepspeed: validation errors name what was expected") {
  auto id2 = [](const std::function<void(Zero12&)>& mutate, ds::options o = {}) {
    Zero12 z;
    mutate(z);
    return error_of([&] { (void)z.describe(o); });
  };
  auto id3 = [](const std::function<void(Zero3&)>& mutate, ds::options o = {}) {
    Zero3 z;
    mutate(z);
    return error_of([&] { (void)ds::describe(z.in, o); });
  };
  ds::options opt;
  opt.with_optimizer = true;

  CHECK(id2([](Zero12&) {}) == 0);
  CHECK(id3([](Zero3&) {}) == 0);
  // 702: not a model-states file
  CHECK(id2([](Zero12& z) { z.model().erase("buffer_names"); }) == 702);
  CHECK(id2([](Zero12& z) { z.model().set("param_shapes", 3); }) == 702);
  CHECK(id2([](Zero12& z) { z.model().erase("shared_params"); }) == 702);
  // 703: not an optim-states file
  CHECK(id2([](Zero12& z) { z.in.optim[1].tree = Value(Dict{{"x", 1}}); }) == 703);
  CHECK(id2([](Zero12& z) { z.osd(0).erase("zero_stage"); }) == 703);
  CHECK(id2([](Zero12& z) { z.osd(0).set("zero_stage", 7); }) == 703);
  CHECK(id2([](Zero12& z) { z.osd(0).set("single_partition_of_fp32_groups", Value::list({Value(1), Value(2)})); }) == 703);
  // 704: stages differ
  CHECK(id2([](Zero12& z) { z.osd(1).set("zero_stage", stage_enum(1)); }) == 704);
  // 705: file counts
  CHECK(id2([](Zero12& z) { z.in.optim.pop_back(); }) == 705);
  CHECK(id2([](Zero12& z) { z.in.model.push_back(z.in.model[0]); }) == 705);
  CHECK(id3([](Zero3& z) { z.in.model.pop_back(); }) == 705);
  // 706: rank order
  CHECK(id2([](Zero12& z) { std::swap(z.in.optim[0].name, z.in.optim[1].name); }) == 706);
  CHECK(id3([](Zero3& z) { std::swap(z.in.model[0].name, z.in.model[1].name); }) == 706);
  // 707: partition sizes against the layout rule
  CHECK(id2([](Zero12& z) {
          auto& l = z.osd(1).at("single_partition_of_fp32_groups").as_list();
          l[0] = Value(z.optim_arenas[1]->f32({11, 12, 13, 14}));  // 4 < the 5 real elements
        }) == 707);
  CHECK(id2([](Zero12& z) { z.osd(1).at("group_paddings").as_list()[0] = Value(0); }) == 707);
  CHECK(id3([](Zero3& z) { z.osd(1).at("fp32_flat_groups").as_list()[2] = Value(z.optim_arenas[1]->f32({22, 0})); }) == 707);
  CHECK(id3([](Zero3& z) {
          for (int r = 0; r < 2; ++r)
            z.osd(r).at("fp32_flat_groups").as_list().push_back(Value(z.optim_arenas[static_cast<std::size_t>(r)]->f32({0})));
        }) == 707);
  // 708: group counts
  CHECK(id2([](Zero12& z) { z.osd(0).at("single_partition_of_fp32_groups").as_list().pop_back(); }) == 708);
  CHECK(id3([](Zero3& z) { z.osd(1).at("fp32_flat_groups").as_list().pop_back(); }) == 708);
  // 709: mixture of experts
  CHECK(id2([](Zero12& z) {
          for (int r = 0; r < 2; ++r) z.osd(r).set("partition_count", Value::list({Value(2), Value(1)}));
        }) == 709);
  CHECK(id2([](Zero12& z) { z.in.expert_files.push_back("tag/layer_0_expert_0_mp_rank_00_model_states.pt"); }) == 709);
  CHECK(id2([](Zero12& z) {
          z.model().erase("param_shapes");
          z.model().set("num_experts", Value::list({Value(2)}));
        }) == 709);
  // 710: model parallel
  CHECK(id2([](Zero12& z) { z.model().set("mp_world_size", 2); }) == 710);
  CHECK(id2([](Zero12& z) {
          z.in.optim[0].name = "tag/zero_pp_rank_0_mp_rank_01_optim_states.pt";
          z.in.optim[1].name = "tag/zero_pp_rank_1_mp_rank_01_optim_states.pt";
        }) == 710);
  // 711: frozen parameters
  CHECK(id2([](Zero12& z) { z.model().set("frozen_param_fragments", Dict{}); }) == 711);
  CHECK(id2([](Zero12& z) { z.model().at("frozen_param_shapes").as_dict().set("f", shape_of({3})); }) == 711);
  CHECK(id3([](Zero3& z) { z.model(1).at("frozen_param_fragments").as_dict().set("f", z.model_arenas[1]->f32({33})); }) == 711);
  // 712: buffers
  CHECK(id2([](Zero12& z) { z.model().set("buffer_names", strings({"bn.mean", "bn.gone"})); }) == 712);
  CHECK(id2([](Zero12& z) { z.model().at("module").as_dict().set("bn.mean", "text"); }) == 712);
  // 713: a tied name that is also a tensor
  CHECK(id2([](Zero12& z) { z.model().at("shared_params").as_dict().set("bn.mean", "a"); }) == 713);
  // 714: dtypes
  CHECK(id2([](Zero12& z) {
          z.osd(0).at("single_partition_of_fp32_groups").as_list()[1] = Value(z.optim_arenas[0]->put(std::vector<std::int32_t>{1, 2}, {2}));
        }) == 714);
  CHECK(id2([](Zero12& z) {
          z.osd(1).at("single_partition_of_fp32_groups").as_list()[1] =
              Value(z.optim_arenas[1]->put(std::vector<double>{23, 24}, {2}));
        }) == 714);
  // 715: the same name twice
  CHECK(id2([](Zero12& z) {
          z.model().at("frozen_param_shapes").as_dict().set("c", shape_of({4}));
          z.model().at("frozen_param_fragments").as_dict().set("c", z.model_arena.f32(iota(21, 4)));
        }) == 715);
  // 716: world sizes disagree
  CHECK(id2([](Zero12& z) { z.model().set("dp_world_size", 4); }) == 716);
  CHECK(id2([](Zero12& z) { z.osd(1).set("partition_count", Value::list({Value(2), Value(2), Value(2)})); }) == 716);
  // 717: optimizer state structure (only read with with_optimizer)
  CHECK(id2([](Zero12& z) { z.osd(1).erase("base_optimizer_state"); }) == 0);
  CHECK(id2([](Zero12& z) { z.osd(1).erase("base_optimizer_state"); }, opt) == 717);
  CHECK(id3([](Zero3& z) { z.osd(0).at("optimizer_state_dict").as_dict().at("param_groups").as_list().pop_back(); }, opt) == 717);
  // 718: limits
  {
    ds::options lim;
    lim.limits.max_ranks = 1;
    CHECK(id2([](Zero12&) {}, lim) == 718);
    lim = {};
    lim.limits.max_converted_buffer_bytes = 2;
    CHECK(id2([](Zero12&) {}, lim) == 718);
  }
  // 720: constant state differs across ranks
  CHECK(id2([](Zero12& z) {
          z.osd(1).at("base_optimizer_state").as_dict().at("state").as_dict().at(0).as_dict().set("step", z.optim_arenas[1]->scalar(3));
        },
            opt) == 720);
  // 721: a state entry of the wrong kind
  CHECK(id2([](Zero12& z) {
          z.osd(1).at("base_optimizer_state").as_dict().at("state").as_dict().at(0).as_dict().set("exp_avg", "x");
        },
            opt) == 721);
  // 722: a moment shorter than its partition
  CHECK(id2([](Zero12& z) {
          z.osd(1).at("base_optimizer_state").as_dict().at("state").as_dict().at(1).as_dict().set("exp_avg",
                                                                                                  z.optim_arenas[1]->f32({1}));
        },
            opt) == 722);
  // 724: param groups differ across ranks
  CHECK(id2([](Zero12& z) {
          z.osd(1).at("base_optimizer_state").as_dict().at("param_groups").as_list()[0].as_dict().set("lr", 0.5);
        },
            opt) == 724);
}

TEST_CASE("deepspeed: detect from content") {
  const fs::path root = fs::path(STATEDICT_TEST_TMP) / "deepspeed-detect";
  fs::remove_all(root);
  fs::create_directories(root / "global_step5");
  auto write = [](const fs::path& p, const std::string& s) {
    std::ofstream f(p, std::ios::binary);
    f << s;
  };
  ds::detection d = ds::detect(root);
  CHECK_FALSE(d.found);
  CHECK(d.rule.find("no 'latest' file") != std::string::npos);
  CHECK(error_of([&] { (void)ds::describe(root); }) == 700);

  write(root / "latest", "global_step5\n");
  d = ds::detect(root);
  CHECK_FALSE(d.found);
  CHECK(d.rule.find("0 *_model_states.pt") != std::string::npos);
  write(root / "global_step5" / "mp_rank_00_model_states.pt", std::string("PK\x03\x04", 4) + "rest");
  write(root / "global_step5" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", std::string("PK\x03\x04", 4));
  // A legacy file begins with torch's magic number pickled alone (PROTO 2, LONG1 of 10 bytes, STOP).
  write(root / "global_step5" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        std::string("\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.", 15));
  d = ds::detect(root);
  REQUIRE(d.found);
  CHECK(d.tag == "global_step5");
  CHECK(d.rule.find("'latest' names tag 'global_step5'") != std::string::npos);
  REQUIRE(d.optim_files.size() == 2);
  CHECK(d.optim_files[0].filename() == "zero_pp_rank_0_mp_rank_00_optim_states.pt");
  // The tag folder itself.
  d = ds::detect(root / "global_step5");
  CHECK(d.found);
  CHECK(d.rule.find("tag folder") != std::string::npos);
  // Not torch files: not detected.
  write(root / "global_step5" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", "text");
  d = ds::detect(root);
  CHECK_FALSE(d.found);
  CHECK(d.rule.find("does not begin like a torch.save file") != std::string::npos);
  // 701: a latest that cannot name a folder.
  write(root / "latest", "../etc");
  CHECK(error_of([&] { (void)ds::detect(root); }) == 701);
  write(root / "latest", "");
  CHECK(error_of([&] { (void)ds::detect(root); }) == 701);
  CHECK(error_of([&] { (void)ds::detect(root, "a/b"); }) == 701);
  fs::remove_all(root);
}

namespace {

/// A consolidated checkpoint with its optimizer state keyed by name, as any reader gives one
/// (a torch.save file of {model..., optim: {state, param_groups}}), described from memory.
ShardedCheckpoint named_optimizer_state(const std::function<void(Dict& root)>& edit = {}) {
  static std::vector<Tensor> keep;
  auto t = [](std::vector<float> v, shape_t s) {
    keep.push_back(Tensor::from<float>(v, s));
    return Value(keep.back().view());
  };
  Dict root;
  root.set("w", t({1, 2, 3, 4, 5, 6, 7}, {7}));
  root.set("b", t({0.5F, -1.5F}, {2}));
  Dict state;
  for (const char* n : {"w", "b"}) {
    const std::size_t k = std::string(n) == "w" ? 7 : 2;
    std::vector<float> m(k), v(k);
    for (std::size_t i = 0; i < k; ++i) {
      m[i] = 0.1F * static_cast<float>(i + 1);
      v[i] = 0.01F * static_cast<float>(i + 3);
    }
    state.set(n, Dict{{"step", t({3.0F}, {})}, {"exp_avg", t(m, {static_cast<dim_t>(k)})}, {"exp_avg_sq", t(v, {static_cast<dim_t>(k)})}});
  }
  Dict group{{"lr", 0.01}, {"betas", Value::tuple(List{Value(0.9), Value(0.95)})}, {"params", Value::list(List{Value("w"), Value("b")})}};
  root.set("optim", Dict{{"state", state}, {"param_groups", Value::list(List{Value(group)})}});
  if (edit) edit(root);
  FlatStateDict f = flatten(Value(root));
  ShardedCheckpoint ck = describe_views(f.tensors);
  ck.skeleton = f.skeleton;
  return ck;
}

}  // namespace

TEST_CASE("deepspeed write: a checkpoint with named optimizer state, from any reader, as ZeRO 1, 2 and 3 for 1 to 5 ranks") {
  const ShardedCheckpoint ck = named_optimizer_state();
  const auto want = sha256_tensors(ck);
  for (int stage : {1, 2, 3})
    for (std::uint32_t M : {1U, 2U, 3U, 5U}) {
      CAPTURE(stage);
      CAPTURE(M);
      const fs::path out = fs::path(STATEDICT_TEST_TMP) / ("ds-write-tree-" + std::to_string(stage) + "-" + std::to_string(M));
      ds::write_options w;
      w.world_size = M;
      w.zero_stage = stage;
      (void)ds::write(ck, out, w);
      ds::options o;
      o.with_optimizer = true;
      o.frozen_from_module = true;
      const ShardedCheckpoint back = ds::describe(out, o);
      CHECK(back.format == "deepspeed_zero" + std::to_string(stage));
      CHECK(back.metadata.at("deepspeed.world_size") == std::to_string(M));
      const auto got = sha256_tensors(back);
      CHECK(std::map<std::string, std::string>(got.begin(), got.end()) == std::map<std::string, std::string>(want.begin(), want.end()));
    }
}

TEST_CASE("deepspeed write: non-tensor optimizer state (an int step of torch < 1.12) is carried as the group's value") {
  const ShardedCheckpoint ck = named_optimizer_state([](Dict& r) {
    auto& st = r.at(Key(std::string("optim"))).as_dict().at(Key(std::string("state"))).as_dict();
    for (const char* n : {"w", "b"}) st.at(Key(std::string(n))).as_dict().set("step", 7);
  });
  for (int stage : {2, 3}) {
    CAPTURE(stage);
    const fs::path out = fs::path(STATEDICT_TEST_TMP) / ("ds-write-intstep-" + std::to_string(stage));
    ds::write_options w;
    w.world_size = 2;
    w.zero_stage = stage;
    (void)ds::write(ck, out, w);
    const Value optim = torch::load(out / "global_step0" / "zero_pp_rank_1_mp_rank_00_optim_states.pt");
    const Dict& osd = optim.as_dict().at(Key(std::string("optimizer_state_dict"))).as_dict();
    const Dict& sd = (stage == 3 ? osd.at(Key(std::string("optimizer_state_dict"))) : osd.at(Key(std::string("base_optimizer_state")))).as_dict();
    CHECK(sd.at(Key(std::string("state"))).as_dict().at(Key(std::int64_t{0})).as_dict().at(Key(std::string("step"))) == Value(7));
  }
  // Different values in one group cannot share a flat partition.
  const ShardedCheckpoint bad = named_optimizer_state([](Dict& r) {
    auto& st = r.at(Key(std::string("optim"))).as_dict().at(Key(std::string("state"))).as_dict();
    st.at(Key(std::string("w"))).as_dict().set("step", 7);
    st.at(Key(std::string("b"))).as_dict().set("step", 8);
  });
  ds::write_options w;
  w.world_size = 2;
  w.zero_stage = 2;
  CHECK(error_of([&] { (void)ds::write(bad, fs::path(STATEDICT_TEST_TMP) / "ds-write-intstep-bad", w); }) == 725);
}

TEST_CASE("deepspeed write: what it cannot write is refused before a file appears") {
  const fs::path out = fs::path(STATEDICT_TEST_TMP) / "ds-write-refused";
  fs::remove_all(out);
  ds::write_options w;
  w.world_size = 2;
  // No stage: the input is not a DeepSpeed checkpoint that names one.
  CHECK(error_of([&] { (void)ds::write(named_optimizer_state(), out, w); }) == 726);
  w.zero_stage = 2;
  // No optimizer state.
  CHECK(error_of([&] { (void)ds::write(named_optimizer_state([](Dict& r) { r.erase(Key(std::string("optim"))); }), out, w); }) == 725);
  // A group naming a tensor the checkpoint lacks.
  CHECK(error_of([&] {
          (void)ds::write(named_optimizer_state([](Dict& r) {
                            r.at(Key(std::string("optim"))).as_dict().at(Key(std::string("param_groups"))).as_list()[0].as_dict().set("params", Value::list(List{Value("w"), Value("nope")}));
                          }),
                          out, w);
        }) == 725);
  // Parameters of one group with different state keys (one flat partition holds one set).
  CHECK(error_of([&] {
          (void)ds::write(named_optimizer_state([](Dict& r) {
                            r.at(Key(std::string("optim"))).as_dict().at(Key(std::string("state"))).as_dict().at(Key(std::string("b"))).as_dict().erase(Key(std::string("exp_avg_sq")));
                          }),
                          out, w);
        }) == 725);
  // Element-wise state of another shape than its parameter.
  CHECK(error_of([&] {
          (void)ds::write(named_optimizer_state([](Dict& r) {
                            static const Tensor odd = Tensor::from<float>({1, 2, 3}, {3});
                            r.at(Key(std::string("optim"))).as_dict().at(Key(std::string("state"))).as_dict().at(Key(std::string("b"))).as_dict().set("exp_avg", Value(odd.view()));
                          }),
                          out, w);
        }) == 725);
  // A world size of 0, a stage of 4.
  ds::write_options bad = w;
  bad.world_size = 0;
  CHECK(error_of([&] { (void)ds::write(named_optimizer_state(), out, bad); }) == 726);
  bad = w;
  bad.zero_stage = 4;
  CHECK(error_of([&] { (void)ds::write(named_optimizer_state(), out, bad); }) == 726);
  // A universal checkpoint names a folder after each parameter: "a/b" cannot be one.
  ds::write_options u = w;
  u.universal = true;
  CHECK(error_of([&] {
          (void)ds::write(named_optimizer_state([](Dict& r) {
                            r.set("a/b", r.at(Key(std::string("b"))));
                            r.erase(Key(std::string("b")));
                            auto& o = r.at(Key(std::string("optim"))).as_dict();
                            o.at(Key(std::string("param_groups"))).as_list()[0].as_dict().set("params", Value::list(List{Value("w"), Value("a/b")}));
                            auto& st = o.at(Key(std::string("state"))).as_dict();
                            st.set("a/b", st.at(Key(std::string("b"))));
                            st.erase(Key(std::string("b")));
                          }),
                          out, u);
        }) == 725);
  CHECK_FALSE(fs::exists(out));
}

TEST_CASE("deepspeed write: --fresh-optimizer specs are read, or refused naming the part that is wrong") {
  ds::fresh_optimizer f = ds::parse_fresh_optimizer("adamw");
  CHECK(f.type == ds::fresh_optimizer::kind::adamw);
  CHECK(f.lr == 1e-3);
  CHECK(f.beta1 == 0.9);
  CHECK(f.beta2 == 0.999);
  CHECK(f.eps == 1e-8);
  CHECK_FALSE(f.weight_decay.has_value());
  f = ds::parse_fresh_optimizer("adam:lr=3e-4,betas=0.8/0.99,eps=1e-6,weight_decay=0,amsgrad=true,maximize=false");
  CHECK(f.type == ds::fresh_optimizer::kind::adam);
  CHECK(f.lr == 3e-4);
  CHECK(f.beta1 == 0.8);
  CHECK(f.beta2 == 0.99);
  CHECK(f.eps == 1e-6);
  CHECK(f.weight_decay == std::optional<double>(0.0));
  CHECK(f.amsgrad);
  CHECK_FALSE(f.maximize);
  for (const char* bad : {"sgd:lr=0.1", "", "AdamW", "adamw:", "adamw:lr", "adamw:=1", "adamw:lr=", "adamw:lr=x", "adamw:lr=1e-3x",
                          "adamw:lr=-1", "adamw:lr=inf", "adamw:lr=nan", "adamw:lr=1,lr=2", "adamw:betas=0.9", "adamw:betas=0.9/1",
                          "adamw:betas=0.9/0.999/0.5", "adamw:momentum=0.9", "adamw:amsgrad=1", "adamw:lr=1e-3,", "adamw:eps=1e-8;"}) {
    const std::string spec = bad;
    CAPTURE(spec);
    std::string what;
    CHECK(error_of([&] { (void)ds::parse_fresh_optimizer(bad); }, &what) == 727);
    CHECK(what.find("--fresh-optimizer") != std::string::npos);
  }
}

namespace {

/// A weights-only tree: what a torch model file or a Hugging Face folder holds.
ShardedCheckpoint weights_only(dtype d = dtype::F32) {
  static std::vector<Tensor> keep;
  auto t = [&](std::vector<float> v, shape_t s) {
    Tensor x = Tensor::from<float>(v, s);
    if (d == dtype::BF16) {
      x = Tensor(dtype::BF16, s);
      for (std::size_t i = 0; i < v.size(); ++i) {
        std::uint32_t u = 0;
        std::memcpy(&u, &v[i], 4);
        const auto h = static_cast<std::uint16_t>(u >> 16);  // exact: every value here fits in bf16
        std::memcpy(x.data() + 2 * i, &h, 2);
      }
    }
    keep.push_back(std::move(x));
    return Value(keep.back().view());
  };
  Dict root;
  root.set("w", t({1, 2, 3, 4, 5, 6, 7}, {7}));
  root.set("b", t({0.5F, -1.5F}, {2}));
  root.set("frozen.w", t({2, 4, 8}, {3}));
  root.set("pos", t({0.25F, 0.75F}, {2}));
  static const Tensor ids = Tensor::from<std::int64_t>({3, 1, 2}, {3});
  root.set("ids", Value(ids.view()));
  root.set("tied", root.at(Key(std::string("w"))));
  FlatStateDict f = flatten(Value(root));
  ShardedCheckpoint ck = describe_views(f.tensors);
  ck.skeleton = f.skeleton;
  return ck;
}

ds::write_options fresh_options(int stage, std::uint32_t M) {
  ds::write_options w;
  w.world_size = M;
  w.zero_stage = stage;
  w.fresh = ds::parse_fresh_optimizer("adamw:lr=2e-3,betas=0.9/0.95,eps=1e-6,weight_decay=0.05");
  w.fresh->frozen = {"frozen\\..*"};
  w.fresh->buffers = {"pos"};
  return w;
}

}  // namespace

TEST_CASE("deepspeed write: weights only, with a fresh optimizer, as the engine saves it before its first step") {
  const ShardedCheckpoint ck = weights_only();
  const auto want_sha = sha256_tensors(ck);
  const std::map<std::string, std::string> want(want_sha.begin(), want_sha.end());
  for (int stage : {1, 2, 3})
    for (std::uint32_t M : {1U, 2U, 3U}) {
      CAPTURE(stage);
      CAPTURE(M);
      const fs::path out = fs::path(STATEDICT_TEST_TMP) / ("ds-write-fresh-" + std::to_string(stage) + "-" + std::to_string(M));
      (void)ds::write(ck, out, fresh_options(stage, M));
      std::ifstream latest(out / "latest");
      CHECK(std::string(std::istreambuf_iterator<char>(latest), std::istreambuf_iterator<char>()) == "global_step0");
      // Read back: the same weights (masters, frozen, buffers, the tie), no optimizer state, one group.
      ds::options o;
      o.with_optimizer = true;
      o.frozen_from_module = true;
      const ShardedCheckpoint back = ds::describe(out, o);
      const auto got = sha256_tensors(back);
      std::map<std::string, std::string> gm(got.begin(), got.end());
      // The integer buffer is read back as zero_to_fp32 gives it (.float()); it is saved as I64.
      for (const auto& kv : want)
        if (kv.first != "ids") CHECK_MESSAGE(gm[kv.first] == kv.second, kv.first);
      CHECK(gm.size() == want.size());
      REQUIRE(back.find("ids") != nullptr);
      CHECK(back.find("ids")->converted_from == std::optional<dtype>(dtype::I64));
      std::map<std::string, Value> values;
      for (auto& [k, v] : skeleton_values(back.skeleton)) values.emplace(k, v);
      CHECK(values.at("optim.param_groups.0.lr") == Value(2e-3));
      CHECK(values.at("optim.param_groups.0.weight_decay") == Value(0.05));
      CHECK(values.at("optim.param_groups.0.params.0") == Value("w"));
      CHECK(values.at("optim.param_groups.0.params.1") == Value("b"));
      CHECK(values.count("optim.param_groups.0.params.2") == 0);
      // The files: an empty torch state, torch's param group, the buffers named.
      const Value of = torch::load(out / "global_step0" / "zero_pp_rank_0_mp_rank_00_optim_states.pt");
      const Dict& osd = of.as_dict().at(Key(std::string("optimizer_state_dict"))).as_dict();
      const Dict& tsd = osd.at(Key(std::string(stage == 3 ? "optimizer_state_dict" : "base_optimizer_state"))).as_dict();
      CHECK(tsd.at(Key(std::string("state"))).as_dict().size() == 0);
      const Dict& g = tsd.at(Key(std::string("param_groups"))).as_list().at(0).as_dict();
      std::vector<std::string> keys;
      for (const auto& [k, v] : g) keys.push_back(k.str());
      CHECK(keys == std::vector<std::string>{"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                                             "differentiable", "fused", "decoupled_weight_decay", "params"});
      CHECK(g.at(Key(std::string("betas"))) == Value::tuple(List{Value(0.9), Value(0.95)}));
      CHECK(g.at(Key(std::string("decoupled_weight_decay"))) == Value(true));
      CHECK(g.at(Key(std::string("foreach"))).is_none());
      const std::string model = stage == 3 ? "zero_pp_rank_0_mp_rank_00_model_states.pt" : "mp_rank_00_model_states.pt";
      const Value mf = torch::load(out / "global_step0" / model);
      CHECK(mf.as_dict().at(Key(std::string("buffer_names"))) == Value::list(List{Value("pos"), Value("ids")}));
      CHECK(mf.as_dict().at(Key(std::string("global_steps"))) == Value(0));
      CHECK(mf.as_dict().at(Key(std::string("shared_params"))) == Value(Dict{{"tied", "w"}}));
      std::vector<std::string> module;
      for (const auto& [k, v] : mf.as_dict().at(Key(std::string("module"))).as_dict()) module.push_back(k.str());
      CHECK(module == std::vector<std::string>{"w", "b", "frozen.w", "pos", "ids", "tied"});
    }
  // Adam's defaults where the spec leaves them: weight_decay the integer 0, no decoupled decay.
  ds::write_options w = fresh_options(2, 2);
  w.fresh = ds::parse_fresh_optimizer("adam:lr=0.1");
  w.fresh->frozen = {"frozen\\..*"};
  w.fresh->buffers = {"pos"};
  const fs::path out = fs::path(STATEDICT_TEST_TMP) / "ds-write-fresh-adam";
  (void)ds::write(ck, out, w);
  const Value of = torch::load(out / "global_step0" / "zero_pp_rank_1_mp_rank_00_optim_states.pt");
  const Dict& g = of.as_dict().at(Key(std::string("optimizer_state_dict"))).as_dict().at(Key(std::string("base_optimizer_state"))).as_dict().at(Key(std::string("param_groups"))).as_list().at(0).as_dict();
  CHECK(g.at(Key(std::string("weight_decay"))) == Value(0));
  CHECK(g.at(Key(std::string("decoupled_weight_decay"))) == Value(false));
  CHECK(g.at(Key(std::string("betas"))) == Value::tuple(List{Value(0.9), Value(0.999)}));
}

TEST_CASE("deepspeed write: a bf16 input starts a bf16 engine: bf16_ files, a bf16 module, fp32 masters equal to the weights") {
  const ShardedCheckpoint ck = weights_only(dtype::BF16);
  const fs::path out = fs::path(STATEDICT_TEST_TMP) / "ds-write-fresh-bf16";
  (void)ds::write(ck, out, fresh_options(2, 2));
  CHECK(fs::exists(out / "global_step0" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"));
  const Value of = torch::load(out / "global_step0" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt");
  const TensorView part = of.as_dict().at(Key(std::string("optimizer_state_dict"))).as_dict().at(Key(std::string("single_partition_of_fp32_groups"))).as_list().at(0).as_tensor();
  CHECK(part.dtype() == dtype::F32);
  REQUIRE(part.numel() == 6);  // 9 trained elements padded to a multiple of 2·M, 6 per rank
  std::vector<float> v(6);
  std::memcpy(v.data(), part.data(), 24);
  CHECK(v == std::vector<float>{1, 2, 3, 4, 5, 6});
  const Value mf = torch::load(out / "global_step0" / "mp_rank_00_model_states.pt");
  const Dict& module = mf.as_dict().at(Key(std::string("module"))).as_dict();
  CHECK(module.at(Key(std::string("w"))).as_tensor().dtype() == dtype::BF16);
  CHECK(module.at(Key(std::string("pos"))).as_tensor().dtype() == dtype::BF16);
  CHECK(module.at(Key(std::string("ids"))).as_tensor().dtype() == dtype::I64);
}

TEST_CASE("deepspeed write: a fresh optimizer is refused where it cannot be what the user meant, before a file appears") {
  const fs::path out = fs::path(STATEDICT_TEST_TMP) / "ds-write-fresh-refused";
  fs::remove_all(out);
  std::string what;
  // Weights only, no fresh optimizer asked for: refused, saying how to ask.
  ds::write_options w = fresh_options(2, 2);
  w.fresh.reset();
  CHECK(error_of([&] { (void)ds::write(weights_only(), out, w); }, &what) == 725);
  CHECK(what.find("--fresh-optimizer") != std::string::npos);
  // An input with optimizer state: it is written as it is, not replaced.
  CHECK(error_of([&] { (void)ds::write(named_optimizer_state(), out, fresh_options(2, 2)); }, &what) == 726);
  // A pattern that matches nothing (a typo would otherwise train a frozen layer).
  w = fresh_options(2, 2);
  w.fresh->frozen.push_back("frozn\\..*");
  CHECK(error_of([&] { (void)ds::write(weights_only(), out, w); }, &what) == 726);
  CHECK(what.find("frozn") != std::string::npos);
  // Frozen and a buffer at once; an integer tensor frozen.
  w = fresh_options(2, 2);
  w.fresh->buffers.push_back("frozen\\.w");
  CHECK(error_of([&] { (void)ds::write(weights_only(), out, w); }) == 726);
  w = fresh_options(2, 2);
  w.fresh->frozen.push_back("ids");
  CHECK(error_of([&] { (void)ds::write(weights_only(), out, w); }) == 726);
  // Nothing left to train.
  w = fresh_options(2, 2);
  w.fresh->frozen = {"w|b|frozen\\.w"};
  CHECK(error_of([&] { (void)ds::write(weights_only(), out, w); }) == 725);
  // The universal layout (ds_to_universal.py's of a trained state) is not written for one.
  w = fresh_options(2, 2);
  w.universal = true;
  CHECK(error_of([&] { (void)ds::write(weights_only(), out, w); }, &what) == 726);
  CHECK(what.find("--to deepspeed") != std::string::npos);
  // A bad regular expression.
  w = fresh_options(2, 2);
  w.fresh->buffers = {"pos("};
  CHECK(error_of([&] { (void)ds::write(weights_only(), out, w); }) == errors::bad_regex.id);
  CHECK_FALSE(fs::exists(out));
}

TEST_CASE("deepspeed: at stage 3, rank files beyond the first are parsed only when needed or asked for") {
  // Every ZeRO-3 rank writes a model-states file repeating rank 0's param_shapes. Describing
  // parses rank 0's; the others only for what they alone hold (frozen fragments) or when
  // check_rank_files asks for the repeated metadata to be compared.
  const ShardedCheckpoint ck = named_optimizer_state();
  const fs::path out = fs::path(STATEDICT_TEST_TMP) / "ds-lazy-rank-files";
  fs::remove_all(out);
  ds::write_options w;
  w.world_size = 3;
  w.zero_stage = 3;
  (void)ds::write(ck, out, w);
  const fs::path rank2 = out / "global_step0" / "zero_pp_rank_2_mp_rank_00_model_states.pt";
  REQUIRE(fs::exists(rank2));
  ds::options o;
  const auto want = sha256_tensors(ds::describe(out, o));
  o.check_rank_files = true;
  CHECK(sha256_tensors(ds::describe(out, o)) == want);

  // Rank 2's model states say something else: only the check sees it, and names the file.
  {
    Value v = torch::load(rank2);
    Dict& sg0 = v.as_dict().at(Key(std::string("param_shapes"))).as_list()[0].as_dict();
    REQUIRE(!sg0.empty());
    const Value shape = sg0.begin()->second;
    sg0.set("an_extra_parameter", shape);
    torch::save(rank2, v);
  }
  o.check_rank_files = false;
  CHECK(sha256_tensors(ds::describe(out, o)) == want);
  o.check_rank_files = true;
  CHECK(error_of([&] { (void)ds::describe(out, o); }) == 702);
  try {
    (void)ds::describe(out, o);
  } catch (const error& e) {
    CHECK(std::string(e.what()).find("zero_pp_rank_2_mp_rank_00_model_states.pt") != std::string::npos);
    CHECK(std::string(e.what()).find("differ from rank 0's") != std::string::npos);
  }
  // The plug-in asks for the check when open_options::check_replicas is set (--check-replicas).
  formats::open_options oo;
  CHECK_NOTHROW((void)formats::open(out, oo));
  oo.check_replicas = true;
  CHECK(error_of([&] { (void)formats::open(out, oo); }) == 702);
  fs::remove_all(out);
}
