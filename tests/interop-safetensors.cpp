// safetensors against independent witnesses: files written by tests/python/gen_safetensors.py
// (a reference-layout writer in numpy) are read and checked against their manifests; files written
// by statedict are checked by tests/python/torch_check.py --safetensors (a strict reader of the
// reference rules) and compared byte for byte with the Python writer's output.
#include <doctest/doctest.h>

#include <statedict/core/sha256.hpp>
#include <statedict/io/hf_sharded.hpp>
#include <statedict/io/safetensors.hpp>
#include <statedict/formats/safetensors.hpp>
#include <statedict/formats/hf.hpp>

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace statedict;
namespace st = statedict::safetensors;
namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

const fs::path fixtures = fs::path(STATEDICT_FIXTURE_DIR) / "gen_safetensors";

fs::path tmp_dir() { return statedict_test::test_dir("interop-safetensors"); }

using statedict_test::read_all;

using statedict_test::write_all;

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

/// Runs a command; returns its exit status and (via `out`) its stdout+stderr.
int run(const std::string& cmd, std::string* out = nullptr) {
  const fs::path log = tmp_dir() / "cmd.log";
  const int rc = std::system((cmd + " > " + shell_quote(log.string()) + " 2>&1").c_str());
  if (out) *out = read_all(log);
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : 255;
}

std::vector<fs::path> cases() {
  std::vector<fs::path> out;
  REQUIRE_MESSAGE(fs::is_directory(fixtures), "fixtures missing: " << fixtures);
  for (const auto& e : fs::directory_iterator(fixtures))
    if (e.path().extension() == ".json" && e.path().stem().extension() == ".manifest") out.push_back(e.path());
  std::sort(out.begin(), out.end());
  REQUIRE(out.size() >= 10);
  return out;
}

/// SHA-256 of a tensor's stored bytes, read through the file's byte source (works for every dtype).
std::string stored_sha(const st::File& f, const st::TensorEntry& e) {
  std::vector<std::byte> b(static_cast<std::size_t>(e.nbytes()));
  f.source()->read(f.data_offset() + e.begin, b);
  return sha256_hex(std::span<const std::byte>(b));
}

/// A manifest for torch_check.py describing what statedict wrote.
std::string manifest_of(const st::File& f) {
  json m = {{"format", "safetensors"}, {"tensors", json::object()}, {"values", json::object()}, {"aliases", json::object()}};
  for (const auto& e : f.entries())
    m["tensors"][e.name] = {{"dtype", std::string(e.dtype_name)}, {"shape", e.shape}, {"sha256", stored_sha(f, e)}};
  if (f.raw_metadata()) {
    json md = json::object();
    for (const auto& [k, v] : *f.raw_metadata()) md[k] = v;
    m["metadata"] = md;
  }
  return m.dump();
}

std::string check_with_python(const fs::path& file, const fs::path& manifest, bool canonical) {
  std::string out;
  const int rc = run(std::string(STATEDICT_PYTHON) + " " + shell_quote(std::string(STATEDICT_SOURCE_DIR) + "/tests/python/torch_check.py") +
                         " --safetensors " + shell_quote(file.string()) + " " + shell_quote(manifest.string()) +
                         (canonical ? " --canonical" : ""),
                     &out);
  return rc == 0 ? std::string() : "exit " + std::to_string(rc) + ": " + out;
}

}  // namespace

TEST_CASE("every file of the independent writer reads as its manifest says, in both read modes") {
  for (const fs::path& mpath : cases()) {
    const json m = json::parse(read_all(mpath));
    const fs::path file = fixtures / m["path"].get<std::string>();
    CAPTURE(file);
    for (const auto mode : {read_mode::mmap, read_mode::pread}) {
      st::File f = st::File::open(file, {mode, {}});
      CHECK(f.size() == m["tensors"].size());
      for (const auto& kv : m["tensors"].items()) {
        const std::string name = kv.key();
        const json& t = kv.value();
        CAPTURE(name);
        const st::TensorEntry* e = f.find(name);
        REQUIRE(e);
        CHECK(e->dtype_name == t["dtype"].get<std::string>());
        CHECK(e->file_shape == t["shape"].get<shape_t>());  // the header's (values, for packed dtypes)
        CHECK(stored_sha(f, *e) == t["sha256"].get<std::string>());
        if (e->dtype) CHECK(sha256_hex(f.view(*e)) == t["sha256"].get<std::string>());  // through the view too
      }
      if (m.contains("metadata") && !m["metadata"].is_null()) {
        REQUIRE(f.raw_metadata().has_value());
        std::map<std::string, std::string> md;
        for (const auto& [k, v] : m["metadata"].items()) md[k] = v.get<std::string>();
        CHECK(*f.raw_metadata() == md);
      } else {
        CHECK_FALSE(f.raw_metadata().has_value());
      }
    }
  }
}

