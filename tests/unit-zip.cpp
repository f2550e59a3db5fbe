// Unit tests: CRC-32, zip reader (hostile input) and writer (torch's layout, byte for byte).
#include <doctest/doctest.h>

#include <statedict/io/torch_file.hpp>
#include <statedict/io/zip.hpp>
#include <statedict/exec/digest.hpp>
#include <statedict/formats/torch.hpp>

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <span>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "test_util.hpp"

using namespace statedict;

namespace {

std::vector<std::byte> bytes_of(std::string_view s) {
  std::vector<std::byte> v(s.size());
  if (!s.empty()) std::memcpy(v.data(), s.data(), s.size());
  return v;
}

std::vector<std::byte> from_hex(std::string_view h) {
  std::vector<std::byte> v;
  for (std::size_t i = 0; i + 1 < h.size(); i += 2) v.push_back(static_cast<std::byte>(std::stoi(std::string(h.substr(i, 2)), nullptr, 16)));
  return v;
}

std::filesystem::path tmp(const std::string& name) {
  std::filesystem::create_directories(STATEDICT_TEST_TMP);
  return std::filesystem::path(STATEDICT_TEST_TMP) / ("unit-zip-" + name);
}

using statedict_test::read_bytes;

std::shared_ptr<const ByteSource> mem(std::vector<std::byte> v, std::string name = "mem.zip") {
  return MemorySource::copy_of(std::move(name), v);
}

struct Rec {
  std::string name;
  std::string data;
};

/// Writes an archive with our writer and returns its bytes.
std::vector<std::byte> make_zip(const std::vector<Rec>& recs, zip::write_options o = {}) {
  std::vector<zip::EntrySpec> specs;
  for (const auto& r : recs) specs.push_back({r.name, r.data.size()});
  const auto path = tmp("make.zip");
  {
    OutputFile out = OutputFile::create(path);
    zip::Writer w(out, zip::plan(specs, o));
    for (const auto& r : recs) w.entry(bytes_of(r.data));
    w.finish();
    out.commit();
  }
  return read_bytes(path);
}

template <class F>
void expect_error(F&& f, const error_id& id) {
  try {
    f();
    FAIL("expected error " << id.name);
  } catch (const error& e) {
    CHECK_MESSAGE(e.code() == id, "got " << std::string(e.what()));
  }
}

void put32(std::vector<std::byte>& v, std::size_t at, std::uint32_t x) {
  for (int i = 0; i < 4; ++i) v[at + static_cast<std::size_t>(i)] = static_cast<std::byte>((x >> (8 * i)) & 0xff);
}
void put16(std::vector<std::byte>& v, std::size_t at, std::uint16_t x) {
  v[at] = static_cast<std::byte>(x & 0xff);
  v[at + 1] = static_cast<std::byte>(x >> 8);
}
std::size_t find_sig(const std::vector<std::byte>& v, std::uint32_t sig, std::size_t from = 0) {
  for (std::size_t i = from; i + 4 <= v.size(); ++i)
    if (zip::detail::rd32(v.data() + i) == sig) return i;
  return std::string::npos;
}

// A file PyTorch 1.13 wrote: torch.save({"w": arange(6).reshape(2, 3), "step": 1}, "noext").
const char* const torch_noext_hex =
    "504b0304000008080000000000000000000000000000000000000e0014006e6f6578742f646174612e706b6c464210005a5a"
    "5a5a5a5a5a5a5a5a5a5a5a5a5a5a80027d710028580100000077710163746f7263682e5f7574696c730a5f72656275696c64"
    "5f74656e736f725f76320a71022828580700000073746f72616765710363746f7263680a466c6f617453746f726167650a71"
    "045801000000307105580300000063707571064b06747107514b004b024b038671084b034b018671098963636f6c6c656374"
    "696f6e730a4f726465726564446963740a710a2952710b74710c52710d580400000073746570710e4b01752e504b0708fc0c"
    "f21cb4000000b4000000504b0304000008080000000000000000000000000000000000000c0012006e6f6578742f64617461"
    "2f3046420e005a5a5a5a5a5a5a5a5a5a5a5a5a5a000000000000803f0000004000004040000080400000a040504b07081790"
    "e7911800000018000000504b0304000008080000000000000000000000000000000000000d002d006e6f6578742f76657273"
    "696f6e464229005a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a330a"
    "504b0708d19e67550200000002000000504b0102000000000808000000000000fc0cf21cb4000000b40000000e0000000000"
    "0000000000000000000000006e6f6578742f646174612e706b6c504b01020000000008080000000000001790e79118000000"
    "180000000c00000000000000000000000000040100006e6f6578742f646174612f30504b0102000000000808000000000000"
    "d19e675502000000020000000d00000000000000000000000000680100006e6f6578742f76657273696f6e504b06062c0000"
    "00000000001e032d00000000000000000003000000000000000300000000000000b100000000000000d20100000000000050"
    "4b060700000000830200000000000001000000504b05060000000003000300b1000000d20100000000";

// The central directory and end records of a 4 GiB file PyTorch 1.13 wrote:
// torch.save({"big": zeros(2**32 + 100, uint8), "small": arange(5.)}, "big.pt").
const char* const torch_big_tail_hex =
    "504b01020000000008080000000000007bd930f0ff000000ff0000000c00000000000000000000000000000000006269672f"
    "646174612e706b6c504b010200000000080800000000000046d94e37ffffffffffffffff0a00140000000000000000000000"
    "4f0100006269672f646174612f300100100064000000010000006400000001000000504b0102000000000808000000000000"
    "8cc4c96814000000140000000a000c0000000000000000000000ffffffff6269672f646174612f31010008003c0200000100"
    "0000504b0102000000000808000000000000d19e675502000000020000000b000c0000000000000000000000ffffffff6269"
    "672f76657273696f6e01000800ac02000001000000504b06062c000000000000001e032d0000000000000000000400000000"
    "00000004000000000000000f010000000000001a03000001000000504b060700000000290400000100000001000000504b05"
    "0600000000040004000f010000ffffffff0000";

}  // namespace

