// Fuzz target: torch.save files (io/torch_file.hpp): zip or legacy format, read with the strict
// allow-list (CRCs verified), then describe() of what was read, then the lazy describe with
// unknown objects kept and Parameters kept as wrappers (what the layout readers use). Each read
// is done twice, with load_options::fast_paths on and off: the two must agree exactly (the same
// File, views of the same bytes, or the same error), except when the general path stops at a
// resource limit: it converts more (each call's arguments), so it may reach limits.max_nodes
// where the fast one does not. The lazy-free read without CRCs is also done with the zip local
// headers read first and read on a second thread alongside the pickle
// (load_options::overlap_headers_from): those two must agree exactly, errors included.
// SPDX-License-Identifier: MIT
#include <statedict/io/torch_file.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

namespace sd = statedict;
namespace torch = statedict::torch;

namespace {

struct outcome {
  std::optional<torch::File> file;
  std::string error;
  bool limit = false;  ///< the error is a resource limit
};

outcome read(const std::shared_ptr<const sd::ByteSource>& src, torch::load_options o, bool fast) {
  o.fast_paths = fast;
  outcome r;
  try {
    r.file = torch::detail::read_any(src, o, false);
  } catch (const sd::error& e) {
    fuzz::note(e);
    r.error = e.what();
    r.limit = e.code().kind == sd::error_kind::limit;
  }
  return r;
}

bool same_storages(const torch::File& a, const torch::File& b) {
  if (a.storages.size() != b.storages.size()) return false;
  for (std::size_t i = 0; i < a.storages.size(); ++i) {
    const torch::Storage &x = a.storages[i], &y = b.storages[i];
    if (x.key != y.key || x.dtype != y.dtype || x.untyped != y.untyped || x.offset != y.offset || x.nbytes != y.nbytes ||
        x.record != y.record || x.location != y.location)
      return false;
  }
  return true;
}

/// The same tree, and each tensor a view of the same bytes with the same strides (a numpy array
/// copied out of the pickle, in neither file's bytes, the same elements).
bool same_views(const torch::File& a, const torch::File& b) {
  const sd::FlatStateDict fa = sd::flatten(a.value), fb = sd::flatten(b.value);
  if (fa.tensors.size() != fb.tensors.size() || fa.skeleton.dump() != fb.skeleton.dump()) return false;
  for (std::size_t i = 0; i < fa.tensors.size(); ++i) {
    const sd::TensorView &x = fa.tensors[i].second, &y = fb.tensors[i].second;
    auto at = [](const sd::TensorView& v, const torch::File& f) {
      return reinterpret_cast<std::uintptr_t>(v.data()) - reinterpret_cast<std::uintptr_t>(f.view_base);
    };
    auto in_file = [&](const sd::TensorView& v, const torch::File& f) {
      return f.view_base && v.data() >= f.view_base && at(v, f) <= f.source->size();
    };
    const bool placed = in_file(x, a) && in_file(y, b);
    if (!placed && (in_file(x, a) || in_file(y, b) || !sd::equal_bytes(x, y))) return false;
    if (fa.tensors[i].first != fb.tensors[i].first || (placed && at(x, a) != at(y, b)) || x.dtype() != y.dtype() ||
        x.shape() != y.shape() || x.strides() != y.strides())
      return false;
  }
  return true;
}

/// `fast` and `slow` must agree, unless `slow` stopped at a limit and limits may differ.
void compare(const outcome& fast, const outcome& slow, const char* what = "fast_paths on and off", bool limits_may_differ = true) {
  if (limits_may_differ && slow.limit && fast.error != slow.error) return;
  bool ok = fast.file.has_value() == slow.file.has_value() && fast.error == slow.error;
  if (ok && fast.file) {
    const torch::File &a = *fast.file, &b = *slow.file;
    ok = a.format == b.format && a.archive_name == b.archive_name && a.records == b.records &&
         a.pickle_protocol == b.pickle_protocol && a.attributes == b.attributes && same_storages(a, b);
    if (ok) {
      try {
        ok = a.value == b.value && same_views(a, b);
      } catch (const sd::error& e) {  // flatten refusing the tree refuses both alike
        ok = true;
        fuzz::note(e);
      }
    }
  }
  if (!ok) {
    std::fprintf(stderr, "%s disagree:\n  on:  %s\n  off: %s\n", what, fast.file ? "read" : fast.error.c_str(),
                 slow.file ? "read" : slow.error.c_str());
    std::abort();
  }
}

}  // namespace

STATEDICT_FUZZ_TARGET(data, size) {
  const auto src = fuzz::source_of(data, size, "fuzz.pt");
  torch::load_options o;
  o.limits = fuzz::torch_limits();
  o.verify_crc = true;
  o.keep_unknown_objects = false;  // torch.load(weights_only=True)'s refusal first
  const outcome strict = read(src, o, true);
  compare(strict, read(src, o, false));
  if (strict.file) {
    try {
      (void)torch::describe(*strict.file);
    } catch (const sd::error& e) {
      fuzz::note(e);
    }
  }
  o.verify_crc = false;
  o.keep_unknown_objects = true;
  o.keep_wrappers = true;
  compare(read(src, o, true), read(src, o, false));
  o.overlap_headers_from = 0;
  const outcome overlapped = read(src, o, true);
  o.overlap_headers_from = SIZE_MAX;
  compare(overlapped, read(src, o, true), "local headers read alongside the pickle and before it", false);
  o.overlap_headers_from = 0;
  try {
    (void)torch::describe(src, o);
  } catch (const sd::error& e) {
    fuzz::note(e);
  }
  return 0;
}
