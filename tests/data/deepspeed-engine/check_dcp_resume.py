#!/usr/bin/env python3
"""By hand (README.md, "DCP input with optimizer state"): the engine loads statedict's DeepSpeed
output of a torch DCP checkpoint (tests/python/torch2/gen_t2_dcp.py's dcp_fsdp2_w2: FSDP2 + AdamW
after 2 steps) and trains 3 steps; a plain torch model and AdamW resume from the DCP checkpoint
itself (dcp_to_torch_save) on the same batches. Prints both losses.

    check_dcp_resume.py DCP_DIR DEEPSPEED_DIR STAGE WORLD_SIZE

Run in the DeepSpeed root as make_fixtures.py is. This file is ours; it imports deepspeed but
contains none of its code.
"""
import json, os, sys, tempfile
import torch, torch.nn as nn
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf

class Tiny(nn.Module):  # gen_t2_dcp.py's model
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 6, bias=False)
        self.norm = nn.LayerNorm(6)
    def forward(self, idx):
        return self.norm(self.fc2(torch.relu(self.fc1(self.embed(idx)))))

STEPS = 3
def batches():
    r = torch.Generator(); r.manual_seed(99)
    return [torch.randint(0, 10, (4,), generator=r) for _ in range(STEPS)]

def reference(dcp_dir):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "full.pt")
        dcp_to_torch_save(dcp_dir, f)
        sd = torch.load(f, weights_only=False)
    model = Tiny(); model.load_state_dict(sd["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    names = [n for n, _ in model.named_parameters()]
    osd = {"state": {names.index(k): v for k, v in sd["optim"]["state"].items()},
           "param_groups": [dict(g, params=[names.index(p) for p in g["params"]]) for g in sd["optim"]["param_groups"]]}
    opt.load_state_dict(osd)
    losses = []
    for idx in batches():
        loss = model(idx).square().mean(); opt.zero_grad(); loss.backward(); opt.step(); losses.append(loss.item())
    return losses

def rank_main(rank, ws, port, job):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ws), LOCAL_WORLD_SIZE=str(ws),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), USE_LIBUV="0", DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed, deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(7)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the checkpoint's group must win
    zero = {"stage": job["stage"]}
    if job["stage"] == 3: zero["stage3_param_persistence_threshold"] = 0
    cfg = {"train_batch_size": 4 * ws, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**6, "zero_optimization": zero}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    engine.load_checkpoint(job["load"])
    losses = []
    for idx in batches():  # the same batch on every rank, as the FSDP2 run
        loss = engine(idx).square().mean(); engine.backward(loss); engine.step(); losses.append(loss.item())
    if rank == 0:
        json.dump({"losses": losses, "lr": engine.optimizer.optimizer.param_groups[0]["lr"],
                   "wd": engine.optimizer.optimizer.param_groups[0]["weight_decay"]}, open(job["result_file"], "w"))

def entry(rank, ws, port, job):
    try: rank_main(rank, ws, port, job)
    except BaseException:
        import traceback; traceback.print_exc(); os._exit(1)

if __name__ == "__main__":
    dcp_dir, load, stage, ws = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    import torch.multiprocessing as mp
    job = {"load": load, "stage": stage, "result_file": os.path.join(tempfile.mkdtemp(prefix="ds-dcp-"), "result.json")}
    mp.start_processes(entry, args=(ws, mf.free_port(), job), nprocs=ws, join=True, start_method="spawn")
    res = json.load(open(job["result_file"]))
    ref = reference(dcp_dir)
    print(json.dumps({"load": load, "stage": stage, "ws": ws, "engine": res, "torch_reference": ref, "bit_equal": ref == res["losses"],
                      "max_rel": max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref))}))
