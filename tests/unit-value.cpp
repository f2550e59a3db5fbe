#include <doctest/doctest.h>

#include <statedict/statedict.hpp>

#include <cmath>
#include <limits>

using namespace statedict;

TEST_CASE("dict keeps insertion order and tells int keys from string keys") {
  Dict d;
  d.set(1, "int one");
  d.set("1", "string one");
  d.set("b", 2);
  d.set(1, "replaced");
  REQUIRE(d.size() == 3);
  CHECK(d.items()[0].first == Key(1));
  CHECK(d.at(1).as_string() == "replaced");
  CHECK(d.at("1").as_string() == "string one");
  CHECK_THROWS_AS((void)d.at(2), key_error);
  CHECK_THROWS_AS(d.insert("b", 3), key_error);
  CHECK(d.erase("1"));
  CHECK(d.size() == 2);
  CHECK(d.items()[1].first == Key("b"));
}

TEST_CASE("large dicts are indexed and stay consistent") {
  Dict d;
  for (int i = 0; i < 1000; ++i) d.set(i, i * 2);
  for (int i = 0; i < 1000; i += 7) CHECK(d.at(i).as_int() == i * 2);
  CHECK(d.erase(500));
  CHECK(d.find(500) == nullptr);
  CHECK(d.at(999).as_int() == 1998);
  d.set(500, -1);
  CHECK(d.items().back().first == Key(500));
}

TEST_CASE("value kinds and errors") {
  Value v = Value::tuple({1, 2.5, "s", nullptr, true, Bytes{{1, 2}}});
  CHECK(v.is_tuple());
  CHECK(v.at(0).as_int() == 1);
  CHECK(v.at(1).as_double() == 2.5);
  CHECK(v.at(2).as_string() == "s");
  CHECK(v.at(3).is_none());
  CHECK(v.at(4).as_bool());
  CHECK(v.at(5).as_bytes().data.size() == 2);
  try {
    (void)v.at(0).as_string();
    FAIL("expected a type_error");
  } catch (const type_error& e) {
    CHECK(e.code() == errors::value_kind);
    CHECK(std::string(e.what()) == "[statedict.type_error.110] expected str, found int");
  }
}

TEST_CASE("deep equality is structural, ordered, bitwise for floats and by value for tensors") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Value a = Dict{{"x", Value::list({1, nan})}, {"t", Tensor::from<float>({1, 2, 3, 4}, {2, 2})}};
  Value b = Dict{{"x", Value::list({1, nan})}, {"t", Tensor::from<float>({1, 2, 3, 4}, {2, 2})}};
  CHECK(a == b);
  Value c = Dict{{"t", Tensor::from<float>({1, 2, 3, 4}, {2, 2})}, {"x", Value::list({1, nan})}};
  CHECK_FALSE(a == c);  // order matters (OrderedDict semantics)
  CHECK_FALSE(Value(0.0) == Value(-0.0));
  CHECK_FALSE(Value::list({1}) == Value::tuple({1}));
  CHECK_FALSE(Value(Dict{{1, 1}}) == Value(Dict{{"1", 1}}));
  // A transposed view equals a contiguous tensor with the same row-major values.
  Tensor base = Tensor::from<float>({1, 2, 3, 4}, {2, 2});
  TensorView tr(dtype::F32, {2, 2}, {1, 2}, base.data(), {});
  CHECK(Value(tr) == Value(Tensor::from<float>({1, 3, 2, 4}, {2, 2})));
}

TEST_CASE("destroying and comparing a tree 200,000 levels deep does not overflow the stack") {
  constexpr int depth = 200000;
  auto build = [] {
    Value v = 1;
    for (int i = 0; i < depth; ++i) {
      // Built with moves only: an initializer list would copy (recursively) at every level.
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
    return v;
  };
  Value a = build();
  Value b = build();
  CHECK(a == b);
  a = Value();  // destroys the old tree iteratively
  CHECK(a.is_none());
}
