"""Shared helpers for the statedict test-fixture generators and checkers.

Run everything with /usr/bin/python3 (Debian's python3-torch 1.13 + numpy).

Manifest convention (see README.md): one JSON object per case,
    {"format": ..., "tensors": {NAME: {"dtype", "shape", "sha256"}},
     "values": {NAME: json}, "aliases": {NAME: EARLIER_NAME}}
NAME is the dotted path of a leaf: str(key) of each dict key, list/tuple
indices as decimal ints, joined with ".".
"""
import hashlib
import importlib.util
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM_DIR = os.path.join(HERE, "sitecustomize_shim")


def install_shim():
    """Load the dataclass shim in this interpreter and export it to children.

    The shim is loaded by file path because Debian's own sitecustomize has
    already been imported by the time a script runs.  PYTHONPATH is also set
    so that processes started with the 'spawn' method pick it up as their
    sitecustomize before anything else is imported.
    """
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if SHIM_DIR not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([SHIM_DIR] + parts)
    if "_statedict_sitecustomize_shim" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "_statedict_sitecustomize_shim", os.path.join(SHIM_DIR, "sitecustomize.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)


# --------------------------------------------------------------------------- dtypes
# safetensors names; C128 is statedict's own name for complex128.
TORCH_DTYPE_NAMES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "int32": "I32",
    "int64": "I64", "float16": "F16", "bfloat16": "BF16", "float32": "F32",
    "float64": "F64", "complex64": "C64", "complex128": "C128",
}

# element size in bits, for every name a manifest may carry
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64, "C128": 128,
}


def dtype_name(torch_dtype):
    name = str(torch_dtype).replace("torch.", "")
    if name not in TORCH_DTYPE_NAMES:
        raise ValueError(f"no manifest name for dtype {torch_dtype}")
    return TORCH_DTYPE_NAMES[name]


def torch_dtype(name):
    import torch
    for k, v in TORCH_DTYPE_NAMES.items():
        if v == name:
            return getattr(torch, k)
    raise ValueError(f"torch 1.13 has no dtype for {name}")


def tensor_bytes(t):
    """Elements of t, row-major, little-endian, no padding."""
    import torch
    t = t.detach()
    if t.layout != torch.strided:
        raise ValueError("only strided tensors are supported")
    t = t.cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    a = t.numpy()
    if a.dtype.byteorder == ">":  # never on the hosts we run on, but be exact
        a = a.byteswap().newbyteorder()
    return a.tobytes(order="C")


def sha256_hex(b):
    return hashlib.sha256(b).hexdigest()


def tensor_entry(t):
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "sha256": sha256_hex(tensor_bytes(t))}


# --------------------------------------------------------------------------- values
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def json_value(v):
    """Encode a non-tensor leaf for a manifest.

    int within int64 -> JSON int; other ints -> {"int": "<decimal>"};
    finite float -> JSON float (Python repr, always with '.' or 'e');
    nan/inf -> {"float": null, "repr": "nan" | "inf" | "-inf"};
    bytes -> {"bytes_hex": "..."}; str, bool, None -> themselves.
    Anything else -> {"object": "<module>.<qualname>", "repr": repr(v)}.
    """
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        if INT64_MIN <= v <= INT64_MAX:
            return int(v)
        return {"int": str(int(v))}
    if isinstance(v, float):
        if math.isfinite(v):
            return float(v)
        return {"float": None, "repr": repr(v)}
    if isinstance(v, (bytes, bytearray)):
        return {"bytes_hex": bytes(v).hex()}
    t = type(v)
    return {"object": f"{t.__module__}.{t.__qualname__}", "repr": repr(v)}


def values_equal(a, b):
    """Type-aware equality of two manifest JSON values (1 != 1.0, True != 1)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return a == b


# --------------------------------------------------------------------------- flatten
def is_tensor(x):
    import torch
    return isinstance(x, torch.Tensor)


def iter_leaves(obj, prefix=()):
    """Yield (path_tuple, leaf) depth-first in container order.

    dict / OrderedDict: keys in insertion order; list / tuple: indices.
    Tensors (incl. nn.Parameter and ShardedTensor) are leaves, as is
    everything that is not a dict, list or tuple.
    """
    if is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_leaves(v, prefix + (k,))
    elif isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):  # not namedtuples
        for i, v in enumerate(obj):
            yield from iter_leaves(v, prefix + (i,))
    else:
        yield prefix, obj


def dotted(path):
    return ".".join(str(p) for p in path)


def storage_key(t):
    """Identity of the storage a tensor views, or None for storage-less/empty ones."""
    try:
        st = t.storage()
    except Exception:
        return None
    if st.size() == 0 or st.data_ptr() == 0:
        return None
    return (str(t.device), st.data_ptr(), st.size(), str(st.dtype))


def flatten(obj, tensor_entry_fn=tensor_entry):
    """Return (tensors, values, aliases) manifest maps for a nested object."""
    tensors, values, aliases = {}, {}, {}
    first_by_storage = {}
    for path, leaf in iter_leaves(obj):
        name = dotted(path)
        if name in tensors or name in values:
            raise ValueError(f"duplicate dotted name {name!r}")
        if is_tensor(leaf):
            tensors[name] = tensor_entry_fn(leaf)
            key = storage_key(leaf)
            if key is not None:
                if key in first_by_storage:
                    aliases[name] = first_by_storage[key]
                else:
                    first_by_storage[key] = name
        else:
            values[name] = json_value(leaf)
    return tensors, values, aliases


def dict_attributes(obj, prefix=()):
    """Python attributes carried by dict subclasses (e.g. state_dict()._metadata).

    Returns {dotted_path_of_dict: {attr: json}}; the top level is "".
    """
    out = {}
    if isinstance(obj, dict):
        attrs = getattr(obj, "__dict__", None)
        if attrs:
            out[dotted(prefix)] = {k: _plain_json(v) for k, v in attrs.items()}
        for k, v in obj.items():
            out.update(dict_attributes(v, prefix + (k,)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(dict_attributes(v, prefix + (i,)))
    return out


def _plain_json(v):
    if isinstance(v, dict):
        return {str(k): _plain_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain_json(x) for x in v]
    return json_value(v)


def make_manifest(fmt, obj=None, *, tensors=None, values=None, aliases=None, **extra):
    if obj is not None:
        t, v, a = flatten(obj)
        tensors = {**t, **(tensors or {})}
        values = {**v, **(values or {})}
        aliases = {**a, **(aliases or {})}
    m = {"format": fmt, "tensors": tensors or {}, "values": values or {}, "aliases": aliases or {}}
    m.update({k: v for k, v in extra.items() if v is not None})
    return m


def write_manifest(outdir, case, manifest):
    path = os.path.join(outdir, f"{case}.manifest.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(dumps_manifest(manifest))
    os.replace(tmp, path)
    return path


def dumps_manifest(m):
    """JSON text of a manifest: one line per tensor / value / alias entry."""
    def j(x):
        return json.dumps(x, ensure_ascii=False, allow_nan=False)

    items = list(m.items())
    lines = ["{"]
    for i, (k, v) in enumerate(items):
        comma = "," if i + 1 < len(items) else ""
        if isinstance(v, dict) and v and k in ("tensors", "values", "aliases"):
            lines.append(f" {j(k)}: {{")
            sub = list(v.items())
            for n, (kk, vv) in enumerate(sub):
                lines.append(f"  {j(kk)}: {j(vv)}" + ("," if n + 1 < len(sub) else ""))
            lines.append(" }" + comma)
        else:
            lines.append(f" {j(k)}: {j(v)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def load_manifest(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)
