// `statedict inspect` and `convert` on the Megatron-LM fixtures of tests/python/gen_megatron.py:
// every case merged and compared with its manifests; consolidated to .safetensors and checked by
// the independent reader of tests/python/torch_check.py; re-split with --to megatron --tp --pp and
// judged by the reference merge and split (tests/python/megatron_check.py); the vocabulary cut and
// re-padded; rules given on the command line; the usage errors.
#include "cli_util.hpp"

using namespace cli_test;

namespace {

const fs::path megatron_dir = fixture_root / "gen_megatron";

/// The model manifest, plus the optimizer manifest's tensors when `optimizer`.
json expected(const std::string& name, bool optimizer) {
  json m = load_json(megatron_dir / (name + ".manifest.json"));
  if (optimizer && fs::exists(megatron_dir / (name + ".optim.manifest.json"))) {
    const json o = load_json(megatron_dir / (name + ".optim.manifest.json"));
    for (const auto& [k, v] : o["tensors"].items()) m["tensors"][k] = v;
  }
  return m;
}

int run_python(const std::vector<std::string>& args) {
  std::vector<std::string> argv{cli_test::python};
  argv.insert(argv.end(), args.begin(), args.end());
  const run_result r = run(argv);
  INFO(r.describe());
  CHECK(r.code == 0);
  return r.code;
}

}  // namespace

TEST_CASE("megatron cli: inspect of every fixture, with and without the optimizer") {
  const json cases = load_json(megatron_dir / "megatron_cases.json");
  REQUIRE(cases.size() == 10);
  compare_options co;
  co.values = false;  // manifests list tensors only; args, iteration, ... are values of the description
  for (const auto& c : cases) {
    const std::string name = c["case"].get<std::string>();
    CAPTURE(name);
    const fs::path dir = megatron_dir / c["path"].get<std::string>();
    const json got = inspect(dir);
    CHECK(got["format"] == expected(name, false)["format"]);
    const auto p = compare_with_manifest(got, expected(name, false), co);
    CHECK_MESSAGE(p.empty(), join(p));
    const auto q = compare_with_manifest(inspect(dir, {"--with-optimizer"}), expected(name, true), co);
    CHECK_MESSAGE(q.empty(), join(q));
  }
}

TEST_CASE("megatron cli: convert to safetensors, checked by an independent reader") {
  const fs::path out = scratch("megatron-st");
  for (const char* name : {"llama_tp4_pp2_bf16", "gpt2_tp2_pp1_v0_oldkeys", "qwen_tp2_pp2_vpp2_bf16_distopt", "mcore_te_stacked_tp2_pp2",
                           "mcore_local_perlayer_tp2"}) {
    CAPTURE(name);
    const fs::path file = out / (std::string(name) + ".safetensors");
    const run_result r = cli({"convert", (megatron_dir / name).string(), file.string(), "--check-replicas"});
    INFO(r.describe());
    REQUIRE(r.code == 0);
    CHECK(r.err.find("from megatron") != std::string::npos);
    run_python({(source_dir / "tests/python/torch_check.py").string(), "--safetensors", file.string(),
            (megatron_dir / (std::string(name) + ".manifest.json")).string(), "--lenient"});
  }
  drop_scratch("megatron-st");
}

