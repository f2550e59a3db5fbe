// statedict: open any supported checkpoint as a ShardedCheckpoint, detecting its format from content.
// SPDX-License-Identifier: MIT
//
// Files: safetensors (an 8-byte header length, then a JSON object), torch.save (a zip archive, or
// the legacy pickle stream), a Hugging Face index (`*.index.json`). Directories: DCP (`.metadata`),
// DeepSpeed ZeRO (`latest` or a tag folder), OLMo/FSDP flat parameters (`model/rank<N>.pt`),
// ShardedTensor rank files (`rank<N>.pt`), Hugging Face sharded (`model.safetensors.index.json` or
// `model.safetensors`). Each format's own detect() decides from the bytes; the result says which
// rule matched. When nothing matches, the error lists what each rule looked for and what it found.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "../core/error.hpp"
#include "../io/file.hpp"
#include "../io/hf_sharded.hpp"
#include "../io/safetensors.hpp"
#include "../io/torch_file.hpp"
#include "../shard/checkpoint.hpp"
#include "dcp.hpp"
#include "deepspeed.hpp"
#include "fsdp.hpp"
#include "sharded_tensor.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id unknown_format {790, error_kind::format, "detect.unknown_format"};
inline constexpr error_id no_such_path   {791, error_kind::usage,  "detect.no_such_path"};
// clang-format on
}  // namespace errors

