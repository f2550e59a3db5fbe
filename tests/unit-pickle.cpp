// Unit tests: the safe unpickler (every opcode, every limit, the allow-list) and the pickler.
#include <doctest/doctest.h>

#include <statedict/io/pickle_read.hpp>
#include <statedict/io/pickle_write.hpp>

#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

using namespace statedict;

namespace {

/// A string literal with embedded NULs, whole.
std::string operator""_b(const char* s, std::size_t n) { return std::string(s, n); }

std::span<const std::byte> bytes(std::string_view s) { return {reinterpret_cast<const std::byte*>(s.data()), s.size()}; }

std::string unhex(std::string_view h) {
  std::string s;
  for (std::size_t i = 0; i + 1 < h.size(); i += 2) s += static_cast<char>(std::stoi(std::string(h.substr(i, 2)), nullptr, 16));
  return s;
}

std::string hex(const std::vector<std::byte>& v) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (std::byte b : v) {
    s += d[std::to_integer<unsigned>(b) >> 4];
    s += d[std::to_integer<unsigned>(b) & 15];
  }
  return s;
}

pickle::Result run(std::string_view p, const pickle::options& o = {}) { return pickle::load(bytes(p), o); }
Value val(std::string_view p, const pickle::options& o = {}) { return run(p, o).value; }

pickle::options keep() {
  pickle::options o;
  o.keep_unknown_objects = true;
  return o;
}

/// torch.load(weights_only=True)'s behaviour: globals beyond its list refused.
pickle::options strict() {
  pickle::options o;
  o.keep_unknown_objects = false;
  return o;
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

void expect_error_p(std::string_view p, const error_id& id, const pickle::options& o = {}) {
  expect_error([&] { (void)run(p, o); }, id);
}

std::string u32(std::uint32_t v) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}
std::string u64(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}
std::string binunicode(std::string_view s) { return "X" + u32(static_cast<std::uint32_t>(s.size())) + std::string(s); }
std::string global(std::string_view m, std::string_view n) { return "c" + std::string(m) + "\n" + std::string(n) + "\n"; }

const std::string P2 = "\x80\x02";

}  // namespace

TEST_CASE("constants and integers") {
  CHECK(val(P2 + "N.").is_none());
  CHECK(val(P2 + "\x88.").as_bool());
  CHECK_FALSE(val(P2 + "\x89.").as_bool());
  CHECK(val("I01\n.").as_bool());
  CHECK_FALSE(val("I00\n.").as_bool());
  CHECK(val(P2 + "K\xff.").as_int() == 255);
  CHECK(val(P2 + "M\x01\x02.").as_int() == 0x201);
  CHECK(val(P2 + "J\xff\xff\xff\xff.").as_int() == -1);
  CHECK(val(P2 + "I-42\n.").as_int() == -42);
  CHECK(val(P2 + "L123L\n.").as_int() == 123);
  CHECK(val(P2 + std::string("\x8a\x00", 2) + ".").as_int() == 0);
  CHECK(val(P2 + std::string("\x8a\x05\x00\x00\x00\x80\x00", 7) + ".").as_int() == 2147483648LL);
  CHECK(val(P2 + std::string("\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80", 10) + ".").as_int() == INT64_MIN);
  // Non-minimal encodings of small values are still ints.
  CHECK(val(P2 + std::string("\x8a\x0a\xfe\xff\xff\xff\xff\xff\xff\xff\xff\xff", 12) + ".").as_int() == -2);
  // 2**64: beyond int64, an Object builtins.int with the minimal little-endian bytes.
  const Value big = val(P2 + std::string("\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01", 11) + ".");
  REQUIRE(big.is_object());
  CHECK(big.as_object().qualified() == "builtins.int");
  CHECK(big.as_object().args.at(0).as_bytes().data == std::vector<std::uint8_t>{0, 0, 0, 0, 0, 0, 0, 0, 1});
  const Value big4 = val(P2 + "\x8b" + u32(9) + std::string("\x00\x00\x00\x00\x00\x00\x00\x00\xff", 9) + ".");
  CHECK(big4.as_object().args.at(0).as_bytes().data == std::vector<std::uint8_t>{0, 0, 0, 0, 0, 0, 0, 0, 0xff});
  expect_error_p(P2 + "\x8b\xff\xff\xff\xff.", errors::pk_bad_operand);
  expect_error_p("Ixyz\n.", errors::pk_bad_text);
  // Text integers beyond int64 (protocols 0 and 1: torch's legacy magic number) are big ints too.
  const Value magic = val("L119547037146038801333356L\n.");
  REQUIRE(magic.is_object());
  CHECK(magic.as_object().qualified() == "builtins.int");
  CHECK(magic.as_object().args.at(0).as_bytes().data ==
        std::vector<std::uint8_t>{0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19});
  CHECK(val("I99999999999999999999999\n.").as_object().args.at(0).as_bytes().data ==
        std::vector<std::uint8_t>{255, 255, 127, 246, 74, 225, 199, 2, 45, 21});
  CHECK(val("L-18446744073709551616\n.").as_object().args.at(0).as_bytes().data ==
        std::vector<std::uint8_t>{0, 0, 0, 0, 0, 0, 0, 0, 0xff});
  // -2^63 - 1 and 2^63: just beyond int64 either way; -2^63 itself is an int.
  CHECK(val("L-9223372036854775808L\n.").as_int() == INT64_MIN);
  CHECK(val("L9223372036854775808L\n.").as_object().args.at(0).as_bytes().data ==
        std::vector<std::uint8_t>{0, 0, 0, 0, 0, 0, 0, 0x80, 0});
  expect_error_p("L12345678901234567890x\n.", errors::pk_bad_text);
  expect_error_p("L-\n.", errors::pk_bad_text);
  pickle::options small;
  small.limits.max_long_bytes = 8;
  expect_error_p("L119547037146038801333356L\n.", errors::pk_long_limit, small);
  expect_error_p("L" + std::string(40, '9') + "\n.", errors::pk_long_limit, small);
}

TEST_CASE("floats: BINFLOAT is big-endian, bits are kept") {
  CHECK(val(P2 + "G\x3f\xf8\x00\x00\x00\x00\x00\x00."_b).as_double() == 1.5);
  const double nan = val(P2 + "G\x7f\xf8\x00\x00\x00\x00\x00\x01."_b).as_double();
  CHECK(std::isnan(nan));
  CHECK(std::bit_cast<std::uint64_t>(nan) == 0x7ff8000000000001ULL);
  CHECK(std::signbit(val(P2 + "G\x80\x00\x00\x00\x00\x00\x00\x00."_b).as_double()));
  CHECK(val("F0.25\n.").as_double() == 0.25);
  expect_error_p("F1.2.3\n.", errors::pk_bad_text);
}

