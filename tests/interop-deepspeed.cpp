// DeepSpeed ZeRO fixtures (tests/python/gen_zero_fsdp.py): every case is described, consolidated
// through the planner and executor, and compared bit for bit with its manifests (what
// zero_to_fp32 outputs, and the Adam state keyed by name); a BF16 output is compared with
// PyTorch's own cast; the moments are shown not to be read without with_optimizer.
#include <doctest/doctest.h>

#include <statedict/exec/digest.hpp>
#include <statedict/formats/deepspeed.hpp>
#include <statedict/io/torch_file.hpp>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
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
