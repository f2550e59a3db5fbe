// statedict: block-FP8 quantization while streaming (formats/transform.hpp quantize;
// docs/formats/quantized.md): the F8_E4M3 weight and its F32 `weight_scale_inv` as two computed
// byte sources over the same input, sharing each band of block rows' multipliers.
// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../../core/dtype.hpp"
#include "../../core/error.hpp"
#include "../../core/shape.hpp"
#include "../../core/source.hpp"
#include "dequantize.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id quantize_bad_value  {867, error_kind::format,      "quantize.bad_value"};
inline constexpr error_id quantize_bad_tensor {868, error_kind::type,        "quantize.bad_tensor"};
inline constexpr error_id quantize_name_taken {869, error_kind::key,         "quantize.name_taken"};
// clang-format on
}  // namespace errors

namespace formats::detail {

/// The largest finite float8_e4m3fn value.
inline constexpr float fp8_e4m3_max = 448.0F;

/// One block-FP8 quantization of tensor `tensor` (F32, BF16 or F16 [..., rows, cols], its bytes
/// `in`): the multiplier of every block, computed a band of block rows at a time as transformers'
/// FineGrainedFP8 quantizer does (docs/formats/quantized.md, "Quantizing"):
///   amax = max |x| over the block (x widened exactly to f32),
///   m    = amax > 0 ? f32(f32(1 / amax) * 448) : 1,
/// the stored value is e4m3(clamp(f32(x * m), -448, 448)) rounded to nearest even, and the stored
/// inverse scale f32(1 / m). A block whose last rows or columns are cut (rows or cols not a
/// multiple of the block) takes its maximum over the elements it has (DeepSeek's grid).
/// A value that is not finite, or a maximum so small that 1 / amax overflows, is an error naming
/// the tensor and the element or block (errors::quantize_bad_value), thrown while streaming.
class fp8_quant_blocks {
 public:
  fp8_quant_blocks(std::string tensor, std::shared_ptr<const ByteSource> in, dtype dt, const shape_t& shape, std::uint64_t br,
                   std::uint64_t bc)
      : tensor_(std::move(tensor)), in_(std::move(in)), dt_(dt), br_(br), bc_(bc) {
    rows_ = static_cast<std::uint64_t>(shape[shape.size() - 2]);
    cols_ = static_cast<std::uint64_t>(shape.back());
    srows_ = (rows_ + br - 1) / br;
    scols_ = (cols_ + bc - 1) / bc;
    elements_ = numel(shape);
    mats_ = rows_ * cols_ == 0 ? 0 : elements_ / (rows_ * cols_);
    in_->check_range(0, checked_mul(elements_, itemsize(dt_)), "tensor to quantize");
  }
  [[nodiscard]] const std::string& tensor() const noexcept { return tensor_; }
  [[nodiscard]] std::uint64_t rows() const noexcept { return rows_; }
  [[nodiscard]] std::uint64_t cols() const noexcept { return cols_; }
  [[nodiscard]] std::uint64_t block_rows() const noexcept { return br_; }
  [[nodiscard]] std::uint64_t block_cols() const noexcept { return bc_; }
  [[nodiscard]] std::uint64_t scale_rows() const noexcept { return srows_; }
  [[nodiscard]] std::uint64_t scale_cols() const noexcept { return scols_; }
  [[nodiscard]] std::uint64_t elements() const noexcept { return elements_; }
  [[nodiscard]] const ByteSource& input() const noexcept { return *in_; }
  [[nodiscard]] std::uint64_t input_itemsize() const noexcept { return itemsize(dt_); }