TEST_CASE("crc32: known values, both implementations, every length and alignment") {
  CHECK(zip::crc32(bytes_of("123456789")) == 0xCBF43926U);
  CHECK(zip::crc32(bytes_of("")) == 0U);
  CHECK(zip::crc32(bytes_of("The quick brown fox jumps over the lazy dog")) == 0x414FA339U);
  std::vector<std::byte> data(70000);
  std::mt19937 rng(7);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  for (std::size_t start : {0U, 1U, 3U, 15U}) {
    for (std::size_t n : {0U, 1U, 15U, 16U, 63U, 64U, 255U, 256U, 257U, 1000U, 4097U, 65536U}) {
      const std::span<const std::byte> s(data.data() + start, n);
      CHECK(zip::crc32(s) == zip::crc32_portable(s));
    }
  }
}

TEST_CASE("crc32: continuation and combination of pieces in any order") {
  std::vector<std::byte> data(100000);
  std::mt19937 rng(11);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  const std::uint32_t whole = zip::crc32(data);
  for (std::size_t split : {0U, 1U, 64U, 999U, 50000U, 99999U, 100000U}) {
    const std::span<const std::byte> a(data.data(), split), b(data.data() + split, data.size() - split);
    CHECK(zip::crc32(b, zip::crc32(a)) == whole);
    CHECK(zip::crc32_combine(zip::crc32(a), zip::crc32(b), b.size()) == whole);
  }
  zip::CrcPieces pieces;
  const std::size_t cuts[] = {0, 7, 4096, 4100, 70000, 100000};
  for (std::size_t i = 5; i-- > 0;)  // reported backwards
    pieces.add(cuts[i], cuts[i + 1] - cuts[i], zip::crc32(std::span<const std::byte>(data.data() + cuts[i], cuts[i + 1] - cuts[i])));
  REQUIRE(pieces.complete(data.size()));
  CHECK(pieces.combined() == whole);
  zip::CrcPieces gap;
  gap.add(0, 10, 0);
  gap.add(11, 5, 0);
  CHECK_FALSE(gap.complete(16));
  zip::CrcPieces overlap;
  overlap.add(0, 10, 0);
  overlap.add(5, 11, 0);
  CHECK_FALSE(overlap.complete(16));
  CHECK(zip::crc32_combine(0x12345678U, 0, 0) == 0x12345678U);
}

TEST_CASE("writer: torch's own archive, byte for byte") {
  const auto golden = from_hex(torch_noext_hex);
  // Read it with our reader, then write the same records with our writer.
  auto ar = zip::Archive::open(mem(golden, "noext"));
  REQUIRE(ar.entries().size() == 3);
  CHECK(ar.entries()[0].name == "noext/data.pkl");
  CHECK(ar.entries()[0].data_offset == 64);
  CHECK(ar.entries()[1].data_offset == 320);
  CHECK(ar.entries()[2].data_offset == 448);
  CHECK(ar.zip64());
  std::vector<Rec> recs;
  for (const auto& e : ar.entries()) {
    const Region r = ar.read(e);
    recs.push_back({e.name, std::string(reinterpret_cast<const char*>(r.data), static_cast<std::size_t>(r.size))});
  }
  const auto ours = make_zip(recs);
  CHECK(ours == golden);
}

