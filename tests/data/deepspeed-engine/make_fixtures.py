#!/usr/bin/env python3
"""Generates the DeepSpeed engine fixtures of this folder (see README.md).

Runs the real DeepSpeed engine (CPU accelerator, gloo) on a tiny model, one process per rank,
and writes for each case the checkpoint the engine saves plus truths taken from DeepSpeed
itself (zero_to_fp32, the live engine, ds_to_universal + a universal reload).

    DS_ACCELERATOR=cpu USE_LIBUV=0 PYTHONPATH=$DS_SRC \
      python3 make_fixtures.py --out DIR --ds-src $DS_SRC [--only CASE,...] [--no-reshard]

This file is ours; it imports deepspeed but contains none of its code.
"""
import argparse
import hashlib
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, SEQ, GLOBAL_BATCH = 64, 24, 6, 12
TRAIN_STEPS, EXTRA_STEPS = 2, 3
TAG = "global_step2"

# name: stage, world size, dtype, extra zero config, param groups, BF16_Optimizer, reshard targets
CASES = {
    "zero1_ws2_fp32": dict(stage=1, ws=2, dtype="fp32", reshard=[3]),
    "zero1_ws3_bf16": dict(stage=1, ws=3, dtype="bf16", reshard=[2]),
    "zero1_ws4_fp32": dict(stage=1, ws=4, dtype="fp32", reshard=[2]),
    "zero2_ws2_fp32": dict(stage=2, ws=2, dtype="fp32", reshard=[3], keep_universal=True),
    "zero2_ws2_bf16": dict(stage=2, ws=2, dtype="bf16", reshard=[3]),
    "zero2_ws4_fp32": dict(stage=2, ws=4, dtype="fp32", reshard=[2]),
    "zero2_ws3_fp32_roundrobin": dict(stage=2, ws=3, dtype="fp32", zero={"round_robin_gradients": True}),
    "zero2_ws2_fp32_2groups": dict(stage=2, ws=2, dtype="fp32", groups=2),
    "zero3_ws2_fp32": dict(stage=3, ws=2, dtype="fp32", reshard=[3]),
    "zero3_ws3_bf16": dict(stage=3, ws=3, dtype="bf16", reshard=[2]),
    "zero3_ws4_fp32": dict(stage=3, ws=4, dtype="fp32", reshard=[2]),
    "zero3_ws2_bf16_subgroups": dict(stage=3, ws=2, dtype="bf16", zero={"sub_group_size": 1000}),
    "zero3_ws3_fp32_2groups": dict(stage=3, ws=3, dtype="fp32", groups=2),
    "zero3_ws2_fp32_persist": dict(stage=3, ws=2, dtype="fp32", zero={"stage3_param_persistence_threshold": 100000}),
    "bf16opt_ws2": dict(stage=1, ws=2, dtype="bf16", bf16opt=True, reshard=[3]),
}


# --------------------------------------------------------------------------- manifest helpers
DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def tensor_bytes(t):
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes(order="C")


def tensor_entry(t):
    return {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
            "sha256": hashlib.sha256(tensor_bytes(t)).hexdigest()}


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


