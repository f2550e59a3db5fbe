"""Writes Megatron-core "torch_dist" checkpoints with torch >= 2.6 DCP (run it under the sid root's
python3, see torch_dist_runner.py), and reads them back into a full per-layer model.

    python3 -m megatron_fixtures.torch_dist_layout INPUT.pt OUTDIR   (INPUT written by the runner)

What Megatron-core does and where (details and citations: tests/python/layouts/megatron.md):
  * dist_checkpointing/serialization.py save(): common (non-sharded) state to common.pt on rank 0
    (core_v0.15.0) or as the ShardedObject "common_state" inside the DCP data (core_v0.19.0),
    metadata.json {"sharded_backend": "torch_dist", ...} written last.
  * strategies/torch.py: every ShardedTensor becomes DCP chunks at its global offset (stacked
    layers: a leading layer axis, chunk size 1 on it); ShardedObjects become BYTE_IO items named
    "{key}/shard_{offsets}_{global shape}" holding torch.save([data]); only main replicas are written;
    MCoreSavePlanner wraps the metadata in MCoreMetadata (core_v0.15.0; a plain Metadata in 0.19.0).
  * strategies/filesystem_async.py: files __{rank}_{i}.distcp, i < thread_count; byte items dealt
    round-robin, tensors by decreasing chunk bytes to the least-filled file; byte items first.
  * transformer_block.py / mlp.py: layers stacked under "decoder.layers.<name>" (global shape
    [num_layers, ...]) unless non_homogeneous_layers / singleton_local_shards, then per layer
    "decoder.layers.<global index>.<name>"; SwiGLU linear_fc1 rank r's W half is chunk r and its V
    half chunk tp + r of 2*tp along the output dim, or with singleton_local_shards the separate keys
    "<name>_w" / "<name>_v" (chunk r of tp each).
  * optimizer: Float16OptimizerWithFloat16Params.sharded_state_dict: exp_avg / exp_avg_sq /
    fp32_param as "optimizer.state.<kind>.<model key>" sharded exactly like the model tensor; the
    per-parameter step becomes one "common_step" in the common state; param_groups lose "params".
"""
import argparse
import dataclasses
import heapq
import io
import json
import math
import os
import pickle
import sys
import tempfile
from collections import OrderedDict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from megatron_fixtures import model as M  # noqa: E402
from megatron_fixtures import standins  # noqa: E402


# --------------------------------------------------------------------------- names
def mcore_name(legacy, te):
    """Canonical legacy name -> Megatron-core GPTModel name (TE layer spec or local spec; in a
    distributed checkpoint both use the TE spelling, see rank_items)."""
    n = legacy
    n = n.replace(f"{M.LM}.embedding.", "embedding.")
    n = n.replace(f"{M.LM}.output_layer.", "output_layer.")
    n = n.replace(f"{M.ENC}.final_norm.", "decoder.final_layernorm.")
    n = n.replace(f"{M.ENC}.layers.", "decoder.layers.")
    if te:
        n = n.replace(".input_norm.", ".self_attention.linear_qkv.layer_norm_")
        n = n.replace(".post_attention_norm.", ".mlp.linear_fc1.layer_norm_")
    else:
        n = n.replace(".input_norm.", ".input_layernorm.")
        n = n.replace(".post_attention_norm.", ".pre_mlp_layernorm.")
    n = n.replace(".self_attention.query_key_value.", ".self_attention.linear_qkv.")
    n = n.replace(".self_attention.dense.", ".self_attention.linear_proj.")
    n = n.replace(".mlp.dense_h_to_4h.", ".mlp.linear_fc1.")
    n = n.replace(".mlp.dense_4h_to_h.", ".mlp.linear_fc2.")
    return n


def tp_axis(mname):
    """TP axis of a Megatron-core parameter (None: replicated across TP)."""
    if mname.endswith(("word_embeddings.weight", "output_layer.weight")):
        return 0
    if ".linear_qkv." in mname and not ".layer_norm_" in mname:
        return 0
    if ".linear_fc1." in mname and not ".layer_norm_" in mname:
        return 0
    if mname.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


