// Interop with real PyTorch 1.13 (STATEDICT_PYTHON): our reader against every torch.save fixture
// (values bit for bit, aliases, _metadata, archive names, the malicious pickle), and PyTorch
// loading what our writer produced (equal values, tied weights still tied, weights_only where
// PyTorch accepts its own file that way, state dicts that load into modules and optimizers).
#include <doctest/doctest.h>

#include <statedict/core/sha256.hpp>
#include <statedict/io/torch_file.hpp>
#include <statedict/formats/torch.hpp>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

using namespace statedict;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

const fs::path fixtures = fs::path(STATEDICT_FIXTURE_DIR) / "gen_torch_files";

fs::path out_dir() {
  const fs::path d = fs::path(STATEDICT_TEST_TMP) / "interop-torch";
  fs::create_directories(d);
  return d;
}

json load_json(const fs::path& p) {
  std::ifstream f(p);
  return json::parse(f);
}

struct Fixture {
  std::string name;
  fs::path file;
  json manifest;
};

std::vector<Fixture> all_fixtures() {
  std::vector<Fixture> out;
  REQUIRE_MESSAGE(fs::is_directory(fixtures), "fixtures missing: " << fixtures.string());
  for (const auto& e : fs::directory_iterator(fixtures)) {
    const std::string n = e.path().filename().string();
    const std::string suffix = ".manifest.json";
    if (n.size() <= suffix.size() || n.compare(n.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    Fixture f;
    f.name = n.substr(0, n.size() - suffix.size());
    f.manifest = load_json(e.path());
    f.file = fixtures / f.manifest.at("path").get<std::string>();
    out.push_back(std::move(f));
  }
  std::sort(out.begin(), out.end(), [](const Fixture& a, const Fixture& b) { return a.name < b.name; });
  REQUIRE(out.size() >= 20);
  return out;
}

/// Decimal digits of a little-endian two's complement integer.
std::string decimal(std::vector<std::uint8_t> b) {
  const bool neg = !b.empty() && (b.back() & 0x80U);
  if (neg) {  // magnitude = ~b + 1
    unsigned carry = 1;
    for (auto& x : b) {
      const unsigned v = static_cast<unsigned>(static_cast<std::uint8_t>(~x)) + carry;
      x = static_cast<std::uint8_t>(v & 0xffU);
      carry = v >> 8;
    }
  }
  std::string digits;
  std::vector<std::uint8_t> big(b.rbegin(), b.rend());  // big-endian
  while (std::any_of(big.begin(), big.end(), [](std::uint8_t x) { return x != 0; })) {
    unsigned rem = 0;
    for (auto& x : big) {
      const unsigned cur = rem * 256 + x;
      x = static_cast<std::uint8_t>(cur / 10);
      rem = cur % 10;
    }
    digits += static_cast<char>('0' + rem);
  }
  if (digits.empty()) digits = "0";
  if (neg) digits += '-';
  return {digits.rbegin(), digits.rend()};
}

/// A non-tensor leaf as the manifest encodes it (tests/python/README.md).
json leaf_json(const Value& v) {
  switch (v.kind()) {
    case value_kind::none: return nullptr;
    case value_kind::boolean: return v.as_bool();
    case value_kind::integer: return v.as_int();
    case value_kind::string: return v.as_string();
    case value_kind::floating: {
      const double d = v.as_double();
      if (std::isfinite(d)) return d;
      return json{{"float", nullptr}, {"repr", std::isnan(d) ? "nan" : (d > 0 ? "inf" : "-inf")}};
    }
    case value_kind::bytes: {
      static const char* hx = "0123456789abcdef";
      std::string s;
      for (auto c : v.as_bytes().data) {
        s += hx[c >> 4];
        s += hx[c & 15];
      }
      return json{{"bytes_hex", s}};
    }
    case value_kind::object: {
      const Object& o = v.as_object();
      if (o.qualified() == "builtins.int" && o.args.size() == 1 && o.args[0].is_bytes()) return json{{"int", decimal(o.args[0].as_bytes().data)}};
      return json{{"object", o.qualified()}};
    }
    default: return "?";
  }
}

/// Type-aware equality (1 != 1.0, true != 1, -0.0 != 0.0); objects compare by class only.
bool same(const json& a, const json& b) {
  if (a.is_object() && b.is_object() && a.contains("object") && b.contains("object")) return a["object"] == b["object"];
  // nlohmann parses non-negative integers as unsigned: an int is an int either way.
  if (a.is_number_integer() && b.is_number_integer())
    return a.is_number_unsigned() == b.is_number_unsigned() ? a == b
                                                          : (a.is_number_unsigned() ? b.get<std::int64_t>() >= 0 && a.get<std::uint64_t>() == b.get<std::uint64_t>()
                                                                                    : a.get<std::int64_t>() >= 0 && a.get<std::uint64_t>() == b.get<std::uint64_t>());
  if (a.type() != b.type()) return false;
  if (a.is_number_float()) return std::bit_cast<std::uint64_t>(a.get<double>()) == std::bit_cast<std::uint64_t>(b.get<double>());
  if (a.is_object()) {
    if (a.size() != b.size()) return false;
    for (auto it = a.begin(); it != a.end(); ++it)
      if (!b.contains(it.key()) || !same(it.value(), b[it.key()])) return false;
    return true;
  }
  if (a.is_array()) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
      if (!same(a[i], b[i])) return false;
    return true;
  }
  return a == b;
}

/// Plain dicts as JSON with str keys (the manifest's dict_attributes).
json plain_json(const Value& v) {
  if (v.is_dict()) {
    json o = json::object();
    for (const auto& [k, x] : v.as_dict()) o[k.str()] = plain_json(x);
    return o;
  }
  if (v.is_sequence()) {
    json a = json::array();
    for (const auto& x : v.as_list()) a.push_back(plain_json(x));
    return a;
  }
  return leaf_json(v);
}

struct Leaves {
  std::vector<std::pair<std::string, TensorView>> tensors;
  std::vector<std::pair<std::string, const Value*>> values;
};

/// The manifest's naming: str(key) / index joined with '.', tensors and non-containers are
/// leaves, empty containers have none.
void leaves(const Value& v, const std::string& name, Leaves& out) {
  auto child = [&](const std::string& k) { return name.empty() ? k : name + "." + k; };
  if (v.is_tensor()) out.tensors.emplace_back(name, v.as_tensor());
  else if (v.is_dict())
    for (const auto& [k, x] : v.as_dict()) leaves(x, child(k.str()), out);
  else if (v.is_sequence())
    for (std::size_t i = 0; i < v.as_list().size(); ++i) leaves(v.as_list()[i], child(std::to_string(i)), out);
  else out.values.emplace_back(name, &v);
}

/// Which storage of the file a tensor views: its index in File::storages, found by byte offset
/// when the views address the file's bytes; with pread (no mapping) each storage record is read
/// into a buffer of its own, shared by all its views, so the buffer identifies it.
long storage_of(const torch::File& f, const TensorView& t) {
  if (!f.view_base) return t.numel() == 0 && t.nbytes() == 0 && !t.owner() ? -2 : static_cast<long>(reinterpret_cast<std::uintptr_t>(t.owner().get()) & 0x7fffffff);
  const std::uint64_t at = static_cast<std::uint64_t>(t.data() - f.view_base);
  for (const auto& s : f.storages)
    if (s.nbytes == 0 && at == s.offset && t.numel() == 0) return -2;  // an empty storage: never an alias
  for (std::size_t i = 0; i < f.storages.size(); ++i) {
    const auto& s = f.storages[i];
    if (s.nbytes == 0) continue;
    if (at >= s.offset && (at < s.offset + s.nbytes || (t.numel() == 0 && at == s.offset + s.nbytes))) return static_cast<long>(i);
  }
  return -1;
}

std::vector<std::string> compare(const torch::File& f, const json& m) {
  std::vector<std::string> problems;
  Leaves got;
  leaves(f.value, "", got);
  const json& mt = m.at("tensors");
  const json& mv = m.at("values");
  std::set<std::string> seen;
  std::map<long, std::string> first_of_storage;
  json aliases = json::object();
  for (const auto& [name, t] : got.tensors) {
    seen.insert(name);
    if (!mt.contains(name)) {
      problems.push_back(name + ": unexpected tensor");
      continue;
    }
    const json& e = mt[name];
    if (e["dtype"] != std::string(statedict::name(t.dtype()))) problems.push_back(name + ": dtype " + std::string(statedict::name(t.dtype())));
    if (e["shape"].get<shape_t>() != t.shape()) problems.push_back(name + ": shape " + to_string(t.shape()));
    if (e["sha256"] != sha256_hex(t)) problems.push_back(name + ": sha256 differs");
    const long s = storage_of(f, t);
    if (s == -2) continue;
    if (s < 0) problems.push_back(name + ": does not view a storage of the file");
    else if (auto it = first_of_storage.find(s); it != first_of_storage.end()) aliases[name] = it->second;
    else first_of_storage[s] = name;
  }
  for (const auto& [name, v] : got.values) {
    seen.insert(name);
    if (!mv.contains(name)) problems.push_back(name + ": unexpected value");
    else if (!same(leaf_json(*v), mv[name])) problems.push_back(name + ": value " + leaf_json(*v).dump() + " != " + mv[name].dump());
  }
  for (auto it = mt.begin(); it != mt.end(); ++it)
    if (!seen.count(it.key())) problems.push_back(it.key() + ": tensor missing");
  for (auto it = mv.begin(); it != mv.end(); ++it)
    if (!seen.count(it.key())) problems.push_back(it.key() + ": value missing");
  if (aliases != m.at("aliases")) problems.push_back("aliases " + aliases.dump() + " != " + m.at("aliases").dump());
  json attrs = json::object();
  for (const auto& a : f.attributes) {
    std::string path;
    for (const Key& k : a.path) path += (path.empty() ? "" : ".") + k.str();
    attrs[path] = plain_json(Value(a.attributes));
  }
  if (!same(attrs, m.value("dict_attributes", json::object()))) problems.push_back("dict_attributes " + attrs.dump());
  if (m.contains("archive_prefix") && m["archive_prefix"] != f.archive_name) problems.push_back("archive name " + f.archive_name);
  if (m.contains("records") && m["records"].get<std::vector<std::string>>() != f.records) problems.push_back("records differ");
  return problems;
}

std::pair<int, std::string> run(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = ::pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

std::string sh(const fs::path& p) {
  std::string s = "'";
  for (char c : p.string()) s += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return s + "'";
}

/// Runs a Python script (with torch) that reads `input` (JSON) and writes its JSON answer.
json python(const std::string& name, const std::string& code, const json& input) {
  const fs::path dir = out_dir();
  const fs::path script = dir / (name + ".py"), in = dir / (name + ".in.json"), out = dir / (name + ".out.json");
  std::ofstream(script) << "import json, sys\nsys.path.insert(0, " << json(std::string(STATEDICT_SOURCE_DIR) + "/tests/python").dump()
                        << ")\nIN = json.load(open(sys.argv[1]))\nOUT = None\n"
                        << code << "\njson.dump(OUT, open(sys.argv[2], 'w'))\n";
  std::ofstream(in) << input.dump();
  fs::remove(out);
  const auto result = run(std::string(STATEDICT_PYTHON) + " " + sh(script) + " " + sh(in) + " " + sh(out));
  REQUIRE_MESSAGE(result.first == 0, "python " << name << " failed:\n" << result.second);
  return load_json(out);
}

}  // namespace

TEST_CASE("our reader matches PyTorch on every fixture, bit for bit") {
  for (const Fixture& fx : all_fixtures()) {
    if (fx.manifest.contains("malicious")) continue;
    CAPTURE(fx.name);
    // mmap, pread, and mmap with the local headers read alongside the pickle (for every archive,
    // not only those of 256 entries or more).
    for (int how = 0; how < 3; ++how) {
      torch::load_options o;
      o.mode = how == 1 ? read_mode::pread : read_mode::mmap;
      if (how == 2) o.overlap_headers_from = 0;
      const torch::File f = torch::read(fx.file, o);
      CHECK(f.format == (fx.manifest["format"] == "torch_legacy" ? "legacy" : "zip"));
      const auto problems = compare(f, fx.manifest);
      for (const auto& p : problems) FAIL_CHECK(fx.name << ": " << p);
    }
  }
}

TEST_CASE("every fixture reads the same with the fast paths on and off") {
  int tensors = 0;
  for (const Fixture& fx : all_fixtures()) {
    if (fx.manifest.contains("malicious")) continue;
    CAPTURE(fx.name);
    torch::load_options on, off;
    off.fast_paths = false;
    const torch::File a = torch::read(fx.file, on), b = torch::read(fx.file, off);
    CHECK(a.value == b.value);
    CHECK(a.attributes == b.attributes);
    REQUIRE(a.storages.size() == b.storages.size());
    for (std::size_t i = 0; i < a.storages.size(); ++i) {
      CHECK(a.storages[i].key == b.storages[i].key);
      CHECK(a.storages[i].dtype == b.storages[i].dtype);
      CHECK(a.storages[i].offset == b.storages[i].offset);
    }
    const FlatStateDict fa = flatten(a.value), fb = flatten(b.value);
    CHECK(fa.skeleton.dump() == fb.skeleton.dump());  // the same ties and views
    REQUIRE(fa.tensors.size() == fb.tensors.size());
    for (std::size_t i = 0; i < fa.tensors.size(); ++i) {
      auto at = [](const TensorView& v, const torch::File& f) {  // two mappings: compare offsets
        return reinterpret_cast<std::uintptr_t>(v.data()) - reinterpret_cast<std::uintptr_t>(f.view_base);
      };
      CHECK(at(fa.tensors[i].second, a) == at(fb.tensors[i].second, b));
      CHECK(fa.tensors[i].second.strides() == fb.tensors[i].second.strides());
    }
    tensors += static_cast<int>(fa.tensors.size());
  }
  CHECK(tensors > 50);
}

TEST_CASE("describe() places every tensor at the right bytes with the right strides") {
  for (const Fixture& fx : all_fixtures()) {
    if (fx.manifest.contains("malicious")) continue;
    CAPTURE(fx.name);
    const ShardedCheckpoint ck = torch::describe(fx.file);
    torch::load_options pr;
    pr.mode = read_mode::pread;
    const ShardedCheckpoint ck2 = torch::describe(fx.file, pr);
    REQUIRE(ck2.tensors.size() == ck.tensors.size());
    pr.overlap_headers_from = 0;  // the local headers read alongside the pickle
    const ShardedCheckpoint ck3 = torch::describe(fx.file, pr);
    REQUIRE(ck3.tensors.size() == ck.tensors.size());
    for (std::size_t i = 0; i < ck.tensors.size(); ++i) CHECK(ck3.tensors[i].chunks.at(0) == ck.tensors[i].chunks.at(0));
    const auto src = ck.sources.at(0);
    std::size_t checked = 0;
    for (std::size_t i = 0; i < ck.tensors.size(); ++i) {
      const TensorInfo& t = ck.tensors[i];
      CHECK(ck2.tensors[i].chunks.at(0) == t.chunks.at(0));
      const Placement& p = t.chunks.at(0).at;
      const shape_t strides = p.strides.empty() ? contiguous_strides(t.shape) : p.strides;
      const TensorView v(t.dtype, t.shape, strides, src->data() + p.byte_offset, src->owner());
      if (!fx.manifest["tensors"].contains(t.name)) continue;  // a flatten name that differs from the manifest's
      CHECK_MESSAGE(fx.manifest["tensors"][t.name]["sha256"] == sha256_hex(v), t.name);
      ++checked;
    }
    CHECK(checked > 0);
  }
}

TEST_CASE("the malicious pickle: a security error, and nothing ran") {
  for (const Fixture& fx : all_fixtures()) {
    if (!fx.manifest.contains("malicious")) continue;
    const fs::path sentinel = fx.manifest["malicious"]["sentinel"].get<std::string>();
    for (bool keep : {false, true}) {
      torch::load_options o;
      o.keep_unknown_objects = keep;
      try {
        (void)torch::read(fx.file, o);
        FAIL("the malicious file was accepted");
      } catch (const security_error& e) {
        CHECK(e.code() == errors::pk_blocked_module);
        CHECK(std::string(e.what()).find(fx.manifest["malicious"]["forbidden_global"].get<std::string>()) != std::string::npos);
      }
      CHECK_THROWS_AS((void)torch::describe(fx.file, o), security_error);
    }
    CHECK_FALSE(fs::exists(sentinel));
  }
}

TEST_CASE("PyTorch loads our writer's output equal to the source, tied weights still tied") {
  json jobs = json::array();
  for (const Fixture& fx : all_fixtures()) {
    if (fx.manifest.contains("malicious")) continue;
    const torch::File f = torch::read(fx.file);
    const fs::path out = out_dir() / (fx.name + ".ours.pt");
    torch::save(out, f);
    // Our own reader agrees with the manifest on our file too.
    const torch::File back = torch::read(out);
    CHECK_MESSAGE(back.value == f.value, fx.name);
    CHECK_MESSAGE(back.attributes == f.attributes, fx.name);
    const bool wo = fx.manifest.value("torch_weights_only", json::object()).value("loads", false);
    jobs.push_back({{"case", fx.name}, {"file", out.string()}, {"manifest", (fixtures / (fx.name + ".manifest.json")).string()}, {"weights_only", false}});
    if (wo) jobs.push_back({{"case", fx.name}, {"file", out.string()}, {"manifest", (fixtures / (fx.name + ".manifest.json")).string()}, {"weights_only", true}});
  }
  const json res = python("check_ours", R"(
import _common as C, torch_check as T
OUT = []
for j in IN:
    m = C.load_manifest(j["manifest"])
    OUT.append({"case": j["case"], "weights_only": j["weights_only"],
                "problems": T.check_torch(j["file"], m, j["weights_only"], [], True)})
)", jobs);
  REQUIRE(res.size() == jobs.size());
  std::size_t weights_only = 0;
  for (const auto& r : res) {
    CAPTURE(r["case"].get<std::string>());
    CAPTURE(r["weights_only"].get<bool>());
    for (const auto& p : r["problems"]) FAIL_CHECK(p.get<std::string>());
    weights_only += r["weights_only"].get<bool>() ? 1U : 0U;
  }
  CHECK(weights_only >= 5);  // dtypes, views, tied, scalars_empty, module_state_dict, ...
}

TEST_CASE("our state dicts load into real modules and optimizers; Parameters kept as Parameters") {
  // model_optim through our writer: load_state_dict into the fixture's Net and an AdamW with the
  // same two parameter groups, then take a step.
  const torch::File mo = torch::read(fixtures / "model_optim.pt");
  const fs::path mo_out = out_dir() / "model_optim.roundtrip.pt";
  torch::save(mo_out, mo);
  // Parameters, written back as Parameters.
  torch::load_options keep;
  keep.keep_wrappers = true;
  const torch::File pa = torch::read(fixtures / "parameters.pt", keep);
  CHECK(pa.value["weight"].is_object());
  const fs::path pa_out = out_dir() / "parameters.wrappers.pt";
  torch::save(pa_out, pa);
  // A forced-ZIP64 file (every record with ZIP64 fields).
  torch::save_options z;
  z.zip.zip64_threshold = 1;
  const fs::path z_out = out_dir() / "zip64.pt";
  torch::save(z_out, torch::read(fixtures / "dtypes.pt").value, z);
  const json res = python("modules", R"(
import torch, zipfile
import gen_torch_files as G
r = {}
sd = torch.load(IN["model_optim"])
net = G.make_net()
r["load_state_dict"] = str(net.load_state_dict(sd["model"]))
decay = [p for n, p in net.named_parameters() if p.ndim >= 2]
no_decay = [p for n, p in net.named_parameters() if p.ndim < 2]
opt = torch.optim.AdamW([{"params": decay, "lr": 1e-3, "weight_decay": 0.01},
                         {"params": no_decay, "lr": 5e-4, "weight_decay": 0.0}], betas=(0.9, 0.95), eps=1e-8)
opt.load_state_dict(sd["optim"])
loss = torch.nn.functional.cross_entropy(net(torch.tensor([1, 2])), torch.tensor([3, 4]))
loss.backward(); opt.step()
r["optimizer_step"] = float(opt.state_dict()["state"][0]["step"])
p = torch.load(IN["parameters"])
r["param_types"] = {k: type(v).__name__ for k, v in p.items() if k != "list"}
r["requires_grad"] = {k: bool(v.requires_grad) for k, v in p.items() if k != "list"}
r["list_types"] = [type(v).__name__ for v in p["list"]]
z = torch.load(IN["zip64"])
ref = torch.load(IN["dtypes"])
import _common as C
r["zip64_equal"] = all(C.tensor_entry(z[k]) == C.tensor_entry(ref[k]) for k in ref)
r["zip64_testzip"] = zipfile.ZipFile(IN["zip64"]).testzip()
OUT = r
)", json{{"model_optim", mo_out.string()}, {"parameters", pa_out.string()}, {"zip64", z_out.string()},
         {"dtypes", (fixtures / "dtypes.pt").string()}});
  CHECK(res["load_state_dict"] == "<All keys matched successfully>");
  CHECK(res["optimizer_step"] == 4.0);
  CHECK(res["param_types"] == json{{"weight", "Parameter"}, {"frozen", "Parameter"}, {"bf16_param", "Parameter"}, {"plain_requires_grad", "Tensor"}});
  CHECK(res["requires_grad"] == json{{"weight", true}, {"frozen", false}, {"bf16_param", true}, {"plain_requires_grad", false}});
  CHECK(res["list_types"] == json{"Parameter", "Parameter"});
  CHECK(res["zip64_equal"] == true);
  CHECK(res["zip64_testzip"].is_null());  // every CRC right
}
