#!/usr/bin/python3
"""Write a manifest beside every file of the real-world corpus (tests/data/corpus).

    /usr/bin/python3 tests/python/corpus_manifest.py [CORPUS_DIR] [--only ORIGIN]... [--check]
                                                     [--debian-root DIR]

For each corpus file FILE this writes FILE.manifest.json in the convention of
tests/python/README.md, from what PyTorch itself reads in the file:

- torch.save zip and legacy files: torch.load(FILE, map_location="cpu",
  weights_only=False), flattened to dotted names; then torch.load(...,
  weights_only=True) for its verdict (`torch_weights_only`).
- TorchScript archives: torch.load hands them to torch.jit.load; the manifest
  describes the module's state_dict() and says so in `torch_113.returns`.
- safetensors files and Hugging Face sharded directories: the bytes are
  parsed by torch_check.read_safetensors (lenient) and every tensor whose
  dtype torch has is rebuilt with torch.frombuffer and hashed from the torch
  tensor, so the hashes are torch's; dtypes this torch lacks (F8_*) are hashed
  from their stored bytes, which is the same definition.

Nothing outside an allow-list of globals is ever unpickled with
weights_only=False: before loading, every GLOBAL / STACK_GLOBAL / INST of the
file's pickles is listed statically with pickletools. A file naming a module
that only means code execution (os, posix, subprocess, builtins.eval, ...)
gets `malicious` in its manifest and is only offered to the weights_only
unpickler (which refuses globals before calling anything); a file naming some
other unknown module (a project's own classes) is not loaded by this script
and says so in `torch_113.error`; it is then read by torch's own loader with
a pickle module that puts inert stubs in place of those classes (nothing of
theirs runs), reported as `stub_load`. Tensors that only such objects (or a
pickled nn.Module) hold are listed in `object_tensors` by attribute path.

Every manifest records the torch that wrote it (`manifest_by`) and what this
torch made of the file (`torch_113`: {"loads", "error", "returns"}). When
torch 1.13 cannot load a file, its tensors are left empty for a newer torch
to fill in: run this script with torch 2.x (tools/sid-python) and it rewrites
exactly those manifests, keeping the 1.13 verdicts and adding its own
(`torch_2`, `torch_2_weights_only`); every other manifest stays torch 1.13's.

--check compares instead of writing: exit 1 with one line per manifest that
would change.
"""
import argparse
import io
import json
import os
import pickletools
import struct
import sys
import tarfile
import traceback
import warnings
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402
import torch_check  # noqa: E402

# The torch running this script decides the names of its verdicts and how a
# tensor is described (torch 2.x has dtypes that _common does not name).
ENTRY, TORCH_DTYPE = C.tensor_entry, C.torch_dtype
LOAD_KEY, WO_KEY = "torch_113", "torch_weights_only"


def setup_torch():
    global ENTRY, TORCH_DTYPE, LOAD_KEY, WO_KEY
    import torch
    if not torch.__version__.startswith("1."):
        sys.path.insert(0, os.path.join(HERE, "torch2"))
        import _t2 as T2
        ENTRY, TORCH_DTYPE = T2.tensor_entry, T2.torch_dtype
        LOAD_KEY, WO_KEY = "torch_2", "torch_2_weights_only"
    return torch.__version__


DEFAULT_CORPUS = os.path.normpath(os.path.join(HERE, "..", "data", "corpus"))
SKIP_SUFFIXES = (".manifest.json", ".md", ".index.json")

# Modules whose mere presence means code execution: never unpickled here.
DANGEROUS = ("os.", "posix.", "nt.", "subprocess.", "builtins.eval", "builtins.exec",
             "__builtin__.eval", "__builtin__.exec", "builtins.compile", "__builtin__.compile",
             "builtins.__import__", "__builtin__.__import__", "builtins.open", "__builtin__.open",
             "runpy.", "importlib.", "marshal.", "types.", "socket.", "shutil.", "pty.",
             "webbrowser.", "urllib.", "requests.", "sys.", "_io.", "io.", "code.", "pickle.",
             "_pickle.", "ctypes.", "cloudpickle.", "dill.", "logging.", "operator.attrgetter")
# What this script lets torch.load(weights_only=False) unpickle.
ALLOWED_PREFIXES = ("torch.", "collections.OrderedDict", "_codecs.encode", "numpy.core.multiarray._reconstruct",
                    "numpy.core.multiarray.scalar", "numpy.dtype", "numpy.ndarray", "builtins.set",
                    "builtins.frozenset", "builtins.slice", "builtins.complex", "__builtin__.set",
                    "__builtin__.frozenset", "__builtin__.slice", "__builtin__.complex", "argparse.Namespace",
                    "__torch__.")


