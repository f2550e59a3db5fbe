// The executor (exec/executor.hpp) with real files: output bytes identical for 1..4 threads and any
// budget, the zero-copy paths taken, the executor's own buffers within the budget, casts from
// mapped and pread sources, CRC-32 / SHA-256 sinks, progress, errors.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <statedict/exec/digest.hpp>
#include <statedict/exec/executor.hpp>
#include <statedict/io/file.hpp>
#include <statedict/shard/layout.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "test_util.hpp"

using namespace statedict;
namespace fs = std::filesystem;

namespace {

using bytes = std::vector<std::byte>;

fs::path scratch(const std::string& name) { return statedict_test::fresh_dir("unit-executor", name); }

fs::path existing(const std::string& name) { return fs::path(STATEDICT_TEST_TMP) / "unit-executor" / name; }

using statedict_test::read_bytes;

/// Writes `dst` as files in `dir` (one per destination), from `src`.
exec_stats write_files(const ShardedCheckpoint& src, const Destination& dst, const fs::path& dir, const exec_options& opt,
                       const plan_options& popt = {}) {
  const Plan plan = make_plan(src, dst, popt);
  std::vector<OutputFile> files;
  std::vector<std::unique_ptr<FileSink>> sinks;
  std::vector<Sink*> ptrs;
  files.reserve(dst.names.size());
  for (const auto& n : dst.names) {
    files.push_back(OutputFile::create(dir / n));
    sinks.push_back(std::make_unique<FileSink>(files.back()));
    if (opt.direct_io) (void)sinks.back()->use_direct_io();
    ptrs.push_back(sinks.back().get());
  }
  const exec_stats st = execute(plan, src, ptrs, opt);
  for (auto& f : files) f.commit();
  return st;
}

ShardedCheckpoint open_files(const Destination& d, const fs::path& dir, read_mode mode) {
  std::vector<std::shared_ptr<const ByteSource>> srcs;
  for (const auto& n : d.names) srcs.push_back(InputFile::open(dir / n, mode));
  return layout::as_checkpoint(d, std::move(srcs));
}

struct Model {
  std::vector<TensorInfo> tensors;
  bytes data;  // consolidated, layout::single(tensors)
  ShardedCheckpoint checkpoint() const {
    return layout::as_checkpoint(layout::single(tensors, "original"), {MemorySource::copy_of("original", data)});
  }
};

Model make_model(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Model m;
  m.tensors = {{"embed", dtype::F32, {1000, 384}, {}},  // 1.5 MB: large runs
               {"w1", dtype::F32, {384, 700}, {}},
               {"b1", dtype::F32, {700}, {}},
               {"w2", dtype::BF16, {700, 96}, {}},
               {"norm", dtype::F32, {}, {}},
               {"tiny", dtype::F32, {3}, {}}};
  const auto one = layout::single(m.tensors, "x");
  m.data.resize(static_cast<std::size_t>(one.sizes[0]));
  for (auto& b : m.data) b = static_cast<std::byte>(rng());
  return m;
}

using statedict_test::error_of;

}  // namespace

TEST_CASE("resharding real files gives identical bytes for 1..4 threads and any budget") {
  const Model m = make_model(1);
  const std::vector<std::vector<std::size_t>> groups{{0, 1, 2, 4, 5}, {3}};
  // 8 ZeRO-3 ranks on disk.
  const Destination z8 = layout::zero3(m.tensors, groups, 8);
  const fs::path d8 = scratch("z8");
  exec_options opt;
  (void)write_files(m.checkpoint(), z8, d8, opt);
  // Reshard to 3 chunked ranks with every thread count and a few budgets.
  std::vector<int> dims{0, 1, 0, 1, -1, -1};
  const Destination c3 = layout::chunked(m.tensors, dims, 3);
  std::vector<bytes> reference;
  for (read_mode mode : {read_mode::mmap, read_mode::pread})
    for (unsigned threads = 1; threads <= 4; ++threads)
      for (std::uint64_t budget : {std::uint64_t{1} << 19, std::uint64_t{4} << 20, default_memory_budget}) {
        CAPTURE(threads);
        CAPTURE(budget);
        const fs::path out = scratch("c3");
        opt.threads = threads;
        opt.memory_budget = budget;
        opt.direct_io = budget != default_memory_budget;  // both ways of writing the files
        const exec_stats st = write_files(open_files(z8, d8, mode), c3, out, opt);
        CHECK(st.buffer_bytes <= budget);
        CHECK(st.bytes_written == make_plan(open_files(z8, d8, mode), c3).bytes());
        std::vector<bytes> got;
        for (const auto& n : c3.names) got.push_back(read_bytes(out / n));
        if (reference.empty()) reference = got;
        CHECK(got == reference);
      }
  // And from those 3 files back to one: the original bytes.
  const fs::path back = scratch("back");
  opt.threads = 2;
  (void)write_files(open_files(c3, existing("c3"), read_mode::mmap), layout::single(m.tensors, "one"), back, opt);
  CHECK(read_bytes(back / "one") == m.data);
}

