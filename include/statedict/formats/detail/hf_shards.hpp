// statedict: Hugging Face checkpoints whose shards are not all safetensors files: transformers'
// `pytorch_model-0000k-of-0000n.bin` + `pytorch_model.bin.index.json` (torch.save shards), or an
// index mixing both kinds. Each shard is read by its own format (told by its content, never its
// name) and the shards are merged into one description, validated against the index as
// io/hf_sharded.hpp validates safetensors shards (formats/hf.hpp is the public header).
// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/flatten.hpp"
#include "../../io/file.hpp"
#include "../../io/hf_sharded.hpp"
#include "../../io/safetensors.hpp"
#include "../../io/torch_file.hpp"
#include "../../shard/checkpoint.hpp"

namespace statedict::inline v0::hf::detail {

/// Whether the file holds a torch.save archive or pickle (else it is read as safetensors).
inline bool is_torch_file(const ByteSource& src) {
  const torch::file_kind k = torch::detect(src);
  return k == torch::file_kind::zip || k == torch::file_kind::legacy || k == torch::file_kind::legacy_tar;
}

/// One shard described by its own format, its tensors by name and its aliases (name -> target).
struct shard_content {
  ShardedCheckpoint ck;
  std::unordered_map<std::string, std::size_t> tensor;  ///< name -> index into ck.tensors
  std::unordered_map<std::string, std::string> alias;
};

/// Describes shard `path`; `where` names the index for errors. A shard holds named tensors only: a
/// non-tensor value, or a view into another tensor's elements, is hf.shard_content.
inline shard_content describe_shard(const std::filesystem::path& path, const open_options& opt, const torch::load_options& topt,
                                    const std::string& where) {
  shard_content s;
  const std::string at = where + ": shard " + quote(path.filename().string());
  try {
    auto src = InputFile::open(path, opt.mode);
    s.ck = is_torch_file(*src) ? torch::describe(std::move(src), topt) : safetensors::File::open(std::move(src), opt.lim).describe();
  } catch (error& e) {
    e.add_context(where);
    throw;
  }
  if (!s.ck.skeleton.is_null()) {
    if (const auto values = skeleton_values(s.ck.skeleton); !values.empty())
      throw_error(errors::hf_shard_content, at, "holds the value " + quote(values.front().first) + ": a shard holds tensors only");
    if (statedict::detail::may_hold_aliases(s.ck.skeleton))
      for (const auto& t : statedict::detail::list_tensorish(s.ck.skeleton.json())) {
        if (t.kind == statedict::detail::snode::tensor) continue;
        if (t.kind != statedict::detail::snode::alias)
          throw_error(errors::hf_shard_content, at, "tensor " + quote(t.name) + " is a view into " + quote(t.target) +
                                                        "; a shard holds whole tensors (or the same tensor under two names)");
        s.alias.emplace(t.name, t.target);
      }
  }
  for (std::size_t i = 0; i < s.ck.tensors.size(); ++i) s.tensor.emplace(s.ck.tensors[i].name, i);
  return s;
}

/// The checkpoint an index describes, each shard read by its own format: tensors in weight_map
/// order (each once; a name the index lists that its shard holds as an alias of another tensor
/// stays a tie), sources = every shard's sources, metadata = the index's. Every weight_map entry
/// must be in its shard, and every tensor of a shard listed for that shard.
inline ShardedCheckpoint describe_mixed_index(const std::filesystem::path& index_path, const Index& index, const open_options& opt,
                                              const torch::load_options& topt) {
  const std::string where = "checkpoint " + quote(index_path.string());
  const std::filesystem::path dir = statedict::detail::parent_or_dot(index_path);
  std::vector<shard_content> shards;
  std::vector<std::uint32_t> first_source;
  ShardedCheckpoint out;
  out.format = "hf_sharded";
  for (const std::string& fn : index.files) {
    shards.push_back(describe_shard(dir / fn, opt, topt, where));
    first_source.push_back(static_cast<std::uint32_t>(out.sources.size()));
    for (auto& src : shards.back().ck.sources) out.sources.push_back(src);
  }
  std::unordered_map<std::string, std::size_t> listed_file;
  std::vector<std::pair<std::string, std::string>> aliases;
  for (const auto& [name, k] : index.listed) {
    listed_file.emplace(name, k);
    shard_content& s = shards[k];
    if (auto it = s.tensor.find(name); it != s.tensor.end()) {
      TensorInfo t = std::move(s.ck.tensors[it->second]);
      for (Chunk& c : t.chunks) c.at.source += first_source[k];
      out.tensors.push_back(std::move(t));
    } else if (auto a = s.alias.find(name); a != s.alias.end()) {
      aliases.emplace_back(name, a->second);
    } else {
      throw_error(errors::hf_missing_tensor, where + ": tensor " + quote(name),
                  "the index puts it in " + quote(index.files[k]) + ", which does not contain it");
    }
  }
  for (std::size_t k = 0; k < shards.size(); ++k) {
    auto check = [&](const std::string& name) {
      auto it = listed_file.find(name);
      if (it == listed_file.end())
        throw_error(errors::hf_unlisted_tensor, where + ": tensor " + quote(name),
                    "is in " + quote(index.files[k]) + " but not in the index's weight_map");
      if (it->second != k)
        throw_error(errors::hf_tensor_in_two_files, where + ": tensor " + quote(name),
                    "is in both " + quote(index.files[it->second]) + " and " + quote(index.files[k]));
    };
    for (const auto& [name, i] : shards[k].tensor) check(name);
    for (const auto& [name, target] : shards[k].alias) {
      check(name);
      if (listed_file.count(target) == 0)  // the tie's target must be stored too
        throw_error(errors::hf_unlisted_tensor, where + ": tensor " + quote(target),
                    "is in " + quote(index.files[k]) + " (as the target of " + quote(name) + ") but not in the index's weight_map");
    }
  }
  if (!aliases.empty()) out.skeleton = safetensors::File::flat_skeleton_with_aliases(out.tensors, aliases);
  for (const auto& [k, v] : index.metadata.items()) out.metadata[k] = v.is_string() ? v.get<std::string>() : v.dump();
  return out;
}

}  // namespace statedict::inline v0::hf::detail
