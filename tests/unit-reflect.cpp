// reflect.hpp: structs <-> Value, field names (Boost.Describe and the extractor), error paths.
#include <doctest/doctest.h>

#include <statedict/reflect.hpp>
#include <statedict/statedict.hpp>

#include <boost/describe/class.hpp>

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "test_util.hpp"

using namespace statedict;

namespace demo {
enum class mode : std::uint8_t { train = 1, eval = 2 };

struct Optim {
  double lr;
  std::array<double, 2> betas;
  std::optional<std::int64_t> step;
  bool amsgrad;
};

struct Layer {
  TensorView weight;
  std::optional<TensorView> bias;
};

struct Checkpoint {
  std::vector<Layer> layers;
  Optim optim;
  std::map<std::string, double> metrics;
  std::map<std::int64_t, std::string> names_by_id;
  std::string note;
  mode how;
  std::uint8_t version;
  float scale;
  std::pair<int, std::string> tag;
  std::tuple<std::int16_t, double, std::vector<std::string>> extra;
  Bytes blob;
  Value anything;
  Tensor owned;
};

/// Described with Boost.Describe: names come from the macro.
struct Described {
  int alpha;
  std::string beta;
};
BOOST_DESCRIBE_STRUCT(Described, (), (alpha, beta))

/// A class with private members, described from inside.
class Hidden {
 public:
  Hidden() = default;
  Hidden(int a, double b) : a_(a), b_(b) {}
  [[nodiscard]] int a() const { return a_; }
  [[nodiscard]] double b() const { return b_; }

 private:
  int a_ = 0;
  double b_ = 0;
  BOOST_DESCRIBE_CLASS(Hidden, (), (), (), (a_, b_))
};

/// Aggregates with a base: PFR refuses them, Boost.Describe lists the base's members first.
struct Base {
  int id;
};
struct Derived : Base {
  std::string label;
};
BOOST_DESCRIBE_STRUCT(Base, (), (id))
BOOST_DESCRIBE_STRUCT(Derived, (Base), (label))

struct Frozen {
  const int answer;
  const std::string why;
};

template <class T>
struct Box {
  T content;
  std::map<std::string, std::pair<int, long>> index;
};

/// A type the user maps by hand.
struct Celsius {
  double degrees;
  Celsius() = default;
  explicit Celsius(double d) : degrees(d) {}
};

struct Weather {
  Celsius temperature;
  std::vector<Celsius> forecast;
};
}  // namespace demo

template <>
struct statedict::value_codec<demo::Celsius> {
  static Value to(const demo::Celsius& c) { return Value(std::to_string(c.degrees) + "C"); }
  static demo::Celsius from(const Value& v) {
    const std::string& s = v.as_string();  // throws errors::value_kind for a non-str
    if (s.empty() || s.back() != 'C') throw_error(errors::reflect_kind, "expected a temperature like '21.5C'");
    return demo::Celsius(std::stod(s.substr(0, s.size() - 1)));
  }
};

namespace {
struct Anonymous {
  int first_field;
  double second;
};

using statedict_test::error_of;

template <class F>
std::string error_text(F&& f) {
  try {
    f();
  } catch (const error& e) {
    return e.what();
  }
  return "no error";
}

demo::Checkpoint sample() {
  demo::Checkpoint c{};
  c.layers.push_back({Tensor::from<float>({1, 2, 3, 4}, {2, 2}), std::nullopt});
  c.layers.push_back({Tensor::from<float>({5, 6}, {2}), TensorView(Tensor::from<float>({0.5F}, {1}))});
  c.optim = {1e-3, {0.9, 0.999}, 7, false};
  c.metrics = {{"loss", 0.25}, {"acc", 0.9}};
  c.names_by_id = {{3, "three"}, {-1, "minus one"}};
  c.note = "hello";
  c.how = demo::mode::eval;
  c.version = 200;
  c.scale = 0.1F;
  c.tag = {4, "four"};
  c.extra = {-5, 2.5, {"x", "y"}};
  c.blob = Bytes{{0, 1, 255}};
  c.anything = Value::list({1, "two", nullptr});
  c.owned = Tensor::from<double>({1.5, -2.5}, {2});
  return c;
}
}  // namespace

