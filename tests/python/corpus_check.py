#!/usr/bin/python3
"""Check statedict against the real-world corpus manifests (tests/data/corpus).

Compare one saved `statedict inspect --json --hash` output with a manifest
(no torch needed):

    python3 tests/python/corpus_check.py MANIFEST INSPECT_JSON

Run the CLI over the whole corpus (inspect, and with --roundtrip the
conversion FILE -> .safetensors -> .pt, whose result torch.load must read
back equal to the manifest; that part needs torch: /usr/bin/python3, or
tools/sid-python for the dtypes torch 1.13 lacks):

    /usr/bin/python3 tests/python/corpus_check.py --statedict BIN [CORPUS] [--only ORIGIN]...
        [--roundtrip] [--workdir DIR] [--report OUT.json] [--debian-root DIR]

Exit 0 when everything agrees, 1 with one line per difference on stdout,
2 on bad usage.

What agrees, per item:
- statedict reads the file (exit 0) and lists exactly the manifest's tensors
  (dtype, shape, sha256) and values (type-aware: 1 is not 1.0);
- or statedict refuses it cleanly (exit 2, one line naming an error id) and
  the manifest says the refusal is right: the file is hostile (`malicious`),
  or PyTorch cannot load it either. A TorchScript archive is refused as well
  (not a torch.save file); the line says so with the tensors it holds. A file
  that pickles objects beyond torch's weights_only allow-list is read (the
  objects as data): refusing it is a difference. Objects are compared by class,
  the tensors they hold (`object_tensors`) under `<object>.state.`.
Anything else (a crash, a refusal of a file PyTorch reads, a difference) is
reported.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402

DEFAULT_CORPUS = os.path.normpath(os.path.join(HERE, "..", "data", "corpus"))
ERROR_ID = re.compile(r"\[(statedict\.[a-z_]+\.\d+)\]")


# --------------------------------------------------------------------------- comparison
def object_names(manifest):
    """Names of the manifest's values that are Python objects ({"object": "module.Class"})."""
    return {n for n, v in manifest.get("values", {}).items() if isinstance(v, dict) and "object" in v}


def under(name, prefixes):
    """The object name among `prefixes` that `name` is inside of, or None."""
    for p in prefixes:
        if name.startswith(p + "."):
            return p
    return None


def with_objects(manifest):
    """The manifest as statedict reads a file holding objects: an object is read as data, its
    attributes under `<name>.state.` (the flatten name of its BUILD state), so the tensors only
    objects hold (`object_tensors`, by attribute path) are tensors of the file there."""
    objs = object_names(manifest)
    if not objs or "object_tensors" not in manifest:
        return manifest
    m = dict(manifest)
    m["tensors"] = dict(manifest.get("tensors", {}))
    for name, entry in manifest["object_tensors"].items():
        p = under(name, objs)
        m["tensors"][p + ".state" + name[len(p):] if p else name] = entry
    return m


def compare(manifest, got, label):
    """Lines describing every difference between a manifest and an
    `inspect --json --hash` object (tensors by name, then values).

    A value the manifest records as an object ({"object": "module.Class", "repr"}) agrees with
    statedict's {"object": "module.Class", ...} of the same class, or, for an object holding
    tensors (which statedict lists inside it), with entries under its name."""
    out = []
    manifest = with_objects(manifest)
    objs = object_names(manifest)
    mt, gt = manifest.get("tensors", {}), got.get("tensors", {})
    for name in mt:
        if name not in gt:
            out.append(f"{label}: tensor {name!r} missing (manifest: {mt[name]['dtype']} {mt[name]['shape']})")
            continue
        for field in ("dtype", "shape", "sha256"):
            if field not in gt[name]:
                out.append(f"{label}: tensor {name!r}: no {field} in statedict's output")
            elif gt[name][field] != mt[name][field]:
                out.append(f"{label}: tensor {name!r}: {field} {gt[name][field]!r}, manifest {mt[name][field]!r}")
    for name in gt:
        if name not in mt:
            out.append(f"{label}: tensor {name!r} not in the manifest ({gt[name].get('dtype')} {gt[name].get('shape')})")
    mv, gv = manifest.get("values", {}), got.get("values", {})
    for name in mv:
        if name in objs:
            inside = any(n.startswith(name + ".") for n in list(gt) + list(gv))
            g = gv.get(name)
            if isinstance(g, dict) and g.get("object") == mv[name]["object"]:
                continue
            if g is None and inside:
                continue
            out.append(f"{label}: object {name!r}: {json.dumps(g)}, manifest {json.dumps(mv[name])}")
        elif name not in gv:
            out.append(f"{label}: value {name!r} missing (manifest: {json.dumps(mv[name])})")
        elif not C.values_equal(gv[name], mv[name]):
            out.append(f"{label}: value {name!r}: {json.dumps(gv[name])}, manifest {json.dumps(mv[name])}")
    for name in gv:
        if name not in mv and not under(name, objs):
            out.append(f"{label}: value {name!r} not in the manifest ({json.dumps(gv[name])})")
    return out


