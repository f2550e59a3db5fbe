#!/usr/bin/python3
"""Load a torch.distributed.checkpoint directory with PyTorch 1.13's own DCP
reader on M gloo processes and check it against a manifest.

Usage:
  /usr/bin/python3 tests/python/dcp_load_check.py DCP_DIR MANIFEST M
        [--receive sharded|plain] [--shard-dim D]

Each of the M ranks allocates, for every tensor of the checkpoint, a receiver
of the MANIFEST's dtype and shape: a ShardedTensor chunked along --shard-dim
(default 0) over the M ranks (--receive sharded, the default; DCP then reshards
on load), or a full plain tensor on every rank (--receive plain).  0-d, empty
and too-low-rank tensors are always received as plain tensors.  Receivers are
pre-filled with a poison pattern.  torch.distributed._shard.checkpoint.
load_state_dict fills them (non-tensor items are loaded as Python objects);
rank 0 gathers the global tensors and compares dtype, shape and sha256 of every
tensor and every non-tensor value (flattened to dotted names) with MANIFEST.

Checks beyond what PyTorch's loader does (it silently casts and ignores holes):
  * .metadata dtype / size of each tensor equal the manifest's;
  * the chunks of each tensor lie inside it, do not overlap and cover it;
  * every chunk has a storage entry whose byte range lies inside its file;
  * each stored chunk loads with torch.load(weights_only=True) as a tensor of
    the metadata's dtype and of the chunk's size.

Exit status: 0 all match; 1 with one line per problem otherwise; 2 bad usage.
"""
import argparse
import io
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

C.install_shim()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _dist as D  # noqa: E402


class CheckError(Exception):
    pass


# --------------------------------------------------------------------------- static checks
def read_metadata(path):
    import torch.distributed._shard.checkpoint as dcp
    return dcp.FileSystemReader(path).read_metadata()


def _overlap(a_off, a_size, b_off, b_size):
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_off, a_size, b_off, b_size))


def static_checks(path, md, manifest):
    from torch.distributed._shard.checkpoint.metadata import TensorStorageMetadata, MetadataIndex
    problems = []
    exp = manifest.get("tensors", {})
    storage = md.storage_data or {}
    for fqn, m in md.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                problems.append(f"{fqn}: bytes item has no storage entry")
            continue
        size = list(m.size)
        if fqn in exp:
            want_dtype = exp[fqn]["dtype"]
            try:
                got_dtype = C.dtype_name(m.properties.dtype)
            except ValueError:
                got_dtype = str(m.properties.dtype)
            if got_dtype != want_dtype:
                problems.append(f"{fqn}: .metadata dtype {got_dtype} != expected {want_dtype}")
            if size != exp[fqn]["shape"]:
                problems.append(f"{fqn}: .metadata size {size} != expected {exp[fqn]['shape']}")
        numel = 1
        for s in size:
            numel *= s
        covered = 0
        chunks = [(list(c.offsets), list(c.sizes)) for c in m.chunks]
        for i, (off, sz) in enumerate(chunks):
            if len(off) != len(size) or len(sz) != len(size):
                problems.append(f"{fqn}: chunk {i} has rank {len(off)}/{len(sz)}, tensor has {len(size)}")
                continue
            if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(off, sz, size)):
                problems.append(f"{fqn}: chunk {i} at {off} size {sz} lies outside {size}")
            vol = 1
            for s in sz:
                vol *= s
            covered += vol
            for j in range(i):
                if _overlap(off, sz, *chunks[j]) and vol:
                    problems.append(f"{fqn}: chunks {j} and {i} overlap ({chunks[j][0]} / {off})")
            key = MetadataIndex(fqn, torch.Size(off))
            info = storage.get(key)
            if info is None:
                problems.append(f"{fqn}: chunk {i} at {off} has no storage entry")
                continue
            fpath = os.path.join(path, info.relative_path)
            if not os.path.isfile(fpath):
                problems.append(f"{fqn}: chunk {i}: file {info.relative_path} does not exist")
            elif info.offset < 0 or info.length < 0 or info.offset + info.length > os.path.getsize(fpath):
                problems.append(f"{fqn}: chunk {i}: bytes [{info.offset}, {info.offset + info.length}) "
                                f"outside {info.relative_path} ({os.path.getsize(fpath)} bytes)")
        if covered != numel:
            problems.append(f"{fqn}: chunks cover {covered} of {numel} elements")
    return problems


