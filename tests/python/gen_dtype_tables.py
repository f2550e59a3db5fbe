#!/usr/bin/python3
"""Conversion tables computed by real PyTorch, for tests/interop-dtype.cpp.

Usage: /usr/bin/python3 tests/python/gen_dtype_tables.py OUTDIR

Every table is a raw little-endian array named `<what>.<type>` (type u8, u16, u32 or u64 holds
the bit patterns); OUTDIR/manifest.json lists each file with its element count, so the C++ test
can check it read what was written.

Inputs and what computes the expected outputs:
  f32_sweep.u32      every f32 whose high 19 bits (sign, exponent, top 10 mantissa bits) take all
                     values, combined with 8 patterns of the low 13 bits (0, 1, just below / at /
                     just above the f16 rounding tie, ...). The high bits cover every exponent,
                     both signs, infinities and NaNs with payloads; the patterns put every rounding
                     position of bf16 (bit 16), f16 (bit 13 and the subnormal positions), e4m3
                     (bit 20) and e5m2 (bit 21) exactly on, just below and just above a tie.
  f32_to_bf16.u16, f32_to_f16.u16: torch `.to(dtype)` of f32_sweep.
  f32_hi.u32, f32_to_f64.u64: the sweep entries with low pattern 1 and torch `.to(float64)` of them.
  bf16_all.u16 / f16_all.u16 = 0..65535;  *_to_f32.u32, *_to_f64.u64, bf16_to_f16.u16,
                     f16_to_bf16.u16: torch `.to(dtype)`.
  f64_sweep.u64      f32 values at and beside bf16 and f16 ties, moved by -1, 0, +1 f64 ulps (where
                     rounding to f32 first and then to 16 bits differs from rounding once), f32
                     midpoints +-1 ulp, and every f64 exponent with a few mantissas (far beyond the
                     f32 range and far below its subnormals).
  f64_to_bf16.u16, f64_to_f16.u16, f64_to_f32.u32: torch `.to(dtype)` of f64_sweep.
  f8e4m3_decode.u32, f8e5m2_decode.u32: all 256 codes decoded by the OCP FP8 spec (value grid
                     below, not PyTorch: 1.13 has no float8). NaN codes give the f32 bits that
                     PyTorch's c10 decoders produce (Float8_e4m3fn.h: sign | 0x7ff00000; Float8_e5m2.h
                     widens to f16 and then to f32 with the quiet bit set).
  f32_to_f8e4m3.u8, f32_to_f8e5m2.u8: f32_sweep rounded to nearest even on the exact value grid,
                     with the overflow rules of c10/util/Float8_e4m3fn.h (NaN, inf and anything that
                     rounds above 448 -> 0x7f | sign) and Float8_e5m2.h (NaN -> 0x7f | sign, anything
                     that rounds above 57344, inf included -> 0x7c | sign).
"""
import json
import os
import re
import sys
import time

import numpy as np
import torch

LOW13_PATTERNS = [0x0000, 0x0001, 0x0800, 0x0FFF, 0x1000, 0x1001, 0x1FFE, 0x1FFF]


def f32_sweep():
    hi = np.arange(1 << 19, dtype=np.uint32) << np.uint32(13)
    low = np.array(LOW13_PATTERNS, dtype=np.uint32)
    return (hi[:, None] | low[None, :]).reshape(-1)


