#!/usr/bin/python3
"""Write distributed-checkpoint fixtures with real PyTorch 1.13 (gloo, CPU).

Usage: /usr/bin/python3 tests/python/gen_sharded.py OUTDIR [--world-sizes 2,3,4]

For each world size W it writes, under OUTDIR:
  st_ranks_w{W}/rank{N}.pt      ShardedTensor rank files (OLMo legacy sharded
                                checkpointer style): each rank torch.save()s a
                                nested state dict with ShardedTensors.
  dcp_w{W}/                     torch.distributed._shard.checkpoint.save_state_dict
                                + FileSystemWriter() (1.13 default: one
                                __{rank}_{n}.distcp file per item)
  dcp_w{W}_single_file/         same, FileSystemWriter(single_file_per_rank=True)
and one <case>.manifest.json per case describing the consolidated (global)
tensors and values.  Every DCP checkpoint is loaded back with PyTorch's own
load_state_dict at the same world size, and every rank file with torch.load,
before the manifest is written.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

C.install_shim()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _dist as D  # noqa: E402

RAGGED_ROWS = {2: 1, 3: 4, 4: 5}  # rows such that the last rank(s) get no chunk


def _g(seed):
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def content(ws):
    """Deterministic global content for world size ws.

    Returns (sharded, plain, values):
      sharded: {key: (global_tensor, dim, placement_order)}
      plain:   {key: tensor}   (replicated on every rank)
      values:  {key: python value}
    Keys are the flat names used by the DCP cases.
    """
    r = _g(100 + ws)
    rev = list(reversed(range(ws)))
    sharded = {
        # uneven along dim 0: the last chunk is smaller
        "model.embed.weight": (torch.randn(2 * ws + 1, 6, generator=r), 0, None),
        # bf16, along dim 1, uneven
        "model.proj.weight": (torch.randn(5, 7, generator=r).to(torch.bfloat16), 1, None),
        # only the first placement gets a chunk; every other rank has none
        "model.tiny": (torch.randn(1, 3, generator=r), 0, None),
        # trailing ranks get no chunk (W=4: 2,2,1,0 rows; W=3: 2,2,0)
        "model.ragged": (torch.randn(RAGGED_ROWS[ws], 2, generator=r).to(torch.bfloat16), 0, None),
        # placements in reverse rank order: chunk i lives on rank W-1-i
        "model.reversed": (torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4), 0, rev),
        # f32 along dim 1, 3-d
        "model.cols": (torch.randn(2, 2 * ws + 3, 2, generator=r), 1, None),
    }
    plain = {
        "model.norm.weight": torch.ones(6) + 0.5 * torch.randn(6, generator=r),
        "model.norm.bias_bf16": torch.randn(6, generator=r).to(torch.bfloat16),
        "model.mask": torch.tensor([True, False, True, True]),
        "step_tensor": torch.tensor(42, dtype=torch.int64),
    }
    values = {
        "step": 42,
        "name": "run-\u03b1",
        "lrs": [0.1, 0.01],
        "config": {"hidden": 6, "act": "gelu", "dims": [1, 2], "flag": True, "none": None},
    }
    return sharded, plain, values


def rank_file_tree(ws, make_sharded, make_plain):
    """Nested state dict for the ShardedTensor rank files (like an FSDP
    SHARDED_STATE_DICT model + optimizer, as OLMo's legacy checkpointer saves)."""
    sharded, plain, values = content(ws)
    model = {}
    for k, (t, dim, order) in sharded.items():
        model[k[len("model."):]] = make_sharded(k, t, dim, order)
    for k, t in plain.items():
        if k.startswith("model."):
            model[k[len("model."):]] = make_plain(k, t)
    optim_state = {}
    for k in ("embed.weight", "proj.weight"):
        t, dim, order = sharded["model." + k]
        optim_state[k] = {
            "step": make_plain("optim.step", torch.tensor(3.0)),
            "exp_avg": make_sharded("optim.state." + k + ".exp_avg", t.float() * 0.1, dim, order),
            "exp_avg_sq": make_sharded("optim.state." + k + ".exp_avg_sq", t.float() ** 2, dim, order),
        }
    return {
        "model": model,
        "optim": {"state": optim_state,
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                                    "params": sorted(optim_state)}]},
        "step": values["step"],
        "name": values["name"],
        "config": values["config"],
    }


