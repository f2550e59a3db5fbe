#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/) from the
PyTorch-generated fixtures (tests/python/generate_all.sh; build/<dir>/fixtures).

    python3 tests/fuzz/make_corpus.py --fixtures build/gcc/fixtures [--out tests/fuzz/corpus]
        [--torch2-fixtures DIR]

--torch2-fixtures: a folder holding gen_t2_objects/ and gen_t2_torch/ as tests/python/torch2/
generate_all.sh writes them (PyTorch 2.x): adds legacy files at pickle protocols 0-5 and files
pickling objects (Namespace args, numpy arrays of every layout at protocols 2 and 5, sparse and
quantized tensors) to the torch, pickle and open targets.

Only small files are used (the committed corpus stays well under 2 MB). Directory-based targets
get the multi-file encoding of tests/fuzz/fuzz_common.hpp: u8 flags, then per file u8 name
length, name, u32 little-endian length, data. Existing seeds (crash reproducers added by hand)
are kept; a seed with the same name is overwritten.
"""
import argparse
import io
import json
import os
import pickletools
import re
import struct
import sys
import zipfile

MAX_SEED = 48 * 1024


def multi(flags, files):
    out = bytearray([flags])
    for name, data in files:
        n = name.encode()
        assert len(n) < 65
        out += bytes([len(n)]) + n + struct.pack("<I", len(data)) + data
    return bytes(out)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def tree(root, prefix="", skip=()):
    """(relative name, bytes) of every file under root, sorted, skipping names matching skip."""
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if any(re.search(s, rel) for s in skip):
                continue
            out.append((prefix + rel, read(os.path.join(dirpath, n))))
    out.sort(key=lambda x: (x[0] != prefix + "latest", x[0]))
    return out


# Megatron-LM rank files are mostly RNG and optimizer state: re-saved without them (by Debian's
# PyTorch, which the fixtures' generator uses) they fit in a seed. torch_dist data files do not:
# those seeds hold the folder's metadata.json, .metadata and common.pt only.
MEGATRON_STRIP = r"""
import os, sys, torch
sys.path.insert(0, sys.argv[1])
from megatron_fixtures import standins
standins.install()
src, dst, keep_optim = sys.argv[2], sys.argv[3], sys.argv[4] == "1"
rng = {"rng_state", "random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states"}
for dirpath, _, names in os.walk(src):
    for n in names:
        rel = os.path.relpath(os.path.join(dirpath, n), src)
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        if n == "model_optim_rng.pt":
            sd = torch.load(os.path.join(src, rel), map_location="cpu")
            sd = {k: v for k, v in sd.items() if k not in rng and (keep_optim or k != "optimizer")}
            if not keep_optim:  # one layer per model chunk (the optimizer state numbers every parameter)
                a = sd["args"]
                a.num_layers = (getattr(a, "pipeline_model_parallel_size", None) or 1) * (getattr(a, "virtual_pipeline_model_parallel_size", None) or 1)
                for k, chunk in sd.items():
                    if k.startswith("model"):
                        lm = chunk["language_model"]
                        enc = lm["encoder"] if "encoder" in lm else lm["transformer"]
                        for key in [x for x in enc if x.startswith("layers.") and not x.startswith("layers.0.")]:
                            del enc[key]
            torch.save(sd, os.path.join(dst, rel))
        elif n != "distrib_optim.pt" or keep_optim:
            with open(os.path.join(src, rel), "rb") as f, open(os.path.join(dst, rel), "wb") as g:
                g.write(f.read())
