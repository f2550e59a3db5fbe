"""torch_dist (Megatron-core distributed checkpoint) fixtures, driven from torch 1.13.

Megatron-core's torch_dist format is torch.distributed.checkpoint (DCP) of torch >= 2.x, which
torch 1.13 cannot write.  This runner trains the models with torch 1.13 (the same numbers as the
legacy cases), hands them to ``torch_dist_layout.py`` running under the Debian sid root's
python3 (torch 2.x; tools/sid-python), and checks what that wrote by unstacking it here, without
the writer's code.  Without a torch 2.x runner the cases are skipped (with a message).

Runner: $STATEDICT_TORCH2_PYTHON (a command) when set, else tools/sid-python when the sid root
exists ($STATEDICT_SID_ROOT, default /var/cache/statedict/sid-root, with its stamp file).
This never builds the sid root itself.
"""
import argparse
import os
import shlex
import subprocess
import tempfile
from collections import OrderedDict

import torch

import _common
from . import legacy_layout as L
from . import model as M
from . import standins

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SPECS = [
    dict(name="mcore_te_stacked_tp2_pp2", config="llama_gqa", tp=2, pp=2, seed=21, te=True, stacked=True,
         singleton_local_shards=False, optimizer=True, common="file", mcore_metadata=True, thread_count=2,
         description="core_v0.15.0 defaults: TE layer names, layers stacked on a leading axis, SwiGLU fc1 as "
                     "one key (W halves then V halves), common.pt, .metadata pickles MCoreMetadata, two "
                     "files per rank, optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.* keys, rng_state objects"),
    dict(name="mcore_local_perlayer_tp2", config="llama_gqa", tp=2, pp=1, seed=22, te=False, stacked=False,
         singleton_local_shards=True, optimizer=False, common="object", mcore_metadata=False, thread_count=1,
         description="core_v0.19.0 layout: local layer spec (same keys, `_extra_state` None), per-layer keys decoder.layers.<i>.*, "
                     "singleton_local_shards (linear_fc1.weight_w / _v), common state as the "
                     "'common_state' ShardedObject (no common.pt), plain torch Metadata, one file per rank, no optimizer"),
    dict(name="mcore_te_stacked_gpt2_tp2", config="gpt2_mha", tp=2, pp=1, seed=23, te=True, stacked=True,
         singleton_local_shards=False, optimizer=False, common="file", mcore_metadata=True, thread_count=2,
         description="GeLU MLP, LayerNorm with biases (layer_norm_bias), linear biases, learned position "
                     "embeddings, tied output layer (not stored), no optimizer"),
]


def runner_command():
    env = os.environ.get("STATEDICT_TORCH2_PYTHON")
    if env:
        return shlex.split(env)
    root = os.environ.get("STATEDICT_SID_ROOT", "/var/cache/statedict/sid-root")
    tool = os.path.join(REPO, "tools", "sid-python")
    if os.path.isfile(os.path.join(root, "statedict-sid-root.stamp")) and os.path.isfile(tool):
        return [tool]
    return None


def common_state(spec, cfg, trained):
    """The non-sharded part of generate_state_dict (checkpointing.py, core_v0.15.0) as it reaches
    common.pt: ShardedTensors / ShardedObjects removed, emptied containers dropped."""
    case = L.LegacyCase(spec["name"], cfg, spec["tp"], spec["pp"], None, "bf16", "core_v0.8", 3.0,
                        "plain" if spec["optimizer"] else "none")
    args = L.make_args(case, 0, 0)
    d = vars(args)
    d["transformer_impl"] = "transformer_engine" if spec["te"] else "local"
    d["use_legacy_models"] = False
    d["ckpt_format"] = "torch_dist"
    d["use_dist_ckpt"] = True
    d["dist_ckpt_format"] = "torch_dist"
    common = {"args": args, "checkpoint_version": 3.0, "iteration": 10}
    if spec["optimizer"]:
        sd = L.optimizer_state(case, trained, 0, 0)["optimizer"]
        groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
        common["optimizer"] = {"optimizer": {"state": {"common_step": trained.step[next(iter(trained.step))].clone()},
                                             "param_groups": groups}}
        common["opt_param_scheduler"] = L.scheduler_state(case)
    common["num_floating_point_operations_so_far"] = 1.5e10
    common["content_metadata"] = {"singleton_local_shards": spec["singleton_local_shards"],
                                  "chained_optim_avoid_prefix": True}
    return common


