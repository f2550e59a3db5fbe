// statedict: the quantized pairs of a checkpoint (block-FP8 weights with their inverse scales,
// MXFP4 blocks with their exponents) and the computed byte sources that dequantize them while
// the executor streams (formats/transform.hpp dequantize; docs/formats/quantized.md).
// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../../core/dtype.hpp"
#include "../../core/error.hpp"
#include "../../core/shape.hpp"
#include "../../core/source.hpp"
#include "../../io/file.hpp"
#include "../../shard/box.hpp"
#include "../../shard/checkpoint.hpp"
#include "../transform_types.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id dequantize_needed      {860, error_kind::usage,       "dequantize.needed"};
inline constexpr error_id dequantize_no_scale    {861, error_kind::format,      "dequantize.missing_scale"};
inline constexpr error_id dequantize_bad_scale   {862, error_kind::format,      "dequantize.bad_scale"};
inline constexpr error_id dequantize_bad_blocks  {863, error_kind::format,      "dequantize.bad_blocks"};
inline constexpr error_id dequantize_scale_value {864, error_kind::format,      "dequantize.bad_scale_value"};
inline constexpr error_id dequantize_layout      {865, error_kind::unsupported, "dequantize.unsupported_layout"};
inline constexpr error_id dequantize_name_taken  {866, error_kind::key,         "dequantize.name_taken"};
// clang-format on
}  // namespace errors

