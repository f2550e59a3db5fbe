// statedict: DeepSpeed ZeRO rank files parsed (model states, optimizer states) and every tensor of
// the consolidated checkpoint placed in them, as zero_to_fp32 would consolidate it
// (formats/deepspeed.hpp is the public header).
// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../../core/dtype.hpp"
#include "../../core/error.hpp"
#include "../../core/shape.hpp"
#include "../../core/tensor.hpp"
#include "../../core/value.hpp"
#include "../../core/visit.hpp"
#include "../../io/file.hpp"
#include "../../io/torch_file.hpp"
#include "../../shard/checkpoint.hpp"
#include "../../shard/layout.hpp"
#include "files.hpp"
#include "../format.hpp"
#include "../optim_shard.hpp"

#include "../deepspeed.hpp"

namespace statedict::inline v0::deepspeed::detail {


using optim_shard::Access;

using formats::detail::file_ctx;

/// ZeroStageEnum as pickled by Python <= 3.10 (REDUCE(cls, (2,))), >= 3.11
/// (getattr(cls, 'gradients')), or a plain int (older DeepSpeed).
inline int zero_stage(const Value& v, const Access& a) {
  auto by_name = [](std::string_view n) -> int {
    if (n == "disabled") return 0;
    if (n == "optimizer_states") return 1;
    if (n == "gradients") return 2;
    if (n == "weights" || n == "max_stage") return 3;
    return -1;
  };
  int s = -1;
  if (v.is_int()) {
    s = static_cast<int>(std::clamp<std::int64_t>(v.as_int(), -1, 100));
  } else if (v.is_object()) {
    const Object& o = v.as_object();
    if (o.name == "ZeroStageEnum" && o.args.size() == 1 && o.args[0].is_int()) {
      s = static_cast<int>(std::clamp<std::int64_t>(o.args[0].as_int(), -1, 100));
    } else if ((o.qualified() == "builtins.getattr" || o.qualified() == "__builtin__.getattr") && o.args.size() == 2 &&
               o.args[0].is_object() && o.args[0].as_object().name == "ZeroStageEnum" && o.args[1].is_string()) {
      s = by_name(o.args[1].as_string());
    }
  }
  if (s < 1 || s > 3)
    a.fail("optimizer_state_dict.zero_stage is not a ZeRO stage 1, 2 or 3 (an int or deepspeed's ZeroStageEnum)");
  return s;
}

/// The dp rank in a DeepSpeed optim/model file name (`[bf16_]zero_pp_rank_<dp>_mp_rank_<mp>_...`),
/// and the mp rank; nullopt when the name does not follow the pattern.
struct rank_name {
  std::uint64_t dp = 0;
  std::string mp;
};
inline std::optional<rank_name> parse_rank_name(std::string_view n) {
  const auto at = n.find("zero_pp_rank_");
  if (at == std::string_view::npos) return std::nullopt;
  std::size_t i = at + 13, j = i;
  while (j < n.size() && j - i < 19 && n[j] >= '0' && n[j] <= '9') ++j;
  if (j == i || n.substr(j, 9) != "_mp_rank_") return std::nullopt;
  rank_name r;
  r.dp = std::stoull(std::string(n.substr(i, j - i)));
  std::size_t k = j + 9, m = k;
  while (m < n.size() && n[m] >= '0' && n[m] <= '9') ++m;
  r.mp = std::string(n.substr(k, m - k));
  return r;
}

inline std::string base_name(const std::string& path) {
  return std::filesystem::path(path).filename().string();
}

/// One optim-states file, parsed.
struct optim_file {
  const optim_shard::LoadedFile* file = nullptr;
  const Dict* osd = nullptr;  ///< optimizer_state_dict
  int stage = 0;
  std::vector<std::int64_t> partition_count;
  /// DeepSpeed's BF16_Optimizer (bf16 with fp32 gradient accumulation, stage 0/1): no zero_stage,
  /// the stage-1 flat partitions saved whole, all padding recorded on the last rank.
  bool bf16_optimizer = false;
};

/// One model-states file, parsed.
struct model_file {
  const optim_shard::LoadedFile* file = nullptr;
  const Dict* top = nullptr;
  const Dict* module = nullptr;
  std::vector<std::string> buffer_names;
  /// param_shapes: one list per flat group (stage 1/2) or sub-group (stage 3).
  std::vector<std::vector<std::pair<std::string, shape_t>>> param_shapes;
  std::vector<std::pair<std::string, shape_t>> frozen_shapes;
  const Dict* frozen_fragments = nullptr;
  std::vector<std::pair<std::string, std::string>> shared;  ///< (alias, owner)
};

inline std::vector<std::pair<std::string, shape_t>> shape_list(const Value& v, const Access& a, std::string_view what,
                                                               const limits& lim) {
  std::vector<std::pair<std::string, shape_t>> out;
  const Dict& d = a.dict(v, what);
  if (d.size() > lim.max_entries)
    throw_error(errors::ds_limit, a.where, std::string(what) + " lists " + std::to_string(d.size()) +
                                               " parameters, more than limits::max_entries");
  for (const auto& [k, s] : d) {
    if (!k.is_string()) a.fail(std::string(what) + " has a non-string key " + k.str());
    out.emplace_back(k.as_string(), a.shape(s, std::string(what) + "[" + quote(k.as_string()) + "]"));
  }
  return out;
}

inline model_file parse_model(const optim_shard::LoadedFile& f, const limits& lim) {
  model_file m;
  m.file = &f;
  Access a{errors::ds_bad_model_states, file_ctx(f)};
  const Dict& top = a.dict(f.tree, "the model states");
  m.top = &top;
  if (top.contains("num_experts") && !top.contains("param_shapes"))
    throw_error(errors::ds_moe, a.where,
                "a mixture-of-experts checkpoint (num_experts, no param_shapes): DeepSpeed saves no "
                "param_shapes for it, so its fp32 partitions cannot be mapped to names "
                "(docs/formats/deepspeed.md, 'Mixture of experts')");
  // zero_to_fp32 parse_model_states: "is not a model state checkpoint" without buffer_names.
  const Value& bn = a.at(top, "buffer_names", "the model states (not a DeepSpeed model-states file?)");
  for (const Value& n : a.list(bn, "buffer_names")) m.buffer_names.push_back(a.string(n, "a buffer_names entry"));
  m.module = &a.dict(a.at(top, "module", "the model states"), "module");
  const List& ps = a.list(a.at(top, "param_shapes", "the model states"), "param_shapes");
  if (ps.size() > lim.max_entries) throw_error(errors::ds_limit, a.where, "param_shapes has too many groups");
  for (std::size_t g = 0; g < ps.size(); ++g)
    m.param_shapes.push_back(shape_list(ps[g], a, "param_shapes[" + std::to_string(g) + "]", lim));
  if (const Value* fs = Access::opt(top, "frozen_param_shapes")) m.frozen_shapes = shape_list(*fs, a, "frozen_param_shapes", lim);
  if (const Value* ff = Access::opt(top, "frozen_param_fragments")) m.frozen_fragments = &a.dict(*ff, "frozen_param_fragments");
  const Value& sp = a.at(top, "shared_params", "the model states");
  if (!sp.is_none())
    for (const auto& [k, v] : a.dict(sp, "shared_params")) {
      if (!k.is_string()) a.fail("shared_params has a non-string key " + k.str());
      m.shared.emplace_back(k.as_string(), a.string(v, "shared_params[" + quote(k.as_string()) + "]"));
    }
  if (const Value* mp = Access::opt(top, "mp_world_size"); mp && mp->is_int() && mp->as_int() != 1)
    throw_error(errors::ds_model_parallel, a.where,
                "mp_world_size is " + std::to_string(mp->as_int()) +
                    "; model (tensor) parallel ZeRO checkpoints are not consolidated (each mp rank is a "
                    "different slice of the model, which zero_to_fp32 does not merge either)");
  return m;
}

inline optim_file parse_optim(const optim_shard::LoadedFile& f) {
  optim_file o;
  o.file = &f;
  Access a{errors::ds_bad_optim_states, file_ctx(f)};
  const Dict& top = a.dict(f.tree, "the optim states");
  if (top.contains("optimizer") && !top.contains("optimizer_state_dict"))
    throw_error(errors::ds_moe, a.where,
                "holds 'optimizer' and no 'optimizer_state_dict': an expert-parallel optim file of a "
                "mixture-of-experts checkpoint");
  o.osd = &a.dict(a.at(top, "optimizer_state_dict", "the optim states (not a DeepSpeed ZeRO optim-states file?)"),
                  "optimizer_state_dict");
  // zero_to_fp32 parse_optim_states: "is not a zero checkpoint" without zero_stage. The
  // BF16_Optimizer (runtime/bf16_optimizer.py state_dict) saves no zero_stage but the stage-1
  // keys; zero_to_fp32 refuses it, ds_to_universal.py reads it, and so does this reader.
  if (const Value* zs = Access::opt(*o.osd, "zero_stage")) {
    o.stage = zero_stage(*zs, a);
  } else if (o.osd->contains("single_partition_of_fp32_groups") && o.osd->contains("base_optimizer_state") &&
             o.osd->contains("group_paddings") && !o.osd->contains("loss_scaler")) {
    o.stage = 1;
    o.bf16_optimizer = true;
  } else {
    a.fail("optimizer_state_dict has no zero_stage (a ZeRO optimizer's files have it) and is not DeepSpeed's "
           "BF16_Optimizer layout either (single_partition_of_fp32_groups, base_optimizer_state, group_paddings): "
           "not a ZeRO checkpoint?");
  }
  const Value& pc = a.at(*o.osd, "partition_count", "optimizer_state_dict");
  if (pc.is_int()) {
    o.partition_count.push_back(pc.as_int());
  } else {
    for (const Value& v : a.list(pc, "partition_count")) o.partition_count.push_back(a.integer(v, "a partition_count entry"));
  }
  if (o.partition_count.empty()) a.fail("partition_count is empty");
  for (std::int64_t c : o.partition_count)
    if (c < 1) a.fail("partition_count holds " + std::to_string(c) + "; expected a rank count >= 1");
  return o;
}

/// Element i of an integer or bool view as PyTorch's `.float()` gives it (round to nearest even,
/// which is what the conversion below does under the default rounding mode).
inline float as_float(const TensorView& t, std::uint64_t i) {
  const std::byte* p = t.data() + t.byte_offset_of(i);
  auto get = [&](auto x) {
    std::memcpy(&x, p, sizeof x);
    return x;
  };
  switch (t.dtype()) {
    case dtype::BOOL: return get(std::uint8_t{}) != 0 ? 1.0F : 0.0F;
    case dtype::U8: return static_cast<float>(get(std::uint8_t{}));
    case dtype::I8: return static_cast<float>(get(std::int8_t{}));
    case dtype::I16: return static_cast<float>(get(std::int16_t{}));
    case dtype::U16: return static_cast<float>(get(std::uint16_t{}));
    case dtype::I32: return static_cast<float>(get(std::int32_t{}));
    case dtype::U32: return static_cast<float>(get(std::uint32_t{}));
    case dtype::I64: return static_cast<float>(get(std::int64_t{}));
    case dtype::U64: return static_cast<float>(get(std::uint64_t{}));
    default: return 0.0F;
  }
}
inline void store_f32(std::byte* p, float f) { std::memcpy(p, &f, 4); }

/// The logical dtype of an output model tensor.
inline statedict::dtype out_dtype(const options& opt, statedict::dtype natural) { return opt.dtype.value_or(natural); }

/// The state being assembled.
struct builder {
  const options& opt;
  optim_shard::SourceTable table;
  ShardedCheckpoint ckpt;
  optim_shard::SkeletonBuilder skel;
  std::unordered_set<std::string> names;  ///< model entries so far (tensors and aliases)