TEST_CASE("strings and bytes") {
  CHECK(val(P2 + binunicode("h\xc3\xa9") + ".").as_string() == "h\xc3\xa9");
  CHECK(val("\x80\x04\x8c\x02hi.").as_string() == "hi");
  CHECK(val("\x80\x04\x8d" + u64(2) + "hi.").as_string() == "hi");
  CHECK(val("\x80\x03" "C\x02\x00\xff."_b).as_bytes().data == std::vector<std::uint8_t>{0, 0xff});
  CHECK(val("\x80\x03" "B" + u32(1) + "z.").as_bytes().data == std::vector<std::uint8_t>{'z'});
  CHECK(val("\x80\x04\x8e" + u64(1) + "z.").as_bytes().data == std::vector<std::uint8_t>{'z'});
  // Python 2 str: text when it decodes as UTF-8 (torch.load's encoding='utf-8'), bytes otherwise.
  CHECK(val(P2 + "U\x03" "abc.").as_string() == "abc");
  CHECK(val(P2 + "U\x01\xff.").as_bytes().data == std::vector<std::uint8_t>{0xff});
  CHECK(val(P2 + "T" + u32(2) + "ok.").as_string() == "ok");
  // Surrogates pass (Python's surrogatepass); invalid UTF-8 does not.
  CHECK(val(P2 + binunicode("\xed\xa0\x80") + ".").as_string() == "\xed\xa0\x80");
  expect_error_p(P2 + binunicode("\xc0\x80") + ".", errors::pk_bad_utf8);
  expect_error_p(P2 + binunicode("\xff") + ".", errors::pk_bad_utf8);
  expect_error_p(P2 + binunicode("\xf4\x90\x80\x80") + ".", errors::pk_bad_utf8);
  // GLOBAL and INST name lines are decoded strictly (Python's unpicklers: errors='strict'), so a
  // corrupt class name is an error, not an unknown class kept as data; surrogates too.
  CHECK(val(P2 + "cmym\xc3\xa9" "dule\nThing\n)\x81.", keep()).as_object().module == "mym\xc3\xa9" "dule");
  expect_error([&] { (void)val(P2 + "cmym\xff" "dule\nThing\n)\x81.", keep()); }, errors::pk_bad_utf8);
  expect_error([&] { (void)val(P2 + "cmymodule\nTh\xed\xa0\x80ing\n)\x81.", keep()); }, errors::pk_bad_utf8);
  expect_error([&] { (void)val(P2 + "(imym\xc0\x80" "dule\nThing\n.", keep()); }, errors::pk_bad_utf8);
  // A name its module does not have, in the modules whose pickled names are a closed set: a
  // corrupt pickle (Python cannot load it), not an unknown class kept as data.
  expect_error([&] { (void)val(P2 + "ctorch._utils\n_rebuild_tenor_v2\n)R.", keep()); }, errors::pk_no_such_name);
  expect_error([&] { (void)val(P2 + "ccollections\nObderedDict\n)R.", keep()); }, errors::pk_no_such_name);
  expect_error([&] { (void)val(P2 + "c_codecs\nencoded\n)R.", keep()); }, errors::pk_no_such_name);
  CHECK(val(P2 + "ccollections\nOrderedDict\n)R.").is_dict());
  CHECK(val(P2 + "cUserDict\nIterableUserDict\n)\x81.", keep()).is_object());  // Python 2's name, mapped by Python
  const Value ba = val("\x80\x05\x96" + u64(2) + "ab.");
  CHECK(ba.as_object().qualified() == "builtins.bytearray");
  CHECK(ba.as_object().args.at(0).as_bytes().data == std::vector<std::uint8_t>{'a', 'b'});
  // A length beyond the input is a truncation, never an allocation.
  expect_error_p(P2 + "X\xe8\x03\x00\x00" "abc."_b, errors::pk_truncated);
  expect_error_p("\x80\x04\x8d" + u64(~0ULL) + ".", errors::pk_string_limit);
  expect_error_p(P2 + "T\xff\xff\xff\xff.", errors::pk_bad_operand);
}

TEST_CASE("protocol 0 text: STRING (quoted, escaped) and UNICODE (raw-unicode-escape)") {
  // STRING: Python 2's repr of a str; escape_decode'd; str when UTF-8 (torch.load's encoding).
  CHECK(val("S'abc'\n.").as_string() == "abc");
  CHECK(val("S\"it's\"\n.").as_string() == "it's");
  CHECK(val("S'a\\'b\\\\c\\n\\t\\x41\\101\\0'\n.").as_string() == "a'b\\c\n\tAA"_b + std::string(1, '\0'));
  CHECK(val("S'\\xff\\x00'\n.").as_bytes().data == std::vector<std::uint8_t>{0xff, 0});
  CHECK(val("S'\\q'\n.").as_string() == "\\q");       // unknown escapes stay as they are
  CHECK(val("S'\\777'\n.").as_bytes().data == std::vector<std::uint8_t>{0xff});  // octal: the low 8 bits
  CHECK(val("S'\xc3\xa9'\n.").as_string() == "\xc3\xa9");  // raw UTF-8 bytes in the literal
  CHECK(val("S''\n.").as_string().empty());
  expect_error_p("Sabc\n.", errors::pk_bad_text);
  expect_error_p("S'abc\"\n.", errors::pk_bad_text);
  expect_error_p("S'\n.", errors::pk_bad_text);
  expect_error_p("S'\\x4'\n.", errors::pk_bad_text);
  expect_error_p("S'\\'\n.", errors::pk_bad_text);  // the closing quote is escaped: trailing backslash
  expect_error_p("S'abc'", errors::pk_truncated);
  // UNICODE: bytes are code points (latin-1), \uXXXX and \UXXXXXXXX after an odd run of backslashes.
  CHECK(val("Vabc\n.").as_string() == "abc");
  CHECK(val("V\\u00e9t\\u00e9\n.").as_string() == "\xc3\xa9t\xc3\xa9");
  CHECK(val("V\xe9\n.").as_string() == "\xc3\xa9");
  CHECK(val("V\\U0001f600\n.").as_string() == "\xf0\x9f\x98\x80");
  CHECK(val("V\\\\u0041\n.").as_string() == "\\\\u0041");  // an even run: no escape
  CHECK(val("V\\\\\\u0041\n.").as_string() == "\\\\A");
  CHECK(val("V\\ud800\n.").as_string() == "\xed\xa0\x80");  // a lone surrogate, as Python keeps it
  CHECK(val("Va\\b\n.").as_string() == "a\\b");
  expect_error_p("V\\u12\n.", errors::pk_bad_text);
  expect_error_p("V\\u12zz\n.", errors::pk_bad_text);
  expect_error_p("V\\U00110000\n.", errors::pk_bad_text);
  // Decoded strings are dict keys like any other (protocol 0 dicts: MARK DICT, SETITEM).
  const Value d = val("(dp0\nV\\u00e9\np1\nI1\nsVplain\np2\nS'x\\ty'\np3\ns.");
  CHECK(d.as_dict().at("\xc3\xa9").as_int() == 1);
  CHECK(d.as_dict().at("plain").as_string() == "x\ty");
  pickle::options o;
  o.limits.max_string_bytes = 3;
  expect_error_p("V\xe9\xe9\n.", errors::pk_string_limit, o);  // 4 bytes once decoded
  expect_error_p("S'abcd'\n.", errors::pk_string_limit, o);
}

