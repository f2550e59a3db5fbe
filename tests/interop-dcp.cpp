// torch.distributed.checkpoint against real PyTorch 1.13: every DCP fixture of gen_sharded.py
// (2, 3 and 4 gloo ranks, one file per item and one file per rank) is detected, described,
// consolidated through the planner and executor into one buffer and compared bit for bit with
// the manifest (tensors by SHA-256, every value type-aware, every chunk box). dcp_w4 resharded by
// statedict's writer to 2 and 3 ranks is then loaded by PyTorch's own DCP reader on 2 and 3 gloo
// processes (tests/python/dcp_load_check.py) and compared with the same manifest.
#include <doctest/doctest.h>

#include <statedict/core/flatten.hpp>
#include <statedict/core/sha256.hpp>
#include <statedict/exec/digest.hpp>
#include <statedict/exec/executor.hpp>
#include <statedict/exec/sink.hpp>
#include <statedict/formats/dcp.hpp>
#include <statedict/shard/layout.hpp>
#include <statedict/shard/plan.hpp>

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

using namespace statedict;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const fs::path fixtures = fs::path(STATEDICT_FIXTURE_DIR) / "gen_sharded";

json load_json(const fs::path& p) {
  std::ifstream f(p);
  REQUIRE_MESSAGE(f.good(), "missing fixture manifest " << p.string() << " (run tests/python/generate_all.sh)");
  return json::parse(f);
}

std::vector<fs::path> manifests(const std::string& prefix) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(fixtures, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) == 0 && n.size() > 14 && n.substr(n.size() - 14) == ".manifest.json") out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

/// A Value against its manifest JSON encoding (tests/python/README.md), type-aware.
bool manifest_equal(const Value& v, const json& j) {
  switch (v.kind()) {
    case value_kind::none: return j.is_null();
    case value_kind::boolean: return j.is_boolean() && j.get<bool>() == v.as_bool();
    case value_kind::integer: return j.is_number_integer() && j.get<std::int64_t>() == v.as_int();
    case value_kind::floating: {
      const double d = v.as_double();
      if (!std::isfinite(d))
        return j.is_object() && j.value("repr", "") == (std::isnan(d) ? "nan" : d > 0 ? "inf" : "-inf");
      return j.is_number_float() && j.get<double>() == d && std::signbit(j.get<double>()) == std::signbit(d);
    }
    case value_kind::string: return j.is_string() && j.get<std::string>() == v.as_string();
    case value_kind::bytes: {
      static constexpr char hex[] = "0123456789abcdef";
      std::string h;
      for (std::uint8_t b : v.as_bytes().data) {
        h += hex[b >> 4];
        h += hex[b & 15];
      }
      return j.is_object() && j.value("bytes_hex", "?") == h;
    }
    default: return false;
  }
}

void check_values(const ShardedCheckpoint& c, const json& manifest) {
  const auto values = skeleton_values(c.skeleton);
  std::map<std::string, const Value*> got;
  for (const auto& [n, v] : values) got[n] = &v;
  CHECK(got.size() == manifest["values"].size());
  for (const auto& item : manifest["values"].items()) {
    const std::string name = item.key();
    const json& want = item.value();
    CAPTURE(name);
    auto it = got.find(name);
    REQUIRE(it != got.end());
    CHECK_MESSAGE(manifest_equal(*it->second, want), "value " << name << " differs from the manifest: " << want.dump());
  }
}

/// Consolidates every tensor into one buffer (planner + executor) and returns name -> SHA-256.
std::map<std::string, std::string> consolidate(const ShardedCheckpoint& c) {
  const Destination d = layout::single(c.tensors);
  const Plan plan = make_plan(c, d);
  MemorySink sink("consolidated");
  Sink* sinks[] = {&sink};
  exec_options eo;
  eo.memory_budget = 1 << 20;  // tiny budget: bounded memory, many small blocks
  (void)execute(plan, c, sinks, eo);
  std::map<std::string, std::string> out;
  for (const auto& t : d.tensors) {
    const std::uint64_t bytes = byte_size(t.shape, itemsize(t.dtype));
    const std::uint64_t off = t.chunks.empty() ? 0 : t.chunks[0].at.byte_offset;
    out[t.name] = sha256_hex(sink.bytes().subspan(static_cast<std::size_t>(off), static_cast<std::size_t>(bytes)));
  }
  return out;
}

