// Layouts (shard/layout.hpp): each rule against an element-level oracle written from the original
// code's definition (torch.chunk, DTensor, FSDP's torch.chunk of the flat parameter, DeepSpeed's
// padded partitions), and numbers printed by PyTorch 1.13. interop-layout.cpp checks many more
// against PyTorch itself.
#include <doctest/doctest.h>

#include <statedict/shard/cover.hpp>
#include <statedict/shard/layout.hpp>

#include <map>
#include <random>
#include <vector>

using namespace statedict;
using namespace statedict::layout;

namespace {
// torch.chunk, by its definition: pieces of ceil(n / k) taken from the front until nothing is
// left; k empty pieces when n == 0.
std::vector<std::uint64_t> torch_chunk_sizes(std::uint64_t n, std::uint64_t k) {
  if (n == 0) return std::vector<std::uint64_t>(k, 0);
  const std::uint64_t s = (n + k - 1) / k;
  std::vector<std::uint64_t> out;
  for (std::uint64_t left = n; left > 0; left -= std::min(left, s)) out.push_back(std::min(left, s));
  return out;
}

// DTensor Shard.local_shard_size_and_offset, transcribed.
Span dtensor_local(std::uint64_t n, std::uint64_t k, std::uint64_t r) {
  if (n % k == 0) return Span{n / k * r, n / k};
  const std::uint64_t full = (n + k - 1) / k, start = full * r;
  if (n < start) return Span{n, 0};
  return Span{start, std::min(n, start + full) - start};
}
}  // namespace

TEST_CASE("torch.chunk sizes, counts and ChunkShardingSpec's helpers") {
  // Printed by PyTorch 1.13: [x.numel() for x in torch.empty(n).chunk(k)].
  CHECK(torch_chunk_sizes(13, 4) == std::vector<std::uint64_t>{4, 4, 4, 1});
  CHECK(torch_chunk_sizes(5, 4) == std::vector<std::uint64_t>{2, 2, 1});
  CHECK(torch_chunk_sizes(6, 4) == std::vector<std::uint64_t>{2, 2, 2});
  CHECK(torch_chunk_sizes(10, 8) == std::vector<std::uint64_t>{2, 2, 2, 2, 2});
  CHECK(torch_chunk_sizes(0, 3) == std::vector<std::uint64_t>{0, 0, 0});
  for (std::uint64_t n = 0; n <= 60; ++n)
    for (std::uint64_t k = 1; k <= 17; ++k) {
      const auto sizes = torch_chunk_sizes(n, k);
      CHECK(chunk_count(n, k) == sizes.size());
      CHECK(split_size(n, k) == (n + k - 1) / k);
      std::uint64_t off = 0;
      for (std::uint64_t r = 0; r < k; ++r) {
        const Span s = chunk(n, k, r);
        const std::uint64_t want = r < sizes.size() ? sizes[r] : 0;
        CHECK(s.size == want);
        CHECK(chunked_dim_size(n, split_size(n, k), r) == want);
        if (want > 0) CHECK(s.offset == off);
        CHECK(s == dtensor_local(n, k, r));  // DTensor agrees, empty parts included
        off += want;
      }
      CHECK(off == n);
    }
  // No overflow near the top of the range.
  const std::uint64_t big = std::uint64_t{1} << 62;
  CHECK(chunk(big + 3, 4, 3) == Span{3 * (big / 4 + 1), big / 4});  // split = 2^60 + 1
  CHECK(chunk(~std::uint64_t{0}, 3, 2).size == (~std::uint64_t{0}) / 3);
}

