#!/usr/bin/python3
"""PyTorch 1.13 checks of what the programs in examples/ write (tests/cli-examples.cpp).

Usage:
  check_examples.py surgery ORIG.pt GROWN.pt ROWS
      GROWN is ORIG with the embedding grown to ROWS rows (new rows: the mean of the old ones, in
      float64 then rounded) and its AdamW moments grown with zero rows; the tied head still shares
      the embedding's storage; every other leaf equal; a fresh AdamW over parameters of the grown
      shapes accepts the optimizer state and takes a step.
  check_examples.py typed_config FILE
      torch.load(FILE, weights_only=True) gives the config dict examples/typed_config.cpp writes.

Prints one problem per line; exit status 1 when there is any.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

C.install_shim()

import torch  # noqa: E402

import torch_check  # noqa: E402

# torch 1.13's weights_only unpickler has no BINFLOAT (opcode 'G'), which pickle writes for every
# float (torch.save too): there the files, which hold no objects, are read with the full unpickler.
WEIGHTS_ONLY = int(torch.__version__.split(".")[0]) >= 2


def surgery(orig_path, grown_path, rows):
    problems = []
    a = torch.load(orig_path, map_location="cpu")
    b = torch.load(grown_path, map_location="cpu", weights_only=WEIGHTS_ONLY)
    emb_a, emb_b = a["model"]["emb.weight"], b["model"]["emb.weight"]
    old = emb_a.shape[0]
    if list(emb_b.shape) != [rows, emb_a.shape[1]]:
        return [f"model.emb.weight is {list(emb_b.shape)}, expected [{rows}, {emb_a.shape[1]}]"]
    if not torch.equal(emb_b[:old], emb_a):
        problems.append("model.emb.weight: the old rows changed")
    mean = emb_a.double().mean(0).float()
    if not all(torch.equal(emb_b[r], mean) for r in range(old, rows)):
        problems.append("model.emb.weight: the new rows are not the mean of the old ones")
    if not torch_check.shares_storage(b["model"]["head.weight"], emb_b):
        problems.append("model.head.weight no longer shares the embedding's storage")
    sa, sb = a["optim"]["state"][0], b["optim"]["state"][0]
    for k in ("exp_avg", "exp_avg_sq"):
        if list(sb[k].shape) != [rows, emb_a.shape[1]] or not torch.equal(sb[k][:old], sa[k]) or sb[k][old:].count_nonzero():
            problems.append(f"optim.state.0.{k}: not the old moments followed by zero rows")
    la, lb = torch_check.leaf_map(a), torch_check.leaf_map(b)
    changed = {"model.emb.weight", "model.head.weight", "optim.state.0.exp_avg", "optim.state.0.exp_avg_sq"}
    if set(la) != set(lb):
        problems.append(f"names differ: {sorted(set(la) ^ set(lb))[:6]}")
    for n in set(la) & set(lb) - changed:
        x, y = la[n], lb[n]
        same = torch.equal(x, y) and x.dtype == y.dtype if C.is_tensor(x) and C.is_tensor(y) else C.values_equal(C.json_value(x), C.json_value(y))
        if not same:
            problems.append(f"{n}: changed")
    # The optimizer state loads into AdamW over parameters of the grown shapes, and steps.
    ids = [p for g in b["optim"]["param_groups"] for p in g["params"]]
    shapes = {i: b["optim"]["state"][i]["exp_avg"].shape for i in ids}
    params = {i: torch.nn.Parameter(torch.zeros(shapes[i])) for i in ids}
    groups = [{"params": [params[i] for i in g["params"]]} for g in b["optim"]["param_groups"]]
    opt = torch.optim.AdamW(groups)
    try:
        opt.load_state_dict(b["optim"])
        for p in params.values():
            p.grad = torch.ones_like(p)
        opt.step()
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        problems.append(f"AdamW.load_state_dict/step failed: {type(e).__name__}: {e}")
    return problems


def typed_config(path):
    d = torch.load(path, map_location="cpu", weights_only=WEIGHTS_ONLY)
    want = {"model": "tiny", "layers": 2, "hidden": [16, 32],
            "optimizer": {"name": "adamw", "lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": None}}
    problems = [f"{k}: {d.get(k)!r}, expected {v!r}" for k, v in want.items() if d.get(k) != v]
    w = d.get("weights", {}).get("fc.weight")
    expect = torch.tensor([0.5, -1, 2, 3.25, 4, 5, -6, 7, 8, 9.5, 10, 11]).reshape(3, 4).to(torch.bfloat16)
    if w is None or w.dtype != torch.bfloat16 or not torch.equal(w, expect):
        problems.append(f"weights.fc.weight: {w!r}, expected {expect!r}")
    return problems


def main(argv):
    if len(argv) >= 2 and argv[1] == "surgery" and len(argv) == 5:
        problems = surgery(argv[2], argv[3], int(argv[4]))
    elif len(argv) == 3 and argv[1] == "typed_config":
        problems = typed_config(argv[2])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
