// Megatron-LM reader and writer without fixtures: the rule table, names, the distrib_optim.pt
// buffer layout by hand, and small legacy checkpoints written here (torch.save through statedict)
// to reach every refusal: rank folders, the tracker, args, layers, QKV orders, the vocabulary, a
// tensor no rule names that differs across TP ranks, and the writer's options. What real
// producers write is judged in interop-megatron.cpp against PyTorch and the reference merge.
#include <doctest/doctest.h>

#include <statedict/exec/digest.hpp>
#include <statedict/exec/read.hpp>
#include <statedict/formats/megatron.hpp>
#include <statedict/formats/torch.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace statedict;
namespace mg = statedict::megatron;
namespace fs = std::filesystem;

namespace {

/// torch::save with every object pickled as it is (as PyTorch would write these trees), not as
/// the data statedict's outputs carry.
void save_as_written(const fs::path& path, const Value& tree) {
  torch::save_options so;
  so.pickle.objects = pickle::write_options::objects_policy::as_written;
  torch::save(path, tree, so);
}

using statedict_test::error_of;

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const error& e) {
    return e.what();
  }
  return "";
}

fs::path scratch(const std::string& name) { return statedict_test::fresh_dir("unit-megatron-" + std::to_string(::getpid()), name); }

using statedict_test::write_all;

/// A full tensor of distinct values (base, base + 1, ...).
struct full {
  shape_t shape;
  std::vector<float> v;
  full(shape_t s, float base) : shape(std::move(s)), v(numel(shape)) {
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = base + static_cast<float>(i);
  }
  /// Rows [b, b + n) or columns [b, b + n) (2-d), as a tensor.
  [[nodiscard]] Value rows(dim_t b, dim_t n) const {
    const std::uint64_t row = shape.size() > 1 ? numel(std::span<const dim_t>(shape).subspan(1)) : 1;
    std::vector<float> out(v.begin() + static_cast<std::ptrdiff_t>(b * static_cast<dim_t>(row)),
                           v.begin() + static_cast<std::ptrdiff_t>((b + n) * static_cast<dim_t>(row)));
    shape_t s = shape;
    s[0] = n;
    return Value(Tensor::from(out, s));
  }
  [[nodiscard]] Value cols(dim_t b, dim_t n) const {
    std::vector<float> out;
    for (dim_t r = 0; r < shape[0]; ++r)
      for (dim_t c = b; c < b + n; ++c) out.push_back(v[static_cast<std::size_t>(r * shape[1] + c)]);
    return Value(Tensor::from(out, shape_t{shape[0], n}));
  }
  [[nodiscard]] Value all() const { return rows(0, shape[0]); }
};

/// A small GPT (2 layers, hidden 4, 2 heads of 2, ffn 8, vocab 8, untied, fp32) written as a legacy
/// checkpoint for TP x PP; `edit` changes a rank's tree or args before it is saved.
struct synthetic {
  std::uint64_t tp = 2, pp = 1;
  double version = 3.0;
  std::map<std::string, full> model;
  std::function<void(std::uint64_t tp_rank, std::uint64_t pp_rank, Dict& top, Dict& args)> edit;

  synthetic() {
    float base = 0;
    auto add = [&](const std::string& n, shape_t s) {
      model.emplace(n, full(s, base));
      base += 1000;
    };
    add("word", {8, 4});
    add("output", {8, 4});
    add("final_norm", {4});
    for (int l = 0; l < 2; ++l) {
      const std::string p = "l" + std::to_string(l) + ".";
      add(p + "norm", {4});
      add(p + "qkv", {12, 4});
      add(p + "dense", {4, 4});
      add(p + "fc1", {8, 4});
      add(p + "fc2", {4, 8});
    }
  }

  Value column(const std::string& n, std::uint64_t r) const {
    const full& f = model.at(n);
    const dim_t k = f.shape[0] / static_cast<dim_t>(tp);
    return f.rows(static_cast<dim_t>(r) * k, k);
  }
  Value row(const std::string& n, std::uint64_t r) const {
    const full& f = model.at(n);
    const dim_t k = f.shape[1] / static_cast<dim_t>(tp);
    return f.cols(static_cast<dim_t>(r) * k, k);
  }

