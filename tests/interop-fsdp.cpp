// OLMo local sharded (FSDP flat parameter) fixtures from tests/python/gen_zero_fsdp.py: every case
// is described, consolidated through the planner and executor, and compared bit for bit with its
// manifests (what OLMo's unshard_checkpoint outputs). The use_orig_params=False case, whose
// optimizer state OLMo cannot unshard, is compared with a Python oracle that slices the flat
// optimizer state with the files' own _shard_param_infos.
#include <doctest/doctest.h>

#include <statedict/exec/digest.hpp>
#include <statedict/formats/fsdp.hpp>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

using namespace statedict;
namespace fsdp = statedict::fsdp;
namespace fs = std::filesystem;

namespace {

const fs::path fixtures = fs::path(STATEDICT_FIXTURE_DIR) / "gen_zero_fsdp";

nlohmann::ordered_json read_json(const fs::path& p) {
  std::ifstream f(p);
  REQUIRE_MESSAGE(f.good(), "missing " << p.string());
  return nlohmann::ordered_json::parse(f);
}

bool same_value(const nlohmann::ordered_json& j, const Value& v) {
  if (j.is_null()) return v.is_none();
  if (j.is_boolean()) return v.is_bool() && v.as_bool() == j.get<bool>();
  if (j.is_number_integer()) return v.is_int() && v.as_int() == j.get<std::int64_t>();
  if (j.is_number_float()) return v.is_double() && v.as_double() == j.get<double>();
  if (j.is_string()) return v.is_string() && v.as_string() == j.get<std::string>();
  return false;
}

std::string run_python(const std::string& code) {
  const fs::path script = fs::path(STATEDICT_TEST_TMP) / "interop-fsdp.py";
  {
    std::ofstream f(script);
    f << code;
  }
  const std::string cmd = std::string(STATEDICT_PYTHON) + " " + script.string();
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  REQUIRE(::pclose(p) == 0);
  return out;
}

}  // namespace

TEST_CASE("fsdp interop: every OLMo fixture consolidates bit for bit") {
  std::vector<std::pair<std::string, std::string>> cases;
  for (const auto& c : read_json(fixtures / "zero_fsdp_cases.json"))
    if (c.at("format").get<std::string>() == "olmo_local_sharded")
      cases.emplace_back(c.at("case").get<std::string>(), c.at("checkpoint").get<std::string>());
  REQUIRE(cases.size() == 5);
  for (const auto& [name, ckpt] : cases) {
    const std::string captured_name = name;
    CAPTURE(captured_name);
    const fs::path dir = fixtures / ckpt;
    const fsdp::detection d = fsdp::detect(dir);
    REQUIRE(d.found);
    CHECK(d.metadata_world_size == std::optional<std::uint64_t>(d.world_size));

    const bool has_optim = fs::exists(fixtures / (name + ".optim.manifest.json"));
    fsdp::options o;
    o.with_optimizer = true;
    o.with_train_state = true;
    for (bool optim : {false, true}) {
      o.with_optimizer = optim;
      const ShardedCheckpoint c = fsdp::describe(dir, o);
      const auto h = sha256_tensors(c);
      const std::map<std::string, std::string> sha(h.begin(), h.end());
      const auto m = read_json(fixtures / (name + ".manifest.json"));
      CHECK(c.format == m.at("format").get<std::string>());
      // OLMo's output: parameters only, in order of first appearance, no aliases.
      std::vector<std::string> want, got;
      for (const auto& [k, e] : m.at("tensors").items()) {
        const std::string captured_k = k;
        CAPTURE(captured_k);
        want.push_back(k);
        const TensorInfo* t = c.find(k);
        REQUIRE(t);
        CHECK(std::string(statedict::name(t->dtype)) == e.at("dtype").get<std::string>());
        CHECK(t->shape == e.at("shape").get<shape_t>());
        CHECK(sha.at(k) == e.at("sha256").get<std::string>());
      }
      for (const auto& t : c.tensors)
        if (t.name.rfind("optim.", 0) != 0) got.push_back(t.name);
      CHECK(got == want);
      CHECK(skeleton_aliases(c.skeleton).empty());
      std::map<std::string, Value> vals;
      for (auto& [k, v] : skeleton_values(c.skeleton)) vals.emplace(k, v);
      CHECK(vals.at("train.global_step") == Value(2));
      CHECK(vals.at("train.world_size") == Value(static_cast<std::int64_t>(d.world_size)));
      if (!optim || !has_optim) continue;
      const auto om = read_json(fixtures / (name + ".optim.manifest.json"));
      std::size_t n = 0;
      for (const auto& [k, e] : om.at("tensors").items()) {
        const std::string captured_k = k;
        CAPTURE(captured_k);
        ++n;
        const TensorInfo* t = c.find(k);
        REQUIRE(t);
        CHECK(std::string(statedict::name(t->dtype)) == e.at("dtype").get<std::string>());
        CHECK(t->shape == e.at("shape").get<shape_t>());
        CHECK(sha.at(k) == e.at("sha256").get<std::string>());
      }
      CHECK(c.tensors.size() == want.size() + n);
      std::size_t nv = 0;
      for (const auto& [k, j] : om.at("values").items()) {
        const std::string captured_k = k;
        CAPTURE(captured_k);
        ++nv;
        REQUIRE(vals.count(k) == 1);
        CHECK(same_value(j, vals.at(k)));
      }
      std::size_t mine = 0;
      for (const auto& [k, v] : vals) mine += k.rfind("optim.", 0) == 0 ? 1U : 0U;
      CHECK(mine == nv);
    }
  }
}

