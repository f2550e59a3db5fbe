#!/usr/bin/python3
"""OLMo "mapped" safetensors fixtures (olmo/safetensors_util.py) with their manifests.

    /usr/bin/python3 tests/python/gen_olmo_st.py OUTDIR

For each case writes OUTDIR/<case>.safetensors and OUTDIR/<case>.manifest.json. The writer below
follows OLMo's state_dict_to_safetensors_file rules (see layouts/olmo_safetensors.md): dicts are
walked; a tensor leaf is stored under the name urlsafe_b64(pickle((path, False))); any other leaf
(lists and tuples included) is pickled into a 1-D U8 tensor stored under urlsafe_b64(pickle((path,
True))); the file is what safetensors.torch.save_file writes (no __metadata__). The manifest
describes the nested dict the file decodes to (names = dotted paths, int keys as decimal), plus
`olmo_entries` (each stored entry's typed key path, whether it is pickled, and the repr of a pickled
value), so a checker can tell int keys from str keys and tuples from lists.

Each case is decoded back with layouts/olmo_safetensors.py (the reference reader) and must give
exactly the source dict.
"""
import base64
import collections
import math
import os
import pickle
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import _common as C  # noqa: E402
import gen_safetensors as G  # noqa: E402
from layouts import olmo_safetensors as ref  # noqa: E402
from layouts._raw import flatten as raw_flatten  # noqa: E402

PROTOCOL = 4  # pickle.DEFAULT_PROTOCOL of the Pythons OLMo runs on (3.8 .. 3.13)


# --------------------------------------------------------------------------- the writer
def _key_name(path, pickled):
    # Equal strings in one path are made one object, so they are memoized (BINGET) the way they are
    # when OLMo's keys are literals; see the spec for why both encodings must be accepted.
    interned = {}
    path = tuple(interned.setdefault(k, k) if isinstance(k, str) else k for k in path)
    return base64.urlsafe_b64encode(pickle.dumps((path, pickled), protocol=PROTOCOL)).decode("ascii")


def olmo_entries(state, prefix=()):
    """(path, pickled, tensor) in the order OLMo's flatten_dict yields them."""
    for key, value in state.items():
        path = prefix + (key,)
        if isinstance(value, torch.Tensor):
            yield path, False, value
        elif isinstance(value, dict):
            yield from olmo_entries(value, path)
        else:
            blob = bytearray(pickle.dumps(value, protocol=PROTOCOL))
            yield path, True, torch.frombuffer(blob, dtype=torch.uint8)


def write_olmo_file(state, path):
    """-> list of (path, pickled, name) in flatten order."""
    tensors, order = {}, []
    for keys, pickled, t in olmo_entries(state):
        name = _key_name(keys, pickled)
        if name in tensors:
            raise ValueError(f"two entries encode to the same name: {keys!r}")
        t = t.detach()
        if not t.is_contiguous():
            raise ValueError(f"{keys!r}: safetensors refuses non-contiguous tensors")
        tensors[name] = (C.dtype_name(t.dtype), list(t.shape), C.tensor_bytes(t))
        order.append((keys, pickled, name))
    _refuse_shared(state)
    with open(path, "wb") as f:
        f.write(G.serialize(tensors, metadata=None))
    return order


def _refuse_shared(state):
    seen = {}
    for p, leaf in C.iter_leaves(state):
        if C.is_tensor(leaf):
            k = C.storage_key(leaf)
            if k is not None and k in seen:
                raise ValueError(f"{p} shares storage with {seen[k]}: safetensors.save_file refuses that")
            if k is not None:
                seen[k] = p


# --------------------------------------------------------------------------- sources
class TinyOlmo(nn.Module):
    """Parameter names as OLMo's model has them (transformer.wte, blocks.N.att_proj, ...)."""

    def __init__(self, vocab=13, d=8, n_layers=2):
        super().__init__()
        self.transformer = nn.ModuleDict()
        self.transformer["wte"] = nn.Embedding(vocab, d)
        blocks = nn.ModuleList()
        for _ in range(n_layers):
            b = nn.Module()
            b.attn_norm = nn.LayerNorm(d)
            b.att_proj = nn.Linear(d, 3 * d, bias=False)
            b.attn_out = nn.Linear(d, d, bias=False)
            b.ff_norm = nn.LayerNorm(d)
            b.ff_proj = nn.Linear(d, 4 * d, bias=False)
            b.ff_out = nn.Linear(2 * d, d, bias=False)
            blocks.append(b)
        self.transformer["blocks"] = blocks
        self.transformer["ln_f"] = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.transformer["wte"](idx)
        for b in self.transformer["blocks"]:
            h = b.att_proj(b.attn_norm(x))
            q, k, v = h.chunk(3, dim=-1)
            a = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
            x = x + b.attn_out(a)
            u, g = b.ff_proj(b.ff_norm(x)).chunk(2, dim=-1)
            x = x + b.ff_out(torch.nn.functional.silu(g) * u)
        return self.transformer["ln_f"](x) @ self.transformer["wte"].weight.t()