TEST_CASE("zero-copy paths: copy_file_range and writes from the mapping") {
  const Model m = make_model(2);
  const fs::path d1 = scratch("one");
  exec_options opt;
  (void)write_files(m.checkpoint(), layout::single(m.tensors, "one"), d1, opt);
  const Destination one = layout::single(m.tensors, "one");
  // 2 ranks along dim 0: each rank's part of `embed` is a 768 KB run; with a 256 KB threshold
  // copy_file_range takes them (or, on a filesystem that refuses, positioned writes do).
  std::vector<int> dims{0, 0, 0, 0, -1, -1};
  const Destination c2 = layout::chunked(m.tensors, dims, 2);
  opt.copy_file_range = true;
  opt.copy_file_range_min = 256 << 10;
  opt.threads = 2;
  const exec_stats st = write_files(open_files(one, d1, read_mode::mmap), c2, scratch("c2"), opt);
  CHECK(st.bytes_in_kernel + st.bytes_from_mapping > 0);
  CHECK(st.bytes_converted == 0);
  // Without zero copy, through the buffers: the same bytes.
  exec_options slow;
  slow.zero_copy = false;
  slow.memory_budget = 1 << 20;
  const exec_stats st2 = write_files(open_files(one, d1, read_mode::mmap), c2, scratch("c2slow"), slow);
  CHECK(st2.bytes_in_kernel == 0);
  CHECK(st2.bytes_from_mapping == 0);
  for (const auto& n : c2.names) CHECK(read_bytes(existing("c2") / n) == read_bytes(existing("c2slow") / n));
  // Positioned writes straight from the mapping (pread_files off, no copy_file_range): the same bytes.
  exec_options mapped;
  mapped.pread_files = false;
  mapped.copy_file_range_min = std::uint64_t{1} << 40;
  mapped.threads = 2;
  const exec_stats st3 = write_files(open_files(one, d1, read_mode::mmap), c2, scratch("c2map"), mapped);
  CHECK(st3.bytes_in_kernel == 0);
  CHECK(st3.bytes_from_mapping > 0);
  for (const auto& n : c2.names) CHECK(read_bytes(existing("c2") / n) == read_bytes(existing("c2map") / n));
}

TEST_CASE("default copy path: plain runs of mapped files are written from the mapping, pread sources through the buffers") {
  const Model m = make_model(5);
  const fs::path d1 = scratch("path-one");
  const Destination one = layout::single(m.tensors, "one");
  (void)write_files(m.checkpoint(), one, d1, exec_options{});
  std::vector<int> dims{0, 0, 0, 0, -1, -1};
  const Destination c2 = layout::chunked(m.tensors, dims, 2);
  // Mapped sources with the default options: every run of 64 KiB or more is one pwrite straight
  // from the mapping (one copy instead of pread + pwrite), whatever the threads and the budget.
  std::vector<bytes> reference;
  for (unsigned threads : {1U, 2U, 3U})
    for (std::uint64_t budget : {std::uint64_t{1} << 19, default_memory_budget}) {
      CAPTURE(threads);
      CAPTURE(budget);
      exec_options opt;
      opt.threads = threads;
      opt.memory_budget = budget;
      const fs::path out = scratch("path-map");
      const exec_stats st = write_files(open_files(one, d1, read_mode::mmap), c2, out, opt);
      CHECK(st.bytes_in_kernel == 0);
      CHECK(st.bytes_from_mapping >= (std::uint64_t{1000} * 384 + std::uint64_t{384} * 700) * 4);  // embed, w1
      std::vector<bytes> got;
      for (const auto& n : c2.names) got.push_back(read_bytes(out / n));
      if (reference.empty()) reference = got;
      CHECK(got == reference);
    }
  // Sources read with pread (--io pread) and mapped sources with pread_files: through the buffers,
  // the same bytes.
  for (bool pread_files : {false, true}) {
    exec_options opt;
    opt.threads = 2;
    opt.pread_files = pread_files;
    const fs::path out = scratch("path-pread");
    const exec_stats st = write_files(open_files(one, d1, pread_files ? read_mode::mmap : read_mode::pread), c2, out, opt);
    CHECK(st.bytes_from_mapping == 0);
    CHECK(st.bytes_in_kernel == 0);
    std::vector<bytes> got;
    for (const auto& n : c2.names) got.push_back(read_bytes(out / n));
    CHECK(got == reference);
  }
}

namespace {
/// Counts the writes a MemorySink receives.
class CountingSink final : public Sink {
 public:
  explicit CountingSink(std::string name) : inner_(std::move(name)) {}
  [[nodiscard]] const std::string& name() const noexcept override { return inner_.name(); }
  void write(std::uint64_t offset, std::span<const std::byte> b) override {
    writes.fetch_add(1);
    inner_.write(offset, b);
  }
  void reserve(std::uint64_t size) override { inner_.reserve(size); }
  [[nodiscard]] std::span<const std::byte> bytes() const noexcept { return inner_.bytes(); }
  std::atomic<std::uint64_t> writes{0};

 private:
  MemorySink inner_;
};
}  // namespace

TEST_CASE("pieces split along dim 1 are written row by row across the ranks, in blocks, with the same bytes") {
  // Tensor-parallel pieces of dim 1 (Megatron-LM's row-parallel weights): each row of the merged
  // tensor is one short run from each rank. Walked rank by rank, every run is a write of its own
  // (w1: 384 rows x 4 ranks of 700 bytes); walked row by row across the ranks, they follow each
  // other in the write buffer and go out in blocks.
  const Model m = make_model(6);
  const fs::path d1 = scratch("rows-one");
  const Destination one = layout::single(m.tensors, "one");
  (void)write_files(m.checkpoint(), one, d1, exec_options{});
  std::vector<int> dims{1, 1, 0, 1, -1, -1};
  const Destination tp4 = layout::chunked(m.tensors, dims, 4);
  const fs::path d4 = scratch("rows-tp4");
  (void)write_files(open_files(one, d1, read_mode::mmap), tp4, d4, exec_options{});
  std::vector<TensorInfo> bf = m.tensors;
  for (auto& t : bf) t.dtype = dtype::BF16;
  for (bool cast : {false, true})
    for (read_mode mode : {read_mode::mmap, read_mode::pread})
      for (unsigned threads : {1U, 2U, 3U})
        for (std::uint64_t budget : {std::uint64_t{1} << 19, default_memory_budget}) {
          CAPTURE(cast);
          CAPTURE(threads);
          CAPTURE(budget);
          const ShardedCheckpoint src = open_files(tp4, d4, mode);
          const Plan plan = make_plan(src, layout::single(cast ? bf : m.tensors, "merged"));
          CountingSink sink("merged");
          Sink* p[] = {&sink};
          exec_options opt;
          opt.threads = threads;
          opt.memory_budget = budget;
          const exec_stats st = execute(plan, src, p, opt);
          CHECK(st.bytes_written == plan.bytes());
          if (cast) {
            MemorySink want("want");
            Sink* q[] = {&want};
            (void)execute(make_plan(m.checkpoint(), layout::single(bf, "merged")), m.checkpoint(), q, exec_options{});
            CHECK(std::equal(sink.bytes().begin(), sink.bytes().end(), want.bytes().begin(), want.bytes().end()));
          } else {
            CHECK(std::equal(sink.bytes().begin(), sink.bytes().end(), m.data.begin(), m.data.end()));
          }
          // embed (dim 1, 96 columns a rank) alone has 4000 runs, w1 1536, w2 2800.
          CHECK(sink.writes.load() < 100);
        }
}