def expected(spec, trained):
    """Full model and optimizer by Megatron-core per-layer name, fc1 as [W; V]."""
    from .torch_dist_layout import mcore_name
    model = OrderedDict()
    optim = OrderedDict()
    for n, t in trained.params.items():
        m = mcore_name(n, True)
        if not trained.cfg.untie_embeddings_and_output_weights and m == "output_layer.weight":
            continue
        model[m] = t.to(torch.bfloat16)
        if spec["optimizer"]:
            optim[m] = OrderedDict([("exp_avg", trained.exp_avg[n]), ("exp_avg_sq", trained.exp_avg_sq[n]),
                                    ("fp32_param", t)])
    return model, optim


def unstack(spec, cfg, tensors):
    """DCP keys -> per-layer Megatron-core names (the reader side, independent of the writer)."""
    model, optim = OrderedDict(), OrderedDict()
    L_ = cfg.num_layers
    for key, t in tensors.items():
        kind, name = None, key
        if key.startswith("optimizer.state."):
            kind, name = key[len("optimizer.state."):].split(".", 1)
        if name.startswith("decoder.layers.") and not name.split(".")[2].isdigit():
            if t.shape[0] != L_:
                raise AssertionError(f"{key}: stacked axis {t.shape[0]} != {L_} layers")
            parts = [(name.replace("decoder.layers.", f"decoder.layers.{i}.", 1), t[i]) for i in range(L_)]
        else:
            parts = [(name, t)]
        for n, x in parts:
            if kind is None:
                model[n] = x
            else:
                optim.setdefault(n, OrderedDict())[kind] = x
    # singleton_local_shards: <name>_w and <name>_v are the two halves of <name>
    for k in [k for k in model if k.endswith("_w")]:
        base = k[:-2]
        model[base] = torch.cat([model.pop(k), model.pop(base + "_v")], 0)
    return model, optim


def _merge_wv_optim(optim):
    out = OrderedDict()
    for n, d in optim.items():
        if n.endswith(("_w", "_v")):
            continue
        out[n] = d
    for n in [n for n in optim if n.endswith("_w")]:
        base = n[:-2]
        out[base] = OrderedDict((kind, torch.cat([optim[n][kind], optim[base + "_v"][kind]], 0)) for kind in optim[n])
    return out