"""


def megatron_seeds(mg):
    """(seed name, flags, files) for the megatron target."""
    out = []
    if not os.path.isdir(mg):
        return out
    import subprocess
    import tempfile
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        for case, optim, flags in (("gpt2_tp2_pp1_v0_oldkeys", False, 16), ("qwen_tp2_pp2_vpp2_bf16_distopt", False, 18),
                                   ("gpt2_tp2_pp2_fp16_2306", False, 6),
                                   ("gpt2_tp1_pp1_fp32", True, 1)):
            dst = os.path.join(tmp, case)
            r = subprocess.run(["/usr/bin/python3", "-c", MEGATRON_STRIP, os.path.join(here, "..", "python"), os.path.join(mg, case), dst,
                                "1" if optim else "0"], capture_output=True, text=True)
            if r.returncode != 0:
                print(f"skip megatron/{case}: {r.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
                continue
            out.append((case, flags, tree(dst)))
    for case in ("mcore_te_stacked_tp2_pp2", "mcore_local_perlayer_tp2"):
        p = os.path.join(mg, case)
        files = [f for f in tree(p) if f[0] in ("metadata.json", ".metadata", "common.pt")]
        if files:
            out.append((case, 1, files))
    return out


def safe_name(s):
    return re.sub(r"[^A-Za-z0-9._-]", "_", s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus"))
    ap.add_argument("--torch2-fixtures", help="folder with gen_t2_objects/ and gen_t2_torch/ (PyTorch 2.x fixtures)")
    a = ap.parse_args()
    fx = a.fixtures
    seeds = {}  # target -> {name: bytes}

    def add(target, name, data):
        if len(data) > MAX_SEED:
            print(f"skip {target}/{name}: {len(data)} bytes", file=sys.stderr)
            return
        seeds.setdefault(target, {})[safe_name(name)] = data

    def add_large(target, name, data, limit):
        """One seed that only fits a larger cap (a Megatron rank file with its optimizer state)."""
        if len(data) <= limit:
            seeds.setdefault(target, {})[safe_name(name)] = data

    st_dir = os.path.join(fx, "gen_safetensors")
    st_files = sorted(f for f in os.listdir(st_dir) if f.endswith(".safetensors"))
    for f in st_files:
        data = read(os.path.join(st_dir, f))
        add("safetensors", f, data)
        add("safetensors_roundtrip", f, data)

    # HF index: the shards the target creates are a.safetensors (x, y), b.safetensors (z, alias t)
    # and model-00001-of-00002.safetensors (w).
    idx = [
        {"metadata": {"total_size": 34}, "weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors",
                                                          "w": "model-00001-of-00002.safetensors"}},
        {"weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors", "t": "b.safetensors",
                        "w": "model-00001-of-00002.safetensors"}},
        {"metadata": {"total_size": 24, "format": "pt", "statedict.skeleton": json.dumps({"root": {"dict": []}})},
         "weight_map": {"x": "a.safetensors", "y": "a.safetensors"}},
    ]
    for i, j in enumerate(idx):
        add("hf_index", f"index{i}.json", json.dumps(j, indent=2).encode())

    pt_dir = os.path.join(fx, "gen_torch_files")
    pt_files = sorted(f for f in os.listdir(pt_dir) if not f.endswith(".json"))
    for f in pt_files:
        data = read(os.path.join(pt_dir, f))
        add("torch", f, data)
        add("torch_roundtrip", f, data)
        if data[:4] == b"PK\x03\x04":
            add("zip", f, data)
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                for n in z.namelist():
                    if n.endswith("data.pkl"):
                        add("pickle", f + ".data.pkl", z.read(n))
                        add("pickle_roundtrip", f + ".data.pkl", z.read(n))
        else:
            add("pickle", f, data)  # legacy: the first pickle is the magic number
            add("pickle_roundtrip", f, data)

    sh = os.path.join(fx, "gen_sharded")
    for d in sorted(os.listdir(sh)):
        p = os.path.join(sh, d)
        if not os.path.isdir(p):
            continue
        if d.startswith("dcp_"):
            md = read(os.path.join(p, ".metadata"))
            add("dcp_metadata", d + ".metadata", md)
            add("pickle", d + ".metadata", md)
            add("pickle_roundtrip", d + ".metadata", md)
            if d.endswith("single_file") and d in ("dcp_w2_single_file", "dcp_w4_single_file"):
                files = tree(p)
                add("dcp", d, multi(0, files))
                add("dcp", d + "_pread", multi(1, files))
                add("open", d, multi(0, files))
            distcp = os.path.join(p, "__0_0.distcp")
            if os.path.exists(distcp) and d == "dcp_w2":
                add("zip", d + "__0_0.distcp", read(distcp))
        if d == "st_ranks_w2":
            files = tree(p)
            add("sharded_tensor", d, multi(0, files))
            add("sharded_tensor", d + "_replicas", multi(1, files))
            add("open", d, multi(2, files))

    zf = os.path.join(fx, "gen_zero_fsdp")
    for d in ("zero1_ws1_fp32", "zero3_ws1_fp32", "zero2_ws2_fp16", "zero1_ws3_fp16_elastic"):
        p = os.path.join(zf, d)
        if not os.path.isdir(p):
            continue
        files = tree(p, skip=[r"\.py$"])
        add("deepspeed", d, multi(0, files))
        add("deepspeed", d + "_optim", multi(1, files))
        if d == "zero1_ws1_fp32":
            add("open", d, multi(1, files))
    # Files the real DeepSpeed engine wrote (tests/data/deepspeed-engine): ZeRO-3 partitions with
    # their ds_id attribute, the BF16_Optimizer's files; read with the optimizer, written again for
    # 2 ranks (flags 1 | 16 | 1 << 5) and read back.
    engine = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests", "data",
                          "deepspeed-engine")
    for d, flags in (("zero3_ws2_fp32", 1 | 16 | 32), ("bf16opt_ws2", 1 | 2 | 16 | 32)):
        p = os.path.join(engine, d)
        if os.path.isdir(p):
            add_large("deepspeed", "engine_" + d, multi(flags, tree(p)), 128 * 1024)
    for d in ("olmo_fsdp_torch21_flat_ws2", "olmo_fsdp_torch20_ws2"):
        p = os.path.join(zf, d, "step2")
        if not os.path.isdir(p):
            continue
        files = tree(p, skip=[r"^train/rank[1-9]", r"config\.yaml$"])
        add("fsdp", d, multi(0, [f for f in files if not f[0].startswith("train/")]))
        add("fsdp", d + "_optim_train", multi(3, files))
        if d == "olmo_fsdp_torch21_flat_ws2":
            add("open", d, multi(0, [f for f in files if not f[0].startswith("train/")]))

    for name, flags, files in megatron_seeds(os.path.join(fx, "gen_megatron")):
        add_large("megatron", name, multi(flags, files), 2 * MAX_SEED)
    od = os.path.join(fx, "gen_olmo_st")
    if os.path.isdir(od):
        for f in ("olmo_model.safetensors", "olmo_nested.safetensors", "olmo_optim.safetensors"):
            add("olmo", f, read(os.path.join(od, f)))
        add("open", "olmo_nested", multi(0, [("olmo_nested.safetensors", read(os.path.join(od, "olmo_nested.safetensors")))]))
    cd = os.path.join(fx, "gen_colossalai")
    for d, flags in (("colossalai_dist_tp2_dp2_st_sharded", 4 | 8), ("colossalai_dist_tp2_bin_sharded", 2),
                     ("colossalai_hybrid_tp2_async", 1)):
        p = os.path.join(cd, d)
        if os.path.isdir(p):
            add("colossalai", f"{d}_{flags}", multi(flags, tree(p, skip=[r"lr_scheduler$"])))
    fd = os.path.join(fx, "gen_fairscale")
    for d, flags in (("metaseq_fsdp_ws2_fp16", 1), ("fairseq_fsdp_v037_ws2", 1)):
        p = os.path.join(fd, d)
        if os.path.isdir(p):
            add("fairscale", f"{d}_{flags}", multi(flags, tree(p)))
    if a.torch2_fixtures:
        t2 = a.torch2_fixtures
        picks = [("gen_t2_torch", f"legacy_p{p}.pt") for p in range(6)] + [
            ("gen_t2_objects", f"{c}{s}.pt") for c in ("fairseq_args", "numpy_arrays", "sparse", "quantized", "parameter_state")
            for s in ("", "_p5")]
        for gen, f in picks:
            path = os.path.join(t2, gen, f)
            if not os.path.exists(path):
                continue
            data = read(path)
            same_as_other = f in ("legacy_p2.pt", "legacy_p3.pt", "legacy_p5.pt")  # p1 and p4 have their opcodes
            if f != "legacy_p2.pt":  # the torch 1.13 fixtures have protocol 2 already
                add("torch", "t2_" + f, data)
            if same_as_other:
                continue
            add("torch_roundtrip", "t2_" + f, data)
            if data[:4] == b"PK\x03\x04":
                with zipfile.ZipFile(io.BytesIO(data)) as z:
                    for n in z.namelist():
                        if n.endswith("data.pkl"):
                            add("pickle", "t2_" + f + ".data.pkl", z.read(n))
                            add("pickle_roundtrip", "t2_" + f + ".data.pkl", z.read(n))
            else:  # the sys_info and object pickles of a legacy file, each a seed of its own
                stream = io.BytesIO(data)
                for i in range(4):
                    start = stream.tell()
                    for _ in pickletools.genops(stream):
                        pass
                    if i >= 2:
                        add("pickle", f"t2_{f}.{i}.pkl", data[start:stream.tell()])
        for f in ("legacy_p1.pt", "numpy_arrays_p5.pt"):
            gen = "gen_t2_torch" if f.startswith("legacy") else "gen_t2_objects"
            path = os.path.join(t2, gen, f)
            if os.path.exists(path):
                add("open", "t2_" + f, multi(0, [(f, read(path))]))

    add("open", "one_tensor.safetensors", multi(0, [("model.safetensors", read(os.path.join(st_dir, "metadata.safetensors")))]))
    add("open", "tied.pt", multi(0, [("tied.pt", read(os.path.join(pt_dir, "tied.pt")))]))
    add("open", "legacy_views.pt", multi(0, [("legacy_views.pt", read(os.path.join(pt_dir, "legacy_views.pt")))]))

    total = 0
    for target, files in sorted(seeds.items()):
        d = os.path.join(a.out, target)
        os.makedirs(d, exist_ok=True)
        for name, data in sorted(files.items()):
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
            total += len(data)
        print(f"{target}: {len(files)} seeds")
    print(f"total {total} bytes")


if __name__ == "__main__":
    main()