  explicit builder(const options& o) : opt(o) {}

  void claim(const std::string& name, std::string_view what, const std::string& where) {
    if (!names.insert(name).second)
      throw_error(errors::ds_duplicate_name, where, std::string(what) + " " + quote(name) + " appears twice in the output");
  }
  void add_model_tensor(TensorInfo t, std::string_view what, const std::string& where) {
    claim(t.name, what, where);
    skel.tensor(std::vector<std::string>{t.name}, t);
    ckpt.tensors.push_back(std::move(t));
  }
};

/// Buffers: `module` entries named in buffer_names, in module order, as `.float()` makes them
/// (zero_to_fp32 parse_model_states).
inline void add_buffers(builder& b, const model_file& m) {
  const std::string where = file_ctx(*m.file);
  std::unordered_set<std::string> wanted(m.buffer_names.begin(), m.buffer_names.end());
  std::unordered_set<std::string> seen;
  for (const auto& [k, v] : *m.module) {
    if (!k.is_string() || !wanted.count(k.as_string())) continue;
    const std::string& name = k.as_string();
    seen.insert(name);
    if (!v.is_tensor())
      throw_error(errors::ds_buffer, where, "module[" + quote(name) + "] is a " + std::string(to_string(v.kind())) +
                                                ", expected the buffer's tensor");
    const TensorView& t = v.as_tensor();
    TensorInfo info{name, b.opt.dtype.value_or(dtype::F32), t.shape(), {}};
    if (is_floating(t.dtype())) {
      info.chunks.push_back(optim_shard::whole_chunk(t, b.table, where + ": module[" + quote(name) + "]"));
    } else if (!statedict::info(t.dtype()).is_complex) {
      // .float() of an integer or bool buffer, computed here as PyTorch converts (nearest even).
      const std::uint64_t bytes = checked_mul(t.numel(), 4, "buffer size");
      if (bytes > b.opt.limits.max_converted_buffer_bytes)
        throw_error(errors::ds_limit, where,
                    "integer buffer " + quote(name) + " needs " + std::to_string(bytes) +
                        " bytes as F32, more than limits::max_converted_buffer_bytes");
      const Tensor values = b.table.materialize(t, where + ": module[" + quote(name) + "]");
      std::vector<std::byte> out(static_cast<std::size_t>(bytes));
      for (std::uint64_t i = 0; i < t.numel(); ++i)
        store_f32(out.data() + i * 4, as_float(values.view(), i));
      const std::uint32_t src = b.table.add_owned(name + " (as F32)", std::move(out));
      info.chunks.push_back(Chunk{full_box(t.shape()), Placement{src, 0, {}, dtype::F32}});
      info.converted_from = t.dtype();
      if (!b.opt.cast_integer_buffers) info.dtype = dtype::F32;
    } else {
      throw_error(errors::ds_buffer, where, "buffer " + quote(name) + " is " + std::string(statedict::name(t.dtype())) +
                                                ", which `.float()` would not convert exactly");
    }
    b.add_model_tensor(std::move(info), "buffer", where);
  }
  for (const std::string& n : m.buffer_names)
    if (!seen.count(n))
      throw_error(errors::ds_buffer, where, "buffer_names lists " + quote(n) + " but module has no such tensor");
}


/// Stage 1/2 frozen parameters: frozen_param_fragments[name] as-is, in the model dtype
/// (zero_to_fp32 _zero2_merge_frozen_params), only when frozen_param_shapes is non-empty.
inline void add_frozen12(builder& b, const model_file& m) {
  const std::string where = file_ctx(*m.file);
  if (m.frozen_shapes.empty()) return;
  if (!m.frozen_fragments)
    throw_error(errors::ds_frozen, where, "frozen_param_shapes lists " + std::to_string(m.frozen_shapes.size()) +
                                              " parameters but frozen_param_fragments is missing");
  for (const auto& [name, shape] : m.frozen_shapes) {
    const Value* v = m.frozen_fragments->find(name);
    if (!v || !v->is_tensor())
      throw_error(errors::ds_frozen, where, "frozen_param_fragments has no tensor for frozen parameter " + quote(name));
    const TensorView& t = v->as_tensor();
    if (t.shape() != shape)
      throw_error(errors::ds_frozen, where, "frozen_param_fragments[" + quote(name) + "] has shape " + to_string(t.shape()) +
                                                ", frozen_param_shapes says " + to_string(shape));
    if (!is_floating(t.dtype()))
      throw_error(errors::ds_dtype, where, "frozen parameter " + quote(name) + " is " + std::string(statedict::name(t.dtype())));
    TensorInfo info{name, out_dtype(b.opt, t.dtype()), shape, {}};
    info.chunks.push_back(optim_shard::whole_chunk(t, b.table, where + ": frozen_param_fragments[" + quote(name) + "]"));
    b.add_model_tensor(std::move(info), "frozen parameter", where);
  }
}

/// Stage 3 frozen parameters: rank r's fragment holds elements [r * pn, (r + 1) * pn) of the
/// parameter, pn = ceil(numel / W), the tail of the last one uninitialised
/// (zero_to_fp32 _zero3_merge_frozen_params; partition_parameters.py _partition_param).
/// Fed one rank's model-states file at a time (add_rank, ranks in order), so that no more than
/// one of them is parsed at once; finish() checks the cover and adds the tensors.
class frozen3 {
 public:
  frozen3(builder& b, const model_file& m0, std::uint32_t W) : b_(b), m0_(m0), W_(W), chunks_(m0.frozen_shapes.size()),
                                                               dtypes_(m0.frozen_shapes.size()) {}

