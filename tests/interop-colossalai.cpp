// ColossalAI checkpoints (tests/python/gen_colossalai.py, written by ColossalAI's rules): every
// distributed-layout fixture and every released-layout fixture (model and optimizer keyed by name)
// read bit for bit against its manifests; corrupt copies (a missing rank, overlapping boxes, global
// shapes that differ, a missing file, an index that does not fit the optimizer, replicas that
// differ) each refused with its error id; `--to colossalai --world-size M` judged by the Python
// reference reader, through the round trip ColossalAI M=3 -> DCP 2 -> ColossalAI M=4.
#include <doctest/doctest.h>

#include <statedict/formats/colossalai.hpp>
#include <statedict/formats/registry.hpp>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "layout_util.hpp"

using namespace statedict;
namespace fs = std::filesystem;
using json = nlohmann::json;
using layout_test::compare;

namespace {

const fs::path colo_dir = fs::path(STATEDICT_FIXTURE_DIR) / "gen_colossalai";

std::vector<std::string> cases(const std::string& prefix) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(colo_dir)) {
    const std::string n = e.path().filename().string();
    const std::string suffix = ".manifest.json";
    if (n.rfind(prefix, 0) == 0 && n.size() > suffix.size() && n.substr(n.size() - suffix.size()) == suffix &&
        n.find(".optim.") == std::string::npos)
      out.push_back(n.substr(0, n.size() - suffix.size()));
  }
  std::sort(out.begin(), out.end());
  return out;
}

/// Both manifests of a case as one (model tensors, optimizer tensors and values).
json merged(const std::string& c) {
  json m = cli_test::load_json(colo_dir / (c + ".manifest.json"));
  const json o = cli_test::load_json(colo_dir / (c + ".optim.manifest.json"));
  for (const auto& [k, v] : o["tensors"].items()) m["tensors"][k] = v;
  for (const auto& [k, v] : o["values"].items()) m["values"][k] = v;
  return m;
}

fs::path copy_case(const std::string& c, const std::string& scratch) {
  const fs::path dst = cli_test::scratch(scratch) / c;
  fs::copy(colo_dir / c, dst, fs::copy_options::recursive);
  return dst;
}

using ojson = nlohmann::ordered_json;

/// Edits a JSON file in place, keeping its key order (an index's order is the parameter order).
void edit_json(const fs::path& p, const std::function<void(ojson&)>& f) {
  ojson j = ojson::parse(cli_test::read_file(p));
  f(j);
  cli_test::write_file(p, j.dump(4));
}

int open_error(const fs::path& p, bool with_optimizer = false) {
  return layout_test::error_of([&] {
    formats::open_options o;
    o.with_optimizer = with_optimizer;
    (void)formats::open(p, o);
  });
}

}  // namespace

TEST_CASE("colossalai interop: every distributed-layout fixture rebuilds its parameters bit for bit") {
  const auto cs = cases("colossalai_dist_");
  REQUIRE(cs.size() == 8);
  for (const std::string& c : cs) {
    CAPTURE(c);
    const json m = cli_test::load_json(colo_dir / (c + ".manifest.json"));
    const auto opened = formats::open(colo_dir / c);
    CHECK(opened.format->name() == "colossalai");
    const ShardedCheckpoint& ck = opened.checkpoint;
    CHECK(ck.format == "colossalai_dist");
    const auto problems = compare(ck, m);
    CHECK_MESSAGE(problems.empty(), cli_test::join(problems));
    std::string unlisted;
    for (const auto& n : m["not_in_metadata"]) unlisted += (unlisted.empty() ? "" : ",") + n.get<std::string>();
    CHECK(ck.metadata.at("colossalai.not_in_metadata") == unlisted);
    // pread reads the same bytes
    formats::open_options po;
    po.mode = read_mode::pread;
    CHECK(sha256_tensors(formats::open(colo_dir / c, po).checkpoint) == sha256_tensors(ck));
  }
}

TEST_CASE("colossalai interop: released-layout fixtures, the model and the optimizer keyed by name") {
  const auto cs = cases("colossalai_hybrid_");
  REQUIRE(cs.size() == 3);
  for (const std::string& c : cs) {
    CAPTURE(c);
    const auto model = formats::open(colo_dir / c);
    CHECK(model.checkpoint.format == "colossalai_hybrid");
    auto problems = compare(model.checkpoint, cli_test::load_json(colo_dir / (c + ".manifest.json")));
    CHECK_MESSAGE(problems.empty(), cli_test::join(problems));
    formats::open_options o;
    o.with_optimizer = true;
    const auto both = formats::open(colo_dir / c, o);
    problems = compare(both.checkpoint, merged(c));
    CHECK_MESSAGE(problems.empty(), cli_test::join(problems));
  }
}

