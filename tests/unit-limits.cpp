// Caps on hostile input (docs/limits.md): for each cap that had no test of its own, a file that
// exceeds the default (or a lowered) cap fails with the cap's error id, and the same file passes
// once the cap is raised. Also: formats::open passes each format's settings to its reader.
#include <doctest/doctest.h>

#include <statedict/core/flatten.hpp>
#include <statedict/formats/registry.hpp>
#include <statedict/formats/dcp.hpp>
#include <statedict/formats/deepspeed.hpp>
#include <statedict/io/hf_sharded.hpp>
#include <statedict/io/pickle_read.hpp>
#include <statedict/io/safetensors.hpp>
#include <statedict/io/torch_file.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "test_util.hpp"

using namespace statedict;
namespace fs = std::filesystem;

namespace {

fs::path tmp(const std::string& name) {
  const fs::path d = fs::path(STATEDICT_TEST_TMP) / "unit-limits";
  fs::create_directories(d);
  return d / name;
}

using statedict_test::write_all;

std::string le64(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

fs::path st_file(const std::string& name, const std::string& header, const std::string& data) {
  const fs::path p = tmp(name + ".safetensors");
  write_all(p, le64(header.size()) + header + data);
  return p;
}

using statedict_test::error_of;

std::span<const std::byte> bytes_of(const std::string& s) { return std::as_bytes(std::span<const char>(s.data(), s.size())); }

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

}  // namespace

TEST_CASE("safetensors: max_json_depth and max_rank, raised") {
  std::string deep;
  for (int i = 0; i < 130; ++i) deep += "[";
  for (int i = 0; i < 130; ++i) deep += "]";
  // nesting inside an ignored tensor-info field ... is refused by the schema; nest in the header's
  // unknown top-level values instead: only __metadata__ and tensors are allowed there too, so the
  // depth is reached through __metadata__ (a syntax check that runs before the schema check).
  const auto p = st_file("depth", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"__metadata__":{"k":"v"},"z":)" + deep + "}",
                         std::string(4, '\0'));
  CHECK(error_of([&] { (void)safetensors::File::open(p); }) == errors::st_json_depth.id);
  safetensors::open_options o;
  o.lim.max_json_depth = 200;
  // raised: the depth passes, and the schema then refuses the non-object "z"
  CHECK(error_of([&] { (void)safetensors::File::open(p, o); }) == errors::st_tensor_info.id);

  std::string dims;
  for (int i = 0; i < 1100; ++i) dims += i ? ",1" : "1";
  const auto r = st_file("rank", R"({"a":{"dtype":"F32","shape":[)" + dims + R"(],"data_offsets":[0,4]}})", std::string(4, '\0'));
  CHECK(error_of([&] { (void)safetensors::File::open(r); }) == errors::st_too_many_dims.id);
  o = {};
  o.lim.max_rank = 2000;
  CHECK(safetensors::File::open(r, o).entries().at(0).shape.size() == 1100);
}

TEST_CASE("safetensors: max_skeleton_depth, lowered then the default") {
  // A tree nested 30 levels: {"x": [[[...[tensor]...]]]} written with its skeleton.
  Value v(Tensor::zeros(dtype::F32, {2}));
  for (int i = 0; i < 30; ++i) v = Value::list({std::move(v)});
  Dict root;
  root.set("x", std::move(v));
  const fs::path p = tmp("deep_skeleton.safetensors");
  (void)safetensors::write_state(p, Value(std::move(root)));
  safetensors::open_options o;
  o.lim.max_skeleton_depth = 20;
  CHECK(error_of([&] { (void)safetensors::File::open(p, o); }) == errors::st_skeleton_depth.id);
  CHECK(error_of([&] { (void)safetensors::File::open(p); }) == 0);
  CHECK(safetensors::File::open(p).describe().tensors.size() == 1);
  formats::open_options fo;
  fo.settings.set<safetensors::open_options>().lim.max_skeleton_depth = 20;
  CHECK(error_of([&] { (void)formats::open(p, fo); }) == errors::st_skeleton_depth.id);
}

TEST_CASE("Hugging Face: max_index_bytes, lowered then the default") {
  Dict d;
  d.set("w", Tensor::zeros(dtype::F32, {64}));
  d.set("v", Tensor::zeros(dtype::F32, {64}));
  const fs::path dir = tmp("hf");
  fs::remove_all(dir);
  formats::save_options w;
  w.max_shard_size = 300;
  (void)formats::write_hf(from_tree(Value(std::move(d))), dir, w);
  REQUIRE(fs::exists(dir / hf::index_name));
  hf::open_options small;
  small.max_index_bytes = 10;
  CHECK(error_of([&] { (void)hf::Checkpoint::open(dir, small); }) == errors::hf_index_json.id);
  CHECK(error_of([&] { (void)hf::Checkpoint::open(dir); }) == 0);
  formats::open_options fo;
  fo.settings.set<hf::open_options>().max_index_bytes = 10;
  CHECK(error_of([&] { (void)formats::open(dir, fo); }) == errors::hf_index_json.id);
  CHECK(formats::open(dir).checkpoint.tensors.size() == 2);
}