TEST_CASE("containers, marks and stack operations") {
  const Value t = val(P2 + "K\x01K\x02K\x03\x87.");
  REQUIRE(t.is_tuple());
  CHECK(t.as_list().size() == 3);
  CHECK(val(P2 + "K\x01\x85.").as_list().size() == 1);
  CHECK(val(P2 + "K\x01K\x02\x86.").as_list().size() == 2);
  CHECK(val(P2 + ").").is_tuple());
  CHECK(val(P2 + "(K\x01K\x02K\x03K\x04t.").as_list().size() == 4);
  CHECK(val(P2 + "(K\x01l.").is_list());
  const Value d = val(P2 + "(" + binunicode("a") + "K\x01K\x07K\x02" "d.");
  CHECK(d.as_dict().at("a").as_int() == 1);
  CHECK(d.as_dict().at(7).as_int() == 2);
  const Value l = val(P2 + "]K\x01" "a(K\x02K\x03" "e.");
  CHECK(l.as_list().size() == 3);
  const Value dd = val(P2 + "}" + binunicode("k") + "K\x01s(" + binunicode("m") + "K\x02" + binunicode("k") + "K\x03u.");
  // Setting an existing key replaces its value and keeps its position (Python's dict).
  REQUIRE(dd.as_dict().size() == 2);
  CHECK(dd.as_dict().items()[0].first == Key("k"));
  CHECK(dd.as_dict().at("k").as_int() == 3);
  // Sets (protocol 4): EMPTY_SET + ADDITEMS, FROZENSET.
  const Value s = val("\x80\x04\x8f(K\x01K\x02\x90.");
  CHECK(s.as_object().qualified() == "builtins.set");
  CHECK(s.as_object().items.size() == 2);
  const Value fs = val("\x80\x04(K\x01\x91.");
  CHECK(fs.as_object().qualified() == "builtins.frozenset");
  // POP, POP_MARK, DUP
  CHECK(val(P2 + "K\x01K\x02" "0.").as_int() == 1);
  CHECK(val(P2 + "K\x01(K\x02K\x03" "1.").as_int() == 1);
  CHECK(val(P2 + "K\x05" "2\x86.").as_list().at(1).as_int() == 5);
  CHECK(val(P2 + "K\x01(0.").as_int() == 1);  // POP of an empty mark pops the mark
  // Errors
  expect_error_p(P2 + ".", errors::pk_stack_underflow);
  expect_error_p(P2 + "K\x01(\x85.", errors::pk_stack_underflow);  // items below a MARK are not visible
  expect_error_p(P2 + "K\x01t.", errors::pk_no_mark);
  expect_error_p(P2 + "(K\x01" "d.", errors::pk_bad_operand);
  expect_error_p(P2 + "K\x01K\x02" "a.", errors::pk_bad_operand);
  expect_error_p(P2 + "K\x01K\x02K\x03s.", errors::pk_bad_operand);
  expect_error_p(P2 + "](K\x01\x90.", errors::pk_bad_operand);
  expect_error_p(P2 + "}(K\x01u.", errors::pk_bad_operand);
  expect_error_p(P2 + "K\x01", errors::pk_truncated);
  expect_error_p(P2 + "M\x01", errors::pk_truncated);
  expect_error_p("", errors::pk_truncated);
}

TEST_CASE("lists grown in turns, with tuples made between the appends, keep every item in order") {
  // Two lists memoized empty, then filled alternately: APPEND of a tuple to one, an APPENDS batch
  // of tuples to the other, so each list grows while the other's items and new tuples are stored
  // after it. Both must read back whole and in order.
  std::string p = P2 + "]q\x00]q\x01"_b;
  std::vector<std::int64_t> want_a, want_b;
  for (int round = 0; round < 60; ++round) {
    const auto n = static_cast<char>(round);
    p += "h\x00"_b + "K" + n + "K\x01\x86" + "a0";  // a.append((n, 1))
    want_a.push_back(round);
    p += "h\x01(";
    for (int j = 0; j < round % 5; ++j) p += "K"_b + n + "K" + static_cast<char>(j) + "\x86";
    p += "e0";  // b.extend([(n, 0), (n, 1), ...])
    for (int j = 0; j < round % 5; ++j) want_b.push_back(round * 10 + j);
  }
  p += "h\x00h\x01\x86."_b;
  const Value v = val(p);
  REQUIRE(v.is_tuple());
  const List& a = v.at(0).as_list();
  const List& b = v.at(1).as_list();
  REQUIRE(a.size() == want_a.size());
  REQUIRE(b.size() == want_b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].at(0).as_int() == want_a[i]);
    CHECK(a[i].at(1).as_int() == 1);
  }
  for (std::size_t i = 0; i < b.size(); ++i) {
    CHECK(b[i].at(0).as_int() * 10 + b[i].at(1).as_int() == want_b[i]);
  }
}

TEST_CASE("memo: PUT/GET in every form, shared containers see later mutation") {
  CHECK(val(P2 + "K\x07q\x03" "0h\x03.").as_int() == 7);
  CHECK(val(P2 + "K\x07r" + u32(70000) + "0j" + u32(70000) + ".").as_int() == 7);
  CHECK(val("\x80\x04K\x07\x94K\x08\x94" "0" "0h\x01.").as_int() == 8);
  CHECK(val("K\x07p12\n0g12\n.").as_int() == 7);
  // A list memoized empty, referenced twice, filled afterwards: both references see the items.
  const Value v = val(P2 + "]q\x00h\x00\x86q\x01h\x00K\x01"_b "a0.");
  REQUIRE(v.is_tuple());
  CHECK(v.at(0).as_list().size() == 1);
  CHECK(v.at(1).as_list().size() == 1);
  // Ids far beyond the input are stored sparsely.
  CHECK(val(P2 + "K\x07r\xff\xff\xff\x7f" "0j\xff\xff\xff\x7f.").as_int() == 7);
  expect_error_p(P2 + "h\x05.", errors::pk_bad_memo);
  expect_error_p(P2 + "q\x00."_b, errors::pk_stack_underflow);
  expect_error_p("K\x01px\n.", errors::pk_bad_text);
}

TEST_CASE("protocols, frames and opcodes that are refused") {
  for (char p : {'\x02', '\x03', '\x04', '\x05'}) CHECK(val(std::string("\x80") + p + "K\x01.").as_int() == 1);
  expect_error_p("\x80\x06K\x01.", errors::pk_bad_protocol);
  CHECK(val("\x80\x04\x95" + u64(3) + "K\x01.").as_int() == 1);
  expect_error_p("\x80\x04\x95" + u64(1000) + "K\x01.", errors::pk_truncated);
  CHECK(run("\x80\x04\x95" + u64(3) + "K\x01.").protocol == 4);
  const std::vector<std::string> refused{"\x97", "\x98", std::string("\x82\x01", 2),
                                        std::string("\x83\x01\x00", 3), std::string("\x84\x01\x00\x00\x00", 5)};
  for (const std::string& op : refused)
    expect_error_p(P2 + op + ".", errors::pk_unsupported_opcode);
  expect_error_p(P2 + "\xff.", errors::pk_unknown_opcode);
  expect_error_p(P2 + "z.", errors::pk_unknown_opcode);
  // STOP ends the pickle; the rest is not read (torch's legacy format concatenates pickles).
  const auto r = run(P2 + "K\x01.garbage");
  CHECK(r.consumed == 5);
}

