// statedict: the format plug-in interface, and the options every format shares.
// SPDX-License-Identifier: MIT
//
// A checkpoint layout (safetensors, torch.save, DCP, DeepSpeed, ...) is one class derived from
// Format, in one header under formats/: detect() says from content whether an input is that
// layout (and why, or what it looked for instead), describe() turns it into the ShardedCheckpoint
// every writer consumes, and save() writes one where the layout can be written. The registry
// (formats/registry.hpp) lists them; open() and save() go through it. A format's own options (its
// caps on hostile input, its switches) travel in open_options::settings / save_options::settings
// by type, so adding a format adds no field here.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <typeindex>
#include <typeinfo>
#include <utility>
#include <vector>

#include "../core/dtype.hpp"
#include "../core/error.hpp"
#include "../core/source.hpp"
#include "../exec/options.hpp"
#include "../io/file.hpp"
#include "../shard/checkpoint.hpp"
#include "../shard/plan_options.hpp"
#include "transform_types.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id unknown_format  {790, error_kind::format, "detect.unknown_format"};
inline constexpr error_id no_such_path    {791, error_kind::usage,  "detect.no_such_path"};
inline constexpr error_id no_such_format  {795, error_kind::usage,  "formats.no_such_format"};
inline constexpr error_id cannot_write    {796, error_kind::usage,  "formats.cannot_write"};
inline constexpr error_id output_unclear  {797, error_kind::usage,  "formats.output_unclear"};
inline constexpr error_id bad_save_option {798, error_kind::usage,  "formats.bad_save_option"};
// clang-format on
}  // namespace errors

namespace formats {

/// Settings of particular formats and readers, kept by type: a format reads its own with
/// `get<dcp::limits>()` (a default one when nobody set it), a caller changes one with
/// `set<dcp::limits>().max_files = 8`. Copies are deep.
class settings {
 public:
  settings() = default;
  settings(const settings& o) {
    for (const auto& [k, v] : o.items_) items_.emplace(k, v->clone());
  }
  settings(settings&&) noexcept = default;
  settings& operator=(const settings& o) {
    if (this != &o) *this = settings(o);
    return *this;
  }
  settings& operator=(settings&&) noexcept = default;
  ~settings() = default;

  template <class T>
  [[nodiscard]] const T& get() const {
    if (const auto it = items_.find(std::type_index(typeid(T))); it != items_.end()) return static_cast<const item<T>&>(*it->second).value;
    static const T fallback{};
    return fallback;
  }
  /// The settings of type T, for editing (made with T's defaults on first use).
  template <class T>
  T& set() {
    auto& slot = items_[std::type_index(typeid(T))];
    if (!slot) slot = std::make_unique<item<T>>();
    return static_cast<item<T>&>(*slot).value;
  }
  template <class T>
  T& set(T value) {
    return set<T>() = std::move(value);
  }

 private:
  struct any_item {
    virtual ~any_item() = default;
    [[nodiscard]] virtual std::unique_ptr<any_item> clone() const = 0;
  };
  template <class T>
  struct item final : any_item {
    T value{};
    item() = default;
    explicit item(const T& v) : value(v) {}
    [[nodiscard]] std::unique_ptr<any_item> clone() const override { return std::make_unique<item>(value); }
  };
  std::map<std::type_index, std::unique_ptr<any_item>> items_;
};

/// How open() reads a checkpoint.
struct open_options {
  /// mmap (default) or pread (network filesystems).
  read_mode mode = read_mode::mmap;
  /// Describe optimizer state too, keyed by parameter name, for formats that shard it (DeepSpeed,
  /// FSDP). Formats that store it as ordinary entries (torch.save files, DCP) always include it.
  bool with_optimizer = false;
  /// dtype of every floating model tensor. Formats that choose dtypes while describing apply it
  /// there (DeepSpeed: F32 master weights by default, as zero_to_fp32); for the others open()
  /// sets it on the description and the executor casts exactly (round to nearest even).
  std::optional<statedict::dtype> dtype;
  /// With `dtype`: also cast tensors a reader converted to a floating dtype from an integer one
  /// (DeepSpeed's buffers: TensorInfo::converted_from), which the dtype may not hold exactly.
  bool cast_integer_origin = false;
  /// With `dtype`: tensors whose names this accepts keep their dtype (`--keep-dtype REGEX`).
  std::function<bool(std::string_view)> keep_dtype;
  /// Dequantize block-FP8 / MXFP4 pairs (formats::dequantize) before `dtype` is applied. For a
  /// directory with a config.json, its `quantization_config.weight_block_size` gives the block.
  std::optional<dequantize_options> dequantize;
  /// Quantize the selected weights to block-FP8 (formats::quantize) after `dequantize` and before
  /// `dtype`, which then leaves the quantized weights and their scales as they are.
  std::optional<quantize_options> quantize;
  /// Check that replicated copies agree (ShardedTensor rank files; the planner checks the rest).
  bool check_replicas = false;
  /// Read the input as this format (its registry name) instead of detecting it.
  std::string format;
  /// Format settings by type: caps on hostile input (`settings.set<torch::limits>()`,
  /// docs/limits.md lists every field) and format switches.
  formats::settings settings;
};

/// How save() writes a checkpoint.
struct save_options {
  /// The output format (its registry name: "safetensors", "hf", "torch", "dcp", ...); empty: from
  /// the output path (formats/registry.hpp choose_output).
  std::string format;
  exec_options exec{};
  plan_options plan{};
  /// Outputs split into shards by size (Hugging Face): largest shard, decimal units
  /// (huggingface_hub's rule); unset: 5 GB. Given, it also asks for a sharded output.
  std::optional<std::uint64_t> max_shard_size;
  /// Outputs for a number of ranks (DCP): the ranks that will load it.
  std::optional<std::uint32_t> world_size;
  /// Multi-file outputs: write only the files of part k of K (shard/plan.hpp assign_parts),
  /// each atomically, straight into the output directory; `index_only` writes only the index
  /// (after checking that every file exists with its planned size), the final step.
  std::optional<PartSpec> part;
  bool index_only = false;
  /// Classes written as themselves ("argparse.Namespace"). Every other object whose class
  /// torch.load(weights_only=True) does not accept is written as its data (formats/objects.hpp),
  /// so that loading the output runs no code; name a class here only for input you trust.
  std::vector<std::string> keep_classes;
  /// Format settings by type (`settings.set<dcp::save_settings>()`).
  formats::settings settings;
};

/// What a format's detect() says about an input.
struct Detection {
  enum class verdict : std::uint8_t {
    no,       ///< not this format (`rule` says what was looked for and found; empty: not applicable)
    damaged,  ///< not readable as this format, but named like it: when nothing matches, describe()
              ///< is run to report precisely what is wrong
    yes,      ///< this format; `rule` is the rule that matched
  };
  verdict how = verdict::no;
  std::string rule;