void check_tensors(const ShardedCheckpoint& c, const json& manifest) {
  CHECK(c.tensors.size() == manifest["tensors"].size());
  const auto consolidated = consolidate(c);
  std::map<std::string, std::string> streamed;
  for (auto& [n, h] : sha256_tensors(c)) streamed[n] = h;
  for (const auto& item : manifest["tensors"].items()) {
    const std::string name = item.key();
    const json& want = item.value();
    CAPTURE(name);
    const TensorInfo* t = c.find(name);
    REQUIRE(t);
    CHECK(std::string(statedict::name(t->dtype)) == want["dtype"].get<std::string>());
    CHECK(t->shape == want["shape"].get<shape_t>());
    CHECK(consolidated.at(name) == want["sha256"].get<std::string>());
    CHECK(streamed.at(name) == want["sha256"].get<std::string>());
  }
}

int run(const std::string& cmd) {
  MESSAGE(cmd);
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

}  // namespace

TEST_CASE("every PyTorch 1.13 DCP fixture describes and consolidates bit-exactly") {
  const auto ms = manifests("dcp_w");
  REQUIRE_MESSAGE(ms.size() == 6, "expected dcp_w2/3/4 and their single-file variants in " << fixtures.string());
  for (const auto& mp : ms) {
    const json m = load_json(mp);
    const fs::path dir = fixtures / m["path"].get<std::string>();
    CAPTURE(dir.string());
    const auto det = dcp::detect(dir);
    CHECK(det.found);
    CHECK(det.rule.find("1.13") != std::string::npos);
    const ShardedCheckpoint c = dcp::describe(dir);
    CHECK(c.format == "dcp");
    check_tensors(c, m);
    check_values(c, m);
    // chunk boxes exactly as .metadata lists them (manifest dcp_chunks, in order)
    for (const auto& [name, chunks] : m["dcp_chunks"].items()) {
      const TensorInfo* t = c.find(name);
      REQUIRE(t);
      std::vector<Box> want;
      for (const auto& ch : chunks) {
        Box b{ch["offsets"].get<shape_t>(), ch["sizes"].get<shape_t>()};
        if (!is_empty(b) || b.sizes.empty()) want.push_back(b);
      }
      std::vector<Box> got;
      for (const auto& ch : t->chunks) got.push_back(std::get<Box>(ch.region));
      CHECK(got == want);
    }
    // the files the manifest lists are the sources (each item's chunk points into its file)
    std::set<std::string> files;
    for (const auto& s : c.sources) files.insert(fs::path(s->name()).filename().string());
    std::set<std::string> want_files;
    for (const auto& f : m["files"]) want_files.insert(f.get<std::string>());
    CHECK(files == want_files);
  }
}

