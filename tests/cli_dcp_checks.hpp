// `statedict convert --to dcp --world-size M --dcp-layout 1.13` of every sharded fixture (DCP written by 2, 3 and 4
// ranks, ShardedTensor rank files, DeepSpeed ZeRO 1/2/3, OLMo FSDP) for M = 1, 2, 3 and 5 (over
// tests/cli-dcp-*.cpp): each
// output is re-inspected by statedict and loaded by PyTorch 1.13's own DCP reader on M gloo
// processes into ShardedTensors chunked on dim 0 (tests/python/dcp_load_check.py's checks and
// loader, batched by tests/cli_oracle.py), and compared with the fixture's manifest.
#pragma once

#include "cli_util.hpp"

namespace cli_test {

/// Every sharded fixture converted to DCP for each world size in `ms`, checked as above.
inline void check_dcp(const std::vector<int>& ms, const std::string& scratch_name) {
  const fs::path work = scratch(scratch_name);
  json jobs = json::array();
  std::vector<std::string> labels;
  std::size_t fixtures_seen = 0;
  for (const std::string g : {"gen_sharded", "gen_zero_fsdp"}) {
    for (const fixture& f : fixtures(g)) {
      CAPTURE(f.label());
      REQUIRE(f.sharded());
      ++fixtures_seen;
      for (const int m : ms) {
        CAPTURE(m);
        const fs::path out = work / (f.name + "-m" + std::to_string(m));
        // PyTorch 1.13 is the oracle here: the 1.13 layout (tests/interop-torch2.cpp loads the
        // default 2.x layout in PyTorch 2.14).
        const run_result r = cli({"convert", f.path.string(), out.string(), "--to", "dcp", "--world-size", std::to_string(m),
                                  "--dcp-layout", "1.13"});
        INFO(r.describe());
        REQUIRE(r.code == 0);
        REQUIRE(fs::exists(out / ".metadata"));
        for (const auto& e : fs::directory_iterator(out)) {
          const std::string n = e.path().filename().string();
          if (n == ".metadata") continue;
          // __<rank>_<n>.distcp with rank < M, nothing else (no temporaries left behind).
          CHECK_MESSAGE(n.rfind("__", 0) == 0, "unexpected file " << n);
          const bool distcp = n.size() > 7 && n.substr(n.size() - 7) == ".distcp";
          CHECK_MESSAGE(distcp, "unexpected file " << n);
          if (n.rfind("__", 0) == 0) CHECK(std::stoi(n.substr(2)) < m);
        }
        const json got = inspect(out);
        CHECK(got.value("format", "") == "dcp");
        compare_options o;
        o.aliases = false;  // DCP stores every name as its own item
        const auto p = compare_with_manifest(got, f.manifest, o);
        CHECK_MESSAGE(p.empty(), f.label() << " -> DCP M=" << m << " re-inspected:" << join(p));
        jobs.push_back({{"kind", "dcp"}, {"dir", out.string()}, {"manifest", f.manifest}, {"world_size", m}});
        labels.push_back(f.label() + " -> DCP M=" + std::to_string(m));
      }
    }
  }
  CHECK(fixtures_seen == 26);
  CHECK(jobs.size() == 26 * ms.size());
  const auto results = oracle(jobs, work);
  for (std::size_t i = 0; i < results.size(); ++i)
    CHECK_MESSAGE(results[i].empty(), labels[i] << ": PyTorch's DCP reader disagrees:" << join(results[i]));
  MESSAGE(fixtures_seen << " sharded fixtures, " << jobs.size() << " DCP outputs loaded by PyTorch");
  drop_scratch(scratch_name);
}

}  // namespace cli_test
