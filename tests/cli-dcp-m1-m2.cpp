// convert --to dcp --world-size 1 and 2 of every sharded fixture, loaded by PyTorch's own DCP reader on
// that many gloo processes (tests/cli_dcp_checks.hpp; M is split over two executables to keep each short).
#include "cli_dcp_checks.hpp"

using namespace cli_test;

TEST_CASE("convert --to dcp --world-size 1 and 2: PyTorch's DCP reader loads every sharded fixture") {
  check_dcp({1, 2}, "dcp-m1-m2");
}
