#!/usr/bin/python3
"""Independent safetensors writer (pure Python + numpy) and its fixtures.

Usage: /usr/bin/python3 tests/python/gen_safetensors.py OUTDIR

Writes OUTDIR/<case>.safetensors and OUTDIR/<case>.manifest.json per case.

The writer reproduces the reference implementation's layout
(huggingface/safetensors `prepare` / `serialize`):
  * tensors sorted by dtype DEScending in the Dtype enum order DTYPE_ORDER,
    then by name ascending (byte-wise on UTF-8 == code-point order);
    data packed in that order with no gaps;
  * header JSON = one object: "__metadata__" first (only when metadata is
    given; its entries in ascending key order), then each tensor in offset order
    as {"dtype":..,"shape":[..],"data_offsets":[begin,end]} (keys in that order);
    compact separators (",", ":"), non-ASCII written as raw UTF-8, only '"',
    '\\' and control characters < 0x20 escaped (\\b \\f \\n \\r \\t, others
    \\u00xx with lower-case hex): json.dumps(..., separators=(",", ":"),
    ensure_ascii=False);
  * header padded with b" " to a multiple of 8 bytes; N = padded length.
`header_bytes()` is importable (torch_check.py --canonical uses it).
"""
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

DTYPE_ORDER = ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
               "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
               "C64", "F64", "I64", "U64"]
RANK = {d: i for i, d in enumerate(DTYPE_ORDER)}

NUMPY = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16,
         "F16": np.float16, "I32": np.int32, "U32": np.uint32, "F32": np.float32,
         "C64": np.complex64, "F64": np.float64, "I64": np.int64, "U64": np.uint64}


def nbytes(dtype, shape):
    n = 1
    for s in shape:
        n *= s
    bits = n * C.DTYPE_BITS[dtype]
    if bits % 8:
        raise ValueError(f"{dtype}{list(shape)} is not a whole number of bytes")
    return bits // 8


def reference_order(tensors):
    """tensors: {name: (dtype, shape, data_bytes)} -> names in reference write order."""
    return sorted(tensors, key=lambda n: (-RANK[tensors[n][0]], n.encode("utf-8")))


def header_bytes(tensors, metadata=None, order=None, dumps=None, pad=True):
    """Header (JSON + space padding) for tensors laid out in `order`.

    tensors: {name: (dtype, shape, data)}; order defaults to the reference order.
    Returns (header_bytes, order).
    """
    order = reference_order(tensors) if order is None else list(order)
    obj = {}
    if metadata is not None:
        obj["__metadata__"] = {k: metadata[k] for k in sorted(metadata, key=lambda s: s.encode())}
    off = 0
    for name in order:
        dtype, shape, data = tensors[name]
        n = nbytes(dtype, shape)
        if data is not None and len(data) != n:
            raise ValueError(f"{name}: {len(data)} data bytes, expected {n}")
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    if dumps is None:
        text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    else:
        text = dumps(obj)
    hb = text.encode("utf-8")
    if pad:
        hb += b" " * ((8 - len(hb) % 8) % 8)
    return hb, order


def serialize(tensors, metadata=None, order=None, dumps=None, pad=True):
    hb, order = header_bytes(tensors, metadata, order, dumps, pad)
    parts = [struct.pack("<Q", len(hb)), hb]
    parts += [tensors[n][2] for n in order]
    return b"".join(parts)


