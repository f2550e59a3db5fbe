// `statedict convert` with stderr a file (not a terminal): progress as plain newline-terminated
// lines from each writer (one safetensors file, a torch.save file, a Hugging Face folder), none
// with --quiet, and a failing command's error still the one line.
#include <doctest/doctest.h>

#include <statedict/statedict.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "cli_util.hpp"

namespace {

using namespace cli_test;

/// A safetensors file of two small F32 tensors.
fs::path sample(const fs::path& dir) {
  statedict::Dict d;
  for (const char* n : {"a.weight", "b.weight"}) {
    statedict::Tensor t(statedict::dtype::F32, {64, 64});
    float x = 0;
    for (float& v : t.values<float>()) v = (x += 0.5F);
    d.insert(n, std::move(t));
  }
  const fs::path p = dir / "in.safetensors";
  (void)statedict::safetensors::write_state(p, statedict::Value(std::move(d)));
  return p;
}

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

}  // namespace

TEST_CASE("convert, stderr not a terminal: plain progress lines, the copy and the sync named, then the summary") {
  const fs::path dir = scratch("progress");
  const fs::path in = sample(dir);
  struct target {
    std::vector<std::string> extra;
    std::string out, file;  // the output, and the file the copy and sync lines name
  };
  const std::vector<target> targets{{{}, "out.safetensors", "out.safetensors"},
                                    {{}, "out.pt", "out.pt"},
                                    {{"--to", "hf"}, "hf", "model.safetensors"}};
  for (const auto& t : targets) {
    CAPTURE(t.out);
    std::vector<std::string> args{"convert", in.string(), (dir / t.out).string()};
    args.insert(args.end(), t.extra.begin(), t.extra.end());
    const run_result r = cli(args);
    INFO(r.describe());
    REQUIRE(r.code == 0);
    CHECK(r.err.find('\r') == std::string::npos);
    REQUIRE_FALSE(r.err.empty());
    CHECK(r.err.back() == '\n');
    const auto ls = lines(r.err);
    for (const auto& l : ls) CHECK(starts_with(l, "statedict: "));
    REQUIRE(ls.size() == 3);
    // The copy: percent, bytes of the total, the file (a line at its start: no rate yet).
    CHECK(starts_with(ls[0], "statedict: copying  "));
    CHECK(ls[0].find("% ") != std::string::npos);
    CHECK(ls[0].find(" of 32.8 kB  " + t.file) != std::string::npos);
    CHECK(ls[1] == "statedict: syncing  0:00  " + t.file);
    CHECK(starts_with(ls[2], "statedict: wrote "));
  }
  // --quiet: nothing on stderr.
  const run_result q = cli({"convert", in.string(), (dir / "quiet.safetensors").string(), "--quiet"});
  INFO(q.describe());
  CHECK(q.code == 0);
  CHECK(q.err.empty());
  CHECK(fs::exists(dir / "quiet.safetensors"));
  // An error before the copy: the one line, no progress before it.
  const run_result e = cli({"convert", (dir / "missing.safetensors").string(), (dir / "x.safetensors").string()});
  CHECK(e.code == 2);
  CHECK(lines(e.err).size() == 1);
  drop_scratch("progress");
}