  /// Elements [first, first + n) of the input (n <= 2048) widened exactly to f32.
  void widen(std::uint64_t first, std::size_t n, float* out) const {
    const std::size_t isz = itemsize(dt_);
    std::byte buf[2048 * 4];
    const std::byte* b = bytes(*in_, first * isz, std::span<std::byte>(buf, n * isz));
    if (dt_ == dtype::F32) {
      std::memcpy(out, b, n * 4);
    } else if (dt_ == dtype::BF16) {
      for (std::size_t k = 0; k < n; ++k) {
        std::uint16_t h = 0;
        std::memcpy(&h, b + k * 2, 2);
        out[k] = f32_from_bf16(h);
      }
    } else {
      for (std::size_t k = 0; k < n; ++k) {
        std::uint16_t h = 0;
        std::memcpy(&h, b + k * 2, 2);
        out[k] = f32_from_f16(h);
      }
    }
  }

  /// The multipliers m of the blocks of band `band` (block row) of matrix `mat`: scale_cols() floats.
  std::shared_ptr<const std::vector<float>> band(std::uint64_t mat, std::uint64_t band) const {
    const std::uint64_t key = mat * srows_ + band;
    {
      const std::lock_guard<std::mutex> lock(m_);
      for (const auto& [k, v] : cache_)
        if (k == key) return v;
    }
    auto v = std::make_shared<std::vector<float>>(compute_band(mat, band));
    const std::lock_guard<std::mutex> lock(m_);
    if (cache_.size() >= 8) cache_.erase(cache_.begin());
    cache_.emplace_back(key, v);
    return v;
  }

 private:
  static const std::byte* bytes(const ByteSource& src, std::uint64_t offset, std::span<std::byte> dst) {
    if (const std::byte* d = src.data()) return d + offset;
    src.read(offset, dst);
    return dst.data();
  }

  static std::string shown(float v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(v));
    return buf;
  }

  std::vector<float> compute_band(std::uint64_t mat, std::uint64_t band) const {
    std::vector<float> amax(static_cast<std::size_t>(scols_), 0.0F);
    float buf[2048];
    const std::uint64_t r0 = band * br_, r1 = std::min(rows_, r0 + br_);
    for (std::uint64_t r = r0; r < r1; ++r) {
      const std::uint64_t row = (mat * rows_ + r) * cols_;
      for (std::uint64_t j = 0; j < cols_;) {
        const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(2048, cols_ - j));
        widen(row + j, n, buf);
        bool finite = true;
        for (std::size_t k = 0; k < n; ++k) finite &= std::isfinite(buf[k]);
        if (!finite)
          for (std::size_t k = 0; k < n; ++k)
            if (!std::isfinite(buf[k]))
              throw_error(errors::quantize_bad_value, "tensor " + quote(tensor_),
                          "element [" + std::to_string(r) + ", " + std::to_string(j + k) + "] of its matrix " + std::to_string(mat) +
                              " is " + shown(buf[k]) + ": a block-FP8 scale needs finite values");
        // Column blocks of this run: the maximum of each, |x| exact in f32.
        for (std::size_t k = 0; k < n;) {
          const std::uint64_t c = (j + k) / bc_;
          const auto end = static_cast<std::size_t>(std::min<std::uint64_t>(n, (c + 1) * bc_ - j));
          float m = amax[static_cast<std::size_t>(c)];
          for (std::size_t x = k; x < end; ++x) m = std::max(m, std::fabs(buf[x]));
          amax[static_cast<std::size_t>(c)] = m;
          k = end;
        }
        j += n;
      }
    }
    for (std::size_t c = 0; c < amax.size(); ++c) {
      const float a = amax[c];
      if (a == 0.0F) {
        amax[c] = 1.0F;  // an all-zero block: multiplier and inverse scale 1, zeros kept with their signs
        continue;
      }
      const float m = (1.0F / a) * fp8_e4m3_max;
      if (!std::isfinite(m))
        throw_error(errors::quantize_bad_value, "tensor " + quote(tensor_),
                    "block [" + std::to_string(band) + ", " + std::to_string(c) + "] of its matrix " + std::to_string(mat) +
                        " has largest magnitude " + shown(a) +
                        ": 1 / that overflows float32, so no block-FP8 scale represents it (keep the tensor's dtype)");
      amax[c] = m;
    }
    return amax;
  }

  std::string tensor_;
  std::shared_ptr<const ByteSource> in_;
  dtype dt_;
  std::uint64_t br_, bc_, rows_ = 0, cols_ = 0, srows_ = 0, scols_ = 0, elements_ = 0, mats_ = 0;
  mutable std::mutex m_;
  mutable std::vector<std::pair<std::uint64_t, std::shared_ptr<const std::vector<float>>>> cache_;
};