TEST_CASE("writer: ZIP64 layout of a 4 GiB torch file, computed without writing it") {
  const std::vector<zip::EntrySpec> specs{
      {"big/data.pkl", 255}, {"big/data/0", 4294967396ULL}, {"big/data/1", 20}, {"big/version", 2}};
  const zip::Layout L = zip::plan(specs);
  CHECK(L.entries[0].header_offset == 0);
  CHECK(L.entries[1].header_offset == 335);
  CHECK(L.entries[1].data_offset == 448);
  CHECK(L.entries[1].zip64);
  CHECK(L.entries[1].descriptor_size() == 24);
  CHECK(L.entries[2].header_offset == 4294967868ULL);
  CHECK(L.entries[2].zip64);
  CHECK(L.entries[2].data_offset % 64 == 0);
  CHECK(L.entries[3].header_offset == 4294967980ULL);
  CHECK(L.central_offset == 0x10000031aULL);
  CHECK(L.total_size == 4294968459ULL);
  const std::uint32_t crcs[] = {4029733243U, 927914310U, 1758053516U, 1432854225U};
  CHECK(zip::tail_bytes(L, crcs) == from_hex(torch_big_tail_hex));
  // The local header of the big record carries both sizes; the one past 4 GiB its own offset.
  const auto h1 = zip::local_header_bytes(L.entries[1]);
  CHECK(h1.size() == 448 - 335);
  CHECK(zip::detail::rd16(h1.data() + 30 + 10) == 0x0001);
  CHECK(zip::detail::rd64(h1.data() + 30 + 14) == 4294967396ULL);
  const auto h2 = zip::local_header_bytes(L.entries[2]);
  CHECK(zip::detail::rd64(h2.data() + 30 + 10 + 4) == 4294967868ULL);
}

TEST_CASE("writer + reader: every entry aligned, data zero-copy, ZIP64 forced on a small archive") {
  for (std::uint64_t threshold : {0xFFFFFFFFULL, 1ULL, 100ULL}) {
    zip::write_options o;
    o.zip64_threshold = threshold;
    std::vector<Rec> recs{{"a/data.pkl", "pickle"}, {"a/data/0", std::string(1000, 'x')}, {"a/data/1", ""},
                          {"a/data/2", std::string(70, 'y')}, {"a/version", "3\n"}};
    const auto bytes = make_zip(recs, o);
    auto src = mem(bytes);
    auto ar = zip::Archive::open(src, {zip::limits{}, true});
    REQUIRE(ar.entries().size() == recs.size());
    for (std::size_t i = 0; i < recs.size(); ++i) {
      const auto& e = ar.entries()[i];
      CAPTURE(threshold);
      CHECK(e.name == recs[i].name);
      CHECK(e.data_offset % 64 == 0);
      CHECK(e.size == recs[i].data.size());
      const Region r = ar.read(e);
      CHECK(r.data == src->data() + e.data_offset);  // zero-copy
      CHECK(std::string(reinterpret_cast<const char*>(r.data), static_cast<std::size_t>(r.size)) == recs[i].data);
    }
  }
}

namespace {
/// A source that counts the positioned reads of local headers (peek) and their sizes.
class PeekCounter final : public ByteSource {
 public:
  explicit PeekCounter(std::shared_ptr<const ByteSource> base) : base_(std::move(base)) {}
  [[nodiscard]] const std::string& name() const noexcept override { return base_->name(); }
  [[nodiscard]] std::uint64_t size() const noexcept override { return base_->size(); }
  [[nodiscard]] const std::byte* data() const noexcept override { return base_->data(); }
  [[nodiscard]] keep_alive owner() const override { return base_->owner(); }
  void read(std::uint64_t offset, std::span<std::byte> dst) const override { base_->read(offset, dst); }
  void peek(std::uint64_t offset, std::span<std::byte> dst) const override {
    ++peeks;
    largest = std::max<std::size_t>(largest, dst.size());
    base_->peek(offset, dst);
  }
  mutable std::size_t peeks = 0;
  mutable std::size_t largest = 0;

 private:
  std::shared_ptr<const ByteSource> base_;
};
}  // namespace

TEST_CASE("reader: local headers that lie close together are read together, far ones apart") {
  // 200 small records, one of 300 KiB, 200 more small ones: the small ones' headers lie within
  // a few KiB of each other; the big record separates two groups.
  std::vector<Rec> recs;
  for (int i = 0; i < 400; ++i) {
    if (i == 200) recs.push_back({"m/data/big", std::string(300 << 10, 'b')});
    recs.push_back({"m/data/" + std::to_string(i), std::string(static_cast<std::size_t>(1 + i % 7), static_cast<char>('a' + i % 26))});
  }
  const auto bytes = make_zip(recs);
  auto counter = std::make_shared<PeekCounter>(mem(bytes));
  const auto ar = zip::Archive::open(counter);
  REQUIRE(ar.entries().size() == recs.size());
  for (std::size_t i = 0; i < recs.size(); ++i) {
    const auto& e = ar.entries()[i];
    CAPTURE(e.name);
    CHECK(e.name == recs[i].name);
    CHECK(e.data_offset % 64 == 0);
    const Region r = ar.read(e);
    CHECK(std::string(reinterpret_cast<const char*>(r.data), static_cast<std::size_t>(r.size)) == recs[i].data);
  }
  // One read per group of nearby headers (a small record and its header take about 100 bytes):
  // the 401 headers in two or three reads, none longer than 64 KiB.
  CHECK(counter->peeks >= 2);
  CHECK(counter->peeks <= 4);
  CHECK(counter->largest <= std::size_t{64} << 10);

  SUBCASE("a bad header inside a group is still named") {
    auto v = bytes;
    const std::size_t h = static_cast<std::size_t>(ar.entries()[57].header_offset);
    put32(v, h, 0x01020304);
    try {
      (void)zip::Archive::open(mem(v));
      FAIL("expected zip.bad_local_header");
    } catch (const error& e) {
      CHECK(e.code() == errors::zip_bad_local_header);
      CHECK_MESSAGE(std::string(e.what()).find("'m/data/57'") != std::string::npos, e.what());
    }
    auto w = bytes;
    const std::size_t h2 = static_cast<std::size_t>(ar.entries()[301].header_offset);
    put16(w, h2 + 26, 3);  // a name length that does not match its central directory entry
    expect_error([&] { (void)zip::Archive::open(mem(w)); }, errors::zip_bad_local_header);
  }
}

