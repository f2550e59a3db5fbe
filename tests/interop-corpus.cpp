// The real-world corpus (tests/data/corpus: files other projects' tools wrote, manifests written
// from what PyTorch reads in them) through the library, with tests/python/corpus_check.py's rules:
// statedict reads a file exactly as its manifest says (tensors by dtype, shape and sha256 of the
// elements; values type-aware), or refuses it cleanly where the manifest says a refusal is right
// (a hostile file, one no PyTorch loads, a TorchScript archive, one needing globals outside the
// weights_only allow-list). Every file it reads is written again as a .pt, which torch 2.14 must
// load with its default weights_only=True and with mmap=True, equal to the manifest.
#include <doctest/doctest.h>

#include <fstream>
#include <regex>

#include "interop_t2.hpp"

using namespace t2_test;

namespace {

const fs::path corpus = source_dir / "tests" / "data" / "corpus";

/// Why a clean refusal agrees with the manifest, or "" (corpus_check.py's refusal_is_right).
std::string refusal_is_right(const json& m) {
  if (m.contains("malicious")) return "hostile";
  const bool loads = m.value("torch_113", json::object()).value("loads", false) || m.value("torch_2", json::object()).value("loads", false);
  if (!loads && m.value("tensors", json::object()).empty() && m.value("values", json::object()).empty()) return "no PyTorch loads it";
  if (m.value("format", "") == "torchscript") return "TorchScript";
  static const std::regex unsupported("Unsupported (class|global)");
  for (const char* k : {"torch_weights_only", "torch_2_weights_only"}) {
    const json e = m.value(k, json::object()).value("error", json());
    if (e.is_string() && std::regex_search(e.get<std::string>(), unsupported)) return "globals outside the allow-list";
  }
  if (m.contains("stub_load")) return "a project's own classes";
  return "";
}

struct item {
  std::string label;
  fs::path path;
  fs::path manifest_path;
  json manifest;
};

std::vector<item> corpus_items() {
  std::vector<item> out;
  for (auto it = fs::recursive_directory_iterator(corpus); it != fs::recursive_directory_iterator(); ++it) {
    const std::string n = it->path().filename().string();
    const std::string suffix = ".manifest.json";
    if (!it->is_regular_file() || n.size() <= suffix.size() || n.compare(n.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    const std::string rel = fs::relative(it->path(), corpus).string();
    if (rel.rfind("LICENSES", 0) == 0) continue;
    item x;
    x.manifest_path = it->path();
    x.manifest = load_json(it->path());
    if (rel.rfind("debian/", 0) == 0) {  // files Debian packages install: checked where installed
      x.path = x.manifest.value("path", "");
      x.label = rel.substr(0, rel.size() - suffix.size());
      if (!fs::exists(x.path)) continue;
    } else {
      x.path = it->path().parent_path() / n.substr(0, n.size() - suffix.size());
      x.label = rel.substr(0, rel.size() - suffix.size());
    }
    out.push_back(std::move(x));
  }
  std::sort(out.begin(), out.end(), [](const item& a, const item& b) { return a.label < b.label; });
  return out;
}

}  // namespace

TEST_CASE("the real-world corpus reads as PyTorch reads it, and what statedict writes from it loads in torch 2.14") {
  const fs::path work = scratch("interop-corpus");
  const auto items = corpus_items();
  REQUIRE(items.size() >= 129);  // every committed manifest (the Debian ones where installed)
  job_list jobs;
  std::size_t read = 0, refused = 0, written = 0;
  for (const item& x : items) {
    CAPTURE(x.label);
    sd::formats::Opened o;
    std::string message;
    int id = 0;
    try {
      o = sd::formats::open(x.path);
    } catch (const sd::error& e) {
      id = e.id();
      message = e.what();
    }
    if (id != 0) {
      const std::string why = refusal_is_right(x.manifest);
      if (why == "hostile") CHECK_MESSAGE((id == 457 || id == 458 || id == 790), "a hostile file refused with " << message);
      CHECK_MESSAGE(!why.empty(), "refused a file PyTorch reads: " << message);
      ++refused;
      continue;
    }
    CHECK_MESSAGE(refusal_is_right(x.manifest) != "hostile", "a hostile file was read");
    ++read;
    compare_options co;
    co.aliases = false;  // the manifests list ties by storage; the values of the tensors are compared
    // A pickled object that holds tensors (a whole nn.Module): the manifest lists them by
    // attribute path (model._parameters.weight); statedict names them through the object's parts
    // (model.state._parameters.weight, its BUILD state), and writes the object as its data, which
    // torch then loads as the attribute dict (model._parameters.weight again). The attributes
    // themselves are not compared.
    json read_want = x.manifest, written_want = x.manifest;
    fs::path written_manifest = x.manifest_path;
    if (x.manifest.contains("object_tensors") && !x.manifest["object_tensors"].empty()) {
      json& free = written_want["unchecked_values_under"] = json::array();
      for (const auto& [k, v] : x.manifest["values"].items())
        if (v.is_object() && v.contains("object")) {
          read_want["values"].erase(k);
          written_want["values"].erase(k);
          free.push_back(k);
        }
      for (const auto& [k, v] : x.manifest["object_tensors"].items()) {
        const auto dot = k.find('.');
        read_want["tensors"][k.substr(0, dot) + ".state" + k.substr(dot)] = v;
        written_want["tensors"][k] = v;
      }
      co.values = false;
      written_manifest = work / (std::to_string(written) + ".manifest.json");
      std::ofstream(written_manifest) << written_want.dump();
    }
    const auto p = compare_with_manifest(describe_json(o.checkpoint), read_want, co);
    CHECK_MESSAGE(p.empty(), "read:" << join(p));
    // Written again as a .pt: torch 2.14's default torch.load (weights_only) and mmap=True.
    const fs::path pt = work / (std::to_string(written++) + ".pt");
    const int wid = error_of([&] { sd::formats::save(o.checkpoint, pt); });
    CHECK_MESSAGE(wid == 0, "writing the .pt failed with error " << wid);
    if (wid == 0) jobs.add(x.label + " -> .pt", {{"kind", "torch"}, {"path", pt.string()}, {"manifest", written_manifest.string()}});
  }
  CHECK(read >= 120);  // 129 files: 120 read, 9 refused where PyTorch refuses or only runs code
  const std::size_t checked = jobs.check(work);
  MESSAGE(items.size() << " corpus files: " << read << " read equal to their manifests, " << refused << " refused where right, " << checked << " .pt outputs loaded by torch 2.14");
  drop_scratch("interop-corpus");
}