  fs::path write(const std::string& name) const {
    const fs::path root = scratch(name);
    write_all(root / "latest_checkpointed_iteration.txt", "7");
    for (std::uint64_t p = 0; p < pp; ++p)
      for (std::uint64_t r = 0; r < tp; ++r) {
        Dict args;
        args.set(version >= 3.0 ? "tensor_model_parallel_size" : "model_parallel_size", static_cast<std::int64_t>(tp));
        args.set("pipeline_model_parallel_size", static_cast<std::int64_t>(pp));
        args.set("num_layers", 2);
        args.set("hidden_size", 4);
        args.set("num_attention_heads", 2);
        args.set("kv_channels", 2);
        args.set("padded_vocab_size", 8);
        args.set("untie_embeddings_and_output_weights", true);
        args.set("params_dtype", Value(Object{"torch", "float32", object_build::global, {}, {}, {}}));
        Dict lm, enc;
        const std::uint64_t per = 2 / pp;
        for (std::uint64_t l = p * per; l < (p + 1) * per; ++l) {
          const std::string g = "l" + std::to_string(l) + ".", k = "layers." + std::to_string(l - p * per) + ".";
          enc.set(k + "input_norm.weight", model.at(g + "norm").all());
          enc.set(k + "self_attention.query_key_value.weight", column(g + "qkv", r));
          enc.set(k + "self_attention.query_key_value._extra_state", Value());
          enc.set(k + "self_attention.dense.weight", row(g + "dense", r));
          enc.set(k + "mlp.dense_h_to_4h.weight", column(g + "fc1", r));
          enc.set(k + "mlp.dense_4h_to_h.weight", row(g + "fc2", r));
        }
        if (p == 0) lm.set("embedding", Value(Dict{{"word_embeddings", Value(Dict{{"weight", column("word", r)}})}}));
        if (p + 1 == pp) {
          enc.set("final_norm.weight", model.at("final_norm").all());
          lm.set("output_layer", Value(Dict{{"weight", column("output", r)}}));
        }
        lm.set("encoder", Value(std::move(enc)));
        Dict top;
        top.set("args", Value());
        if (version > 0) top.set("checkpoint_version", version);
        top.set("iteration", 7);
        top.set("model", Value(Dict{{"language_model", Value(std::move(lm))}}));
        top.set("opt_param_scheduler", Value(Dict{{"num_steps", 7}}));
        if (edit) edit(r, p, top, args);
        if (top.find("args")->is_none())
          top.set("args", Value(Object{"argparse", "Namespace", object_build::newobj, {}, {Value(std::move(args))}, {}}));
        char dir[64];
        std::snprintf(dir, sizeof dir, pp > 1 ? "mp_rank_%02d_%03d" : "mp_rank_%02d", static_cast<int>(r), static_cast<int>(p));
        fs::create_directories(root / "iter_0000007" / dir);
        save_as_written(root / "iter_0000007" / dir / "model_optim_rng.pt", Value(std::move(top)));
      }
    return root;
  }
};

std::vector<float> values_of(const ShardedCheckpoint& ck, const std::string& name) {
  const Tensor t = read_tensor(ck, name);
  const auto s = t.values<float>();
  return {s.begin(), s.end()};
}

}  // namespace

