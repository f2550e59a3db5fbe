#!/usr/bin/python3
"""ColossalAI checkpoint fixtures: the distributed (per-TP/PP-rank) model layout of PR 6181 and the
released HybridParallelCheckpointIO sharded model + optimizer layout, with manifests.

    /usr/bin/python3 tests/python/gen_colossalai.py OUTDIR [--only SUBSTRING]...

Writes, per case C, the checkpoint folder OUTDIR/C/, OUTDIR/C.manifest.json (the whole model as
ColossalAI's loader rebuilds it) and, for the released layout, OUTDIR/C.optim.manifest.json (the Adam
state keyed by parameter name). ColossalAI needs CUDA and NCCL, so the ranks are reproduced in one
process by following its source function by function (layouts/colossalai.md names each one); a
small torch model is trained for two real Adam steps and split the way ShardFormer splits it
(column-parallel linears and vocab-parallel embeddings on dim 0, row-parallel linears on dim 1,
Embedding1D on dim 1, everything else replicated). Every case is read back with
layouts/colossalai.py (which sees only the files) and must give the source model bit for bit.
"""
import argparse
import collections
import json
import os
import pickle
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import _common as C  # noqa: E402
import gen_safetensors as G  # noqa: E402
import torch_check  # noqa: E402
from layouts import colossalai as ref  # noqa: E402
from layouts._raw import flatten as raw_flatten  # noqa: E402

D, V, P = 6, 24, 9


# --------------------------------------------------------------------------- the model
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_norm = nn.LayerNorm(D)
        self.q_proj = nn.Linear(D, D)               # Linear1D_Col: weight and bias on dim 0
        self.o_proj = nn.Linear(D, D)               # Linear1D_Row: weight on dim 1, bias replicated
        self.up_proj = nn.Linear(D, 2 * D, bias=False)
        self.down_proj = nn.Linear(2 * D, D)


class ColoNet(nn.Module):
    def __init__(self, vocab=V, fused_qkv=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, D)  # VocabParallelEmbedding1D: dim 0
        self.pos_embed = nn.Embedding(P, D)         # Embedding1D: dim 1 (the embedding dim)
        self.layers = nn.ModuleList([Block(), Block()])
        self.layers[0].register_buffer("scale", torch.tensor([0.5, 2.0]))  # persistent, replicated
        if fused_qkv:  # FusedLinear1D_Col (BLIP-2, SAM; GPT-2's c_attn is the transposed variant)
            self.layers[1].qkv = nn.Linear(D, 3 * D)
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, vocab, bias=False)  # VocabParallelLMHead1D: dim 0

    def forward(self, idx):
        x = self.embed_tokens(idx) + self.pos_embed(torch.arange(idx.shape[1]))
        for i, b in enumerate(self.layers):
            h = b.input_norm(x)
            x = x + b.o_proj(torch.tanh(b.q_proj(h)))
            x = x + b.down_proj(torch.relu(b.up_proj(h)))
            if hasattr(b, "qkv"):
                q, k, v = b.qkv(h).chunk(3, dim=-1)
                x = x + torch.tanh(q * k) * v
            if i == 0:
                x = x * self.layers[0].scale.mean()
        return self.lm_head(self.norm(x))


def tp_dim(name):
    """The dim ShardFormer splits a parameter on, None when replicated."""
    if name.startswith("embed_tokens.") or name.startswith("lm_head."):
        return 0
    if name == "pos_embed.weight":
        return 1
    leaf = name.split(".")[-2:]
    if leaf[0] in ("q_proj", "up_proj", "qkv"):
        return 0
    if leaf[0] in ("o_proj", "down_proj") and leaf[1] == "weight":
        return 1
    return None


def stage_of(name, pp):
    """PP=2 puts the embeddings and layer 0 on stage 0, layer 1, the norm and the head on stage 1."""
    if pp == 1:
        return 0
    return 0 if name.startswith(("embed_tokens", "pos_embed", "layers.0.")) else 1


def trained(vocab=V, seed=2024, fused_qkv=False):
    torch.manual_seed(seed)
    model = ColoNet(vocab, fused_qkv)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    idx = torch.randint(0, vocab, (3, P))
    for _ in range(2):
        opt.zero_grad()
        model(idx).logsumexp(-1).mean().backward()
        opt.step()
    return model, opt


