// The planner (shard/plan.hpp) with the executor on in-memory sources and sinks: every pair of
// layouts round-trips bytes exactly, holes and overlaps injected into descriptions and plans are
// all reported (error id, tensor name, element index), casts follow the value, parts are disjoint.
#include <doctest/doctest.h>

#include <statedict/exec/executor.hpp>
#include <statedict/shard/layout.hpp>
#include <statedict/shard/plan.hpp>

#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace statedict;

namespace {

using bytes = std::vector<std::byte>;

struct Written {
  Destination dest;
  std::vector<bytes> buffers;
  [[nodiscard]] ShardedCheckpoint checkpoint() const {
    std::vector<std::shared_ptr<const ByteSource>> srcs;
    for (std::size_t i = 0; i < buffers.size(); ++i)
      srcs.push_back(MemorySource::copy_of(dest.names[i], buffers[i]));
    return layout::as_checkpoint(dest, std::move(srcs));
  }
};

Written write(const ShardedCheckpoint& src, const Destination& dst, unsigned threads = 1,
              std::uint64_t budget = default_memory_budget, const plan_options& popt = {}) {
  const Plan plan = make_plan(src, dst, popt);
  std::vector<std::unique_ptr<MemorySink>> sinks;
  std::vector<Sink*> ptrs;
  for (const auto& n : dst.names) {
    sinks.push_back(std::make_unique<MemorySink>(n));
    ptrs.push_back(sinks.back().get());
  }
  exec_options opt;
  opt.threads = threads;
  opt.memory_budget = budget;
  const exec_stats st = execute(plan, src, ptrs, opt);
  CHECK(st.buffer_bytes <= budget);
  Written w{dst, {}};
  for (std::size_t i = 0; i < sinks.size(); ++i) {
    bytes b(sinks[i]->bytes().begin(), sinks[i]->bytes().end());
    b.resize(std::max<std::size_t>(b.size(), static_cast<std::size_t>(plan.destination_sizes[i])));
    w.buffers.push_back(std::move(b));
  }
  return w;
}

using statedict_test::error_of;

std::vector<TensorInfo> random_tensors(std::mt19937_64& rng) {
  static const dtype kinds[] = {dtype::F32, dtype::BF16, dtype::F16, dtype::I32, dtype::F64, dtype::U8, dtype::I64};
  const dtype common = kinds[rng() % 7];
  std::vector<TensorInfo> ts(1 + rng() % 6);
  for (std::size_t i = 0; i < ts.size(); ++i) {
    ts[i].name = "t" + std::to_string(i) + (rng() % 2 ? ".weight" : ".bias");
    ts[i].dtype = rng() % 3 ? common : kinds[rng() % 7];
    ts[i].shape.resize(rng() % 4);
    for (auto& d : ts[i].shape) d = static_cast<dim_t>(rng() % 8);
    if (rng() % 8 == 0 && !ts[i].shape.empty()) ts[i].shape[0] = 0;
  }
  return ts;
}

/// Flat layouts need one dtype per group: tensors grouped by dtype, in order, cut at random.
std::vector<std::vector<std::size_t>> random_groups(std::mt19937_64& rng, const std::vector<TensorInfo>& ts) {
  std::vector<std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < ts.size(); ++i) {
    bool joined = false;
    if (rng() % 3)
      for (auto& g : groups)
        if (ts[g.back()].dtype == ts[i].dtype) {
          g.push_back(i);
          joined = true;
          break;
        }
    if (!joined) groups.push_back({i});
  }
  return groups;
}

/// Each tensor stored with reversed (column-major) strides in one buffer.
Destination transposed(const std::vector<TensorInfo>& ts) {
  Destination d = layout::single(ts, "transposed");
  for (auto& t : d.tensors)
    for (auto& c : t.chunks) {
      shape_t st(t.shape.size());
      std::int64_t acc = 1;
      for (std::size_t k = 0; k < st.size(); ++k) {
        st[k] = acc;
        acc *= std::max<std::int64_t>(t.shape[k], 1);
      }
      c.at.strides = st;
    }
  return d;
}

