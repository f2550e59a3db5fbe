// `statedict verify A B` end to end: every fixture of every format equals (exit 0) its own
// consolidated .safetensors and .pt conversions; one byte flipped inside one tensor's data (found
// from the safetensors header) makes it exit 1 naming exactly that tensor; --rtol accepts a BF16
// round trip that the exact comparison rejects; --with-optimizer compares the optimizer state of
// ZeRO and OLMo checkpoints. Bad input and usage exit 2 with one line on stderr naming the path
// (missing path, unrecognised directory, unknown option, wrong argument count, ...) for every
// command.
#include "cli_util.hpp"

using namespace cli_test;

namespace {

const std::set<std::string> refused = {"gen_torch_files/malicious_os_system", "gen_safetensors/exotic_dtypes"};

bool has_c128(const json& m) {
  for (const auto& [n, t] : m["tensors"].items())
    if (t["dtype"] == "C128") return true;
  return false;
}

/// One line on stderr, exit 2, naming `what`.
void check_usage_error(const run_result& r, const std::string& what) {
  INFO(r.describe());
  CHECK(r.code == 2);
  CHECK(lines(r.err).size() == 1);
  CHECK_MESSAGE(r.err.find(what) != std::string::npos, "stderr does not name '" << what << "'");
}

}  // namespace

TEST_CASE("verify: every fixture equals its conversions; a flipped byte is found and named") {
  const fs::path work = scratch("verify");
  std::size_t equal_checked = 0, flips_checked = 0;
  for (const std::string g : {"gen_torch_files", "gen_safetensors", "gen_sharded", "gen_zero_fsdp"}) {
    for (const fixture& f : fixtures(g)) {
      if (refused.count(f.label())) continue;
      CAPTURE(f.label());
      const fs::path dir = work / f.name;
      fs::create_directories(dir);
      const fs::path pt = dir / "c.pt";
      {
        const run_result c = cli({"convert", f.path.string(), pt.string()});
        REQUIRE_MESSAGE(c.code == 0, c.describe());
        const run_result v = cli({"verify", f.path.string(), pt.string()});
        CHECK_MESSAGE(v.code == 0, "verify fixture .pt: " << v.describe());
        CHECK(v.out.rfind("equal: ", 0) == 0);
        ++equal_checked;
        // Written through the page cache instead of with direct I/O: the same bytes (same file
        // name: a .pt's archive folder is named after it).
        fs::create_directories(dir / "cached");
        const fs::path cached = dir / "cached" / "c.pt";
        const run_result cc = cli({"convert", f.path.string(), cached.string(), "--write", "cached"});
        REQUIRE_MESSAGE(cc.code == 0, cc.describe());
        CHECK_MESSAGE(read_file(cached) == read_file(pt), "--write cached wrote other bytes than direct I/O");
      }
      if (has_c128(f.manifest)) continue;
      const fs::path st = dir / "c.safetensors";
      const run_result c = cli({"convert", f.path.string(), st.string()});
      REQUIRE_MESSAGE(c.code == 0, c.describe());
      const run_result v = cli({"verify", f.path.string(), st.string()});
      CHECK_MESSAGE(v.code == 0, "verify fixture .safetensors: " << v.describe());
      const run_result v2 = cli({"verify", st.string(), f.path.string(), "--io", "pread"});
      CHECK_MESSAGE(v2.code == 0, "verify .safetensors fixture --io pread: " << v2.describe());
      const fs::path st_cached = dir / "cached" / "c.safetensors";
      const run_result sc = cli({"convert", f.path.string(), st_cached.string(), "--write", "cached", "--threads", "3"});
      REQUIRE_MESSAGE(sc.code == 0, sc.describe());
      CHECK_MESSAGE(read_file(st_cached) == read_file(st), "--write cached wrote other bytes than direct I/O");

      // Flip one byte in the middle of the largest tensor's data; nothing else ties to it unless
      // the manifest says so.
      const auto entries = safetensors_entries(st);
      std::string victim;
      std::uint64_t size = 0;
      for (const auto& [n, e] : entries)
        if (e.end - e.begin > size) {
          victim = n;
          size = e.end - e.begin;
        }
      if (size == 0) continue;
      const st_entry& e = entries.at(victim);
      std::string bytes = read_file(st);
      const std::uint64_t at = e.begin + size / 2;
      bytes[at] = static_cast<char>(bytes[at] ^ 0x5a);
      const fs::path bad = dir / "flipped.safetensors";
      write_file(bad, bytes);
      const run_result d = cli({"verify", f.path.string(), bad.string()});
      INFO(d.describe());
      CHECK(d.code == 1);
      CHECK(d.err.empty());
      CHECK_MESSAGE(d.out.find("tensor " + statedict::quote(victim) + ": element ") != std::string::npos,
                    "verify does not name tensor '" << victim << "' and the element");
      // Only that tensor (and names tied to it) differ.
      std::set<std::string> tied{victim};
      const json aliases = f.manifest.value("aliases", json::object());
      for (const auto& [a, t] : aliases.items())
        if (t == victim) tied.insert(a);
      std::size_t diff_lines = 0;
      for (const auto& l : lines(d.out))
        if (l.rfind("tensor ", 0) == 0 || l.rfind("value ", 0) == 0) ++diff_lines;
      CHECK(diff_lines == tied.size());
      CHECK(lines(d.out).back().rfind("different: ", 0) == 0);
      ++flips_checked;
    }
  }
  MESSAGE(equal_checked << " fixtures verified equal to their conversions, " << flips_checked << " flipped bytes found");
  CHECK(equal_checked == 59);
  CHECK(flips_checked >= 50);
  drop_scratch("verify");
}