  static Detection match(std::string rule) { return {verdict::yes, std::move(rule)}; }
  static Detection miss(std::string why) { return {verdict::no, std::move(why)}; }
  static Detection not_applicable() { return {verdict::no, {}}; }
  static Detection named_like(std::string why) { return {verdict::damaged, std::move(why)}; }
  [[nodiscard]] bool found() const noexcept { return how == verdict::yes; }
};

/// The input as every format's detect() sees it: its path and, for a file, its bytes (opened once
/// and shared by all formats).
class Input {
 public:
  Input(std::filesystem::path path, read_mode mode) : path_(std::move(path)), mode_(mode) {
    std::error_code ec;
    dir_ = std::filesystem::is_directory(path_, ec);
  }
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  [[nodiscard]] bool is_directory() const noexcept { return dir_; }
  [[nodiscard]] std::string filename() const { return path_.filename().string(); }
  [[nodiscard]] read_mode mode() const noexcept { return mode_; }
  /// The file's bytes (nullptr for a directory).
  [[nodiscard]] const std::shared_ptr<const ByteSource>& file() const {
    if (!dir_ && !file_) file_ = InputFile::open(path_, mode_);
    return file_;
  }
  /// Up to the first 4 KiB of the file (empty for a directory).
  [[nodiscard]] std::span<const std::byte> head() const {
    if (!dir_ && !head_read_) {
      const auto& f = file();
      head_.resize(static_cast<std::size_t>(std::min<std::uint64_t>(f->size(), 4096)));
      f->peek(0, head_);
      head_read_ = true;
    }
    return head_;
  }

 private:
  std::filesystem::path path_;
  read_mode mode_;
  bool dir_ = false;
  mutable std::shared_ptr<const ByteSource> file_;
  mutable std::vector<std::byte> head_;
  mutable bool head_read_ = false;
};

/// How strongly a format claims an output path (Format::claims_output): by its name (an extension
/// of the format's) over by the options given (a world size asks for DCP).
enum class output_claim : std::uint8_t { none, by_options, by_name };

/// One checkpoint layout.
class Format {
 public:
  Format() = default;
  Format(const Format&) = delete;
  Format& operator=(const Format&) = delete;
  virtual ~Format() = default;

  /// Registry name: the value of `--to` / `open_options::format`, and ShardedCheckpoint::format
  /// of what it describes ("dcp").
  [[nodiscard]] virtual std::string_view name() const noexcept = 0;
  /// What it is, in words ("torch.distributed.checkpoint directory").
  [[nodiscard]] virtual std::string_view title() const noexcept = 0;

  /// Says from content whether `in` is this format. Never throws for an input that is not; the
  /// rule says what matched, or what was looked for and found (open() lists these when no format
  /// matches).
  [[nodiscard]] virtual Detection detect(const Input& in, const open_options& opt) const = 0;
  /// Describes `in`: every tensor, where its bytes are, and the rest of the tree.
  [[nodiscard]] virtual ShardedCheckpoint describe(const Input& in, const open_options& opt) const = 0;
  /// True when describe() applies open_options::dtype itself.
  [[nodiscard]] virtual bool applies_dtype() const noexcept { return false; }

  /// True when this format can write checkpoints.
  [[nodiscard]] virtual bool can_write() const noexcept { return false; }
  /// Whether an output at `out` with these options is this format's by default: by its name (the
  /// format's extension), or by the options given. save() picks the strongest claim, then the
  /// first registered format.
  [[nodiscard]] virtual output_claim claims_output(const std::filesystem::path& /*out*/, const save_options& /*opt*/) const {
    return output_claim::none;
  }
  /// Checks the options for an output at `out` before anything is read (throws a usage error).
  virtual void check_output(const std::filesystem::path& /*out*/, const save_options& /*opt*/) const {}
  /// Writes `ck` at `out` atomically; returns the names of the files written.
  virtual std::vector<std::string> save(const ShardedCheckpoint& ck, const std::filesystem::path& out, const save_options& opt) const {
    (void)ck;
    (void)opt;
    throw_error(errors::cannot_write, "output " + quote(out.string()), std::string(name()) + " checkpoints can be read, not written");
  }
};

/// A checkpoint and how it was recognised.
struct Opened {
  ShardedCheckpoint checkpoint;
  /// The detection rule that matched, in words.
  std::string rule;
  /// The format that read it.
  std::shared_ptr<const Format> format;
};

}  // namespace formats
}  // namespace statedict::inline v0
