// Crash safety of `statedict convert`: the tool is killed with SIGKILL at random moments spread
// over a whole run (fixed seed), and after every kill OUT must be absent or byte-identical to the
// previous complete output - never partial. Then one successful run must leave no temporary
// (`.<name>.statedict-<pid>-<n>.tmp`, io/file.hpp) behind: the killed runs' temporaries are
// removed by the next run that writes the same target.
//
// Outputs covered: a single .safetensors file, a single torch.save file, a Hugging Face sharded
// directory (--max-shard-size) and a DCP directory (--to dcp). The release build runs 120 trials
// on a 96 MiB input. Under AddressSanitizer the tool is several times slower and the input and
// trial count are cut (32 MiB, 24 trials) to keep the test's run time similar; what is checked is
// the same.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <statedict/io/safetensors.hpp>
#include <statedict/formats/safetensors.hpp>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace statedict;
namespace fs = std::filesystem;

#if defined(__SANITIZE_ADDRESS__)
#define CRASH_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CRASH_ASAN 1
#endif
#endif
#ifndef CRASH_ASAN
#define CRASH_ASAN 0
#endif

namespace {

constexpr int tensor_count = CRASH_ASAN ? 8 : 24;            // of 4 MiB each
constexpr int trials_file = CRASH_ASAN ? 8 : 40;             // .safetensors and .pt each
constexpr int trials_dir = CRASH_ASAN ? 4 : 20;              // HF directory and DCP directory each
static_assert(CRASH_ASAN || 2 * trials_file + 2 * trials_dir >= 100, "the release build runs at least 100 trials");

fs::path root() { return fs::path(STATEDICT_TEST_TMP) / "cli-crash"; }

pid_t spawn(const std::vector<std::string>& args) {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int devnull = ::open("/dev/null", O_WRONLY);
    if (devnull >= 0) {
      ::dup2(devnull, 1);
      ::dup2(devnull, 2);
    }
    std::vector<std::string> copy = args;
    std::vector<char*> argv;
    std::string exe = STATEDICT_CLI;
    argv.push_back(exe.data());
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(exe.c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

int wait_status(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
  }
  return status;
}

int run(const std::vector<std::string>& args) {
  const int st = wait_status(spawn(args));
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/// Every regular file under `p` (or `p` itself) by relative path, with its bytes.
std::map<std::string, std::string> snapshot(const fs::path& p) {
  std::map<std::string, std::string> m;
  auto read = [](const fs::path& f) {
    std::string s(static_cast<std::size_t>(fs::file_size(f)), '\0');
    const int fd = ::open(f.c_str(), O_RDONLY);
    REQUIRE(fd >= 0);
    std::size_t done = 0;
    while (done < s.size()) {
      const ssize_t n = ::read(fd, s.data() + done, s.size() - done);
      REQUIRE(n > 0);
      done += static_cast<std::size_t>(n);
    }
    ::close(fd);
    return s;
  };
  if (fs::is_regular_file(p)) {
    m[""] = read(p);
  } else if (fs::is_directory(p)) {
    for (const auto& e : fs::recursive_directory_iterator(p))
      if (e.is_regular_file()) m[fs::relative(e.path(), p).string()] = read(e.path());
      else if (!e.is_directory()) m[fs::relative(e.path(), p).string()] = "<not a regular file>";
  }
  return m;
}

/// Identity of every file under `p`: inode, size, mtime and ctime. Unchanged identities mean
/// unchanged bytes (any write or replacement changes them), so a trial reads OUT's bytes only when
/// it was replaced.
std::map<std::string, std::array<std::int64_t, 6>> identities(const fs::path& p) {
  std::map<std::string, std::array<std::int64_t, 6>> m;
  auto id = [](const fs::path& f) {
    struct stat st {};
    REQUIRE(::lstat(f.c_str(), &st) == 0);
    return std::array<std::int64_t, 6>{static_cast<std::int64_t>(st.st_ino), static_cast<std::int64_t>(st.st_size),
                                       st.st_mtim.tv_sec, st.st_mtim.tv_nsec, st.st_ctim.tv_sec, st.st_ctim.tv_nsec};
  };
  if (fs::is_regular_file(p)) {
    m[""] = id(p);
  } else if (fs::is_directory(p)) {
    m["."] = id(p);
    for (const auto& e : fs::recursive_directory_iterator(p)) m[fs::relative(e.path(), p).string()] = id(e.path());
  }
  return m;
}

/// Names in `d` that look like statedict temporaries.
std::vector<std::string> temporaries(const fs::path& d) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(d)) {
    const std::string n = e.path().filename().string();
    if (n.find(".statedict-") != std::string::npos) out.push_back(n);
  }
  return out;
}

/// Writes the input: tensor_count F32 tensors of 1024 x 1024, distinct contents.
fs::path make_input() {
  const fs::path in = root() / ("in-" + std::to_string(tensor_count) + ".safetensors");
  if (fs::exists(in)) return in;
  std::vector<Tensor> ts;
  std::vector<safetensors::Input> inputs;
  std::mt19937 rng(7);
  for (int i = 0; i < tensor_count; ++i) {
    Tensor t(dtype::F32, {1024, 1024});
    auto v = t.values<float>();
    for (std::size_t k = 0; k < v.size(); ++k) v[k] = static_cast<float>(rng() % 100000) * 0.001F + static_cast<float>(i);
    ts.push_back(std::move(t));
  }
  for (int i = 0; i < tensor_count; ++i)
    inputs.push_back(safetensors::Input::of("layers." + std::to_string(i) + ".weight", ts[static_cast<std::size_t>(i)].view()));
  (void)safetensors::write(in, inputs);
  return in;
}

struct outcome {
  int killed_before_commit = 0;  ///< OUT was still the previous output (or absent)
  int finished = 0;              ///< the run completed before the kill
  int trials = 0;
  int compared = 0;  ///< trials after which OUT had been replaced, so its bytes were compared
};

/// Runs `trials` killed conversions of `in` to `out` (extra args appended) and checks OUT each time.
outcome crash_trials(const fs::path& in, const fs::path& out, const std::vector<std::string>& extra, int trials,
                     std::uint64_t seed) {
  std::vector<std::string> args{"convert", in.string(), out.string(), "--threads", "2"};
  args.insert(args.end(), extra.begin(), extra.end());
  INFO("statedict convert " << in.string() << " " << out.string());
  fs::remove_all(out);
  // A first complete output; its bytes are what every later state must equal.
  REQUIRE(run(args) == 0);
  const auto reference = snapshot(out);
  REQUIRE_FALSE(reference.empty());
  // One uninterrupted run, timed, so the kills spread across a whole run.
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE(run(args) == 0);
  const double full = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(snapshot(out) == reference);  // the conversion is deterministic
  auto verified = identities(out);
  MESSAGE(out.filename().string() << ": one run takes " << full << " s");

  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> when(0.0, full * 1.1);
  outcome oc;
  for (int i = 0; i < trials; ++i) {
    const double delay = when(rng);
    const pid_t pid = spawn(args);
    std::this_thread::sleep_for(std::chrono::duration<double>(delay));
    ::kill(pid, SIGKILL);
    const int st = wait_status(pid);
    ++oc.trials;
    if (WIFEXITED(st)) {
      CHECK_MESSAGE(WEXITSTATUS(st) == 0, "trial " << i << " exited with " << WEXITSTATUS(st));
      ++oc.finished;
    } else {
      CHECK(WTERMSIG(st) == SIGKILL);
    }
    // OUT is the previous complete output, byte for byte, or absent; never partial.
    if (fs::exists(out)) {
      const auto ids = identities(out);
      if (ids != verified) {
        const auto now = snapshot(out);
        ++oc.compared;
        CHECK_MESSAGE(now == reference, "trial " << i << ": killed after " << delay << " s, OUT differs from the complete output ("
                                                 << now.size() << " files vs " << reference.size() << ")");
        if (now == reference) verified = identities(out);
      }
    }
    if (!WIFEXITED(st)) ++oc.killed_before_commit;
  }
  // The next successful run removes what the killed runs left.
  REQUIRE(run(args) == 0);
  CHECK(snapshot(out) == reference);
  const auto left = temporaries(out.parent_path());
  CHECK_MESSAGE(left.empty(), left.size() << " temporaries left, first: " << (left.empty() ? "" : left[0]));
  MESSAGE(out.filename().string() << ": " << oc.trials << " trials, " << oc.killed_before_commit << " killed, "
                                  << oc.finished << " finished before the kill, " << oc.compared
                                  << " left a replaced OUT (bytes compared)");
  return oc;
}

}  // namespace