namespace {
/// The resident pages of the process's file mappings (RssFile of /proc/self/status), in KiB.
std::uint64_t rss_file_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("RssFile:", 0) == 0) return std::stoull(line.substr(8));
  return 0;
}

/// Drops a file's clean pages from the page cache; false when some stayed (mincore).
bool evict(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  const auto size = static_cast<std::size_t>(fs::file_size(p));
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) return false;
  std::vector<unsigned char> in((size + 4095) / 4096);
  const bool ok = ::mincore(m, size, in.data()) == 0 &&
                  std::none_of(in.begin(), in.end(), [](unsigned char c) { return (c & 1) != 0; });
  ::munmap(m, size);
  return ok;
}

/// Pages of a file's cached bytes that sit in folios of 2 MiB or more, and all its pages; nullopt
/// when the kernel does not tell (/proc/kpageflags and the pagemap's frame numbers need
/// CAP_SYS_ADMIN). Maps the file and its cached pages only: nothing is read in.
std::optional<std::pair<std::size_t, std::size_t>> pages_in_large_folios(const fs::path& p) {
  const auto size = static_cast<std::size_t>(fs::file_size(p));
  const std::size_t pages = (size + 4095) / 4096;
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) return std::nullopt;
  std::vector<unsigned char> in(pages);
  (void)::mincore(m, size, in.data());
  volatile unsigned char sink = 0;
  for (std::size_t i = 0; i < pages; ++i)
    if (in[i] & 1) sink = static_cast<unsigned char>(sink + static_cast<const unsigned char*>(m)[i * 4096]);
  const int pm = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC), kf = ::open("/proc/kpageflags", O_RDONLY | O_CLOEXEC);
  std::optional<std::pair<std::size_t, std::size_t>> out;
  std::vector<std::uint64_t> entries(pages);
  const auto at = static_cast<off_t>(reinterpret_cast<std::uintptr_t>(m) / 4096 * 8);
  if (pm >= 0 && kf >= 0 && ::pread(pm, entries.data(), pages * 8, at) == static_cast<ssize_t>(pages * 8)) {
    std::size_t large = 0, run = 0, seen = 0;
    bool frames = true;
    for (std::size_t i = 0; i <= pages; ++i) {
      std::uint64_t f = 0;
      const bool present = i < pages && (entries[i] >> 63) != 0;
      if (present) {
        const std::uint64_t pfn = entries[i] & ((std::uint64_t{1} << 55) - 1);
        frames = frames && pfn != 0 && ::pread(kf, &f, 8, static_cast<off_t>(pfn * 8)) == 8;
        ++seen;
      }
      const bool tail = present && (f >> 16 & 1) != 0;  // KPF_COMPOUND_TAIL
      if (!tail) {  // a folio ends here
        if (run >= 512) large += run;
        run = present && (f >> 15 & 1) != 0 ? 1 : 0;  // KPF_COMPOUND_HEAD starts one
      } else if (run) {
        ++run;
      }
    }
    if (frames && seen) out = std::pair{large, seen};
  }
  if (pm >= 0) ::close(pm);
  if (kf >= 0) ::close(kf);
  ::munmap(m, size);
  return out;
}

/// Whether transparent huge pages are on for regions that ask (madvise) or for all.
bool thp_on_request() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string s;
  std::getline(f, s);
  return s.find("[madvise]") != std::string::npos || s.find("[always]") != std::string::npos;
}
}  // namespace