# --------------------------------------------------------------------------- data
def bf16_bits(a):
    """float32 array -> bfloat16 bit patterns (round to nearest even), as uint16."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(a)
    out = rounded.astype(np.uint16)
    out[nan] = 0x7FC0
    return out


def make(rng, dtype, shape):
    """Deterministic tensor data: returns (dtype, shape, little-endian bytes)."""
    shape = tuple(shape)
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if dtype == "BOOL":
        a = rng.integers(0, 2, n).astype(np.bool_)
    elif dtype in ("U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"):
        info = np.iinfo(NUMPY[dtype])
        a = rng.integers(info.min, info.max, n, dtype=NUMPY[dtype], endpoint=True)
    elif dtype in ("F16", "F32", "F64"):
        a = (rng.standard_normal(n) * 3).astype(NUMPY[dtype])
    elif dtype == "C64":
        a = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(np.complex64)
    elif dtype == "BF16":
        a = bf16_bits(rng.standard_normal(n).astype(np.float32))
    else:  # F8_*, F4, F6_*: raw bit patterns
        a = rng.integers(0, 256, nbytes(dtype, shape), dtype=np.uint8)
        return dtype, shape, a.tobytes()
    return dtype, shape, a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()


# --------------------------------------------------------------------------- cases
def _loose_dumps(obj):
    """Header text a sloppy writer could produce: indented, tensors by name
    descending, trailing spaces not to a multiple of 8 (still valid JSON)."""
    items = sorted(obj.items(), key=lambda kv: kv[0], reverse=True)
    return json.dumps(dict(items), indent=2) + "   "


def cases():
    rng = np.random.default_rng(1234)
    out = {}

    out["all_dtypes"] = dict(tensors={
        f"t_{d.lower()}": make(rng, d, shape) for d, shape in [
            ("BOOL", [3, 5]), ("U8", [7]), ("I8", [2, 3]), ("I16", [4]), ("U16", [2, 2]),
            ("F16", [3, 3]), ("BF16", [2, 5]), ("I32", [5]), ("U32", [1, 3]), ("F32", [2, 3, 4]),
            ("C64", [3]), ("F64", [4, 1]), ("I64", [3]), ("U64", [2]),
            ("F8_E5M2", [6]), ("F8_E4M3", [2, 3])]})

    out["exotic_dtypes"] = dict(tensors={
        "e8m0": make(rng, "F8_E8M0", [5]),
        "e4m3fnuz": make(rng, "F8_E4M3FNUZ", [2, 2]),
        "e5m2fnuz": make(rng, "F8_E5M2FNUZ", [3]),
        "f4": make(rng, "F4", [2, 4]),            # 8 elements -> 4 bytes
        "f6_e2m3": make(rng, "F6_E2M3", [4]),     # 4 elements -> 3 bytes
        "f6_e3m2": make(rng, "F6_E3M2", [2, 4]),  # 8 elements -> 6 bytes
        "f32": make(rng, "F32", [2])})

    out["scalar_0d"] = dict(tensors={
        "f32": make(rng, "F32", []), "i64": make(rng, "I64", []), "bf16": make(rng, "BF16", []),
        "bool": make(rng, "BOOL", [])})

    out["empty"] = dict(tensors={
        "e0": make(rng, "F32", [0]), "e3x0": make(rng, "I64", [3, 0]),
        "e0x0x2": make(rng, "BF16", [0, 0, 2]), "u8_e0": make(rng, "U8", [0]),
        "x": make(rng, "F32", [2])})

    # Not the reference order: odd-length U8/BOOL tensors first, so the F32,
    # F64 and I64 data that follow start at offsets that are not multiples of
    # their element size.  Still a valid file (offsets contiguous from 0).
    mis = {"a_u8": make(rng, "U8", [3]), "b_f32": make(rng, "F32", [2, 2]),
           "c_u8": make(rng, "U8", [5]), "d_f64": make(rng, "F64", [3]),
           "e_bool": make(rng, "BOOL", [1]), "f_i64": make(rng, "I64", [2]),
           "g_bf16": make(rng, "BF16", [3])}
    out["misaligned"] = dict(tensors=mis, order=list(mis), canonical=False)

    out["metadata"] = dict(
        tensors={"w": make(rng, "F32", [2, 2]), "b": make(rng, "F16", [2])},
        metadata={"format": "pt", "z_last": "1", "note": "h\u00e9llo \"quoted\"\n", "empty": ""})

    out["one_tensor"] = dict(tensors={"weight": make(rng, "F32", [3, 4])})

    many = {}
    kinds = ["F32", "F16", "BF16", "I32", "U8"]
    for i in range(5000):
        d = kinds[i % len(kinds)]
        many[f"layers.{i}.{d.lower()}"] = make(rng, d, [(i % 3) + 1])
    out["many_tensors"] = dict(tensors=many)

    out["unicode_names"] = dict(tensors={
        "h\u00e9llo": make(rng, "F32", [2]),
        "\u4e16\u754c.weight": make(rng, "F32", [1]),
        "emoji.\U0001F600": make(rng, "I8", [3]),
        "quote\"name": make(rng, "F32", [1]),
        "back\\slash": make(rng, "F32", [1]),
        "ctrl\u0001\u001f\n\t": make(rng, "U8", [1]),
        "del\u007f": make(rng, "U8", [2]),
        "slash/name": make(rng, "F16", [1]),
        "space name": make(rng, "F16", [1]),
        "\u00c5ngstr\u00f6m": make(rng, "BF16", [2]),   # sorts after ASCII
        "Zebra": make(rng, "F32", [1]), "apple": make(rng, "F32", [1])})

    out["no_tensors"] = dict(tensors={})
    out["no_tensors_metadata"] = dict(tensors={}, metadata={"format": "pt"})

    # Valid but not what the reference writes: pretty-printed header, tensors
    # listed in name order, data in yet another order, padding not to 8 bytes.
    loose = {"b": make(rng, "F32", [2]), "a": make(rng, "U8", [3]), "c": make(rng, "I64", [1])}
    loose = {"b": make(rng, "F32", [2]), "a": make(rng, "U8", [3]), "c": make(rng, "I64", [1])}
    out["loose_header"] = dict(tensors=loose, order=["a", "c", "b"], canonical=False,
                               metadata={"format": "pt"}, dumps=_loose_dumps, pad=False)
    return out


def main(argv):
    if len(argv) != 2:
        print("usage: /usr/bin/python3 gen_safetensors.py OUTDIR", file=sys.stderr)
        return 2
    outdir = argv[1]
    os.makedirs(outdir, exist_ok=True)
    for case, spec in cases().items():
        tensors = spec["tensors"]
        metadata = spec.get("metadata")
        hb, order = header_bytes(tensors, metadata, spec.get("order"), spec.get("dumps"),
                                 spec.get("pad", True))
        blob = struct.pack("<Q", len(hb)) + hb + b"".join(tensors[n][2] for n in order)
        filename = case + ".safetensors"
        with open(os.path.join(outdir, filename), "wb") as f:
            f.write(blob)
        entries = {n: {"dtype": d, "shape": list(s), "sha256": C.sha256_hex(b)}
                   for n, (d, s, b) in ((n, tensors[n]) for n in order)}
        C.write_manifest(outdir, case, C.make_manifest(
            "safetensors", tensors=entries, path=filename, metadata=metadata,
            canonical=spec.get("canonical", True)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
