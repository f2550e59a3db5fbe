// flatten / unflatten: the skeleton format, exact scalars, names, aliases and views, the listing
// and subset helpers, hostile skeletons (each with its error id), and property tests over
// thousands of random trees.
#include <doctest/doctest.h>

#include <statedict/statedict.hpp>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <string>
#include <unordered_map>
#include <vector>

using namespace statedict;
using nlohmann::json;

namespace {

/// The id of the statedict error `f` throws (0: none, -1: another exception).
template <class F>
int thrown_id(F&& f) {
  try {
    f();
  } catch (const statedict::error& e) {
    return e.id();
  } catch (...) {
    return -1;
  }
  return 0;
}

template <class F>
std::string error_text(F&& f) {
  try {
    f();
  } catch (const statedict::error& e) {
    return e.what();
  }
  return "";
}

Value round_trip(const Value& v) { return unflatten(flatten(v)); }

/// Round trip through the skeleton's JSON text, as a file would carry it.
Value text_round_trip(const Value& v) {
  FlatStateDict f = flatten(v);
  return unflatten(f.tensors, json::parse(f.skeleton.dump()));
}

std::vector<const TensorView*> tensor_leaves(const Value& v) {
  std::vector<const TensorView*> out;
  visit(v, [&](const Path&, const Value& n) {
    if (n.is_tensor()) out.push_back(&n.as_tensor());
  });
  return out;
}

std::vector<std::string> names(const FlatStateDict& f) {
  std::vector<std::string> out;
  for (const auto& [n, v] : f.tensors) out.push_back(n);
  return out;
}

double bits(std::uint64_t b) { return std::bit_cast<double>(b); }

Dict dict(std::initializer_list<std::pair<Key, Value>> items) {
  Dict d;
  for (const auto& [k, v] : items) d.insert(k, v);
  return d;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Format

TEST_CASE("flatten names tensors by dotted path in pre-order and the skeleton holds the rest") {
  Tensor w = Tensor::from<float>({1, 2, 3, 4}, {2, 2});
  Tensor b = Tensor::from<std::int64_t>({7}, {1});
  Dict layer = dict({{"weight", w}, {"bias", b}});
  Dict model = dict({{"layer", layer}, {"n", 3}, {"scale", 0.5}, {"name", "gpt"}, {"ok", true}, {"none", nullptr}});
  Value tree = dict({{"model", model}, {"ids", Value::tuple({1, 2})}, {"raw", Bytes{{0, 255}}}});
  const FlatStateDict f = flatten(tree);
  CHECK(names(f) == std::vector<std::string>{"model.layer.weight", "model.layer.bias"});
  CHECK(f.tensors[0].second.data() == w.data());  // views, not copies
  const json want = json::parse(R"({"statedict_skeleton": 1, "root": {"dict": [
    ["model", {"dict": [
      ["layer", {"dict": [
        ["weight", {"tensor": "model.layer.weight", "dtype": "F32", "shape": [2, 2]}],
        ["bias", {"tensor": "model.layer.bias", "dtype": "I64", "shape": [1]}]]}],
      ["n", 3], ["scale", 0.5], ["name", "gpt"], ["ok", true], ["none", null]]}],
    ["ids", {"tuple": [1, 2]}],
    ["raw", {"bytes": "AP8="}]]}})");
  CHECK(f.skeleton == want);
  CHECK(round_trip(tree) == tree);
  CHECK(text_round_trip(tree) == tree);
}

TEST_CASE("int and string keys, lists, tuples, empty containers and objects are kept exactly") {
  Object ns{"argparse", "Namespace", object_build::newobj, {}, {Value(dict({{"lr", 0.1}, {"epochs", 3}}))}, {}};
  Object size{"torch", "Size", object_build::reduce, {Value::tuple({2, 3})}, {}, {}};
  Object dtype{"torch", "float32", object_build::global, {}, {}, {}};
  Object od{"collections", "OrderedDict", object_build::reduce, {}, {}, {Value::tuple({"a", 1})}};
  Value tree = dict({{1, "int one"},
                     {"1", "string one"},
                     {"empty_dict", Dict{}},
                     {"empty_list", Value::list()},
                     {"empty_tuple", Value::tuple()},
                     {"nested", Value::list({Value::tuple({Value::list(), Dict{}}), Value::tuple({})})},
                     {"objs", Value::list({ns, size, dtype, od})},
                     {-5, Value::list({nullptr})}});
  const FlatStateDict f = flatten(tree);
  CHECK(f.tensors.empty());
  const Value back = text_round_trip(tree);
  CHECK(back == tree);
  CHECK(back.as_dict().items()[0].first.is_int());
  CHECK(back.as_dict().items()[1].first.is_string());
  CHECK(back["objs"].at(0).as_object().how == object_build::newobj);
  CHECK(back["objs"].at(2).as_object().how == object_build::global);
  // The object encoding
  const json& objs = f.skeleton.json()["root"]["dict"][6][1]["list"];
  CHECK(objs[1] == json::parse(R"({"object": {"module": "torch", "name": "Size", "how": "reduce",
                                   "args": [{"tuple": [2, 3]}], "state": [], "items": []}})"));
  CHECK(f.skeleton.json()["root"]["dict"][0][0] == 1);
  CHECK(f.skeleton.json()["root"]["dict"][1][0] == "1");
}

TEST_CASE("doubles round-trip bit for bit through the skeleton text; ints stay ints") {
  const std::vector<double> doubles = {0.0,
                                       -0.0,
                                       1.0,
                                       -1.0,
                                       0.1,
                                       1e-3,
                                       0.999,
                                       1.0 / 3.0,
                                       1e300,
                                       -1e-300,
                                       std::numeric_limits<double>::max(),
                                       std::numeric_limits<double>::lowest(),
                                       std::numeric_limits<double>::min(),
                                       std::numeric_limits<double>::denorm_min(),
                                       -std::numeric_limits<double>::denorm_min(),
                                       9007199254740993.0,  // 2^53 + 1 rounds to 2^53: still exact as a double
                                       123456789012345678.0,
                                       std::numeric_limits<double>::infinity(),
                                       -std::numeric_limits<double>::infinity(),
                                       std::numeric_limits<double>::quiet_NaN(),
                                       bits(0xfff8000000000000ULL),  // -nan
                                       bits(0x7ff8000000000001ULL),  // payload
                                       bits(0x7ff0000000000001ULL),  // signalling
                                       bits(0xffffffffffffffffULL)};
  List l;
  for (double d : doubles) l.emplace_back(d);
  const std::vector<std::int64_t> ints = {0, 1, -1, 2, 1LL << 53, (1LL << 53) + 1, INT64_MAX, INT64_MIN, INT64_MIN + 1};
  for (auto i : ints) l.emplace_back(i);
  const Value tree = Value::list(std::move(l));
  const FlatStateDict f = flatten(tree);
  const std::string text = f.skeleton.dump();
  const Value back = unflatten(f.tensors, json::parse(text));
  REQUIRE(back == tree);  // Value == compares doubles bitwise
  for (std::size_t i = 0; i < doubles.size(); ++i) {
    CHECK(back.at(i).is_double());
    CHECK(std::bit_cast<std::uint64_t>(back.at(i).as_double()) == std::bit_cast<std::uint64_t>(doubles[i]));
  }
  for (std::size_t i = 0; i < ints.size(); ++i) CHECK(back.at(doubles.size() + i).as_int() == ints[i]);
  const json& items = f.skeleton.json()["root"]["list"];
  CHECK(items[0].is_number_float());
  CHECK(items[2].is_number_float());  // 1.0 is a float: "1.0" in the text
  CHECK(text.find("1.0,") != std::string::npos);
  CHECK(items[17] == json::parse(R"({"float": "inf"})"));
  CHECK(items[18] == json::parse(R"({"float": "-inf"})"));
  CHECK(items[19] == json::parse(R"({"float": "nan"})"));
  CHECK(items[20] == json::parse(R"({"float": "0xfff8000000000000"})"));
  CHECK(items[21] == json::parse(R"({"float": "0x7ff8000000000001"})"));
  CHECK(items[doubles.size()].is_number_integer());
  CHECK(items[doubles.size() + 6] == INT64_MAX);
  // A finite double written as hex bits is read too (any writer may choose the exact form).
  const Value one = unflatten(NamedTensors{}, json::parse(R"({"statedict_skeleton": 1, "root": {"float": "0x3FF0000000000000"}})"));
  CHECK(one == Value(1.0));
}

