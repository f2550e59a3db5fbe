"""torch.distributed.checkpoint (DCP) directories written by torch 2.x on 2 and 3 gloo processes.

Usage: tools/sid-python tests/python/torch2/gen_t2_dcp.py OUTDIR [--world-sizes 2,3] [--spawn]

Per world size W (OUTDIR/<case>/ and OUTDIR/<case>.manifest.json):
  dcp_dtensor_w{W}  dcp.save of nested dicts of DTensors on a CPU device mesh: Shard(0) with an
                    uneven split (2W+1 rows), Shard(1) bf16, Replicate, a 2-d mesh-free plain
                    tensor, a 0-d int64, and non-tensor items (int, str, list, dict, float)
  dcp_fsdp2_w{W}    a tiny model under FSDP2 fully_shard (gloo, CPU) after 2 AdamW steps:
                    get_state_dict(model, optimizer) saved as {"model", "optim", "step"}
The manifests describe the consolidated global tensors and values, with world_size, files and
dcp_chunks (from .metadata). Each checkpoint is checked twice before its manifest is written:
dcp.load(no_dist=True) into receivers of the manifest's dtypes and shapes, and
format_utils.dcp_to_torch_save followed by torch.load.
"""
import datetime
import json
import os
import shutil
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _t2 as T  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402,F401
from torch.distributed.fsdp import fully_shard  # noqa: E402,F401
from torch.distributed.tensor import DTensor  # noqa: E402,F401

warnings.simplefilter("ignore")


# --------------------------------------------------------------------------- processes
START_METHOD = "fork"