TEST_CASE("fsdp interop: use_orig_params=False optimizer state, which OLMo cannot unshard") {
  const std::string py = R"(
import json, math, os, sys
sys.path.insert(0, ")" + std::string(STATEDICT_SOURCE_DIR) + R"(/tests/python")
from zero_fsdp import standins
from zero_fsdp.manifest import tensor_entry
import torch
standins.install()
step = ")" + (fixtures / "olmo_fsdp_torch21_flat_ws2" / "step2").string() + R"("
full, steps = {}, {}
for r in range(2):
    ms = torch.load(os.path.join(step, "model", f"rank{r}.pt"), map_location="cpu")
    osd = torch.load(os.path.join(step, "optim", f"rank{r}.pt"), map_location="cpu")
    g = osd["param_groups"][0]
    by_name = {n.replace("_fsdp_wrapped_module.", ""): osd["state"][i] for n, i in zip(g["param_names"], g["params"])}
    for mod in ms["modules"]:
        prefix = mod["name"].replace("_fsdp_wrapped_module.", "")
        h = mod["handles"][0]
        st = by_name[(prefix + "." if prefix else "") + "_flat_param"]
        for fqn, shape, info in zip(h["flat_param._fqns"], h["flat_param._shapes"], h["flat_param._shard_param_infos"]):
            if not info.in_shard:
                continue
            name = prefix + "." + fqn if prefix else fqn
            for k in ("exp_avg", "exp_avg_sq"):
                t = full.setdefault(f"optim.state.{name}.{k}", torch.full(tuple(shape), math.nan))
                t.view(-1)[info.intra_param_start_idx:info.intra_param_end_idx + 1] = \
                    st[k][info.offset_in_shard:info.offset_in_shard + info.numel_in_shard]
            steps[f"optim.state.{name}.step"] = st["step"]
assert not any(bool(torch.isnan(t).any()) for t in full.values())
full.update(steps)
print(json.dumps({k: tensor_entry(v) for k, v in full.items()}))
)";
  const auto expect = nlohmann::json::parse(run_python(py));
  fsdp::options o;
  o.with_optimizer = true;
  const ShardedCheckpoint c = fsdp::describe(fixtures / "olmo_fsdp_torch21_flat_ws2" / "step2", o);
  const auto h = sha256_tensors(c);
  const std::map<std::string, std::string> sha(h.begin(), h.end());
  REQUIRE(expect.size() == 30);
  for (const auto& [k, e] : expect.items()) {
    const std::string captured_k = k;
    CAPTURE(captured_k);
    const TensorInfo* t = c.find(k);
    REQUIRE(t);
    CHECK(t->shape == e.at("shape").get<shape_t>());
    CHECK(sha.at(k) == e.at("sha256").get<std::string>());
  }
}

TEST_CASE("fsdp interop: pread mode gives the same result") {
  const fs::path dir = fixtures / "olmo_fsdp_torch20_ws4" / "step2";
  fsdp::options o;
  o.with_optimizer = true;
  const auto a = sha256_tensors(fsdp::describe(dir, o));
  o.mode = read_mode::pread;
  const ShardedCheckpoint c = fsdp::describe(dir, o);
  for (const auto& s : c.sources) CHECK(s->data() == nullptr);
  CHECK(sha256_tensors(c) == a);
}
