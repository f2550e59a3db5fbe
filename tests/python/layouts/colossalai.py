"""Reference readers for ColossalAI checkpoints (see layouts/colossalai.md).

load_dist(dir)
    The distributed model layout of ColossalAI PR 6181 (`pytorch_model-meta-dist-XXXXX(.index).json` +
    per-rank weight files). Rebuilds every parameter the metadata lists, as load_dist_model() does
    for a receiver that asks for the whole tensor: each shard's leading `lengths` box of the stored
    tensor is placed at `offsets`. Stricter than ColossalAI: every element must be covered,
    overlapping shards (replicas) must agree, all shards of a tensor must share one dtype (ColossalAI
    casts everything to the first tensor's dtype), and `file` is taken by base name (ColossalAI joins
    it to the folder, so an absolute save-time path wins).
load_hybrid_model(dir) / load_hybrid_optim(dir) / load_hybrid_optim_by_name(dir)
    The released HybridParallelCheckpointIO sharded layout: an index (`weight_map`) over `.bin` or
    `.safetensors` shards; the optimizer index maps param ids to shard files and names the
    param-group file (`pytorch_optim_group.bin`, a list of group dicts). Ids are mapped to parameter
    names by the rule in the spec (per pipeline stage, sorted ids against the stage's weight_map
    entries, shapes checked).
Only torch.load (for .bin files) and the strict safetensors parser are used; nothing is imported
from the generators.
"""
import json
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_check  # noqa: E402
from layouts._raw import RawTensor, raw_from_torch, restricted_loads  # noqa: E402

META_PREFIX = "pytorch_model-meta-dist-"
DIST_WEIGHT_RE = re.compile(r"(pytorch_model|model)-dist-\d{5}(-shard-\d{5})?\.(bin|safetensors)")
STAGE_RE = re.compile(r"-stage-(\d{5})-shard-\d{5}\.")

NUMPY_OF = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16,
            "I32": np.int32, "U32": np.uint32, "I64": np.int64, "U64": np.uint64, "F16": np.float16,
            "BF16": np.uint16, "F32": np.float32, "F64": np.float64, "C64": np.complex64,
            "C128": np.complex128}


class ColossalFormatError(Exception):
    def __init__(self, rule, detail):
        super().__init__(f"{rule}: {detail}")
        self.rule = rule


# --------------------------------------------------------------------------- files
def read_weight_file(path):
    """{name: RawTensor} of a .bin (torch.load) or .safetensors shard, plus its safetensors metadata."""
    if path.endswith(".safetensors"):
        entries, metadata, _n, start, blob = torch_check.read_safetensors(path, strict=False)
        out = {}
        for name, dtype, shape, s, e in entries:
            out[name] = RawTensor(dtype, shape, blob[start + s:start + e])
        return out, metadata
    import torch
    obj = torch.load(path, map_location="cpu")
    if not isinstance(obj, dict):
        raise ColossalFormatError("BadWeightFile", f"{path} holds a {type(obj).__name__}, not a dict")
    return obj, None


def _as_array(raw):
    a = np.frombuffer(raw.data, dtype=NUMPY_OF[raw.dtype]) if raw.data else np.zeros(0, NUMPY_OF[raw.dtype])
    return a.reshape(raw.shape)


# --------------------------------------------------------------------------- (a) distributed layout
def dist_meta_files(d):
    """Meta files as load_metadata() finds them: prefix + '.json' (the '.index.json' ones included)."""
    out = []
    for fn in sorted(os.listdir(d)):
        m = re.fullmatch(r"pytorch_model-meta-dist-(\d{5})(\.index)?\.json", fn)
        if m:
            out.append((int(m.group(1)), fn))
    return out


def is_dist(d):
    return os.path.isdir(d) and bool(dist_meta_files(d))