  void add_rank(const model_file& m, std::uint32_t r) {
    const std::string where = file_ctx(*m.file);
    for (std::size_t k = 0; k < m0_.frozen_shapes.size(); ++k) {
      const auto& [name, shape] = m0_.frozen_shapes[k];
      const std::uint64_t n = numel(shape);
      const std::uint64_t pn = layout::zero3_partitioned_param_info(n, W_).partitioned_numel;
      const Value* v = m.frozen_fragments ? m.frozen_fragments->find(name) : nullptr;
      if (!v || !v->is_tensor())
        throw_error(errors::ds_frozen, where, "frozen_param_fragments has no tensor for frozen parameter " + quote(name));
      const TensorView& t = v->as_tensor();
      if (t.numel() != pn)
        throw_error(errors::ds_frozen, where,
                    "rank " + std::to_string(r) + "'s fragment of frozen parameter " + quote(name) + " has " +
                        std::to_string(t.numel()) + " elements; a " + std::to_string(n) + "-element parameter over " +
                        std::to_string(W_) + " ranks has partitions of ceil(" + std::to_string(n) + "/" +
                        std::to_string(W_) + ") = " + std::to_string(pn));
      if (!is_floating(t.dtype()) || (dtypes_[k] && *dtypes_[k] != t.dtype()))
        throw_error(errors::ds_dtype, where, "fragment of frozen parameter " + quote(name) + " is " +
                                                 std::string(statedict::name(t.dtype())));
      dtypes_[k] = t.dtype();
      const std::uint64_t lo = static_cast<std::uint64_t>(r) * pn;  // < n + W: no overflow
      if (lo >= n) continue;                                           // all padding on this rank
      const layout::FlatPiece piece{0, FlatRange{lo, std::min(n, lo + pn)}, 0};
      const optim_shard::RankBuffer buf{optim_shard::Segment{&t, pn, where + ": frozen_param_fragments[" + quote(name) + "]"}};
      for (Chunk& c : optim_shard::place(std::span(&piece, 1), std::span(&buf, 1), b_.table, "frozen parameter " + quote(name)))
        chunks_[k].push_back(std::move(c));
    }
  }