TEST_CASE("convert killed at random moments leaves the previous output or nothing, never a partial one") {
  if (std::string(STATEDICT_CLI).empty() || !fs::exists(STATEDICT_CLI)) {
    WARN_MESSAGE(false, "statedict CLI not built; skipped");
    return;
  }
  fs::create_directories(root());
  const fs::path in = make_input();
  int total = 0;
  SUBCASE("single .safetensors file") {
    fs::create_directories(root() / "st");
    total = crash_trials(in, root() / "st" / "out.safetensors", {}, trials_file, 1).trials;
  }
  SUBCASE("single torch.save file") {
    fs::create_directories(root() / "pt");
    total = crash_trials(in, root() / "pt" / "out.pt", {}, trials_file, 2).trials;
  }
  SUBCASE("Hugging Face sharded directory") {
    fs::create_directories(root() / "hf");
    total = crash_trials(in, root() / "hf" / "out", {"--max-shard-size", "20MB"}, trials_dir, 3).trials;
  }
  SUBCASE("DCP directory for 2 ranks") {
    fs::create_directories(root() / "dcp");
    total = crash_trials(in, root() / "dcp" / "out", {"--to", "dcp", "--world-size", "2"}, trials_dir, 4).trials;
  }
  CHECK(total > 0);
}