TEST_CASE("balanced and exact splits") {
  for (std::uint64_t n = 0; n <= 40; ++n)
    for (std::uint64_t k = 1; k <= 17; ++k) {
      std::uint64_t off = 0;
      for (std::uint64_t r = 0; r < k; ++r) {
        const Span s = balanced(n, k, r);
        CHECK(s.offset == off);
        CHECK(s.size == n / k + (r < n % k ? 1 : 0));
        off += s.size;
      }
      CHECK(off == n);
      if (n % k) {
        CHECK_THROWS_AS(split(n, k, 0, split_rule::exact), usage_error);
      } else {
        CHECK(split(n, k, k - 1, split_rule::exact) == Span{n - n / k, n / k});
      }
    }
  CHECK_THROWS_AS(split(5, 0, 0), usage_error);
  CHECK_THROWS_AS(split(5, 2, 2), usage_error);
  CHECK(split_box(shape_t{3, 10}, 1, 4, 3) == Box{{0, 9}, {3, 1}});
  CHECK_THROWS_AS(split_box(shape_t{3, 10}, 2, 4, 0), usage_error);
}

namespace {
// FSDP oracle: build the padded flat parameter element by element, torch.chunk it, and read off
// where each parameter's elements landed.
struct flat_oracle {
  std::vector<std::int64_t> owner;  // param index or -1 for padding
  std::vector<std::uint64_t> intra;
};
flat_oracle build_fsdp(const std::vector<std::uint64_t>& numels, std::uint64_t ws, std::uint64_t align) {
  flat_oracle o;
  for (std::size_t i = 0; i < numels.size(); ++i) {
    if (align > 0)
      while (o.owner.size() % align) {
        o.owner.push_back(-1);
        o.intra.push_back(0);
      }
    for (std::uint64_t k = 0; k < numels[i]; ++k) {
      o.owner.push_back(static_cast<std::int64_t>(i));
      o.intra.push_back(k);
    }
  }
  if (align > 0)
    while (o.owner.size() % ws) {
      o.owner.push_back(-1);
      o.intra.push_back(0);
    }
  return o;
}
}  // namespace

TEST_CASE("FSDP flat parameter: alignment padding, shards and _shard_param_infos") {
  // use_orig_params=True, f32: 4-element alignment before each parameter, then to a multiple of ws.
  const std::vector<std::uint64_t> numels{3, 5, 7, 0, 2};
  const auto f = fsdp_flat_param(numels, 4, 4);
  CHECK(f.offsets == std::vector<std::uint64_t>{0, 4, 12, 20, 20});
  CHECK(f.numels_with_padding == std::vector<std::uint64_t>{3, 1, 5, 3, 7, 1, 0, 2, 2});
  CHECK(f.numel == 24);
  CHECK(fsdp_aligned_numel(dtype::BF16) == 8);
  CHECK(fsdp_aligned_numel(dtype::F32) == 4);

  std::mt19937_64 rng(31);
  for (int iter = 0; iter < 400; ++iter) {
    std::vector<std::uint64_t> ns(1 + rng() % 6);
    for (auto& n : ns) n = rng() % 12;
    const std::uint64_t ws = 1 + rng() % 17;
    const std::uint64_t align = rng() % 2 ? 0 : std::uint64_t{1} << (rng() % 4);
    const auto fp = fsdp_flat_param(ns, ws, align);
    const auto oracle = build_fsdp(ns, ws, align);
    REQUIRE(fp.numel == oracle.owner.size());
    const auto sizes = torch_chunk_sizes(fp.numel, ws);
    const std::uint64_t S = sizes.empty() ? 0 : sizes[0];
    for (std::uint64_t r = 0; r < ws; ++r) {
      const FsdpShard sh = fsdp_shard(fp.numel, r, ws);
      CHECK(sh.numel == S);
      CHECK(sh.numel_padded == S - (r < sizes.size() ? sizes[r] : 0));
      CHECK(sh.start == S * r);
      const auto infos = fsdp_shard_param_infos(fp, r, ws);
      REQUIRE(infos.size() == ns.size());
      for (std::size_t i = 0; i < ns.size(); ++i) {
        // Oracle: positions of param i inside [S r, S (r + 1)).
        std::int64_t lo = -1, hi = -1, first_pos = -1;
        for (std::uint64_t p = S * r; p < std::min<std::uint64_t>(S * (r + 1), fp.numel); ++p)
          if (oracle.owner[p] == static_cast<std::int64_t>(i)) {
            if (lo < 0) {
              lo = static_cast<std::int64_t>(oracle.intra[p]);
              first_pos = static_cast<std::int64_t>(p - S * r);
            }
            hi = static_cast<std::int64_t>(oracle.intra[p]);
          }
        if (lo >= 0) {
          CHECK(infos[i].in_shard);
          CHECK(infos[i].intra_param_start_idx == lo);
          CHECK(infos[i].intra_param_end_idx == hi);
          CHECK(infos[i].offset_in_shard == first_pos);
          CHECK(infos[i].numel_in_shard == hi - lo + 1);
        } else if (infos[i].in_shard) {
          CHECK(ns[i] == 0);  // an empty parameter strictly inside the shard, as the original says
          CHECK(infos[i].numel_in_shard == 0);
        }
      }
    }
    // The pieces rebuild every element exactly once.
    const auto pieces = fsdp_pieces(fp, ws);
    for (std::size_t i = 0; i < ns.size(); ++i) {
      std::vector<int> seen(ns[i], 0);
      for (const FlatPiece& p : pieces[i]) {
        for (std::uint64_t k = p.range.begin; k < p.range.end; ++k) {
          ++seen[k];
          const std::uint64_t pos = S * p.rank + p.offset + (k - p.range.begin);
          CHECK(oracle.owner[pos] == static_cast<std::int64_t>(i));
          CHECK(oracle.intra[pos] == k);
        }
      }
      for (int v : seen) CHECK(v == 1);
    }
  }
}

