"""torch.save files (torch 2.x) holding objects beyond torch.load's weights_only allow-list, as
training frameworks write them: argparse.Namespace args (fairseq / metaseq / Megatron), numpy
arrays and scalars, RNG states, nn.Parameter with Python attributes, sparse and quantized tensors.

Usage: tools/sid-python tests/python/torch2/gen_t2_objects.py OUTDIR

Every case is saved at pickle protocol 2 (torch.save's default) as OUTDIR/<case>.pt, and at
protocol 5 as OUTDIR/<case>_p5.pt (numpy arrays then pickle through numpy's _frombuffer and an
in-band bytearray). The manifest describes what a data-only reader should see (README.md here):
objects with a plain attribute dict (argparse.Namespace) are containers of their attributes,
numpy arrays and scalars are tensors, sparse tensors are their dense equivalent, quantized
tensors their integer representation; side keys say where each came from. torch.load
(weights_only=False) must give back exactly that; what weights_only=True says is recorded.
"""
import argparse
import collections
import os
import random
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _t2 as T  # noqa: E402
import _t2types  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

warnings.simplefilter("ignore")


def small_model(seed):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    return m.state_dict()


# --------------------------------------------------------------------------- cases
def case_fairseq_args():
    args = argparse.Namespace(
        arch="transformer_lm", task="language_modeling", lr=[0.0005], max_tokens=2048,
        adam_betas="(0.9, 0.98)", clip_norm=0.0, fp16=False, seed=1, no_progress_bar=True,
        dtype=torch.bfloat16, precision=_t2types.Precision.BF16, stage=_t2types.Stage.FINETUNE,
        device=torch.device("cpu"), data=None, layers={"enc": 2, "dec": 2})
    sd = small_model(31)
    return {
        "args": args,
        "model": sd,
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "FairseqAdam",
                               "lr_scheduler_state": {"best": 3.25}, "num_updates": 10}],
        "extra_state": {"epoch": 2, "val_loss": 3.25, "train_iterator": {"epoch": 2, "iterations_in_epoch": 5,
                                                                           "shuffle": True}},
        "last_optimizer_state": {"state": {}, "param_groups": [{"lr": [0.0005], "betas": (0.9, 0.98),
                                                                "params": list(range(len(sd)))}]},
    }


def case_megatron_rng():
    random.seed(32)
    np.random.seed(32)
    torch.manual_seed(32)
    args = argparse.Namespace(num_layers=2, hidden_size=4, params_dtype=torch.float16,
                              tensor_model_parallel_size=1, iteration=100, rank=0)
    return {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": 100,
        "model": {"language_model": {"embedding": {"word_embeddings": {"weight": torch.randn(6, 4)}},
                                     "encoder": small_model(33)}},
        "rng_state": [{
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "rng_tracker_states": collections.OrderedDict(),
        }],
        "num_floating_point_operations_so_far": 12345,
    }


def case_numpy_arrays():
    a = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    return {
        "f32": a,
        "f64_fortran": np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3) * 1.5),
        "f16": np.array([0.5, -2.0, 65504.0], dtype=np.float16),
        "i64_0d": np.array(-5, dtype=np.int64),
        "i32_big_endian": np.arange(6, dtype=">i4").reshape(2, 3),
        "f64_big_endian": np.array([1.0, -0.0, np.inf], dtype=">f8"),
        "u8": np.array([0, 7, 255], dtype=np.uint8),
        "u16": np.array([1, 65535], dtype=np.uint16),
        "bool": np.array([True, False, True]),
        "c64": np.array([1 + 2j, -3j], dtype=np.complex64),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "non_contiguous": np.arange(10, dtype=np.int16)[::2],
        "scalars": {"f32": np.float32(1.5), "f64": np.float64(-2.75), "i64": np.int64(-3),
                    "u8": np.uint8(200), "bool": np.bool_(True), "i32": np.int32(7)},
        "torch_too": torch.arange(3, dtype=torch.float32),
        "ordered": collections.OrderedDict([("z", 1), ("a", np.float32(2.0))]),
    }


def case_parameter_state():
    torch.manual_seed(34)
    w = nn.Parameter(torch.randn(4, 3))
    w.tensor_model_parallel = True                    # Megatron-style attributes
    w.partition_dim = 0
    w.partition_stride = 1
    b = nn.Parameter(torch.zeros(4), requires_grad=False)
    b.sequence_parallel = False
    plain = nn.Parameter(torch.ones(2))
    return {"weight": w, "bias": b, "plain": plain}


def case_sparse():
    torch.manual_seed(35)
    i = torch.tensor([[0, 1, 3, 3], [2, 0, 1, 4]])
    v = torch.tensor([1.5, -2.0, 3.25, 4.0])
    coo = torch.sparse_coo_tensor(i, v, (4, 5)).coalesce()
    dense = torch.zeros(3, 4)
    dense[0, 1], dense[2, 3], dense[2, 0] = 1.0, 2.0, -1.0
    return {"coo": coo, "csr": dense.to_sparse_csr(), "coo_i64": torch.sparse_coo_tensor(
        torch.tensor([[1, 2]]), torch.tensor([10, 20]), (4,)).coalesce(), "dense": dense}


