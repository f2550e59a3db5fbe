// Hugging Face sharded checkpoints: the huggingface_hub split rule, size strings, the index text,
// atomic directory output, and the reader's validation of an index against its shards.
#include <doctest/doctest.h>

#include <statedict/io/hf_sharded.hpp>
#include <statedict/formats/hf.hpp>
#include <statedict/statedict.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace statedict;
namespace st = statedict::safetensors;
namespace fs = std::filesystem;

namespace {

fs::path tmp_dir(const std::string& sub) { return statedict_test::fresh_path("unit-hf", sub); }

using statedict_test::read_all;

using statedict_test::write_all;

std::uint64_t size_of(std::string_view s) { return hf::parse_max_shard_size(s); }

int size_error(std::string_view s) {
  try {
    (void)hf::parse_max_shard_size(s);
  } catch (const error& e) {
    return e.id();
  }
  return 0;
}

std::vector<std::vector<std::size_t>> groups(const hf::ShardPlan& p) {
  std::vector<std::vector<std::size_t>> g;
  for (const auto& s : p.shards) g.push_back(s.items);
  return g;
}

hf::ShardPlan plan(std::vector<std::uint64_t> sizes, std::uint64_t max) {
  std::vector<hf::ShardItem> items;
  for (std::size_t i = 0; i < sizes.size(); ++i) items.push_back({"t" + std::to_string(i), sizes[i], std::nullopt});
  return hf::plan_shards(items, max);
}

int open_error(const fs::path& p) {
  try {
    (void)hf::Checkpoint::open(p);
  } catch (const error& e) {
    return e.id();
  }
  return 0;
}

}  // namespace

