"""Independent re-implementations of the consolidation algorithms, used to check the fixtures.

* ``zero_to_fp32(root)`` follows DeepSpeed's deepspeed/utils/zero_to_fp32.py (deepspeedai/DeepSpeed
  @00158f6: parse_model_states, parse_optim_states, _get_fp32_state_dict_from_zero{2,3}_checkpoint,
  zero3_partitioned_param_info, GatheredTensor) step by step, including its file discovery (glob +
  natural sort), its checks (file count == partition count, the 2*world_size alignment check for
  stage 1/2, the offset*world_size == available check for stage 3) and its quirks (buffers cast with
  ``.float()``, frozen parameters not cast, frozen parameters missing for stage 1).
* ``zero_optim(root)`` consolidates the Adam moments.  zero_to_fp32 discards them; the rules here are
  the same layout rules applied to ``base_optimizer_state`` / ``optimizer_state_dict``.
* ``olmo_unshard(step_dir)`` follows OLMo's LocalShardedCheckpointer.unshard_checkpoint and
  _iter_flat_param_shards (allenai/OLMo olmo/checkpoint.py @00d7726).

Only torch is needed (plus the stand-in classes, so the pickles resolve).  This module never imports
the writers: it sees nothing but the files.
"""
import glob
import math
import os
import re
from collections import OrderedDict, defaultdict

import torch

from . import standins
from .manifest import Manifest


def _natural_keys(text):
    return [int(c) if c.isdigit() else c for c in re.split(r"(\d+)", text)]


def _files(d, pattern):
    found = sorted(glob.glob(os.path.join(d, pattern)), key=_natural_keys)
    if not found:
        raise FileNotFoundError(f"no {pattern} in {d}")
    return found


def _load(path):
    return torch.load(path, map_location="cpu")


def _numel(shape):
    return shape.numel() if callable(getattr(shape, "numel", None)) else math.prod(shape)


def _resolve_tag_dir(root, tag=None):
    if tag is None:
        with open(os.path.join(root, "latest")) as f:
            tag = f.read().strip()
    d = os.path.join(root, tag)
    if not os.path.isdir(d):
        raise FileNotFoundError(d)
    return d


def _model_states(tag_dir):
    out = []
    for path in _files(tag_dir, "*_model_states.pt"):
        sd = _load(path)
        if "buffer_names" not in sd:
            raise ValueError(f"{path} is not a model state checkpoint")
        names = sd["buffer_names"]
        out.append({
            "buffers": OrderedDict((k, v.float()) for k, v in sd["module"].items() if k in names),
            "param_shapes": sd["param_shapes"],
            "shared": [[k, v] for k, v in sd["shared_params"].items()],
            "frozen_shapes": sd.get("frozen_param_shapes"),
            "frozen_frags": sd.get("frozen_param_fragments"),
        })
    return out


def _optim_states(tag_dir):
    paths = _files(tag_dir, "*_optim_states.pt")
    sds = [_load(p)["optimizer_state_dict"] for p in paths]
    if "zero_stage" not in sds[0]:
        raise ValueError(f"{paths[0]} is not a zero checkpoint")
    stage = int(sds[0]["zero_stage"])
    ws = sds[0]["partition_count"]
    if isinstance(ws, list):
        ws = max(ws)
    if ws != len(paths):
        raise ValueError(f"expected {ws} optim files, found {len(paths)}")
    return stage, ws, sds


