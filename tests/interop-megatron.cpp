// Megatron-LM fixtures from tests/python/gen_megatron.py (legacy TP 1/2/4 x PP 1/2 and virtual PP,
// checkpoint_version 0 / 1.0 / 3.0, GQA and MHA, SwiGLU and GeLU, tied and untied, old spellings,
// the distributed optimizer; Megatron-core torch_dist in both key schemes written by torch 2.x DCP):
// every case is described, consolidated through the planner and executor (replicas compared) and
// compared bit for bit with its manifests, which the reference merge made from the training run.
// The writer's checkpoints for other TP / PP sizes are judged by the reference merge and split
// (tests/python/megatron_check.py, megatron_fixtures/megatron_ref.py), and read back equal to the
// original: TP 4 -> TP 2 -> TP 1.
#include <doctest/doctest.h>

#include <statedict/exec/digest.hpp>
#include <statedict/exec/read.hpp>
#include <statedict/formats/megatron.hpp>
#include <statedict/formats/registry.hpp>
#include <statedict/formats/safetensors.hpp>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace statedict;
namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

const fs::path fixtures = fs::path(STATEDICT_FIXTURE_DIR) / "gen_megatron";

json read_json(const fs::path& p) {
  std::ifstream f(p);
  REQUIRE_MESSAGE(f.good(), "missing " << p.string() << " (fixtures: tests/python/generate_all.sh)");
  return json::parse(f);
}

std::map<std::string, std::string> hashes(const ShardedCheckpoint& c) {
  const auto h = sha256_tensors(c);
  return {h.begin(), h.end()};
}

bool same_value(const json& j, const Value& v) {
  if (j.is_null()) return v.is_none();
  if (j.is_boolean()) return v.is_bool() && v.as_bool() == j.get<bool>();
  if (j.is_number_integer()) return v.is_int() && v.as_int() == j.get<std::int64_t>();
  if (j.is_number_float()) return v.is_double() && v.as_double() == j.get<double>();
  if (j.is_string()) return v.is_string() && v.as_string() == j.get<std::string>();
  return false;
}

/// The tensors of `c` whose names start (or not) with "optimizer.", in order.
std::vector<std::string> names(const ShardedCheckpoint& c, bool optimizer) {
  std::vector<std::string> out;
  for (const auto& t : c.tensors)
    if ((t.name.rfind("optimizer.", 0) == 0) == optimizer) out.push_back(t.name);
  return out;
}

/// Every tensor of `manifest` is in `c` with its dtype, shape and hash, and `c` has no other of
/// its kind (model or optimizer), in the manifest's order.
void check_tensors(const ShardedCheckpoint& c, const std::map<std::string, std::string>& sha, const json& manifest, bool optimizer) {
  std::vector<std::string> want;
  for (const auto& [k, e] : manifest.at("tensors").items()) {
    const std::string captured = k;
    CAPTURE(captured);
    want.push_back(k);
    const TensorInfo* t = c.find(k);
    REQUIRE(t);
    CHECK(std::string(statedict::name(t->dtype)) == e.at("dtype").get<std::string>());
    CHECK(t->shape == e.at("shape").get<shape_t>());
    CHECK(sha.at(k) == e.at("sha256").get<std::string>());
  }
  CHECK(names(c, optimizer) == want);
}

int run(const std::string& cmd, std::string* out = nullptr) {
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(p != nullptr);
  std::string text;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) text.append(buf, n);
  const int rc = ::pclose(p);
  if (out) *out = text;
  if (rc != 0) MESSAGE(cmd << "\n" << text);
  return rc;
}

/// tests/python/megatron_check.py on a written checkpoint.
int oracle(const fs::path& dir, const std::string& manifest, std::uint64_t tp, std::uint64_t pp, std::optional<std::uint64_t> vpp = {}) {
  std::string cmd = std::string(STATEDICT_PYTHON) + " " + STATEDICT_SOURCE_DIR + "/tests/python/megatron_check.py " + dir.string() + " " + manifest +
                    " --tp " + std::to_string(tp) + " --pp " + std::to_string(pp);
  if (vpp) cmd += " --vpp " + std::to_string(*vpp);
  return run(cmd);
}

fs::path scratch(const std::string& name) { return statedict_test::fresh_path("interop-megatron-" + std::to_string(::getpid()), name); }

}  // namespace

