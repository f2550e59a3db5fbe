// `statedict inspect` end to end, against the manifests real PyTorch wrote for every fixture of
// every format (torch.save zip and legacy, safetensors, DCP, ShardedTensor rank files, DeepSpeed
// ZeRO 1/2/3, OLMo FSDP): `--json --hash` gives the manifest's tensor names, dtypes, shapes and
// SHA-256, its non-tensor values and its aliases; `--io pread` prints exactly what mmap prints;
// `--with-optimizer` adds exactly the optimizer manifest (ZeRO, OLMo); the plain-text listing
// names every tensor; inputs statedict must refuse exit 2 with one line on stderr.
#include "cli_util.hpp"

using namespace cli_test;

namespace {

/// Fixtures statedict refuses by design, with the reason: they must exit 2 naming the file.
const std::map<std::string, std::string> refused = {
    {"gen_torch_files/malicious_os_system", "calls posix.system from its pickle"},
};

std::string expected_format(const fixture& f) {
  const std::string m = f.format();
  return m == "torch_legacy" ? "torch" : m;
}

std::size_t check_generator(const std::string& generator) {
  std::size_t checked = 0;
  for (const fixture& f : fixtures(generator)) {
    CAPTURE(f.label());
    if (auto it = refused.find(f.label()); it != refused.end()) {
      const run_result r = cli({"inspect", "--json", "--hash", f.path.string()});
      INFO(it->second << ": " << r.describe());
      CHECK(r.code == 2);
      CHECK(r.out.empty());
      CHECK(lines(r.err).size() == 1);
      CHECK(r.err.find(f.path.filename().string()) != std::string::npos);
      if (f.manifest.contains("malicious")) CHECK_FALSE(fs::exists(f.manifest["malicious"].value("sentinel", "/nonexistent")));
      ++checked;
      continue;
    }
    const run_result mm = cli({"inspect", "--json", "--hash", f.path.string()});
    INFO(mm.describe().substr(0, 600));
    REQUIRE(mm.code == 0);
    const json got = json::parse(mm.out);
    CHECK(got.value("format", "") == expected_format(f));
    if (f.format() == "torch_legacy") CHECK(got.value("rule", "").find("legacy") != std::string::npos);
    const auto problems = compare_with_manifest(got, statedict_view(f.manifest));
    CHECK_MESSAGE(problems.empty(), f.label() << ": inspect --json --hash differs from the manifest:" << join(problems));
    // safetensors __metadata__ comes back as "metadata".
    if (f.manifest.contains("metadata") && !f.manifest["metadata"].empty())
      CHECK(got.value("metadata", json::object()) == f.manifest["metadata"]);

    // pread: byte-identical output.
    const run_result pr = cli({"inspect", "--json", "--hash", "--io", "pread", f.path.string()});
    CHECK(pr.code == 0);
    CHECK_MESSAGE(pr.out == mm.out, f.label() << ": --io pread prints something else than mmap");

    // Plain text: one line per tensor (name first), tied names listed.
    const run_result txt = cli({"inspect", f.path.string()});
    CHECK(txt.code == 0);
    for (const auto& kv : f.manifest["tensors"].items()) {
      const std::string n = kv.key();
      if (f.manifest.contains("aliases") && f.manifest["aliases"].contains(n)) continue;
      if (n.find('\n') != std::string::npos) continue;
      CHECK_MESSAGE(txt.out.find("  " + n) != std::string::npos, "text listing lacks '" << n << "'");
    }

    // --with-optimizer: the weights plus exactly the optimizer manifest.
    if (f.optim) {
      const run_result ro = cli({"inspect", "--json", "--hash", "--with-optimizer", f.path.string()});
      REQUIRE(ro.code == 0);
      const json go = json::parse(ro.out);
      json want = f.manifest;
      for (const auto& [n, t] : (*f.optim)["tensors"].items()) want["tensors"][n] = t;
      for (const auto& [n, v] : (*f.optim)["values"].items()) want["values"][n] = v;
      // OLMo: the train/rank*.pt state (step, epoch, tokens seen...) comes along as values.
      if (f.format() == "olmo_local_sharded")
        for (const auto& [n, v] : go["values"].items())
          if (n.rfind("train.", 0) == 0 && !want["values"].contains(n)) want["values"][n] = v;
      const auto op = compare_with_manifest(go, want);
      CHECK_MESSAGE(op.empty(), f.label() << ": inspect --with-optimizer differs from manifest + optim manifest:" << join(op));
      const run_result po = cli({"inspect", "--json", "--hash", "--with-optimizer", "--io", "pread", f.path.string()});
      CHECK(po.code == 0);
      CHECK_MESSAGE(po.out == ro.out, f.label() << ": --with-optimizer --io pread prints something else than mmap");
    }
    ++checked;
  }
  MESSAGE(generator << ": " << checked << " fixtures inspected");
  return checked;
}

}  // namespace

TEST_CASE("inspect: torch.save files (zip and legacy) equal their manifests") {
  CHECK(check_generator("gen_torch_files") == 23);
}

TEST_CASE("inspect: safetensors files equal their manifests") {
  CHECK(check_generator("gen_safetensors") >= 12);
}

TEST_CASE("inspect: DCP and ShardedTensor rank files equal their manifests") {
  CHECK(check_generator("gen_sharded") >= 9);
}

TEST_CASE("inspect: DeepSpeed ZeRO 1/2/3 and OLMo FSDP, with and without the optimizer") {
  const auto all = fixtures("gen_zero_fsdp");
  CHECK(all.size() == 17);
  std::size_t with_optim = 0;
  for (const auto& f : all) if (f.optim) ++with_optim;
  CHECK(with_optim == 16);
  CHECK(check_generator("gen_zero_fsdp") == 17);
}

TEST_CASE("inspect: a ZeRO tag folder and the 'latest' folder above it describe the same checkpoint") {
  for (const fixture& f : fixtures("gen_zero_fsdp")) {
    if (f.format().rfind("deepspeed_zero", 0) != 0) continue;
    CAPTURE(f.label());
    const std::string tag = read_file(f.path / "latest");
    const fs::path tagdir = f.path / tag.substr(0, tag.find_last_not_of("\n ") + 1);
    REQUIRE(fs::is_directory(tagdir));
    json a = inspect(f.path), b = inspect(tagdir);
    for (json* j : {&a, &b}) {
      j->erase("rule");
      (*j)["metadata"].erase("deepspeed.tag");  // known only when 'latest' names the tag
    }
    CHECK_MESSAGE(a == b, "the tag folder describes something else than " << f.path.string());
  }
}
