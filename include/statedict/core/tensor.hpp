// statedict: TensorView (non-owning, zero-copy, with a keep-alive handle) and Tensor (owning).
// SPDX-License-Identifier: MIT
//
// A view is dtype + shape + strides (in elements) + a byte pointer + a keep-alive handle: a shared
// owner of whatever the bytes live in (a file mapping, a buffer), so a view stays valid however long
// it is kept. `TensorView` reads (const bytes); `TensorSpan` writes. Views never copy.
//
// Typed access (`span<T>()`, `at<T>()`) checks the dtype; `span<T>()` also needs contiguous, aligned
// data, because a `T*` into misaligned bytes would be undefined behaviour. Files such as safetensors
// may place an F32 tensor at an odd offset: `load<T>(i)` reads any element through memcpy, and
// `copy`/`contiguous()` produce an aligned copy.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "cast.hpp"
#include "dtype.hpp"
#include "error.hpp"
#include "shape.hpp"

namespace statedict::inline v0 {

/// Shared owner of the memory a view points into (a mapping, a buffer); may be empty for memory the
/// caller keeps alive.
using keep_alive = std::shared_ptr<const void>;

/// Alignment of every buffer statedict allocates (a cache line; also what torch.save uses in files).
inline constexpr std::size_t tensor_alignment = 64;

template <class Byte>
class basic_tensor_view {
  static_assert(std::is_same_v<std::remove_const_t<Byte>, std::byte>, "Byte is std::byte or const std::byte");

 public:
  using byte_type = Byte;

  /// An empty 1-d F32 view of zero elements.
  basic_tensor_view() : shape_{0}, strides_{1} {}

  /// A strided view. Checks that dims and strides are non-negative and that the element count fits;
  /// the caller vouches that every addressed byte is inside memory kept alive by `owner`.
  basic_tensor_view(statedict::dtype t, shape_t shape, shape_t strides, Byte* data, keep_alive owner = {})
      : dtype_(t), shape_(std::move(shape)), strides_(std::move(strides)), data_(data), owner_(std::move(owner)) {
    if (strides_.size() != shape_.size()) [[unlikely]] rank_mismatch();
    numel_ = statedict::numel(shape_);
    for (dim_t s : strides_)
      if (s < 0) [[unlikely]] negative_stride();
    if (data_ == nullptr && numel_ != 0) [[unlikely]] throw_error(errors::null_data, "non-empty view without data");
    // The byte extent must be representable: checked here once so later pointer math cannot overflow.
    (void)extent_bytes_checked();
  }

  /// A row-major contiguous view.
  static basic_tensor_view contiguous(statedict::dtype t, shape_t shape, Byte* data, keep_alive owner = {}) {
    shape_t strides = contiguous_strides(shape);
    return basic_tensor_view(t, std::move(shape), std::move(strides), data, std::move(owner));
  }

  /// A mutable view converts to a read-only one.
  template <class B = Byte, class = std::enable_if_t<std::is_const_v<B>>>
  basic_tensor_view(const basic_tensor_view<std::byte>& other)  // NOLINT(google-explicit-constructor)
      : dtype_(other.dtype()),
        shape_(other.shape()),
        strides_(other.strides()),
        data_(other.data()),
        owner_(other.owner()),
        numel_(other.numel()) {}