TEST_CASE("megatron interop: every legacy and torch_dist fixture merges bit for bit") {
  std::size_t legacy = 0, dist = 0;
  for (const auto& c : read_json(fixtures / "megatron_cases.json")) {
    const std::string name = c.at("case").get<std::string>();
    CAPTURE(name);
    const fs::path dir = fixtures / c.at("path").get<std::string>();
    const json m = read_json(fixtures / (name + ".manifest.json"));
    const megatron::detection d = megatron::detect(dir);
    REQUIRE(d.found);
    CHECK(d.torch_dist == (m.at("format") == "megatron_torch_dist"));
    (d.torch_dist ? dist : legacy) += 1;
    const fs::path om = fixtures / (name + ".optim.manifest.json");
    for (bool optim : {false, true}) {
      megatron::options o;
      o.with_optimizer = optim;
      const ShardedCheckpoint ck = megatron::describe(dir, o);
      CHECK(ck.format == m.at("format").get<std::string>());
      const auto sha = hashes(ck);
      check_tensors(ck, sha, m, false);
      if (!optim) {
        CHECK(names(ck, true).empty());
        continue;
      }
      if (!fs::exists(om)) continue;
      const json omf = read_json(om);
      check_tensors(ck, sha, omf, true);
      std::map<std::string, Value> vals;
      for (auto& [k, v] : skeleton_values(ck.skeleton)) vals.emplace(k, v);
      for (const auto& [k, j] : omf.at("values").items()) {
        const std::string captured = k;
        CAPTURE(captured);
        REQUIRE(vals.count(k) == 1);
        CHECK(same_value(j, vals.at(k)));
      }
    }
  }
  CHECK(legacy == 7);
  CHECK(dist == 3);
}

TEST_CASE("megatron interop: replicas (norms, row-parallel biases, the tied head copy) agree when checked") {
  // Written through the planner with check_replicas: every TP copy of a replicated tensor and the
  // last stage's word_embeddings_for_head (and its optimizer state) is compared with the one read.
  for (const char* name : {"gpt2_tp2_pp2_fp16_2306", "qwen_tp2_pp2_vpp2_bf16_distopt", "gpt2_tp4_pp1_v1_release"}) {
    CAPTURE(name);
    megatron::options o;
    o.with_optimizer = true;
    const ShardedCheckpoint ck = megatron::describe(fixtures / name, o);
    formats::save_options so;
    so.plan.check_replicas = true;
    const fs::path out = scratch(std::string(name) + ".safetensors");
    formats::write_safetensors(ck, out, so);
    const ShardedCheckpoint back = formats::open(out).checkpoint;
    CHECK(hashes(back) == hashes(ck));
  }
}

TEST_CASE("megatron interop: the writer's checkpoints are what the reference saver writes, TP 4 -> TP 2 -> TP 1 equals the original") {
  struct step {
    std::uint64_t tp, pp;
    std::optional<std::uint64_t> vpp;
  };
  const std::vector<std::pair<std::string, std::vector<step>>> plans = {
      {"gpt2_tp4_pp1_v1_release", {{2, 2, {}}, {1, 1, {}}}},
      {"llama_tp4_pp2_bf16", {{2, 1, {}}, {1, 2, {}}, {4, 2, 2}}},
      {"qwen_tp2_pp2_vpp2_bf16_distopt", {{1, 4, {}}, {2, 2, 2}}},
      {"gpt2_tp2_pp1_v0_oldkeys", {{4, 2, {}}, {1, 1, {}}}},
      {"gpt2_tp2_pp2_fp16_2306", {{1, 1, {}}, {2, 4, {}}}},
  };
  for (const auto& [name, steps] : plans) {
    const std::string fixture_name = name;  // CAPTURE is a lambda: clang 14 cannot capture a structured binding
    CAPTURE(fixture_name);
    const fs::path manifest = fixtures / (name + ".manifest.json");
    const json m = read_json(manifest);
    fs::path from = fixtures / name;
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const step& s = steps[i];
      CAPTURE(s.tp);
      CAPTURE(s.pp);
      const ShardedCheckpoint ck = megatron::describe(from);
      megatron::write_options w;
      w.tp = s.tp;
      w.pp = s.pp;
      w.vpp = s.vpp;
      w.plan.check_replicas = true;
      const fs::path out = scratch(name + "-" + std::to_string(i));
      const auto files = megatron::write(ck, out, w);
      CHECK(files.size() == s.tp * s.pp + 1);
      CHECK(files.back() == "latest_checkpointed_iteration.txt");
      // The vocabulary keeps its rows; a TP size that does not divide them is refused.
      if (static_cast<std::uint64_t>(ck.find("language_model.embedding.word_embeddings.weight")->shape[0]) % s.tp != 0) continue;
      CHECK(oracle(out, manifest.string(), s.tp, s.pp, s.vpp) == 0);
      const ShardedCheckpoint back = megatron::describe(out);
      check_tensors(back, hashes(back), m, false);
      from = out;
    }
  }
}

