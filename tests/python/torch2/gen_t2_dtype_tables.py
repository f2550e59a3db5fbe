"""Conversion tables computed by PyTorch 2.x for the dtypes 1.13 lacks, for tests/interop-dtype2.cpp.

Usage: tools/sid-python tests/python/torch2/gen_t2_dtype_tables.py OUTDIR

Every table is a raw little-endian array `<what>.<type>` (u8, u16, u32 or u64 hold bit patterns);
OUTDIR/tables.json lists each with its element count and the torch version. F is each of
float8_e4m3fnuz (e4m3fnuz), float8_e5m2fnuz (e5m2fnuz) and float8_e8m0fnu (e8m0):

  F_decode.u32      the 256 codes .to(float32)
  F_to_bf16.u16, F_to_f16.u16, F_to_f64.u64     the 256 codes .to(those)
  f32_sweep.u32     every f32 whose high 16 bits take all values, with the low 16 bits 0x0000,
                    0x0001, 0x7fff, 0x8000, 0x8001, 0xffff: every exponent, both signs, NaNs, and
                    every rounding position of the 8-bit formats on, just below and just above a tie
  f32_to_F.u8       .to(F) of f32_sweep
  bf16_to_F.u8, f16_to_F.u8    .to(F) of all 65536 bf16 / f16 patterns
  f64_sweep.u64     f32_sweep entries with low bits 0x0000 and 0x8000, widened, then -1, 0, +1 ulp
  f64_to_F.u8       .to(F) of f64_sweep
  c64_to_c32.u32    f32_sweep read as complex64 pairs, .to(complex32)
"""
import json
import os
import sys

import numpy as np
import torch

FORMATS = {"e4m3fnuz": torch.float8_e4m3fnuz, "e5m2fnuz": torch.float8_e5m2fnuz, "e8m0": torch.float8_e8m0fnu}
LOW16 = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF]


def bits(t):
    """The bit patterns of a tensor as a numpy array of unsigned ints of its width."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[t.element_size()]
    return t.contiguous().view(width).numpy().view(unsigned)


def main(out):
    os.makedirs(out, exist_ok=True)
    listing = {"torch_version": torch.__version__, "tables": {}}

    def save(name, arr):
        arr = np.ascontiguousarray(arr)
        arr.astype(arr.dtype.newbyteorder("<"), copy=False).tofile(os.path.join(out, name))
        listing["tables"][name] = int(arr.size)

    codes = torch.arange(256, dtype=torch.uint8)
    hi = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    sweep = (hi[:, None] | np.array(LOW16, dtype=np.uint32)[None, :]).reshape(-1)
    save("f32_sweep.u32", sweep)
    f32 = torch.from_numpy(sweep.view(np.float32).copy())
    bases = (hi[:, None] | np.array([0x0000, 0x8000], dtype=np.uint32)[None, :]).reshape(-1)
    wide = torch.from_numpy(bases.view(np.float32).copy()).to(torch.float64).numpy().view(np.uint64)
    f64_bits = np.concatenate([wide - np.uint64(1), wide, wide + np.uint64(1)])
    save("f64_sweep.u64", f64_bits)
    f64 = torch.from_numpy(f64_bits.view(np.float64).copy())
    all16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    for short, dt in FORMATS.items():
        c = codes.view(dt)
        save(f"{short}_decode.u32", bits(c.to(torch.float32)))
        save(f"{short}_to_bf16.u16", bits(c.to(torch.bfloat16)))
        save(f"{short}_to_f16.u16", bits(c.to(torch.float16)))
        save(f"{short}_to_f64.u64", bits(c.to(torch.float64)))
        save(f"f32_to_{short}.u8", bits(f32.to(dt)))
        save(f"bf16_to_{short}.u8", bits(all16.view(torch.bfloat16).to(dt)))
        save(f"f16_to_{short}.u8", bits(all16.view(torch.float16).to(dt)))
        save(f"f64_to_{short}.u8", bits(f64.to(dt)))
    save("c64_to_c32.u32", bits(f32.view(torch.complex64).to(torch.complex32)))
    with open(os.path.join(out, "tables.json"), "w", encoding="utf-8") as f:
        json.dump(listing, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        sys.exit(2)
    main(sys.argv[1])
