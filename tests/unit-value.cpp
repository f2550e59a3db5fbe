#include <doctest/doctest.h>

#include <statedict/statedict.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

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

TEST_CASE("dict operations agree with a reference model across index sizes, copies and erasures") {
  // Keys drawn from a small pool so that operations hit existing keys often; the pool mixes int
  // keys that share their low bits (multiples of 2^32, negatives) with strings, some of which print
  // like the ints. Every step checks every key of the pool against the model.
  std::mt19937_64 rng(20261126);
  for (int round = 0; round < 40; ++round) {
    std::vector<Key> pool;
    const int pool_size = 4 + static_cast<int>(rng() % 600);
    for (int i = 0; i < pool_size; ++i) {
      switch (rng() % 4) {
        case 0: pool.emplace_back(static_cast<std::int64_t>(rng() % 64) << 32); break;
        case 1: pool.emplace_back(-static_cast<std::int64_t>(rng() % 1000)); break;
        case 2: pool.emplace_back(std::to_string(rng() % 1000)); break;
        default: pool.emplace_back("layer." + std::to_string(rng() % 5000) + ".weight"); break;
      }
    }
    Dict d;
    std::vector<std::pair<Key, std::int64_t>> model;  // insertion-ordered
    auto model_find = [&](const Key& k) -> std::int64_t* {
      for (auto& [mk, mv] : model)
        if (mk == k) return &mv;
      return nullptr;
    };
    const int steps = 1 + static_cast<int>(rng() % 1500);
    for (int step = 0; step < steps; ++step) {
      const Key& k = pool[rng() % pool.size()];
      const auto v = static_cast<std::int64_t>(step);
      switch (rng() % 8) {
        case 0:
        case 1:
        case 2:
          d.set(k, v);
          if (auto* mv = model_find(k)) *mv = v; else model.emplace_back(k, v);
          break;
        case 3:
          if (model_find(k)) {
            CHECK_THROWS_AS(d.insert(k, v), key_error);
          } else {
            d.insert(k, v);
            model.emplace_back(k, v);
          }
          break;
        case 4: {
          const bool had = model_find(k) != nullptr;
          CHECK(d.erase(k) == had);
          std::erase_if(model, [&](const auto& e) { return e.first == k; });
          break;
        }
        case 5: {
          Value& slot = d[k];
          if (!model_find(k)) {
            CHECK(slot.is_none());
            slot = v;
            model.emplace_back(k, v);
          }
          break;
        }
        case 6: {
          Dict copy = d;  // a copy (no index yet) must answer like the original
          d = std::move(copy);
          break;
        }
        default: {
          Dict other;
          other = d;
          d = other;
          break;
        }
      }
    }
    REQUIRE(d.size() == model.size());
    for (std::size_t i = 0; i < model.size(); ++i) {
      CHECK(d.items()[i].first == model[i].first);
      CHECK(d.items()[i].second.as_int() == model[i].second);
    }
    for (const Key& k : pool) {
      const std::int64_t* mv = model_find(k);
      const Value* got = d.find(k);
      REQUIRE((got != nullptr) == (mv != nullptr));
      if (got) CHECK(got->as_int() == *mv);
    }
  }
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