# --------------------------------------------------------------------------- static look at pickles
def pickle_globals(data, max_pickles=8):
    """(protocols, globals) of up to max_pickles consecutive pickles in data.

    A pickle's protocol is the one its PROTO opcode names, or for protocols 0
    and 1 (no PROTO) the highest protocol among its opcodes, as pickletools.dis says.

    Only pickletools.genops: nothing is unpickled. Stops quietly at the first
    byte that is not a pickle (raw storages follow the pickles in legacy files).
    """
    f = io.BytesIO(data)
    protos, found, strs = [], [], []
    for _ in range(max_pickles):
        if f.tell() >= len(data):
            break
        proto = 0
        try:
            for op, arg, _pos in pickletools.genops(f):
                proto = max(proto, op.proto)
                if op.name == "PROTO":
                    proto = max(proto, arg)
                elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE",
                                 "SHORT_BINSTRING", "BINSTRING", "STRING"):
                    strs.append(str(arg))
                elif op.name in ("GLOBAL", "INST"):
                    found.append(arg.replace(" ", "."))
                elif op.name == "STACK_GLOBAL":
                    found.append(".".join(strs[-2:]))
        except Exception:
            break
        protos.append(proto)
    return protos, list(dict.fromkeys(found))


def dangerous(glob):
    return any(glob == p.rstrip(".") or glob.startswith(p) for p in DANGEROUS)


def allowed(glob):
    return any(glob == p.rstrip(".") or glob.startswith(p) for p in ALLOWED_PREFIXES)


# --------------------------------------------------------------------------- format detection
def detect(path):
    """('safetensors' | 'torch' | 'torchscript' | 'torch_legacy' | 'torch_legacy_tar' | 'invalid', info)."""
    with open(path, "rb") as f:
        head = f.read(16)
        f.seek(0)
        blob = f.read()
    info = {}
    if len(head) >= 9 and head[8:9] == b"{":
        (n,) = struct.unpack("<Q", head[:8])
        if 8 + n <= len(blob):
            return "safetensors", info
    if head[:4] == b"PK\x03\x04":
        try:
            z = zipfile.ZipFile(io.BytesIO(blob))
        except zipfile.BadZipFile:
            return "invalid", info
        names = z.namelist()
        prefix = names[0].split("/")[0] if names else ""
        info["archive_prefix"] = prefix
        info["records"] = names
        ver = [n for n in names if n == f"{prefix}/version"]
        if ver:
            info["zip_version"] = z.read(ver[0]).decode("ascii", "replace").strip()
        rel = {n[len(prefix) + 1:] for n in names}
        pk = f"{prefix}/data.pkl"
        protos, globs = [], []
        for rec in ("data.pkl", "constants.pkl"):
            if rec in rel:
                p, g = pickle_globals(z.read(f"{prefix}/{rec}"), 1)
                protos += p
                globs += g
        info["pickle_protocol"] = protos[0] if protos else None
        info["globals"] = list(dict.fromkeys(globs))
        if "constants.pkl" in rel or "model.json" in rel or any(r.startswith("code/") for r in rel):
            return "torchscript", info
        if pk in names:
            return "torch", info
        return "invalid", info
    if tarfile.is_tarfile(path):
        try:
            with tarfile.open(path) as t:
                members = t.getnames()
                info["records"] = members
                if "pickle" in members:
                    _, info["globals"] = pickle_globals(t.extractfile("pickle").read(), 1)
        except tarfile.TarError:
            return "invalid", info
        return "torch_legacy_tar", info
    protos, globs = pickle_globals(blob, 8)
    if protos:
        info["pickle_protocol"] = max(protos)
        info["globals"] = globs
        return "torch_legacy", info
    return "invalid", info


# --------------------------------------------------------------------------- loading
def err_text(e):
    """One line: the exception type and its message, without the boilerplate
    that weights_only=True puts in front of the unpickler's own reason."""
    msg = " ".join(str(e).split())
    key = "WeightsUnpickler error: "
    if key in msg:
        msg = msg[msg.index(key):]
    return f"{type(e).__name__}: {msg}"[:400]


def torch_load(path, weights_only):
    import torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", weights_only=weights_only)


def describe_object(obj):
    """(tensors, values, aliases, attrs) of a loaded object, as in _common."""
    import torch
    if isinstance(obj, torch.jit.ScriptModule):
        obj = obj.state_dict()
    t, v, a = C.flatten(obj, tensor_entry_fn=ENTRY)
    return t, v, a, C.dict_attributes(obj)


