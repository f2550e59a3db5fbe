// Corrupt-file corpus: one hand-made file per failure mode, built at run time, each with the error
// id it must produce. Every file is checked twice: through the reader it targets (library level,
// exact id), and through `statedict inspect FILE`, which must exit 2 with exactly one line on
// stderr naming the file and carrying the same id - no crash, no hang, no unbounded allocation
// (the tool runs under a 2 GB address-space limit, except in sanitizer builds whose shadow memory
// needs far more; the limit is the only thing skipped there).
#include <doctest/doctest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <statedict/formats/dcp.hpp>
#include <statedict/formats/registry.hpp>
#include <statedict/io/pickle_write.hpp>
#include <statedict/io/safetensors.hpp>
#include <statedict/io/torch_file.hpp>
#include <statedict/io/zip.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace statedict;
namespace fs = std::filesystem;

#if defined(__SANITIZE_ADDRESS__)
#define CORRUPT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CORRUPT_ASAN 1
#endif
#endif
#ifndef CORRUPT_ASAN
#define CORRUPT_ASAN 0
#endif

namespace {

fs::path dir() {
  static const fs::path d = [] {
    fs::path p = fs::path(STATEDICT_TEST_TMP) / "cli-corrupt";
    fs::remove_all(p);
    fs::create_directories(p);
    return p;
  }();
  return d;
}

using statedict_test::read_all;
using statedict_test::write_all;

std::string le(std::uint64_t v, int n) {
  std::string s(static_cast<std::size_t>(n), '\0');
  for (int i = 0; i < n; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}
void put(std::string& s, std::size_t at, std::uint64_t v, int n) { s.replace(at, static_cast<std::size_t>(n), le(v, n)); }
std::uint64_t get(const std::string& s, std::size_t at, int n) {
  std::uint64_t v = 0;
  for (int i = n; i-- > 0;) v = (v << 8) | static_cast<unsigned char>(s[at + static_cast<std::size_t>(i)]);
  return v;
}

using statedict_test::error_of;

// ---- the command-line tool ------------------------------------------------------------------

struct run_result {
  int exit_code = -1;  ///< -1 when killed by a signal
  int signal = 0;
  std::string err;
};

/// Runs `statedict args...` with stdout discarded, stderr captured, an address-space limit (not
/// under ASan) and a watchdog alarm (a hang shows up as SIGALRM).
run_result run_cli(const std::vector<std::string>& args) {
  const fs::path err_path = dir() / "stderr.txt";
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int devnull = ::open("/dev/null", O_WRONLY);
    const int errfd = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (devnull < 0 || errfd < 0) ::_exit(127);
    ::dup2(devnull, 1);
    ::dup2(errfd, 2);
    if (!CORRUPT_ASAN) {
      struct rlimit rl {};
      rl.rlim_cur = rl.rlim_max = rlim_t{2000000} * 1024;  // ulimit -v 2000000
      ::setrlimit(RLIMIT_AS, &rl);
    }
    ::alarm(120);  // preserved across exec: a hang dies of SIGALRM
    std::vector<char*> argv;
    std::string exe = STATEDICT_CLI;
    argv.push_back(exe.data());
    std::vector<std::string> copy = args;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(exe.c_str(), argv.data());
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
  }
  run_result r;
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  r.err = read_all(err_path);
  return r;
}

bool have_cli() { return std::string(STATEDICT_CLI).size() > 0 && fs::exists(STATEDICT_CLI); }

/// `statedict inspect path`: exit 2, one line on stderr naming `names` (the file) with error `id`.
void check_cli(const fs::path& path, const error_id& id, const std::string& names = "") {
  if (!have_cli()) return;
  const run_result r = run_cli({"inspect", path.string()});
  INFO("inspect " << path.string() << " -> exit " << r.exit_code << ", signal " << r.signal << ", stderr: " << r.err);
  CHECK(r.signal == 0);
  CHECK(r.exit_code == 2);
  REQUIRE_FALSE(r.err.empty());
  CHECK(r.err.back() == '\n');
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  const std::string tag = "[statedict." + std::string(to_string(id.kind)) + "." + std::to_string(id.id) + "]";
  CHECK_MESSAGE(r.err.find(tag) != std::string::npos, "expected " << tag << " (" << id.name << ")");
  const std::string n = names.empty() ? path.filename().string() : names;
  CHECK_MESSAGE(r.err.find(n) != std::string::npos, "the message should name " << n);
  // something after the context: "where: what was expected"
  CHECK(r.err.find(": ", r.err.find(']')) != std::string::npos);
}

/// Library check (exact id) and command-line check for one file.
void expect(const fs::path& path, const error_id& id, const std::function<void()>& lib, const std::string& names = "") {
  std::string what;
  const int got = error_of(lib, &what);
  CHECK_MESSAGE(got == id.id, path.filename().string() << ": expected " << id.name << " (" << id.id << "), got " << got
                                                       << ": " << what);
  check_cli(path, id, names);
}

// ---- safetensors ------------------------------------------------------------------------------

std::string st_bytes(const std::string& header, const std::string& data) { return le(header.size(), 8) + header + data; }
fs::path st_file(const std::string& name, const std::string& header, const std::string& data) {
  const fs::path p = dir() / (name + ".safetensors");
  write_all(p, st_bytes(header, data));
  return p;
}
void expect_st(const fs::path& p, const error_id& id) {
  expect(p, id, [&] { (void)safetensors::File::open(p); });
}

// ---- zip archives and pickles ------------------------------------------------------------------

struct Rec {
  std::string name;
  std::string data;
};

/// A stored zip archive built by hand (no ZIP64 unless asked), so every field can be made to lie.
struct ZipParts {
  std::string bytes;
  std::size_t cd_offset = 0, cd_size = 0, end_pos = 0, end64_pos = 0, locator_pos = 0;
  std::vector<std::size_t> central;  ///< offset of each central header
};
ZipParts build_zip(const std::vector<Rec>& recs, bool zip64) {
  ZipParts z;
  std::vector<std::size_t> local;
  for (const auto& r : recs) {
    local.push_back(z.bytes.size());
    z.bytes += le(0x04034b50, 4) + le(20, 2) + le(0, 2) + le(0, 2) + le(0, 2) + le(0, 2);
    z.bytes += le(zip::crc32(std::as_bytes(std::span<const char>(r.data.data(), r.data.size()))), 4);
    z.bytes += le(r.data.size(), 4) + le(r.data.size(), 4) + le(r.name.size(), 2) + le(0, 2) + r.name + r.data;
  }
  z.cd_offset = z.bytes.size();
  for (std::size_t i = 0; i < recs.size(); ++i) {
    const auto& r = recs[i];
    z.central.push_back(z.bytes.size());
    z.bytes += le(0x02014b50, 4) + le(20, 2) + le(20, 2) + le(0, 2) + le(0, 2) + le(0, 2) + le(0, 2);
    z.bytes += le(zip::crc32(std::as_bytes(std::span<const char>(r.data.data(), r.data.size()))), 4);
    z.bytes += le(r.data.size(), 4) + le(r.data.size(), 4) + le(r.name.size(), 2) + le(0, 2) + le(0, 2) + le(0, 2) + le(0, 2) +
               le(0, 4) + le(local[i], 4) + r.name;
  }
  z.cd_size = z.bytes.size() - z.cd_offset;
  if (zip64) {
    z.end64_pos = z.bytes.size();
    z.bytes += le(0x06064b50, 4) + le(44, 8) + le(45, 2) + le(45, 2) + le(0, 4) + le(0, 4) + le(recs.size(), 8) +
               le(recs.size(), 8) + le(z.cd_size, 8) + le(z.cd_offset, 8);
    z.locator_pos = z.bytes.size();
    z.bytes += le(0x07064b50, 4) + le(0, 4) + le(z.end64_pos, 8) + le(1, 4);
  }
  z.end_pos = z.bytes.size();
  z.bytes += le(0x06054b50, 4) + le(0, 2) + le(0, 2) + le(recs.size(), 2) + le(recs.size(), 2) + le(z.cd_size, 4) +
             le(z.cd_offset, 4) + le(0, 2);
  return z;
}

// pickle fragments (protocol 2)
std::string u32s(std::uint32_t v) { return le(v, 4); }
std::string str(std::string_view s) { return "X" + u32s(static_cast<std::uint32_t>(s.size())) + std::string(s); }
std::string glob(std::string_view m, std::string_view n) { return "c" + std::string(m) + "\n" + std::string(n) + "\n"; }
std::string integer(std::int64_t v) {
  if (v >= INT32_MIN && v <= INT32_MAX) return "J" + u32s(static_cast<std::uint32_t>(static_cast<std::int32_t>(v)));
  return "\x8a\x08" + le(static_cast<std::uint64_t>(v), 8);  // LONG1, 8 bytes
}
std::string tuple(const std::vector<std::int64_t>& v) {
  std::string s = "(";
  for (auto x : v) s += integer(x);
  return s + "t";
}
std::string tensor_v2(std::string_view key, std::int64_t numel, const std::vector<std::int64_t>& size,
                      const std::vector<std::int64_t>& stride) {
  return glob("torch._utils", "_rebuild_tensor_v2") + "((" + str("storage") + glob("torch", "FloatStorage") + str(key) +
         str("cpu") + integer(numel) + "tQ" + integer(0) + tuple(size) + tuple(stride) + "\x89" +
         glob("collections", "OrderedDict") + ")RtR";
}
std::string pkl(const std::string& body) { return "\x80\x02" + body + "."; }
std::string floats4() {
  const float f[4] = {1, 2, 3, 4};
  return std::string(reinterpret_cast<const char*>(f), sizeof f);
}
/// A torch.save archive around `pickle` (records under "a/").
std::string torch_bytes(const std::string& pickle, std::vector<Rec> storages = {}, bool zip64 = false) {
  std::vector<Rec> recs{{"a/data.pkl", pickle}};
  for (auto& s : storages) recs.push_back({"a/data/" + s.name, s.data});
  recs.push_back({"a/version", "3\n"});
  return build_zip(recs, zip64).bytes;
}
fs::path pt_file(const std::string& name, const std::string& bytes) {
  const fs::path p = dir() / (name + ".pt");
  write_all(p, bytes);
  return p;
}
void expect_pt(const fs::path& p, const error_id& id) {
  expect(p, id, [&] { (void)torch::describe(p); });
}
/// A pickle that must fail inside a torch file (library: the unpickler alone and torch::load).
void expect_pickle(const std::string& name, const std::string& pickle, const error_id& id) {
  CHECK_MESSAGE(error_of([&] { (void)pickle::load(std::as_bytes(std::span<const char>(pickle.data(), pickle.size()))); }) == id.id,
                name);
  expect_pt(pt_file(name, torch_bytes(pickle)), id);
}

}  // namespace

