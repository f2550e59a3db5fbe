#!/usr/bin/python3
"""Self-test of the OLMo / ColossalAI / fairscale fixture generators and of layout_check.py.

    /usr/bin/python3 tests/python/selftest_layouts.py [WORKDIR]

1. Runs gen_olmo_st.py, gen_colossalai.py and gen_fairscale.py into WORKDIR/fixtures/<generator>/
   (each one already proves that the reference reader gives back its source model bit for bit).
2. layout_check.py must accept every fixture against its own manifests (the optimizer ones too),
   and torch_check.py every fairscale rank-0 manifest.
3. It must reject broken files and manifests, each with the expected reason.
WORKDIR defaults to a temporary folder that is removed afterwards. Exit 0 when every expectation holds.
"""
import contextlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
PY = "/usr/bin/python3"
GENERATORS = ("gen_olmo_st.py", "gen_colossalai.py", "gen_fairscale.py")
failures = []


def check(label, argv, rc, contains=None, tool="layout_check"):
    """Run layout_check.main / torch_check.main in this process and compare exit code and output."""
    mod = __import__(tool)
    out = io.StringIO()
    t = time.time()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = mod.main([tool + ".py"] + argv)
    ok = code == rc and (contains is None or contains in out.getvalue())
    print(f"{'ok  ' if ok else 'FAIL'} {label} (rc {code}, {time.time() - t:.2f}s)")
    if not ok:
        failures.append(label)
        print("     stdout:", out.getvalue().strip()[-800:])


def manifests(d):
    for n in sorted(os.listdir(d)):
        if n.endswith(".manifest.json"):
            with open(os.path.join(d, n), encoding="utf-8") as f:
                yield n[:-len(".manifest.json")], os.path.join(d, n), json.load(f)


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)


# --------------------------------------------------------------------------- OLMo negatives
def olmo_negatives(fx, work):
    import torch
    import gen_olmo_st as gen
    import gen_safetensors as G
    import _common as C
    d = os.path.join(fx, "gen_olmo_st")
    m_optim = os.path.join(d, "olmo_optim.manifest.json")

    m = json.load(open(m_optim))
    first = next(iter(m["tensors"]))
    m["tensors"][first]["sha256"] = "0" * 64
    bad = os.path.join(work, "olmo_bad_sha.manifest.json")
    write_json(bad, m)
    check("olmo: wrong sha", ["olmo", os.path.join(d, "olmo_optim.safetensors"), bad], 1, f"{first}: sha256")

    state = gen.optim_case()
    state["state"] = {str(k): v for k, v in state["state"].items()}  # int ids written as str
    p = os.path.join(work, "olmo_str_ids.safetensors")
    gen.write_olmo_file(state, p)
    check("olmo: str keys where OLMo has int ids", ["olmo", p, m_optim], 1, "stored with other key types")

    state = gen.optim_case()
    state["param_groups"] = [dict(g, betas=list(g["betas"])) for g in state["param_groups"]]
    p = os.path.join(work, "olmo_list_betas.safetensors")
    gen.write_olmo_file(state, p)
    check("olmo: a tuple written as a list", ["olmo", p, m_optim], 1, "pickled value")

    def key(path, pickled, memo=True, proto=4):
        if not memo:  # equal strings as distinct objects: no BINGET
            path = tuple(k[:1] + k[1:] if isinstance(k, str) else k for k in path)
        raw = pickle.dumps((path, pickled), protocol=proto)
        import base64
        return base64.urlsafe_b64encode(raw).decode()

    one = torch.tensor([1.0, 2.0])
    tb = C.tensor_bytes(one)

    def write(path, tensors):
        with open(path, "wb") as f:
            f.write(G.serialize(tensors, metadata=None))

    p = os.path.join(work, "olmo_nomemo.safetensors")
    # ("repeat", "repeat", "repeat") encoded without memo: decodes the same, is not canonical
    nested = gen.nested_case()
    gen.write_olmo_file(nested, p)
    tensors = {}
    from layouts import olmo_safetensors as olmo
    ents, _ = olmo.read_entries(p)
    for e in ents:
        name = e.name
        if e.keys == ("repeat", "repeat", "repeat"):
            name = key(e.keys, e.pickled, memo=False)
            assert name != e.name
        tensors[name] = (e.tensor.dtype, e.tensor.shape, e.tensor.data)
    write(p, tensors)
    mn = os.path.join(d, "olmo_nested.manifest.json")
    check("olmo: unmemoized repeated key strings decode the same", ["olmo", p, mn], 0)
    check("olmo: ... but are not canonical", ["olmo", p, mn, "--canonical"], 1, "NotCanonical")
    check("olmo: protocol-5 names decode the same",
          ["olmo", _rewrite(work, "olmo_p5", ents, lambda e: key(e.keys, e.pickled, proto=5), write), mn], 0)

    evil_key = __import__("base64").urlsafe_b64encode(b"\x80\x02cposix\nsystem\nX\x04\x00\x00\x00true\x85R.").decode()
    p = os.path.join(work, "olmo_evil_key.safetensors")
    write(p, {evil_key: ("F32", [2], tb)})
    check("olmo: a key pickle naming a global", ["olmo", p, mn], 1, "BadKeyPickle")
    p = os.path.join(work, "olmo_dup.safetensors")
    write(p, {key(("ab", "ab"), False): ("F32", [2], tb), key(("ab", "ab"), False, memo=False): ("F32", [2], tb)})
    check("olmo: one key path stored twice", ["olmo", p, mn], 1, "DuplicateKeyPath")
    p = os.path.join(work, "olmo_conflict.safetensors")
    pk = pickle.dumps([1, 2], protocol=4)
    write(p, {key(("a",), True): ("U8", [len(pk)], pk), key(("a", 1), False): ("F32", [2], tb)})
    check("olmo: a path through a leaf", ["olmo", p, mn], 1, "KeyPathConflict")
    p = os.path.join(work, "olmo_f32_pickle.safetensors")
    write(p, {key(("a",), True): ("F32", [2], tb)})
    check("olmo: a pickled value that is not U8", ["olmo", p, mn], 1, "PickledNotU8")
    p = os.path.join(work, "olmo_not_b64.safetensors")
    write(p, {"model.weight": ("F32", [2], tb)})
    check("olmo: a plain safetensors name", ["olmo", p, mn], 1, "BadKeyBase64")
    check("olmo: malicious value refused", ["olmo", os.path.join(d, "olmo_malicious.safetensors"),
                                            os.path.join(d, "olmo_malicious.manifest.json")], 1, "posix.system")
    m = json.load(open(os.path.join(d, "olmo_malicious.manifest.json")))
    ok = not os.path.exists(m["malicious"]["sentinel"])
    print(f"{'ok  ' if ok else 'FAIL'} olmo: malicious sentinel never created")
    if not ok:
        failures.append("olmo sentinel")