TEST_CASE("colossalai interop: corrupt distributed checkpoints are refused with their error ids") {
  const std::string c = "colossalai_dist_tp2_bin_sharded";
  SUBCASE("a missing rank leaves holes") {
    const fs::path d = copy_case(c, "colo-missing-rank");
    fs::remove(d / "pytorch_model-meta-dist-00001.json");
    CHECK(open_error(d) == errors::colossalai_hole.id);
  }
  SUBCASE("overlapping boxes") {
    const fs::path d = copy_case(c, "colo-overlap");
    edit_json(d / "pytorch_model-meta-dist-00001.json", [](ojson& j) { j["metadata"]["embed_tokens.weight"]["offsets"][0] = 11; });
    CHECK(open_error(d) == errors::colossalai_overlap.id);
  }
  SUBCASE("global shapes that differ") {
    const fs::path d = copy_case(c, "colo-global");
    edit_json(d / "pytorch_model-meta-dist-00001.json", [](ojson& j) { j["metadata"]["embed_tokens.weight"]["global_shape"][0] = 25; });
    CHECK(open_error(d) == errors::colossalai_global_shape.id);
  }
  SUBCASE("a box outside the tensor") {
    const fs::path d = copy_case(c, "colo-box");
    edit_json(d / "pytorch_model-meta-dist-00001.json", [](ojson& j) { j["metadata"]["embed_tokens.weight"]["offsets"][0] = 13; });
    CHECK(open_error(d) == errors::colossalai_bad_box.id);
  }
  SUBCASE("a rank listed twice") {
    const fs::path d = copy_case(c, "colo-dup-rank");
    fs::copy_file(d / "pytorch_model-meta-dist-00001.json", d / "pytorch_model-meta-dist-00002.json");
    CHECK(open_error(d) == errors::colossalai_duplicate_rank.id);
  }
  SUBCASE("a missing weight file") {
    const fs::path d = copy_case(c, "colo-missing-file");
    fs::remove(d / "pytorch_model-dist-00001-shard-00000.bin");
    CHECK(open_error(d) == errors::colossalai_missing_file.id);
  }
  SUBCASE("a parameter its file does not hold") {
    const fs::path d = copy_case(c, "colo-missing-tensor");
    edit_json(d / "pytorch_model-meta-dist-00001.json", [](ojson& j) {
      j["metadata"]["embed_tokens.weight"]["file"] = "pytorch_model-dist-00001-shard-00001.bin";
    });
    CHECK(open_error(d) == errors::colossalai_missing_tensor.id);
  }
  SUBCASE("a box larger than the stored tensor") {
    const fs::path d = copy_case(c, "colo-shard-shape");
    for (const char* f : {"pytorch_model-meta-dist-00000.json", "pytorch_model-meta-dist-00001.json"})
      edit_json(d / f, [](ojson& j) {
        j["metadata"]["norm.weight"]["lengths"][0] = 7;
        j["metadata"]["norm.weight"]["global_shape"][0] = 7;
      });
    CHECK(open_error(d) == errors::colossalai_shard_shape.id);
  }
  SUBCASE("metadata that is not JSON, or lacks a field") {
    const fs::path d = copy_case(c, "colo-bad-json");
    cli_test::write_file(d / "pytorch_model-meta-dist-00001.json", "{\"metadata\": {\"a\": ");
    CHECK(open_error(d) == errors::colossalai_bad_json.id);
    edit_json(d / "pytorch_model-meta-dist-00000.json", [](ojson& j) { j["metadata"]["embed_tokens.weight"].erase("rank"); });
    cli_test::write_file(d / "pytorch_model-meta-dist-00001.json", "{}");
    CHECK(open_error(d) == errors::colossalai_bad_json.id);
  }
  cli_test::drop_scratch("colo-missing-rank");
}