// =============================================================================================

TEST_CASE("the corpus builders make valid files") {
  const auto st = st_file("valid", R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"__metadata__":{"k":"v"}})",
                          floats4());
  CHECK(safetensors::File::open(st).size() == 1);
  const auto pt = pt_file("valid", torch_bytes(pkl(tensor_v2("0", 4, {4}, {1})), {{"0", floats4()}}));
  CHECK(torch::load(pt).as_tensor().numel() == 4);
  const auto pt64 = pt_file("valid64", torch_bytes(pkl(tensor_v2("0", 4, {4}, {1})), {{"0", floats4()}}, true));
  CHECK(torch::load(pt64).as_tensor().numel() == 4);
  if (have_cli()) {
    for (const auto& p : {st, pt, pt64}) {
      const run_result r = run_cli({"inspect", p.string()});
      INFO(r.err);
      CHECK(r.exit_code == 0);
    }
  }
}

TEST_CASE("safetensors: truncated at every cut point") {
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"I64","shape":[3],"data_offsets":[16,40]}})";
  const std::string data = std::string(40, '\x11');
  const std::string full = st_bytes(header, data);
  CHECK(error_of([&] {
          write_all(dir() / "full.safetensors", full);
          (void)safetensors::File::open(dir() / "full.safetensors");
        }) == 0);
  for (std::size_t cut = 0; cut < full.size(); ++cut) {
    // every cut in the first 16 bytes and the last 16, every 7th in between (CLI runs are slower)
    const bool run_cli_too = cut < 16 || cut + 16 > full.size() || cut % 7 == 0;
    const fs::path p = dir() / ("cut" + std::to_string(cut) + ".safetensors");
    write_all(p, full.substr(0, cut));
    const error_id& id = cut < 8                    ? errors::st_header_too_small
                         : cut < 8 + header.size() ? errors::st_header_length
                                                   : errors::st_incomplete_buffer;
    CAPTURE(cut);
    if (run_cli_too) expect_st(p, id);
    else CHECK(error_of([&] { (void)safetensors::File::open(p); }) == id.id);
    fs::remove(p);
  }
}

