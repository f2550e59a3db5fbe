// Micro-benchmark: flatten + unflatten of a 100k-leaf optimizer-like state dict.
//
// The tree: {"model": 25,000 parameters named model.layers.<l>.<module>.weight/bias,
//            "optim": {"state": {id: {"step": 0-d tensor, "exp_avg": T, "exp_avg_sq": T}},
//                      "param_groups": [two groups of AdamW hyper-parameters + "params" ids]}}
// that is 100,000 tensor leaves (+ 25,000 int ids and a few scalars). Target: flatten + unflatten
// (BM_FlattenUnflatten) under 50 ms in a Release build. Read CPU time: the machine is shared.
//
//   cmake -S . -B /tmp/build-bench -DSTATEDICT_BUILD_BENCH=ON -DCMAKE_BUILD_TYPE=Release
//   cmake --build /tmp/build-bench --target bench-flatten && /tmp/build-bench/bin/bench-flatten
#include <benchmark/benchmark.h>

#include <statedict/statedict.hpp>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace statedict;

constexpr int n_params = 25000;

struct Tree {
  Tensor storage;  // every tensor is a view into this one buffer (disjoint ranges)
  Value tree;
};

Tree make_tree() {
  constexpr dim_t elems = 8;  // per parameter; the benchmark measures structure, not bytes
  Tree t;
  t.storage = Tensor::zeros(dtype::F32, {static_cast<dim_t>(n_params) * (3 * elems + 1)});
  const std::byte* base = t.storage.data();
  std::size_t next = 0;
  auto carve = [&](shape_t shape) {
    TensorView v = TensorView::contiguous(dtype::F32, std::move(shape), base + next * 4, {});
    next += static_cast<std::size_t>(v.numel());
    return v;
  };
  static const char* modules[] = {"attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.up_proj"};
  Dict model;
  model.reserve(n_params);
  Dict state;
  state.reserve(n_params);
  List ids[2];
  for (int i = 0; i < n_params; ++i) {
    const int layer = i / 10, m = (i / 2) % 5;
    std::string name = "layers." + std::to_string(layer) + "." + modules[m] + (i % 2 ? ".bias" : ".weight");
    model.insert(std::move(name), carve({2, elems / 2}));
    Dict s;
    s.insert("step", carve({}));
    s.insert("exp_avg", carve({2, elems / 2}));
    s.insert("exp_avg_sq", carve({2, elems / 2}));
    state.insert(i, std::move(s));
    ids[i % 2].emplace_back(i);
  }
  List groups;
  for (int g = 0; g < 2; ++g) {
    Dict d;
    d.insert("lr", 1e-3);
    d.insert("betas", Value::tuple({0.9, 0.999}));
    d.insert("eps", 1e-8);
    d.insert("weight_decay", g == 0 ? 0.01 : 0.0);
    d.insert("amsgrad", false);
    d.insert("maximize", false);
    d.insert("foreach", Value());
    d.insert("capturable", false);
    d.insert("params", Value::list(std::move(ids[g])));
    groups.emplace_back(std::move(d));
  }
  Dict optim;
  optim.insert("state", std::move(state));
  optim.insert("param_groups", Value::list(std::move(groups)));
  Dict root;
  root.insert("model", std::move(model));
  root.insert("optim", std::move(optim));
  t.tree = Value(std::move(root));
  return t;
}

const Tree& tree() {
  static const Tree t = make_tree();
  return t;
}

// Results are destroyed with the timer paused: these measure the operations themselves. The
// *Destroy variant adds freeing both results.

void BM_Flatten(benchmark::State& st) {
  const Value& v = tree().tree;
  for (auto _ : st) {
    auto f = std::make_unique<FlatStateDict>(flatten(v));
    benchmark::DoNotOptimize(f.get());
    st.PauseTiming();
    f.reset();
    st.ResumeTiming();
  }
}

void BM_Unflatten(benchmark::State& st) {
  const FlatStateDict f = flatten(tree().tree);
  for (auto _ : st) {
    auto v = std::make_unique<Value>(unflatten(f));
    benchmark::DoNotOptimize(v.get());
    st.PauseTiming();
    v.reset();
    st.ResumeTiming();
  }
}

// The headline figure (target: under 50 ms).
void BM_FlattenUnflatten(benchmark::State& st) {
  const Value& v = tree().tree;
  for (auto _ : st) {
    auto f = std::make_unique<FlatStateDict>(flatten(v));
    auto back = std::make_unique<Value>(unflatten(*f));
    benchmark::DoNotOptimize(back.get());
    st.PauseTiming();
    back.reset();
    f.reset();
    st.ResumeTiming();
  }
  st.counters["tensors"] = 100000;
}

void BM_FlattenUnflattenDestroy(benchmark::State& st) {
  const Value& v = tree().tree;
  for (auto _ : st) {
    FlatStateDict f = flatten(v);
    Value back = unflatten(f);
    benchmark::DoNotOptimize(back);
  }
}

// Reference: a deep copy and destruction of the skeleton's JSON document, i.e. what allocating and
// freeing the nlohmann DOM the format prescribes costs by itself (flatten keeps the compact form
// and builds no DOM; unflatten reads the compact form).
void BM_SkeletonCopyDestroy(benchmark::State& st) {
  const FlatStateDict f = flatten(tree().tree);
  const nlohmann::json& doc = f.skeleton.json();
  for (auto _ : st) {
    nlohmann::json copy = doc;
    benchmark::DoNotOptimize(copy);
  }
}

// What a writer pays on top of flatten: the JSON document of a compact skeleton, built and freed.
void BM_SkeletonJson(benchmark::State& st) {
  const FlatStateDict f = flatten(tree().tree);
  for (auto _ : st) {
    nlohmann::json doc = Skeleton(f.skeleton).take_json();
    benchmark::DoNotOptimize(doc);
  }
}

// For reference: the skeleton as text (what a writer stores) and back.
void BM_SkeletonDumpParse(benchmark::State& st) {
  const FlatStateDict f = flatten(tree().tree);
  for (auto _ : st) {
    std::string s = f.skeleton.json().dump();
    nlohmann::json j = nlohmann::json::parse(s);
    benchmark::DoNotOptimize(j);
  }
}

}  // namespace

BENCHMARK(BM_Flatten)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Unflatten)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FlattenUnflatten)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FlattenUnflattenDestroy)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SkeletonCopyDestroy)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SkeletonJson)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SkeletonDumpParse)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
