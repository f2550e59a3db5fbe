// statedict: error hierarchy with stable ids.
// SPDX-License-Identifier: MIT
//
// Every failure statedict reports is an exception derived from `statedict::error`. Each carries a
// stable numeric id and a dotted name (`errors::st_header_too_large` is 301,
// "safetensors.header_too_large"), a context that says where it happened (file, tensor, key path),
// and a detail that says what was expected. `what()` reads
//
//   [statedict.format_error.301] file 'a.safetensors': header length 9999999999 exceeds the cap ...
//
// Ids are declared next to the code that raises them, as `inline constexpr error_id` constants in
// `namespace statedict::errors`; docs/errors.md lists them all (tools/check_error_ids.py keeps the
// list complete and the ids unique). Ranges: 1xx core, 2xx flatten/optimizer/reflect,
// 3xx safetensors + HF sharded + files, 4xx zip + pickle, 5xx torch files, 6xx shard + exec,
// 7xx checkpoint layouts, 8xx command line.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "config.hpp"

namespace statedict::inline v0 {

/// What went wrong, broadly; decides the exception class.
enum class error_kind : unsigned char {
  usage,        ///< the caller used the API wrongly (bad argument, wrong typed access)
  type,         ///< a value or tensor has another kind or dtype than required
  shape,        ///< shapes or strides do not fit
  key,          ///< a name or key is missing, extra or duplicated
  format,       ///< an input file is malformed
  limit,        ///< an input exceeds a configured cap (a kind of format error)
  security,     ///< an input asks for something never allowed (a pickle global outside the allow-list)
  unsupported,  ///< valid input that statedict does not handle
  io,           ///< the operating system refused (open, read, write, rename)
  plan,         ///< a copy plan does not cover its destination exactly once
};

constexpr std::string_view to_string(error_kind k) noexcept {
  switch (k) {
    case error_kind::usage: return "usage_error";
    case error_kind::type: return "type_error";
    case error_kind::shape: return "shape_error";
    case error_kind::key: return "key_error";
    case error_kind::format: return "format_error";
    case error_kind::limit: return "limit_error";
    case error_kind::security: return "security_error";
    case error_kind::unsupported: return "unsupported_error";
    case error_kind::io: return "io_error";
    case error_kind::plan: return "plan_error";
  }
  return "error";
}

/// A stable error identity: numeric id, kind, dotted name.
struct error_id {
  int id;
  error_kind kind;
  std::string_view name;
  friend constexpr bool operator==(const error_id& a, const error_id& b) noexcept { return a.id == b.id; }
};

/// Base of every statedict exception. Copying never throws (the text is shared).
class error : public std::exception {
 public:
  error(const error_id& id, std::string context, std::string detail)
      : id_(id), data_(std::make_shared<data>(data{std::move(context), std::move(detail), {}})) {
    rebuild();
  }

  [[nodiscard]] const char* what() const noexcept override { return data_->what.c_str(); }
  [[nodiscard]] int id() const noexcept { return id_.id; }
  [[nodiscard]] const error_id& code() const noexcept { return id_; }
  [[nodiscard]] error_kind kind() const noexcept { return id_.kind; }
  [[nodiscard]] std::string_view name() const noexcept { return id_.name; }
  /// Where it happened: "file 'x.pt': key 'model.w'" (outermost first); may be empty.
  [[nodiscard]] const std::string& context() const noexcept { return data_->context; }
  /// What was found and what was expected.
  [[nodiscard]] const std::string& detail() const noexcept { return data_->detail; }

  /// Prepends an outer context ("file 'x.pt'") to this error; used when rethrowing with more
  /// knowledge of where the failing input came from.
  error& add_context(std::string_view outer) {
    if (outer.empty()) return *this;
    auto d = std::make_shared<data>(*data_);
    d->context = d->context.empty() ? std::string(outer) : std::string(outer) + ": " + d->context;
    data_ = std::move(d);
    rebuild();
    return *this;
  }

 private:
  struct data {
    std::string context;
    std::string detail;
    std::string what;
  };
  void rebuild() {
    std::string w = "[statedict.";
    w += to_string(id_.kind);
    w += '.';
    w += std::to_string(id_.id);
    w += "] ";
    if (!data_->context.empty()) {
      w += data_->context;
      w += ": ";
    }
    w += data_->detail;
    data_->what = std::move(w);
  }

