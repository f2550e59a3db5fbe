"""Manifest writing: the expected consolidated result of a fixture, in the project's shared convention.

    {"format": "...", "tensors": {NAME: {"dtype": "F32", "shape": [..], "sha256": "<hex>"}},
     "values": {NAME: <json>}, "aliases": {ALIAS_NAME: OWNER_NAME}}

``sha256`` is the SHA-256 of the tensor's elements, row-major, little-endian, no padding.
"""
import hashlib
import json
import math
import os
import sys

import torch

SAFETENSORS_DTYPE = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

# Same-width integer views let numpy hand out the raw bytes of dtypes it lacks (bfloat16).
_RAW_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.bool: torch.uint8}


def tensor_bytes(t):
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return b""
    view = _RAW_VIEW.get(t.dtype)
    arr = (t.view(view) if view is not None else t).numpy()
    data = arr.tobytes(order="C")
    if sys.byteorder != "little":
        data = arr.byteswap().tobytes(order="C")
    return data


def tensor_entry(t):
    return {
        "dtype": SAFETENSORS_DTYPE[t.dtype],
        "shape": [int(d) for d in t.shape],
        "sha256": hashlib.sha256(tensor_bytes(t)).hexdigest(),
    }


def json_value(v):
    """A non-tensor leaf as JSON (same encoding as the other fixture generators: non-finite floats
    become {"float": null, "repr": ...})."""
    if v is None or isinstance(v, (bool, str, int)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": None, "repr": repr(v)}
    raise TypeError(f"no JSON form for {type(v)}")


def leaves(name, v):
    """Dotted-path leaves of a value: list/tuple items get their index, dict items their str(key)."""
    if isinstance(v, (list, tuple)):
        out = []
        for i, x in enumerate(v):
            out.extend(leaves(f"{name}.{i}", x))
        return out
    if isinstance(v, dict):
        out = []
        for k, x in v.items():
            out.extend(leaves(f"{name}.{k}", x))
        return out
    return [(name, json_value(v))]


class Manifest:
    def __init__(self, fmt):
        self.fmt = fmt
        self.tensors = {}
        self.values = {}
        self.aliases = {}

    def add_tensor(self, name, t):
        if name in self.tensors:
            raise ValueError(f"duplicate manifest tensor {name}")
        self.tensors[name] = tensor_entry(t)

    def add_value(self, name, v):
        for n, x in leaves(name, v):
            if n in self.values:
                raise ValueError(f"duplicate manifest value {n}")
            self.values[n] = x

    def to_json(self):
        return {"format": self.fmt, "tensors": self.tensors, "values": self.values, "aliases": self.aliases}

    def write(self, path):
        """One line per tensor / value / alias entry, written to a temporary name then renamed."""
        def j(x):
            return json.dumps(x, ensure_ascii=False, allow_nan=False)

        m = self.to_json()
        lines = ["{"]
        items = list(m.items())
        for i, (k, v) in enumerate(items):
            comma = "," if i + 1 < len(items) else ""
            if isinstance(v, dict) and v:
                lines.append(f" {j(k)}: {{")
                sub = list(v.items())
                for n, (kk, vv) in enumerate(sub):
                    lines.append(f"  {j(kk)}: {j(vv)}" + ("," if n + 1 < len(sub) else ""))
                lines.append(" }" + comma)
            else:
                lines.append(f" {j(k)}: {j(v)}{comma}")
        lines.append("}")
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, path)


def compare(expected, actual, what):
    """Raise with the first difference between two manifest dicts."""
    for key in ("format", "tensors", "values", "aliases"):
        e, a = expected[key], actual[key]
        if e == a:
            continue
        if isinstance(e, dict) and isinstance(a, dict):
            missing = [k for k in e if k not in a]
            extra = [k for k in a if k not in e]
            if missing or extra:
                raise AssertionError(f"{what}: {key}: missing {missing[:5]}, unexpected {extra[:5]}")
            for k in e:
                if e[k] != a[k]:
                    raise AssertionError(f"{what}: {key}.{k}: expected {e[k]}, got {a[k]}")
            if list(e) != list(a):
                raise AssertionError(f"{what}: {key}: order differs: {list(e)} vs {list(a)}")
        raise AssertionError(f"{what}: {key}: expected {e}, got {a}")