TEST_CASE("megatron cli: convert --to megatron for another TP / PP, judged by the reference merge and split") {
  const fs::path out = scratch("megatron-split");
  struct job {
    const char* name;
    std::vector<std::string> sizes;
    std::vector<std::string> check;
  };
  const std::vector<job> jobs = {
      {"llama_tp4_pp2_bf16", {"--tp", "2", "--pp", "1"}, {"--tp", "2", "--pp", "1"}},
      {"qwen_tp2_pp2_vpp2_bf16_distopt", {"--tp", "1", "--pp", "2", "--vpp", "2"}, {"--tp", "1", "--pp", "2", "--vpp", "2"}},
      {"gpt2_tp1_pp1_fp32", {"--to", "megatron", "--tp", "2"}, {"--tp", "2", "--pp", "1"}},
  };
  for (const auto& j : jobs) {
    CAPTURE(j.name);
    const fs::path dir = out / j.name;
    std::vector<std::string> args{"convert", (megatron_dir / j.name).string(), dir.string()};
    args.insert(args.end(), j.sizes.begin(), j.sizes.end());
    const run_result r = cli(args);
    INFO(r.describe());
    REQUIRE(r.code == 0);
    CHECK(r.err.find("Megatron-LM checkpoint for TP") != std::string::npos);
    std::vector<std::string> check{(source_dir / "tests/python/megatron_check.py").string(), dir.string(),
                                   (megatron_dir / (std::string(j.name) + ".manifest.json")).string()};
    check.insert(check.end(), j.check.begin(), j.check.end());
    run_python(check);
    CHECK(compare_with_manifest(inspect(dir), expected(j.name, false), {true, false, false}).empty());
  }
  drop_scratch("megatron-split");
}

TEST_CASE("megatron cli: --true-vocab-size cuts on read, re-pads on write; --megatron-rule") {
  const fs::path out = scratch("megatron-vocab");
  const fs::path src = megatron_dir / "gpt2_tp4_pp1_v1_release";
  const json cut = inspect(src, {"--true-vocab-size", "37"});
  CHECK(cut["tensors"]["language_model.embedding.word_embeddings.weight"]["shape"] == json::array({37, 8}));
  CHECK(cut["metadata"]["megatron.true_vocab_size"] == "37");
  const run_result r = cli({"convert", src.string(), (out / "tp2").string(), "--tp", "2", "--true-vocab-size", "37"});
  INFO(r.describe());
  REQUIRE(r.code == 0);
  run_python({(source_dir / "tests/python/megatron_check.py").string(), (out / "tp2").string(), "-", "--tp", "2", "--pp", "1"});
  CHECK(inspect(out / "tp2")["tensors"]["language_model.embedding.word_embeddings.weight"]["shape"] == json::array({40, 8}));
  // A rule from the command line changes how a tensor merges (here wrongly: the position
  // embeddings are replicated, split as rows they stack 4 copies), and the output shows it.
  const json ruled = inspect(src, {"--megatron-rule", "*position_embeddings.weight=column"});
  CHECK(ruled["tensors"]["language_model.embedding.position_embeddings.weight"]["shape"] == json::array({32, 8}));
  drop_scratch("megatron-vocab");
}

TEST_CASE("megatron cli: usage errors") {
  const fs::path src = megatron_dir / "gpt2_tp2_pp1_v0_oldkeys";
  const fs::path out = scratch("megatron-usage");
  auto fails = [](const std::vector<std::string>& args, const std::string& text) {
    const run_result r = cli(args);
    INFO(r.describe());
    CHECK(r.code == 2);
    CHECK(r.err.find(text) != std::string::npos);
  };
  fails({"convert", src.string(), (out / "x.safetensors").string(), "--tp", "2"}, "apply to Megatron-LM output");
  fails({"convert", src.string(), (out / "m").string(), "--to", "megatron", "--tp", "0"}, "--tp");
  fails({"convert", src.string(), (out / "m").string(), "--tp", "3"}, "[statedict.usage_error.972]");
  fails({"convert", src.string(), (out / "m").string(), "--tp", "2", "--world-size", "2"}, "--world-size");
  fails({"inspect", src.string(), "--megatron-rule", "*.x"}, "[statedict.usage_error.963]");
  fails({"inspect", (fixture_root / "gen_torch_files" / "nested.pt").string(), "--true-vocab-size", "3"}, "apply to Megatron-LM checkpoints");
  fails({"inspect", src.string(), "--true-vocab-size", "41"}, "[statedict.usage_error.961]");
  fails({"convert", src.string(), (out / "m").string(), "--to", "megatron", "--with-optimizer"}, "[statedict.usage_error.971]");
  CHECK_FALSE(fs::exists(out / "m"));
  drop_scratch("megatron-usage");
}