TEST_CASE("mapped sources are read into the page cache in 2 MiB folios (exec_options::large_folios), pages read with pread before or not") {
  // Read in through a mapping without MADV_HUGEPAGE, a file is cached in 4 KiB folios, and every
  // later copy out of it pays a page-table entry (and a lookup) per 4 KiB.
  std::vector<TensorInfo> tensors;
  for (int i = 0; i < 32; ++i) tensors.push_back({"t" + std::to_string(i), dtype::F32, {std::uint64_t{1} << 19}, {}});
  const Destination one = layout::single(tensors, "one");
  bytes data(static_cast<std::size_t>(one.sizes[0]));
  std::mt19937_64 rng(11);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  const ShardedCheckpoint mem = layout::as_checkpoint(one, {MemorySource::copy_of("one", data)});
  std::vector<std::vector<std::size_t>> groups(1);
  for (std::size_t i = 0; i < tensors.size(); ++i) groups[0].push_back(i);
  const Destination z4 = layout::zero3(tensors, groups, 4);
  const fs::path d4 = scratch("folios-z4");
  (void)write_files(mem, z4, d4, exec_options{});  // 4 rank files of 16 MiB
  const auto probe = pages_in_large_folios(d4 / z4.names[0]);  // cached: just written
  bool evicted = true;
  for (const auto& name : z4.names) evicted = evict(d4 / name) && evicted;
  if (!thp_on_request() || !evicted || !probe) {
    MESSAGE("not checked here: transparent huge pages on request " << thp_on_request() << ", rank files evicted "
                                                                    << evicted << ", /proc/kpageflags readable " << probe.has_value());
    return;
  }
  // A 2 MiB folio needs 2 MiB of free memory in one piece, which the kernel tries once to make
  // (compaction) and otherwise falls back to small folios: up to three tries, each from a cold
  // cache. Without the advice every try finds no page in a 2 MiB folio.
  // Before each copy, one 4 KiB page every 300 KB of each rank file is read with pread, as a
  // reader of a format's headers does (a .pt has a zip header per storage): a 2 MiB folio cannot
  // be formed over a cached page, so without dropping those pages again first the copy would read
  // the whole file in 4 KiB folios.
  auto read_headers = [&](const fs::path& p) {
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    REQUIRE(fd >= 0);
    (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
    char b[64];
    for (std::uint64_t at = 4096; at + sizeof b < fs::file_size(p); at += 300 << 10)
      REQUIRE(::pread(fd, b, sizeof b, static_cast<off_t>(at)) == static_cast<ssize_t>(sizeof b));
    ::close(fd);
  };
  std::size_t large = 0, cached = 0;
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (attempt > 0)
      for (const auto& name : z4.names) REQUIRE(evict(d4 / name));
    for (const auto& name : z4.names) read_headers(d4 / name);
    const ShardedCheckpoint src = open_files(z4, d4, read_mode::mmap);
    const fs::path out = scratch("folios-one");
    (void)write_files(src, one, out, exec_options{});
    CHECK(read_bytes(out / "one") == data);
    large = cached = 0;
    for (const auto& name : z4.names) {
      const auto f = pages_in_large_folios(d4 / name);
      REQUIRE(f);
      large += f->first;
      cached += f->second;
    }
    if (large * 2 >= cached) break;
  }
  CAPTURE(large);
  CAPTURE(cached);
  CHECK(cached >= 4 * 4096 - 64);  // every rank file was read in whole (64 MiB in 4 KiB pages)
  CHECK(large * 2 >= cached);  // at least half of it in 2 MiB folios
}

TEST_CASE("exec_options::read_ahead: cold mapped sources are read ahead of the copy, cached ones not") {
  std::vector<TensorInfo> tensors;
  for (int i = 0; i < 16; ++i) tensors.push_back({"t" + std::to_string(i), dtype::F32, {std::uint64_t{1} << 19}, {}});
  const Destination one = layout::single(tensors, "one");
  bytes data(static_cast<std::size_t>(one.sizes[0]));
  std::mt19937_64 rng(5);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  const ShardedCheckpoint mem = layout::as_checkpoint(one, {MemorySource::copy_of("one", data)});
  std::vector<std::vector<std::size_t>> groups(1);
  for (std::size_t i = 0; i < tensors.size(); ++i) groups[0].push_back(i);
  const Destination z2 = layout::zero3(tensors, groups, 2);
  const fs::path d2 = scratch("ahead-z2");
  (void)write_files(mem, z2, d2, exec_options{});  // 2 rank files of 16 MiB
  bool evicted = true;
  for (const auto& name : z2.names) evicted = evict(d2 / name) && evicted;
  if (!evicted) {
    MESSAGE("not checked here: the rank files stay cached after POSIX_FADV_DONTNEED");
    return;
  }
  auto consolidate = [&](std::uint64_t ahead, unsigned threads) {
    const ShardedCheckpoint src = open_files(z2, d2, read_mode::mmap);
    exec_options opt;
    opt.read_ahead = ahead;
    opt.threads = threads;
    const fs::path out = scratch("ahead-one");
    const exec_stats st = write_files(src, one, out, opt);
    CHECK(read_bytes(out / "one") == data);
    return st.bytes_read_ahead;
  };
  CHECK(consolidate(0, 2) == 0);  // off
  // The helper starts before the copy and reads its first 8 MiB step at once; a machine too busy
  // to run it before the copy is done gets three tries.
  std::uint64_t cold = 0;
  for (int attempt = 0; attempt < 3 && cold == 0; ++attempt) {
    for (const auto& name : z2.names) REQUIRE(evict(d2 / name));
    cold = consolidate(std::uint64_t{4} << 20, 1);
  }
  CAPTURE(cold);
  CHECK(cold > 0);
  CHECK(cold <= 32 * (std::uint64_t{1} << 20));
  // All cached now: nothing to read ahead. Other work on the machine (the suite runs tests in
  // parallel) can evict pages in between, so the files are read into the cache again before each
  // of three tries.
  std::uint64_t cached = 1;
  for (int attempt = 0; attempt < 3 && cached != 0; ++attempt) {
    for (const auto& name : z2.names) (void)read_bytes(d2 / name);
    cached = consolidate(std::uint64_t{64} << 20, 2);
  }
  CHECK(cached == 0);
}

