#!/usr/bin/python3
"""Write torch.save fixtures (zip and legacy formats) with real PyTorch 1.13.

Usage: /usr/bin/python3 tests/python/gen_torch_files.py OUTDIR

Each case is a file OUTDIR/<case>.<ext> plus OUTDIR/<case>.manifest.json
(see README.md).  Every written file (except the malicious one, which is never
loaded) is loaded back with torch.load and re-described; the generator fails if
the description differs from the in-memory object's.
"""
import io
import os
import pickletools
import shlex
import sys
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

FMT_ZIP = "torch"
FMT_LEGACY = "torch_legacy"


def g(seed):
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


# --------------------------------------------------------------------------- cases
def case_nested():
    r = g(1)
    return {
        "a": {"b": {"c": torch.randn(2, 3, generator=r)}},
        "list": [torch.arange(4), {"x": torch.randn(3, generator=r)}, [torch.ones(2, dtype=torch.int32), 5]],
        "tuple": (torch.zeros(1), "s", 3.5, (True, None)),
        7: torch.randn(2, generator=r),                      # int key
        -1: "negative int key",
        "ints": {0: torch.tensor([1, 2, 3]), 1: torch.tensor([4.0]), 10: {"deep": [1, 2]}},
        "empty_dict": {},
        "empty_list": [],
        "after_empty": torch.full((2, 2), 7, dtype=torch.int16),
    }


def case_dtypes():
    r = g(2)
    f = torch.tensor([0.0, -0.0, 1.5, -2.25, float("inf"), float("-inf"), float("nan"), 1e-40])
    d = {
        "bool": torch.tensor([True, False, True, True, False]),
        "uint8": torch.tensor([0, 1, 127, 128, 255], dtype=torch.uint8),
        "int8": torch.tensor([-128, -1, 0, 1, 127], dtype=torch.int8),
        "int16": torch.tensor([-32768, -1, 0, 1, 32767], dtype=torch.int16),
        "int32": torch.tensor([-2**31, -1, 0, 1, 2**31 - 1], dtype=torch.int32),
        "int64": torch.tensor([-2**63, -1, 0, 1, 2**63 - 1], dtype=torch.int64),
        "float16": f.to(torch.float16),
        "bfloat16": f.to(torch.bfloat16),
        "float32": f.clone(),
        "float64": f.to(torch.float64) * 3,
        "complex64": torch.complex(torch.randn(2, 3, generator=r), torch.randn(2, 3, generator=r)),
        "complex128": torch.complex(torch.randn(3, dtype=torch.float64, generator=r),
                                    torch.randn(3, dtype=torch.float64, generator=r)),
        # a second tensor per dtype family, 2-d, so there are > 10 storages
        "float32_2d": torch.randn(3, 4, generator=r),
        "bfloat16_2d": torch.randn(4, 3, generator=r).to(torch.bfloat16),
        "float16_2d": torch.randn(2, 5, generator=r).to(torch.float16),
        "int64_2d": torch.randint(-1000, 1000, (3, 3), generator=r),
        "bool_2d": torch.randint(0, 2, (2, 7), generator=r).bool(),
    }
    return d


def case_views():
    r = g(3)
    return {
        "transposed": torch.randn(3, 5, generator=r).t(),
        "offset": torch.arange(10, dtype=torch.float32)[2:],
        "column": torch.randn(4, 3, generator=r)[:, 1],
        "expanded": torch.randn(3, 1, generator=r).expand(3, 4),
        "expanded_scalar": torch.tensor(5.0).expand(2, 3),
        "stepped": torch.arange(20, dtype=torch.int64)[::3],
        "permuted": torch.randn(2, 3, 4, generator=r).permute(2, 0, 1),
        "window": torch.randn(6, 6, generator=r)[1:4, 2:5],
        "bf16_transposed": torch.randn(2, 3, generator=r).to(torch.bfloat16).t(),
        "unsqueezed": torch.randn(4, generator=r)[1:3].unsqueeze(0),
        "empty_view": torch.randn(4, generator=r)[4:],
    }


def case_tied():
    r = g(4)
    w = torch.randn(3, 4, generator=r)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    p = nn.Parameter(torch.randn(2, 2, generator=r))
    shared = torch.randn(5, generator=r)
    x = torch.randn(10, generator=r)
    return {
        "a": w,
        "b": w,                                # same object
        "base": base,
        "base_row1": base[1],                  # view + its base
        "base_t": base.t(),
        "param": p,
        "param_again": p,
        "enc": {"w": shared},
        "dec": {"w": shared},
        "first": x[:6],                        # overlapping views, base not saved
        "second": x[4:],
    }


