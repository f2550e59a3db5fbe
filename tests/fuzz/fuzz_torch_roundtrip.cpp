// Fuzz target: a torch.save file that reads is written back (torch::save, the torch.save layout)
// and read again: equal Value trees (tensors compared by dtype, shape and bytes) and equal dict
// attributes. A writer refusal is acceptable only as a statedict::error. A bare storage that
// stays in the tree is compared by class, bytes and location: its key is a name inside the file,
// which the writer renumbers (torch.load does not show it either). Objects of classes outside
// torch's weights_only list are written as their data: the written file must then read with
// those classes refused (keep_unknown_objects = false), and written again it must read back the
// same (the data form is a fixed point).
// SPDX-License-Identifier: MIT
#include <statedict/io/torch_file.hpp>
#include <statedict/formats/torch.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

namespace torch = statedict::torch;
using statedict::Value;

namespace {
bool same_list(const statedict::List& a, const statedict::List& b);

bool same(const Value& a, const Value& b) {
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case statedict::value_kind::list:
    case statedict::value_kind::tuple: return same_list(a.as_list(), b.as_list());
    case statedict::value_kind::dict: {
      const auto& x = a.as_dict().items();
      const auto& y = b.as_dict().items();
      if (x.size() != y.size()) return false;
      for (std::size_t i = 0; i < x.size(); ++i)
        if (!(x[i].first == y[i].first) || !same(x[i].second, y[i].second)) return false;
      return true;
    }
    case statedict::value_kind::object: {
      const statedict::Object& x = a.as_object();
      const statedict::Object& y = b.as_object();
      if (x.module != y.module || x.name != y.name || x.how != y.how) return false;
      if (torch::detail::is_storage_object(x) && torch::detail::is_storage_object(y))
        // The writer puts every storage on 'cpu' (io/torch_file.hpp), whatever location it was read with.
        return statedict::equal_bytes(x.args[0].as_tensor(), y.args[0].as_tensor()) && y.args[2] == Value("cpu");
      return same_list(x.args, y.args) && same_list(x.state, y.state) && same_list(x.items, y.items);
    }
    default: return a == b;
  }
}

bool same_list(const statedict::List& a, const statedict::List& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!same(a[i], b[i])) return false;
  return true;
}

/// Whether the writer turns anything of `v` into data (an object of a class torch's list lacks;
/// big ints and dicts of other keys are written in their own forms).
bool has_data_objects(const Value& v) {
  std::vector<const Value*> work{&v};
  while (!work.empty()) {
    const Value* x = work.back();
    work.pop_back();
    if (x->is_sequence()) {
      for (const Value& c : x->as_list()) work.push_back(&c);
    } else if (x->is_dict()) {
      for (const auto& kv : x->as_dict().items()) work.push_back(&kv.second);
    } else if (x->is_object()) {
      const statedict::Object& o = x->as_object();
      const std::string q = o.qualified();
      if (q != "builtins.int" && q != "builtins.dict" && !statedict::pickle::writable_as_itself(q, {})) return true;
      for (const statedict::List* l : {&o.args, &o.state, &o.items})
        for (const Value& c : *l) work.push_back(&c);
    }
  }
  return false;
}

std::optional<torch::File> write_and_read(const torch::File& f, const std::filesystem::path& path, torch::load_options o) {
  try {
    torch::save(path, f);
  } catch (const statedict::error& e) {
    fuzz::note(e);
    return std::nullopt;
  }
  o.limits.pickle.max_nodes = std::uint64_t{1} << 18;
  o.mode = statedict::read_mode::pread;
  o.verify_crc = true;
  o.keep_unknown_objects = false;  // only what torch.load(weights_only=True) accepts
  try {
    return torch::read(path, o);
  } catch (const statedict::error& e) {
    std::fprintf(stderr, "torch round trip: the written file does not read with objects refused: %s\n", e.what());
    std::abort();
  }
}
}  // namespace

STATEDICT_FUZZ_TARGET(data, size) {
  torch::load_options o;
  o.limits = fuzz::torch_limits();
  std::optional<torch::File> a;
  try {
    a = torch::read(fuzz::source_of(data, size, "fuzz.pt"), o);
  } catch (const statedict::error& e) {
    fuzz::note(e);
    return 0;
  }
  const auto path = fuzz::scratch_root() / "roundtrip.pt";
  std::optional<torch::File> written = write_and_read(*a, path, o);
  if (!written) return 0;
  if (has_data_objects(a->value)) {  // the data form: written again, it stays what it is
    a = std::move(written);
    written = write_and_read(*a, fuzz::scratch_root() / "roundtrip2.pt", o);
    if (!written) {
      std::fprintf(stderr, "torch round trip: the data form of the objects cannot be written\n");
      std::abort();
    }
  }
  const torch::File& b = *written;
  if (!same(a->value, b.value)) {
    std::fprintf(stderr, "torch round trip: the values differ\n");
    std::abort();
  }
  if (a->attributes != b.attributes) {
    std::fprintf(stderr, "torch round trip: the attributes differ\n");
    std::abort();
  }
  return 0;
}
