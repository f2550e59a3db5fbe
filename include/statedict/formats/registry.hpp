// statedict: the format registry, and open() / save() over it.
// SPDX-License-Identifier: MIT
//
// open(path) asks every registered format, in order, whether the path is one of its checkpoints
// (from content: formats/format.hpp Detection) and describes it with the first that says yes; the
// result says which rule matched. When none does, the error lists what each format looked for and
// what it found. save(ck, out) writes with the format named in the options, or the first that
// claims the output path (its extension, or the options given).
//
// A new layout is one header with a class derived from Format, and one line in builtin_formats()
// (or a call to add_format() from a program that brings its own).
#pragma once

#include "../core/config.hpp"
#include "../core/detail/defines_facade.hpp"

#include <algorithm>
#include <filesystem>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "../shard/checkpoint.hpp"
#include "colossalai.hpp"
#include "dcp.hpp"
#include "deepspeed.hpp"
#include "fairscale.hpp"
#include "format.hpp"
#include "fsdp.hpp"
#include "hf.hpp"
#include "objects.hpp"
#include "olmo_safetensors.hpp"
#include "megatron.hpp"
#include "safetensors.hpp"
#include "sharded_tensor.hpp"
#include "torch.hpp"
#include "transform.hpp"

namespace statedict::inline v0::formats {

/// The formats statedict knows, in detection order (directories: the most specific first; files:
/// safetensors before torch.save).
inline std::vector<std::shared_ptr<const Format>> builtin_formats() {
  return {
      std::make_shared<megatron::format>(),
      std::make_shared<dcp::format>(),
      std::make_shared<deepspeed::format>(),
      std::make_shared<deepspeed::universal_format>(),
      std::make_shared<fsdp::format>(),
      std::make_shared<sharded_tensor::format>(),
      std::make_shared<colossalai::format>(),
      std::make_shared<fairscale::format>(),
      std::make_shared<hf::format>(),
      std::make_shared<olmo_safetensors::format>(),
      std::make_shared<safetensors::format>(),
      std::make_shared<torch::format>(),
  };
}

namespace detail {
struct registry_state {
  std::mutex mutex;
  std::vector<std::shared_ptr<const Format>> formats = builtin_formats();
};
inline registry_state& registry_instance() {
  static registry_state r;
  return r;
}
}  // namespace detail

/// The registered formats, in detection order (a copy: safe while another thread adds one).
STATEDICT_API std::vector<std::shared_ptr<const Format>> registered_formats() {
  auto& r = detail::registry_instance();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.formats;
}

/// Registers a format of the program's own. It is tried before the built-in ones (so it can claim
/// inputs they would misread); a format with the same name replaces the registered one.
STATEDICT_API void add_format(std::shared_ptr<const Format> f) {
  auto& r = detail::registry_instance();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::erase_if(r.formats, [&](const auto& g) { return g->name() == f->name(); });
  r.formats.insert(r.formats.begin(), std::move(f));
}

/// The registered format named `name`; throws errors::no_such_format listing the names.
STATEDICT_API std::shared_ptr<const Format> find_format(std::string_view name) {
  const auto all = registered_formats();
  for (const auto& f : all)
    if (f->name() == name) return f;
  std::string names;
  for (const auto& f : all) names += (names.empty() ? "" : ", ") + std::string(f->name());
  throw_error(errors::no_such_format, "format " + quote(name), "is not one of: " + names);
}


namespace detail {
/// A Hugging Face config.json's `quantization_config.weight_block_size` ([rows, cols]) into `d`;
/// nothing when there is no such file or entry. A file above 16 MiB or a block size that is not
/// two positive integers is an error.
inline void block_size_from_config(const std::filesystem::path& config, dequantize_options& d) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(config, ec)) return;
  const auto f = InputFile::open(config, read_mode::pread);
  if (f->size() > (std::uint64_t{16} << 20)) throw_error(errors::dequantize_bad_scale, "file " + quote(config.string()), "is larger than 16 MiB");
  std::string text(static_cast<std::size_t>(f->size()), '\0');
  f->read(0, std::as_writable_bytes(std::span<char>(text.data(), text.size())));
  const auto j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object() || !j.contains("quantization_config") || !j["quantization_config"].is_object()) return;
  const auto& q = j["quantization_config"];
  if (!q.contains("weight_block_size")) return;
  const auto& b = q["weight_block_size"];
  if (!b.is_array() || b.size() != 2 || !b[0].is_number_unsigned() || !b[1].is_number_unsigned() || b[0].get<std::uint64_t>() == 0 ||
      b[1].get<std::uint64_t>() == 0)
    throw_error(errors::dequantize_bad_scale, "file " + quote(config.string()),
                "quantization_config.weight_block_size is " + b.dump() + ", not two positive integers [rows, cols]");
  d.block_rows = b[0].get<std::uint64_t>();
  d.block_cols = b[1].get<std::uint64_t>();
}
}  // namespace detail

