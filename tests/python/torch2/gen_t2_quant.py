"""Quantized checkpoints (block-FP8, MXFP4) and their dequantized tensors as torch computes them,
for `statedict convert --dequantize` (docs/formats/quantized.md).

Usage: tools/sid-python tests/python/torch2/gen_t2_quant.py OUTDIR

Cases (OUTDIR/<case>/ a Hugging Face folder: model.safetensors + config.json, and
OUTDIR/<case>.manifest.json whose "expected" maps an output dtype to the sha256 of every tensor
of the dequantized checkpoint):
  fp8_block  DeepSeek-V3 style: `X.weight` float8_e4m3fn with `X.weight_scale_inv` float32 per
             128 x 128 block, rows and columns not multiples of 128 (200 x 300, partial last
             blocks), a 3-d expert tensor `experts.gate_up_proj` with `gate_up_proj_scale_inv`,
             and a bf16 norm that is not quantized. Expected values: DeepSeek's weight_dequant
             order, `(w.float() * s_of_its_block).to(dtype)`: fp8 -> f32, the product in f32,
             one cast.
  mxfp4      gpt-oss style: `mlp.experts.gate_up_proj_blocks` uint8 [E, N, G, 16] with
             `gate_up_proj_scales` uint8 [E, N, G]; expected values from transformers'
             `convert_moe_packed_tensors` (its name without `_blocks`, its [E, G * 32, N] layout).
"""
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _t2 as T  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

warnings.simplefilter("ignore")
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def entries(tensors):
    return {k: T.tensor_entry(v.contiguous()) for k, v in sorted(tensors.items())}


def block_scale(s, rows, cols, b):
    """Each scale repeated over its b x b block, cut to rows x cols (partial last blocks)."""
    return s.repeat_interleave(b, dim=-2).repeat_interleave(b, dim=-1)[..., :rows, :cols]


def fp8_block(out):
    b = 128
    d = os.path.join(out, "fp8_block")
    os.makedirs(d, exist_ok=True)
    w = (torch.randn(200, 300, generator=gen(1)) * 100).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3, generator=gen(2)) * 1e-3 + 1e-5
    e = (torch.randn(2, 130, 260, generator=gen(3)) * 40).to(torch.float8_e4m3fn)
    es = torch.rand(2, 2, 3, generator=gen(4)) * 0.3
    norm = torch.randn(300, generator=gen(5)).to(torch.bfloat16)
    save_file({"layer.w.weight": w, "layer.w.weight_scale_inv": s, "experts.gate_up_proj": e,
               "experts.gate_up_proj_scale_inv": es, "norm.weight": norm}, os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "deepseek_v3", "quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [b, b]}}, f)
    exp = {}
    for name, dt in DTYPES.items():
        exp[name] = entries({
            "layer.w.weight": (w.float() * block_scale(s, 200, 300, b)).to(dt),
            "experts.gate_up_proj": (e.float() * block_scale(es, 130, 260, b)).to(dt),
            "norm.weight": norm.to(dt)})
    T.write_manifest(out, "fp8_block", {"format": "hf", "path": "fp8_block", "expected": exp})


def mxfp4(out):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    d = os.path.join(out, "mxfp4")
    os.makedirs(d, exist_ok=True)
    E, N, G = 2, 6, 3
    blocks = torch.randint(0, 256, (E, N, G, 16), dtype=torch.uint8, generator=gen(6))
    scales = torch.randint(110, 140, (E, N, G), dtype=torch.uint8, generator=gen(7))
    scales[0, 0, 0] = 0      # 2^-127: subnormal in f32 and bf16
    scales[0, 1, 2] = 254    # 2^127: 6 * 2^127 overflows to inf
    scales[1, 5, 1] = 1
    dblocks = torch.randint(0, 256, (E, 4, 1, 16), dtype=torch.uint8, generator=gen(8))
    dscales = torch.randint(120, 130, (E, 4, 1), dtype=torch.uint8, generator=gen(9))
    bias = torch.randn(E, N, generator=gen(10)).to(torch.bfloat16)
    p = "model.layers.0.mlp.experts."
    save_file({p + "gate_up_proj_blocks": blocks, p + "gate_up_proj_scales": scales, p + "gate_up_proj_bias": bias,
               p + "down_proj_blocks": dblocks, p + "down_proj_scales": dscales}, os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4",
                                                                   "modules_to_not_convert": ["router"]}}, f)
    exp = {}
    for name, dt in DTYPES.items():
        exp[name] = entries({
            p + "gate_up_proj": convert_moe_packed_tensors(blocks, scales, dtype=dt),
            p + "down_proj": convert_moe_packed_tensors(dblocks, dscales, dtype=dt),
            p + "gate_up_proj_bias": bias.to(dt)})
    T.write_manifest(out, "mxfp4", {"format": "hf", "path": "mxfp4", "expected": exp})


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    fp8_block(out)
    mxfp4(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