# --------------------------------------------------------------------------- DCP objects
class Shards(torch.Tensor):
    """The local chunks of one checkpoint key (what Megatron's CheckpointableShardedTensor /
    LocalShardsContainer or a torch ShardedTensor hands to DCP: one WriteItem per chunk).
    A wrapper tensor of the global shape that only implements DCP's checkpointable protocol."""

    @staticmethod
    def __new__(cls, global_shape, chunks):
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(global_shape), dtype=chunks[0][1].dtype)

    def __init__(self, global_shape, chunks):
        self.global_shape = torch.Size(global_shape)
        self.chunks = [(torch.Size(off), t.contiguous()) for off, t in chunks]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"Shards supports no tensor operation ({func})")

    def __repr__(self):
        return f"Shards({tuple(self.global_shape)}, {len(self.chunks)} chunks)"

    def __create_write_items__(self, fqn, obj):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        items = []
        for i, (off, t) in enumerate(self.chunks):
            items.append(WriteItem(
                index=MetadataIndex(fqn, off, i), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.size()),
                                            properties=TensorProperties.create_from_tensor(t),
                                            size=self.global_shape)))
        return items

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=off, sizes=t.size()) for off, t in self.chunks]

    def __get_tensor_shard__(self, index):
        if index.index is not None and index.index < len(self.chunks) and self.chunks[index.index][0] == index.offset:
            return self.chunks[index.index][1]
        for off, t in self.chunks:
            if off == index.offset:
                return t
        raise ValueError(f"no chunk at {index.offset} for {index.fqn}")


def object_key(key, global_shape, offset):
    """ShardedObject.unique_key (mapping.py)."""
    return f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, global_shape))}"


def object_bytes(datas):
    """strategies/torch.py _mcore_to_torch_sharded_object: torch.save([data of each local shard])."""
    b = io.BytesIO()
    torch.save(list(datas), b)
    return b