namespace formats {

/// Caps on hostile input of every reader open() may hand a path to (docs/limits.md lists each
/// field, its default and its error). Raise a field when a legitimate checkpoint exceeds it.
struct open_limits {
  safetensors::limits safetensors{};
  /// Largest Hugging Face index file read (hf::open_options::max_index_bytes).
  std::uint64_t max_index_bytes = hf::open_options{}.max_index_bytes;
  torch::limits torch{};
  dcp::limits dcp{};
  deepspeed::limits deepspeed{};
  fsdp::limits fsdp{};
  sharded_tensor::limits sharded_tensor{};
};

struct open_options {
  /// mmap (default) or pread (network filesystems).
  read_mode mode = read_mode::mmap;
  /// Describe optimizer state too, keyed by parameter name (DeepSpeed, FSDP). Formats that store
  /// the optimizer state as ordinary entries (torch.save files, DCP) always include it.
  bool with_optimizer = false;
  /// dtype of the model tensors of formats that choose it while describing (DeepSpeed: F32 by
  /// default as zero_to_fp32; FSDP: the flat parameter's). Other formats are cast by cast().
  std::optional<statedict::dtype> dtype;
  /// Check that replicated copies agree (ShardedTensor rank files; the planner checks the rest).
  bool check_replicas = false;
  /// Caps on hostile input, per reader.
  open_limits limits{};
};

/// A checkpoint and how it was recognised.
struct Opened {
  ShardedCheckpoint checkpoint;
  /// The detection rule that matched, in words.
  std::string rule;
  /// True when the format already applied open_options::dtype.
  bool dtype_applied = false;
};

namespace detail {
/// A safetensors file starts with a little-endian header length that fits the file, followed by
/// a JSON object ('{', after optional spaces).
inline bool looks_like_safetensors(const ByteSource& src, std::string& found) {
  if (src.size() < 9) {
    found = "the file has " + std::to_string(src.size()) + " bytes, fewer than a safetensors header needs";
    return false;
  }
  std::byte head[8];
  src.read(0, head);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | std::to_integer<std::uint64_t>(head[i]);
  if (n > src.size() - 8) {
    found = "the first 8 bytes (" + std::to_string(n) + " as a header length) exceed the file";
    return false;
  }
  std::byte c[1];
  for (std::uint64_t i = 8; i < 8 + n && i < 8 + 64; ++i) {
    src.read(i, c);
    const auto ch = std::to_integer<char>(c[0]);
    if (ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r') continue;
    if (ch == '{') return true;
    break;
  }
  found = "no JSON object after the header length";
  return false;
}

/// True when the byte after the 8-byte header length is '{', whatever the length says.
inline bool json_after_length(const ByteSource& src) {
  if (src.size() < 9) return false;
  std::byte c[1];
  src.read(8, c);
  return std::to_integer<char>(c[0]) == '{';
}

inline bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace detail

/// Opens `path` (a file or a directory) as a ShardedCheckpoint.
inline Opened open(const std::filesystem::path& path, const open_options& opt = {}) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string where = quote(path.string());
  if (!fs::exists(path, ec)) throw_error(errors::no_such_path, where, "no such file or directory");
  Opened out;
  const hf::open_options hf_options{.mode = opt.mode, .lim = opt.limits.safetensors, .max_index_bytes = opt.limits.max_index_bytes};
  if (fs::is_directory(path, ec)) {
    std::vector<std::string> tried;
    if (auto d = dcp::detect(path); d.found) {
      out.checkpoint = dcp::describe(path, dcp::options{.limits = opt.limits.dcp, .mode = opt.mode});
      out.rule = d.rule;
      return out;
    } else {
      tried.push_back("DCP: " + d.rule);
    }
    if (auto d = deepspeed::detect(path, {}, opt.limits.deepspeed); d.found) {
      deepspeed::options o;
      o.dtype = opt.dtype;
      o.with_optimizer = opt.with_optimizer;
      o.mode = opt.mode;
      o.limits = opt.limits.deepspeed;
      out.checkpoint = deepspeed::describe(path, o);
      out.rule = d.rule;
      out.dtype_applied = true;
      return out;
    } else {
      tried.push_back("DeepSpeed: " + d.rule);
    }
    if (auto d = fsdp::detect(path, opt.limits.fsdp); d.found) {
      fsdp::options o;
      o.dtype = opt.dtype;
      o.with_optimizer = opt.with_optimizer;
      o.with_train_state = opt.with_optimizer;
      o.mode = opt.mode;
      o.limits = opt.limits.fsdp;
      out.checkpoint = fsdp::describe(path, o);
      out.rule = d.rule;
      out.dtype_applied = true;
      return out;
    } else {
      tried.push_back("FSDP flat parameters: " + d.rule);
    }
    if (auto d = sharded_tensor::detect(path); d.found) {
      sharded_tensor::options o;
      o.mode = opt.mode;
      o.check_replicas = opt.check_replicas;
      o.limits = opt.limits.sharded_tensor;
      out.checkpoint = sharded_tensor::describe(path, o);
      out.rule = d.rule;
      return out;
    } else {
      tried.push_back("ShardedTensor rank files: " + d.rule);
    }
    if (fs::exists(path / hf::index_name, ec) || fs::exists(path / hf::single_name, ec)) {
      out.checkpoint = hf::Checkpoint::open(path, hf_options).describe();
      out.rule = fs::exists(path / hf::index_name, ec) ? "Hugging Face sharded: " + std::string(hf::index_name)
                                                       : "Hugging Face single file: " + std::string(hf::single_name);
      return out;
    }
    tried.push_back(std::string("Hugging Face: neither ") + std::string(hf::index_name) + " nor " +
                    std::string(hf::single_name) + " is in the directory");
    std::string msg = "not a checkpoint directory statedict recognises; looked for:";
    for (const auto& t : tried) msg += " [" + t + "]";
    throw_error(errors::unknown_format, "directory " + where, msg);
  }

  const std::string name = path.filename().string();
  if (detail::ends_with(name, ".index.json")) {
    out.checkpoint = hf::Checkpoint::open(path, hf_options).describe();
    out.rule = "Hugging Face index file";
    return out;
  }
  auto src = InputFile::open(path, opt.mode);
  std::string st_found;
  if (detail::looks_like_safetensors(*src, st_found)) {
    out.checkpoint = safetensors::File::open(src, opt.limits.safetensors).describe();
    out.rule = "safetensors: little-endian header length followed by a JSON object";
    return out;
  }
  switch (torch::detect(*src)) {
    case torch::file_kind::zip:
      out.checkpoint = torch::describe(src, torch::load_options{.limits = opt.limits.torch, .mode = opt.mode});
      out.rule = "torch.save: zip archive";
      return out;
    case torch::file_kind::legacy:
    case torch::file_kind::legacy_tar:
      out.checkpoint = torch::describe(src, torch::load_options{.limits = opt.limits.torch, .mode = opt.mode});
      out.rule = "torch.save: legacy (pre-1.6) format";
      return out;
    case torch::file_kind::unknown: break;
  }
  // Neither format matched. A file named .safetensors, or whose header length is followed by a
  // JSON object, is a damaged safetensors file (a truncated one, or one whose header length lies):
  // the safetensors reader says precisely what is wrong with it.
  if (detail::ends_with(name, ".safetensors") || detail::json_after_length(*src))
    (void)safetensors::File::open(src, opt.limits.safetensors);
  throw_error(errors::unknown_format, "file " + where,
              "not a checkpoint file statedict recognises; looked for: [safetensors: " + st_found +
                  "] [torch.save: neither a zip archive (PK\\x03\\x04) nor a pickle (\\x80\\x02)]");
}

}  // namespace formats
}  // namespace statedict::inline v0
