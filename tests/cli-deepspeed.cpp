// DeepSpeed through the `statedict` tool: the checkpoints the real engine wrote
// (tests/data/deepspeed-engine) inspected, and resharded with `convert --to deepspeed`: the output
// verifies equal to its input, and the usage mistakes are refused before anything is written.
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