# --------------------------------------------------------------------------- one rank's sharded state
def rank_items(spec, full, tp_rank, pp_rank):
    """{dcp key: Shards | BytesIO} written by rank (tp_rank, pp_rank)."""
    cfg = M.CONFIGS[spec["config"]]
    tp, pp = spec["tp"], spec["pp"]
    te, stacked, singleton = spec["te"], spec["stacked"], spec["singleton_local_shards"]
    L = cfg.num_layers
    per = L // pp
    layers = range(pp_rank * per, (pp_rank + 1) * per)
    pre, post = pp_rank == 0, pp_rank == pp - 1
    out = OrderedDict()
    tensors = OrderedDict()          # dcp key -> (global shape, [(offset, local)])
    objects = OrderedDict()          # dcp key -> [data]

    def add_tensor(key, gshape, off, t):
        g, lst = tensors.setdefault(key, (tuple(gshape), []))
        if g != tuple(gshape):
            raise AssertionError(f"{key}: global shape {gshape} vs {g}")
        lst.append((tuple(off), t))

    def shard(lname, t, layer=None, kinds=("model",)):
        """Add the TP piece(s) of full tensor t under key (+ optimizer keys)."""
        # The dist-checkpoint keys of the norms are TE-style for both layer specs: the local spec maps
        # input_layernorm. / pre_mlp_layernorm. to them (gpt_layer_specs.py sharded_state_dict_keys_map).
        mname = mcore_name(lname, True)
        axis = tp_axis(mname)
        if axis is None and tp_rank != 0:
            return                       # replica_id != 0: not written
        glu = cfg.swiglu and ".linear_fc1." in mname and ".layer_norm_" not in mname
        pieces = []                      # (key suffix, global shape, offset, local)
        if axis is None:
            pieces.append(("", t.shape, (0,) * t.dim(), t))
        elif glu:
            w, v = torch.chunk(t, 2, 0)
            n = w.shape[0] // tp
            if singleton:
                pieces.append(("_w", w.shape, (tp_rank * n,) + (0,) * (t.dim() - 1), w[tp_rank * n:(tp_rank + 1) * n]))
                pieces.append(("_v", v.shape, (tp_rank * n,) + (0,) * (t.dim() - 1), v[tp_rank * n:(tp_rank + 1) * n]))
            else:
                pieces.append(("", t.shape, (tp_rank * n,) + (0,) * (t.dim() - 1), w[tp_rank * n:(tp_rank + 1) * n]))
                pieces.append(("", t.shape, ((tp + tp_rank) * n,) + (0,) * (t.dim() - 1), v[tp_rank * n:(tp_rank + 1) * n]))
        else:
            n = t.shape[axis] // tp
            off = [0] * t.dim()
            off[axis] = tp_rank * n
            pieces.append(("", t.shape, tuple(off), t.narrow(axis, tp_rank * n, n)))
        for kind in kinds:
            for suffix, gshape, off, local in pieces:
                if layer is not None and stacked:
                    key = mname.replace(f"decoder.layers.{layer}.", "decoder.layers.") + suffix
                    g, o, loc = (L,) + tuple(gshape), (layer,) + tuple(off), local.unsqueeze(0)
                else:
                    key, g, o, loc = mname + suffix, tuple(gshape), tuple(off), local
                if kind != "model":
                    key = f"optimizer.state.{kind}.{key}"
                add_tensor(key, g, o, loc.clone())

    def extra_state(lname_module, layer=None):
        """`_extra_state` of a linear module as a ShardedObject (replica_id (0, tp, dp): TP rank 0)."""
        if tp_rank != 0:
            return
        mname = mcore_name(lname_module + ".weight", True)[:-len(".weight")] + "._extra_state"
        data = torch.frombuffer(bytearray(pickle.dumps(None, protocol=4)), dtype=torch.uint8) if te else None
        if layer is not None and stacked:
            key = mname.replace(f"decoder.layers.{layer}.", "decoder.layers.")
            objects[object_key(key, (L,), (layer,))] = [data]
        else:
            objects[object_key(mname, (1,), (0,))] = [data]

    kinds_of = lambda n: ("model",) + (("exp_avg", "exp_avg_sq", "fp32_param") if spec["optimizer"] else ())
    P, EA, ES = full["params"], full["exp_avg"], full["exp_avg_sq"]

    def emit(lname, layer=None):
        for kind in kinds_of(lname):
            src = {"model": P, "exp_avg": EA, "exp_avg_sq": ES, "fp32_param": full["masters"]}[kind]
            shard(lname, src[lname], layer, kinds=(kind,))

    names = list(P)
    if pre:
        for n in names:
            if n.startswith(f"{M.LM}.embedding."):
                emit(n)
    for i in layers:
        for n in M.layer_param_names(cfg, i):
            emit(n, i)
        for mod in ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"):
            extra_state(f"{M.ENC}.layers.{i}.{mod}", i)
    if post:
        for n in names:
            if n.startswith(f"{M.ENC}.final_norm."):
                emit(n)
        if cfg.untie_embeddings_and_output_weights:
            # no output_layer._extra_state: GPTModel.sharded_state_dict drops it (older checkpoints
            # stored only the weight)
            emit(f"{M.LM}.output_layer.weight")
    # RNG: ShardedObject('rng_state', [rng dict], (pp, tp), (pp_rank, tp_rank))
    objects[object_key("rng_state", (pp, tp), (pp_rank, tp_rank))] = [[full["rng"][f"{tp_rank},{pp_rank}"]]]
    for k, (g, chunks) in tensors.items():
        out[k] = Shards(g, chunks)
    if spec["common"] == "object" and tp_rank == 0 and pp_rank == 0:
        objects[object_key("common_state", (1,), (0,))] = [full["common"]]
    for k, datas in objects.items():
        out[k] = object_bytes(datas)
    return out


# --------------------------------------------------------------------------- planner and writer
def make_planner(spec, stacked_keys):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import Metadata

    class Planner(DefaultSavePlanner):
        def create_global_plan(self, all_plans):
            plans, md = super().create_global_plan(all_plans)
            if spec["mcore_metadata"]:
                cls = mcore_metadata_class()
                md = cls(mcore_data={k: {} for k in stacked_keys}, **{f.name: getattr(md, f.name) for f in dataclasses.fields(Metadata)})
                self.metadata = md
            return plans, md

    return Planner(flatten_state_dict=False, flatten_sharded_tensors=False)