using layout_fn = std::function<Destination(std::mt19937_64&, const std::vector<TensorInfo>&)>;

std::vector<std::pair<std::string, layout_fn>> all_layouts() {
  auto world = [](std::mt19937_64& rng) { return static_cast<std::uint32_t>(1 + rng() % 17); };
  return {
      {"single", [](std::mt19937_64& rng, const std::vector<TensorInfo>& ts) {
         return layout::single(ts, "one", std::uint64_t{1} << (rng() % 7));
       }},
      {"chunk dim 0", [world](std::mt19937_64& rng, const std::vector<TensorInfo>& ts) {
         std::vector<int> dims;
         for (const auto& t : ts) dims.push_back(t.shape.empty() ? -1 : 0);
         return layout::chunked(ts, dims, world(rng));
       }},
      {"tensor parallel", [world](std::mt19937_64& rng, const std::vector<TensorInfo>& ts) {
         std::vector<int> dims;
         for (const auto& t : ts) dims.push_back(t.shape.empty() || rng() % 4 == 0 ? -1 : static_cast<int>(rng() % t.shape.size()));
         return layout::chunked(ts, dims, world(rng), rng() % 2 ? layout::split_rule::balanced : layout::split_rule::chunk, 4);
       }},
      {"fsdp", [world](std::mt19937_64& rng, const std::vector<TensorInfo>& ts) {
         return layout::fsdp(ts, random_groups(rng, ts), world(rng), rng() % 2 == 0);
       }},
      {"zero12", [world](std::mt19937_64& rng, const std::vector<TensorInfo>& ts) {
         return layout::zero12(ts, random_groups(rng, ts), world(rng));
       }},
      {"zero3", [world](std::mt19937_64& rng, const std::vector<TensorInfo>& ts) {
         return layout::zero3(ts, random_groups(rng, ts), world(rng));
       }},
      {"files", [](std::mt19937_64& rng, const std::vector<TensorInfo>& ts) {
         const std::size_t nf = 1 + rng() % 3;
         std::vector<std::vector<std::size_t>> files(nf);
         std::vector<std::string> names;
         for (std::size_t i = 0; i < ts.size(); ++i) files[rng() % nf].push_back(i);
         for (std::size_t f = 0; f < nf; ++f) names.push_back("file" + std::to_string(f));
         return layout::packed(ts, files, names, 8);
       }},
      {"transposed", [](std::mt19937_64&, const std::vector<TensorInfo>& ts) { return transposed(ts); }},
  };
}

Written original(std::mt19937_64& rng, const std::vector<TensorInfo>& ts) {
  Written w{layout::single(ts, "original"), {}};
  bytes b(static_cast<std::size_t>(w.dest.sizes[0]));
  for (auto& x : b) x = static_cast<std::byte>(rng());
  w.buffers.push_back(std::move(b));
  return w;
}

}  // namespace

TEST_CASE("every pair of layouts round-trips the bytes exactly") {
  std::mt19937_64 rng(2024);
  const auto layouts = all_layouts();
  int pairs = 0;
  for (const auto& la : layouts)
    for (const auto& lb : layouts)
      for (int rep = 0; rep < 6; ++rep) {
        const std::string& na = la.first;
        const std::string& nb = lb.first;
        const layout_fn& fa = la.second;
        const layout_fn& fb = lb.second;
        CAPTURE(na);
        CAPTURE(nb);
        CAPTURE(rep);
        const auto ts = random_tensors(rng);
        const Written orig = original(rng, ts);
        const unsigned threads = 1 + static_cast<unsigned>(rng() % 3);
        const std::uint64_t budget = rng() % 2 ? default_memory_budget : std::uint64_t{1} << 20;  // small: many items
        const Written a = write(orig.checkpoint(), fa(rng, ts), threads, budget);
        const Written b = write(a.checkpoint(), fb(rng, ts), threads, budget);
        const Written back = write(b.checkpoint(), layout::single(ts, "back"), threads, budget);
        REQUIRE(back.buffers[0] == orig.buffers[0]);
        ++pairs;
      }
  CHECK(pairs == 64 * 6);
}

