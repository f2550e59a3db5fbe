// Planner and executor benchmarks.
//
//   bench-plan                      Google Benchmark: planning time on many chunks (in memory)
//   bench-plan gen DIR [opts]       writes a sharded checkpoint of random bytes (rank files)
//   bench-plan reshard DIR OUT [opts]
//                                   plans and runs DIR (--from ranks, --layout) -> OUT (--to ranks,
//                                   --to-layout; --to 1 is one consolidated file), atomically (OutputDir);
//                                   prints one JSON line of timings and executor statistics
// Options: --mib N (model size, default 3072), --from N, --to N, --layout chunk|zero3|tp,
// --to-layout ..., --threads N, --budget-mib N, --dtype F32|BF16|F16 (output dtype).
// bench/reshard_bench.sh drives these and measures them against cp.
#include <benchmark/benchmark.h>

#include <statedict/exec/executor.hpp>
#include <statedict/io/file.hpp>
#include <statedict/shard/layout.hpp>
#include <statedict/shard/plan.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

using namespace statedict;
namespace fs = std::filesystem;

namespace {

// ---------------------------------------------------------------------------------------------
// A LLaMA-like model of about `mib` MiB of F32: embedding and head of vocab 32003 (odd, so that
// chunks and partitions are uneven), blocks of attention (4 x d*d) and MLP (3 x d*f, f odd) with
// 1-d norms, as many blocks as fit.

std::vector<TensorInfo> model(std::uint64_t mib) {
  const dim_t vocab = 32003, d = 2048, f = 5503;
  std::vector<TensorInfo> ts;
  ts.push_back({"embed.weight", dtype::F32, {vocab, d}, {}});
  std::uint64_t bytes = static_cast<std::uint64_t>(2 * vocab * d * 4);
  const std::uint64_t block = static_cast<std::uint64_t>((4 * d * d + 3 * d * f + 2 * d) * 4);
  const std::uint64_t target = mib << 20;
  for (int l = 0; bytes + block <= target || l == 0; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    for (const char* n : {"q", "k", "v", "o"}) ts.push_back({p + "attn." + n + ".weight", dtype::F32, {d, d}, {}});
    ts.push_back({p + "mlp.gate.weight", dtype::F32, {f, d}, {}});
    ts.push_back({p + "mlp.up.weight", dtype::F32, {f, d}, {}});
    ts.push_back({p + "mlp.down.weight", dtype::F32, {d, f}, {}});
    ts.push_back({p + "norm1.weight", dtype::F32, {d}, {}});
    ts.push_back({p + "norm2.weight", dtype::F32, {d}, {}});
    bytes += block;
  }
  ts.push_back({"norm.weight", dtype::F32, {d}, {}});
  ts.push_back({"head.weight", dtype::F32, {vocab, d}, {}});
  return ts;
}

Destination make_layout(const std::string& kind, const std::vector<TensorInfo>& ts, std::uint32_t ranks,
                        std::optional<dtype> stored = std::nullopt) {
  if (ranks == 1 && kind != "zero3") return layout::single(ts, "consolidated.bin", 64, stored);
  Destination d;
  if (kind == "chunk" || kind == "tp") {
    // chunk: every matrix along dim 0 (DCP / ChunkShardingSpec rows). tp: Megatron-style column and
    // row parallel linears (q, k, v, gate, up along dim 0; o, down along dim 1), norms replicated.
    std::vector<int> dims;
    for (const auto& t : ts) {
      const bool row = t.name.find(".o.") != std::string::npos || t.name.find(".down.") != std::string::npos;
      dims.push_back(t.shape.size() < 2 ? -1 : (kind == "tp" && row ? 1 : 0));
    }
    d = layout::chunked(ts, dims, ranks, layout::split_rule::chunk, 64, stored);
  } else if (kind == "zero3") {
    std::vector<std::vector<std::size_t>> groups(1);
    for (std::size_t i = 0; i < ts.size(); ++i) groups[0].push_back(i);
    d = layout::zero3(ts, groups, ranks, stored);
  } else {
    std::fprintf(stderr, "unknown layout %s (chunk, tp, zero3)\n", kind.c_str());
    std::exit(2);
  }
  for (std::uint32_t r = 0; r < ranks; ++r) d.names[r] = "rank" + std::to_string(r) + ".bin";
  return d;
}

struct args {
  std::vector<std::string> pos;
  std::map<std::string, std::string> opt;
  std::string get(const std::string& k, const std::string& def) const {
    auto it = opt.find(k);
    return it == opt.end() ? def : it->second;
  }
};

args parse(int argc, char** argv) {
  args a;
  for (int i = 2; i < argc; ++i) {
    std::string s = argv[i];
    if (s.rfind("--", 0) == 0 && i + 1 < argc)
      a.opt[s.substr(2)] = argv[++i];
    else
      a.pos.push_back(s);
  }
  return a;
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int cmd_gen(const args& a) {
  const fs::path dir = a.pos.at(0);
  const auto ts = model(std::stoull(a.get("mib", "3072")));
  const auto ranks = static_cast<std::uint32_t>(std::stoul(a.get("ranks", "8")));
  const Destination d = make_layout(a.get("layout", "chunk"), ts, ranks);
  fs::create_directories(dir);
  std::vector<std::byte> buf(16 << 20);
  std::uint64_t x = 0x9e3779b97f4a7c15ULL;
  std::uint64_t total = 0;
  for (std::uint32_t r = 0; r < ranks; ++r) {
    OutputFile f = OutputFile::create(dir / d.names[r]);
    for (std::uint64_t off = 0; off < d.sizes[r]; off += buf.size()) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), d.sizes[r] - off));
      for (std::size_t i = 0; i + 8 <= n; i += 8) {  // splitmix64
        x += 0x9e3779b97f4a7c15ULL;
        std::uint64_t z = x;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        z ^= z >> 31;
        std::memcpy(buf.data() + i, &z, 8);
      }
      f.pwrite(off, std::span<const std::byte>(buf.data(), n));
    }
    f.commit();
    total += d.sizes[r];
  }
  std::printf("{\"tensors\": %zu, \"bytes\": %llu, \"ranks\": %u}\n", ts.size(), static_cast<unsigned long long>(total), ranks);
  return 0;
}