TEST_CASE("allow-listed globals become plain values") {
  // OrderedDict() -> Dict, filled later
  const Value od = val(P2 + global("collections", "OrderedDict") + ")R(" + binunicode("a") + "K\x01u.");
  CHECK(od.as_dict().at("a").as_int() == 1);
  const Value od2 = val(P2 + global("collections", "OrderedDict") + "]" + binunicode("x") + "K\x02\x86" "a\x85R.");
  CHECK(od2.as_dict().at("x").as_int() == 2);
  // bytes: _codecs.encode(latin-1 str, 'latin1'); empty bytes via __builtin__.bytes()
  const Value b = val(P2 + global("_codecs", "encode") + binunicode("\x00\xc3\xbf"_b) + binunicode("latin1") + "\x86R.");
  CHECK(b.as_bytes().data == std::vector<std::uint8_t>{0, 0xff});
  CHECK(val(P2 + global("__builtin__", "bytes") + ")R.").as_bytes().data.empty());
  expect_error_p(P2 + global("_codecs", "encode") + binunicode("\xe4\xb8\x96") + binunicode("latin1") + "\x86R.", errors::pk_bad_call);
  expect_error_p(P2 + global("_codecs", "encode") + binunicode("a") + binunicode("rot13") + "\x86R.", errors::pk_bad_call);
  // torch.Size -> tuple of ints
  const Value sz = val(P2 + global("torch", "Size") + "K\x02K\x03\x86\x85R.");
  CHECK(sz.is_tuple());
  CHECK(sz.at(1).as_int() == 3);
  // set / frozenset / bytearray / complex (protocol 2 forms)
  const Value st = val(P2 + global("__builtin__", "set") + "]K\x01" "a\x85R.");
  CHECK(st.as_object().qualified() == "builtins.set");
  CHECK(st.as_object().items.size() == 1);
  const Value cx = val(P2 + global("__builtin__", "complex") + "G\x3f\xf0\x00\x00\x00\x00\x00\x00G\x40\x00\x00\x00\x00\x00\x00\x00\x86R."_b);
  CHECK(cx.as_object().qualified() == "builtins.complex");
  CHECK(cx.as_object().how == object_build::reduce);
  CHECK(cx.as_object().args.at(1).as_double() == 2.0);
  // A dtype global referenced: Object(how=global); torch.device('cpu'): Object(how=reduce)
  const Value dt = val(P2 + global("torch", "bfloat16") + ".");
  CHECK(dt.as_object().how == object_build::global);
  CHECK(dt.as_object().qualified() == "torch.bfloat16");
  const Value dev = val(P2 + global("torch", "device") + binunicode("cpu") + "\x85R.");
  CHECK(dev.as_object().args.at(0).as_string() == "cpu");
  // STACK_GLOBAL (protocol 4)
  CHECK(val("\x80\x04\x8c\x05torch\x8c\x07" "float32\x93.").as_object().name == "float32");
  expect_error_p("\x80\x04K\x01K\x02\x93.", errors::pk_bad_operand);
}

TEST_CASE("BUILD on an OrderedDict: attributes reported by path") {
  // {"sd": OrderedDict(w=1) with _metadata = {"": {"version": 1}}}
  const std::string sd = global("collections", "OrderedDict") + ")R" + binunicode("w") + "K\x01s}" + binunicode("_metadata") +
                         "}" + binunicode("") + "}" + binunicode("version") + "K\x01sss" "b";
  const auto r = run(P2 + "}" + binunicode("sd") + sd + "s.");
  CHECK(r.value.as_dict().at("sd").as_dict().at("w").as_int() == 1);
  REQUIRE(r.attributes.size() == 1);
  CHECK(r.attributes[0].path == Path{Key("sd")});
  CHECK(r.attributes[0].attributes.at("_metadata").as_dict().at("").as_dict().at("version").as_int() == 1);
  // Under an object (inside call arguments) the dict keeps its attributes as an OrderedDict object.
  const Value kept = val(P2 + global("m", "C") + sd + "\x85R.", keep());
  const Object& inner = kept.as_object().args.at(0).as_object();
  CHECK(inner.qualified() == "collections.OrderedDict");
  CHECK(inner.state.size() == 1);
  CHECK(inner.items.size() == 1);
  // BUILD with None changes nothing; BUILD on a plain dict or a list is an error.
  CHECK(run(P2 + global("collections", "OrderedDict") + ")RNb.").attributes.empty());
  expect_error_p(P2 + "}}b.", errors::pk_bad_operand);
  expect_error_p(P2 + "]}b.", errors::pk_bad_operand);
}

TEST_CASE("dicts with keys other than int and str") {
  const Value d = val(P2 + "}(K\x01K\x02\x86" + binunicode("v") + "\x88K\x03u.");
  REQUIRE(d.is_object());
  CHECK(d.as_object().qualified() == "builtins.dict");
  REQUIRE(d.as_object().items.size() == 2);
  CHECK(d.as_object().items[0].at(0).is_tuple());
  CHECK(d.as_object().items[1].at(0).is_bool());
  const Value od = val(P2 + global("collections", "OrderedDict") + ")RG\x3f\xf0\x00\x00\x00\x00\x00\x00K\x01s."_b);
  CHECK(od.as_object().qualified() == "collections.OrderedDict");
}

TEST_CASE("security: unknown globals are refused, or kept as data; code-running modules always refused") {
  const std::string call_system = P2 + global("posix", "system") + binunicode("touch /tmp/x") + "\x85R.";
  expect_error([&] { (void)run(call_system); }, errors::pk_blocked_module);
  expect_error([&] { (void)run(call_system, keep()); }, errors::pk_blocked_module);
  for (auto [m, n] : {std::pair{"os", "system"}, {"nt", "system"}, {"subprocess", "Popen"}, {"builtins", "eval"},
                      {"__builtin__", "exec"}, {"builtins", "__import__"}, {"os.path", "join"}, {"sys", "modules"}}) {
    expect_error_p(P2 + global(m, n) + ".", errors::pk_blocked_module, keep());
  }
  try {
    (void)run(P2 + global("mymodule", "MyClass") + ")R.", strict());
    FAIL("expected a security error");
  } catch (const security_error& e) {
    CHECK(e.code() == errors::pk_forbidden_global);
    CHECK(std::string(e.what()).find("'mymodule.MyClass'") != std::string::npos);
  }
  // Kept: REDUCE, NEWOBJ, BUILD, APPENDS and SETITEMS all land in the Object, nothing runs.
  const Value o = val(P2 + global("mymodule", "MyClass") + "K\x01\x85R}" + binunicode("a") + "K\x02sb(K\x03K\x04" "e.", keep());
  const Object& ob = o.as_object();
  CHECK(ob.qualified() == "mymodule.MyClass");
  CHECK(ob.how == object_build::reduce);
  CHECK(ob.args.size() == 1);
  CHECK(ob.state.at(0).as_dict().at("a").as_int() == 2);
  CHECK(ob.items.size() == 2);
  const Value n = val(P2 + global("mymodule", "Data") + ")\x81}b.", keep());
  CHECK(n.as_object().how == object_build::newobj);
  const Value ni = val("\x80\x04" + global("mymodule", "Data") + ")}\x92.", keep());
  CHECK(ni.as_object().how == object_build::newobj);
  expect_error_p("\x80\x04" + global("mymodule", "Data") + ")}K\x01K\x02s\x92.", errors::pk_unsupported_opcode, keep());
  const Value dictlike = val(P2 + global("collections", "defaultdict") + ")R(K\x01K\x02u.", keep());
  CHECK(dictlike.as_object().items.at(0).is_tuple());
  // INST and OBJ (protocol 0/1 instance creation) go through the same checks.
  expect_error_p("(K\x01imymodule\nC\n.", errors::pk_forbidden_global, strict());
  CHECK(val("(K\x01imymodule\nC\n.", keep()).as_object().args.size() == 1);
  CHECK(val("(" + global("mymodule", "C") + "K\x01o.", keep()).as_object().args.size() == 1);
  expect_error_p("(o.", errors::pk_stack_underflow, keep());
  // REDUCE of something that is not a global, or with non-tuple args.
  expect_error_p(P2 + "K\x01)R.", errors::pk_bad_operand);
  expect_error_p(P2 + global("torch", "device") + "K\x01R.", errors::pk_bad_operand);
  expect_error_p(P2 + "c\nx\n.", errors::pk_bad_operand);
}