def zero_to_fp32(root, tag=None):
    """Returns (OrderedDict name -> tensor, [[alias, owner], ...])."""
    tag_dir = _resolve_tag_dir(root, tag)
    models = _model_states(tag_dir)
    stage, ws, osds = _optim_states(tag_dir)
    out = OrderedDict()
    out.update(models[0]["buffers"])
    if stage <= 2:
        groups = [sd["single_partition_of_fp32_groups"] for sd in osds]
        fshapes = models[0]["frozen_shapes"]
        if fshapes:
            for name in fshapes:
                out[name] = models[0]["frozen_frags"][name]  # no dtype cast, no reshape
        for gi, shapes in enumerate(models[0]["param_shapes"]):
            full = torch.cat([g[gi] for g in groups], 0)
            offset, avail = 0, full.numel()
            for name, shape in shapes.items():
                n = _numel(shape)
                out[name] = full.narrow(0, offset, n).view(shape)
                offset += n
            align = 2 * ws
            if align * math.ceil(offset / align) != align * math.ceil(avail / align):
                raise ValueError(f"consumed {offset} numels out of {avail}")
    elif stage == 3:
        fshapes = models[0]["frozen_shapes"]
        if fshapes:
            for name, shape in fshapes.items():
                n = _numel(shape)
                frags = [m["frozen_frags"][name] for m in models]
                out[name] = torch.cat(frags, 0).narrow(0, 0, n).view(shape)
        flat = [sd["fp32_flat_groups"] for sd in osds]
        bounds = [0]
        for t in flat[0]:
            bounds.append(bounds[-1] + t.numel())
        avail = bounds[-1] * ws
        shapes = OrderedDict((k, v) for d in models[0]["param_shapes"] for k, v in d.items())
        offset = 0
        for name, shape in shapes.items():
            n = _numel(shape)
            pn = (n + ws - 1) // ws  # zero3_partitioned_param_info
            chunks = []
            for r in range(ws):
                chunks.extend(_slice_groups(flat[r], bounds, offset, offset + pn))
            out[name] = torch.cat(chunks, 0)[:n].view(shape).contiguous()
            offset += pn
        if offset * ws != avail:
            raise ValueError(f"consumed {offset * ws} numels out of {avail}")
    else:
        raise ValueError(f"unknown zero stage {stage}")
    shared = models[0]["shared"]
    for alias, owner in shared:
        if owner in out:
            out[alias] = out[owner]
    return out, shared


def _slice_groups(groups, bounds, start, end):
    """The part [start, end) of the concatenation of ``groups`` (GatheredTensor.contiguous)."""
    out = []
    for g, t in enumerate(groups):
        lo, hi = bounds[g], bounds[g + 1]
        s, e = max(start, lo), min(end, hi)
        if s < e:
            out.append(t[s - lo:e - lo])
    return out