TEST_CASE("only the requested tensors are read; unread bytes may be anything") {
  std::mt19937_64 rng(5);
  std::vector<TensorInfo> ts{{"w", dtype::F32, {6, 4}, {}}, {"exp_avg", dtype::F32, {6, 4}, {}}};
  Written orig = original(rng, ts);
  const Written z = write(orig.checkpoint(), layout::zero3(ts, std::vector<std::vector<std::size_t>>{{0, 1}}, 3));
  ShardedCheckpoint src = z.checkpoint();
  // The moments' chunks point far outside their sources: harmless while nobody asks for them.
  for (auto& c : src.tensors[1].chunks) c.at.byte_offset += 1 << 30;
  src.reindex();
  const std::vector<TensorInfo> only{ts[0]};
  const Written back = write(src, layout::single(only, "params"));
  CHECK(std::memcmp(back.buffers[0].data(), orig.buffers[0].data(), 96) == 0);
  CHECK(error_of([&] { write(src, layout::single(ts, "all")); }) == errors::chunk_outside_source.id);
}

TEST_CASE("holes and overlaps in descriptions are reported with tensor and element") {
  std::mt19937_64 rng(99);
  std::vector<TensorInfo> ts{{"layer.w", dtype::F32, {8, 6}, {}}, {"layer.b", dtype::F32, {8}, {}}};
  const Written orig = original(rng, ts);
  const std::vector<int> cols{1, -1};
  const Written tp = write(orig.checkpoint(), layout::chunked(ts, cols, 3));  // w: 8 x [2,2,2]; b replicated
  const Destination one = layout::single(ts, "one");
  std::string what;

  SUBCASE("a missing source chunk is a hole") {
    ShardedCheckpoint s = tp.checkpoint();
    s.tensors[0].chunks.erase(s.tensors[0].chunks.begin() + 1);  // columns 2..3
    CHECK(error_of([&] { make_plan(s, one); }, &what) == errors::uncovered.id);
    CHECK(what.find("'layer.w'") != std::string::npos);
    CHECK(what.find("[0, 2]") != std::string::npos);
  }
  SUBCASE("a shrunken chunk leaves a hole at its end") {
    ShardedCheckpoint s = tp.checkpoint();
    std::get<Box>(s.tensors[0].chunks[2].region).sizes[0] = 5;  // rows 5..7 of columns 4..5 missing
    CHECK(error_of([&] { make_plan(s, one); }, &what) == errors::uncovered.id);
    CHECK(what.find("[5, 4]") != std::string::npos);
  }
  SUBCASE("partially overlapping chunks are doubly covered") {
    ShardedCheckpoint s = tp.checkpoint();
    auto& b = std::get<Box>(s.tensors[0].chunks[1].region);
    b.offsets[1] = 1;  // columns 1..2 instead of 2..3: column 1 twice, column 3 never
    CHECK(error_of([&] { make_plan(s, one); }, &what) == errors::source_overlap.id);
    CHECK(what.find("[0, 1]") != std::string::npos);
    CHECK(what.find("'rank0'") != std::string::npos);
    CHECK(what.find("'rank1'") != std::string::npos);
    plan_options o;
    o.allow_overlapping_sources = true;  // then the hole is what is left
    CHECK(error_of([&] { make_plan(s, one, o); }, &what) == errors::uncovered.id);
    CHECK(what.find("[0, 3]") != std::string::npos);
  }
  SUBCASE("replicas are read once, from the lowest source") {
    const Plan p = make_plan(tp.checkpoint(), one);
    std::uint64_t bias_bytes = 0;
    for (const auto& o : p.ops)
      if (o.tensor == 1) {
        bias_bytes += o.dst_bytes();
        CHECK(o.src == 0);
      }
    CHECK(bias_bytes == 32);
  }
  SUBCASE("replica checks find differing copies") {
    Written bad = tp;
    // rank2's copy of the bias follows its two columns of w: 8 x 2 floats.
    bad.buffers[2][64 + 12] ^= std::byte{1};  // byte 12 of the bias: element 3
    plan_options o;
    o.check_replicas = true;
    CHECK(error_of([&] { write(tp.checkpoint(), one, 2, default_memory_budget, o); }) == 0);
    CHECK(error_of([&] { write(bad.checkpoint(), one, 2, default_memory_budget, o); }, &what) == errors::replica_mismatch.id);
    CHECK(what.find("'layer.b'") != std::string::npos);
    CHECK(what.find("'rank2' at byte 76") != std::string::npos);
    CHECK(error_of([&] { write(bad.checkpoint(), one); }) == 0);  // unchecked: rank0's copy is used
  }
  SUBCASE("destination holes and overlaps") {
    Destination d = layout::chunked(ts, cols, 3);
    d.tensors[0].chunks.pop_back();
    CHECK(error_of([&] { make_plan(tp.checkpoint(), d); }, &what) == errors::destination_uncovered.id);
    CHECK(what.find("[0, 4]") != std::string::npos);
    plan_options o;
    o.require_full_destination = false;
    CHECK(error_of([&] { make_plan(tp.checkpoint(), d, o); }) == 0);
    Destination e = layout::single(ts, "one");
    e.tensors[1].chunks[0].at.byte_offset = 4 * 40;  // bias bytes over w's last row
    e.sizes[0] = 0;
    CHECK(error_of([&] { make_plan(tp.checkpoint(), e); }, &what) == errors::destination_overlap.id);
    CHECK(what.find("'layer.w'") != std::string::npos);
    CHECK(what.find("'layer.b'") != std::string::npos);
    Destination f = layout::single(ts, "one");
    f.sizes[0] = 100;
    CHECK(error_of([&] { make_plan(tp.checkpoint(), f); }) == errors::destination_too_small.id);
  }
  SUBCASE("chunks that do not fit their tensor or source") {
    ShardedCheckpoint s = tp.checkpoint();
    std::get<Box>(s.tensors[0].chunks[0].region).sizes[0] = 9;
    CHECK(error_of([&] { make_plan(s, one); }) == errors::bad_region.id);
    s = tp.checkpoint();
    s.tensors[0].chunks[0].at.source = 7;
    CHECK(error_of([&] { make_plan(s, one); }) == errors::bad_source_id.id);
    s = tp.checkpoint();
    s.tensors[0].chunks[2].at.byte_offset = 100;
    CHECK(error_of([&] { make_plan(s, one); }, &what) == errors::chunk_outside_source.id);
    CHECK(what.find("'rank2'") != std::string::npos);
    s = tp.checkpoint();
    s.tensors[0].chunks[0].at.strides = {1};
    CHECK(error_of([&] { make_plan(s, one); }) == errors::bad_strides.id);
  }
  SUBCASE("tensors that do not match") {
    Destination d = one;
    d.tensors[0].name = "other";
    CHECK(error_of([&] { make_plan(tp.checkpoint(), d); }, &what) == errors::missing_tensor.id);
    CHECK(what.find("'other'") != std::string::npos);
    d = one;
    d.tensors[1].shape = {9};
    CHECK(error_of([&] { make_plan(tp.checkpoint(), d); }) == errors::tensor_shape_mismatch.id);
    d = one;
    d.tensors[1].name = "layer.w";
    CHECK(error_of([&] { make_plan(tp.checkpoint(), d); }) == errors::duplicate_tensor.id);
    d = one;
    d.tensors[0].chunks[0].at.stored = dtype::I32;
    CHECK(error_of([&] { make_plan(tp.checkpoint(), d); }) == errors::unsupported_cast.id);
    plan_options o;
    o.max_ops = 2;
    CHECK(error_of([&] { make_plan(tp.checkpoint(), one, o); }) == errors::too_many_ops.id);
  }
}

