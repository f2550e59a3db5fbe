// Shared helpers of the tests/cli-*.cpp end-to-end tests of the `statedict` tool: run a program
// (no shell) capturing stdout, stderr and its exit code; fresh scratch directories; the fixture
// manifests of tests/python/gen_*.py; `inspect --json` output compared with a manifest; the safetensors
// header of a file; the batched PyTorch oracle tests/cli_oracle.py.
#pragma once

#include <doctest/doctest.h>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <statedict/statedict.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.hpp"

extern char** environ;  // NOLINT

namespace cli_test {

namespace fs = std::filesystem;
using json = nlohmann::json;

inline const fs::path fixture_root = STATEDICT_FIXTURE_DIR;
inline const std::string cli_path = STATEDICT_CLI;
inline const std::string python = STATEDICT_PYTHON;
inline const fs::path source_dir = STATEDICT_SOURCE_DIR;

struct run_result {
  int code = -1;  ///< exit status; 128 + signal when killed by one
  std::string out, err;
  [[nodiscard]] std::string describe() const {
    return "exit " + std::to_string(code) + "\n--- stdout:\n" + out.substr(0, 4000) + "\n--- stderr:\n" + err.substr(0, 4000);
  }
};

using statedict_test::read_all;
using statedict_test::write_all;
/// read_all and write_all (test_util.hpp) under the names the command-line tests use.
inline std::string read_file(const fs::path& p) { return read_all(p); }
inline void write_file(const fs::path& p, const std::string& s) { write_all(p, s); }

/// A fresh, empty directory under STATEDICT_TEST_TMP, unique to this process.
inline fs::path scratch(const std::string& name) { return statedict_test::fresh_dir("cli-" + std::to_string(::getpid()), name); }

/// Removes this process's scratch tree (call at the end of a test case that succeeded).
inline void drop_scratch(const std::string& name) {
  std::error_code ec;
  fs::remove_all(fs::path(STATEDICT_TEST_TMP) / ("cli-" + std::to_string(::getpid())) / name, ec);
}

/// Runs argv[0] (a path) with argv, stdin from /dev/null, stdout and stderr into files; no shell.
inline run_result run(const std::vector<std::string>& argv) {
  static int counter = 0;
  const fs::path dir = fs::path(STATEDICT_TEST_TMP) / ("cli-" + std::to_string(::getpid())) / "_run";
  fs::create_directories(dir);
  const std::string tag = std::to_string(counter++);
  const fs::path out = dir / ("out" + tag), err = dir / ("err" + tag);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int rc = ::posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  run_result r;
  if (rc != 0) {
    r.err = "posix_spawn " + argv[0] + ": " + std::strerror(rc);
    return r;
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = read_file(out);
  r.err = read_file(err);
  std::error_code ec;
  fs::remove(out, ec);
  fs::remove(err, ec);
  return r;
}

/// `statedict ARGS...`
inline run_result cli(std::vector<std::string> args) {
  args.insert(args.begin(), cli_path);
  return run(args);
}

/// The lines of s without empty ones.
inline std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> v;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) v.push_back(l);
  return v;
}

inline json load_json(const fs::path& p) {
  std::ifstream f(p);
  REQUIRE_MESSAGE(f.good(), "cannot read " << p.string() << " (fixtures: tests/python/generate_all.sh)");
  return json::parse(f);
}

/// One fixture case: its manifest, the checkpoint path (a file or a directory) and, for ZeRO and
/// OLMo cases, the optimizer manifest.
struct fixture {
  std::string generator;  ///< "gen_torch_files"
  std::string name;       ///< case name
  fs::path manifest_path;
  json manifest;
  fs::path path;
  std::optional<json> optim;
  [[nodiscard]] std::string label() const { return generator + "/" + name; }
  [[nodiscard]] std::string format() const { return manifest.value("format", ""); }
  [[nodiscard]] bool sharded() const {
    const std::string f = format();
    return f == "dcp" || f == "sharded_tensor_ranks" || f.rfind("deepspeed_zero", 0) == 0 || f == "olmo_local_sharded";
  }
};