def case_scalars_empty():
    return {
        "f32_0d": torch.tensor(3.25),
        "i64_0d": torch.tensor(-7),
        "bool_0d": torch.tensor(True),
        "bf16_0d": torch.tensor(-1.5, dtype=torch.bfloat16),
        "f16_0d": torch.tensor(65504.0, dtype=torch.float16),
        "c64_0d": torch.tensor(1 + 2j, dtype=torch.complex64),
        "empty_1d": torch.empty(0),
        "empty_3x0": torch.empty(3, 0, dtype=torch.int64),
        "empty_0x5_bf16": torch.empty(0, 5, dtype=torch.bfloat16),
        "empty_2x0x3_f16": torch.empty(2, 0, 3, dtype=torch.float16),
    }


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)

    def forward(self, x):
        return self.ln(torch.relu(self.fc(x))) + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight        # tied weights
        self.register_buffer("mask", torch.tril(torch.ones(3, 3, dtype=torch.bool)))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.bn(x))


def make_net():
    torch.manual_seed(5)
    return Net()


def case_module_state_dict():
    return make_net().state_dict()


def case_parameters():
    r = g(6)
    return {
        "weight": nn.Parameter(torch.randn(3, 4, generator=r)),
        "frozen": nn.Parameter(torch.randn(2, generator=r), requires_grad=False),
        "bf16_param": nn.Parameter(torch.randn(2, 2, generator=r).to(torch.bfloat16)),
        "plain_requires_grad": torch.randn(2, generator=r).requires_grad_(True),
        "list": [nn.Parameter(torch.ones(1)), nn.Parameter(torch.zeros(2, 1))],
    }


def case_model_optim():
    net = make_net()
    decay, no_decay = [], []
    for name, prm in net.named_parameters():
        (decay if prm.ndim >= 2 else no_decay).append(prm)
    opt = torch.optim.AdamW([
        {"params": decay, "lr": 1e-3, "weight_decay": 0.01},
        {"params": no_decay, "lr": 5e-4, "weight_decay": 0.0},
    ], betas=(0.9, 0.95), eps=1e-8)
    r = g(7)
    for _ in range(3):
        idx = torch.randint(0, 10, (8,), generator=r)
        target = torch.randint(0, 10, (8,), generator=r)
        loss = nn.functional.cross_entropy(net(idx), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"model": net.state_dict(), "optim": opt.state_dict(), "epoch": 3, "loss": float(loss.item())}


def case_python_values():
    return {
        "str": "hello",
        "unicode": "h\u00e9llo \u4e16\u754c \U0001F600",
        "empty_str": "",
        "bytes": b"\x00\x01\xfe\xffbin",
        "empty_bytes": b"",
        "float": 0.1,
        "neg_zero": -0.0,
        "tiny": 5e-324,
        "big_float": 1.7976931348623157e308,
        "nan": float("nan"),
        "inf": float("inf"),
        "neg_inf": float("-inf"),
        "none": None,
        "true": True,
        "false": False,
        "ints": [0, 1, -1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, -2**31, -2**31 - 1,
                 2**63 - 1, -2**63],
        "big_ints": [2**63, 2**64, 2**70, -2**70, -2**63 - 1],
        "mixed": ("a", 1, 2.5, None, b"b", [True, {"k": "v"}]),
        "tensor": torch.tensor([1.0, 2.0]),
    }


TORCH_CASES = {
    "nested": case_nested,
    "dtypes": case_dtypes,
    "views": case_views,
    "tied": case_tied,
    "scalars_empty": case_scalars_empty,
    "module_state_dict": case_module_state_dict,
    "parameters": case_parameters,
    "model_optim": case_model_optim,
    "python_values": case_python_values,
}
LEGACY_CASES = ["nested", "dtypes", "views", "tied", "scalars_empty", "module_state_dict",
                "model_optim", "python_values"]
# file names whose archive folder name is not trivially "<case>"
BASENAME_CASES = {
    "my.model-v1.2_final": "my.model-v1.2_final.bin",   # folder: my.model-v1.2_final/
    "noext": "noext",                                   # folder: noext/
    "mod\u00e8le": "mod\u00e8le.pt",                    # 1.13 keeps the non-ASCII name
    "sp ace": "sp ace.pt",
}