/// The F8_E4M3 bytes of a quantized weight, row-major: each element computed from its block's
/// multiplier (fp8_quant_blocks) when read.
class fp8_quant_values_source final : public ByteSource {
 public:
  explicit fp8_quant_values_source(std::shared_ptr<const fp8_quant_blocks> q) : name_("quantized " + quote(q->tensor())), q_(std::move(q)) {}
  [[nodiscard]] const std::string& name() const noexcept override { return name_; }
  [[nodiscard]] std::uint64_t size() const noexcept override { return q_->elements(); }
  [[nodiscard]] keep_alive owner() const override { return {}; }
  void read(std::uint64_t offset, std::span<std::byte> dst) const override {
    check_range(offset, dst.size());
    float buf[2048];
    const std::uint64_t rows = q_->rows(), cols = q_->cols(), bc = q_->block_cols();
    std::size_t done = 0;
    while (done < dst.size()) {
      const std::uint64_t e = offset + done;
      const std::uint64_t mat = e / (rows * cols), rem = e % (rows * cols);
      const std::uint64_t i = rem / cols, j0 = rem % cols;
      const auto run = static_cast<std::size_t>(std::min<std::uint64_t>({2048, dst.size() - done, cols - j0}));
      const auto m = q_->band(mat, i / q_->block_rows());
      q_->widen(e, run, buf);
      auto* out = reinterpret_cast<std::uint8_t*>(dst.data() + done);
      for (std::size_t x = 0; x < run;) {
        const std::uint64_t c = (j0 + x) / bc;
        const auto end = static_cast<std::size_t>(std::min<std::uint64_t>(run, (c + 1) * bc - j0));
        const float mul = (*m)[static_cast<std::size_t>(c)];
        for (std::size_t k = x; k < end; ++k)
          out[k] = f8e4m3_from_f32(std::clamp(buf[k] * mul, -fp8_e4m3_max, fp8_e4m3_max));
        x = end;
      }
      done += run;
    }
    release_read_pages(q_->input(), offset * q_->input_itemsize(), dst.size() * q_->input_itemsize());
  }

 private:
  std::string name_;
  std::shared_ptr<const fp8_quant_blocks> q_;
};

/// The F32 inverse scales [..., scale rows, scale cols] of a quantized weight: 1 / multiplier.
class fp8_quant_scales_source final : public computed_source {
 public:
  explicit fp8_quant_scales_source(std::shared_ptr<const fp8_quant_blocks> q)
      : computed_source("scales of quantized " + quote(q->tensor()),
                        checked_mul(q->elements() == 0 ? 0 : q->elements() / (q->rows() * q->cols()), q->scale_rows() * q->scale_cols())),
        q_(std::move(q)) {}

 private:
  void compute(std::uint64_t first, std::size_t n, float* out) const override {
    const std::uint64_t sr = q_->scale_rows(), sc = q_->scale_cols();
    for (std::size_t k = 0; k < n;) {
      const std::uint64_t e = first + k;
      const std::uint64_t mat = e / (sr * sc), band = (e % (sr * sc)) / sc, c0 = e % sc;
      const auto m = q_->band(mat, band);
      const auto run = static_cast<std::size_t>(std::min<std::uint64_t>(n - k, sc - c0));
      for (std::size_t x = 0; x < run; ++x) out[k + x] = 1.0F / (*m)[static_cast<std::size_t>(c0 + x)];
      k += run;
    }
  }
  std::shared_ptr<const fp8_quant_blocks> q_;
};

}  // namespace formats::detail
}  // namespace statedict::inline v0