TEST_CASE("bytes, unicode and strings that are not UTF-8 round-trip; the skeleton stays dumpable") {
  Bytes all;
  for (int i = 0; i < 256; ++i) all.data.push_back(static_cast<std::uint8_t>(i));
  const std::string bad = "lone surrogate \xed\xa0\x80 and \xff";
  Value tree = dict({{"all", all},
                     {"empty", Bytes{}},
                     {"one", Bytes{{1}}},
                     {"two", Bytes{{1, 2}}},
                     {"unicode", "h\xc3\xa9llo \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80"},
                     {"", ""},
                     {"bad", bad},
                     {bad, 1},
                     {"ctl", std::string("a\0b\n\x01", 5)}});
  const FlatStateDict f = flatten(tree);
  const std::string text = f.skeleton.dump();  // would throw on invalid UTF-8
  const json& items = f.skeleton.json()["root"]["dict"];
  CHECK(items[6][1].contains("str_bytes"));
  CHECK(items[7][0].contains("str_bytes"));
  CHECK(items[4][1].is_string());
  CHECK(unflatten(f.tensors, json::parse(text)) == tree);
}

// ------------------------------------------------------------------------------------------------
// Names

TEST_CASE("names are dotted paths whenever unique, including keys with dots (the HF convention)") {
  Tensor t = Tensor::zeros(dtype::F32, {2});
  Value tree = dict({{"model.layers.0.weight", t}, {"model.layers.0.bias", Tensor::zeros(dtype::F32, {2})}});
  CHECK(names(flatten(tree)) == std::vector<std::string>{"model.layers.0.weight", "model.layers.0.bias"});
}

TEST_CASE("colliding dotted names use quoted string segments; int keys stay bare") {
  auto z = [] { return Value(Tensor::zeros(dtype::F32, {1})); };
  Value state = dict({{1, dict({{"exp_avg", z()}})}, {"1", dict({{"exp_avg", z()}})}, {2, dict({{"exp_avg", z()}})}});
  Value tree = dict({{"state", state}});
  CHECK(names(flatten(tree)) == std::vector<std::string>{"state.1.exp_avg", "state[\"1\"].exp_avg", "state.2.exp_avg"});
  CHECK(round_trip(tree) == tree);

  Value dots = dict({{"a.b", dict({{"c", z()}})}, {"a", dict({{"b.c", z()}, {"b", dict({{"c", z()}})}})}, {"x", z()}});
  CHECK(names(flatten(dots)) == std::vector<std::string>{"[\"a.b\"].c", "a[\"b.c\"]", "a.b.c", "x"});
  CHECK(round_trip(dots) == dots);

  // Quoting escapes quotes, backslashes and control characters; empty and int-like strings are quoted.
  Value odd = dict({{"q\"\\\n.x", z()}, {"q\"\\\n", dict({{"x", z()}})}, {"", dict({{"x", z()}})}, {".x", z()},
                    {"-7", z()}, {-7, z()}});
  CHECK(names(flatten(odd)) == std::vector<std::string>{"[\"q\\\"\\\\\\u000a.x\"]", "q\"\\\n.x", "[\"\"].x", "[\".x\"]",
                                                        "[\"-7\"]", "-7"});
  CHECK(round_trip(odd) == odd);
}

TEST_CASE("mark_repeats finds exactly the names that occur twice, whatever their hashes") {
  // flatten's collision check: names sorted by hash, compared within runs of equal hashes. Forced
  // hashes make those runs long (all equal, or 7 values) so the in-run sort is what finds repeats.
  std::mt19937_64 rng(11);
  for (int round = 0; round < 60; ++round) {
    const std::size_t n = 1 + rng() % 400;
    std::vector<std::string> pool;
    for (std::size_t i = 0; i < n; ++i) pool.push_back("n" + std::to_string(rng() % (n + 3)) + (rng() % 2 ? ".w" : ""));
    std::map<std::string, int> seen;
    for (const auto& p : pool) ++seen[p];
    std::vector<std::uint8_t> want(n, 0);
    for (std::size_t i = 0; i < n; ++i) want[i] = seen[pool[i]] > 1;
    const bool want_any = std::find(want.begin(), want.end(), 1) != want.end();
    auto name = [&](std::size_t i) { return std::string_view(pool[i]); };
    auto check = [&](auto hash) {
      std::vector<std::uint8_t> got(n, 0);
      CHECK(detail::mark_repeats(n, name, got, hash) == want_any);
      CHECK(got == want);
    };
    check(detail::name_hash{});
    check([](std::string_view) { return std::size_t{42}; });
    check([](std::string_view v) { return v.size() % 7; });
  }
}

TEST_CASE("address_sort is a stable sort by address: sorted input, a few ascending runs, or any order") {
  // decide() relies on equal addresses keeping their pre-order (the earlier leaf is the one the
  // later aliases). Inputs cover each path: one run (no work), 2-8 runs (merged), more (radix,
  // over the bytes that differ, some addresses far apart so high bytes differ too).
  using entry = std::pair<std::uintptr_t, std::uint32_t>;
  std::mt19937_64 rng(5);
  for (int round = 0; round < 300; ++round) {
    const std::size_t n = rng() % 600;
    const std::size_t runs = round < 100 ? 1 + static_cast<std::size_t>(round % 10) : 0;  // 0: random order
    const bool wide = round % 3 == 0;
    std::vector<entry> v;
    for (std::size_t i = 0; i < n; ++i) {
      std::uintptr_t a = static_cast<std::uintptr_t>(rng() % 64) * 8;  // many equal addresses
      if (wide) a += static_cast<std::uintptr_t>(rng() % 4) << 40;
      v.emplace_back(a, static_cast<std::uint32_t>(i));
    }
    if (runs) {  // cut into `runs` pieces, each sorted
      for (std::size_t r = 0; r < runs; ++r) {
        const auto b = v.begin() + static_cast<std::ptrdiff_t>(n * r / runs), e = v.begin() + static_cast<std::ptrdiff_t>(n * (r + 1) / runs);
        std::stable_sort(b, e, [](const entry& x, const entry& y) { return x.first < y.first; });
      }
    }
    std::vector<entry> want = v;
    std::stable_sort(want.begin(), want.end(), [](const entry& x, const entry& y) { return x.first < y.first; });
    detail::address_sort(v);
    CHECK(v == want);
  }
}

TEST_CASE("a skeleton tape keeps strings of any length: 4 GiB and more in the pool's own length field") {
  // Tape nodes hold a 32-bit length; longer strings (made here with a small limit) store theirs
  // in the pool. Both forms read back the same bytes, next to each other.
  detail::skeleton_tape t;
  const std::string long_one = "a string stored the long way", short_one = "short";
  const auto [la, lb] = t.add_string_node(long_one, 4);
  const auto [sa, sb] = t.add_string_node(short_one);
  CHECK(lb == detail::skeleton_tape::long_string);
  CHECK(sb == short_one.size());
  CHECK(t.pool.size() == 8 + long_one.size() + short_one.size());
  CHECK(t.str(detail::skeleton_tape::node{la, lb, detail::snode::string, 0}) == long_one);
  CHECK(t.str(detail::skeleton_tape::node{sa, sb, detail::snode::bytes, 0}) == short_one);
  const auto [ea, eb] = t.add_string_node("", 0);
  CHECK(eb == detail::skeleton_tape::long_string);
  CHECK(t.str(detail::skeleton_tape::node{ea, eb, detail::snode::string, 0}).empty());
}

TEST_CASE("names are valid UTF-8 even when keys are not") {
  auto z = [] { return Value(Tensor::zeros(dtype::F32, {1})); };
  Value tree = dict({{"ok\xc3\xa9", dict({{"bad\xff", z()}})}, {"\xed\xa0\x80", z()}});
  const FlatStateDict f = flatten(tree);
  CHECK(names(f) == std::vector<std::string>{"ok\xc3\xa9[\"bad\\xff\"]", "[\"\\xed\\xa0\\x80\"]"});
  (void)f.skeleton.dump();  // would throw on invalid UTF-8
  CHECK(round_trip(tree) == tree);
  CHECK(skeleton_values(flatten(Value(dict({{"\xff", 1}}))).skeleton).front().first == "[\"\\xff\"]");
}

