// DeepSpeed ZeRO fixtures (tests/python/gen_zero_fsdp.py): every case is described, consolidated
// through the planner and executor, and compared bit for bit with its manifests (what
// zero_to_fp32 outputs, and the Adam state keyed by name); a BF16 output is compared with
// PyTorch's own cast; the moments are shown not to be read without with_optimizer.
#include <doctest/doctest.h>

#include <statedict/exec/digest.hpp>
#include <statedict/formats/deepspeed.hpp>
#include <statedict/formats/registry.hpp>
#include <statedict/io/torch_file.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

using namespace statedict;
namespace ds = statedict::deepspeed;
namespace fs = std::filesystem;

namespace {

const fs::path fixtures = fs::path(STATEDICT_FIXTURE_DIR) / "gen_zero_fsdp";

/// Manifests keep their order (zero_to_fp32's output order).
nlohmann::ordered_json read_json(const fs::path& p) {
  std::ifstream f(p);
  REQUIRE_MESSAGE(f.good(), "missing " << p.string());
  return nlohmann::ordered_json::parse(f);
}

/// Model tensors have no "optim." prefix; optimizer tensors do.
bool in_part(const std::string& name, const std::string& prefix) {
  return prefix.empty() ? name.rfind("optim.", 0) != 0 : name.rfind(prefix, 0) == 0;
}

std::vector<std::string> zero_cases() {
  std::vector<std::string> out;
  for (const auto& c : read_json(fixtures / "zero_fsdp_cases.json")) {
    const std::string name = c.at("case").get<std::string>();
    if (name.rfind("zero", 0) == 0) out.push_back(name);
  }
  return out;
}

std::string read_all_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

/// A non-tensor Value equal to a manifest's JSON value.
bool same_value(const nlohmann::ordered_json& j, const Value& v) {
  if (j.is_null()) return v.is_none();
  if (j.is_boolean()) return v.is_bool() && v.as_bool() == j.get<bool>();
  if (j.is_number_integer()) return v.is_int() && v.as_int() == j.get<std::int64_t>();
  if (j.is_number_float()) return v.is_double() && v.as_double() == j.get<double>();
  if (j.is_string()) return v.is_string() && v.as_string() == j.get<std::string>();
  return false;
}

/// Compares a consolidated checkpoint with a manifest: every manifest tensor is there with its
/// dtype, shape and SHA-256 (aliases through the skeleton), no extra tensor, every value equal.
void compare(const ShardedCheckpoint& c, const std::map<std::string, std::string>& sha, const nlohmann::ordered_json& m,
             const std::string& prefix, bool check_values) {
  std::map<std::string, std::string> alias;
  for (const auto& [a, t] : skeleton_aliases(c.skeleton)) alias[a] = t;
  std::size_t n = 0;
  for (const auto& [name, e] : m.at("tensors").items()) {
    const std::string captured_name = name;
    CAPTURE(captured_name);
    ++n;
    std::string stored = name;
    if (auto it = alias.find(name); it != alias.end()) {
      CHECK(m.at("aliases").value(name, "") == it->second);
      stored = it->second;
    }
    const TensorInfo* t = c.find(stored);
    REQUIRE(t != nullptr);
    CHECK(std::string(statedict::name(t->dtype)) == e.at("dtype").get<std::string>());
    CHECK(t->shape == e.at("shape").get<shape_t>());
    CHECK(sha.at(stored) == e.at("sha256").get<std::string>());
  }
  CHECK(m.at("aliases").size() == [&] {
    std::size_t k = 0;
    for (const auto& [a, t] : alias) k += in_part(a, prefix) ? 1U : 0U;
    return k;
  }());
  std::size_t mine = 0;
  for (const auto& t : c.tensors) mine += in_part(t.name, prefix) ? 1U : 0U;
  CHECK(mine + m.at("aliases").size() == n);
  if (check_values) {
    std::map<std::string, Value> vals;
    for (auto& [k, v] : skeleton_values(c.skeleton)) vals.emplace(k, v);
    for (const auto& [k, j] : m.at("values").items()) {
      const std::string captured_k = k;
      CAPTURE(captured_k);
      REQUIRE(vals.count(k) == 1);
      CHECK(same_value(j, vals.at(k)));
    }
    CHECK(vals.size() == m.at("values").size());
  }
}

class CountingSource final : public ByteSource {
 public:
  explicit CountingSource(std::shared_ptr<const ByteSource> base) : base_(std::move(base)) {}
  [[nodiscard]] const std::string& name() const noexcept override { return base_->name(); }
  [[nodiscard]] std::uint64_t size() const noexcept override { return base_->size(); }
  [[nodiscard]] keep_alive owner() const override { return base_->owner(); }
  void read(std::uint64_t offset, std::span<std::byte> dst) const override {
    {
      std::lock_guard<std::mutex> lock(m_);
      reads_.emplace_back(offset, offset + dst.size());
    }
    base_->read(offset, dst);
  }
  std::vector<std::pair<std::uint64_t, std::uint64_t>> reads() const {
    std::lock_guard<std::mutex> lock(m_);
    return reads_;
  }