TEST_CASE("FSDP 1.13 shard metadata matches PyTorch 1.13") {
  // FlatParamHandle over Linear(3,5), Linear(5,2) (numels 15, 5, 10, 2), world size 4, printed by
  // torch 1.13's _get_unpadded_shard / _get_shard_metadata.
  const std::vector<std::uint64_t> numels{15, 5, 10, 2};
  using P = std::pair<std::int64_t, std::int64_t>;
  CHECK(fsdp_legacy_shard_metadata(numels, 0, 4) == LegacyShardMetadata{{P{0, 7}}, P{0, 0}});
  CHECK(fsdp_legacy_shard_metadata(numels, 1, 4) == LegacyShardMetadata{{P{8, 14}, P{0, 0}}, P{0, 1}});
  CHECK(fsdp_legacy_shard_metadata(numels, 2, 4) == LegacyShardMetadata{{P{1, 4}, P{0, 3}}, P{1, 2}});
  CHECK(fsdp_legacy_shard_metadata(numels, 3, 4) == LegacyShardMetadata{{P{4, 9}, P{0, 1}}, P{2, 3}});
  CHECK(fsdp_shard(32, 3, 4).numel_padded == 0);
  // 7 elements on 4 ranks: chunks 2,2,2,1 -> rank 3 padded by 1; 3 elements on 4 ranks: rank 3 has
  // no chunk at all and is all padding.
  CHECK(fsdp_shard(7, 3, 4).numel_padded == 1);
  CHECK(fsdp_shard(3, 3, 4).numel_padded == 1);
  CHECK(fsdp_shard(3, 3, 4).numel == 1);
  CHECK(fsdp_legacy_shard_metadata(std::vector<std::uint64_t>{3}, 3, 4) == LegacyShardMetadata{});
}

