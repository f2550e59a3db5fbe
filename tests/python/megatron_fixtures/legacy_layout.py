"""Writes Megatron-LM legacy ("torch" format) checkpoints from a trained full model.

Follows, function by function (citations: tests/python/layouts/megatron.md):
  megatron/training/checkpointing.py       get_checkpoint_name, generate_state_dict, save_checkpoint,
                                           get_rng_state, the tracker file
  megatron/legacy/model/gpt_model.py       state_dict_for_save_checkpoint (language_model,
                                           word_embeddings_for_head)
  megatron/legacy/model/language_model.py  embedding / encoder / output_layer keys
  megatron/legacy/model/transformer.py     layer offsets for PP and virtual PP
  tools/checkpoint/saver_megatron.py       the TP partition of every tensor
  megatron/core/optimizer/*.py             param groups, Float16 / FP32 / distributed optimizer
                                           state dicts, distrib_optim.pt (dp_zero gather)
  megatron/core/distributed/param_and_grad_buffer.py   the grad buffer layout behind distrib_optim.pt

This module is the *writer*.  ``megatron_ref.py`` reads the files back without importing it.
"""
import argparse
import dataclasses
import math
import os
import random
from collections import OrderedDict
from typing import Optional

import numpy as np
import torch

from . import model as M
from . import standins
from . import torchsave


@dataclasses.dataclass(frozen=True)
class Era:
    name: str
    encoder: str          # key of the transformer inside language_model
    attention: str        # self_attention | attention
    input_norm: str
    post_norm: str
    final_norm: str
    extra_state: bool     # ColumnParallelLinear/RowParallelLinear emit `_extra_state: None`
    rng: str              # "list" (rng_state list) | "top" (top-level keys)
    scheduler: str        # opt_param_scheduler | lr_scheduler


ERAS = {
    # core_v0.8.0: norms renamed (2023-09), `_extra_state` None on the parallel linears (2023-12).
    "core_v0.8": Era("core_v0.8", "encoder", "self_attention", "input_norm", "post_attention_norm",
                     "final_norm", True, "list", "opt_param_scheduler"),
    # 23.06: the pre-rename norm spelling, no `_extra_state`.
    "23.06": Era("23.06", "encoder", "self_attention", "input_layernorm", "post_attention_layernorm",
                 "final_layernorm", False, "list", "opt_param_scheduler"),
    # the spellings core_v0.8.0 still loads through its backward-compatibility branches:
    # `transformer`, `.attention.`, `*_layernorm`, `lr_scheduler`, RNG keys at the top level.
    "2020": Era("2020", "transformer", "attention", "input_layernorm", "post_attention_layernorm",
                "final_layernorm", False, "top", "lr_scheduler"),
}


@dataclasses.dataclass(frozen=True)
class LegacyCase:
    name: str
    cfg: M.GPTConfig
    tp: int
    pp: int
    vpp: Optional[int]
    dtype: str                       # fp32 | fp16 | bf16
    era: str
    checkpoint_version: Optional[float]   # None: the key is absent (version 0)
    optimizer: str                   # none | plain | distributed
    dp: int = 1
    release: bool = False
    iteration: int = 10
    seed: int = 1
    enum_by_value: bool = False
    rank0_manifest: bool = True
    description: str = ""

    @property
    def torch_dtype(self):
        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.dtype]

    @property
    def qkv_version(self):
        return 0.0 if self.checkpoint_version is None else self.checkpoint_version


# --------------------------------------------------------------------------- pipeline layout
def chunks_of_stage(case, pp_rank):
    """[(pre_process, post_process, [global layer indices])] for each model chunk of a PP stage.

    megatron/legacy/model/transformer.py ParallelTransformer.__init__: without virtual PP stage p
    holds layers [p*L/pp, (p+1)*L/pp); with vpp chunks, chunk v of stage p holds L/(pp*vpp) layers
    starting at v*(L/vpp) + p*(L/(pp*vpp)).  pre_process is the first stage's first chunk,
    post_process the last stage's last chunk."""
    L, pp = case.cfg.num_layers, case.pp
    vpp = case.vpp or 1
    n = L // (pp * vpp)
    out = []
    for v in range(vpp):
        start = v * (L // vpp) + pp_rank * n
        pre = pp_rank == 0 and v == 0
        post = pp_rank == pp - 1 and v == vpp - 1
        out.append((pre, post, list(range(start, start + n))))
    return out


# --------------------------------------------------------------------------- TP partition
def _leaf(name):
    return name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]