# --------------------------------------------------------------------------- file writers
def save_bin(obj, path):
    """save_state_dict(..., use_safetensors=False): torch.save of the tree with every tensor .data.cpu()."""
    torch.save(obj, path)


def save_st_hf(tensors, path):
    """save_state_dict(..., use_safetensors=True): safetensors.torch.save_file(..., metadata={"format": "pt"})."""
    t = {n: (C.dtype_name(v.dtype), list(v.shape), C.tensor_bytes(v)) for n, v in tensors.items()}
    with open(path, "wb") as f:
        f.write(G.serialize(t, metadata={"format": "pt"}))


def save_st_colossal(tensors, path, metadata=None):
    """colossalai/utils/safetensors.py save(): its own header (json.dumps defaults, "__metadata__"
    first with "format": "pt", tensors in insertion order, each metadata value json.dumps'ed), padded
    with spaces to a multiple of 8, data in insertion order."""
    header = {}
    meta = {"format": "pt"}
    for k, v in (metadata or {}).items():
        meta[k] = json.dumps(v)
    header["__metadata__"] = meta
    off, parts = 0, []
    for name, t in tensors.items():
        b = C.tensor_bytes(t)
        header[name] = {"dtype": C.dtype_name(t.dtype), "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        parts.append(b)
    hb = json.dumps(header).encode("utf-8")
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(hb).to_bytes(8, "little") + hb + b"".join(parts))


def object_to_u8(obj):
    """_object_to_tensor(): pickle.Pickler(f).dump(obj) (default protocol) as a 1-D uint8 tensor."""
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=4)), dtype=torch.uint8)


def mb(t):
    """calculate_tensor_size(): numel * element_size / 1024 / 1024 (a float, in MiB)."""
    return t.numel() * t.element_size() / 1024 / 1024


def shard_blocks(items, size_per_shard, size_fn):
    """StateDictSharder: start a new block when the next item would overflow a non-empty block;
    the last block is always yielded."""
    blocks, cur, cur_size = [], collections.OrderedDict(), 0
    for key, value in items:
        size = size_fn(value)
        if cur_size + size > size_per_shard and cur_size > 0:
            blocks.append((cur, cur_size))
            cur, cur_size = collections.OrderedDict(), 0
        cur[key] = value
        cur_size += size
    blocks.append((cur, cur_size))
    return blocks


def optim_state_mb(state):
    return sum(mb(v) for v in state.values() if torch.is_tensor(v))