TEST_CASE("nested classes: getattr(Outer, 'Inner') called is the global Outer.Inner, still checked") {
  // What Python writes for ShardedTensor.ProcessGroupState (torch 1.13 ShardedTensor.__reduce_ex__).
  const std::string inner = P2 + global("__builtin__", "getattr") + global("mymodule", "Outer") + binunicode("Inner") +
                            "\x86R)\x81.";
  const Value v = val(inner, keep());
  CHECK(v.as_object().qualified() == "mymodule.Outer.Inner");
  CHECK(v.as_object().how == object_build::newobj);
  expect_error_p(inner, errors::pk_forbidden_global, strict());
  // The inner name must be a plain identifier.
  expect_error_p(P2 + global("__builtin__", "getattr") + global("mymodule", "Outer") + binunicode("a.b") +
                     "\x86R)\x81.",
                 errors::pk_bad_operand, keep());
  // getattr of something other than (global, str) cannot be called.
  expect_error_p(P2 + global("__builtin__", "getattr") + "K\x01" + binunicode("x") + "\x86R)\x81.",
                 errors::pk_bad_operand, keep());
}

TEST_CASE("persistent ids go to the caller's loader") {
  pickle::options o;
  std::vector<Value> seen;
  o.persistent_load = [&](const Value& pid) -> Value {
    seen.push_back(pid);
    return Value(42);
  };
  CHECK(val(P2 + "(" + binunicode("storage") + "K\x01tQ.", o).as_int() == 42);
  CHECK(seen.at(0).at(0).as_string() == "storage");
  CHECK(val("Pabc\n.", o).as_int() == 42);
  CHECK(seen.at(1).as_string() == "abc");
  expect_error_p(P2 + "K\x01Q.", errors::pk_no_persistent_load);
}

TEST_CASE("limits: each cap has its own error") {
  SUBCASE("depth") {
    std::string deep = P2;
    for (int i = 0; i < 50; ++i) deep += "]";
    for (int i = 0; i < 49; ++i) deep += "a";
    deep += ".";
    pickle::options o;
    o.limits.max_depth = 20;
    expect_error_p(deep, errors::pk_depth_limit, o);
    CHECK(val(deep).is_list());
    std::string marks = P2 + std::string(30, '(') + "N.";
    expect_error_p(marks, errors::pk_depth_limit, o);
  }
  SUBCASE("depth: results of calls nested inside calls") {
    // set((set((... set(([],)) ...),)),): each call's result is a leaf holding the previous one.
    // The leaves' own height counts where they land (it did not: a chain n calls long read as a
    // tree n levels deep whatever max_depth said, and copying it recursed n frames deep).
    auto chain = [](int n) {
      std::string p = P2 + global("__builtin__", "set") + "q\x00" "0]q\x01" "0"_b;
      for (int i = 0; i < n; ++i)
        p += "h\x00h"_b + std::string(1, static_cast<char>(i + 1)) + "\x85\x85Rq"_b + std::string(1, static_cast<char>(i + 2)) + "0";
      return p + "h" + std::string(1, static_cast<char>(n + 1)) + ".";
    };
    pickle::options o;
    o.limits.max_depth = 20;
    const Value ok = val(chain(19), o);  // 19 nested sets around an empty list: 20 levels
    CHECK(ok.as_object().items.at(0).is_object());
    expect_error_p(chain(20), errors::pk_depth_limit, o);
    expect_error_p(chain(100), errors::pk_depth_limit, o);
  }
  SUBCASE("memo") {
    pickle::options o;
    o.limits.max_memo = 2;
    expect_error_p(P2 + "Nq\x00q\x01q\x02."_b, errors::pk_memo_limit, o);
    expect_error_p("\x80\x04N\x94\x94\x94.", errors::pk_memo_limit, o);
    // Ids below one already stored (room the memo grew into) count as well.
    expect_error_p(P2 + "Nq\x05q\x00q\x01."_b, errors::pk_memo_limit, o);
    o.limits.max_memo = 3;
    CHECK(val(P2 + "Nq\x05q\x00q\x01q\x01."_b, o).is_none());
  }
  SUBCASE("nodes: a billion laughs of memo references") {
    std::string p = P2 + "]q\x00"_b;
    for (int i = 1; i < 40; ++i) p += "h" + std::string(1, static_cast<char>(i - 1)) + "h" + std::string(1, static_cast<char>(i - 1)) + "\x86q" + std::string(1, static_cast<char>(i));
    p += ".";
    // 2^40 values; the default cap (8 Mi values) stops it the same way, after building 8 times
    // as many values as this one (a minute under the sanitizers).
    pickle::options o;
    o.limits.max_nodes = std::uint64_t{1} << 20;
    expect_error_p(p, errors::pk_node_limit, o);
  }
  SUBCASE("nodes: a large persistent value referenced many times") {
    // The loader's answer is a leaf of 1,001 values; 200 references to it through two shared
    // lists make 200,000+ values, each copy counted in full (found by fuzzing: the copies were
    // counted as one value each and a 2 KB pickle ran for minutes).
    pickle::options o;
    o.limits.max_nodes = 100000;
    o.persistent_load = [](const Value&) {
      List l;
      for (int i = 0; i < 1000; ++i) l.emplace_back(i);
      return Value::list(std::move(l));
    };
    std::string refs;
    for (int i = 0; i < 10; ++i) refs += "h\x00"_b;
    std::string p = P2 + "K\x01Qq\x00" "0("_b + refs + "lq\x01" "0("_b;  // pid 1 -> memo 0; [10 x memo 0] -> memo 1
    for (int i = 0; i < 20; ++i) p += "h\x01";
    p += "l.";  // [20 x memo 1]: 200 copies of the 1,001-value leaf
    expect_error_p(p, errors::pk_node_limit, o);
    o.limits.max_nodes = 300000;
    const Value v = val(p, o);
    CHECK(v.as_list().size() == 20);
    CHECK(v.at(19).at(9).as_list().size() == 1000);
  }
  SUBCASE("stack") {
    pickle::options o;
    o.limits.max_stack = 10;
    expect_error_p(P2 + std::string(20, 'N') + ".", errors::pk_stack_limit, o);
    // Exactly at the limit is fine, one more is not; also past the first growth of the stack.
    CHECK(val(P2 + "(" + std::string(10, 'N') + "l.", o).as_list().size() == 10);
    expect_error_p(P2 + "(" + std::string(11, 'N') + "l.", errors::pk_stack_limit, o);
    o.limits.max_stack = 1000;
    CHECK(val(P2 + "(" + std::string(1000, 'N') + "l.", o).as_list().size() == 1000);
    expect_error_p(P2 + "(" + std::string(1001, 'N') + "l.", errors::pk_stack_limit, o);
    o.limits.max_stack = 0;
    expect_error_p(P2 + "N.", errors::pk_stack_limit, o);
  }
  SUBCASE("strings") {
    pickle::options o;
    o.limits.max_string_bytes = 3;
    expect_error_p(P2 + binunicode("abcd") + ".", errors::pk_string_limit, o);
    expect_error_p("\x80\x03" "C\x04" "abcd.", errors::pk_string_limit, o);
    expect_error_p(P2 + "U\x04" "abcd.", errors::pk_string_limit, o);
  }
  SUBCASE("longs") {
    pickle::options o;
    o.limits.max_long_bytes = 4;
    expect_error_p(P2 + "\x8a\x05" + std::string(5, '\x01') + ".", errors::pk_long_limit, o);
  }
  SUBCASE("a list that contains itself") {
    expect_error_p(P2 + "]q\x00h\x00"_b "a.", errors::pk_recursive);
  }
}

