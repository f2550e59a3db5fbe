// formats/convert.hpp: the transformations `statedict convert` applies to a description (select,
// cast, ties) and the Hugging Face writer's parts (several processes, then the index step).
#include <doctest/doctest.h>

#include <statedict/formats/registry.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace statedict;
namespace fs = std::filesystem;

namespace {

fs::path tmp_dir(const std::string& sub) { return statedict_test::fresh_path("unit-convert", sub); }

using statedict_test::read_all;

using statedict_test::error_of;

/// A safetensors file of six 1000-element F32 tensors (4000 bytes each), two of them under "b.".
fs::path sample_file() {
  const fs::path dir = tmp_dir("src");
  fs::create_directories(dir);
  Dict d;
  float x = 0;
  for (const char* n : {"a.w0", "a.w1", "a.w2", "b.w0", "b.w1", "c"}) {
    Tensor t(dtype::F32, {10, 100});
    for (float& v : t.values<float>()) v = (x += 0.25F);
    d.insert(n, std::move(t));
  }
  const fs::path p = dir / "model.safetensors";
  (void)safetensors::write_state(p, Value(std::move(d)));
  return p;
}

}  // namespace

TEST_CASE("Hugging Face output in parts: byte-identical to one process, the index step checks every shard") {
  const ShardedCheckpoint ck = formats::open(sample_file()).checkpoint;
  formats::save_options o;
  o.max_shard_size = 9000;  // two tensors per shard: three shards
  const fs::path whole = tmp_dir("whole");
  const auto files = formats::write_hf(ck, whole, o);
  CHECK(files.size() == 4);  // three shards and the index
  const fs::path d = tmp_dir("parts");
  formats::save_options idx = o;
  idx.index_only = true;
  CHECK(error_of([&] { (void)formats::write_hf(ck, d, idx); }) == errors::convert_part.id);
  CHECK_FALSE(fs::exists(d / "model.safetensors.index.json"));
  for (std::uint32_t k = 0; k < 2; ++k) {
    formats::save_options p = o;
    p.part = PartSpec{k, 2};
    (void)formats::write_hf(ck, d, p);
    CHECK_FALSE(fs::exists(d / "model.safetensors.index.json"));
  }
  (void)formats::write_hf(ck, d, idx);
  for (const auto& f : files) {
    CAPTURE(f);
    CHECK(read_all(d / f) == read_all(whole / f));
  }
  // A shard of the wrong size stops the index step.
  const fs::path shard = d / files.front();
  fs::resize_file(shard, fs::file_size(shard) - 1);
  fs::remove(d / "model.safetensors.index.json");
  CHECK(error_of([&] { (void)formats::write_hf(ck, d, idx); }) == errors::convert_part.id);
  // Parts of an output that fits one file are refused.
  formats::save_options one;
  one.part = PartSpec{0, 2};
  CHECK(error_of([&] { (void)formats::write_hf(ck, tmp_dir("one"), one); }) == errors::convert_part.id);
}

TEST_CASE("select keeps whole dotted prefixes; selecting nothing is an error") {
  const ShardedCheckpoint ck = formats::open(sample_file()).checkpoint;
  const ShardedCheckpoint b = formats::select(ck, {"b"});
  REQUIRE(b.tensors.size() == 2);
  CHECK(b.tensors[0].name == "b.w0");
  CHECK(b.tensors[1].name == "b.w1");
  CHECK(formats::select(ck, {"a.w1", "c"}).tensors.size() == 2);
  CHECK(formats::select(ck, {}).tensors.size() == ck.tensors.size());
  CHECK(error_of([&] { (void)formats::select(ck, {"zzz"}); }) == errors::select_nothing.id);
}

TEST_CASE("cast changes floating tensors only, and the output holds the rounded values") {
  ShardedCheckpoint ck = formats::open(sample_file()).checkpoint;
  formats::cast(ck, dtype::BF16);
  for (const auto& t : ck.tensors) CHECK(t.dtype == dtype::BF16);
  const fs::path out = tmp_dir("bf16");
  fs::create_directories(out);
  formats::write_safetensors(ck, out / "m.safetensors");
  const auto f = safetensors::File::open(out / "m.safetensors");
  const FlatStateDict flat = flatten(safetensors::read_state(f));
  const auto c = flat.find("c");
  REQUIRE(c);
  CHECK(c->dtype() == dtype::BF16);
  Tensor back(dtype::F32, c->shape());
  copy(*c, back.span());
  // 1250.25 .. 1500 in steps of 0.25: bf16 keeps 8 significant bits, so 1250.25 rounds to 1248.
  CHECK(back.values<float>()[0] == 1248.0F);
}