def case_quantized():
    torch.manual_seed(36)
    x = torch.randn(3, 4)
    return {
        "per_tensor_qint8": torch.quantize_per_tensor(x, 0.05, 3, torch.qint8),
        "per_tensor_quint8": torch.quantize_per_tensor(x, 0.1, 128, torch.quint8),
        "per_channel_qint8": torch.quantize_per_channel(
            x, torch.tensor([0.01, 0.02, 0.04], dtype=torch.float64), torch.tensor([0, 1, -1]), 0, torch.qint8),
        "per_channel_quint8_axis1": torch.quantize_per_channel(
            x, torch.tensor([0.1, 0.05, 0.02, 0.01], dtype=torch.float64), torch.tensor([120, 128, 130, 127]),
            1, torch.quint8),
        "scale_note": "int_repr in tensors, scale and zero point in the quantized key",
    }


CASES = {
    "fairseq_args": case_fairseq_args,
    "megatron_rng": case_megatron_rng,
    "numpy_arrays": case_numpy_arrays,
    "parameter_state": case_parameter_state,
    "sparse": case_sparse,
    "quantized": case_quantized,
}


# --------------------------------------------------------------------------- side information
def side_info(obj):
    """Where the manifest's tensors come from, for leaves that are not plain torch tensors."""
    out = {"objects": {}, "numpy": {}, "sparse": {}, "quantized": {}, "parameter_state": {}}

    def walk(o, path):
        name = ".".join(str(p) for p in path)
        if isinstance(o, (np.ndarray, np.generic)):
            a = np.asarray(o)
            out["numpy"][name] = {"dtype": a.dtype.str, "scalar": isinstance(o, np.generic),
                                  "fortran_order": bool(a.flags.f_contiguous and not a.flags.c_contiguous)}
        elif isinstance(o, torch.Tensor):
            if o.layout == torch.sparse_coo:
                out["sparse"][name] = {"layout": "sparse_coo", "indices": T.tensor_entry(o._indices()),
                                       "values": T.tensor_entry(o._values())}
            elif o.layout == torch.sparse_csr:
                out["sparse"][name] = {"layout": "sparse_csr", "crow_indices": T.tensor_entry(o.crow_indices()),
                                       "col_indices": T.tensor_entry(o.col_indices()),
                                       "values": T.tensor_entry(o.values())}
            elif o.is_quantized:
                q = {"dtype": str(o.dtype).replace("torch.", ""), "qscheme": str(o.qscheme()).replace("torch.", "")}
                if o.qscheme() == torch.per_tensor_affine:
                    q.update(scale=o.q_scale(), zero_point=o.q_zero_point())
                else:
                    q.update(axis=o.q_per_channel_axis(), scales=T.tensor_entry(o.q_per_channel_scales()),
                             zero_points=T.tensor_entry(o.q_per_channel_zero_points()))
                out["quantized"][name] = q
            if isinstance(o, nn.Parameter):
                state = {k: T.C.json_value(v) for k, v in vars(o).items()}
                out["parameter_state"][name] = {"requires_grad": o.requires_grad, "state": state}
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, path + (k,))
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                walk(v, path + (i,))
        elif type(o).__reduce_ex__ is object.__reduce_ex__ and isinstance(getattr(o, "__dict__", None), dict):
            out["objects"][name] = f"{type(o).__module__}.{type(o).__qualname__}"
            for k, v in vars(o).items():
                walk(v, path + (k,))
    walk(obj, ())
    return {k: v for k, v in out.items() if v}


def allowed_globals():
    import torch._weights_only_unpickler as W
    return set(W._get_allowed_globals())


def save_case(outdir, case, obj, protocol):
    filename = case + ".pt"
    path = os.path.join(outdir, filename)
    torch.save(obj, path, pickle_protocol=protocol)
    expect = T.describe(obj, expand_objects=True)
    got = T.describe(torch.load(path, weights_only=False), expand_objects=True)
    for k in ("tensors", "values", "aliases"):
        if got[k] != expect[k]:
            bad = [n for n in set(got[k]) | set(expect[k]) if got[k].get(n) != expect[k].get(n)]
            raise SystemExit(f"{case}: reloaded {k} differ from the saved object: {sorted(bad)[:5]}")
    globs = T.pickle_globals(T.main_pickle(path))
    allowed = allowed_globals()
    T.write_manifest(outdir, case, T.make_manifest(
        "torch", expect, path=filename, torch_version=torch.__version__, pickle_protocol=protocol,
        torch_weights_only=T.weights_only_result(path), pickle_globals=globs,
        beyond_allow_list=[g for g in globs if g not in allowed], **side_info(obj)))


def main(argv):
    if len(argv) != 2:
        print("usage: gen_t2_objects.py OUTDIR", file=sys.stderr)
        return 2
    outdir = argv[1]
    os.makedirs(outdir, exist_ok=True)
    torch.set_num_threads(1)
    for case, fn in CASES.items():
        obj = fn()
        save_case(outdir, case, obj, 2)
        save_case(outdir, case + "_p5", obj, 5)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
