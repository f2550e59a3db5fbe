// ColossalAI checkpoints on hand-built folders: the distributed layout (split, replicated and padded
// pieces, 0-d and empty parameters, every metadata error id, the caps), detection against Hugging
// Face folders, and the writer (split dims from the rule, the recorded dims and the settings,
// files split by size, usage errors).
#include <doctest/doctest.h>

#include <statedict/exec/read.hpp>
#include <statedict/formats/colossalai.hpp>
#include <statedict/formats/registry.hpp>

#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <unistd.h>
#include <vector>

#include "test_util.hpp"

using namespace statedict;
namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

fs::path fresh(const std::string& name) {
  const fs::path d = fs::path(STATEDICT_TEST_TMP) / ("unit-colossalai-" + std::to_string(::getpid())) / name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

using statedict_test::error_of;

Tensor f32(std::vector<float> v, shape_t s) { return Tensor::from<float>(std::span<const float>(v), std::move(s)); }

void st_file(const fs::path& p, const std::vector<std::pair<std::string, Tensor>>& ts) {
  std::vector<safetensors::Input> in;
  for (const auto& [n, t] : ts) in.push_back(safetensors::Input::of(n, t.view()));
  (void)safetensors::write(p, in);
}

ojson item(std::vector<int> off, std::vector<int> len, std::vector<int> g, const std::string& file, int rank) {
  return ojson{{"offsets", off}, {"lengths", len}, {"global_shape", g}, {"file", file}, {"rank", rank}};
}

void meta(const fs::path& dir, int rank, const ojson& items) {
  const ojson doc{{"checkpoint_version", "1.0"}, {"total_size", 0.0}, {"metadata", items}};
  std::ofstream(dir / ("pytorch_model-meta-dist-0000" + std::to_string(rank) + ".index.json")) << doc.dump(4);
}

/// TP 2: w [4, 2] split on dim 0, b [2] replicated, e [3] padded to 4 rows on rank 1 (box 1 row),
/// s a 0-d parameter, z an empty one.
fs::path tp2(const std::string& name, dtype w1 = dtype::F32) {
  const fs::path d = fresh(name);
  Tensor w1t = f32({5, 6, 7, 8}, {2, 2});
  if (w1 == dtype::F16) {
    w1t = Tensor(dtype::F16, {2, 2});
    std::memset(w1t.data(), 0, 8);
  }
  st_file(d / "model-dist-00000-shard-00000.safetensors",
          {{"w", f32({1, 2, 3, 4}, {2, 2})}, {"b", f32({9, 9}, {2})}, {"e", f32({10, 11}, {2})}, {"s", f32({42}, {})}, {"z", f32({}, {0, 2})}});
  st_file(d / "model-dist-00001-shard-00000.safetensors",
          {{"w", std::move(w1t)}, {"b", f32({9, 9}, {2})}, {"e", f32({12, 7}, {2})}, {"s", f32({42}, {})}, {"z", f32({}, {0, 2})}});
  for (int r = 0; r < 2; ++r) {
    const std::string f = "model-dist-0000" + std::to_string(r) + "-shard-00000.safetensors";
    ojson m;
    m["w"] = item({2 * r, 0}, {2, 2}, {4, 2}, f, r);
    m["b"] = item({0}, {2}, {2}, f, r);
    m["e"] = item({2 * r}, {r == 0 ? 2 : 1}, {3}, f, r);
    m["s"] = item({}, {}, {}, f, r);
    m["z"] = item({0, 0}, {0, 2}, {0, 2}, f, r);
    meta(d, r, m);
  }
  return d;
}

std::vector<float> values(const ShardedCheckpoint& ck, const std::string& n) {
  const Tensor t = read_tensor(ck, n);
  std::vector<float> v(static_cast<std::size_t>(t.numel()));
  if (!v.empty()) std::memcpy(v.data(), t.data(), v.size() * 4);
  return v;
}

}  // namespace

