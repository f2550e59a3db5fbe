"""A streaming safetensors writer for torch tensors (torch 1.13 + numpy; the `safetensors` package is
not installable here).

The header comes from the project's independent reference-layout writer
(tests/python/gen_safetensors.py `header_bytes`: dtype-descending then name order, no gaps, header
padded to 8 bytes), so files written here are laid out as `safetensors.torch.save_file` lays them out.

Deliberately *leaner* than the real library, to be fair to the peers that use it: `save_file` first
copies every tensor into a Python `bytes` object (`_tobytes`) and only then writes, so its peak memory
is about twice the state dict.  This writer hands each tensor's own buffer to write(2) without a copy.
The file is fsync'ed before returning (statedict fsyncs its outputs; the comparison includes that
cost on both sides).
"""
import os
import struct
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "..", "tests", "python"))

from gen_safetensors import header_bytes  # noqa: E402

_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
          "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_MAX_WRITE = 1 << 30  # write(2) moves at most 0x7ffff000 bytes per call on Linux


def dtype_name(t):
    return _NAMES[str(t.dtype).replace("torch.", "")]


def raw_view(t):
    """The tensor's bytes as a numpy array, without copying (t must be contiguous, on the CPU)."""
    import torch
    if not t.is_contiguous():
        raise ValueError("safetensors needs contiguous tensors")
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    elif t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.reshape(-1).numpy()


def _write_all(fd, buf):
    mv = memoryview(buf).cast("B")
    while len(mv):
        n = os.write(fd, mv[:_MAX_WRITE])
        mv = mv[n:]


def save(tensors, path, metadata=None, fsync=True):
    """tensors: mapping name -> contiguous CPU tensor.  Returns the number of bytes written."""
    specs = {name: (dtype_name(t), tuple(t.shape)) for name, t in tensors.items()}
    return save_lazy(specs, tensors.__getitem__, path, metadata, fsync)


def save_lazy(specs, produce, path, metadata=None, fsync=True):
    """specs: name -> (safetensors dtype, shape); produce(name) -> contiguous CPU tensor, called once
    per tensor in file order, so at most one tensor needs to exist at a time."""
    entries = {name: (dt, tuple(shape), None) for name, (dt, shape) in specs.items()}
    hb, order = header_bytes(entries, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, struct.pack("<Q", len(hb)) + hb)
        total = 8 + len(hb)
        for name in order:
            t = produce(name)
            if tuple(t.shape) != tuple(specs[name][1]) or dtype_name(t) != specs[name][0]:
                raise ValueError(f"{name}: produced {t.dtype}{list(t.shape)}, header says {specs[name]}")
            if t.numel():
                arr = raw_view(t)
                _write_all(fd, arr)
                total += arr.nbytes
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return total


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