TEST_CASE("a quoted name that is taken gets the first free #k suffix") {
  auto z = [] { return Value(Tensor::zeros(dtype::F32, {1})); };
  // Paths ("1") and (1) collide as "1": the string one is quoted as ["1"], which a literal key
  // '["1"]' already uses; so it becomes ["1"]#2, unless that is taken too.
  Value tree = dict({{"[\"1\"]", z()}, {"[\"1\"]#2", z()}, {"1", z()}, {1, z()}});
  const FlatStateDict f = flatten(tree);
  CHECK(names(f) == std::vector<std::string>{"[\"1\"]", "[\"1\"]#2", "[\"1\"]#3", "1"});
  CHECK(round_trip(tree) == tree);
}

TEST_CASE("object children are named args.i, state and items.i") {
  Object o{"m", "C", object_build::reduce, {Value(Tensor::zeros(dtype::F32, {1}))}, {}, {}};
  o.state.emplace_back(dict({{"w", Tensor::zeros(dtype::F32, {1})}}));
  o.items.emplace_back(Tensor::zeros(dtype::F32, {1}));
  Value tree = dict({{"obj", o}});
  CHECK(names(flatten(tree)) == std::vector<std::string>{"obj.args.0", "obj.state.w", "obj.items.0"});
  CHECK(round_trip(tree) == tree);
}

// ------------------------------------------------------------------------------------------------
// Aliases and views

TEST_CASE("tied weights become an alias; views into an earlier contiguous tensor become view_of") {
  Tensor w = Tensor::from<float>({0, 1, 2, 3, 4, 5}, {2, 3});
  const TensorView v = w.view();
  const TensorView wt(dtype::F32, {3, 2}, {1, 3}, w.data(), {});
  Value tree = dict({{"embed", v},
                     {"head", v},                                   // the very same view
                     {"t", wt},                                     // w.t()
                     {"tail", v.narrow(0, 1, 1)},                   // w[1:]
                     {"col", v.select(1, 2)},                       // w[:, 2]
                     {"flat", v.flatten()},                         // w.view(-1)
                     {"t2", wt},                                    // the same transposed view again
                     {"empty", v.narrow(0, 0, 0)}});               // zero elements: never aliased
  const FlatStateDict f = flatten(tree);
  CHECK(names(f) == std::vector<std::string>{"embed", "empty"});
  const json& d = f.skeleton.json()["root"]["dict"];
  CHECK(d[1][1] == json::parse(R"({"alias": "embed"})"));
  CHECK(d[2][1] == json::parse(R"({"view_of": "embed", "dtype": "F32", "offset": 0, "shape": [3, 2], "strides": [1, 3]})"));
  CHECK(d[3][1] == json::parse(R"({"view_of": "embed", "dtype": "F32", "offset": 3, "shape": [1, 3], "strides": [3, 1]})"));
  CHECK(d[4][1] == json::parse(R"({"view_of": "embed", "dtype": "F32", "offset": 2, "shape": [2], "strides": [3]})"));
  CHECK(d[5][1] == json::parse(R"({"view_of": "embed", "dtype": "F32", "offset": 0, "shape": [6], "strides": [1]})"));
  CHECK(d[6][1] == d[2][1]);
  CHECK(d[7][1].contains("tensor"));
  CHECK(skeleton_aliases(f.skeleton) == std::vector<std::pair<std::string, std::string>>{
                                            {"head", "embed"}, {"t", "embed"}, {"tail", "embed"},
                                            {"col", "embed"},  {"flat", "embed"}, {"t2", "embed"}});
  // The quick test for ties: true here; false for trees whose keys and strings merely say so.
  CHECK(detail::may_hold_aliases(f.skeleton));
  CHECK(detail::may_hold_aliases(flatten(dict({{"a", dict({{"x", v}, {"y", v.narrow(0, 1, 1)}})}})).skeleton));
  Tensor u = Tensor::from<float>({0, 1}, {2});
  const Value untied = dict({{"alias", u.view()}, {"view_of", Value(std::string("alias"))}, {"l", Value::list({Value(1)})}});
  CHECK(!detail::may_hold_aliases(flatten(untied).skeleton));
  CHECK(skeleton_aliases(flatten(untied).skeleton).empty());
  // unflatten gives back the very same views: aliasing survives.
  const Value back = unflatten(f);
  CHECK(back == tree);
  const auto a = tensor_leaves(tree), b = tensor_leaves(back);
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(same_view(*a[i], *b[i]));
}

TEST_CASE("partial overlaps, other dtypes, later containers and odd offsets are stored separately") {
  Tensor w = Tensor::from<float>({0, 1, 2, 3, 4, 5, 6, 7}, {8});
  const TensorView v = w.view();
  const TensorView as_int(dtype::I32, {8}, {1}, w.data(), {});
  const TensorView odd(dtype::U8, {4}, {1}, w.data() + 1, {});
  Value tree = dict({{"a", v.narrow(0, 0, 5)},      // [0, 5)
                     {"b", v.narrow(0, 3, 5)},      // [3, 8): overlaps a, neither contains the other
                     {"c", v.narrow(0, 1, 2)},      // inside a: view_of a
                     {"ints", as_int},              // same bytes, another dtype
                     {"all", v},                    // contains a, but comes after it
                     {"d", v.narrow(0, 6, 1)},      // inside b (and all): view_of b, the first found
                     {"odd", odd}});                // U8 inside F32 bytes: another dtype
  const FlatStateDict f = flatten(tree);
  CHECK(names(f) == std::vector<std::string>{"a", "b", "ints", "all", "odd"});
  const json& d = f.skeleton.json()["root"]["dict"];
  CHECK(d[2][1]["view_of"] == "a");
  CHECK(d[2][1]["offset"] == 1);
  CHECK(d[5][1].contains("view_of"));
  const Value back = unflatten(f);
  CHECK(back == tree);
  const auto x = tensor_leaves(tree), y = tensor_leaves(back);
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(same_view(*x[i], *y[i]));
}

TEST_CASE("a same-dtype view at an odd byte offset is a view of the container it aligns with") {
  // Bytes viewed as U16 at offset 0 ("base") and at byte offset 1 ("shifted", a tensor of its own);
  // "inner" lies inside both but aligns only with "shifted".
  std::vector<std::uint8_t> raw(32, 0);
  auto buf = std::make_shared<std::vector<std::uint8_t>>(raw);
  const auto* p = reinterpret_cast<const std::byte*>(buf->data());
  const TensorView base(dtype::U16, {16}, {1}, p, buf);
  const TensorView shifted(dtype::U16, {8}, {1}, p + 1, buf);
  const TensorView inner(dtype::U16, {2}, {1}, p + 3, buf);
  Value tree = dict({{"base", base}, {"shifted", shifted}, {"inner", inner}});
  const FlatStateDict f = flatten(tree);
  CHECK(names(f) == std::vector<std::string>{"base", "shifted"});
  CHECK(f.skeleton.json()["root"]["dict"][2][1]["view_of"] == "shifted");
  CHECK(f.skeleton.json()["root"]["dict"][2][1]["offset"] == 1);
  CHECK(unflatten(f) == tree);
}

TEST_CASE("a chain of views resolves to the tensor node; owners are kept") {
  Tensor w = Tensor::from<float>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {3, 4});
  const TensorView v = w.view();
  Value tree = dict({{"w", v}, {"rows", v.narrow(0, 1, 2)}, {"cell", v.narrow(0, 1, 2).narrow(1, 1, 2)}});
  const FlatStateDict f = flatten(tree);
  CHECK(names(f) == std::vector<std::string>{"w"});
  CHECK(f.skeleton.json()["root"]["dict"][2][1] ==
        json::parse(R"({"view_of": "w", "dtype": "F32", "offset": 5, "shape": [2, 2], "strides": [4, 1]})"));
  const Value back = unflatten(f);
  CHECK(back["cell"].as_tensor().owner() == w.view().owner());
  CHECK(back == tree);
}