_MCORE = {}


def mcore_metadata_class():
    """A dataclass Metadata subclass pickled as megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata
    (core_v0.15.0 strategies/torch.py: one extra field, mcore_data)."""
    if "cls" in _MCORE:
        return _MCORE["cls"]
    from torch.distributed.checkpoint.metadata import Metadata
    modname = "megatron.core.dist_checkpointing.strategies.torch"
    standins.install()
    mod = standins._module(modname)

    @dataclasses.dataclass
    class MCoreMetadata(Metadata):
        mcore_data: dict = None

    MCoreMetadata.__module__ = modname
    MCoreMetadata.__qualname__ = "MCoreMetadata"
    mod.MCoreMetadata = MCoreMetadata
    _MCORE["cls"] = MCoreMetadata
    return MCoreMetadata


def make_writer(path, thread_count):
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.planner import WriteItemType
    import queue

    def item_bytes(wi):
        n = 1
        for s in wi.tensor_data.chunk.sizes:
            n *= s
        return n * torch._utils._element_size(wi.tensor_data.properties.dtype)

    def split(bins, items):
        if bins == 1:
            return [list(items)]
        bytes_items = [w for w in items if w.type == WriteItemType.BYTE_IO]
        tensor_items = [w for w in items if w.type != WriteItemType.BYTE_IO]
        buckets = [[] for _ in range(bins)]
        for i, w in enumerate(bytes_items):
            buckets[i % bins].append(w)
        sized = sorted(((w, item_bytes(w)) for w in tensor_items), key=lambda x: x[1], reverse=True)
        heap = [(0, i) for i in range(bins)]
        for w, size in sized:
            total, b = heapq.heappop(heap)
            buckets[b].append(w)
            heapq.heappush(heap, (total + size, b))
        return buckets

    class Writer(FileSystemWriter):
        def storage_meta(self):
            # torch records the checkpoint path and a random uuid4 save_id; fixed here so that the
            # fixture is byte-identical from run to run (same types: a PosixPath and a str).
            import pathlib
            import uuid
            meta = super().storage_meta()
            name = os.path.basename(os.path.normpath(str(self.path)))
            meta.checkpoint_id = pathlib.PosixPath("/checkpoints") / name / "iter_0000010"
            meta.save_id = str(uuid.uuid5(uuid.NAMESPACE_URL, "statedict-megatron-" + name))
            return meta

        def finish(self, metadata, results):
            # With thread_count > 1 the write results arrive in thread completion order, so the
            # storage_data order of .metadata varies between runs; sorted by (file, offset) here.
            ordered = [sorted(r, key=lambda w: (w.storage_data.relative_path, w.storage_data.offset)) for r in results]
            return super().finish(metadata, ordered)

        def write_data(self, plan, planner):
            prefix = plan.storage_data.prefix
            q = queue.Queue()
            n = 0
            for bucket in split(self.thread_count, plan.items):
                if not bucket:
                    continue
                name = f"{prefix}{n}.distcp"
                n += 1
                q.put((self.fs.concat_path(self.path, name), name, bucket))
            return self._write_data(planner, q)

    return Writer(path, single_file_per_rank=True, thread_count=thread_count, sync_files=False)