TEST_CASE("megatron: rule patterns, parsing and the built-in table") {
  CHECK(mg::matches("*.dense.weight", "a.b.dense.weight"));
  CHECK(mg::matches("*norm.weight", "language_model.encoder.final_norm.weight"));
  CHECK(mg::matches("*", ""));
  CHECK(mg::matches("a*b*c", "a-x-b-y-c"));
  CHECK_FALSE(mg::matches("a*b*c", "a-x-b-y-d"));
  CHECK_FALSE(mg::matches("*.dense.weight", "dense.weight"));
  CHECK(mg::matches("exact", "exact"));
  CHECK_FALSE(mg::matches("exact", "exactly"));
  CHECK(mg::parse_rule("*.my_proj.weight=row") == mg::rule{"*.my_proj.weight", mg::split::row});
  CHECK(mg::parse_rule("a=b=glu") == mg::rule{"a=b", mg::split::glu});
  CHECK(error_of([] { (void)mg::parse_rule("*.x"); }) == 963);
  CHECK(error_of([] { (void)mg::parse_rule("=row"); }) == 963);
  CHECK(message_of([] { (void)mg::parse_rule("*.x=diagonal"); }).find("replicated, column, row, vocab, qkv, fc1, glu") != std::string::npos);
  const std::string L = "language_model.encoder.layers.3.";
  CHECK(mg::rule_for(L + "self_attention.query_key_value.bias", {}, true) == mg::split::qkv);
  CHECK(mg::rule_for(L + "self_attention.dense.weight", {}, true) == mg::split::row);
  CHECK(mg::rule_for(L + "self_attention.dense.bias", {}, true) == mg::split::replicated);
  CHECK(mg::rule_for(L + "mlp.dense_h_to_4h.bias", {}, true) == mg::split::fc1);
  CHECK(mg::rule_for(L + "mlp.dense_4h_to_h.weight", {}, true) == mg::split::row);
  CHECK(mg::rule_for(L + "post_attention_norm.bias", {}, true) == mg::split::replicated);
  CHECK(mg::rule_for("language_model.output_layer.weight", {}, true) == mg::split::vocab);
  CHECK(mg::rule_for("output_layer.weight", {}, true) == mg::split::vocab);
  CHECK(mg::rule_for("language_model.embedding.position_embeddings.weight", {}, true) == mg::split::replicated);
  CHECK_FALSE(mg::rule_for(L + "mlp.router.weight", {}, true));
  // The caller's rules come first; without the defaults only they apply.
  const std::vector<mg::rule> mine{{"*.dense.weight", mg::split::column}};
  CHECK(mg::rule_for(L + "self_attention.dense.weight", mine, true) == mg::split::column);
  CHECK_FALSE(mg::rule_for(L + "mlp.dense_4h_to_h.weight", mine, false));
}

TEST_CASE("megatron: old key spellings and layer numbers") {
  using mg::detail::normalise_lm_key;
  CHECK(normalise_lm_key("transformer.layers.0.attention.query_key_value.weight") == "encoder.layers.0.self_attention.query_key_value.weight");
  CHECK(normalise_lm_key("encoder.layers.1.input_layernorm.bias") == "encoder.layers.1.input_norm.bias");
  CHECK(normalise_lm_key("encoder.final_layernorm.weight") == "encoder.final_norm.weight");
  CHECK(normalise_lm_key("encoder.layers.0.self_attention.layernorm_qkv.weight") == "encoder.layers.0.self_attention.layernorm_qkv.weight");
  CHECK(normalise_lm_key("word_embeddings.weight") == "embedding.word_embeddings.weight");
  CHECK(normalise_lm_key("embedding.position_embeddings.weight") == "embedding.position_embeddings.weight");
  CHECK(normalise_lm_key("output_layer.weight") == "output_layer.weight");
  const auto l = mg::detail::layer_of("layers.12.mlp.x", "layers.");
  REQUIRE(l);
  CHECK(l->first == 12);
  CHECK(l->second == "mlp.x");
  CHECK_FALSE(mg::detail::layer_of("layers.01.x", "layers."));
  CHECK_FALSE(mg::detail::layer_of("layers.x.y", "layers."));
  CHECK_FALSE(mg::detail::layer_of("layers.3", "layers."));
  CHECK(mg::detail::parse_rank_dir("mp_rank_03") == std::vector<std::uint64_t>{3});
  CHECK(mg::detail::parse_rank_dir("mp_rank_103_002") == std::vector<std::uint64_t>{103, 2});
  CHECK(mg::detail::parse_rank_dir("mp_rank_01_002_003") == std::vector<std::uint64_t>{1, 2, 3});
  CHECK_FALSE(mg::detail::parse_rank_dir("mp_rank_1"));
  CHECK_FALSE(mg::detail::parse_rank_dir("mp_rank_01_02"));
  CHECK_FALSE(mg::detail::parse_rank_dir("mp_rank_01_002_003_004"));
}

