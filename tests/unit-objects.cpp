// Unit tests: objects as data. Reading: numpy arrays, scalars and dtypes (every pickled form),
// copyreg's protocol-1 objects, the refusals that stay; writing: objects of classes outside
// torch's weights_only list pickled as their data, skeletons rewritten the same way, and how
// inspect spells objects (value_repr).
#include <doctest/doctest.h>

#include <statedict/core/flatten.hpp>
#include <statedict/core/value_json.hpp>
#include <statedict/formats/objects.hpp>
#include <statedict/formats/registry.hpp>
#include <statedict/formats/torch.hpp>
#include <statedict/io/pickle_read.hpp>
#include <statedict/io/pickle_write.hpp>
#include <statedict/io/torch_file.hpp>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

using namespace statedict;

namespace {

std::string operator""_b(const char* s, std::size_t n) { return std::string(s, n); }

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
std::string str(std::string_view s) { return "X" + u32(static_cast<std::uint32_t>(s.size())) + std::string(s); }
std::string glob(std::string_view m, std::string_view n) { return "c" + std::string(m) + "\n" + std::string(n) + "\n"; }
std::string bin(std::string_view b) { return "B" + u32(static_cast<std::uint32_t>(b.size())) + std::string(b); }
std::string ints(const std::vector<int>& v) {
  std::string s = "(";
  for (int x : v) s += "J" + u32(static_cast<std::uint32_t>(x));
  return s + "t";
}

/// numpy.dtype(code, False, True) with its BUILD state (version 3, byte order).
std::string np_dtype(std::string_view code, std::string_view order) {
  return glob("numpy", "dtype") + str(code) + "\x89\x88\x87R(K\x03" + str(order) + "NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"_b;
}
/// _reconstruct(numpy.ndarray, (0,), b'b') + BUILD((1, shape, dtype, fortran, data)), `data` a
/// pickled bytes-like value.
std::string ndarray(std::string_view core, const std::vector<int>& shape, const std::string& dt, bool fortran, const std::string& data,
                    std::string_view cls = "ndarray") {
  return glob(std::string(core) + ".multiarray", "_reconstruct") + glob("numpy", cls) + "K\x00\x85"_b + bin("b") + "\x87R" +
         "(K\x01" + ints(shape) + dt + (fortran ? "\x88" : "\x89") + data + "tb";
}
std::string floats(std::initializer_list<float> v) {
  std::string s;
  for (float f : v) s.append(reinterpret_cast<const char*>(&f), sizeof f);
  return s;
}

/// Loads `p` with its bytes kept alive (so in-place views are allowed), or not.
struct Loaded {
  std::shared_ptr<std::string> bytes;
  Value value;
};
Loaded load(const std::string& p, bool keep_input = true, pickle::options o = {}) {
  Loaded l{std::make_shared<std::string>(p), {}};
  if (keep_input) o.input_owner = l.bytes;
  l.value = pickle::load(std::span<const std::byte>(reinterpret_cast<const std::byte*>(l.bytes->data()), l.bytes->size()), o).value;
  return l;
}
bool inside(const Loaded& l, const TensorView& t) {
  const auto* b = reinterpret_cast<const std::byte*>(l.bytes->data());
  return t.data() >= b && t.data() < b + l.bytes->size();
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
void expect_error_p(const std::string& p, const error_id& id, pickle::options o = {}) {
  expect_error([&] { (void)load(p, true, o); }, id);
}

const std::string P3 = "\x80\x03";

}  // namespace

TEST_CASE("numpy ndarray: _reconstruct + BUILD becomes a tensor, in place when it can be") {
  const std::string f32 = P3 + ndarray("numpy.core", {2, 3}, np_dtype("f4", "<"), false, bin(floats({0, 1, 2, 3, 4, 5}))) + ".";
  const Loaded a = load(f32);
  const TensorView& t = a.value.as_tensor();
  CHECK(t.dtype() == dtype::F32);
  CHECK(t.shape() == shape_t{2, 3});
  CHECK(t.strides() == shape_t{3, 1});
  CHECK(t.load<float>(4) == 4.F);
  CHECK(inside(a, t));  // a view of the pickle's bytes
  const Loaded copied = load(f32, false);
  CHECK_FALSE(inside(copied, copied.value.as_tensor()));
  CHECK(copied.value.as_tensor().load<float>(5) == 5.F);

  // numpy 2's module path; column-major; version-less 4-item state
  const Loaded f = load(P3 + ndarray("numpy._core", {2, 3}, np_dtype("f4", "<"), true, bin(floats({0, 1, 2, 3, 4, 5}))) + ".");
  CHECK(f.value.as_tensor().strides() == shape_t{1, 2});
  CHECK(f.value.as_tensor().load<float>(3) == 1.F);
  CHECK(f.value.as_tensor().load<float>(1) == 2.F);
  const std::string four = glob("numpy.core.multiarray", "_reconstruct") + glob("numpy", "ndarray") + "K\x00\x85"_b + bin("b") + "\x87R(" +
                           ints({2}) + np_dtype("f4", "<") + "\x89" + bin(floats({7, 8})) + "tb";
  CHECK(load(P3 + four + ".").value.as_tensor().load<float>(1) == 8.F);

  // Big-endian: copied and swapped per element; complex per component; one-byte types untouched.
  const Loaded be = load(P3 + ndarray("numpy.core", {2}, np_dtype("i4", ">"), false, bin("\x00\x00\x01\x02\xff\xff\xff\xfe"_b)) + ".");
  CHECK_FALSE(inside(be, be.value.as_tensor()));
  CHECK(be.value.as_tensor().load<std::int32_t>(0) == 0x102);
  CHECK(be.value.as_tensor().load<std::int32_t>(1) == -2);
  const Loaded c = load(P3 + ndarray("numpy.core", {1}, np_dtype("c8", ">"), false, bin("\x3f\x80\x00\x00\x40\x00\x00\x00"_b)) + ".");
  float re = 0, im = 0;
  std::memcpy(&re, c.value.as_tensor().data(), 4);
  std::memcpy(&im, c.value.as_tensor().data() + 4, 4);
  CHECK(re == 1.F);
  CHECK(im == 2.F);
  const Loaded b = load(P3 + ndarray("numpy.core", {3}, np_dtype("b1", "|"), false, bin("\x01\x00\x01"_b)) + ".");
  CHECK(b.value.as_tensor().dtype() == dtype::BOOL);
  CHECK(inside(b, b.value.as_tensor()));

  // Every element type numpy and statedict share.
  const std::pair<const char*, dtype> types[] = {{"i1", dtype::I8},   {"i2", dtype::I16}, {"i8", dtype::I64}, {"u1", dtype::U8},
                                                 {"u2", dtype::U16},  {"u4", dtype::U32}, {"u8", dtype::U64}, {"f2", dtype::F16},
                                                 {"f8", dtype::F64},  {"c16", dtype::C128}};
  for (const auto& [code, type] : types) {
    const std::string data(itemsize(type), '\x01');
    CHECK(load(P3 + ndarray("numpy.core", {1}, np_dtype(code, "<"), false, bin(data)) + ".").value.as_tensor().dtype() == type);
  }

  // 0-d, empty (protocol 2's bytes()), and protocol 2's _codecs.encode(latin-1 str) data.
  const Loaded scalar = load(P3 + ndarray("numpy.core", {}, np_dtype("i8", "<"), false, bin("\x05\0\0\0\0\0\0\0"_b)) + ".");
  CHECK(scalar.value.as_tensor().rank() == 0);
  CHECK(scalar.value.as_tensor().load<std::int64_t>(0) == 5);
  const Loaded empty = load("\x80\x02" + ndarray("numpy.core", {0, 3}, np_dtype("f4", "<"), false, glob("__builtin__", "bytes") + ")R") + ".");
  CHECK(empty.value.as_tensor().numel() == 0);
  CHECK(empty.value.as_tensor().data() != nullptr);
  // Empty, with dimensions whose product is far beyond int64: no element, no stride to compute.
  const Loaded wide = load(P3 + ndarray("numpy.core", {0, 0x7fffffff, 0x7fffffff, 0x7fffffff}, np_dtype("f8", "<"), true, bin("")) + ".");
  CHECK(wide.value.as_tensor().numel() == 0);
  const std::string latin = glob("_codecs", "encode") + str("\x00\x00\xc2\x80?"_b) + str("latin1") + "\x86R";  // 1.0f = 00 00 80 3f
  CHECK(load("\x80\x02" + ndarray("numpy.core", {1}, np_dtype("f4", "<"), false, latin) + ".").value.as_tensor().load<float>(0) == 1.F);
  // A Python 2 str as the data: its bytes (as latin-1 code points once decoded).
  CHECK(load("\x80\x02" + ndarray("numpy.core", {1}, np_dtype("i4", "<"), false, "U\x04\x01\x00\x00\x00"_b) + ".").value.as_tensor().load<std::int32_t>(0) == 1);
}

TEST_CASE("numpy: what stays an object, and what is an error") {
  // Object arrays, strings, records: the array stays an object (its call and state, as data).
  const Loaded obj = load(P3 + ndarray("numpy.core", {1}, np_dtype("O8", "|"), false, "(K\x01l") + ".");
  REQUIRE(obj.value.is_object());
  CHECK(obj.value.as_object().qualified() == "numpy.core.multiarray._reconstruct");
  CHECK(obj.value.as_object().state.size() == 1);
  const std::string record = glob("numpy", "dtype") + str("V8") + "\x89\x88\x87R(K\x03" + str("|") + "N(" + str("a") + "t}NJ\x08\0\0\0J\x01\0\0\0K\x00tb"_b;
  CHECK(load(P3 + ndarray("numpy.core", {1}, record, false, bin("12345678")) + ".").value.is_object());
  // ndarray subclasses (np.matrix) stay objects too.
  CHECK(load(P3 + ndarray("numpy.core", {1}, np_dtype("f4", "<"), false, bin(floats({1})), "matrix") + ".").value.is_object());

  // What numpy itself refuses.
  expect_error_p(P3 + ndarray("numpy.core", {2}, np_dtype("f4", "<"), false, bin(floats({1}))) + ".", errors::pk_bad_numpy);
  expect_error_p(P3 + ndarray("numpy.core", {-1}, np_dtype("f4", "<"), false, bin("")) + ".", errors::pk_bad_numpy);
  expect_error_p(P3 + ndarray("numpy.core", {1}, np_dtype("f4", "<"), false, "(K\x01l") + ".", errors::pk_bad_numpy);
  expect_error_p(P3 + ndarray("numpy.core", std::vector<int>(65, 1), np_dtype("f4", "<"), false, bin(floats({1}))) + ".", errors::pk_bad_numpy);
  const std::string head = glob("numpy.core.multiarray", "_reconstruct") + glob("numpy", "ndarray") + "K\x00\x85"_b + bin("b") + "\x87R";
  expect_error_p(P3 + head + "K\x01" "b.", errors::pk_bad_numpy);                               // state not a tuple
  expect_error_p(P3 + head + "(K\x01K\x02t" "b.", errors::pk_bad_numpy);                         // too short
  expect_error_p(P3 + head + "(" + str("v") + ints({1}) + np_dtype("f4", "<") + "\x89" + bin(floats({1})) + "tb.", errors::pk_bad_numpy);
  expect_error_p(P3 + head + "(K\x01" + ints({1}) + np_dtype("f4", "<") + str("F") + bin(floats({1})) + "tb.", errors::pk_bad_numpy);
  // A 2^62-element shape: checked arithmetic, never an allocation.
  expect_error([&] { (void)load(P3 + ndarray("numpy.core", {0x40000000, 0x40000000, 0x40000000}, np_dtype("f8", "<"), false, bin("")) + "."); },
               errors::overflow);

  // torch.load(weights_only=True) refuses numpy: so does the strict mode.
  pickle::options strict;
  strict.keep_unknown_objects = false;
  expect_error_p(P3 + ndarray("numpy.core", {1}, np_dtype("f4", "<"), false, bin(floats({1}))) + ".", errors::pk_forbidden_global, strict);
}

TEST_CASE("numpy: protocol 5's _frombuffer and scalars, read in place and from values alike") {
  const std::string buf = "\x96" + u64(8) + floats({1.5F, -2.F});
  const std::string fb = "\x80\x05" + glob("numpy._core.numeric", "_frombuffer") + "(" + buf + np_dtype("f4", "<") + ints({2}) + str("C") + "tR.";
  const Loaded a = load(fb);
  CHECK(a.value.as_tensor().load<float>(1) == -2.F);
  CHECK(inside(a, a.value.as_tensor()));
  const std::string fortran = "\x80\x05" + glob("numpy.core.numeric", "_frombuffer") + "(\x96" + u64(16) + floats({0, 1, 2, 3}) +
                              np_dtype("f4", "<") + ints({2, 2}) + str("F") + "tR.";
  CHECK(load(fortran).value.as_tensor().load<float>(1) == 2.F);
  // The same calls through the general form (arguments as Values, bytes copied) give the same.
  pickle::Registry general = pickle::Registry::weights_only();
  general.add("numpy._core.numeric._frombuffer", pickle::Rule{pickle::Rule::kind::function, pickle::detail::frombuffer_call, {}, {}, true});
  general.add("numpy.core.multiarray.scalar", pickle::Rule{pickle::Rule::kind::function, pickle::detail::scalar_call, {}, {}, true});
  pickle::options go;
  go.registry = &general;
  const Loaded g = load(fb, true, go);
  CHECK(g.value.as_tensor().load<float>(0) == 1.5F);
  CHECK_FALSE(inside(g, g.value.as_tensor()));
  expect_error_p("\x80\x05" + glob("numpy._core.numeric", "_frombuffer") + "(" + buf + np_dtype("f4", "<") + ints({2}) + str("K") + "tR.",
                 errors::pk_bad_numpy, go);
  expect_error_p("\x80\x05" + glob("numpy._core.numeric", "_frombuffer") + "(" + buf + np_dtype("f4", "<") + ints({3}) + str("C") + "tR.",
                 errors::pk_bad_numpy);
  // A dtype statedict has no tensor for: the call stays, as data.
  CHECK(load("\x80\x05" + glob("numpy._core.numeric", "_frombuffer") + "(" + buf + np_dtype("M8", "<") + ints({1}) + str("C") + "tR.")
            .value.as_object().name == "_frombuffer");

  // Scalars: dtype and the element's bytes.
  const std::string sc = P3 + glob("numpy.core.multiarray", "scalar") + np_dtype("f8", "<") + "C\x08" + "\0\0\0\0\0\0\xf8?"_b + "\x86R.";
  const Loaded s = load(sc);
  CHECK(s.value.as_tensor().rank() == 0);
  CHECK(s.value.as_tensor().load<double>(0) == 1.5);
  CHECK(load(sc, true, go).value.as_tensor().load<double>(0) == 1.5);
  const std::string sc2 = "\x80\x02" + glob("numpy.core.multiarray", "scalar") + np_dtype("u1", "|") + glob("_codecs", "encode") +
                          str("\xc3\x88") + str("latin1") + "\x86R\x86R.";
  CHECK(load(sc2).value.as_tensor().load<std::uint8_t>(0) == 200);
  expect_error_p(P3 + glob("numpy.core.multiarray", "scalar") + np_dtype("f8", "<") + "C\x04xxxx\x86R.", errors::pk_bad_numpy);
  // An object scalar (np.object_) stays the call.
  CHECK(load(P3 + glob("numpy.core.multiarray", "scalar") + np_dtype("O8", "|") + "K\x01\x86R.").value.is_object());
}

TEST_CASE("protocol 0/1 objects: copyreg._reconstructor(cls, object, None) is an object of cls") {
  const std::string p1 = glob("copy_reg", "_reconstructor") + "(" + glob("argparse", "Namespace") + glob("__builtin__", "object") +
                         "NtR}(" + str("lr") + "G?\xb9\x99\x99\x99\x99\x99\x9a" "ub.";
  const Value ns = load(p1).value;
  CHECK(ns.as_object().qualified() == "argparse.Namespace");
  CHECK(ns.as_object().how == object_build::newobj);
  CHECK(ns.as_object().state.at(0).as_dict().at("lr").as_double() == 0.1);
  // Other forms stay the call, as data.
  CHECK(load(glob("copy_reg", "_reconstructor") + "(" + glob("mymodule", "D") + glob("__builtin__", "dict") + "}tR.").value.as_object().name ==
        "_reconstructor");
  pickle::options strict;
  strict.keep_unknown_objects = false;
  expect_error_p(p1, errors::pk_forbidden_global, strict);
}

TEST_CASE("what stays refused whatever the mode: code, not data") {
  for (auto [m, n] : {std::pair{"types", "CodeType"}, {"types", "FunctionType"}, {"__builtin__", "apply"}, {"posix", "system"}})
    expect_error_p(P3 + glob(m, n) + ".", errors::pk_blocked_module);
  CHECK(load(P3 + glob("types", "SimpleNamespace") + ")\x81}" + str("a") + "K\x01sb.").value.as_object().name == "SimpleNamespace");
}

TEST_CASE("writer: objects outside torch's list pickled as their data, never as calls") {
  Object ns{"argparse", "Namespace", object_build::newobj, {}, {}, {}};
  Object precision{"mymodule", "Precision", object_build::reduce, {"bf16"}, {}, {}};
  ns.state.emplace_back(Dict{{"lr", 0.1}, {"precision", precision}, {"dtype", Object{"torch", "bfloat16", object_build::global, {}, {}, {}}}});
  Object generic{"mymodule", "Thing", object_build::reduce, {1, "a"}, {Value::tuple({nullptr, Dict{{"slot", 2}}})}, {Value::list({3})}};
  Object cls{"mymodule", "Thing", object_build::global, {}, {}, {}};
  Object empty{"mymodule", "Empty", object_build::newobj, {}, {}, {}};
  Object device{"torch", "device", object_build::reduce, {"cpu"}, {}, {}};
  const Value tree(Dict{{"args", ns}, {"g", generic}, {"cls", cls}, {"empty", empty}, {"device", device}});

  std::vector<std::byte> out;
  pickle::Writer w(out);
  w.dump(tree);
  const Value back = pickle::load(out).value;  // loads in strict mode too: nothing beyond torch's list
  pickle::options strict;
  strict.keep_unknown_objects = false;
  CHECK(pickle::load(out, strict).value == back);
  const Dict& args = back["args"].as_dict();
  CHECK(args.at("lr").as_double() == 0.1);
  CHECK(args.at("precision").as_dict().at("args").as_list().at(0).as_string() == "bf16");
  CHECK(args.at("dtype").as_object().qualified() == "torch.bfloat16");  // on torch's list: itself
  const Dict& g = back["g"].as_dict();
  CHECK(g.at("args") == Value::tuple({1, "a"}));
  CHECK(g.at("state").as_list().at(1).as_dict().at("slot").as_int() == 2);
  CHECK(g.at("items") == Value::list({Value::list({3})}));
  CHECK(back["cls"].as_string() == "mymodule.Thing");
  CHECK(back["empty"].as_dict().empty());
  CHECK(back["device"].as_object().qualified() == "torch.device");
  CHECK(w.converted.at("argparse.Namespace") == 1);
  CHECK(w.converted.at("mymodule.Thing") == 2);
  CHECK(w.converted.at("mymodule.Precision") == 1);
  CHECK(w.converted.count("torch.device") == 0);

  // Named classes are written as themselves; dumps() writes every object as it is.
  pickle::write_options keep;
  keep.keep_classes = {"argparse.Namespace"};
  const Value kept = pickle::load(pickle::dumps(tree, nullptr, keep)).value;
  CHECK(kept["args"].as_object().qualified() == "argparse.Namespace");
  CHECK(kept["args"].as_object().state.at(0).as_dict().at("precision").is_dict());
  CHECK(pickle::load(pickle::dumps(tree)).value == tree);
}

TEST_CASE("torch.save of a tree with objects: tensors inside them are written, the objects as data") {
  const Tensor t = Tensor::from<float>({1, 2, 3}, {3});
  Object module{"torch.nn.modules.linear", "Linear", object_build::newobj, {}, {}, {}};
  module.state.emplace_back(Dict{{"_parameters", Dict{{"weight", Value(t.view())}}}, {"in_features", 3}});
  const Value tree(Dict{{"model", module}, {"same", Value(t.view())}});
  const auto p = std::filesystem::path(STATEDICT_TEST_TMP) / "unit-objects-module.pt";
  std::filesystem::create_directories(p.parent_path());
  torch::save(p, tree);
  torch::load_options strict;
  strict.keep_unknown_objects = false;  // what weights_only=True accepts
  const Value back = torch::load(p, strict);
  const TensorView& w = back["model"]["_parameters"]["weight"].as_tensor();
  CHECK(w.load<float>(2) == 3.F);
  CHECK(w.data() == back["same"].as_tensor().data());  // still one storage
  CHECK(back["model"]["in_features"].as_int() == 3);
}

TEST_CASE("objects_as_data: skeleton object nodes become dicts recording their class") {
  const Tensor t = Tensor::from<float>({1, 2}, {2});
  Object ns{"argparse", "Namespace", object_build::newobj, {}, {Value(Dict{{"lr", 0.1}, {"w", Value(t.view())}})}, {}};
  Object generic{"mymodule", "Thing", object_build::reduce, {Value(t.view()), 2}, {}, {}};
  Object device{"torch", "device", object_build::reduce, {"cpu"}, {}, {}};
  Object ref{"mymodule", "Thing", object_build::global, {}, {}, {}};
  const Value tree(Dict{{"args", ns}, {"g", generic}, {"device", device}, {"ref", ref}, {"deep", Value::list({Value::list({ns})})}});
  const FlatStateDict flat = flatten(tree);
  nlohmann::json sk = flat.skeleton.json();
  const auto notes = formats::objects_as_data(sk, {});
  REQUIRE(notes.size() == 2);
  CHECK(notes[0].cls == "argparse.Namespace");
  CHECK(notes[0].instances == 2);
  CHECK(notes[0].all_attributes);
  CHECK(notes[1].cls == "mymodule.Thing");
  CHECK(notes[1].instances == 1);
  CHECK(notes[1].references == 1);
  CHECK_FALSE(notes[1].all_attributes);
  CHECK(notes[1].describe() == "mymodule.Thing: 1 object written as a dict of its args, state and items; 1 reference to the class written as its name");
  CHECK(sk["root"]["dict"][0][1]["class"] == "argparse.Namespace");
  // Tensor names are kept; the tree is the data.
  const Value back = unflatten(flat.tensors, sk);
  CHECK(back["args"]["lr"].as_double() == 0.1);
  CHECK(back["args"]["w"].as_tensor().data() == t.view().data());
  CHECK(back["g"]["args"].as_list().at(1).as_int() == 2);
  CHECK(back["device"].as_object().qualified() == "torch.device");
  CHECK(back["ref"].as_string() == "mymodule.Thing");
  CHECK(back["deep"].as_list().at(0).as_list().at(0)["lr"].as_double() == 0.1);
  // Kept classes stay objects; malformed object nodes are left for unflatten to report.
  nlohmann::json kept = flat.skeleton.json();
  CHECK(formats::objects_as_data(kept, {"argparse.Namespace", "mymodule.Thing"}).empty());
  CHECK(kept == flat.skeleton.json());
  nlohmann::json bad = nlohmann::json::parse(R"({"statedict_skeleton": 1, "root": {"object": {"module": 1, "name": "n"}}})");
  CHECK(formats::objects_as_data(bad, {}).empty());
  // A checkpoint without objects keeps its compact skeleton.
  ShardedCheckpoint plain;
  plain.skeleton = flatten(Value(Dict{{"w", Value(t.view())}})).skeleton;
  CHECK(formats::objects_as_data(plain, {}).empty());
  CHECK(plain.skeleton.tape() != nullptr);
  // A skeleton held as a JSON document is walked to tell: save() copies a checkpoint (every
  // chunk record of a many-rank one) only when there are objects to rewrite.
  CHECK_FALSE(formats::detail::holds_objects(Skeleton(plain.skeleton.json())));
  CHECK(formats::detail::holds_objects(Skeleton(flat.skeleton.json())));
  const nlohmann::json nested = nlohmann::json::parse(
      R"({"statedict_skeleton": 1, "root": {"dict": [["a", {"list": [{"tuple": [{"object": {"module": "m", "name": "n"}}]}]}]]}})");
  CHECK(formats::detail::holds_objects(Skeleton(nested)));
  const nlohmann::json no_object = nlohmann::json::parse(
      R"({"statedict_skeleton": 1, "root": {"dict": [["a", {"list": [{"tuple": [{"value": 1}]}]}]]}})");
  CHECK_FALSE(formats::detail::holds_objects(Skeleton(no_object)));
}

TEST_CASE("formats::save writes every output's skeleton with its objects as data; keep_classes spares a class") {
  const Tensor t = Tensor::from<float>({1, 2}, {2});
  Object ns{"argparse", "Namespace", object_build::newobj, {}, {Value(Dict{{"lr", 0.1}})}, {}};
  const Value tree(Dict{{"args", ns}, {"w", Value(t.view())}});
  const auto dir = std::filesystem::path(STATEDICT_TEST_TMP) / "unit-objects-save";
  std::filesystem::create_directories(dir);
  ShardedCheckpoint ck;
  const FlatStateDict flat = flatten(tree);
  for (const auto& [name, v] : flat.tensors)
    (void)add_stored(ck, name, v.dtype(), v.shape(), std::make_shared<MemorySource>(name, v.data(), v.nbytes(), v.owner()), 0);
  ck.skeleton = flat.skeleton;
  (void)formats::save(ck, dir / "data.safetensors");
  const ShardedCheckpoint back = formats::open(dir / "data.safetensors").checkpoint;
  CHECK(back.skeleton.json()["root"]["dict"][0][1]["class"] == "argparse.Namespace");
  CHECK(back.skeleton.json()["root"]["dict"][0][1]["dict"][0][0] == "lr");
  CHECK(ck.skeleton.json()["root"]["dict"][0][1].contains("object"));  // the caller's checkpoint is untouched
  formats::save_options keep;
  keep.keep_classes = {"argparse.Namespace"};
  (void)formats::save(ck, dir / "kept.safetensors", keep);
  CHECK(formats::open(dir / "kept.safetensors").checkpoint.skeleton.json()["root"]["dict"][0][1].contains("object"));
  // .pt: the data, read back with objects refused.
  (void)formats::save(ck, dir / "data.pt");
  torch::load_options strict;
  strict.keep_unknown_objects = false;
  CHECK(torch::load(dir / "data.pt", strict)["args"]["lr"].as_double() == 0.1);
}

TEST_CASE("value_repr: objects as Python spells them") {
  Object ns{"argparse", "Namespace", object_build::newobj, {}, {Value(Dict{{"lr", 0.1}, {"arch", "transformer"}, {"betas", Value::tuple({0.9})},
                                                                            {"layers", Dict{{"enc", 2}}}, {"fp16", false}, {"data", nullptr}})}, {}};
  CHECK(value_repr(Value(ns)) == "argparse.Namespace(lr=0.1, arch='transformer', betas=(0.9,), layers={'enc': 2}, fp16=False, data=None)");
  CHECK(value_repr(Value(Object{"torch", "device", object_build::reduce, {"cpu"}, {}, {}})) == "torch.device('cpu')");
  CHECK(value_repr(Value(Object{"torch", "float32", object_build::global, {}, {}, {}})) == "torch.float32");
  Object st{"m", "C", object_build::reduce, {1}, {Value(Dict{{1, "x"}})}, {2}};
  CHECK(value_repr(Value(st)) == "m.C(1) <state {1: 'x'}> <items [2]>");
  CHECK(value_repr(Value(Bytes{{0, 'a', 0xff}})) == "b'\\x00a\\xff'");
  CHECK(value_repr(Value("it's")) == "\"it's\"");
  CHECK(value_repr(Value(1.0)) == "1.0");
  CHECK(value_repr(Value(1e100)) == "1e+100");
  Value deep = Value::list();
  for (int i = 0; i < 100; ++i) deep = Value::list({deep});
  CHECK(value_repr(deep).find("...") != std::string::npos);
  CHECK(value_json(Value(ns))["repr"] == value_repr(Value(ns)));
}
