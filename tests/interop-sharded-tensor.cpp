// ShardedTensor rank files against real PyTorch 1.13: every st_ranks_w{2,3,4} fixture of
// gen_sharded.py (OLMo's legacy sharded checkpointer style: nested model + optimizer state with
// ShardedTensors, bf16, uneven and empty chunks, reversed placements) is detected, described with
// replica checks, consolidated through the planner and executor and compared bit for bit with the
// manifest; the shard boxes are checked against the manifest's sharding; and the description is
// written as DCP for 2 ranks and loaded by PyTorch's DCP reader.
#include <doctest/doctest.h>

#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <statedict/core/flatten.hpp>
#include <statedict/core/sha256.hpp>
#include <statedict/exec/digest.hpp>
#include <statedict/exec/executor.hpp>
#include <statedict/exec/sink.hpp>
#include <statedict/formats/dcp.hpp>
#include <statedict/formats/sharded_tensor.hpp>
#include <statedict/shard/layout.hpp>
#include <statedict/shard/plan.hpp>

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

bool manifest_equal(const Value& v, const json& j) {
  switch (v.kind()) {
    case value_kind::none: return j.is_null();
    case value_kind::boolean: return j.is_boolean() && j.get<bool>() == v.as_bool();
    case value_kind::integer: return j.is_number_integer() && j.get<std::int64_t>() == v.as_int();
    case value_kind::floating:
      return j.is_number_float() && j.get<double>() == v.as_double() && std::signbit(j.get<double>()) == std::signbit(v.as_double());
    case value_kind::string: return j.is_string() && j.get<std::string>() == v.as_string();
    default: return false;
  }
}

std::map<std::string, std::string> consolidate(const ShardedCheckpoint& c) {
  const Destination d = layout::single(c.tensors);
  const Plan plan = make_plan(c, d);
  MemorySink sink("consolidated");
  Sink* sinks[] = {&sink};
  (void)execute(plan, c, sinks);
  std::map<std::string, std::string> out;
  for (const auto& t : d.tensors) {
    const std::uint64_t bytes = byte_size(t.shape, itemsize(t.dtype));
    const std::uint64_t off = t.chunks.empty() ? 0 : t.chunks[0].at.byte_offset;
    out[t.name] = sha256_hex(sink.bytes().subspan(static_cast<std::size_t>(off), static_cast<std::size_t>(bytes)));
  }
  return out;
}

int run(const std::string& cmd) {
  MESSAGE(cmd);
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

}  // namespace

TEST_CASE("every PyTorch 1.13 ShardedTensor rank-file fixture describes and consolidates bit-exactly") {
  for (int w : {2, 3, 4}) {
    const std::string cs = "st_ranks_w" + std::to_string(w);
    CAPTURE(cs);
    const json m = load_json(fixtures / (cs + ".manifest.json"));
    const fs::path dir = fixtures / m["path"].get<std::string>();
    const auto det = sharded_tensor::detect(dir);
    CHECK(det.found);
    sharded_tensor::options o;
    o.check_replicas = true;  // replicated tensors and values equal on every rank
    const ShardedCheckpoint c = sharded_tensor::describe(dir, o);
    CHECK(c.sources.size() == static_cast<std::size_t>(w));
    CHECK(c.tensors.size() == m["tensors"].size());
    const auto hashes = consolidate(c);
    for (const auto& item : m["tensors"].items()) {
      const std::string name = item.key();
      const json& want = item.value();
      CAPTURE(name);
      const TensorInfo* t = c.find(name);
      REQUIRE(t);
      CHECK(std::string(statedict::name(t->dtype)) == want["dtype"].get<std::string>());
      CHECK(t->shape == want["shape"].get<shape_t>());
      CHECK(hashes.at(name) == want["sha256"].get<std::string>());
    }
    // every shard where the manifest says: box and rank file, in placement order
    for (const auto& item : m["sharding"].items()) {
      const std::string name = item.key();
      CAPTURE(name);
      const TensorInfo* t = c.find(name);
      REQUIRE(t);
      const json& chunks = item.value()["chunks"];
      REQUIRE(t->chunks.size() == chunks.size());
      for (std::size_t i = 0; i < chunks.size(); ++i) {
        CHECK(std::get<Box>(t->chunks[i].region) == Box{chunks[i]["offsets"].get<shape_t>(), chunks[i]["sizes"].get<shape_t>()});
        CHECK(fs::path(c.sources[t->chunks[i].at.source]->name()).filename().string() ==
              "rank" + std::to_string(chunks[i]["rank"].get<int>()) + ".pt");
      }
    }
    const auto values = skeleton_values(c.skeleton);
    CHECK(values.size() == m["values"].size());
    for (const auto& [n, v] : values) {
      const std::string vn = n;
      CAPTURE(vn);
      REQUIRE(m["values"].contains(vn));
      CHECK(manifest_equal(v, m["values"][vn]));
    }
  }
}

TEST_CASE("rank files converted to DCP for 2 ranks load in PyTorch 1.13's DCP reader") {
  const fs::path manifest = fixtures / "st_ranks_w3.manifest.json";
  const ShardedCheckpoint c = sharded_tensor::describe(fixtures / "st_ranks_w3");
  const fs::path out = fs::path(STATEDICT_TEST_TMP) / "interop-sharded-tensor" / "w3_to_dcp2";
  fs::create_directories(out.parent_path());
  dcp::write_options o;
  o.classes = dcp::class_names::torch_1_13;  // checked by PyTorch 1.13's DCP reader
  o.world_size = 2;
  dcp::write(c, out, o);
  const std::string checker = std::string(STATEDICT_SOURCE_DIR) + "/tests/python/dcp_load_check.py";
  CHECK(run(std::string(STATEDICT_PYTHON) + " " + checker + " " + out.string() + " " + manifest.string() + " 2") == 0);
}