  [[nodiscard]] statedict::dtype dtype() const noexcept { return dtype_; }
  [[nodiscard]] const shape_t& shape() const noexcept { return shape_; }
  [[nodiscard]] const shape_t& strides() const noexcept { return strides_; }
  [[nodiscard]] Byte* data() const noexcept { return data_; }
  [[nodiscard]] const keep_alive& owner() const noexcept { return owner_; }
  [[nodiscard]] std::size_t rank() const noexcept { return shape_.size(); }
  [[nodiscard]] std::uint64_t numel() const noexcept { return numel_; }
  [[nodiscard]] std::size_t itemsize() const noexcept { return statedict::itemsize(dtype_); }
  /// Bytes of the elements themselves (numel * itemsize), whatever the strides.
  [[nodiscard]] std::uint64_t nbytes() const noexcept { return numel_ * itemsize(); }
  [[nodiscard]] bool is_contiguous() const noexcept { return statedict::is_contiguous(shape_, strides_); }
  /// Bytes from data() to one past the last addressed byte (0 for an empty view).
  [[nodiscard]] std::uint64_t extent_bytes() const noexcept {
    if (numel_ == 0) return 0;
    std::uint64_t last = 0;
    for (std::size_t i = 0; i < shape_.size(); ++i)
      last += static_cast<std::uint64_t>(shape_[i] - 1) * static_cast<std::uint64_t>(strides_[i]);
    return (last + 1) * itemsize();
  }

  /// The sub-view `[start, start + length)` along `dim` (like torch.narrow).
  [[nodiscard]] basic_tensor_view narrow(std::size_t dim, dim_t start, dim_t length) const {
    if (dim >= rank())
      throw_error(errors::out_of_range, "narrow: dim " + std::to_string(dim) + " of a " + std::to_string(rank()) +
                                            "-d tensor");
    if (start < 0 || length < 0 || start > shape_[dim] || length > shape_[dim] - start)
      throw_error(errors::out_of_range, "narrow: [" + std::to_string(start) + ", +" + std::to_string(length) +
                                            ") outside dim " + std::to_string(dim) + " of size " +
                                            std::to_string(shape_[dim]));
    basic_tensor_view v = *this;
    v.shape_[dim] = length;
    v.numel_ = statedict::numel(v.shape_);
    if (length > 0) v.data_ = data_ + static_cast<std::size_t>(start * strides_[dim]) * itemsize();
    return v;
  }

  /// The (rank-1)-d view at `index` along `dim` (like tensor.select).
  [[nodiscard]] basic_tensor_view select(std::size_t dim, dim_t index) const {
    basic_tensor_view v = narrow(dim, index, 1);
    v.shape_.erase(v.shape_.begin() + static_cast<std::ptrdiff_t>(dim));
    v.strides_.erase(v.strides_.begin() + static_cast<std::ptrdiff_t>(dim));
    return v;
  }

  /// The same contiguous bytes with another shape of equal element count.
  [[nodiscard]] basic_tensor_view reshape(shape_t shape) const {
    if (!is_contiguous()) throw_error(errors::not_contiguous, "reshape of a non-contiguous view");
    if (statedict::numel(shape) != numel_)
      throw_error(errors::shape_mismatch, "reshape " + to_string(shape_) + " to " + to_string(shape));
    return contiguous(dtype_, std::move(shape), data_, owner_);
  }

  /// A 1-d view of all elements (contiguous views only).
  [[nodiscard]] basic_tensor_view flatten() const { return reshape(shape_t{static_cast<dim_t>(numel_)}); }

  /// Typed contiguous access. Throws when T does not match the dtype, the view is not contiguous, or
  /// the data is not aligned for T.
  template <element_type T>
  [[nodiscard]] auto span() const {
    using E = std::conditional_t<std::is_const_v<Byte>, const T, T>;
    check_dtype<T>();
    if (!is_contiguous()) throw_error(errors::not_contiguous, "span<" + std::string(name(dtype_)) + "> of a strided view");
    if (reinterpret_cast<std::uintptr_t>(data_) % alignof(T) != 0)
      throw_error(errors::misaligned, std::string(name(dtype_)) + " data at a misaligned address; use load() or contiguous()");
    return std::span<E>(reinterpret_cast<E*>(data_), static_cast<std::size_t>(numel_));
  }

