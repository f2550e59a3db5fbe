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
  quantize_bf16, quantize_f32
             A tiny Qwen3 (transformers' own random initialisation, seeded) as a Hugging Face
             folder in bf16 (and in f32), one 128 x 128 block of a q_proj all zeros (some -0.0).
             Expected ("expected" maps "default" to every tensor of the quantized checkpoint):
             transformers' FineGrainedFP8 quantizer itself (`Fp8Quantize.convert`) on exactly the
             weights its `replace_with_fp8_linear` turns into FP8Linear, everything else as it is.
  quantize_partial
             A bf16 safetensors file with weights whose rows or columns are not multiples of 128.
             Expected "default": as transformers' quantizer leaves them (unchanged); "partial":
             reference math written here on DeepSeek's grid (the last blocks cut), in the same
             order of operations as transformers' quantizer.
  qwen3_fp8  The bf16 Qwen3 quantized by transformers' quantizer and saved with its
             quantization_config: what `--dequantize` reads, and what transformers loads with
             `dequantize=True` as the logits oracle (t2_quant_check.py).
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


def qwen3_config():
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=160, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=64,
                       tie_word_embeddings=False)


def tf_quantizer():
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    q = FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=[128, 128]))
    q.pre_quantized = False
    return q


def tf_fp8_modules(config):
    """The modules transformers' FineGrainedFP8 quantizer turns into FP8Linear / FP8Experts."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tf_quantizer()._process_model_before_weight_loading(model)
    return sorted(n for n, m in model.named_modules() if isinstance(m, (FP8Linear, FP8Experts)))


def tf_quantize(tensors, weights):
    """`tensors` with each of `weights` through transformers' Fp8Quantize (it leaves tensors whose
    dimensions are not multiples of the block as they are)."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    op = Fp8Quantize(tf_quantizer())
    out = {}
    for k, v in tensors.items():
        out.update(op.convert({k: v}) if k in weights else {k: v})
    return out


def save_hf(d, tensors, config):
    os.makedirs(d, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def qwen3(out):
    from transformers import AutoModelForCausalLM
    config = qwen3_config()
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(config).eval()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    q = "model.layers.0.self_attn.q_proj.weight"
    sd[q][:128, 128:] = 0.0
    sd[q][5:9, 130:140] = -0.0
    weights = {m + ".weight" for m in tf_fp8_modules(config)}
    assert weights and all(w in sd for w in weights), weights
    for name, dt in (("bf16", torch.bfloat16), ("f32", torch.float32)):
        tensors = {k: v.to(dt) for k, v in sd.items()}
        cfg = config.to_dict()
        cfg["dtype"] = str(dt).replace("torch.", "")
        save_hf(os.path.join(out, "qwen3_" + name), tensors, cfg)
        quantized = tf_quantize(tensors, weights)
        assert sum(1 for v in quantized.values() if v.dtype == torch.float8_e4m3fn) == len(weights)
        T.write_manifest(out, "quantize_" + name, {"format": "hf", "path": "qwen3_" + name,
                                                 "quantized": sorted(weights),
                                                 "expected": {"default": entries(quantized)}})
        if dt == torch.bfloat16:
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
            save_hf(os.path.join(out, "qwen3_fp8"), quantized, cfg)


def quantize_partial(out):
    """Weights of 200 x 256, 256 x 300 and 130 x 130 (bf16): partial blocks on either side."""
    d = os.path.join(out, "quantize_partial")
    os.makedirs(d, exist_ok=True)
    tensors = {"a.weight": torch.randn(200, 256, generator=gen(21)).to(torch.bfloat16),
               "b.weight": (torch.randn(256, 300, generator=gen(22)) * 3).to(torch.bfloat16),
               "c.weight": (torch.randn(130, 130, generator=gen(23)) * 1e-3).to(torch.bfloat16)}
    tensors["c.weight"][128:, :] = 0.0   # a partial block of zeros only
    save_file(tensors, os.path.join(d, "model.safetensors"))
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    partial = {}
    for k, v in tensors.items():
        b = 128
        rows, cols = v.shape
        x = v.float()
        pr, pc = -rows % b, -cols % b
        padded = torch.nn.functional.pad(x, (0, pc, 0, pr))   # zeros change no maximum of magnitudes
        blocks = padded.reshape(padded.shape[0] // b, b, padded.shape[1] // b, b)
        amax = blocks.abs().amax(dim=(1, 3))
        # transformers' order: 448 / amax is computed as reciprocal(amax) * 448; zero blocks get 1
        mul = torch.where(amax > 0, amax.reciprocal() * fp8_max, torch.ones_like(amax))
        q = (blocks * mul[:, None, :, None]).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
        partial[k] = q.reshape(padded.shape)[:rows, :cols]
        partial[k + "_scale_inv"] = mul.reciprocal()
    T.write_manifest(out, "quantize_partial", {
        "format": "safetensors", "path": "quantize_partial/model.safetensors",
        "expected": {"default": entries(tf_quantize(tensors, set(tensors))), "partial": entries(partial)}})


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    fp8_block(out)
    mxfp4(out)
    qwen3(out)
    quantize_partial(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
