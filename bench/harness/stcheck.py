"""Independent output check: two safetensors files hold the same tensors (names, dtypes, shapes and
bytes), whatever their order in the file.  Standard library only; memory bounded by one tensor."""
import json
import mmap
import os
import struct


def header(path):
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: shorter than 8 bytes")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise ValueError(f"{path}: header of {n} bytes")
        hdr = json.loads(f.read(n))
    hdr.pop("__metadata__", None)
    return hdr, 8 + n


def same_tensors(a, b, chunk=64 << 20):
    """Returns None when equal, else a one-line description of the first difference."""
    ha, oa = header(a)
    hb, ob = header(b)
    if ha.keys() != hb.keys():
        only_a = sorted(set(ha) - set(hb))[:3]
        only_b = sorted(set(hb) - set(ha))[:3]
        return f"tensor names differ: only in {os.path.basename(a)}: {only_a}, only in {os.path.basename(b)}: {only_b}"
    with open(a, "rb") as fa, open(b, "rb") as fb:
        ma = mmap.mmap(fa.fileno(), 0, prot=mmap.PROT_READ) if os.path.getsize(a) else b""
        mb = mmap.mmap(fb.fileno(), 0, prot=mmap.PROT_READ) if os.path.getsize(b) else b""
        try:
            for name in sorted(ha):
                ea, eb = ha[name], hb[name]
                if ea["dtype"] != eb["dtype"] or list(ea["shape"]) != list(eb["shape"]):
                    return f"{name!r}: {ea['dtype']}{ea['shape']} vs {eb['dtype']}{eb['shape']}"
                (sa, za), (sb, zb) = ea["data_offsets"], eb["data_offsets"]
                if za - sa != zb - sb:
                    return f"{name!r}: {za - sa} vs {zb - sb} bytes"
                for k in range(0, za - sa, chunk):
                    n = min(chunk, za - sa - k)
                    if ma[oa + sa + k:oa + sa + k + n] != mb[ob + sb + k:ob + sb + k + n]:
                        return f"{name!r}: bytes differ"
        finally:
            for m in (ma, mb):
                if isinstance(m, mmap.mmap):
                    m.close()
    return None


def manifest(path):
    """The tests' manifest convention for the tensors of a safetensors file:
    {"format", "tensors": {NAME: {"dtype", "shape", "sha256"}}, "values": {}, "aliases": {}}, where
    sha256 covers the elements row-major, little-endian, no padding (= the safetensors bytes)."""
    import hashlib
    hdr, off = header(path)
    tensors = {}
    with open(path, "rb") as f:
        for name in sorted(hdr, key=lambda n: hdr[n]["data_offsets"][0]):
            e = hdr[name]
            s, z = e["data_offsets"]
            f.seek(off + s)
            h = hashlib.sha256()
            left = z - s
            while left:
                b = f.read(min(left, 64 << 20))
                if not b:
                    raise ValueError(f"{path}: truncated in {name!r}")
                h.update(b)
                left -= len(b)
            tensors[name] = {"dtype": e["dtype"], "shape": list(e["shape"]), "sha256": h.hexdigest()}
    return {"format": "safetensors", "tensors": tensors, "values": {}, "aliases": {}}