namespace formats::detail {

/// One quantized pair found by its names, dtypes and shapes.
struct quant_pair {
  quant_scheme scheme = quant_scheme::fp8_block;
  std::string values;  ///< the quantized tensor: X.weight (F8_E4M3) or X_blocks (U8)
  std::string scales;  ///< X.weight_scale_inv (F32) or X_scales (U8 / F8_E8M0)
  std::string output;  ///< the dequantized tensor's name: X.weight, or X
};

inline bool quant_ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

/// The name of the inverse scale of a block-FP8 tensor: `X.weight` -> `X.weight_scale_inv`, any
/// other name `N` -> `N_scale_inv` (transformers' finegrained_fp8 rule for expert tensors).
inline std::string fp8_scale_name(std::string_view w) { return std::string(w) + "_scale_inv"; }

/// The quantized pairs of `ck` of `scheme` (both for quant_scheme::any), found by name: every
/// `N_scale_inv` with its `N`, every F8_E4M3 tensor (whose scale may be missing: checked later),
/// every U8 `X_blocks` and every U8 / F8_E8M0 `X_scales` (other tensors so named are not MXFP4:
/// they pass through). Nothing else is validated here.
inline std::vector<quant_pair> find_quant_pairs(const ShardedCheckpoint& ck, quant_scheme scheme) {
  std::vector<quant_pair> out;
  const bool fp8 = scheme != quant_scheme::mxfp4, mx = scheme != quant_scheme::fp8_block;
  constexpr std::string_view inv = "_scale_inv", blocks = "_blocks", scales = "_scales";
  for (const TensorInfo& t : ck.tensors) {
    if (fp8 && quant_ends_with(t.name, inv)) {
      out.push_back({quant_scheme::fp8_block, t.name.substr(0, t.name.size() - inv.size()), t.name, t.name.substr(0, t.name.size() - inv.size())});
    } else if (fp8 && t.dtype == dtype::F8_E4M3 && !ck.find(fp8_scale_name(t.name))) {
      out.push_back({quant_scheme::fp8_block, t.name, fp8_scale_name(t.name), t.name});  // a missing scale
    } else if (mx && quant_ends_with(t.name, blocks) && t.dtype == dtype::U8) {
      const std::string x = t.name.substr(0, t.name.size() - blocks.size());
      out.push_back({quant_scheme::mxfp4, t.name, x + std::string(scales), x});
    } else if (mx && quant_ends_with(t.name, scales) && (t.dtype == dtype::U8 || t.dtype == dtype::F8_E8M0) &&
               !ck.find(t.name.substr(0, t.name.size() - scales.size()) + std::string(blocks))) {
      const std::string x = t.name.substr(0, t.name.size() - scales.size());
      out.push_back({quant_scheme::mxfp4, x + std::string(blocks), t.name, x});  // missing blocks
    }
  }
  return out;
}

/// The bytes of tensor `t` as one source of its own, row-major and little-endian: what a
/// safetensors or Hugging Face reader describes. Anything else (a sharded or strided tensor) is
/// refused: the computed sources read the quantized bytes by element index.
inline std::shared_ptr<const ByteSource> whole_bytes(const ShardedCheckpoint& ck, const TensorInfo& t, std::string_view of,
                                                      std::string_view verb = "dequantizing") {
  const auto& c = t.chunks;
  const bool whole = c.size() == 1 && c[0].at.stored == t.dtype && c[0].at.order == byte_order::little &&
                     (c[0].at.strides.empty() || c[0].at.strides == contiguous_strides(t.shape)) && covers_whole(c[0].region, t.shape) &&
                     c[0].at.source < ck.sources.size() && ck.sources[c[0].at.source];
  if (!whole)
    throw_error(errors::dequantize_layout, "tensor " + quote(t.name),
                "is stored in several pieces or strided; " + std::string(verb) + " " + std::string(of) +
                    " needs it whole and contiguous (a safetensors or Hugging Face checkpoint)");
  const std::uint64_t n = byte_size(t.shape, itemsize(t.dtype));
  return std::make_shared<SliceSource>(ck.sources[c[0].at.source], c[0].at.byte_offset, n, ck.sources[c[0].at.source]->name());
}

/// float8_e4m3fn and E8M0 decoded once into tables (core/dtype.hpp's exact conversions), so the
/// dequantizing loops below are a load and a multiply an element, with no call or branch.
inline const float* f8e4m3_table() {
  static const auto t = [] {
    std::array<float, 256> a{};
    for (unsigned i = 0; i < 256; ++i) a[i] = f32_from_f8e4m3(static_cast<std::uint8_t>(i));
    return a;
  }();
  return t.data();
}
inline const float* f8e8m0_table() {
  static const auto t = [] {
    std::array<float, 256> a{};
    for (unsigned i = 0; i < 256; ++i) a[i] = f32_from_f8e8m0(static_cast<std::uint8_t>(i));
    return a;
  }();
  return t.data();
}

/// After a read of [offset, offset + length) of `src` (a mapped file, or a slice of one)
/// consumed bytes up to offset + length: the mapped pages of each 2 MiB window of the file that
/// the read finished are released, as the executor releases the pages of the sources it copies
/// itself, so the file-backed RSS does not grow with the input. A window another thread still
/// reads is mapped again where it is used: slower, never wrong.
inline void release_read_pages(const ByteSource& src, std::uint64_t offset, std::uint64_t length) {
  constexpr std::uint64_t window = std::uint64_t{2} << 20;
  const ByteSource* p = &src;
  while (const auto* sl = dynamic_cast<const SliceSource*>(p)) {
    offset += sl->offset();
    p = sl->base().get();
  }
  const auto* f = dynamic_cast<const InputFile*>(p);
  if (!f || !f->data()) return;
  const std::uint64_t lo = offset / window, hi = (offset + length) / window;
  if (hi > lo) f->advise(lo * window, (hi - lo) * window, access_hint::dontneed);  // windows lo .. hi - 1 are behind
}

/// A tensor computed from others, element by element, as F32 bytes in row-major order: reading
/// [offset, offset + n) computes just those elements, in pieces of a few KiB, so the executor
/// dequantizes in its own blocks and bounded memory. Errors found in the bytes (a NaN scale)
/// are thrown from read(), naming the tensor; the executor then fails and commits no file.
class computed_source : public ByteSource {
 public:
  computed_source(std::string name, std::uint64_t elements) : name_(std::move(name)), size_(checked_mul(elements, 4, "byte size")) {}
  [[nodiscard]] const std::string& name() const noexcept override { return name_; }
  [[nodiscard]] std::uint64_t size() const noexcept override { return size_; }
  [[nodiscard]] keep_alive owner() const override { return {}; }
  void read(std::uint64_t offset, std::span<std::byte> dst) const override {
    check_range(offset, dst.size());
    constexpr std::size_t piece = 2048;
    float buf[piece];
    std::uint64_t at = offset;
    std::size_t done = 0;
    while (done < dst.size()) {
      const std::uint64_t first = at / 4, skip = at % 4;
      const std::uint64_t left = dst.size() - done;
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(piece, (skip + left + 3) / 4));
      compute(first, n, buf);
      const auto take = static_cast<std::size_t>(std::min<std::uint64_t>(n * 4 - skip, left));
      std::memcpy(dst.data() + done, reinterpret_cast<const std::byte*>(buf) + skip, take);
      done += take;
      at += take;
    }
  }

