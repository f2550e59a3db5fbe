"""Small pieces the layout readers share: raw tensors, a restricted unpickler, manifest flattening.

A RawTensor is a tensor as bytes (row-major, little-endian) plus its safetensors dtype name and shape,
so a reader can hash and compare tensors of any dtype (including ones torch 1.13 lacks) without torch.
"""
import io
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as C  # noqa: E402


class RawTensor:
    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype, shape, data):
        self.dtype = dtype
        self.shape = [int(s) for s in shape]
        self.data = bytes(data)

    def entry(self):
        return {"dtype": self.dtype, "shape": list(self.shape), "sha256": C.sha256_hex(self.data)}

    def __repr__(self):
        return f"RawTensor({self.dtype}, {self.shape}, {len(self.data)} bytes)"


def raw_from_torch(t):
    return RawTensor(C.dtype_name(t.dtype), list(t.shape), C.tensor_bytes(t))


def to_torch(raw):
    """RawTensor -> torch tensor (dtypes torch 1.13 knows)."""
    import torch
    dt = C.torch_dtype(raw.dtype)
    if not raw.data:
        return torch.empty(raw.shape, dtype=dt)
    return torch.frombuffer(bytearray(raw.data), dtype=dt).reshape(raw.shape)


# --------------------------------------------------------------------------- unpickling
class ForbiddenGlobal(pickle.UnpicklingError):
    def __init__(self, module, name):
        super().__init__(f"the pickle names {module}.{name}, which is not allowed here")
        self.qualname = f"{module}.{name}"


SAFE_GLOBALS = frozenset({
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
    ("builtins", "complex"), ("builtins", "bytearray"), ("builtins", "slice"),
})


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles plain data only: no global but the few in `allowed` is ever resolved."""

    def __init__(self, data, allowed=SAFE_GLOBALS):
        super().__init__(io.BytesIO(data))
        self._allowed = allowed

    def find_class(self, module, name):
        if (module, name) in self._allowed:
            return super().find_class(module, name)
        raise ForbiddenGlobal(module, name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not allowed here")


def restricted_loads(data, allowed=SAFE_GLOBALS):
    return RestrictedUnpickler(data, allowed).load()


# --------------------------------------------------------------------------- flattening
def iter_leaves(obj, prefix=()):
    """(path, leaf) in container order; RawTensor and torch tensors are leaves (as _common.iter_leaves)."""
    if isinstance(obj, RawTensor) or C.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_leaves(v, prefix + (k,))
    elif isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        for i, v in enumerate(obj):
            yield from iter_leaves(v, prefix + (i,))
    else:
        yield prefix, obj


def flatten(obj):
    """(tensors, values) manifest maps of a nested object holding RawTensors or torch tensors."""
    tensors, values = {}, {}
    for path, leaf in iter_leaves(obj):
        name = C.dotted(path)
        if name in tensors or name in values:
            raise ValueError(f"two leaves are both named {name!r}")
        if isinstance(leaf, RawTensor):
            tensors[name] = leaf.entry()
        elif C.is_tensor(leaf):
            tensors[name] = C.tensor_entry(leaf)
        else:
            values[name] = C.json_value(leaf)
    return tensors, values