TEST_CASE("ZeRO stage 1/2: padding to 2 x dp, equal partitions, per-rank padding") {
  for (std::uint64_t n = 0; n <= 70; ++n)
    for (std::uint64_t dp = 1; dp <= 17; ++dp) {
      const auto z = zero12_partitions(n, dp);
      CHECK(z.padded_numel % (2 * dp) == 0);
      CHECK(z.padded_numel >= n);
      CHECK(z.padded_numel - n < 2 * dp);
      std::uint64_t real = 0;
      for (std::uint64_t r = 0; r < dp; ++r) {
        CHECK(z.parts[r].size == z.padded_numel / dp);  // the padding makes the division exact
        CHECK(z.parts[r].offset == r * (z.padded_numel / dp));
        real += z.parts[r].size - zero12_group_padding(z, r);
      }
      CHECK(real == n);
    }
  // get_data_parallel_partitions without the padding: first numel % dp one larger.
  const auto odd = zero12_partitions(10, 4, 1);
  CHECK(odd.padded_numel == 12);
  const auto raw = balanced(10, 4, 1);
  CHECK(raw == Span{3, 3});

  std::mt19937_64 rng(37);
  for (int iter = 0; iter < 300; ++iter) {
    std::vector<std::uint64_t> ns(1 + rng() % 6);
    for (auto& n : ns) n = rng() % 20;
    const std::uint64_t dp = 1 + rng() % 17;
    std::uint64_t total = 0;
    for (auto n : ns) total += n;
    const auto z = zero12_partitions(total, dp);
    const auto pieces = zero12_pieces(ns, dp);
    std::uint64_t base = 0;
    for (std::size_t i = 0; i < ns.size(); ++i) {
      std::vector<int> seen(ns[i], 0);
      for (const FlatPiece& p : pieces[i]) {
        CHECK(p.offset + p.range.size() <= z.parts[p.rank].size);
        for (std::uint64_t k = p.range.begin; k < p.range.end; ++k) {
          ++seen[k];
          CHECK(z.parts[p.rank].offset + p.offset + (k - p.range.begin) == base + k);  // flat position
        }
      }
      for (int v : seen) CHECK(v == 1);
      base += ns[i];
    }
  }
}

TEST_CASE("ZeRO stage 3: per-parameter partitions") {
  CHECK(zero3_partitioned_param_info(10, 4) == Zero3ParamInfo{3, 2});
  CHECK(zero3_partitioned_param_info(12, 4) == Zero3ParamInfo{3, 0});
  CHECK(zero3_partitioned_param_info(0, 4) == Zero3ParamInfo{0, 0});
  CHECK(zero3_partitioned_param_info(3, 8) == Zero3ParamInfo{1, 5});
  const std::vector<std::uint64_t> ns{10, 3, 0, 8};
  const auto pieces = zero3_pieces(ns, 4);
  // Rank buffers: param 0 at 0 (3 each), param 1 at 3 (1 each), param 3 at 4 (2 each).
  CHECK(pieces[0] == std::vector<FlatPiece>{{0, {0, 3}, 0}, {1, {3, 6}, 0}, {2, {6, 9}, 0}, {3, {9, 10}, 0}});
  CHECK(pieces[1] == std::vector<FlatPiece>{{0, {0, 1}, 3}, {1, {1, 2}, 3}, {2, {2, 3}, 3}});
  CHECK(pieces[2].empty());
  CHECK(pieces[3] == std::vector<FlatPiece>{{0, {0, 2}, 4}, {1, {2, 4}, 4}, {2, {4, 6}, 4}, {3, {6, 8}, 4}});
}

TEST_CASE("chunks_from turns pieces into chunks of the reader's files") {
  const std::vector<FlatPiece> pieces{{0, {0, 3}, 0}, {1, {3, 5}, 2}, {2, {5, 5}, 0}};
  const auto chunks = chunks_from(std::span<const FlatPiece>(pieces), [](std::uint32_t r) {
    return Placement{r + 10, 1000 * r + 64, {}, dtype::BF16};
  });
  REQUIRE(chunks.size() == 2);
  CHECK(chunks[1].region == ChunkRegion{FlatRange{3, 5}});
  CHECK(chunks[1].at == Placement{11, 1068, {}, dtype::BF16});
}

