// io/file.hpp: mapped and pread input files, atomic output files and directories.
#include <doctest/doctest.h>

#include <statedict/io/file.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace statedict;
namespace fs = std::filesystem;

namespace {

fs::path tmp_dir(const std::string& sub) { return statedict_test::fresh_dir("unit-file", sub); }

using statedict_test::read_all;

using statedict_test::write_all;

std::span<const std::byte> bytes(std::string_view s) { return std::as_bytes(std::span<const char>(s.data(), s.size())); }

std::string str(std::span<const std::byte> b) { return std::string(reinterpret_cast<const char*>(b.data()), b.size()); }

using statedict_test::error_of;

/// Names in `dir` (temporaries included).
std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST_CASE("InputFile maps a file; views keep the mapping alive after the file object is gone") {
  const fs::path d = tmp_dir("map");
  write_all(d / "a.bin", "hello, mapped world");
  keep_alive owner;
  const std::byte* data = nullptr;
  {
    auto f = InputFile::open(d / "a.bin");
    CHECK(f->mapped());
    CHECK(f->mode() == read_mode::mmap);
    CHECK(f->size() == 19);
    CHECK(f->fd() >= 0);
    CHECK(f->name() == (d / "a.bin").string());
    data = f->data();
    REQUIRE(data != nullptr);
    owner = f->owner();
    std::byte buf[6];
    f->read(7, buf);
    CHECK(str(buf) == "mapped");
    f->advise(0, 19, access_hint::sequential);
    f->advise(5, 1000, access_hint::willneed);  // past the end: clipped, never fails
    f->advise(1000, 10, access_hint::dontneed);
  }
  fs::remove(d / "a.bin");  // the mapping outlives the name and the InputFile
  CHECK(str(std::span<const std::byte>(data, 5)) == "hello");
  owner.reset();
}

TEST_CASE("InputFile in pread mode reads without mapping") {
  const fs::path d = tmp_dir("pread");
  write_all(d / "a.bin", "0123456789");
  auto f = InputFile::open(d / "a.bin", read_mode::pread);
  CHECK_FALSE(f->mapped());
  CHECK(f->data() == nullptr);
  std::byte buf[4];
  f->read(6, buf);
  CHECK(str(buf) == "6789");
  Region r = read_region(*f, 2, 3);
  CHECK(str(r.span()) == "234");
  // Out-of-range reads are format errors, not crashes.
  CHECK(error_of([&] { f->read(8, buf); }) == 116);
  CHECK(error_of([&] { f->read(~std::uint64_t{0}, buf); }) == 116);
  // A file that shrank after it was opened.
  CHECK(::truncate((d / "a.bin").c_str(), 4) == 0);
  CHECK(error_of([&] { f->read(6, buf); }) == 386);
}

TEST_CASE("InputFile: drop_sparse_blocks drops the blocks with a few pages cached; read_ahead and cached") {
  // 8 blocks of 2 MiB. After eviction: block 1 gets three scattered pages read (as a format's
  // headers are read with pread), block 2 is read whole, block 3 gets 300 of its 512 pages, block 5
  // a few pages like block 1. Only block 1 is dropped when blocks 0-3 are asked for.
  const fs::path d = tmp_dir("sparse");
  constexpr std::uint64_t block = std::uint64_t{2} << 20, page = 4096;
  std::string content(static_cast<std::size_t>(8 * block), '\0');
  for (std::size_t i = 0; i < content.size(); ++i) content[i] = static_cast<char>(i * 7 + i / 4096);
  write_all(d / "f.bin", content);
  const int fd = ::open((d / "f.bin").c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  (void)::fdatasync(fd);
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  auto f = InputFile::open(d / "f.bin");
  auto count = [&](std::uint64_t from, std::uint64_t pages) {
    std::vector<unsigned char> in(static_cast<std::size_t>(pages));
    REQUIRE(::mincore(const_cast<std::byte*>(f->data()) + from, static_cast<std::size_t>(pages * page), in.data()) == 0);
    std::uint64_t n = 0;
    for (unsigned char c : in) n += c & 1U;
    return n;
  };
  if (count(0, 8 * block / page) != 0) {
    MESSAGE("not checked here: the file system keeps the file cached after POSIX_FADV_DONTNEED");
    ::close(fd);
    return;
  }
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);  // each pread reads its own pages only
  std::vector<char> buf(static_cast<std::size_t>(block));
  for (std::uint64_t at : {block + 5 * page + 100, block + 200 * page, block + 511 * page, 5 * block + 9 * page})
    REQUIRE(::pread(fd, buf.data(), 64, static_cast<off_t>(at)) == 64);
  REQUIRE(::pread(fd, buf.data(), buf.size(), static_cast<off_t>(2 * block)) == static_cast<ssize_t>(block));
  REQUIRE(::pread(fd, buf.data(), 300 * page, static_cast<off_t>(3 * block)) == static_cast<ssize_t>(300 * page));
  const std::uint64_t sparse = count(block, 512), partial = count(3 * block, 512);
  CAPTURE(sparse);
  REQUIRE(count(0, 512) == 0);
  REQUIRE(sparse >= 3);
  REQUIRE(sparse <= 64);
  REQUIRE(count(2 * block, 512) == 512);
  REQUIRE(partial >= 300);
  REQUIRE(count(5 * block, 512) >= 1);
  CHECK(f->cached(2 * block, block));
  CHECK_FALSE(f->cached(block, block));

  CHECK(f->drop_sparse_blocks(block / 2, 3 * block, block, 64) == 1);  // blocks 0-3 overlap the range
  CHECK(count(block, 512) == 0);
  CHECK(count(2 * block, 512) == 512);
  CHECK(count(3 * block, 512) == partial);
  CHECK(count(5 * block, 512) >= 1);  // outside the range
  CHECK(f->drop_sparse_blocks(0, 4 * block, block, 64) == 0);
  CHECK(str(std::span<const std::byte>(f->data() + block + 5 * page + 100, 3)) == content.substr(block + 5 * page + 100, 3));

  // cached(..., sample_every) asks about the sampled pages and the last one only; a block whose
  // sampled pages are cached but not the rest is still found sparse and dropped.
  for (std::uint64_t p : std::array<std::uint64_t, 3>{0, 256, 511}) REQUIRE(::pread(fd, buf.data(), 64, static_cast<off_t>(4 * block + p * page)) == 64);
  REQUIRE(count(4 * block, 512) == 3);
  CHECK_FALSE(f->cached(4 * block, block));
  CHECK(f->cached(4 * block, block, 256 * page));
  CHECK_FALSE(f->cached(4 * block, block, 128 * page));  // page 128 is not cached
  CHECK(f->cached(4 * block + 100, 256 * page, 256 * page));  // pages 0 and 256
  CHECK(f->cached(2 * block, block, 64 * page));
  CHECK_FALSE(f->cached(5 * block, block, 64 * page));
  CHECK(f->drop_sparse_blocks(4 * block, block, block, 64) == 1);
  CHECK(count(4 * block, 512) == 0);

  // read_ahead: the range is cached afterwards, and not mapped in the file's own mapping.
  auto rss_file_kib = [] {
    std::ifstream st("/proc/self/status");
    std::string line;
    while (std::getline(st, line))
      if (line.rfind("RssFile:", 0) == 0) return std::stoull(line.substr(8));
    return 0ULL;
  };
  CHECK_FALSE(f->cached(6 * block + 100, block));
  const auto rss_before = rss_file_kib();
  CHECK(f->read_ahead(6 * block + 100, block, true));
  CHECK(rss_file_kib() < rss_before + 1024);  // KiB: the 2 MiB read in is not left mapped
  CHECK(f->cached(6 * block + 100, block));

  // Unmapped files, empty ranges and blocks that are not whole pages: nothing to do.
  const auto unmapped = InputFile::open(d / "f.bin", read_mode::pread);
  CHECK(unmapped->drop_sparse_blocks(0, 8 * block, block, 64) == 0);
  CHECK_FALSE(unmapped->read_ahead(0, block, true));
  CHECK_FALSE(unmapped->cached(2 * block, block));
  CHECK(f->drop_sparse_blocks(0, 8 * block, block + 1, 64) == 0);
  CHECK(f->drop_sparse_blocks(8 * block, block, block, 64) == 0);
  CHECK_FALSE(f->read_ahead(8 * block, block, true));
  ::close(fd);
}

TEST_CASE("InputFile refuses what it cannot open") {
  const fs::path d = tmp_dir("refuse");
  CHECK(error_of([&] { (void)InputFile::open(d / "missing"); }) == 380);
  CHECK(error_of([&] { (void)InputFile::open(d); }) == 383);
  write_all(d / "empty", "");
  auto e = InputFile::open(d / "empty");
  CHECK(e->size() == 0);
  CHECK_FALSE(e->mapped());
  e->read(0, {});
  try {
    (void)InputFile::open(d / "missing");
  } catch (const io_error& err) {
    CHECK(std::string(err.what()).find("missing") != std::string::npos);
  }
}

TEST_CASE("OutputFile appears only on commit, replaces atomically, and cleans up when abandoned") {
  const fs::path d = tmp_dir("out");
  write_all(d / "x.bin", "old");
  {
    OutputFile f = OutputFile::create(d / "x.bin");
    CHECK(f.path() == d / "x.bin");
    CHECK(f.temp_path().parent_path() == d);
    f.write(std::string_view("new "));
    f.write(bytes("content"));
    CHECK(f.position() == 11);
    CHECK(read_all(d / "x.bin") == "old");  // untouched until commit
    CHECK(fs::exists(f.temp_path()));
    f.commit();
    f.commit();  // idempotent
  }
  CHECK(read_all(d / "x.bin") == "new content");
  CHECK(listing(d) == std::vector<std::string>{"x.bin"});
  {
    OutputFile f = OutputFile::create(d / "x.bin");
    f.write(std::string_view("never"));
  }  // abandoned: temporary removed, old file kept
  CHECK(read_all(d / "x.bin") == "new content");
  CHECK(listing(d) == std::vector<std::string>{"x.bin"});
  {
    OutputFile f = OutputFile::create(d / "y.bin");
    OutputFile g = std::move(f);  // moves keep one owner of the temporary
    g.write(std::string_view("y"));
    g.commit();
  }
  CHECK(read_all(d / "y.bin") == "y");
}

TEST_CASE("OutputFile positioned writes, resize and seek") {
  const fs::path d = tmp_dir("pwrite");
  OutputFile f = OutputFile::create(d / "p.bin");
  f.resize(10);
  f.pwrite(6, bytes("WXYZ"));
  f.pwrite(0, bytes("ab"));
  f.seek(2);
  f.write(std::string_view("cd"));
  f.commit();
  const std::string s = read_all(d / "p.bin");
  CHECK(s.size() == 10);
  CHECK(s.substr(0, 4) == "abcd");
  CHECK(s.substr(6) == "WXYZ");
  CHECK(s[4] == '\0');
}

TEST_CASE("temporaries of dead writers are removed by the next writer of the same target") {
  const fs::path d = tmp_dir("stale");
  // A pid that cannot exist (above the kernel's pid_max limit of 2^22).
  const std::string stale = ".t.bin.statedict-99999999-0.tmp";
  write_all(d / stale, "partial");
  const std::string mine = ".t.bin.statedict-" + std::to_string(::getpid()) + "-999.tmp";
  write_all(d / mine, "ours, still running");
  write_all(d / ".other.bin.statedict-99999999-0.tmp", "another target");
  {
    OutputFile f = OutputFile::create(d / "t.bin");
    f.write(std::string_view("t"));
    f.commit();
  }
  const auto names = listing(d);
  CHECK(std::find(names.begin(), names.end(), stale) == names.end());
  CHECK(std::find(names.begin(), names.end(), mine) != names.end());
  CHECK(std::find(names.begin(), names.end(), ".other.bin.statedict-99999999-0.tmp") != names.end());
}

TEST_CASE("OutputDir appears whole on commit and replaces an existing directory in one step") {
  const fs::path root = tmp_dir("dir");
  const fs::path target = root / "ckpt";
  {
    OutputDir o = OutputDir::create(target);
    OutputFile a = o.create_file("a.txt");
    a.write(std::string_view("A"));
    a.commit();
    OutputFile b = o.create_file("sub/b.txt");
    b.write(std::string_view("B"));
    b.commit();
    CHECK_FALSE(fs::exists(target));
    o.commit();
  }
  CHECK(read_all(target / "a.txt") == "A");
  CHECK(read_all(target / "sub/b.txt") == "B");
  CHECK(listing(root) == std::vector<std::string>{"ckpt"});
  {
    OutputDir o = OutputDir::create(root / "ckpt/");  // a trailing slash names the same directory
    OutputFile c = o.create_file("c.txt");
    c.write(std::string_view("C"));
    c.commit();
    o.commit();
  }
  CHECK(listing(target) == std::vector<std::string>{"c.txt"});  // old files gone with the old tree
  CHECK(listing(root) == std::vector<std::string>{"ckpt"});
  {
    OutputDir o = OutputDir::create(target);
    OutputFile c = o.create_file("never.txt");
    c.write(std::string_view("x"));
    c.commit();
  }  // abandoned: target untouched, temporary tree removed
  CHECK(listing(target) == std::vector<std::string>{"c.txt"});
  CHECK(listing(root) == std::vector<std::string>{"ckpt"});
  write_all(root / "plain", "a file");
  CHECK(error_of([&] {
          OutputDir o = OutputDir::create(root / "plain");
          o.commit();
        }) == 387);
}