TEST_CASE("megatron: the distrib_optim.pt buffer layout, by hand") {
  // Reverse order, starts 64-aligned: p2 [0, 3), p1 [64, 164), p0 [192, 202).
  auto [a, na] = mg::detail::buffer_layout({10, 100, 3}, {false, false, false}, 2, std::nullopt);
  REQUIRE(a.size() == 3);
  CHECK(a[0].param == 2);
  CHECK(a[0].offset == 0);
  CHECK(a[1].offset == 64);
  CHECK(a[2].offset == 192);
  CHECK(na == 202);
  // A shared embedding closes the bucket at 192 (the 64-aligned end) and starts its own at the
  // lcm(2, 128)-padded 256; the saved buffer concatenates [0, 192) and [256, 266).
  auto [b, nb] = mg::detail::buffer_layout({10, 100, 3}, {true, false, false}, 2, std::nullopt);
  CHECK(b[2].offset == 192);
  CHECK(nb == 202);
  // Buckets of 100 elements: [0, 100) closes, the next starts at 128.
  auto [c, nc] = mg::detail::buffer_layout({100, 100}, {false, false}, 1, 100);
  CHECK(c[0].offset == 0);
  CHECK(c[1].offset == 100);
  CHECK(nc == 200);
}

TEST_CASE("megatron: a small legacy checkpoint merges over TP and PP") {
  for (std::uint64_t pp : {1U, 2U}) {
    CAPTURE(pp);
    synthetic s;
    s.pp = pp;
    const fs::path root = s.write("merge" + std::to_string(pp));
    const mg::detection d = mg::detect(root);
    CHECK(d.found);
    CHECK_FALSE(d.torch_dist);
    const ShardedCheckpoint ck = mg::describe(root);
    CHECK(ck.format == "megatron");
    CHECK(values_of(ck, "language_model.embedding.word_embeddings.weight") == s.model.at("word").v);
    CHECK(values_of(ck, "language_model.encoder.layers.1.self_attention.dense.weight") == s.model.at("l1.dense").v);
    CHECK(values_of(ck, "language_model.encoder.layers.1.mlp.dense_4h_to_h.weight") == s.model.at("l1.fc2").v);
    CHECK(values_of(ck, "language_model.encoder.layers.0.self_attention.query_key_value.weight") == s.model.at("l0.qkv").v);
    CHECK(values_of(ck, "language_model.output_layer.weight") == s.model.at("output").v);
    CHECK(ck.find("language_model.encoder.layers.1.input_norm.weight")->chunks.size() == 2);  // TP 0 and its replica
    std::map<std::string, Value> vals;
    for (auto& [k, v] : skeleton_values(ck.skeleton)) vals.emplace(k, v);
    CHECK(vals.at("iteration") == Value(7));
    CHECK(vals.at("checkpoint_version") == Value(3.0));
    CHECK(vals.at("opt_param_scheduler.num_steps") == Value(7));
    CHECK(vals.count("args") == 1);
  }
}

