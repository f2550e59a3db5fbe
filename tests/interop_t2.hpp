// Shared helpers of tests/interop-torch2.cpp and tests/interop-corpus.cpp: what statedict reads,
// as `inspect --json --hash` would print it but through the library (so the sanitizer build
// checks the readers too), manifests adjusted to statedict's dtype names, and the batched torch
// 2.x oracle (tests/python/torch2/t2_oracle.py through tools/sid-python).
#pragma once

#include "cli_util.hpp"
#include "test_util.hpp"

#include <statedict/statedict.hpp>

#include <set>

namespace t2_test {

using namespace cli_test;
namespace sd = statedict;

/// Whether the Python oracle runs: not in the sanitizer build, whose stage checks the readers and
/// writers in process (the main build runs the same tests with the oracle).
#if defined(STATEDICT_TEST_NO_ORACLE)
inline constexpr bool with_oracle = false;
#else
inline constexpr bool with_oracle = true;
#endif

inline const fs::path t2_fixtures = fixture_root / "torch2";

/// inspect --json --hash of an opened checkpoint: every tensor (tied names too) with dtype, shape
/// and sha256, every value, every tie.
inline json describe_json(const sd::ShardedCheckpoint& opened) {
  const auto ties = opened.skeleton.is_null() ? std::vector<sd::formats::Tie>{} : sd::formats::tied_names(opened.skeleton);
  const auto values = opened.skeleton.is_null() ? std::vector<std::pair<std::string, sd::Value>>{} : sd::skeleton_values(opened.skeleton);
  const sd::ShardedCheckpoint ck = sd::formats::expand_ties(opened, ties);
  const auto hashes = sd::sha256_tensors(ck);
  json j = {{"tensors", json::object()}, {"values", json::object()}, {"aliases", json::object()}};
  for (std::size_t i = 0; i < ck.tensors.size(); ++i) {
    const sd::TensorInfo& t = ck.tensors[i];
    json shape = json::array();
    for (const auto d : t.shape) shape.push_back(d);
    j["tensors"][t.name] = {{"dtype", std::string(sd::name(t.dtype))}, {"shape", shape}, {"sha256", hashes[i].second}};
  }
  for (const auto& [n, v] : values) j["values"][n] = json(sd::value_json(v));
  for (const auto& t : ties) j["aliases"][t.name] = t.target;
  return j;
}

using statedict_test::error_of;

/// Runs the torch 2.x oracle on a job list (t2_oracle.py's jobs); one list of problems per job.
inline std::vector<std::vector<std::string>> t2_oracle(const json& jobs, const fs::path& workdir) {
  const fs::path in = workdir / "t2_jobs.json", out = workdir / "t2_results.json";
  write_file(in, jobs.dump());
  std::error_code ec;
  fs::remove(out, ec);
  const run_result r = run({(source_dir / "tools" / "sid-python").string(),
                            (source_dir / "tests" / "python" / "torch2" / "t2_oracle.py").string(), in.string(), out.string()});
  INFO("t2_oracle.py: " << r.describe());
  REQUIRE(r.code == 0);
  const json res = load_json(out);
  REQUIRE(res.size() == jobs.size());
  std::vector<std::vector<std::string>> v;
  for (const auto& x : res) v.push_back(x.get<std::vector<std::string>>());
  return v;
}

/// Jobs and their labels, run as one batch.
struct job_list {
  json jobs = json::array();
  std::vector<std::string> labels;
  void add(std::string label, json job) {
    labels.push_back(std::move(label));
    jobs.push_back(std::move(job));
  }
  /// Runs them (main build) and checks every one came back clean; returns how many ran.
  std::size_t check(const fs::path& workdir) const {
    if (!with_oracle || jobs.empty()) return 0;
    const auto results = t2_oracle(jobs, workdir);
    for (std::size_t i = 0; i < results.size(); ++i)
      CHECK_MESSAGE(results[i].empty(), labels[i] << ": torch 2.x disagrees:" << join(results[i]));
    return results.size();
  }
};

}  // namespace t2_test
