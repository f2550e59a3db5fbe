#include <doctest/doctest.h>

#include <statedict/statedict.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <string>
#include <span>
#include <utility>
#include <vector>

using namespace statedict;

TEST_CASE("checked sizes") {
  CHECK(numel(shape_t{}) == 1);
  CHECK(numel(shape_t{2, 0, 3}) == 0);
  CHECK_THROWS_AS(numel(shape_t{2, -1}), shape_error);
  CHECK_THROWS_AS(numel(shape_t{1LL << 40, 1LL << 40}), limit_error);
  CHECK_THROWS_AS(byte_size(shape_t{1LL << 61}, 8), limit_error);
  CHECK(contiguous_strides(shape_t{2, 3, 4}) == shape_t{12, 4, 1});
  CHECK(is_contiguous(shape_t{2, 1, 3}, shape_t{3, 99, 1}));
  CHECK(is_contiguous(shape_t{0, 3}, shape_t{1, 5}));
  CHECK_FALSE(is_contiguous(shape_t{2, 3}, shape_t{1, 2}));
}

TEST_CASE("shape_t keeps up to five dims in place and otherwise behaves like std::vector<dim_t>") {
  // Ranks up to inline_capacity live in the object itself: copies and moves allocate nothing.
  const shape_t five{1, 2, 3, 4, 5};
  shape_t copy = five;
  CHECK(copy.capacity() == shape_t::inline_capacity);
  CHECK(copy == five);
  shape_t six{1, 2, 3, 4, 5, 6};
  CHECK(six.capacity() > shape_t::inline_capacity);
  const dim_t* heap = six.data();
  shape_t moved = std::move(six);
  CHECK(moved.data() == heap);  // a heap buffer is handed over, not copied
  CHECK(six.empty());           // NOLINT(bugprone-use-after-move): a moved-from shape is empty
  six.push_back(7);
  CHECK(six == shape_t{7});
  CHECK(shape_t(3) == shape_t{0, 0, 0});
  CHECK(shape_t(3).capacity() == shape_t::inline_capacity);  // sized construction stays inline too
  CHECK(contiguous_strides(five).capacity() == shape_t::inline_capacity);
  CHECK(shape_t(2, 9) == shape_t{9, 9});
  CHECK(shape_t{1, 2} < shape_t{1, 3});
  CHECK(shape_t{1, 2} < shape_t{1, 2, 0});
  const std::vector<dim_t> v{4, 5, 6, 7, 8, 9, 10};
  CHECK(shape_t(v.begin(), v.end()).vec() == v);
  CHECK(shape_t(std::span<const dim_t>(v)).vec() == v);
  CHECK(numel(shape_t(v.begin(), v.begin() + 2)) == 20);  // converts to std::span
  const nlohmann::json j = shape_t{3, 1, 4, 1, 5, 9};
  CHECK(j.dump() == "[3,1,4,1,5,9]");
  CHECK(j.get<shape_t>() == shape_t{3, 1, 4, 1, 5, 9});

  // Random operations against std::vector as the reference, crossing the inline/heap boundary
  // both ways (fixed seed).
  std::uint64_t seed = 0x5eed;
  auto rnd = [&](std::uint64_t n) {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    return (seed >> 33) % n;
  };
  shape_t a, b;
  std::vector<dim_t> ra, rb;
  for (int step = 0; step < 20000; ++step) {
    const auto x = static_cast<dim_t>(rnd(1000));
    switch (rnd(12)) {
      case 0: case 1: a.push_back(x); ra.push_back(x); break;
      case 2: if (!ra.empty()) { a.pop_back(); ra.pop_back(); } break;
      case 3: { const auto at = rnd(ra.size() + 1); a.insert(a.begin() + at, x); ra.insert(ra.begin() + static_cast<std::ptrdiff_t>(at), x); break; }
      case 4: if (!ra.empty()) { const auto at = rnd(ra.size()); a.erase(a.begin() + at); ra.erase(ra.begin() + static_cast<std::ptrdiff_t>(at)); } break;
      case 5: { const auto n = rnd(9); a.resize(n, x); ra.resize(n, x); break; }
      case 6: b = a; rb = ra; break;
      case 7: a.swap(b); ra.swap(rb); break;
      case 8: { shape_t t(std::move(a)); a = std::move(b); b = std::move(t); std::swap(ra, rb); break; }
      case 9: a.reserve(rnd(12)); break;
      case 10: { const auto at = rnd(ra.size() + 1); a.insert(a.begin() + at, rb.begin(), rb.end());
                 ra.insert(ra.begin() + static_cast<std::ptrdiff_t>(at), rb.begin(), rb.end()); break; }
      default: if (ra.size() > 3) { a.erase(a.begin() + 1, a.begin() + 3); ra.erase(ra.begin() + 1, ra.begin() + 3); } break;
    }
    REQUIRE(a.vec() == ra);
    REQUIRE(b.vec() == rb);
    REQUIRE((a == b) == (ra == rb));
    REQUIRE((a < b) == (ra < rb));
    REQUIRE(a.capacity() >= a.size());
  }
}