  void finish() {
    for (std::size_t k = 0; k < m0_.frozen_shapes.size(); ++k) {
      const auto& [name, shape] = m0_.frozen_shapes[k];
      TensorInfo info{name, out_dtype(b_.opt, dtypes_[k].value_or(dtype::F32)), shape, std::move(chunks_[k])};
      optim_shard::check_flat_cover(info.chunks, numel(shape), errors::ds_frozen, "frozen parameter " + quote(name));
      b_.add_model_tensor(std::move(info), "frozen parameter", file_ctx(*m0_.file));
    }
  }

 private:
  builder& b_;
  const model_file& m0_;
  std::uint32_t W_;
  std::vector<std::vector<Chunk>> chunks_;
  std::vector<std::optional<statedict::dtype>> dtypes_;
};

/// Stage 1/2 with frozen_from_module: `module` entries that are not buffers, trainable
/// parameters or tied names are the frozen parameters, whole in the model dtype.
inline void add_frozen_from_module(builder& b, const model_file& m) {
  const std::string where = file_ctx(*m.file);
  std::unordered_set<std::string> skip(m.buffer_names.begin(), m.buffer_names.end());
  for (const auto& g : m.param_shapes)
    for (const auto& [n, s] : g) skip.insert(n);
  for (const auto& [alias, owner] : m.shared) skip.insert(alias);
  for (const auto& [k, v] : *m.module) {
    if (!k.is_string() || skip.count(k.as_string()) || b.names.count(k.as_string())) continue;
    if (!v.is_tensor() || !is_floating(v.as_tensor().dtype())) continue;
    const TensorView& t = v.as_tensor();
    TensorInfo info{k.as_string(), out_dtype(b.opt, t.dtype()), t.shape(), {}};
    info.chunks.push_back(optim_shard::whole_chunk(t, b.table, where + ": module[" + quote(k.as_string()) + "]"));
    b.add_model_tensor(std::move(info), "frozen parameter", where);
  }
}

/// The flat tensors of a list in an optim file (single_partition_of_fp32_groups,
/// fp32_flat_groups).
inline std::vector<const TensorView*> flat_list(const optim_file& o, std::string_view key) {
  Access a{errors::ds_bad_optim_states, file_ctx(*o.file)};
  std::vector<const TensorView*> out;
  const List& l = a.list(a.at(*o.osd, std::string(key), "optimizer_state_dict"), key);
  for (std::size_t i = 0; i < l.size(); ++i) {
    const TensorView& t = a.tensor(l[i], std::string(key) + "[" + std::to_string(i) + "]");
    if (t.rank() != 1)
      a.fail(std::string(key) + "[" + std::to_string(i) + "] has shape " + to_string(t.shape()) + "; expected a flat 1-d tensor");
    if (!is_floating(t.dtype()))
      throw_error(errors::ds_dtype, a.where, std::string(key) + "[" + std::to_string(i) + "] is " +
                                                std::string(statedict::name(t.dtype())) + ", not a floating dtype");
    out.push_back(&t);
  }
  return out;
}

/// What the trainable parameters need for the optimizer pass: per parameter its pieces and family.
struct trainable {
  std::vector<optim_shard::ParamState> params;
  /// Names of each optimizer param group's parameters, in param_shapes order.
  std::vector<std::vector<std::string>> group_names;
};

inline std::string where_rank(const optim_file& o, std::uint32_t r) {
  return file_ctx(*o.file) + " (rank " + std::to_string(r) + ")";
}

/// Stage 1/2 trainable parameters (zero_to_fp32 _zero2_merge_trainable_params; the layout is
/// layout::zero12_partitions / zero12_pieces).
inline trainable add_trainable12(builder& b, const model_file& m, const std::vector<optim_file>& optims, std::uint32_t W) {
  trainable out;
  const std::size_t G = m.param_shapes.size();
  std::vector<std::vector<const TensorView*>> parts(W);
  for (std::uint32_t r = 0; r < W; ++r) {
    parts[r] = flat_list(optims[r], "single_partition_of_fp32_groups");
    if (parts[r].size() != G)
      throw_error(errors::ds_group_count, where_rank(optims[r], r),
                  "single_partition_of_fp32_groups has " + std::to_string(parts[r].size()) + " groups; param_shapes in " +
                      quote(base_name(m.file->name)) + " has " + std::to_string(G));
  }
  for (std::size_t g = 0; g < G; ++g) {
    const auto& shapes = m.param_shapes[g];
    std::vector<std::uint64_t> numels;
    for (const auto& [n, s] : shapes) numels.push_back(numel(s));
    const std::uint64_t N = layout::detail::sum_checked(numels);
    const layout::Zero12Partitions z = layout::zero12_partitions(N, W);
    std::vector<optim_shard::RankBuffer> bufs(W);
    std::optional<statedict::dtype> dt;
    for (std::uint32_t r = 0; r < W; ++r) {
      const TensorView& t = *parts[r][g];
      const std::string where = where_rank(optims[r], r);
      const layout::Span part = z.parts[r];
      const std::uint64_t real = N > part.offset ? std::min(part.size, N - part.offset) : 0;
      // DeepSpeed saves the partition with its padding cut off (_get_groups_without_padding); older
      // versions recorded all padding on the last rank only, so accept [real, size]. The
      // BF16_Optimizer saves it whole and records the group's whole padding on the last rank.
      const bool bf16 = optims[r].bf16_optimizer;
      if (t.numel() < (bf16 ? part.size : real) || t.numel() > part.size)
        throw_error(errors::ds_partition_size, where,
                    "group " + std::to_string(g) + ": single_partition_of_fp32_groups[" + std::to_string(g) + "] has " +
                        std::to_string(t.numel()) + " elements; the group's " + std::to_string(N) +
                        " elements padded to " + std::to_string(z.padded_numel) + " (a multiple of 2 x " +
                        std::to_string(W) + " ranks) give rank " + std::to_string(r) + " a partition of " +
                        std::to_string(part.size) + " holding " + std::to_string(real) + " real elements");
      if (const Value* gp = Access::opt(*optims[r].osd, "group_paddings")) {
        const Value* pad = gp->is_sequence() && g < gp->as_list().size() ? &gp->as_list()[g] : nullptr;
        const std::uint64_t want = !bf16 ? part.size - t.numel() : r + 1 == W ? z.padded_numel - N : 0;
        if (!pad || !pad->is_int() || static_cast<std::uint64_t>(pad->as_int()) != want)
          throw_error(errors::ds_partition_size, where,
                      "group_paddings[" + std::to_string(g) + "] is not " + std::to_string(want) +
                          (bf16 ? std::string(" (BF16_Optimizer: the group's padding on the last rank, 0 elsewhere)")
                                : " (the partition of " + std::to_string(part.size) + " minus the " +
                                      std::to_string(t.numel()) + " elements saved)"));
      }
      if (dt && *dt != t.dtype())
        throw_error(errors::ds_dtype, where, "group " + std::to_string(g) + " partition is " +
                                                 std::string(statedict::name(t.dtype())) + ", rank 0's is " +
                                                 std::string(statedict::name(*dt)));
      dt = t.dtype();
      bufs[r].push_back(optim_shard::Segment{&t, part.size,
                                             where + ": single_partition_of_fp32_groups[" + std::to_string(g) + "]"});
    }
    const auto pieces = layout::zero12_pieces(numels, W);
    std::vector<std::string> names;
    for (std::size_t k = 0; k < shapes.size(); ++k) {
      const auto& [name, shape] = shapes[k];
      TensorInfo info{name, out_dtype(b.opt, dt.value_or(dtype::F32)), shape, {}};
      const std::string what = "parameter " + quote(name) + " (group " + std::to_string(g) + ")";
      info.chunks = optim_shard::place(pieces[k], bufs, b.table, what);
      optim_shard::check_flat_cover(info.chunks, numels[k], errors::ds_partition_size, what);
      b.add_model_tensor(std::move(info), "parameter", file_ctx(*m.file));
      out.params.push_back(optim_shard::ParamState{name, shape, g, pieces[k], 0});
      names.push_back(name);
    }
    out.group_names.push_back(std::move(names));
  }
  return out;
}

/// Stage 3 trainable parameters (zero_to_fp32 _zero3_merge_trainable_params,
/// zero3_partitioned_param_info; layout::zero3_pieces over each rank's fp32_flat_groups
/// concatenated).
inline trainable add_trainable3(builder& b, const model_file& m, const std::vector<optim_file>& optims, std::uint32_t W) {
  trainable out;
  std::vector<std::vector<const TensorView*>> flats(W);
  for (std::uint32_t r = 0; r < W; ++r) {
    flats[r] = flat_list(optims[r], "fp32_flat_groups");
    if (flats[r].size() != flats[0].size())
      throw_error(errors::ds_group_count, where_rank(optims[r], r),
                  "fp32_flat_groups has " + std::to_string(flats[r].size()) + " sub-groups, rank 0 has " +
                      std::to_string(flats[0].size()));
    for (std::size_t k = 0; k < flats[r].size(); ++k)
      if (flats[r][k]->numel() != flats[0][k]->numel() || flats[r][k]->dtype() != flats[0][k]->dtype())
        throw_error(errors::ds_partition_size, where_rank(optims[r], r),
                    "fp32_flat_groups[" + std::to_string(k) + "] has " + std::to_string(flats[r][k]->numel()) + " " +
                        std::string(statedict::name(flats[r][k]->dtype())) + " elements, rank 0's has " +
                        std::to_string(flats[0][k]->numel()) + " " + std::string(statedict::name(flats[0][k]->dtype())) +
                        " (every rank holds the same partition sizes)");
  }
  std::vector<std::uint64_t> numels;
  std::vector<std::pair<std::string, shape_t>> all;
  std::vector<std::size_t> subgroup_of;
  for (std::size_t sg = 0; sg < m.param_shapes.size(); ++sg)
    for (const auto& e : m.param_shapes[sg]) {
      all.push_back(e);
      numels.push_back(numel(e.second));
      subgroup_of.push_back(sg);
    }
  std::uint64_t want = 0;
  for (std::uint64_t n : numels) want = checked_add(want, layout::zero3_partitioned_param_info(n, W).partitioned_numel, "partition size");
  std::uint64_t have = 0;
  for (const TensorView* t : flats[0]) have = checked_add(have, t->numel(), "partition size");
  // zero_to_fp32: "consumed {offset * world_size} numels out of {avail_numel}".
  if (want != have)
    throw_error(errors::ds_partition_size, where_rank(optims[0], 0),
                "fp32_flat_groups hold " + std::to_string(have) + " elements per rank; the " + std::to_string(all.size()) +
                    " parameters of param_shapes partitioned over " + std::to_string(W) + " ranks (ceil(numel/" +
                    std::to_string(W) + ") each) need " + std::to_string(want));
  std::vector<optim_shard::RankBuffer> bufs(W);
  for (std::uint32_t r = 0; r < W; ++r)
    for (std::size_t k = 0; k < flats[r].size(); ++k)
      bufs[r].push_back(optim_shard::Segment{flats[r][k], flats[r][k]->numel(),
                                             where_rank(optims[r], r) + ": fp32_flat_groups[" + std::to_string(k) + "]"});
  const statedict::dtype dt = flats[0].empty() ? dtype::F32 : flats[0][0]->dtype();
  const auto pieces = layout::zero3_pieces(numels, W);
  for (std::size_t i = 0; i < all.size(); ++i) {
    const auto& [name, shape] = all[i];
    TensorInfo info{name, out_dtype(b.opt, dt), shape, {}};
    const std::string what = "parameter " + quote(name);
    info.chunks = optim_shard::place(pieces[i], bufs, b.table, what);
    optim_shard::check_flat_cover(info.chunks, numels[i], errors::ds_partition_size, what);
    b.add_model_tensor(std::move(info), "parameter", file_ctx(*m.file));
    out.params.push_back(optim_shard::ParamState{name, shape, 0, pieces[i], subgroup_of[i]});
  }
  return out;
}

/// Tied names: `shared_params` aliases whose owner is in the output (zero_to_fp32 does the same).
inline void add_aliases(builder& b, const model_file& m) {
  const std::string where = file_ctx(*m.file);
  for (const auto& [alias, owner] : m.shared) {
    if (!b.ckpt.find(owner)) continue;
    if (b.names.count(alias))
      throw_error(errors::ds_shared, where, "shared_params makes " + quote(alias) + " an alias of " + quote(owner) +
                                                ", but " + quote(alias) + " is already a tensor of its own");
    b.claim(alias, "tied name", where);
    b.skel.alias(std::vector<std::string>{alias}, owner);
  }
}

/// The keys of a param group other than `params`, as (key, value).
inline void add_group_values(builder& b, std::size_t g, const Value& group, const std::vector<std::string>& names) {
  const std::vector<std::string> base{"optim", "param_groups", std::to_string(g)};
  auto path = [&](const std::string& k) {
    auto p = base;
    p.push_back(k);
    return p;
  };
  List params;
  for (const auto& n : names) params.emplace_back(n);
  b.skel.value(path("params"), Value::list(std::move(params)));
  if (group.is_dict())
    for (const auto& [k, v] : group.as_dict())
      if (!(k.is_string() && k.as_string() == "params")) b.skel.value(path(k.str()), v);
}

inline void add_merged_state(builder& b, optim_shard::MergedState merged) {
  for (TensorInfo& t : merged.tensors) {
    // "optim.state.<param>.<key>": the param name may contain dots, so the path is built from parts.
    const std::string rest = t.name.substr(std::string("optim.state.").size());
    const auto dot = rest.rfind('.');
    b.skel.tensor(std::vector<std::string>{"optim", "state", rest.substr(0, dot), rest.substr(dot + 1)}, t);
    b.ckpt.tensors.push_back(std::move(t));
  }
  for (auto& [name, v] : merged.values) {
    const auto dot = name.rfind('.');
    b.skel.value(std::vector<std::string>{"optim", "state", name.substr(0, dot), name.substr(dot + 1)}, v);
  }
}

/// Stage 1/2 optimizer state: base_optimizer_state (rigid: the torch optimizer's state_dict over
/// one flat partition per group; elastic: a list of per-group states with padding cut off).
inline void add_optimizer12(builder& b, const trainable& tr, const std::vector<optim_file>& optims, std::uint32_t W) {
  const std::size_t G = tr.group_names.size();
  optim_shard::StateFamilies fams(G, std::vector<std::vector<optim_shard::StateSegment>>(W));
  std::vector<const Value*> groups(W, nullptr);
  std::vector<std::string> wheres(W);
  bool elastic = false;
  // Every rank's partition of group g has the same size (the padded group over W).
  std::vector<std::uint64_t> part_size(G, 0);
  {
    std::vector<std::uint64_t> n(G, 0);
    for (const auto& p : tr.params) n[p.family] = checked_add(n[p.family], numel(p.shape), "group size");
    for (std::size_t g = 0; g < G; ++g) part_size[g] = layout::zero12_partitions(n[g], W).parts[0].size;
  }
  for (std::uint32_t r = 0; r < W; ++r) {
    const std::string where = where_rank(optims[r], r);
    wheres[r] = where;
    Access a{errors::ds_optim_state, where};
    const Value& base = a.at(*optims[r].osd, "base_optimizer_state", "optimizer_state_dict");
    const List* parts = nullptr;
    if (base.is_sequence()) {  // elastic_checkpoint
      if (r > 0 && !elastic) a.fail("base_optimizer_state is a list here and a dict on rank 0");
      elastic = true;
      parts = &base.as_list();
      if (parts->size() != G)
        a.fail("base_optimizer_state has " + std::to_string(parts->size()) + " groups, param_shapes has " + std::to_string(G));
      for (std::size_t g = 0; g < G; ++g)
        fams[g][r].push_back(optim_shard::StateSegment{&a.dict((*parts)[g], "base_optimizer_state[" + std::to_string(g) + "]"),
                                                       part_size[g], where + ": base_optimizer_state[" + std::to_string(g) + "]"});
    } else {
      if (elastic) a.fail("base_optimizer_state is a dict here and a list on rank 0");
      const Dict& sd = a.dict(base, "base_optimizer_state");
      const Dict& state = a.dict(a.at(sd, "state", "base_optimizer_state"), "base_optimizer_state.state");
      const Value& pg = a.at(sd, "param_groups", "base_optimizer_state");
      const List& pgl = a.list(pg, "base_optimizer_state.param_groups");
      groups[r] = &pg;
      if (pgl.size() != G)
        a.fail("base_optimizer_state has " + std::to_string(pgl.size()) + " param groups, param_shapes has " + std::to_string(G));
      for (std::size_t g = 0; g < G; ++g) {
        // Group g's optimizer holds one tensor, this rank's flat partition: params == [id].
        const Dict& grp = a.dict(pgl[g], "param_groups[" + std::to_string(g) + "]");
        const List& ids = a.list(a.at(grp, "params", "param_groups[" + std::to_string(g) + "]"),
                                 "param_groups[" + std::to_string(g) + "].params");
        if (ids.size() != 1 || !ids[0].is_int())
          a.fail("param_groups[" + std::to_string(g) + "].params should hold the one id of the group's flat partition");
        const Key id(ids[0].as_int());
        const Value* st = state.find(id);
        fams[g][r].push_back(optim_shard::StateSegment{st ? &a.dict(*st, "state[" + id.str() + "]") : nullptr,
                                                       part_size[g],
                                                       where + ": base_optimizer_state.state[" + id.str() + "]"});
      }
    }
  }
  if (!elastic) optim_shard::check_groups_equal(groups, wheres);
  add_merged_state(b, optim_shard::merge_state(tr.params, fams, b.table));
  for (std::size_t g = 0; g < G; ++g)
    add_group_values(b, g, elastic ? Value() : groups[0]->as_list()[g], tr.group_names[g]);
}

/// What a writer needs to write the engine's files again (formats/detail/deepspeed_write.hpp),
/// as the skeleton JSON of a tree without tensors: the model-states values the consolidated state
/// does not hold (engine counters, scheduler, data sampler, client state, ds_config, ds_version),
/// the ZeRO optimizer's loss scaler and flags, the module's entries with their dtypes (in order),
/// buffer_names, and the config switches the layout depends on. Values holding tensors (a client
/// state with tensors) are not carried; their keys are listed under "not_carried".
inline std::string engine_state(const model_file& m, const optim_file& o) {
  Dict carried;
  List skipped;
  static const std::set<std::string> layout_keys{"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
                                                 "shared_params", "frozen_param_fragments", "dp_world_size", "mp_world_size"};
  auto has_tensor = [](const Value& v) {
    bool found = false;
    visit(v, [&](const Path&, const Value& x) {
      if (!x.is_tensor()) return visit_control::descend;
      found = true;
      return visit_control::stop;
    });
    return found;
  };
  for (const auto& [k, v] : *m.top) {
    if (k.is_string() && layout_keys.count(k.as_string())) continue;
    if (has_tensor(v)) skipped.emplace_back(k.str());
    else carried.set(k, v);
  }
  Dict optimizer;
  for (const char* k : {"loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad"})
    if (const Value* v = Access::opt(*o.osd, k); v && !has_tensor(*v)) optimizer.set(k, *v);
  List module;
  for (const auto& [k, v] : *m.module)
    if (k.is_string() && v.is_tensor()) module.emplace_back(Value::list(List{Value(k.as_string()), Value(std::string(statedict::name(v.as_tensor().dtype())))}));
  List buffers;
  for (const auto& n : m.buffer_names) buffers.emplace_back(n);
  Dict e;
  e.set("model_states", Value(std::move(carried)));
  e.set("optimizer", Value(std::move(optimizer)));
  e.set("module", Value::list(std::move(module)));
  e.set("buffer_names", Value::list(std::move(buffers)));
  if (!m.module->empty())
    for (const auto& [k, v] : *m.module)
      if (k.is_string() && v.is_tensor() && is_floating(v.as_tensor().dtype()) && std::find(m.buffer_names.begin(), m.buffer_names.end(), k.as_string()) == m.buffer_names.end()) {
        e.set("model_dtype", std::string(statedict::name(v.as_tensor().dtype())));
        break;
      }
  // The ZeRO switches the layout depends on, from the config the run was saved with.
  if (const Value* cfg = Access::opt(*m.top, "ds_config"); cfg && cfg->is_dict())
    if (const Value* z = cfg->as_dict().find(Key(std::string("zero_optimization"))); z && z->is_dict()) {
      if (const Value* rr = z->as_dict().find(Key(std::string("round_robin_gradients"))); rr && rr->is_bool()) e.set("round_robin", *rr);
      if (const Value* sg = z->as_dict().find(Key(std::string("sub_group_size"))); sg && (sg->is_int() || sg->is_double()))
        e.set("sub_group_size", static_cast<std::int64_t>(sg->as_number()));
    }
  if (!skipped.empty()) e.set("not_carried", Value::list(std::move(skipped)));
  return flatten(Value(std::move(e))).skeleton.dump();
}

/// Stage 3 optimizer state: optimizer_state_dict is the torch optimizer's state_dict over the
/// sub-group flats (ids 0..K-1 in sub-group order, listed by their param group).
inline void add_optimizer3(builder& b, const trainable& tr, const model_file& m, const std::vector<optim_file>& optims,
                           std::uint32_t W) {
  const std::size_t K = m.param_shapes.size();
  optim_shard::StateFamilies fams(1, std::vector<std::vector<optim_shard::StateSegment>>(W));
  std::vector<const Value*> groups(W, nullptr);
  std::vector<std::string> wheres(W);
  for (std::uint32_t r = 0; r < W; ++r) {
    const std::string where = where_rank(optims[r], r);
    wheres[r] = where;
    Access a{errors::ds_optim_state, where};
    const Dict& sd = a.dict(a.at(*optims[r].osd, "optimizer_state_dict", "optimizer_state_dict"),
                            "optimizer_state_dict.optimizer_state_dict");
    const Dict& state = a.dict(a.at(sd, "state", "the optimizer state"), "optimizer state");
    const Value& pg = a.at(sd, "param_groups", "the optimizer state");
    groups[r] = &pg;
    // The flats are the optimizer's params in param_groups order: ids 0, 1, ... K-1.
    std::int64_t next = 0;
    for (const Value& grp : a.list(pg, "param_groups"))
      for (const Value& id : a.list(a.at(a.dict(grp, "a param group"), "params", "a param group"), "params"))
        if (!id.is_int() || id.as_int() != next++)
          a.fail("param_groups list the sub-group flats out of order (expected ids 0.." + std::to_string(K - 1) + ")");
    if (static_cast<std::uint64_t>(next) != K)
      a.fail("param_groups list " + std::to_string(next) + " sub-group flats, param_shapes has " + std::to_string(K));
    const List& flats = a.list(a.at(*optims[r].osd, "fp32_flat_groups", "optimizer_state_dict"), "fp32_flat_groups");
    for (std::size_t k = 0; k < K; ++k) {
      const Value* st = state.find(Key(static_cast<std::int64_t>(k)));
      const std::uint64_t n = k < flats.size() && flats[k].is_tensor() ? flats[k].as_tensor().numel() : 0;
      fams[0][r].push_back(optim_shard::StateSegment{st ? &a.dict(*st, "state[" + std::to_string(k) + "]") : nullptr, n,
                                                     where + ": optimizer_state_dict.state[" + std::to_string(k) + "]"});
    }
  }
  optim_shard::check_groups_equal(groups, wheres);
  add_merged_state(b, optim_shard::merge_state(tr.params, fams, b.table));
  // Group gi's parameters: those of the sub-groups its params list, in param_shapes order.
  const List& g0 = groups[0]->as_list();
  std::vector<std::size_t> group_of(K, 0);
  for (std::size_t gi = 0; gi < g0.size(); ++gi)
    for (const Value& id : g0[gi].as_dict().at("params").as_list()) group_of[static_cast<std::size_t>(id.as_int())] = gi;
  for (std::size_t gi = 0; gi < g0.size(); ++gi) {
    std::vector<std::string> names;
    for (const auto& p : tr.params)
      if (group_of[p.scalar_segment] == gi) names.push_back(p.name);
    add_group_values(b, gi, g0[gi], names);
  }
}

}  // namespace statedict::inline v0::deepspeed::detail