TEST_CASE("mapped sources: every page a copy mapped is released again, fault-around windows included") {
  // 8 ZeRO-3 ranks of a 24 MB model consolidated into one file: each rank's runs are ranges of
  // their own (they end inside pages), populated and released one work item at a time. A fault
  // (or MADV_POPULATE_READ) maps the cached pages of the whole 64 KiB window around the page it
  // needs; released by the range alone, the window's pages outside it stayed mapped.
  std::mt19937_64 rng(7);
  std::vector<TensorInfo> tensors;
  for (int i = 0; i < 48; ++i) tensors.push_back({"t" + std::to_string(i), dtype::F32, {125003}, {}});
  const Destination one = layout::single(tensors, "one");
  bytes data(static_cast<std::size_t>(one.sizes[0]));
  for (auto& b : data) b = static_cast<std::byte>(rng());
  const ShardedCheckpoint mem = layout::as_checkpoint(one, {MemorySource::copy_of("one", data)});
  const std::vector<std::vector<std::size_t>> groups{[] {
    std::vector<std::size_t> g(48);
    for (std::size_t i = 0; i < g.size(); ++i) g[i] = i;
    return g;
  }()};
  const Destination z8 = layout::zero3(tensors, groups, 8);
  const fs::path d8 = scratch("rss-z8");
  (void)write_files(mem, z8, d8, exec_options{});
  for (unsigned threads : {1U, 2U}) {
    for (std::uint64_t release_after : {std::uint64_t{0}, exec_options{}.release_after}) {
      CAPTURE(threads);
      CAPTURE(release_after);
      const ShardedCheckpoint src = open_files(z8, d8, read_mode::mmap);
      const std::uint64_t before = rss_file_kib();
      exec_options opt;
      opt.threads = threads;
      opt.release_after = release_after;
      const fs::path out = scratch("rss-one");
      const exec_stats st = write_files(src, one, out, opt);
      const std::uint64_t after = rss_file_kib();
      CHECK(after <= before + 512);  // KiB: what a copy of 24 MB leaves mapped
      CHECK(read_bytes(out / "one") == data);
      // Each work item is a piece of one rank file. Released after every item, that is a range
      // per item; held until 8 MiB, the pieces of a rank in a row are one range.
      if (release_after == 0)
        CHECK(st.ranges_released >= st.work_items);
      else
        CHECK(st.ranges_released <= 8 * (one.sizes[0] / release_after + 2 * threads));
    }
  }
}

TEST_CASE("FileSink starts writeback every write_behind bytes, and writes the same bytes") {
  for (std::uint64_t pace : {std::uint64_t{0}, std::uint64_t{1} << 20}) {
    CAPTURE(pace);
    const fs::path d = scratch("write-behind");
    OutputFile f = OutputFile::create(d / "out");
    FileSink sink(f);
    sink.write_behind(pace);
    bytes chunk(std::size_t{256} << 10);
    bytes want;
    for (std::size_t i = 0; i < 16; ++i) {  // 4 MiB, back to front
      std::fill(chunk.begin(), chunk.end(), static_cast<std::byte>(i));
      sink.write((15 - i) * chunk.size(), chunk);
    }
    for (std::size_t i = 16; i-- > 0;) want.insert(want.end(), chunk.size(), static_cast<std::byte>(i));
    sink.finish();
    f.commit();
    CHECK(sink.writebacks_started() == (pace ? 4U : 0U));
    CHECK(read_bytes(d / "out") == want);
  }
}

TEST_CASE("FileSink with direct I/O: pieces in any order and from several threads, a header before, holes") {
  const fs::path d = scratch("direct");
  {
    OutputFile probe = OutputFile::create(d / "probe");
    FileSink s(probe);
    if (!s.use_direct_io()) {
      MESSAGE("no direct I/O under " STATEDICT_TEST_TMP " (tmpfs?): skipped");
      return;
    }
  }
  // 1000 header bytes written through the page cache first, then 151,651 bytes cut into pieces
  // at random points, within pages and across them; every seventh piece is never written (a
  // hole: zeros), the last one too. The sink starts mid-page: the header's last page is shared.
  std::mt19937_64 rng(11);
  const std::uint64_t header = 1000, size = 37 * 4096 + 100;
  std::vector<std::uint64_t> cuts{0, size};
  for (int i = 0; i < 300; ++i) cuts.push_back(rng() % size);
  for (std::uint64_t c : {std::uint64_t{4096 * 3}, std::uint64_t{4096 * 3 + 1}, std::uint64_t{4096 * 20 - 1}}) cuts.push_back(c);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  bytes want(header + size, std::byte{0});
  for (std::size_t i = 0; i < header; ++i) want[i] = static_cast<std::byte>(i * 7 + 1);
  std::vector<std::pair<std::uint64_t, std::uint64_t>> pieces;  // [begin, end) within the sink
  for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
    if (i % 7 == 3) continue;
    pieces.emplace_back(cuts[i], cuts[i + 1]);
    for (std::uint64_t k = cuts[i]; k < cuts[i + 1]; ++k) want[header + k] = static_cast<std::byte>(rng() | 1);
  }
  for (unsigned threads : {1U, 4U}) {
    CAPTURE(threads);
    std::shuffle(pieces.begin(), pieces.end(), rng);
    OutputFile f = OutputFile::create(d / "out");
    f.write(std::span<const std::byte>(want).first(header));
    FileSink sink(f, header);
    REQUIRE(sink.use_direct_io(8192));  // 2-page staging: long pieces take several writes
    CHECK(sink.fd() < 0);               // no copy_file_range into it
    CHECK(sink.concurrent_writes());
    sink.track_crc32({FlatRange{0, size}});
    sink.reserve(size);
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        for (std::size_t i = t; i < pieces.size(); i += threads) {
          const auto [b, e] = pieces[i];
          sink.write(b, std::span<const std::byte>(want).subspan(static_cast<std::size_t>(header + b), static_cast<std::size_t>(e - b)));
        }
      });
    for (auto& th : pool) th.join();
    CHECK(sink.pending_pages() > 0);  // the header's page and the holes' pages wait for finish()
    sink.finish();
    CHECK(sink.pending_pages() == 0);
    CHECK(sink.crc32(0) == zip::crc32(std::span<const std::byte>(want).subspan(header)));
    // Whole pages went past the page cache: after the write, the file's middle is not cached
    // (written through the page cache, every page of it would be).
    {
      const auto in = InputFile::open(f.temp_path(), read_mode::mmap);
      CHECK_FALSE(in->cached(8 * 4096, 16 * 4096));
    }
    f.commit();
    CHECK(read_bytes(d / "out") == want);
  }
}

