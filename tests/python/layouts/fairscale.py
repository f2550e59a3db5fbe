"""Reference consolidation of fairscale FSDP sharded checkpoints as fairseq and metaseq save them
(see layouts/fairscale.md).

find_shards(path)        the rank files: <stem>-shard0.pt .. <stem>-shard{W-1}.pt
consolidate_weights(sds) fairscale's consolidate_shard_weights rule (both metadata schemas), with the
                         tied names of EVERY unit restored (fairscale restores only the last unit's,
                         and takes its paths without the unit's prefix) -> ({name: tensor}, aliases)
consolidate_optim(sds)   the last_optimizer_state of every rank merged into one state per parameter
                         name: padding removed per rank, flat moments concatenated and split like the
                         weights, non-tensor and 0-dim state checked equal on every rank.
Every rank's padding is checked against FSDP's torch.chunk rule; shapes, names and numels must be the
same on every rank. Only torch.load is used; nothing is imported from the generators.
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from layouts._raw import raw_from_torch  # noqa: E402

SHARD_RE = re.compile(r"^(?P<stem>.*)-shard(?P<rank>\d+)\.pt$")


class FairscaleFormatError(Exception):
    def __init__(self, rule, detail):
        super().__init__(f"{rule}: {detail}")
        self.rule = rule


# --------------------------------------------------------------------------- discovery
def find_shards(path):
    """A folder with exactly one <stem>-shard{r}.pt family, any one of its files, or the stem itself
    (e.g. checkpoint_last-model_part-0 or checkpoint_last.pt) -> the files in rank order."""
    if os.path.isdir(path):
        d, stems = path, {}
        for fn in os.listdir(d):
            m = SHARD_RE.match(fn)
            if m and not re.search(r"rank-\d+", fn):
                stems.setdefault(m.group("stem"), []).append(fn)
        if len(stems) != 1:
            raise FairscaleFormatError("NotFound" if not stems else "Ambiguous",
                                       f"{d}: shard families {sorted(stems)}")
        stem = next(iter(stems))
    else:
        d, fn = os.path.split(path)
        m = SHARD_RE.match(fn)
        stem = m.group("stem") if m else (fn[:-3] if fn.endswith(".pt") else fn)
    files, r = [], 0
    while os.path.isfile(os.path.join(d, f"{stem}-shard{r}.pt")):
        files.append(os.path.join(d, f"{stem}-shard{r}.pt"))
        r += 1
    if not files:
        raise FairscaleFormatError("NotFound", f"no {stem}-shard0.pt in {d}")
    extra = [fn for fn in os.listdir(d) if (m := SHARD_RE.match(fn)) and m.group("stem") == stem
             and int(m.group("rank")) >= r]
    if extra:
        raise FairscaleFormatError("MissingRank", f"{stem}-shard{r}.pt is missing but {sorted(extra)} exist")
    return files


def load_shards(files):
    import torch
    return [torch.load(f, map_location="cpu") for f in files]


def metadata_of(sd):
    for k in ("shard_metadata", "fsdp_metadata"):
        if k in sd:
            return sd[k]
    raise FairscaleFormatError("NoMetadata", "neither shard_metadata (metaseq) nor fsdp_metadata (fairseq)")


# --------------------------------------------------------------------------- metadata
def backing_params(meta, flat_key):
    """[(unit index, fsdp_path, state-dict key, backing name, names, shapes, numels, padding, no_broadcast)]
    in metadata order, for either schema."""
    out = []
    for ui, unit in enumerate(meta["param_metadata"]):
        path = unit["fsdp_path"]
        nob = bool(unit.get("no_broadcast_optim_state", False))
        if "params" in unit:  # fairscale >= 0.3.9
            for bname, v in unit["params"].items():
                names, shapes, numels, padding = (v["names"], v["shapes"], v["numels"], v["padding"])
                out.append((ui, path, _join(path, bname), bname, list(names), [list(s) for s in shapes],
                            list(numels), int(padding), nob))
        elif unit.get("is_flat"):  # fairscale 0.3.7 / 0.3.8
            if unit["param_names"]:
                out.append((ui, path, _join(path, flat_key), flat_key, list(unit["param_names"]),
                            [list(s) for s in unit["param_shapes"]], list(unit["param_numels"]),
                            int(unit["num_padded"][0]), nob))
        else:
            for i, n in enumerate(unit["param_names"]):
                out.append((ui, path, _join(path, n), n, [n], [list(unit["param_shapes"][i])],
                            [int(unit["param_numels"][i])], int(unit["num_padded"][i]), nob))
    return out


def _join(path, name):
    return f"{path}.{name}" if path else name


def _flat_key(models, meta):
    """0.3.7 stores the flat parameter as 'flat_param', 0.3.8 as 'flat_param_0'."""
    if any("params" in u for u in meta["param_metadata"]):
        return "flat_param_0"
    root_keys = set(models[0])
    for u in meta["param_metadata"]:
        if u.get("is_flat") and u["param_names"]:
            p = u["fsdp_path"]
            if _join(p, "flat_param") in root_keys:
                return "flat_param"
            return "flat_param_0"
    return "flat_param_0"


def chunk_rule(total, world, rank):
    """(shard length, padding) FSDP's _get_shard gives rank `rank` of a `total`-element tensor."""
    size = -(-total // world) if total else 0
    have = max(0, min(size, total - rank * size))
    return size, size - have


def _check_structure(metas, W):
    ref = [(b[1], b[3], b[4], b[5], b[6], b[8]) for b in metas[0]]
    for r, m in enumerate(metas):
        got = [(b[1], b[3], b[4], b[5], b[6], b[8]) for b in m]
        if got != ref:
            raise FairscaleFormatError("RanksDiffer", f"rank {r}: units / names / shapes differ from rank 0's")


def _gather(sds, per_rank_meta, bi, get_tensor, what):
    """Unpadded concatenation of backing parameter bi over the ranks (rank 0 only for experts)."""
    W = len(sds)
    b0 = per_rank_meta[0][bi]
    total = sum(b0[6])
    nob = b0[8]
    pieces = []
    for r in range(1 if nob else W):
        t = get_tensor(r)
        pad = per_rank_meta[r][bi][7]
        if t.dim() != 1:
            raise FairscaleFormatError("NotFlat", f"{what} rank {r}: {list(t.shape)} is not 1-D")
        want_len, want_pad = (total, 0) if nob else chunk_rule(total, W, r)
        if t.numel() != want_len or pad != want_pad:
            raise FairscaleFormatError("PaddingRule", f"{what} rank {r}: {t.numel()} elements with padding {pad}, "
                                                      f"FSDP gives {want_len} with padding {want_pad}")
        pieces.append(t[:t.numel() - pad] if pad > 0 else t)
    import torch
    full = torch.cat(pieces) if pieces else None
    if full is None or full.numel() != total:
        raise FairscaleFormatError("NumelMismatch", f"{what}: {0 if full is None else full.numel()} != {total}")
    return full


def _split(full, names, shapes, numels, prefix):
    out = []
    for n, t, s in zip(names, full.split(numels), shapes):
        out.append((_join(prefix, n), t.reshape(s)))
    return out


# --------------------------------------------------------------------------- weights
def consolidate_weights(sds, ties="all"):
    """-> ({name: RawTensor}, {alias: name}). ties="fairscale" mimics fairscale's own output."""
    metas = [metadata_of(sd) for sd in sds]
    models = [sd["model"] for sd in sds]
    flat_key = _flat_key(models, metas[0])
    per_rank = [backing_params(m, flat_key) for m in metas]
    _check_structure(per_rank, len(sds))
    out, aliases = {}, {}
    for bi, b in enumerate(per_rank[0]):
        _ui, path, key, _bname, names, shapes, numels, _pad, _nob = b

        def get(r, key=key):
            if key not in models[r]:
                raise FairscaleFormatError("MissingKey", f"rank {r}: {key} not in model")
            return models[r][key]
        full = _gather(sds, per_rank, bi, get, key)
        for name, t in _split(full, names, shapes, numels, path):
            if name in out:
                raise FairscaleFormatError("DuplicateName", name)
            out[name] = raw_from_torch(t.contiguous())
    units = metas[0]["param_metadata"]
    tie_units = units if ties == "all" else units[-1:]
    for unit in tie_units:
        for src, dst in unit.get("shared_param_info", []):
            if ties == "all":
                src, dst = _join(unit["fsdp_path"], src), _join(unit["fsdp_path"], dst)
            if src not in out:
                raise FairscaleFormatError("BadTie", f"shared source {src} is not a consolidated parameter")
            out[dst] = out[src]
            aliases[dst] = src
    for bname in metas[0].get("buffer_names", []):
        if bname not in models[0]:
            raise FairscaleFormatError("MissingBuffer", f"{bname} not in rank 0's model")
        out[bname] = raw_from_torch(models[0][bname])
    return out, aliases


# --------------------------------------------------------------------------- optimizer
def consolidate_optim(sds):
    """-> {"state": {name: {...}}, "param_groups": [...], <other last_optimizer_state keys>}."""
    import torch
    metas = [metadata_of(sd) for sd in sds]
    flat_key = _flat_key([sd["model"] for sd in sds], metas[0])
    per_rank = [backing_params(m, flat_key) for m in metas]
    _check_structure(per_rank, len(sds))
    osds = []
    for r, sd in enumerate(sds):
        o = sd.get("last_optimizer_state")
        if not isinstance(o, dict) or "state" not in o or "param_groups" not in o:
            raise FairscaleFormatError("NoOptimizer", f"rank {r}: no last_optimizer_state with state and param_groups")
        osds.append(o)
    for r, o in enumerate(osds[1:], 1):
        if _plain(o["param_groups"]) != _plain(osds[0]["param_groups"]):
            raise FairscaleFormatError("ParamGroupsDiffer", f"rank {r}'s param_groups differ from rank 0's")
        for k in o:
            if k not in ("state", "param_groups") and _plain(o[k]) != _plain(osds[0].get(k)):
                raise FairscaleFormatError("OptimizerKeyDiffers", f"rank {r}: {k} differs from rank 0's")
    backing = per_rank[0]
    ids = sorted(i for g in osds[0]["param_groups"] for i in g["params"])
    if ids != list(range(len(backing))):
        raise FairscaleFormatError("ParamCount", f"optimizer ids {ids} but {len(backing)} backing parameters")
    names_of = {}
    state = {}
    for bi, b in enumerate(backing):
        _ui, path, key, _bname, names, shapes, numels, _pad, nob = b
        names_of[bi] = [_join(path, n) for n in names]
        st0 = osds[0]["state"].get(bi)
        if st0 is None:
            continue
        merged = {n: {} for n in names_of[bi]}
        for skey, v0 in st0.items():
            if torch.is_tensor(v0) and v0.dim() > 0:
                full = _gather(sds, per_rank, bi, lambda r, skey=skey: osds[r]["state"][bi][skey], f"{key} {skey}")
                for name, t in _split(full, names, shapes, numels, path):
                    merged[name][skey] = raw_from_torch(t.contiguous())
            else:
                for r in range(1, 1 if nob else len(sds)):
                    vr = osds[r]["state"][bi].get(skey)
                    same = torch.equal(vr, v0) if torch.is_tensor(v0) else _plain(vr) == _plain(v0)
                    if not same:
                        raise FairscaleFormatError("StateDiffers", f"{key} {skey}: rank {r} has {vr!r}, rank 0 {v0!r}")
                for name in names_of[bi]:
                    merged[name][skey] = raw_from_torch(v0) if torch.is_tensor(v0) else v0
        state.update(merged)
    groups = []
    for g in osds[0]["param_groups"]:
        g = dict(g)
        g["params"] = [n for i in g["params"] for n in names_of[i]]
        groups.append(g)
    out = {"state": state, "param_groups": groups}
    for k, v in osds[0].items():
        if k not in ("state", "param_groups"):
            out[k] = v
    return out


def _plain(v):
    import torch
    if torch.is_tensor(v):
        return ("tensor", str(v.dtype), tuple(v.shape), v.tolist())
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v
