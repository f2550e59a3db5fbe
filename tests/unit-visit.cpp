// Visitors: pre-order walks with paths (object children included), skip / stop, in-place
// replacement, transform, fold, path lookup and the tree-relative inverse of `dotted`.
#include <doctest/doctest.h>

#include <statedict/statedict.hpp>

#include <string>
#include <vector>

using namespace statedict;

namespace {

Value sample() {
  Dict inner;
  inner.set("w", Tensor::from<float>({1, 2}, {2}));
  inner.set(7, "seven");
  Object ns{"argparse", "Namespace", object_build::newobj, {Value(1), Value("a")}, {}, {}};
  Dict st;
  st.set("lr", 0.5);
  ns.state.emplace_back(std::move(st));
  ns.items.emplace_back(Value::tuple({Value("k"), Value(2)}));
  Dict root;
  root.set("model", std::move(inner));
  root.set("list", Value::list({Value(10), Value::tuple({Value(11), Value()})}));
  root.set("ns", std::move(ns));
  root.set("empty", Dict{});
  return Value(std::move(root));
}

std::vector<std::string> names_of(const Value& v) {
  std::vector<std::string> out;
  visit(v, [&](const Path& p, const Value&) { out.push_back(dotted(p)); });
  return out;
}

}  // namespace

TEST_CASE("visit walks every node in pre-order with its path, object children included") {
  const Value v = sample();
  std::vector<std::string> names;
  std::vector<value_kind> kinds;
  visit(v, [&](const Path& p, const Value& n) {
    names.push_back(dotted(p));
    kinds.push_back(n.kind());
  });
  const std::vector<std::string> want = {"",          "model",      "model.w",        "model.7",    "list",
                                         "list.0",    "list.1",     "list.1.0",       "list.1.1",   "ns",
                                         "ns.args.0", "ns.args.1",  "ns.state",       "ns.state.lr", "ns.items.0",
                                         "ns.items.0.0", "ns.items.0.1", "empty"};
  CHECK(names == want);
  CHECK(kinds.front() == value_kind::dict);
  CHECK(kinds[2] == value_kind::tensor);
  CHECK(kinds[6] == value_kind::tuple);
  CHECK(kinds[9] == value_kind::object);
}

TEST_CASE("paths keep key types: int keys and list indices are ints, dict keys keep their kind") {
  Dict d;
  d.set(1, "int");
  d.set("1", "str");
  d.set("l", Value::list({Value(0)}));
  std::vector<Path> paths;
  visit(Value(std::move(d)), [&](const Path& p, const Value&) { paths.push_back(p); });
  REQUIRE(paths.size() == 5);
  CHECK(paths[1] == Path{Key(1)});
  CHECK(paths[2] == Path{Key("1")});
  CHECK(paths[4] == Path{Key("l"), Key(0)});
  CHECK(dotted(paths[1]) == dotted(paths[2]));  // why flatten needs a disambiguation rule
}

TEST_CASE("an object with several state values uses state.i paths") {
  Object o{"m", "C", object_build::reduce, {}, {Value(1), Value(2)}, {}};
  CHECK(names_of(Value(o)) == std::vector<std::string>{"", "state.0", "state.1"});
  Object one{"m", "C", object_build::reduce, {}, {Value(1)}, {}};
  CHECK(names_of(Value(one)) == std::vector<std::string>{"", "state"});
}

TEST_CASE("skip leaves a subtree out; stop ends the walk") {
  const Value v = sample();
  std::vector<std::string> names;
  visit(v, [&](const Path& p, const Value& n) {
    names.push_back(dotted(p));
    return n.is_object() || dotted(p) == "model" ? visit_control::skip : visit_control::descend;
  });
  CHECK(names == std::vector<std::string>{"", "model", "list", "list.0", "list.1", "list.1.0", "list.1.1", "ns", "empty"});
  names.clear();
  visit(v, [&](const Path& p, const Value&) {
    names.push_back(dotted(p));
    return dotted(p) == "list.0" ? visit_control::stop : visit_control::descend;
  });
  CHECK(names.back() == "list.0");
  CHECK(names.size() == 6);
  // skip at the root visits nothing else
  int count = 0;
  visit(v, [&](const Path&, const Value&) {
    ++count;
    return visit_control::skip;
  });
  CHECK(count == 1);
}

