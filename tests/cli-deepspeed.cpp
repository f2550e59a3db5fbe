// DeepSpeed through the `statedict` tool: the checkpoints the real engine wrote
// (tests/data/deepspeed-engine) inspected, and resharded with `convert --to deepspeed`: the output
// verifies equal to its input; weights only (a torch model file, a .safetensors, a Hugging Face
// folder) written with a fresh optimizer; and the usage mistakes are refused before anything is
// written.
#include "cli_util.hpp"

using namespace cli_test;

namespace {
const fs::path engine = source_dir / "tests/data/deepspeed-engine";
}  // namespace

TEST_CASE("deepspeed cli: the real engine's ZeRO-3 files are read") {
  // Since DeepSpeed 0.14.5 every fp32 partition is pickled with a ds_id attribute
  // (_rebuild_from_type_v2): the files the engine writes today.
  const run_result r = cli({"inspect", "--json", (engine / "zero3_ws3_bf16").string()});
  INFO(r.describe());
  REQUIRE(r.code == 0);
  const json j = json::parse(r.out);
  CHECK(j.at("format") == "deepspeed_zero3");
  CHECK(j.at("tensors").at("blocks.0.fc1.weight").at("shape") == json::array({37, 24}));
}

TEST_CASE("deepspeed cli: convert --to deepspeed --world-size M reshards, and verify finds it equal") {
  const fs::path dir = scratch("deepspeed-reshard");
  for (const std::string c : {"zero1_ws4_fp32", "zero2_ws3_fp32_roundrobin", "zero3_ws2_bf16_subgroups", "bf16opt_ws2"}) {
    CAPTURE(c);
    const std::string in = (engine / c).string(), out = (dir / c).string();
    run_result r = cli({"convert", in, out, "--to", "deepspeed", "--world-size", "3", "--with-optimizer", "--frozen-from-module"});
    INFO(r.describe());
    REQUIRE(r.code == 0);
    CHECK(r.err.find("DeepSpeed checkpoint for 3 ranks") != std::string::npos);
    CHECK(read_file(dir / c / "latest") == "global_step2");
    r = cli({"verify", in, out, "--with-optimizer", "--frozen-from-module"});
    INFO(r.describe());
    CHECK(r.code == 0);
  }
  drop_scratch("deepspeed-reshard");
}

