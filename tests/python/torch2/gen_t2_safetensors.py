"""safetensors files written by the real safetensors package, and Hugging Face model folders
written by transformers' save_pretrained (tiny models built from a local config, no download).

Usage: tools/sid-python tests/python/torch2/gen_t2_safetensors.py OUTDIR

Cases (OUTDIR/<case>.safetensors or OUTDIR/<case>/, and OUTDIR/<case>.manifest.json):
  st_all_dtypes      safetensors.torch.save_file of every dtype it writes (F8_*, F8_E8M0, F4 too)
  st_metadata        save_file with __metadata__ {"format": "pt", ...}
  hf_gpt2, hf_llama  save_pretrained with a small max_shard_size: model-0000k-of-0000n.safetensors
                     + model.safetensors.index.json (tied lm_head dropped as transformers does)
  hf_llama_bin       the same Llama as pytorch_model-0000k-of-0000n.bin shards + index, split by
                     huggingface_hub's split_torch_state_dict_into_shards (transformers 5 writes
                     safetensors only); from_pretrained must load it
The HF manifests carry "hf": the model class, the input ids and the sha256 of the logits, which
t2_check.py hf compares against.
"""
import json
import os
import struct
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _t2 as T  # noqa: E402

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

warnings.simplefilter("ignore")


def g(seed):
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def read_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


def describe_safetensors(path):
    """Manifest tensors of a safetensors file, in file offset order, from its header and bytes;
    every tensor is also read with safe_open and must hold the same bytes."""
    header, start = read_header(path)
    meta = header.pop("__metadata__", None)
    with open(path, "rb") as f:
        blob = f.read()
    tensors = {}
    with safe_open(path, "pt") as st:
        for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
            b, end = e["data_offsets"]
            data = blob[start + b:start + end]
            t = st.get_tensor(name)
            if T.strided_bytes(t) != data:
                raise SystemExit(f"{path}: safe_open gives other bytes for {name}")
            tensors[name] = {"dtype": e["dtype"], "shape": e["shape"], "sha256": T.C.sha256_hex(data)}
    return tensors, meta


def all_dtypes():
    r = g(41)
    f = torch.tensor([0.0, -0.0, 1.5, -2.25, 448.0, float("inf"), float("nan"), 1e-3])
    return {
        "bool": torch.tensor([True, False, True]),
        "u8": torch.tensor([0, 255, 7], dtype=torch.uint8),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "i16": torch.tensor([-32768, 1, 32767], dtype=torch.int16),
        "u16": torch.tensor([0, 1, 65535], dtype=torch.uint16),
        "i32": torch.tensor([-2**31, 1, 2**31 - 1], dtype=torch.int32),
        "u32": torch.tensor([0, 1, 2**32 - 1], dtype=torch.uint32),
        "i64": torch.tensor([-2**63, 1, 2**63 - 1], dtype=torch.int64),
        "u64": torch.tensor([0, 1, 2**64 - 1], dtype=torch.uint64),
        "f16": f.to(torch.float16),
        "bf16": torch.randn(3, 4, generator=r).to(torch.bfloat16),
        "f32": torch.randn(2, 3, generator=r),
        "f64": f.to(torch.float64),
        "c64": torch.complex(torch.randn(3, generator=r), torch.randn(3, generator=r)),
        "f8_e4m3": f.to(torch.float8_e4m3fn),
        "f8_e5m2": f.to(torch.float8_e5m2),
        "f8_e4m3fnuz": f.to(torch.float8_e4m3fnuz),
        "f8_e5m2fnuz": f.to(torch.float8_e5m2fnuz),
        "f8_e8m0": torch.tensor([1.0, 0.5, 2.0**100]).to(torch.float8_e8m0fnu),
        "f4": torch.arange(0, 256, 37, dtype=torch.uint8)[:6].reshape(2, 3).view(torch.float4_e2m1fn_x2),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
    }