def tp_shards(case, name, t):
    """The tensor-parallel pieces of full tensor `t` (canonical name `name`), rank order.

    tools/checkpoint/saver_megatron.py: word embeddings / output layer / QKV / dense_h_to_4h rows
    are chunked (dim 0), dense and dense_4h_to_h weights are chunked on dim 1, SwiGLU's
    dense_h_to_4h gives rank r [W_r; V_r], everything else is replicated.  QKV of
    checkpoint_version 0 / 1.0 is stored per rank as [3, np, hn] / [np, hn, 3]
    (checkpointing.py fix_query_key_value_ordering undoes it on load)."""
    cfg, tp = case.cfg, case.tp
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return [c.clone() for c in torch.chunk(t, tp, 0)]
    if ".query_key_value." in name:
        ng, per, hn = cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups, cfg.kv_channels
        rest = tuple(t.shape[1:])
        grouped = t.reshape((ng, per + 2, hn) + rest)
        out = []
        for piece in torch.chunk(grouped, tp, 0):
            if case.qkv_version < 2.0:
                assert per == 1, "checkpoint_version < 2 predates grouped-query attention"
                x = piece.reshape((-1, 3, hn) + rest)                  # [np_r, 3, hn, ...]
                if case.qkv_version == 0:
                    x = x.transpose(0, 1)                               # [3, np_r, hn, ...]
                else:
                    x = x.transpose(1, 2)                               # [np_r, hn, 3, ...]
                piece = x
            out.append(piece.contiguous().reshape((-1,) + rest).clone())
        return out
    if name.endswith("self_attention.dense.weight") or name.endswith("mlp.dense_4h_to_h.weight"):
        return [c.contiguous().clone() for c in torch.chunk(t, tp, 1)]
    if ".mlp.dense_h_to_4h." in name:
        if cfg.swiglu:
            w, v = torch.chunk(t, 2, 0)
            return [torch.cat([a, b], 0).clone() for a, b in zip(torch.chunk(w, tp, 0), torch.chunk(v, tp, 0))]
        return [c.clone() for c in torch.chunk(t, tp, 0)]
    return [t.clone() for _ in range(tp)]


# --------------------------------------------------------------------------- modules
class _Module(torch.nn.Module):
    pass


class _ParallelLinear(torch.nn.Module):
    """megatron/core/tensor_parallel/layers.py Column/RowParallelLinear since 2023-12: `_extra_state`
    is None."""

    def get_extra_state(self):
        return None

    def set_extra_state(self, state):
        pass


def _child(root, path, cls=_Module):
    mod = root
    for part in path.split("."):
        if not hasattr(mod, part) or getattr(mod, part) is None:
            setattr(mod, part, cls() if part == path.split(".")[-1] else _Module())
        mod = getattr(mod, part)
    return mod


def _with_params(mod, tensors):
    for k, t in tensors.items():
        mod.register_parameter(k, torch.nn.Parameter(t, requires_grad=t.is_floating_point()))
    return mod


def _era_layer_path(era, leaf_path):
    """Canonical path inside a layer (input_norm.weight, self_attention.dense.bias, ...) -> era's."""
    head, _, tail = leaf_path.partition(".")
    if head == "input_norm":
        head = era.input_norm
    elif head == "post_attention_norm":
        head = era.post_norm
    elif head == "self_attention":
        head = era.attention
    return head + "." + tail


# --------------------------------------------------------------------------- one rank's model
def chunk_param_order(case, pre, post, layers):
    """(canonical name, role) of a chunk's parameters in module registration order.
    role "head" is the last stage's copy of a tied word embedding (word_embeddings_for_head)."""
    cfg = case.cfg
    names = []
    if pre:
        names.append((f"{M.LM}.embedding.word_embeddings.weight", "param"))
        if cfg.position_embedding_type == "learned_absolute":
            names.append((f"{M.LM}.embedding.position_embeddings.weight", "param"))
    for i in layers:
        names += [(n, "param") for n in M.layer_param_names(cfg, i)]
    if post:
        names.append((f"{M.ENC}.final_norm.weight", "param"))
        if cfg.norm_has_bias:
            names.append((f"{M.ENC}.final_norm.bias", "param"))
        if cfg.untie_embeddings_and_output_weights:
            names.append((f"{M.LM}.output_layer.weight", "param"))
        elif not pre:
            names.append((f"{M.LM}.embedding.word_embeddings.weight", "head"))
    return names