class Stub:
    """Stands for an instance of a class this script does not import.

    Keeps what the pickle gave it (constructor arguments, state) and runs
    nothing of the class it stands for.
    """

    def __init__(self, *args, **kwargs):
        self.stub_args = args
        if kwargs:
            self.stub_kwargs = kwargs

    def __setstate__(self, state):
        self.stub_state = state

    def __repr__(self):
        return f"<stub {type(self).__module__}.{type(self).__qualname__}>"


def stub_class(module, name):
    return type(name, (Stub,), {"__module__": module, "__qualname__": name})


def stub_pickle_module():
    """A pickle module for torch.load(pickle_module=...) whose find_class
    resolves the allow-listed globals and turns every other one into a Stub
    class; names that mean code execution are refused outright."""
    import pickle
    import types

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            full = f"{module}.{name}"
            if dangerous(full):
                raise pickle.UnpicklingError(f"refused global {full}")
            if allowed(full):
                try:
                    return super().find_class(module, name)
                except (AttributeError, ImportError, ModuleNotFoundError):
                    pass
            return stub_class(module, name)

    def load(f, **kw):
        return Unpickler(f, **kw).load()

    return types.SimpleNamespace(Unpickler=Unpickler, load=load, __name__="corpus_stub_pickle")


def stub_load(path, fmt):
    """torch's own loader with the stub pickle module.

    torch.load of 1.13 ignores pickle_module unless weights_only is set (it
    assigns pickle over it), so this calls the two loaders torch.load would
    call, as torch.load calls them.
    """
    import torch
    ser = torch.serialization
    mod = stub_pickle_module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with open(path, "rb") as f:
            if fmt == "torch":
                with ser._open_zipfile_reader(f) as zr:
                    return ser._load(zr, "cpu", mod, encoding="utf-8")
            if fmt == "torch_legacy":
                return ser._legacy_load(f, "cpu", mod, encoding="utf-8")
    raise ValueError(f"no stub load for format {fmt}")


def object_tensors(obj):
    """Tensors reachable only through objects' attributes (a pickled
    nn.Module, a project's own class), named by their attribute path
    (`model._modules.0._parameters.weight`). Tensors that C.flatten already
    names (through dicts, lists, tuples) are not repeated."""
    import torch
    out, seen = {}, set()

    def walk(x, path, inside_object):
        if isinstance(x, torch.Tensor):
            if inside_object:
                out[C.dotted(path)] = ENTRY(x)
            return
        if id(x) in seen:
            return
        if isinstance(x, dict):
            seen.add(id(x))
            for k, v in x.items():
                walk(v, path + (k,), inside_object)
        elif isinstance(x, (list, tuple)):
            seen.add(id(x))
            for i, v in enumerate(x):
                walk(v, path + (i,), inside_object)
        elif isinstance(x, Stub):
            # a stub's state is the object's attributes: name them as such
            seen.add(id(x))
            state = getattr(x, "stub_state", None)
            if isinstance(state, dict):
                for k, v in state.items():
                    walk(v, path + (k,), True)
            elif state is not None:
                walk(state, path + ("state",), True)
            if getattr(x, "stub_args", ()):
                walk(x.stub_args, path + ("args",), True)
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            seen.add(id(x))
            for k, v in vars(x).items():
                walk(v, path + (k,), True)

    walk(obj, (), False)
    return out


def weights_only_verdict(path):
    try:
        torch_load(path, True)
        return {"loads": True, "error": None}
    except Exception as e:
        return {"loads": False, "error": err_text(e)}


def manifest_for_torch(path, fmt, info):
    import torch
    m = {"format": fmt, "tensors": {}, "values": {}, "aliases": {}}
    globs = info.get("globals", [])
    bad = [g for g in globs if dangerous(g)]
    unknown = [g for g in globs if not allowed(g)]
    if bad:
        m["malicious"] = {"forbidden_global": bad[0], "globals": globs}
        m[LOAD_KEY] = {"loads": False, "error": f"not loaded: names {bad[0]} (code execution)", "returns": None}
        m[WO_KEY] = weights_only_verdict(path)
        return m
    obj = None
    if unknown:
        # torch.load with weights_only=False would import and run these
        # classes; their module is not installed anyway, or is not ours to run.
        m[LOAD_KEY] = {"loads": False, "error": f"not loaded: global {unknown[0]} is outside this script's allow-list",
                          "returns": None}
        try:
            obj = stub_load(path, fmt)
            m["stub_load"] = {"loads": True, "stubbed": unknown}
        except Exception as e:
            m["stub_load"] = {"loads": False, "error": err_text(e), "stubbed": unknown}
    else:
        try:
            obj = torch_load(path, False)
            ty = type(obj)
            m[LOAD_KEY] = {"loads": True, "error": None, "returns": f"{ty.__module__}.{ty.__qualname__}"}
        except Exception as e:
            m[LOAD_KEY] = {"loads": False, "error": err_text(e), "returns": None}
    if obj is not None:
        t, v, a, attrs = describe_object(obj)
        m["tensors"], m["values"], m["aliases"] = t, v, a
        if attrs and fmt != "torchscript":
            m["dict_attributes"] = attrs
        if fmt != "torchscript":
            ot = object_tensors(obj)
            if ot:
                m["object_tensors"] = ot
    m[WO_KEY] = weights_only_verdict(path)
    return m


