#!/usr/bin/python3
"""Generate large quantized Hugging Face folders for B12 (block-FP8) and B13 (MXFP4).

    /usr/bin/python3 bench/gen/gen_quant.py OUTDIR --scheme fp8-block|mxfp4 --gib 3

Writes, under OUTDIR:
  fp8block-<gib>g/ or mxfp4-<gib>g/   model-0000i-of-0000n.safetensors (about 1 GiB each),
                                      model.safetensors.index.json and config.json with its
                                      quantization_config
  <name>.stamp.json                   reuse marker

--gib is the size of the quantized tensors on disk. Written with numpy alone (the float8 bytes as
raw bytes under safetensors' F8_E4M3 dtype): no torch needed.
  fp8-block  DeepSeek-V3-shaped layers (hidden 7168): F8_E4M3 weights with F32 weight_scale_inv
             per 128 x 128 block, among them kv_a_proj_with_mqa's 576 rows (a partial last block
             row), and BF16 norms. Dequantized to BF16 the output is twice the input.
  mxfp4      gpt-oss-120b-shaped expert layers (32 experts here, hidden 2880): U8 *_blocks
             [E, N, 90, 16] with U8 E8M0 *_scales [E, N, 90], and BF16 biases. Dequantized to
             BF16 the output is about four times the input.
The values come from one random buffer at per-tensor offsets; the fp8 bytes avoid e4m3's NaN
codes and the E8M0 exponents stay within 120 .. 133 (finite products).
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import stamp  # noqa: E402

VERSION = 1
GiB = 1 << 30
POOL = 64 << 20  # the random buffer every tensor's bytes are cut from


def fp8_layer(i):
    p = f"model.layers.{i}."
    h, qr, kvr, heads = 7168, 1536, 512, 128
    t = []
    for name, rows, cols in (("self_attn.q_a_proj", qr, h), ("self_attn.q_b_proj", heads * 192, qr),
                             ("self_attn.kv_a_proj_with_mqa", kvr + 64, h), ("self_attn.kv_b_proj", heads * 256, kvr),
                             ("self_attn.o_proj", h, heads * 128), ("mlp.gate_proj", 18432, h),
                             ("mlp.up_proj", 18432, h), ("mlp.down_proj", h, 18432)):
        t.append((p + name + ".weight", "F8_E4M3", [rows, cols]))
        t.append((p + name + ".weight_scale_inv", "F32", [-(-rows // 128), -(-cols // 128)]))
    for name, n in (("input_layernorm", h), ("post_attention_layernorm", h), ("self_attn.q_a_layernorm", qr),
                    ("self_attn.kv_a_layernorm", kvr)):
        t.append((p + name + ".weight", "BF16", [n]))
    return t


def mxfp4_layer(i):
    p = f"model.layers.{i}.mlp.experts."
    e, h = 32, 2880
    return [(p + "gate_up_proj_blocks", "U8", [e, 2 * h, 90, 16]), (p + "gate_up_proj_scales", "U8", [e, 2 * h, 90]),
            (p + "gate_up_proj_bias", "BF16", [e, 2 * h]),
            (p + "down_proj_blocks", "U8", [e, h, 90, 16]), (p + "down_proj_scales", "U8", [e, h, 90]),
            (p + "down_proj_bias", "BF16", [e, h])]


SIZE = {"F8_E4M3": 1, "U8": 1, "BF16": 2, "F32": 4}


def nbytes(t):
    n = SIZE[t[1]]
    for d in t[2]:
        n *= d
    return n


def payload(t, pool, rng):
    """The tensor's bytes: a slice of the pool made valid for its role."""
    name, dt, shape = t
    n = nbytes(t)
    off = int(rng.integers(0, POOL - 1))
    reps = -(-(off + n) // POOL)
    raw = np.tile(pool, reps)[off:off + n] if reps > 1 else pool[off:off + n]
    if dt == "F8_E4M3":
        return np.where((raw & 0x7f) == 0x7f, raw ^ 0x01, raw).tobytes()
    if dt == "F32":
        return (1e-4 + raw[: n // 4].astype(np.float32) / 255 * 1e-2).astype("<f4").tobytes()
    if name.endswith("_scales"):
        return (120 + raw % 14).astype(np.uint8).tobytes()
    if dt == "BF16":
        return ((raw[: n // 2].astype(np.uint16) & 0x7f) | 0x3f00).astype("<u2").tobytes()
    return raw.tobytes()


def write_file(path, tensors, pool, rng):
    header, off = {}, 0
    for t in tensors:
        n = nbytes(t)
        header[t[0]] = {"dtype": t[1], "shape": t[2], "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for t in tensors:
            b = payload(t, pool, rng)
            assert len(b) == nbytes(t), t
            f.write(b)
    os.replace(path + ".tmp", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--scheme", choices=["fp8-block", "mxfp4"], required=True)
    ap.add_argument("--gib", type=float, default=3.0)
    a = ap.parse_args()
    name = f"{'fp8block' if a.scheme == 'fp8-block' else 'mxfp4'}-{a.gib:g}g"
    root = os.path.join(a.outdir, name)
    st = os.path.join(a.outdir, name + ".stamp.json")
    params = {"version": VERSION, "scheme": a.scheme, "gib": a.gib}
    if stamp.fresh(st, params):
        print(f"reusing {root}")
        return 0
    layer = fp8_layer if a.scheme == "fp8-block" else mxfp4_layer
    tensors, total, i = [], 0, 0
    while total < a.gib * GiB:
        for t in layer(i):
            if total >= a.gib * GiB and t[0].endswith((".weight", "_blocks")):
                break
            tensors.append(t)
            total += nbytes(t)
        i += 1
    # Whole layers per file, about 1 GiB each; a quantized weight and its scales stay together.
    files, cur, size = [], [], 0
    for t in tensors:
        cur.append(t)
        size += nbytes(t)
        if size >= GiB and not t[0].endswith((".weight", "_blocks")):
            files.append(cur)
            cur, size = [], 0
    if cur:
        files.append(cur)
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(45)
    pool = rng.integers(0, 256, POOL, dtype=np.uint8)
    weight_map = {}
    for k, ts in enumerate(files):
        fn = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        write_file(os.path.join(root, fn), ts, pool, rng)
        weight_map.update({t[0]: fn for t in ts})
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    q = ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
         if a.scheme == "fp8-block" else {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]})
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump({"model_type": "deepseek_v3" if a.scheme == "fp8-block" else "gpt_oss", "torch_dtype": "bfloat16",
                   "quantization_config": q}, f, indent=1)
    stamp.record(st, params, [root])
    print(f"wrote {root}: {len(tensors)} tensors, {total / GiB:.2f} GiB in {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