TEST_CASE("writer: bytes identical to Python's pickler (protocol 2)") {
  {
    Dict d;
    d.set("a", Value::list({1, 2.5, nullptr, true, false, "x", Bytes{{0, 0xff}}, Value::tuple({1, 2}), Value::tuple({1, 2, 3, 4}),
                            -1, std::int64_t{1} << 40, 300, 70000, -2147483648LL, 2147483648LL, INT64_MIN}));
    d.set(3, "x");
    d.set("e", Dict{});
    d.set("l", Value::list());
    d.set("t", Value::tuple());
    d.set("b", Bytes{});
    d.set("u", "h\xc3\xa9\xf0\x9f\x98\x80");
    CHECK(hex(pickle::dumps(Value(d))) == "80027d71002858010000006171015d7102284b014740040000000000004e88895801000000787103635f636f646563730a656e636f64650a7104580300000000c3bf710558060000006c6174696e3171068671075271084b014b02867109284b014b024b034b0474710a4affffffff8a060000000000014d2c014a701101004a000000808a0500000080008a080000000000000080654b036803580100000065710b7d710c58010000006c710d5d710e580100000074710f295801000000627110635f5f6275696c74696e5f5f0a62797465730a7111295271125801000000757113580700000068c3a9f09f98807114752e");
  }
  {
    // Values read from Python's own pickle of [2**64, -2**70, 2**63] write back identically.
    const std::string py = unhex("80025d7100288a090000000000000000018a090000000000000000c08a09000000000000008000652e");
    CHECK(hex(pickle::dumps(val(py))) == "80025d7100288a090000000000000000018a090000000000000000c08a09000000000000008000652e");
    const std::string sets = unhex("80025d710028635f5f6275696c74696e5f5f0a7365740a71015d71024b0161857103527104635f5f6275696c74696e5f5f0a66726f7a656e7365740a71055d71064b0261857107527108635f5f6275696c74696e5f5f0a6279746561727261790a7109635f636f646563730a656e636f64650a710a58020000006162710b58060000006c6174696e31710c86710d52710e85710f527110635f5f6275696c74696e5f5f0a636f6d706c65780a7111473ff0000000000000474000000000000000867112527113652e");
    CHECK(hex(pickle::dumps(val(sets))) == "80025d710028635f5f6275696c74696e5f5f0a7365740a71015d71024b0161857103527104635f5f6275696c74696e5f5f0a66726f7a656e7365740a71055d71064b0261857107527108635f5f6275696c74696e5f5f0a6279746561727261790a7109635f636f646563730a656e636f64650a710a58020000006162710b58060000006c6174696e31710c86710d52710e85710f527110635f5f6275696c74696e5f5f0a636f6d706c65780a7111473ff0000000000000474000000000000000867112527113652e");
  }
  {
    List l;
    for (int i = 0; i <= 1000; ++i) l.emplace_back(i);
    const std::string h = hex(pickle::dumps(Value::list(l)));
    CHECK(h.substr(h.size() - 14) == "65284de80365" "2e");  // the trailing batch of one is MARK ... APPENDS
    Dict d;
    for (int i = 0; i <= 1000; ++i) d.set(i, i);
    const std::string hd = hex(pickle::dumps(Value(d)));
    CHECK(hd.substr(hd.size() - 20) == "75284de8034de80375" "2e");
    Dict one;
    one.set("k", Value::list({"v"}));
    CHECK(hex(pickle::dumps(Value(one))) == "80027d710058010000006b71015d7102580100000076710361732e");
  }
}

TEST_CASE("writer -> reader round trip, objects and attributes included") {
  Object reduced{"mymodule", "Config", object_build::reduce, {1, "a"}, {}, {}};
  reduced.state.emplace_back(Dict{{"x", 1}});
  reduced.state.emplace_back(Value::tuple({nullptr, Dict{{"slot", 2}}}));
  Object newobj{"mymodule", "Data", object_build::newobj, {}, {}, {}};
  newobj.items = {1, 2, 3};
  Object dictlike{"collections", "defaultdict", object_build::reduce, {}, {}, {}};
  dictlike.items = {Value::tuple({1, 2}), Value::tuple({"k", Value::list()})};
  Object odd_keys{"builtins", "dict", object_build::reduce, {}, {}, {}};
  odd_keys.items = {Value::tuple({Value::tuple({1, 2}), 3})};
  Object big{"builtins", "int", object_build::reduce, {Bytes{{0, 0, 0, 0, 0, 0, 0, 0, 1}}}, {}, {}};
  Object dtype{"torch", "float16", object_build::global, {}, {}, {}};
  Object fset{"builtins", "frozenset", object_build::reduce, {}, {}, {1, 2}};
  Object barr{"builtins", "bytearray", object_build::reduce, {Bytes{{1, 2, 255}}}, {}, {}};
  Dict inner{{"w", 1.5}};
  Dict root{{"objs", Value::list({reduced, newobj, dictlike, odd_keys, big, dtype, fset, barr})},
            {"nested", Value::tuple({inner, Dict{}})},
            {"s", "repeated"},
            {"s2", "repeated"},
            {-5, Value::list({Bytes{}, Bytes{{'a'}}})}};
  std::vector<pickle::Attributes> attrs{{Path{}, Dict{{"_metadata", Dict{{"", Dict{{"version", 1}}}}}}},
                                        {Path{Key("nested"), Key(0)}, Dict{{"note", "inner"}}}};
  const auto bytes = pickle::dumps(Value(root), &attrs);
  const auto r = pickle::load(bytes, keep());
  CHECK(r.value == Value(root));
  CHECK(r.attributes == attrs);
  CHECK(pickle::load(bytes).value == Value(root));  // objects are data by default
  // Without keep_unknown_objects, mymodule is refused; the rest is on the allow-list.
  expect_error([&] { (void)pickle::load(bytes, strict()); }, errors::pk_forbidden_global);
}