TEST_CASE("megatron: a tensor no rule names must be equal on every TP rank") {
  synthetic s;
  s.edit = [](std::uint64_t r, std::uint64_t, Dict& top, Dict&) {
    Dict& enc = top.at("model").as_dict().at("language_model").as_dict().at("encoder").as_dict();
    enc.set("layers.0.mlp.router.weight", Value(Tensor::from({1.0F + static_cast<float>(r), 2.0F}, shape_t{2})));
    enc.set("layers.0.mlp.gate_scale", Value(Tensor::from({5.0F, 6.0F}, shape_t{2})));
  };
  const fs::path root = s.write("unknown");
  const std::string msg = message_of([&] { (void)mg::describe(root); });
  CHECK(msg.find("[statedict.format_error.957]") != std::string::npos);
  CHECK(msg.find("language_model.encoder.layers.0.mlp.router.weight") != std::string::npos);
  CHECK(msg.find("--megatron-rule") != std::string::npos);
  // Named by a rule it merges as told; the equal one without a rule is replicated.
  mg::options o;
  o.rules.push_back(mg::parse_rule("*.router.weight=column"));
  const ShardedCheckpoint ck = mg::describe(root, o);
  CHECK(values_of(ck, "language_model.encoder.layers.0.mlp.router.weight") == std::vector<float>{1, 2, 2, 2});
  CHECK(values_of(ck, "language_model.encoder.layers.0.mlp.gate_scale") == std::vector<float>{5, 6});
  // Shapes that differ without a rule: the same refusal.
  synthetic t;
  t.edit = [](std::uint64_t r, std::uint64_t, Dict& top, Dict&) {
    top.at("model").as_dict().at("language_model").as_dict().at("encoder").as_dict().set(
        "layers.1.extra", Value(Tensor::zeros(dtype::F32, shape_t{static_cast<dim_t>(r + 1)})));
  };
  CHECK(error_of([&] { (void)mg::describe(t.write("unknown-shape")); }) == 957);
}

