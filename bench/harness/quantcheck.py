"""Spot checks of a dequantized Hugging Face folder against reference math in numpy (B12, B13):
some tensors recomputed from the quantized input, bit for bit in BF16, each one's whole bytes
(MXFP4: one expert of each tensor checked, the rest by size). Independent of statedict's code:
float8_e4m3fn and E2M1 are decoded from their definitions."""
import json
import os

import numpy as np

from . import stcheck


def _e4m3_table():
    t = np.zeros(256, dtype=np.float64)
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 15, b & 7
        v = np.nan if (e == 15 and m == 7) else (np.ldexp(m / 8.0, -6) if e == 0 else np.ldexp(1 + m / 8.0, e - 7))
        t[b] = -v if s else v
    return t.astype(np.float32)


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def _bf16(x):
    """float32 -> bf16 bits, round to nearest even (finite values)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7fff + ((u >> 16) & 1)) >> 16).astype(np.uint16)


class _Folder:
    def __init__(self, root):
        self.root = root
        with open(os.path.join(root, "model.safetensors.index.json")) as f:
            self.map = json.load(f)["weight_map"]
        self.headers = {}

    def info(self, name):
        fn = os.path.join(self.root, self.map[name])
        if fn not in self.headers:
            self.headers[fn] = stcheck.header(fn)
        hdr, off = self.headers[fn]
        return fn, hdr[name], off

    def read(self, name, dtype, count=None, first=0):
        fn, e, off = self.info(name)
        n = int(np.prod(e["shape"])) if count is None else count
        return np.fromfile(fn, dtype=dtype, count=n, offset=off + e["data_offsets"][0] + first * np.dtype(dtype).itemsize)


def _out_folder(path):
    if os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        return _Folder(path)
    one = _Folder.__new__(_Folder)
    one.root, one.headers = path, {}
    hdr, _ = stcheck.header(os.path.join(path, "model.safetensors"))
    one.map = {k: "model.safetensors" for k in hdr if k != "__metadata__"}
    return one


def fp8_block(src, out, names):
    """None when each of `names` (block-FP8 weights of `src`) is, in `out`, BF16 of
    f32(e4m3(w) * scale of its 128 x 128 block), and no weight_scale_inv is left."""
    i, o = _Folder(src), _out_folder(out)
    if any(k.endswith("_scale_inv") for k in o.map):
        return "weight_scale_inv tensors left in the output"
    lut = _e4m3_table()
    for n in names:
        _, e, _ = i.info(n)
        rows, cols = e["shape"]
        w = lut[i.read(n, np.uint8)].reshape(rows, cols)
        s = i.read(n + "_scale_inv", "<f4").reshape(-(-rows // 128), -(-cols // 128))
        full = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:rows, :cols]
        want = _bf16(w * full)
        _, oe, _ = o.info(n)
        if oe["dtype"] != "BF16" or oe["shape"] != [rows, cols]:
            return f"{n}: {oe['dtype']} {oe['shape']}, want BF16 {[rows, cols]}"
        got = o.read(n, "<u2").reshape(rows, cols)
        if not np.array_equal(got, want):
            return f"{n}: {int((got != want).sum())} of {rows * cols} values differ"
    return None


def mxfp4(src, out, names):
    """None when, for each X of `names` (X_blocks [E, N, G, 16] in `src`), `out` holds X BF16
    [E, G * 32, N] and its last expert equals e2m1 * 2^(scale - 127) transposed, rounded once."""
    i, o = _Folder(src), _out_folder(out)
    for x in names:
        _, e, _ = i.info(x + "_blocks")
        E, N, G, _16 = e["shape"]
        per = N * G * 16
        b = i.read(x + "_blocks", np.uint8, per, (E - 1) * per).reshape(N, G, 16)
        s = i.read(x + "_scales", np.uint8, N * G, (E - 1) * N * G).reshape(N, G)
        vals = np.empty((N, G, 32), dtype=np.float32)
        vals[:, :, 0::2] = E2M1[b & 15]
        vals[:, :, 1::2] = E2M1[b >> 4]
        vals *= np.ldexp(np.float32(1), s.astype(np.int32) - 127)[:, :, None].astype(np.float32)
        want = _bf16(vals.reshape(N, G * 32).T.copy())
        _, oe, _ = o.info(x)
        if oe["dtype"] != "BF16" or oe["shape"] != [E, G * 32, N]:
            return f"{x}: {oe['dtype']} {oe['shape']}, want BF16 {[E, G * 32, N]}"
        got = o.read(x, "<u2", G * 32 * N, (E - 1) * G * 32 * N).reshape(G * 32, N)
        if not np.array_equal(got, want):
            return f"{x} (expert {E - 1}): {int((got != want).sum())} of {got.size} values differ"
    return None