def f64_sweep():
    # Bases: every high-19-bit f32 with the low 13 bits 0 (bf16 ties live here: low 16 bits 0x8000)
    # or 0x1000 (f16 ties), widened exactly to f64.
    hi = np.arange(1 << 19, dtype=np.uint32) << np.uint32(13)
    bases32 = np.concatenate([hi, hi | np.uint32(0x1000)])
    with np.errstate(invalid="ignore"):
        bases = bases32.view(np.float32).astype(np.float64).view(np.uint64)
    # Widening quiets signalling NaNs; rebuild NaN bases from the f32 bits so payloads stay.
    f32_nan = ((bases32 & np.uint32(0x7F800000)) == np.uint32(0x7F800000)) & ((bases32 & np.uint32(0x7FFFFF)) != 0)
    nan64 = ((bases32.astype(np.uint64) & np.uint64(0x80000000)) << np.uint64(32)) | np.uint64(0x7FF0000000000000) | \
        ((bases32.astype(np.uint64) & np.uint64(0x7FFFFF)) << np.uint64(29))
    bases = np.where(f32_nan, nan64, bases)
    half_f32_ulp = np.uint64(1 << 28)  # half an f32 ulp, in f64 ulps (same binade)
    steps = [np.uint64(0), np.uint64(1), np.uint64(2**64 - 1),  # 0, +1, -1 (mod 2^64)
             half_f32_ulp, half_f32_ulp - np.uint64(1), half_f32_ulp + np.uint64(1)]
    parts = [bases + s for s in steps]
    # Every f64 exponent, both signs, with mantissas 0, 1, the top bit, all ones and one pattern.
    e = np.arange(2048, dtype=np.uint64) << np.uint64(52)
    mants = np.array([0, 1, 1 << 51, (1 << 52) - 1, 0x123456789ABCD], dtype=np.uint64)
    grid = (e[:, None] | mants[None, :]).reshape(-1)
    parts += [grid, grid | np.uint64(1 << 63)]
    with np.errstate(over="ignore"):
        return np.concatenate(parts)


def torch_from_bits(bits, dtype):
    """A torch tensor of `dtype` with exactly these bit patterns (no conversion on the way in)."""
    signed = {np.uint8: np.int8, np.uint16: np.int16, np.uint32: np.int32, np.uint64: np.int64}[bits.dtype.type]
    as_int = torch.from_numpy(bits.view(signed).copy())
    return as_int.view(dtype)


def torch_bits(t):
    """Bit patterns of a torch tensor as an unsigned numpy array."""
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[t.element_size()]
    return t.contiguous().view(int_type).numpy().view(unsigned)


# ------------------------------------------------------------------------------------- float8
# An independent reference: round to nearest even on the exact value grid (numpy float64 holds
# every f32 and every grid point exactly; rint rounds half to even).
class Fp8Format:
    def __init__(self, name, mbits, bias, max_finite, has_inf):
        self.name, self.mbits, self.bias, self.max_finite, self.has_inf = name, mbits, bias, max_finite, has_inf
        self.emin = 1 - bias

    def decode(self, code):
        """The value of a code by the OCP FP8 spec (None for NaN, inf as float('inf'))."""
        sign = -1.0 if code & 0x80 else 1.0
        ebits = 7 - self.mbits
        e = (code >> self.mbits) & ((1 << ebits) - 1)
        m = code & ((1 << self.mbits) - 1)
        emax_field = (1 << ebits) - 1
        if self.has_inf and e == emax_field:
            return sign * float("inf") if m == 0 else None
        if not self.has_inf and e == emax_field and m == (1 << self.mbits) - 1:
            return None
        if e == 0:
            return sign * m * 2.0 ** (self.emin - self.mbits)
        return sign * (1 + m / 2.0 ** self.mbits) * 2.0 ** (e - self.bias)

    def encode(self, x32):
        """f32 values (numpy float32 array) -> codes (uint8), RNE on the grid, PyTorch overflow rules."""
        x = x32.astype(np.float64)
        sign = np.where(np.signbit(x), 0x80, 0).astype(np.uint8)
        a = np.abs(x)
        nan = np.isnan(a)
        a_ = np.where(nan | np.isinf(a), 0.0, a)
        _, exp = np.frexp(a_)                      # a = f * 2^exp, f in [0.5, 1)
        e = np.maximum(exp - 1, self.emin)         # binade exponent, clamped to the subnormal range
        quantum = np.ldexp(1.0, e - self.mbits)
        r = np.rint(a_ / quantum) * quantum         # round to nearest even on the grid
        # Encode r exactly.
        _, rexp = np.frexp(r)
        re = rexp - 1
        sub = r < 2.0 ** self.emin
        sub_code = np.rint(r / 2.0 ** (self.emin - self.mbits))
        norm_mant = np.rint((np.ldexp(r, -re) - 1.0) * 2 ** self.mbits)
        norm_code = (re + self.bias) * 2 ** self.mbits + norm_mant
        code = np.where(sub, sub_code, norm_code)
        overflow = r > self.max_finite
        if self.has_inf:  # e5m2: NaN -> 0x7f; inf and overflow -> inf
            code = np.where(overflow | np.isinf(a), 0x7C, code)
            code = np.where(nan, 0x7F, code)
        else:  # e4m3fn: NaN, inf and overflow -> NaN
            code = np.where(overflow | np.isinf(a) | nan, 0x7F, code)
        return code.astype(np.uint8) | sign