TEST_CASE("memory budget: the executor's buffers never exceed it") {
  const Model m = make_model(3);
  const auto src = m.checkpoint();
  std::vector<TensorInfo> bf = m.tensors;
  for (auto& t : bf) t.dtype = dtype::BF16;  // a cast everywhere: the buffers are used
  for (std::uint64_t budget : {std::uint64_t{300} << 10, std::uint64_t{1} << 20, std::uint64_t{16} << 20})
    for (unsigned threads : {1U, 3U, 8U}) {
      const Plan plan = make_plan(src, layout::single(bf, "bf16", 1));
      MemorySink sink("bf16");
      Sink* p[] = {&sink};
      exec_options opt;
      opt.memory_budget = budget;
      opt.threads = threads;
      const exec_stats st = execute(plan, src, p, opt);
      CHECK(st.buffer_bytes <= budget);
      CHECK(st.buffer_bytes > 0);
      CHECK(st.bytes_converted > 0);
    }
  MemorySink sink("x");
  Sink* p[] = {&sink};
  exec_options tiny;
  tiny.memory_budget = 100 << 10;
  CHECK(error_of([&] { execute(make_plan(src, layout::single(m.tensors, "x")), src, p, tiny); }) ==
        errors::budget_too_small.id);
}

TEST_CASE("casts from pread sources equal cast_run") {
  const Model m = make_model(4);
  const fs::path d1 = scratch("cast");
  exec_options opt;
  (void)write_files(m.checkpoint(), layout::single(m.tensors, "one"), d1, opt);
  std::vector<TensorInfo> f16{m.tensors[0], m.tensors[1]};
  for (auto& t : f16) t.dtype = dtype::F16;
  for (read_mode mode : {read_mode::mmap, read_mode::pread}) {
    const auto src = open_files(layout::single(m.tensors, "one"), d1, mode);
    const Plan plan = make_plan(src, layout::single(f16, "half"));
    MemorySink sink("half");
    Sink* p[] = {&sink};
    exec_options small;
    small.memory_budget = 512 << 10;
    small.threads = 2;
    execute(plan, src, p, small);
    const std::size_t n = 1000 * 384 + 384 * 700;
    bytes want(2 * n);
    cast_run(dtype::F32, m.data.data(), dtype::F16, want.data(), n);
    CHECK(bytes(sink.bytes().begin(), sink.bytes().end()) == want);
  }
}

TEST_CASE("big-endian sources: every element swapped as it is copied, bit-exact for any threads and budget") {
  // The model's bytes read as big-endian elements: the expected little-endian output swaps each
  // element (each component of a complex one) of the source bytes; casts come after the swap.
  Model m = make_model(5);
  m.tensors.push_back({"c", dtype::C64, {500}, {}});
  m.tensors.push_back({"h", dtype::C32, {3}, {}});
  m.tensors.push_back({"q", dtype::U8, {7}, {}});
  m.tensors.push_back({"u", dtype::U64, {9}, {}});
  const auto one = layout::single(m.tensors, "x");
  m.data.resize(static_cast<std::size_t>(one.sizes[0]));
  std::mt19937_64 rng(5);
  for (auto& b : m.data) b = static_cast<std::byte>(rng());
  const fs::path d1 = scratch("big");
  exec_options opt;
  (void)write_files(m.checkpoint(), one, d1, opt);
  bytes little = m.data;
  std::uint64_t at = 0;
  for (const TensorInfo& t : m.tensors) {
    const std::uint64_t n = numel(t.shape);
    byteswap_run(t.dtype, little.data() + at, static_cast<std::size_t>(n));
    at += n * itemsize(t.dtype);
  }
  CHECK(little != m.data);
  // The F32 tensors cast to BF16 as well: swapped, then rounded.
  std::vector<TensorInfo> out_tensors = m.tensors;
  out_tensors[1].dtype = dtype::BF16;
  bytes want_cast;
  {
    const auto single = layout::single(m.tensors, "x");
    const std::uint64_t off1 = single.tensors[1].chunks[0].at.byte_offset;
    const std::size_t n1 = 384 * 700;
    bytes w1(2 * n1);
    cast_run(dtype::F32, little.data() + off1, dtype::BF16, w1.data(), n1);
    want_cast.assign(little.begin(), little.begin() + static_cast<std::ptrdiff_t>(off1));
    want_cast.insert(want_cast.end(), w1.begin(), w1.end());
    want_cast.insert(want_cast.end(), little.begin() + static_cast<std::ptrdiff_t>(off1 + 4 * n1), little.end());
  }
  for (read_mode mode : {read_mode::mmap, read_mode::pread})
    for (unsigned threads : {1U, 3U})
      for (std::uint64_t budget : {std::uint64_t{1} << 19, default_memory_budget}) {
        CAPTURE(threads);
        CAPTURE(budget);
        ShardedCheckpoint src = open_files(one, d1, mode);
        for (TensorInfo& t : src.tensors)
          for (Chunk& c : t.chunks) c.at.order = byte_order::big;
        opt.threads = threads;
        opt.memory_budget = budget;
        for (const bool cast : {false, true}) {
          const Destination dst = layout::single(cast ? out_tensors : m.tensors, "y");
          const Plan plan = make_plan(src, dst);
          for (const CopyOp& o : plan.ops) CHECK(o.swap);
          MemorySink sink("y");
          Sink* p[] = {&sink};
          execute(plan, src, p, opt);
          CHECK(bytes(sink.bytes().begin(), sink.bytes().end()) == (cast ? want_cast : little));
        }
        // Digests are of the little-endian elements.
        const auto h = sha256_tensors(src, opt);
        CHECK(h[0].second == sha256_hex(TensorView::contiguous(dtype::F32, m.tensors[0].shape, little.data(), nullptr)));
      }
  // Replicas are compared after the swap: a big-endian copy equals the little-endian one.
  ShardedCheckpoint two = open_files(one, d1, read_mode::mmap);
  two.sources.push_back(MemorySource::copy_of("little", little));
  for (TensorInfo& t : two.tensors) {
    Chunk le = t.chunks[0];
    le.at.source = 1;
    t.chunks[0].at.order = byte_order::big;
    t.chunks.push_back(le);
  }
  plan_options check;
  check.check_replicas = true;
  const Plan rp = make_plan(two, layout::single(m.tensors, "z"), check);
  CHECK(!rp.checks.empty());
  MemorySink sink("z");
  Sink* p[] = {&sink};
  execute(rp, two, p, opt);
  CHECK(bytes(sink.bytes().begin(), sink.bytes().end()) == little);
  // Destinations are little-endian only.
  Destination bad = layout::single(m.tensors, "w");
  bad.tensors[0].chunks[0].at.order = byte_order::big;
  CHECK(error_of([&] { (void)make_plan(open_files(one, d1, read_mode::mmap), bad); }) == errors::destination_byte_order.id);
}