/// Every `<case>.manifest.json` of fixture generator `generator` (sorted by case name).
inline std::vector<fixture> fixtures(const std::string& generator) {
  const fs::path dir = fixture_root / generator;
  std::vector<fixture> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    const std::string suffix = ".manifest.json";
    if (n.size() <= suffix.size() || n.compare(n.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    if (n.find(".optim.manifest.json") != std::string::npos) continue;
    fixture f;
    f.generator = generator;
    f.name = n.substr(0, n.size() - suffix.size());
    f.manifest_path = e.path();
    f.manifest = load_json(e.path());
    f.path = dir / f.manifest.value("path", f.name);
    // OLMo checkpoints: the step folder is the checkpoint.
    if (f.format() == "olmo_local_sharded" && fs::is_directory(f.path / "step2")) f.path /= "step2";
    // Partial overlaps (two views of an unsaved base, neither containing the other) are stored as
    // two tensors by design (docs/flatten.md, "what is tied", rule 3), so they are not expected tied.
    if (f.manifest.contains("aliases") && (f.name == "tied" || f.name == "legacy_tied")) {
      f.manifest["untied_by_design"] = json::object();
      for (const char* a : {"second"})
        if (f.manifest["aliases"].contains(a)) {
          f.manifest["untied_by_design"][a] = f.manifest["aliases"][a];
          f.manifest["aliases"].erase(a);
        }
    }
    const fs::path om = dir / (f.name + ".optim.manifest.json");
    if (fs::exists(om)) f.optim = load_json(om);
    out.push_back(std::move(f));
  }
  REQUIRE_MESSAGE(!out.empty(), "no manifests in " << dir.string() << " (fixtures: tests/python/generate_all.sh)");
  std::sort(out.begin(), out.end(), [](const fixture& a, const fixture& b) { return a.name < b.name; });
  return out;
}

/// Dtypes PyTorch 1.13 cannot load (so its torch.load is no oracle for them).
inline bool torch113_has(const std::string& dtype) {
  static const std::set<std::string> no{"U16", "U32", "U64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ",
                                        "F4", "F6_E2M3", "F6_E3M2", "F4_X2", "F6_E2M3_X4", "F6_E3M2_X4", "C32",
                                        "BITS8", "BITS16", "BITS1X8", "BITS2X4", "BITS4X2"};
  return !no.count(dtype);
}

/// The manifest as statedict names things: a safetensors F4 / F6_* tensor (its last dimension
/// counting values) is an F4_X2 / F6_*_X4 tensor of 2 / 4 values per element, as statedict (and,
/// for F4, PyTorch's float4_e2m1fn_x2) holds it.
inline json statedict_view(json m) {
  for (auto& [n, t] : m["tensors"].items()) {
    const std::string d = t.value("dtype", "");
    const int per = d == "F4" ? 2 : (d == "F6_E2M3" || d == "F6_E3M2") ? 4 : 1;
    if (per == 1 || t["shape"].empty()) continue;
    t["dtype"] = d == "F4" ? "F4_X2" : d + "_X4";
    t["shape"].back() = t["shape"].back().get<std::int64_t>() / per;
  }
  return m;
}
inline bool torch113_loads(const json& manifest) {
  for (const auto& [n, t] : manifest["tensors"].items())
    if (!torch113_has(t["dtype"].get<std::string>())) return false;
  return true;
}

// ---------------------------------------------------------------------------------------------
// inspect --json against a manifest

/// A manifest value (tests/python/README.md encoding) against `inspect --json`'s encoding of the
/// same leaf (examples/statedict/verify.hpp value_json: non-finite floats as "nan"/"inf"/"-inf").
/// Type-aware: 1 is not 1.0, true is not 1; -0.0 keeps its sign.
inline bool value_matches(const json& want, const json& got) {
  if (want.is_object() && want.contains("float")) return got.is_string() && got.get<std::string>() == want.value("repr", "?");
  if (want.is_number_float()) {
    if (!got.is_number_float()) return false;
    const double a = want.get<double>(), b = got.get<double>();
    return a == b && std::signbit(a) == std::signbit(b);
  }
  if (want.is_number_integer()) return got.is_number_integer() && got == want;
  return got == want;  // null, bool, string, {"bytes_hex": ...}
}

struct compare_options {
  bool hashes = true;
  bool values = true;
  bool aliases = true;
  /// Manifest values whose encoding inspect cannot reproduce ({"int": ...} beyond int64,
  /// {"object": ...}) are compared by presence only.
  bool lenient_objects = true;
};

/// Problems (empty when equal) between inspect's JSON and a manifest: the same tensor names, each
/// with the same dtype, shape and sha256; the same values; every manifest alias listed.
inline std::vector<std::string> compare_with_manifest(const json& got, const json& want, const compare_options& o = {}) {
  std::vector<std::string> p;
  const json& gt = got.at("tensors");
  const json& wt = want.at("tensors");
  for (const auto& [n, w] : wt.items()) {
    if (!gt.contains(n)) {
      p.push_back("tensor '" + n + "' missing");
      continue;
    }
    const json& g = gt[n];
    if (g.value("dtype", "") != w["dtype"]) p.push_back("tensor '" + n + "': dtype " + g.value("dtype", "?") + ", want " + w["dtype"].get<std::string>());
    if (g["shape"] != w["shape"]) p.push_back("tensor '" + n + "': shape " + g["shape"].dump() + ", want " + w["shape"].dump());
    if (o.hashes && g.value("sha256", "") != w["sha256"]) p.push_back("tensor '" + n + "': sha256 differs");
  }
  for (const auto& [n, g] : gt.items())
    if (!wt.contains(n)) p.push_back("tensor '" + n + "' unexpected");
  if (o.values && want.contains("values")) {
    const json& gv = got.contains("values") ? got["values"] : json::object();
    for (const auto& [n, w] : want["values"].items()) {
      if (!gv.contains(n)) {
        p.push_back("value '" + n + "' missing");
        continue;
      }
      if (o.lenient_objects && w.is_object() && (w.contains("int") || w.contains("object"))) continue;
      if (!value_matches(w, gv[n])) p.push_back("value '" + n + "': " + gv[n].dump() + ", want " + w.dump());
    }
    for (const auto& [n, g] : gv.items())
      if (!want["values"].contains(n)) p.push_back("value '" + n + "' unexpected");
  }
  if (o.aliases && want.contains("aliases")) {
    const json& ga = got.contains("aliases") ? got["aliases"] : json::object();
    for (const auto& [n, w] : want["aliases"].items())
      if (!ga.contains(n)) p.push_back("alias '" + n + "' -> '" + w.get<std::string>() + "' not listed as tied");
  }
  return p;
}

/// `statedict inspect --json --hash PATH [extra...]`, parsed; a failing run fails the check.
inline json inspect(const fs::path& path, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args{"inspect", "--json", "--hash", path.string()};
  args.insert(args.end(), extra.begin(), extra.end());
  const run_result r = cli(args);
  INFO("statedict inspect " << path.string() << ": " << r.describe());
  REQUIRE(r.code == 0);
  return json::parse(r.out);
}

/// Joins problems for a message.
inline std::string join(const std::vector<std::string>& v, std::size_t max = 12) {
  std::string s;
  for (std::size_t i = 0; i < v.size() && i < max; ++i) s += "\n  " + v[i];
  if (v.size() > max) s += "\n  ... " + std::to_string(v.size() - max) + " more";
  return s;
}

/// A manifest reduced to the tensors and values under `prefix.` (or equal to it).
inline json manifest_subset(const json& m, const std::string& prefix) {
  auto keep = [&](const std::string& n) { return n == prefix || n.rfind(prefix + ".", 0) == 0; };
  json out = m;
  out["tensors"] = json::object();
  out["values"] = json::object();
  out["aliases"] = json::object();
  for (const auto& [n, t] : m["tensors"].items())
    if (keep(n)) out["tensors"][n] = t;
  if (m.contains("values"))
    for (const auto& [n, v] : m["values"].items())
      if (keep(n)) out["values"][n] = v;
  if (m.contains("aliases"))
    for (const auto& [n, a] : m["aliases"].items())
      if (keep(n) && keep(a.get<std::string>())) out["aliases"][n] = a;
  return out;
}

// ---------------------------------------------------------------------------------------------
// safetensors files

struct st_entry {
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;  ///< absolute file offsets of the data
};

/// The tensors of a .safetensors file with absolute byte offsets.
inline std::map<std::string, st_entry> safetensors_entries(const fs::path& p) {
  const std::string bytes = read_file(p);
  REQUIRE(bytes.size() >= 8);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
  REQUIRE(8 + n <= bytes.size());
  const json h = json::parse(bytes.substr(8, n));
  std::map<std::string, st_entry> out;
  for (const auto& [k, v] : h.items()) {
    if (k == "__metadata__") continue;
    st_entry e;
    e.dtype = v["dtype"];
    e.shape = v["shape"].get<std::vector<std::int64_t>>();
    e.begin = 8 + n + v["data_offsets"][0].get<std::uint64_t>();
    e.end = 8 + n + v["data_offsets"][1].get<std::uint64_t>();
    out[k] = e;
  }
  return out;
}

/// The safetensors `__metadata__` of a file (empty object when it has none).
inline json safetensors_metadata(const fs::path& p) {
  const std::string bytes = read_file(p);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
  const json h = json::parse(bytes.substr(8, n));
  return h.contains("__metadata__") ? h["__metadata__"] : json::object();
}

// ---------------------------------------------------------------------------------------------
// The PyTorch oracle (tests/cli_oracle.py): many checks in one Python process.

/// Runs tests/cli_oracle.py on a job list; returns one list of problems per job (in order).
/// Jobs: {"kind": "torch", "file", "manifest"} (torch.load + torch_check.check_torch with
/// --check-aliases), {"kind": "safetensors", "file", "manifest"} (torch_check's strict reader),
/// {"kind": "dcp", "dir", "manifest", "world_size"} (dcp_load_check.py's checks and loader),
/// {"kind": "cast", "orig", "cast", "dtype"} (torch.load both; `cast` must equal
/// orig.to(dtype) for floating tensors and orig for the rest).
inline std::vector<std::vector<std::string>> oracle(const json& jobs, const fs::path& workdir) {
  const fs::path in = workdir / "oracle_jobs.json", out = workdir / "oracle_results.json";
  write_file(in, jobs.dump());
  std::error_code ec;
  fs::remove(out, ec);
  const run_result r = run({python, (source_dir / "tests" / "cli_oracle.py").string(), in.string(), out.string()});
  INFO("cli_oracle.py: " << r.describe());
  REQUIRE(r.code == 0);
  const json res = load_json(out);
  REQUIRE(res.size() == jobs.size());
  std::vector<std::vector<std::string>> v;
  for (const auto& x : res) v.push_back(x.get<std::vector<std::string>>());
  return v;
}

}  // namespace cli_test
