// OLMo mapped safetensors on hand-built files: base64, key decoding, the tree with typed keys,
// detection (OLMo, plain, mixed), every refusal with its error id (duplicate and conflicting key
// paths, empty paths, key element types, globals and stray bytes in key pickles, pickled values
// that are not 1-D U8 or are dicts, caps), and the writer's refusals (ties, views, a tree that is
// not a dict, a tensor inside a value).
#include <doctest/doctest.h>

#include <statedict/exec/digest.hpp>
#include <statedict/formats/olmo_safetensors.hpp>
#include <statedict/formats/registry.hpp>

#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <unistd.h>
#include <vector>

#include "test_util.hpp"

using namespace statedict;
namespace fs = std::filesystem;
namespace ol = statedict::formats::detail::olmo;

namespace {

fs::path tmp(const std::string& name) {
  const fs::path d = fs::path(STATEDICT_TEST_TMP) / ("unit-olmo-" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d / name;
}

using statedict_test::error_of;

std::vector<std::byte> bytes_of(std::initializer_list<int> b) {
  std::vector<std::byte> out;
  for (int x : b) out.push_back(static_cast<std::byte>(x));
  return out;
}

/// An OLMo name for (keys, pickled), as OLMo writes it.
std::string key(std::initializer_list<Key> keys, bool pickled = false) {
  return ol::encode_key(Path(keys), pickled, errors::olmo_unwritable);
}

/// The name of an arbitrary pickle (hand-made key encodings).
std::string name_of_pickle(const std::vector<std::byte>& p) { return ol::b64_encode(p); }

/// The name of the pickle of `v` (protocol 4).
std::string name_of_value(const Value& v) {
  ol::P4Writer w(errors::olmo_unwritable, "test");
  return ol::b64_encode(w.dumps(v));
}

/// A pickled value as OLMo stores it: a 1-D U8 tensor.
Tensor pickled(const Value& v) {
  ol::P4Writer w(errors::olmo_unwritable, "test");
  const auto p = w.dumps(v);
  Tensor t(dtype::U8, shape_t{static_cast<dim_t>(p.size())});
  std::memcpy(t.data(), p.data(), p.size());
  return t;
}

struct Item {
  std::string name;
  Tensor t;
};

fs::path write(const std::string& file, const std::vector<Item>& items) {
  std::vector<safetensors::Input> in;
  for (const auto& it : items) in.push_back(safetensors::Input::of(it.name, it.t.view()));
  safetensors::write_options o;
  o.dedupe_views = false;
  const fs::path p = tmp(file);
  (void)safetensors::write(p, in, o);
  return p;
}

Tensor f32(std::initializer_list<float> v) { return Tensor::from<float>(v, shape_t{static_cast<dim_t>(v.size())}); }

}  // namespace

TEST_CASE("olmo: urlsafe base64 both ways, canonical only") {
  const auto b = bytes_of({0xfb, 0xff, 0x00, 0x3e});
  CHECK(ol::b64_encode(b) == "-_8APg==");
  CHECK(ol::b64_decode("-_8APg==") == b);
  CHECK(ol::b64_decode("-_8APh==") == std::nullopt);  // unused bits set
  CHECK(ol::b64_decode("-_8APg=") == std::nullopt);
  CHECK(ol::b64_decode("+/8APg==") == std::nullopt);  // standard alphabet
  CHECK(ol::b64_decode("") == std::nullopt);
  CHECK(ol::b64_decode("ab=c") == std::nullopt);
  CHECK(ol::b64_encode(bytes_of({1, 2, 3})) == "AQID");
  CHECK(ol::b64_decode("AQID") == bytes_of({1, 2, 3}));
}

TEST_CASE("olmo: names are the examples of the layout spec") {
  CHECK(key({"model", "transformer.wte.weight"}) == "gASVJwAAAAAAAACMBW1vZGVslIwWdHJhbnNmb3JtZXIud3RlLndlaWdodJSGlImGlC4=");
  CHECK(key({"optim", "state", 0, "exp_avg"}) == "gASVIwAAAAAAAAAojAVvcHRpbZSMBXN0YXRllEsAjAdleHBfYXZnlHSUiYaULg==");
  CHECK(key({"optim", "param_groups"}, true) == "gASVHQAAAAAAAACMBW9wdGltlIwMcGFyYW1fZ3JvdXBzlIaUiIaULg==");
  CHECK(key({std::int64_t{1} << 40}) == "gASVDgAAAAAAAACKBgAAAAAAAYWUiYaULg==");
  CHECK(key({-1}) == "gASVCwAAAAAAAABK_____4WUiYaULg==");
  const auto d = ol::decode_key("gASVIwAAAAAAAAAojAVvcHRpbZSMBXN0YXRllEsAjAdleHBfYXZnlHSUiYaULg==", {}, 1000);
  REQUIRE(std::holds_alternative<ol::DecodedKey>(d));
  const auto& k = std::get<ol::DecodedKey>(d);
  CHECK(k.keys == Path{"optim", "state", 0, "exp_avg"});
  CHECK(k.keys[2].is_int());
  CHECK_FALSE(k.pickled);
}

TEST_CASE("olmo: a file reads as its nested tree, typed keys and values included") {
  Dict groups;
  groups.set("lr", 0.001);
  List gl;
  gl.emplace_back(groups);
  const fs::path p = write("tree.safetensors", {{key({"model", "w"}), f32({1, 2, 3})},
                                                {key({"optim", "state", 0, "exp_avg"}), f32({4, 5, 6})},
                                                {key({"optim", "param_groups"}, true), pickled(Value::list(gl))},
                                                {key({"epoch"}, true), pickled(Value(7))},
                                                {key({7, "x"}, true), pickled(Value::tuple({Value(1), Value("a")}))}});
  const auto opened = formats::open(p);
  CHECK(opened.format->name() == "olmo");
  const ShardedCheckpoint& ck = opened.checkpoint;
  CHECK(ck.format == "olmo_safetensors");
  REQUIRE(ck.find("model.w"));
  REQUIRE(ck.find("optim.state.0.exp_avg"));
  CHECK(ck.tensors.size() == 2);
  std::map<std::string, Value> vals;
  for (auto& [n, v] : skeleton_values(ck.skeleton)) vals.emplace(n, v);
  CHECK(vals.at("epoch") == Value(7));
  CHECK(vals.at("optim.param_groups.0.lr") == Value(0.001));
  CHECK(vals.at("7.x.0") == Value(1));
  // int keys stay ints in the skeleton (a JSON integer key), so writing back gives int ids
  const auto sk = ck.skeleton.json();
  bool int_key = false;
  for (const auto& pair : sk["root"]["dict"])
    if (pair[0].is_number_integer() && pair[0] == 7) int_key = true;
  CHECK(int_key);
  // the same file written by statedict decodes to the same tree, byte for byte
  const fs::path q = tmp("tree-again.safetensors");
  formats::save_options so;
  so.format = "olmo";
  (void)formats::save(ck, q, so);
  const auto again = formats::open(q).checkpoint;
  CHECK(again.skeleton.json() == ck.skeleton.json());
  CHECK(sha256_tensors(again) == sha256_tensors(ck));
  // pread reads the same
  formats::open_options po;
  po.mode = read_mode::pread;
  CHECK(sha256_tensors(formats::open(p, po).checkpoint) == sha256_tensors(ck));
}

TEST_CASE("olmo: a plain safetensors file stays plain; a mix is refused") {
  const fs::path plain = write("plain.safetensors", {{"model.w", f32({1})}, {"b", f32({2})}});
  CHECK(formats::open(plain).format->name() == "safetensors");
  CHECK(error_of([&] { (void)olmo_safetensors::describe(plain); }) == errors::olmo_bad_name.id);
  const fs::path mixed = write("mixed.safetensors", {{"model.w", f32({1})}, {key({"b"}), f32({2})}});
  CHECK(error_of([&] { (void)formats::open(mixed); }) == errors::olmo_mixed_names.id);
}

TEST_CASE("olmo: conflicting key paths are refused, not overwritten") {
  // ("a", "a") memoized (OLMo's literal keys) and not memoized: one path, two names.
  const auto unmemo = bytes_of({0x80, 0x04, 0x95, 0x0e, 0, 0, 0, 0, 0, 0, 0, 0x8c, 0x01, 'a', 0x94, 0x8c, 0x01, 'a', 0x94,
                                0x86, 0x94, 0x89, 0x86, 0x94, 0x2e});
  CHECK(name_of_pickle(unmemo) != key({"a", "a"}));
  const auto d = ol::decode_key(name_of_pickle(unmemo), {}, 1000);
  REQUIRE(std::holds_alternative<ol::DecodedKey>(d));
  CHECK(std::get<ol::DecodedKey>(d).keys == Path{"a", "a"});
  const fs::path dup = write("dup.safetensors", {{key({"a", "a"}), f32({1})}, {name_of_pickle(unmemo), f32({2})}});
  CHECK(error_of([&] { (void)formats::open(dup); }) == errors::olmo_path_conflict.id);
  // a path through a pickled leaf (OLMo writes into the list, or replaces a None by a dict)
  const fs::path through = write("through.safetensors", {{key({"a"}, true), pickled(Value::list({Value(1)}))}, {key({"a", 0}), f32({1})}});
  CHECK(error_of([&] { (void)formats::open(through); }) == errors::olmo_path_conflict.id);
  const fs::path none = write("none.safetensors", {{key({"a"}, true), pickled(Value())}, {key({"a", "b"}), f32({1})}});
  CHECK(error_of([&] { (void)formats::open(none); }) == errors::olmo_path_conflict.id);
  // a leaf where other entries make a dict
  const fs::path dict_leaf = write("dictleaf.safetensors", {{key({"a", "b"}), f32({1})}, {key({"a"}), f32({2})}});
  CHECK(error_of([&] { (void)formats::open(dict_leaf); }) == errors::olmo_path_conflict.id);
}

TEST_CASE("olmo: key pickles that are not (str/int path, bool) are refused with olmo.bad_key") {
  auto bad = [&](const std::string& name) {
    const fs::path p = write("badkey.safetensors", {{key({"ok"}), f32({1})}, {name, f32({2})}});
    return error_of([&] { (void)formats::open(p); });
  };
  CHECK(bad(name_of_value(Value::tuple({Value::tuple(), Value(false)}))) == errors::olmo_bad_key.id);  // empty path
  CHECK(bad(name_of_value(Value::tuple({Value::tuple({Value(1.5)}), Value(false)}))) == errors::olmo_bad_key.id);
  CHECK(bad(name_of_value(Value::tuple({Value::tuple({Value(true)}), Value(false)}))) == errors::olmo_bad_key.id);
  CHECK(bad(name_of_value(Value::tuple({Value::tuple({Value("a")}), Value(1)}))) == errors::olmo_bad_key.id);
  CHECK(bad(name_of_value(Value::list({Value::tuple({Value("a")}), Value(false)}))) == errors::olmo_bad_key.id);
  // a global in the key pickle: os.system (blocked) and collections.OrderedDict (no global at all)
  const auto os_system = bytes_of({0x80, 0x02, 'c', 'o', 's', '\n', 's', 'y', 's', 't', 'e', 'm', '\n', 'X', 1, 0, 0, 0, 'x',
                                   0x85, 'R', 0x2e});
  CHECK(bad(name_of_pickle(os_system)) == errors::olmo_bad_key.id);
  const auto od = bytes_of({0x80, 0x02, 'c', 'c', 'o', 'l', 'l', 'e', 'c', 't', 'i', 'o', 'n', 's', '\n', 'O', 'r', 'd', 'e', 'r', 'e',
                            'd', 'D', 'i', 'c', 't', '\n', ')', 'R', 0x89, 0x86, 0x2e});
  CHECK(bad(name_of_pickle(od)) == errors::olmo_bad_key.id);
  // stray bytes after STOP, a truncated pickle
  auto good = ol::b64_decode(key({"x"})).value();
  auto stray = good;
  stray.push_back(std::byte{0});
  stray.push_back(std::byte{0});
  stray.push_back(std::byte{0});
  CHECK(bad(name_of_pickle(stray)) == errors::olmo_bad_key.id);
  good.resize(good.size() - 3);
  CHECK(bad(name_of_pickle(good)) == errors::olmo_bad_key.id);
  // a key path deeper than the cap
  olmo_safetensors::limits lim;
  lim.max_key_depth = 2;
  const fs::path deep = write("deep.safetensors", {{key({"a", "b", "c"}), f32({1})}});
  CHECK(error_of([&] { (void)olmo_safetensors::entries(safetensors::File::open(deep), lim); }) == errors::olmo_bad_key.id);
}

TEST_CASE("olmo: pickled values must be 1-D U8 pickles of non-dicts, within the cap") {
  const fs::path not_u8 = write("notu8.safetensors", {{key({"a"}, true), f32({1, 2})}});
  CHECK(error_of([&] { (void)formats::open(not_u8); }) == errors::olmo_pickled_value.id);
  const fs::path dict = write("dict.safetensors", {{key({"a"}, true), pickled(Value(Dict{{"k", 1}}))}});
  CHECK(error_of([&] { (void)formats::open(dict); }) == errors::olmo_pickled_value.id);
  Tensor trunc = pickled(Value::list({Value(1), Value(2)}));
  Tensor cut(dtype::U8, shape_t{trunc.shape()[0] - 2});
  std::memcpy(cut.data(), trunc.data(), static_cast<std::size_t>(cut.nbytes()));
  const fs::path t = write("trunc.safetensors", {{key({"a"}, true), std::move(cut)}});
  CHECK(error_of([&] { (void)formats::open(t); }) == errors::pk_truncated.id);
  // a value naming code to run: refused by the unpickler, never called
  const auto evil = bytes_of({0x80, 0x02, 'c', 'p', 'o', 's', 'i', 'x', '\n', 's', 'y', 's', 't', 'e', 'm', '\n', 'X', 4, 0, 0, 0,
                              't', 'r', 'u', 'e', 0x85, 'R', 0x2e});
  Tensor e(dtype::U8, shape_t{static_cast<dim_t>(evil.size())});
  std::memcpy(e.data(), evil.data(), evil.size());
  const fs::path ev = write("evil.safetensors", {{key({"epoch"}, true), std::move(e)}});
  CHECK(error_of([&] { (void)formats::open(ev); }) == errors::pk_blocked_module.id);
  // the value cap
  olmo_safetensors::options o;
  o.limits.max_value_bytes = 4;
  const fs::path big = write("bigvalue.safetensors", {{key({"a"}, true), pickled(Value("a long string"))}});
  CHECK(error_of([&] { (void)olmo_safetensors::describe(big, o); }) == errors::olmo_limit.id);
  // unknown classes are read as data (a numpy-like scalar); written back as themselves only when
  // the caller keeps their class, else as their data (no global of theirs in the output)
  const auto np = bytes_of({0x80, 0x04, 0x95, 0x20, 0, 0, 0, 0, 0, 0, 0, 0x8c, 0x05, 'n', 'u', 'm', 'p', 'y', 0x94, 0x8c, 0x05,
                            'f', 'l', 'o', 'a', 't', 0x94, 0x93, 0x94, 'G', 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x85, 0x94, 'R', 0x94, 0x2e});
  Tensor n(dtype::U8, shape_t{static_cast<dim_t>(np.size())});
  std::memcpy(n.data(), np.data(), np.size());
  const fs::path npf = write("np.safetensors", {{key({"loss"}, true), std::move(n)}});
  const auto ck = formats::open(npf).checkpoint;
  const auto vals = skeleton_values(ck.skeleton);
  REQUIRE(vals.size() == 1);
  CHECK(vals[0].second.is_object());
  const fs::path back = tmp("np-again.safetensors");
  formats::save_options so;
  so.format = "olmo";
  so.keep_classes = {"numpy.float"};
  (void)formats::save(ck, back, so);
  const auto f = safetensors::File::open(back);
  REQUIRE(f.entries().size() == 1);
  const auto v = f.view(f.entries()[0]);
  REQUIRE(v.nbytes() == np.size());
  CHECK(std::memcmp(v.data(), np.data(), np.size()) == 0);
  const fs::path data = tmp("np-data.safetensors");
  so.keep_classes.clear();
  (void)formats::save(ck, data, so);
  const auto g = safetensors::File::open(data);
  REQUIRE(g.entries().size() == 1);
  const auto w = g.view(g.entries()[0]);
  const std::string_view text(reinterpret_cast<const char*>(w.data()), static_cast<std::size_t>(w.nbytes()));
  CHECK(text.find("numpy") == std::string_view::npos);
  const auto again = skeleton_values(formats::open(data).checkpoint.skeleton);
  REQUIRE(again.size() == 1);
  CHECK_FALSE(again[0].second.is_object());
}

TEST_CASE("olmo: the writer refuses what a mapped file cannot hold") {
  formats::save_options so;
  so.format = "olmo";
  // tied tensors (an alias in the skeleton)
  Tensor w = f32({1, 2});
  Dict d;
  d.set("a", w.view());
  d.set("b", w.view());
  FlatStateDict flat = flatten(Value(d));
  ShardedCheckpoint tied = describe_views(flat.tensors);
  tied.skeleton = std::move(flat.skeleton);
  CHECK(error_of([&] { (void)formats::save(tied, tmp("tied.safetensors"), so); }) == errors::olmo_unwritable.id);
  // a tree that is not a dict
  FlatStateDict lst = flatten(Value::list({Value(w.view())}));
  ShardedCheckpoint as_list = describe_views(lst.tensors);
  as_list.skeleton = std::move(lst.skeleton);
  CHECK(error_of([&] { (void)formats::save(as_list, tmp("list.safetensors"), so); }) == errors::olmo_unwritable.id);
  // a tensor inside a pickled value
  Dict inner;
  inner.set("x", Value::list({Value(w.view())}));
  FlatStateDict in = flatten(Value(inner));
  ShardedCheckpoint nested = describe_views(in.tensors);
  nested.skeleton = std::move(in.skeleton);
  CHECK(error_of([&] { (void)formats::save(nested, tmp("nested.safetensors"), so); }) == errors::olmo_unwritable.id);
  // options that do not apply
  so.world_size = 2;
  CHECK(error_of([&] { (void)formats::choose_output(tmp("x.safetensors"), so); }) == errors::bad_save_option.id);
}