def load_dist(d):
    """-> ({name: RawTensor} in first-listed order, info dict)."""
    metas = dist_meta_files(d)
    if not metas:
        raise ColossalFormatError("NotDist", f"no {META_PREFIX}XXXXX(.index).json in {d}")
    shards = {}   # name -> {rank: shard}
    order = []
    for dist_id, fn in metas:
        with open(os.path.join(d, fn), encoding="utf-8") as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or not isinstance(doc.get("metadata"), dict):
            raise ColossalFormatError("BadMeta", f"{fn}: no 'metadata' object")
        for name, item in doc["metadata"].items():
            for k in ("offsets", "lengths", "global_shape", "file", "rank"):
                if k not in item:
                    raise ColossalFormatError("BadMeta", f"{fn}: {name} has no {k!r}")
            rank = item["rank"]
            if name not in shards:
                shards[name] = {}
                order.append(name)
            if rank in shards[name]:
                raise ColossalFormatError("DuplicateRank", f"{name}: rank {rank} listed twice ({fn})")
            shards[name][rank] = dict(item, meta_file=fn, dist_id=dist_id)

    cache = {}

    def tensor_of(file_field, name):
        base = os.path.basename(file_field)
        if base not in cache:
            p = os.path.join(d, base)
            if not os.path.isfile(p):
                raise ColossalFormatError("MissingFile", f"{name}: file {file_field!r} ({base}) not in {d}")
            cache[base] = read_weight_file(p)[0]
        t = cache[base].get(name)
        if t is None:
            raise ColossalFormatError("MissingTensor", f"{name} not in {base}")
        return t if isinstance(t, RawTensor) else raw_from_torch(t)

    out = {}
    for name in order:
        per_rank = shards[name]
        gshape = None
        for rank, sh in per_rank.items():
            if gshape is None:
                gshape = list(sh["global_shape"])
            elif list(sh["global_shape"]) != gshape:
                raise ColossalFormatError("GlobalShapeDiffers", f"{name}: {sh['global_shape']} vs {gshape}")
        dtype = None
        full = None
        covered = np.zeros(gshape, dtype=np.int32)
        for rank in sorted(per_rank):
            sh = per_rank[rank]
            off, ln = list(sh["offsets"]), list(sh["lengths"])
            if not (len(off) == len(ln) == len(gshape)):
                raise ColossalFormatError("BadBox", f"{name} rank {rank}: offsets/lengths rank differs from global_shape")
            if any(o < 0 or l < 0 or o + l > g for o, l, g in zip(off, ln, gshape)):
                raise ColossalFormatError("BadBox", f"{name} rank {rank}: box {off}+{ln} outside {gshape}")
            t = tensor_of(sh["file"], name)
            if dtype is None:
                dtype = t.dtype
                full = np.zeros(gshape, dtype=NUMPY_OF[dtype])
            elif t.dtype != dtype:
                raise ColossalFormatError("DtypeDiffers", f"{name} rank {rank}: {t.dtype}, rank 0's shard is {dtype}")
            if len(t.shape) != len(gshape) or any(s < l for s, l in zip(t.shape, ln)):
                raise ColossalFormatError("ShardTooSmall", f"{name} rank {rank}: stored {t.shape}, box lengths {ln}")
            piece = _as_array(t)[tuple(slice(0, l) for l in ln)]
            box = tuple(slice(o, o + l) for o, l in zip(off, ln))
            seen = covered[box] > 0
            if seen.any() and not np.array_equal(full[box][seen], piece[seen]):
                raise ColossalFormatError("ReplicasDiffer", f"{name} rank {rank}: overlaps another shard with other values")
            full[box] = piece
            covered[box] += 1
        if (covered == 0).any():
            raise ColossalFormatError("NotCovered", f"{name}: {(covered == 0).sum()} of {covered.size} elements in no shard")
        out[name] = RawTensor(dtype, gshape, np.ascontiguousarray(full).tobytes())
    # Every weight file the layout names, also those no listed tensor points to (buffers only).
    for fn in sorted(os.listdir(d)):
        if DIST_WEIGHT_RE.fullmatch(fn) and fn not in cache:
            cache[fn] = read_weight_file(os.path.join(d, fn))[0]
    unlisted = sorted({k for f in cache.values() for k in f} - set(out))
    return out, {"meta_files": [fn for _, fn in metas], "weight_files": sorted(cache), "not_in_metadata": unlisted}


# --------------------------------------------------------------------------- (b) released layout
def _find_index(d, names):
    for n in names:
        p = os.path.join(d, n)
        if os.path.isfile(p):
            return p
    return None


MODEL_INDEXES = ("pytorch_model.bin.index.json", "model.safetensors.index.json")
OPTIM_INDEXES = ("pytorch_optim.bin.index.json", "optimizer.safetensors.index.json")


def is_hybrid(d):
    return hybrid_dirs(d) != (None, None)


def hybrid_dirs(d):
    """(model dir, optimizer dir) of a released-layout checkpoint: `d` itself when it holds the index,
    else the `modeling/` and `optimizer/` folders ColossalChat and Colossal-LLaMA save into."""
    if not os.path.isdir(d):
        return None, None
    m = d if _find_index(d, MODEL_INDEXES) else None
    o = d if _find_index(d, OPTIM_INDEXES) else None
    if m is None and os.path.isdir(os.path.join(d, "modeling")) and _find_index(os.path.join(d, "modeling"), MODEL_INDEXES):
        m = os.path.join(d, "modeling")
    if o is None and os.path.isdir(os.path.join(d, "optimizer")) and _find_index(os.path.join(d, "optimizer"), OPTIM_INDEXES):
        o = os.path.join(d, "optimizer")
    return m, o


def _load_index(path):
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise ColossalFormatError("BadIndex", f"{path}: no weight_map")
    return doc.get("metadata", {}), doc["weight_map"]