def run(outdir, only, selftest):
    outdir = os.path.abspath(outdir)     # the torch 2.x process runs in another directory (and root)
    cmd = runner_command()
    specs = [s for s in SPECS if not only or only in s["name"]]
    if not specs:
        return [], []
    if cmd is None:
        print("gen_megatron: torch_dist cases skipped: no torch >= 2.6 runner (set STATEDICT_TORCH2_PYTHON "
              "or build the sid root with tools/sid-root.sh)")
        return [], []
    standins.install()
    job = {"specs": specs, "full": {}, "common": {}}
    trained_of = {}
    for spec in specs:
        cfg = M.CONFIGS[spec["config"]]
        tr = M.train(cfg, spec["tp"], spec["seed"])
        trained_of[spec["name"]] = tr
        case = L.LegacyCase(spec["name"], cfg, spec["tp"], spec["pp"], None, "bf16", "core_v0.8", 3.0, "plain")
        rng = {f"{t},{p}": L.rng_state(case, t, p) for t in range(spec["tp"]) for p in range(spec["pp"])}
        job["full"][spec["name"]] = {"params": tr.model(torch.bfloat16), "masters": tr.params,
                                     "exp_avg": tr.exp_avg, "exp_avg_sq": tr.exp_avg_sq, "rng": rng}
        spec["full"] = spec["name"]
        job["common"][spec["name"]] = common_state(spec, cfg, tr)
    problems, index = [], []
    with tempfile.TemporaryDirectory(dir=outdir) as tmp:
        inp = os.path.join(tmp, "job.pt")
        torch.save(job, inp)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__)))] +
                                            [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        for spec in specs:
            import shutil
            shutil.rmtree(os.path.join(outdir, spec["name"]), ignore_errors=True)
        r = subprocess.run(cmd + ["-m", "megatron_fixtures.torch_dist_layout", inp, outdir], env=env,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            return [], [f"torch_dist writer failed ({r.returncode}):\n{r.stdout[-3000:]}"]
    back_path = os.path.join(outdir, ".torch_dist_readback.pt")
    back = torch.load(back_path)
    os.remove(back_path)
    for spec in specs:
        cfg = M.CONFIGS[spec["config"]]
        tr = trained_of[spec["name"]]
        rb = back[spec["name"]]
        model, optim = unstack(spec, cfg, rb["tensors"])
        optim = _merge_wv_optim(optim)
        exp_model, exp_optim = expected(spec, tr)
        model = OrderedDict((k, model[k]) for k in exp_model if k in model) if set(model) == set(exp_model) else model
        if selftest:
            if list(model) != list(exp_model):
                problems.append(f"{spec['name']}: model names differ: {sorted(set(model) ^ set(exp_model))[:6]}")
            else:
                for k in exp_model:
                    if model[k].dtype != exp_model[k].dtype or not torch.equal(model[k], exp_model[k]):
                        problems.append(f"{spec['name']}: {k} differs")
            if set(optim) != set(exp_optim):
                problems.append(f"{spec['name']}: optimizer names differ: {sorted(set(optim) ^ set(exp_optim))[:6]}")
            else:
                for k, d in exp_optim.items():
                    for kind, t in d.items():
                        if not torch.equal(optim[k][kind], t):
                            problems.append(f"{spec['name']}: optimizer {k} {kind} differs")
            objs = rb["objects"]
            want_rng = {f"rng_state/shard_{p}.{t}_{spec['pp']}.{spec['tp']}" for t in range(spec["tp"]) for p in range(spec["pp"])}
            if not want_rng <= set(objs):
                problems.append(f"{spec['name']}: rng_state objects missing: {sorted(want_rng - set(objs))}")
            if spec["common"] == "object":
                if "common_state/shard_0_1" not in objs or os.path.exists(os.path.join(outdir, spec["name"], "common.pt")):
                    problems.append(f"{spec['name']}: expected the common_state object and no common.pt")
            cls = rb["metadata"]["class"]
            want_cls = ("megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata" if spec["mcore_metadata"]
                        else "torch.distributed.checkpoint.metadata.Metadata")
            if cls != want_cls:
                problems.append(f"{spec['name']}: .metadata class {cls} != {want_cls}")
        m = _common.make_manifest("megatron_torch_dist", exp_model)
        m["path"] = spec["name"]
        m["megatron"] = {
            "layout": "torch_dist", "tensor_model_parallel_size": spec["tp"], "pipeline_model_parallel_size": spec["pp"],
            "layer_keys": "stacked" if spec["stacked"] else "per_layer",
            "singleton_local_shards": spec["singleton_local_shards"], "layer_spec": "te" if spec["te"] else "local",
            "common": "common.pt" if spec["common"] == "file" else "common_state object",
            "metadata_class": rb["metadata"]["class"], "true_vocab_size": cfg.true_vocab_size,
            "padded_vocab_size": cfg.padded_vocab_size(spec["tp"]), "vocab_in_manifest": "padded (as stored)",
            "num_layers": cfg.num_layers, "fc1_in_manifest": "[W; V]" if cfg.swiglu else "as stored",
            "files": sorted(os.listdir(os.path.join(outdir, spec["name"]))),
            "dcp_tensors": {k: {"dtype": v["dtype"].replace("torch.", ""), "size": v["size"], "chunks": len(v["chunks"])}
                            for k, v in rb["metadata"]["tensors"].items()},
            "dcp_objects": rb["metadata"]["objects"],
        }
        _common.write_manifest(outdir, spec["name"], m)
        if spec["optimizer"]:
            obj = {"optimizer": {"state": OrderedDict((k, dict(v)) for k, v in exp_optim.items())}}
            om = _common.make_manifest("megatron_optim", obj)
            om["path"] = spec["name"]
            _common.write_manifest(outdir, spec["name"] + ".optim", om)
        index.append({"case": spec["name"], "format": "megatron_torch_dist", "path": spec["name"],
                      "tp": spec["tp"], "pp": spec["pp"], "vpp": None, "description": spec["description"]})
    return index, problems
