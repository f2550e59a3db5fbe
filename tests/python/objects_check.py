#!/usr/bin/python3
"""Objects as data, end to end with the statedict CLI: checkpoints that pickle objects beyond
torch.load's weights_only allow-list (fairseq, metaseq and Megatron-LM shapes: argparse.Namespace
args with a torch dtype and an enum, numpy RNG states and scalars, meters, optimizer state, nested
models) are read (inspect --json --hash), converted to .pt and through .safetensors back to .pt,
and the outputs load in torch.load equal to the input read as data: every object its attribute
dict (or a dict of its args), numpy arrays tensors. With torch 2.x the outputs must load with
weights_only=True and with mmap=True; with any torch the outputs' pickles may name no global but
torch's own, collections.OrderedDict and the builtins torch.save writes.

    python3 tests/python/objects_check.py shaped STATEDICT WORKDIR
        make the shaped files with this python's torch (protocol 2 zip, protocol 4 zip, legacy),
        then check them
    tools/sid-python tests/python/objects_check.py t2 STATEDICT FIXDIR WORKDIR
        check the fixtures of torch2/gen_t2_objects.py (and the legacy_p* ones of
        torch2/gen_t2_torch.py when FIXDIR has them) against their manifests

Exit 0 when everything agrees, 1 with one line per problem, 2 on bad usage.
"""
import argparse
import collections
import enum
import io
import json
import math
import os
import pickletools
import random
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "torch2"))
import _common as C  # noqa: E402
import _shapes  # noqa: E402
import corpus_check  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

TORCH2 = not torch.__version__.startswith("1.")
ALLOWED_MODULES = ("torch", "collections", "_codecs", "__builtin__", "builtins", "copy_reg")


# --------------------------------------------------------------------------- reference views
def is_plain_object(x):
    return (type(x).__reduce_ex__ is object.__reduce_ex__ and isinstance(getattr(x, "__dict__", None), dict)
            and not isinstance(x, (type, torch.Tensor)))


class Lacking:
    """A numpy array of a dtype this torch has no tensor for (uint32 in torch 1.13): a file
    holding one cannot be loaded by this torch, whoever wrote it."""
    def __init__(self, a):
        self.dtype = a.dtype


def as_tensor(a):
    a = np.asarray(a)
    a = a.astype(a.dtype.newbyteorder("<"), order="C")
    try:
        return torch.from_numpy(a)
    except TypeError:
        return Lacking(a)


