"""Write OLMo ``LocalShardedCheckpointer`` checkpoints of an FSDP model, as OLMo and PyTorch write them.

FSDP needs CUDA in torch 1.13, so the flat parameters are built here by following PyTorch's code:
  * torch 2.0 form (``_shard_param_offsets`` / ``_shard_indices``, no alignment padding): the same
    algorithm as torch/distributed/fsdp/flat_param.py in torch 1.13 (read locally) —
    FlatParamHandle._init_flat_param, flatten_params, shard, _get_unpadded_shard, _get_shard,
    _init_shard_metadata, _get_shard_metadata, _get_flat_param_offsets — with 2.0's ``_fqns`` name;
  * torch >= 2.1 form (``_shard_param_infos``, ``_numels_with_padding``): pytorch/pytorch
    torch/distributed/fsdp/_flat_param.py (@01caf79 / @fe03cf6) — _init_flat_param_and_metadata
    (alignment padding of 16 bytes / itemsize before each parameter and to a multiple of the world
    size, only with use_orig_params=True, padding value _FLAT_PARAM_PADDING_VALUE = 42),
    _init_shard_metadata, _get_shard_metadata (_ShardParamInfo, inclusive end).
OLMo side (allenai/OLMo olmo/checkpoint.py @00d7726): _fsdp_modules, _get_flat_param_state_to_save
(``_FLAT_PARAM_METADATA_TO_SAVE``), save_checkpoint (model/optim/train rank files, metadata.yaml,
config.yaml), and olmo/optim.py get_param_groups (``param_names``, ``sharded``, ``max_grad_norm``...).

Layout of one case:
  <root>/step2/model/rank{r}.pt   {"modules": [{"handles": [{"flat_param.data": ..., "flat_param._fqns": ...}],
                                                "name": "<FSDP module name>"}, ...]}
  <root>/step2/optim/rank{r}.pt   the rank's torch optimizer state_dict (original params, sharded views)
  <root>/step2/train/rank{r}.pt   OLMo trainer state (steps, rng states, checkpoint paths)
  <root>/step2/metadata.yaml      "world_size: N"
  <root>/step2/config.yaml        (a short stand-in for OLMo's TrainConfig dump)
"""
import collections
import os
import pathlib
import random

import numpy as np
import torch

from . import model as tiny
from . import standins
from . import torchsave
from .manifest import Manifest

FSDP = "_fsdp_wrapped_module"
PADDING_VALUE = 42.0  # _flat_param.py _FLAT_PARAM_PADDING_VALUE (alignment padding contents)
STEP = 2
BATCH = 4


class FsdpCase:
    def __init__(self, name, world_size, form="torch21", use_orig_params=True):
        self.name = name
        self.world_size = world_size
        self.form = form  # "torch20" | "torch21"
        self.use_orig_params = use_orig_params
        if form == "torch20" and not use_orig_params:
            raise ValueError("torch20 form is generated with use_orig_params=True only")

    @property
    def aligned(self):
        # _flat_param.py FlatParamHandle.__init__: align_addresses = use_orig_params (torch >= 2.1)
        return self.form == "torch21" and self.use_orig_params

    def describe(self):
        bits = [f"ws {self.world_size}", f"{self.form} field names"]
        bits.append("use_orig_params=True" if self.use_orig_params else "use_orig_params=False")
        bits.append("alignment padding" if self.aligned else "no alignment padding")
        return ", ".join(bits)


# FSDP units: the root plus one nested FSDP instance per listed sub-module (an auto-wrap policy).
NESTED_UNITS = ["block0", "block1", "tiny"]


def unit_of(name):
    for u in NESTED_UNITS:
        if name.startswith(u + "."):
            return u
    return ""


def prefixed(name):
    """Name of an original parameter as the FSDP-wrapped model's named_parameters() reports it."""
    u = unit_of(name)
    if u:
        return f"{FSDP}.{u}.{FSDP}.{name[len(u) + 1:]}"
    return f"{FSDP}.{name}"