namespace {
// Each tensor covered exactly once (or, when replicated, once per rank) and no two chunks of one
// destination share a byte.
void check_destination(const Destination& d, bool replicated_ok = false) {
  for (const auto& t : d.tensors) {
    std::vector<Box> boxes;
    std::vector<std::uint32_t> dest;
    for (const auto& c : t.chunks) {
      for (const auto& m : mapped_boxes(c, t.shape, t.name)) {
        boxes.push_back(m.box);
        dest.push_back(c.at.source);
      }
      CHECK(c.at.source < d.names.size());
    }
    CHECK_FALSE(cover(full_box(t.shape), boxes, replicated_ok));
  }
  std::map<std::uint32_t, std::vector<std::pair<std::uint64_t, std::uint64_t>>> ranges;
  for (const auto& t : d.tensors)
    for (const auto& c : t.chunks) {
      const std::uint64_t bytes = storage_extent(c, t.name) * itemsize(c.at.stored);
      ranges[c.at.source].emplace_back(c.at.byte_offset, c.at.byte_offset + bytes);
      CHECK(c.at.byte_offset + bytes <= d.sizes[c.at.source]);
    }
  for (auto& [k, v] : ranges) {
    std::sort(v.begin(), v.end());
    for (std::size_t i = 1; i < v.size(); ++i) CHECK(v[i].first >= v[i - 1].second);
  }
}
}  // namespace

TEST_CASE("destination builders") {
  const std::vector<TensorInfo> ts{{"emb", dtype::F32, {13, 6}, {}},
                                   {"w", dtype::F32, {7, 10}, {}},
                                   {"b", dtype::F32, {7}, {}},
                                   {"scale", dtype::F32, {}, {}},
                                   {"empty", dtype::F32, {0, 4}, {}}};
  const auto one = single(ts, "all", 64);
  CHECK(one.names.size() == 1);
  CHECK(one.tensors[1].chunks[0].at.byte_offset == 320);  // 13 * 6 * 4 = 312, aligned to 64
  check_destination(one);
  for (std::uint32_t w = 1; w <= 9; ++w) {
    const std::vector<int> dims{0, 1, -1, -1, 1};
    for (auto rule : {split_rule::chunk, split_rule::balanced}) {
      const auto c = chunked(ts, dims, w, rule, 8);
      CHECK(c.names.size() == w);
      check_destination(c, true);
      CHECK(c.tensors[2].chunks.size() == w);  // replicated on every rank
    }
    const std::vector<std::vector<std::size_t>> groups{{0, 1}, {2, 3}};
    const std::vector<TensorInfo> params(ts.begin(), ts.begin() + 4);
    check_destination(layout::fsdp(params, groups, w, false));
    check_destination(layout::fsdp(params, groups, w, true));
    check_destination(zero12(params, groups, w, 2, dtype::F32));
    check_destination(zero3(params, groups, w));
  }
  const auto z3 = zero3(std::vector<TensorInfo>(ts.begin(), ts.begin() + 3), std::vector<std::vector<std::size_t>>{{0, 1, 2}}, 4);
  CHECK(z3.sizes == std::vector<std::uint64_t>(4, (20 + 18 + 2) * 4));  // ceil(78/4) + ceil(70/4) + ceil(7/4)
  const std::vector<std::vector<std::size_t>> files{{1, 0}, {2, 3, 4}};
  const auto p = packed(ts, files, {"a.safetensors", "b.safetensors"});
  check_destination(p);
  CHECK(p.tensors[0].chunks[0].at == Placement{0, 280, {}, dtype::F32});
  CHECK_THROWS_AS(packed(ts, std::vector<std::vector<std::size_t>>{{0, 1}, {2, 3}}, {"a", "b"}), usage_error);
  CHECK_THROWS_AS(packed(ts, files, {"a"}), usage_error);
  CHECK_THROWS_AS(layout::fsdp(std::vector<TensorInfo>{{"x", dtype::F32, {2}, {}}, {"y", dtype::BF16, {2}, {}}},
                       std::vector<std::vector<std::size_t>>{{0, 1}}, 2),
                  usage_error);
}
