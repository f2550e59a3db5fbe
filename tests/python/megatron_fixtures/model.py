"""A tiny GPT in plain PyTorch whose parameters carry Megatron-LM's legacy names, and its training.

The model is the *full* (unsharded) model: one tensor per parameter, named the way a merged legacy
Megatron checkpoint names it (``language_model.encoder.layers.<global index>...``, the norm
spelling of core_v0.8.0).  Everything else (TP/PP partitioning, old key spellings, file layout)
lives in ``legacy_layout.py`` and ``torch_dist_layout.py``.

Layout conventions of the full tensors (the ones Megatron's tools/checkpoint loader produces):
  * query_key_value: rows grouped per query group, ``[ng, np/ng + 2, hn]`` (checkpoint_version >= 2):
    for each group, its np/ng query heads, then its key head, then its value head.
  * dense_h_to_4h with SwiGLU: ``[W; V]``, the gate half W (all ffn rows) above the V half.
  * word embeddings / output layer: ``padded_vocab_size`` rows; the rows past ``true_vocab_size``
    are padding but hold trained values like any other row (real checkpoints do too).
"""
import dataclasses
import math
from collections import OrderedDict
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int          # == num_attention_heads for MHA
    ffn_hidden_size: int
    true_vocab_size: int
    make_vocab_size_divisible_by: int
    max_position_embeddings: int
    seq_length: int
    swiglu: bool
    normalization: str             # "LayerNorm" | "RMSNorm"
    add_bias_linear: bool
    add_qkv_bias: bool
    position_embedding_type: str   # "learned_absolute" | "rope"
    untie_embeddings_and_output_weights: bool

    @property
    def kv_channels(self):
        return self.hidden_size // self.num_attention_heads

    @property
    def group_query_attention(self):
        return self.num_query_groups != self.num_attention_heads

    @property
    def norm_has_bias(self):
        return self.normalization == "LayerNorm"

    @property
    def qkv_has_bias(self):
        # megatron/legacy/model/transformer.py ParallelAttention: bias=args.add_bias_linear or args.add_qkv_bias
        return self.add_bias_linear or self.add_qkv_bias

    def padded_vocab_size(self, tp):
        """megatron/training/tokenizer/tokenizer.py _vocab_size_with_padding: round up to a multiple
        of make_vocab_size_divisible_by * tensor_model_parallel_size."""
        multiple = self.make_vocab_size_divisible_by * tp
        return ((self.true_vocab_size + multiple - 1) // multiple) * multiple


GPT2_MHA = GPTConfig(
    name="gpt2_mha", num_layers=4, hidden_size=8, num_attention_heads=4, num_query_groups=4,
    ffn_hidden_size=16, true_vocab_size=37, make_vocab_size_divisible_by=4,
    max_position_embeddings=8, seq_length=8, swiglu=False, normalization="LayerNorm",
    add_bias_linear=True, add_qkv_bias=False, position_embedding_type="learned_absolute",
    untie_embeddings_and_output_weights=False)

LLAMA_GQA = GPTConfig(
    name="llama_gqa", num_layers=4, hidden_size=16, num_attention_heads=8, num_query_groups=4,
    ffn_hidden_size=24, true_vocab_size=37, make_vocab_size_divisible_by=4,
    max_position_embeddings=8, seq_length=8, swiglu=True, normalization="RMSNorm",
    add_bias_linear=False, add_qkv_bias=False, position_embedding_type="rope",
    untie_embeddings_and_output_weights=True)

# Same as LLAMA_GQA but tied (virtual pipeline case) and with a QKV bias only (Qwen style).
QWEN_GQA_TIED = dataclasses.replace(
    LLAMA_GQA, name="qwen_gqa_tied", untie_embeddings_and_output_weights=False, add_qkv_bias=True)

CONFIGS = {c.name: c for c in (GPT2_MHA, LLAMA_GQA, QWEN_GQA_TIED)}


# --------------------------------------------------------------------------- names
LM = "language_model"
ENC = f"{LM}.encoder"


def layer_param_names(cfg, i):
    """Canonical names of layer i's parameters, in module registration order
    (ParallelTransformerLayer: input_norm, self_attention.{query_key_value, dense},
    post_attention_norm, mlp.{dense_h_to_4h, dense_4h_to_h}; weight before bias)."""
    p = f"{ENC}.layers.{i}."
    names = [p + "input_norm.weight"]
    if cfg.norm_has_bias:
        names.append(p + "input_norm.bias")
    names.append(p + "self_attention.query_key_value.weight")
    if cfg.qkv_has_bias:
        names.append(p + "self_attention.query_key_value.bias")
    names.append(p + "self_attention.dense.weight")
    if cfg.add_bias_linear:
        names.append(p + "self_attention.dense.bias")
    names.append(p + "post_attention_norm.weight")
    if cfg.norm_has_bias:
        names.append(p + "post_attention_norm.bias")
    names.append(p + "mlp.dense_h_to_4h.weight")
    if cfg.add_bias_linear:
        names.append(p + "mlp.dense_h_to_4h.bias")
    names.append(p + "mlp.dense_4h_to_h.weight")
    if cfg.add_bias_linear:
        names.append(p + "mlp.dense_4h_to_h.bias")
    return names


def param_shapes(cfg, tp):
    """OrderedDict canonical name -> full shape, in the merged model's order."""
    h, hn, nq, ng = cfg.hidden_size, cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
    V = cfg.padded_vocab_size(tp)
    ffn = cfg.ffn_hidden_size
    qkv_rows = (nq + 2 * ng) * hn
    shapes = OrderedDict()
    shapes[f"{LM}.embedding.word_embeddings.weight"] = (V, h)
    if cfg.position_embedding_type == "learned_absolute":
        shapes[f"{LM}.embedding.position_embeddings.weight"] = (cfg.max_position_embeddings, h)
    for i in range(cfg.num_layers):
        for n in layer_param_names(cfg, i):
            leaf = n.split(f"layers.{i}.", 1)[1]
            shapes[n] = {
                "input_norm.weight": (h,), "input_norm.bias": (h,),
                "self_attention.query_key_value.weight": (qkv_rows, h),
                "self_attention.query_key_value.bias": (qkv_rows,),
                "self_attention.dense.weight": (h, nq * hn),
                "self_attention.dense.bias": (h,),
                "post_attention_norm.weight": (h,), "post_attention_norm.bias": (h,),
                "mlp.dense_h_to_4h.weight": ((2 if cfg.swiglu else 1) * ffn, h),
                "mlp.dense_h_to_4h.bias": ((2 if cfg.swiglu else 1) * ffn,),
                "mlp.dense_4h_to_h.weight": (h, ffn),
                "mlp.dense_4h_to_h.bias": (h,),
            }[leaf]
    shapes[f"{ENC}.final_norm.weight"] = (h,)
    if cfg.norm_has_bias:
        shapes[f"{ENC}.final_norm.bias"] = (h,)
    if cfg.untie_embeddings_and_output_weights:
        shapes[f"{LM}.output_layer.weight"] = (V, h)
    return shapes


def no_weight_decay(name, shape):
    """megatron/core/optimizer/__init__.py _get_param_groups: biases and 1-D params are not decayed."""
    return name.endswith(".bias") or len(shape) == 1


# --------------------------------------------------------------------------- forward
def _norm(cfg, x, w, b):
    if cfg.normalization == "LayerNorm":
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, 1e-5)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def _rope(x):
    # x: [s, heads, hn]; plain (non-interleaved) rotary embedding over the whole head dim.
    s, _, hn = x.shape
    half = hn // 2
    inv = 1.0 / (10000 ** (torch.arange(0, half, dtype=torch.float32) / half))
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def forward(cfg, P, tokens):
    """Logits [s, V] for one sequence, computed from the full parameter dict P."""
    g = P.__getitem__
    s = tokens.shape[0]
    x = torch.nn.functional.embedding(tokens, g(f"{LM}.embedding.word_embeddings.weight"))
    if cfg.position_embedding_type == "learned_absolute":
        x = x + g(f"{LM}.embedding.position_embeddings.weight")[:s]
    nq, ng, hn = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    per = nq // ng
    mask = torch.full((s, s), float("-inf")).triu(1)
    for i in range(cfg.num_layers):
        p = f"{ENC}.layers.{i}."
        opt = lambda n: P.get(p + n)
        y = _norm(cfg, x, g(p + "input_norm.weight"), opt("input_norm.bias"))
        qkv = torch.nn.functional.linear(y, g(p + "self_attention.query_key_value.weight"),
                                         opt("self_attention.query_key_value.bias"))
        qkv = qkv.view(s, ng, per + 2, hn)
        q = qkv[:, :, :per].reshape(s, nq, hn)
        k = qkv[:, :, per].repeat_interleave(per, dim=1)
        v = qkv[:, :, per + 1].repeat_interleave(per, dim=1)
        if cfg.position_embedding_type == "rope":
            q, k = _rope(q), _rope(k)
        att = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hn) + mask
        ctx = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(s, nq * hn)
        x = x + torch.nn.functional.linear(ctx, g(p + "self_attention.dense.weight"),
                                           opt("self_attention.dense.bias"))
        y = _norm(cfg, x, g(p + "post_attention_norm.weight"), opt("post_attention_norm.bias"))
        z = torch.nn.functional.linear(y, g(p + "mlp.dense_h_to_4h.weight"), opt("mlp.dense_h_to_4h.bias"))
        if cfg.swiglu:
            a, b = torch.chunk(z, 2, dim=-1)
            z = torch.nn.functional.silu(a) * b
        else:
            z = torch.nn.functional.gelu(z)
        x = x + torch.nn.functional.linear(z, g(p + "mlp.dense_4h_to_h.weight"), opt("mlp.dense_4h_to_h.bias"))
    x = _norm(cfg, x, g(f"{ENC}.final_norm.weight"), P.get(f"{ENC}.final_norm.bias"))
    head = P.get(f"{LM}.output_layer.weight", g(f"{LM}.embedding.word_embeddings.weight"))
    return torch.nn.functional.linear(x, head)