TEST_CASE("colossalai: split, replicated and padded pieces are assembled, leading boxes only") {
  const fs::path d = tp2("basic");
  const auto opened = formats::open(d);
  CHECK(opened.format->name() == "colossalai");
  const ShardedCheckpoint& ck = opened.checkpoint;
  CHECK(values(ck, "w") == std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8});
  CHECK(values(ck, "b") == std::vector<float>{9, 9});
  CHECK(values(ck, "e") == std::vector<float>{10, 11, 12});  // rank 1 stores 2 rows, its box is 1
  CHECK(values(ck, "s") == std::vector<float>{42});
  CHECK(ck.find("z")->shape == shape_t{0, 2});
  CHECK(ck.find("b")->chunks.size() == 2);  // replicas, one per rank
  CHECK(ck.metadata.at("colossalai.partition_dims") == R"({"w":0,"b":-1,"e":0,"s":-1,"z":-1})");
  CHECK_FALSE(ck.metadata.contains("colossalai.not_in_metadata"));
}

TEST_CASE("colossalai: what the metadata gets wrong is refused with its error id") {
  auto with = [](const std::string& name, const std::function<void(const fs::path&)>& edit) {
    const fs::path d = tp2(name);
    edit(d);
    return error_of([&] { (void)colossalai::describe(d); });
  };
  auto edit_meta = [](const fs::path& d, int r, const std::function<void(ojson&)>& f) {
    const fs::path p = d / ("pytorch_model-meta-dist-0000" + std::to_string(r) + ".index.json");
    std::ifstream in(p);
    ojson j = ojson::parse(in);
    f(j);
    std::ofstream(p) << j.dump();
  };
  CHECK(error_of([&] { (void)colossalai::describe(tp2("f16", dtype::F16)); }) == errors::colossalai_dtype.id);
  CHECK(with("neg", [&](const fs::path& d) { edit_meta(d, 1, [](ojson& j) { j["metadata"]["w"]["offsets"][0] = -1; }); }) ==
        errors::colossalai_bad_json.id);
  CHECK(with("rank-str", [&](const fs::path& d) { edit_meta(d, 1, [](ojson& j) { j["metadata"]["w"]["rank"] = "1"; }); }) ==
        errors::colossalai_bad_json.id);
  CHECK(with("dims", [&](const fs::path& d) { edit_meta(d, 1, [](ojson& j) { j["metadata"]["w"]["lengths"] = {2}; }); }) ==
        errors::colossalai_bad_box.id);
  CHECK(with("escape", [&](const fs::path& d) {
          edit_meta(d, 1, [](ojson& j) { j["metadata"]["w"]["file"] = "../model-dist-00009-shard-00000.safetensors"; });
        }) == errors::colossalai_missing_file.id);
  CHECK(with("dup-key", [&](const fs::path& d) {
          std::ofstream(d / "pytorch_model-meta-dist-00001.index.json") << R"({"metadata": {"w": {}, "w": {}}})";
        }) == errors::colossalai_bad_json.id);
  CHECK(with("deep", [&](const fs::path& d) {
          std::ofstream(d / "pytorch_model-meta-dist-00001.index.json") << std::string(200, '[') << std::string(200, ']');
        }) == errors::colossalai_bad_json.id);
  // The file the metadata recorded at save time is read by its base name in the folder.
  CHECK(with("abs", [&](const fs::path& d) {
          edit_meta(d, 1, [](ojson& j) {
            for (auto& [k, v] : j["metadata"].items()) v["file"] = "/elsewhere/run/model-dist-00001-shard-00000.safetensors";
          });
        }) == 0);
}

TEST_CASE("colossalai: the caps") {
  const fs::path d = tp2("caps");
  colossalai::options o;
  o.limits.max_json_bytes = 64;
  CHECK(error_of([&] { (void)colossalai::describe(d, o); }) == errors::colossalai_limit.id);
  o = {};
  o.limits.max_entries = 3;
  CHECK(error_of([&] { (void)colossalai::describe(d, o); }) == errors::colossalai_limit.id);
  o = {};
  o.limits.max_files = 1;
  CHECK(error_of([&] { (void)colossalai::describe(d, o); }) == errors::colossalai_limit.id);
}