def chunk_state_dict(case, shards, tp_rank, pre, post, layers):
    """state_dict_for_save_checkpoint() of one model chunk: plain dicts at the GPTModel /
    TransformerLanguageModel / Embedding levels, module.state_dict() OrderedDicts (with _metadata)
    below them."""
    era, cfg = ERAS[case.era], case.cfg
    lin_cls = _ParallelLinear if era.extra_state else _Module
    get = lambda n: shards[n][tp_rank]
    lm = {}
    if pre:
        emb = {}
        emb["word_embeddings"] = _with_params(_Module(), {
            "weight": get(f"{M.LM}.embedding.word_embeddings.weight")}).state_dict()
        if cfg.position_embedding_type == "learned_absolute":
            emb["position_embeddings"] = _with_params(_Module(), {
                "weight": get(f"{M.LM}.embedding.position_embeddings.weight")}).state_dict()
        lm["embedding"] = emb
    enc = _Module()
    enc.layers = torch.nn.ModuleList()
    for local, i in enumerate(layers):
        layer = _Module()
        enc.layers.append(layer)
        prefix = f"{M.ENC}.layers.{i}."
        for n in M.layer_param_names(cfg, i):
            path = _era_layer_path(era, n[len(prefix):])
            mod_path, _, pname = path.rpartition(".")
            is_linear = mod_path.endswith(("query_key_value", ".dense", "dense_h_to_4h", "dense_4h_to_h"))
            mod = _child(layer, mod_path, lin_cls if is_linear else _Module)
            _with_params(mod, {pname: get(n)})
    if post:
        fn = _child(enc, era.final_norm)
        _with_params(fn, {"weight": get(f"{M.ENC}.final_norm.weight")})
        if cfg.norm_has_bias:
            _with_params(fn, {"bias": get(f"{M.ENC}.final_norm.bias")})
    lm[era.encoder] = enc.state_dict()
    if post and cfg.untie_embeddings_and_output_weights:
        lm["output_layer"] = _with_params(lin_cls(), {"weight": get(f"{M.LM}.output_layer.weight")}).state_dict()
    sd = {"language_model": lm}
    if post and not pre and not cfg.untie_embeddings_and_output_weights:
        sd["word_embeddings_for_head"] = _with_params(_Module(), {
            "weight": get(f"{M.LM}.embedding.word_embeddings.weight").clone()}).state_dict()
    return sd