def manifest_for_safetensors_entries(entries, blob, data_start):
    """tensors map from parsed safetensors entries; torch rebuilds each it can."""
    import torch
    tensors, missing = {}, set()
    for name, dtype, shape, s, e in entries:
        raw = blob[data_start + s:data_start + e]
        entry = {"dtype": dtype, "shape": shape, "sha256": C.sha256_hex(raw)}
        try:
            tdt = TORCH_DTYPE(dtype)
        except ValueError:
            tdt = None
        if tdt is None:
            missing.add(dtype)
        else:
            numel = 1
            for d in shape:
                numel *= d
            if numel:
                t = torch.frombuffer(bytearray(raw), dtype=tdt).reshape(shape)
            else:
                t = torch.empty(shape, dtype=tdt)
            te = ENTRY(t)
            if te != entry:
                raise AssertionError(f"{name}: torch reads {te}, the bytes say {entry}")
        tensors[name] = entry
    return tensors, missing


def manifest_for_safetensors(path):
    m = {"format": "safetensors", "tensors": {}, "values": {}, "aliases": {}}
    try:
        entries, metadata, n, data_start, blob = torch_check.read_safetensors(path, strict=False)
    except torch_check.SafetensorsRuleError as e:
        m["safetensors_error"] = {"rule": e.rule, "detail": e.detail}
        return m
    m["tensors"], missing = manifest_for_safetensors_entries(entries, blob, data_start)
    if metadata is not None:
        m["metadata"] = metadata
    if missing:
        m[LOAD_KEY] = {"loads": False, "error": f"this torch has no dtype for {', '.join(sorted(missing))}: "
                                                     "those tensors are hashed from their stored bytes",
                          "returns": None}
    else:
        m[LOAD_KEY] = {"loads": True, "error": None, "returns": "torch.Tensor (torch.frombuffer per tensor)"}
    return m


def manifest_for_hf_sharded(dirpath, index_name):
    with open(os.path.join(dirpath, index_name), encoding="utf-8") as f:
        index = json.load(f)
    weight_map = index["weight_map"]
    m = {"format": "hf_sharded", "tensors": {}, "values": {}, "aliases": {}}
    missing_all = set()
    files = sorted(set(weight_map.values()))
    for shard in files:
        entries, metadata, n, data_start, blob = torch_check.read_safetensors(os.path.join(dirpath, shard), strict=False)
        t, missing = manifest_for_safetensors_entries(entries, blob, data_start)
        for name in t:
            if weight_map.get(name) != shard:
                raise AssertionError(f"{shard}: {name} is not mapped to this shard by {index_name}")
        m["tensors"].update(t)
        missing_all |= missing
    m["files"] = [index_name] + files
    if "metadata" in index:
        m["index_metadata"] = index["metadata"]
    if missing_all:
        m[LOAD_KEY] = {"loads": False, "error": f"this torch has no dtype for {', '.join(sorted(missing_all))}: "
                                                     "those tensors are hashed from their stored bytes",
                          "returns": None}
    else:
        m[LOAD_KEY] = {"loads": True, "error": None, "returns": "torch.Tensor (torch.frombuffer per tensor)"}
    return m


def make_manifest(path):
    fmt, info = detect(path)
    if fmt == "safetensors":
        m = manifest_for_safetensors(path)
    elif fmt in ("torch", "torchscript", "torch_legacy", "torch_legacy_tar"):
        m = manifest_for_torch(path, fmt, info)
    else:
        m = {"format": "invalid", "tensors": {}, "values": {}, "aliases": {}}
        try:
            torch_load(path, False) if not info.get("globals") else None
            m[LOAD_KEY] = {"loads": True, "error": None, "returns": None}
        except Exception as e:
            m[LOAD_KEY] = {"loads": False, "error": err_text(e), "returns": None}
    for k in ("archive_prefix", "zip_version", "pickle_protocol", "records"):
        if k in info and info[k] is not None:
            m[k] = info[k]
    if info.get("globals") and "malicious" not in m and fmt != "torchscript":
        m["globals"] = info["globals"]
    return m