def load_hybrid_model(d):
    """{name: RawTensor} in weight_map order."""
    idx = _find_index(d, MODEL_INDEXES)
    if idx is None:
        raise ColossalFormatError("NoIndex", f"no {' or '.join(MODEL_INDEXES)} in {d}")
    _meta, wm = _load_index(idx)
    files = {}
    out = {}
    for name, fn in wm.items():
        if fn not in files:
            if not os.path.isfile(os.path.join(d, fn)):
                raise ColossalFormatError("MissingFile", f"{name}: {fn} (from the index) not in {d}")
            files[fn] = read_weight_file(os.path.join(d, fn))[0]
        t = files[fn].get(name)
        if t is None:
            raise ColossalFormatError("MissingTensor", f"{name} not in {fn}")
        out[name] = t if isinstance(t, RawTensor) else raw_from_torch(t)
    extra = sorted({k for f in files.values() for k in f} - set(wm))
    if extra:
        raise ColossalFormatError("UnindexedTensor", f"tensors in shard files but not in the index: {extra[:5]}")
    return out


def _stage(fn):
    m = STAGE_RE.search(fn)
    return int(m.group(1)) if m else 0


def load_hybrid_optim(d):
    """{"state": {id: {key: tensor or value}}, "param_groups": [...], "files": {id: file}}."""
    idx = _find_index(d, OPTIM_INDEXES)
    if idx is None:
        raise ColossalFormatError("NoIndex", f"no {' or '.join(OPTIM_INDEXES)} in {d}")
    meta, wm = _load_index(idx)
    group_file = meta.get("param_groups")
    if not group_file:
        raise ColossalFormatError("NoParamGroups", f"{idx}: metadata has no param_groups file")
    import torch
    groups = torch.load(os.path.join(d, group_file), map_location="cpu")
    if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g for g in groups):
        raise ColossalFormatError("BadParamGroups", f"{group_file} is not a list of group dicts")
    state, where = {}, {}
    loaded = {}
    for key, fn in wm.items():
        pid = int(key)
        if fn not in loaded:
            if not os.path.isfile(os.path.join(d, fn)):
                raise ColossalFormatError("MissingFile", f"param id {pid}: {fn} (from the index) not in {d}")
            loaded[fn] = _read_optim_file(os.path.join(d, fn))
        st = loaded[fn].get(pid)
        if st is None:
            raise ColossalFormatError("MissingState", f"param id {pid} not in {fn}")
        state[pid] = st
        where[pid] = fn
    return {"state": state, "param_groups": groups, "files": where}


def _read_optim_file(path):
    if path.endswith(".safetensors"):
        raw, metadata = read_weight_file(path)
        non_tensor = json.loads((metadata or {}).get("non_tensor_keys", "[]"))
        out = {}
        for k, t in raw.items():
            parts = k.split(".")
            if len(parts) != 3 or parts[0] != "state":
                raise ColossalFormatError("BadOptimKey", f"{path}: {k!r} is not state.<id>.<key>")
            v = restricted_loads(t.data) if k in non_tensor else t
            out.setdefault(int(parts[1]), {})[parts[2]] = v
        return out
    import torch
    obj = torch.load(path, map_location="cpu")
    return {int(k): {kk: (raw_from_torch(vv) if torch.is_tensor(vv) else vv) for kk, vv in v.items()}
            for k, v in obj.items()}


def param_names_for_ids(d, optim):
    """id -> parameter name (spec: per stage, sorted ids against the stage's leading weight_map entries).
    `d` is the model folder."""
    idx = _find_index(d, MODEL_INDEXES)
    if idx is None:
        raise ColossalFormatError("NoModelIndex", "naming optimizer state needs the model index next to it")
    _meta, wm = _load_index(idx)
    model = None
    names_by_stage = {}
    for name, fn in wm.items():
        names_by_stage.setdefault(_stage(fn), []).append(name)
    all_ids = sorted(i for g in optim["param_groups"] for i in g["params"])
    ids_by_stage = {}
    if len(names_by_stage) == 1:
        ids_by_stage[next(iter(names_by_stage))] = all_ids
    else:
        for pid in all_ids:
            if pid not in optim["files"]:
                raise ColossalFormatError("UnplacedId", f"param id {pid} has no state, so its stage is unknown")
            ids_by_stage.setdefault(_stage(optim["files"][pid]), []).append(pid)
    mapping = {}
    for s, ids in sorted(ids_by_stage.items()):
        names = names_by_stage.get(s, [])
        if len(ids) > len(names):
            raise ColossalFormatError("ParamOrderMismatch", f"stage {s}: {len(ids)} ids, {len(names)} model entries")
        mapping.update(zip(ids, names))
    for pid, name in mapping.items():
        st = optim["state"].get(pid, {})
        ea = st.get("exp_avg")
        if ea is not None:
            if model is None:
                model = load_hybrid_model(d)
            if list(ea.shape) != list(model[name].shape):
                raise ColossalFormatError("ParamOrderMismatch",
                                          f"id {pid} -> {name}: exp_avg {ea.shape} vs parameter {model[name].shape}")
    return mapping


def load_hybrid_optim_by_name(optim_dir, model_dir):
    optim = load_hybrid_optim(optim_dir)
    names = param_names_for_ids(model_dir, optim)
    state = {names[pid]: st for pid, st in sorted(optim["state"].items())}
    groups = []
    for g in optim["param_groups"]:
        g = dict(g)
        g["params"] = [names[i] for i in g["params"]]
        groups.append(g)
    return {"state": state, "param_groups": groups}
