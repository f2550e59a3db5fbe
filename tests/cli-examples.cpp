// The programs in examples/ run on real checkpoints (the bundled DeepSpeed ZeRO-3 example and the
// PyTorch fixtures), their outputs judged by PyTorch 1.13 (tests/cli_oracle.py) and by PyTorch 1.13
// and today's PyTorch (tests/python/check_examples.py).
#include <cstdlib>

#include "cli_util.hpp"

using namespace cli_test;

namespace {

std::string example(const std::string& name) { return (fs::path(cli_path).parent_path() / name).string(); }

const std::vector<std::string> model_optim_params = {
    // Net's parameters in the order tests/python/gen_torch_files.py's AdamW lists them (matrices first).
    "emb.weight", "blocks.0.fc.weight", "blocks.1.fc.weight", "blocks.0.fc.bias", "blocks.0.ln.weight", "blocks.0.ln.bias",
    "blocks.1.fc.bias", "blocks.1.ln.weight", "blocks.1.ln.bias", "bn.weight", "bn.bias"};

}  // namespace

TEST_CASE("examples/to_hf: DeepSpeed ZeRO-3 and a torch.save checkpoint to Hugging Face shards, renamed and in BF16") {
  const fs::path work = scratch("examples-to-hf");
  const fs::path zero3 = source_dir / "examples" / "checkpoints" / "zero3-tiny";
  const fs::path model_optim = fixture_root / "gen_torch_files" / "model_optim.pt";
  json jobs = json::array();

  // The untransformed reference of the DeepSpeed folder, checked by PyTorch against its manifest.
  const fs::path ref = work / "zero3.pt";
  const run_result c = cli({"convert", zero3.string(), ref.string()});
  REQUIRE_MESSAGE(c.code == 0, c.describe());
  jobs.push_back({{"kind", "torch"}, {"file", ref.string()}, {"manifest", (source_dir / "examples" / "checkpoints" / "zero3-tiny.manifest.json").string()}});

  const run_result a = run({example("to_hf"), zero3.string(), (work / "hf-zero3").string()});
  REQUIRE_MESSAGE(a.code == 0, a.describe());
  CHECK(a.out.find("lm_head.weight") != std::string::npos);
  CHECK(a.out.find("tied to model.embed_tokens.weight") != std::string::npos);
  CHECK(fs::exists(work / "hf-zero3" / "model.safetensors.index.json"));
  jobs.push_back({{"kind", "cast"}, {"orig", ref.string()}, {"cast", (work / "hf-zero3").string()}, {"dtype", "BF16"},
                  {"rename", {{"embed.weight", "model.embed_tokens.weight"}, {"head.weight", "lm_head.weight"}}},
                  {"aliases", {{"lm_head.weight", "model.embed_tokens.weight"}}},
                  {"keep", {"block0.norm.num_batches_tracked"}}});  // an integer buffer ZeRO keeps as F32

  const run_result b = run({example("to_hf"), model_optim.string(), (work / "hf-pt").string(), "model"});
  REQUIRE_MESSAGE(b.code == 0, b.describe());
  CHECK(b.out.find("tied to emb.weight") != std::string::npos);
  json rename = json::object();
  const json manifest = load_json(fixture_root / "gen_torch_files" / "model_optim.manifest.json");
  for (const auto& [n, t] : manifest["tensors"].items())
    rename[n] = n.rfind("model.", 0) == 0 ? json(n.substr(6)) : json(nullptr);
  for (const char* v : {"epoch", "loss"}) rename[v] = nullptr;
  for (const auto& [n, v] : manifest["values"].items())
    if (n.rfind("model.", 0) != 0) rename[n] = nullptr;
  rename["model.head.weight"] = "lm_head.weight";
  jobs.push_back({{"kind", "cast"}, {"orig", model_optim.string()}, {"cast", (work / "hf-pt").string()}, {"dtype", "BF16"},
                  {"rename", rename}, {"aliases", {{"lm_head.weight", "emb.weight"}}}});

  const auto results = oracle(jobs, work);
  for (std::size_t i = 0; i < results.size(); ++i) CHECK_MESSAGE(results[i].empty(), "job " << i << ": " << join(results[i]));
  drop_scratch("examples-to-hf");
}

/// The Pythons that judge the examples: Debian's (PyTorch 1.13), and today's PyTorch from the sid
/// root (tools/sid-python) when that root is built (the test command builds it; a build without
/// it checks with 1.13 alone).
std::vector<std::vector<std::string>> judges() {
  std::vector<std::vector<std::string>> out{{python}};
  const char* env = std::getenv("STATEDICT_SID_ROOT");
  const fs::path root = env && *env ? fs::path(env) : fs::path("/var/cache/statedict/sid-root");
  if (fs::exists(root / "usr" / "lib" / "python3" / "dist-packages" / "torch")) out.push_back({(source_dir / "tools" / "sid-python").string()});
  return out;
}

run_result judge(const std::vector<std::string>& who, std::vector<std::string> args) {
  args.insert(args.begin(), who.begin(), who.end());
  return run(args);
}

TEST_CASE("examples/optimizer_surgery: the vocabulary grows, the model and its AdamW state follow") {
  const fs::path work = scratch("examples-surgery");
  const fs::path in = fixture_root / "gen_torch_files" / "model_optim.pt", out = work / "grown.pt";
  std::vector<std::string> args = {example("optimizer_surgery"), in.string(), out.string(), "12"};
  args.insert(args.end(), model_optim_params.begin(), model_optim_params.end());
  const run_result r = run(args);
  REQUIRE_MESSAGE(r.code == 0, r.describe());
  CHECK(r.out.find("model.emb.weight [12, 4]") != std::string::npos);
  for (const auto& who : judges()) {
    const run_result check = judge(who, {(source_dir / "tests" / "python" / "check_examples.py").string(), "surgery", in.string(), out.string(), "12"});
    CHECK_MESSAGE(check.code == 0, check.describe());
  }

  // A parameter list that does not match the optimizer's is refused, and nothing is written.
  const fs::path bad = work / "bad.pt";
  const run_result e = run({example("optimizer_surgery"), in.string(), bad.string(), "12", "emb.weight"});
  CHECK(e.code == 1);
  CHECK_FALSE(fs::exists(bad));
  drop_scratch("examples-surgery");
}

TEST_CASE("examples/typed_config: a reflected struct and a BF16 tensor through torch.load(weights_only=True)") {
  const fs::path work = scratch("examples-typed");
  const fs::path out = work / "run.pt";
  const run_result r = run({example("typed_config"), out.string()});
  REQUIRE_MESSAGE(r.code == 0, r.describe());
  CHECK(r.out.find("fc.weight[1, 2] = -6, sum = 53.25") != std::string::npos);
  for (const auto& who : judges()) {
    const run_result check = judge(who, {(source_dir / "tests" / "python" / "check_examples.py").string(), "typed_config", out.string()});
    CHECK_MESSAGE(check.code == 0, check.describe());
  }
  drop_scratch("examples-typed");
}

TEST_CASE("examples/consolidate and examples/flatten_optimizer run") {
  const fs::path work = scratch("examples-other");
  const run_result c = run({example("consolidate"), (source_dir / "examples" / "checkpoints" / "zero3-tiny").string(), (work / "m.safetensors").string()});
  CHECK_MESSAGE(c.code == 0, c.describe());
  CHECK(c.out.find("embed.weight: BF16") != std::string::npos);
  const run_result f = run({example("flatten_optimizer")});
  CHECK_MESSAGE(f.code == 0, f.describe());
  CHECK(f.out.find("round trip: exact") != std::string::npos);
  drop_scratch("examples-other");
}