# --------------------------------------------------------------------------- driver
def corpus_items(root, only):
    """(name relative to its origin dir, absolute path, kind) of every corpus item."""
    for origin in sorted(os.listdir(root)):
        od = os.path.join(root, origin)
        if not os.path.isdir(od) or (only and origin not in only):
            continue
        for dirpath, dirnames, filenames in os.walk(od):
            dirnames.sort()
            indexes = [f for f in filenames if f.endswith(".safetensors.index.json")]
            if indexes:
                yield dirpath, indexes[0], "hf_sharded"
                dirnames[:] = []
                continue
            for fn in sorted(filenames):
                if fn.endswith(SKIP_SUFFIXES):
                    continue
                yield os.path.join(dirpath, fn), None, "file"


# Files that Debian packages ship: used at test time by installing the package,
# never committed. (package, installed path); manifests go to
# CORPUS/debian/<package>/<file name>.manifest.json.
DEBIAN_FILES = [
    ("lammps-examples", "/usr/share/lammps/examples/mliap/relu1hidden.mliap.pytorch.model.pt"),
    ("cp2k-data", "/usr/share/cp2k/NequIP/water.pth"),
]


def debian_manifests(corpus, root, me, check):
    """Manifests of DEBIAN_FILES found under root ('/' when installed, or a
    folder where the .deb files were unpacked with dpkg-deb -x)."""
    changed = 0
    for package, installed in DEBIAN_FILES:
        src = os.path.join(root, installed.lstrip("/"))
        if not os.path.exists(src):
            print(f"{installed}: not found under {root} (install {package})", file=sys.stderr)
            continue
        out = os.path.join(corpus, "debian", package, os.path.basename(installed) + ".manifest.json")
        changed += emit(out, lambda: make_manifest(src), {"path": installed, "package": package}, me, check, corpus)
    return changed


def read_json(path):
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def emit(out, build, extra, me, check, corpus):
    """Write (or with check, compare) one manifest; 1 when it changes.

    Who owns a manifest: torch 1.13 writes every one. A torch 2.x run only
    fills those whose file torch 1.13 could not load (`torch_113.loads`
    false), keeping the 1.13 verdicts beside its own `torch_2` ones; a later
    1.13 run leaves such a manifest alone while 1.13 still cannot load the file.
    """
    old = read_json(out)
    if LOAD_KEY == "torch_2" and (old is None or old.get("torch_113", {}).get("loads", True)):
        return 0
    m = build()
    if old is not None and LOAD_KEY == "torch_113" and old.get("manifest_by", {}).get("torch") != me["torch"] \
            and "torch_2" in old and not m.get(LOAD_KEY, {}).get("loads", True):
        return 0
    if LOAD_KEY == "torch_2":
        for k in ("torch_113", "torch_weights_only"):
            if k in old:
                m[k] = old[k]
    m.update(extra)
    m["manifest_by"] = me
    text = C.dumps_manifest(m)
    before = None
    if os.path.exists(out):
        with open(out, encoding="utf-8") as f:
            before = f.read()
    if before == text:
        return 0
    if check:
        print(f"{os.path.relpath(out, corpus)}: differs from what torch {me['torch']} writes")
        return 1
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(out + ".tmp", out)
    return 1


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("corpus", nargs="?", default=DEFAULT_CORPUS)
    ap.add_argument("--only", action="append", default=[], help="origin folder name (repeatable)")
    ap.add_argument("--check", action="store_true", help="compare with the committed manifests, write nothing")
    ap.add_argument("--debian-root", metavar="DIR",
                    help="also describe the Debian-shipped files (DEBIAN_FILES) found under DIR ('/' when installed)")
    args = ap.parse_args(argv)
    me = {"torch": setup_torch(), "script": "tests/python/corpus_manifest.py"}
    changed = 0
    for path, index, kind in corpus_items(args.corpus, set(args.only)):
        def build(path=path, index=index, kind=kind):
            return manifest_for_hf_sharded(path, index) if kind == "hf_sharded" else make_manifest(path)
        try:
            changed += emit(path + ".manifest.json", build, {"path": os.path.basename(path)}, me, args.check,
                            args.corpus)
        except Exception:
            print(f"{path}: manifest failed\n{traceback.format_exc()}", file=sys.stderr)
            return 2
    if args.debian_root:
        changed += debian_manifests(args.corpus, args.debian_root, me, args.check)
    if args.check:
        return 1 if changed else 0
    print(f"{changed} manifests written by torch {me['torch']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