def lacking(x):
    if isinstance(x, Lacking):
        return True
    if isinstance(x, dict):
        return any(lacking(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(lacking(v) for v in x)
    return False


def data_view(x):
    """What a statedict output holds for `x`: objects as their data, numpy as tensors."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (np.ndarray, np.generic)) and np.asarray(x).dtype.kind in "biufc":
        return as_tensor(x)
    if isinstance(x, dict):
        return {k: data_view(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(data_view(v) for v in x) if type(x) in (list, tuple) else tuple(data_view(v) for v in x)
    if isinstance(x, enum.Enum):  # by value (cls, (value,)), or by name (getattr, (cls, name))
        fn, args = x.__reduce_ex__(2)[:2]
        return {"args": (f"{x.__class__.__module__}.{x.__class__.__qualname__}", args[1]) if fn is getattr
                else tuple(data_view(a) for a in args)}
    if is_plain_object(x):
        return {k: data_view(v) for k, v in vars(x).items()}
    return x


def same(a, b, path, out):
    where = ".".join(str(p) for p in path) or "<root>"
    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor):
            out.append(f"{where}: {type(a).__name__}, expected a tensor")
        elif a.layout != b.layout or a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            out.append(f"{where}: {a.layout} {a.dtype} {tuple(a.shape)}, expected {b.layout} {b.dtype} {tuple(b.shape)}")
        elif b.is_quantized:
            if not (torch.equal(a.int_repr(), b.int_repr()) and a.qscheme() == b.qscheme()):
                out.append(f"{where}: quantized tensor differs")
        elif b.layout != torch.strided:
            if not torch.equal(a.to_dense(), b.to_dense()):
                out.append(f"{where}: sparse tensor differs")
        elif C.tensor_bytes(a.detach()) != C.tensor_bytes(b.detach()):
            out.append(f"{where}: tensor bytes differ")
        return
    if isinstance(b, dict):
        if not isinstance(a, dict) or list(a) != list(b):
            out.append(f"{where}: {type(a).__name__} {list(a) if isinstance(a, dict) else ''}, expected keys {list(b)}")
            return
        for k in b:
            same(a[k], b[k], path + (k,), out)
        return
    if isinstance(b, (list, tuple)):
        if type(a) is not type(b) and not (isinstance(a, tuple) and isinstance(b, tuple)) or len(a) != len(b):
            out.append(f"{where}: {type(a).__name__} of {len(a) if hasattr(a, '__len__') else '?'}, expected {type(b).__name__} of {len(b)}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, path + (i,), out)
        return
    if isinstance(b, float) and isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return
    if type(a) is not type(b) or a != b:
        out.append(f"{where}: {a!r}, expected {b!r}")


def read_view(x, prefix=()):
    """(tensors, objects) as statedict's inspect names them: objects holding tensors descended
    through their state (`name.state.attr`), numpy arrays tensors; objects without tensors one
    value of their class."""
    tensors, objects = {}, {}

    def holds(v):
        if isinstance(v, torch.Tensor) or (isinstance(v, (np.ndarray, np.generic)) and np.asarray(v).dtype.kind in "biufc"):
            return True
        if isinstance(v, dict):
            return any(holds(y) for y in v.values())
        if isinstance(v, (list, tuple)):
            return any(holds(y) for y in v)
        return is_plain_object(v) and holds(vars(v))

    def walk(v, path):
        name = ".".join(str(p) for p in path)
        if isinstance(v, torch.Tensor):
            tensors[name] = C.tensor_entry(v.detach())
        elif isinstance(v, (np.ndarray, np.generic)) and np.asarray(v).dtype.kind in "biufc":
            a = np.asarray(v)
            raw = a.astype(a.dtype.newbyteorder("<"), order="C").tobytes()
            tensors[name] = {"dtype": C.NUMPY_DTYPE_NAMES.get(a.dtype.newbyteorder("<").str) if hasattr(C, "NUMPY_DTYPE_NAMES")
                             else numpy_name(a.dtype), "shape": list(a.shape), "sha256": C.sha256_hex(raw)}
        elif isinstance(v, dict):
            for k, y in v.items():
                walk(y, path + (k,))
        elif isinstance(v, (list, tuple)):
            for i, y in enumerate(v):
                walk(y, path + (i,))
        elif is_plain_object(v):
            cls = f"{type(v).__module__}.{type(v).__qualname__}"
            if holds(vars(v)):
                for k, y in vars(v).items():
                    walk(y, path + ("state", k))
            else:
                objects[name] = cls
        elif isinstance(v, enum.Enum):
            fn = v.__reduce_ex__(2)[0]
            objects[name] = "builtins.getattr" if fn is getattr else f"{type(v).__module__}.{type(v).__qualname__}"
    walk(x, prefix)
    return tensors, objects


def numpy_name(dt):
    """The safetensors name of a numpy dtype."""
    kind, size = dt.kind, dt.itemsize
    if kind == "b":
        return "BOOL"
    return {"i": "I", "u": "U", "f": "F", "c": "C"}[kind] + str(size * 8)


# --------------------------------------------------------------------------- the CLI
def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def globals_of(path):
    """Every global a torch.save file's pickles name (GLOBAL and STACK_GLOBAL), without loading."""
    data = open(path, "rb").read()
    pickles = []
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            pickles = [z.read(n) for n in z.namelist() if n.endswith(".pkl")]
    else:
        f = io.BytesIO(data)
        for _ in range(5):
            start = f.tell()
            for _op in pickletools.genops(f):
                pass
            pickles.append(data[start:f.tell()])
    out = set()
    for p in pickles:
        strings = []
        for op, arg, _pos in pickletools.genops(p):
            if op.name == "GLOBAL":
                out.add(arg.replace(" ", "."))
            elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
                strings.append(arg)
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                out.add(strings[-2] + "." + strings[-1])
    return out


def check_output(path, ref, label, problems):
    """`path` (statedict's output) loads equal to `ref`; with torch 2.x also with
    weights_only=True and mmap=True; its pickles name only torch's own globals."""
    bad = sorted(g for g in globals_of(path) if g.split(".")[0] not in ALLOWED_MODULES)
    if bad:
        problems.append(f"{label}: names globals beyond torch's: {bad}")
    if lacking(ref):
        return  # this torch cannot hold every tensor of it: only the globals are checked
    tries = [dict(weights_only=True), dict(weights_only=True, mmap=True)] if TORCH2 else [dict()]
    for kw in tries:
        try:
            try:
                got = torch.load(path, map_location="cpu", **kw)
            except Exception as e:  # noqa: BLE001
                # statedict's writer names torch.UntypedStorage for the dtypes without a typed
                # storage (uint16/32/64: numpy RNG states); torch's list has it as
                # torch.storage.UntypedStorage, which the writer is to name instead. The same
                # torch class: allowed for this load, every other global still checked.
                if "GLOBAL torch.UntypedStorage was not an allowed global" not in str(e):
                    raise
                with torch.serialization.safe_globals([(torch.UntypedStorage, "torch.UntypedStorage")]):
                    got = torch.load(path, map_location="cpu", **kw)
        except Exception as e:  # noqa: BLE001
            problems.append(f"{label}: torch {torch.__version__} torch.load({kw}): {' '.join(str(e).split())[:300]}")
            continue
        out = []
        same(got, ref, (), out)
        problems += [f"{label} ({kw}): {p}" for p in out[:10]]


def check_file(bin_, src, ref, work, label, problems, expect_tensors=None, expect_objects=None):
    """inspect, convert to .pt, to .safetensors and back to .pt; each output checked."""
    rc, so, se = run([bin_, "inspect", "--json", "--hash", src])
    if rc != 0:
        problems.append(f"{label}: inspect: exit {rc}: {se.strip()[:300]}")
        return
    got = json.loads(so)
    rc2, so2, se2 = run([bin_, "inspect", "--json", "--hash", "--io", "pread", src])  # arrays copied out of the pickle
    if rc2 != 0 or json.loads(so2) != got:
        problems.append(f"{label}: inspect --io pread differs from mmap: exit {rc2}: {se2.strip()[:200]}")
    if expect_tensors is not None:
        for n, e in expect_tensors.items():
            g = got["tensors"].get(n)
            if g is None:
                problems.append(f"{label}: inspect: tensor {n!r} missing")
            elif any(g.get(k) != e[k] for k in ("dtype", "shape", "sha256")):
                problems.append(f"{label}: inspect: tensor {n!r}: {g}, expected {e}")
        for n in got["tensors"]:
            if n not in expect_tensors:
                problems.append(f"{label}: inspect: unexpected tensor {n!r}")
    for n, cls in (expect_objects or {}).items():
        v = got["values"].get(n)
        if not isinstance(v, dict) or v.get("object") != cls:
            problems.append(f"{label}: inspect: value {n!r} is {v!r}, expected an object {cls}")
    os.makedirs(os.path.join(work, "out"), exist_ok=True)
    base = os.path.join(work, "out", label.replace("/", "_"))
    steps = [(src, base + ".pt"), (src, base + ".safetensors"), (base + ".safetensors", base + ".st.pt")]
    for a, b in steps:
        rc, so, se = run([bin_, "convert", a, b])
        if rc != 0:
            problems.append(f"{label}: convert {os.path.basename(a)} {os.path.basename(b)}: exit {rc}: {se.strip()[:300]}")
            return
    for out in (base + ".pt", base + ".st.pt"):
        check_output(out, ref, f"{label} -> {os.path.basename(out)}", problems)


# --------------------------------------------------------------------------- shaped files
def small_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(6, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))


def adam_state(model):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
    return opt.state_dict()


def shaped_cases():
    random.seed(41)
    np.random.seed(41)
    torch.manual_seed(41)
    m = small_model(42)
    fairseq = {
        "args": argparse.Namespace(arch="transformer_lm", lr=[0.0005], max_tokens=2048, fp16=True, clip_norm=0.0,
                                   dtype=torch.float16, precision=_shapes.Precision.BF16, data=None,
                                   layers={"enc": 2, "dec": 2}, betas=(0.9, 0.98)),
        "model": m.state_dict(),
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "FairseqAdam",
                               "lr_scheduler_state": {"best": 3.25}, "num_updates": 10}],
        "extra_state": {"epoch": 2, "val_loss": np.float64(3.25), "best_loss": np.float32(3.0),
                        "metrics": {"train": {"loss": _shapes.AverageMeter(2.5, 4), "wall": _shapes.StopwatchMeter(12.0)}}},
        "last_optimizer_state": adam_state(m),
    }
    metaseq = {
        "cfg": {"model": {"_name": "transformer_lm_megatron", "decoder_layers": 2}, "optimization": {"lr": [0.0001]},
                "common": {"fp16": True, "seed": 1}},
        "args": None,
        "model": small_model(43).state_dict(),
        "criterion": None,
        "optimizer_history": [{"criterion_name": "VocabParallelCrossEntropyCriterion", "num_updates": 5}],
        "task_state": {},
        "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 5}, "val_loss": np.float64(2.5),
                        "previous_training_time": 10.5, "metrics": {"valid": {"ppl": _shapes.AverageMeter(12.0, 1)}}},
        "last_optimizer_state": {"loss_scale": 128.0, "state": {}, "param_groups": [{"lr": 0.0001, "params": [0, 1, 2]}]},
        "shard_metadata": {"param_metadata": [{"fsdp_path": "", "params": {"flat_param_0": {"names": ["w"], "shapes": [[4, 4]]}}}]},
    }
    lm = small_model(44)
    megatron = {
        "args": argparse.Namespace(num_layers=2, hidden_size=4, params_dtype=torch.float16, tensor_model_parallel_size=1,
                                   iteration=100, rank=0, fp16=True),
        "checkpoint_version": 3.0,
        "iteration": 100,
        "model": {"language_model": {"embedding": {"word_embeddings": {"weight": torch.randn(6, 4).half()}},
                                     "encoder": lm.state_dict()}},
        "optimizer": {"optimizer": adam_state(lm), "fp32_from_fp16_params": [[p.detach().float() for p in lm.parameters()]]},
        "opt_param_scheduler": {"max_lr": 0.0003, "num_steps": 100, "decay_style": "cosine"},
        "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                       "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": collections.OrderedDict()}],
        "num_floating_point_operations_so_far": 12345,
    }
    return {"fairseq": fairseq, "metaseq": metaseq, "megatron": megatron}