# --------------------------------------------------------------------------- model and data
class Block(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    """vocab 64 x hidden 24, embedding tied to lm_head, 2 blocks (24x37, 24x29), a frozen Linear,
    a registered buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.register_buffer("pos", torch.randn(SEQ, HIDDEN) * 0.1)
        self.blocks = nn.ModuleList([Block(HIDDEN, 37), Block(HIDDEN, 29)])
        self.frozen = nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight
        with torch.no_grad():  # non-trivial LayerNorm parameters
            for ln in (self.blocks[0].ln, self.blocks[1].ln, self.ln_f):
                ln.weight.add_(torch.randn(HIDDEN) * 0.05)
                ln.bias.add_(torch.randn(HIDDEN) * 0.05)

    def forward(self, ids, labels):
        x = self.embed(ids) + self.pos[: ids.shape[1]].to(self.embed.weight.dtype)
        for b in self.blocks:
            x = b(x)
        x = x + 0.5 * self.frozen(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def batch(step, rank, ws):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    mb = GLOBAL_BATCH // ws
    return ids[rank * mb:(rank + 1) * mb], labels[rank * mb:(rank + 1) * mb]


def param_groups(model, groups):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if groups == 1:
        return [{"params": [p for _, p in named], "lr": 1e-2, "weight_decay": 0.01}], {n: 0 for n, _ in named}
    g0 = [(n, p) for n, p in named if n.endswith("weight") and ".ln" not in n and not n.startswith("ln")]
    g1 = [(n, p) for n, p in named if (n, p) not in g0]
    return ([{"params": [p for _, p in g0], "lr": 1e-2, "weight_decay": 0.1},
             {"params": [p for _, p in g1], "lr": 3e-3, "weight_decay": 0.0}],
            {**{n: 0 for n, _ in g0}, **{n: 1 for n, _ in g1}})


def ds_config(case, ws, load_universal=False):
    c = CASES[case]
    zero = {"stage": c["stage"]}
    if c["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 0  # partition every parameter
    zero.update(c.get("zero", {}))
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // ws,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000000,
        "zero_optimization": zero,
        "bf16": {"enabled": c["dtype"] == "bf16"},
    }
    if c.get("bf16opt"):
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if load_universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


# --------------------------------------------------------------------------- CPU workarounds
class _DoneWork:
    def wait(self, *a, **k):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def synchronize(self):
        pass


# collective -> names of the arguments it writes
_OUTPUTS = {"broadcast": ["tensor"], "all_reduce": ["tensor"], "reduce": ["tensor"],
            "all_reduce_coalesced": ["tensors"], "all_gather": ["tensor_list"],
            "all_gather_into_tensor": ["output_tensor"], "_all_gather_base": ["output_tensor"],
            "reduce_scatter": ["output"], "reduce_scatter_tensor": ["output"],
            "_reduce_scatter_base": ["output"], "all_to_all_single": ["output"], "all_to_all": ["output_tensor_list"]}


def patch_gloo_16bit():
    """Debian's gloo rejects 16-bit tensors: run those collectives in fp32 and copy back."""
    import torch.distributed as tdist
    import torch.distributed.distributed_c10d as c10d

    def is16(x):
        return isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16)

    def wrap(name, orig):
        sig = inspect.signature(orig)

        def fn(*args, **kwargs):
            ba = sig.bind(*args, **kwargs)
            has16 = any(is16(v) or (isinstance(v, (list, tuple)) and any(is16(t) for t in v))
                        for v in ba.arguments.values())
            if not has16:
                return orig(*args, **kwargs)
            back = []
            for k, v in list(ba.arguments.items()):
                if is16(v):
                    nv = v.float()
                    ba.arguments[k] = nv
                    if k in _OUTPUTS[name]:
                        back.append((v, nv))
                elif isinstance(v, (list, tuple)) and any(is16(t) for t in v):
                    nl = [t.float() if is16(t) else t for t in v]
                    ba.arguments[k] = nl
                    if k in _OUTPUTS[name]:
                        back += [(t, n) for t, n in zip(v, nl) if is16(t)]
            was_async = ba.arguments.get("async_op", False)
            if "async_op" in ba.arguments:
                ba.arguments["async_op"] = False
            orig(*ba.args, **ba.kwargs)
            for t, n in back:
                t.copy_(n)
            return _DoneWork() if was_async else None

        fn.__name__ = name
        fn._statedict_fp32_wrapper = True
        return fn

    for name in _OUTPUTS:
        for mod in (tdist, c10d):
            orig = getattr(mod, name, None)
            if orig is not None and not getattr(orig, "_statedict_fp32_wrapper", False):
                setattr(mod, name, wrap(name, orig))


# --------------------------------------------------------------------------- one rank
def log(*a):
    print(*a, file=sys.stderr, flush=True)


def make_engine(case, ws, load_universal=False):
    import deepspeed
    torch.manual_seed(42)
    model = TinyLM()
    groups, group_of = param_groups(model, CASES[case].get("groups", 1))
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8)
    cfg = ds_config(case, ws, load_universal)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return model, engine, cfg, group_of


def train_steps(engine, steps, rank, ws):
    import deepspeed.comm as dist
    losses, per_rank = [], []
    for step in steps:
        ids, labels = batch(step, rank, ws)
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
        local = loss.detach().float().reshape(1).clone()
        gathered = [torch.zeros(1) for _ in range(ws)]
        dist.all_gather(gathered, local)
        per_rank.append([float(t.item()) for t in gathered])
        losses.append(float(torch.stack(gathered).mean().item()))
    return {"steps": list(steps), "mean_loss": losses, "per_rank_loss": per_rank}