 protected:
  /// Elements [first, first + n) (n <= 2048) into out.
  virtual void compute(std::uint64_t first, std::size_t n, float* out) const = 0;
  /// Bytes [offset, offset + dst.size()) of `src`: in place when mapped, else read into dst.
  static const std::byte* bytes(const ByteSource& src, std::uint64_t offset, std::span<std::byte> dst) {
    src.check_range(offset, dst.size());
    if (const std::byte* d = src.data()) return d + offset;
    src.read(offset, dst);
    return dst.data();
  }
  std::string name_;
  std::uint64_t size_;
};

/// Block-FP8 (DeepSeek-V3, Qwen3-FP8): weight F8_E4M3 [..., rows, cols], scale F32 (or BF16 / F16,
/// widened exactly) [..., ceil(rows / br), ceil(cols / bc)]; element (i, j) is
/// `float(w) * float(s[i / br][j / bc])`, the product rounded once to F32 (what DeepSeek's
/// weight_dequant and transformers compute before their cast to the model's dtype).
class fp8_block_source final : public computed_source {
 public:
  fp8_block_source(std::string tensor, std::shared_ptr<const ByteSource> w, std::shared_ptr<const ByteSource> s, dtype scale_dtype,
                   const shape_t& shape, std::uint64_t br, std::uint64_t bc)
      : computed_source("dequantized " + quote(tensor), numel(shape)), tensor_(std::move(tensor)), w_(std::move(w)), s_(std::move(s)),
        sdt_(scale_dtype), br_(br), bc_(bc) {
    rows_ = static_cast<std::uint64_t>(shape[shape.size() - 2]);
    cols_ = static_cast<std::uint64_t>(shape.back());
    srows_ = (rows_ + br - 1) / br;
    scols_ = (cols_ + bc - 1) / bc;
  }

 private:
  void compute(std::uint64_t first, std::size_t n, float* out) const override {
    compute_values(first, n, out);
    release_read_pages(*w_, first, n);
  }
  void compute_values(std::uint64_t first, std::size_t n, float* out) const {
    std::byte wbuf[2048];
    float sbuf[2048 + 2];
    std::size_t k = 0;
    while (k < n) {
      const std::uint64_t e = first + k;
      const std::uint64_t mat = e / (rows_ * cols_), rem = e % (rows_ * cols_);
      const std::uint64_t i = rem / cols_, j0 = rem % cols_;
      const auto run = static_cast<std::size_t>(std::min<std::uint64_t>(n - k, cols_ - j0));
      const std::byte* w = bytes(*w_, e, std::span<std::byte>(wbuf, run));
      const std::uint64_t c0 = j0 / bc_, c1 = (j0 + run - 1) / bc_;
      const std::uint64_t srow = (mat * srows_ + i / br_) * scols_;
      const auto ns = static_cast<std::size_t>(c1 - c0 + 1);
      const std::size_t isz = itemsize(sdt_);
      const std::byte* sb = bytes(*s_, (srow + c0) * isz, std::span<std::byte>(reinterpret_cast<std::byte*>(sbuf), ns * isz));
      float sv[2048 + 2];
      if (sdt_ == dtype::F32) {
        std::memcpy(sv, sb, ns * 4);
      } else {
        for (std::size_t c = 0; c < ns; ++c) {
          std::uint16_t h = 0;
          std::memcpy(&h, sb + c * 2, 2);
          sv[c] = sdt_ == dtype::BF16 ? f32_from_bf16(h) : f32_from_f16(h);
        }
      }
      for (std::size_t c = 0; c < ns; ++c)
        if (!std::isfinite(sv[c]))
          throw_error(errors::dequantize_scale_value, "tensor " + quote(tensor_),
                      "scale [" + std::to_string(i / br_) + ", " + std::to_string(c0 + c) + "] of its matrix " + std::to_string(mat) +
                          " is not finite (" + std::to_string(sv[c]) + ")");
      // One column block at a time: its scale is a constant of the inner loop.
      const float* lut = f8e4m3_table();
      const auto* wb = reinterpret_cast<const std::uint8_t*>(w);
      for (std::size_t x = 0, c = 0; x < run; ++c) {
        const auto end = static_cast<std::size_t>(std::min<std::uint64_t>(run, (c0 + c + 1) * bc_ - j0));
        const float scale = sv[c];
        float* o = out + k;
        for (std::size_t y = x; y < end; ++y) o[y] = lut[wb[y]] * scale;
        x = end;
      }
      k += run;
    }
  }
  std::string tensor_;
  std::shared_ptr<const ByteSource> w_, s_;
  dtype sdt_;
  std::uint64_t br_, bc_, rows_ = 0, cols_ = 0, srows_ = 0, scols_ = 0;
};