def trained_olmo():
    """A TinyOlmo after 2 AdamW steps, with OLMo's two param groups (decay / no decay)."""
    torch.manual_seed(1234)
    model = TinyOlmo()
    names = [n for n, _ in model.named_parameters()]
    decay = [n for n in names if n.endswith("proj.weight") or n.endswith("out.weight")]
    no_decay = [n for n in names if n not in decay]
    params = dict(model.named_parameters())
    groups = [
        {"params": [params[n] for n in decay], "param_names": decay, "weight_decay": 0.1},
        {"params": [params[n] for n in no_decay], "param_names": no_decay, "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=4e-4, betas=(0.9, 0.95), eps=1e-5)
    for g in opt.param_groups:
        g["initial_lr"] = g["lr"]
        g["max_grad_norm"] = 1.0
    idx = torch.randint(0, 13, (2, 5))
    for _ in range(2):
        opt.zero_grad()
        model(idx).logsumexp(-1).mean().backward()
        opt.step()
    return model, opt


def model_case():
    model, _ = trained_olmo()
    # What scripts/unshard.py hands to state_dict_to_safetensors_file: {fqn: tensor}.
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def optim_case():
    _, opt = trained_olmo()
    sd = opt.state_dict()
    # LocalShardedCheckpointer.unshard_checkpoint: state keyed by int ids, a defaultdict(dict).
    state = collections.defaultdict(dict)
    for pid, st in sd["state"].items():
        state[pid] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def optim_fqn_case():
    _, opt = trained_olmo()
    sd = opt.state_dict()
    id_to_name = {}
    for g in sd["param_groups"]:
        id_to_name.update(zip(g["params"], g["param_names"]))
    state = {id_to_name[pid]: {k: v.clone() for k, v in st.items()} for pid, st in sd["state"].items()}
    groups = []
    for g in sd["param_groups"]:
        g = dict(g)
        g["params"] = list(g["param_names"])
        groups.append(g)
    return {"state": state, "param_groups": groups}


def nested_case():
    torch.manual_seed(99)
    g = torch.Generator().manual_seed(7)
    return {
        "model": {
            "transformer.wte.weight": torch.randn(5, 3, generator=g),
            "transformer.blocks.0.att_proj.weight": torch.randn(9, 3, generator=g).to(torch.bfloat16),
            "ln.bias": torch.randn(3, generator=g).to(torch.float16),
        },
        "optim": {
            "state": {
                0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(5, 3, generator=g),
                    "exp_avg_sq": torch.rand(5, 3, generator=g)},
                1: {"step": torch.tensor(3.0), "exp_avg": torch.randn(9, 3, generator=g),
                    "exp_avg_sq": torch.rand(9, 3, generator=g)},
                2: {},  # an empty dict has no entry: it disappears
            },
            "param_groups": [
                {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
                 "foreach": None, "params": [0, 1], "param_names": ["transformer.wte.weight",
                                                                    "transformer.blocks.0.att_proj.weight"]},
            ],
        },
        "epoch": 3,
        "global_step": 1234567890123,
        "neg": -70000,
        "big": 2 ** 70,
        "loss": 2.5,
        "lr_zero": -0.0,
        "nan": float("nan"),
        "inf": -math.inf,
        "name": "run-\u00fc\u4e16",
        "flag": True,
        "nothing": None,
        "blob": b"\x00\xff\x10",
        "lrs": [0.1, 0.2, [1, "a", None]],
        "shape": (2, 3),
        "empty": {},
        "empty_list": [],
        "nested": {"a": {"b": {"c": torch.tensor(11, dtype=torch.int64)}}, "deep_empty": {"x": {}}},
        7: {"seven": "int key at the top"},
        -1: torch.arange(4, dtype=torch.int32),
        "int_keys": {0: torch.tensor([True, False, True]), 300: torch.arange(6, dtype=torch.uint8),
                     70000: torch.tensor([-1, 2], dtype=torch.int8), 2 ** 40: torch.tensor([1.5], dtype=torch.float64)},
        "repeat": {"repeat": {"repeat": torch.tensor([1.0, 2.0])}},
        "\u043a\u043b\u044e\u0447": torch.zeros(2, 0),
        "empties": {"e0": torch.zeros(0), "e3x0": torch.zeros(3, 0, dtype=torch.int16)},
        "scalar_bf16": torch.tensor(0.15625, dtype=torch.bfloat16),
        "i16": torch.tensor([-300, 300], dtype=torch.int16),
        "c64": torch.tensor([1 + 2j, -3.5j], dtype=torch.complex64),
        "ordered": collections.OrderedDict([("z", torch.tensor([1.0])), ("a", [collections.OrderedDict(k=1)])]),
    }


# --------------------------------------------------------------------------- manifests
def _json_key(k):
    return k if isinstance(k, (str, int)) and not isinstance(k, bool) else {"repr": repr(k)}


def manifest_for(state, order, filename):
    tensors, values = raw_flatten(_drop_empty_dicts(state))
    entries = []
    for keys, pickled, _name in order:
        e = {"keys": [_json_key(k) for k in keys], "pickled": pickled}
        if pickled:
            e["repr"] = repr(_lookup(state, keys))
        entries.append(e)
    return C.make_manifest("olmo_safetensors", tensors=tensors, values=values, path=filename,
                           olmo_entries=entries)


def _drop_empty_dicts(obj):
    """The nested dict as it decodes: dicts without leaves vanish; a dict subclass becomes a dict."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if isinstance(v, dict):
                v = _drop_empty_dicts(v)
                if not v:
                    continue
            out[k] = v
        return out
    return obj


def _lookup(state, keys):
    for k in keys:
        state = state[k]
    return state


# --------------------------------------------------------------------------- self-check
def verify(path, manifest, state):
    nested, entries, metadata = ref.decode_file(path, strict=True)
    problems = []
    if metadata is not None:
        problems.append(f"unexpected __metadata__ {metadata}")
    t, v = raw_flatten(nested)
    import torch_check
    problems += torch_check.compare_with_manifest(manifest, t, v)
    want = _drop_empty_dicts(state)
    if _typed(nested) != _typed(want):
        problems.append("decoded dict differs from the source in key types or container types")
    for ent in entries:
        if ent.pickled and ent.tensor.data != pickle.dumps(ent.value, protocol=PROTOCOL):
            problems.append(f"{ent.keys!r}: pickled bytes are not pickle.dumps(value)")
        if ent.name != ref.canonical_name(ent.keys, ent.pickled):
            problems.append(f"{ent.keys!r}: name is not the canonical encoding")
    if problems:
        raise SystemExit(f"{path}: reference decode disagrees with the source:\n  " + "\n  ".join(problems))


def _typed(obj):
    """A comparable form that keeps key types, list vs tuple, and tensor bytes."""
    from layouts._raw import RawTensor
    if isinstance(obj, RawTensor):
        return ("T", obj.dtype, tuple(obj.shape), obj.data)
    if C.is_tensor(obj):
        return ("T", C.dtype_name(obj.dtype), tuple(obj.shape), C.tensor_bytes(obj))
    if isinstance(obj, dict):
        items = sorted(((type(k).__name__, repr(k)), _typed(v)) for k, v in obj.items())
        return ("D", tuple(items))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_typed(x) for x in obj))
    if isinstance(obj, float):
        return ("F", repr(obj))
    return (type(obj).__name__, repr(obj))


def malicious_file(outdir):
    """A valid mapped file whose one pickled value calls posix.system: never to be unpickled."""
    sentinel = os.path.join(os.path.abspath(outdir), "pwned_olmo")
    cmd = f"touch {sentinel}".encode()
    evil = b"\x80\x02cposix\nsystem\nX" + struct.pack("<I", len(cmd)) + cmd + b"\x85R."
    good = torch.arange(3, dtype=torch.float32)
    tensors = {
        _key_name(("model", "w"), False): ("F32", [3], C.tensor_bytes(good)),
        _key_name(("epoch",), True): ("U8", [len(evil)], evil),
    }
    name = "olmo_malicious.safetensors"
    with open(os.path.join(outdir, name), "wb") as f:
        f.write(G.serialize(tensors, metadata=None))
    t = {"model.w": C.tensor_entry(good)}
    return C.make_manifest("olmo_safetensors", tensors=t, path=name,
                           malicious={"forbidden_global": "posix.system", "sentinel": sentinel})


CASES = {
    "olmo_model": model_case,          # scripts/unshard.py --safe-tensors: model.safetensors
    "olmo_optim": optim_case,          # ... optim.safetensors from LocalShardedCheckpointer (int ids)
    "olmo_optim_fqn": optim_fqn_case,  # ... optim state keyed by parameter name (FSDP full checkpoints)
    "olmo_nested": nested_case,        # every kind of leaf and key the rules allow
}


def main(argv):
    if len(argv) != 2:
        print("usage: /usr/bin/python3 gen_olmo_st.py OUTDIR", file=sys.stderr)
        return 2
    outdir = argv[1]
    os.makedirs(outdir, exist_ok=True)
    torch.set_num_threads(1)
    t0 = time.time()
    for case, make in CASES.items():
        state = make()
        filename = case + ".safetensors"
        path = os.path.join(outdir, filename)
        order = write_olmo_file(state, path)
        manifest = manifest_for(state, order, filename)
        verify(path, manifest, state)
        C.write_manifest(outdir, case, manifest)
    C.write_manifest(outdir, "olmo_malicious", malicious_file(outdir))
    print(f"gen_olmo_st: {len(CASES) + 1} cases in {time.time() - t0:.1f}s -> {outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
