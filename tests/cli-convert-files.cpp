// `statedict convert` of every torch.save and safetensors fixture to .safetensors, .pt, a Hugging
// Face sharded directory, --dtype BF16 and --only PREFIX, checked by statedict and by PyTorch
// (tests/cli_convert_checks.hpp).
#include "cli_convert_checks.hpp"

using namespace cli_test;

TEST_CASE("convert: torch.save and safetensors fixtures, checked by PyTorch") {
  const convert_counts n = check_convert({"gen_torch_files", "gen_safetensors"}, "convert-files");
  CHECK(n.fixtures == 33);
  CHECK(n.torch_checked >= 30);
  CHECK(n.hf_sharded >= 20);
  drop_scratch("convert-files");
}