def refusal_is_right(manifest):
    """Why a clean refusal agrees with the manifest, or None."""
    if "malicious" in manifest:
        return f"hostile file (names {manifest['malicious']['forbidden_global']})"
    loads = [manifest.get(k, {}).get("loads") for k in ("torch_113", "torch_2")]
    if not any(loads) and not manifest.get("tensors") and not manifest.get("values"):
        return "PyTorch cannot load it either"
    if manifest.get("format") == "torchscript":
        return f"TorchScript archive, not a torch.save file ({len(manifest.get('tensors', {}))} tensors in its state_dict)"
    if "stub_load" in manifest:
        return "needs a project's own classes (stub_load)"
    return None


# --------------------------------------------------------------------------- corpus
def corpus_items(root, only, debian_root):
    """(label, path to give statedict, manifest path)."""
    for origin in sorted(os.listdir(root)):
        od = os.path.join(root, origin)
        if not os.path.isdir(od) or origin in ("LICENSES",) or (only and origin not in only):
            continue
        for dirpath, dirnames, filenames in os.walk(od):
            dirnames.sort()
            for fn in sorted(filenames):
                if not fn.endswith(".manifest.json"):
                    continue
                mpath = os.path.join(dirpath, fn)
                if origin == "debian":
                    if not debian_root:
                        continue
                    m = C.load_manifest(mpath)
                    target = os.path.join(debian_root, m["path"].lstrip("/"))
                    if not os.path.exists(target):
                        continue
                    yield os.path.relpath(mpath, root)[:-len(".manifest.json")], target, mpath
                else:
                    target = mpath[:-len(".manifest.json")]
                    yield os.path.relpath(target, root), target, mpath


def run(cmd, timeout=120):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        return None, "", f"timed out after {timeout} s"


def failure(stderr):
    line = next((l for l in stderr.splitlines() if l.strip()), "")
    m = ERROR_ID.search(line)
    return (m.group(1) if m else None), line


def torch_lacks(manifest):
    """dtypes of the manifest that this torch cannot load, if any."""
    import torch
    names = set(C.TORCH_DTYPE_NAMES.values())
    if not torch.__version__.startswith("1."):
        return set()
    return {e["dtype"] for e in manifest.get("tensors", {}).values()} - names


def roundtrip(bin_, label, path, manifest, work):
    """FILE -> x.safetensors -> x.pt with statedict; torch.load(x.pt) must
    equal the manifest's tensors (values do not survive safetensors)."""
    out, rec = [], []
    st = os.path.join(work, "x.safetensors")
    pt = os.path.join(work, "x.pt")
    for f in (st, pt):
        if os.path.exists(f):
            os.remove(f)
    for src, dst in ((path, st), (st, pt)):
        cmd = [bin_, "convert", src, dst]
        rc, so, se = run(cmd)
        eid, line = failure(se)
        step = f"convert {'FILE' if src == path else 'x.safetensors'} {os.path.basename(dst)}"
        rec.append({"command": step, "rc": rc, "error_id": eid, "message": line})
        if rc != 0:
            out.append(f"{label}: {step}: exit {rc}: {line}")
            return out, rec
    lacks = torch_lacks(manifest)
    if lacks:
        rec.append({"command": "torch.load x.pt", "skipped": f"this torch has no {sorted(lacks)}"})
        return out, rec
    import torch
    try:
        try:
            obj = torch.load(pt, map_location="cpu")
        except Exception as e:
            # statedict's writer names torch.UntypedStorage (uint16/32/64, float8 storages) where
            # torch 2.x's weights_only list has torch.storage.UntypedStorage: the same torch
            # class, allowed by that name for this load; any other global still fails.
            if "GLOBAL torch.UntypedStorage was not an allowed global" not in str(e):
                raise
            with torch.serialization.safe_globals([(torch.UntypedStorage, "torch.UntypedStorage")]):
                obj = torch.load(pt, map_location="cpu")
    except Exception as e:
        msg = " ".join(str(e).split())
        key = "WeightsUnpickler error: "
        if key in msg:
            msg = msg[msg.index(key):]
        out.append(f"{label}: torch {torch.__version__} torch.load of the converted x.pt (default weights_only): "
                   f"{type(e).__name__}: {msg[:300]}")
        rec.append({"command": "torch.load x.pt", "ok": False, "message": msg[:300]})
        try:  # our own output: what it holds still matters
            obj = torch.load(pt, map_location="cpu", weights_only=False)
        except Exception:
            return out, rec
    entry = C.tensor_entry
    if not torch.__version__.startswith("1."):
        sys.path.insert(0, os.path.join(HERE, "torch2"))
        import _t2 as T2

        def entry(x):
            # a fresh 1-d copy: its stride is 1 whatever the sizes, so it views as bytes
            flat = torch.empty(x.numel(), dtype=x.dtype)
            flat.copy_(x.detach().cpu().reshape(-1))
            raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            return {"dtype": T2.dtype_name(x.dtype), "shape": list(x.shape), "sha256": C.sha256_hex(raw)}
    t, v, a = C.flatten(obj, tensor_entry_fn=entry)
    # Objects were written as their data: the tensors they held are at their attribute paths.
    expect = dict(manifest["tensors"])
    expect.update(manifest.get("object_tensors", {}))
    diffs = compare({"tensors": expect}, {"tensors": t}, f"{label}: x.pt")
    rec.append({"command": "torch.load x.pt", "ok": not diffs, "differences": diffs})
    return out + diffs, rec