# --------------------------------------------------------------------------- training
@dataclasses.dataclass
class Trained:
    cfg: GPTConfig
    tp_for_padding: int
    params: "OrderedDict[str, torch.Tensor]"       # fp32 masters after training
    exp_avg: "OrderedDict[str, torch.Tensor]"
    exp_avg_sq: "OrderedDict[str, torch.Tensor]"
    step: "OrderedDict[str, torch.Tensor]"         # torch 1.13 AdamW keeps a 0-d float32 tensor
    hyper: dict                                    # lr, betas, eps, weight_decay (the decayed group's)
    steps: int

    def model(self, dtype):
        """The model as Megatron saves it: the fp32 masters cast to the model dtype."""
        return OrderedDict((n, t.to(dtype)) for n, t in self.params.items())


def train(cfg, tp_for_padding, seed, steps=2, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8):
    """Initialise the full model deterministically and run `steps` real AdamW steps on random tokens.

    AdamW is element-wise, so the moments of any TP shard are slices of these full moments; that is
    what makes a reference consolidation exact.  The padded vocabulary rows get gradients like the
    others (the softmax covers them), as in Megatron.
    """
    gen = torch.Generator().manual_seed(seed)
    shapes = param_shapes(cfg, tp_for_padding)
    params = OrderedDict()
    for n, shp in shapes.items():
        if n.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shp, generator=gen)
        else:
            t = 0.2 * torch.randn(shp, generator=gen)
        params[n] = torch.nn.Parameter(t)
    decay = [p for n, p in params.items() if not no_weight_decay(n, p.shape)]
    nodecay = [p for n, p in params.items() if no_weight_decay(n, p.shape)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": nodecay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps)
    for _ in range(steps):
        tokens = torch.randint(0, cfg.true_vocab_size, (cfg.seq_length + 1,), generator=gen)
        logits = forward(cfg, params, tokens[:-1])
        loss = torch.nn.functional.cross_entropy(logits, tokens[1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    ea, es, st = OrderedDict(), OrderedDict(), OrderedDict()
    for n, p in params.items():
        s = opt.state[p]
        ea[n] = s["exp_avg"].detach().clone()
        es[n] = s["exp_avg_sq"].detach().clone()
        st[n] = s["step"].detach().clone()
    out = OrderedDict((n, p.detach().clone()) for n, p in params.items())
    hyper = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    return Trained(cfg, tp_for_padding, out, ea, es, st, hyper, steps)