static_assert(field_names<demo::Optim>() == std::array<std::string_view, 4>{"lr", "betas", "step", "amsgrad"});
static_assert(field_names<demo::Described>() == std::array<std::string_view, 2>{"alpha", "beta"});
static_assert(field_names<demo::Hidden>() == std::array<std::string_view, 2>{"a_", "b_"});
static_assert(field_names<Anonymous>() == std::array<std::string_view, 2>{"first_field", "second"});
static_assert(field_names<demo::Box<demo::Box<int>>>() == std::array<std::string_view, 2>{"content", "index"});

TEST_CASE("a nested struct becomes a dict of its fields, in declaration order, and comes back equal") {
  const demo::Checkpoint c = sample();
  const Value v = to_value(c);
  REQUIRE(v.is_dict());
  std::vector<std::string> keys;
  for (const auto& [k, _] : v.as_dict()) keys.push_back(k.as_string());
  CHECK(keys == std::vector<std::string>{"layers", "optim", "metrics", "names_by_id", "note", "how", "version", "scale",
                                         "tag", "extra", "blob", "anything", "owned"});
  // Kinds as a Python state dict would have them.
  CHECK(v["layers"].is_list());
  CHECK(v["layers"].at(0)["weight"].is_tensor());
  CHECK(v["layers"].at(0)["bias"].is_none());
  CHECK(v["optim"]["lr"].as_double() == 1e-3);
  CHECK(v["optim"]["betas"].is_tuple());
  CHECK(v["optim"]["step"].as_int() == 7);
  CHECK(v["optim"]["amsgrad"].as_bool() == false);
  CHECK(v["names_by_id"].as_dict().begin()->first == Key(-1));  // std::map order
  CHECK(v["how"].as_int() == 2);
  CHECK(v["version"].as_int() == 200);
  CHECK(v["scale"].as_double() == static_cast<double>(0.1F));
  CHECK(v["tag"].is_tuple());
  CHECK(v["extra"].at(2).at(1).as_string() == "y");
  CHECK(v["blob"].as_bytes().data.size() == 3);
  CHECK(v["anything"] == Value::list({1, "two", nullptr}));

  const auto back = from_value<demo::Checkpoint>(v);
  CHECK(to_value(back) == v);
  CHECK(back.optim.betas[1] == 0.999);
  CHECK(back.names_by_id.at(3) == "three");
  CHECK(back.how == demo::mode::eval);
  CHECK(std::get<2>(back.extra)[0] == "x");
  CHECK(back.layers[1].bias.has_value());
  CHECK(back.owned.values<double>()[1] == -2.5);
}

TEST_CASE("TensorView members are shared, Tensor members are copied when read") {
  const demo::Checkpoint c = sample();
  const Value v = to_value(c);
  CHECK(v["layers"].at(0)["weight"].as_tensor().data() == c.layers[0].weight.data());
  CHECK(v["owned"].as_tensor().data() == c.owned.data());
  const auto back = from_value<demo::Checkpoint>(v);
  CHECK(back.layers[0].weight.data() == c.layers[0].weight.data());
  CHECK(back.owned.data() != c.owned.data());
  CHECK(equal_bytes(back.owned, c.owned));
}