def olmo_module_name(unit):
    """OLMo _fsdp_modules: names from the root FSDP's named_modules()."""
    return "" if unit == "" else f"{FSDP}.{unit}"


class FlatUnit:
    """One FlatParameter (unsharded), built like FlatParamHandle does."""

    def __init__(self, unit, module, exclude, dtype_size, ws, aligned):
        self.unit = unit
        self.fqns, self.shapes, self.numels = [], [], []
        self.numels_with_padding, self.is_padding = [], []
        self.params = []  # original parameter objects, flattening order
        self.shared = []  # (fqn, prim_fqn) for SharedParamInfo entries
        pieces = []
        seen = {}
        aligned_numel = 16 // dtype_size if aligned else 0  # _get_aligned_numel
        total = 0
        for mname, m in module.named_modules():
            for pname, p in m.named_parameters(recurse=False):
                if id(p) in exclude:
                    continue  # already flattened into a nested FSDP unit
                fqn = f"{mname}.{pname}" if mname else pname
                if id(p) in seen:
                    self.shared.append((fqn, seen[id(p)]))
                    continue
                if aligned_numel > 0:
                    pad = aligned_numel - (total % aligned_numel)
                    if 0 < pad < aligned_numel:
                        pieces.append(torch.full((pad,), PADDING_VALUE))
                        self.numels_with_padding.append(pad)
                        self.is_padding.append(True)
                        total += pad
                seen[id(p)] = fqn
                self.params.append(p)
                self.fqns.append(fqn)
                self.shapes.append(p.shape)
                self.numels.append(p.numel())
                self.numels_with_padding.append(p.numel())
                self.is_padding.append(False)
                pieces.append(p.detach().reshape(-1))
                total += p.numel()
        if aligned_numel > 0:
            pad = ws - (total % ws)
            if 0 < pad < ws:
                pieces.append(torch.full((pad,), PADDING_VALUE))
                self.numels_with_padding.append(pad)
                self.is_padding.append(True)
                total += pad
        self.flat = torch.cat(pieces)
        self.piece_layout = self._layout()

    def _layout(self):
        """[(param index or None, start, end_inclusive)] over the unsharded flat parameter."""
        out, off, pi = [], 0, 0
        for n, pad in zip(self.numels_with_padding, self.is_padding):
            out.append((None if pad else pi, off, off + n - 1))
            if not pad:
                pi += 1
            off += n
        return out

    def flatten_like(self, per_param, fill):
        """Lay per-parameter tensors (e.g. exp_avg) out like the flat parameter; padding gets ``fill``."""
        pieces = []
        for idx, s, e in self.piece_layout:
            if idx is None:
                pieces.append(torch.full((e - s + 1,), fill))
            else:
                pieces.append(per_param[idx].detach().reshape(-1))
        return torch.cat(pieces)

    def shard(self, tensor, rank, ws):
        """FlatParamHandle._get_unpadded_shard / _get_shard: torch.chunk, then right-pad with zeros."""
        chunks = torch.flatten(tensor).chunk(ws)
        chunk = chunks[rank] if len(chunks) > rank else chunks[0].new_empty(0)
        pad = chunks[0].numel() - chunk.numel()
        shard = chunk.clone()
        if pad > 0:
            shard = torch.nn.functional.pad(shard, [0, pad])
        return shard, pad

    def shard_bounds(self, rank, ws):
        size = self.flat.chunk(ws)[0].numel()
        return size * rank, size * (rank + 1) - 1  # inclusive end (shard)

    def metadata_torch20(self, rank, ws):
        """flat_param.py (1.13/2.0) _get_shard_metadata: inclusive [start, end] offsets of each
        parameter slice in this shard, and the inclusive index range of those parameters."""
        start, end = self.shard_bounds(rank, ws)
        offsets, indices = [], []
        for i, (idx, ps, pe) in enumerate(self.piece_layout):
            if start > pe or end < ps:
                continue
            intra_s = 0 if start <= ps else start - ps
            intra_e = min(pe, end) - ps
            indices.append(idx)
            offsets.append((intra_s, intra_e))
        shard_indices = (indices[0], indices[-1]) if indices else (0, 0)
        return tuple(offsets), shard_indices

    def metadata_torch21(self, rank, ws):
        """_flat_param.py _get_shard_metadata: one _ShardParamInfo per real parameter."""
        start, end = self.shard_bounds(rank, ws)
        size = end - start + 1
        infos = []
        for idx, ps, pe in self.piece_layout:
            if idx is None:
                continue
            if not (start <= pe and end >= ps):
                infos.append(standins._ShardParamInfo(False, None, None, None, None))
                continue
            if start <= ps:
                intra_s, off = 0, ps - start
            else:
                intra_s, off = start - ps, 0
            assert 0 <= off < size
            intra_e = min(pe, end) - ps
            infos.append(standins._ShardParamInfo(True, off, intra_e - intra_s + 1, intra_s, intra_e))
        return tuple(infos)

    def param_slices(self, rank, ws):
        """{param index: (intra_start, intra_end_inclusive, offset_in_shard)} for this rank."""
        start, end = self.shard_bounds(rank, ws)
        out = {}
        for idx, ps, pe in self.piece_layout:
            if idx is None or start > pe or end < ps:
                continue
            intra_s = 0 if start <= ps else start - ps
            intra_e = min(pe, end) - ps
            out[idx] = (intra_s, intra_e, max(ps - start, 0))
        return out