def write_st(outdir, case, tensors, metadata=None):
    filename = case + ".safetensors"
    path = os.path.join(outdir, filename)
    save_file(tensors, path, metadata=metadata)
    desc, meta = describe_safetensors(path)
    extra = {"path": filename, "safetensors_writer": "safetensors " + __import__("safetensors").__version__}
    if meta is not None:
        extra["metadata"] = meta
    T.write_manifest(outdir, case, T.C.make_manifest("safetensors", tensors=desc, **extra))


# --------------------------------------------------------------------------- Hugging Face
INPUT_IDS = [[1, 5, 9, 2, 7, 3, 11, 4], [6, 0, 13, 8, 2, 2, 10, 1]]


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                     tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(42)
    return GPT2LMHeadModel(cfg)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=False)
    torch.manual_seed(43)
    return LlamaForCausalLM(cfg)


def logits_sha(model):
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor(INPUT_IDS)).logits
    return T.C.sha256_hex(T.strided_bytes(out.float())), out


def folder_tensors(d):
    """Manifest tensors of an HF folder: every shard in index order, each in file order."""
    files = sorted(f for f in os.listdir(d) if f.endswith((".safetensors", ".bin")))
    tensors = {}
    for f in files:
        p = os.path.join(d, f)
        if f.endswith(".safetensors"):
            tensors.update(describe_safetensors(p)[0])
        else:
            sd = torch.load(p, map_location="cpu", weights_only=True)
            tensors.update(T.flatten(sd)[0])
    return tensors, files


def hf_manifest(outdir, case, model, fmt):
    from transformers import AutoModelForCausalLM
    d = os.path.join(outdir, case)
    sha, logits = logits_sha(model)
    reloaded = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    sha2, logits2 = logits_sha(reloaded)
    if sha2 != sha:
        raise SystemExit(f"{case}: from_pretrained gives other logits ({(logits2 - logits).abs().max()})")
    tensors, files = folder_tensors(d)
    T.write_manifest(outdir, case, T.C.make_manifest(
        fmt, tensors=tensors, path=case, files=sorted(os.listdir(d)),
        hf={"model_class": type(model).__name__, "input_ids": INPUT_IDS, "logits_sha256": sha,
            "logits_dtype": "F32", "logits_shape": list(logits.shape),
            "tied": getattr(model.config, "tie_word_embeddings", False)}))


def write_hf(outdir, case, model, max_shard_size):
    d = os.path.join(outdir, case)
    model.save_pretrained(d, max_shard_size=max_shard_size)
    hf_manifest(outdir, case, model, "hf_safetensors")


def write_hf_bin(outdir, case, model, max_shard_size):
    from huggingface_hub import split_torch_state_dict_into_shards
    d = os.path.join(outdir, case)
    os.makedirs(d, exist_ok=True)
    model.config.save_pretrained(d)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    split = split_torch_state_dict_into_shards(sd, filename_pattern="pytorch_model{suffix}.bin",
                                               max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        torch.save({n: sd[n] for n in names}, os.path.join(d, filename))
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        with open(os.path.join(d, "pytorch_model.bin.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
    hf_manifest(outdir, case, model, "hf_torch")


def main(argv):
    if len(argv) != 2:
        print("usage: gen_t2_safetensors.py OUTDIR", file=sys.stderr)
        return 2
    outdir = argv[1]
    os.makedirs(outdir, exist_ok=True)
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    write_st(outdir, "st_all_dtypes", all_dtypes())
    write_st(outdir, "st_metadata", {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
             metadata={"format": "pt"})  # one entry: the writer orders a map of several at random
    write_hf(outdir, "hf_gpt2", tiny_gpt2(), "20KB")
    llama = tiny_llama()
    write_hf(outdir, "hf_llama", llama, "16KB")
    write_hf_bin(outdir, "hf_llama_bin", llama, "16KB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