# --------------------------------------------------------------------------- args
def make_args(case, tp_rank, pp_rank):
    cfg, era = case.cfg, ERAS[case.era]
    a = argparse.Namespace()
    d = a.__dict__
    d["num_layers"] = cfg.num_layers
    if era.name != "2020":
        d["encoder_num_layers"] = cfg.num_layers
    d["hidden_size"] = cfg.hidden_size
    d["ffn_hidden_size"] = cfg.ffn_hidden_size
    d["num_attention_heads"] = cfg.num_attention_heads
    d["kv_channels"] = cfg.kv_channels
    if era.name != "2020":
        d["group_query_attention"] = cfg.group_query_attention
        d["num_query_groups"] = cfg.num_query_groups if cfg.group_query_attention else 1
        d["position_embedding_type"] = cfg.position_embedding_type
        d["add_position_embedding"] = cfg.position_embedding_type == "learned_absolute"
        d["use_rotary_position_embeddings"] = cfg.position_embedding_type == "rope"
        d["rotary_percent"] = 1.0
        d["normalization"] = cfg.normalization
        d["apply_layernorm_1p"] = False
        d["swiglu"] = cfg.swiglu
        d["add_bias_linear"] = cfg.add_bias_linear
        d["add_qkv_bias"] = cfg.add_qkv_bias
        d["untie_embeddings_and_output_weights"] = cfg.untie_embeddings_and_output_weights
    d["max_position_embeddings"] = cfg.max_position_embeddings
    d["seq_length"] = cfg.seq_length
    d["make_vocab_size_divisible_by"] = cfg.make_vocab_size_divisible_by
    d["padded_vocab_size"] = cfg.padded_vocab_size(case.tp)
    d["tokenizer_type"] = "GPT2BPETokenizer"
    if era.name == "2020":
        d["model_parallel_size"] = case.tp
    else:
        d["tensor_model_parallel_size"] = case.tp
        d["pipeline_model_parallel_size"] = case.pp
        d["virtual_pipeline_model_parallel_size"] = case.vpp
        d["num_layers_per_virtual_pipeline_stage"] = (
            cfg.num_layers // (case.pp * case.vpp) if case.vpp else None)
        d["data_parallel_size"] = case.dp
    d["world_size"] = case.tp * case.pp * case.dp
    d["rank"] = tp_rank + case.tp * case.dp * pp_rank
    d["local_rank"] = d["rank"] % 8
    d["fp16"] = case.dtype == "fp16"
    d["bf16"] = case.dtype == "bf16"
    d["params_dtype"] = case.torch_dtype
    if era.name != "2020":
        d["use_distributed_optimizer"] = case.optimizer == "distributed"
        d["accumulate_allreduce_grads_in_fp32"] = case.dtype == "bf16"
        d["overlap_grad_reduce"] = False
        d["ddp_bucket_size"] = None
        d["model_type"] = standins.ModelType.encoder_or_decoder
        d["transformer_impl"] = "local"
    if era.name == "core_v0.8":
        d["use_legacy_models"] = True
        d["ckpt_format"] = "torch"
        d["use_dist_ckpt"] = False
    d["optimizer"] = "adam"
    d["lr"] = 1e-2
    d["min_lr"] = 1e-3
    d["weight_decay"] = 0.1
    d["adam_beta1"] = 0.9
    d["adam_beta2"] = 0.95
    d["adam_eps"] = 1e-8
    d["micro_batch_size"] = 1
    d["global_batch_size"] = case.dp
    d["train_iters"] = 100
    d["seed"] = 1234
    d["no_save_optim"] = None if case.optimizer != "none" else True
    d["no_save_rng"] = None
    d["save"] = "/checkpoints/" + case.name
    d["load"] = None
    d["consumed_train_samples"] = case.iteration * case.dp
    d["consumed_valid_samples"] = 0
    return a


# --------------------------------------------------------------------------- RNG
def rng_state(case, tp_rank, pp_rank):
    """get_rng_state(): python, numpy, torch CPU, CUDA and the model-parallel tracker states."""
    seed = 1000 * case.seed + 10 * pp_rank + tp_rank
    py = random.Random(seed)
    for _ in range(3):
        py.random()
    npr = np.random.RandomState(seed)
    npr.standard_normal(3)      # has_gauss = 1 with a cached value
    g = torch.Generator().manual_seed(seed)
    torch.rand(3, generator=g)
    cuda = torch.tensor(list(np.frombuffer(np.array([1234 + case.seed, 4 * case.iteration], dtype="<i8").tobytes(),
                                           dtype=np.uint8)), dtype=torch.uint8)
    tracker = torch.tensor(list(np.frombuffer(np.array([1234 + 2718 + tp_rank, 4 * case.iteration],
                                                       dtype="<i8").tobytes(), dtype=np.uint8)), dtype=torch.uint8)
    return OrderedDict([
        ("random_rng_state", py.getstate()),
        ("np_rng_state", npr.get_state()),
        ("torch_rng_state", g.get_state()),
        ("cuda_rng_state", cuda),
        ("rng_tracker_states", {"model-parallel-rng": tracker}),
    ])


# --------------------------------------------------------------------------- optimizer
def _group_key(name, shape):
    # (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) of megatron/core/optimizer/__init__.py
    return (0.0 if M.no_weight_decay(name, shape) else 1.0, 1.0, False, False)


def rank_param_list(case, pp_rank):
    """[(canonical name, role)] over the rank's chunks, in named_parameters order."""
    out = []
    for pre, post, layers in chunks_of_stage(case, pp_rank):
        out += chunk_param_order(case, pre, post, layers)
    return out


def _torch_optimizer_state(case, trained, pp_rank, tp_rank, masters):
    """A real torch AdamW state dict for this rank, the way Megatron builds its param groups
    (_get_param_groups, _update_min_and_max_lr_in_param_groups; the scheduler then sets
    lr and weight_decay = weight_decay * wd_mult)."""
    params = rank_param_list(case, pp_rank)
    groups, order = OrderedDict(), []
    for name, role in params:
        key = _group_key(name, trained.params[name].shape)
        groups.setdefault(key, []).append((name, role))
    tparams = {}
    torch_groups = []
    for (wd_mult, lr_mult, ep, dec), members in groups.items():
        plist = []
        for name, role in members:
            p = torch.nn.Parameter(masters[(name, role)])
            tparams[(name, role)] = p
            plist.append(p)
        torch_groups.append({"params": plist, "wd_mult": wd_mult, "lr_mult": lr_mult,
                             "is_expert_parallel": ep, "is_decoupled_lr": dec,
                             "max_lr": trained.hyper["lr"], "min_lr": 1e-3})
    h = trained.hyper
    opt = torch.optim.AdamW(torch_groups, lr=h["lr"], betas=h["betas"], eps=h["eps"], weight_decay=h["weight_decay"])
    for g in opt.param_groups:
        g["weight_decay"] = h["weight_decay"] * g["wd_mult"]
    for (name, role), p in tparams.items():
        opt.state[p] = OrderedDict([
            ("step", trained.step[name].clone()),
            ("exp_avg", tp_shards(case, name, trained.exp_avg[name])[tp_rank]),
            ("exp_avg_sq", tp_shards(case, name, trained.exp_avg_sq[name])[tp_rank]),
        ])
    return opt.state_dict(), [[tparams[m] for m in members] for members in groups.values()]


def optimizer_state(case, trained, pp_rank, tp_rank):
    masters = {}
    for name, role in rank_param_list(case, pp_rank):
        masters[(name, role)] = tp_shards(case, name, trained.params[name])[tp_rank]
    inner, groups = _torch_optimizer_state(case, trained, pp_rank, tp_rank, masters)
    if case.optimizer == "distributed":
        # DistributedOptimizer.state_dict(): param_groups without "params", no "state".
        sd = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
        for g in sd["optimizer"]["param_groups"]:
            del g["params"]
        if case.dtype == "fp16":
            sd["grad_scaler"] = _grad_scaler()
        return sd
    if case.dtype == "fp32":
        return inner                                   # FP32Optimizer.state_dict()
    sd = {"optimizer": inner}                          # Float16OptimizerWithFloat16Params.state_dict()
    if case.dtype == "fp16":
        sd["grad_scaler"] = _grad_scaler()
    sd["fp32_from_fp16_params"] = [[p.detach() for p in g] for g in groups]
    return sd


def _grad_scaler():
    # DynamicGradScaler.state_dict(): the scale is a CUDA float tensor, the trackers are ints.
    return {"scale": torch.tensor([65536.0]), "growth_tracker": 2, "hysteresis_tracker": 2}


def buffer_layout(params, dp, bucket_size=None):
    """ParamAndGradBuffer layout (core_v0.8.0 .. core_v0.15.0) with the distributed optimizer.

    params: [(key, numel, shared_embedding)] in named_parameters order.  Parameters are placed in
    reverse order, each start padded to a multiple of 64; a shared embedding gets a bucket of its
    own; every bucket end is padded to lcm(dp, 128).  Returns
    [{"start", "end", "numel_unpadded", "params": [(key, start, end)]}] with absolute offsets."""
    pad = lambda x, d: int(math.ceil(x / d) * d)
    buckets = []
    cur = {"start": 0, "params": []}
    idx = 0

    def close(end):
        nonlocal cur
        cur["numel_unpadded"] = end - cur["start"]
        cur["end"] = pad(end, math.lcm(dp, 128))
        buckets.append(cur)
        cur = {"start": cur["end"], "params": []}
        return buckets[-1]["end"]

    for key, numel, shared in reversed(params):
        idx = pad(idx, 64)
        if shared and cur["params"]:
            idx = close(idx)   # data_start_index is already 64-aligned and dp-divisible here
        end = idx + numel
        cur["params"].append((key, idx, end))
        if (bucket_size is not None and end - cur["start"] >= bucket_size) or shared:
            end = close(end)
        idx = end
    if cur["params"]:
        close(idx)
    return buckets


def distrib_optim_state(case, trained, pp_rank, tp_rank):
    """DistributedOptimizer.get_parameter_state_dp_zero() as saved by save_parameter_state:
    {"buckets_coalesced": True, gbuf_idx: {(param_dtype, grad_dtype): {"param", "exp_avg",
    "exp_avg_sq", "numel_unpadded"}}}, one gbuf per model chunk (single dtype)."""
    cfg = case.cfg
    state = {"buckets_coalesced": True}
    grad_dtype = torch.float32 if case.dtype == "bf16" else case.torch_dtype
    tied_pp = (not cfg.untie_embeddings_and_output_weights) and case.pp > 1
    for gbuf_idx, (pre, post, layers) in enumerate(chunks_of_stage(case, pp_rank)):
        plist = []
        for name, role in chunk_param_order(case, pre, post, layers):
            numel = tp_shards(case, name, trained.params[name])[tp_rank].numel()
            shared = tied_pp and name.endswith("word_embeddings.weight") and (role == "head" or (pre and not post))
            plist.append(((name, role), numel, shared))
        buckets = buffer_layout(plist, case.dp)
        total = sum(b["numel_unpadded"] for b in buckets)
        world = {k: torch.zeros(total, dtype=torch.float32) for k in ("param", "exp_avg", "exp_avg_sq")}
        off = 0
        for b in buckets:
            for (name, role), s, e in b["params"]:
                o = off + s - b["start"]
                src = {"param": trained.params, "exp_avg": trained.exp_avg, "exp_avg_sq": trained.exp_avg_sq}
                for k in world:
                    world[k][o:o + (e - s)] = tp_shards(case, name, src[k][name])[tp_rank].reshape(-1)
            off += b["numel_unpadded"]
        entry = dict(world)
        entry["numel_unpadded"] = total
        state[gbuf_idx] = {(case.torch_dtype, grad_dtype): entry}
    return state


# --------------------------------------------------------------------------- scheduler
def scheduler_state(case):
    if ERAS[case.era].scheduler == "lr_scheduler":
        return {"max_lr": 1e-2, "warmup_steps": 2, "num_steps": case.iteration * case.dp,
                "decay_style": "cosine", "decay_steps": 100, "min_lr": 1e-3}
    return {"max_lr": 1e-2, "lr_warmup_steps": 2, "num_steps": case.iteration * case.dp,
            "lr_decay_style": "cosine", "lr_decay_steps": 100, "min_lr": 1e-3, "start_wd": 0.1,
            "end_wd": 0.1, "wd_incr_style": "constant", "wd_incr_steps": 100}


# --------------------------------------------------------------------------- files
def rank_dir_name(case, tp_rank, pp_rank):
    """get_checkpoint_name: mp_rank_TT without pipeline parallelism, mp_rank_TT_PPP with it."""
    if case.pp == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def iter_dir_name(case):
    return "release" if case.release else f"iter_{case.iteration:07d}"


def write_case(case, trained, outdir):
    """Write the checkpoint directory OUTDIR/<case.name>; returns the written relative paths."""
    standins.install()
    standins.enum_by_value(case.enum_by_value)
    era = ERAS[case.era]
    root = os.path.join(outdir, case.name)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release" if case.release else str(case.iteration))
    files = ["latest_checkpointed_iteration.txt"]
    model = trained.model(case.torch_dtype)
    shards = {n: tp_shards(case, n, t) for n, t in model.items()}
    for pp_rank in range(case.pp):
        for tp_rank in range(case.tp):
            sd = {}
            args = make_args(case, tp_rank, pp_rank)
            sd["args"] = args
            if case.checkpoint_version is not None:
                sd["checkpoint_version"] = case.checkpoint_version
            sd["iteration"] = case.iteration
            chunks = chunks_of_stage(case, pp_rank)
            if len(chunks) == 1:
                sd["model"] = chunk_state_dict(case, shards, tp_rank, *chunks[0])
            else:
                for i, ch in enumerate(chunks):
                    sd[f"model{i}"] = chunk_state_dict(case, shards, tp_rank, *ch)
            if case.optimizer != "none":
                sd["optimizer"] = optimizer_state(case, trained, pp_rank, tp_rank)
                sd[era.scheduler] = scheduler_state(case)
            rng = rng_state(case, tp_rank, pp_rank)
            cpu = [rng["torch_rng_state"], rng["cuda_rng_state"], rng["rng_tracker_states"]["model-parallel-rng"]]
            if era.rng == "list":
                sd["rng_state"] = [rng]
            else:
                sd.update(rng)
            if era.name == "core_v0.8":
                sd["num_floating_point_operations_so_far"] = 1.5e9 * case.iteration
            rel = os.path.join(iter_dir_name(case), rank_dir_name(case, tp_rank, pp_rank))
            os.makedirs(os.path.join(root, rel), exist_ok=True)
            local = f"cuda:{args.local_rank}"
            torchsave.save(sd, os.path.join(root, rel, "model_optim_rng.pt"), cuda=local, cpu_tensors=cpu)
            files.append(os.path.join(rel, "model_optim_rng.pt"))
            if case.optimizer == "distributed":
                dist = distrib_optim_state(case, trained, pp_rank, tp_rank)
                torchsave.save(dist, os.path.join(root, rel, "distrib_optim.pt"))
                files.append(os.path.join(rel, "distrib_optim.pt"))
    standins.enum_by_value(False)
    return files