  /// Reads element `i` in row-major order; works on strided and misaligned views.
  template <element_type T>
  [[nodiscard]] T load(std::uint64_t i) const {
    check_dtype<T>();
    if (i >= numel_) throw_error(errors::out_of_range, "element " + std::to_string(i) + " of " + std::to_string(numel_));
    T out;
    std::memcpy(&out, data_ + byte_offset_of(i), sizeof(T));
    return out;
  }

  /// Byte offset from data() of row-major element `i` (unchecked).
  [[nodiscard]] std::uint64_t byte_offset_of(std::uint64_t i) const noexcept {
    std::uint64_t off = 0;
    for (std::size_t d = shape_.size(); d-- > 0;) {
      const auto n = static_cast<std::uint64_t>(shape_[d]);
      off += (i % n) * static_cast<std::uint64_t>(strides_[d]);
      i /= n;
    }
    return off * itemsize();
  }

  /// Number of trailing elements that form one contiguous block in memory (the inner run length).
  [[nodiscard]] std::uint64_t inner_run() const noexcept {
    std::uint64_t run = 1;
    for (std::size_t d = shape_.size(); d-- > 0;) {
      if (shape_[d] == 1) continue;
      if (static_cast<std::uint64_t>(strides_[d]) != run) break;
      run *= static_cast<std::uint64_t>(shape_[d]);
    }
    return std::min<std::uint64_t>(run, std::max<std::uint64_t>(numel_, 1));
  }

  /// Calls f(Byte* ptr, uint64 count) for each maximal contiguous run of elements, in row-major order.
  template <class F>
  void for_each_run(F&& f) const {
    if (numel_ == 0) return;
    const std::uint64_t run = inner_run();
    for (std::uint64_t i = 0; i < numel_; i += run) f(data_ + byte_offset_of(i), run);
  }

 private:
  template <class T>
  void check_dtype() const {
    if (dtype_of<T> != dtype_)
      throw_error(errors::dtype_mismatch, "tensor is " + std::string(name(dtype_)) + ", accessed as " +
                                              std::string(name(dtype_of<T>)));
  }
  // The constructor's failures, out of line so that its checks stay compares.
  [[noreturn, gnu::cold, gnu::noinline]] void rank_mismatch() const {
    throw_error(errors::bad_stride, "shape " + to_string(shape_) + " has " + std::to_string(shape_.size()) +
                                        " dims but strides " + to_string(strides_) + " have " + std::to_string(strides_.size()));
  }
  [[noreturn, gnu::cold, gnu::noinline]] void negative_stride() const {
    throw_error(errors::bad_stride, "negative stride in " + to_string(strides_));
  }

  std::uint64_t extent_bytes_checked() const {
    if (numel_ == 0) return 0;
    std::uint64_t last = 0;
    for (std::size_t i = 0; i < shape_.size(); ++i)
      last = checked_add(last, checked_mul(static_cast<std::uint64_t>(shape_[i] - 1),
                                           static_cast<std::uint64_t>(strides_[i]), "view extent"),
                         "view extent");
    const std::uint64_t e = checked_mul(checked_add(last, 1, "view extent"), itemsize(), "view extent");
    if (e > max_size) [[unlikely]] throw_error(errors::overflow, "view extent exceeds 2^63-1 bytes");
    return e;
  }