int cmd_reshard(const args& a) {
  const fs::path in = a.pos.at(0), out = a.pos.at(1);
  const auto ts = model(std::stoull(a.get("mib", "3072")));
  const auto from = static_cast<std::uint32_t>(std::stoul(a.get("from", "8")));
  const auto to = static_cast<std::uint32_t>(std::stoul(a.get("to", "3")));
  const std::string kind = a.get("layout", "chunk");
  std::optional<dtype> stored;
  if (a.opt.count("dtype")) {
    stored = dtype_from_name(a.get("dtype", "F32"));
    if (!stored) return 2;
  }
  std::vector<TensorInfo> dst_ts = ts;
  if (stored)
    for (auto& t : dst_ts) t.dtype = *stored;
  const double t0 = now();
  const Destination src_layout = make_layout(kind, ts, from);
  std::vector<std::shared_ptr<const ByteSource>> sources;
  for (const auto& n : src_layout.names) sources.push_back(InputFile::open(in / n));
  const ShardedCheckpoint src = layout::as_checkpoint(src_layout, sources);
  const Destination dst = make_layout(a.get("to-layout", kind), dst_ts, to);
  const double t1 = now();
  const Plan plan = make_plan(src, dst);
  const double t2 = now();
  OutputDir dir = OutputDir::create(out);
  std::vector<OutputFile> files;
  std::vector<std::unique_ptr<FileSink>> sinks;
  std::vector<Sink*> ptrs;
  files.reserve(dst.names.size());
  for (const auto& n : dst.names) {
    files.push_back(dir.create_file(n));
    sinks.push_back(std::make_unique<FileSink>(files.back()));
    ptrs.push_back(sinks.back().get());
  }
  exec_options opt;
  opt.threads = static_cast<unsigned>(std::stoul(a.get("threads", "2")));
  opt.memory_budget = std::stoull(a.get("budget-mib", "256")) << 20;
  const exec_stats st = execute(plan, src, ptrs, opt);
  const double t3 = now();
  for (auto& f : files) f.commit();
  dir.commit();
  const double t4 = now();
  std::printf(
      "{\"describe_s\": %.4f, \"plan_s\": %.4f, \"execute_s\": %.4f, \"commit_s\": %.4f, \"ops\": %zu, "
      "\"bytes\": %llu, \"in_kernel\": %llu, \"from_mapping\": %llu, \"converted\": %llu, \"buffer_bytes\": %llu, "
      "\"block_bytes\": %llu, \"threads\": %u, \"items\": %llu}\n",
      t1 - t0, t2 - t1, t3 - t2, t4 - t3, plan.ops.size(), static_cast<unsigned long long>(st.bytes_written),
      static_cast<unsigned long long>(st.bytes_in_kernel), static_cast<unsigned long long>(st.bytes_from_mapping),
      static_cast<unsigned long long>(st.bytes_converted), static_cast<unsigned long long>(st.buffer_bytes),
      static_cast<unsigned long long>(st.block_bytes), st.threads, static_cast<unsigned long long>(st.work_items));
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Micro-benchmarks: planning cost grows with chunks, not bytes.

/// A source of the right size with no bytes behind it (planning never reads).
class SizedSource final : public ByteSource {
 public:
  SizedSource(std::string n, std::uint64_t s) : name_(std::move(n)), size_(s) {}
  [[nodiscard]] const std::string& name() const noexcept override { return name_; }
  [[nodiscard]] std::uint64_t size() const noexcept override { return size_; }
  [[nodiscard]] keep_alive owner() const override { return {}; }
  void read(std::uint64_t, std::span<std::byte>) const override {}

 private:
  std::string name_;
  std::uint64_t size_;
};

ShardedCheckpoint sized(const Destination& d) {
  std::vector<std::shared_ptr<const ByteSource>> s;
  for (std::size_t i = 0; i < d.names.size(); ++i) s.push_back(std::make_shared<SizedSource>(d.names[i], d.sizes[i]));
  return layout::as_checkpoint(d, std::move(s));
}

// ZeRO-3 with `ranks` ranks, 1000 parameters of odd sizes: 1000 * ranks flat chunks, consolidated.
void BM_PlanZero3Consolidate(benchmark::State& state) {
  const auto ranks = static_cast<std::uint32_t>(state.range(0));
  std::vector<TensorInfo> ts;
  for (int i = 0; i < 1000; ++i) {
    std::string name = std::to_string(i);  // not "p" + to_string(i): GCC 12 -Wrestrict false positive at -O3
    name.insert(0, 1, 'p');
    ts.push_back({name, dtype::F32, {97 + i, 33}, {}});
  }
  std::vector<std::vector<std::size_t>> g(1);
  for (std::size_t i = 0; i < ts.size(); ++i) g[0].push_back(i);
  const ShardedCheckpoint src = sized(layout::zero3(ts, g, ranks));
  const Destination dst = layout::single(ts);
  std::size_t chunks = 0;
  for (const auto& t : src.tensors) chunks += t.chunks.size();
  for (auto _ : state) {
    Plan p = make_plan(src, dst);
    benchmark::DoNotOptimize(p.ops.data());
  }
  state.counters["chunks"] = static_cast<double>(chunks);
  state.counters["chunks/s"] = benchmark::Counter(static_cast<double>(chunks), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_PlanZero3Consolidate)->Arg(8)->Arg(64)->Arg(1024)->Unit(benchmark::kMillisecond);

// ZeRO-3 on `ranks` ranks resharded to ranks - 1: every parameter's slices cut differently.
void BM_PlanZero3Reshard(benchmark::State& state) {
  const auto ranks = static_cast<std::uint32_t>(state.range(0));
  std::vector<TensorInfo> ts;
  for (int i = 0; i < 1000; ++i) {
    std::string name = std::to_string(i);  // not "p" + to_string(i): GCC 12 -Wrestrict false positive at -O3
    name.insert(0, 1, 'p');
    ts.push_back({name, dtype::F32, {97 + i, 33}, {}});
  }
  std::vector<std::vector<std::size_t>> g(1);
  for (std::size_t i = 0; i < ts.size(); ++i) g[0].push_back(i);
  const ShardedCheckpoint src = sized(layout::zero3(ts, g, ranks));
  const Destination dst = layout::zero3(ts, g, ranks - 1);
  for (auto _ : state) {
    Plan p = make_plan(src, dst);
    benchmark::DoNotOptimize(p.ops.data());
  }
  state.counters["chunks"] = static_cast<double>(1000 * ranks);
}
BENCHMARK(BM_PlanZero3Reshard)->Arg(8)->Arg(64)->Arg(512)->Unit(benchmark::kMillisecond);

// The 3 GiB model of the driver: tensor parallel 8 -> consolidated (strided copies).
void BM_PlanTpConsolidate(benchmark::State& state) {
  const auto ts = model(3072);
  const ShardedCheckpoint src = sized(make_layout("tp", ts, 8));
  const Destination dst = make_layout("chunk", ts, 1);
  for (auto _ : state) {
    Plan p = make_plan(src, dst);
    benchmark::DoNotOptimize(p.ops.data());
  }
}
BENCHMARK(BM_PlanTpConsolidate)->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  try {
    if (cmd == "gen") return cmd_gen(parse(argc, argv));
    if (cmd == "reshard") return cmd_reshard(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