TEST_CASE("rewriting each file gives the reference writer's bytes, accepted by the strict reader") {
  int compared = 0;
  for (const fs::path& mpath : cases()) {
    const json m = json::parse(read_all(mpath));
    const fs::path file = fixtures / m["path"].get<std::string>();
    CAPTURE(file);
    st::File f = st::File::open(file);
    bool supported = true;
    for (const auto& e : f.entries()) supported = supported && e.dtype.has_value();
    if (!supported) continue;  // exotic dtypes: statedict has no dtype for them yet
    const fs::path out = tmp_dir() / file.filename();
    st::write_options o;
    o.metadata = f.raw_metadata();
    st::write(out, st::inputs_of(f.describe()), o);
    const bool canonical = m.value("canonical", true);
    if (canonical) {
      CHECK(read_all(out) == read_all(file));  // byte-identical to the independent writer
      ++compared;
    }
    // The strict reader (reference rules + strict extras + --canonical) accepts our file and
    // finds every tensor of the original manifest.
    CHECK(check_with_python(out, mpath, true) == "");
  }
  CHECK(compared >= 8);
}

TEST_CASE("statedict's writer output passes the strict reader: casts, strided views, aliases, metadata") {
  std::vector<Tensor> ts;
  std::vector<st::Input> in;
  ts.push_back(Tensor::from<float>({1.5F, -2.25F, 3e-3F, 1e30F, 0.0F, -0.0F}, {2, 3}));
  in.push_back(st::Input::of("model.embed.weight", ts.back().view()));
  in.push_back(st::Input::of("lm_head.weight", ts.back().view()));  // tied
  ts.push_back(Tensor::from<std::int64_t>({7}, {}));
  in.push_back(st::Input::of("step", ts.back().view()));
  ts.push_back(Tensor::from<double>({1, 2, 3, 4, 5, 6}, {3, 2}));
  in.push_back(st::Input::of("cols", ts.back().view().narrow(1, 1, 1)));
  ts.push_back(Tensor::from<std::uint8_t>({1, 2, 3}, {3}));
  in.push_back(st::Input::of("h\xc3\xa9llo \"q\"\n", ts.back().view()));
  st::write_options o;
  o.cast = dtype::BF16;
  o.metadata = std::map<std::string, std::string>{{"format", "pt"}, {"z", "\xe4\xb8\x96"}};
  const fs::path out = tmp_dir() / "ours.safetensors";
  st::write(out, in, o);
  st::File f = st::File::open(out);
  const fs::path mf = tmp_dir() / "ours.manifest.json";
  write_all(mf, manifest_of(f));
  CHECK(check_with_python(out, mf, true) == "");
  CHECK(f.view("lm_head.weight").data() == f.view("model.embed.weight").data());
}

TEST_CASE("the index text matches Python's json.dumps(index, indent=2)") {
  std::vector<std::pair<std::string, std::string>> wm{{"a.weight", "model-00001-of-00002.safetensors"},
                                                      {"\xc3\xa9\xf0\x9f\x98\x80\x7f\"\\\n", "model-00002-of-00002.safetensors"}};
  std::map<std::string, std::string> md{{"producer", "statedict \xe4\xb8\x96"}};
  const std::string ours = hf::index_json(1234, md, wm);
  json in = {{"metadata", {{"total_size", 1234}, {"producer", md["producer"]}}}, {"weight_map", json::object()}};
  for (const auto& [k, v] : wm) in["weight_map"][k] = v;
  const fs::path src = tmp_dir() / "index-in.json";
  write_all(src, in.dump());
  const fs::path expected = tmp_dir() / "index-python.json";
  std::string log;
  REQUIRE(run(std::string(STATEDICT_PYTHON) + " -c " +
                  shell_quote("import json,sys; d=json.load(open(sys.argv[1])); open(sys.argv[2],'w').write(json.dumps(d, indent=2))") +
                  " " + shell_quote(src.string()) + " " + shell_quote(expected.string()),
              &log) == 0);
  CHECK(ours == read_all(expected));
}