# --------------------------------------------------------------------------- helpers
def describe(obj):
    t, v, a = C.flatten(obj)
    return {"tensors": t, "values": v, "aliases": a, "dict_attributes": C.dict_attributes(obj)}


def weights_only_result(path):
    try:
        torch.load(path, weights_only=True)
        return {"loads": True}
    except Exception as e:  # record torch's own verdict, one line
        msg = str(e).replace("\n", " ")
        i = msg.find("WeightsUnpickler error:")
        return {"loads": False, "error": msg[i:] if i >= 0 else msg[:200]}


def zip_info(path):
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    return {"archive_prefix": names[0].split("/", 1)[0], "records": names}


def finish_case(outdir, case, filename, fmt, obj):
    path = os.path.join(outdir, filename)
    expect = describe(obj)
    got = describe(torch.load(path))
    for k in ("tensors", "values", "aliases"):
        if not C.values_equal(expect[k], got[k]):
            raise SystemExit(f"{case}: reloaded {k} differ from the saved object")
    extra = {"path": filename, "torch_weights_only": weights_only_result(path)}
    if expect["dict_attributes"]:
        extra["dict_attributes"] = expect["dict_attributes"]
    if fmt == FMT_ZIP:
        extra.update(zip_info(path))
    C.write_manifest(outdir, case, C.make_manifest(
        fmt, tensors=expect["tensors"], values=expect["values"], aliases=expect["aliases"], **extra))


def save_case(outdir, case, filename, fmt, obj):
    path = os.path.join(outdir, filename)
    torch.save(obj, path, _use_new_zipfile_serialization=(fmt == FMT_ZIP))
    finish_case(outdir, case, filename, fmt, obj)


# --------------------------------------------------------------------------- malicious
class _Payload:
    """Pickles as os.system(cmd). Only ever pickled here, never unpickled."""

    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def write_malicious(outdir):
    case = "malicious_os_system"
    filename = case + ".pt"
    sentinel = os.path.join(os.path.abspath(outdir), "pwned")
    cmd = "touch " + shlex.quote(sentinel)
    buf = io.BytesIO()
    torch.save({"weight": torch.arange(4, dtype=torch.float32), "payload": _Payload(cmd)}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src:
        records = {n.split("/", 1)[1]: src.read(n) for n in src.namelist()}
    data_pkl = records["data.pkl"]
    # Check without executing anything that the pickle really calls os.system.
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(data_pkl)]
    glob = [arg for name, arg in ops if name == "GLOBAL"]
    system_global = next(a for a in glob if a.endswith(" system"))  # 'posix system' on Linux
    assert ("REDUCE", None) in ops
    path = os.path.join(outdir, filename)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        for rec in ["data.pkl"] + sorted(r for r in records if r.startswith("data/")) + ["version"]:
            z.writestr(zipfile.ZipInfo(f"{case}/{rec}", date_time=(1980, 1, 1, 0, 0, 0)), records[rec])
    C.write_manifest(outdir, case, C.make_manifest(
        FMT_ZIP, path=filename,
        malicious={"forbidden_global": system_global.replace(" ", "."), "sentinel": sentinel,
                   "note": "a safe reader must reject this file and must not create the sentinel"},
        tensors={"weight": C.tensor_entry(torch.arange(4, dtype=torch.float32))}))


# --------------------------------------------------------------------------- main
def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    outdir = argv[1]
    os.makedirs(outdir, exist_ok=True)
    torch.set_num_threads(1)

    objs = {}
    for case, fn in TORCH_CASES.items():
        objs[case] = fn()
        save_case(outdir, case, case + ".pt", FMT_ZIP, objs[case])
    for case in LEGACY_CASES:
        save_case(outdir, "legacy_" + case, "legacy_" + case + ".pt", FMT_LEGACY, objs[case])

    # saved through a stream: archive folder is "archive/"
    buf = io.BytesIO()
    torch.save(objs["nested"], buf)
    with open(os.path.join(outdir, "stream_saved.pt"), "wb") as f:
        f.write(buf.getvalue())
    finish_case(outdir, "stream_saved", "stream_saved.pt", FMT_ZIP, objs["nested"])

    small = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "step": 1}
    for case, filename in BASENAME_CASES.items():
        save_case(outdir, case, filename, FMT_ZIP, small)

    write_malicious(outdir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
