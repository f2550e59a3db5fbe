// Shared by the tests: the id of the statedict::error a call throws; scratch directories under
// STATEDICT_TEST_TMP; whole files read and written. Everything inline: the test files are also
// compiled together, several in one translation unit (STATEDICT_TEST_UNITY).
#pragma once

#include <doctest/doctest.h>

#include <statedict/core/error.hpp>

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace statedict_test {

/// The id of the statedict::error `f` throws, 0 when it throws none; its message goes to the
/// test log (and to `*what` when asked for).
inline int error_of(const std::function<void()>& f, std::string* what = nullptr) {
  try {
    f();
  } catch (const statedict::error& e) {
    MESSAGE(std::string(e.what()));
    if (what) *what = e.what();
    return e.id();
  }
  return 0;
}

/// STATEDICT_TEST_TMP/`test`, created when missing; what is in it stays.
inline std::filesystem::path test_dir(const std::string& test) {
  const std::filesystem::path d = std::filesystem::path(STATEDICT_TEST_TMP) / test;
  std::filesystem::create_directories(d);
  return d;
}

/// STATEDICT_TEST_TMP/`test`/`sub`, removed with all it held, its parent created: a path for the
/// code under test to create.
inline std::filesystem::path fresh_path(const std::string& test, const std::string& sub) {
  const std::filesystem::path d = std::filesystem::path(STATEDICT_TEST_TMP) / test / sub;
  std::error_code ec;
  std::filesystem::remove_all(d, ec);
  std::filesystem::create_directories(d.parent_path());
  return d;
}

/// STATEDICT_TEST_TMP/`test`/`sub`, an empty directory.
inline std::filesystem::path fresh_dir(const std::string& test, const std::string& sub) {
  std::filesystem::path d = fresh_path(test, sub);
  std::filesystem::create_directories(d);
  return d;
}

/// The bytes of the file at `p` (empty when it cannot be read).
inline std::string read_all(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

/// read_all() as bytes.
inline std::vector<std::byte> read_bytes(const std::filesystem::path& p) {
  const std::string s = read_all(p);
  const auto* b = reinterpret_cast<const std::byte*>(s.data());
  return std::vector<std::byte>(b, b + s.size());
}

/// Writes `bytes` as the whole file at `p`.
inline void write_all(const std::filesystem::path& p, std::string_view bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE_MESSAGE(f.good(), "cannot write " << p.string());
}
inline void write_all(const std::filesystem::path& p, std::span<const std::byte> bytes) {
  write_all(p, std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

}  // namespace statedict_test