def zero_optim(root, tag=None):
    """Consolidated Adam state: OrderedDict name -> {key: tensor}, plus param_groups info."""
    tag_dir = _resolve_tag_dir(root, tag)
    models = _model_states(tag_dir)
    stage, ws, osds = _optim_states(tag_dir)
    result = OrderedDict()
    groups_info = []
    if stage <= 2:
        base0 = osds[0]["base_optimizer_state"]
        elastic = isinstance(base0, list)
        for gi, shapes in enumerate(models[0]["param_shapes"]):
            per_rank = []
            for sd in osds:
                b = sd["base_optimizer_state"]
                per_rank.append(b[gi] if elastic else b["state"][gi])
            keys = [k for k, v in per_rank[0].items() if torch.is_tensor(v) and v.dim() > 0]
            scalars = {k: v for k, v in per_rank[0].items() if k not in keys}
            for sd_r in per_rank[1:]:
                for k, v in scalars.items():
                    if not torch.equal(torch.as_tensor(sd_r[k]), torch.as_tensor(v)):
                        raise ValueError(f"{k} differs across ranks")
            fulls = {k: torch.cat([s[k] for s in per_rank], 0) for k in keys}
            offset = 0
            for name, shape in shapes.items():
                n = _numel(shape)
                entry = OrderedDict()
                for k in per_rank[0]:
                    entry[k] = fulls[k].narrow(0, offset, n).view(shape) if k in fulls else scalars[k]
                result[name] = entry
                offset += n
            info = {"params": list(shapes.keys())}
            if not elastic:
                pg = base0["param_groups"][gi]
                info.update({k: v for k, v in pg.items() if k != "params"})
            groups_info.append(info)
    else:
        # Flat groups are the base optimizer's params, in param_groups order (state ids 0..n-1).
        base0 = osds[0]["optimizer_state_dict"]
        n_sub = len(osds[0]["fp32_flat_groups"])
        states = [[sd["optimizer_state_dict"]["state"][i] for i in range(n_sub)] for sd in osds]
        keys = [k for k, v in states[0][0].items() if torch.is_tensor(v) and v.dim() > 0]
        bounds = [0]
        for t in osds[0]["fp32_flat_groups"]:
            bounds.append(bounds[-1] + t.numel())
        sub_of_param = {}
        offset = 0
        shapes_by_sub = models[0]["param_shapes"]
        for si, shapes in enumerate(shapes_by_sub):
            for name, shape in shapes.items():
                n = _numel(shape)
                pn = (n + ws - 1) // ws
                entry = OrderedDict()
                for k, v in states[0][si].items():
                    if k in keys:
                        chunks = []
                        for r in range(ws):
                            chunks.extend(_slice_groups([s[k] for s in states[r]], bounds, offset, offset + pn))
                        entry[k] = torch.cat(chunks, 0)[:n].view(shape).contiguous()
                    else:
                        entry[k] = v
                result[name] = entry
                sub_of_param[name] = si
                offset += pn
        # param group of each sub-group: position of its flat param id in param_groups
        id_to_group = {}
        for gi, pg in enumerate(base0["param_groups"]):
            for pid in pg["params"]:
                id_to_group[pid] = gi
        for gi, pg in enumerate(base0["param_groups"]):
            names = [n for n, si in sub_of_param.items() if id_to_group[si] == gi]
            info = {"params": names}
            info.update({k: v for k, v in pg.items() if k != "params"})
            groups_info.append(info)
    return stage, result, groups_info


def zero_manifests(root):
    """Build both manifests from the files alone."""
    standins.install()
    out, shared = zero_to_fp32(root)
    stage, moments, groups_info = zero_optim(root)
    man = Manifest(f"deepspeed_zero{stage}")
    alias_of = {a: o for a, o in shared if o in out}
    for k, v in out.items():
        man.add_tensor(k, v)
    man.aliases = alias_of
    om = Manifest(f"deepspeed_zero{stage}_optim")
    for name, entry in moments.items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            om.add_tensor(f"optim.state.{name}.{k}", torch.as_tensor(entry[k]))
    for i, info in enumerate(groups_info):
        om.add_value(f"optim.param_groups.{i}.params", info["params"])
        for k, v in info.items():
            if k != "params":
                om.add_value(f"optim.param_groups.{i}.{k}", v)
    return man, om


# ---------------------------------------------------------------------------------------------------
# OLMo LocalShardedCheckpointer
# ---------------------------------------------------------------------------------------------------

def _iter_flat_param_shards(model_state):
    for module_data in model_state["modules"]:
        prefix = module_data["name"].replace("_fsdp_wrapped_module.", "")
        for handle in module_data["handles"]:
            data = handle["flat_param.data"]
            npad = handle["flat_param._shard_numel_padded"]
            if npad > 0 and not bool((data[-npad:] == 0).all()):
                raise ValueError("right padding of a flat param shard is not zero")
            if "flat_param._shard_indices" in handle:  # torch <= 2.0
                first = handle["flat_param._shard_indices"][0]
                cur = 0
                for fqn, shape, (s, e) in zip(handle["flat_param._fqns"][first:],
                                              handle["flat_param._shapes"][first:],
                                              handle["flat_param._shard_param_offsets"]):
                    n = e - s + 1
                    yield (f"{prefix}.{fqn}" if prefix else fqn), shape, (s, e), data[cur:cur + n]
                    cur += n
            else:  # torch >= 2.1
                for fqn, shape, info in zip(handle["flat_param._fqns"], handle["flat_param._shapes"],
                                            handle["flat_param._shard_param_infos"]):
                    if not info.in_shard:
                        continue
                    yield ((f"{prefix}.{fqn}" if prefix else fqn), shape,
                           (info.intra_param_start_idx, info.intra_param_end_idx),
                           data[info.offset_in_shard:info.offset_in_shard + info.numel_in_shard])