def gather_flat(t, ws):
    import deepspeed.comm as dist
    parts = [torch.zeros_like(t) for _ in range(ws)]
    dist.all_gather(parts, t.detach().float().contiguous())
    return torch.cat(parts)


def live_truth(case, model, engine, ws):
    """Per-parameter fp32 weights and Adam state from the live engine (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    c = CASES[case]
    opt = engine.optimizer
    names = {id(p): n for n, p in model.named_parameters()}
    out = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}, "step": {}}
    checks = {}
    if c["stage"] in (1, 2):
        # re-link the Adam state of every group (DeepSpeed links it after group 0's step only)
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
        if c.get("bf16opt"):
            lp_groups, hp_parts = opt.bf16_groups, opt.fp32_groups_flat_partition
        else:
            lp_groups, hp_parts = opt.round_robin_bit16_groups, opt.single_partition_of_fp32_groups
        for i, (lps, hp) in enumerate(zip(lp_groups, hp_parts)):
            st = opt.optimizer.state[hp]
            flats = {"fp32": gather_flat(hp, ws), "exp_avg": gather_flat(st["exp_avg"], ws),
                     "exp_avg_sq": gather_flat(st["exp_avg_sq"], ws)}
            off = 0
            for p in lps:  # the flat group is these params in this order, then padding
                n = names[id(p)]
                for k, flat in flats.items():
                    out[k][n] = flat[off:off + p.numel()].reshape(p.shape).clone()
                out["step"][n] = st["step"].clone() if torch.is_tensor(st["step"]) else st["step"]
                off += p.numel()
        if c.get("bf16opt"):  # what zero_to_fp32 would take from the model states
            out["buffers"] = {n: b.detach().clone() for n, b in engine.module.named_buffers()}
            out["frozen"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()
                             if not p.requires_grad}
        # the engine's own accessors, compared with the raw partitions
        for n, p in model.named_parameters():
            if not p.requires_grad:
                continue
            got = {"fp32": safe_get_full_fp32_param(p), "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
                   "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq")}
            checks[n] = {k: bool(torch.equal(v.float(), out[k][n])) for k, v in got.items()}
    else:
        sg_of = {}
        for sg, ps in enumerate(opt.fp16_groups):
            for p in ps:
                sg_of[id(p)] = sg
        for n, p in model.named_parameters():
            if not p.requires_grad:
                continue
            out["fp32"][n] = safe_get_full_fp32_param(p).float().reshape(p.ds_shape).clone()
            for k in ("exp_avg", "exp_avg_sq"):
                out[k][n] = safe_get_full_optimizer_state(p, k).float().reshape(p.ds_shape).clone()
            st = opt.optimizer.state[opt.fp32_partitioned_groups_flat[sg_of[id(p)]]]
            out["step"][n] = st["step"].clone() if torch.is_tensor(st["step"]) else st["step"]
        checks = {"sub_groups": len(opt.fp16_groups),
                  "sub_group_of": {names[id(p)]: sg for sg, ps in enumerate(opt.fp16_groups) for p in ps}}
    return out, checks


def rank_main(rank, ws, port, job):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ws), LOCAL_WORLD_SIZE=str(ws),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), USE_LIBUV="0", DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    patch_gloo_16bit()
    import deepspeed
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    import deepspeed.comm as dist
    case = job["case"]
    result = {}
    if job["mode"] == "train":
        model, engine, cfg, group_of = make_engine(case, ws)
        result["train"] = train_steps(engine, range(TRAIN_STEPS), rank, ws)
        engine.save_checkpoint(job["save_dir"], tag=TAG)
        dist.barrier()
        truth, checks = live_truth(case, model, engine, ws)
        if rank == 0:
            torch.save(truth, job["truth_file"])
            result["checks"] = checks
            result["config"] = cfg
            result["group_of"] = group_of
            result["param_names"] = [n for n, _ in model.named_parameters(remove_duplicate=False)]
            result["frozen"] = [n for n, p in model.named_parameters() if not p.requires_grad]
            result["buffers"] = [n for n, _ in model.named_buffers()]
            result["optimizer_class"] = type(engine.optimizer).__module__ + "." + type(engine.optimizer).__name__
        dist.barrier()
        del engine
        # reload the saved checkpoint at the same world size and train further
        model, engine, _, _ = make_engine(case, ws)
        engine.load_checkpoint(job["save_dir"], tag=TAG)
        result["reload"] = train_steps(engine, range(TRAIN_STEPS, TRAIN_STEPS + EXTRA_STEPS), rank, ws)
    elif job["mode"] == "universal":
        model, engine, cfg, _ = make_engine(case, ws, load_universal=True)
        engine.load_checkpoint(job["load_dir"])
        engine._config.load_universal_checkpoint = False
        engine.save_checkpoint(job["save_dir"], tag=TAG)
        dist.barrier()
        result["config"] = cfg
        result["reload"] = train_steps(engine, range(TRAIN_STEPS, TRAIN_STEPS + EXTRA_STEPS), rank, ws)
    if rank == 0:
        with open(job["result_file"], "w") as f:
            json.dump(result, f)
    dist.barrier()


def _rank_entry(rank, ws, port, job):
    try:
        rank_main(rank, ws, port, job)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def launch(ws, job):
    import torch.multiprocessing as mp
    mp.start_processes(_rank_entry, args=(ws, free_port(), job), nprocs=ws, join=True, start_method="spawn")
    with open(job["result_file"]) as f:
        return json.load(f)


# --------------------------------------------------------------------------- per case
def tensors_manifest(sd, fmt, path):
    tensors, aliases, seen = {}, {}, {}
    for k, v in sd.items():
        tensors[k] = tensor_entry(v)
        key = id(v)
        if key in seen:
            aliases[k] = seen[key]
        else:
            seen[key] = k
    return {"format": fmt, "tensors": tensors, "values": {}, "aliases": aliases, "path": path}


def clean_case_dir(d):
    z = os.path.join(d, "zero_to_fp32.py")
    if os.path.exists(z):
        os.remove(z)


def versions():
    import deepspeed
    return {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}


def do_case(case, out, work, ds_src, reshard=True):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    c = CASES[case]
    ws = c["ws"]
    case_dir = os.path.join(out, case)
    shutil.rmtree(case_dir, ignore_errors=True)
    timings = {}
    t0 = time.time()
    job = {"case": case, "mode": "train", "save_dir": case_dir,
           "truth_file": os.path.join(work, case + ".truth.pt"),
           "result_file": os.path.join(work, case + ".result.json")}
    res = launch(ws, job)
    clean_case_dir(case_dir)
    timings["train_save_reload_s"] = round(time.time() - t0, 1)
    truth = torch.load(job["truth_file"], weights_only=True)
    fmt = f"deepspeed_zero{c['stage']}"
    z2f_error = None
    try:
        sd = get_fp32_state_dict_from_zero_checkpoint(case_dir)
        man = tensors_manifest(sd, fmt, case)
        matches = {n: bool(torch.equal(sd[n], t)) for n, t in truth["fp32"].items()}
    except BaseException as e:  # BF16_Optimizer checkpoints
        z2f_error = f"{type(e).__name__}: {e}".replace(os.path.abspath(out) + "/", "")
        # zero_to_fp32's layout: buffers and frozen params as the engine holds them, then the
        # trainable fp32 weights from the live engine, then the tied name
        sd = dict(truth["buffers"])
        sd.update(truth["frozen"])
        sd.update(truth["fp32"])
        sd["lm_head.weight"] = sd["embed.weight"]
        man = tensors_manifest(sd, "deepspeed_bf16_optimizer", case)
        man["zero_to_fp32_error"] = z2f_error
        man["source"] = ("buffers and frozen parameters: the live engine's module (as saved); trainable: "
                         "deepspeed.utils.safe_get_full_fp32_param on the live engine (equal to the raw "
                         "fp32 partitions); lm_head.weight: the same tensor as embed.weight")
        matches = None
    write_json(os.path.join(out, case + ".manifest.json"), man)

    # optimizer state manifest
    ot, ov = {}, {}
    for n in truth["exp_avg"]:
        for k in ("exp_avg", "exp_avg_sq"):
            ot[f"optim.state.{n}.{k}"] = tensor_entry(truth[k][n])
        s = truth["step"][n]
        if torch.is_tensor(s):
            ot[f"optim.state.{n}.step"] = tensor_entry(s)
            ov[f"optim.state.{n}.step"] = float(s.item()) if s.is_floating_point() else int(s.item())
        else:
            ov[f"optim.state.{n}.step"] = s
    write_json(os.path.join(out, case + ".optim.manifest.json"),
               {"format": fmt if z2f_error is None else "deepspeed_bf16_optimizer", "tensors": ot,
                "values": ov, "aliases": {}, "path": case})
    write_json(os.path.join(out, case + ".losses.json"),
               {"case": case, "world_size": ws, "train": res["train"], "reload_same_world_size": res["reload"]})

    info = {"case": case, "world_size": ws, "stage": c["stage"], "dtype": c["dtype"],
            "bf16_optimizer": bool(c.get("bf16opt")), "versions": versions(), "config": res["config"],
            "optimizer": res["optimizer_class"],
            "client_optimizer": "torch.optim.AdamW(betas=(0.9, 0.95), eps=1e-8)",
            "param_names": res["param_names"], "frozen": res["frozen"],
            "tied": {"lm_head.weight": "embed.weight"}, "buffers": res["buffers"],
            "param_group_of": res["group_of"], "train_steps": TRAIN_STEPS, "tag": TAG,
            "zero_to_fp32_matches_live_engine": matches,
            "engine_accessors_match_raw_partitions": res["checks"] if c["stage"] < 3 else None,
            "stage3_sub_groups": res["checks"] if c["stage"] == 3 else None,
            "timings": timings}
    if not reshard:
        write_json(os.path.join(out, case + ".info.json"), info)
        return info

    # reshard through DeepSpeed's universal checkpoint
    info["reshard"] = {}
    for m in c.get("reshard", []):
        t0 = time.time()
        name = f"reshard_{case}_to{m}"
        uni_root = os.path.join(work, "uni_" + case)
        shutil.rmtree(uni_root, ignore_errors=True)
        os.makedirs(uni_root)
        cmd = [sys.executable, os.path.join(ds_src, "deepspeed/checkpoint/ds_to_universal.py"),
               "--input_folder", os.path.join(case_dir, TAG), "--output_folder", os.path.join(uni_root, TAG),
               "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]
        r = subprocess.run(cmd, cwd=ds_src, capture_output=True, text=True)
        shown = " ".join(cmd[1:]).replace(ds_src + "/", "").replace(case_dir, case).replace(uni_root, "UNI")
        entry = {"to": m, "ds_to_universal": shown, "rc": r.returncode}
        if r.returncode != 0:
            entry["error"] = (r.stdout + r.stderr)[-3000:]
            info["reshard"][name] = entry
            log(f"!! ds_to_universal failed for {case}: {entry['error'][-500:]}")
            continue
        if c.get("keep_universal"):
            dst = os.path.join(out, "universal_" + case)
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(uni_root, dst)
        rdir = os.path.join(out, name)
        shutil.rmtree(rdir, ignore_errors=True)
        job = {"case": case, "mode": "universal", "load_dir": uni_root, "save_dir": rdir,
               "result_file": os.path.join(work, name + ".result.json")}
        try:
            res2 = launch(m, job)
        except BaseException as e:
            entry["error"] = f"{type(e).__name__}: {e}"
            info["reshard"][name] = entry
            log(f"!! universal load failed for {case} -> {m}: {e}")
            continue
        clean_case_dir(rdir)
        entry["seconds"] = round(time.time() - t0, 1)
        entry["config"] = res2["config"]
        info["reshard"][name] = entry
        write_json(os.path.join(out, name + ".losses.json"),
                   {"case": name, "from_world_size": ws, "world_size": m, "after_universal_load": res2["reload"]})
        try:
            sd = get_fp32_state_dict_from_zero_checkpoint(rdir)
            write_json(os.path.join(out, name + ".manifest.json"), tensors_manifest(sd, fmt, name))
        except BaseException as e:
            entry["zero_to_fp32_error"] = f"{type(e).__name__}: {e}".replace(os.path.abspath(out) + "/", "")
    write_json(os.path.join(out, case + ".info.json"), info)
    return info


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--work", default=None)
    ap.add_argument("--ds-src", required=True)
    ap.add_argument("--only", default="")
    ap.add_argument("--no-reshard", action="store_true")
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="ds-fixtures-")
    os.makedirs(work, exist_ok=True)
    cases = [x for x in a.only.split(",") if x] or list(CASES)
    for case in cases:
        t0 = time.time()
        log(f"== {case}")
        try:
            do_case(case, a.out, work, a.ds_src, reshard=not a.no_reshard)
            log(f"== {case} done in {time.time() - t0:.0f} s")
        except BaseException as e:
            log(f"!! {case} FAILED after {time.time() - t0:.0f} s: {type(e).__name__}: {e}")
            traceback.print_exc()


if __name__ == "__main__":
    main()