TEST_CASE("colossalai interop: replicas that differ are caught by --check-replicas") {
  const std::string c = "colossalai_dist_tp2_dp2_st_sharded";
  const fs::path d = copy_case(c, "colo-replicas");
  // Flip one byte of a replicated parameter in rank 1's file.
  const auto meta = cli_test::load_json(d / "pytorch_model-meta-dist-00001.index.json");
  const std::string file = meta["metadata"]["norm.weight"]["file"];
  const auto f = safetensors::File::open(d / file);
  const auto* e = f.find("norm.weight");
  REQUIRE(e != nullptr);
  const std::uint64_t at = f.data_offset() + e->begin;
  {
    std::fstream s(d / file, std::ios::in | std::ios::out | std::ios::binary);
    s.seekg(static_cast<std::streamoff>(at));
    char b = 0;
    s.read(&b, 1);
    b = static_cast<char>(b ^ 0x40);
    s.seekp(static_cast<std::streamoff>(at));
    s.write(&b, 1);
  }
  const auto ck = formats::open(d).checkpoint;
  const fs::path out = cli_test::scratch("colo-replicas-out") / "x.safetensors";
  formats::save_options so;
  so.plan.check_replicas = true;
  CHECK(layout_test::error_of([&] { (void)formats::save(ck, out, so); }) == errors::replica_mismatch.id);
  so.plan.check_replicas = false;
  CHECK(layout_test::error_of([&] { (void)formats::save(ck, out, so); }) == 0);
}

TEST_CASE("colossalai interop: a released checkpoint whose index does not fit its optimizer is refused") {
  const std::string c = "colossalai_hybrid_tp2_bin";
  SUBCASE("parameter order") {
    const fs::path d = copy_case(c, "colo-order");
    edit_json(d / "modeling/pytorch_model.bin.index.json", [](ojson& j) {
      std::vector<std::pair<std::string, ojson>> items;
      for (const auto& [k, v] : j["weight_map"].items()) items.emplace_back(k, v);
      std::swap(items[0], items[2]);  // embed_tokens (24x6) and a layer norm (6)
      ojson wm = ojson::object();
      for (auto& [k, v] : items) wm[k] = v;
      j["weight_map"] = wm;
    });
    CHECK(open_error(d) == 0);  // the model alone is fine
    CHECK(open_error(d, true) == errors::colossalai_param_order.id);
  }
  SUBCASE("a tensor the index does not list") {
    const fs::path d = copy_case(c, "colo-unindexed");
    edit_json(d / "modeling/pytorch_model.bin.index.json", [](ojson& j) { j["weight_map"].erase("norm.bias"); });
    CHECK(open_error(d) == errors::colossalai_bad_index.id);
  }
  SUBCASE("a missing optimizer shard") {
    const fs::path d = copy_case(c, "colo-optim-file");
    fs::remove(d / "optimizer/pytorch_optim-00003.bin");
    CHECK(open_error(d) == 0);
    CHECK(open_error(d, true) == errors::colossalai_missing_file.id);
  }
  SUBCASE("no optimizer at all") {
    const fs::path d = copy_case(c, "colo-no-optim");
    fs::remove_all(d / "optimizer");
    CHECK(open_error(d, true) == errors::colossalai_bad_optimizer.id);
  }
}

TEST_CASE("colossalai interop: ColossalAI M=3 -> DCP 2 -> ColossalAI M=4 keeps every tensor") {
  const fs::path out = cli_test::scratch("colo-roundtrip");
  for (const std::string& c : {std::string("colossalai_dist_tp3_async_sharded"), std::string("colossalai_dist_tp3_bin_unsharded")}) {
    CAPTURE(c);
    const auto src = formats::open(colo_dir / c).checkpoint;
    formats::save_options dcp2;
    dcp2.format = "dcp";
    dcp2.world_size = 2;
    (void)formats::save(src, out / (c + ".dcp"), dcp2);
    const auto mid = formats::open(out / (c + ".dcp")).checkpoint;
    CHECK(mid.format == "dcp");
    formats::save_options to4;
    to4.format = "colossalai";
    to4.world_size = 4;
    const fs::path dst = out / (c + ".tp4");
    (void)formats::save(mid, dst, to4);
    // Four ranks' metadata files, and the reference reader rebuilds the manifest from them.
    for (int r = 0; r < 4; ++r) CHECK(fs::exists(dst / ("pytorch_model-meta-dist-0000" + std::to_string(r) + ".index.json")));
    json m = cli_test::load_json(colo_dir / (c + ".manifest.json"));
    m.erase("not_in_metadata");  // the buffers ColossalAI's metadata omits are not in the conversion either
    const fs::path man = out / (c + ".manifest.json");
    cli_test::write_file(man, m.dump());
    const auto r = layout_test::layout_check({"colossalai", dst.string(), man.string()});
    CHECK_MESSAGE(r.code == 0, r.describe());
    // statedict reads it back the same
    const auto back = formats::open(dst).checkpoint;
    CHECK(back.format == "colossalai_dist");
    const auto problems = compare(back, m);
    CHECK_MESSAGE(problems.empty(), cli_test::join(problems));
    // every split is an even split on one dim, as ColossalAI's search_tp_partition_dim requires
    const json meta = cli_test::load_json(dst / "pytorch_model-meta-dist-00003.index.json");
    for (const auto& [n, item] : meta["metadata"].items()) {
      const std::string param_name = n;  // CAPTURE is a lambda: clang 14 cannot capture a structured binding
      CAPTURE(param_name);
      int split = 0;
      for (std::size_t d = 0; d < item["global_shape"].size(); ++d)
        if (item["lengths"][d] != item["global_shape"][d]) {
          ++split;
          CHECK(item["global_shape"][d].get<std::int64_t>() == 4 * item["lengths"][d].get<std::int64_t>());
          CHECK(item["offsets"][d].get<std::int64_t>() == 3 * item["lengths"][d].get<std::int64_t>());
        }
      CHECK(split <= 1);
    }
  }
  cli_test::drop_scratch("colo-roundtrip");
}