def write_index(path, metadata, weight_map):
    """CheckpointIndexFile.write_index_file: json.dumps(indent=2) + newline."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2) + "\n")


# --------------------------------------------------------------------------- (a) PR 6181 distributed layout
class DistCase:
    def __init__(self, name, tp, pp=1, dp=1, dtype=torch.bfloat16, kind="bin", shard=True,
                 size_per_shard=0.0006, padded_vocab=None, save_dir=None, dp_writer=None, fused_qkv=False):
        self.name, self.tp, self.pp, self.dp, self.dtype = name, tp, pp, dp, dtype
        self.kind = kind            # "bin", "st" (sync safetensors), "async" (ColossalAI's writer)
        self.shard = shard
        self.size_per_shard = size_per_shard
        self.padded_vocab = padded_vocab  # (vocab, divisible_by): the python -O padded-vocab case
        self.save_dir = save_dir    # the checkpoint path given at save time (unsharded "file" fields)
        self.dp_writer = dp_writer or {}  # dist_id -> dp rank whose meta file survived
        self.fused_qkv = fused_qkv  # a fused q/k/v weight, split per head group (not a contiguous box)


DIST_CASES = [
    DistCase("colossalai_dist_tp2_bin_sharded", 2),
    DistCase("colossalai_dist_tp2_dp2_st_sharded", 2, dp=2, kind="st", dp_writer={1: 1}),
    DistCase("colossalai_dist_tp3_bin_unsharded", 3, dtype=torch.float16, shard=False,
             save_dir="/checkpoints/run7/model_0"),
    DistCase("colossalai_dist_tp3_async_sharded", 3, dtype=torch.float16, kind="async"),
    DistCase("colossalai_dist_tp3_async_unsharded", 3, dtype=torch.float16, kind="async", shard=False,
             save_dir="ckpt/model_0"),
    DistCase("colossalai_dist_pp2_tp2_bin_sharded", 2, pp=2, dtype=torch.float32, size_per_shard=0.0009),
    DistCase("colossalai_dist_tp2_padded_vocab_O", 2, padded_vocab=(22, 4)),
    DistCase("colossalai_dist_tp3_fused_qkv", 3, dtype=torch.float32, fused_qkv=True),
]


def padded_rows(vocab, divisible_by, tp):
    """VocabParallelEmbedding1D / PaddingParallelModule: pad to a multiple of divisible_by * tp."""
    multiple = divisible_by * tp
    return vocab if vocab % multiple == 0 else vocab + multiple - vocab % multiple


def local_shard(name, full, tp, r, padded_to=None):
    """This TP rank's piece of a parameter (a new tensor, as ShardFormer allocates) and its meta box."""
    dim = tp_dim(name)
    g = list(full.shape)
    if name.endswith("qkv.weight") or name.endswith("qkv.bias"):
        # split_fused_qkv_in_gpt2_style: [Q, K, V] -> rank r holds [Q_r, K_r, V_r]; the metadata
        # still says rows part*r .. part*(r+1) of the fused weight.
        q, k, v = full.chunk(3, 0)
        t = torch.cat([x.chunk(tp, 0)[r] for x in (q, k, v)], 0).clone()
        part = g[0] // tp
        offsets = [0] * len(g)
        offsets[0] = part * r
        return t, offsets, list(t.shape)
    if dim is None or tp == 1:
        return full.clone(), [0] * len(g), list(g)
    if padded_to is not None and dim == 0:
        pad = padded_to - g[0]
        # to_padded_tensor: zero rows appended; after training the head's rows need not stay zero,
        # so they are filled with a marker a reader must never let through.
        fill = torch.full([pad] + g[1:], 7.0, dtype=full.dtype)
        padded = torch.cat([full, fill], 0)
        part = padded_to // tp
        t = padded.narrow(0, r * part, part).clone()
        offsets = [0] * len(g)
        offsets[0] = part * r
        lengths = list(t.shape)
        if r == tp - 1:  # create_model_metadata: the last rank's length is what is left
            lengths[0] = g[0] - part * (tp - 1)
        return t, offsets, lengths
    assert g[dim] % tp == 0, (name, g, tp)  # search_tp_partition_dim asserts an even split
    part = g[dim] // tp
    t = full.narrow(dim, r * part, part).clone()
    offsets = [0] * len(g)
    offsets[dim] = part * r
    lengths = list(t.shape)
    if r == tp - 1:
        lengths[dim] = g[dim] - part * (tp - 1)
    return t, offsets, lengths


def write_dist_case(root, case):
    vocab = case.padded_vocab[0] if case.padded_vocab else V
    model, _ = trained(vocab, fused_qkv=case.fused_qkv)
    full = collections.OrderedDict((n, p.detach().to(case.dtype)) for n, p in model.named_parameters())
    buffers = collections.OrderedDict((n, b.detach().to(case.dtype)) for n, b in model.named_buffers())
    padded_to = padded_rows(vocab, case.padded_vocab[1], case.tp) if case.padded_vocab else None
    files = []
    for pp_rank in range(case.pp):
        for tp_rank in range(case.tp):
            dist_id = case.tp * pp_rank + tp_rank  # HybridParallelCheckpointIO: tp_size * pp_rank + tp_rank
            dp = case.dp_writer.get(dist_id, 0)
            rank = (dp * case.pp + pp_rank) * case.tp + tp_rank  # mesh (dp, pp, tp) rank
            params, meta = collections.OrderedDict(), collections.OrderedDict()
            for n, t in full.items():
                if stage_of(n, case.pp) != pp_rank:
                    continue
                local, offsets, lengths = local_shard(
                    n, t, case.tp, tp_rank, padded_to if n in ("embed_tokens.weight", "lm_head.weight") else None)
                params[n] = local
                meta[n] = {"offsets": offsets, "lengths": lengths, "global_shape": list(t.shape)}
            bufs = collections.OrderedDict((n, b.clone()) for n, b in buffers.items()
                                           if stage_of(n, case.pp) == pp_rank)
            files += write_dist_rank(root, case, dist_id, rank, params, bufs, meta)
    tensors, fused = {}, {}
    for n, t in full.items():
        tensors[n] = C.tensor_entry(t)
        if case.fused_qkv and ".qkv." in n:
            # What the boxes (and ColossalAI's loader) give: the ranks' [Q_r, K_r, V_r] pieces one
            # after the other, not the model's [Q, K, V].
            pieces = [local_shard(n, t, case.tp, r)[0] for r in range(case.tp)]
            tensors[n] = C.tensor_entry(torch.cat(pieces, 0))
            fused[n] = {"model_sha256": C.tensor_entry(t)["sha256"], "split_sizes": [D, D, D]}
    manifest = C.make_manifest("colossalai_dist", tensors=tensors,
                               path=os.path.basename(root), tp=case.tp, pp=case.pp, dp=case.dp,
                               files=sorted(files), not_in_metadata=list(buffers),
                               fused_qkv=fused or None)
    return manifest


