"""Helpers for the torch 2.x fixture generators and checkers (run under tools/sid-python).

Extends ../_common.py (manifests, flattening, value encoding) with the dtypes that torch 2.x
adds and with manifest entries for things that are not plain strided tensors (numpy arrays,
sparse and quantized tensors). See README.md in this folder.
"""
import enum
import os
import pickletools
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402

# torch dtype -> manifest name. The safetensors names where safetensors has the dtype; C32
# (complex32), BITS* and F4_X2 are this folder's own names for dtypes safetensors cannot store.
# float4_e2m1fn_x2 packs two F4 values per byte; torch counts bytes (an [n, k] tensor holds 2k
# values per row), so a torch file's manifest calls it F4_X2 with torch's shape, while a
# safetensors file calls it F4 with the number of 4-bit values (last dimension doubled).
TORCH2_DTYPE_NAMES = dict(C.TORCH_DTYPE_NAMES)
TORCH2_DTYPE_NAMES.update({
    "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0", "float4_e2m1fn_x2": "F4_X2", "complex32": "C32",
    "bits8": "BITS8", "bits16": "BITS16", "bits1x8": "BITS1X8", "bits2x4": "BITS2X4",
    "bits4x2": "BITS4X2",
})
C.DTYPE_BITS.update({"F4_X2": 8, "C32": 32, "BITS8": 8, "BITS16": 16, "BITS1X8": 8,
                     "BITS2X4": 8, "BITS4X2": 8})

# numpy dtype kind+size -> manifest name
NUMPY_NAMES = {"b1": "BOOL", "u1": "U8", "i1": "I8", "i2": "I16", "u2": "U16", "i4": "I32",
               "u4": "U32", "i8": "I64", "u8": "U64", "f2": "F16", "f4": "F32", "f8": "F64",
               "c8": "C64", "c16": "C128"}


def dtype_name(torch_dtype):
    name = str(torch_dtype).replace("torch.", "")
    if name not in TORCH2_DTYPE_NAMES:
        raise ValueError(f"no manifest name for dtype {torch_dtype}")
    return TORCH2_DTYPE_NAMES[name]


def torch_dtype(name):
    import torch
    for k, v in TORCH2_DTYPE_NAMES.items():
        if v == name and hasattr(torch, k):
            return getattr(torch, k)
    raise ValueError(f"torch has no dtype for {name}")


def strided_bytes(t):
    """Elements of a strided tensor, row-major, little-endian (the host's order), no padding."""
    import torch
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return b""
    flat = t.reshape(-1)
    if flat.stride(0) != 1:
        # .contiguous() keeps the stride of a size-1 dimension (a [n, 1] view with stride 5
        # counts as contiguous), and such a tensor cannot be viewed as bytes: a fresh 1-d copy.
        flat = torch.empty(t.numel(), dtype=t.dtype)
        flat.copy_(t.reshape(-1))
    return bytes(flat.view(torch.uint8).numpy().tobytes())


def numpy_bytes(a):
    import numpy as np
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and sys.byteorder == "big"):
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.tobytes(order="C")


def numpy_name(dt):
    key = dt.kind + str(dt.itemsize)
    if key not in NUMPY_NAMES:
        raise ValueError(f"no manifest name for numpy dtype {dt}")
    return NUMPY_NAMES[key]


def tensor_entry(t):
    """Manifest entry of a leaf that holds array data.

    torch strided tensor: its dtype, shape, sha256. Sparse tensor: of its dense equivalent.
    Quantized tensor: of its integer representation (int_repr). numpy array or scalar: of its
    elements in row-major little-endian order, whatever its memory order or byte order.
    """
    import numpy as np
    if isinstance(t, (np.ndarray, np.generic)):
        a = np.asarray(t)
        return {"dtype": numpy_name(a.dtype), "shape": list(a.shape),
                "sha256": C.sha256_hex(numpy_bytes(a))}
    import torch
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        t = t.int_repr()
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "sha256": C.sha256_hex(strided_bytes(t))}


def is_array(x):
    """torch tensors, numpy arrays and numpy scalars (np.float64 too, though it is a float)."""
    import numpy as np
    import torch
    if isinstance(x, np.generic):
        return x.dtype.kind in "biufc"
    return isinstance(x, (torch.Tensor, np.ndarray))