TEST_CASE("reader: local headers left unread, read later or on another thread; torch's layout predicts them") {
  std::vector<Rec> recs;
  for (int i = 0; i < 120; ++i)
    recs.push_back({"m/data/" + std::to_string(i), std::string(static_cast<std::size_t>(i * 13 % 200), static_cast<char>('a' + i % 26))});
  zip::write_options z64;
  z64.zip64_threshold = 3000;  // later records get ZIP64 fields in their local headers
  for (const zip::write_options& o : {zip::write_options{}, z64}) {
    const auto bytes = make_zip(recs, o);
    const auto plain = zip::Archive::open(mem(bytes));
    zip::read_options deferred;
    deferred.defer_local_headers = true;
    auto later = zip::Archive::open(mem(bytes), deferred);
    REQUIRE(later.entries().size() == recs.size());
    for (const auto& e : later.entries()) CHECK(e.data_offset == 0);
    expect_error([&] { (void)later.read(later.entries()[5]); }, errors::zip_bad_local_header);
    // torch's layout, computed from the central directory alone, is where our writer put the data.
    for (std::size_t i = 0; i < recs.size(); ++i) CHECK(zip::written_data_offset(later, later.entries()[i], o) == plain.entries()[i].data_offset);
    later.locate(later.entries()[5]);
    CHECK(later.entries()[5].data_offset == plain.entries()[5].data_offset);
    std::vector<std::uint64_t> offsets;
    std::thread t([&] { offsets = later.data_offsets(); });
    t.join();
    REQUIRE(offsets.size() == recs.size());
    later.adopt_data_offsets(offsets);
    for (std::size_t i = 0; i < recs.size(); ++i) {
      CHECK(later.entries()[i].data_offset == plain.entries()[i].data_offset);
      const Region r = later.read(later.entries()[i]);
      CHECK(std::string(reinterpret_cast<const char*>(r.data), static_cast<std::size_t>(r.size)) == recs[i].data);
    }
    expect_error([&] { later.adopt_data_offsets(std::vector<std::uint64_t>(3)); }, errors::out_of_range);
    expect_error([&] { later.locate(plain.entries()[0]); }, errors::out_of_range);
  }
  // Another alignment: the prediction is wrong for most records; the headers are not.
  zip::write_options wide;
  wide.alignment = 256;
  const auto bytes = make_zip(recs, wide);
  const auto ar = zip::Archive::open(mem(bytes));
  std::size_t wrong = 0;
  for (const auto& e : ar.entries()) wrong += zip::written_data_offset(ar, e) != e.data_offset;
  CHECK(wrong > 60);
  // A bad header: data_offsets() throws what open() throws.
  auto v = bytes;
  put32(v, static_cast<std::size_t>(ar.entries()[77].header_offset), 0x01020304);
  zip::read_options deferred;
  deferred.defer_local_headers = true;
  const auto bad = zip::Archive::open(mem(v), deferred);
  expect_error([&] { (void)bad.data_offsets(); }, errors::zip_bad_local_header);
  expect_error([&] { (void)zip::Archive::open(mem(v)); }, errors::zip_bad_local_header);
}

TEST_CASE("reader: archive embedded at an offset, and data prepended to an archive") {
  const auto zipped = make_zip({{"archive/data.pkl", "abc"}, {"archive/data/0", "0123456789"}});
  std::vector<std::byte> file;
  file.reserve(1000 + zipped.size() + 77);
  file.insert(file.end(), 1000, std::byte{0x55});
  file.insert(file.end(), zipped.begin(), zipped.end());
  file.insert(file.end(), 77, std::byte{0x66});
  auto whole = mem(file, "items.distcp");
  // As a DCP reader sees it: a slice of the file.
  auto slice = std::make_shared<SliceSource>(whole, 1000, zipped.size());
  auto ar = zip::Archive::open(slice);
  CHECK(ar.prefix_bytes() == 0);
  const Region r = ar.read("archive/data/0");
  CHECK(std::memcmp(r.data, "0123456789", 10) == 0);
  CHECK(r.data == whole->data() + 1000 + ar.at("archive/data/0").data_offset);
  // Data in front of the archive (no slice): offsets are rebased.
  auto front = std::make_shared<SliceSource>(whole, 0, 1000 + zipped.size());
  auto ar2 = zip::Archive::open(front);
  CHECK(ar2.prefix_bytes() == 1000);
  CHECK(std::memcmp(ar2.read("archive/data/0").data, "0123456789", 10) == 0);
  // Bytes after the end record are tolerated (as Python's zipfile and miniz do).
  auto ar3 = zip::Archive::open(whole);
  CHECK(ar3.prefix_bytes() == 1000);
  CHECK(std::memcmp(ar3.read("archive/data.pkl").data, "abc", 3) == 0);
}