TEST_CASE("writer: errors") {
  expect_error([] { (void)pickle::dumps(Value("\xff")); }, errors::pk_write_utf8);
  expect_error([] { (void)pickle::dumps(Value(Tensor::from<float>({1.F}, {1}))); }, errors::pk_unwritable);
  Value deep = Value::list();
  for (int i = 0; i < 1200; ++i) deep = Value::list({deep});
  expect_error([&] { (void)pickle::dumps(deep); }, errors::pk_write_depth);
  Object bad{"torch", "float32", object_build::global, {1}, {}, {}};
  expect_error([&] { (void)pickle::dumps(Value(bad)); }, errors::pk_unwritable);
}

TEST_CASE("writer: a global whose name holds a newline is refused, not written as a broken GLOBAL") {
  // Found by fuzz-pickle-roundtrip: STACK_GLOBAL of module "a\nb", name "c", kept as an unknown
  // object, was written as "ca\nb\nc\n", which reads back as another global and desynchronises.
  const Value v = val("\x80\x04\x8c\x03" "a\nb\x94\x8c\x01" "c\x94\x93\x94."_b, keep());
  REQUIRE(v.is_object());
  CHECK(v.as_object().module == "a\nb");
  expect_error([&] { (void)pickle::dumps(v); }, errors::pk_unwritable);
  const Value called = val("\x80\x04\x8c\x01" "a\x8c\x03" "b\nc\x93)R."_b, keep());
  expect_error([&] { (void)pickle::dumps(called); }, errors::pk_unwritable);
}

TEST_CASE("writer: the classes dict, OrderedDict, set and frozenset themselves stay globals; sets take no BUILD") {
  // Found by fuzz-pickle-roundtrip: a bare GLOBAL collections.OrderedDict (the class, not called)
  // was written as OrderedDict() and read back as an empty dict.
  for (const char* name : {"OrderedDict", "dict", "set", "frozenset"}) {
    const std::string module = std::string(name) == "OrderedDict" ? "collections" : "__builtin__";
    const Value v = val(P2 + "]" + global(module, name) + "a.", keep());
    REQUIRE(v.at(0).is_object());
    CHECK(v.at(0).as_object().how == object_build::global);
    const auto r = pickle::load(pickle::dumps(v), keep());
    CHECK_MESSAGE(r.value == v, name);
  }
  // Found by the same target: a BUILD on an EMPTY_SET was kept as the set's state, which the writer
  // could only write as set() + BUILD, a pickle that then did not load. Python refuses it too.
  expect_error_p("\x80\x04\x8f}b."_b, errors::pk_bad_operand, keep());
  expect_error_p("\x80\x04(\x91}b."_b, errors::pk_bad_operand, keep());
}

TEST_CASE("a dict key set twice keeps its first place and its last value; the replaced value leaves nothing") {
  // Found by fuzz-torch-roundtrip: {"model": OrderedDict with _metadata, ..., "model": 3} reported
  // the replaced OrderedDict's attributes at path "model", which by then held the int 3.
  const std::string od = global("collections", "OrderedDict") + ")R" + binunicode("w") + "K\x01s}" + binunicode("_metadata") +
                         "}sb";
  const auto r = run(P2 + "}(" + binunicode("model") + od + binunicode("loss") + "K\x02" + binunicode("model") + "K\x03u.");
  REQUIRE(r.value.as_dict().size() == 2);
  CHECK(r.value.as_dict().items()[0].first == Key("model"));
  CHECK(r.value.as_dict().items()[0].second.as_int() == 3);
  CHECK(r.value.as_dict().items()[1].second.as_int() == 2);
  CHECK(r.attributes.empty());
  // Replaced the other way round, the attributes are those of the dict that stays.
  const auto k = run(P2 + "}(" + binunicode("model") + "K\x03" + binunicode("model") + od + "u.");
  REQUIRE(k.attributes.size() == 1);
  CHECK(k.attributes[0].path == Path{Key("model")});
}

TEST_CASE("a value the result holds in several places is whole in each") {
  // The result's conversion moves a registered function's value out of the reader when one path
  // reaches it, and copies it otherwise: every way of reaching a value twice must copy.
  const std::string leaf = global("_codecs", "encode") + "(" + binunicode("ab") + binunicode("latin1") + "tR";
  const Value ab(Bytes{{'a', 'b'}});
  SUBCASE("through the memo") {
    const Value v = val(P2 + leaf + "q\x00h\x00\x86."_b);
    CHECK(v == Value::tuple({ab, ab}));
  }
  SUBCASE("through DUP") {
    const Value v = val(P2 + leaf + "2\x86.");
    CHECK(v == Value::tuple({ab, ab}));
  }
  SUBCASE("in a container reached twice") {
    const Value v = val(P2 + "}q\x02" + binunicode("k") + leaf + "sh\x02\x86.");
    CHECK(v == Value::tuple({Value(Dict{{"k", ab}}), Value(Dict{{"k", ab}})}));
  }
  SUBCASE("in an OrderedDict made from pairs, and in the list of those pairs") {
    const std::string pairs = "]q\x01" + binunicode("k") + leaf + "\x86" "a";
    const Value v = val(P2 + global("collections", "OrderedDict") + pairs + "\x85R" + "h\x01\x86.");
    CHECK(v == Value::tuple({Value(Dict{{"k", ab}}), Value::list({Value::tuple({"k", ab})})}));
  }
  SUBCASE("once: moved, and whole") {
    const Value v = val(P2 + "(" + leaf + leaf + "l.");
    CHECK(v == Value::list({ab, ab}));
  }
}

TEST_CASE("a registry extending the shared one: its own rules first, then the base's; the base unchanged") {
  const pickle::Registry& base = pickle::Registry::shared();
  CHECK(&base == &pickle::Registry::shared());
  pickle::Registry ext(&base);
  CHECK(ext.size() == base.size());
  ext.function("mod.f", [](pickle::Call& c) -> Value { return Value(static_cast<std::int64_t>(c.args.size())); });
  ext.function("_codecs.encode", [](pickle::Call&) -> Value { return Value("mine"); });  // overrides the base's
  CHECK(ext.size() == base.size() + 2);
  CHECK(base.find("mod.f") == nullptr);
  pickle::options o = strict();
  o.registry = &ext;
  // mod.f(1, 2), an OrderedDict (a base rule) and _codecs.encode (overridden) in one pickle.
  const std::string p = P2 + global("mod", "f") + "K\x01K\x02\x86R" + global("collections", "OrderedDict") + ")R" +
                        global("_codecs", "encode") + binunicode("a") + binunicode("latin1") + "\x86R\x87.";
  const Value v = val(p, o);
  REQUIRE(v.is_tuple());
  CHECK(v.as_list().at(0) == Value(std::int64_t{2}));
  CHECK(v.as_list().at(1).is_dict());
  CHECK(v.as_list().at(2) == Value("mine"));
  // The base alone still encodes, and does not know mod.f.
  o.registry = &base;
  CHECK(val(P2 + global("_codecs", "encode") + binunicode("a") + binunicode("latin1") + "\x86R.", o).is_bytes());
  expect_error_p(P2 + global("mod", "f") + ")R.", errors::pk_forbidden_global, o);
}