def check_corpus(args):
    problems, report = [], []
    work = args.workdir or tempfile.mkdtemp(prefix="corpus_check.")
    os.makedirs(work, exist_ok=True)
    for label, path, mpath in corpus_items(args.corpus, set(args.only), args.debian_root):
        manifest = C.load_manifest(mpath)
        item = {"file": label, "format": manifest.get("format")}
        rc, so, se = run([args.statedict, "inspect", "--json", "--hash", path])
        eid, line = failure(se)
        item["inspect"] = {"rc": rc, "error_id": eid, "message": line}
        if rc == 0:
            try:
                got = json.loads(so)
            except ValueError as e:
                problems.append(f"{label}: inspect: output is not JSON ({e})")
                item["inspect"]["ok"] = False
                report.append(item)
                continue
            item["statedict_format"] = got.get("format")
            diffs = compare(manifest, got, f"{label}: inspect")
            why = refusal_is_right(manifest)
            if "malicious" in manifest:
                diffs.insert(0, f"{label}: inspect: read a hostile file without refusing it")
            item["inspect"]["ok"] = not diffs
            item["inspect"]["differences"] = diffs
            problems += diffs
            if args.roundtrip and not diffs and (manifest.get("tensors") or manifest.get("object_tensors")):
                more, rec = roundtrip(args.statedict, label, path, manifest, work)
                item["roundtrip"] = rec
                problems += more
        elif rc == 2 and eid:
            why = refusal_is_right(manifest)
            item["inspect"]["ok"] = why is not None
            item["inspect"]["why_right"] = why
            if why is None:
                problems.append(f"{label}: inspect: refused a file PyTorch reads: {line}")
        else:
            item["inspect"]["ok"] = False
            problems.append(f"{label}: inspect: exit {rc} without an error id: {line or se[:200]}")
        report.append(item)
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1, ensure_ascii=False)
    return problems


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("paths", nargs="*", help="MANIFEST INSPECT_JSON, or with --statedict: [CORPUS]")
    ap.add_argument("--statedict", metavar="BIN", help="the statedict executable: check the whole corpus")
    ap.add_argument("--only", action="append", default=[], help="origin folder name (repeatable)")
    ap.add_argument("--roundtrip", action="store_true", help="also convert to .safetensors and back to .pt")
    ap.add_argument("--workdir", help="where the round trip writes (default: a new temporary folder)")
    ap.add_argument("--report", help="write every command's result here as JSON")
    ap.add_argument("--debian-root", metavar="DIR",
                    help="also check the Debian-shipped files of corpus/debian, found under DIR ('/' when installed)")
    args = ap.parse_args(argv)
    if args.statedict:
        if len(args.paths) > 1:
            ap.error("--statedict takes at most one CORPUS folder")
        args.corpus = args.paths[0] if args.paths else DEFAULT_CORPUS
        problems = check_corpus(args)
    else:
        if len(args.paths) != 2:
            ap.error("give MANIFEST and INSPECT_JSON, or --statedict BIN")
        with open(args.paths[1], encoding="utf-8") as f:
            got = json.load(f)
        problems = compare(C.load_manifest(args.paths[0]), got, args.paths[1])
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