TEST_CASE("megatron interop: the vocabulary trimmed on read, re-padded on write") {
  const fs::path dir = fixtures / "gpt2_tp4_pp1_v1_release";  // 37 tokens padded to 48 at TP 4
  const ShardedCheckpoint full = megatron::describe(dir);
  megatron::options o;
  o.true_vocab_size = 37;
  o.with_optimizer = true;
  const ShardedCheckpoint cut = megatron::describe(dir, o);
  const std::string we = "language_model.embedding.word_embeddings.weight";
  REQUIRE(cut.find(we)->shape == shape_t{37, 8});
  CHECK(cut.metadata.at("megatron.true_vocab_size") == "37");
  const Tensor a = read_tensor(full, we), b = read_tensor(cut, we);
  CHECK(std::memcmp(a.data(), b.data(), b.nbytes()) == 0);

  // Re-padded for TP 2 (args.make_vocab_size_divisible_by is 4): to the multiple of 4 x 2 at or
  // above 37, 40 rows: from the stored table its first 40 rows, from the cut one its 37 rows and
  // three copies of row 36 (Megatron's saver grows the table so).
  const std::uint64_t row = 8 * a.view().itemsize();
  megatron::write_options w;
  w.tp = 2;
  w.true_vocab_size = 37;
  const fs::path out = scratch("repad-stored");
  (void)megatron::write(full, out, w);
  CHECK(oracle(out, "-", 2, 1) == 0);
  const Tensor c = read_tensor(megatron::describe(out), we);
  REQUIRE(c.shape() == shape_t{40, 8});
  CHECK(std::memcmp(c.data(), a.data(), 40 * row) == 0);
  const fs::path out2 = scratch("repad-cut");
  (void)megatron::write(cut, out2, w);
  CHECK(oracle(out2, "-", 2, 1) == 0);
  const Tensor d = read_tensor(megatron::describe(out2), we);
  REQUIRE(d.shape() == shape_t{40, 8});
  CHECK(std::memcmp(d.data(), b.data(), 37 * row) == 0);
  for (std::uint64_t r = 37; r < 40; ++r) CHECK(std::memcmp(d.data() + r * row, b.data() + 36 * row, row) == 0);
  // Without the true size, rows that TP does not divide are refused.
  w.true_vocab_size.reset();
  CHECK_THROWS_WITH(megatron::write(cut, scratch("repad-none"), w), doctest::Contains("--true-vocab-size"));
}

TEST_CASE("megatron interop: torch_dist, stacked and per-layer keys give the same names, by placements only") {
  // mcore_te_stacked_tp2_pp2 (stacked layers, fc1 one key [W; V], MCoreMetadata, common.pt) and
  // mcore_local_perlayer_tp2 (per-layer keys, fc1 as _w / _v, plain Metadata, common_state) hold
  // llama models of one shape: the same names, dtypes and shapes (values: the first test case).
  const ShardedCheckpoint a = megatron::describe(fixtures / "mcore_te_stacked_tp2_pp2");
  const ShardedCheckpoint b = megatron::describe(fixtures / "mcore_local_perlayer_tp2");
  CHECK(a.metadata.at("megatron.layers") == "stacked");
  CHECK(b.metadata.at("megatron.layers") == "per_layer");
  CHECK(a.metadata.at("megatron.metadata_class") == "megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata");
  CHECK(a.metadata.at("megatron.common") == "common.pt");
  CHECK(b.metadata.at("megatron.common") == "common_state");
  REQUIRE(names(a, false) == names(b, false));
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    CHECK(a.tensors[i].shape == b.tensors[i].shape);
    CHECK(a.tensors[i].dtype == b.tensors[i].dtype);
  }
  // Every per-layer chunk points into a .distcp file: nothing was copied.
  for (const auto& t : a.tensors)
    for (const auto& ch : t.chunks) CHECK(a.sources.at(ch.at.source)->name().find(".distcp") != std::string::npos);
  std::map<std::string, Value> vals;
  for (auto& [k, v] : skeleton_values(b.skeleton)) vals.emplace(k, v);
  CHECK(vals.at("iteration") == Value(10));
  CHECK(vals.at("args").is_object());
}

TEST_CASE("megatron interop: pread mode gives the same result") {
  for (const char* name : {"llama_tp2_pp1_bf16_distopt", "mcore_te_stacked_tp2_pp2"}) {
    CAPTURE(name);
    megatron::options o;
    o.with_optimizer = true;
    const auto a = sha256_tensors(megatron::describe(fixtures / name, o));
    o.mode = read_mode::pread;
    const ShardedCheckpoint c = megatron::describe(fixtures / name, o);
    for (const auto& s : c.sources) CHECK(s->data() == nullptr);
    CHECK(sha256_tensors(c) == a);
  }
}
