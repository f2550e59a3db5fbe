// The OLMo mapped safetensors, ColossalAI and fairscale layouts through the `statedict` tool:
// `inspect --json --hash` (and `--with-optimizer`) of every fixture against its manifests, the
// malicious OLMo value refused with one line, `convert` of every fixture to .safetensors and .pt
// checked by statedict and by PyTorch (tests/cli_oracle.py), and `convert --to olmo` /
// `--to colossalai --world-size M` judged by the Python reference readers.
#include "cli_util.hpp"

using namespace cli_test;
namespace sd = statedict;

namespace {

const std::vector<std::string> generators{"gen_olmo_st", "gen_colossalai", "gen_fairscale"};

/// The fixtures of the three layouts (fairscale's rank-0 manifests describe one rank file as
/// torch.load returns it, with argparse.Namespace objects statedict reads only as data: skipped).
std::vector<fixture> layout_fixtures() {
  std::vector<fixture> out;
  for (const auto& g : generators)
    for (auto& f : fixtures(g))
      if (f.name.find(".rank0") == std::string::npos) out.push_back(std::move(f));
  return out;
}

json with_optim(const fixture& f) {
  json want = f.manifest;
  for (const auto& [n, t] : (*f.optim)["tensors"].items()) want["tensors"][n] = t;
  for (const auto& [n, v] : (*f.optim)["values"].items()) want["values"][n] = v;
  return want;
}

}  // namespace

TEST_CASE("layouts: inspect --json --hash equals every manifest, --with-optimizer adds the optimizer manifest") {
  std::size_t checked = 0, optim = 0;
  for (const fixture& f : layout_fixtures()) {
    CAPTURE(f.label());
    if (f.manifest.contains("malicious")) {
      const run_result r = cli({"inspect", "--json", f.path.string()});
      INFO(r.describe());
      CHECK(r.code == 2);
      CHECK(lines(r.err).size() == 1);
      CHECK(r.err.find("posix") != std::string::npos);
      CHECK_FALSE(fs::exists(f.manifest["malicious"]["sentinel"].get<std::string>()));
      continue;
    }
    const json got = inspect(f.path);
    CHECK(got["format"] == f.manifest["format"]);
    const auto p = compare_with_manifest(got, f.manifest);
    CHECK_MESSAGE(p.empty(), join(p));
    const run_result pr = cli({"inspect", "--json", "--hash", "--io", "pread", f.path.string()});
    CHECK(json::parse(pr.out) == got);
    ++checked;
    if (!f.optim) continue;
    const auto po = compare_with_manifest(inspect(f.path, {"--with-optimizer"}), with_optim(f));
    CHECK_MESSAGE(po.empty(), join(po));
    ++optim;
  }
  CHECK(checked == 4 + 11 + 6);
  CHECK(optim == 3 + 6);
}

TEST_CASE("layouts: convert to .safetensors and .pt, checked by statedict and PyTorch") {
  const fs::path work = scratch("layouts-convert");
  json jobs = json::array();
  std::vector<std::string> labels;
  std::size_t n = 0;
  for (const fixture& f : layout_fixtures()) {
    if (f.manifest.contains("malicious")) continue;
    CAPTURE(f.label());
    const fs::path dir = work / std::to_string(++n);
    fs::create_directories(dir);
    const json want = f.optim ? with_optim(f) : f.manifest;
    const std::vector<std::string> extra = f.optim ? std::vector<std::string>{"--with-optimizer"} : std::vector<std::string>{};
    for (const char* ext : {"out.safetensors", "out.pt"}) {
      std::vector<std::string> args{"convert", f.path.string(), (dir / ext).string()};
      args.insert(args.end(), extra.begin(), extra.end());
      const run_result r = cli(args);
      REQUIRE_MESSAGE(r.code == 0, r.describe());
      const auto p = compare_with_manifest(inspect(dir / ext), want);
      CHECK_MESSAGE(p.empty(), ext << " re-inspected:" << join(p));
    }
    jobs.push_back({{"kind", "safetensors"}, {"file", (dir / "out.safetensors").string()}, {"manifest", want}});
    labels.push_back(f.label() + " .safetensors");
    jobs.push_back({{"kind", "torch"}, {"file", (dir / "out.pt").string()}, {"manifest", want}});
    labels.push_back(f.label() + " .pt");
  }
  const auto results = oracle(jobs, work);
  for (std::size_t i = 0; i < results.size(); ++i) CHECK_MESSAGE(results[i].empty(), labels[i] << ": PyTorch disagrees:" << join(results[i]));
  CHECK(n == 21);
  drop_scratch("layouts-convert");
}

TEST_CASE("layouts: convert --to olmo and --to colossalai, judged by the reference readers") {
  const fs::path work = scratch("layouts-write");
  const fs::path checker = source_dir / "tests/python/layout_check.py";
  // OLMo: a fixture back to OLMo, and a fairscale checkpoint (flat names) to OLMo without its ties.
  const fs::path olmo_in = fixture_root / "gen_olmo_st" / "olmo_optim.safetensors";
  run_result r = cli({"convert", olmo_in.string(), (work / "optim.safetensors").string(), "--to", "olmo"});
  REQUIRE_MESSAGE(r.code == 0, r.describe());
  r = run({python, checker.string(), "olmo", (work / "optim.safetensors").string(),
           (fixture_root / "gen_olmo_st" / "olmo_optim.manifest.json").string(), "--canonical"});
  CHECK_MESSAGE(r.code == 0, r.describe());
  CHECK(read_file(work / "optim.safetensors") == read_file(olmo_in));
  // A tied checkpoint cannot be an OLMo file: one line, exit 2, nothing written.
  const fs::path fair = fixture_root / "gen_fairscale" / "metaseq_fsdp_ws2_fp16";
  r = cli({"convert", fair.string(), (work / "tied.safetensors").string(), "--to", "olmo"});
  CHECK(r.code == 2);
  CHECK(r.err.find("." + std::to_string(sd::errors::olmo_unwritable.id) + "]") != std::string::npos);
  CHECK_FALSE(fs::exists(work / "tied.safetensors"));
  // ColossalAI for 3 ranks from a fairscale checkpoint, read back by the reference reader.
  const fs::path tp3 = work / "tp3";
  r = cli({"convert", fair.string(), tp3.string(), "--to", "colossalai", "--world-size", "3"});
  REQUIRE_MESSAGE(r.code == 0, r.describe());
  json m = load_json(fixture_root / "gen_fairscale" / "metaseq_fsdp_ws2_fp16.manifest.json");
  for (const auto& [a, t] : m["aliases"].items()) m["tensors"].erase(a);  // ColossalAI lists a tied parameter once
  m["aliases"] = json::object();
  write_file(work / "m.json", m.dump());
  r = run({python, checker.string(), "colossalai", tp3.string(), (work / "m.json").string()});
  CHECK_MESSAGE(r.code == 0, r.describe());
  const auto p = compare_with_manifest(inspect(tp3), m);
  CHECK_MESSAGE(p.empty(), join(p));
  // Options that do not fit the output are refused before reading.
  r = cli({"convert", fair.string(), (work / "x").string(), "--to", "olmo", "--world-size", "2"});
  CHECK(r.code == 2);
  CHECK(r.err.find("." + std::to_string(sd::errors::bad_save_option.id) + "]") != std::string::npos);
  drop_scratch("layouts-write");
}