def build_units(net, ws, aligned):
    mods = dict(net.named_modules())
    nested_ids = set()
    units = []
    for u in NESTED_UNITS:
        fu = FlatUnit(u, mods[u], set(), 4, ws, aligned)
        nested_ids.update(id(p) for p in fu.params)
        units.append(fu)
    root = FlatUnit("", net, nested_ids, 4, ws, aligned)
    return [root] + units  # root first: order of OLMo's _fsdp_modules (named_modules pre-order)


def olmo_param_groups(net):
    """olmo/optim.py get_param_groups with no_decay_norm_and_bias: Linear weights decay, the rest not;
    names (with FSDP prefixes) sorted.  Built from named_parameters() so a tied weight is listed once."""
    decay, no_decay = [], []
    mods = dict(net.named_modules())
    for name, p in net.named_parameters():
        if not p.requires_grad:
            continue
        owner = mods[name.rpartition(".")[0]]
        if name.endswith("weight") and isinstance(owner, torch.nn.Linear):
            decay.append(name)
        else:
            no_decay.append(name)
    decay.sort(key=prefixed)
    no_decay.sort(key=prefixed)
    defaults = {"sharded": True, "max_grad_norm": 1.0, "max_grad_norm_ratio": None}
    return [
        (decay, {"param_names": [prefixed(n) for n in decay], **defaults}),
        (no_decay, {"param_names": [prefixed(n) for n in no_decay], "weight_decay": 0.0, **defaults}),
    ]