TEST_CASE("hashing sinks: CRC-32 of regions in any order, SHA-256 in order") {
  const Model m = make_model(5);
  const auto src = m.checkpoint();
  // Column shards on 4 ranks, consolidated into a file whose records' CRCs are tracked.
  std::vector<int> cols{1, 1, 0, 1, -1, -1};
  const Destination c4 = layout::chunked(m.tensors, cols, 4);
  std::vector<bytes> ranks;
  std::vector<std::shared_ptr<const ByteSource>> rank_src;
  {
    const Plan plan = make_plan(src, c4);
    std::vector<std::unique_ptr<MemorySink>> sinks;
    std::vector<Sink*> ptrs;
    for (const auto& n : c4.names) {
      sinks.push_back(std::make_unique<MemorySink>(n));
      ptrs.push_back(sinks.back().get());
    }
    execute(plan, src, ptrs);
    for (auto& s : sinks) rank_src.push_back(MemorySource::copy_of(s->name(), s->bytes()));
  }
  const auto sharded = layout::as_checkpoint(c4, rank_src);
  const Destination one = layout::single(m.tensors, "one.bin", 64);
  const Plan plan = make_plan(sharded, one);
  const fs::path dir = scratch("crc");
  for (unsigned threads : {1U, 4U}) {
    OutputFile f = OutputFile::create(dir / "one.bin");
    FileSink sink(f, 100);  // after a 100-byte "header"
    std::vector<FlatRange> regions;
    for (const auto& t : one.tensors) {
      const auto off = t.chunks[0].at.byte_offset;
      regions.push_back(FlatRange{off, off + byte_size(t.shape, itemsize(t.dtype))});
    }
    sink.track_crc32(regions);
    Sink* p[] = {&sink};
    exec_options opt;
    opt.threads = threads;
    opt.memory_budget = 1 << 20;
    execute(plan, sharded, p, opt);
    f.commit();
    const bytes file = read_bytes(dir / "one.bin");
    CHECK(file.size() == 100 + one.sizes[0]);
    for (std::size_t i = 0; i < regions.size(); ++i) {
      const auto r = regions[i];
      CHECK(sink.crc32(i) == zip::crc32(std::span<const std::byte>(file.data() + 100 + r.begin, r.size())));
    }
    CHECK(std::equal(file.begin() + 100 + static_cast<std::ptrdiff_t>(regions[1].begin),
                     file.begin() + 100 + static_cast<std::ptrdiff_t>(regions[1].end),
                     m.data.begin() + 1000 * 384 * 4));
  }
  // Whole-destination CRC-32 and SHA-256 (the latter written in order from one thread).
  Crc32Sink crc("crc");
  Sha256Sink sha("sha");
  Sink* p2[] = {&crc};
  Sink* p3[] = {&sha};
  const Plan tight = make_plan(sharded, layout::single(m.tensors, "one"));
  exec_options opt;
  opt.threads = 3;
  execute(tight, sharded, p2, opt);
  execute(tight, sharded, p3, opt);
  CHECK(crc.crc32() == zip::crc32(m.data));
  CHECK(sha.hex() == sha256_hex(std::span<const std::byte>(m.data)));
  // Per tensor, as inspect --hash prints: equal to hashing the consolidated views.
  const auto digests = sha256_tensors(sharded, opt);
  REQUIRE(digests.size() == m.tensors.size());
  std::uint64_t off = 0;
  for (std::size_t i = 0; i < m.tensors.size(); ++i) {
    const auto& t = m.tensors[i];
    const auto view = TensorView::contiguous(t.dtype, t.shape, m.data.data() + off);
    CHECK(digests[i].first == t.name);
    CHECK(digests[i].second == sha256_hex(view));
    off += byte_size(t.shape, itemsize(t.dtype));
  }
  CHECK(error_of([&] {
          Sha256Sink s;
          s.write(10, std::as_bytes(std::span<const char>("abc", 3)));
          s.write(5, std::as_bytes(std::span<const char>("abc", 3)));
        }) == errors::unordered_write.id);
}

