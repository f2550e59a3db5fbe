// Lazy random access (bench case B8): open a checkpoint of any layout and read one tensor into
// memory, nothing else. Not a Google Benchmark: bench/run.py times the whole process against
// `cp` of the same number of bytes.
//
//   bench-read CKPT [NAME] [--sha256]
//
// Without NAME, the tensor whose bytes are closest to 64 MiB. Prints the tensor's name, dtype,
// shape and bytes, the seconds spent in open() and in read_tensor(), and with --sha256 the
// SHA-256 of its elements (row-major, little-endian), for checking against a reference.
#include <statedict/statedict.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace sd = statedict;

int main(int argc, char** argv) try {
  std::string ckpt, name;
  bool sha = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--sha256") sha = true;
    else if (ckpt.empty()) ckpt = a;
    else name = a;
  }
  if (ckpt.empty()) {
    std::fprintf(stderr, "usage: bench-read CKPT [NAME] [--sha256]\n");
    return 2;
  }
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  const sd::Opened in = sd::open(ckpt);
  const auto t1 = clock::now();
  if (name.empty()) {
    const std::uint64_t target = 64ULL << 20;
    std::uint64_t best = ~0ULL;
    for (const sd::TensorInfo& t : in.checkpoint.tensors) {
      const std::uint64_t bytes = sd::byte_size(t.shape, sd::itemsize(t.dtype));
      const std::uint64_t d = bytes > target ? bytes - target : target - bytes;
      if (d < best) {
        best = d;
        name = t.name;
      }
    }
  }
  const sd::Tensor t = sd::read_tensor(in.checkpoint, name);
  const auto t2 = clock::now();
  std::printf("%s %s %s %llu bytes; open %.4f s, read %.4f s", name.c_str(), std::string(sd::name(t.dtype())).c_str(),
              sd::to_string(t.shape()).c_str(), static_cast<unsigned long long>(t.nbytes()),
              std::chrono::duration<double>(t1 - t0).count(), std::chrono::duration<double>(t2 - t1).count());
  if (sha) std::printf("; sha256 %s", sd::sha256_hex(std::span<const std::byte>(t.data(), static_cast<std::size_t>(t.nbytes()))).c_str());
  std::printf("\n");
  return 0;
} catch (const sd::error& e) {
  std::fprintf(stderr, "bench-read: %s\n", e.what());
  return 2;
}