TEST_CASE("verify: BF16 round trip differs exactly, equal within --rtol; --with-optimizer") {
  const fs::path work = scratch("verify-tol");
  const fixture f = fixtures("gen_sharded").front();  // dcp_w2: F32 and BF16 tensors
  const fs::path bf = work / "bf16.safetensors";
  REQUIRE(cli({"convert", f.path.string(), bf.string(), "--dtype", "BF16"}).code == 0);
  const run_result exact = cli({"verify", f.path.string(), bf.string()});
  CHECK(exact.code == 1);
  CHECK(exact.out.find("dtype F32 in A, BF16 in B") != std::string::npos);
  const run_result tol = cli({"verify", f.path.string(), bf.string(), "--rtol", "0.01"});
  CHECK_MESSAGE(tol.code == 0, tol.describe());
  const run_result tight = cli({"verify", f.path.string(), bf.string(), "--rtol", "1e-9"});
  CHECK(tight.code == 1);
  CHECK(tight.out.find("beyond rtol/atol") != std::string::npos);

  for (const fixture& z : fixtures("gen_zero_fsdp")) {
    if (!z.optim) continue;
    CAPTURE(z.label());
    const fs::path out = work / (z.name + ".safetensors");
    REQUIRE(cli({"convert", z.path.string(), out.string(), "--with-optimizer"}).code == 0);
    const run_result v = cli({"verify", z.path.string(), out.string(), "--with-optimizer"});
    CHECK_MESSAGE(v.code == 0, v.describe());
    // Without the optimizer on A, B's optimizer tensors are "only in B".
    const run_result w = cli({"verify", z.path.string(), out.string()});
    CHECK(w.code == 1);
    CHECK(w.out.find("exp_avg") != std::string::npos);
  }
  drop_scratch("verify-tol");
}

TEST_CASE("bad input and usage: exit 2, one line on stderr naming the path") {
  const fs::path work = scratch("usage");
  const fixture f = fixtures("gen_safetensors").front();
  const std::string good = f.path.string();
  const std::string missing = (work / "no-such-checkpoint.safetensors").string();

  check_usage_error(cli({"verify", missing, good}), "no-such-checkpoint.safetensors");
  check_usage_error(cli({"verify", good, missing}), "no-such-checkpoint.safetensors");
  check_usage_error(cli({"inspect", missing}), "no-such-checkpoint.safetensors");
  check_usage_error(cli({"convert", missing, (work / "o.safetensors").string()}), "no-such-checkpoint.safetensors");

  // A directory statedict does not recognise: empty, and holding an unrelated file.
  const fs::path empty = work / "empty-dir";
  fs::create_directories(empty);
  check_usage_error(cli({"verify", empty.string(), good}), "empty-dir");
  check_usage_error(cli({"inspect", empty.string()}), "empty-dir");
  const fs::path junk = work / "junk-dir";
  fs::create_directories(junk);
  write_file(junk / "notes.txt", "not a checkpoint\n");
  check_usage_error(cli({"verify", good, junk.string()}), "junk-dir");
  check_usage_error(cli({"convert", junk.string(), (work / "o.pt").string()}), "junk-dir");
  // A file that is no checkpoint.
  write_file(work / "garbage.bin", std::string(100, 'x'));
  check_usage_error(cli({"inspect", (work / "garbage.bin").string()}), "garbage.bin");

  // Usage: argument counts, unknown options, bad values.
  check_usage_error(cli({"verify", good}), "verify");
  check_usage_error(cli({"verify", good, good, good}), "verify");
  check_usage_error(cli({"verify", good, good, "--rtol", "abc"}), "--rtol");
  check_usage_error(cli({"verify", good, good, "--frobnicate"}), "--frobnicate");
  check_usage_error(cli({"inspect"}), "inspect");
  check_usage_error(cli({"inspect", good, "--io", "carrier-pigeon"}), "--io");
  check_usage_error(cli({"convert", good}), "convert");
  check_usage_error(cli({"convert", good, (work / "o.pt").string(), "--write", "sideways"}), "--write");
  check_usage_error(cli({"convert", good, (work / "out.unknown").string()}), "out.unknown");
  check_usage_error(cli({"convert", good, (work / "o.pt").string(), "--dtype", "I32"}), "--dtype");
  check_usage_error(cli({"convert", good, (work / "o.pt").string(), "--world-size", "2"}), "--world-size");
  check_usage_error(cli({"convert", good, (work / "d").string(), "--to", "dcp", "--world-size", "0"}), "--world-size");
  check_usage_error(cli({"convert", good, (work / "d").string(), "--to", "dcp", "--dcp-layout", "3"}), "--dcp-layout");
  check_usage_error(cli({"convert", good, (work / "o.pt").string(), "--dcp-layout", "1.13"}), "--dcp-layout");
  check_usage_error(cli({"convert", good, (work / "o.safetensors").string(), "--only", "no_such_prefix"}), "--only");
  check_usage_error(cli({"frobnicate"}), "frobnicate");
  CHECK_FALSE(fs::exists(work / "o.pt"));
  CHECK_FALSE(fs::exists(work / "o.safetensors"));
  CHECK_FALSE(fs::exists(work / "d"));

  const run_result none = cli({});
  CHECK(none.code == 2);
  const run_result help = cli({"--help"});
  CHECK(help.code == 0);
  CHECK(help.out.find("statedict verify A B") != std::string::npos);

  // Equal inputs in different formats, the same path twice.
  const run_result same = cli({"verify", good, good});
  CHECK(same.code == 0);
  drop_scratch("usage");
}
