#!/usr/bin/env python3
"""Reference numbers for shard/layout.hpp, computed by real PyTorch 1.13 where it can.

    gen_layout_refs.py OUTDIR     writes OUTDIR/layout_refs.json (checked by tests/interop-layout.cpp)

From PyTorch itself (CPU, no process group needed):
  * torch.chunk sizes                                 [x.numel() for x in torch.empty(n).chunk(k)]
  * ChunkShardingSpec.build_metadata shard offsets/sizes, and get_chunk_sharding_params
  * FSDP 1.13 FlatParamHandle: _get_unpadded_shard (shard numel, numel to pad) and
    _get_shard_metadata (_shard_param_offsets, _shard_indices) for real modules
From the fixture generator's independent re-derivations (tests/python/zero_fsdp), because torch >= 2.1
FSDP and DeepSpeed cannot run here: a second witness, not the original:
  * FSDP torch >= 2.1 _shard_param_infos with and without use_orig_params alignment
  * DeepSpeed ZeRO-1/2 partitions and groups_padding, ZeRO-3 partition numel
"""
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _common  # noqa: E402

_common.install_shim()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402


def torch_chunk():
    out = []
    for n in range(0, 65):
        for k in range(1, 18):
            out.append({"n": n, "k": k, "sizes": [int(x.numel()) for x in torch.empty(n).chunk(k)]})
    return out


def chunk_sharding_spec():
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed._shard.sharding_spec._internals import get_chunk_sharding_params
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    out = []
    shapes = [[10, 6], [7], [3, 10], [0, 5], [5, 13, 2], [1, 1], [17, 3]]
    for shape in shapes:
        for dim in range(len(shape)):
            for k in range(1, 10):
                spec = ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(k)])
                meta = spec.build_metadata(torch.Size(shape), TensorProperties())
                shards = [{"offsets": list(m.shard_offsets), "sizes": list(m.shard_sizes),
                           "rank": int(m.placement.rank())} for m in meta.shards_metadata]
                params = [list(get_chunk_sharding_params(shape[dim], k, spec, r)) for r in range(k)]
                out.append({"shape": shape, "dim": dim, "k": k, "shards": shards, "params": params})
    return out


class _Params(nn.Module):
    def __init__(self, numels):
        super().__init__()
        for i, n in enumerate(numels):
            self.register_parameter(f"p{i}", nn.Parameter(torch.zeros(n)))


def fsdp_113():
    from torch.distributed.fsdp.flat_param import FlatParamHandle, HandleConfig, HandleShardingStrategy

    rng = random.Random(1234)
    cases = [[15, 5, 10, 2], [3], [1, 1, 1], [7, 13, 64, 1, 5]]
    for _ in range(16):
        cases.append([rng.randint(1, 40) for _ in range(rng.randint(1, 7))])
    out = []
    cfg = HandleConfig(HandleShardingStrategy.FULL_SHARD, False, None, None)
    for numels in cases:
        mod = _Params(numels)
        handle = FlatParamHandle(list(mod.parameters()), mod, torch.device("cpu"), cfg)
        flat = handle.flat_param
        assert [int(n) for n in flat._numels] == numels
        for ws in range(1, 10):
            ranks = []
            for r in range(ws):
                chunk, pad = FlatParamHandle._get_unpadded_shard(flat, r, ws)
                s = chunk.numel() + pad
                offsets, indices = handle._get_shard_metadata(s * r, s * (r + 1) - 1)
                ranks.append({"shard_numel": int(s), "numel_padded": int(pad),
                              "offsets": [list(map(int, o)) for o in offsets], "indices": list(map(int, indices))})
            out.append({"numels": numels, "ws": ws, "ranks": ranks})
    return out


def fsdp_21_rederived():
    from zero_fsdp import fsdp_layout

    rng = random.Random(99)
    out = []
    for _ in range(12):
        numels = [rng.randint(1, 30) for _ in range(rng.randint(1, 6))]
        mod = _Params(numels)
        for aligned in (False, True):
            for ws in (1, 2, 3, 4, 7, 8, 16):
                unit = fsdp_layout.FlatUnit("", mod, set(), 4, ws, aligned)
                ranks = []
                for r in range(ws):
                    _, pad = unit.shard(unit.flat, r, ws)
                    infos = [[bool(i.in_shard), i.offset_in_shard, i.numel_in_shard, i.intra_param_start_idx,
                              i.intra_param_end_idx] for i in unit.metadata_torch21(r, ws)]
                    ranks.append({"numel_padded": int(pad), "infos": infos})
                out.append({"numels": numels, "aligned": aligned, "ws": ws, "flat_numel": int(unit.flat.numel()),
                            "numels_with_padding": [int(n) for n in unit.numels_with_padding], "ranks": ranks})
    return out


def zero_rederived():
    from zero_fsdp import deepspeed_layout as dl

    z12, z3 = [], []
    for n in list(range(0, 41)) + [97, 1000, 4099]:
        for dp in range(1, 18):
            flat = dl.align_dense([torch.zeros(n)], 2 * dp)
            parts = dl.data_parallel_partitions(flat, dp)
            z12.append({"n": n, "dp": dp, "padded": int(flat.numel()), "sizes": [int(p.numel()) for p in parts],
                        "padding": [int(dl.group_padding(n, parts, r)) for r in range(dp)]})
            z3.append({"n": n, "ws": dp, "partitioned_numel": int(dl.z3_partition_numel(n, dp))})
    return z12, z3


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: gen_layout_refs.py OUTDIR")
    outdir = sys.argv[1]
    os.makedirs(outdir, exist_ok=True)
    refs = {"torch_version": torch.__version__, "torch_chunk": torch_chunk(),
            "chunk_sharding_spec": chunk_sharding_spec(), "fsdp_113": fsdp_113(),
            "fsdp_21_rederived": fsdp_21_rederived()}
    refs["zero12_rederived"], refs["zero3_rederived"] = zero_rederived()
    with open(os.path.join(outdir, "layout_refs.json"), "w") as f:
        json.dump(refs, f)
    print(f"layout_refs.json: {sum(len(v) for v in refs.values() if isinstance(v, list))} cases")


if __name__ == "__main__":
    main()