TEST_CASE("a sharded directory written by statedict passes the strict reader shard by shard") {
  std::vector<Tensor> ts;
  std::vector<st::Input> in;
  for (int i = 0; i < 5; ++i) {
    ts.push_back(Tensor::from(std::vector<float>(64, static_cast<float>(i) + 0.5F), {8, 8}));
    in.push_back(st::Input::of("layers." + std::to_string(i) + ".weight", ts.back().view()));
  }
  const fs::path dir = tmp_dir() / "sharded";
  hf::write_options o;
  o.max_shard_size = 600;
  hf::write_result r = hf::write_sharded(dir, in, o);
  REQUIRE(r.plan.shards.size() == 3);
  for (const auto& s : r.plan.shards) {
    st::File f = st::File::open(dir / s.filename);
    const fs::path mf = tmp_dir() / (s.filename + ".manifest.json");
    write_all(mf, manifest_of(f));
    CHECK(check_with_python(dir / s.filename, mf, true) == "");
  }
}

TEST_CASE("an HF directory written in Python (huggingface_hub's split and index) reads, and statedict rewrites it byte for byte") {
  const fs::path py_dir = tmp_dir() / "hf-python";
  fs::remove_all(py_dir);
  fs::create_directories(py_dir);
  // An independent writer: tests/python/gen_safetensors.py for each shard, the split of
  // huggingface_hub's split_state_dict_into_shards_factory, the index with json.dumps(indent=2).
  const std::string script = R"PY(
import hashlib, json, os, sys
sys.path.insert(0, sys.argv[2])
import numpy as np
import gen_safetensors as G
out = sys.argv[1]
rng = np.random.default_rng(7)
names = ["model.layers.%d.weight" % i for i in range(7)] + ["model.norm.\u00e9"]
tensors = {n: G.make(rng, "F32" if i % 2 else "BF16", [i + 1, 8]) for i, n in enumerate(names)}
max_size, shards, cur, cur_size, total = 100, [], {}, 0, 0
for n, t in tensors.items():
    size = len(t[2])
    if size > max_size:
        total += size
        shards.append({n: t})
        continue
    if cur_size + size > max_size:
        shards.append(cur)
        cur, cur_size = {}, 0
    cur[n] = t
    cur_size += size
    total += size
if cur:
    shards.append(cur)
wm = {}
for i, sh in enumerate(shards):
    fn = "model-%05d-of-%05d.safetensors" % (i + 1, len(shards))
    with open(os.path.join(out, fn), "wb") as f:
        f.write(G.serialize(sh, {"format": "pt"}))
    for n in sh:
        wm[n] = fn
with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
    f.write(json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=2))
with open(os.path.join(out, "..", "hf-python.manifest.json"), "w") as f:
    json.dump({n: {"dtype": d, "shape": list(s), "sha256": hashlib.sha256(b).hexdigest()} for n, (d, s, b) in tensors.items()}, f)
)PY";
  write_all(tmp_dir() / "hf_python.py", script);
  std::string log;
  REQUIRE_MESSAGE(run(std::string(STATEDICT_PYTHON) + " " + shell_quote((tmp_dir() / "hf_python.py").string()) + " " +
                          shell_quote(py_dir.string()) + " " + shell_quote(std::string(STATEDICT_SOURCE_DIR) + "/tests/python"),
                      &log) == 0,
                  log);
  const json manifest = json::parse(read_all(tmp_dir() / "hf-python.manifest.json"));

  hf::Checkpoint c = hf::Checkpoint::open(py_dir);
  CHECK(c.files().size() >= 4);
  CHECK(c.items().size() == manifest.size());
  std::vector<st::Input> in;  // in the Python state dict's order
  for (const auto& kv : manifest.items()) {
    const std::string name = kv.key();
    CAPTURE(name);
    REQUIRE(c.find(name));
    CHECK(c.sha256(name) == kv.value()["sha256"].get<std::string>());
    CHECK(c.view(name).shape() == kv.value()["shape"].get<shape_t>());
    in.push_back(st::Input::of(name, c.view(name)));
  }
  const fs::path ours = tmp_dir() / "hf-ours";
  hf::write_options o;
  o.max_shard_size = 100;
  hf::write_result r = hf::write_sharded(ours, in, o);
  REQUIRE(r.files.size() == c.files().size() + 1);
  for (const auto& f : r.files) {
    CAPTURE(f);
    CHECK(read_all(ours / f) == read_all(py_dir / f));
  }
}
