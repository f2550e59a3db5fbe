"""torch.distributed helpers shared by gen_sharded.py and dcp_load_check.py.

Import _common first and call _common.install_shim() before importing this
module (torch.distributed._shard does not import on Python 3.11 otherwise).
"""
import datetime
import os
import shutil
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(fn, world_size, *args):
    """Run fn(rank, world_size, *args) in `world_size` gloo processes on CPU.

    Uses torch.multiprocessing.spawn and a file:// rendezvous in a fresh temp
    directory (no TCP port to pick).  Raises if any rank fails.
    """
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp = tempfile.mkdtemp(prefix="statedict_gloo_")
    try:
        mp.spawn(_entry, args=(fn, world_size, os.path.join(tmp, "rendezvous"), args),
                 nprocs=world_size, join=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _entry(rank, fn, world_size, init_file, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def chunk_spec(dim, world_size, placement_order=None):
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    order = list(range(world_size)) if placement_order is None else list(placement_order)
    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in order])


def chunk_layout(shape, dim, world_size, placement_order=None):
    """[(rank, offsets, sizes)] of a ChunkShardingSpec, in placement order,
    without a process group (same arithmetic as ChunkShardingSpec.build_metadata:
    split = ceil(size/chunks); empty chunks are dropped)."""
    order = list(range(world_size)) if placement_order is None else list(placement_order)
    size = shape[dim]
    split = -(-size // len(order)) if size else 0
    out = []
    for i, rank in enumerate(order):
        n = max(0, min(split, size - split * i))
        if n > 0:
            off = [0] * len(shape)
            off[dim] = split * i
            sz = list(shape)
            sz[dim] = n
            out.append((rank, off, sz))
    return out


def box(t, offsets, sizes):
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        t = t.narrow(d, o, s)
    return t


def sharded_from_global(full, spec):
    """A ShardedTensor laid out by `spec` whose local shards hold `full`'s values."""
    from torch.distributed._shard import sharded_tensor
    st = sharded_tensor.empty(spec, *full.shape, dtype=full.dtype)
    for shard in st.local_shards():
        shard.tensor.copy_(box(full, shard.metadata.shard_offsets, shard.metadata.shard_sizes))
    return st


def sharded_zeros(shape, dtype, spec, fill=None):
    from torch.distributed._shard import sharded_tensor
    st = sharded_tensor.empty(spec, *shape, dtype=dtype)
    for shard in st.local_shards():
        if fill is None:
            poison(shard.tensor)
        else:
            shard.tensor.fill_(fill)
    return st


def poison(t):
    """Fill with a recognisable non-zero pattern, so unread elements are noticed."""
    if t.dtype == torch.bool:
        t.fill_(True)
    elif t.is_complex() or t.is_floating_point():
        t.fill_(-12345.0)
    else:
        t.fill_(0x5A)
    return t


def local_shard_records(st):
    """[(offsets, sizes, tensor)] of a ShardedTensor's local shards."""
    return [(list(s.metadata.shard_offsets), list(s.metadata.shard_sizes), s.tensor)
            for s in st.local_shards()]


def global_chunks(st):
    """[(rank, offsets, sizes)] of all shards in a ShardedTensor's metadata."""
    out = []
    for m in st.metadata().shards_metadata:
        out.append((m.placement.rank(), list(m.shard_offsets), list(m.shard_sizes)))
    return out