TEST_CASE("max shard sizes parse as huggingface_hub's parse_size_to_int") {
  CHECK(size_of("5GB") == 5'000'000'000ULL);
  CHECK(size_of("500MB") == 500'000'000ULL);
  CHECK(size_of("10KB") == 10'000ULL);
  CHECK(size_of("1TB") == 1'000'000'000'000ULL);
  CHECK(size_of("5gb") == 5'000'000'000ULL);
  CHECK(size_of(" 1.5 GB ") == 1'500'000'000ULL);
  CHECK(size_of("0.1KB") == 100);
  CHECK(size_of("4.14MB") == 4'139'999);  // int(4.14 * 10**6) in double precision
  CHECK(size_of("1e3KB") == 1'000'000);
  CHECK(size_of(".5KB") == 500);
  CHECK(size_of("5.GB") == 5'000'000'000ULL);
  CHECK(size_of("0GB") == 0);
  CHECK(size_of("123456") == 123456);  // statedict: a bare byte count
  for (const char* bad : {"10KiB", "1GiB", "5G", "", "GB", "-1GB", "abcGB", "1.5.GB", "1e400GB", "nanGB", "1 0GB",
                          "99999999999999999999", "1e30TB"})
    CHECK_MESSAGE(size_error(bad) == 358, bad);
  CHECK(size_error("5") == 0);  // "5" alone is a byte count
}

TEST_CASE("split: greedy in input order, as the huggingface_hub docstring example") {
  // [6, 6, 2, 6, 2, 2] GB with a 10 GB limit: [6], [6+2], [6+2+2].
  hf::ShardPlan p = plan({6, 6, 2, 6, 2, 2}, 10);
  CHECK(groups(p) == std::vector<std::vector<std::size_t>>{{0}, {1, 2}, {3, 4, 5}});
  CHECK(p.total_size == 24);
  CHECK(p.shards[0].filename == "model-00001-of-00003.safetensors");
  CHECK(p.shards[2].filename == "model-00003-of-00003.safetensors");
  CHECK(p.is_sharded());
}

TEST_CASE("split: a tensor above the maximum gets its own shard, ahead of the one still open") {
  hf::ShardPlan p = plan({3, 20, 4, 5}, 10);
  CHECK(groups(p) == std::vector<std::vector<std::size_t>>{{1}, {0, 2}, {3}});
  CHECK(p.total_size == 32);
  // Exactly the maximum fits; zero-size tensors never open a shard.
  CHECK(groups(plan({10, 10, 0}, 10)) == std::vector<std::vector<std::size_t>>{{0}, {1, 2}});
  CHECK(groups(plan({0, 1}, 0)) == std::vector<std::vector<std::size_t>>{{1}, {0}});
}

TEST_CASE("split: one shard is model.safetensors; nothing at all is one empty file") {
  hf::ShardPlan p = plan({1, 2}, 100);
  REQUIRE(p.shards.size() == 1);
  CHECK(p.shards[0].filename == "model.safetensors");
  CHECK(p.shards[0].items == std::vector<std::size_t>{0, 1});
  CHECK_FALSE(p.is_sharded());
  hf::ShardPlan e = plan({}, 100);
  REQUIRE(e.shards.size() == 1);
  CHECK(e.shards[0].items.empty());
}

TEST_CASE("split: tensors sharing a storage follow the first one, counted once") {
  std::vector<hf::ShardItem> items{{"a", 4, 1}, {"b", 4, 2}, {"c", 4, 1}, {"d", 4, 3}};
  hf::ShardPlan p = hf::plan_shards(items, 8);
  CHECK(groups(p) == std::vector<std::vector<std::size_t>>{{0, 1, 2}, {3}});
  CHECK(p.total_size == 12);
}

TEST_CASE("index text is json.dumps(index, indent=2) with ASCII escapes") {
  const std::string t = hf::index_json(12, {{"note", "\xc3\xa9\xf0\x9f\x98\x80\"\n\x7f"}},
                                       {{"a", "model-00001-of-00002.safetensors"}, {"b\\", "model-00002-of-00002.safetensors"}});
  CHECK(t ==
        "{\n  \"metadata\": {\n    \"total_size\": 12,\n    \"note\": \"\\u00e9\\ud83d\\ude00\\\"\\n\\u007f\"\n  },\n"
        "  \"weight_map\": {\n    \"a\": \"model-00001-of-00002.safetensors\",\n"
        "    \"b\\\\\": \"model-00002-of-00002.safetensors\"\n  }\n}");
}

TEST_CASE("write_sharded: shards, index, tied tensors, and reading it all back as one map") {
  std::vector<Tensor> ts;
  std::vector<st::Input> in;
  for (int i = 0; i < 6; ++i) {
    std::vector<float> v(25, static_cast<float>(i));
    ts.push_back(Tensor::from(v, {5, 5}));  // 100 bytes each
    in.push_back(st::Input::of("layers." + std::to_string(i) + ".w", ts.back().view()));
  }
  in.push_back(st::Input::of("lm_head.w", ts[0].view()));  // tied to layers.0.w
  const fs::path dir = tmp_dir("sharded");
  hf::write_options o;
  o.max_shard_size = hf::parse_max_shard_size("0.25KB");  // 250 bytes: two tensors per shard
  o.metadata = {{"producer", "unit-hf"}};
  hf::write_result r = hf::write_sharded(dir, in, o);
  CHECK(r.plan.shards.size() == 3);
  CHECK(r.plan.total_size == 600);
  CHECK(r.files.back() == "model.safetensors.index.json");
  CHECK(fs::exists(dir / "model-00003-of-00003.safetensors"));
  CHECK_FALSE(fs::exists(dir / "model.safetensors"));
  const auto index = nlohmann::ordered_json::parse(read_all(dir / "model.safetensors.index.json"));
  CHECK(index["metadata"]["total_size"] == 600);
  CHECK(index["metadata"]["producer"] == "unit-hf");
  CHECK(index["weight_map"].size() == 6);  // the alias is not a stored tensor
  CHECK(index["weight_map"]["layers.5.w"] == "model-00003-of-00003.safetensors");
  // Each shard carries {"format": "pt"} only (plus statedict's alias record where needed).
  st::File s1 = st::File::open(dir / "model-00001-of-00003.safetensors");
  CHECK(s1.metadata() == std::map<std::string, std::string>{{"format", "pt"}});
  CHECK(s1.aliases().size() == 1);

  hf::Checkpoint c = hf::Checkpoint::open(dir);
  CHECK(c.files().size() == 3);
  REQUIRE(c.items().size() == 7);
  CHECK(c.items()[0].name == "layers.0.w");
  CHECK(c.items()[6].name == "lm_head.w");
  CHECK(c.items()[6].alias);
  for (const auto& i : in) CHECK_MESSAGE(equal_bytes(c.view(i.name), i.view), i.name);
  CHECK(c.view("lm_head.w").data() == c.view("layers.0.w").data());
  CHECK(c.sha256("layers.3.w") == sha256_hex(ts[3].view()));
  CHECK(c.sha256("lm_head.w") == sha256_hex(ts[0].view()));
  ShardedCheckpoint d = c.describe();
  CHECK(d.format == "hf_sharded");
  CHECK(d.sources.size() == 3);
  CHECK(d.tensors.size() == 6);  // the alias is an alias node of the skeleton
  REQUIRE_FALSE(d.skeleton.is_null());
  NamedTensors nt;
  for (const auto& t : d.tensors) nt.emplace_back(t.name, c.view(t.name));
  CHECK(unflatten(nt, d.skeleton) == c.to_flat_dict());
  CHECK(d.find("layers.4.w")->chunks[0].at.source == 2);
  CHECK(d.metadata.at("producer") == "unit-hf");
  CHECK(d.metadata.at("total_size") == "600");
  // Opening the index file itself gives the same.
  CHECK(hf::Checkpoint::open(dir / "model.safetensors.index.json").items().size() == 7);
  Value flat = c.to_flat_dict();
  CHECK(flat.as_dict().size() == 7);

  // Writing again replaces the directory in one step; a single shard has no index.
  o.max_shard_size = hf::default_max_shard_size;
  hf::write_result r2 = hf::write_sharded(dir, in, o);
  CHECK(r2.files == std::vector<std::string>{"model.safetensors"});
  CHECK_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  CHECK_FALSE(fs::exists(dir / "model-00001-of-00003.safetensors"));
  st::File single = st::File::open(dir / "model.safetensors");
  CHECK(single.metadata() == std::map<std::string, std::string>{{"format", "pt"}, {"producer", "unit-hf"}});
  hf::Checkpoint c2 = hf::Checkpoint::open(dir);
  CHECK(c2.items().size() == 7);
  CHECK(c2.describe().sources.size() == 1);
}

TEST_CASE("write_sharded sizes after the cast") {
  std::vector<Tensor> ts;
  std::vector<st::Input> in;
  for (int i = 0; i < 4; ++i) {
    ts.push_back(Tensor::from(std::vector<float>(25, 1.0F), {25}));  // 100 bytes in F32, 50 in BF16
    in.push_back(st::Input::of("t" + std::to_string(i), ts.back().view()));
  }
  hf::write_options o;
  o.max_shard_size = 100;
  o.cast = dtype::BF16;
  const fs::path dir = tmp_dir("cast");
  hf::write_result r = hf::write_sharded(dir, in, o);
  CHECK(r.plan.shards.size() == 2);
  CHECK(r.plan.total_size == 200);
  hf::Checkpoint c = hf::Checkpoint::open(dir);
  CHECK(c.view("t3").dtype() == dtype::BF16);
}

TEST_CASE("the reader validates the index against the shards") {
  const fs::path dir = tmp_dir("validate");
  fs::create_directories(dir);
  Tensor a = Tensor::from<float>({1, 2}, {2});
  Tensor b = Tensor::from<float>({3}, {1});
  st::write(dir / "s1.safetensors", std::vector<st::Input>{st::Input::of("x", a.view())});
  st::write(dir / "s2.safetensors", std::vector<st::Input>{st::Input::of("y", b.view())});
  st::write(dir / "s3.safetensors", std::vector<st::Input>{st::Input::of("x", b.view())});
  const fs::path idx = dir / "model.safetensors.index.json";
  auto with_index = [&](const std::string& text) {
    write_all(idx, text);
    return open_error(dir);
  };
  CHECK(with_index(R"({"metadata":{"total_size":12},"weight_map":{"x":"s1.safetensors","y":"s2.safetensors"}})") == 0);
  CHECK(with_index(R"({"weight_map":{"x":"s1.safetensors","y":"s2.safetensors"}})") == 0);  // metadata is optional
  CHECK(with_index("{\"weight_map\":") == 350);
  CHECK(with_index(R"({"weight_map":{"x":"s1.safetensors","x":"s1.safetensors","y":"s2.safetensors"}})") == 352);
  CHECK(with_index(R"({"metadata":{}})") == 351);
  CHECK(with_index(R"({"weight_map":[]})") == 351);
  CHECK(with_index(R"({"weight_map":{"x":1}})") == 351);
  CHECK(with_index(R"({"metadata":[],"weight_map":{"x":"s1.safetensors"}})") == 351);
  CHECK(with_index(R"({"weight_map":{"x":"../s1.safetensors"}})") == 356);
  CHECK(with_index(R"({"weight_map":{"x":"/etc/passwd"}})") == 356);
  CHECK(with_index(R"({"weight_map":{"x":".."}})") == 356);
  CHECK(with_index(R"({"weight_map":{"x":"s1.safetensors","y":"s1.safetensors"}})") == 353);
  CHECK(with_index(R"({"weight_map":{"x":"s1.safetensors"}})") == 0);  // s2 is not part of this checkpoint
  CHECK(with_index(R"({"weight_map":{"y":"s2.safetensors","x":"s3.safetensors","z":"s1.safetensors"}})") == 353);
  CHECK(with_index(R"({"weight_map":{"x":"s1.safetensors","y":"s3.safetensors"}})") == 353);
  // s1 and s3 both hold x: whichever the index names, the other one is a second copy.
  st::write(dir / "s4.safetensors", std::vector<st::Input>{st::Input::of("x", b.view()), st::Input::of("w", a.view())});
  CHECK(with_index(R"({"weight_map":{"x":"s1.safetensors","w":"s4.safetensors"}})") == 354);
  CHECK(with_index(R"({"weight_map":{"w":"s4.safetensors"}})") == 355);
  CHECK(with_index(R"({"weight_map":{"x":"missing.safetensors"}})") == 380);
  try {
    write_all(idx, R"({"weight_map":{"x":"s1.safetensors","y":"s1.safetensors"}})");
    (void)hf::Checkpoint::open(dir);
    FAIL("expected an error");
  } catch (const format_error& e) {
    const std::string w = e.what();
    CHECK(w.find("tensor 'y'") != std::string::npos);
    CHECK(w.find("s1.safetensors") != std::string::npos);
    CHECK(w.find("model.safetensors.index.json") != std::string::npos);
  }
  // A corrupt shard is reported with the checkpoint and the shard.
  write_all(dir / "s5.safetensors", "garbage!");
  write_all(idx, R"({"weight_map":{"x":"s5.safetensors"}})");
  try {
    (void)hf::Checkpoint::open(dir);
    FAIL("expected an error");
  } catch (const format_error& e) {
    CHECK(std::string(e.what()).find("s5.safetensors") != std::string::npos);
    CHECK(std::string(e.what()).find("checkpoint") != std::string::npos);
  }
  const fs::path empty = tmp_dir("empty");
  fs::create_directories(empty);
  CHECK(open_error(empty) == 357);
}

namespace {
int describe_error(const fs::path& p) {
  try {
    (void)hf::describe_checkpoint(p, {}, {});
  } catch (const error& e) {
    return e.id();
  }
  return 0;
}
}  // namespace

TEST_CASE("an index of torch.save shards (transformers' .bin) is read shard by shard, by content") {
  const fs::path dir = tmp_dir("bin");
  fs::create_directories(dir);
  Tensor a = Tensor::from<float>({1, 2}, {2});
  Tensor b = Tensor::from<std::int64_t>({3}, {1});
  Tensor c = Tensor::from<float>({4, 5, 6}, {3});
  auto dict = [](std::vector<std::pair<std::string, Value>> items) {
    Dict d;
    for (auto& [k, v] : items) d.insert(k, std::move(v));
    return Value(std::move(d));
  };
  torch::save(dir / "pytorch_model-00001-of-00002.bin", dict({{"x", Value(a.view())}, {"tied", Value(a.view())}}));
  torch::save(dir / "pytorch_model-00002-of-00002.bin", dict({{"y", Value(b.view())}}));
  st::write(dir / "more.safetensors", std::vector<st::Input>{st::Input::of("z", c.view())});
  const fs::path idx = dir / "pytorch_model.bin.index.json";
  write_all(idx, R"({"metadata":{"total_size":32},"weight_map":{"y":"pytorch_model-00002-of-00002.bin",)"
                 R"("x":"pytorch_model-00001-of-00002.bin","tied":"pytorch_model-00001-of-00002.bin","z":"more.safetensors"}})");
  for (const fs::path& p : {dir, idx}) {
    CAPTURE(p.string());
    const formats::Opened o = formats::open(p);
    CHECK(o.format->name() == "hf");
    const ShardedCheckpoint& ck = o.checkpoint;
    CHECK(ck.format == "hf_sharded");
    REQUIRE(ck.tensors.size() == 3);  // weight_map order; the tie stays a tie
    CHECK(ck.tensors[0].name == "y");
    CHECK(ck.tensors[1].name == "x");
    CHECK(ck.tensors[2].name == "z");
    CHECK(ck.sources.size() == 3);
    CHECK(ck.metadata.at("total_size") == "32");
    const auto hashes = sha256_tensors(formats::expand_ties(ck));
    REQUIRE(hashes.size() == 4);
    CHECK(hashes[0].second == sha256_hex(b.view()));
    CHECK(hashes[1].second == sha256_hex(a.view()));
    CHECK(hashes[2].second == sha256_hex(c.view()));
    CHECK(hashes[3].first == "tied");
    CHECK(hashes[3].second == sha256_hex(a.view()));
  }
  // The same validation as for safetensors shards, and a shard holds tensors only.
  auto with_index = [&](const std::string& text) {
    write_all(idx, text);
    return describe_error(dir);
  };
  CHECK(with_index(R"({"weight_map":{"x":"pytorch_model-00001-of-00002.bin","tied":"pytorch_model-00001-of-00002.bin"}})") == 0);
  CHECK(with_index(R"({"weight_map":{"x":"pytorch_model-00001-of-00002.bin"}})") == 355);  // "tied" unlisted
  CHECK(with_index(R"({"weight_map":{"x":"pytorch_model-00001-of-00002.bin","tied":"pytorch_model-00001-of-00002.bin",)"
                   R"("y":"pytorch_model-00001-of-00002.bin"}})") == 353);
  CHECK(with_index(R"({"weight_map":{"x":"pytorch_model-00001-of-00002.bin","tied":"pytorch_model-00001-of-00002.bin",)"
                   R"("y":"pytorch_model-00002-of-00002.bin","z":"pytorch_model-00002-of-00002.bin"}})") == 353);
  CHECK(with_index(R"({"weight_map":{"x":"../pytorch_model-00001-of-00002.bin"}})") == 356);
  CHECK(with_index(R"({"weight_map":{"x":"pytorch_model-00001-of-00002.bin","tied":"gone.bin"}})") == 380);
  torch::save(dir / "values.bin", dict({{"w", Value(a.view())}, {"step", Value(std::int64_t{3})}}));
  CHECK(with_index(R"({"weight_map":{"w":"values.bin","x":"pytorch_model-00001-of-00002.bin"}})") == 335);
  torch::save(dir / "again.bin", dict({{"x", Value(c.view())}}));
  CHECK(with_index(R"({"weight_map":{"x":"again.bin","tied":"pytorch_model-00001-of-00002.bin"}})") == 354);
  // A directory with a single pytorch_model.bin.
  const fs::path single = tmp_dir("bin_single");
  fs::create_directories(single);
  torch::save(single / "pytorch_model.bin", dict({{"w", Value(c.view())}}));
  const formats::Opened o = formats::open(single);
  CHECK(o.format->name() == "hf");
  REQUIRE(o.checkpoint.tensors.size() == 1);
  CHECK(o.checkpoint.tensors[0].name == "w");
}