  statedict::dtype dtype_ = statedict::dtype::F32;
  shape_t shape_;
  shape_t strides_;
  Byte* data_ = nullptr;
  keep_alive owner_;
  std::uint64_t numel_ = 0;
};

/// Read-only view.
using TensorView = basic_tensor_view<const std::byte>;
/// Writable view.
using TensorSpan = basic_tensor_view<std::byte>;

namespace detail {
/// Calls f(src_ptr, dst_ptr, count) for runs contiguous in both views, row-major; shapes must match.
template <class F>
void for_each_run2(const TensorView& src, const TensorSpan& dst, F&& f) {
  const std::uint64_t n = src.numel();
  if (n == 0) return;
  const std::uint64_t run = std::min(src.inner_run(), dst.inner_run());
  // Both inner runs are products of trailing dims, so the smaller one divides the larger.
  for (std::uint64_t i = 0; i < n; i += run) f(src.data() + src.byte_offset_of(i), dst.data() + dst.byte_offset_of(i), run);
}
}  // namespace detail

/// Copies src into dst element by element (row-major), casting when dtypes differ (see cast.hpp for
/// which casts exist). Shapes must be equal.
inline void copy(const TensorView& src, const TensorSpan& dst) {
  if (src.shape() != dst.shape())
    throw_error(errors::shape_mismatch, "copy from " + to_string(src.shape()) + " to " + to_string(dst.shape()));
  check_cast(src.dtype(), dst.dtype());
  detail::for_each_run2(src, dst, [&](const std::byte* s, std::byte* d, std::uint64_t count) {
    cast_run(src.dtype(), s, dst.dtype(), d, static_cast<std::size_t>(count));
  });
}

namespace detail {

/// Buffers of at least this many bytes get a mapping of their own (Linux), 2 MiB-aligned and
/// advised MADV_HUGEPAGE: the first write into one (reading a tensor into it) then takes a page
/// fault per 2 MiB where transparent huge pages are "madvise" or "always", not one per 4 KiB, each
/// with its own allocation and accounting.
inline constexpr std::size_t huge_buffer_min = std::size_t{8} << 20;

/// An uninitialised buffer of `bytes` (> 0) bytes, aligned to at least tensor_alignment.
inline std::shared_ptr<std::byte> tensor_buffer(std::size_t bytes) {
#if defined(__linux__)
  const long page = ::sysconf(_SC_PAGESIZE);
  if (bytes >= huge_buffer_min && page > 0) {
    constexpr std::size_t huge = std::size_t{2} << 20;
    const auto pg = static_cast<std::size_t>(page);
    const std::size_t len = (bytes + pg - 1) / pg * pg;
    if (len <= SIZE_MAX - huge) {
      void* m = ::mmap(nullptr, len + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m != MAP_FAILED) {
        auto* base = static_cast<std::byte*>(m);
        const std::size_t head = (huge - reinterpret_cast<std::uintptr_t>(base) % huge) % huge;
        if (head) ::munmap(base, head);
        if (huge - head) ::munmap(base + head + len, huge - head);
        std::byte* p = base + head;
        (void)::madvise(p, len, MADV_HUGEPAGE);
        return std::shared_ptr<std::byte>(p, [len](std::byte* q) { ::munmap(q, len); });  // on failure, unmaps it
      }
    }
  }
#endif
  auto* p = static_cast<std::byte*>(::operator new(bytes, std::align_val_t{tensor_alignment}));
  return std::shared_ptr<std::byte>(p, [](std::byte* q) { ::operator delete(q, std::align_val_t{tensor_alignment}); });
}

}  // namespace detail

/// Owning, contiguous, 64-byte-aligned tensor (from 8 MiB up, a 2 MiB-aligned mapping of its own
/// in huge pages: detail::tensor_buffer). Copies share the buffer (like a shared_ptr); use
/// `clone()` for a deep copy.
class Tensor {
 public:
  Tensor() : Tensor(statedict::dtype::F32, shape_t{0}) {}

  /// Uninitialised elements.
  Tensor(statedict::dtype t, shape_t shape) {
    const std::uint64_t bytes = byte_size(shape, statedict::itemsize(t));
    const std::size_t alloc = static_cast<std::size_t>((std::max<std::uint64_t>(bytes, 1) + tensor_alignment - 1) /
                                                       tensor_alignment * tensor_alignment);
    buffer_ = detail::tensor_buffer(alloc);
    view_ = TensorSpan::contiguous(t, std::move(shape), buffer_.get(), buffer_);
  }

  static Tensor zeros(statedict::dtype t, shape_t shape) {
    Tensor x(t, std::move(shape));
    if (x.nbytes()) std::memset(x.data(), 0, static_cast<std::size_t>(x.nbytes()));
    return x;
  }