  error_id id_;
  std::shared_ptr<data> data_;
};

// clang-format off
class usage_error : public error { public: using error::error; };
class type_error : public error { public: using error::error; };
class shape_error : public error { public: using error::error; };
class key_error : public error { public: using error::error; };
class format_error : public error { public: using error::error; };
/// An input exceeds a configured cap; raise the cap (each has a name and a documented default).
class limit_error : public format_error { public: using format_error::format_error; };
/// An input asks for something that is never allowed, such as calling an arbitrary pickle global.
class security_error : public format_error { public: using format_error::format_error; };
class unsupported_error : public error { public: using error::error; };
class io_error : public error { public: using error::error; };
class plan_error : public error { public: using error::error; };
// clang-format on

/// Throws the exception class that matches `id.kind`.
[[noreturn]] inline void throw_error(const error_id& id, std::string context, std::string detail) {
  switch (id.kind) {
    case error_kind::usage: throw usage_error(id, std::move(context), std::move(detail));
    case error_kind::type: throw type_error(id, std::move(context), std::move(detail));
    case error_kind::shape: throw shape_error(id, std::move(context), std::move(detail));
    case error_kind::key: throw key_error(id, std::move(context), std::move(detail));
    case error_kind::format: throw format_error(id, std::move(context), std::move(detail));
    case error_kind::limit: throw limit_error(id, std::move(context), std::move(detail));
    case error_kind::security: throw security_error(id, std::move(context), std::move(detail));
    case error_kind::unsupported: throw unsupported_error(id, std::move(context), std::move(detail));
    case error_kind::io: throw io_error(id, std::move(context), std::move(detail));
    case error_kind::plan: throw plan_error(id, std::move(context), std::move(detail));
  }
  throw error(id, std::move(context), std::move(detail));
}

/// Throws without a context; callers up the stack add one with `error::add_context`.
[[noreturn]] inline void throw_error(const error_id& id, std::string detail) {
  throw_error(id, std::string(), std::move(detail));
}

/// Quotes a name from an input file for an error message: single quotes, control and non-ASCII
/// bytes escaped as \xNN, long names cut in the middle, so one hostile name cannot forge or flood
/// the one-line message.
inline std::string quote(std::string_view s, std::size_t max_len = 160) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string out;
  out.reserve(s.size() + 2);
  out += '\'';
  auto put = [&](unsigned char c) {
    if (c == '\\' || c == '\'') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c >= 0x7f) {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  };
  if (s.size() <= max_len) {
    for (char c : s) put(static_cast<unsigned char>(c));
  } else {
    for (char c : s.substr(0, max_len / 2)) put(static_cast<unsigned char>(c));
    out += "...";
    for (char c : s.substr(s.size() - max_len / 2)) put(static_cast<unsigned char>(c));
  }
  out += '\'';
  return out;
}

/// Error ids of the core module (1xx).
namespace errors {
// clang-format off
inline constexpr error_id overflow            {101, error_kind::limit,       "core.overflow"};
inline constexpr error_id negative_dim        {102, error_kind::shape,       "core.negative_dim"};
inline constexpr error_id shape_mismatch      {103, error_kind::shape,       "core.shape_mismatch"};
inline constexpr error_id out_of_range        {104, error_kind::usage,       "core.out_of_range"};
inline constexpr error_id dtype_mismatch      {105, error_kind::type,        "core.dtype_mismatch"};
inline constexpr error_id misaligned          {106, error_kind::usage,       "core.misaligned"};
inline constexpr error_id not_contiguous      {107, error_kind::usage,       "core.not_contiguous"};
inline constexpr error_id unknown_dtype       {108, error_kind::format,      "core.unknown_dtype"};
inline constexpr error_id unsupported_cast    {109, error_kind::unsupported, "core.unsupported_cast"};
inline constexpr error_id value_kind          {110, error_kind::type,        "core.value_kind"};
inline constexpr error_id missing_key         {111, error_kind::key,         "core.missing_key"};
inline constexpr error_id duplicate_key       {112, error_kind::key,         "core.duplicate_key"};
inline constexpr error_id bad_stride          {113, error_kind::shape,       "core.bad_stride"};
inline constexpr error_id null_data           {114, error_kind::usage,       "core.null_data"};
inline constexpr error_id too_many_dims       {115, error_kind::limit,       "core.too_many_dims"};
// clang-format on
}  // namespace errors

}  // namespace statedict::inline v0