TEST_CASE("holes and overlaps injected into a plan are all reported by verify") {
  std::mt19937_64 rng(123);
  std::vector<TensorInfo> ts{{"a", dtype::F32, {10, 6}, {}}, {"b", dtype::BF16, {5}, {}}};
  const Written orig = original(rng, ts);
  const std::vector<int> cols{1, 0};
  const Written tp = write(orig.checkpoint(), layout::chunked(ts, cols, 4));
  const Plan good = make_plan(tp.checkpoint(), layout::single(ts, "out"));
  CHECK_NOTHROW(verify(good));
  std::string what;
  REQUIRE(good.ops.size() >= 2);
  for (std::size_t k = 0; k < good.ops.size(); ++k) {
    CAPTURE(k);
    Plan p = good;
    p.ops.erase(p.ops.begin() + static_cast<std::ptrdiff_t>(k));
    CHECK(error_of([&] { verify(p); }, &what) == errors::unwritten.id);
    CHECK(what.find("'out'") != std::string::npos);
    CHECK(what.find("element [") != std::string::npos);
    p = good;
    p.ops.push_back(good.ops[k]);
    CHECK(error_of([&] { verify(p); }, &what) == errors::written_twice.id);
    CHECK(what.find("is written twice") != std::string::npos);
    p = good;
    p.ops[k].src_offset = p.source_sizes[p.ops[k].src];
    CHECK(error_of([&] { verify(p); }) == errors::read_outside.id);
    p = good;
    p.ops.push_back(good.ops[k]);
    p.ops.back().dst_offset += 1 << 20;  // an extra write where no chunk is
    CHECK(error_of([&] { verify(p); }) == errors::write_outside.id);
    p = good;
    p.ops[k].dst_offset += 1 << 20;  // moved: its bytes are a hole first (in byte order)
    CHECK(error_of([&] { verify(p); }) == errors::unwritten.id);
  }
  // The unwritten element is named exactly: drop the op that writes a[3, 3] (rank 1's column 3 of row 3).
  Plan p = good;
  std::erase_if(p.ops, [](const CopyOp& o) { return o.tensor == 0 && o.src == 1; });
  CHECK(error_of([&] { verify(p); }, &what) == errors::unwritten.id);
  CHECK(what.find("tensor 'a' element [0, 2]") != std::string::npos);
}