/// MXFP4 (gpt-oss): blocks U8 [p0, p1, ..., G, 16], two E2M1 values a byte (low nibble first),
/// scales [p0, p1, ..., G] of E8M0 exponents (2^(e - 127)). The values, [p0, p1, ..., G * 32],
/// are returned with dimensions 1 and 2 swapped, as transformers' convert_moe_packed_tensors
/// does: gate_up_proj_blocks [E, N, G, 16] gives gate_up_proj [E, G * 32, N].
class mxfp4_source final : public computed_source {
 public:
  mxfp4_source(std::string tensor, std::shared_ptr<const ByteSource> b, std::shared_ptr<const ByteSource> s, const shape_t& values_shape)
      : computed_source("dequantized " + quote(tensor), numel(values_shape)), tensor_(std::move(tensor)), b_(std::move(b)), s_(std::move(s)) {
    // Every row index computed is below numel / 32, so these bounds make in-place reads safe.
    b_->check_range(0, size_ / 4 / 2, "MXFP4 blocks");
    s_->check_range(0, size_ / 4 / 32, "MXFP4 scales");
    const shape_t ts = contiguous_strides(values_shape);
    out_shape_ = values_shape;
    std::swap(out_shape_[1], out_shape_[2]);
    step_.assign(ts.begin(), ts.end());
    std::swap(step_[1], step_[2]);
  }
  [[nodiscard]] const shape_t& shape() const noexcept { return out_shape_; }

