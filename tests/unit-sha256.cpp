#include <doctest/doctest.h>

#include <statedict/core/sha256.hpp>

#include <string>
#include <vector>

using namespace statedict;

TEST_CASE("SHA-256 test vectors (FIPS 180-4 examples)") {
  CHECK(sha256_hex(std::string_view("")) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(sha256_hex(std::string_view("abc")) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(sha256_hex(std::string_view("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // One million 'a', fed in uneven pieces: exercises the partial-block paths.
  Sha256 h;
  std::string chunk(997, 'a');
  std::size_t left = 1000000;
  while (left) {
    const std::size_t n = std::min(left, chunk.size());
    h.update(std::string_view(chunk.data(), n));
    left -= n;
  }
  CHECK(h.hex() == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_CASE("SHA-256 of every length around the block boundary matches a byte-at-a-time feed") {
  std::string s;
  for (int len = 0; len < 200; ++len) {
    Sha256 a, b;
    a.update(s);
    for (char c : s) b.update(std::string_view(&c, 1));
    CHECK(a.hex() == b.hex());
    s += static_cast<char>('a' + len % 26);
  }
}

TEST_CASE("tensor hash is over row-major elements whatever the strides") {
  Tensor t = Tensor::from<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  TensorView v = t.view();
  // The transpose of the transpose, as a strided view over different memory, hashes the same.
  Tensor tt = Tensor::from<float>({1, 4, 2, 5, 3, 6}, {3, 2});
  TensorView strided(dtype::F32, {2, 3}, {1, 2}, tt.data(), {});
  CHECK(sha256_hex(v) == sha256_hex(strided));
  CHECK(sha256_hex(v) == sha256_hex(std::span<const std::byte>(t.data(), 24)));
  Tensor other = Tensor::from<float>({1, 2, 3, 4, 5, 7}, {2, 3});
  CHECK(sha256_hex(v) != sha256_hex(other.view()));
}