TEST_CASE("a PyTorch optimizer param group reads into a struct (ints where floats are declared, a list for a tuple)") {
  // As torch.optim.Adam's state_dict()["param_groups"][0] unpickles: weight_decay is the int 0.
  Value group = Dict{{"lr", 0.001}, {"betas", Value::tuple({0.9, 0.999})}, {"weight_decay", 0}, {"amsgrad", false}};
  struct Group {
    double lr;
    std::array<double, 2> betas;
    double weight_decay;
    bool amsgrad;
  };
  const auto g = from_value<Group>(group);
  CHECK(g.weight_decay == 0.0);
  CHECK(g.betas[0] == 0.9);
  group.as_dict().set("betas", Value::list({0.8, 0.99}));
  CHECK(from_value<Group>(group).betas[0] == 0.8);
}

TEST_CASE("described structs and classes use their descriptions") {
  const Value v = to_value(demo::Described{3, "x"});
  CHECK(v == Value(Dict{{"alpha", 3}, {"beta", "x"}}));
  CHECK(from_value<demo::Described>(v).beta == "x");
  const Value h = to_value(demo::Hidden(4, 0.5));
  CHECK(h == Value(Dict{{"a_", 4}, {"b_", 0.5}}));
  const auto back = from_value<demo::Hidden>(h);
  CHECK(back.a() == 4);
  CHECK(back.b() == 0.5);
}

TEST_CASE("described bases come first; const members of aggregates are filled by from_value") {
  demo::Derived d;
  d.id = 9;
  d.label = "nine";
  const Value v = to_value(d);
  CHECK(v == Value(Dict{{"id", 9}, {"label", "nine"}}));
  CHECK(from_value<demo::Derived>(v).id == 9);
  const auto f = from_value<demo::Frozen>(Value(Dict{{"answer", 42}, {"why", "because"}}));
  CHECK(f.answer == 42);
  CHECK(to_value(f)["why"].as_string() == "because");
}

TEST_CASE("structs in an unnamed namespace, local to a function, and templates get their names") {
  CHECK(to_value(Anonymous{1, 2.0}) == Value(Dict{{"first_field", 1}, {"second", 2.0}}));
  struct Local {
    int inner_name;
  };
  CHECK(to_value(Local{5}) == Value(Dict{{"inner_name", 5}}));
  demo::Box<demo::Box<int>> b{{7, {}}, {{"k", {1, 2}}}};
  const Value v = to_value(b);
  CHECK(v["content"]["content"].as_int() == 7);
  CHECK(from_value<demo::Box<demo::Box<int>>>(v).index.at("k").second == 2);
}