TEST_CASE("casts follow the value through logical dtypes") {
  std::vector<float> v{1.0F, 1.00390625F, -3.14159F, 65504.0F, 1e-8F, 0.333333F};
  const bytes raw(reinterpret_cast<const std::byte*>(v.data()), reinterpret_cast<const std::byte*>(v.data() + v.size()));
  ShardedCheckpoint src;
  src.sources.push_back(MemorySource::copy_of("f32", raw));
  src.tensors.push_back(TensorInfo{"x", dtype::F32, {6}, {Chunk{FlatRange{0, 6}, Placement{0, 0, {}, dtype::F32}}}});
  // Destination logical BF16 stored as F32: values rounded to bf16 then widened.
  std::vector<TensorInfo> want{{"x", dtype::BF16, {6}, {}}};
  const Written w = write(src, layout::single(want, "o", 1, dtype::F32));
  REQUIRE(w.buffers[0].size() == 24);
  for (std::size_t i = 0; i < 6; ++i) {
    float got;
    std::memcpy(&got, w.buffers[0].data() + 4 * i, 4);
    CHECK(got == f32_from_bf16(bf16_from_f32(v[i])));
  }
  // Stored F32, logical BF16 (ZeRO master weights of a bf16 model), to F16: through bf16.
  ShardedCheckpoint s2 = src;
  s2.tensors[0].dtype = dtype::BF16;
  s2.reindex();
  std::vector<TensorInfo> h{{"x", dtype::F16, {6}, {}}};
  const Written w2 = write(s2, layout::single(h, "o"));
  for (std::size_t i = 0; i < 6; ++i) {
    std::uint16_t got;
    std::memcpy(&got, w2.buffers[0].data() + 2 * i, 2);
    CHECK(got == f16_from_f32(f32_from_bf16(bf16_from_f32(v[i]))));
  }
  const Plan p = make_plan(s2, layout::single(h, "o"));
  REQUIRE(p.ops.size() == 1);
  CHECK(p.ops[0].nvia == 1);
  CHECK(p.ops[0].via[0] == dtype::BF16);
  // Exact widenings fold away: stored BF16, logical F32, written F16 is one cast.
  CHECK(detail::cast_chain(dtype::BF16, dtype::F32, dtype::F32, dtype::F16) == std::vector<dtype>{dtype::BF16, dtype::F16});
  CHECK(detail::cast_chain(dtype::F32, dtype::F32, dtype::F32, dtype::F32) == std::vector<dtype>{dtype::F32});
}