/// Opens `path` (a file or a directory) as a ShardedCheckpoint, detecting its format from content
/// (or reading it as `opt.format`), and applies `opt.dtype` to every floating tensor.
STATEDICT_API Opened open(const std::filesystem::path& path, const open_options& opt = {}) {
  std::error_code ec;
  const std::string where = quote(path.string());
  if (!std::filesystem::exists(path, ec)) throw_error(errors::no_such_path, where, "no such file or directory");
  const Input in(path, opt.mode);
  Opened out;
  if (!opt.format.empty()) {
    out.format = find_format(opt.format);
    out.rule = "read as " + std::string(out.format->name()) + " (asked for)";
  } else {
    std::string tried;
    std::shared_ptr<const Format> damaged;
    for (const auto& f : registered_formats()) {
      Detection d = f->detect(in, opt);
      if (d.found()) {
        out.format = f;
        out.rule = std::move(d.rule);
        break;
      }
      if (d.how == Detection::verdict::damaged && !damaged) damaged = f;
      if (!d.rule.empty()) tried += " [" + std::string(f->title()) + ": " + d.rule + "]";
    }
    if (!out.format) {
      // Named like a format but not readable as one: its reader says precisely what is wrong.
      if (damaged) (void)damaged->describe(in, opt);
      throw_error(errors::unknown_format, (in.is_directory() ? "directory " : "file ") + where,
                  std::string("not a checkpoint ") + (in.is_directory() ? "directory" : "file") +
                      " statedict recognises; looked for:" + tried);
    }
  }
  out.checkpoint = out.format->describe(in, opt);
  if (opt.dequantize) {
    dequantize_options d = *opt.dequantize;
    if (in.is_directory()) detail::block_size_from_config(path / "config.json", d);
    out.checkpoint = dequantize(out.checkpoint, d);
  }
  cast_options how{opt.cast_integer_origin, opt.keep_dtype};
  if (opt.quantize) {
    std::set<std::string, std::less<>> before;
    for (const TensorInfo& t : out.checkpoint.tensors)
      if (t.dtype == dtype::F8_E4M3) before.insert(t.name);
    out.checkpoint = quantize(out.checkpoint, *opt.quantize);
    // `dtype` leaves the new block-FP8 pairs as they are: F8_E4M3 weights and F32 scales.
    auto made = std::make_shared<std::set<std::string, std::less<>>>();
    for (const TensorInfo& t : out.checkpoint.tensors)
      if (t.dtype == dtype::F8_E4M3 && !before.contains(t.name)) {
        made->insert(t.name);
        made->insert(detail::fp8_scale_name(t.name));
      }
    how.keep = [made, user = opt.keep_dtype](std::string_view n) { return made->contains(n) || (user && user(n)); };
  }
  if (opt.dtype && !out.format->applies_dtype()) cast(out.checkpoint, *opt.dtype, how);
  return out;
}

/// The format an output at `out` is written in: `opt.format`, else the registered format that
/// claims the path most strongly (its extension over its options; the first among equals); its
/// options are checked (usage errors) before anything is read.
STATEDICT_API std::shared_ptr<const Format> choose_output(const std::filesystem::path& out, const save_options& opt) {
  std::shared_ptr<const Format> f;
  if (!opt.format.empty()) {
    f = find_format(opt.format);
    if (!f->can_write()) throw_error(errors::cannot_write, "--to " + opt.format, std::string(f->title()) + " checkpoints can be read, not written");
  } else {
    std::string writable;
    output_claim best = output_claim::none;
    for (const auto& g : registered_formats()) {
      if (!g->can_write()) continue;
      writable += (writable.empty() ? "" : "|") + std::string(g->name());
      const output_claim c = g->claims_output(out, opt);
      if (c > best) {
        best = c;
        f = g;
      }
    }
    if (!f)
      throw_error(errors::output_unclear, "output " + quote(out.string()),
                  "cannot tell the output format from its name: name it .safetensors or .pt, or give the format (--to " + writable + ")");
  }
  f->check_output(out, opt);
  return f;
}

/// Writes `ck` at `out` in the chosen format (choose_output), its objects as data (objects_as_data,
/// sparing opt.keep_classes); returns the files written.
STATEDICT_API std::vector<std::string> save(const ShardedCheckpoint& ck, const std::filesystem::path& out, const save_options& opt = {}) {
  const auto f = choose_output(out, opt);
  if (!detail::holds_objects(ck.skeleton)) return f->save(ck, out, opt);
  ShardedCheckpoint data = ck;
  (void)objects_as_data(data, opt.keep_classes);
  return f->save(data, out, opt);
}

}  // namespace statedict::inline v0::formats