TEST_CASE("views narrow, select and iterate runs row-major") {
  std::vector<float> data(24);
  std::iota(data.begin(), data.end(), 0.0F);
  Tensor t = Tensor::from(data, {2, 3, 4});
  TensorView v = t.view();
  CHECK(v.is_contiguous());
  auto n = v.narrow(2, 1, 2);  // [2,3,2]
  CHECK_FALSE(n.is_contiguous());
  CHECK(n.load<float>(0) == 1.0F);
  CHECK(n.load<float>(1) == 2.0F);
  CHECK(n.load<float>(2) == 5.0F);
  int runs = 0;
  n.for_each_run([&](const std::byte*, std::uint64_t count) {
    ++runs;
    CHECK(count == 2);
  });
  CHECK(runs == 6);
  auto s = v.select(0, 1);
  CHECK(s.shape() == shape_t{3, 4});
  CHECK(s.load<float>(0) == 12.0F);
  CHECK_THROWS_AS((void)v.narrow(1, 2, 2), usage_error);
  CHECK_THROWS_AS((void)v.span<double>(), type_error);
}

TEST_CASE("typed span refuses misaligned data; load and copy handle it") {
  std::vector<std::byte> raw(1 + 4 * 4);
  float vals[4] = {1.5F, -2.0F, 3.25F, 1e30F};
  std::memcpy(raw.data() + 1, vals, sizeof vals);
  TensorView v = TensorView::contiguous(dtype::F32, {4}, raw.data() + 1);
  CHECK_THROWS_AS((void)v.span<float>(), usage_error);
  CHECK(v.load<float>(2) == 3.25F);
  Tensor c = contiguous(v);
  CHECK(c.values<float>()[3] == 1e30F);
  Tensor b = contiguous(v, dtype::BF16);
  CHECK(f32_from_bf16(b.values<bfloat16>()[0].bits) == 1.5F);
}

TEST_CASE("copy casts between floating dtypes and refuses integer casts") {
  Tensor src = Tensor::from<float>({1.0F, 0.1F, 65520.0F, -1e-8F}, {4});
  Tensor h(dtype::F16, {4});
  copy(src, h.span());
  auto hv = h.values<float16>();
  CHECK(hv[0].bits == 0x3c00);
  CHECK(hv[2].bits == 0x7c00);  // 65520 rounds to inf
  Tensor i = Tensor::from<std::int32_t>({1, 2}, {2});
  Tensor f(dtype::F32, {2});
  CHECK_THROWS_AS(copy(i, f.span()), unsupported_error);
}

TEST_CASE("bf16/f16 round trips and rounding ties") {
  CHECK(bf16_from_f32(1.0F) == 0x3f80);
  // 1 + 2^-8 is a tie between bf16 1.0 (even) and 1.0078125 (odd): rounds to even.
  CHECK(bf16_from_f32(1.00390625F) == 0x3f80);
  CHECK(bf16_from_f32(1.01171875F) == 0x3f82);
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const auto x = static_cast<std::uint16_t>(h);
    const float f = f32_from_f16(x);
    if (f == f) CHECK_EQ(f16_from_f32(f), x);
    const float g = f32_from_bf16(x);
    if (g == g) CHECK_EQ(bf16_from_f32(g), x);
  }
}

#if defined(__linux__)
namespace {
/// AnonHugePages (KiB) of the mapping that holds `p`, from /proc/self/smaps; -1 when not found.
long long anon_huge_kib(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  const auto at = static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(p));
  bool in = false;
  while (std::getline(smaps, line)) {
    const char c = line.empty() ? ' ' : line[0];
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')) {  // "lo-hi perms offset dev inode [name]"
      unsigned long long lo = 0, hi = 0;
      in = std::sscanf(line.c_str(), "%llx-%llx", &lo, &hi) == 2 && at >= lo && at < hi;
    } else if (in && line.rfind("AnonHugePages:", 0) == 0) {
      return std::stoll(line.substr(14));
    }
  }
  return -1;
}

std::string thp_mode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string all;
  std::getline(f, all);
  const auto b = all.find('['), e = all.find(']');
  return b == std::string::npos || e == std::string::npos ? "" : all.substr(b + 1, e - b - 1);
}
}  // namespace

TEST_CASE("large Tensors are 2 MiB-aligned mappings of their own, filled in 2 MiB pages where the kernel allows") {
  // 24 MiB + 100 bytes: a buffer of at least detail::huge_buffer_min bytes.
  const Tensor t(dtype::U8, shape_t{(std::int64_t{24} << 20) + 100});
  CHECK(reinterpret_cast<std::uintptr_t>(t.data()) % (std::uintptr_t{2} << 20) == 0);
  std::memset(t.data(), 0x5A, static_cast<std::size_t>(t.nbytes()));
  CHECK(t.values<std::uint8_t>()[t.numel() - 1] == 0x5A);
  const std::string mode = thp_mode();
  if (mode == "madvise" || mode == "always") {
    CAPTURE(mode);
    CHECK(anon_huge_kib(t.data()) >= 2048);  // the kernel may fall back to 4 KiB pages for some
  } else {
    MESSAGE("transparent huge pages are '" << mode << "' here: the 2 MiB pages are not checked");
  }
  // Copies share the mapping; it is unmapped with the last of them.
  const void* where = t.data();
  {
    const Tensor u = t;  // NOLINT(performance-unnecessary-copy-initialization)
    CHECK(u.data() == where);
  }
  // Small tensors stay on the heap, aligned to tensor_alignment.
  const Tensor small(dtype::F32, shape_t{1000});
  CHECK(reinterpret_cast<std::uintptr_t>(small.data()) % tensor_alignment == 0);
}
#endif