# --------------------------------------------------------------------------- strict reader
def make_strict_reader(path, md):
    import torch.distributed._shard.checkpoint as dcp
    from torch.distributed._shard.checkpoint.planner import LoadItemType
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.futures import Future

    class StrictFileSystemReader(dcp.FileSystemReader):
        """FileSystemReader.read_data with checks on every stored chunk."""

        def read_data(self, plan, planner):
            per_file = {}
            for req in plan.items:
                per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
            for rel, reqs in per_file.items():
                with open(os.path.join(self.path, rel), "rb") as f:
                    for req in reqs:
                        info = self.storage_data[req.storage_index]
                        fqn = req.storage_index.fqn
                        f.seek(info.offset)
                        data = f.read(info.length)
                        if len(data) != info.length:
                            raise CheckError(f"{fqn}: {rel} ends before byte {info.offset + info.length}")
                        if req.type == LoadItemType.BYTE_IO:
                            planner.load_bytes(req, io.BytesIO(data))
                            continue
                        tmd = md.state_dict_metadata[fqn]
                        chunk = next((c for c in tmd.chunks
                                      if list(c.offsets) == list(req.storage_index.offset)), None)
                        try:
                            t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                        except Exception as e:
                            raise CheckError(f"{fqn}: chunk at {list(req.storage_index.offset)} in {rel}: "
                                             f"torch.load(weights_only=True) failed: {' '.join(str(e).split())[-200:]}")
                        if not isinstance(t, torch.Tensor):
                            raise CheckError(f"{fqn}: chunk in {rel} holds a {type(t).__name__}, not a tensor")
                        if t.dtype != tmd.properties.dtype:
                            raise CheckError(f"{fqn}: chunk in {rel} is {t.dtype}, .metadata says {tmd.properties.dtype}")
                        if chunk is None or list(t.shape) != list(chunk.sizes):
                            raise CheckError(f"{fqn}: chunk in {rel} has shape {list(t.shape)}, .metadata says "
                                             f"{None if chunk is None else list(chunk.sizes)}")
                        t = narrow_tensor_by_index(t, req.storage_offsets, req.lengths)
                        target = planner.resolve_tensor(req).detach()
                        if target.size() != t.size():
                            raise CheckError(f"{fqn}: read size {list(t.size())} != receiver {list(target.size())}")
                        target.copy_(t)
                        planner.commit_tensor(req, target)
            fut = Future()
            fut.set_result(None)
            return fut

    return StrictFileSystemReader(path)


# --------------------------------------------------------------------------- worker
def _one_line(e):
    if isinstance(e, CheckError):
        return str(e)
    return f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"