TEST_CASE("deepspeed cli: --to deepspeed refuses what it cannot write, and writes nothing") {
  const fs::path dir = scratch("deepspeed-refuse");
  const std::string in = (engine / "zero1_ws2_fp32").string(), out = (dir / "out").string();
  struct refusal {
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<refusal> cases{
      {{"convert", in, out, "--to", "deepspeed", "--with-optimizer"}, "--world-size"},
      {{"convert", in, out, "--to", "deepspeed", "--world-size", "2"}, "--with-optimizer"},
      {{"convert", in, out, "--to", "deepspeed", "--world-size", "2", "--with-optimizer"}, "--frozen-from-module"},
      {{"convert", in, out, "--to", "dcp", "--world-size", "2", "--zero-stage", "3"}, "--zero-stage applies to DeepSpeed output"},
      {{"convert", in, out, "--to", "deepspeed", "--world-size", "2", "--zero-stage", "4"}, "--zero-stage"},
      {{"inspect", (engine / "zero1_ws2_fp32" / "global_step2" / "mp_rank_00_model_states.pt").string(), "--frozen-from-module"},
       "--frozen-from-module applies to DeepSpeed"},
  };
  for (const auto& c : cases) {
    const run_result r = cli(c.args);
    INFO(r.describe());
    CHECK(r.code == 2);
    CHECK(r.err.find(c.says) != std::string::npos);
    CHECK(lines(r.err).size() == 1);
    CHECK_FALSE(fs::exists(out));
  }
  drop_scratch("deepspeed-refuse");
}

TEST_CASE("deepspeed cli: weights only, --fresh-optimizer writes what the engine starts from, for any stage and world size") {
  const fs::path dir = scratch("deepspeed-fresh");
  const std::string model = (engine / "fresh_model.pt").string();
  // The same weights as a .safetensors file and a Hugging Face folder.
  REQUIRE(cli({"convert", model, (dir / "m.safetensors").string()}).code == 0);
  REQUIRE(cli({"convert", model, (dir / "hf").string(), "--to", "hf"}).code == 0);
  const std::string spec = "adamw:lr=2e-3,betas=0.9/0.95,eps=1e-6,weight_decay=0.05";
  for (const std::string& in : {model, (dir / "m.safetensors").string(), (dir / "hf").string()})
    for (const char* stage : {"2", "3"}) {
      CAPTURE(in);
      CAPTURE(stage);
      const std::string out = (dir / ("out-" + std::to_string(in.size()) + "-" + std::string(stage))).string();
      run_result r = cli({"convert", in, out, "--to", "deepspeed", "--world-size", "3", "--zero-stage", stage, "--fresh-optimizer", spec,
                          "--frozen", "frozen\\..*", "--buffer", "pos"});
      INFO(r.describe());
      REQUIRE(r.code == 0);
      CHECK(read_file(fs::path(out) / "latest") == "global_step0");
      r = cli({"verify", in, out});
      INFO(r.describe());
      CHECK(r.code == 0);
      // The param group is the spec's; there is no optimizer state yet.
      r = cli({"inspect", "--json", "--with-optimizer", out});
      INFO(r.describe());
      REQUIRE(r.code == 0);
      const json j = json::parse(r.out);
      CHECK(j.at("values").at("optim.param_groups.0.lr") == 2e-3);
      CHECK(j.at("values").at("optim.param_groups.0.betas.1") == 0.95);
      CHECK(j.at("values").at("optim.param_groups.0.weight_decay") == 0.05);
      for (const auto& t : j.at("tensors").items()) CHECK(t.key().rfind("optim.", 0) != 0);
    }
  // A DeepSpeed checkpoint read without its optimizer state: the same weights with the optimizer
  // started afresh (at step 0, whatever the input's tag), its stage kept unless asked.
  const std::string out = (dir / "reset").string();
  run_result r = cli({"convert", (engine / "zero2_ws2_fp32").string(), out, "--to", "deepspeed", "--world-size", "3", "--fresh-optimizer", spec,
                      "--frozen", "frozen\\..*", "--buffer", "pos"});
  INFO(r.describe());
  REQUIRE(r.code == 0);
  CHECK(read_file(fs::path(out) / "latest") == "global_step0");
  r = cli({"verify", (engine / "zero2_ws2_fp32").string(), out});
  INFO(r.describe());
  CHECK(r.code == 0);
  drop_scratch("deepspeed-fresh");
}

TEST_CASE("deepspeed cli: --fresh-optimizer mistakes are refused with the part that is wrong, and nothing is written") {
  const fs::path dir = scratch("deepspeed-fresh-refuse");
  const std::string model = (engine / "fresh_model.pt").string(), out = (dir / "out").string();
  const std::vector<std::string> ds{"convert", model, out, "--to", "deepspeed", "--world-size", "2", "--zero-stage", "2"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> a = ds;
    a.insert(a.end(), more.begin(), more.end());
    return a;
  };
  struct refusal {
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<refusal> cases{
      {ds, "--fresh-optimizer"},
      {with({"--fresh-optimizer", "adamw:lr=1e-4,betas=0.9"}), "[statedict.usage_error.727]"},
      {with({"--fresh-optimizer", "lion:lr=1e-4"}), "expected adamw or adam"},
      {with({"--fresh-optimizer", "adamw:lr=1e-4,momentum=0.9"}), "momentum"},
      {with({"--fresh-optimizer", "adamw", "--frozen", "frozn.*"}), "'frozn.*': matches no tensor"},
      {with({"--frozen", "frozen.*"}), "apply with --fresh-optimizer"},
      {{"convert", model, out, "--to", "dcp", "--world-size", "2", "--fresh-optimizer", "adamw"}, "--fresh-optimizer applies to DeepSpeed output"},
      {{"convert", (engine / "zero2_ws2_fp32").string(), out, "--to", "deepspeed", "--world-size", "2", "--with-optimizer", "--fresh-optimizer", "adamw"},
       "read the input without it"},
  };
  for (const auto& c : cases) {
    const run_result r = cli(c.args);
    INFO(r.describe());
    CHECK(r.code == 2);
    CHECK(r.err.find(c.says) != std::string::npos);
    CHECK(lines(r.err).size() == 1);
    CHECK_FALSE(fs::exists(out));
  }
  drop_scratch("deepspeed-fresh-refuse");
}