def write_dist_rank(root, case, dist_id, rank, params, bufs, meta):
    """save_sharded_model / save_unsharded_model with gather_dtensor=False for one dist_id."""
    use_safetensors = case.kind in ("st", "async")
    meta_name = f"pytorch_model-meta-dist-{dist_id:05d}" + (".index.json" if use_safetensors else ".json")
    written = [meta_name]
    if case.shard:
        # _model_sharder(gather_dtensor=False): local parameters, then persistent buffers.
        base = "model.safetensors" if use_safetensors else "pytorch_model.bin"
        base = base.replace(".bin", f"-dist-{dist_id:05d}-shard.bin")
        base = base.replace(".safetensors", f"-dist-{dist_id:05d}-shard.safetensors")
        items = list(params.items()) + list(bufs.items())
        weight_map, total = {}, 0
        for idx, (block, size) in enumerate(shard_blocks(items, case.size_per_shard, mb)):
            # get_shard_filename in PR 6181 numbers shards from 0 (released code: from 1).
            fname = base.replace(".bin", f"-{idx:05d}.bin").replace(".safetensors", f"-{idx:05d}.safetensors")
            total += size
            for k in block:
                weight_map[k] = fname
            path = os.path.join(root, fname)
            if case.kind == "bin":
                save_bin(block, path)
            elif case.kind == "st":
                save_st_hf(block, path)
            else:
                save_st_colossal(block, path)
            written.append(fname)
        for n in meta:
            meta[n]["file"] = weight_map[n]
        total_size = total
    else:
        # model.state_dict() with ParallelModule's own hooks swapped for nn.Module's: local tensors,
        # each module's parameters then its buffers.
        sd = collections.OrderedDict()
        for n, t in list(params.items()) + list(bufs.items()):
            sd[n] = t
        sd = collections.OrderedDict(sorted(sd.items(), key=lambda kv: _module_order(kv[0])))
        fname = f"pytorch_model-dist-{dist_id:05d}" + (".safetensors" if case.kind == "async" else ".bin")
        path = os.path.join(root, fname)
        if case.kind == "async":
            save_st_colossal(sd, path)
        else:
            save_bin(sd, path)
        written.append(fname)
        for n in meta:
            meta[n]["file"] = case.save_dir.rstrip("/") + "/" + fname  # os.path.join(checkpoint, ...)
        total_size = None
    doc = {"checkpoint_version": "1.0", "total_size": total_size, "metadata": {}}
    for n, m in meta.items():
        doc["metadata"][n] = dict(m, rank=rank)
    with open(os.path.join(root, meta_name), "w") as f:
        json.dump(doc, f, indent=4)  # save_metadata: no trailing newline
    return written


_ORDER = None


def _module_order(name):
    """Position of a name in ColoNet().state_dict() (per module: parameters, then buffers)."""
    global _ORDER
    if _ORDER is None:
        _ORDER = {n: i for i, n in enumerate(ColoNet(fused_qkv=True).state_dict())}
    return _ORDER[name]


# --------------------------------------------------------------------------- (b) released layout
class HybridCase:
    def __init__(self, name, tp, pp=1, dtype=torch.bfloat16, model_kind="bin", optim_kind="bin",
                 int_step=False, size_per_shard=0.0008, stage_listdir=None):
        self.name, self.tp, self.pp, self.dtype = name, tp, pp, dtype
        self.model_kind, self.optim_kind = model_kind, optim_kind
        self.int_step = int_step          # HybridAdam keeps "step" as a Python int
        self.size_per_shard = size_per_shard
        self.stage_listdir = stage_listdir or list(range(pp))  # order os.listdir gave the tmp index files