TEST_CASE("progress, padding and usage errors") {
  const Model m = make_model(6);
  const auto src = m.checkpoint();
  // FSDP ranks with trailing padding: the files have their full size.
  const std::vector<std::vector<std::size_t>> groups{{0, 1, 2, 4, 5}};
  std::vector<TensorInfo> f32;
  for (std::size_t i : groups[0]) f32.push_back(m.tensors[i]);
  const Destination fs7 = layout::fsdp(f32, std::vector<std::vector<std::size_t>>{{0, 1, 2, 3, 4}}, 7, true);
  const fs::path dir = scratch("fsdp");
  std::vector<std::pair<std::uint64_t, std::uint64_t>> calls;
  std::set<std::string> files;
  exec_options opt;
  opt.threads = 3;
  opt.progress = [&](const progress_event& e) {
    CHECK(e.phase == progress_phase::copying);
    calls.emplace_back(e.done, e.total);
    if (!e.file.empty()) files.emplace(e.file);
  };
  (void)write_files(src, fs7, dir, opt);
  for (std::size_t r = 0; r < 7; ++r) CHECK(fs::file_size(dir / fs7.names[r]) == fs7.sizes[r]);
  REQUIRE(!calls.empty());
  for (std::size_t i = 1; i < calls.size(); ++i) CHECK(calls[i].first >= calls[i - 1].first);
  CHECK(calls.back().first == calls.back().second);
  CHECK(calls.size() < 2100);
  // Each report names the destination the bytes went to: every rank file written is named.
  for (const auto& f : files) CHECK(std::find(fs7.names.begin(), fs7.names.end(), f) != fs7.names.end());
  CHECK(files.size() >= 2);

  const Plan plan = make_plan(src, layout::single(m.tensors, "x"));
  MemorySink sink("x");
  Sink* p[] = {&sink};
  std::vector<std::shared_ptr<const ByteSource>> none;
  CHECK(error_of([&] { execute(plan, none, p); }) == errors::source_mismatch.id);
  std::vector<std::shared_ptr<const ByteSource>> shorter{MemorySource::copy_of("original", std::span(m.data).first(10))};
  CHECK(error_of([&] { execute(plan, shorter, p); }) == errors::source_mismatch.id);
  Sink* nul[] = {nullptr};
  CHECK(error_of([&] { execute(plan, src, nul); }) == errors::sink_missing.id);
  CHECK(error_of([&] { execute(plan, src, std::span<Sink* const>()); }) == errors::sink_missing.id);
  MemorySink small("small", 10);
  CHECK(error_of([&] { small.write(8, std::span(m.data).first(4)); }) == errors::sink_overflow.id);
}

TEST_CASE("scheduler: items in order, a thread moves to a destination nobody is writing, or waits") {
  using detail::exec_item;
  auto item = [](std::uint32_t dst, bool converts = false) { return exec_item{exec_item::kind::ops, 0, 1, 0, 0, dst, converts}; };
  const std::atomic<bool> stop{false};
  const std::uint32_t none = exec_item::no_dst;
  SUBCASE("two threads, three files") {
    // Destinations 0 0 0 1 1 2, a compare item (no destination), then a cast into 0.
    std::vector<exec_item> items{item(0), item(0), item(0), item(1), item(1), item(2), exec_item{exec_item::kind::compare, 0, 1, 0, 0}, item(0, true)};
    detail::exec_scheduler s;
    s.init(items, 3, {});
    CHECK(s.take(items, none, stop) == 0);  // thread A writes destination 0
    CHECK(s.take(items, none, stop) == 3);  // thread B: 0 is busy, first item of 1
    CHECK(s.take(items, 0, stop) == 1);     // A finished its item of 0: the next in order is 0 again
    CHECK(s.take(items, 1, stop) == 4);     // B: 0 busy (A), so 1 again, ahead of 2
    CHECK(s.take(items, 1, stop) == 5);     // B: 0 busy, 1 drained: 2
    CHECK(s.take(items, 2, stop) == 6);     // B: 0 busy, nothing else writes a file: the compare item
    CHECK(s.take(items, 0, stop) == 2);     // A: back to plan order
    CHECK(s.take(items, none, stop) == 7);  // B: 0 is busy, but a cast may share it (its work is CPU)
    CHECK(s.take(items, 0, stop) == items.size());
    CHECK(s.take(items, 0, stop) == items.size());
  }
  SUBCASE("a plain copy into a busy file waits until the file is free") {
    std::vector<exec_item> items{item(0), item(0), item(0)};
    detail::exec_scheduler s;
    s.init(items, 1, {});
    CHECK(s.take(items, none, stop) == 0);  // A
    std::atomic<std::size_t> got{99};
    std::thread b([&] { got = s.take(items, none, stop); });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    CHECK(got.load() == 99);              // B waits: A is writing the file
    CHECK(s.take(items, 0, stop) == 1);   // A goes on with the file
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(got.load() == 99);              // B still waits
    CHECK(s.take(items, 0, stop) == 2);
    CHECK(s.take(items, 0, stop) == items.size());  // A is done: B wakes to no work
    b.join();
    CHECK(got.load() == items.size());
  }
  SUBCASE("a file that takes concurrent writes (direct I/O) is written by two threads at once") {
    std::vector<exec_item> items{item(0), item(0), item(1), item(0)};
    detail::exec_scheduler s;
    s.init(items, 2, {1, 0});
    CHECK(s.take(items, none, stop) == 0);  // A writes 0
    CHECK(s.take(items, none, stop) == 2);  // B still prefers the file nobody writes
    CHECK(s.take(items, 1, stop) == 1);     // B: 0 is busy (A) but shared: no waiting
    CHECK(s.take(items, 0, stop) == 3);
    CHECK(s.take(items, 0, stop) == items.size());
  }
  SUBCASE("a waiting thread gives up when the run stops") {
    std::vector<exec_item> items{item(0), item(0)};
    detail::exec_scheduler s;
    s.init(items, 1, {});
    std::atomic<bool> stopping{false};
    CHECK(s.take(items, none, stopping) == 0);
    std::atomic<std::size_t> got{99};
    std::thread b([&] { got = s.take(items, none, stopping); });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    stopping = true;
    s.wake_all();
    b.join();
    CHECK(got.load() == items.size());
  }
}