 private:
  void compute(std::uint64_t first, std::size_t n, float* out) const override {
    compute_values(first, n, out);
    // Output elements of one expert (dimension 0) read its blocks only: released once passed.
    const std::uint64_t per = size_ / 4 / static_cast<std::uint64_t>(out_shape_[0]);
    if (per != 0 && (first + n) / per > first / per) {
      const std::uint64_t e0 = first / per, e1 = (first + n) / per;  // experts e0 .. e1 - 1 are done
      release_read_pages(*b_, e0 * (per / 2), (e1 - e0) * (per / 2));
    }
  }
  static constexpr float lut[16] = {0.0F, 0.5F, 1.0F, 1.5F, 2.0F, 3.0F, 4.0F, 6.0F, -0.0F, -0.5F, -1.0F, -1.5F, -2.0F, -3.0F, -4.0F, -6.0F};
  [[noreturn]] void nan_scale(std::uint64_t row) const {
    throw_error(errors::dequantize_scale_value, "tensor " + quote(tensor_),
                "scale " + std::to_string(row) + " (row-major, of " + std::to_string(s_->size()) + ") is 0xff, E8M0's NaN");
  }
  /// gpt-oss' layout, values [E, N, G * 32] read as [E, G * 32, N], both sources mapped: along an
  /// output row, value v of each of the N block rows (G * 16 bytes apart), the same byte and
  /// nibble of each; a strided load, two table look-ups and a multiply an element.
  void compute_transposed(std::uint64_t first, std::size_t n, float* out, const std::uint8_t* b, const std::uint8_t* s) const {
    const float* e8 = f8e8m0_table();
    const auto v_size = static_cast<std::uint64_t>(out_shape_[1]), n_size = static_cast<std::uint64_t>(out_shape_[2]);
    const std::uint64_t groups = v_size / 32;
    std::size_t k = 0;
    while (k < n) {
      const std::uint64_t at = first + k, e = at / (v_size * n_size), v = (at / n_size) % v_size, n0 = at % n_size;
      const auto run = static_cast<std::size_t>(std::min<std::uint64_t>(n - k, n_size - n0));
      const std::uint64_t row0 = (e * n_size + n0) * groups + v / 32;
      const unsigned shift = static_cast<unsigned>(v % 2) * 4;
      const std::uint8_t* bp = b + row0 * 16 + (v % 32) / 2;
      const std::uint8_t* sp = s + row0;
      const std::size_t bstep = static_cast<std::size_t>(groups) * 16, sstep = static_cast<std::size_t>(groups);
      float* o = out + k;
      unsigned nan = 0;
      for (std::size_t x = 0; x < run; ++x) {
        const std::uint8_t sc = sp[x * sstep];
        nan |= static_cast<unsigned>(sc == 0xff);
        o[x] = lut[(bp[x * bstep] >> shift) & 0xfU] * e8[sc];
      }
      if (nan)
        for (std::size_t x = 0; x < run; ++x)
          if (sp[x * sstep] == 0xff) nan_scale(row0 + x * sstep);
      k += run;
    }
  }
  void compute_values(std::uint64_t first, std::size_t n, float* out) const {
    const std::size_t r = out_shape_.size();
    if (r == 3 && b_->data() && s_->data()) {
      compute_transposed(first, n, out, reinterpret_cast<const std::uint8_t*>(b_->data()), reinterpret_cast<const std::uint8_t*>(s_->data()));
      return;
    }
    // The output index of `first`, and the values' flat index t it reads.
    std::vector<std::uint64_t> idx(r);
    std::uint64_t rest = first, t = 0;
    for (std::size_t d = r; d-- > 0;) {
      const auto size = static_cast<std::uint64_t>(out_shape_[d]);
      idx[d] = rest % size;
      rest /= size;
      t += idx[d] * static_cast<std::uint64_t>(step_[d]);
    }
    std::uint64_t row = ~std::uint64_t{0};
    std::byte blk[16], sc[1];
    const std::byte* b = nullptr;
    float scale = 0;
    // Mapped sources (checked whole once): read in place without a call per row.
    const std::byte* bmap = b_->data();
    const std::byte* smap = s_->data();
    for (std::size_t k = 0; k < n; ++k) {
      if (t / 32 != row) {
        row = t / 32;
        b = bmap ? bmap + row * 16 : bytes(*b_, row * 16, blk);
        const auto e = static_cast<std::uint8_t>(smap ? smap[row] : *bytes(*s_, row, sc));
        if (e == 0xff) nan_scale(row);
        scale = f32_from_f8e8m0(e);
      }
      const std::uint64_t q = t % 32;
      const auto byte = static_cast<std::uint8_t>(b[q / 2]);
      out[k] = lut[(q % 2) ? (byte >> 4) : (byte & 0xf)] * scale;
      // Next output index.
      for (std::size_t d = r; d-- > 0;) {
        t += static_cast<std::uint64_t>(step_[d]);
        if (++idx[d] < static_cast<std::uint64_t>(out_shape_[d])) break;
        t -= idx[d] * static_cast<std::uint64_t>(step_[d]);
        idx[d] = 0;
      }
    }
  }
  std::string tensor_;
  std::shared_ptr<const ByteSource> b_, s_;
  shape_t out_shape_, step_;
};

}  // namespace formats::detail
}  // namespace statedict::inline v0