HYBRID_CASES = [
    HybridCase("colossalai_hybrid_tp2_bin", 2),
    HybridCase("colossalai_hybrid_pp2_tp2_st", 2, pp=2, dtype=torch.float16, model_kind="st",
               stage_listdir=[1, 0]),
    HybridCase("colossalai_hybrid_tp2_async", 2, model_kind="async", optim_kind="async", int_step=True),
]


def write_hybrid_case(case_root, case):
    """A ColossalChat / Colossal-LLaMA save_checkpoint folder: modeling/ (booster.save_model, shard=True),
    optimizer/ (booster.save_optimizer, shard=True), lr_scheduler (booster.save_lr_scheduler: a bare
    torch.save file) and running_states.json."""
    model, opt = trained()
    root = os.path.join(case_root, "modeling")
    os.makedirs(root)
    names = [n for n, _ in model.named_parameters()]
    full = collections.OrderedDict((n, p.detach().to(case.dtype)) for n, p in model.named_parameters())
    buffers = collections.OrderedDict((n, b.detach().to(case.dtype)) for n, b in model.named_buffers())
    osd = opt.state_dict()

    # ---- model: save_sharded_model (gathered, unpadded tensors), one set of files per stage
    use_st = case.model_kind in ("st", "async")
    weights_name = "model.safetensors" if use_st else "pytorch_model.bin"
    index_name = "model.safetensors.index.json" if use_st else "pytorch_model.bin.index.json"
    stage_maps, stage_sizes = {}, {}
    for s in range(case.pp):
        base = weights_name
        if case.pp > 1:
            base = base.replace(".bin", f"-stage-{s + 1:05d}-shard.bin")
            base = base.replace(".safetensors", f"-stage-{s + 1:05d}-shard.safetensors")
        items = [(n, t.clone()) for n, t in full.items() if stage_of(n, case.pp) == s]
        items += [(n, b.clone()) for n, b in buffers.items() if stage_of(n, case.pp) == s]
        wm, total = collections.OrderedDict(), 0
        for idx, (block, size) in enumerate(shard_blocks(items, case.size_per_shard, mb)):
            fname = base.replace(".bin", f"-{idx + 1:05d}.bin").replace(".safetensors", f"-{idx + 1:05d}.safetensors")
            total += size
            for k in block:
                wm[k] = fname
            path = os.path.join(root, fname)
            {"bin": save_bin, "st": save_st_hf, "async": save_st_colossal}[case.model_kind](block, path)
        stage_maps[s], stage_sizes[s] = wm, total
    if case.pp == 1:
        write_index(os.path.join(root, index_name), {"total_size": stage_sizes[0]}, stage_maps[0])
    else:
        meta, wm = {"total_size": 0}, collections.OrderedDict()
        for s in case.stage_listdir:  # the master merges tmp_index_files/* in os.listdir order
            meta["total_size"] += stage_sizes[s]
            wm.update(stage_maps[s])
        write_index(os.path.join(root, index_name), meta, wm)

    # ---- optimizer: save_sharded_optimizer
    root = os.path.join(case_root, "optimizer")
    os.makedirs(root)
    async_opt = case.optim_kind == "async"
    states_name = "optimizer.safetensors" if async_opt else "pytorch_optim.bin"
    oindex_name = "optimizer.safetensors.index.json" if async_opt else "pytorch_optim.bin.index.json"
    group_file = "pytorch_optim_group.bin"
    id_of = {n: i for i, n in enumerate(names)}  # get_param_info: running index over param_groups
    ostage_maps, ostage_sizes = {}, {}
    for s in range(case.pp):
        base = states_name
        if case.pp > 1:
            base = base.replace(".bin", f"-stage-{s + 1:05d}-shard.bin")
            base = base.replace(".safetensors", f"-stage-{s + 1:05d}-shard.safetensors")
        items = []
        for n in names:
            if stage_of(n, case.pp) != s:
                continue
            pid = id_of[n]
            st = osd["state"][pid]
            state = collections.OrderedDict()
            for k, v in st.items():  # gather_from_sharded_optimizer_state: full fp32 moments; step as is
                if k == "step":
                    state[k] = int(v.item()) if case.int_step else v.clone()
                else:
                    state[k] = v.clone()
            items.append((pid, state))
        wm, total = collections.OrderedDict(), 0
        for idx, (block, size) in enumerate(shard_blocks(items, case.size_per_shard, optim_state_mb)):
            fname = base.replace(".bin", f"-{idx + 1:05d}.bin").replace(".safetensors", f"-{idx + 1:05d}.safetensors")
            total += size
            for k in block:
                wm[k] = fname
            path = os.path.join(root, fname)
            if async_opt:
                flat, non_tensor = collections.OrderedDict(), []
                for pid, state in block.items():  # _flatten_optim_state_dict(seperator=".")
                    for k, v in state.items():
                        key = f"state.{pid}.{k}"
                        if not torch.is_tensor(v):
                            non_tensor.append(key)
                            v = object_to_u8(v)
                        flat[key] = v
                save_st_colossal(flat, path, {"non_tensor_keys": non_tensor} if non_tensor else None)
            else:
                save_bin(block, path)
        ostage_maps[s], ostage_sizes[s] = wm, total
    groups = []
    for g in osd["param_groups"]:  # {**group, "params": ids}; HybridAdam has its own defaults
        g = dict(g)
        if case.int_step:
            g = {"params": g["params"], "lr": g["lr"], "betas": g["betas"], "eps": g["eps"],
                 "weight_decay": g["weight_decay"], "bias_correction": True}
        groups.append(g)
    torch.save(groups, os.path.join(root, group_file))
    if case.pp == 1:
        write_index(os.path.join(root, oindex_name),
                    {"param_groups": group_file, "total_size": ostage_sizes[0]}, ostage_maps[0])
    else:
        meta, wm = {"total_size": 0}, collections.OrderedDict()
        for s in case.stage_listdir:
            meta["total_size"] += ostage_sizes[s]
            wm.update(ostage_maps[s])
        meta["param_groups"] = group_file
        write_index(os.path.join(root, oindex_name), meta, wm)

    sched = torch.optim.lr_scheduler.CosineAnnealingLR(torch.optim.SGD([torch.zeros(1)], lr=1e-3), T_max=10)
    torch.save(sched.state_dict(), os.path.join(case_root, "lr_scheduler"))
    with open(os.path.join(case_root, "running_states.json"), "w", encoding="utf-8") as f:
        json.dump({"epoch": 0, "step": 2, "sample_start_index": 6}, f, ensure_ascii=False, indent=4)

    weights = C.make_manifest(
        "colossalai_hybrid",
        tensors={**{n: C.tensor_entry(t) for n, t in full.items()},
                 **{n: C.tensor_entry(b) for n, b in buffers.items()}},
        path=os.path.basename(case_root), tp=case.tp, pp=case.pp)
    optim = {"state": collections.OrderedDict(), "param_groups": []}
    for n in names:
        st = osd["state"][id_of[n]]
        optim["state"][n] = {k: (int(v.item()) if (k == "step" and case.int_step) else v) for k, v in st.items()}
    for g in groups:
        g = dict(g)
        g["params"] = [names[i] for i in g["params"]]
        optim["param_groups"].append(g)
    t, v = raw_flatten({"optim": optim})
    om = C.make_manifest("colossalai_hybrid_optim", tensors=t, values=v, path=os.path.basename(case_root))
    return weights, om