TEST_CASE("mutable visit may replace nodes; the replacement's children are visited") {
  Value v = sample();
  visit(v, [](const Path& p, Value& n) {
    if (n.is_int()) n = n.as_int() * 100;
    if (dotted(p) == "empty") n = Value::list({Value(1), Value(2)});
  });
  CHECK(v["list"].at(0).as_int() == 1000);
  CHECK(v["ns"].as_object().args[0].as_int() == 100);
  CHECK(v["empty"].as_list().size() == 2);
  CHECK(v["empty"].at(1).as_int() == 200);  // visited after the replacement
}

TEST_CASE("transform rebuilds a tree; a replacement ends the descent there") {
  const Value v = sample();
  const Value same = transform(v, [](const Path&, const Value&) { return std::optional<Value>(); });
  CHECK(same == v);
  int calls = 0;
  const Value t = transform(v, [&](const Path& p, const Value& n) -> std::optional<Value> {
    ++calls;
    if (n.is_tensor()) return Value("tensor:" + dotted(p));
    if (dotted(p) == "ns") return Value("object dropped");
    if (n.is_int()) return Value(n.as_int() + 1);
    return std::nullopt;
  });
  CHECK(t["model"]["w"].as_string() == "tensor:model.w");
  CHECK(t["ns"].as_string() == "object dropped");
  CHECK(t["list"].at(0).as_int() == 11);
  CHECK(t["list"].at(1).is_tuple());
  CHECK(t["list"].at(1).at(0).as_int() == 12);
  CHECK(t["empty"].as_dict().empty());
  CHECK(v["list"].at(0).as_int() == 10);  // the input is untouched
  CHECK(calls == 11);                     // 18 nodes, less ns's 7 descendants (never visited)
  // Replacing the root returns the replacement.
  CHECK(transform(v, [](const Path&, const Value&) { return std::optional<Value>(Value(3)); }) == Value(3));
}

TEST_CASE("fold accumulates over every node") {
  const Value v = sample();
  const int nodes = fold(v, 0, [](int acc, const Path&, const Value&) { return acc + 1; });
  CHECK(nodes == 18);
  const std::uint64_t elems = fold(v, std::uint64_t{0}, [](std::uint64_t acc, const Path&, const Value& n) {
    return acc + (n.is_tensor() ? n.as_tensor().numel() : 0);
  });
  CHECK(elems == 2);
  const std::size_t deepest =
      fold(v, std::size_t{0}, [](std::size_t acc, const Path& p, const Value&) { return std::max(acc, p.size()); });
  CHECK(deepest == 4);  // ns.items.0.1
}

TEST_CASE("find_path resolves every path visit reports, and nothing else") {
  const Value v = sample();
  visit(v, [&](const Path& p, const Value& n) {
    const Value* f = find_path(v, p);
    REQUIRE(f != nullptr);
    CHECK(f == &n);
  });
  CHECK(find_path(v, {Key("model"), Key("x")}) == nullptr);
  CHECK(find_path(v, {Key("list"), Key("0")}) == nullptr);  // a list index is an int
  CHECK(find_path(v, {Key("list"), Key(5)}) == nullptr);
  CHECK(find_path(v, {Key("list"), Key(-1)}) == nullptr);
  CHECK(find_path(v, {Key("ns"), Key("args")}) == nullptr);  // "args" needs an index
  CHECK(find_path(v, {Key("ns"), Key("kwargs"), Key(0)}) == nullptr);
  CHECK(find_path(v, {Key("model"), Key("w"), Key(0)}) == nullptr);  // below a leaf
  Value m = sample();
  Value* w = find_path(m, {Key("ns"), Key("state"), Key("lr")});
  REQUIRE(w != nullptr);
  *w = 1.5;
  CHECK(m["ns"].as_object().state[0]["lr"].as_double() == 1.5);
}