TEST_CASE("reader: an archive comment is skipped, a lying comment length is not") {
  auto bytes = make_zip({{"x/data.pkl", "abc"}});
  const std::size_t end = bytes.size() - 22;
  put16(bytes, end + 20, 5);
  bytes.insert(bytes.end(), {std::byte{'h'}, std::byte{'e'}, std::byte{'l'}, std::byte{'l'}, std::byte{'o'}});
  CHECK(zip::Archive::open(mem(bytes)).entries().size() == 1);
  put16(bytes, end + 20, 6);
  expect_error([&] { (void)zip::Archive::open(mem(bytes)); }, errors::zip_not_a_zip);
}

TEST_CASE("reader: hostile archives, one error id each") {
  const auto good = make_zip({{"p/data.pkl", "pickle-bytes"}, {"p/data/0", std::string(100, 'z')}});
  const std::size_t cd = find_sig(good, 0x02014b50);
  const std::size_t cd2 = find_sig(good, 0x02014b50, cd + 4);
  const std::size_t end64 = find_sig(good, 0x06064b50);
  const std::size_t loc = find_sig(good, 0x07064b50);
  const std::size_t end = find_sig(good, 0x06054b50);
  REQUIRE(cd != std::string::npos);
  REQUIRE(end != std::string::npos);
  auto open = [](const std::vector<std::byte>& v) { return zip::Archive::open(mem(v)); };

  SUBCASE("too short / no end record") {
    expect_error([&] { (void)open(from_hex("504b0506")); }, errors::zip_not_a_zip);
    std::vector<std::byte> junk(5000, std::byte{0});
    expect_error([&] { (void)open(junk); }, errors::zip_not_a_zip);
  }
  SUBCASE("truncated: the central directory is cut off") {
    std::vector<std::byte> v(good.begin() + static_cast<std::ptrdiff_t>(cd + 10), good.end());
    expect_error([&] { (void)open(v); }, errors::zip_bad_end_record);
  }
  SUBCASE("entry count larger than the directory") {
    auto v = good;
    // Both the classic and the ZIP64 records.
    put16(v, end + 8, 400);
    put16(v, end + 10, 400);
    for (std::size_t i = 0; i < 8; ++i) v[end64 + 24 + i] = v[end64 + 32 + i] = std::byte{0};
    put32(v, end64 + 24, 400);
    put32(v, end64 + 32, 400);
    expect_error([&] { (void)open(v); }, errors::zip_bad_central_dir);
  }
  SUBCASE("classic and ZIP64 records disagree") {
    auto v = good;
    put16(v, end + 10, 3);
    put16(v, end + 8, 3);
    expect_error([&] { (void)open(v); }, errors::zip_bad_zip64);
  }
  SUBCASE("ZIP64 locator pointing nowhere") {
    auto v = good;
    put32(v, end64, 0x12345678);  // destroy the record right before the locator
    put32(v, loc + 8, 3);         // and the recorded offset points into a local header
    expect_error([&] { (void)open(v); }, errors::zip_bad_zip64);
  }
  SUBCASE("ZIP64 locator recording another offset than the record's") {
    auto v = good;
    put32(v, loc + 8, 3);  // the record is intact right before the locator
    expect_error([&] { (void)open(v); }, errors::zip_bad_zip64);
  }
  SUBCASE("multi-disk archives") {
    auto v = good;
    put32(v, loc + 16, 2);
    expect_error([&] { (void)open(v); }, errors::zip_multi_disk);
  }
  SUBCASE("entry data past the central directory (lying size)") {
    auto v = good;
    put32(v, cd2 + 20, 100000);
    put32(v, cd2 + 24, 100000);
    expect_error([&] { (void)open(v); }, errors::zip_entry_out_of_bounds);
  }
  SUBCASE("local header offset past the directory") {
    auto v = good;
    put32(v, cd2 + 42, static_cast<std::uint32_t>(cd + 1));
    expect_error([&] { (void)open(v); }, errors::zip_entry_out_of_bounds);
  }
  SUBCASE("local header missing") {
    auto v = good;
    put32(v, cd2 + 42, 1);
    expect_error([&] { (void)open(v); }, errors::zip_bad_local_header);
  }
  SUBCASE("local header names another entry") {
    auto v = good;
    const std::size_t lh = find_sig(v, 0x04034b50, 10);
    v[lh + 30] = std::byte{'q'};
    expect_error([&] { (void)open(v); }, errors::zip_bad_local_header);
  }
  SUBCASE("stored entry whose sizes differ") {
    auto v = good;
    put32(v, cd2 + 20, 99);
    expect_error([&] { (void)open(v); }, errors::zip_size_mismatch);
  }
  SUBCASE("duplicate names") {
    auto v = good;
    // "p/data.pkl" and "p/data/0" have different lengths; rename the second in both headers.
    auto dup = make_zip({{"p/a", "1"}, {"p/b", "2"}});
    const std::size_t c1 = find_sig(dup, 0x02014b50);
    const std::size_t c2 = find_sig(dup, 0x02014b50, c1 + 4);
    const std::size_t l2 = find_sig(dup, 0x04034b50, 10);
    dup[c2 + 46 + 2] = std::byte{'a'};
    dup[l2 + 30 + 2] = std::byte{'a'};
    expect_error([&] { (void)open(dup); }, errors::zip_duplicate_entry);
  }
  SUBCASE("names with NUL, empty names") {
    auto v = good;
    v[cd + 46 + 1] = std::byte{0};
    expect_error([&] { (void)open(v); }, errors::zip_bad_entry_name);
  }
  SUBCASE("truncated extra field") {
    auto v = make_zip({{"z/a", "1"}}, zip::write_options{64, 1});  // ZIP64 fields everywhere
    const std::size_t c = find_sig(v, 0x02014b50);
    put16(v, c + 46 + 3 + 2, 200);  // ZIP64 field claims 200 bytes
    expect_error([&] { (void)open(v); }, errors::zip_bad_extra_field);
  }
  SUBCASE("escape values without a ZIP64 field") {
    auto v = good;
    put32(v, cd2 + 42, 0xFFFFFFFFU);
    expect_error([&] { (void)open(v); }, errors::zip_bad_zip64);
  }
  SUBCASE("ZIP64 field too short for the escaped values") {
    auto v = make_zip({{"z/a", "1"}}, zip::write_options{64, 1});
    const std::size_t c = find_sig(v, 0x02014b50);
    put16(v, c + 46 + 3 + 2, 8);  // only one of the three values
    expect_error([&] { (void)open(v); }, errors::zip_bad_zip64);
  }
  SUBCASE("compressed and encrypted entries: clear errors naming the entry, only when read") {
    auto v = good;
    put16(v, cd2 + 10, 12);  // bzip2
    auto ar = open(v);
    CHECK(ar.read("p/data.pkl").size == 12);
    try {
      (void)ar.read("p/data/0");
      FAIL("expected an error");
    } catch (const unsupported_error& e) {
      CHECK(e.code() == errors::zip_compressed_entry);
      CHECK(std::string(e.what()).find("'p/data/0'") != std::string::npos);
      CHECK(std::string(e.what()).find("method 12") != std::string::npos);
    }
    auto d = good;
    put16(d, cd2 + 10, 8);  // "deflated", but the bytes are not a DEFLATE stream
    expect_error([&] { (void)open(d).read("p/data/0"); }, errors::zip_bad_deflate);
    expect_error([&] { open(d).check_readable(open(d).at("p/data/0")); }, errors::zip_compressed_entry);  // not usable in place
    auto w = good;
    put16(w, cd + 8, 0x0809);
    expect_error([&] { (void)open(w).read("p/data.pkl"); }, errors::zip_encrypted_entry);
  }
  SUBCASE("missing entry") { expect_error([&] { (void)open(good).at("p/nope"); }, errors::zip_missing_entry); }
  SUBCASE("CRC is checked only when asked") {
    auto v = good;
    const auto e = open(v).at("p/data/0");
    v[static_cast<std::size_t>(e.data_offset) + 5] = std::byte{'!'};
    CHECK(open(v).read("p/data/0").size == 100);
    expect_error([&] { (void)zip::Archive::open(mem(v), {zip::limits{}, true}).read("p/data/0"); }, errors::zip_crc_mismatch);
  }
  SUBCASE("limits: entries and central directory size") {
    zip::read_options o;
    o.limits.max_entries = 1;
    expect_error([&] { (void)zip::Archive::open(mem(good), o); }, errors::zip_too_many_entries);
    zip::read_options o2;
    o2.limits.max_central_directory_bytes = 50;
    expect_error([&] { (void)zip::Archive::open(mem(good), o2); }, errors::zip_central_dir_too_large);
  }
}