TEST_CASE("dcp_w4 resharded by statedict loads in PyTorch 1.13's DCP reader at 2 and 3 ranks") {
  const fs::path src_dir = fixtures / "dcp_w4";
  const fs::path manifest = fixtures / "dcp_w4.manifest.json";
  const json m = load_json(manifest);
  const ShardedCheckpoint src = dcp::describe(src_dir);
  const std::string checker = std::string(STATEDICT_SOURCE_DIR) + "/tests/python/dcp_load_check.py";
  for (std::uint32_t world : {2U, 3U}) {
    CAPTURE(world);
    const fs::path out = fs::path(STATEDICT_TEST_TMP) / "interop-dcp" / ("w4_to_" + std::to_string(world));
    fs::create_directories(out.parent_path());
    dcp::write_options o;
    o.classes = dcp::class_names::torch_1_13;  // checked by PyTorch 1.13's DCP reader
    o.world_size = world;
    o.exec.memory_budget = 1 << 20;
    dcp::write(src, out, o);
    // statedict reads its own output back identically ...
    const ShardedCheckpoint back = dcp::describe(out);
    check_tensors(back, m);
    check_values(back, m);
    // ... and so does PyTorch, with ranks receiving ShardedTensors chunked along dim 0
    CHECK(run(std::string(STATEDICT_PYTHON) + " " + checker + " " + out.string() + " " + manifest.string() + " " +
              std::to_string(world)) == 0);
  }
  // plain receivers (every rank gets the whole tensors) and a dim-1 sharded receiver
  const fs::path out3 = fs::path(STATEDICT_TEST_TMP) / "interop-dcp" / "w4_to_3";
  CHECK(run(std::string(STATEDICT_PYTHON) + " " + checker + " " + out3.string() + " " + manifest.string() +
            " 2 --receive plain") == 0);
  CHECK(run(std::string(STATEDICT_PYTHON) + " " + checker + " " + out3.string() + " " + manifest.string() +
            " 2 --shard-dim 1") == 0);
}

TEST_CASE("a corrupted item is caught by PyTorch's checker too (the oracle can fail)") {
  const fs::path out = fs::path(STATEDICT_TEST_TMP) / "interop-dcp" / "corrupt";
  const fs::path manifest = fixtures / "dcp_w3.manifest.json";
  dcp::write_options o;
  o.classes = dcp::class_names::torch_1_13;  // checked by PyTorch 1.13's DCP reader
  o.world_size = 2;
  dcp::write(dcp::describe(fixtures / "dcp_w3"), out, o);
  // flip one byte inside model.embed.weight's first chunk data
  const ShardedCheckpoint c = dcp::describe(out);
  const TensorInfo* t = c.find("model.embed.weight");
  REQUIRE(t);
  const auto& ch = t->chunks.front();
  const fs::path file = c.sources[ch.at.source]->name();
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(ch.at.byte_offset));
    char b = 0;
    f.read(&b, 1);
    b = static_cast<char>(b ^ 0x40);
    f.seekp(static_cast<std::streamoff>(ch.at.byte_offset));
    f.write(&b, 1);
  }
  std::map<std::string, std::string> h;
  for (auto& [n, d] : sha256_tensors(dcp::describe(out))) h[n] = d;
  CHECK(h.at("model.embed.weight") != load_json(manifest)["tensors"]["model.embed.weight"]["sha256"].get<std::string>());
  const std::string checker = std::string(STATEDICT_SOURCE_DIR) + "/tests/python/dcp_load_check.py";
  CHECK(run(std::string(STATEDICT_PYTHON) + " " + checker + " " + out.string() + " " + manifest.string() + " 2") != 0);
}

TEST_CASE("the 2.x layout of a real checkpoint reads back equal (nesting from planner_data)") {
  const json m = load_json(fixtures / "dcp_w3_single_file.manifest.json");
  const fs::path out = fs::path(STATEDICT_TEST_TMP) / "interop-dcp" / "w3_v2";
  dcp::write_options o;
  o.world_size = 4;
  o.classes = dcp::class_names::torch_2;
  dcp::write(dcp::describe(fixtures / "dcp_w3_single_file"), out, o);
  CHECK(dcp::detect(out).rule.find("2.x layout") != std::string::npos);
  const ShardedCheckpoint back = dcp::describe(out);
  check_tensors(back, m);
  check_values(back, m);
  const auto md = dcp::read_metadata(out);
  REQUIRE(md.flatten_mapping);
  // 2.x flattening splits the config dict into one item per leaf
  bool has_config_act = false;
  for (const auto& [k, p] : *md.flatten_mapping) has_config_act = has_config_act || k == "config.act";
  CHECK(has_config_act);
}