TEST_CASE("match_dotted and undotted invert dotted names against a tree") {
  Dict d;
  d.set("a.b", Dict{{"c", 1}});
  Dict a;
  a.set("b.c", 2);
  a.set("b", Dict{{"c", 3}});
  d.set("a", std::move(a));
  d.set(1, "int");
  d.set("1", "str");
  d.set("x", Value::list({Value(5), Value(6)}));
  const Value v(std::move(d));
  const auto m = match_dotted(v, "a.b.c");
  REQUIRE(m.size() == 3);  // three paths print alike, reported in pre-order
  CHECK(m[0] == Path{Key("a.b"), Key("c")});
  CHECK(m[1] == Path{Key("a"), Key("b.c")});
  CHECK(m[2] == Path{Key("a"), Key("b"), Key("c")});
  CHECK_FALSE(undotted(v, "a.b.c").has_value());
  CHECK(match_dotted(v, "1").size() == 2);
  CHECK_FALSE(undotted(v, "1").has_value());
  CHECK(undotted(v, "x.1") == Path{Key("x"), Key(1)});
  CHECK(match_dotted(v, "a.b").size() == 2);  // the key "a.b", and a -> b
  CHECK(undotted(v, "a") == Path{Key("a")});
  CHECK(match_dotted(v, "x.01").empty());
  CHECK(match_dotted(v, "x.1.").empty());
  CHECK(match_dotted(v, "nothing").empty());
  CHECK(undotted(v, "") == Path{});
  // Every node of the sample resolves back to itself by its dotted name when that name is unique.
  const Value s = sample();
  visit(s, [&](const Path& p, const Value&) {
    auto back = undotted(s, dotted(p));
    REQUIRE(back.has_value());
    CHECK(*back == p);
  });
}

TEST_CASE("an empty string key prints as an empty segment") {
  Dict inner;
  inner.set("", 1);
  Dict d;
  d.set("", std::move(inner));
  const Value v(std::move(d));
  // "" (root), "" (key ""), "." (key "" then key "")
  CHECK(names_of(v) == std::vector<std::string>{"", "", "."});
  CHECK(match_dotted(v, "").size() == 2);
  CHECK(undotted(v, ".") == Path{Key(""), Key("")});
}

TEST_CASE("visit, transform, fold, copy_tree and find_path work on a tree 200,000 levels deep") {
  constexpr int depth = 200000;
  Value v = Tensor::from<float>({1}, {1});
  for (int i = 0; i < depth; ++i) {
    if (i % 3 == 0) {
      List l;
      l.push_back(std::move(v));
      v = Value::list(std::move(l));
    } else if (i % 3 == 1) {
      Dict d;
      d.set("k", std::move(v));
      v = std::move(d);
    } else {
      Object o{"m", "C", object_build::reduce, {}, {}, {}};
      o.args.push_back(std::move(v));
      v = std::move(o);
    }
  }
  std::size_t nodes = 0, max_path = 0;
  Path leaf;
  visit(v, [&](const Path& p, const Value& n) {
    ++nodes;
    max_path = std::max(max_path, p.size());
    if (n.is_tensor()) leaf = p;
  });
  CHECK(nodes == depth + 1);
  CHECK(max_path == depth + depth / 3);  // objects contribute two keys each
  const Value* found = find_path(v, leaf);
  REQUIRE(found != nullptr);
  CHECK(found->is_tensor());
  const int tensors = fold(v, 0, [](int acc, const Path&, const Value& n) { return acc + (n.is_tensor() ? 1 : 0); });
  CHECK(tensors == 1);
  const Value t = transform(v, [](const Path&, const Value& n) -> std::optional<Value> {
    if (n.is_tensor()) return Value(42);
    return std::nullopt;
  });
  CHECK(find_path(t, leaf)->as_int() == 42);
  const Value c = copy_tree(v);
  CHECK(c == v);
  Value m = copy_tree(v);
  visit(m, [](const Path&, Value& n) {
    if (n.is_tensor()) n = 7;
  });
  CHECK(find_path(m, leaf)->as_int() == 7);
}