TEST_CASE("reader: a huge entry count in a tiny file does not allocate") {
  auto v = make_zip({{"p/a", "1"}});
  const std::size_t end = find_sig(v, 0x06054b50);
  const std::size_t end64 = find_sig(v, 0x06064b50);
  for (std::size_t off : {end64 + 24, end64 + 32}) {
    put32(v, off, 0xFFFFFFFFU);
    put32(v, off + 4, 0x0FFFFFFFU);
  }
  put16(v, end + 8, 0xFFFF);
  put16(v, end + 10, 0xFFFF);
  zip::read_options o;
  o.limits.max_entries = ~std::uint64_t{0};
  expect_error([&] { (void)zip::Archive::open(mem(v), o); }, errors::zip_bad_central_dir);
}

TEST_CASE("writer: misuse is reported") {
  expect_error([] { (void)zip::plan({{"", 1}}); }, errors::zip_bad_writer_input);
  expect_error([] { (void)zip::plan({{"a", 1}}, zip::write_options{48, 0xFFFFFFFFU}); }, errors::zip_bad_writer_input);
  const auto path = tmp("misuse.zip");
  OutputFile out = OutputFile::create(path);
  zip::Writer w(out, zip::plan({{"a/x", 3}, {"a/y", 1}}));
  expect_error([&] { w.write(bytes_of("abc")); }, errors::zip_writer_order);
  w.begin_entry();
  expect_error([&] { w.write(bytes_of("abcd")); }, errors::zip_writer_order);
  w.write(bytes_of("ab"));
  expect_error([&] { w.end_entry(); }, errors::zip_writer_order);
  w.write(bytes_of("c"));
  w.end_entry();
  expect_error([&] { w.finish(); }, errors::zip_writer_order);
  expect_error([&] { (void)zip::tail_bytes(w.layout(), std::vector<std::uint32_t>{1}); }, errors::zip_bad_writer_input);
}