def spawn(fn, world_size, *args):
    """fn(rank, world_size, *args) on world_size gloo processes, file:// rendezvous.

    The processes are forked (torch.multiprocessing.start_processes): a spawned one spends
    ~5 s of CPU importing torch.distributed again. --spawn uses torch.multiprocessing.spawn's
    start method (fresh interpreters, /dev/shm tensors passing), as a test of tools/sid-run.sh."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp = tempfile.mkdtemp(prefix="statedict_t2_gloo_")
    try:
        mp.start_processes(_entry, args=(fn, world_size, os.path.join(tmp, "rendezvous"), args),
                           nprocs=world_size, join=True, start_method=START_METHOD)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _entry(rank, fn, world_size, init_file, args):
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def full_description(sd):
    """Manifest maps of a state dict whose DTensors are gathered to full tensors (collective)."""
    from torch.distributed.tensor import DTensor

    def gather(o):
        if isinstance(o, DTensor):
            return o.full_tensor()
        if isinstance(o, dict):
            return {k: gather(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return type(o)(gather(v) for v in o)
        return o
    return T.describe(gather(sd))


# --------------------------------------------------------------------------- cases
def dtensor_state(world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world_size,))
    r = torch.Generator()
    r.manual_seed(50 + world_size)                   # same on every rank: a global tensor
    embed = torch.randn(2 * world_size + 1, 4, generator=r)
    proj = torch.randn(3, 7, generator=r).to(torch.bfloat16)
    rep = torch.randn(2, 2, generator=r)
    cols = torch.arange(2 * (2 * world_size + 3), dtype=torch.int64).reshape(2, -1)

    def dt(t, placement):
        # every rank holds the same global tensor: shard it locally (gloo scatters no bf16)
        return distribute_tensor(t, mesh, [placement], src_data_rank=None)

    def tree(leaf):
        return {
            "model": {
                "embed": {"weight": leaf(embed, Shard(0))},
                "proj": {"weight": leaf(proj, Shard(1))},
                "norm": {"weight": leaf(rep, Replicate())},
                "cols": leaf(cols, Shard(1)),
                "plain": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                "count": torch.tensor(7),
            },
            "step": 5,
            "name": "dtensor run",
            "lrs": [0.1, 0.01],
            "config": {"layers": 2, "dropout": 0.0},
        }
    return tree(dt), T.describe(tree(lambda t, _: t))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 6, bias=False)
        self.norm = nn.LayerNorm(6)

    def forward(self, idx):
        return self.norm(self.fc2(torch.relu(self.fc1(self.embed(idx)))))


def fsdp2_state(world_size):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(60)
    model = Tiny()
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    r = torch.Generator()
    r.manual_seed(61)
    for _ in range(2):
        idx = torch.randint(0, 10, (4,), generator=r)   # same batch on every rank
        loss = model(idx).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "step": 2}
    return sd, full_description(sd)


CASES = {"dcp_dtensor": dtensor_state, "dcp_fsdp2": fsdp2_state}


def rank_main(rank, world_size, jobs):
    """jobs: [(case, path, desc_file)], all saved by one set of processes (spawning costs more
    than saving)."""
    for case, path, desc_file in jobs:
        sd, desc = CASES[case](world_size)
        dcp.save(sd, checkpoint_id=path)
        if rank == 0:
            with open(desc_file, "w") as f:
                json.dump(desc, f)


# --------------------------------------------------------------------------- checks
def receivers(manifest):
    """A nested state dict of poisoned receivers and placeholder values for dcp.load."""
    root = {}
    for name, e in manifest["tensors"].items():
        t = torch.empty(e["shape"], dtype=T.torch_dtype(e["dtype"]))
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.numel():
            t.fill_(-3 if t.dtype != torch.bool else True)
        _put(root, name.split("."), t)
    return root


def _put(root, parts, v):
    d = root
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = v


def check(path, manifest, case):
    # 1. dcp.load without a process group; non-tensor items come back as stored objects
    sd = receivers(manifest)
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    got = T.flatten(sd)[0]
    if got != manifest["tensors"]:
        bad = [n for n in manifest["tensors"] if got.get(n) != manifest["tensors"][n]]
        raise SystemExit(f"{case}: dcp.load(no_dist=True) gives other tensors: {bad[:5]}")
    # 2. dcp_to_torch_save + torch.load
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(path, out)
        got = T.describe(torch.load(out, weights_only=False))
    if got["tensors"] != manifest["tensors"] or got["values"] != manifest["values"]:
        raise SystemExit(f"{case}: dcp_to_torch_save gives another state dict")


def dcp_chunks(path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = FileSystemReader(path).read_metadata()
    out, kinds = {}, {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            out[fqn] = [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in m.chunks]
        else:
            kinds[fqn] = "bytes"
    return out, kinds


def main(argv):
    global START_METHOD
    args = argv[1:]
    if "--spawn" in args:
        args.remove("--spawn")
        START_METHOD = "spawn"
    sizes = [2, 3]
    if "--world-sizes" in args:
        i = args.index("--world-sizes")
        sizes = [int(x) for x in args[i + 1].split(",")]
        del args[i:i + 2]
    if len(args) != 1:
        print("usage: gen_t2_dcp.py OUTDIR [--world-sizes 2,3] [--spawn]", file=sys.stderr)
        return 2
    outdir = args[0]
    os.makedirs(outdir, exist_ok=True)
    torch.set_num_threads(1)
    for w in sizes:
        jobs = []
        for case in CASES:
            name = f"{case}_w{w}"
            path = os.path.join(outdir, name)
            shutil.rmtree(path, ignore_errors=True)
            jobs.append((case, path, os.path.join(outdir, f".{name}.desc.json")))
        spawn(rank_main, w, jobs)
        for case, path, desc_file in jobs:
            name = os.path.basename(path)
            with open(desc_file) as f:
                desc = json.load(f)
            os.remove(desc_file)
            chunks, items = dcp_chunks(path)
            manifest = T.make_manifest("dcp", desc, path=name, world_size=w,
                                       files=sorted(os.listdir(path)), torch_version=torch.__version__,
                                       dcp_chunks=chunks, dcp_bytes_items=sorted(items))
            check(path, manifest, name)
            T.write_manifest(outdir, name, manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