# --------------------------------------------------------------------------- main
def check_against(manifest, got, label):
    t, v = raw_flatten(got)
    problems = torch_check.compare_with_manifest(manifest, t, v, label="reference read")
    if problems:
        raise SystemExit(f"{label}: the reference reader disagrees with the source:\n  " + "\n  ".join(problems))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("outdir")
    ap.add_argument("--only", action="append", default=[])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.outdir, exist_ok=True)
    t0 = time.time()
    n = 0
    for case in DIST_CASES + HYBRID_CASES:
        if args.only and not any(s in case.name for s in args.only):
            continue
        root = os.path.join(args.outdir, case.name)
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        if isinstance(case, DistCase):
            m = write_dist_case(root, case)
            C.write_manifest(args.outdir, case.name, m)
            got, _info = ref.load_dist(root)
            check_against(m, got, case.name)
        else:
            m, om = write_hybrid_case(root, case)
            C.write_manifest(args.outdir, case.name, m)
            C.write_manifest(args.outdir, case.name + ".optim", om)
            mdir, odir = ref.hybrid_dirs(root)
            check_against(m, ref.load_hybrid_model(mdir), case.name)
            check_against(om, {"optim": ref.load_hybrid_optim_by_name(odir, mdir)}, case.name + " optimizer")
        n += 1
    print(f"gen_colossalai: {n} cases verified in {time.time() - t0:.1f}s -> {args.outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