TEST_CASE("errors name the field path and what was expected") {
  Value v = to_value(sample());
  {
    Value bad = v;
    bad["optim"].as_dict().set("betas", "0.9, 0.999");
    const std::string text = error_text([&] { (void)from_value<demo::Checkpoint>(bad); });
    CHECK(text == "[statedict.type_error.240] field 'optim.betas': expected tuple (or list) of 2, found str");
  }
  {
    Value bad = v;
    bad["optim"].as_dict().set("betas", Value::tuple({0.9, 0.99, 0.999}));
    CHECK(error_of([&] { (void)from_value<demo::Checkpoint>(bad); }) == 244);
  }
  {
    Value bad = v;
    bad["layers"].as_list()[1].as_dict().set("bias", 3);
    const std::string text = error_text([&] { (void)from_value<demo::Checkpoint>(bad); });
    CHECK(text == "[statedict.type_error.240] field 'layers.1.bias': expected tensor, found int");
  }
  {
    Value bad = v;
    bad["optim"].as_dict().erase("lr");
    const std::string text = error_text([&] { (void)from_value<demo::Checkpoint>(bad); });
    CHECK(text == "[statedict.key_error.241] field 'optim': missing field 'lr' (float (or int))");
  }
  {
    Value bad = v;
    bad["optim"].as_dict().erase("step");  // optional: missing reads as nullopt
    CHECK_FALSE(from_value<demo::Checkpoint>(bad).optim.step.has_value());
  }
  {
    Value bad = v;
    bad["optim"].as_dict().set("lrr", 0.1);
    const std::string text = error_text([&] { (void)from_value<demo::Checkpoint>(bad); });
    CHECK(text ==
          "[statedict.key_error.242] field 'optim': key 'lrr' names no field (fields: lr, betas, step, amsgrad)");
    from_value_options lenient;
    lenient.ignore_unknown_fields = true;
    CHECK(from_value<demo::Checkpoint>(bad, lenient).optim.lr == 1e-3);
  }
  {
    Value bad = v;
    bad.as_dict().set("version", 256);
    const std::string text = error_text([&] { (void)from_value<demo::Checkpoint>(bad); });
    CHECK(text == "[statedict.type_error.243] field 'version': 256 is outside [0, 255]");
  }
  {
    Value bad = v;
    bad.as_dict().set("scale", 1e300);
    CHECK(error_of([&] { (void)from_value<demo::Checkpoint>(bad); }) == 243);
  }
  {
    Value bad = v;
    bad.as_dict().set("version", true);  // a bool is not an int here
    CHECK(error_of([&] { (void)from_value<demo::Checkpoint>(bad); }) == 240);
  }
  {
    Value bad = v;
    bad["metrics"].as_dict().set(5, 1.0);
    const std::string text = error_text([&] { (void)from_value<demo::Checkpoint>(bad); });
    CHECK(text == "[statedict.type_error.245] field 'metrics.5': key 5 is an int; this map has str keys");
  }
  {
    Value bad = v;
    bad["metrics"].as_dict().set("odd\nname", "high");
    const std::string text = error_text([&] { (void)from_value<demo::Checkpoint>(bad); });
    CHECK(text == "[statedict.type_error.240] field 'metrics.odd\\x0aname': expected float (or int), found str");
  }
  CHECK(error_text([] { (void)from_value<demo::Optim>(Value(3)); }) ==
        "[statedict.type_error.240] top level: expected dict (a struct's fields), found int");
}

TEST_CASE("to_value refuses integers a state dict cannot hold") {
  struct Big {
    std::uint64_t n;
  };
  CHECK(error_text([] { (void)to_value(Big{1ULL << 63}); }) ==
        "[statedict.type_error.243] field 'n': 9223372036854775808 does not fit a state dict int (int64)");
  CHECK(to_value(Big{(1ULL << 63) - 1})["n"].as_int() == INT64_MAX);
}

TEST_CASE("integer map keys are range-checked and must be ints") {
  struct ByByte {
    std::map<std::uint8_t, int> m;
  };
  CHECK(from_value<ByByte>(Value(Dict{{"m", Dict{{200, 1}}}})).m.at(200) == 1);
  CHECK(error_text([] { (void)from_value<ByByte>(Value(Dict{{"m", Dict{{300, 1}}}})); }) ==
        "[statedict.type_error.243] field 'm.300': key 300 is outside [0, 255]");
  CHECK(error_text([] { (void)from_value<ByByte>(Value(Dict{{"m", Dict{{"7", 1}}}})); }) ==
        "[statedict.type_error.245] field 'm.7': key '7' is a str; this map has int keys");
  struct ByU64 {
    std::map<std::uint64_t, int> m;
  };
  CHECK(error_text([] { (void)to_value(ByU64{{{~0ULL, 1}}}); }) ==
        "[statedict.type_error.243] field 'm': map key 18446744073709551615 does not fit a state dict int (int64)");
}

TEST_CASE("custom codecs: used for their type, and their errors get the field path") {
  demo::Weather w{demo::Celsius(21.5), {demo::Celsius(1), demo::Celsius(-3)}};
  const Value v = to_value(w);
  CHECK(v["forecast"].at(1).as_string() == "-3.000000C");
  CHECK(from_value<demo::Weather>(v).forecast[1].degrees == -3.0);
  Value bad = v;
  bad["forecast"].as_list()[0] = "hot";
  CHECK(error_text([&] { (void)from_value<demo::Weather>(bad); }) ==
        "[statedict.type_error.240] field 'forecast.0': expected a temperature like '21.5C'");
}
