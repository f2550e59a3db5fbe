// shard/layout.hpp against numbers computed by PyTorch 1.13 itself (tests/python/gen_layout_refs.py):
// torch.chunk, ChunkShardingSpec.build_metadata / get_chunk_sharding_params, and FSDP 1.13's
// FlatParamHandle shard metadata. For torch >= 2.1 FSDP and DeepSpeed, which cannot run here, the
// fixture generator's independent re-derivations are a second witness.
#include <doctest/doctest.h>

#include <statedict/shard/layout.hpp>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

using namespace statedict;
using namespace statedict::layout;
using json = nlohmann::json;

namespace {
const json& refs() {
  static const json j = [] {
    const auto p = std::filesystem::path(STATEDICT_FIXTURE_DIR) / "gen_layout_refs" / "layout_refs.json";
    std::ifstream f(p);
    REQUIRE_MESSAGE(f.good(), "missing fixture " << p.string() << " (run tests/python/generate_all.sh)");
    return json::parse(f);
  }();
  return j;
}
}  // namespace

TEST_CASE("torch.chunk sizes from PyTorch") {
  std::size_t n_cases = 0;
  for (const auto& c : refs()["torch_chunk"]) {
    const auto n = c["n"].get<std::uint64_t>(), k = c["k"].get<std::uint64_t>();
    const auto sizes = c["sizes"].get<std::vector<std::uint64_t>>();
    CAPTURE(n);
    CAPTURE(k);
    CHECK(chunk_count(n, k) == sizes.size());
    std::uint64_t off = 0;
    for (std::uint64_t r = 0; r < k; ++r) {
      const Span s = chunk(n, k, r);
      CHECK(s.size == (r < sizes.size() ? sizes[r] : 0));
      if (s.size) CHECK(s.offset == off);
      off += s.size;
    }
    ++n_cases;
  }
  CHECK(n_cases == 65 * 17);
}

TEST_CASE("ChunkShardingSpec shard metadata from PyTorch") {
  for (const auto& c : refs()["chunk_sharding_spec"]) {
    const auto shape = c["shape"].get<shape_t>();
    const auto dim = c["dim"].get<std::size_t>();
    const auto k = c["k"].get<std::uint64_t>();
    CAPTURE(c.dump());
    // build_metadata lists the non-empty shards, in placement order.
    std::vector<Box> want;
    for (const auto& s : c["shards"]) want.push_back(Box{s["offsets"].get<shape_t>(), s["sizes"].get<shape_t>()});
    std::vector<Box> got;
    for (std::uint64_t r = 0; r < k; ++r) {
      Box b = split_box(shape, dim, k, r);
      if (b.sizes[dim] > 0) got.push_back(b);
    }
    CHECK(got == want);
    // get_chunk_sharding_params: (start_pos, chunk_size); empty ranks start at the dim size.
    for (std::uint64_t r = 0; r < k; ++r) {
      const auto p = c["params"][r];
      const Span s = chunk(static_cast<std::uint64_t>(shape[dim]), k, r);
      CHECK(s.offset == p[0].get<std::uint64_t>());
      CHECK(s.size == p[1].get<std::uint64_t>());
    }
  }
}

TEST_CASE("FSDP 1.13 FlatParamHandle shard metadata from PyTorch") {
  std::size_t n_cases = 0;
  for (const auto& c : refs()["fsdp_113"]) {
    const auto numels = c["numels"].get<std::vector<std::uint64_t>>();
    const auto ws = c["ws"].get<std::uint64_t>();
    CAPTURE(c["numels"].dump());
    CAPTURE(ws);
    std::uint64_t total = 0;
    for (auto n : numels) total += n;
    for (std::uint64_t r = 0; r < ws; ++r) {
      const auto& want = c["ranks"][r];
      const FsdpShard sh = fsdp_shard(total, r, ws);
      CHECK(sh.numel == want["shard_numel"].get<std::uint64_t>());
      CHECK(sh.numel_padded == want["numel_padded"].get<std::uint64_t>());
      const LegacyShardMetadata m = fsdp_legacy_shard_metadata(numels, r, ws);
      CHECK(json(m.param_offsets) == want["offsets"]);
      CHECK(json(m.indices) == want["indices"]);
      // The torch >= 2.1 form says the same thing for the same (unaligned) flat parameter.
      const auto infos = fsdp_shard_param_infos(fsdp_flat_param(numels, ws), r, ws);
      std::size_t j = 0;
      for (const auto& info : infos)
        if (info.in_shard && info.numel_in_shard > 0) {
          REQUIRE(j < m.param_offsets.size());
          CHECK(info.intra_param_start_idx == m.param_offsets[j].first);
          CHECK(info.intra_param_end_idx == m.param_offsets[j].second);
          ++j;
        }
      CHECK(j == m.param_offsets.size());
    }
    ++n_cases;
  }
  CHECK(n_cases == 20 * 9);
}

TEST_CASE("FSDP >= 2.1 _shard_param_infos, with and without alignment (re-derivation)") {
  for (const auto& c : refs()["fsdp_21_rederived"]) {
    const auto numels = c["numels"].get<std::vector<std::uint64_t>>();
    const auto ws = c["ws"].get<std::uint64_t>();
    const bool aligned = c["aligned"].get<bool>();
    CAPTURE(c["numels"].dump());
    CAPTURE(ws);
    CAPTURE(aligned);
    const auto f = fsdp_flat_param(numels, ws, aligned ? fsdp_aligned_numel(dtype::F32) : 0);
    CHECK(f.numel == c["flat_numel"].get<std::uint64_t>());
    CHECK(f.numels_with_padding == c["numels_with_padding"].get<std::vector<std::uint64_t>>());
    for (std::uint64_t r = 0; r < ws; ++r) {
      const auto& want = c["ranks"][r];
      CHECK(fsdp_shard(f.numel, r, ws).numel_padded == want["numel_padded"].get<std::uint64_t>());
      const auto infos = fsdp_shard_param_infos(f, r, ws);
      REQUIRE(infos.size() == want["infos"].size());
      for (std::size_t i = 0; i < infos.size(); ++i) {
        const auto& w = want["infos"][i];
        CHECK(infos[i].in_shard == w[0].get<bool>());
        if (!infos[i].in_shard) continue;
        CHECK(infos[i].offset_in_shard == w[1].get<std::int64_t>());
        CHECK(infos[i].numel_in_shard == w[2].get<std::int64_t>());
        CHECK(infos[i].intra_param_start_idx == w[3].get<std::int64_t>());
        CHECK(infos[i].intra_param_end_idx == w[4].get<std::int64_t>());
      }
    }
  }
}

TEST_CASE("DeepSpeed ZeRO partitions and padding (re-derivation)") {
  for (const auto& c : refs()["zero12_rederived"]) {
    const auto n = c["n"].get<std::uint64_t>(), dp = c["dp"].get<std::uint64_t>();
    CAPTURE(n);
    CAPTURE(dp);
    const auto z = zero12_partitions(n, dp);
    CHECK(z.padded_numel == c["padded"].get<std::uint64_t>());
    for (std::uint64_t r = 0; r < dp; ++r) {
      CHECK(z.parts[r].size == c["sizes"][r].get<std::uint64_t>());
      CHECK(zero12_group_padding(z, r) == c["padding"][r].get<std::uint64_t>());
    }
  }
  for (const auto& c : refs()["zero3_rederived"])
    CHECK(zero3_partitioned_param_info(c["n"].get<std::uint64_t>(), c["ws"].get<std::uint64_t>()).partitioned_numel ==
          c["partitioned_numel"].get<std::uint64_t>());
}