// ------------------------------------------------------------------------------------------------
// Tensor maps

TEST_CASE("unflatten takes tensors from any name -> tensor collection, in any order") {
  Tensor a = Tensor::from<float>({1, 2}, {2});
  Tensor b = Tensor::from<std::int32_t>({3}, {1});
  Value tree = dict({{"x", dict({{"a", a}})}, {"b", b}, {"n", 1}});
  const FlatStateDict f = flatten(tree);
  std::map<std::string, TensorView> sorted(f.tensors.begin(), f.tensors.end());
  CHECK(unflatten(sorted, f.skeleton) == tree);
  std::unordered_map<std::string, TensorView> hashed(f.tensors.begin(), f.tensors.end());
  CHECK(unflatten(hashed, f.skeleton) == tree);
  std::map<std::string, Tensor> owned;  // e.g. tensors a reader materialised: other memory, same values
  for (const auto& [n, v] : f.tensors) owned.emplace(n, Tensor::copy_of(v));
  const Value back = unflatten(owned, f.skeleton);
  CHECK(back == tree);
  CHECK(back["b"].as_tensor().data() == owned.at("b").data());
  std::vector<std::pair<std::string_view, Tensor>> views = {{"x.a", a}, {"b", b}};
  CHECK(unflatten(views, f.skeleton) == tree);
}

TEST_CASE("a null skeleton means a flat dict of the tensors in order") {
  NamedTensors t = {{"z.w", Tensor::zeros(dtype::F32, {1})}, {"a", Tensor::zeros(dtype::F16, {2})}};
  const Value v = unflatten(t, json());
  REQUIRE(v.is_dict());
  CHECK(v.as_dict().items()[0].first == Key("z.w"));
  CHECK(v.as_dict().items()[1].first == Key("a"));
}

TEST_CASE("flat_skeleton describes a flat dict of named tensors, as in a safetensors file") {
  NamedTensors t = {{"model.b", Tensor::zeros(dtype::BF16, {3})}, {"model.a", Tensor::zeros(dtype::I64, {2, 0})}};
  const json s = flat_skeleton(t);
  CHECK(s == json::parse(R"({"statedict_skeleton": 1, "root": {"dict": [
    ["model.b", {"tensor": "model.b", "dtype": "BF16", "shape": [3]}],
    ["model.a", {"tensor": "model.a", "dtype": "I64", "shape": [2, 0]}]]}})"));
  const Value v = unflatten(t, s);
  CHECK(v == unflatten(t, json()));
  struct Info {
    std::string name;
    statedict::dtype dtype;
    shape_t shape;
  };
  const std::vector<Info> infos = {{"model.b", dtype::BF16, {3}}, {"model.a", dtype::I64, {2, 0}}};
  CHECK(flat_skeleton(infos) == s);
  CHECK(skeleton_tensors(s) == std::vector<SkeletonTensor>{{"model.b", dtype::BF16, {3}}, {"model.a", dtype::I64, {2, 0}}});
}

// ------------------------------------------------------------------------------------------------
// Listings and subsets

TEST_CASE("skeleton_values lists non-tensor leaves by name; tensor-free objects are one value") {
  Object ns{"argparse", "Namespace", object_build::newobj, {}, {Value(dict({{"lr", 0.1}}))}, {}};
  Object holder{"m", "Holder", object_build::reduce, {Value(Tensor::zeros(dtype::F32, {1})), Value(5)}, {}, {}};
  Value tree = dict({{"opt", dict({{"state", dict({{1, dict({{"step", 3}})}, {"1", dict({{"step", 4}})}})}})},
                     {"args", ns},
                     {"holder", holder},
                     {"empty", Dict{}},
                     {"b", Bytes{{9}}}});
  const auto values = skeleton_values(flatten(tree).skeleton);
  REQUIRE(values.size() == 5);
  CHECK(values[0] == std::pair<std::string, Value>{"opt.state.1.step", 3});
  CHECK(values[1] == std::pair<std::string, Value>{"opt.state[\"1\"].step", 4});
  CHECK(values[2] == std::pair<std::string, Value>{"args", ns});
  CHECK(values[3] == std::pair<std::string, Value>{"holder.args.1", 5});
  CHECK(values[4].first == "b");
}

TEST_CASE("alias names are unique among tensor names and match flatten's rule") {
  Tensor w = Tensor::zeros(dtype::F32, {4});
  // The alias at ("a", "b") prints like the tensor at ("a.b"): flatten quotes both.
  Value tree = dict({{"a.b", w}, {"a", dict({{"b", w}})}});
  const FlatStateDict f = flatten(tree);
  CHECK(names(f) == std::vector<std::string>{"[\"a.b\"]"});
  CHECK(skeleton_aliases(f.skeleton) == std::vector<std::pair<std::string, std::string>>{{"a.b", "[\"a.b\"]"}});
}

TEST_CASE("name_prefix_filter matches whole segments") {
  const PathFilter keep = name_prefix_filter({"model.layers.1", "optim."});
  CHECK(keep({Key("model"), Key("layers"), Key(1), Key("w")}));
  CHECK(keep({Key("model"), Key("layers"), Key("1")}));
  CHECK_FALSE(keep({Key("model"), Key("layers"), Key(10), Key("w")}));
  CHECK(keep({Key("optim"), Key("state")}));
  CHECK_FALSE(keep({Key("optim")}));
  CHECK_FALSE(keep({Key("optimizer"), Key("x")}));
  CHECK(name_prefix_filter({""})({Key("anything")}));
}

TEST_CASE("select keeps the chosen part; dropped alias and view targets are promoted") {
  Tensor w = Tensor::from<float>({0, 1, 2, 3, 4, 5}, {2, 3});
  const TensorView v = w.view();
  Value tree = dict({{"model", dict({{"embed", v}, {"head", v}, {"t", TensorView(dtype::F32, {3, 2}, {1, 3}, w.data(), {})},
                                     {"row", v.narrow(0, 1, 1)}})},
                     {"groups", Value::list({dict({{"lr", 1}}), dict({{"lr", 2}}), dict({{"lr", 3}})})},
                     {"obj", Object{"m", "C", object_build::reduce, {Value(1), Value(2)}, {}, {}}},
                     {"empty", Dict{}}});
  const FlatStateDict f = flatten(tree);

  // The dropped tensor's first kept alias is promoted; a kept view then points at it.
  const FlatStateDict heads = select(f, name_prefix_filter({"model.head", "model.row"}));
  CHECK(names(heads) == std::vector<std::string>{"model.head"});
  CHECK(same_view(heads.tensors[0].second, v));
  const Value hv = unflatten(heads);
  CHECK(hv == Value(dict({{"model", dict({{"head", v}, {"row", v.narrow(0, 1, 1)}})}})));
  CHECK(same_view(hv["model"]["row"].as_tensor(), v.narrow(0, 1, 1)));
  const SkeletonSubset hs = skeleton_subset(f.skeleton, name_prefix_filter({"model.head", "model.row"}));
  CHECK(hs.tensors == std::vector<SubsetTensor>{{"model.head", "model.embed", std::nullopt}});
  // A view alone is promoted to a tensor of its own: its elements come from a view of the source.
  const SkeletonSubset rs = skeleton_subset(f.skeleton, name_prefix_filter({"model.row"}));
  CHECK(rs.tensors == std::vector<SubsetTensor>{{"model.row", "model.embed", ViewSpec{dtype::F32, 3, {1, 3}, {3, 1}}}});
  const FlatStateDict rows = select(f, name_prefix_filter({"model.row"}));
  CHECK(same_view(rows.tensors.at(0).second, v.narrow(0, 1, 1)));
  CHECK(rows.skeleton.json()["root"]["dict"][0][1]["dict"][0][1] == json::parse(R"({"tensor": "model.row", "dtype": "F32", "shape": [1, 3]})"));

  // A kept view whose base is kept stays a view; a second alias of a promoted one aliases it.
  const FlatStateDict both = select(f, name_prefix_filter({"model.t", "model.embed"}));
  CHECK(names(both) == std::vector<std::string>{"model.embed"});
  CHECK(both.skeleton.json()["root"]["dict"][0][1]["dict"][1][1].contains("view_of"));

  // Lists keep indices: dropped elements before a kept one become None.
  const Value g = unflatten(select(f, name_prefix_filter({"groups.1"})));
  CHECK(g == Value(dict({{"groups", Value::list({nullptr, dict({{"lr", 2}})})}})));
  // Objects are kept whole; empty containers are kept when they match.
  const Value o = unflatten(select(f, name_prefix_filter({"obj.args.1", "empty"})));
  CHECK(o == Value(dict({{"obj", tree["obj"]}, {"empty", Dict{}}})));
  // Nothing matches: the root container stays, empty.
  CHECK(unflatten(select(f, name_prefix_filter({"nothing"}))) == Value(Dict{}));
  // Everything matches: the same tree.
  CHECK(unflatten(select(f, name_prefix_filter({""}))) == tree);
}