def _rewrite(work, name, ents, namer, write):
    p = os.path.join(work, name + ".safetensors")
    write(p, {namer(e): (e.tensor.dtype, e.tensor.shape, e.tensor.data) for e in ents})
    return p


# --------------------------------------------------------------------------- ColossalAI negatives
def colossalai_negatives(fx, work):
    import torch
    d = os.path.join(fx, "gen_colossalai")

    def copy(case):
        dst = os.path.join(work, case)
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(os.path.join(d, case), dst)
        return dst, os.path.join(d, case + ".manifest.json")

    c, m = copy("colossalai_dist_tp2_bin_sharded")
    os.remove(os.path.join(c, "pytorch_model-meta-dist-00001.json"))
    check("colossalai dist: a rank's metadata missing", ["colossalai", c, m], 1, "NotCovered")

    c, m = copy("colossalai_dist_tp3_bin_unsharded")
    f = os.path.join(c, "pytorch_model-dist-00001.bin")
    sd = torch.load(f)
    sd["norm.bias"] = sd["norm.bias"] + 1
    torch.save(sd, f)
    check("colossalai dist: replicas that differ", ["colossalai", c, m], 1, "ReplicasDiffer")

    c, m = copy("colossalai_dist_tp2_dp2_st_sharded")
    mf = os.path.join(c, "pytorch_model-meta-dist-00001.index.json")
    doc = json.load(open(mf))
    doc["metadata"]["lm_head.weight"]["offsets"][0] -= 1
    json.dump(doc, open(mf, "w"), indent=4)
    check("colossalai dist: an overlapping box", ["colossalai", c, m], 1, "ReplicasDiffer")

    c, m = copy("colossalai_dist_tp2_padded_vocab_O")
    mf = os.path.join(c, "pytorch_model-meta-dist-00001.json")
    doc = json.load(open(mf))
    doc["metadata"]["embed_tokens.weight"]["lengths"][0] += 2  # let the padding rows through
    doc["metadata"]["embed_tokens.weight"]["global_shape"][0] += 2
    doc["metadata"]["lm_head.weight"]["lengths"][0] += 2
    doc["metadata"]["lm_head.weight"]["global_shape"][0] += 2
    json.dump(doc, open(mf, "w"), indent=4)
    check("colossalai dist: global shapes that differ between ranks", ["colossalai", c, m], 1, "GlobalShapeDiffers")

    c, m = copy("colossalai_hybrid_tp2_bin")
    om = os.path.join(d, "colossalai_hybrid_tp2_bin.optim.manifest.json")
    idx = os.path.join(c, "modeling", "pytorch_model.bin.index.json")
    doc = json.load(open(idx))
    items = list(doc["weight_map"].items())
    items[0], items[1] = items[1], items[0]  # embed_tokens and pos_embed change places
    doc["weight_map"] = dict(items)
    json.dump(doc, open(idx, "w"), indent=2)
    check("colossalai hybrid: parameter order that does not fit the optimizer",
          ["colossalai", c, m, "--optim", om], 1, "ParamOrderMismatch")

    c, m = copy("colossalai_hybrid_pp2_tp2_st")
    os.remove(os.path.join(c, "modeling", "model-stage-00002-shard-00001.safetensors"))
    check("colossalai hybrid: a shard file missing", ["colossalai", c, m], 1, "MissingFile")


