// statedict: the types of the transforms of formats/transform.hpp (ties, cast options, split
// parts) and the name functions rename() takes.
// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "../core/shape.hpp"
#include "../core/skeleton.hpp"

namespace statedict::inline v0::formats {

/// A name the skeleton ties to a stored tensor: an alias of it, or a view into its elements.
struct Tie {
  std::string name;              ///< the tied name (as listed: dotted)
  std::string target;            ///< the stored tensor it refers to
  std::optional<ViewSpec> view;  ///< the elements, for a view; nullopt for an alias
};

/// What cast() changes besides floating tensors.
struct cast_options {
  /// Also cast tensors a reader converted to a floating dtype from an integer one (DeepSpeed's
  /// buffers, made F32 as zero_to_fp32 makes them: TensorInfo::converted_from). Off by default:
  /// BF16 or F16 cannot hold every integer (2^8 + 1 and 2^11 + 1 are the first they round).
  bool integer_origin = false;
  /// Tensors whose names this accepts keep their dtype (`convert --keep-dtype REGEX`); empty: none.
  std::function<bool(std::string_view)> keep;
};

/// The quantization schemes dequantize() knows (docs/formats/quantized.md).
enum class quant_scheme : std::uint8_t {
  fp8_block,  ///< `X.weight` F8_E4M3 with `X.weight_scale_inv` F32 per block (DeepSeek-V3, Qwen3-FP8)
  mxfp4,      ///< `X_blocks` U8 (two E2M1 a byte) with `X_scales` U8 E8M0 exponents (gpt-oss)
  any,        ///< both, each pair recognised by its names, dtypes and shapes
};

/// What dequantize() does.
struct dequantize_options {
  quant_scheme scheme = quant_scheme::any;
  /// Block-FP8 block size, rows then columns (a Hugging Face config's
  /// `quantization_config.weight_block_size`); DeepSeek-V3's 128 x 128 by default.
  std::uint64_t block_rows = 128;
  std::uint64_t block_cols = 128;
};

/// What quantize() does: block-FP8 (`float8_e4m3fn` weights with F32 `weight_scale_inv`, the
/// layout of DeepSeek-V3 and of transformers' FineGrainedFP8; docs/formats/quantized.md).
struct quantize_options {
  /// The block, rows then columns (written as `quantization_config.weight_block_size`).
  std::uint64_t block_rows = 128;
  std::uint64_t block_cols = 128;
  /// The tensors to quantize; empty: default_quantized(), the 2-D F32 / BF16 / F16 `.weight`
  /// tensors except embeddings, lm_head, norms and MoE routers. A tensor it selects that cannot
  /// be quantized (another dtype, fewer than 2 dimensions) is an error.
  std::function<bool(std::string_view)> select;
  /// Tensors whose rows or columns are not a multiple of the block: quantized on the block grid,
  /// the last blocks cut (DeepSeek's layout), when true; left as they are when false, as
  /// transformers' quantizer leaves them (its dequantization assumes whole blocks).
  bool partial_blocks = false;
};

/// One part of a split: its name and its size along the split dimension.
struct part {
  std::string name;
  dim_t size = 0;
};

// ---------------------------------------------------------------------------------------------
// Names

/// A renaming: the new name of a leaf from its dotted name (the name itself: unchanged).
using name_map = std::function<std::string(std::string_view)>;

/// Names that begin with `prefix` lose it ("module." turns "module.fc.w" into "fc.w").
inline name_map strip_prefix(std::string prefix) {
  return [p = std::move(prefix)](std::string_view n) {
    return n.size() > p.size() && n.substr(0, p.size()) == p ? std::string(n.substr(p.size())) : std::string(n);
  };
}

/// Every name gets `prefix` in front.
inline name_map add_prefix(std::string prefix) {
  return [p = std::move(prefix)](std::string_view n) { return p + std::string(n); };
}

/// `from` itself and every name below it (`from.` ...) move to `to` (and `to.` ...).
inline name_map rename_prefix(std::string from, std::string to) {
  return [f = std::move(from), t = std::move(to)](std::string_view n) {
    if (n == f) return t;
    if (n.size() > f.size() && n.substr(0, f.size()) == f && n[f.size()] == '.') return t + std::string(n.substr(f.size()));
    return std::string(n);
  };
}

/// Names found in `table` (whole names) get its value; the others stay.
inline name_map rename_map(std::map<std::string, std::string, std::less<>> table) {
  return [m = std::move(table)](std::string_view n) {
    const auto it = m.find(n);
    return it == m.end() ? std::string(n) : it->second;
  };
}

/// `first`, then `second`.
inline name_map then(name_map first, name_map second) {
  return [a = std::move(first), b = std::move(second)](std::string_view n) { return b(a(n)); };
}

}  // namespace statedict::inline v0::formats