E4M3 = Fp8Format("e4m3", 3, 7, 448.0, has_inf=False)
E5M2 = Fp8Format("e5m2", 2, 15, 57344.0, has_inf=True)


def f8_decode_table(fmt):
    out = np.zeros(256, dtype=np.uint32)
    for code in range(256):
        v = fmt.decode(code)
        sign = 0x80000000 if code & 0x80 else 0
        if v is not None:
            out[code] = np.array([v], dtype=np.float32).view(np.uint32)[0]
        elif fmt is E4M3:
            out[code] = sign | 0x7FF00000
        else:  # the f16 NaN 0bS11111MM00000000 widened, quiet bit set
            out[code] = sign | 0x7F800000 | 0x400000 | ((code & 3) << 21)
    return out


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    files = {}

    def write(name, arr):
        arr = np.ascontiguousarray(arr)
        assert arr.dtype.byteorder in ("=", "<", "|")
        arr.tofile(os.path.join(out, name))
        files[name] = int(arr.size)

    # f32 -> 16-bit floats (and f64)
    s32 = f32_sweep()
    x = torch_from_bits(s32, torch.float32)
    write("f32_sweep.u32", s32)
    write("f32_to_bf16.u16", torch_bits(x.to(torch.bfloat16)))
    write("f32_to_f16.u16", torch_bits(x.to(torch.float16)))
    hi1 = s32[1::len(LOW13_PATTERNS)]  # low pattern 0x0001: every exponent, sign and NaN payload top
    write("f32_hi.u32", hi1)
    write("f32_to_f64.u64", torch_bits(torch_from_bits(hi1, torch.float32).to(torch.float64)))

    # every 16-bit pattern, widened and cross-cast
    all16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    write("all16.u16", all16)
    for name, dt in (("bf16", torch.bfloat16), ("f16", torch.float16)):
        t = torch_from_bits(all16, dt)
        write(f"{name}_to_f32.u32", torch_bits(t.to(torch.float32)))
        write(f"{name}_to_f64.u64", torch_bits(t.to(torch.float64)))
    write("bf16_to_f16.u16", torch_bits(torch_from_bits(all16, torch.bfloat16).to(torch.float16)))
    write("f16_to_bf16.u16", torch_bits(torch_from_bits(all16, torch.float16).to(torch.bfloat16)))

    # f64 -> narrower floats
    s64 = f64_sweep()
    d = torch_from_bits(s64, torch.float64)
    write("f64_sweep.u64", s64)
    write("f64_to_bf16.u16", torch_bits(d.to(torch.bfloat16)))
    write("f64_to_f16.u16", torch_bits(d.to(torch.float16)))
    write("f64_to_f32.u32", torch_bits(d.to(torch.float32)))

    # float8: the OCP spec and PyTorch's overflow rules (no float8 in torch 1.13)
    write("f8e4m3_decode.u32", f8_decode_table(E4M3))
    write("f8e5m2_decode.u32", f8_decode_table(E5M2))
    xs = s32.view(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        write("f32_to_f8e4m3.u8", E4M3.encode(xs))
        write("f32_to_f8e5m2.u8", E5M2.encode(xs))

    cap = re.search(r"CPU capability usage: (\w+)", torch.__config__.show())
    manifest = {"torch": torch.__version__, "cpu_capability": cap.group(1) if cap else "unknown", "files": files}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    print(f"gen_dtype_tables: {sum(files.values())} entries in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