TEST_CASE("safetensors: lying headers, offsets, shapes, dtypes, metadata") {
  const std::string f16 = floats4() + floats4();
  SUBCASE("header length larger than the file") {
    std::string b = st_bytes(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", f16);
    put(b, 0, b.size(), 8);
    const fs::path p = dir() / "hdr_past_end.safetensors";
    write_all(p, b);
    expect_st(p, errors::st_header_length);
  }
  SUBCASE("header length huge (2^62, 2^64-1)") {
    for (std::uint64_t n : {std::uint64_t{1} << 62, ~std::uint64_t{0}, std::uint64_t{100'000'001}}) {
      std::string b = st_bytes(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", f16);
      put(b, 0, n, 8);
      const fs::path p = dir() / ("hdr_huge_" + std::to_string(n) + ".safetensors");
      write_all(p, b);
      expect_st(p, errors::st_header_too_large);
    }
  }
  SUBCASE("overlapping offsets") {
    expect_st(st_file("overlap",
                      R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                      f16 + std::string(8, '\0')),
              errors::st_invalid_offset);
  }
  SUBCASE("offsets out of the file") {
    expect_st(st_file("past_end", R"({"a":{"dtype":"F32","shape":[1048576],"data_offsets":[0,4194304]}})", f16),
              errors::st_incomplete_buffer);
    expect_st(st_file("past_end_gap", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[4096,4112]}})", f16),
              errors::st_invalid_offset);
    expect_st(st_file("offset_2_64",
                      R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"U8","shape":[0],"data_offsets":[16,18446744073709551615]}})",
                      f16),
              errors::st_size_mismatch);
    expect_st(st_file("offset_too_big", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,18446744073709551616]}})", f16),
              errors::st_bad_offset_value);
  }
  SUBCASE("element count overflow") {
    expect_st(st_file("numel", R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,16]}})", f16),
              errors::st_overflow);
    expect_st(st_file("bits", R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,16]}})", f16),
              errors::st_overflow);
  }
  SUBCASE("negative and non-integer dims") {
    expect_st(st_file("negdim", R"({"a":{"dtype":"F32","shape":[-1,4],"data_offsets":[0,16]}})", f16), errors::st_bad_dim);
    expect_st(st_file("floatdim", R"({"a":{"dtype":"F32","shape":[4.0],"data_offsets":[0,16]}})", f16), errors::st_bad_dim);
  }
  SUBCASE("unknown dtype") {
    expect_st(st_file("dtype", R"({"a":{"dtype":"F33","shape":[4],"data_offsets":[0,16]}})", f16), errors::st_unknown_dtype);
  }
  SUBCASE("__metadata__ that is not an object of strings") {
    expect_st(st_file("meta_int", R"({"__metadata__":{"k":1},"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", f16),
              errors::st_metadata_type);
    expect_st(st_file("meta_list", R"({"__metadata__":["k"],"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", f16),
              errors::st_metadata_type);
  }
  SUBCASE("too many dims, and deep JSON (200,000 levels)") {
    std::string dims;
    for (int i = 0; i < 2000; ++i) dims += i ? ",1" : "1";
    expect_st(st_file("rank", R"({"a":{"dtype":"F32","shape":[)" + dims + R"(],"data_offsets":[0,4]}})", floats4().substr(0, 4)),
              errors::st_too_many_dims);
    const std::string deep = R"({"__metadata__":{},"x":)" + std::string(200000, '[') + std::string(200000, ']') + "}";
    expect_st(st_file("deep_json", deep, ""), errors::st_json_depth);
  }
  SUBCASE("rank over what the planner places (64): inspect shows it, convert refuses it in one line") {
    std::string dims;
    for (int i = 0; i < 100; ++i) dims += i ? ",1" : "1";
    const auto p = st_file("rank100", R"({"a":{"dtype":"F32","shape":[)" + dims + R"(],"data_offsets":[0,4]}})", floats4().substr(0, 4));
    CHECK(safetensors::File::open(p).describe().tensors.size() == 1);
    if (have_cli()) {
      CHECK(run_cli({"inspect", p.string()}).exit_code == 0);
      const fs::path out = dir() / "rank100_out.safetensors";
      const run_result r = run_cli({"convert", p.string(), out.string()});
      INFO(r.err);
      CHECK(r.exit_code == 2);
      CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
      CHECK(r.err.find(".115]") != std::string::npos);
      CHECK(r.err.find("'a'") != std::string::npos);
      CHECK_FALSE(fs::exists(out));
    }
  }
  SUBCASE("statedict skeleton nested 200,000 levels deep") {
    std::string node = "[]";
    std::string skel = R"({\"statedict_skeleton\":1,\"root\":{\"dict\":[[\"x\",)";
    for (int i = 0; i < 200000; ++i) skel += R"({\"list\":[)";
    skel += R"({\"tensor\":\"a\",\"dtype\":\"F32\",\"shape\":[4]})";
    for (int i = 0; i < 200000; ++i) skel += "]}";
    skel += "]]}}";
    const auto p = st_file("deep_skeleton",
                           R"({"__metadata__":{"statedict.skeleton":")" + skel + R"("},"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
                           floats4());
    expect(p, errors::st_skeleton_depth, [&] { (void)safetensors::File::open(p).describe(); });
  }
  SUBCASE("header that is not JSON, not an object, not UTF-8") {
    expect_st(st_file("not_json", "{\"a\":", ""), errors::st_header_json);
    expect_st(st_file("utf8", "{\"\xff\":1}", ""), errors::st_header_utf8);
  }
}

TEST_CASE("torch.save zip: truncated at every cut point") {
  const std::string full = torch_bytes(pkl(tensor_v2("0", 4, {4}, {1})), {{"0", floats4()}}, true);
  const fs::path ok = pt_file("cut_full", full);
  CHECK(torch::load(ok).as_tensor().numel() == 4);
  for (std::size_t cut = 0; cut < full.size(); ++cut) {
    const bool run_cli_too = cut < 8 || cut + 64 > full.size() || cut % 9 == 0;
    const fs::path p = dir() / ("cut" + std::to_string(cut) + ".pt");
    write_all(p, full.substr(0, cut));
    CAPTURE(cut);
    if (cut < 4) {
      // too short to be anything: the library says "not a torch file", the tool "unknown format"
      CHECK(error_of([&] { (void)torch::describe(p); }) == errors::pt_not_torch.id);
      if (run_cli_too) check_cli(p, errors::unknown_format);
    } else if (run_cli_too) {
      expect_pt(p, errors::zip_not_a_zip);
    } else {
      CHECK(error_of([&] { (void)torch::describe(p); }) == errors::zip_not_a_zip.id);
    }
    fs::remove(p);
  }
}

TEST_CASE("zip: central directory and ZIP64 fields that lie") {
  const std::string pickle = pkl(tensor_v2("0", 4, {4}, {1}));
  const std::vector<Rec> recs{{"a/data.pkl", pickle}, {"a/data/0", floats4()}, {"a/version", "3\n"}};
  SUBCASE("central directory outside the file") {
    ZipParts z = build_zip(recs, false);
    put(z.bytes, z.end_pos + 16, 0x7fff0000, 4);
    expect_pt(pt_file("cd_outside", z.bytes), errors::zip_bad_end_record);
    z = build_zip(recs, false);
    put(z.bytes, z.end_pos + 12, 0x00ffffff, 4);  // size: 16 MiB, under the cap, past the file
    expect_pt(pt_file("cd_size_outside", z.bytes), errors::zip_bad_end_record);
    z = build_zip(recs, false);
    put(z.bytes, z.end_pos + 12, 0xfffffff0, 4);  // size beyond limits.max_central_directory_bytes
    expect_pt(pt_file("cd_size_huge", z.bytes), errors::zip_central_dir_too_large);
  }
  SUBCASE("entry counts that lie") {
    ZipParts z = build_zip(recs, false);
    put(z.bytes, z.end_pos + 8, 60000, 2);
    put(z.bytes, z.end_pos + 10, 60000, 2);
    expect_pt(pt_file("count_lie", z.bytes), errors::zip_bad_central_dir);
    z = build_zip(recs, false);
    put(z.bytes, z.end_pos + 10, 2, 2);
    expect_pt(pt_file("count_disagree", z.bytes), errors::zip_bad_end_record);
  }
  SUBCASE("local header offsets outside the file") {
    ZipParts z = build_zip(recs, false);
    put(z.bytes, z.central[1] + 42, 0x7fffffff, 4);
    expect_pt(pt_file("local_outside", z.bytes), errors::zip_entry_out_of_bounds);
    z = build_zip(recs, false);
    put(z.bytes, z.central[1] + 20, 0x7fffffff, 4);  // compressed size
    put(z.bytes, z.central[1] + 24, 0x7fffffff, 4);  // size
    expect_pt(pt_file("entry_size_outside", z.bytes), errors::zip_entry_out_of_bounds);
  }
  SUBCASE("ZIP64 end record fields") {
    ZipParts z = build_zip(recs, true);
    put(z.bytes, z.end64_pos + 48, std::uint64_t{1} << 62, 8);  // central directory offset
    put(z.bytes, z.end_pos + 16, 0xffffffff, 4);
    expect_pt(pt_file("z64_cd_offset", z.bytes), errors::zip_bad_end_record);
    z = build_zip(recs, true);
    put(z.bytes, z.end64_pos + 40, std::uint64_t{1} << 62, 8);  // central directory size
    put(z.bytes, z.end_pos + 12, 0xffffffff, 4);
    expect_pt(pt_file("z64_cd_size", z.bytes), errors::zip_central_dir_too_large);
    z = build_zip(recs, true);
    put(z.bytes, z.end64_pos + 24, std::uint64_t{1} << 40, 8);  // entry counts
    put(z.bytes, z.end64_pos + 32, std::uint64_t{1} << 40, 8);
    put(z.bytes, z.end_pos + 8, 0xffff, 2);
    put(z.bytes, z.end_pos + 10, 0xffff, 2);
    expect_pt(pt_file("z64_count", z.bytes), errors::zip_too_many_entries);
    z = build_zip(recs, true);
    put(z.bytes, z.end64_pos + 32, 7, 8);  // disagrees with the classic record's 3
    expect_pt(pt_file("z64_disagree", z.bytes), errors::zip_bad_zip64);
    z = build_zip(recs, true);
    put(z.bytes, z.end64_pos + 4, std::uint64_t{1} << 62, 8);  // record size
    expect_pt(pt_file("z64_record_size", z.bytes), errors::zip_bad_zip64);
    z = build_zip(recs, true);
    put(z.bytes, z.end64_pos, 0x12345678, 4);                    // no record where the locator says
    put(z.bytes, z.locator_pos + 8, std::uint64_t{1} << 62, 8);  // and the locator points far away
    expect_pt(pt_file("z64_locator", z.bytes), errors::zip_bad_zip64);
  }
  SUBCASE("ZIP64 extra fields") {
    // Escape values in the central header with a ZIP64 extra field carrying lies: the extra field
    // is appended to entry 1's central header, and the directory sizes fixed up.
    auto with_extra = [&](std::uint64_t size, std::uint64_t offset, bool short_field) {
      ZipParts z = build_zip(recs, false);
      const std::size_t h = z.central[1];
      if (offset == 0) offset = get(z.bytes, h + 42, 4);  // the true local header offset
      const std::size_t name_end = h + 46 + get(z.bytes, h + 28, 2);
      std::string extra = le(1, 2) + le(short_field ? 8 : 24, 2) + le(size, 8);
      if (!short_field) extra += le(size, 8) + le(offset, 8);
      z.bytes.insert(name_end, extra);
      put(z.bytes, h + 30, extra.size(), 2);
      put(z.bytes, h + 20, 0xffffffff, 4);
      put(z.bytes, h + 24, 0xffffffff, 4);
      put(z.bytes, h + 42, 0xffffffff, 4);
      const std::size_t end = z.end_pos + extra.size();
      put(z.bytes, end + 12, z.cd_size + extra.size(), 4);
      return z.bytes;
    };
    expect_pt(pt_file("x64_offset", with_extra(16, std::uint64_t{1} << 62, false)), errors::zip_entry_out_of_bounds);
    expect_pt(pt_file("x64_offset_max", with_extra(16, ~std::uint64_t{0}, false)), errors::zip_entry_out_of_bounds);
    expect_pt(pt_file("x64_size", with_extra(std::uint64_t{1} << 62, 0, false)),
              errors::zip_entry_out_of_bounds);
    expect_pt(pt_file("x64_short", with_extra(16, 0, true)), errors::zip_bad_zip64);
  }
}

TEST_CASE("pickle: memo, forbidden globals, nesting, huge declared sizes") {
  SUBCASE("memo reference to an unset slot") {
    expect_pickle("memo", pkl(std::string("]q\x00h\x05", 5)), errors::pk_bad_memo);
    expect_pickle("memo_long", pkl(std::string("]r\x00\x00\x00\x00j\xff\xff\xff\x7f", 11)), errors::pk_bad_memo);
  }
  SUBCASE("a pickle that would call os.system") {
    expect_pickle("posix_system", pkl(glob("posix", "system") + str("touch pwned") + "\x85R"), errors::pk_blocked_module);
    expect_pickle("os_system", pkl(glob("os", "system") + str("touch pwned") + "\x85R"), errors::pk_blocked_module);
    // STACK_GLOBAL (protocol 4) spelling of the same call
    expect_pickle("posix_stack_global", "\x80\x04" + str("posix") + str("system") + "\x93" + str("touch pwned") + "\x85R.",
                  errors::pk_blocked_module);
    CHECK_FALSE(fs::exists("pwned"));
  }
  SUBCASE("nesting 200,000 levels deep") {
    expect_pickle("deep_marks", pkl(std::string(200000, '(') + "N"), errors::pk_depth_limit);
    expect_pickle("deep_lists", pkl(std::string(200000, ']') + std::string(199999, 'a')), errors::pk_depth_limit);
    std::string tuples;
    for (int i = 0; i < 200000; ++i) tuples += "\x85";  // TUPLE1 around the top, 200,000 times
    expect_pickle("deep_tuples", pkl("N" + tuples), errors::pk_depth_limit);
  }
  SUBCASE("huge declared lengths") {
    expect_pickle("binunicode8", pkl("\x8d" + le(std::uint64_t{1} << 60, 8) + "abc"), errors::pk_string_limit);
    expect_pickle("binbytes8", pkl("\x8e" + le(std::uint64_t{1} << 60, 8) + "abc"), errors::pk_string_limit);
    expect_pickle("bytearray8", pkl("\x96" + le(~std::uint64_t{0}, 8) + "abc"), errors::pk_string_limit);
    expect_pickle("binunicode", pkl("X" + le(0xfffffff0U, 4) + "abc"), errors::pk_string_limit);
    expect_pickle("long4", pkl("\x8b" + le(0x7fffffff, 4) + "abc"), errors::pk_long_limit);
    expect_pickle("frame", "\x80\x04\x95" + le(std::uint64_t{1} << 60, 8) + "N.", errors::pk_truncated);
    expect_pickle("binunicode_short", pkl("X" + le(1000, 4) + "abc"), errors::pk_truncated);
  }
}

TEST_CASE("torch: tensors that reference what is not there") {
  SUBCASE("missing storage record") {
    expect_pt(pt_file("no_storage", torch_bytes(pkl(tensor_v2("0", 4, {4}, {1})))), errors::pt_missing_record);
  }
  SUBCASE("storage smaller than it says, and a huge declared storage") {
    expect_pt(pt_file("small_storage", torch_bytes(pkl(tensor_v2("0", 4, {4}, {1})), {{"0", floats4().substr(0, 8)}})),
              errors::pt_bad_storage);
    expect_pt(pt_file("huge_storage", torch_bytes(pkl(tensor_v2("0", std::int64_t{1} << 61, {4}, {1})), {{"0", floats4()}})),
              errors::pt_bad_storage);
  }
  SUBCASE("huge shape and view past the storage") {
    expect_pt(pt_file("huge_shape",
                      torch_bytes(pkl(tensor_v2("0", 4, {std::int64_t{1} << 40, std::int64_t{1} << 40}, {1, 1})), {{"0", floats4()}})),
              errors::overflow);
    expect_pt(pt_file("view_past", torch_bytes(pkl(tensor_v2("0", 4, {8}, {1})), {{"0", floats4()}})),
              errors::pt_view_out_of_bounds);
  }
  SUBCASE("negative dims, too many dims") {
    expect_pt(pt_file("neg_dim", torch_bytes(pkl(tensor_v2("0", 4, {-4}, {1})), {{"0", floats4()}})), errors::pt_bad_tensor);
    std::vector<std::int64_t> dims(70, 1);
    expect_pt(pt_file("rank70", torch_bytes(pkl(tensor_v2("0", 4, dims, dims)), {{"0", floats4()}})), errors::pt_rank_limit);
  }
}

TEST_CASE("DCP: an item whose length runs past its data file") {
  const fs::path fixture = fs::path(STATEDICT_FIXTURE_DIR) / "gen_sharded" / "dcp_w2";
  const fs::path d = dir() / "dcp_short";
  fs::remove_all(d);
  if (fs::exists(fixture / ".metadata")) {
    fs::copy(fixture, d);
  } else {
    // No PyTorch fixtures: a checkpoint written by statedict has the same layout.
    WARN_MESSAGE(false, "no fixture " << fixture.string() << "; using a checkpoint written by statedict");
    ShardedCheckpoint ck;
    ck.format = "memory";
    const std::string b = floats4() + floats4();
    ck.sources.push_back(MemorySource::copy_of("w", std::as_bytes(std::span<const char>(b.data(), b.size()))));
    const shape_t s24{2, 4};
    ck.tensors.push_back(TensorInfo{"w", dtype::F32, s24, {Chunk{full_box(s24), Placement{0, 0, {}, dtype::F32}}}});
    dcp::write_options o;
    o.world_size = 2;
    dcp::write(ck, d, o);
  }
  REQUIRE(error_of([&] { (void)dcp::describe(d); }) == 0);
  // Cut the last 16 bytes off the largest data file: its last item now runs past the end.
  fs::path victim;
  for (const auto& e : fs::directory_iterator(d))
    if (e.path().extension() == ".distcp" && (victim.empty() || fs::file_size(e.path()) > fs::file_size(victim))) victim = e.path();
  REQUIRE_FALSE(victim.empty());
  fs::resize_file(victim, fs::file_size(victim) - 16);
  expect(d, errors::dcp_item_outside_file, [&] { (void)dcp::describe(d); }, victim.filename().string());
  // Cut to nothing: every item of that file is outside it.
  fs::resize_file(victim, 0);
  expect(d, errors::dcp_item_outside_file, [&] { (void)dcp::describe(d); }, victim.filename().string());
  // The whole .metadata truncated: a pickle that ends early.
  const std::string md = read_all(d / ".metadata");
  write_all(d / ".metadata", md.substr(0, md.size() / 2));
  expect(d, errors::pk_truncated, [&] { (void)dcp::describe(d); }, ".metadata");
}