def worker(rank, ws, path, tensor_specs, byte_keys, receive, shard_dim, result_file):
    import torch.distributed._shard.checkpoint as dcp
    from torch.distributed._shard.checkpoint.api import CheckpointException
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    md = read_metadata(path)
    sd = {}
    for fqn, (dtype_name, shape) in tensor_specs.items():
        dtype = C.torch_dtype(dtype_name)
        numel = 1
        for s in shape:
            numel *= s
        if receive == "sharded" and len(shape) > shard_dim and numel > 0:
            sd[fqn] = D.sharded_zeros(shape, dtype, D.chunk_spec(shard_dim, ws))
        else:
            sd[fqn] = D.poison(torch.empty(shape, dtype=dtype))
    for k in byte_keys:
        sd[k] = None
    error = None
    try:
        dcp.load_state_dict(sd, make_strict_reader(path, md))
    except CheckpointException as e:  # a BaseException in 1.13; one entry per failed rank
        if rank == 0:
            error = "; ".join(f"load_state_dict failed on rank {r}: {_one_line(exc)}"
                              for r, (exc, _) in sorted(e.failures.items()))
    except Exception as e:
        error = f"load_state_dict failed on rank {rank}: {_one_line(e)}"

    pieces = {}
    if error is None:
        for fqn, v in sd.items():
            if isinstance(v, ShardedTensor):
                pieces[fqn] = [(o, s, t.clone()) for o, s, t in D.local_shard_records(v)]
            elif rank == 0 and isinstance(v, torch.Tensor):
                pieces[fqn] = [([0] * v.dim(), list(v.shape), v.clone())]
    gathered = [None] * ws if rank == 0 else None
    dist.gather_object((error, pieces), gathered, dst=0)
    if rank != 0:
        return

    problems = [e for e, _ in gathered if e]
    if not problems:
        tensors = {}
        for fqn, (dtype_name, shape) in tensor_specs.items():
            full = D.poison(torch.empty(shape, dtype=C.torch_dtype(dtype_name)))
            for _, p in gathered:
                for off, size, t in p.get(fqn, []):
                    D.box(full, off, size).copy_(t)
            tensors[fqn] = C.tensor_entry(full)
        values = {}
        for k in byte_keys:
            _, v, _ = C.flatten({k: sd[k]})
            values.update(v)
        import torch_check
        problems = torch_check.compare_with_manifest(json.load(open(result_file + ".manifest")),
                                                     tensors, values, label="checkpoint")
    with open(result_file, "w") as f:
        json.dump(problems, f)


# --------------------------------------------------------------------------- main
def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dcp_dir")
    p.add_argument("manifest")
    p.add_argument("world_size", type=int, metavar="M")
    p.add_argument("--receive", choices=["sharded", "plain"], default="sharded")
    p.add_argument("--shard-dim", type=int, default=0)
    args = p.parse_args(argv[1:])
    if args.world_size < 1 or args.shard_dim < 0:
        p.error("M must be >= 1 and --shard-dim >= 0")
    try:
        manifest = C.load_manifest(args.manifest)
    except (OSError, ValueError) as e:
        print(f"cannot read manifest {args.manifest}: {e}")
        return 2

    path = os.path.abspath(args.dcp_dir)
    try:
        md = read_metadata(path)
    except Exception as e:
        print(f"cannot read {os.path.join(args.dcp_dir, '.metadata')}: {type(e).__name__}: {e}")
        return 1
    from torch.distributed._shard.checkpoint.metadata import TensorStorageMetadata
    problems = static_checks(path, md, manifest)

    tensor_specs, byte_keys = {}, []
    exp = manifest.get("tensors", {})
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            if fqn in exp:
                spec = (exp[fqn]["dtype"], list(exp[fqn]["shape"]))
            else:  # still load it, so it is reported as unexpected
                spec = (str(m.properties.dtype).replace("torch.", ""), list(m.size))
                try:
                    spec = (C.dtype_name(m.properties.dtype), spec[1])
                except ValueError:
                    pass
            try:
                C.torch_dtype(spec[0])
            except ValueError:
                problems.append(f"{fqn}: dtype {spec[0]} cannot be received by torch 1.13; not loaded")
                continue
            tensor_specs[fqn] = spec
        else:
            byte_keys.append(fqn)

    tmp = tempfile.mkdtemp(prefix="statedict_dcp_check_")
    try:
        result_file = os.path.join(tmp, "result.json")
        with open(result_file + ".manifest", "w") as f:
            json.dump(manifest, f)
        try:
            D.run(worker, args.world_size, path, tensor_specs, byte_keys, args.receive,
                  args.shard_dim, result_file)
            with open(result_file) as f:
                problems += json.load(f)
        except Exception as e:
            msg = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            problems.append(f"PyTorch DCP load failed: {msg[-1] if msg else type(e).__name__}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    for line in problems:
        print(line)
    if problems:
        print(f"FAIL {args.dcp_dir}: {len(problems)} problem(s) (M={args.world_size}, "
              f"receive={args.receive})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