TEST_CASE("colossalai: released layout detection by ColossalAI's shard names, not Hugging Face's") {
  const fs::path hf = fresh("hf-names");
  st_file(hf / "model-00001-of-00001.safetensors", {{"a", f32({1}, {1})}});
  std::ofstream(hf / "model.safetensors.index.json") << R"({"metadata": {"total_size": 4}, "weight_map": {"a": "model-00001-of-00001.safetensors"}})";
  CHECK(colossalai::detect(hf).found == colossalai::detection::layout::none);
  CHECK(formats::open(hf).format->name() == "hf");
  const fs::path co = fresh("co-names");
  fs::create_directories(co / "modeling");
  st_file(co / "modeling" / "model-00001.safetensors", {{"a", f32({1}, {1})}});
  std::ofstream(co / "modeling" / "model.safetensors.index.json") << R"({"metadata": {"total_size": 0.1}, "weight_map": {"a": "model-00001.safetensors"}})";
  CHECK(colossalai::detect(co).found == colossalai::detection::layout::released);
  const auto ck = formats::open(co).checkpoint;
  CHECK(ck.format == "colossalai_hybrid");
  CHECK(values(ck, "a") == std::vector<float>{1});
}

TEST_CASE("colossalai: the writer splits evenly on the chosen dim, by size into files") {
  const fs::path d = tp2("writer-src");
  const auto ck = formats::open(d).checkpoint;
  formats::save_options so;
  so.format = "colossalai";
  so.world_size = 2;
  so.max_shard_size = 20;  // bytes: every rank's tensors over several files
  const fs::path out = fresh("writer") / "out";
  const auto files = formats::save(ck, out, so);
  CHECK(fs::exists(out / "model-dist-00000-shard-00001.safetensors"));
  CHECK(std::find(files.begin(), files.end(), "pytorch_model-meta-dist-00001.index.json") != files.end());
  const auto back = formats::open(out).checkpoint;
  for (const char* n : {"w", "b", "e", "s"}) CHECK(values(back, n) == values(ck, n));
  std::ifstream in(out / "pytorch_model-meta-dist-00001.index.json");
  const ojson m = ojson::parse(in);
  CHECK(m["metadata"]["w"]["offsets"] == ojson::array({2, 0}));  // the source's dim 0
  CHECK(m["metadata"]["e"]["lengths"] == ojson::array({3}));     // 3 rows on 2 ranks: whole
  CHECK(m["metadata"]["b"]["lengths"] == ojson::array({2}));     // replicated in the source
  // usage errors: an unknown tensor, a dim out of range, a world size of 0
  so.settings.set<colossalai::save_settings>().partition_dims["nope"] = 0;
  CHECK(error_of([&] { (void)formats::save(ck, fresh("w2") / "o", so); }) == errors::colossalai_bad_option.id);
  so.settings.set<colossalai::save_settings>().partition_dims = {{"w", 2}};
  CHECK(error_of([&] { (void)formats::save(ck, fresh("w3") / "o", so); }) == errors::colossalai_bad_option.id);
  so.settings.set<colossalai::save_settings>().partition_dims = {};
  so.world_size = 0;
  CHECK(error_of([&] { (void)formats::choose_output(fresh("w4") / "o", so); }) == errors::colossalai_bad_option.id);
}

TEST_CASE("colossalai: without recorded dims, tensors of 2 or more dims split on the first dim M divides") {
  Tensor a = f32({1, 2, 3, 4, 5, 6}, {3, 2});  // 3 rows: dim 1 for M = 2
  Tensor v = f32({1, 2}, {2});
  const ShardedCheckpoint ck = describe_views({{"a", a.view()}, {"v", v.view()}});
  formats::save_options so;
  so.format = "colossalai";
  so.world_size = 2;
  const fs::path out = fresh("rule") / "o";
  (void)formats::save(ck, out, so);
  std::ifstream in(out / "pytorch_model-meta-dist-00001.index.json");
  const ojson m = ojson::parse(in);
  CHECK(m["metadata"]["a"]["offsets"] == ojson::array({0, 1}));
  CHECK(m["metadata"]["v"]["lengths"] == ojson::array({2}));
  const auto back = formats::open(out).checkpoint;
  CHECK(values(back, "a") == std::vector<float>{1, 2, 3, 4, 5, 6});
}
