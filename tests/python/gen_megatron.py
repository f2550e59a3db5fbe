#!/usr/bin/python3
"""Megatron-LM checkpoint fixtures: legacy (torch format) TP/PP/virtual-PP checkpoints with the
expected merged model and optimizer state, and (when a torch 2.x runner is available) Megatron-core
torch_dist checkpoints.  See tests/python/megatron_fixtures/README.md and tests/python/layouts/megatron.md.

    /usr/bin/python3 tests/python/gen_megatron.py OUTDIR [--only SUBSTRING] [--no-selftest]
                                                         [--no-torch-dist]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import _common  # noqa: E402
from megatron_fixtures import cases as C  # noqa: E402
from megatron_fixtures import legacy_layout as L  # noqa: E402
from megatron_fixtures import megatron_ref as R  # noqa: E402
from megatron_fixtures import model as M  # noqa: E402
from megatron_fixtures import standins  # noqa: E402


# --------------------------------------------------------------------------- manifests
def model_manifest(case, model, files):
    cfg = case.cfg
    m = _common.make_manifest("megatron", model)
    m["path"] = case.name
    m["megatron"] = {
        "layout": "legacy",
        "tensor_model_parallel_size": case.tp,
        "pipeline_model_parallel_size": case.pp,
        "virtual_pipeline_model_parallel_size": case.vpp,
        "checkpoint_version": case.checkpoint_version,
        "qkv_order_in_files": {0.0: "[3, np, hn]", 1.0: "[np, hn, 3]"}.get(case.qkv_version, "[ng, np/ng + 2, hn]"),
        "iteration": None if case.release else case.iteration,
        "release": case.release,
        "true_vocab_size": cfg.true_vocab_size,
        "padded_vocab_size": cfg.padded_vocab_size(case.tp),
        "vocab_in_manifest": "padded (as stored)",
        "num_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_query_groups": cfg.num_query_groups,
        "kv_channels": cfg.kv_channels,
        "swiglu": cfg.swiglu,
        "untie_embeddings_and_output_weights": cfg.untie_embeddings_and_output_weights,
        "params_dtype": case.dtype,
        "optimizer": case.optimizer,
        "era": case.era,
        "files": files,
    }
    return m


def expected_optimizer(case, trained, merged_groups):
    """The merged optimizer state, from the training run (not from the files)."""
    obj = {"optimizer": {"state": {}, "param_groups": merged_groups}}
    st = obj["optimizer"]["state"]
    for n in trained.params:
        e = {"exp_avg": trained.exp_avg[n], "exp_avg_sq": trained.exp_avg_sq[n]}
        if case.dtype != "fp32":
            e["fp32_param"] = trained.params[n]
        if case.optimizer == "plain":
            e["step"] = trained.step[n]
        st[n] = e
    return obj


def expected_groups(case, trained, rank0_groups):
    """Merged param groups: group order by first appearance walking the canonical model
    (which starts with the 2-D word embedding, so decayed first), params in canonical order,
    hyperparameters as saved by the first rank."""
    keys = []
    members = {}
    for n, t in trained.params.items():
        k = M.no_weight_decay(n, t.shape)
        if k not in members:
            keys.append(k)
            members[k] = []
        members[k].append(n)
    out = []
    for gi, k in enumerate(keys):
        g = {kk: vv for kk, vv in rank0_groups[gi].items() if kk != "params"}
        if g.get("wd_mult") is not None and g["wd_mult"] != (0.0 if k else 1.0):
            raise AssertionError("rank 0's group order is not decayed-first")
        g["params"] = members[k]
        out.append(g)
    return out


def merged_optimizer_obj(merged, case):
    obj = {"optimizer": {"state": {}, "param_groups": merged.param_groups}}
    for n, d in merged.optimizer.items():
        obj["optimizer"]["state"][n] = dict(d)
    return obj


def rank0_manifest(case, path):
    sd = R.load(path)
    m = _common.make_manifest("torch", sd)
    ns, arrays = {}, {}
    for name, v in list(m["values"].items()):
        obj = v.get("object") if isinstance(v, dict) else None
        if obj == "argparse.Namespace":
            m["values"][name] = {"object": "argparse.Namespace"}
        elif obj == "numpy.ndarray":
            m["values"][name] = {"object": "numpy.ndarray"}
    import numpy as np
    for path_t, leaf in _common.iter_leaves(sd):
        name = _common.dotted(path_t)
        if isinstance(leaf, argparse.Namespace):
            ns[name] = {k: _common.json_value(v) for k, v in vars(leaf).items()}
        elif isinstance(leaf, np.ndarray):
            arrays[name] = {"dtype": str(leaf.dtype), "shape": list(leaf.shape),
                            "sha256": _common.sha256_hex(np.ascontiguousarray(leaf).astype(leaf.dtype.newbyteorder("<")).tobytes())}
    m["namespaces"] = ns
    m["numpy_arrays"] = arrays
    attrs = _common.dict_attributes(sd)
    if attrs:
        m["dict_attributes"] = attrs
    m["path"] = os.path.relpath(path, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(path)))))
    return m


# --------------------------------------------------------------------------- checks
def same_tensors(a, b, what):
    problems = []
    if list(a) != list(b):
        problems.append(f"{what}: names/order differ: {sorted(set(a) ^ set(b))[:5]} ... "
                        f"(first {list(a)[:3]} vs {list(b)[:3]})")
        return problems
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            problems.append(f"{what}: {k} differs ({x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)})")
    return problems


def check_manifest_equal(m1, m2, what):
    p = []
    for key in ("tensors", "values"):
        if list(m1[key]) != list(m2[key]):
            p.append(f"{what}: {key} names differ: {sorted(set(m1[key]) ^ set(m2[key]))[:6]}")
            continue
        for k in m1[key]:
            if key == "tensors" and m1[key][k] != m2[key][k]:
                p.append(f"{what}: tensor {k} differs")
            if key == "values" and not _common.values_equal(m1[key][k], m2[key][k]):
                p.append(f"{what}: value {k} differs: {m1[key][k]!r} vs {m2[key][k]!r}")
    return p


def selftest_case(case, trained, outdir):
    problems = []
    source = trained.model(case.torch_dtype)
    merged = R.merge(os.path.join(outdir, case.name))
    problems += same_tensors(merged.model, source, f"{case.name} merged model")
    if case.optimizer != "none":
        exp = expected_optimizer(case, trained, expected_groups(case, trained, merged.rank0["optimizer"]["optimizer"]["param_groups"]
                                                               if "optimizer" in merged.rank0["optimizer"] else merged.rank0["optimizer"]["param_groups"]))
        got = merged_optimizer_obj(merged, case)
        problems += check_manifest_equal(_common.make_manifest("x", exp), _common.make_manifest("x", got),
                                         f"{case.name} merged optimizer")
    # split -> merge round trips through files, with Megatron's saver rules
    targets = [(2, 1, None), (1, 2, None)] if case.tp == 4 else [(1, 1, None)]
    if case.vpp:
        targets.append((1, 2, 2))
    for tp, pp, vpp in targets:
        if case.cfg.num_query_groups % tp or case.cfg.num_layers % (pp * (vpp or 1)):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            R.write_split(merged.model, merged.facts, tmp, tp, pp, vpp, args_template=merged.rank0["args"])
            again = R.merge(tmp, with_optimizer=False)
            problems += same_tensors(again.model, source, f"{case.name} split(tp={tp}, pp={pp}, vpp={vpp}) -> merge")
    # the reference split equals the writer's per-rank tensors
    parts = R.split(merged.model, merged.facts, case.tp, case.pp, case.vpp)
    for (r, p), chunks in parts.items():
        if case.era != "core_v0.8" or case.qkv_version < 2:
            break
        sd = R.load(os.path.join(outdir, case.name, L.iter_dir_name(case), L.rank_dir_name(case, r, p), "model_optim_rng.pt"))
        for v, chunk in enumerate(chunks):
            mine = [(k, t) for k, t, _ in R.chunk_tensors(chunk)]
            theirs = [(k, t) for k, t, _ in R.chunk_tensors(R.chunks_of(sd)[v])]
            if [k for k, _ in mine] != [k for k, _ in theirs] or any(not torch.equal(a, b) for (_, a), (_, b) in zip(mine, theirs)):
                problems.append(f"{case.name}: reference split of rank {r},{p} chunk {v} differs from the file")
            mine_keys = _enc_keys(chunk)
            their_keys = _enc_keys(R.chunks_of(sd)[v])
            if mine_keys != their_keys:
                problems.append(f"{case.name}: encoder keys of rank {r},{p} chunk {v} differ: {mine_keys[:4]} vs {their_keys[:4]}")
    return problems


def _enc_keys(chunk):
    return list(chunk["language_model"]["encoder"].keys())


# --------------------------------------------------------------------------- main
def run_legacy(outdir, only, selftest):
    index = []
    problems = []
    trained_cache = {}
    for case in C.LEGACY_CASES:
        if only and only not in case.name:
            continue
        key = (case.cfg.name, case.tp, case.seed)
        if key not in trained_cache:
            trained_cache[key] = M.train(case.cfg, case.tp, case.seed)
        trained = trained_cache[key]
        shutil.rmtree(os.path.join(outdir, case.name), ignore_errors=True)
        files = L.write_case(case, trained, outdir)
        source = trained.model(case.torch_dtype)
        _common.write_manifest(outdir, case.name, model_manifest(case, source, files))
        first = os.path.join(outdir, case.name, L.iter_dir_name(case), L.rank_dir_name(case, 0, 0), "model_optim_rng.pt")
        if case.rank0_manifest:
            r0 = rank0_manifest(case, first)
            r0["path"] = os.path.join(case.name, L.iter_dir_name(case), L.rank_dir_name(case, 0, 0), "model_optim_rng.pt")
            _common.write_manifest(outdir, case.name + ".rank0", r0)
        if case.optimizer != "none":
            sd0 = R.load(first)
            opt0 = sd0["optimizer"]
            groups0 = opt0["optimizer"]["param_groups"] if "optimizer" in opt0 else opt0["param_groups"]
            exp = expected_optimizer(case, trained, expected_groups(case, trained, groups0))
            om = _common.make_manifest("megatron_optim", exp)
            om["path"] = case.name
            _common.write_manifest(outdir, case.name + ".optim", om)
        if selftest:
            problems += selftest_case(case, trained, outdir)
        index.append({"case": case.name, "format": "megatron_legacy", "path": case.name,
                      "tp": case.tp, "pp": case.pp, "vpp": case.vpp, "description": case.description})
    return index, problems


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--only", default="")
    ap.add_argument("--no-selftest", action="store_true")
    ap.add_argument("--no-torch-dist", action="store_true")
    a = ap.parse_args(argv)
    os.makedirs(a.outdir, exist_ok=True)
    t0 = time.time()
    torch.manual_seed(0)
    index, problems = run_legacy(a.outdir, a.only, not a.no_selftest)
    if not a.no_torch_dist:
        from megatron_fixtures import torch_dist_runner
        idx2, p2 = torch_dist_runner.run(a.outdir, a.only, not a.no_selftest)
        index += idx2
        problems += p2
    with open(os.path.join(a.outdir, "megatron_cases.json"), "w") as f:
        json.dump(index, f, indent=1)
        f.write("\n")
    for p in problems:
        print("PROBLEM:", p)
    print(f"gen_megatron: {len(index)} cases in {time.time() - t0:.1f} s, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
