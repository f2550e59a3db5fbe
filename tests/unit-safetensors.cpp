// safetensors reader and writer: every validation rule of the reference reader with its error id,
// the writer's byte layout, streaming, casts, aliases, and misaligned data.
#include <doctest/doctest.h>

#include <statedict/core/sha256.hpp>
#include <statedict/io/safetensors.hpp>
#include <statedict/formats/safetensors.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace statedict;
namespace st = statedict::safetensors;
namespace fs = std::filesystem;

namespace {

std::string le64(std::uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

/// A file image: u64 N, header, data.
std::string image(const std::string& header, const std::string& data = {}) { return le64(header.size()) + header + data; }

std::shared_ptr<const ByteSource> mem(const std::string& bytes, std::string name = "t.safetensors") {
  return MemorySource::copy_of(std::move(name), std::as_bytes(std::span<const char>(bytes.data(), bytes.size())));
}

st::File open_image(const std::string& bytes, const st::limits& lim = {}) { return st::File::open(mem(bytes), lim); }

/// The id of the error opening `bytes` raises, or 0.
int error_of(const std::string& bytes, const st::limits& lim = {}) {
  try {
    (void)open_image(bytes, lim);
  } catch (const error& e) {
    return e.id();
  }
  return 0;
}

std::string tensor_json(const std::string& name, const std::string& dtype, const std::string& shape, std::uint64_t b,
                        std::uint64_t e) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" + std::to_string(b) +
         "," + std::to_string(e) + "]}";
}

fs::path tmp_dir() { return statedict_test::test_dir("unit-safetensors"); }

using statedict_test::read_all;

using statedict_test::write_all;

std::string bytes_of(const void* p, std::size_t n) { return std::string(static_cast<const char*>(p), n); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Valid files

TEST_CASE("reads a minimal file: tensors in offset order, zero copy into the source") {
  const float w[2] = {1.5F, -2.0F};
  const std::int64_t s = 7;
  // Header lists tensors in name order, data in another order: the file order is by offset.
  const std::string h =
      "{" + tensor_json("a_scalar", "I64", "[]", 8, 16) + "," + tensor_json("b_w", "F32", "[2]", 0, 8) + "}";
  auto src = mem(image(h, bytes_of(w, 8) + bytes_of(&s, 8)));
  st::File f = st::File::open(src);
  REQUIRE(f.size() == 2);
  CHECK(f.entries()[0].name == "b_w");
  CHECK(f.entries()[1].name == "a_scalar");
  CHECK(f.header_size() == h.size());
  CHECK(f.data_offset() == 8 + h.size());
  TensorView v = f.view("b_w");
  CHECK(v.shape() == shape_t{2});
  CHECK(v.load<float>(1) == -2.0F);
  CHECK(v.data() == src->data() + 8 + h.size());  // zero copy
  TensorView sc = f.view("a_scalar");
  CHECK(sc.rank() == 0);
  CHECK(sc.load<std::int64_t>(0) == 7);
  CHECK_FALSE(f.raw_metadata().has_value());
  CHECK(f.find("nope") == nullptr);
  CHECK_THROWS_AS((void)f.view("nope"), key_error);
}

TEST_CASE("accepts what the reference accepts: whitespace, {}, null metadata, unknown fields, empty tensors") {
  CHECK(error_of(image("{}")) == 0);
  CHECK(error_of(image("{}      ")) == 0);
  CHECK(error_of(image(" \t\r\n{} \t\r\n")) == 0);  // serde_json skips JSON whitespace on both sides
  CHECK(error_of(image("{\"__metadata__\":null}")) == 0);
  CHECK_FALSE(open_image(image("{\"__metadata__\":null}")).raw_metadata().has_value());
  st::File m = open_image(image("{\"__metadata__\":{}}"));
  REQUIRE(m.raw_metadata().has_value());
  CHECK(m.raw_metadata()->empty());
  // Unknown fields of a tensor are ignored, whatever they hold.
  CHECK(error_of(image("{\"t\":{\"dtype\":\"U8\",\"extra\":{\"x\":[1,2.5,{\"y\":null}],\"x\":true},\"shape\":[1],"
                       "\"data_offsets\":[0,1]}}",
                       "z")) == 0);
  // Zero-size tensors anywhere, several at the same offset.
  const std::string h = "{" + tensor_json("e0", "F32", "[0]", 0, 0) + "," + tensor_json("e1", "I64", "[3,0]", 0, 0) +
                        "," + tensor_json("x", "U8", "[2]", 0, 2) + "," + tensor_json("e2", "BF16", "[0,0,2]", 2, 2) + "}";
  st::File f = open_image(image(h, "ab"));
  CHECK(f.size() == 4);
  CHECK(f.view("e1").numel() == 0);
  CHECK(f.view("x").load<std::uint8_t>(1) == 'b');
}

TEST_CASE("misaligned tensors read correctly: load() and copies work, span<T> refuses") {
  // An odd-length U8 tensor first puts the F32 and F64 data at odd offsets.
  const float f4[3] = {1.0F, -0.5F, 3.25F};
  const double d2[2] = {1e300, -2.5};
  std::string data = "abc" + bytes_of(f4, 12) + bytes_of(d2, 16);
  std::string h = "{" + tensor_json("a", "U8", "[3]", 0, 3) + "," + tensor_json("f", "F32", "[3]", 3, 15) + "," +
                  tensor_json("d", "F64", "[2]", 15, 31) + "}";
  // Pad so that the data section starts 8-aligned in the (page-aligned) mapping: "f" is then
  // certainly misaligned for float, "d" for double.
  while (h.size() % 8) h += ' ';
  for (const auto mode : {read_mode::mmap, read_mode::pread}) {
    const fs::path p = tmp_dir() / "misaligned.safetensors";
    write_all(p, image(h, data));
    st::File file = st::File::open(p, {mode, {}});
    TensorView f = file.view("f");
    CHECK(f.load<float>(0) == 1.0F);
    CHECK(f.load<float>(2) == 3.25F);
    if (mode == read_mode::mmap) {
      REQUIRE(reinterpret_cast<std::uintptr_t>(f.data()) % alignof(float) != 0);
      CHECK_THROWS_AS((void)f.span<float>(), usage_error);
      CHECK_THROWS_AS((void)file.view("d").span<double>(), usage_error);
    }
    Tensor c = contiguous(f);
    CHECK(c.values<float>()[1] == -0.5F);
    TensorView d = file.view("d");
    CHECK(d.load<double>(0) == 1e300);
    Tensor dc = contiguous(d, dtype::F32);
    CHECK(dc.values<float>()[1] == -2.5F);
    CHECK(sha256_hex(d) == sha256_hex(std::span<const std::byte>(reinterpret_cast<const std::byte*>(d2), 16)));
  }
}

TEST_CASE("sha256 streams a tensor's stored bytes in both modes, for every dtype") {
  const fs::path p = tmp_dir() / "hash.safetensors";
  write_all(p, image("{" + tensor_json("q", "F4", "[4]", 0, 2) + "," + tensor_json("w", "F32", "[2]", 2, 10) + "}",
                     "ab" + std::string("\x00\x00\x80\x3f\x00\x00\x00\x40", 8)));
  for (const auto mode : {read_mode::mmap, read_mode::pread}) {
    st::File f = st::File::open(p, {mode, {}});
    CHECK(f.sha256("q") == sha256_hex(std::string_view("ab")));
    CHECK(f.sha256("w") == sha256_hex(f.view("w")));
    CHECK_THROWS_AS((void)f.sha256("nope"), key_error);
  }
}

TEST_CASE("pread mode reads the same bytes as mmap mode") {
  const fs::path p = tmp_dir() / "pread.safetensors";
  std::vector<float> v(1000);
  std::iota(v.begin(), v.end(), 0.0F);
  Tensor t = Tensor::from(v, {10, 100});
  std::vector<st::Input> in{st::Input::of("w", t.view())};
  st::write(p, in);
  st::File a = st::File::open(p);
  st::File b = st::File::open(p, {read_mode::pread, {}});
  CHECK(dynamic_cast<const InputFile&>(*b.source()).mapped() == false);
  CHECK(equal_bytes(a.view("w"), b.view("w")));
  CHECK(equal_bytes(a.view("w"), t.view()));
}

// ---------------------------------------------------------------------------------------------
// One corrupt file per rule, each with its id. Order of checks follows the reference.

TEST_CASE("HeaderTooSmall (302): fewer than 8 bytes") {
  CHECK(error_of("") == 302);
  CHECK(error_of(std::string(7, '\0')) == 302);
}

TEST_CASE("HeaderTooLarge (301): N above the cap, checked before the file length") {
  CHECK(error_of(le64(100'000'001) + "{}") == 301);
  CHECK(error_of(le64(~std::uint64_t{0})) == 301);
  CHECK(error_of(le64(100'000'000) + "{}") == 303);  // at the cap: the length rule applies next
  st::limits lim;
  lim.max_header_bytes = 4;
  CHECK(error_of(image("{}      "), lim) == 301);
  try {
    (void)open_image(le64(200'000'000), {});
    FAIL("expected an error");
  } catch (const limit_error& e) {
    CHECK(std::string(e.what()).find("t.safetensors") != std::string::npos);
  }
}

TEST_CASE("InvalidHeaderLength (303): N runs past the end of the file") {
  CHECK(error_of(le64(3) + "{}") == 303);
  CHECK(error_of(le64(1)) == 303);
}

TEST_CASE("InvalidHeader (304): the header is not UTF-8") {
  CHECK(error_of(image("{\"a\xff\":1}")) == 304);
  CHECK(error_of(image("{\"\xc0\x80\":1}")) == 304);          // overlong NUL
  CHECK(error_of(image("{\"\xed\xa0\x80\":1}")) == 304);      // UTF-16 surrogate
  CHECK(error_of(image("{\"\xf4\x90\x80\x80\":1}")) == 304);  // above U+10FFFF
  CHECK(error_of(image("{}\xe2\x82")) == 304);                 // truncated sequence at the end
  // Valid multi-byte names are fine.
  CHECK(error_of(image("{" + tensor_json("h\xc3\xa9\xe4\xb8\x96\xf0\x9f\x98\x80", "U8", "[1]", 0, 1) + "}", "x")) == 0);
}

TEST_CASE("InvalidHeaderDeserialization, syntax (305)") {
  CHECK(error_of(image("")) == 305);  // N = 0
  CHECK(error_of(image("{\"a\":")) == 305);
  CHECK(error_of(image("{} x")) == 305);
  CHECK(error_of(image(std::string("{}\0\0", 4))) == 305);  // NUL padding is not JSON whitespace
  CHECK(error_of(image("\xef\xbb\xbf{}")) == 305);            // a byte-order mark
  CHECK(error_of(image("{/*c*/}")) == 305);                   // comments
  CHECK(error_of(image("{\"a\":1,}")) == 305);                // trailing comma (syntax wins over schema)
  CHECK(error_of(image("{\"a\":1} x")) == 305);
  CHECK(error_of(image("{\"a\":1,\"b\":" + std::string(200, '[') + "}")) == 307);
  // A number beyond f64, even in an ignored field (serde_json refuses it).
  CHECK(error_of(image("{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"x\":1e400}}", "z")) == 305);
}

TEST_CASE("the header JSON grammar is serde_json's") {
  auto with_field = [](const std::string& value) {
    return image("{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"x\":" + value + "}}", "z");
  };
  // Accepted in an ignored field.
  for (const char* ok : {"0", "-0", "1.5e-3", "-12E+2", "1e308", "1e-400", "18446744073709551616", "-9223372036854775809",
                         "true", "false", "null", "\"\\u0041\\ud83d\\ude00\\/\\b\\f\\n\\r\\t\\\\\\\"\\u0000\"", "[]",
                         "{}", "[[],{},[{}]]", "{\"a\":[1,{\"b\":null}]}", " [ 1 , 2 ] "})
    CHECK_MESSAGE(error_of(with_field(ok)) == 0, ok);
  // Refused.
  for (const char* bad : {"01", "1.", ".5", "-", "+1", "1e", "1e+", "-1e400", "tru", "nul", "falsey", "\"\\x\"",
                          "\"\\ud800\"", "\"\\udc00\"", "\"\\ud800\\u0041\"", "\"\\u12G4\"", "\"abc", "[1 2]", "[1,]",
                          "{\"a\" 1}", "{1:2}", "{\"a\":1,}", "[", "NaN", "Infinity", "'a'", "\"\t\""})
    CHECK_MESSAGE(error_of(with_field(bad)) == 305, bad);
  // Escapes in names decode to UTF-8.
  st::File f = open_image(image("{\"h\\u00e9\\ud83d\\ude00\\u0000\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", "z"));
  CHECK(f.entries()[0].name == std::string("h\xc3\xa9\xf0\x9f\x98\x80\0", 8));
}

TEST_CASE("InvalidHeaderDeserialization, not an object (306)") {
  CHECK(error_of(image("[]")) == 306);
  CHECK(error_of(image("\"x\"")) == 306);
  CHECK(error_of(image("null")) == 306);
  CHECK(error_of(image("  17 ")) == 306);
}

TEST_CASE("JSON nesting limit (307): serde_json's 127 levels") {
  auto nested = [](int arrays) {
    return image("{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"x\":" + std::string(static_cast<std::size_t>(arrays), '[') +
                     std::string(static_cast<std::size_t>(arrays), ']') + "}}",
                 "z");
  };
  CHECK(error_of(nested(125)) == 0);    // 2 objects + 125 arrays = 127 levels
  CHECK(error_of(nested(126)) == 307);  // 128 levels
}

TEST_CASE("duplicate keys (308), which the reference silently resolves") {
  const std::string t = tensor_json("a", "U8", "[1]", 0, 1);
  CHECK(error_of(image("{" + t + "," + t + "}", "x")) == 308);
  CHECK(error_of(image("{\"a\":{\"dtype\":\"U8\",\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", "x")) == 308);
  CHECK(error_of(image("{\"__metadata__\":{},\"__metadata__\":{}}")) == 308);
  CHECK(error_of(image("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}")) == 308);
  try {
    (void)open_image(image("{" + t + "," + t + "}", "x"));
  } catch (const format_error& e) {
    CHECK(std::string(e.what()).find("tensor 'a'") != std::string::npos);
  }
}

TEST_CASE("tensor info schema (309)") {
  CHECK(error_of(image("{\"a\":\"F32\"}")) == 309);
  CHECK(error_of(image("{\"a\":[\"U8\",[1],[0,1]]}", "x")) == 309);  // serde would take a sequence; statedict does not
  CHECK(error_of(image("{\"a\":null}")) == 309);
  CHECK(error_of(image("{\"a\":{\"shape\":[1],\"data_offsets\":[0,1]}}", "x")) == 309);
  CHECK(error_of(image("{\"a\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}", "x")) == 309);
  CHECK(error_of(image("{\"a\":{\"dtype\":\"U8\",\"shape\":[1]}}", "x")) == 309);
  CHECK(error_of(image("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}", "x")) == 309);
  CHECK(error_of(image("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}}", "x")) == 309);
  CHECK(error_of(image("{\"a\":{\"dtype\":8,\"shape\":[1],\"data_offsets\":[0,1]}}", "x")) == 309);
  CHECK(error_of(image("{\"a\":{\"dtype\":\"U8\",\"shape\":1,\"data_offsets\":[0,1]}}", "x")) == 309);
  CHECK(error_of(image("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":{}}}", "x")) == 309);
}

TEST_CASE("unknown dtype (310)") {
  CHECK(error_of(image("{" + tensor_json("a", "F128", "[1]", 0, 1) + "}", "x")) == 310);
  CHECK(error_of(image("{" + tensor_json("a", "f32", "[1]", 0, 4) + "}", "xxxx")) == 310);  // names are case-sensitive
  CHECK(error_of(image("{" + tensor_json("a", "C128", "[1]", 0, 16) + "}", std::string(16, 'x'))) == 310);
}

TEST_CASE("shape elements must be usize (311)") {
  for (const char* shape : {"[-1]", "[1.5]", "[\"2\"]", "[18446744073709551616]", "[-0]", "[[1]]", "[null]", "[1e0]"})
    CHECK_MESSAGE(error_of(image("{" + tensor_json("a", "U8", shape, 0, 1) + "}", "x")) == 311, shape);
}

TEST_CASE("data_offsets elements must be usize (312)") {
  CHECK(error_of(image("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[-1,0]}}", "x")) == 312);
  CHECK(error_of(image("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1.0]}}", "x")) == 312);
  CHECK(error_of(image("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,\"1\"]}}", "x")) == 312);
}

TEST_CASE("__metadata__ must be a map of strings (313)") {
  CHECK(error_of(image("{\"__metadata__\":{\"a\":1}}")) == 313);
  CHECK(error_of(image("{\"__metadata__\":{\"a\":null}}")) == 313);
  CHECK(error_of(image("{\"__metadata__\":{\"a\":{}}}")) == 313);
  CHECK(error_of(image("{\"__metadata__\":[]}")) == 313);
  CHECK(error_of(image("{\"__metadata__\":\"x\"}")) == 313);
  st::File f = open_image(image("{\"__metadata__\":{\"format\":\"pt\",\"b\":\"\\u00e9\\n\"}}"));
  CHECK(f.metadata().at("b") == "\xc3\xa9\n");
}

TEST_CASE("InvalidOffset (314): offsets contiguous from 0") {
  CHECK(error_of(image("{" + tensor_json("a", "U8", "[1]", 1, 2) + "}", "xx")) == 314);  // does not start at 0
  CHECK(error_of(image("{" + tensor_json("a", "U8", "[2]", 0, 2) + "," + tensor_json("b", "U8", "[1]", 3, 4) + "}",
                       "xxxx")) == 314);  // hole
  CHECK(error_of(image("{" + tensor_json("a", "U8", "[2]", 0, 2) + "," + tensor_json("b", "U8", "[2]", 1, 3) + "}",
                       "xxx")) == 314);  // overlap
  CHECK(error_of(image("{" + tensor_json("a", "U8", "[0]", 0, 0) + "," + tensor_json("b", "U8", "[1]", 2, 1) + "}",
                       "x")) == 314);  // end < begin
  try {
    (void)open_image(image("{" + tensor_json("a", "U8", "[1]", 1, 2) + "}", "xx"));
  } catch (const format_error& e) {
    CHECK(std::string(e.what()).find("tensor 'a'") != std::string::npos);
    CHECK(std::string(e.what()).find("t.safetensors") != std::string::npos);
  }
}

TEST_CASE("ValidationOverflow (315): checked element and bit counts") {
  CHECK(error_of(image("{" + tensor_json("a", "U8", "[4294967296,4294967296,2]", 0, 0) + "}")) == 315);
  CHECK(error_of(image("{" + tensor_json("a", "F64", "[2305843009213693952]", 0, 0) + "}")) == 315);  // 2^61 * 64 bits
}

TEST_CASE("MisalignedSlice (316): sub-byte dtypes must fill whole bytes") {
  CHECK(error_of(image("{" + tensor_json("a", "F4", "[3]", 0, 2) + "}", "xx")) == 316);
  CHECK(error_of(image("{" + tensor_json("a", "F6_E2M3", "[2]", 0, 2) + "}", "xx")) == 316);
  CHECK(error_of(image("{" + tensor_json("a", "F4", "[4]", 0, 2) + "}", "xx")) == 0);
}

TEST_CASE("TensorInvalidInfo (317): byte size must match shape and dtype") {
  CHECK(error_of(image("{" + tensor_json("a", "F32", "[2]", 0, 4) + "}", "xxxx")) == 317);
  CHECK(error_of(image("{" + tensor_json("a", "F32", "[]", 0, 8) + "}", "xxxxxxxx")) == 317);
}

TEST_CASE("MetadataIncompleteBuffer (318): the data section is covered exactly") {
  CHECK(error_of(image("{" + tensor_json("a", "U8", "[1]", 0, 1) + "}", "xy")) == 318);  // trailing byte
  CHECK(error_of(image("{" + tensor_json("a", "U8", "[2]", 0, 2) + "}", "x")) == 318);   // missing byte
  CHECK(error_of(image("{}", "x")) == 318);
}

TEST_CASE("statedict limits (319, 320, 321)") {
  st::limits lim;
  lim.max_rank = 4;
  CHECK(error_of(image("{" + tensor_json("a", "U8", "[1,1,1,1,1]", 0, 1) + "}", "x"), lim) == 319);
  CHECK(error_of(image("{" + tensor_json("a", "U8", "[1,1,1,1]", 0, 1) + "}", "x"), lim) == 0);
  lim = {};
  lim.max_tensors = 2;
  CHECK(error_of(image("{" + tensor_json("a", "U8", "[0]", 0, 0) + "," + tensor_json("b", "U8", "[0]", 0, 0) + "," +
                       tensor_json("c", "U8", "[0]", 0, 0) + "}"),
                 lim) == 320);
  CHECK(error_of(image("{" + tensor_json("a", "U8", "[9223372036854775808,0]", 0, 0) + "}")) == 321);
}

TEST_CASE("packed dtypes: F4 / F6 values in elements of 2 / 4; a last dimension that does not split refuses views (322)") {
  // F8_E8M0 is an element of its own; F4 [2, 4] is F4_X2 [2, 2]; F6_E2M3 [8] is F6_E2M3_X4 [2].
  st::File ok = open_image(image("{" + tensor_json("s", "F8_E8M0", "[2]", 0, 2) + "," + tensor_json("q", "F4", "[2,4]", 2, 6) + "," +
                                     tensor_json("h", "F6_E2M3", "[8]", 6, 12) + "}",
                                 "ab" + std::string("cdef") + std::string("ghijkl")));
  CHECK(ok.entries()[0].dtype == dtype::F8_E8M0);
  CHECK(ok.entries()[1].dtype == dtype::F4_X2);
  CHECK(ok.entries()[1].shape == shape_t{2, 2});
  CHECK(ok.entries()[1].file_shape == shape_t{2, 4});
  CHECK(ok.entries()[2].dtype == dtype::F6_E2M3_X4);
  CHECK(ok.entries()[2].shape == shape_t{2});
  CHECK(ok.view("q").nbytes() == 4);
  CHECK(ok.view("h").nbytes() == 6);
  const ShardedCheckpoint ck = ok.describe();
  CHECK(ck.tensors[1].shape == shape_t{2, 2});
  // Valid safetensors (6 four-bit values are 3 bytes), but 3 values per row do not make pairs.
  st::File f = open_image(image("{" + tensor_json("q", "F4", "[2,3]", 0, 3) + "," + tensor_json("w", "U8", "[1]", 3, 4) + "}", "abcd"));
  CHECK(f.size() == 2);
  CHECK(f.entries()[0].dtype_name == "F4");
  CHECK_FALSE(f.entries()[0].dtype.has_value());
  CHECK(f.sha256("q") == sha256_hex(std::string_view("abc")));  // hashed as stored all the same
  try {
    (void)f.view("q");
    FAIL("expected an error");
  } catch (const unsupported_error& e) {
    CHECK(e.id() == 322);
    CHECK(std::string(e.what()).find("multiple of 2") != std::string::npos);
  }
  CHECK_THROWS_AS((void)f.describe(), unsupported_error);
  CHECK(error_of(image("{" + tensor_json("z", "F4", "[]", 0, 0) + "}", "")) == 316);  // one 4-bit value: half a byte
}

TEST_CASE("the writer names packed dtypes as safetensors does and refuses what it cannot hold (330)") {
  auto id_of = [](const auto& f) {
    try {
      f();
    } catch (const error& e) {
      return e.id();
    }
    return 0;
  };
  const st::Layout l = st::layout(std::vector<st::TensorSpec>{{"q", dtype::F4_X2, {2, 3}}}, std::nullopt);
  CHECK(l.header.find("\"dtype\":\"F4\",\"shape\":[2,6]") != std::string::npos);
  const st::Layout l6 = st::layout(std::vector<st::TensorSpec>{{"h", dtype::F6_E3M2_X4, {5}}}, std::nullopt);
  CHECK(l6.header.find("\"dtype\":\"F6_E3M2\",\"shape\":[20]") != std::string::npos);
  CHECK(l6.file_size == l6.data_start() + 15);
  for (const dtype t : {dtype::C32, dtype::BITS16, dtype::C128})
    CHECK(id_of([&] { (void)st::layout(std::vector<st::TensorSpec>{{"x", t, {2}}}, std::nullopt); }) == 330);
  CHECK(id_of([&] { (void)st::layout(std::vector<st::TensorSpec>{{"x", dtype::F4_X2, {}}}, std::nullopt); }) == 330);
  // Written and read back: the same elements.
  const fs::path p = tmp_dir() / "packed.safetensors";
  Tensor t(dtype::F4_X2, {2, 3});
  for (std::size_t i = 0; i < 6; ++i) t.data()[i] = static_cast<std::byte>(0x10 * i + 1);
  st::write(p, std::vector<st::Input>{st::Input::of("q", t.view())});
  const st::File back = st::File::open(p);
  CHECK(back.entries()[0].dtype_name == "F4");
  CHECK(back.entries()[0].file_shape == shape_t{2, 6});
  CHECK(sha256_hex(back.view("q")) == sha256_hex(t.view()));
}

TEST_CASE("statedict metadata is checked (323)") {
  const std::string t = tensor_json("a", "U8", "[1]", 0, 1);
  CHECK(error_of(image("{\"__metadata__\":{\"statedict.aliases\":\"nope\"}," + t + "}", "x")) == 323);
  CHECK(error_of(image("{\"__metadata__\":{\"statedict.aliases\":\"{\\\"b\\\":\\\"zz\\\"}\"}," + t + "}", "x")) == 323);
  CHECK(error_of(image("{\"__metadata__\":{\"statedict.aliases\":\"{\\\"a\\\":\\\"a\\\"}\"}," + t + "}", "x")) == 323);
  CHECK(error_of(image("{\"__metadata__\":{\"statedict.skeleton\":\"[1]\"}," + t + "}", "x")) == 323);
  st::File f = open_image(image("{\"__metadata__\":{\"statedict.aliases\":\"{\\\"b\\\":\\\"a\\\"}\",\"u\":\"v\"}," + t + "}", "x"));
  CHECK(f.metadata().size() == 1);  // the user's only
  CHECK(f.raw_metadata()->size() == 2);
  CHECK(f.view("b").data() == f.view("a").data());
}

TEST_CASE("file-backed errors name the path") {
  const fs::path p = tmp_dir() / "bad.safetensors";
  write_all(p, image("{" + tensor_json("w", "F32", "[2]", 0, 4) + "}", "xxxx"));
  try {
    (void)st::File::open(p);
    FAIL("expected an error");
  } catch (const format_error& e) {
    CHECK(e.id() == 317);
    CHECK(std::string(e.what()).find("bad.safetensors") != std::string::npos);
    CHECK(std::string(e.what()).find("tensor 'w'") != std::string::npos);
  }
  CHECK_THROWS_AS((void)st::File::open(tmp_dir() / "missing.safetensors"), io_error);
}

// ---------------------------------------------------------------------------------------------
// describe / to_flat_dict

TEST_CASE("describe: one source, one whole-box chunk per tensor, user metadata") {
  Tensor a = Tensor::from<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = Tensor::from<std::int64_t>({9}, {});
  const fs::path p = tmp_dir() / "describe.safetensors";
  std::vector<st::Input> in{st::Input::of("a", a.view()), st::Input::of("b", b.view())};
  st::write_options o;
  o.metadata = std::map<std::string, std::string>{{"format", "pt"}};
  st::write(p, in, o);
  st::File f = st::File::open(p);
  ShardedCheckpoint c = f.describe();
  CHECK(c.format == "safetensors");
  REQUIRE(c.sources.size() == 1);
  REQUIRE(c.tensors.size() == 2);
  CHECK(c.tensors[0].name == "b");  // I64 sorts before F32 (dtype descending)
  const TensorInfo* ta = c.find("a");
  REQUIRE(ta);
  CHECK(ta->shape == shape_t{2, 3});
  REQUIRE(ta->chunks.size() == 1);
  CHECK(std::get<Box>(ta->chunks[0].region) == Box{{0, 0}, {2, 3}});
  CHECK(ta->chunks[0].at.byte_offset == f.data_offset() + f.find("a")->begin);
  CHECK(c.skeleton.is_null());
  CHECK(c.metadata == std::map<std::string, std::string>{{"format", "pt"}});
  // Reading back through the description gives the same bytes.
  float got[6];
  c.sources[0]->read(ta->chunks[0].at.byte_offset, std::as_writable_bytes(std::span<float>(got)));
  CHECK(got[5] == 6.0F);
  Value v = f.to_flat_dict();
  CHECK(v.as_dict().size() == 2);
  CHECK(v["a"] == Value(a));
}

// ---------------------------------------------------------------------------------------------
// Writer

TEST_CASE("layout matches the reference writer byte for byte") {
  // The reference's own serialization tests: "attn.0" F32 [1,2,3] gives a 64-byte header with no
  // padding; "attn0" F32 [1,1,2,3] gives 65 bytes of JSON padded with 7 spaces to 72.
  std::vector<st::TensorSpec> s1{{"attn.0", dtype::F32, {1, 2, 3}}};
  st::Layout l1 = st::layout(s1, std::nullopt);
  CHECK(l1.header == le64(64) + "{\"attn.0\":{\"dtype\":\"F32\",\"shape\":[1,2,3],\"data_offsets\":[0,24]}}");
  std::vector<st::TensorSpec> s2{{"attn0", dtype::F32, {1, 1, 2, 3}}};
  st::Layout l2 = st::layout(s2, std::nullopt);
  CHECK(l2.header == le64(72) + "{\"attn0\":{\"dtype\":\"F32\",\"shape\":[1,1,2,3],\"data_offsets\":[0,24]}}       ");
  CHECK(l2.file_size == 8 + 72 + 24);
  // No tensors: "{}" and six spaces; with metadata {"framework": "pt"}: 35 bytes padded to 40.
  CHECK(st::layout({}, std::nullopt).header == le64(8) + "{}      ");
  CHECK(st::layout({}, std::map<std::string, std::string>{{"framework", "pt"}}).header ==
        le64(40) + "{\"__metadata__\":{\"framework\":\"pt\"}}     ");
}

TEST_CASE("layout order: dtype descending in the reference enum, then name bytewise") {
  std::vector<st::TensorSpec> s{{"b", dtype::F32, {1}},  {"a", dtype::F32, {1}},    {"z", dtype::U8, {3}},
                                {"m", dtype::I64, {1}},  {"c", dtype::BF16, {2}},   {"\xc3\x85", dtype::F32, {1}},
                                {"B", dtype::F32, {1}},  {"q", dtype::F8_E4M3, {1}}, {"r", dtype::F8_E5M2, {1}},
                                {"u", dtype::U64, {1}},  {"k", dtype::C64, {1}},    {"f", dtype::F64, {1}}};
  st::Layout l = st::layout(s, std::nullopt);
  std::vector<std::string> order;
  for (const auto& e : l.entries) order.push_back(s[e.index].name);
  CHECK(order == std::vector<std::string>{"u", "m", "f", "k", "B", "a", "b", "\xc3\x85", "c", "q", "r", "z"});
  CHECK(l.entries[0].begin == 0);
  for (std::size_t i = 1; i < l.entries.size(); ++i) CHECK(l.entries[i].begin == l.entries[i - 1].end);
}

TEST_CASE("header strings are escaped as serde_json does") {
  std::vector<st::TensorSpec> s{{std::string("q\"b\\s\x01\x1f\x7f\n\t\b\f\r/\xc3\xa9", 16), dtype::U8, {1}}};
  st::Layout l = st::layout(s, std::map<std::string, std::string>{{"k", "\x02"}});
  const std::string json = l.header.substr(8);
  CHECK(json.find("\"q\\\"b\\\\s\\u0001\\u001f\x7f\\n\\t\\b\\f\\r/\xc3\xa9\"") != std::string::npos);
  CHECK(json.find("{\"__metadata__\":{\"k\":\"\\u0002\"},") == 0);
  // And the reader reads the names back.
  std::string bytes = l.header + "x";
  st::File f = open_image(bytes);
  CHECK(f.entries()[0].name == s[0].name);
  CHECK(f.metadata().at("k") == "\x02");
}

TEST_CASE("layout refuses what safetensors cannot hold") {
  auto id = [](std::vector<st::TensorSpec> s, std::optional<std::map<std::string, std::string>> md = std::nullopt) {
    try {
      (void)st::layout(s, md);
    } catch (const error& e) {
      return e.id();
    }
    return 0;
  };
  CHECK(id({{"c", dtype::C128, {1}}}) == 330);
  CHECK(id({{"a", dtype::U8, {1}}, {"a", dtype::F32, {1}}}) == 331);
  CHECK(id({{"__metadata__", dtype::U8, {1}}}) == 331);
  CHECK(id({{"\xff", dtype::U8, {1}}}) == 331);
  CHECK(id({}, std::map<std::string, std::string>{{"k", "\xff"}}) == 334);
  st::limits lim;
  lim.max_header_bytes = 16;
  CHECK_THROWS_AS((void)st::layout(std::vector<st::TensorSpec>{{"a", dtype::U8, {1}}}, std::nullopt, lim), limit_error);
}

TEST_CASE("write round-trips every storable dtype, strided and misaligned views, through small buffers") {
  std::vector<Tensor> ts;
  std::vector<st::Input> in;
  int k = 0;
  for (dtype t : {dtype::BOOL, dtype::U8, dtype::I8, dtype::I16, dtype::U16, dtype::I32, dtype::U32, dtype::I64,
                  dtype::U64, dtype::F16, dtype::BF16, dtype::F32, dtype::F64, dtype::F8_E4M3, dtype::F8_E5M2, dtype::C64}) {
    Tensor x(t, {3, 5});
    for (std::uint64_t i = 0; i < x.nbytes(); ++i) x.data()[i] = static_cast<std::byte>((i * 7 + static_cast<std::uint64_t>(k)) & (t == dtype::BOOL ? 1 : 0xff));
    ts.push_back(x);
    in.push_back(st::Input::of("t" + std::to_string(k++), x.view()));
  }
  // A strided view (a column slice) and a misaligned one.
  Tensor big = Tensor::from<float>(std::vector<float>(40, 0.0F), {5, 8});
  for (int i = 0; i < 40; ++i) big.values<float>()[static_cast<std::size_t>(i)] = static_cast<float>(i) * 0.5F;
  TensorView cols = big.view().narrow(1, 2, 3);
  in.push_back(st::Input::of("strided", cols));
  std::vector<std::byte> raw(1 + 16);
  const float fv[4] = {1, 2, 3, 4};
  std::memcpy(raw.data() + 1, fv, 16);
  in.push_back(st::Input::of("misaligned", TensorView::contiguous(dtype::F32, {4}, raw.data() + 1)));
  const fs::path p = tmp_dir() / "roundtrip.safetensors";
  st::write_options o;
  o.exec.max_block = 64 << 10;  // the smallest block
  st::write_result r = st::write(p, in, o);
  CHECK(fs::file_size(p) == r.layout.file_size);
  st::File f = st::File::open(p);
  CHECK(f.size() == in.size());
  for (const auto& i : in) CHECK_MESSAGE(equal_bytes(f.view(i.name), i.view), i.name);
}

TEST_CASE("write casts floating tensors only, exactly as cast_run does") {
  Tensor w = Tensor::from<float>({1.0F, 0.1F, -3.3e38F, 65520.0F}, {4});
  Tensor h = Tensor::from<double>({0.1, -2.0}, {2});
  Tensor steps = Tensor::from<std::int64_t>({5}, {1});
  std::vector<st::Input> in{st::Input::of("w", w.view()), st::Input::of("h", h.view()), st::Input::of("step", steps.view())};
  const fs::path p = tmp_dir() / "cast.safetensors";
  st::write_options o;
  o.cast = dtype::BF16;
  o.exec.max_block = 64 << 10;
  st::write(p, in, o);
  st::File f = st::File::open(p);
  CHECK(f.find("w")->dtype == dtype::BF16);
  CHECK(f.find("h")->dtype == dtype::BF16);
  CHECK(f.find("step")->dtype == dtype::I64);
  CHECK(equal_bytes(f.view("w"), contiguous(w.view(), dtype::BF16).view()));
  CHECK(equal_bytes(f.view("h"), contiguous(h.view(), dtype::BF16).view()));
  CHECK(equal_bytes(f.view("step"), steps.view()));
  o.cast = dtype::I32;
  CHECK_THROWS_AS(st::write(tmp_dir() / "cast-int.safetensors", in, o), usage_error);
}

TEST_CASE("write streams from byte sources (mapped, pread, memory) with and without casts") {
  std::vector<float> v(3000);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) / 7.0F;
  Tensor t = Tensor::from(v, {3000});
  const fs::path src_path = tmp_dir() / "source.safetensors";
  st::write(src_path, std::vector<st::Input>{st::Input::of("x", t.view())});
  for (const auto mode : {read_mode::mmap, read_mode::pread}) {
    for (const bool cfr : {true, false}) {
      for (const auto cast : {std::optional<dtype>{}, std::optional<dtype>{dtype::F16}}) {
        st::File src = st::File::open(src_path, {mode, {}});
        std::vector<st::Input> in = st::inputs_of(src.describe());
        st::write_options o;
        o.cast = cast;
        o.exec.copy_file_range = cfr;
        o.exec.copy_file_range_min = 1;
        o.exec.max_block = 64 << 10;
        const fs::path out = tmp_dir() / "copy.safetensors";
        st::write(out, in, o);
        st::File f = st::File::open(out);
        CHECK(equal_bytes(f.view("x"), contiguous(t.view(), cast).view()));
        if (!cast) CHECK(read_all(out) == read_all(src_path));
      }
    }
  }
}

TEST_CASE("tied tensors are written once and come back as views of the same data") {
  Tensor emb = Tensor::from<float>({1, 2, 3, 4}, {2, 2});
  Tensor other = Tensor::from<float>({5, 6}, {2});
  std::vector<st::Input> in{st::Input::of("model.embed.weight", emb.view()), st::Input::of("lm_head.weight", emb.view()),
                            st::Input::of("b", other.view())};
  const fs::path p = tmp_dir() / "tied.safetensors";
  st::write_options o;
  o.metadata = std::map<std::string, std::string>{{"format", "pt"}};
  st::write_result r = st::write(p, in, o);
  CHECK(r.specs.size() == 2);
  REQUIRE(r.aliases.size() == 1);
  CHECK(r.aliases[0] == std::pair<std::string, std::string>{"lm_head.weight", "model.embed.weight"});
  st::File f = st::File::open(p);
  CHECK(f.size() == 2);
  CHECK(f.metadata() == std::map<std::string, std::string>{{"format", "pt"}});
  CHECK(f.raw_metadata()->at("statedict.aliases") == "{\"lm_head.weight\":\"model.embed.weight\"}");
  CHECK(f.view("lm_head.weight").data() == f.view("model.embed.weight").data());
  Value d = f.to_flat_dict();
  CHECK(d.as_dict().size() == 3);
  CHECK(d["lm_head.weight"].as_tensor().data() == d["model.embed.weight"].as_tensor().data());
  // describe() lists stored tensors and a flat skeleton with the alias node, so ties survive.
  ShardedCheckpoint c = f.describe();
  CHECK(c.tensors.size() == 2);
  CHECK_FALSE(c.find("lm_head.weight"));
  REQUIRE_FALSE(c.skeleton.is_null());
  NamedTensors nt;
  for (const auto& e : f.entries()) nt.emplace_back(e.name, f.view(e));
  const Value u = unflatten(nt, c.skeleton);
  CHECK(u == d);
  CHECK(u["lm_head.weight"].as_tensor().data() == u["model.embed.weight"].as_tensor().data());
  // The same view under the same name twice is a caller error; reserved metadata keys too.
  o.metadata = std::map<std::string, std::string>{{"statedict.aliases", "{}"}};
  CHECK_THROWS_AS(st::write(tmp_dir() / "bad.safetensors", in, o), usage_error);
  // Dedupe off: both written.
  st::write_options o2;
  o2.dedupe_views = false;
  st::write(p, in, o2);
  CHECK(st::File::open(p).size() == 3);
}

TEST_CASE("a skeleton goes into __metadata__ and comes back unchanged") {
  Tensor a = Tensor::from<float>({1}, {1});
  nlohmann::json sk = {{"statedict_skeleton", 1}, {"root", {{"dict", nlohmann::json::array({"x"})}}}};
  st::write_options o;
  o.skeleton = sk;
  o.metadata = std::map<std::string, std::string>{{"note", "kept"}};
  const fs::path p = tmp_dir() / "skeleton.safetensors";
  st::write(p, std::vector<st::Input>{st::Input::of("x", a.view())}, o);
  st::File f = st::File::open(p);
  CHECK(f.skeleton() == sk);
  CHECK(f.metadata() == std::map<std::string, std::string>{{"note", "kept"}});
  CHECK(f.describe().skeleton == sk);
}

TEST_CASE("a failed write leaves no file behind") {
  Tensor a = Tensor::from<float>({1, 2}, {2});
  auto small = MemorySource::copy_of("small", std::as_bytes(std::span<const float>(a.values<float>())));
  // The source holds 8 bytes but the input claims 16: the error surfaces mid-stream.
  std::vector<st::Input> in{st::Input::from_source("x", dtype::F32, {4}, small, 0)};
  const fs::path p = tmp_dir() / "failed.safetensors";
  fs::remove(p);
  CHECK_THROWS_AS(st::write(p, in), format_error);
  CHECK_FALSE(fs::exists(p));
  for (const auto& e : fs::directory_iterator(tmp_dir()))
    CHECK_MESSAGE(e.path().filename().string().find(".failed.safetensors.statedict-") == std::string::npos, e.path());
}

// ---------------------------------------------------------------------------------------------
// Whole states (core/flatten.hpp)

namespace {
/// A training checkpoint: model with tied embeddings, optimizer with int keys, scalars, strings.
Value training_state(std::vector<Tensor>& keep) {
  keep.push_back(Tensor::from<float>({1, 2, 3, 4, 5, 6}, {3, 2}));
  keep.push_back(Tensor::from<float>({0.5F, -0.5F}, {2}));
  keep.push_back(Tensor::from<float>({0.1F, 0.2F, 0.3F, 0.4F, 0.5F, 0.6F}, {3, 2}));
  keep.push_back(Tensor::from<std::int64_t>({42}, {}));
  Dict model;
  model.insert("embed.weight", keep[0]);
  model.insert("norm.bias", keep[1]);
  model.insert("lm_head.weight", keep[0]);  // tied
  Dict st0;
  st0.insert("step", keep[3]);
  st0.insert("exp_avg", keep[2]);
  Dict state;
  state.insert(0, Value(std::move(st0)));
  Dict group;
  group.insert("lr", 1e-3);
  group.insert("betas", Value::tuple({0.9, 0.95}));
  group.insert("params", Value::list({0, 1}));
  Dict optim;
  optim.insert("state", Value(std::move(state)));
  optim.insert("param_groups", Value::list({Value(std::move(group))}));
  Dict root;
  root.insert("model", Value(std::move(model)));
  root.insert("optim", Value(std::move(optim)));
  root.insert("epoch", 5);
  root.insert("run", "baseline \xce\xb1");
  root.insert("note", Value());
  return Value(std::move(root));
}
}  // namespace

TEST_CASE("a full nested state round-trips through one file, ties and user metadata intact") {
  std::vector<Tensor> keep;
  const Value state = training_state(keep);
  const fs::path p = tmp_dir() / "state.safetensors";
  st::write_options o;
  o.metadata = std::map<std::string, std::string>{{"format", "pt"}};
  st::write_result r = st::write_state(p, state, o);
  CHECK(r.specs.size() == 4);  // the tied head is not stored twice
  st::File f = st::File::open(p);
  CHECK(f.metadata() == std::map<std::string, std::string>{{"format", "pt"}});
  CHECK_FALSE(f.skeleton().is_null());
  CHECK(f.describe().skeleton == f.skeleton());
  for (const auto mode : {read_mode::mmap, read_mode::pread}) {
    const Value back = st::read_state(st::File::open(p, {mode, {}}));
    CHECK(back == state);
    if (mode == read_mode::mmap)
      CHECK(back["model"]["lm_head.weight"].as_tensor().data() == back["model"]["embed.weight"].as_tensor().data());
  }
  // The file is still a valid plain safetensors file for any other reader.
  CHECK(f.size() == 4);
}

TEST_CASE("a cast state keeps a consistent skeleton; integer tensors are untouched") {
  std::vector<Tensor> keep;
  const Value state = training_state(keep);
  const fs::path p = tmp_dir() / "state-bf16.safetensors";
  st::write_options o;
  o.cast = dtype::BF16;
  st::write_state(p, state, o);
  const Value back = st::read_state(st::File::open(p));
  CHECK(back["model"]["embed.weight"].as_tensor().dtype() == dtype::BF16);
  CHECK(equal_bytes(back["model"]["embed.weight"].as_tensor(), contiguous(keep[0].view(), dtype::BF16).view()));
  CHECK(back["optim"]["state"][0]["step"].as_tensor().dtype() == dtype::I64);
  CHECK(back["optim"]["param_groups"].at(0)["lr"] == Value(1e-3));
  CHECK(back["run"] == Value("baseline \xce\xb1"));
}

TEST_CASE("a plain dict is written as a plain file and reads back as a flat dict") {
  Tensor a = Tensor::from<float>({1, 2}, {2});
  Tensor b = Tensor::from<std::int32_t>({3}, {1});
  Dict d;
  d.insert("b", b);
  d.insert("a", a);
  d.insert("a_tied", a);
  const fs::path p = tmp_dir() / "plain.safetensors";
  st::write_state(p, Value(d));
  st::File f = st::File::open(p);
  CHECK(f.skeleton().is_null());
  CHECK(f.aliases().size() == 1);
  const Value back = st::read_state(f);
  CHECK(back.as_dict().size() == 3);
  CHECK(back["a_tied"] == Value(a));
  CHECK(back["b"] == Value(b));
  // A file from another writer (no statedict metadata) is a flat dict in file order.
  st::write_options o;
  o.dedupe_views = false;
  st::write(p, std::vector<st::Input>{st::Input::of("z", a.view()), st::Input::of("y", a.view())}, o);
  const Value plain = st::read_state(st::File::open(p));
  CHECK(plain.as_dict().items()[0].first == Key("y"));
}