def iter_leaves(obj, prefix=(), expand_objects=False):
    """Like _common.iter_leaves, with numpy arrays and numpy scalars as array leaves.

    expand_objects: objects with a __dict__ that are no tensors (argparse.Namespace, ...)
    are containers of their attributes, as a data-only reader sees their pickled state.
    """
    import torch
    if isinstance(obj, torch.Tensor) or is_array(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_leaves(v, prefix + (k,), expand_objects)
    elif isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        for i, v in enumerate(obj):
            yield from iter_leaves(v, prefix + (i,), expand_objects)
    elif expand_objects and type(obj).__reduce_ex__ is object.__reduce_ex__ and \
            isinstance(getattr(obj, "__dict__", None), dict) and not isinstance(obj, type):
        for k, v in vars(obj).items():
            yield from iter_leaves(v, prefix + (k,), expand_objects)
    else:
        yield prefix, obj


def storage_key(t):
    import torch
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_quantized:
        return None
    try:
        st = t.untyped_storage()
    except Exception:
        return None
    if st.nbytes() == 0 or st.data_ptr() == 0:
        return None
    return (str(t.device), st.data_ptr(), st.nbytes())


def flatten(obj, expand_objects=False):
    """(tensors, values, aliases) manifest maps of a nested object (see _common.flatten)."""
    tensors, values, aliases = {}, {}, {}
    first = {}
    for path, leaf in iter_leaves(obj, (), expand_objects):
        name = C.dotted(path)
        if name in tensors or name in values:
            raise ValueError(f"duplicate dotted name {name!r}")
        if is_array(leaf):
            tensors[name] = tensor_entry(leaf)
            key = storage_key(leaf)
            if key is not None:
                if key in first:
                    aliases[name] = first[key]
                else:
                    first[key] = name
        elif isinstance(leaf, enum.Enum):      # IntEnum too: pickled as a call of its class
            t = type(leaf)
            values[name] = {"object": f"{t.__module__}.{t.__qualname__}", "repr": repr(leaf)}
        else:
            values[name] = C.json_value(leaf)
    return tensors, values, aliases


def describe(obj, expand_objects=False):
    t, v, a = flatten(obj, expand_objects)
    return {"tensors": t, "values": v, "aliases": a}


def leaf_map(obj, expand_objects=False):
    return {C.dotted(p): v for p, v in iter_leaves(obj, (), expand_objects)}


# --------------------------------------------------------------------------- torch files
def one_line(e):
    return " ".join(f"{type(e).__name__}: {e}".split())


def weights_only_result(path):
    """What torch.load(weights_only=True) does with the file: {"loads": bool, "error": ...}."""
    import torch
    try:
        torch.load(path, map_location="cpu", weights_only=True)
        return {"loads": True}
    except Exception as e:
        msg = one_line(e)
        i = msg.find("WeightsUnpickler error:")
        if i >= 0:
            msg = msg[i:]
            j = msg.find(" Check the documentation")
            if j > 0:
                msg = msg[:j]
        return {"loads": False, "error": msg[:300]}


def zip_info(path):
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
    names = [i.filename for i in infos]
    return {"archive_prefix": names[0].split("/", 1)[0], "records": names}


def record_offsets(path):
    """{record name: offset of its data in the file} of a zip."""
    out = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for i in z.infolist():
            f.seek(i.header_offset)
            h = f.read(30)
            n, m = int.from_bytes(h[26:28], "little"), int.from_bytes(h[28:30], "little")
            out[i.filename] = i.header_offset + 30 + n + m
    return out


def pickle_globals(data):
    """Sorted 'module.name' of every global a pickle references (GLOBAL and STACK_GLOBAL).

    Tracks the values pushed just before each STACK_GLOBAL, through the memo, without
    unpickling anything."""
    string_ops = ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8", "STRING",
                  "BINSTRING", "SHORT_BINSTRING")
    out, pushed, memo = set(), [], {}
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name == "GLOBAL":
            out.add(arg.replace(" ", "."))
            pushed.append(None)
        elif name == "STACK_GLOBAL":
            if len(pushed) >= 2 and isinstance(pushed[-2], str) and isinstance(pushed[-1], str):
                out.add(f"{pushed[-2]}.{pushed[-1]}")
            pushed.append(None)
        elif name in string_ops:
            pushed.append(arg)
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = pushed[-1] if pushed else None
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            pushed.append(memo.get(arg))
        else:
            pushed.append(None)
    return sorted(out)


def main_pickle(path):
    """The pickle bytes that hold the tree: data.pkl of a zip."""
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        return z.read(name)


def write_manifest(outdir, case, manifest):
    return C.write_manifest(outdir, case, manifest)


def make_manifest(fmt, desc, **extra):
    return C.make_manifest(fmt, tensors=desc["tensors"], values=desc["values"],
                           aliases=desc["aliases"], **extra)