// ------------------------------------------------------------------------------------------------
// Hostile skeletons: every failure is a statedict error with its id, never a crash.

TEST_CASE("malformed skeletons are format errors naming the node") {
  Tensor w = Tensor::from<float>({1, 2, 3, 4}, {2, 2});
  const NamedTensors none;
  const NamedTensors one = {{"w", w}};
  const std::string W = R"({"tensor": "w", "dtype": "F32", "shape": [2, 2]})";
  auto doc = [](const std::string& root) { return R"({"statedict_skeleton": 1, "root": )" + root + "}"; };
  struct Case {
    std::string text;
    const NamedTensors* map;
    int id;
  };
  const std::vector<Case> cases = {
      // header
      {"[]", &none, 200},
      {"null", &one, 0},  // null skeleton: a flat dict of the map (valid)
      {R"({"root": null})", &none, 200},
      {R"({"statedict_skeleton": "1", "root": null})", &none, 200},
      {R"({"statedict_skeleton": 1.0, "root": null})", &none, 200},
      {R"({"statedict_skeleton": 2, "root": null})", &none, 201},
      {R"({"statedict_skeleton": 1})", &none, 200},
      // node kinds
      {doc(R"({"foo": 1})"), &none, 200},
      {doc(R"({"list": 1})"), &none, 200},
      {doc(R"({"list": [], "tuple": []})"), &none, 200},
      {doc(R"([1])"), &none, 200},
      {doc(R"({"list": [[1]]})"), &none, 200},
      {doc(R"({"list": [], "note": "unknown members are ignored"})"), &none, 0},
      {doc("18446744073709551615"), &none, 200},
      {doc("9223372036854775807"), &none, 0},
      // dicts
      {doc(R"({"dict": [[1]]})"), &none, 200},
      {doc(R"({"dict": [["a", 1, 2]]})"), &none, 200},
      {doc(R"({"dict": ["a"]})"), &none, 200},
      {doc(R"({"dict": [[true, 1]]})"), &none, 200},
      {doc(R"({"dict": [[1.5, 1]]})"), &none, 200},
      {doc(R"({"dict": [[null, 1]]})"), &none, 200},
      {doc(R"({"dict": [[18446744073709551615, 1]]})"), &none, 200},
      {doc(R"({"dict": [[{"str_bytes": "/w=="}, 1]]})"), &none, 0},
      {doc(R"({"dict": [[{"str_bytes": "/w==", "x": 1}, 1]]})"), &none, 200},
      {doc(R"({"dict": [["a", 1], ["a", 2]]})"), &none, 210},
      {doc(R"({"dict": [[1, 1], [1, 2]]})"), &none, 210},
      {doc(R"({"dict": [[1, 1], ["1", 2]]})"), &none, 0},
      // scalars
      {doc(R"({"float": "nanx"})"), &none, 200},
      {doc(R"({"float": "0x123"})"), &none, 200},
      {doc(R"({"float": "0x+fffffffffffffff"})"), &none, 200},
      {doc(R"({"float": "0xfffffffffffffffg"})"), &none, 200},
      {doc(R"({"float": 1.5})"), &none, 200},
      {doc(R"({"bytes": "abc"})"), &none, 200},
      {doc(R"({"bytes": "AB=C"})"), &none, 200},
      {doc(R"({"bytes": "AR=="})"), &none, 200},  // unused bits set: not canonical
      {doc(R"({"bytes": "AQ=="})"), &none, 0},
      {doc(R"({"bytes": "A Q="})"), &none, 200},
      {doc(R"({"str_bytes": 5})"), &none, 200},
      {doc(R"({"str_bytes": "*"})"), &none, 200},
      // objects
      {doc(R"({"object": {"module": "m", "name": "n", "how": "call", "args": [], "state": [], "items": []}})"), &none, 200},
      {doc(R"({"object": {"module": "m", "name": "n", "how": "reduce", "state": [], "items": []}})"), &none, 200},
      {doc(R"({"object": {"module": "m", "name": "n", "how": "reduce", "args": {}, "state": [], "items": []}})"), &none, 200},
      {doc(R"({"object": {"module": 1, "name": "n", "how": "reduce", "args": [], "state": [], "items": []}})"), &none, 200},
      {doc(R"({"object": {"name": "n", "how": "reduce", "args": [], "state": [], "items": []}})"), &none, 200},
      {doc(R"({"object": []})"), &none, 200},
      // tensor nodes
      {doc(R"({"tensor": 5, "dtype": "F32", "shape": [2, 2]})"), &one, 200},
      {doc(R"({"tensor": "w", "dtype": "F33", "shape": [2, 2]})"), &one, 200},
      {doc(R"({"tensor": "w", "shape": [2, 2]})"), &one, 200},
      {doc(R"({"tensor": "w", "dtype": "F32"})"), &one, 200},
      {doc(R"({"tensor": "w", "dtype": "F32", "shape": "2x2"})"), &one, 200},
      {doc(R"({"tensor": "w", "dtype": "F32", "shape": [-2, -2]})"), &one, 200},
      {doc(R"({"tensor": "w", "dtype": "F32", "shape": [2.0, 2]})"), &one, 200},
      {doc(W), &one, 0},
      {doc(R"({"tensor": "v", "dtype": "F32", "shape": [2, 2]})"), &one, 202},
      {doc("null"), &one, 203},
      {doc(R"({"tensor": "w", "dtype": "F16", "shape": [2, 2]})"), &one, 204},
      {doc(R"({"tensor": "w", "dtype": "F32", "shape": [4]})"), &one, 205},
      {doc(R"({"list": [)" + W + "," + W + "]}"), &one, 206},
      {doc(R"({"list": [{"alias": "w"}, )" + W + "]}"), &one, 207},
      {doc(R"({"list": [)" + W + R"(, {"alias": "v"}]})"), &one, 202},
      {doc(R"({"list": [)" + W + R"(, {"alias": 1}]})"), &one, 200},
      // view_of nodes (w has 4 elements)
      {doc(R"({"list": [)" + W + R"(, {"view_of": "w", "dtype": "F32", "offset": 1, "shape": [3], "strides": [1]}]})"), &one, 0},
      {doc(R"({"list": [)" + W + R"(, {"view_of": "w", "dtype": "F32", "offset": 2, "shape": [3], "strides": [1]}]})"), &one, 208},
      {doc(R"({"list": [)" + W + R"(, {"view_of": "w", "dtype": "F32", "offset": 0, "shape": [2, 2], "strides": [3, 1]}]})"), &one, 208},
      {doc(R"({"list": [)" + W + R"(, {"view_of": "w", "dtype": "F32", "offset": 9223372036854775807, "shape": [2], "strides": [1]}]})"), &one, 208},
      {doc(R"({"list": [)" + W + R"(, {"view_of": "w", "dtype": "F32", "offset": 0, "shape": [2], "strides": [9223372036854775807]}]})"), &one, 208},
      {doc(R"({"list": [)" + W + R"(, {"view_of": "w", "dtype": "F32", "offset": 4, "shape": [0], "strides": [1]}]})"), &one, 0},
      {doc(R"({"list": [)" + W + R"(, {"view_of": "w", "dtype": "F32", "offset": 5, "shape": [0], "strides": [1]}]})"), &one, 208},
      {doc(R"({"list": [)" + W + R"(, {"view_of": "w", "dtype": "I32", "offset": 0, "shape": [1], "strides": [1]}]})"), &one, 209},
      {doc(R"({"list": [)" + W + R"(, {"view_of": "w", "dtype": "F32", "offset": -1, "shape": [1], "strides": [1]}]})"), &one, 200},
      {doc(R"({"list": [)" + W + R"(, {"view_of": "w", "dtype": "F32", "offset": 0, "shape": [1, 1], "strides": [1]}]})"), &one, 200},
      {doc(R"({"list": [)" + W + R"(, {"view_of": "w", "dtype": "F32", "shape": [1], "strides": [1]}]})"), &one, 200},
      {doc(R"({"list": [)" + W + R"(, {"view_of": "w", "dtype": "F32", "offset": 0, "shape": [1], "strides": [-1]}]})"), &one, 200},
      {doc(R"({"list": [{"view_of": "w", "dtype": "F32", "offset": 0, "shape": [1], "strides": [1]}, )" + W + "]}"), &one, 207},
  };
  for (const auto& c : cases) {
    CAPTURE(c.text);
    CHECK(thrown_id([&] { (void)unflatten(*c.map, json::parse(c.text)); }) == c.id);
  }
}