 private:
  std::shared_ptr<const ByteSource> base_;
  mutable std::mutex m_;
  mutable std::vector<std::pair<std::uint64_t, std::uint64_t>> reads_;
};

/// Byte ranges of every tensor under a key named exp_avg / exp_avg_sq in a loaded file.
void moment_ranges(const Value& v, const std::byte* base, bool in_moment,
                   std::vector<std::pair<std::uint64_t, std::uint64_t>>& out) {
  if (v.is_tensor()) {
    const TensorView& t = v.as_tensor();
    if (in_moment && t.numel() > 0) {
      const auto off = static_cast<std::uint64_t>(t.data() - base);
      out.emplace_back(off, off + t.extent_bytes());
    }
  } else if (v.is_dict()) {
    for (const auto& [k, x] : v.as_dict())
      moment_ranges(x, base, in_moment || (k.is_string() && (k.as_string() == "exp_avg" || k.as_string() == "exp_avg_sq")), out);
  } else if (v.is_sequence()) {
    for (const auto& x : v.as_list()) moment_ranges(x, base, in_moment, out);
  }
}

/// Runs `python_code` with the fixtures' Python and returns its stdout.
std::string run_python(const std::string& code) {
  const fs::path script = fs::path(STATEDICT_TEST_TMP) / "interop-deepspeed.py";
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

TEST_CASE("deepspeed interop: every ZeRO fixture consolidates bit for bit") {
  const auto cases = zero_cases();
  REQUIRE(cases.size() == 12);
  for (const auto& name : cases) {
    CAPTURE(name);
    const fs::path dir = fixtures / name;
    const ds::detection d = ds::detect(dir);
    REQUIRE(d.found);
    CHECK(d.tag == "global_step2");
    CHECK(d.rule.find("'latest' names tag 'global_step2'") != std::string::npos);

    const ShardedCheckpoint w = ds::describe(dir);
    const auto manifest = read_json(fixtures / (name + ".manifest.json"));
    CHECK(w.format == manifest.at("format").get<std::string>());
    const auto wh = sha256_tensors(w);
    compare(w, {wh.begin(), wh.end()}, manifest, "", false);
    // zero_to_fp32's order: the manifest's, without the tied names.
    std::vector<std::string> want, got;
    for (const auto& [k, e] : manifest.at("tensors").items())
      if (!manifest.at("aliases").contains(k)) want.push_back(k);
    for (const auto& t : w.tensors) got.push_back(t.name);
    CHECK(got == want);

    // The tag folder itself is a checkpoint too.
    const ShardedCheckpoint w2 = ds::describe(dir / "global_step2");
    CHECK(w2.tensors.size() == w.tensors.size());

    ds::options o;
    o.with_optimizer = true;
    const ShardedCheckpoint full = ds::describe(dir, o);
    const auto fh = sha256_tensors(full);
    const std::map<std::string, std::string> all(fh.begin(), fh.end());
    compare(full, all, manifest, "", false);
    compare(full, all, read_json(fixtures / (name + ".optim.manifest.json")), "optim.", true);
  }
}

TEST_CASE("deepspeed interop: --dtype BF16 and F16 are PyTorch's casts of the fp32 result") {
  const std::string py = R"(
import json, sys, hashlib
sys.path.insert(0, ")" + std::string(STATEDICT_SOURCE_DIR) + R"(/tests/python")
from zero_fsdp import standins, reference_consolidate as rc
from zero_fsdp.manifest import tensor_entry
import torch
standins.install()
out = {}
for case in ["zero2_ws2_fp16", "zero3_ws4_bf16_subgroups", "zero1_ws4_bf16"]:
    sd, shared = rc.zero_to_fp32(")" + fixtures.string() + R"(/" + case)
    aliases = {a for a, o in shared}
    out[case] = {k: {dt: tensor_entry(v.to(getattr(torch, dt)))["sha256"] for dt in ("bfloat16", "float16")}
                 for k, v in sd.items() if k not in aliases}
print(json.dumps(out))
)";
  const auto expect = nlohmann::json::parse(run_python(py));
  for (const auto& [name, tensors] : expect.items()) {
    const std::string captured_name = name;
    CAPTURE(captured_name);
    for (auto [dt, key] : {std::pair{dtype::BF16, "bfloat16"}, std::pair{dtype::F16, "float16"}}) {
      ds::options o;
      o.dtype = dt;
      const ShardedCheckpoint c = ds::describe(fixtures / name, o);
      const auto h = sha256_tensors(c);
      REQUIRE(h.size() == tensors.size());
      for (const auto& [n, s] : h) {
        const std::string captured_n = n;
        CAPTURE(captured_n);
        CHECK(c.find(n)->dtype == dt);
        CHECK(s == tensors.at(n).at(key).get<std::string>());
      }
    }
  }
}

TEST_CASE("deepspeed interop: the moments are not read unless asked for") {
  for (const std::string name : {"zero2_ws3_fp32_roundrobin", "zero1_ws3_fp16_elastic", "zero3_ws3_fp32_subgroups"}) {
    CAPTURE(name);
    const ds::detection d = ds::detect(fixtures / name);
    REQUIRE(d.found);
    // Where the moments are in each optim file, from the files themselves.
    std::map<std::string, std::vector<std::pair<std::uint64_t, std::uint64_t>>> moments;
    torch::load_options lo;
    lo.keep_unknown_objects = true;
    for (const auto& p : d.optim_files) {
      const torch::File f = torch::read(p, lo);
      moment_ranges(f.value, f.source->data(), false, moments[p.string()]);
      CHECK(moments[p.string()].size() > 0);
    }
    ShardedCheckpoint c = ds::describe(fixtures / name);
    std::vector<std::shared_ptr<CountingSource>> counted;
    for (auto& s : c.sources) {
      counted.push_back(std::make_shared<CountingSource>(s));
      s = counted.back();
    }
    (void)sha256_tensors(c);
    std::uint64_t from_optim = 0;
    for (const auto& cs : counted) {
      auto it = moments.find(cs->name());
      if (it == moments.end()) continue;
      for (const auto& [b, e] : cs->reads()) {
        from_optim += e - b;
        for (const auto& [mb, me] : it->second) CHECK_FALSE((b < me && mb < e));
      }
    }
    CHECK(from_optim > 0);  // the fp32 partitions were read, through the counting sources
  }
}

TEST_CASE("deepspeed interop: pread mode describes the same bytes without reading the files whole") {
  for (const std::string name : {"zero2_ws8_bf16", "zero3_ws2_fp16"}) {
    CAPTURE(name);
    ds::options o;
    o.with_optimizer = true;
    const auto a = sha256_tensors(ds::describe(fixtures / name, o));
    o.mode = read_mode::pread;
    const ShardedCheckpoint c = ds::describe(fixtures / name, o);
    for (const auto& s : c.sources) CHECK((s->data() == nullptr || s->size() <= 64));  // files not mapped (small converted buffers aside)
    CHECK(sha256_tensors(c) == a);
  }
}

TEST_CASE("deepspeed interop: checkpoints the real DeepSpeed engine wrote consolidate bit for bit") {
  // tests/data/deepspeed-engine: written by DeepSpeed 0.16.5's own engine (CPU, gloo, torch 2.14),
  // with DeepSpeed's zero_to_fp32 output (or, where it refuses, the live engine's fp32 weights) and
  // the live engine's Adam state as the truth; see its README.md.
  const fs::path engine = fs::path(STATEDICT_SOURCE_DIR) / "tests/data/deepspeed-engine";
  std::vector<std::string> cases;
  for (const auto& e : fs::directory_iterator(engine)) {
    const std::string f = e.path().filename().string();
    const std::string suffix = ".manifest.json";
    if (f.size() > suffix.size() && f.compare(f.size() - suffix.size(), suffix.size(), suffix) == 0 &&
        f.find(".optim.") == std::string::npos)
      cases.push_back(f.substr(0, f.size() - suffix.size()));
  }
  std::sort(cases.begin(), cases.end());
  REQUIRE(cases.size() >= 12);
  std::size_t stage3 = 0, bf16_optimizer = 0;
  for (const auto& name : cases) {
    CAPTURE(name);
    const fs::path dir = engine / name;
    const auto manifest = read_json(engine / (name + ".manifest.json"));
    ds::options o;
    o.with_optimizer = true;
    // The BF16_Optimizer's files, which zero_to_fp32 refuses: the truth is the live engine's
    // module (buffers and frozen parameters in bf16, as saved) and fp32 masters. statedict reads
    // them as stage 1 (frozen parameters from module) with zero_to_fp32's `.float()` of buffers,
    // exact for bf16 values: compared in the module's dtype.
    const bool refused = manifest.contains("zero_to_fp32_error");
    o.frozen_from_module = refused;
    ShardedCheckpoint full = ds::describe(dir, o);
    CHECK(full.format == (refused ? std::string("deepspeed_zero1") : manifest.at("format").get<std::string>()));
    stage3 += full.format == "deepspeed_zero3" ? 1U : 0U;
    bf16_optimizer += full.metadata.count("deepspeed.optimizer") ? 1U : 0U;
    if (refused) {
      CHECK(full.metadata.at("deepspeed.optimizer") == "BF16_Optimizer");
      for (auto& t : full.tensors)
        if (manifest.at("tensors").contains(t.name)) t.dtype = *dtype_from_name(manifest.at("tensors").at(t.name).at("dtype").get<std::string>());
    }
    const auto fh = sha256_tensors(full);
    const std::map<std::string, std::string> all(fh.begin(), fh.end());
    compare(full, all, manifest, "", false);
    // zero_to_fp32's order: the manifest's, without the tied names.
    std::vector<std::string> want, got;
    for (const auto& [k, e] : manifest.at("tensors").items())
      if (!manifest.at("aliases").contains(k)) want.push_back(k);
    for (const auto& t : full.tensors)
      if (!in_part(t.name, "optim.")) got.push_back(t.name);
    CHECK(got == want);
    const fs::path om = engine / (name + ".optim.manifest.json");
    if (fs::exists(om)) compare(full, all, read_json(om), "optim.", false);
  }
  CHECK(stage3 >= 4);
  CHECK(bf16_optimizer >= 1);
}

namespace {

/// Two trees hold the same data: dicts with the same keys (in any order; the engine's state dicts
/// vary the order of exp_avg and exp_avg_sq between processes), the same values and tensors
/// (dtype, shape, elements); keys named in `ignore` are skipped at every depth.
void same_tree(const Value& a, const Value& b, const std::set<std::string>& ignore, const std::string& path) {
  CAPTURE(path);
  if (a.is_tensor() || b.is_tensor()) {
    REQUIRE(a.is_tensor());
    REQUIRE(b.is_tensor());
    CHECK(a.as_tensor().dtype() == b.as_tensor().dtype());
    CHECK(a.as_tensor().shape() == b.as_tensor().shape());
    CHECK(a == b);
    return;
  }
  if (a.is_dict() && b.is_dict()) {
    std::set<std::string> ka, kb;
    for (const auto& [k, v] : a.as_dict())
      if (!ignore.count(k.str())) ka.insert(k.str());
    for (const auto& [k, v] : b.as_dict())
      if (!ignore.count(k.str())) kb.insert(k.str());
    CHECK(ka == kb);
    for (const auto& [k, v] : a.as_dict())
      if (!ignore.count(k.str()))
        if (const Value* w = b.as_dict().find(k)) same_tree(v, *w, ignore, path + "." + k.str());
    return;
  }
  if (a.is_sequence() && b.is_sequence()) {
    REQUIRE(a.as_list().size() == b.as_list().size());
    for (std::size_t i = 0; i < a.as_list().size(); ++i) same_tree(a.as_list()[i], b.as_list()[i], ignore, path + "." + std::to_string(i));
    return;
  }
  if (a.is_object() && b.is_object() && a.as_object().qualified() == b.as_object().qualified()) {
    const Object &x = a.as_object(), &y = b.as_object();
    same_tree(Value::list(x.args), Value::list(y.args), ignore, path + ".args");
    same_tree(Value::list(x.state), Value::list(y.state), ignore, path + ".state");
    return;
  }
  CHECK(a == b);
}

}  // namespace

TEST_CASE("deepspeed writer: a real engine checkpoint resharded is what the engine itself saved for the new world size") {
  // reshard_<case>_to<M>: the engine's own save at M ranks after loading <case> (N ranks) through
  // DeepSpeed's universal checkpoint (tests/data/deepspeed-engine/README.md).
  const fs::path engine = fs::path(STATEDICT_SOURCE_DIR) / "tests/data/deepspeed-engine";
  std::size_t n = 0;
  for (const auto& e : fs::directory_iterator(engine)) {
    const std::string f = e.path().filename().string();
    if (f.rfind("reshard_", 0) != 0 || !e.is_directory()) continue;
    const auto to = f.rfind("_to");
    const std::string source = f.substr(8, to - 8);
    const auto M = static_cast<std::uint32_t>(std::stoul(f.substr(to + 3)));
    CAPTURE(f);
    ++n;
    ds::options o;
    o.with_optimizer = true;
    o.frozen_from_module = true;  // stage 1 keeps frozen parameters only in module
    const ShardedCheckpoint src = ds::describe(engine / source, o);
    const fs::path out = fs::path(STATEDICT_TEST_TMP) / ("ds-write-" + f);
    ds::write_options w;
    w.world_size = M;
    const auto written = ds::write(src, out, w);
    CHECK(written.back() == "latest");
    // File for file, every value and tensor as the engine wrote it (the config is the resumed
    // run's own, the stage enum is pickled by value here and by name by the engine's Python).
    const ds::detection mine = ds::detect(out), theirs = ds::detect(engine / f);
    REQUIRE(mine.found);
    REQUIRE(mine.model_files.size() == theirs.model_files.size());
    REQUIRE(mine.optim_files.size() == theirs.optim_files.size());
    const std::set<std::string> ignore{"ds_config", "zero_stage"};
    for (std::size_t i = 0; i < mine.optim_files.size(); ++i) {
      CHECK(mine.optim_files[i].filename() == theirs.optim_files[i].filename());
      same_tree(torch::load(mine.optim_files[i]), torch::load(theirs.optim_files[i]), ignore, mine.optim_files[i].filename().string());
    }
    for (std::size_t i = 0; i < mine.model_files.size(); ++i) {
      CHECK(mine.model_files[i].filename() == theirs.model_files[i].filename());
      same_tree(torch::load(mine.model_files[i]), torch::load(theirs.model_files[i]), ignore, mine.model_files[i].filename().string());
    }
    // And read back, it consolidates to the engine's state.
    const auto a = sha256_tensors(ds::describe(out, o)), b = sha256_tensors(ds::describe(engine / f, o));
    CHECK(std::map<std::string, std::string>(a.begin(), a.end()) == std::map<std::string, std::string>(b.begin(), b.end()));
  }
  CHECK(n >= 3);
}

TEST_CASE("deepspeed writer: every real engine checkpoint written for 1 to 4 ranks reads back as the same state") {
  // Round-robin order, two param groups, several ZeRO-3 sub-groups and the BF16_Optimizer have no
  // engine truth for a reshard (DeepSpeed's universal checkpoint gets the first wrong and refuses
  // the second and third at stage 3): the rules are checked by the round trip.
  const fs::path engine = fs::path(STATEDICT_SOURCE_DIR) / "tests/data/deepspeed-engine";
  std::size_t n = 0;
  for (const auto& e : fs::directory_iterator(engine)) {
    const std::string f = e.path().filename().string();
    if (!e.is_directory() || f.rfind("reshard_", 0) == 0 || !fs::exists(e.path() / "latest")) continue;
    ds::options o;
    o.with_optimizer = true;
    o.frozen_from_module = true;
    const ShardedCheckpoint src = ds::describe(e.path(), o);
    const auto want_sha = sha256_tensors(src);
    const std::map<std::string, std::string> want(want_sha.begin(), want_sha.end());
    // Values, with each group's parameter names as a set: a round-robin checkpoint lists them in
    // the round-robin order of its own world size.
    auto values = [](const ShardedCheckpoint& c) {
      std::map<std::string, Value> out;
      std::map<std::string, std::multiset<std::string>> names;
      for (auto& [k, v] : skeleton_values(c.skeleton)) {
        const auto at = k.find(".params.");
        if (k.rfind("optim.param_groups.", 0) == 0 && at != std::string::npos && v.is_string()) names[k.substr(0, at)].insert(v.as_string());
        else out.emplace(k, v);
      }
      for (auto& [g, s] : names) {
        List l;
        for (const auto& x : s) l.emplace_back(x);
        out.emplace(g + ".params", Value::list(std::move(l)));
      }
      return out;
    };
    const std::map<std::string, Value> want_values = values(src);
    for (std::uint32_t M : {1U, 3U, 4U}) {
      CAPTURE(f);
      CAPTURE(M);
      ++n;
      const fs::path out = fs::path(STATEDICT_TEST_TMP) / ("ds-roundtrip-" + f + "-" + std::to_string(M));
      ds::write_options w;
      w.world_size = M;
      (void)ds::write(src, out, w);
      const ShardedCheckpoint back = ds::describe(out, o);
      CHECK(back.format == src.format);
      CHECK(back.metadata.at("deepspeed.world_size") == std::to_string(M));
      CHECK(back.metadata.count("deepspeed.optimizer") == src.metadata.count("deepspeed.optimizer"));
      const auto got_sha = sha256_tensors(back);
      CHECK(std::map<std::string, std::string>(got_sha.begin(), got_sha.end()) == want);
      CHECK(values(back) == want_values);
    }
  }
  CHECK(n >= 36);
}

TEST_CASE("deepspeed writer: the universal checkpoint is what ds_to_universal.py makes of the same files") {
  // universal_zero2_ws2_fp32: DeepSpeed's ds_to_universal.py --inject_missing_state output for
  // zero2_ws2_fp32 (tests/data/deepspeed-engine/README.md).
  const fs::path engine = fs::path(STATEDICT_SOURCE_DIR) / "tests/data/deepspeed-engine";
  const fs::path truth = engine / "universal_zero2_ws2_fp32";
  ds::options o;
  o.with_optimizer = true;
  const ShardedCheckpoint src = ds::describe(engine / "zero2_ws2_fp32", o);
  const fs::path out = fs::path(STATEDICT_TEST_TMP) / "ds-universal";
  ds::write_options w;
  w.world_size = 2;
  w.universal = true;
  const auto written = ds::write(src, out, w);
  CHECK(written.back() == "latest_universal");
  auto files = [](const fs::path& root) {
    std::set<std::string> s;
    for (const auto& e : fs::recursive_directory_iterator(root))
      if (e.is_regular_file()) s.insert(fs::relative(e.path(), root).string());
    return s;
  };
  const auto mine = files(out), theirs = files(truth);
  CHECK(mine == theirs);
  CHECK(mine.count("global_step2/zero/embed.weight/exp_avg_sq.pt") == 1);
  CHECK(read_all_text(out / "latest_universal") == read_all_text(truth / "latest_universal"));
  for (const auto& f : mine) {
    if (f == "latest_universal" || !theirs.count(f)) continue;
    same_tree(torch::load(out / f), torch::load(truth / f), {"ds_config", "zero_stage"}, f);
  }
  // The same for a ZeRO-3 checkpoint: flat per-parameter tensors, no step file, rank 0's state.
  const fs::path out3 = fs::path(STATEDICT_TEST_TMP) / "ds-universal3";
  w.world_size = 3;
  (void)ds::write(ds::describe(engine / "zero3_ws3_bf16", o), out3, w);
  const Value fp32 = torch::load(out3 / "global_step2/zero/blocks.0.fc1.weight/fp32.pt");
  REQUIRE(fp32.is_tensor());
  CHECK(fp32.as_tensor().shape() == shape_t{37 * 24});
  CHECK_FALSE(fs::exists(out3 / "global_step2/zero/blocks.0.fc1.weight/step.pt"));
  CHECK(fs::exists(out3 / "global_step2/zero_pp_rank_2_mp_rank_00_model_states.pt"));
  const Value common = torch::load(out3 / "global_step2/zero/optimizer_state.pt");
  CHECK(common.as_dict().contains(Key(std::string("param_groups"))));
  CHECK(common.as_dict().contains(Key(std::string("fp32_flat_groups"))));
}

TEST_CASE("deepspeed writer: weights with a fresh optimizer are what the engine saves before its first step") {
  // fresh_<case>: the engine's save_checkpoint right after deepspeed.initialize from the weights of
  // fresh_model.pt and a freshly constructed torch AdamW (tests/data/deepspeed-engine/README.md,
  // make_fresh.py); the optimizer spec each was made with is in fresh_<case>.losses.json.
  const fs::path engine = fs::path(STATEDICT_SOURCE_DIR) / "tests/data/deepspeed-engine";
  std::size_t n = 0;
  for (const auto& e : fs::directory_iterator(engine)) {
    const std::string f = e.path().filename().string();
    if (f.rfind("fresh_zero", 0) != 0 || !e.is_directory()) continue;
    CAPTURE(f);
    ++n;
    // fresh_zero<S>_ws<M>_<dtype>
    const int stage = f[10] - '0';
    const auto M = static_cast<std::uint32_t>(std::stoul(f.substr(f.find("_ws") + 3)));
    const bool bf16 = f.size() > 5 && f.compare(f.size() - 5, 5, "_bf16") == 0;
    formats::open_options how;
    if (bf16) how.dtype = dtype::BF16;  // the engine's bf16 module: the weights rounded, then its masters
    const ShardedCheckpoint src = formats::open(engine / "fresh_model.pt", how).checkpoint;
    ds::write_options w;
    w.world_size = M;
    w.zero_stage = stage;
    w.fresh = ds::parse_fresh_optimizer(read_json(engine / (f + ".losses.json")).at("optimizer").get<std::string>());
    w.fresh->frozen = {"frozen\\..*"};
    w.fresh->buffers = {"pos"};
    const fs::path out = fs::path(STATEDICT_TEST_TMP) / ("ds-" + f);
    const auto written = ds::write(src, out, w);
    CHECK(written.back() == "latest");
    CHECK(read_all_text(out / "latest") == read_all_text(e.path() / "latest"));
    const ds::detection mine = ds::detect(out), theirs = ds::detect(e.path());
    REQUIRE(mine.found);
    REQUIRE(mine.model_files.size() == theirs.model_files.size());
    REQUIRE(mine.optim_files.size() == theirs.optim_files.size());
    // A first ZeRO-3 save holds uninitialised memory in the padding of the last rank's fp32
    // partitions (README.md, "Things seen"): those are compared by shape, and their values
    // through the reader, which skips padding.
    std::set<std::string> ignore{"ds_config", "zero_stage"};
    if (stage == 3) ignore.insert("fp32_flat_groups");
    for (std::size_t i = 0; i < mine.optim_files.size(); ++i) {
      CHECK(mine.optim_files[i].filename() == theirs.optim_files[i].filename());
      const Value a = torch::load(mine.optim_files[i]), b = torch::load(theirs.optim_files[i]);
      same_tree(a, b, ignore, mine.optim_files[i].filename().string());
      if (stage == 3) {
        const List& fa = a.as_dict().at("optimizer_state_dict").as_dict().at("fp32_flat_groups").as_list();
        const List& fb = b.as_dict().at("optimizer_state_dict").as_dict().at("fp32_flat_groups").as_list();
        REQUIRE(fa.size() == fb.size());
        for (std::size_t k = 0; k < fa.size(); ++k) CHECK(fa[k].as_tensor().shape() == fb[k].as_tensor().shape());
      }
    }
    for (std::size_t i = 0; i < mine.model_files.size(); ++i) {
      CHECK(mine.model_files[i].filename() == theirs.model_files[i].filename());
      same_tree(torch::load(mine.model_files[i]), torch::load(theirs.model_files[i]), ignore, mine.model_files[i].filename().string());
    }
    ds::options o;
    o.with_optimizer = true;
    o.frozen_from_module = true;  // stage 1 keeps frozen parameters only in module
    const ShardedCheckpoint back = ds::describe(out, o), truth = ds::describe(e.path(), o);
    const auto a = sha256_tensors(back), b = sha256_tensors(truth);
    CHECK(std::map<std::string, std::string>(a.begin(), a.end()) == std::map<std::string, std::string>(b.begin(), b.end()));
    CHECK(back.tensors.size() == 18);  // 15 trained, the buffer, 2 frozen: no optimizer state yet
  }
  CHECK(n >= 4);
}
