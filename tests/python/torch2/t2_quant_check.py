"""transformers' own view of what `statedict convert --quantize` / `--dequantize` wrote.

Usage: tools/sid-python tests/python/torch2/t2_quant_check.py MODE OURS REFERENCE

Modes (exit 0 when transformers agrees, 1 with one line per disagreement on stdout):
  dequantized  OURS is a Hugging Face folder statedict dequantized (--dequantize --dtype BF16)
               from REFERENCE, a block-FP8 folder. OURS loads with plain from_pretrained (its
               config.json has no quantization_config), REFERENCE with FineGrainedFP8Config
               (dequantize=True); every parameter and the logits of a fixed prompt must be equal.
  quantized    OURS is a folder statedict quantized (--quantize fp8-block), REFERENCE the same
               model quantized by transformers' own quantizer. Both load with
               FineGrainedFP8Config(dequantize=True) on CPU, with no missing or unexpected keys;
               every parameter and the logits must be equal.

The sid root has no `accelerate` (tools/sid-root.sh installs Debian's torch, safetensors and
transformers only). FineGrainedFP8's environment check asks for it before anything else, though
loading with dequantize=True never uses it (that path swaps no module and dequantizes each
weight with its scales while loading); the check is told accelerate is there, and a real use
of it would still fail on its import.
"""
import json
import os
import sys
import warnings

warnings.simplefilter("ignore")

import torch  # noqa: E402


def load(path, dequantize):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    import transformers.quantizers.quantizer_finegrained_fp8 as fp8
    fp8.is_accelerate_available = lambda: True
    kw = {"quantization_config": FineGrainedFP8Config(dequantize=True)} if dequantize else {}
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kw)
    return model.eval(), info


def logits(model):
    ids = torch.tensor([[3, 17, 42, 99, 5, 120, 7, 64]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("dequantized", "quantized"):
        print(__doc__, file=sys.stderr)
        return 2
    mode, ours, ref = sys.argv[1:]
    problems = []
    with open(os.path.join(ours, "config.json")) as f:
        config = json.load(f)
    if mode == "dequantized" and "quantization_config" in config:
        problems.append("config.json of the dequantized folder still has quantization_config")
    if mode == "quantized" and config.get("quantization_config", {}).get("quant_method") != "fp8":
        problems.append(f"config.json has no fp8 quantization_config: {config.get('quantization_config')}")
    a, ainfo = load(ours, dequantize=(mode == "quantized"))
    b, binfo = load(ref, dequantize=True)
    for what, info in (("ours", ainfo), ("reference", binfo)):
        for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
            if info.get(k):
                problems.append(f"{what}: {k} {sorted(info[k])[:8]}")
    sa, sb = a.state_dict(), b.state_dict()
    if sorted(sa) != sorted(sb):
        problems.append(f"parameter names differ: {sorted(set(sa) ^ set(sb))[:8]}")
    for k in sorted(set(sa) & set(sb)):
        if sa[k].dtype != sb[k].dtype or sa[k].shape != sb[k].shape or not torch.equal(sa[k], sb[k]):
            problems.append(f"{k}: {sa[k].dtype} {tuple(sa[k].shape)} vs {sb[k].dtype} {tuple(sb[k].shape)}, equal values: "
                            f"{sa[k].shape == sb[k].shape and torch.equal(sa[k].float(), sb[k].float())}")
    la, lb = logits(a), logits(b)
    if not torch.equal(la, lb):
        problems.append(f"logits differ: max |diff| {(la.float() - lb.float()).abs().max().item()}")
    if lb.abs().max().item() == 0:
        problems.append("the reference's logits are all zero")
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
