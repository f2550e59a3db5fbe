// safetensors micro-benchmarks (Google Benchmark), plus a small conversion driver for
// bench/safetensors_convert.sh.
//
//   bench-safetensors [benchmark flags]          open + index a 100k-tensor file, layout, writes
//   bench-safetensors --make OUT GIB             write a GIB GiB F32 file (64 MiB tensors)
//   bench-safetensors --convert IN OUT [DTYPE]   stream IN to OUT (optionally casting floating
//                                                tensors to DTYPE) and print the peak RssAnon
//
// Build: cmake -DSTATEDICT_BUILD_BENCH=ON -DCMAKE_BUILD_TYPE=Release.
#include <benchmark/benchmark.h>

#include <statedict/io/safetensors.hpp>
#include <statedict/formats/safetensors.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace st = statedict::safetensors;
namespace fs = std::filesystem;
using statedict::dtype;

namespace {

fs::path bench_dir() {
  fs::path d = fs::temp_directory_path() / ("statedict-bench-" + std::to_string(::getuid()));
  fs::create_directories(d);
  return d;
}

/// A file with `n` small tensors named like a transformer's, mixing dtypes (written once, reused).
const fs::path& many_tensors_file(std::size_t n) {
  static const fs::path p = [n] {
    fs::path path = bench_dir() / ("many-" + std::to_string(n) + ".safetensors");
    if (fs::exists(path)) return path;
    statedict::Tensor f32(dtype::F32, {4, 8});
    statedict::Tensor bf16(dtype::BF16, {4, 8});
    std::memset(f32.data(), 0, f32.nbytes());
    std::memset(bf16.data(), 0, bf16.nbytes());
    std::vector<st::Input> in;
    in.reserve(n);
    static const char* parts[] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                  "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj",    "input_layernorm",
                                  "post_attention_layernorm", "rotary_emb"};
    for (std::size_t i = 0; i < n; ++i)
      in.push_back(st::Input::of("model.layers." + std::to_string(i / 10) + "." + parts[i % 10] + ".weight",
                                 (i % 3 ? bf16 : f32).view()));
    st::write_options o;
    o.dedupe_views = false;
    st::write(path, in, o);
    return path;
  }();
  return p;
}

/// Reads /proc/self/status RssAnon (kB).
long rss_anon_kb() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("RssAnon:", 0) == 0) return std::stol(line.substr(8));
  return -1;
}

int make_file(const char* out, double gib) {
  const std::uint64_t total = static_cast<std::uint64_t>(gib * 1024 * 1024 * 1024);
  const statedict::dim_t per = 16 * 1024 * 1024;  // 64 MiB of F32 per tensor
  statedict::Tensor t(dtype::F32, {per});
  auto v = t.values<float>();
  std::uint32_t x = 12345;
  for (auto& f : v) {
    x = x * 1664525U + 1013904223U;
    f = static_cast<float>(static_cast<std::int32_t>(x)) * 1e-9F;
  }
  std::vector<st::Input> in;
  for (std::uint64_t done = 0, i = 0; done < total; done += t.nbytes(), ++i)
    in.push_back(st::Input::of("layers." + std::to_string(i) + ".weight", t.view()));
  st::write_options o;
  o.dedupe_views = false;
  st::write(out, in, o);
  std::printf("wrote %s: %zu tensors, %llu bytes\n", out, in.size(),
              static_cast<unsigned long long>(fs::file_size(out)));
  return 0;
}

int convert(const char* in_path, const char* out_path, const char* to) {
  std::atomic<bool> done{false};
  std::atomic<long> peak{rss_anon_kb()};
  std::thread sampler([&] {
    while (!done.load()) {
      const long r = rss_anon_kb();
      if (r > peak.load()) peak.store(r);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  const auto t0 = std::chrono::steady_clock::now();
  st::File f = st::File::open(in_path);
  st::write_options o;
  o.metadata = f.raw_metadata();
  if (const char* b = std::getenv("STATEDICT_BUFFER_KIB")) o.buffer_bytes = std::stoul(b) * 1024;
  if (to) {
    auto d = statedict::dtype_from_name(to);
    if (!d) {
      std::fprintf(stderr, "unknown dtype %s\n", to);
      return 2;
    }
    o.cast = *d;
  }
  statedict::OutputFile out = statedict::OutputFile::create(out_path);
  st::write_to(out, st::inputs_of(f.describe()), o);
  const auto t1 = std::chrono::steady_clock::now();
  out.commit();  // fsync + rename
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double stream = std::chrono::duration<double>(t1 - t0).count();
  done = true;
  sampler.join();
  const long r = rss_anon_kb();
  if (r > peak.load()) peak.store(r);
  std::printf("convert %s -> %s%s%s: %.3f s (stream %.3f s, fsync+rename %.3f s), peak RssAnon %ld kB\n", in_path,
              out_path, to ? " as " : "", to ? to : "", secs, stream, secs - stream, peak.load());
  return 0;
}

// ---------------------------------------------------------------------------------------------

void BM_open_index_100k(benchmark::State& state) {
  const fs::path& p = many_tensors_file(100'000);
  const auto mode = state.range(0) ? statedict::read_mode::pread : statedict::read_mode::mmap;
  for (auto _ : state) {
    st::File f = st::File::open(p, {mode, {}});
    benchmark::DoNotOptimize(f.find("model.layers.9999.mlp.down_proj.weight"));
  }
  state.counters["tensors"] = 100'000;
  state.counters["header_MB"] = static_cast<double>(st::File::open(p).header_size()) / 1e6;
}
BENCHMARK(BM_open_index_100k)->Arg(0)->Arg(1)->ArgNames({"pread"})->Unit(benchmark::kMillisecond);

void BM_lookup_all_100k(benchmark::State& state) {
  st::File f = st::File::open(many_tensors_file(100'000));
  std::vector<std::string> names;
  for (const auto& e : f.entries()) names.push_back(e.name);
  for (auto _ : state)
    for (const auto& n : names) benchmark::DoNotOptimize(f.view(n));
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * 100'000);
}
BENCHMARK(BM_lookup_all_100k)->Unit(benchmark::kMillisecond);

void BM_layout_100k(benchmark::State& state) {
  st::File f = st::File::open(many_tensors_file(100'000));
  std::vector<st::TensorSpec> specs;
  for (const auto& e : f.entries()) specs.push_back({e.name, *e.dtype, e.shape});
  for (auto _ : state) benchmark::DoNotOptimize(st::layout(specs, std::nullopt));
}
BENCHMARK(BM_layout_100k)->Unit(benchmark::kMillisecond);

void BM_write_256MiB(benchmark::State& state) {
  statedict::Tensor t(dtype::F32, {64 * 1024 * 1024});
  std::memset(t.data(), 0x3f, t.nbytes());
  std::vector<st::Input> in{st::Input::of("w", t.view())};
  st::write_options o;
  if (state.range(0)) o.cast = dtype::BF16;
  const fs::path p = bench_dir() / "write.safetensors";
  for (auto _ : state) st::write(p, in, o);
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(t.nbytes()));
  fs::remove(p);
}
BENCHMARK(BM_write_256MiB)->Arg(0)->Arg(1)->ArgNames({"bf16"})->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 4 && std::strcmp(argv[1], "--make") == 0) return make_file(argv[2], std::stod(argv[3]));
  if (argc >= 4 && std::strcmp(argv[1], "--convert") == 0) return convert(argv[2], argv[3], argc >= 5 ? argv[4] : nullptr);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
