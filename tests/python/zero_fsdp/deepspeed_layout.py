"""Write DeepSpeed ZeRO-1/2/3 checkpoint directories as DeepSpeed's engine writes them.

Every partitioning step follows DeepSpeed's own code (deepspeedai/DeepSpeed; function named in each
comment; exact commits in docs/notes/zero-fsdp-layouts.md).  No DeepSpeed code is used or copied: the
rules are re-derived from reading it and applied to a model trained with a real torch AdamW.

Directory written for one case (``<root>`` = the ``save_dir`` given to ``engine.save_checkpoint``):
  <root>/latest                                   tag, no newline (engine.save_checkpoint)
  <root>/zero_to_fp32.py                          DeepSpeed copies its recovery script here; we write a stub
  <root>/<tag>/mp_rank_00_model_states.pt         stage 1/2, dp rank 0 only (engine._get_ckpt_name)
  <root>/<tag>/zero_pp_rank_{r}_mp_rank_00_model_states.pt     stage 3, every rank
  <root>/<tag>/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt  every rank (engine._get_rank_zero_ckpt_name)
"""
import collections
import copy
import json
import math
import os

import torch

from . import model as tiny
from . import standins
from . import torchsave
from .manifest import Manifest

DS_VERSION = "0.16.4"  # label written as ds_version; the layout follows the code cited in the notes
TAG = "global_step2"
MICRO_BATCH = 2
# ZeRO-3 partitions are allocated with torch.empty (partition_parameters.py _partition_param): the
# tail of the last rank's partition is whatever memory held.  We write a recognisable non-zero value
# so that a reader which wrongly includes padding fails loudly.
Z3_PADDING_GARBAGE = 777.0


class ZeroCase:
    def __init__(self, name, stage, world_size, dtype="fp32", round_robin=False, elastic=False,
                 sub_group_size=None, save_style="legacy", enum_by_value=False, config_as_path=False):
        self.name = name
        self.stage = stage
        self.world_size = world_size
        self.dtype = dtype  # "fp32" | "fp16" | "bf16": the dtype of the model (engine._configure_distributed_model)
        self.round_robin = round_robin  # zero_optimization.round_robin_gradients (stage 1/2)
        self.elastic = elastic  # zero_optimization.elastic_checkpoint (stage 1/2 only)
        self.sub_group_size = sub_group_size  # zero_optimization.sub_group_size (stage 3)
        self.save_style = save_style  # "legacy": raw torch.save; "debloated": clone_tensors_for_torch_save
        self.enum_by_value = enum_by_value  # Python <= 3.10 pickling of ZeroStageEnum
        self.config_as_path = config_as_path  # ds_config pickled as the JSON path string the user passed

    def describe(self):
        bits = [f"stage {self.stage}", f"ws {self.world_size}", self.dtype]
        if self.round_robin:
            bits.append("round_robin_gradients")
        if self.elastic:
            bits.append("elastic_checkpoint")
        if self.sub_group_size:
            bits.append(f"sub_group_size={self.sub_group_size}")
        if self.save_style != "legacy":
            bits.append(self.save_style)
        if self.enum_by_value:
            bits.append("enum pickled by value (py<=3.10)")
        if self.config_as_path:
            bits.append("ds_config is a path string")
        return ", ".join(bits)


LOW_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def ds_config_dict(case):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": MICRO_BATCH * case.world_size,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": case.stage},
        "steps_per_print": 100,
    }
    z = cfg["zero_optimization"]
    if case.round_robin:
        z["round_robin_gradients"] = True
    if case.elastic:
        z["elastic_checkpoint"] = True
    if case.sub_group_size:
        z["sub_group_size"] = case.sub_group_size
    if case.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}
    elif case.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


# ---------------------------------------------------------------------------------------------------
# Partitioning rules
# ---------------------------------------------------------------------------------------------------

def round_robin_reorder(items, num_partitions):
    """stage_1_and_2.py DeepSpeedZeroOptimizer._round_robin_reorder: item i goes to bucket i % n;
    buckets are concatenated in first-seen order (0, 1, ..., n-1)."""
    buckets = collections.OrderedDict()
    for i, t in enumerate(items):
        buckets.setdefault(i % num_partitions, []).append(t)
    out = []
    for j in buckets:
        out.extend(buckets[j])
    return out