TEST_CASE("operations are merged into large sequential copies, ordered by source") {
  std::mt19937_64 rng(8);
  std::vector<TensorInfo> ts;
  for (int i = 0; i < 50; ++i) ts.push_back(TensorInfo{"p" + std::to_string(i), dtype::F32, {7, 3}, {}});
  const Written orig = original(rng, ts);
  std::vector<std::vector<std::size_t>> groups(1);
  for (std::size_t i = 0; i < ts.size(); ++i) groups[0].push_back(i);
  const Written z = write(orig.checkpoint(), layout::zero12(ts, groups, 4));
  const Plan p = make_plan(z.checkpoint(), layout::single(ts, "one"));
  CHECK(p.ops.size() == 4);  // one copy per rank: consecutive parameters merge across tensors
  for (std::size_t i = 1; i < p.ops.size(); ++i) CHECK(p.ops[i - 1].src < p.ops[i].src);
  // Column shards into one matrix: one strided pattern per shard.
  std::vector<TensorInfo> m{{"m", dtype::F32, {1000, 64}, {}}};
  const Written mo = original(rng, m);
  const std::vector<int> cols{1};
  const Written tp = write(mo.checkpoint(), layout::chunked(m, cols, 8));
  const Plan q = make_plan(tp.checkpoint(), layout::single(m, "one"));
  CHECK(q.ops.size() == 8);
  CHECK(q.ops[0].reps == 1000);
  CHECK(q.ops[0].count == 8);
}

TEST_CASE("parts split the destinations deterministically and disjointly") {
  std::mt19937_64 rng(77);
  const auto ts = random_tensors(rng);
  std::vector<TensorInfo> big = ts;
  big.push_back(TensorInfo{"big", dtype::F32, {300, 7}, {}});
  const Written orig = original(rng, big);
  std::vector<int> dims(big.size(), -1);
  dims.back() = 0;
  const Destination d = layout::chunked(big, dims, 7);
  const Plan whole = make_plan(orig.checkpoint(), d);
  const Written all = write(orig.checkpoint(), d);
  for (std::uint32_t k = 1; k <= 5; ++k) {
    const auto parts = assign_parts(whole, k);
    CHECK(parts == assign_parts(whole, k));
    std::vector<std::unique_ptr<MemorySink>> sinks;
    for (const auto& n : d.names) sinks.push_back(std::make_unique<MemorySink>(n));
    std::uint64_t total = 0;
    for (std::uint32_t i = 0; i < k; ++i) {
      const Plan part = select_part(whole, PartSpec{i, k});
      std::vector<bool> mine(d.names.size());
      std::vector<Sink*> ptrs(d.names.size(), nullptr);
      for (std::size_t j = 0; j < d.names.size(); ++j)
        if (parts[j] == i) {
          mine[j] = true;
          ptrs[j] = sinks[j].get();
        }
      CHECK_NOTHROW(verify(part, mine));
      for (const auto& o : part.ops) CHECK(parts[o.dst] == i);
      total += part.bytes();
      execute(part, orig.checkpoint(), ptrs);
    }
    CHECK(total == whole.bytes());
    for (std::size_t j = 0; j < d.names.size(); ++j) {
      bytes b(sinks[j]->bytes().begin(), sinks[j]->bytes().end());
      CHECK(b == all.buffers[j]);
    }
  }
  CHECK(parse_part("2/4").index == 2);
  CHECK(parse_part("2/4").count == 4);
  for (const char* bad : {"4/4", "1", "/2", "a/b", "-1/3", "1/0", ""})
    CHECK(error_of([&] { parse_part(bad); }) == errors::bad_part.id);
}