# --------------------------------------------------------------------------- spawn
def _worker(rank, job_path, outdir, init_file, world):
    """One process of the writing job: every spec is saved by the first tp*pp ranks, in its own
    process group (one spawn for all specs keeps the run short)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    standins.install()
    mcore_metadata_class()
    job = torch.load(job_path, weights_only=False)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for spec in job["specs"]:
            n = spec["tp"] * spec["pp"]
            group = dist.new_group(ranks=list(range(n)))
            if rank < n:
                spec, full = _job_case(job, spec["name"])
                tp_rank, pp_rank = rank % spec["tp"], rank // spec["tp"]
                items = rank_items(spec, full, tp_rank, pp_rank)
                stacked = [k for k, v in items.items() if isinstance(v, Shards) and spec["stacked"] and ".layers." in k
                           and not k.split(".layers.")[1].split(".")[0].isdigit()]
                dcp.save(items, storage_writer=make_writer(os.path.join(outdir, spec["name"]), spec["thread_count"]),
                         planner=make_planner(spec, stacked), process_group=group)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _job_case(job, name):
    spec = next(s for s in job["specs"] if s["name"] == name)
    return spec, dict(job["full"][spec["full"]], common=job["common"][name])


def write_all(job_path, job, outdir):
    import torch.multiprocessing as mp
    for spec in job["specs"]:
        d = os.path.join(outdir, spec["name"])
        os.makedirs(d, exist_ok=True)
        if spec["common"] == "file":
            torch.save(job["common"][spec["name"]], os.path.join(d, "common.pt"))
    world = max(s["tp"] * s["pp"] for s in job["specs"])
    with tempfile.TemporaryDirectory() as tmp:
        # fork: the children reuse the imported torch (spawn would import it again in each)
        mp.start_processes(_worker, args=(job_path, outdir, os.path.join(tmp, "pg"), world), nprocs=world,
                           join=True, start_method="fork")
    for spec in job["specs"]:
        with open(os.path.join(outdir, spec["name"], "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                       "common_backend": "torch", "common_backend_version": 1}, f)


# --------------------------------------------------------------------------- read back
def read_back(outdir):
    """Load every DCP item whole (no_dist): {"tensors": {key: global tensor}, "objects": {key: obj},
    "metadata": summary of .metadata}.  Unstacking is left to the caller."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    standins.install()
    mcore_metadata_class()
    reader = FileSystemReader(outdir)
    md = reader.read_metadata()
    sd = {}
    summary = {"class": f"{type(md).__module__}.{type(md).__qualname__}", "version": getattr(md, "version", None),
               "planner_data": md.planner_data, "tensors": OrderedDict(), "objects": [], "storage": []}
    for k, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            dt = m.properties.dtype
            sd[k] = torch.full(tuple(m.size), float("nan"), dtype=dt) if dt.is_floating_point else torch.zeros(tuple(m.size), dtype=dt)
            summary["tensors"][k] = {"dtype": str(dt), "size": list(m.size),
                                     "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in m.chunks]}
        else:
            sd[k] = io.BytesIO()
            summary["objects"].append(k)
    for idx, info in md.storage_data.items():
        summary["storage"].append([idx.fqn, None if idx.offset is None else list(idx.offset), info.relative_path, info.offset, info.length])
    dcp.load(sd, storage_reader=reader, no_dist=True)
    tensors, objects = OrderedDict(), OrderedDict()
    for k, v in sd.items():
        if isinstance(v, io.BytesIO):
            v.seek(0)
            objects[k] = describe(torch.load(v, weights_only=False))
        else:
            tensors[k] = v
    return {"tensors": tensors, "objects": objects, "metadata": summary}


def describe(obj):
    """A JSON-able summary of a loaded ShardedObject payload (torch.save([data, ...]))."""
    if isinstance(obj, dict):
        return {str(k): describe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [describe(v) for v in obj]
    if torch.is_tensor(obj):
        return {"tensor": str(obj.dtype), "shape": list(obj.shape), "bytes_hex": obj.numpy().tobytes().hex() if obj.dtype == torch.uint8 and obj.numel() <= 16 else None}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return {"object": f"{type(obj).__module__}.{type(obj).__qualname__}"}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("input")
    ap.add_argument("outdir")
    a = ap.parse_args(argv)
    standins.install()
    job = torch.load(a.input, weights_only=False)
    write_all(a.input, job, a.outdir)
    results = {}
    for spec in job["specs"]:
        results[spec["name"]] = read_back(os.path.join(a.outdir, spec["name"]))
    torch.save(results, os.path.join(a.outdir, spec_readback_name()), _use_new_zipfile_serialization=True)


def spec_readback_name():
    return ".torch_dist_readback.pt"


if __name__ == "__main__":
    main()