TEST_CASE("megatron: refusals name the file, the tensor and what was expected") {
  SUBCASE("tracker") {
    synthetic s;
    const fs::path root = s.write("tracker");
    write_all(root / "latest_checkpointed_iteration.txt", "seven\n");
    CHECK(error_of([&] { (void)mg::describe(root); }) == 951);
    CHECK(mg::detect(root).damaged);
    write_all(root / "latest_checkpointed_iteration.txt", "0");
    CHECK(error_of([&] { (void)mg::describe(root); }) == 951);
    write_all(root / "latest_checkpointed_iteration.txt", "8");
    CHECK(error_of([&] { (void)mg::describe(root); }) == 950);
    fs::rename(root / "iter_0000007", root / "iter_0000008");  // the files say 7
    CHECK(message_of([&] { (void)mg::describe(root); }).find("records iteration 7, latest_checkpointed_iteration.txt names 8") != std::string::npos);
    fs::rename(root / "iter_0000008", root / "iter_0000007");
    write_all(root / "latest_checkpointed_iteration.txt", " 7\n");
    CHECK(error_of([&] { (void)mg::describe(root); }) == 0);
  }
  SUBCASE("rank folders") {
    synthetic s;
    s.pp = 2;
    const fs::path root = s.write("ranks");
    fs::remove_all(root / "iter_0000007" / "mp_rank_01_001");
    CHECK(error_of([&] { (void)mg::describe(root); }) == 952);
    fs::create_directories(root / "iter_0000007" / "mp_rank_01");
    fs::copy_file(root / "iter_0000007" / "mp_rank_00_000" / "model_optim_rng.pt", root / "iter_0000007" / "mp_rank_01" / "model_optim_rng.pt");
    CHECK(message_of([&] { (void)mg::describe(root); }).find("one spelling") != std::string::npos);
    fs::create_directories(root / "iter_0000007" / "mp_rank_00_000_001");
    CHECK(error_of([&] { (void)mg::describe(root); }) == 955);
    CHECK_FALSE(mg::detect(scratch("empty")).found);
  }
  SUBCASE("args") {
    synthetic s;
    s.edit = [](std::uint64_t, std::uint64_t, Dict& top, Dict&) { top.set("args", Value(Dict{})); };
    CHECK(error_of([&] { (void)mg::describe(s.write("args-dict")); }) == 953);
    synthetic t;
    t.edit = [](std::uint64_t r, std::uint64_t, Dict&, Dict& args) {
      if (r == 1) args.set("num_layers", 4);
    };
    CHECK(error_of([&] { (void)mg::describe(t.write("args-differ")); }) == 953);
    synthetic u;
    u.edit = [](std::uint64_t, std::uint64_t, Dict&, Dict& args) { args.set("num_attention_heads", -2); };
    CHECK(error_of([&] { (void)mg::describe(u.write("args-negative")); }) == 953);
    synthetic v;
    v.edit = [](std::uint64_t, std::uint64_t, Dict&, Dict& args) { args.set("num_layers", std::int64_t{1} << 40); };
    CHECK(error_of([&] { (void)mg::describe(v.write("args-huge")); }) == 962);
  }
  SUBCASE("layers and pieces") {
    synthetic s;
    s.edit = [](std::uint64_t, std::uint64_t, Dict& top, Dict&) {
      Dict& enc = top.at("model").as_dict().at("language_model").as_dict().at("encoder").as_dict();
      Dict kept;
      for (const auto& [k, v] : enc)
        if (k.as_string().rfind("layers.1.", 0) != 0) kept.set(k, v);
      enc = std::move(kept);
    };
    CHECK(message_of([&] { (void)mg::describe(s.write("no-layer")); }).find("no rank file holds layer 1 of 2") != std::string::npos);
    synthetic t;
    t.edit = [](std::uint64_t r, std::uint64_t, Dict& top, Dict&) {
      if (r == 1)
        top.at("model").as_dict().at("language_model").as_dict().at("encoder").as_dict().set("layers.0.self_attention.dense.weight",
                                                                                             Value(Tensor::zeros(dtype::F32, {4, 3})));
    };
    CHECK(error_of([&] { (void)mg::describe(t.write("piece-shape")); }) == 956);
    synthetic u;
    u.edit = [](std::uint64_t r, std::uint64_t, Dict& top, Dict&) {
      if (r == 1) top.at("model").as_dict().at("language_model").as_dict().at("encoder").as_dict().erase("final_norm.weight");
    };
    CHECK(error_of([&] { (void)mg::describe(u.write("piece-missing")); }) == 959);
    synthetic w;
    w.edit = [](std::uint64_t, std::uint64_t, Dict& top, Dict&) {
      top.at("model").as_dict().at("language_model").as_dict().at("encoder").as_dict().set("layers.5.input_norm.weight",
                                                                                           Value(Tensor::zeros(dtype::F32, {4})));
    };
    CHECK(message_of([&] { (void)mg::describe(w.write("layer-range")); }).find("local layer 5") != std::string::npos);
    synthetic x;
    x.edit = [](std::uint64_t, std::uint64_t, Dict& top, Dict&) { top.at("model").as_dict().set("pooler", Value(Dict{})); };
    CHECK(error_of([&] { (void)mg::describe(x.write("bert")); }) == 955);
  }
  SUBCASE("QKV rows and versions") {
    synthetic s;
    s.edit = [](std::uint64_t, std::uint64_t, Dict&, Dict& args) { args.set("kv_channels", 4); };
    CHECK(message_of([&] { (void)mg::describe(s.write("qkv-rows")); }).find("QKV rows") != std::string::npos);
    synthetic t;
    t.version = 1.0;
    t.edit = [](std::uint64_t, std::uint64_t, Dict&, Dict& args) {
      args.set("group_query_attention", true);
      args.set("num_query_groups", 1);
    };
    CHECK(error_of([&] { (void)mg::describe(t.write("qkv-gqa-v1")); }) == 960);
    synthetic u;
    u.edit = [](std::uint64_t, std::uint64_t, Dict& top, Dict&) { top.set("checkpoint_version", 2.5); };
    CHECK(error_of([&] { (void)mg::describe(u.write("version")); }) == 955);
  }
  SUBCASE("vocabulary") {
    synthetic s;
    const fs::path root = s.write("vocab");
    mg::options o;
    o.true_vocab_size = 9;
    CHECK(error_of([&] { (void)mg::describe(root, o); }) == 961);
    synthetic t;
    t.edit = [](std::uint64_t, std::uint64_t, Dict&, Dict& args) { args.set("padded_vocab_size", 16); };
    CHECK(message_of([&] { (void)mg::describe(t.write("vocab-args")); }).find("padded_vocab_size is 16") != std::string::npos);
  }
}