TEST_CASE("pickle: max_nodes and max_depth, raised") {
  std::string many = "\x80\x02(";
  for (int i = 0; i < 100; ++i) many += "N";
  many += "l.";
  pickle::options o;
  o.limits.max_nodes = 50;
  CHECK(error_of([&] { (void)pickle::load(bytes_of(many), o); }) == errors::pk_node_limit.id);
  o.limits.max_nodes = 1000;
  CHECK(pickle::load(bytes_of(many), o).value.as_list().size() == 100);

  std::string deep = "\x80\x02" + std::string(2000, ']') + std::string(1999, 'a') + ".";
  CHECK(error_of([&] { (void)pickle::load(bytes_of(deep)); }) == errors::pk_depth_limit.id);
  o = {};
  o.limits.max_depth = 5000;
  CHECK(pickle::load(bytes_of(deep), o).value.is_list());

  // Dicts nest through more functions than lists do: 1500 levels, each {"k": ...}, fit the stack
  // of the sanitizer build at -O0 as well.
  std::string dicts = "\x80\x02";
  for (int i = 0; i < 1500; ++i) dicts += "}U\x01k";
  dicts += "N" + std::string(1500, 's') + ".";
  CHECK(error_of([&] { (void)pickle::load(bytes_of(dicts)); }) == errors::pk_depth_limit.id);
  const Value nested = pickle::load(bytes_of(dicts), o).value;
  const Value* at = &nested;
  int levels = 0;
  while (at->is_dict()) {
    at = &(*at)["k"];
    ++levels;
  }
  CHECK(levels == 1500);
  CHECK(at->is_none());
}

TEST_CASE("torch: max_rank raised; formats::open passes torch and safetensors limits") {
  Dict d;
  d.set("w", Tensor::zeros(dtype::F32, shape_t(40, 1)));
  d.set("n", Value::list({1, 2, 3, 4, 5, 6, 7, 8}));
  const fs::path pt = tmp("rank40.pt");
  torch::save(pt, Value(d));
  torch::load_options lo;
  lo.limits.max_rank = 30;
  CHECK(error_of([&] { (void)torch::load(pt, lo); }) == errors::pt_rank_limit.id);
  lo.limits.max_rank = 64;
  CHECK(torch::load(pt, lo).as_dict().size() == 2);

  formats::open_options fo;
  fo.settings.set<torch::load_options>().limits.max_rank = 30;
  CHECK(error_of([&] { (void)formats::open(pt, fo); }) == errors::pt_rank_limit.id);
  fo = {};
  fo.settings.set<torch::load_options>().limits.pickle.max_nodes = 5;
  CHECK(error_of([&] { (void)formats::open(pt, fo); }) == errors::pk_node_limit.id);
  CHECK(formats::open(pt).checkpoint.tensors.size() == 1);

  const auto st = st_file("open", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", std::string(4, '\0'));
  fo = {};
  fo.settings.set<safetensors::open_options>().lim.max_header_bytes = 10;
  CHECK(error_of([&] { (void)formats::open(st, fo); }) == errors::st_header_too_large.id);
  CHECK(formats::open(st).checkpoint.tensors.size() == 1);
}

TEST_CASE("DCP: max_path_length (2.x planner_data), lowered then the default, also through formats::open") {
  Dict c;
  c.set("d", Tensor::zeros(dtype::F32, {4}));
  Dict b;
  b.set("c", Value(std::move(c)));
  Dict a;
  a.set("b", Value(std::move(b)));
  Dict root;
  root.set("a", Value(std::move(a)));
  const fs::path dir = tmp("dcp_paths");
  fs::remove_all(dir);
  dcp::write_options w;
  w.classes = dcp::class_names::torch_2;
  dcp::write(from_tree(Value(std::move(root))), dir, w);
  dcp::options o;
  o.limits.max_path_length = 2;
  CHECK(error_of([&] { (void)dcp::describe(dir, o); }) == errors::dcp_bad_planner_data.id);
  CHECK(error_of([&] { (void)dcp::describe(dir); }) == 0);
  formats::open_options fo;
  fo.settings.set<dcp::options>().limits.max_path_length = 2;
  CHECK(error_of([&] { (void)formats::open(dir, fo); }) == errors::dcp_bad_planner_data.id);
  fo.settings.set<dcp::options>().limits.max_path_length = 4;  // the path is a, b, c, d
  CHECK(formats::open(dir, fo).checkpoint.tensors.size() == 1);
}

TEST_CASE("DeepSpeed: max_tag_bytes of the 'latest' file, raised") {
  const fs::path dir = tmp("ds_tag");
  fs::remove_all(dir);
  fs::create_directories(dir);
  write_all(dir / "latest", std::string(5000, 'x'));
  CHECK(error_of([&] { (void)deepspeed::detect(dir); }) == errors::ds_bad_tag.id);
  deepspeed::limits lim;
  lim.max_tag_bytes = 10000;
  // raised: the tag is read; no such tag folder, so this is not a DeepSpeed checkpoint
  CHECK_FALSE(deepspeed::detect(dir, {}, lim).found);
  formats::open_options fo;
  CHECK(error_of([&] { (void)formats::open(dir, fo); }) == errors::ds_bad_tag.id);
  fo.settings.set<deepspeed::options>().limits.max_tag_bytes = 10000;
  CHECK(error_of([&] { (void)formats::open(dir, fo); }) == errors::unknown_format.id);
}