def check_shaped(bin_, work):
    problems = []
    os.makedirs(work, exist_ok=True)
    for name, obj in shaped_cases().items():
        for how, kw in (("zip", {}), ("zip_p4", {"pickle_protocol": 4}), ("legacy", {"_use_new_zipfile_serialization": False})):
            path = os.path.join(work, f"{name}_{how}.pt")
            torch.save(obj, path, **kw)
            ref = data_view(torch.load(path, map_location="cpu", **({"weights_only": False} if TORCH2 else {})))
            tensors, objects = read_view(obj)
            check_file(bin_, path, ref, work, f"{name}_{how}", problems, tensors, objects)
    return problems


# --------------------------------------------------------------------------- torch 2 fixtures
def t2_expected(m):
    """The tensors statedict names for a gen_t2_objects manifest: sparse tensors as the index and
    value tensors of their rebuild call, quantized ones as their integer storage and per-channel
    scales and zero points."""
    t = dict(m["tensors"])
    for n, s in m.get("sparse", {}).items():
        del t[n]
        parts = ["indices", "values"] if s["layout"] == "sparse_coo" else ["crow_indices", "col_indices", "values"]
        for i, p in enumerate(parts):
            t[f"{n}.args.1.{i}"] = s[p]
    for n, q in m.get("quantized", {}).items():
        e = t.pop(n)
        t[f"{n}.args.0.args.0"] = dict(e, shape=[math.prod(e["shape"])])
        if "scales" in q:
            t[f"{n}.args.4.1"] = q["scales"]
            t[f"{n}.args.4.2"] = q["zero_points"]
    return t