  /// A tensor holding a copy of `values` with the given shape (numel must match).
  template <element_type T>
  static Tensor from(std::span<const T> values, shape_t shape) {
    Tensor x(dtype_of<T>, std::move(shape));
    if (x.numel() != values.size())
      throw_error(errors::shape_mismatch, std::to_string(values.size()) + " values for shape " + to_string(x.shape()));
    if (!values.empty()) std::memcpy(x.data(), values.data(), values.size_bytes());
    return x;
  }
  template <element_type T>
  static Tensor from(std::initializer_list<T> values, shape_t shape) {
    return from(std::span<const T>(values.begin(), values.size()), std::move(shape));
  }
  template <element_type T>
  static Tensor from(const std::vector<T>& values, shape_t shape) {
    return from(std::span<const T>(values), std::move(shape));
  }

  /// A contiguous, aligned copy of any view, cast to `to` when given.
  static Tensor copy_of(const TensorView& v, std::optional<statedict::dtype> to = std::nullopt) {
    Tensor x(to.value_or(v.dtype()), v.shape());
    statedict::copy(v, x.span());
    return x;
  }

  [[nodiscard]] Tensor clone() const { return copy_of(view()); }

  [[nodiscard]] TensorView view() const { return view_; }
  [[nodiscard]] TensorSpan span() const { return view_; }
  operator TensorView() const { return view_; }  // NOLINT(google-explicit-constructor)

  [[nodiscard]] statedict::dtype dtype() const noexcept { return view_.dtype(); }
  [[nodiscard]] const shape_t& shape() const noexcept { return view_.shape(); }
  [[nodiscard]] std::uint64_t numel() const noexcept { return view_.numel(); }
  [[nodiscard]] std::uint64_t nbytes() const noexcept { return view_.nbytes(); }
  [[nodiscard]] std::byte* data() const noexcept { return view_.data(); }
  template <element_type T>
  [[nodiscard]] std::span<T> values() const {
    return view_.span<T>();
  }

 private:
  std::shared_ptr<std::byte> buffer_;
  TensorSpan view_;
};

/// A contiguous, aligned copy of `v` (cast to `to` when given): a fresh Tensor.
inline Tensor contiguous(const TensorView& v, std::optional<dtype> to = std::nullopt) { return Tensor::copy_of(v, to); }

/// True when both views have the same dtype and shape and their elements have the same bytes
/// (row-major; strides may differ). Bitwise, so NaN equals NaN with the same bits and -0 differs from +0.
inline bool equal_bytes(const TensorView& a, const TensorView& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  if (a.numel() == 0) return true;
  const std::uint64_t run = std::min(a.inner_run(), b.inner_run());
  const std::size_t item = a.itemsize();
  for (std::uint64_t i = 0; i < a.numel(); i += run)
    if (std::memcmp(a.data() + a.byte_offset_of(i), b.data() + b.byte_offset_of(i), static_cast<std::size_t>(run) * item) != 0)
      return false;
  return true;
}

/// Memory ranges [data, data + extent) of two views intersect.
inline bool overlaps(const TensorView& a, const TensorView& b) noexcept {
  const std::uint64_t ea = a.extent_bytes(), eb = b.extent_bytes();
  if (ea == 0 || eb == 0) return false;
  const auto pa = reinterpret_cast<std::uintptr_t>(a.data()), pb = reinterpret_cast<std::uintptr_t>(b.data());
  return pa < pb + eb && pb < pa + ea;
}

/// Same dtype, shape, strides and data pointer: the very same view.
inline bool same_view(const TensorView& a, const TensorView& b) noexcept {
  return a.data() == b.data() && a.dtype() == b.dtype() && a.shape() == b.shape() && a.strides() == b.strides();
}

}  // namespace statedict::inline v0