TEST_CASE("fast forms: tried first, handed over on nullopt, their errors placed like the general path's") {
  pickle::Registry reg = pickle::Registry::weights_only();
  int fast_calls = 0, slow_calls = 0;
  reg.function(
      "torch._utils._rebuild_tensor_v2",
      [&](pickle::Call& c) -> Value {
        ++slow_calls;
        return Value(static_cast<std::int64_t>(c.args.size()));
      },
      [&](const pickle::Args& a) -> std::optional<Value> {
        using k = pickle::Args::kind;
        if (a.size() != 4 || a.kind_of(0) != k::integer || a.kind_of(1) != k::str || a.kind_of(2) != k::global) return std::nullopt;
        ++fast_calls;
        shape_t dims;
        if (!a.ints(3, 3, dims)) throw_error(errors::pk_bad_call, "not ints");
        const auto [module, name] = a.global(2);
        return Value(std::string(a.str(1)) + ":" + std::string(module) + "." + std::string(name) + ":" + std::to_string(a.integer(0)) +
                     ":" + to_string(dims));
      });
  pickle::options o;
  o.registry = &reg;
  const std::string f = global("torch._utils", "_rebuild_tensor_v2");
  const std::string g = global("torch", "float32");
  CHECK(val(P2 + f + "(K\x05" + binunicode("s") + g + "(K\x01K\x02ttR.", o).as_string() == "s:torch.float32:5:[1, 2]");
  CHECK(fast_calls == 1);
  CHECK(slow_calls == 0);
  CHECK(val(P2 + f + "(\x88" + binunicode("s") + g + "(K\x01ttR.", o).as_int() == 4);  // a bool, not an int
  CHECK(slow_calls == 1);
  CHECK(val(P2 + f + "(K\x05" + binunicode("s") + g + "tR.", o).as_int() == 3);
  CHECK(slow_calls == 2);
  try {
    (void)val(P2 + f + "(K\x05" + binunicode("s") + g + "(K\x01K\x01K\x01K\x01ttR.", o);
    FAIL("expected an error");
  } catch (const error& e) {
    CHECK(e.code() == errors::pk_bad_call);
    CHECK(std::string(e.what()).find("pickle offset") != std::string::npos);
  }
  // A persistent id's fast form sees the id's items; a non-tuple id goes to persistent_load.
  o.persistent_load = [](const Value&) { return Value(1); };
  o.persistent_fast = [](const pickle::Args& a) -> std::optional<Value> {
    if (a.size() != 2 || a.kind_of(0) != pickle::Args::kind::bytes) return std::nullopt;
    return Value(std::string(a.str(0)));
  };
  CHECK(val(P2 + "(C\x03xyzK\x01tQ.", o).as_string() == "xyz");
  CHECK(val(P2 + "(K\x01K\x01tQ.", o).as_int() == 1);
  CHECK(val(P2 + "K\x01Q.", o).as_int() == 1);
  // A fast form that reads an argument as what it is not, or past the end, gets an error.
  o.persistent_fast = [](const pickle::Args& a) -> std::optional<Value> { return Value(std::string(a.str(0))); };
  expect_error_p(P2 + "(K\x01tQ.", errors::pk_bad_call, o);
  o.persistent_fast = [](const pickle::Args& a) -> std::optional<Value> { return Value(a.value(0)); };
  expect_error_p(P2 + "(K\x01tQ.", errors::pk_bad_call, o);
  o.persistent_fast = [](const pickle::Args& a) -> std::optional<Value> { return Value(a.integer(1)); };
  expect_error_p(P2 + "(K\x01tQ.", errors::pk_bad_call, o);
  o.persistent_fast = [](const pickle::Args& a) -> std::optional<Value> { return Value(std::string(a.global(0).first)); };
  expect_error_p(P2 + "(" + binunicode("x") + "tQ.", errors::pk_bad_call, o);
}

TEST_CASE("persistent handles: read as they are by fast forms, made Values anywhere else, counted as leaves") {
  pickle::Registry reg = pickle::Registry::weights_only();
  int slow_calls = 0;
  reg.function(
      "torch._utils._rebuild_tensor_v2",
      [&](pickle::Call& c) -> Value {
        ++slow_calls;
        return Value("slow:" + c.args.at(0).as_string());
      },
      [](const pickle::Args& a) -> std::optional<Value> {
        if (a.size() != 1 || a.kind_of(0) != pickle::Args::kind::handle) return std::nullopt;
        return Value("fast:" + std::to_string(a.handle(0)));
      });
  pickle::options o;
  o.registry = &reg;
  int values_made = 0;
  // ('h', n) becomes handle n; anything else goes on to persistent_load.
  o.persistent_handle = [](const pickle::Args& a) -> std::optional<std::uint64_t> {
    using k = pickle::Args::kind;
    if (a.size() != 2 || a.kind_of(0) != k::str || a.str(0) != "h" || a.kind_of(1) != k::integer) return std::nullopt;
    return static_cast<std::uint64_t>(a.integer(1)) + (std::uint64_t{1} << 40);  // all 64 bits are the caller's
  };
  o.handle_value = [&](std::uint64_t h) {
    ++values_made;
    return Value("value:" + std::to_string(h - (std::uint64_t{1} << 40)));
  };
  o.persistent_load = [](const Value& pid) { return Value("loaded:" + std::to_string(pid.as_list().size())); };
  const std::string f = global("torch._utils", "_rebuild_tensor_v2");
  const std::string h7 = "(" + binunicode("h") + "K\x07tQ";
  // The fast form sees the handle itself; no Value is made for it.
  CHECK(val(P2 + f + "(" + h7 + "tR.", o).as_string() == "fast:" + std::to_string((std::uint64_t{1} << 40) + 7));
  CHECK(values_made == 0);
  // Bare, through the memo, and as an argument the fast form declines: a Value each time.
  CHECK(val(P2 + h7 + "q\x00h\x00\x86."_b, o) == Value::tuple({"value:7", "value:7"}));
  CHECK(values_made == 2);
  CHECK(val(P2 + f + "(" + h7 + "K\x01tR.", o).as_string() == "slow:value:7");
  CHECK(slow_calls == 1);
  CHECK(values_made == 3);
  // Declined ids take the other ways.
  CHECK(val(P2 + "(" + binunicode("x") + "K\x07tQ.", o).as_string() == "loaded:2");
  // A handle with nothing to turn it into a Value is an error, not a silent None.
  o.handle_value = nullptr;
  expect_error_p(P2 + h7 + ".", errors::pk_no_persistent_load, o);
  // Each Value made from a handle counts against the node limit, as a leaf copied there does.
  o.handle_value = [](std::uint64_t) { return Value::list({1, 2, 3, 4, 5, 6, 7, 8}); };
  o.limits.max_nodes = 20;
  CHECK(val(P2 + h7 + "q\x00h\x00\x86."_b, o).as_list().size() == 2);  // 1 + 2 * 9 values
  expect_error_p(P2 + h7 + "q\x00h\x00h\x00\x87."_b, errors::pk_node_limit, o);
  // ... and its height against the depth limit where it lands.
  o.limits.max_nodes = 1000;
  o.limits.max_depth = 1;
  CHECK(val(P2 + h7 + ".", o).as_list().size() == 8);
  expect_error_p(P2 + "]" + h7 + "a.", errors::pk_depth_limit, o);
}
