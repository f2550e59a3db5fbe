// `statedict convert` of every sharded fixture (DCP, ShardedTensor rank files, DeepSpeed ZeRO 1/2/3,
// OLMo FSDP) to .safetensors, .pt, a Hugging Face sharded directory, --dtype BF16 and --only
// PREFIX, checked by statedict and by PyTorch (tests/cli_convert_checks.hpp).
#include "cli_convert_checks.hpp"

using namespace cli_test;

TEST_CASE("convert: sharded fixtures (DCP, ShardedTensor ranks, ZeRO, OLMo), checked by PyTorch") {
  const convert_counts n = check_convert({"gen_sharded", "gen_zero_fsdp"}, "convert-sharded");
  CHECK(n.fixtures == 26);
  CHECK(n.torch_checked == 26);
  CHECK(n.cast_checked == 26);
  drop_scratch("convert-sharded");
}