def align_dense(tensors, alignment):
    """runtime/utils.py align_dense_tensors + flatten: one zero tensor appended so the total numel is a
    multiple of ``alignment``."""
    flat = [t.reshape(-1) for t in tensors]
    n = sum(t.numel() for t in flat)
    rem = n % alignment
    if rem:
        flat.append(torch.zeros(alignment - rem, dtype=flat[0].dtype))
    return torch.cat(flat)


def data_parallel_partitions(flat, dp):
    """stage_1_and_2.py get_data_parallel_partitions: dp contiguous slices, the first numel % dp
    slices one element longer (never happens after align_dense to 2*dp, kept for fidelity)."""
    base, rem = divmod(flat.numel(), dp)
    parts, start = [], 0
    for i in range(dp):
        size = base + (1 if i < rem else 0)
        parts.append(flat.narrow(0, start, size))
        start += size
    return parts


def group_padding(orig_numel, partitions, rank):
    """stage_1_and_2.py __init__: padding recorded per (group, rank) in groups_padding."""
    left = sum(p.numel() for p in partitions[:rank])
    size = partitions[rank].numel()
    if orig_numel <= left:
        return size
    if orig_numel < left + size:
        return left + size - orig_numel
    return 0


def z3_partition_numel(numel, ws):
    """partition_parameters.py _aligned_size // world_size == ceil(numel / ws); _padding_size =
    (ws - numel % ws) % ws (zero_to_fp32.py zero3_partitioned_param_info computes the same)."""
    return (numel + ws - 1) // ws


def z3_partition(flat, ws, rank, garbage):
    """partition_parameters.py _partition_param: rank r holds flat[r*pn:(r+1)*pn]; elements past the
    end of the parameter are left as allocated (torch.empty)."""
    pn = z3_partition_numel(flat.numel(), ws)
    out = torch.full((pn,), garbage, dtype=flat.dtype)
    start = rank * pn
    if start < flat.numel():
        n = min(pn, flat.numel() - start)
        out[:n] = flat[start:start + n]
    return out


def z3_sub_groups(params, ws, sub_group_size):
    """stage3.py _create_fp16_sub_groups: greedy split on the sum of partition numels."""
    total = sum(z3_partition_numel(p.numel(), ws) for p in params)
    if sub_group_size is None or sub_group_size >= total:
        return [list(params)]
    groups, cur, size = [], [], 0
    for p in params:
        cur.append(p)
        size += z3_partition_numel(p.numel(), ws)
        if size >= sub_group_size or p is params[-1]:
            groups.append(cur)
            cur, size = [], 0
    return groups


# ---------------------------------------------------------------------------------------------------
# Engine-level metadata
# ---------------------------------------------------------------------------------------------------

def buffer_names(module):
    """engine._get_buffer_names: persistent buffers, own first, then children in named_children order."""
    names = []

    def walk(m, prefix):
        for n, b in m.named_buffers(recurse=False):
            if b is not None and n not in m._non_persistent_buffers_set:
                names.append(prefix + n)
        for n, c in m.named_children():
            if c is not None:
                walk(c, prefix + n + ".")

    walk(module, "")
    return names


def shared_params(module):
    """engine._get_shared_params: {alias: owner}; identity of the parameter object decides (DeepSpeed
    uses data_ptr, or ds_id under ZeRO-3)."""
    index, shared = {}, {}

    def walk(m, prefix):
        for n, p in m.named_parameters(recurse=False):
            if p is None:
                continue
            key = prefix + n
            if id(p) in index:
                shared[key] = index[id(p)]
            else:
                index[id(p)] = key
        for n, c in m.named_children():
            if c is not None:
                walk(c, prefix + n + ".")

    walk(module, "")
    return shared


def make_loss_scaler(case):
    """fp16/loss_scaler.py CreateLossScaler: DynamicLossScaler for fp16 with loss_scale 0, else
    LossScaler(1.0).  Two overflow-free steps advance cur_iter to 2 (update_scale)."""
    if case.dtype == "fp16":
        s = standins.DynamicLossScaler(init_scale=2.0 ** 16, scale_window=1000, min_scale=1, delayed_shift=2,
                                       consecutive_hysteresis=False, raise_error_at_min_scale=True,
                                       dtype=torch.float16)
        s.cur_iter = 2
        return s
    return standins.LossScaler(scale=1.0)


def group_hyperparams(group):
    return {k: v for k, v in group.items() if k != "params"}