TEST_CASE("errors name the skeleton node and the tensor") {
  Tensor w = Tensor::from<float>({1, 2, 3, 4}, {2, 2});
  Value tree = dict({{"model", dict({{"layers", Value::list({dict({{"w", w}})})}})}});
  FlatStateDict f = flatten(tree);
  f.tensors[0].second = Tensor::zeros(dtype::F32, {4}).view();
  const std::string msg = error_text([&] { (void)unflatten(f); });
  CHECK(msg.find("[statedict.shape_error.205]") == 0);
  CHECK(msg.find("skeleton node 'model.layers.0.w'") != std::string::npos);
  CHECK(msg.find("tensor 'model.layers.0.w' has shape [4] in the tensor map, [2,2] in the skeleton") != std::string::npos);

  NamedTensors extra = flatten(tree).tensors;
  extra.emplace_back("stray", w);
  const std::string e2 = error_text([&] { (void)unflatten(extra, f.skeleton); });
  CHECK(e2.find("[statedict.key_error.203] tensor map: tensor 'stray' is not declared") == 0);

  NamedTensors dup = {{"w", w}, {"w", w}};
  CHECK(thrown_id([&] { (void)unflatten(dup, json()); }) == 206);

  // A non-contiguous map tensor cannot be a view_of base.
  const TensorView wt(dtype::F32, {2, 2}, {1, 2}, w.data(), {});
  const NamedTensors strided = {{"w", wt}};
  const json s = json::parse(R"({"statedict_skeleton": 1, "root": {"list": [
      {"tensor": "w", "dtype": "F32", "shape": [2, 2]},
      {"view_of": "w", "dtype": "F32", "offset": 0, "shape": [1], "strides": [1]}]}})");
  const std::string e3 = error_text([&] { (void)unflatten(strided, s); });
  CHECK(e3.find("[statedict.format_error.209] skeleton node '1': view of 'w': the base tensor is not contiguous") == 0);
}

TEST_CASE("listing and subset functions validate the skeleton too") {
  const json bad = json::parse(R"({"statedict_skeleton": 1, "root": {"dict": [["a", {"list": 3}]]}})");
  CHECK(thrown_id([&] { (void)skeleton_tensors(bad); }) == 200);
  CHECK(thrown_id([&] { (void)skeleton_values(bad); }) == 200);
  CHECK(thrown_id([&] { (void)skeleton_aliases(bad); }) == 200);
  CHECK(thrown_id([&] { (void)skeleton_subset(bad, name_prefix_filter({""})); }) == 200);
  CHECK(thrown_id([&] { (void)skeleton_tensors(json::parse(R"({"statedict_skeleton": 3, "root": null})")); }) == 201);
  const json dangling = json::parse(R"({"statedict_skeleton": 1, "root": {"dict": [["a", {"alias": "nowhere"}]]}})");
  CHECK(thrown_id([&] { (void)skeleton_subset(dangling, name_prefix_filter({""})); }) == 207);
}

// ------------------------------------------------------------------------------------------------
// Depth

TEST_CASE("flatten and unflatten handle a tree 200,000 levels deep, and a hostile deep skeleton") {
  constexpr int depth = 200000;
  Tensor t = Tensor::from<float>({1, 2}, {2});
  Value v = t;
  for (int i = 0; i < depth; ++i) {
    if (i % 3 == 0) {
      List l;
      l.push_back(std::move(v));
      v = Value::list(std::move(l));
    } else if (i % 3 == 1) {
      Dict d;
      d.set(i, std::move(v));
      v = std::move(d);
    } else {
      Object o{"m", "C", object_build::reduce, {}, {}, {}};
      o.state.push_back(std::move(v));
      v = std::move(o);
    }
  }
  const FlatStateDict f = flatten(v);
  REQUIRE(f.tensors.size() == 1);
  const Value back = unflatten(f);
  CHECK(back == v);
  // Its skeleton as text (dump() would recurse 400,000 levels deep) and back.
  const std::string skel_text = skeleton_dump(f.skeleton);
  CHECK(skel_text.size() > 3000000);
  CHECK(unflatten(f.tensors, json::parse(skel_text)) == v);

  // 300,000 nested lists from text (nlohmann's parser is iterative), ending in a missing tensor.
  std::string text = R"({"statedict_skeleton": 1, "root": )";
  for (int i = 0; i < 300000; ++i) text += R"({"list": [)";
  text += R"({"tensor": "gone", "dtype": "F32", "shape": []})";
  for (int i = 0; i < 300000; ++i) text += "]}";
  text += "}";
  const json deep = json::parse(text);
  const std::string msg = error_text([&] { (void)unflatten(NamedTensors{}, deep); });
  CHECK(msg.find("[statedict.key_error.202] skeleton node '0.0.0.") == 0);
  CHECK(msg.size() < 1000);  // the 600,000-character path is cut in the middle
  CHECK(skeleton_tensors(deep).size() == 1);
}

// ------------------------------------------------------------------------------------------------
// Property tests: random trees (fixed seeds) round-trip exactly, with aliasing intact.

namespace {

class RandomTree {
 public:
  explicit RandomTree(std::uint64_t seed) : rng_(seed) {}

  Value tree() { return node(0); }

 private:
  std::mt19937_64 rng_;
  std::vector<Tensor> bases_;
  std::vector<TensorView> seen_;

  std::size_t pick(std::size_t n) { return static_cast<std::size_t>(rng_() % n); }
  bool chance(int percent) { return pick(100) < static_cast<std::size_t>(percent); }

  Key key() {
    static const std::vector<Key> pool = {Key("a"), Key("b"), Key("a.b"), Key("1"), Key("-1"), Key(""), Key("x.y.z"),
                                          Key("\xc3\xa9"), Key("\xe6\x97\xa5\xe6\x9c\xac"), Key("args"), Key("state"),
                                          Key("items"), Key("[\"1\"]"), Key("w#2"), Key("\xff\xfe"), Key("0"),
                                          Key(0), Key(1), Key(-1), Key(2), Key(INT64_MAX), Key(INT64_MIN), Key(7)};
    if (chance(10)) return Key(static_cast<std::int64_t>(rng_()));
    return pool[pick(pool.size())];
  }

  Value scalar() {
    switch (pick(6)) {
      case 0: return Value();
      case 1: return Value(chance(50));
      case 2: {
        static const std::int64_t ints[] = {0, 1, -1, INT64_MAX, INT64_MIN, 1LL << 53, 42};
        return chance(50) ? Value(ints[pick(7)]) : Value(static_cast<std::int64_t>(rng_()));
      }
      case 3: {
        static const std::uint64_t dbits[] = {0x0000000000000000ULL, 0x8000000000000000ULL, 0x3ff0000000000000ULL,
                                              0x7ff8000000000000ULL, 0xfff8000000000000ULL, 0x7ff8000000000123ULL,
                                              0x7ff0000000000001ULL, 0x7ff0000000000000ULL, 0xfff0000000000000ULL,
                                              0x0000000000000001ULL, 0x7fefffffffffffffULL, 0x3fb999999999999aULL};
        return Value(std::bit_cast<double>(chance(60) ? dbits[pick(12)] : rng_()));
      }
      case 4: {
        static const std::string strs[] = {"", "plain", "with.dot", "\xc3\xa9t\xc3\xa9", "\xf0\x9f\x98\x80",
                                           "bad\xc3", "\xed\xa0\x80", std::string("nul\0byte", 8), "quote\"back\\"};
        if (chance(80)) return Value(strs[pick(9)]);
        std::string s(pick(8), '\0');
        for (char& c : s) c = static_cast<char>(rng_());
        return Value(s);
      }
      default: {
        Bytes b;
        b.data.resize(pick(10));
        for (auto& x : b.data) x = static_cast<std::uint8_t>(rng_());
        return Value(std::move(b));
      }
    }
  }