def write_case(out_root, case):
    standins.install()
    ws = case.world_size
    net = tiny.build_model(with_frozen=False)
    if case.use_orig_params:
        spec = olmo_param_groups(net)
        groups = [(names, dict(extra)) for names, extra in spec]
    else:
        groups = [([n for n, _ in net.named_parameters()], {})]
    # OLMo's AdamW: build_optimizer(lr, betas, weight_decay, eps=1e-5); group keys come first.
    train_spec = [(names, {"lr": 4e-3, "eps": 1e-5, "weight_decay": extra.get("weight_decay", 0.1)})
                  for names, extra in groups]
    opt = tiny.train(net, train_spec, steps=STEP, batch=BATCH * ws)
    named = dict(net.named_parameters())
    units = build_units(net, ws, case.aligned)

    step_dir = os.path.join(out_root, f"step{STEP}")
    for sub in ("model", "optim", "train"):
        os.makedirs(os.path.join(step_dir, sub), exist_ok=True)

    rank_slices = []  # per rank: {full name: (shape, s, e, data)}
    for r in range(ws):
        modules = []
        slices = collections.OrderedDict()
        for fu in units:
            data, npad = fu.shard(fu.flat, r, ws)
            h = collections.OrderedDict()
            h["flat_param.data"] = data  # flat_param.detach(): the sharded flat param (with right padding)
            # _FLAT_PARAM_METADATA_TO_SAVE order; only attributes the torch version has are written.
            if case.form == "torch20":
                offsets, indices = fu.metadata_torch20(r, ws)
                h["flat_param._fqns"] = tuple(fu.fqns)
                h["flat_param._shard_param_offsets"] = offsets
                h["flat_param._shard_indices"] = indices
                h["flat_param._numels"] = tuple(fu.numels)
                h["flat_param._shapes"] = tuple(fu.shapes)
                h["flat_param._shard_numel_padded"] = npad
            else:
                h["flat_param._fqns"] = list(fu.fqns)
                h["flat_param._numels"] = tuple(fu.numels)
                h["flat_param._numels_with_padding"] = tuple(fu.numels_with_padding)
                h["flat_param._shapes"] = list(fu.shapes)
                h["flat_param._shard_numel_padded"] = npad
                h["flat_param._shard_param_infos"] = fu.metadata_torch21(r, ws)
            modules.append({"handles": [dict(h)], "name": olmo_module_name(fu.unit)})
            for idx, (s, e, off) in fu.param_slices(r, ws).items():
                full = f"{fu.unit}.{fu.fqns[idx]}" if fu.unit else fu.fqns[idx]
                slices[full] = (tuple(fu.shapes[idx]), s, e, data[off:off + e - s + 1])
        rank_slices.append(slices)
        torchsave.save({"modules": modules}, os.path.join(step_dir, "model", f"rank{r}.pt"), device=f"cuda:{r}")

        osd = _rank_optimizer_state(case, r, net, opt, groups, units, named)
        if r == 0:
            file_groups = [{k: v for k, v in g.items() if k not in ("params", "param_names")}
                           for g in osd["param_groups"]]
        torchsave.save(osd, os.path.join(step_dir, "optim", f"rank{r}.pt"), device=f"cuda:{r}")

        trainer = _trainer_state(case, r)
        torchsave.save(trainer, os.path.join(step_dir, "train", f"rank{r}.pt"), device=f"cuda:{r}",
                       cpu_tensors=[trainer["rng"]["torch"]])

    with open(os.path.join(step_dir, "metadata.yaml"), "w") as f:
        f.write(f"world_size: {ws}\n")  # _LocalShardedCheckpointerMetadata.save (OmegaConf YAML)
    with open(os.path.join(step_dir, "config.yaml"), "w") as f:
        f.write("# Stand-in for OLMo's TrainConfig dump (olmo/checkpoint.py _save_config).\n"
                f"run_name: {case.name}\nsharded_checkpointer: local\n"
                f"fsdp:\n  use_orig_params: {'true' if case.use_orig_params else 'false'}\n"
                "  sharding_strategy: FULL_SHARD\n")

    man = _model_manifest(rank_slices)
    om = _optim_manifest(opt, groups, named, file_groups) if case.use_orig_params else None
    return man, om, step_dir