namespace {

/// Raw DEFLATE of `in` (zlib, no header), as zip method 8 stores it.
std::vector<std::byte> deflate_raw(std::span<const std::byte> in, int level = 6) {
  z_stream zs{};
  REQUIRE(deflateInit2(&zs, level, Z_DEFLATED, -MAX_WBITS, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  std::vector<std::byte> out(deflateBound(&zs, static_cast<uLong>(in.size())));
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<std::byte*>(in.data()));
  zs.avail_in = static_cast<uInt>(in.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  REQUIRE(deflate(&zs, Z_FINISH) == Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

struct Packed {
  std::string name;
  std::vector<std::byte> data;  ///< uncompressed
  bool deflate = true;
};

/// A plain zip archive (no ZIP64, no data descriptors), as Python's zipfile writes one, with
/// each entry stored or deflated. `declared` overrides the uncompressed size of entry i.
std::vector<std::byte> repack(const std::vector<Packed>& entries, std::map<std::size_t, std::uint32_t> declared = {}) {
  std::vector<std::byte> out, cd;
  auto w16 = [](std::vector<std::byte>& v, std::uint32_t x) { zip::detail::wr16(v, x); };
  auto w32 = [](std::vector<std::byte>& v, std::uint32_t x) { zip::detail::wr32(v, x); };
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const Packed& p = entries[i];
    const std::vector<std::byte> body = p.deflate ? deflate_raw(p.data) : p.data;
    const auto crc = zip::crc32(std::span<const std::byte>(p.data));
    const std::uint32_t size = declared.count(i) ? declared[i] : static_cast<std::uint32_t>(p.data.size());
    const auto header_at = static_cast<std::uint32_t>(out.size());
    for (auto* v : {&out, &cd}) {
      w32(*v, v == &out ? 0x04034b50 : 0x02014b50);
      if (v == &cd) w16(*v, 20);
      w16(*v, 20);
      w16(*v, 0);
      w16(*v, p.deflate ? 8 : 0);
      w32(*v, 0);  // time, date
      w32(*v, crc);
      w32(*v, static_cast<std::uint32_t>(body.size()));
      w32(*v, size);
      w16(*v, static_cast<std::uint32_t>(p.name.size()));
      w16(*v, 0);
      if (v == &cd) {
        w16(*v, 0);
        w16(*v, 0);
        w16(*v, 0);
        w32(*v, 0);
        w32(*v, header_at);
      }
      zip::detail::wrstr(*v, p.name);
    }
    out.insert(out.end(), body.begin(), body.end());
  }
  const auto cd_at = static_cast<std::uint32_t>(out.size());
  out.insert(out.end(), cd.begin(), cd.end());
  w32(out, 0x06054b50);
  w32(out, 0);
  w16(out, static_cast<std::uint32_t>(entries.size()));
  w16(out, static_cast<std::uint32_t>(entries.size()));
  w32(out, static_cast<std::uint32_t>(cd.size()));
  w32(out, cd_at);
  w16(out, 0);
  return out;
}

}  // namespace

TEST_CASE("inflate: raw DEFLATE streams of every shape, and hostile ones") {
  std::mt19937 rng(7);
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{1000}, std::size_t{300000}}) {
    CAPTURE(n);
    std::vector<std::byte> data(n);
    for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<std::byte>(i % 7 == 0 ? rng() & 0xff : i & 0x3);
    for (const int level : {0, 1, 9}) {
      const auto packed = deflate_raw(data, level);
      std::vector<std::byte> back(n);
      zip::inflate_raw(packed, back, "test");
      CHECK(back == data);
      // Declared one byte short or long, cut short, or corrupt: errors, never a write past the buffer.
      if (n > 0) {
        std::vector<std::byte> short_out(n - 1);
        expect_error([&] { zip::inflate_raw(packed, short_out, "test"); }, errors::zip_bad_deflate);
      }
      std::vector<std::byte> long_out(n + 1);
      expect_error([&] { zip::inflate_raw(packed, long_out, "test"); }, errors::zip_bad_deflate);
      expect_error([&] { zip::inflate_raw(std::span(packed).first(packed.size() - 1), back, "test"); }, errors::zip_bad_deflate);
    }
  }
  std::vector<std::byte> out(16);
  const std::vector<std::byte> junk(40, std::byte{0xff});
  expect_error([&] { zip::inflate_raw(junk, out, "test"); }, errors::zip_bad_deflate);
  expect_error([&] { zip::inflate_raw({}, out, "test"); }, errors::zip_bad_deflate);
}

TEST_CASE("reader: deflated entries are inflated into memory, within max_inflated_bytes") {
  std::vector<std::byte> big(5000);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<std::byte>(i * 31 % 251);
  const std::vector<Packed> entries = {{"a/x", bytes_of("hello hello hello"), true}, {"a/y", big, true}, {"a/z", bytes_of("plain"), false}};
  const auto v = repack(entries);
  zip::read_options o;
  o.verify_crc = true;
  const zip::Archive ar = zip::Archive::open(mem(v), o);
  CHECK(ar.at("a/x").deflated());
  const Region x = ar.read("a/x");
  CHECK(std::string(reinterpret_cast<const char*>(x.data), static_cast<std::size_t>(x.size)) == "hello hello hello");
  const Region y = ar.read("a/y");
  CHECK(std::equal(big.begin(), big.end(), y.data, y.data + y.size));
  CHECK(ar.read("a/z").size == 5);
  CHECK(ar.inflated_bytes() == 17 + 5000);
  expect_error([&] { ar.check_readable(ar.at("a/x")); }, errors::zip_compressed_entry);  // never a view of the file

  zip::read_options small;
  small.limits.max_inflated_bytes = 5010;  // y alone fits, x + y do not
  const zip::Archive capped = zip::Archive::open(mem(v), small);
  CHECK(capped.read("a/y").size == 5000);
  expect_error([&] { (void)capped.read("a/x"); }, errors::zip_inflate_limit);

  // A lying uncompressed size, and a CRC that does not match the inflated bytes.
  expect_error([&] { (void)zip::Archive::open(mem(repack(entries, {{1, 4999}}))).read("a/y"); }, errors::zip_bad_deflate);
  expect_error([&] { (void)zip::Archive::open(mem(repack(entries, {{1, 5001}}))).read("a/y"); }, errors::zip_bad_deflate);
  auto bad_crc = v;
  bad_crc[bad_crc.size() - 22 - (46 + 3) * 3 + 16] ^= std::byte{1};  // the first central entry's CRC
  expect_error([&] { (void)zip::Archive::open(mem(bad_crc), o).read("a/x"); }, errors::zip_crc_mismatch);
}

TEST_CASE("torch: an archive whose records another zip tool deflated reads as the original") {
  Dict d;
  d.insert("w", Value(Tensor::from<float>({1, 2, 3, 4, 5, 6}, {2, 3}).view()));
  d.insert("ids", Value(Tensor::from<std::int64_t>({7, -8}, {2}).view()));
  d.insert("step", Value(std::int64_t{12}));
  const auto path = tmp("orig.pt");
  torch::save(path, Value(d));
  const torch::File orig = torch::read(path);
  // Every record, in the same order, stored -> deflated (the data.pkl too).
  const zip::Archive ar = zip::Archive::open(mem(read_bytes(path)));
  std::vector<Packed> entries;
  for (const auto& e : ar.entries()) {
    const Region r = ar.read(e);
    entries.push_back({e.name, std::vector<std::byte>(r.data, r.data + r.size), true});
  }
  const auto deflated = repack(entries);
  for (const bool lazy : {false, true}) {
    CAPTURE(lazy);
    const torch::File f = lazy ? torch::read_lazily(mem(deflated, "deflated.pt")) : torch::read(mem(deflated, "deflated.pt"));
    CHECK(f.value == orig.value);
    CHECK(f.compressed_records == 2);
    CHECK(f.in_memory_bytes >= 24 + 16);
    const ShardedCheckpoint ck = torch::describe(f);
    CHECK(ck.metadata.at("torch.records_in_memory").find("2 deflated record(s)") != std::string::npos);
    CHECK(ck.sources.at(0)->name().find("records in memory") != std::string::npos);
    const auto h = sha256_tensors(ck);
    const auto h0 = sha256_tensors(torch::describe(path));
    CHECK(h == h0);
  }
  torch::load_options lo;
  lo.limits.zip.max_inflated_bytes = 30;
  expect_error([&] { (void)torch::read(mem(deflated, "deflated.pt"), lo); }, errors::zip_inflate_limit);
}