def dcp_tree(ws, make_sharded, make_plain):
    sharded, plain, values = content(ws)
    sd = {}
    for k, (t, dim, order) in sharded.items():
        sd[k] = make_sharded(k, t, dim, order)
    for k, t in plain.items():
        sd[k] = make_plain(k, t)
    sd.update(values)
    return sd


# --------------------------------------------------------------------------- manifests
class _Sharded:
    def __init__(self, t, dim, order):
        self.t, self.dim, self.order = t, dim, order


def _global(ws, tree_fn):
    """(global tree with plain tensors, {name: (dim, chunks)}) for a tree builder."""
    layout = {}

    def mk_sharded(name, t, dim, order):
        return _Sharded(t, dim, order)

    def mk_plain(name, t):
        return t

    tree = tree_fn(ws, mk_sharded, mk_plain)

    def resolve(obj, path=()):
        if isinstance(obj, _Sharded):
            layout[C.dotted(path)] = (obj.dim, D.chunk_layout(list(obj.t.shape), obj.dim, ws, obj.order))
            return obj.t
        if isinstance(obj, dict):
            return {k: resolve(v, path + (k,)) for k, v in obj.items()}
        if isinstance(obj, list):
            return [resolve(v, path + (i,)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(resolve(v, path + (i,)) for i, v in enumerate(obj))
        return obj

    return resolve(tree), layout


def sharding_json(layout):
    return {name: {"dim": dim, "chunks": [{"rank": r, "offsets": o, "sizes": s} for r, o, s in chunks]}
            for name, (dim, chunks) in layout.items()}


# --------------------------------------------------------------------------- workers
def _mk_sharded_dist(ws):
    def mk(name, t, dim, order):
        return D.sharded_from_global(t, D.chunk_spec(dim, ws, order))
    return mk


def _mk_plain(name, t):
    return t.clone()


def _check_rank_tree(rank, ws, loaded, expected_tree, where):
    """Compare a loaded per-rank tree with the expected global tree."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    exp = {C.dotted(p): v for p, v in C.iter_leaves(expected_tree)}
    got = {C.dotted(p): v for p, v in C.iter_leaves(loaded)}
    if exp.keys() != got.keys():
        raise AssertionError(f"{where} rank {rank}: keys differ: {sorted(exp.keys() ^ got.keys())}")
    for name, e in exp.items():
        g = got[name]
        if isinstance(g, ShardedTensor):
            # torch 1.13's _rebuild_wrapper_subclass ignores its dtype argument,
            # so a loaded ShardedTensor's .dtype is the default dtype: use the
            # metadata's tensor_properties (and the shards) instead.
            g_dtype = g.metadata().tensor_properties.dtype
            if list(g.size()) != list(e.shape) or g_dtype != e.dtype:
                raise AssertionError(f"{where} rank {rank}: {name}: global size/dtype "
                                     f"{list(g.size())} {g_dtype} != {list(e.shape)} {e.dtype}")
            for off, size, t in D.local_shard_records(g):
                if t.dtype != e.dtype or not torch.equal(t, D.box(e, off, size)):
                    raise AssertionError(f"{where} rank {rank}: {name}: shard at {off} differs")
        elif C.is_tensor(e):
            if not (C.is_tensor(g) and g.dtype == e.dtype and torch.equal(g, e)):
                raise AssertionError(f"{where} rank {rank}: {name}: tensor differs")
        elif not C.values_equal(C.json_value(g), C.json_value(e)):
            raise AssertionError(f"{where} rank {rank}: {name}: {g!r} != {e!r}")


def worker(rank, ws, outdir):
    import torch.distributed._shard.checkpoint as dcp

    mk_sharded = _mk_sharded_dist(ws)
    expected_rank_tree, _ = _global(ws, rank_file_tree)
    expected_dcp, _ = _global(ws, dcp_tree)

    # ---- ShardedTensor rank files
    st_dir = os.path.join(outdir, f"st_ranks_w{ws}")
    os.makedirs(st_dir, exist_ok=True)
    tree = rank_file_tree(ws, mk_sharded, _mk_plain)
    torch.save(tree, os.path.join(st_dir, f"rank{rank}.pt"))
    dist.barrier()
    loaded = torch.load(os.path.join(st_dir, f"rank{rank}.pt"))
    _check_rank_tree(rank, ws, loaded, expected_rank_tree, "rank file")

    # ---- DCP, both writer modes
    for case, single in ((f"dcp_w{ws}", False), (f"dcp_w{ws}_single_file", True)):
        path = os.path.join(outdir, case)
        sd = dcp_tree(ws, mk_sharded, _mk_plain)
        if single:
            writer = dcp.FileSystemWriter(path, single_file_per_rank=True)
        else:
            writer = dcp.FileSystemWriter(path)
        dcp.save_state_dict(sd, writer)
        dist.barrier()

        # load back with the same world size and layout into poisoned receivers
        def recv_sharded(name, t, dim, order):
            return D.sharded_zeros(t.shape, t.dtype, D.chunk_spec(dim, ws, order))

        def recv_plain(name, t):
            return D.poison(torch.empty_like(t))

        target = dcp_tree(ws, recv_sharded, recv_plain)
        for k in content(ws)[2]:
            target[k] = None
        dcp.load_state_dict(target, dcp.FileSystemReader(path))
        _check_rank_tree(rank, ws, target, expected_dcp, case)
        dist.barrier()


# --------------------------------------------------------------------------- main
def dcp_chunks_json(path):
    """Chunks as recorded in a DCP .metadata (read with PyTorch's own reader)."""
    import torch.distributed._shard.checkpoint as dcp
    md = dcp.FileSystemReader(path).read_metadata()
    out = {}
    for fqn, m in md.state_dict_metadata.items():
        if hasattr(m, "chunks"):
            out[fqn] = [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in m.chunks]
    files = sorted({si.relative_path for si in md.storage_data.values()})
    return out, files


def write_manifests(outdir, ws):
    tree, layout = _global(ws, rank_file_tree)
    case = f"st_ranks_w{ws}"
    C.write_manifest(outdir, case, C.make_manifest(
        "sharded_tensor_ranks", tree, path=case, world_size=ws,
        files=[f"rank{r}.pt" for r in range(ws)], sharding=sharding_json(layout)))

    tree, layout = _global(ws, dcp_tree)
    for case in (f"dcp_w{ws}", f"dcp_w{ws}_single_file"):
        chunks, files = dcp_chunks_json(os.path.join(outdir, case))
        C.write_manifest(outdir, case, C.make_manifest(
            "dcp", tree, path=case, world_size=ws, files=files, sharding=sharding_json(layout),
            dcp_chunks=chunks))


def main(argv):
    import argparse
    p = argparse.ArgumentParser(description="ShardedTensor / DCP fixtures (torch 1.13, gloo)")
    p.add_argument("outdir")
    p.add_argument("--world-sizes", default="2,3,4")
    args = p.parse_args(argv[1:])
    os.makedirs(args.outdir, exist_ok=True)
    outdir = os.path.abspath(args.outdir)
    for ws in [int(x) for x in args.world_sizes.split(",")]:
        if ws not in RAGGED_ROWS:
            p.error(f"world size {ws} not supported (choose from {sorted(RAGGED_ROWS)})")
        import shutil
        for case in (f"st_ranks_w{ws}", f"dcp_w{ws}", f"dcp_w{ws}_single_file"):
            shutil.rmtree(os.path.join(outdir, case), ignore_errors=True)
        D.run(worker, ws, outdir)
        write_manifests(outdir, ws)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