TEST_CASE("colossalai interop: ColossalAI to ColossalAI keeps the split dims; settings state them per parameter") {
  const fs::path out = cli_test::scratch("colo-dims");
  const std::string c = "colossalai_dist_tp2_bin_sharded";
  const auto src = formats::open(colo_dir / c).checkpoint;
  formats::save_options so;
  so.format = "colossalai";
  so.world_size = 2;
  (void)formats::save(src, out / "same", so);
  // Same world size: the same boxes as the source's metadata, parameter by parameter.
  for (int r = 0; r < 2; ++r) {
    const json a = cli_test::load_json(colo_dir / c / ("pytorch_model-meta-dist-0000" + std::to_string(r) + ".json"));
    const json b = cli_test::load_json(out / "same" / ("pytorch_model-meta-dist-0000" + std::to_string(r) + ".index.json"));
    for (const auto& [n, item] : a["metadata"].items()) {
      const std::string param_name = n;  // CAPTURE is a lambda: clang 14 cannot capture a structured binding
      CAPTURE(param_name);
      REQUIRE(b["metadata"].contains(n));
      CHECK(b["metadata"][n]["offsets"] == item["offsets"]);
      CHECK(b["metadata"][n]["lengths"] == item["lengths"]);
    }
  }
  // A stated dim wins; a dim that does not divide evenly is a usage error.
  so.settings.set<colossalai::save_settings>().partition_dims["embed_tokens.weight"] = 1;
  (void)formats::save(src, out / "stated", so);
  const json b = cli_test::load_json(out / "stated" / "pytorch_model-meta-dist-00001.index.json");
  CHECK(b["metadata"]["embed_tokens.weight"]["offsets"] == json::array({0, 3}));
  CHECK(b["metadata"]["embed_tokens.weight"]["lengths"] == json::array({24, 3}));
  so.settings.set<colossalai::save_settings>().partition_dims["pos_embed.weight"] = 0;  // 9 rows on 2 ranks
  CHECK(layout_test::error_of([&] { (void)formats::save(src, out / "uneven", so); }) == errors::colossalai_bad_option.id);
  const auto r = layout_test::layout_check({"colossalai", (out / "stated").string(), [&] {
                                              json m = cli_test::load_json(colo_dir / (c + ".manifest.json"));
                                              m.erase("not_in_metadata");
                                              cli_test::write_file(out / "m.json", m.dump());
                                              return (out / "m.json").string();
                                            }()});
  CHECK_MESSAGE(r.code == 0, r.describe());
  // Written by two processes (--part 0/2, 1/2, then --part index): the same files as in one go.
  so.settings.set<colossalai::save_settings>().partition_dims.erase("pos_embed.weight");
  for (std::uint32_t k = 0; k < 2; ++k) {
    formats::save_options part = so;
    part.part = PartSpec{k, 2};
    (void)formats::save(src, out / "parts", part);
  }
  formats::save_options index = so;
  index.index_only = true;
  (void)formats::save(src, out / "parts", index);
  std::size_t files = 0;
  for (const auto& e : fs::directory_iterator(out / "stated")) {
    ++files;
    const fs::path twin = out / "parts" / e.path().filename();
    REQUIRE(fs::exists(twin));
    CHECK(cli_test::read_file(twin) == cli_test::read_file(e.path()));
  }
  CHECK(files == 4);
  cli_test::drop_scratch("colo-dims");
}