def _rank_optimizer_state(case, r, net, opt, groups, units, named):
    """The rank's ``optim.state_dict()``: a real torch AdamW over this rank's parameters."""
    pg = []
    states = []
    if case.use_orig_params:
        # FSDP use_orig_params: each original parameter is a 1-D view of its part of the local shard
        # (size 0 when not in the shard, and then it gets no gradient and no optimizer state).
        where = {}
        for fu in units:
            sl = fu.param_slices(r, case.world_size)
            for idx, p in enumerate(fu.params):
                where[id(p)] = sl.get(idx)
        for names, extra in groups:
            params = []
            for n in names:
                p = named[n]
                s = where[id(p)]
                local = torch.empty(0) if s is None else p.detach().reshape(-1)[s[0]:s[1] + 1].clone()
                params.append(local)
                if s is not None:
                    st = opt.state[p]
                    states.append((local, {"step": st["step"].clone(),
                                           "exp_avg": st["exp_avg"].reshape(-1)[s[0]:s[1] + 1].clone(),
                                           "exp_avg_sq": st["exp_avg_sq"].reshape(-1)[s[0]:s[1] + 1].clone()}))
            g = {"params": params}
            g.update(extra)
            pg.append(g)
    else:
        # use_orig_params=False: the optimizer holds one sharded FlatParameter per FSDP unit.
        params = []
        step = None
        for fu in units:
            local, _ = fu.shard(fu.flat, r, case.world_size)
            m1 = fu.flatten_like([opt.state[p]["exp_avg"] for p in fu.params], 0.0)
            m2 = fu.flatten_like([opt.state[p]["exp_avg_sq"] for p in fu.params], 0.0)
            step = opt.state[fu.params[0]]["step"]
            params.append(local)
            states.append((local, {"step": step.clone(), "exp_avg": fu.shard(m1, r, case.world_size)[0],
                                   "exp_avg_sq": fu.shard(m2, r, case.world_size)[0]}))
        pnames = [f"{FSDP}._flat_param"] + [f"{FSDP}.{fu.unit}.{FSDP}._flat_param" for fu in units[1:]]
        pg = [{"params": params, "param_names": pnames, "sharded": True, "max_grad_norm": 1.0,
               "max_grad_norm_ratio": None}]
    optim = torch.optim.AdamW(pg, lr=4e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-5)
    for p, st in states:
        optim.state[p] = st
    return optim.state_dict()


def _trainer_state(case, r):
    """olmo/train.py Trainer.trainer_state_dict (rng states of this process; no CUDA here)."""
    random.seed(1000 + r)
    np.random.seed(1000 + r)
    torch.manual_seed(1000 + r)
    return {
        "epoch": 0,
        "global_step": STEP,
        "global_train_examples_seen_this_epoch": STEP * BATCH * case.world_size,
        "global_train_tokens_seen": STEP * BATCH * case.world_size * 5,
        "world_size": case.world_size,
        "checkpoints": [pathlib.PosixPath(f"runs/{case.name}/step{STEP}")],
        "unsharded_checkpoints": [],
        "ephemeral_checkpoints": [],
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.random.get_rng_state(),
            "cuda": None,
        },
    }


def _model_manifest(rank_slices):
    """OLMo unshard_checkpoint output: parameters in order of first appearance (rank 0 first)."""
    man = Manifest("olmo_local_sharded")
    full = collections.OrderedDict()
    for slices in rank_slices:
        for name, (shape, s, e, data) in slices.items():
            if name not in full:
                full[name] = torch.full(shape, float("nan"))
            full[name].view(-1)[s:e + 1] = data
    for name, t in full.items():
        man.add_tensor(name, t)
    return man


def _optim_manifest(opt, groups, named, file_groups):
    om = Manifest("olmo_local_sharded_optim")
    order = [n for names, _ in groups for n in names]  # optimizer param ids 0..n-1
    for n in order:
        st = opt.state[named[n]]
        for k in ("exp_avg", "exp_avg_sq", "step"):
            om.add_tensor(f"optim.state.{n}.{k}", st[k])
    for i, (names, _) in enumerate(groups):
        om.add_value(f"optim.param_groups.{i}.params", list(names))
        for k, v in file_groups[i].items():
            om.add_value(f"optim.param_groups.{i}.{k}", v)
    return om
