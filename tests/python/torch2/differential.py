#!/usr/bin/env python3
"""Differential test: statedict against torch.load(weights_only=True) on mutated real torch.save files.

Not part of CI. Two steps:

    # 1. small real files, written by each PyTorch at hand (1.13: Debian 12's python3; 2.14: the sid root)
    /usr/bin/python3 tests/python/torch2/differential.py bases /tmp/diff/bases
    tools/sid-python tests/python/torch2/differential.py bases /tmp/diff/bases
    # 2. seeded mutants of them, each loaded by torch 2.14 and inspected by statedict
    tools/sid-python tests/python/torch2/differential.py run /tmp/diff/bases /tmp/diff/work \\
        --cli build/dev/bin/statedict --seed 1 --count 2000

Mutations: a bit flipped anywhere; the file truncated; a byte of data.pkl changed, a storage class
or integer of it replaced (re-zipped with good CRCs); a record renamed, dropped, lengthened or
shortened; the version / .storage_alignment / byteorder records rewritten. Each mutant is read by
torch 2.14 (`torch.load(path, weights_only=True)`, in a forked child with a timeout) and by
`statedict inspect --json --hash`; the verdicts are counted:

    agree_read       both read it, the same tensors (names, dtypes, shapes, SHA-256 of the elements)
    agree_refused    both refuse it
    SILENT           both read it, the tensors differ                     (a bug)
    sd_reads_torch_refuses                                                (a bug, or a documented exception)
    sd_refuses_torch_reads                                                (docs/torch-files.md lists the deliberate ones)
    sd_crash / sd_hang                                                    (a bug)
    torch_crash / torch_hang, not_comparable (torch gave something else than plain tensors and data)

The mutants behind every count but the agreements are kept in WORK/<verdict>/ with a line each in
WORK/report.txt.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import zipfile

VERDICTS = ["agree_read", "agree_refused", "SILENT", "sd_reads_torch_refuses", "sd_refuses_torch_reads", "sd_crash",
            "sd_hang", "torch_crash", "torch_hang", "not_comparable"]
DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
          "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "complex64": "C64", "complex128": "C128",
          "uint16": "U16", "uint32": "U32", "uint64": "U64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


# --- step 1: base files -----------------------------------------------------------------------
def make_bases(out: str) -> None:
    import torch
    os.makedirs(out, exist_ok=True)
    tag = "t" + torch.__version__.split("+")[0].replace(".", "_")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, generator=g)
    trees = {
        "dtypes": {"f32": w, "f64": torch.randn(2, generator=g, dtype=torch.float64), "f16": w.half(), "bf16": w.bfloat16(),
                   "i64": torch.arange(5), "i32": torch.arange(3, dtype=torch.int32), "i8": torch.tensor([-3, 4], dtype=torch.int8),
                   "u8": torch.tensor([200, 1], dtype=torch.uint8), "b": torch.tensor([True, False]), "scalar": torch.tensor(2.5),
                   "c64": torch.randn(2, generator=g, dtype=torch.complex64)},
        "tied": {"a": w, "b": w, "view": w[1:, 2:], "t": w.t()},
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, generator=g)}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]},
        "nested": {"layers": [{"w": torch.randn(2, 2, generator=g)}, {"w": torch.randn(1, generator=g)}], "n": 3, "s": "x"},
        "quantized": {"q": torch.quantize_per_tensor(torch.tensor([-1.0, 0.0, 0.5]), 0.1, 3, torch.qint8), "f": w},
    }
    for name, tree in trees.items():
        torch.save(tree, os.path.join(out, f"{tag}_{name}.pt"))
    torch.save(trees["dtypes"], os.path.join(out, f"{tag}_legacy.pt"), _use_new_zipfile_serialization=False)
    print(f"wrote {len(trees) + 1} files written by torch {torch.__version__} to {out}")


# --- step 2: mutants --------------------------------------------------------------------------
def rezip(items: list[tuple[str, bytes]]) -> bytes:
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w", zipfile.ZIP_STORED) as z:
        for n, d in items:
            z.writestr(n, d)
    return b.getvalue()


def mutate(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    try:
        items = [(i.filename, zipfile.ZipFile(io.BytesIO(data)).read(i.filename)) for i in zipfile.ZipFile(io.BytesIO(data)).infolist()]
    except Exception:
        items = None
    kinds = ["bitflip", "truncate"] + (["pkl_byte", "pkl_class", "pkl_int", "rename", "drop", "longer", "shorter", "meta"] * 2 if items else [])
    kind = rng.choice(kinds)
    if kind == "bitflip":
        b = bytearray(data)
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
        return f"bitflip@{i}", bytes(b)
    if kind == "truncate":
        n = rng.randrange(len(data))
        return f"truncate@{n}", data[:n]
    assert items is not None
    names = [n for n, _ in items]
    pkl = next(i for i, n in enumerate(names) if n.endswith("/data.pkl"))
    if kind.startswith("pkl_"):
        p = bytearray(items[pkl][1])
        if kind == "pkl_byte":
            i = rng.randrange(len(p))
            p[i] = rng.randrange(256)
            what = f"pkl_byte@{i}"
        elif kind == "pkl_class":
            classes = [c for c in (b"FloatStorage", b"BoolStorage", b"LongStorage", b"HalfStorage", b"ByteStorage", b"CharStorage",
                                   b"IntStorage", b"DoubleStorage", b"BFloat16Storage", b"QInt8Storage", b"ComplexFloatStorage") if c in p]
            if not classes:
                return "pkl_class(none)", data
            src = rng.choice(classes)
            dst = rng.choice([b"FloatStorage", b"QInt8Storage", b"QUInt8Storage", b"QInt32Storage", b"BoolStorage", b"ByteStorage",
                              b"UntypedStorage", b"DoubleStorage", b"NopeStorage"])
            p = bytearray(bytes(p).replace(src, dst, 1))
            what = f"pkl_class {src.decode()}->{dst.decode()}"
        else:  # an argument of BININT1 / BININT changed
            at = [i for i in range(len(p) - 1) if p[i] in (ord("K"), ord("J"))]
            if not at:
                return "pkl_int(none)", data
            i = rng.choice(at)
            p[i + 1] = rng.randrange(256)
            what = f"pkl_int@{i}"
        items[pkl] = (items[pkl][0], bytes(p))
        return what, rezip(items)
    i = rng.randrange(len(items))
    n, d = items[i]
    if kind == "rename":
        new = rng.choice([n + "x", "other/" + n.split("/", 1)[-1], n.split("/", 1)[-1], n.replace("/", "/.data/", 1)])
        items[i] = (new, d)
        return f"rename {n}->{new}", rezip(items)
    if kind == "drop":
        del items[i]
        return f"drop {n}", rezip(items)
    if kind in ("longer", "shorter"):
        data_recs = [j for j, (m, _) in enumerate(items) if "/data/" in m]
        if not data_recs:
            return f"{kind}(none)", data
        j = rng.choice(data_recs)
        m, d = items[j]
        k = rng.choice([1, 2, 4, 8, 64])
        items[j] = (m, d + bytes(k) if kind == "longer" else d[:-k] if len(d) >= k else b"")
        return f"{kind} {m} by {k}", rezip(items)
    rec, val = rng.choice([("version", b"0"), ("version", b"11"), ("version", b"3x"), ("version", b""), ("version", b"1"),
                           (".storage_alignment", b"abc"), (".storage_alignment", b"32"), (".storage_alignment", b" 64\n"),
                           (".storage_alignment", b"6_4"), ("byteorder", b"big"), ("byteorder", b"middle"),
                           (".format_version", b"x")])
    prefix = names[0].split("/", 1)[0] + "/"
    items = [(m, val if m == prefix + rec else d) for m, d in items]
    if prefix + rec not in names:
        items.append((prefix + rec, val))
    return f"meta {rec}={val!r}", rezip(items)


def flatten_torch(v, prefix, out) -> bool:
    """Plain tensors of a tree of dicts, lists and data, by statedict's names; False for anything else."""
    import torch
    if isinstance(v, torch.Tensor):
        if type(v) is not torch.Tensor and type(v) is not torch.nn.Parameter:
            return False
        if v.is_quantized or v.is_sparse or v.layout != torch.strided or str(v.dtype).split(".")[1] not in DTYPES:
            return False
        c = torch.empty(v.shape, dtype=v.dtype)  # standard strides, whatever v's (a size-1 dim keeps any stride)
        c.copy_(v.detach())
        c = c.reshape(-1)
        raw = c.view(torch.uint8) if c.dtype != torch.bool else c.to(torch.uint8)
        out[prefix] = (DTYPES[str(v.dtype).split(".")[1]], list(v.shape), hashlib.sha256(raw.numpy().tobytes()).hexdigest())
        return True
    if isinstance(v, dict):
        return all(isinstance(k, (str, int)) and flatten_torch(x, f"{prefix}.{k}" if prefix else str(k), out) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return all(flatten_torch(x, f"{prefix}.{i}" if prefix else str(i), out) for i, x in enumerate(v))
    return v is None or isinstance(v, (bool, int, float, str, bytes, torch.Size, torch.dtype, torch.device))


def torch_verdict(path: str, timeout: float):
    """('read', {name: (dtype, shape, sha)}) | ('read_other', None) | ('refused', message) | ('crash', sig) | ('hang', None)"""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            import torch
            v = torch.load(path, weights_only=True)
        except BaseException as e:  # noqa: BLE001 - any refusal
            res = ("refused", f"{type(e).__name__}: {str(e)[:200]}")
        else:
            out: dict = {}
            try:
                res = ("read", out) if flatten_torch(v, "", out) else ("read_other", None)
            except BaseException:  # noqa: BLE001 - a value this script cannot hash
                res = ("read_other", None)
        os.write(w, json.dumps(res).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    import select
    end = timeout
    while True:
        ready, _, _ = select.select([r], [], [], end)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return ("hang", None)
        b = os.read(r, 1 << 20)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if not chunks:
        return ("crash", os.WSTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
    kind, val = json.loads(b"".join(chunks))
    return (kind, val)


def statedict_verdict(cli: str, path: str, timeout: float):
    try:
        p = subprocess.run([cli, "inspect", "--json", "--hash", path], capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return ("hang", None)
    if p.returncode == 0:
        j = json.loads(p.stdout)
        return ("read", {k: (t["dtype"], t["shape"], t.get("sha256")) for k, t in j.get("tensors", {}).items()})
    if p.returncode in (1, 2):
        return ("refused", p.stderr.decode(errors="replace").strip()[:300])
    return ("crash", p.returncode)


def run(bases: str, work: str, cli: str, seed: int, count: int, timeout: float) -> int:
    import warnings
    import torch
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    files = sorted(os.path.join(bases, f) for f in os.listdir(bases) if f.endswith(".pt"))
    if not files:
        sys.exit(f"no .pt files in {bases}: run the `bases` step first")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    rng = random.Random(seed)
    counts = {v: 0 for v in VERDICTS}
    report = open(os.path.join(work, "report.txt"), "w")
    for n in range(count):
        base = rng.choice(files)
        what, data = mutate(open(base, "rb").read(), rng)
        path = os.path.join(work, f"m{n:05d}.pt")
        with open(path, "wb") as f:
            f.write(data)
        t = torch_verdict(path, timeout)
        s = statedict_verdict(cli, path, timeout)
        if s[0] in ("crash", "hang"):
            v = "sd_" + s[0]
        elif t[0] in ("crash", "hang"):
            v = "torch_" + t[0]
        elif t[0] == "refused":
            v = "agree_refused" if s[0] == "refused" else "sd_reads_torch_refuses"
        elif s[0] == "refused":
            v = "sd_refuses_torch_reads"
        elif t[0] == "read_other":
            v = "not_comparable"
        else:
            norm = lambda d: {k: (x[0], tuple(x[1]), x[2]) for k, x in d.items()}  # noqa: E731
            v = "agree_read" if norm(t[1]) == norm(s[1]) else "SILENT"
        counts[v] += 1
        if not v.startswith("agree"):
            os.makedirs(os.path.join(work, v), exist_ok=True)
            os.replace(path, os.path.join(work, v, os.path.basename(path)))
            report.write(f"{v}\t{os.path.basename(path)}\t{os.path.basename(base)}\t{what}\ttorch: {str(t[1])[:160] if t[0] != 'read' else 'read'}"
                         f"\tstatedict: {str(s[1])[:160] if s[0] != 'read' else 'read'}\n")
        else:
            os.remove(path)
    report.close()
    print(json.dumps({"seed": seed, "count": count, "bases": len(files), **counts}, indent=1))
    return 1 if counts["SILENT"] or counts["sd_crash"] or counts["sd_hang"] else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bases")
    b.add_argument("out")
    r = sub.add_parser("run")
    r.add_argument("bases")
    r.add_argument("work")
    r.add_argument("--cli", required=True)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--count", type=int, default=500)
    r.add_argument("--timeout", type=float, default=20.0)
    a = ap.parse_args()
    if a.cmd == "bases":
        make_bases(a.out)
        return 0
    return run(a.bases, a.work, os.path.abspath(a.cli), a.seed, a.count, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
