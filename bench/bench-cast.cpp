// Throughput of cast_run for the pairs that converting a checkpoint spends its time in.
//
//   cmake -S . -B build-bench -DSTATEDICT_BUILD_BENCH=ON -DCMAKE_BUILD_TYPE=Release
//   cmake --build build-bench --target bench-cast && build-bench/bench/bench-cast
//
// bytes_per_second counts the source bytes read. Two sizes per pair: 64 Ki elements (source and
// destination stay in cache: the conversion itself) and 16 Mi elements (through memory, as a real
// checkpoint is). "/misaligned" shifts both buffers by one byte (safetensors data may start anywhere).
#include <benchmark/benchmark.h>

#include <statedict/statedict.hpp>

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

using namespace statedict;

namespace {

/// Source values: normal numbers of both signs over a wide exponent range, with a sprinkling of
/// subnormals, zeros, infinities and NaNs, so no path is skipped by the data.
std::vector<std::byte> make_source(dtype from, std::size_t n) {
  std::mt19937 rng(42);
  std::vector<float> f(n);
  std::uniform_real_distribution<float> mant(1.0F, 2.0F);
  std::uniform_int_distribution<int> ex(-30, 30);
  for (std::size_t i = 0; i < n; ++i) {
    const int e = ex(rng);
    f[i] = std::ldexp(mant(rng), e) * ((rng() & 1U) ? -1.0F : 1.0F);
    if (i % 97 == 0) f[i] = 1e-40F;
    if (i % 101 == 0) f[i] = std::bit_cast<float>(0x7fc00001U);
  }
  std::vector<std::byte> out(n * itemsize(from) + 1);
  cast_run(dtype::F32, reinterpret_cast<const std::byte*>(f.data()), from, out.data(), n);
  return out;
}

void cast(benchmark::State& state, dtype from, dtype to, bool misaligned) {
  const auto n = static_cast<std::size_t>(state.range(0));
  std::vector<std::byte> src = make_source(from, n);
  if (misaligned) std::memmove(src.data() + 1, src.data(), n * itemsize(from));
  std::vector<std::byte> dst(n * itemsize(to) + 1);
  const std::size_t off = misaligned ? 1 : 0;
  for (auto _ : state) {
    cast_run(from, src.data() + off, to, dst.data() + off, n);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(n * itemsize(from)));
}

void register_all() {
  struct pair {
    const char* name;
    dtype from, to;
  };
  const pair pairs[] = {
      {"F32->BF16", dtype::F32, dtype::BF16}, {"F32->F16", dtype::F32, dtype::F16},
      {"BF16->F32", dtype::BF16, dtype::F32}, {"F16->F32", dtype::F16, dtype::F32},
      {"F64->BF16", dtype::F64, dtype::BF16}, {"BF16->F16", dtype::BF16, dtype::F16},
      {"F32->F8_E4M3", dtype::F32, dtype::F8_E4M3},
  };
  for (const auto& p : pairs) {
    for (bool mis : {false, true}) {
      const std::string name = std::string("cast_run/") + p.name + (mis ? "/misaligned" : "");
      benchmark::RegisterBenchmark(name.c_str(), cast, p.from, p.to, mis)->Arg(1 << 16)->Arg(1 << 24)->Unit(benchmark::kMicrosecond);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