TEST_CASE("megatron: checkpoint_version 0 and 1.0 QKV rows, reordered by placements") {
  // One rank of 2 heads of hn = 2 over 4 columns: the >= 2.0 order is [head, q/k/v, hn]. Version 0
  // stores [q/k/v, head, hn], version 1.0 [head, hn, q/k/v]; the row of (head i, block j, k) is
  // 6 i + 2 j + k in the merged tensor.
  for (double version : {0.0, 1.0}) {
    CAPTURE(version);
    synthetic s;
    s.tp = 1;
    s.version = version;
    s.edit = [version](std::uint64_t, std::uint64_t, Dict& top, Dict&) {
      std::vector<float> stored(48);
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 3; ++j)
          for (int k = 0; k < 2; ++k) {
            const int want = 6 * i + 2 * j + k;
            const int at = version == 0 ? (j * 2 + i) * 2 + k : (i * 2 + k) * 3 + j;
            for (int c = 0; c < 4; ++c) stored[static_cast<std::size_t>(at * 4 + c)] = static_cast<float>(want * 10 + c);
          }
      top.at("model").as_dict().at("language_model").as_dict().at("encoder").as_dict().set("layers.0.self_attention.query_key_value.weight",
                                                                                           Value(Tensor::from(stored, {12, 4})));
    };
    const ShardedCheckpoint ck = mg::describe(s.write("qkv-v" + std::to_string(static_cast<int>(version))));
    const auto got = values_of(ck, "language_model.encoder.layers.0.self_attention.query_key_value.weight");
    for (int row = 0; row < 12; ++row)
      for (int c = 0; c < 4; ++c) CHECK(got[static_cast<std::size_t>(row * 4 + c)] == static_cast<float>(row * 10 + c));
    CHECK(ck.find("language_model.encoder.layers.0.self_attention.query_key_value.weight")->chunks.size() == 6);
  }
}

TEST_CASE("megatron: the writer's options and inputs") {
  synthetic s;
  const fs::path root = s.write("writer");
  const ShardedCheckpoint ck = mg::describe(root);
  mg::write_options w;
  w.tp = 0;
  CHECK(error_of([&] { (void)mg::write(ck, scratch("w0"), w); }) == 970);
  w.tp = 3;  // 2 heads do not split over 3 ranks
  CHECK(error_of([&] { (void)mg::write(ck, scratch("w3"), w); }) == 972);
  w.tp = 1;
  w.pp = 4;  // 2 layers
  CHECK(error_of([&] { (void)mg::write(ck, scratch("w4"), w); }) == 972);
  // Without args, or with optimizer state, or a tensor Megatron's GPT has no place for.
  ShardedCheckpoint bare;
  bare.format = "x";
  bare.sources = ck.sources;
  bare.tensors = ck.tensors;
  w.pp = 1;
  CHECK(error_of([&] { (void)mg::write(bare, scratch("w-bare"), w); }) == 971);
  // Round trip TP 2 -> TP 1 -> TP 2 gives the same rank files' tensors.
  w.tp = 1;
  const fs::path one = scratch("w1");
  const auto files = mg::write(ck, one, w);
  CHECK(files == std::vector<std::string>{"iter_0000007/mp_rank_00/model_optim_rng.pt", "latest_checkpointed_iteration.txt"});
  const ShardedCheckpoint back = mg::describe(one);
  CHECK(sha256_tensors(back) == sha256_tensors(ck));
  w.tp = 2;
  const fs::path two = scratch("w2");
  (void)mg::write(back, two, w);
  for (const char* r : {"mp_rank_00", "mp_rank_01"}) {
    const auto a = torch::describe(root / "iter_0000007" / r / "model_optim_rng.pt", torch::load_options{{}, true});
    const auto b = torch::describe(two / "iter_0000007" / r / "model_optim_rng.pt", torch::load_options{{}, true});
    std::map<std::string, std::string> ha, hb;
    for (auto& [n, h] : sha256_tensors(a)) ha.emplace(n, h);
    for (auto& [n, h] : sha256_tensors(b)) hb.emplace(n, h);
    for (const auto& kv : ha) {  // not a structured binding: CAPTURE is a lambda, clang 14 cannot capture one
      const std::string& n = kv.first;
      CAPTURE(n);
      CHECK(hb.at(n) == kv.second);
    }
  }
}