  TensorView fresh() {
    static const dtype dts[] = {dtype::F32, dtype::F16, dtype::BF16, dtype::F64, dtype::I64, dtype::I32, dtype::U8, dtype::BOOL, dtype::C64};
    const dtype dt = dts[pick(9)];
    shape_t shape(pick(4));
    for (auto& d : shape) d = static_cast<dim_t>(pick(4) + (chance(90) ? 1 : 0));
    Tensor t(dt, shape);
    auto* p = reinterpret_cast<unsigned char*>(t.data());
    for (std::uint64_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<unsigned char>(rng_());
    bases_.push_back(t);
    return t.view();
  }

  TensorView derived() {
    const TensorView& b = seen_[pick(seen_.size())];
    switch (pick(6)) {
      case 0: return b;  // the same view again
      case 1: {
        if (b.rank() == 0) return b;
        const std::size_t d = pick(b.rank());
        const dim_t n = b.shape()[d];
        const dim_t start = static_cast<dim_t>(pick(static_cast<std::size_t>(n) + 1));
        return b.narrow(d, start, static_cast<dim_t>(pick(static_cast<std::size_t>(n - start) + 1)));
      }
      case 2: {
        if (b.rank() == 0 || b.shape()[0] == 0) return b;
        return b.select(0, static_cast<dim_t>(pick(static_cast<std::size_t>(b.shape()[0]))));
      }
      case 3: {  // transpose the first two dims
        if (b.rank() < 2) return b;
        shape_t s = b.shape(), st = b.strides();
        std::swap(s[0], s[1]);
        std::swap(st[0], st[1]);
        return TensorView(b.dtype(), s, st, b.data(), b.owner());
      }
      case 4: return b.is_contiguous() && b.numel() > 0 ? b.flatten() : b;
      default: {  // the same bytes as another dtype of the same size, or as bytes at an odd offset
        if (!b.is_contiguous() || b.numel() == 0) return b;
        if (b.itemsize() == 4) return TensorView(b.dtype() == dtype::F32 ? dtype::I32 : dtype::F32, b.shape(), b.strides(), b.data(), b.owner());
        if (b.nbytes() >= 3) return TensorView(dtype::U8, {static_cast<dim_t>(b.nbytes() - 1)}, {1}, b.data() + 1, b.owner());
        return b;
      }
    }
  }

  Value tensor() {
    TensorView v = seen_.empty() || chance(45) ? fresh() : derived();
    seen_.push_back(v);
    return Value(v);
  }

  Value node(int depth) {
    const std::size_t r = pick(100);
    if (depth >= 5 || r < 45) return r % 2 ? tensor() : scalar();
    const std::size_t n = pick(depth == 0 ? 8 : 5);
    if (r < 65) {
      Dict d;
      for (std::size_t i = 0; i < n; ++i) {
        Key k = key();
        if (!d.contains(k)) d.insert(std::move(k), node(depth + 1));
      }
      return Value(std::move(d));
    }
    if (r < 80 || r >= 90) {
      List l;
      for (std::size_t i = 0; i < n; ++i) l.push_back(node(depth + 1));
      return r < 80 ? Value::list(std::move(l)) : Value::tuple(std::move(l));
    }
    static const char* mods[] = {"torch", "argparse", "numpy.core.multiarray", "\xff", ""};
    Object o{mods[pick(5)], chance(50) ? "Namespace" : "sc\xc3\xa4lar", static_cast<object_build>(pick(3)), {}, {}, {}};
    for (std::size_t i = 0; i < pick(3); ++i) o.args.push_back(node(depth + 1));
    for (std::size_t i = 0, m = pick(10) < 7 ? pick(2) : 2; i < m; ++i) o.state.push_back(node(depth + 1));
    for (std::size_t i = 0; i < pick(3); ++i) o.items.push_back(node(depth + 1));
    return Value(std::move(o));
  }
};

bool contains_aligned(const TensorView& outer, const TensorView& inner) {
  if (outer.dtype() != inner.dtype() || !outer.is_contiguous() || outer.numel() == 0 || inner.numel() == 0) return false;
  const auto o = reinterpret_cast<std::uintptr_t>(outer.data()), i = reinterpret_cast<std::uintptr_t>(inner.data());
  return o <= i && i + inner.extent_bytes() <= o + outer.extent_bytes() && (i - o) % inner.itemsize() == 0;
}

}  // namespace

TEST_CASE("a skeleton from flatten stays compact until JSON is asked for; copies, moves and edits keep the document") {
  Tensor w = Tensor::from<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  Object obj{"torch", "Size", object_build::reduce, {Value::tuple({2, 3})}, {}, {}};
  Value tree = dict({{"model", dict({{"w", w}, {"tied", w}, {"row", w.view().narrow(0, 1, 1)}})},
                     {"meta", Value::list({1, 2.5, "s", Value(), true, Value(Bytes{{1, 2, 3}}), Value(std::move(obj))})},
                     {7, Value::tuple({})}});
  const FlatStateDict f = flatten(tree);
  REQUIRE(f.skeleton.tape() != nullptr);
  CHECK_FALSE(f.skeleton.is_null());
  const json doc = json::parse(f.skeleton.dump());
  CHECK(f.skeleton.json() == doc);
  CHECK(&f.skeleton.json() == &f.skeleton.json());  // built once
  CHECK(doc["root"]["dict"][0][1]["dict"][1][1] == json::parse(R"({"alias": "model.w"})"));

  // A copy shares the compact form, not the document; both give the same document and tree.
  Skeleton copy = f.skeleton;
  REQUIRE(copy.tape() == f.skeleton.tape());
  CHECK(copy == doc);
  CHECK(unflatten(f.tensors, copy) == tree);

  // Several threads asking for the document of one skeleton get the same one.
  const Skeleton shared = f.skeleton;
  std::vector<const json*> seen(4, nullptr);
  {
    std::vector<std::thread> threads;
    for (std::size_t i = 0; i < seen.size(); ++i) threads.emplace_back([&, i] { seen[i] = &shared.json(); });
    for (auto& t : threads) t.join();
  }
  for (const json* p : seen) CHECK(p == seen[0]);
  CHECK(*seen[0] == doc);

  // mutable_json drops the compact form: the edit is what unflatten reads from then on.
  Skeleton edited = f.skeleton;
  edited.mutable_json()["root"]["dict"][2][0] = 8;
  CHECK(edited.tape() == nullptr);
  CHECK(unflatten(f.tensors, edited)[8] == Value::tuple({}));
  CHECK(f.skeleton.json() == doc);  // the original is untouched

  // take_json moves the document out, whether or not it was built.
  Skeleton a = f.skeleton, b = f.skeleton;
  (void)b.json();
  CHECK(std::move(a).take_json() == doc);
  CHECK(std::move(b).take_json() == doc);
  CHECK(a.is_null());

  // Moved-from and default skeletons are null: a flat dict of the map.
  Skeleton moved = std::move(copy);
  CHECK(moved.tape() != nullptr);
  CHECK(copy.is_null());
  copy = moved;
  CHECK(copy == doc);
  const NamedTensors two = {{"x", w}, {"y", w}};
  CHECK(unflatten(two, Skeleton()) == dict({{"x", w}, {"y", w}}));

  // A skeleton made from JSON is that JSON.
  const Skeleton from_doc = doc;
  CHECK(from_doc.tape() == nullptr);
  CHECK(&from_doc.json() == &from_doc.json());
  CHECK(unflatten(f.tensors, from_doc) == tree);
}

TEST_CASE("property: the compact and JSON forms of a skeleton reject a map that does not match with the same error") {
  int checked = 0;
  for (std::uint64_t seed = 1; seed <= 1500; ++seed) {
    CAPTURE(seed);
    RandomTree gen(seed);
    const Value tree = gen.tree();
    const FlatStateDict f = flatten(tree);
    if (f.tensors.empty()) continue;
    const json doc = json::parse(f.skeleton.dump());
    std::mt19937_64 rng(seed);
    NamedTensors m = f.tensors;
    const std::size_t i = rng() % m.size();
    switch (rng() % 6) {
      case 0: m.erase(m.begin() + static_cast<std::ptrdiff_t>(i)); break;
      case 1: m.emplace_back("stray", m[i].second); break;
      case 2: m[i].first += "#x"; break;
      case 3: m.push_back(m[i]); break;  // a repeated name
      case 4: {
        const TensorView& v = m[i].second;
        m[i].second = TensorView::contiguous(v.dtype() == dtype::F32 ? dtype::I32 : dtype::F32, v.shape(), v.data(), v.owner());
        break;
      }
      default: {
        Tensor other = Tensor::zeros(m[i].second.dtype(), {static_cast<dim_t>(m[i].second.numel()) + 1});
        m[i].second = other.view();  // another shape (and a buffer the old views do not fit in)
        break;
      }
    }
    const std::string from_json = error_text([&] { (void)unflatten(m, doc); });
    const std::string from_tape = error_text([&] { (void)unflatten(m, f.skeleton); });
    REQUIRE(from_tape == from_json);
    checked += !from_json.empty();
  }
  CHECK(checked > 1000);
}

TEST_CASE("property: random trees round-trip exactly, in memory and through JSON text") {
  int trees = 0, with_alias = 0, with_view = 0, with_values = 0, with_object_value = 0, direct_dumps = 0;
  std::size_t leaves = 0;
  for (std::uint64_t seed = 1; seed <= 3000; ++seed) {
    CAPTURE(seed);
    RandomTree gen(seed);
    const Value tree = gen.tree();
    const FlatStateDict f = flatten(tree);
    const Value back = unflatten(f);
    REQUIRE(back == tree);
    // Every tensor leaf comes back as the very same view (aliases and views share memory again).
    const auto a = tensor_leaves(tree), b = tensor_leaves(back);
    REQUIRE(a.size() == b.size());
    for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(same_view(*a[i], *b[i]));
    leaves += a.size();
    // Through text, and with the tensors in another container.
    const std::string text = f.skeleton.dump();
    REQUIRE(skeleton_dump(f.skeleton) == text);  // through the document
    REQUIRE(f.skeleton.tape());
    if (const auto direct = detail::tape_dump(*f.skeleton.tape())) {  // straight from the compact form
      REQUIRE(*direct == text);
      ++direct_dumps;
    }
    const json parsed = json::parse(text);
    REQUIRE(f.skeleton.json() == parsed);  // the compact form's document
    REQUIRE(unflatten(f.tensors, parsed) == tree);
    REQUIRE(unflatten(f.tensors, Skeleton(parsed)) == tree);
    std::unordered_map<std::string, TensorView> hashed(f.tensors.begin(), f.tensors.end());
    REQUIRE(unflatten(hashed, parsed) == tree);
    // Names are unique; the map lists the skeleton's tensor nodes in order.
    std::set<std::string> unique;
    for (const auto& [n, v] : f.tensors) unique.insert(n);
    REQUIRE(unique.size() == f.tensors.size());
    const auto st = skeleton_tensors(f.skeleton);
    REQUIRE(st.size() == f.tensors.size());
    for (std::size_t i = 0; i < st.size(); ++i) {
      REQUIRE(st[i].name == f.tensors[i].first);
      REQUIRE(st[i].dtype == f.tensors[i].second.dtype());
      REQUIRE(st[i].shape == f.tensors[i].second.shape());
    }
    const auto al = skeleton_aliases(f.skeleton);
    REQUIRE(al.size() + f.tensors.size() == a.size());
    for (const auto& [n, t] : al) {
      REQUIRE_FALSE(unique.count(n));  // alias names never collide with tensor names
      REQUIRE(unique.count(t));
      unique.insert(n);
    }
    with_alias += !al.empty();
    with_view += f.skeleton.dump().find("view_of") != std::string::npos;
    // The compact form answers the listing questions as its document does.
    const auto values = skeleton_values(f.skeleton);
    REQUIRE(values == skeleton_values(parsed));
    REQUIRE(detail::may_hold_aliases(f.skeleton) == !al.empty());
    REQUIRE(detail::may_hold_aliases(parsed) == !al.empty());
    with_values += !values.empty();
    for (const auto& nv : values) with_object_value += nv.second.is_object();
    ++trees;
  }
  CHECK(trees == 3000);
  CHECK(with_alias > 500);  // the generator exercises aliasing
  CHECK(with_view > 300);
  CHECK(with_values > 1000);
  CHECK(with_object_value > 100);
  CHECK(direct_dumps > 1000);
  CHECK(leaves > 10000);
}

TEST_CASE("property: a tensor leaf is stored iff no earlier leaf is the same view or contains it aligned") {
  for (std::uint64_t seed = 10001; seed <= 12000; ++seed) {
    CAPTURE(seed);
    RandomTree gen(seed);
    const Value tree = gen.tree();
    const FlatStateDict f = flatten(tree);
    const auto a = tensor_leaves(tree);
    // Walk leaves and skeleton tensor nodes together: leaf i is a tensor node exactly when it
    // must be stored.
    std::vector<bool> is_tensor_node;
    detail::walk_skeleton(f.skeleton, [&](const detail::skeleton_cursor::event& e, const Path&, detail::skeleton_cursor&) {
      if (e.type != detail::skeleton_cursor::ev::leaf) return;
      if (e.node.kind == detail::snode::tensor) is_tensor_node.push_back(true);
      else if (e.node.kind == detail::snode::alias || e.node.kind == detail::snode::view) is_tensor_node.push_back(false);
    });
    REQUIRE(is_tensor_node.size() == a.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      bool shared = false;
      for (std::size_t j = 0; j < i && !shared; ++j)
        shared = a[i]->numel() > 0 && (same_view(*a[j], *a[i]) || contains_aligned(*a[j], *a[i]));
      CAPTURE(i);
      REQUIRE(is_tensor_node[i] == !shared);
    }
    // The naming rule: the dotted name when it is unique among tensor leaves and valid UTF-8,
    // else the quoted name; a `#k` suffix only when that is taken.
    std::vector<Path> paths;
    visit(tree, [&](const Path& p, const Value& n) {
      if (n.is_tensor()) paths.push_back(p);
    });
    std::map<std::string, int> count;
    for (const auto& p : paths) ++count[dotted(p)];
    std::size_t k = 0;
    for (std::size_t i = 0; i < paths.size(); ++i) {
      if (!is_tensor_node[i]) continue;
      const std::string d = dotted(paths[i]);
      const std::string want = count[d] == 1 && detail::valid_utf8(d) ? d : detail::quoted_name(paths[i]);
      const std::string& got = f.tensors[k++].first;
      CAPTURE(got);
      CAPTURE(want);
      REQUIRE((got == want || got.rfind(want + "#", 0) == 0));
      REQUIRE(detail::valid_utf8(got));
    }
  }
}

TEST_CASE("property: subsets of random trees unflatten to the selected leaves") {
  for (std::uint64_t seed = 20001; seed <= 21000; ++seed) {
    CAPTURE(seed);
    RandomTree gen(seed);
    const Value tree = gen.tree();
    const FlatStateDict f = flatten(tree);
    std::mt19937_64 rng(seed);
    const PathFilter keep = [&](const Path& p) { return (std::hash<std::string>{}(dotted(p)) ^ rng()) % 3 != 0; };
    // The filter is random but deterministic per path within one call sequence; a subset must
    // always unflatten and contain only kept (or promoted) data.
    const FlatStateDict s = select(f, keep);
    const Value sub = unflatten(s);
    // Every tensor in the subset is a view of some tensor leaf's memory in the original.
    for (const auto& [n, v] : s.tensors) {
      bool found = false;
      for (const TensorView* l : tensor_leaves(tree)) found = found || same_view(*l, v);
      REQUIRE(found);
    }
    (void)sub;
  }
}
