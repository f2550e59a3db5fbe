"""torch.save fixtures written by torch 2.x: every savable dtype, storage alignment, training
states, legacy format at every pickle protocol, a DEFLATED zip and a big-endian file.

Usage: tools/sid-python tests/python/torch2/gen_t2_torch.py OUTDIR

Writes OUTDIR/<case>.pt and OUTDIR/<case>.manifest.json per case (see ../README.md and README.md
here). Each file is loaded back with torch.load and must describe exactly like the saved object;
what torch.load(weights_only=True) and torch.load(mmap=True) do is recorded in the manifest.
"""
import io
import os
import sys
import warnings
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _t2 as T  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.utils.serialization  # noqa: E402,F401

warnings.simplefilter("ignore")  # TypedStorage deprecation and friends


def g(seed):
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


# --------------------------------------------------------------------------- cases
def floats():
    return torch.tensor([0.0, -0.0, 1.5, -2.25, 448.0, 57344.0, float("inf"), float("-inf"),
                         float("nan"), 1e-3, 0.0078125, -3.0])


def case_dtypes():
    """One or two tensors of every dtype torch 2.x saves."""
    r = g(21)
    f = floats()
    by = torch.arange(0, 256, 17, dtype=torch.uint8)           # 16 bytes
    d = {
        "bool": torch.tensor([True, False, True, True, False]),
        "uint8": torch.tensor([0, 1, 127, 128, 255], dtype=torch.uint8),
        "int8": torch.tensor([-128, -1, 0, 1, 127], dtype=torch.int8),
        "int16": torch.tensor([-32768, -1, 0, 1, 32767], dtype=torch.int16),
        "uint16": torch.tensor([0, 1, 255, 256, 32768, 65535], dtype=torch.uint16),
        "int32": torch.tensor([-2**31, -1, 0, 1, 2**31 - 1], dtype=torch.int32),
        "uint32": torch.tensor([0, 1, 65536, 2**31, 2**32 - 1], dtype=torch.uint32),
        "int64": torch.tensor([-2**63, -1, 0, 1, 2**63 - 1], dtype=torch.int64),
        "uint64": torch.tensor([0, 1, 2**32, 2**63, 2**64 - 1], dtype=torch.uint64),
        "float16": f.to(torch.float16),
        "bfloat16": f.to(torch.bfloat16),
        "float32": f.clone(),
        "float64": f.to(torch.float64) / 3,
        "complex32": torch.complex(f[:6], f[6:]).to(torch.complex32),
        "complex64": torch.complex(torch.randn(2, 3, generator=r), torch.randn(2, 3, generator=r)),
        "complex128": torch.complex(torch.randn(3, dtype=torch.float64, generator=r),
                                    torch.randn(3, dtype=torch.float64, generator=r)),
        "float8_e4m3fn": f.to(torch.float8_e4m3fn),
        "float8_e5m2": f.to(torch.float8_e5m2),
        "float8_e4m3fnuz": f.to(torch.float8_e4m3fnuz),
        "float8_e5m2fnuz": f.to(torch.float8_e5m2fnuz),
        "float8_e8m0fnu": torch.tensor([1.0, 2.0, 0.5, 1024.0, 2.0**-127, 2.0**127]).to(torch.float8_e8m0fnu),
        "float4_e2m1fn_x2": by.clone().reshape(4, 4).view(torch.float4_e2m1fn_x2),
        "bits8": by[:5].clone().view(torch.bits8),
        "bits16": by.clone().view(torch.bits16),
        "bits1x8": by[:3].clone().view(torch.bits1x8),
        "bits2x4": by[3:6].clone().view(torch.bits2x4),
        "bits4x2": by[6:9].clone().view(torch.bits4x2),
        # 2-d tensors too, so there are more than 10 storages (data/10 sorts before data/2)
        "float8_e4m3fn_2d": torch.randn(3, 4, generator=r).to(torch.float8_e4m3fn),
        "uint16_2d": torch.randint(0, 65536, (2, 3), generator=r).to(torch.uint16),
        "bfloat16_2d_t": torch.randn(4, 3, generator=r).to(torch.bfloat16).t(),
        "uint64_0d": torch.tensor(2**64 - 2, dtype=torch.uint64),
        "float8_e5m2_empty": torch.empty(0, 3, dtype=torch.float8_e5m2),
    }
    return d


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x):
        return x + self.mlp(self.ln(x + self.attn(x)))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.embed.weight                     # tied
        self.register_buffer("causal", torch.tril(torch.ones(4, 4, dtype=torch.bool)))
        self.register_buffer("step_count", torch.tensor(0))

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def case_training_state():
    """model + AdamW + scheduler + GradScaler + loop counters, after 3 steps."""
    torch.manual_seed(22)
    net = TinyLM()
    decay = [p for n, p in net.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in net.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=1e-5)
    r = g(23)
    for _ in range(3):
        idx = torch.randint(0, 12, (2, 4), generator=r)
        loss = nn.functional.cross_entropy(net(idx).reshape(-1, 12), idx.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return {
        "model": net.state_dict(),
        "optimizer": opt.state_dict(),
        "lr_scheduler": sched.state_dict(),
        "iteration": 3,
        "consumed_tokens": 24,
        "loss": float(loss.item()),
        "run_name": "tiny-lm \u00e9t\u00e9",
        "tags": ["a", "b"],
        "best": None,
        "converged": False,
    }


def case_tied_views():
    r = g(24)
    w = torch.randn(3, 4, generator=r)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    p = nn.Parameter(torch.randn(2, 2, generator=r))
    x = torch.randn(10, generator=r)
    return {
        "a": w, "b": w,                                         # the same tensor twice
        "base": base, "row": base[1], "col": base[:, 2], "t": base.t(),
        "window": base[1:3, 2:5], "stepped": base.reshape(-1)[::5],
        "param": p, "param_again": p,
        "first": x[:6], "second": x[4:],                         # overlap, base not saved
        "expanded": torch.randn(3, 1, generator=r).expand(3, 4),
        "bf16_t": torch.randn(2, 3, generator=r).to(torch.bfloat16).t(),
        "u16_view": torch.arange(12, dtype=torch.int32).to(torch.uint16).reshape(3, 4)[:, 1:3],
        "f8_t": torch.randn(3, 2, generator=r).to(torch.float8_e5m2).t(),
        "empty_view": torch.randn(4, generator=r)[4:],
    }


# dtypes a legacy (non-zip) file cannot hold in torch 2.x: its writer asks the storage class for
# a dtype, and torch.UntypedStorage has none ("type object ... has no attribute 'dtype'")
LEGACY_UNSAVABLE = {"uint16", "uint32", "uint64", "complex32", "float8_e4m3fn", "float8_e5m2",
                    "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
                    "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2"}


def legacy_savable(obj):
    return {k: v for k, v in obj.items()
            if str(v.dtype).replace("torch.", "") not in LEGACY_UNSAVABLE}


# --------------------------------------------------------------------------- checks, manifests
def load_result(path, expect, **kw):
    """{"loads": bool, "equal": bool (whether it gives back the manifest), "error": ...}"""
    try:
        got = T.describe(torch.load(path, map_location="cpu", **kw))
    except Exception as e:
        return {"loads": False, "error": T.one_line(e)[:300]}
    return {"loads": True, "equal": all(got[k] == expect[k] for k in ("tensors", "values", "aliases"))}


def alignment(offsets):
    """The largest power of two (up to 4096) that divides every offset."""
    a = 4096
    while a > 1 and any(o % a for o in offsets):
        a //= 2
    return a


def finish(outdir, case, filename, fmt, obj, *, loadable=True, misread=(), **extra):
    """Check that torch.load gives back obj (except the tensors named in misread, which torch
    is known to read wrong: they must differ), then write the manifest."""
    path = os.path.join(outdir, filename)
    expect = T.describe(obj)
    if loadable:
        got = T.describe(torch.load(path, map_location="cpu", weights_only=False))
        wrong = sorted(n for n in expect["tensors"] if got["tensors"].get(n) != expect["tensors"][n])
        if wrong != sorted(misread):
            raise SystemExit(f"{case}: torch.load reads {wrong} wrong, expected {sorted(misread)}")
        for k in ("values", "aliases"):
            if got[k] != expect[k]:
                raise SystemExit(f"{case}: reloaded {k} differ from the saved object")
        if misread:
            extra["torch_misreads"] = sorted(misread)
    info = {"path": filename, "torch_version": torch.__version__}
    info["torch_load"] = load_result(path, expect, weights_only=False)
    info["torch_weights_only"] = T.weights_only_result(path)
    if zipfile.is_zipfile(path):
        info["torch_mmap"] = load_result(path, expect, mmap=True, weights_only=False)
        info.update(T.zip_info(path))
        offsets = T.record_offsets(path)
        info["data_alignment"] = alignment([offsets[n] for n in offsets if "/data/" in n])
        info["pickle_globals"] = T.pickle_globals(T.main_pickle(path))
    info.update(extra)
    T.write_manifest(outdir, case, T.make_manifest(fmt, expect, **info))


def save(outdir, case, obj, *, legacy=False, protocol=2, loadable=True, **extra):
    filename = case + ".pt"
    torch.save(obj, os.path.join(outdir, filename), pickle_protocol=protocol,
               _use_new_zipfile_serialization=not legacy)
    finish(outdir, case, filename, "torch_legacy" if legacy else "torch", obj,
           loadable=loadable, pickle_protocol=protocol, **extra)


def rewrite_zip(src, dst, *, compression=zipfile.ZIP_STORED, replace=None):
    """Copy a torch zip record by record (same names and order) with Python's zipfile."""
    replace = replace or {}
    with zipfile.ZipFile(src) as z:
        records = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(dst, "w", compression=compression) as out:
        for name, data in records:
            short = name.split("/", 1)[1]
            if short in replace:
                data = replace[short](data)
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = compression
            out.writestr(info, data)


def storage_dtypes(obj):
    """{storage key: dtype} as torch.save numbers storages: "0", "1", ... by first use, in the
    order the pickler meets the tensors (depth-first, container order)."""
    keys, out = {}, {}
    for _, leaf in T.iter_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            ptr = leaf.untyped_storage().data_ptr()
            if ptr not in keys:
                keys[ptr] = str(len(keys))
                out[keys[ptr]] = leaf.dtype
            elif out[keys[ptr]].itemsize != leaf.dtype.itemsize:
                raise ValueError("one storage seen through dtypes of different sizes")
    return out


def byteswapped(data, dtype):
    import numpy as np
    width = dtype.itemsize // 2 if dtype.is_complex else dtype.itemsize
    if width == 1 or not data:
        return data
    return np.frombuffer(data, dtype=f"<u{width}").byteswap().tobytes()


# Storages of these dtypes are pickled as torch.UntypedStorage (with _rebuild_tensor_v3);
# torch.load then byte-swaps them as uint8, i.e. not at all, so a big-endian file holding them
# loads wrong on a little-endian machine.
UNTYPED_MULTIBYTE = ("uint16", "uint32", "uint64", "complex32", "bits16")


def write_big_endian(outdir, case, src_case, obj, misread=()):
    """torch 2.x writes a 'byteorder' record; rebuild src as a big-endian machine writes it."""
    src = os.path.join(outdir, src_case + ".pt")
    dst = os.path.join(outdir, case + ".pt")
    dtypes = storage_dtypes(obj)
    replace = {"byteorder": lambda _: b"big"}
    for key, dt in dtypes.items():
        replace[f"data/{key}"] = (lambda dt: lambda data: byteswapped(data, dt))(dt)
    rewrite_zip(src, dst, replace=replace)
    finish(outdir, case, case + ".pt", "torch", obj, byteorder="big", misread=misread,
           note="rebuilt from " + src_case + ".pt: byteorder record 'big', every storage byte-swapped "
                "per element (per component for complex), Python zipfile layout (no 64-byte alignment)")


def main(argv):
    if len(argv) != 2:
        print("usage: gen_t2_torch.py OUTDIR", file=sys.stderr)
        return 2
    outdir = argv[1]
    os.makedirs(outdir, exist_ok=True)
    torch.set_num_threads(1)
    cfg = torch.utils.serialization.config.save

    dtypes = case_dtypes()
    training = case_training_state()
    tied = case_tied_views()
    save(outdir, "dtypes", dtypes, storage_alignment=cfg.storage_alignment)
    old = cfg.storage_alignment
    cfg.storage_alignment = 4096
    try:
        save(outdir, "dtypes_align4096", dtypes, storage_alignment=4096)
    finally:
        cfg.storage_alignment = old
    save(outdir, "training_state", training)
    save(outdir, "tied_views", tied)

    # legacy format at every protocol torch.save writes; zip at protocols other than 2
    legacy_dtypes = legacy_savable(dtypes)
    for p in (1, 2, 3, 4, 5):
        save(outdir, f"legacy_p{p}", training, legacy=True, protocol=p)
    save(outdir, "legacy_dtypes", legacy_dtypes, legacy=True,
         unsavable_dtypes=sorted(LEGACY_UNSAVABLE))
    save(outdir, "legacy_tied_views", legacy_savable(tied), legacy=True)
    for p in (1, 3, 4, 5):
        save(outdir, f"zip_p{p}", training, protocol=p)
    # protocol 0: torch.save writes it (persistent ids become str() of the id tuple), but
    # torch.load cannot read it back ("saved_id must be a tuple, got str")
    small = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "step": 7}
    save(outdir, "legacy_p0", small, legacy=True, protocol=0, loadable=False)
    save(outdir, "zip_p0", small, protocol=0, loadable=False)

    rewrite_zip(os.path.join(outdir, "training_state.pt"), os.path.join(outdir, "deflated.pt"),
                compression=zipfile.ZIP_DEFLATED)
    finish(outdir, "deflated", "deflated.pt", "torch", training, compression="deflated",
           note="training_state.pt with every record rewritten ZIP_DEFLATED by Python's zipfile")
    untyped = {k: v for k, v in dtypes.items() if str(v.dtype)[6:] in UNTYPED_MULTIBYTE}
    typed = {k: v for k, v in dtypes.items() if k not in untyped}
    save(outdir, "dtypes_typed", typed)
    save(outdir, "dtypes_untyped", untyped)
    write_big_endian(outdir, "big_endian_dtypes", "dtypes_typed", typed)
    # the manifest has the true values; torch.load misreads every multi-byte tensor here
    write_big_endian(outdir, "big_endian_untyped", "dtypes_untyped", untyped,
                     misread=[k for k, v in untyped.items() if v.numel() and v.dtype.itemsize > 1])
    write_big_endian(outdir, "big_endian_training_state", "training_state", training)

    # through a stream: archive folder "archive/"
    buf = io.BytesIO()
    torch.save(tied, buf)
    with open(os.path.join(outdir, "stream_saved.pt"), "wb") as f:
        f.write(buf.getvalue())
    finish(outdir, "stream_saved", "stream_saved.pt", "torch", tied)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
