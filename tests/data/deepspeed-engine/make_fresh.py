#!/usr/bin/env python3
"""The step-0 truths of this folder (README.md, "Fresh optimizer state"): what the real DeepSpeed
engine saves right after `deepspeed.initialize` from a model's weights and a freshly constructed
torch AdamW, before any step, and the losses of the steps it trains from there.

    truth: writes fresh_model.pt (the model's weights, a plain torch state dict) and, per case,
           fresh_<case>/ (engine.save_checkpoint at step 0, tag global_step0) and
           fresh_<case>.losses.json (3 steps trained from the same start)
    check: an engine started from other random weights loads DIR with load_checkpoint and trains
           the same 3 steps; prints its losses beside the truth's (exit 1 when they differ)

Run in the DeepSpeed root as make_fixtures.py is. This file is ours; it imports deepspeed but
contains none of its code.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402  (TinyLM, the data, the CPU workarounds)

STEPS = 3
TAG = "global_step0"
# The optimizer the engine gets: a freshly constructed torch AdamW (every hyperparameter set, none
# at torch's default, so that a writer that dropped one would be seen).
HYPER = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.05)
SPEC = "adamw:lr=2e-3,betas=0.9/0.95,eps=1e-6,weight_decay=0.05"

CASES = {
    "zero1_ws2_fp32": dict(stage=1, ws=2, dtype="fp32"),
    "zero2_ws3_bf16": dict(stage=2, ws=3, dtype="bf16"),
    "zero3_ws2_fp32": dict(stage=3, ws=2, dtype="fp32"),
    "zero3_ws3_bf16": dict(stage=3, ws=3, dtype="bf16"),
}


def config(case, ws):
    c = CASES[case]
    zero = {"stage": c["stage"]}
    if c["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_batch_size": mf.GLOBAL_BATCH, "train_micro_batch_size_per_gpu": mf.GLOBAL_BATCH // ws,
            "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True, "steps_per_print": 1000000,
            "zero_optimization": zero, "bf16": {"enabled": c["dtype"] == "bf16"}}


def engine_for(case, ws, seed, weights=None):
    import deepspeed
    torch.manual_seed(seed)
    model = mf.TinyLM()
    if weights is not None:
        model.load_state_dict(torch.load(weights, weights_only=True))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **HYPER)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config(case, ws))
    return engine


def rank_main(rank, ws, port, job):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ws), LOCAL_WORLD_SIZE=str(ws),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), USE_LIBUV="0", DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    mf.patch_gloo_16bit()
    import deepspeed
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    import deepspeed.comm as dist
    case = job["case"]
    if job["mode"] == "truth":
        engine = engine_for(case, ws, 42, job["weights"])
        engine.save_checkpoint(job["save_dir"], tag=TAG)
    else:
        engine = engine_for(case, ws, 7)  # other weights: the checkpoint must bring them
        engine.load_checkpoint(job["load_dir"])
    dist.barrier()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.optimizer.param_groups]
    result = {"steps": mf.train_steps(engine, range(STEPS), rank, ws), "param_groups": repr(groups),
              "global_steps": engine.global_steps}
    if rank == 0:
        with open(job["result_file"], "w") as f:
            json.dump(result, f)
    dist.barrier()


def entry(rank, ws, port, job):
    try:
        rank_main(rank, ws, port, job)
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def launch(ws, job):
    import torch.multiprocessing as mp
    mp.start_processes(entry, args=(ws, mf.free_port(), job), nprocs=ws, join=True, start_method="spawn")
    with open(job["result_file"]) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["truth", "check"])
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--only", default="")
    ap.add_argument("--load", help="check: the checkpoint folder to load")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="ds-fresh-")
    cases = [x for x in a.only.split(",") if x] or list(CASES)
    weights = os.path.join(a.out, "fresh_model.pt")
    if a.mode == "truth":
        torch.manual_seed(42)
        torch.save(mf.TinyLM().state_dict(), weights)
        for case in cases:
            d = os.path.join(a.out, "fresh_" + case)
            shutil.rmtree(d, ignore_errors=True)
            res = launch(CASES[case]["ws"], {"case": case, "mode": "truth", "weights": weights, "save_dir": d,
                                             "result_file": os.path.join(work, case + ".json")})
            mf.clean_case_dir(d)
            mf.write_json(os.path.join(a.out, "fresh_" + case + ".losses.json"),
                          {"case": "fresh_" + case, "world_size": CASES[case]["ws"], "optimizer": SPEC,
                           "versions": mf.versions(), "config": config(case, CASES[case]["ws"]),
                           "param_groups": res["param_groups"], "train_from_step0": res["steps"]})
            print(case, res["steps"]["mean_loss"])
        return 0
    bad = 0
    for case in cases:
        res = launch(CASES[case]["ws"], {"case": case, "mode": "check", "load_dir": a.load,
                                         "result_file": os.path.join(work, case + ".json")})
        with open(os.path.join(a.out, "fresh_" + case + ".losses.json")) as f:
            want = json.load(f)
        same = res["steps"]["per_rank_loss"] == want["train_from_step0"]["per_rank_loss"]
        same_groups = res["param_groups"] == want["param_groups"]
        print(json.dumps({"case": case, "loaded": a.load, "losses": res["steps"]["mean_loss"],
                          "engine_fresh": want["train_from_step0"]["mean_loss"], "bit_equal": same,
                          "param_groups_equal": same_groups, "param_groups": res["param_groups"]}))
        bad += not (same and same_groups)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