def torch_optimizer_state_dict(groups_params, groups_hp, states):
    """A real torch.optim.AdamW.state_dict() over the given flat parameters: DeepSpeed's base optimizer
    holds the flat fp32 partitions as its params, so its state_dict has exactly this structure."""
    pg = []
    for params, hp in zip(groups_params, groups_hp):
        g = dict(hp)
        g["params"] = params
        pg.append(g)
    opt = torch.optim.AdamW(pg)
    for params_list, hp, g in zip(groups_params, groups_hp, opt.param_groups):
        g.update(hp)  # keep the recipe's betas/eps exactly
    for p, st in states:
        opt.state[p] = st
    return opt.state_dict()


# ---------------------------------------------------------------------------------------------------
# The writer
# ---------------------------------------------------------------------------------------------------

def _save(case, obj, path, rank, cpu_tensors=()):
    if case.save_style == "debloated":
        torchsave.save(torchsave.debloat(obj), path, device=None)
    else:
        torchsave.save(obj, path, device=f"cuda:{rank % 8}", cpu_tensors=cpu_tensors)


def write_case(out_root, case):
    """Train, partition and write one case.  Returns (manifest, optim_manifest)."""
    standins.install()
    standins.set_enum_pickle_style(case.enum_by_value)
    ws = case.world_size
    net = tiny.build_model()
    spec = tiny.default_group_spec(net)
    opt = tiny.train(net, spec, steps=2, batch=MICRO_BATCH * ws)
    param_names = {id(p): n for n, p in net.named_parameters()}  # engine.param_names

    # engine._configure_distributed_model: module.half() / module.bfloat16() casts params and buffers.
    low = LOW_DTYPE[case.dtype]
    lp_net = copy.deepcopy(net)
    if case.dtype == "fp16":
        lp_net.half()
    elif case.dtype == "bf16":
        lp_net.bfloat16()
    lp_params = dict(lp_net.named_parameters())

    ckpt_dir = os.path.join(out_root, TAG)
    os.makedirs(ckpt_dir, exist_ok=True)
    cfg = ds_config_dict(case)
    if case.config_as_path:
        with open(os.path.join(out_root, "ds_config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        ds_config = "ds_config.json"
    else:
        ds_config = cfg

    # Param groups as the client optimizer holds them; ZeRO keeps only trainable params.
    trainable_groups = [[p for p in g["params"] if p.requires_grad] for g in opt.param_groups]
    hps = [group_hyperparams(g) for g in opt.param_groups]
    state = {p: opt.state[p] for g in trainable_groups for p in g}
    step = next(iter(state.values()))["step"]

    if case.stage in (1, 2):
        z = _write_stage12(case, out_root, ckpt_dir, net, lp_net, trainable_groups, hps, state, param_names,
                           ds_config)
    else:
        z = _write_stage3(case, out_root, ckpt_dir, net, lp_net, trainable_groups, hps, state, param_names,
                          ds_config)

    with open(os.path.join(out_root, "latest"), "w") as f:
        f.write(TAG)  # engine.save_checkpoint: fd.write(tag), no newline
    with open(os.path.join(out_root, "zero_to_fp32.py"), "w") as f:
        f.write("# Placeholder: DeepSpeed copies its deepspeed/utils/zero_to_fp32.py recovery script here\n"
                "# (engine._copy_recovery_script).  Readers must ignore this file.\n")

    return _manifests(case, net, lp_net, opt, trainable_groups, hps, state, step, param_names, z)


def _model_states(case, lp_net, module_sd, param_shapes, frozen_shapes, frozen_frags, ds_config):
    """engine._save_checkpoint: the dict written to *_model_states.pt (key order kept)."""
    zero = True
    state = dict(
        module=module_sd,
        buffer_names=buffer_names(lp_net),
        optimizer=None,  # ZeRO: the optimizer lives in the optim_states files
        param_shapes=param_shapes,
        frozen_param_shapes=frozen_shapes,
        shared_params=shared_params(lp_net) if zero else None,
        frozen_param_fragments=frozen_frags,
        lr_scheduler=None,
        data_sampler=None,
        random_ltd=None,
        sparse_tensor_module_names=set(),
        skipped_steps=0,
        global_steps=2,
        global_samples=2 * MICRO_BATCH * case.world_size,
        dp_world_size=case.world_size,
        mp_world_size=1,
        ds_config=ds_config,
        ds_version=DS_VERSION,
    )
    state.update({"client_epoch": 0})  # client_state passed to save_checkpoint is merged at top level
    return state


def _frozen_params(net):
    """engine._get_zero_frozen_param_attributes iterates module.parameters() skipping trainable ones."""
    return [(n, p) for n, p in net.named_parameters() if not p.requires_grad]


def _write_stage12(case, out_root, ckpt_dir, net, lp_net, groups, hps, state, param_names, ds_config):
    ws = case.world_size
    align = 2 * ws  # nccl_start_alignment_factor (2) * dp world size
    per_rank_fp32 = [[] for _ in range(ws)]
    per_rank_lean = [[] for _ in range(ws)]
    per_rank_pad = [[] for _ in range(ws)]
    per_rank_moments = [[] for _ in range(ws)]
    per_rank_mappings = [[] for _ in range(ws)]
    param_shapes = []
    rr_orders = []
    for gi, params in enumerate(groups):
        rr = round_robin_reorder(params, ws) if case.round_robin else list(params)
        rr_orders.append(rr)
        # engine._get_zero_param_shapes uses round_robin_bit16_groups
        param_shapes.append(collections.OrderedDict((param_names[id(p)], p.shape) for p in rr))
        orig = sum(p.numel() for p in rr)
        flat = align_dense([p.detach() for p in rr], align)  # flatten_dense_tensors_aligned
        m1 = align_dense([state[p]["exp_avg"] for p in rr], align)
        m2 = align_dense([state[p]["exp_avg_sq"] for p in rr], align)
        parts = data_parallel_partitions(flat, ws)
        p1 = data_parallel_partitions(m1, ws)
        p2 = data_parallel_partitions(m2, ws)
        psize = flat.numel() // ws
        for r in range(ws):
            pad = group_padding(orig, parts, r)
            fp32 = parts[r].detach().clone().float()  # single_partition_of_fp32_groups[i]
            per_rank_fp32[r].append(fp32)
            per_rank_lean[r].append(fp32[:fp32.numel() - pad])  # _get_groups_without_padding: a view
            per_rank_pad[r].append(pad)
            per_rank_moments[r].append((p1[r].clone(), p2[r].clone(), state[rr[0]]["step"].clone(), pad))
            # _create_param_mapping / mixed_precision_linkage._init_lp_to_hp_mapping walk bit16_groups
            # (not the round-robin order) accumulating numel from 0.
            mapping = collections.OrderedDict()
            start, end = r * psize, (r + 1) * psize
            off = 0
            for p in params:
                lp_end = off + p.numel()
                if off < end and lp_end > start:
                    fs, fe = max(off, start), min(lp_end, end)
                    mapping[param_names[id(p)]] = standins.fragment_address(numel=fe - fs, start=fs - start)
                off = lp_end
            per_rank_mappings[r].append(mapping)

    frozen = _frozen_params(net)
    save_frozen = case.stage >= 2  # engine._save_checkpoint: zero_optimization_partition_gradients()
    frozen_shapes = collections.OrderedDict((n, p.shape) for n, p in frozen) if save_frozen else None
    lp_named = dict(lp_net.named_parameters())
    # _get_param_fragment_func: param.detach().cpu() -- the same storage as the module entry on a CPU
    # run; on a GPU run a CPU copy.  We write a CPU copy, as on GPU.
    frozen_frags = (collections.OrderedDict((n, lp_named[n].detach().clone()) for n, _ in frozen)
                    if save_frozen else None)

    module_sd = lp_net.state_dict()  # engine.module_state_dict
    # stage_1_and_2.py _update_model_bit16_weights: after flattening, every trainable parameter's data
    # is a view into its group's bit16 flat buffer (round-robin order, zero padding at the end).  A
    # plain torch.save therefore writes one storage per group holding all its params at offsets.
    lp_by_id = {id(p): lp_params_of(lp_net, param_names[id(p)]) for g in groups for p in g}
    views = {}
    for rr in rr_orders:
        if not rr:
            continue
        flat = align_dense([lp_by_id[id(p)].detach() for p in rr], align)
        off = 0
        for p in rr:
            views[param_names[id(p)]] = flat.narrow(0, off, p.numel()).view(p.shape)
            off += p.numel()
    for key in list(module_sd.keys()):
        owner = shared_params(lp_net).get(key, key)
        if owner in views:
            module_sd[key] = views[owner]
    model = _model_states(case, lp_net, module_sd, param_shapes, frozen_shapes, frozen_frags, ds_config)
    _save(case, model, os.path.join(ckpt_dir, "mp_rank_00_model_states.pt"), 0,
          cpu_tensors=list(frozen_frags.values()) if frozen_frags else ())

    prefix = "bf16_" if case.dtype == "bf16" else ""  # engine._get_zero_ckpt_prefix
    for r in range(ws):
        loss_scaler = make_loss_scaler(case)
        if case.elastic:
            # _get_base_optimizer_state: per group the state with padding cut off (views)
            base = []
            for (e1, e2, st, pad) in per_rank_moments[r]:
                base.append({"step": st, "exp_avg": e1[:e1.numel() - pad], "exp_avg_sq": e2[:e2.numel() - pad]})
        else:
            states = []
            for fp32, (e1, e2, st, pad) in zip(per_rank_fp32[r], per_rank_moments[r]):
                states.append((fp32, {"step": st, "exp_avg": e1, "exp_avg_sq": e2}))
            base = torch_optimizer_state_dict([[fp32] for fp32 in per_rank_fp32[r]], hps, states)
        osd = {}
        osd["loss_scaler"] = loss_scaler
        osd["dynamic_loss_scale"] = bool(loss_scaler.dynamic)
        osd["overflow"] = False
        osd["clip_grad"] = 0.0
        osd["base_optimizer_state"] = base
        # BASE_OPTIMIZER_STATE_STEP is written only if "step" is a param_group key (not for torch AdamW)
        osd["single_partition_of_fp32_groups"] = per_rank_lean[r]
        osd["zero_stage"] = standins.ZeroStageEnum.gradients if case.stage == 2 else \
            standins.ZeroStageEnum.optimizer_states
        osd["group_paddings"] = per_rank_pad[r]
        osd["partition_count"] = [ws for _ in groups]  # a list, one per param group
        osd["ds_version"] = DS_VERSION
        osd["param_slice_mappings"] = per_rank_mappings[r]
        zero_sd = dict(optimizer_state_dict=osd, ds_config=ds_config, ds_version=DS_VERSION)
        _save(case, zero_sd, os.path.join(ckpt_dir, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"), r)
    return {"param_shapes": param_shapes, "rr": rr_orders, "frozen_saved": save_frozen}


def _write_stage3(case, out_root, ckpt_dir, net, lp_net, groups, hps, state, param_names, ds_config):
    ws = case.world_size
    low = LOW_DTYPE[case.dtype]
    # stage3.py _get_trainable_parameter_groups + _create_fp16_sub_groups
    sub_groups, sub_group_gid = [], []
    for gi, params in enumerate(groups):
        if not params:
            continue
        for sg in z3_sub_groups(params, ws, case.sub_group_size):
            sub_groups.append(sg)
            sub_group_gid.append(gi)
    # engine._get_zero_param_shapes: stage 3 uses optimizer.fp16_groups, i.e. one dict per sub-group
    param_shapes = [collections.OrderedDict((param_names[id(p)], p.shape) for p in sg) for sg in sub_groups]

    frozen = _frozen_params(net)
    lp_named = dict(lp_net.named_parameters())
    frozen_shapes = collections.OrderedDict((n, p.shape) for n, p in frozen)  # ds_shape

    # engine.module_state_dict on a partitioned model: every parameter's data is torch.empty(0)
    # (partition_parameters.py free_param); buffers are whole.  Tied names share one empty storage.
    module_sd = lp_net.state_dict()
    empties = {}
    for n, p in _all_named(lp_net):
        e = empties.setdefault(id(p), torch.empty(0, dtype=p.dtype))
        module_sd[n] = e.detach()

    prefix = "bf16_" if case.dtype == "bf16" else ""
    for r in range(ws):
        # fp32 master partitions per sub-group (stage3.py _create_fp32_partitions)
        parts32, m1s, m2s = [], [], []
        for sg in sub_groups:
            parts32.append(torch.cat([z3_partition(p.detach().reshape(-1).float(), ws, r, Z3_PADDING_GARBAGE)
                                      for p in sg]))
            m1s.append(torch.cat([z3_partition(state[p]["exp_avg"].reshape(-1), ws, r, 0.0) for p in sg]))
            m2s.append(torch.cat([z3_partition(state[p]["exp_avg_sq"].reshape(-1), ws, r, 0.0) for p in sg]))
        if case.dtype == "fp32":
            # fp32 model: fp32_partitioned_groups_flat[i] *is* fp16_partitioned_groups_flat[i], a narrow()
            # of one defragmented buffer (stage3.py defragment / _set_fp16_partitioned_groups_flat), so
            # torch.save writes one storage and per-group offsets.
            buf = torch.cat(parts32)
            flats, off = [], 0
            for t in parts32:
                flats.append(buf.narrow(0, off, t.numel()))
                off += t.numel()
        else:
            flats = [t.clone() for t in parts32]  # .to(fp32).clone().detach()
        step = next(iter(state.values()))["step"]
        groups_params = [[] for _ in groups]
        states = []
        for f, e1, e2, gi in zip(flats, m1s, m2s, sub_group_gid):
            groups_params[gi].append(f)  # _set_fp32_optimizer_param_groups
            states.append((f, {"step": step.clone(), "exp_avg": e1, "exp_avg_sq": e2}))
        base = torch_optimizer_state_dict(groups_params, hps, states)
        osd = {}
        osd["zero_stage"] = standins.ZeroStageEnum.weights
        osd["loss_scaler"] = make_loss_scaler(case)
        osd["dynamic_loss_scale"] = bool(osd["loss_scaler"].dynamic)
        osd["overflow"] = False
        osd["partition_count"] = ws  # an int for stage 3
        osd["optimizer_state_dict"] = base
        osd["fp32_flat_groups"] = flats
        zero_sd = dict(optimizer_state_dict=osd, ds_config=ds_config, ds_version=DS_VERSION)
        _save(case, zero_sd, os.path.join(ckpt_dir, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"), r)

        # ds_tensor of each frozen param, in the model dtype, moved to CPU (_get_param_fragment_func)
        frags = collections.OrderedDict(
            (n, z3_partition(lp_named[n].detach().reshape(-1), ws, r, Z3_PADDING_GARBAGE).to(low)) for n, _ in frozen)
        model = _model_states(case, lp_net, module_sd, param_shapes, frozen_shapes, frags, ds_config)
        _save(case, model, os.path.join(ckpt_dir, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"), r,
              cpu_tensors=list(frags.values()))
    return {"param_shapes": param_shapes, "sub_groups": sub_groups, "frozen_saved": True}


def _all_named(module):
    out = []
    for mn, m in module.named_modules():
        for pn, p in m._parameters.items():
            if p is not None:
                out.append((f"{mn}.{pn}" if mn else pn, p))
    return out


def _manifests(case, net, lp_net, opt, groups, hps, state, step, param_names, z):
    """Expected zero_to_fp32 output (zero_to_fp32.py _get_fp32_state_dict_from_zero{2,3}_checkpoint):
    buffers (module entries named in buffer_names, cast with .float()), then frozen params (stage >= 2;
    kept in the model dtype: no cast), then trainable params (fp32, param_shapes order), then aliases
    from shared_params."""
    man = Manifest(f"deepspeed_zero{case.stage}")
    bnames = set(buffer_names(lp_net))
    for k, v in lp_net.state_dict().items():
        if k in bnames:
            man.add_tensor(k, v.float())
    lp_named = dict(lp_net.named_parameters())
    if z["frozen_saved"]:
        for n, _ in _frozen_params(net):
            man.add_tensor(n, lp_named[n].detach())
    named = dict(net.named_parameters())
    for shapes in z["param_shapes"]:
        for n in shapes:
            man.add_tensor(n, named[n].detach())
    for alias, owner in shared_params(lp_net).items():
        if owner in man.tensors:
            man.tensors[alias] = dict(man.tensors[owner])
            man.aliases[alias] = owner

    om = Manifest(f"deepspeed_zero{case.stage}_optim")
    for params in groups:
        for p in params:
            n = param_names[id(p)]
            st = state[p]
            om.add_tensor(f"optim.state.{n}.exp_avg", st["exp_avg"])
            om.add_tensor(f"optim.state.{n}.exp_avg_sq", st["exp_avg_sq"])
            om.add_tensor(f"optim.state.{n}.step", st["step"])
    for i, (params, hp) in enumerate(zip(groups, hps)):
        # Membership in the order the files list it (param_shapes: round-robin order for stage 1/2).
        listed = [n for shapes in z["param_shapes"] for n in shapes]
        mine = {param_names[id(p)] for p in params}
        om.add_value(f"optim.param_groups.{i}.params", [n for n in listed if n in mine])
        if not case.elastic:  # elastic files keep no param_groups
            for k, v in hp.items():
                om.add_value(f"optim.param_groups.{i}.{k}", v)
    return man, om


def lp_params_of(lp_net, name):
    return dict(lp_net.named_parameters())[name]
