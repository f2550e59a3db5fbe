#!/usr/bin/env python3
"""Real AdamW optimizer state dicts (two param groups) for tests/interop-optim.cpp.

Usage: gen_optimizer_json.py OUTDIR   (run with /usr/bin/python3: PyTorch 1.13)

Writes OUTDIR/optimizer.json:

  {"torch": "1.13...",
   "cases": {CASE: {
      "names":       parameter names in optimizer order (group 0's params, then group 1's),
                     found by parameter identity, as torch.distributed.checkpoint does,
      "model_names": model.named_parameters() order,
      "id_form":     DOC of optimizer.state_dict(),
      "name_form":   DOC of the same state keyed by parameter name (state from optimizer.state,
                     which PyTorch keys by the Parameter objects themselves; "params" as names),
      "stateless":   names of parameters that never got a gradient (no state entry),
      "disagree":    [{"group": g, "key": "step", "params": [...]}] for each group whose params'
                     steps differ (from the group's first param with state)}}}

  DOC = {"skeleton": a statedict skeleton (docs/flatten.md) written here, independently of the
                     C++ writer,
         "tensors":  {NAME: {"dtype": "F32", "shape": [...], "data": base64 of the elements,
                             row-major, little-endian}}}
"""
import base64
import json
import math
import os
import sys
from collections import OrderedDict

import torch
from torch import nn

DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def tensor_doc(t):
    t = t.detach().cpu().contiguous()
    raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes(order="C")
    return {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data": base64.b64encode(raw).decode("ascii")}


def encode(obj, path, tensors):
    """One skeleton NODE for obj; tensors go to `tensors` under their dotted path."""
    if isinstance(obj, torch.Tensor):
        name = ".".join(str(p) for p in path)
        if name in tensors:
            raise ValueError(f"duplicate tensor name {name!r}")
        tensors[name] = tensor_doc(obj)
        return {"tensor": name, "dtype": tensors[name]["dtype"], "shape": tensors[name]["shape"]}
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return {"float": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
    if isinstance(obj, dict):
        for k in obj:
            if isinstance(k, bool) or not isinstance(k, (int, str)):
                raise TypeError(f"dict key {k!r}")
        return {"dict": [[k, encode(v, path + (k,), tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"tuple": [encode(v, path + (i,), tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return {"list": [encode(v, path + (i,), tensors) for i, v in enumerate(obj)]}
    raise TypeError(f"cannot encode {type(obj)}")


def doc(obj):
    tensors = {}
    root = encode(obj, (), tensors)
    return {"skeleton": {"statedict_skeleton": 1, "root": root}, "tensors": tensors}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.fc1 = nn.Linear(4, 8)
        self.ln = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 3)
        self.late = nn.Linear(8, 3)    # joins the forward pass from step `late_from` on
        self.unused = nn.Linear(2, 2)  # never used: no gradient, no optimizer state
        self.late_from = 0

    def forward(self, x, step):
        h = self.ln(torch.relu(self.fc1(self.embed(x))))
        out = self.fc2(h)
        if step >= self.late_from:
            out = out + self.late(h)
        return out


def make_case(late_from):
    torch.manual_seed(1234)
    model = Net()
    model.late_from = late_from
    named = list(model.named_parameters())
    decay = [p for n, p in named if n.endswith("weight") and not n.startswith("ln.")]
    no_decay = [p for n, p in named if not (n.endswith("weight") and not n.startswith("ln."))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0, "lr": 5e-4}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    x = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for step in range(3):
        opt.zero_grad()
        model(x, step).square().mean().backward()
        opt.step()

    name_of = {id(p): n for n, p in named}
    names = [name_of[id(p)] for g in opt.param_groups for p in g["params"]]
    sd = opt.state_dict()

    # The by-name form, built from parameter identity (never from the ids' positions).
    state = OrderedDict((name_of[id(p)], dict(s)) for p, s in opt.state.items())
    groups = []
    for g in opt.param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = [name_of[id(p)] for p in g["params"]]
        groups.append(packed)
    by_name = {"state": state, "param_groups": groups}

    stateless = [n for n, p in named if p not in opt.state]
    disagree = []
    for gi, g in enumerate(opt.param_groups):
        steps = {name_of[id(p)]: float(opt.state[p]["step"]) for p in g["params"] if p in opt.state}
        if len(set(steps.values())) > 1:
            first = next(iter(steps.values()))
            disagree.append({"group": gi, "key": "step", "params": [n for n, s in steps.items() if s != first]})
    return {"names": names, "model_names": [n for n, _ in named], "id_form": doc(sd), "name_form": doc(by_name),
            "stateless": stateless, "disagree": disagree}


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    cases = {"adamw_two_groups": make_case(late_from=0), "adamw_late_param": make_case(late_from=1)}
    assert not cases["adamw_two_groups"]["disagree"]
    assert cases["adamw_late_param"]["disagree"]
    path = os.path.join(out, "optimizer.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"torch": torch.__version__, "cases": cases}, f, allow_nan=False, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