def olmo_unshard(step_dir, with_optim=True):
    """Returns (model OrderedDict, optim dict or None, param id -> fqn).

    OLMo can only unshard optimizer state of use_orig_params=True runs (state keyed by original
    parameters); pass with_optim=False for the others."""
    standins.install()
    with open(os.path.join(step_dir, "metadata.yaml")) as f:
        ws = int(re.search(r"world_size:\s*(\d+)", f.read()).group(1))
    full = OrderedDict()
    pieces = defaultdict(dict)
    for r in range(ws):
        ms = _load(os.path.join(step_dir, "model", f"rank{r}.pt"))
        for fqn, shape, (s, e), shard in _iter_flat_param_shards(ms):
            if fqn not in full:
                full[fqn] = torch.full(tuple(shape), float("nan"), dtype=shard.dtype)
            view = full[fqn].view(-1)[s:e + 1]
            if view.shape != shard.shape:
                raise ValueError(f"shard of {fqn} has {shard.shape}, expected {view.shape}")
            view.copy_(shard)
            pieces[r][fqn] = (tuple(shape), s, e)
    for k, v in full.items():
        if torch.isnan(v).any():
            raise ValueError(f"parameter {k} not fully covered")

    if not with_optim:
        return full, None, None
    optim = {"state": defaultdict(OrderedDict)}
    fqn_to_id, id_to_fqn = {}, {}
    for r in range(ws):
        osd = _load(os.path.join(step_dir, "optim", f"rank{r}.pt"))
        if "param_groups" not in optim:
            optim["param_groups"] = osd["param_groups"]
        elif optim["param_groups"] != osd["param_groups"]:
            raise ValueError("param_groups differ across ranks")
        if not id_to_fqn:
            for g in optim["param_groups"]:
                for fqn, pid in zip(g["param_names"], g["params"]):
                    fqn = fqn.replace("_fsdp_wrapped_module.", "")
                    fqn_to_id[fqn] = pid
                    id_to_fqn[pid] = fqn
        for pid, st in osd["state"].items():
            fqn = id_to_fqn[pid]
            piece = pieces[r].get(fqn)
            dst = optim["state"][pid]
            for k, v in st.items():
                if v.shape == torch.Size([]):
                    if k in dst:
                        if not torch.equal(dst[k], v):
                            raise ValueError(f"{k} of {fqn} differs across ranks")
                    else:
                        dst[k] = v
                else:
                    if piece is None:
                        raise ValueError(f"no flat param data for {fqn} on rank {r}")
                    shape, s, e = piece
                    if k not in dst:
                        dst[k] = torch.empty(shape, dtype=v.dtype)
                    dst[k].view(-1)[s:e + 1].copy_(v)
    for g in optim["param_groups"]:
        g["param_names"] = [n.replace("_fsdp_wrapped_module.", "") for n in g["param_names"]]
    return full, optim, id_to_fqn


def olmo_manifests(step_dir, with_optim=True):
    full, optim, id_to_fqn = olmo_unshard(step_dir, with_optim)
    man = Manifest("olmo_local_sharded")
    for k, v in full.items():
        man.add_tensor(k, v)
    if not with_optim:
        return man, None
    om = Manifest("olmo_local_sharded_optim")
    for pid in sorted(optim["state"]):
        fqn = id_to_fqn[pid]
        for k in ("exp_avg", "exp_avg_sq", "step"):
            om.add_tensor(f"optim.state.{fqn}.{k}", optim["state"][pid][k])
    for i, g in enumerate(optim["param_groups"]):
        om.add_value(f"optim.param_groups.{i}.params", g["param_names"])
        for k, v in g.items():
            if k not in ("params", "param_names"):
                om.add_value(f"optim.param_groups.{i}.{k}", v)
    return man, om