# --------------------------------------------------------------------------- fairscale negatives
def fairscale_negatives(fx, work):
    import torch
    d = os.path.join(fx, "gen_fairscale")

    def copy(case):
        dst = os.path.join(work, case)
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(os.path.join(d, case), dst)
        return dst, os.path.join(d, case + ".manifest.json"), os.path.join(d, case + ".optim.manifest.json")

    c, m, om = copy("metaseq_fsdp_ws3_fp16")
    os.remove(os.path.join(c, "checkpoint_last-model_part-0-shard1.pt"))
    check("fairscale: a rank file missing", ["fairscale", c, m], 1, "MissingRank")

    c, m, om = copy("metaseq_fsdp_ws2_fp16")
    os.remove(os.path.join(c, "checkpoint_last-model_part-0-shard1.pt"))
    check("fairscale: the last rank file missing", ["fairscale", c, m], 1, "PaddingRule")

    c, m, om = copy("fairseq_fsdp_ws3_fp32_expert")
    f = os.path.join(c, "checkpoint_last-shard2.pt")
    sd = torch.load(f)
    sd["fsdp_metadata"]["param_metadata"][1]["params"]["flat_param_0"]["padding"] += 1
    torch.save(sd, f)
    check("fairscale: padding that breaks the chunk rule", ["fairscale", c, m], 1, "PaddingRule")

    c, m, om = copy("fairseq_fsdp_ws2_fp32_expert")
    f = os.path.join(c, "checkpoint_last-shard1.pt")
    sd = torch.load(f)
    sd["last_optimizer_state"]["state"][0]["step"] = 3
    torch.save(sd, f)
    check("fairscale: step that differs between ranks", ["fairscale", c, m, "--optim", om], 1, "StateDiffers")

    check("fairscale: fairscale's own ties lose the root and layer-0 ties",
          ["fairscale", os.path.join(d, "metaseq_fsdp_ws2_fp16"), os.path.join(d, "metaseq_fsdp_ws2_fp16.manifest.json"),
           "--fairscale-ties"], 1, "decoder.output_projection.weight: tensor missing")

    c, m, om = copy("metaseq_fsdp_ws2_fp16")
    f = os.path.join(c, "checkpoint_last-model_part-0-shard0.pt")
    sd = torch.load(f)
    sd["model"]["decoder.layers.0.flat_param_0"][-1] += 1  # a real element, rank 0 has no padding there
    torch.save(sd, f)
    check("fairscale: a changed weight", ["fairscale", c, m], 1, "sha256")


def main(argv):
    args = [a for a in argv[1:] if not a.startswith("--")]
    work = args[0] if args else tempfile.mkdtemp(prefix="statedict_layouts_")
    keep = bool(args)
    os.makedirs(work, exist_ok=True)
    fx = os.path.join(work, "fixtures")
    try:
        for gen in GENERATORS:
            out = os.path.join(fx, gen[:-3])
            shutil.rmtree(out, ignore_errors=True)
            t = time.time()
            r = subprocess.run([PY, os.path.join(HERE, gen), out], capture_output=True, text=True, timeout=600)
            dt = time.time() - t
            size = sum(os.path.getsize(os.path.join(a, f)) for a, _, fs in os.walk(out) for f in fs)
            print(f"{'ok  ' if r.returncode == 0 else 'FAIL'} generate {gen} ({dt:.1f}s, {size / 1e6:.2f} MB)")
            if r.returncode:
                failures.append(gen)
                print(r.stdout[-2000:], r.stderr[-2000:])
                return 1

        for case, mpath, m in manifests(os.path.join(fx, "gen_olmo_st")):
            if "malicious" in m:
                continue
            check(f"olmo {case} --canonical", ["olmo", os.path.join(fx, "gen_olmo_st", m["path"]), mpath,
                                               "--canonical"], 0)
        for gen, layout in (("gen_colossalai", "colossalai"), ("gen_fairscale", "fairscale")):
            d = os.path.join(fx, gen)
            for case, mpath, m in manifests(d):
                if case.endswith(".optim"):
                    continue
                if case.endswith(".rank0"):
                    check(f"torch_check {case}", [os.path.join(d, m["path"]), mpath], 0, tool="torch_check")
                    continue
                argv = [layout, os.path.join(d, m["path"]), mpath]
                if os.path.exists(os.path.join(d, case + ".optim.manifest.json")):
                    argv += ["--optim", os.path.join(d, case + ".optim.manifest.json")]
                check(f"{layout} {case}", argv, 0)

        olmo_negatives(fx, work)
        colossalai_negatives(fx, work)
        fairscale_negatives(fx, work)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{len(failures)} failure(s)" if failures else "all ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
