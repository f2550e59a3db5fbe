"""The Megatron-LM legacy checkpoint cases written by gen_megatron.py."""
from . import model as M
from .legacy_layout import LegacyCase

LEGACY_CASES = [
    LegacyCase(
        "gpt2_tp1_pp1_fp32", M.GPT2_MHA, tp=1, pp=1, vpp=None, dtype="fp32", era="core_v0.8",
        checkpoint_version=3.0, optimizer="plain", seed=11,
        description="single rank (mp_rank_00), fp32: FP32Optimizer saves the torch state dict itself"),
    LegacyCase(
        "gpt2_tp2_pp2_fp16_2306", M.GPT2_MHA, tp=2, pp=2, vpp=None, dtype="fp16", era="23.06",
        checkpoint_version=3.0, optimizer="plain", seed=12, enum_by_value=True,
        description="23.06 spelling (input_layernorm ...), tied embeddings across PP "
                    "(word_embeddings_for_head), fp16 with grad_scaler and fp32_from_fp16_params, "
                    "args.model_type pickled by value (Python <= 3.10 style)"),
    LegacyCase(
        "gpt2_tp2_pp1_v0_oldkeys", M.GPT2_MHA, tp=2, pp=1, vpp=None, dtype="fp32", era="2020",
        checkpoint_version=None, optimizer="plain", seed=13,
        description="no checkpoint_version key (version 0: QKV stored [3, np, hn] per rank, 2 heads "
                    "per rank so that the order is visible), "
                    "'transformer' / '.attention.' / *_layernorm keys, lr_scheduler, top-level RNG "
                    "keys, args.model_parallel_size"),
    LegacyCase(
        "gpt2_tp4_pp1_v1_release", M.GPT2_MHA, tp=4, pp=1, vpp=None, dtype="fp16", era="2020",
        checkpoint_version=1.0, optimizer="none", release=True, seed=14, rank0_manifest=False,
        description="checkpoint_version 1.0 (QKV [np, hn, 3] per rank), TP 4, 'release' tracker and "
                    "directory, no optimizer"),
    LegacyCase(
        "llama_tp2_pp1_bf16_distopt", M.LLAMA_GQA, tp=2, pp=1, vpp=None, dtype="bf16", era="core_v0.8",
        checkpoint_version=3.0, optimizer="distributed", dp=2, seed=15, rank0_manifest=False,
        description="GQA, SwiGLU, RMSNorm, RoPE, untied output layer, no biases; distributed "
                    "optimizer (distrib_optim.pt)"),
    LegacyCase(
        "llama_tp4_pp2_bf16", M.LLAMA_GQA, tp=4, pp=2, vpp=None, dtype="bf16", era="core_v0.8",
        checkpoint_version=3.0, optimizer="plain", seed=16, rank0_manifest=False,
        description="TP 4 x PP 2, untied output layer on the last stage, Float16 optimizer; "
                    "param groups ordered differently on the two stages"),
    LegacyCase(
        "qwen_tp2_pp2_vpp2_bf16_distopt", M.QWEN_GQA_TIED, tp=2, pp=2, vpp=2, dtype="bf16",
        era="core_v0.8", checkpoint_version=3.0, optimizer="distributed", dp=2, seed=17,
        description="virtual pipeline (model0, model1; layers 0,2 on stage 0 and 1,3 on stage 1), "
                    "tied embeddings with PP (shared-embedding buckets), QKV bias only, distributed "
                    "optimizer with one buffer per model chunk"),
]

BY_NAME = {c.name: c for c in LEGACY_CASES}