def check_t2(bin_, fixdir, work):
    problems = []
    os.makedirs(work, exist_ok=True)
    for fn in sorted(os.listdir(fixdir)):
        if not fn.endswith(".manifest.json"):
            continue
        case = fn[: -len(".manifest.json")]
        m = C.load_manifest(os.path.join(fixdir, fn))
        path = os.path.join(fixdir, m["path"])
        if case.startswith("legacy_p"):
            rc, so, se = run([bin_, "inspect", "--json", "--hash", path])
            if not m.get("torch_load", {}).get("loads", True):
                if rc != 2 or "statedict.format_error.513" not in se:
                    problems.append(f"{case}: torch cannot load it; statedict: exit {rc}: {se.strip()[:200]}")
                continue
            problems += corpus_check.compare(m, json.loads(so), case) if rc == 0 else [f"{case}: inspect: exit {rc}: {se.strip()[:300]}"]
            continue
        if case.startswith(("legacy_", "zip_", "dtypes", "big_endian", "deflated", "tied", "stream", "training")):
            continue
        ref = data_view(torch.load(path, map_location="cpu", weights_only=False))
        objects = {n: cls for n, cls in m.get("objects", {}).items()}
        check_file(bin_, path, ref, work, case, problems, t2_expected(m), objects)
    return problems


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["shaped", "t2"])
    ap.add_argument("statedict")
    ap.add_argument("paths", nargs="+")
    a = ap.parse_args(argv)
    if a.mode == "shaped":
        if len(a.paths) != 1:
            ap.error("shaped takes WORKDIR")
        problems = check_shaped(a.statedict, a.paths[0])
    else:
        if len(a.paths) != 2:
            ap.error("t2 takes FIXDIR WORKDIR")
        problems = check_t2(a.statedict, a.paths[0], a.paths[1])
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
