#!/usr/bin/python3
"""Self-test of the fixture generators and checkers (not of statedict itself).

Usage: /usr/bin/python3 tests/python/selftest.py [WORKDIR] [--no-dcp]

Generates every fixture into WORKDIR (default: a temp dir, removed after),
then checks that the checkers accept each fixture against its own manifest
and reject deliberately broken files / manifests with the expected reason.
--no-dcp skips the dcp_load_check runs (the slow part, ~4 s each).
Exit 0 when every expectation holds.
"""
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = "/usr/bin/python3"
failures = []


def run(args, timeout=300):
    t = time.time()
    r = subprocess.run([PY] + args, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr, time.time() - t


def expect(label, args, rc, contains=None):
    code, out, err, dt = run(args)
    ok = code == rc and (contains is None or contains in out)
    print(f"{'ok  ' if ok else 'FAIL'} {label} (rc {code}, {dt:.1f}s)")
    if not ok:
        failures.append(label)
        print("     stdout:", out.strip()[-600:])
        print("     stderr:", err.strip()[-600:])


def expect_inproc(label, argv, rc, contains=None):
    """Like expect() for torch_check.py, but in this process (saves a torch import per call)."""
    import contextlib
    import io
    sys.path.insert(0, HERE)
    import torch_check
    out = io.StringIO()
    t = time.time()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = torch_check.main(["torch_check.py"] + argv)
    ok = code == rc and (contains is None or contains in out.getvalue())
    print(f"{'ok  ' if ok else 'FAIL'} {label} (rc {code}, {time.time() - t:.1f}s, in-process)")
    if not ok:
        failures.append(label)
        print("     stdout:", out.getvalue().strip()[-600:])


def tool(name):
    return os.path.join(HERE, name)


def manifests(d):
    for n in sorted(os.listdir(d)):
        if n.endswith(".manifest.json"):
            p = os.path.join(d, n)
            with open(p, encoding="utf-8") as f:
                yield n[:-len(".manifest.json")], p, json.load(f)


def bad_safetensors(work):
    """(name, bytes, expected rule) for the strict reader."""
    def f(header, data=b"", n=None):
        hb = header.encode() if isinstance(header, str) else header
        return struct.pack("<Q", len(hb) if n is None else n) + hb + data

    one = '{"weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    return [
        ("small", b"\x01\x00", "HeaderTooSmall"),
        ("large", f("{}", n=200_000_000), "HeaderTooLarge"),
        ("len", f("{}", n=100), "InvalidHeaderLength"),
        ("utf8", f(b'{"\xff":1}     '), "InvalidHeader:"),
        ("start", f(" {}     "), "InvalidHeaderStart"),
        ("json", f('{"a":}  '), "InvalidHeaderDeserialization"),
        ("dtype", f(one.replace("F32", "F33").ljust(64), b"\0" * 4), "InvalidHeaderDeserialization"),
        ("meta", f('{"__metadata__":{"a":1}}'.ljust(32)), "InvalidHeaderDeserialization"),
        ("offset", f(one.replace("[0,4]", "[4,8]").ljust(64), b"\0" * 8), "InvalidOffset"),
        ("info", f(one.replace("[1]", "[2]").ljust(64), b"\0" * 4), "TensorInvalidInfo"),
        ("misaligned", f(one.replace("F32", "F4").replace("[1]", "[3]").replace("[0,4]", "[0,2]").ljust(64),
                         b"\0" * 2), "MisalignedSlice"),
        ("overflow", f(one.replace("[1]", "[4294967296,4294967296]").ljust(80), b"\0" * 4), "ValidationOverflow"),
        ("incomplete", f(one.ljust(64), b"\0" * 5), "MetadataIncompleteBuffer"),
        ("dup", f(('{"weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                   '"weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}').ljust(112), b"\0" * 4),
         "DuplicateKey"),
        ("pad", f((one + "\n").ljust(64), b"\0" * 4), "HeaderPaddingNotSpaces"),
        ("notaligned", f(one, b"\0" * 4), "HeaderNotAligned"),
        ("extra", f(one.replace("[0,4]}", "[0,4],\"x\":1}").ljust(72), b"\0" * 4), "UnknownTensorField"),
    ]


def main(argv):
    args = [a for a in argv[1:] if not a.startswith("--")]
    no_dcp = "--no-dcp" in argv
    work = args[0] if args else tempfile.mkdtemp(prefix="statedict_selftest_")
    keep = bool(args)
    os.makedirs(work, exist_ok=True)
    fx = os.path.join(work, "fixtures")
    try:
        # ------------------------------------------------------------ generate
        total = 0.0
        for gen in ("gen_torch_files.py", "gen_safetensors.py", "gen_sharded.py"):
            code, out, err, dt = run([tool(gen), fx])
            total += dt
            print(f"{'ok  ' if code == 0 else 'FAIL'} generate {gen} ({dt:.1f}s)")
            if code:
                failures.append(gen)
                print(err[-2000:])
                return 1
        print(f"     generation total {total:.1f}s")

        # ------------------------------------------------------------ positive
        for case, mpath, m in manifests(fx):
            target = os.path.join(fx, m["path"])
            if "malicious" in m:
                continue
            if m["format"] in ("torch", "torch_legacy"):
                expect_inproc(f"torch_check {case}", [target, mpath, "--check-aliases"], 0)
                if m.get("torch_weights_only", {}).get("loads"):
                    expect_inproc(f"torch_check --weights-only {case}", [target, mpath, "--weights-only"], 0)
            elif m["format"] == "safetensors":
                mode = "--canonical" if m.get("canonical") else "--lenient"
                expect_inproc(f"torch_check --safetensors {mode} {case}", ["--safetensors", target, mpath, mode], 0)

        # ------------------------------------------------------------ negative: torch
        m = json.load(open(os.path.join(fx, "model_optim.manifest.json")))
        m["tensors"]["model.emb.weight"]["sha256"] = "0" * 64
        m["values"]["optim.param_groups.1.lr"] = 0.1
        m["values"]["missing.value"] = 1
        bad = os.path.join(work, "bad_model_optim.manifest.json")
        json.dump(m, open(bad, "w"))
        expect("torch_check rejects a wrong sha", [tool("torch_check.py"), os.path.join(fx, "model_optim.pt"), bad],
               1, "model.emb.weight: sha256")
        expect("torch_check rejects a wrong value", [tool("torch_check.py"), os.path.join(fx, "model_optim.pt"), bad],
               1, "optim.param_groups.1.lr: value 0.0005 != expected 0.1")
        expect("torch_check reports a missing name", [tool("torch_check.py"), os.path.join(fx, "model_optim.pt"), bad],
               1, "missing.value: value missing")
        expect("torch_check --weights-only fails on floats (torch 1.13)",
               [tool("torch_check.py"), os.path.join(fx, "model_optim.pt"),
                os.path.join(fx, "model_optim.manifest.json"), "--weights-only"], 1, "Unsupported operand 71")
        expect("torch_check --expect-tied holds", [tool("torch_check.py"), os.path.join(fx, "tied.pt"),
               os.path.join(fx, "tied.manifest.json"), "--expect-tied", "a", "b",
               "--expect-tied", "base", "base_t"], 0)
        expect("torch_check --expect-tied rejects", [tool("torch_check.py"), os.path.join(fx, "tied.pt"),
               os.path.join(fx, "tied.manifest.json"), "--expect-tied", "a", "base"], 1, "do not share storage")

        # ------------------------------------------------------------ negative: safetensors
        for name, blob, rule in bad_safetensors(work):
            p = os.path.join(work, f"bad_{name}.safetensors")
            open(p, "wb").write(blob)
            expect_inproc(f"strict reader: {rule}", ["--safetensors", p,
                          os.path.join(fx, "one_tensor.manifest.json")], 1, rule)
        expect("strict reader: NotCanonical", [tool("torch_check.py"), "--safetensors",
               os.path.join(fx, "misaligned.safetensors"), os.path.join(fx, "misaligned.manifest.json"),
               "--canonical"], 1, "NotCanonical")

        # ------------------------------------------------------------ DCP
        if not no_dcp:
            for case, m_, extra in (("dcp_w2", "2", []), ("dcp_w3", "3", []), ("dcp_w4", "2", []),
                                    ("dcp_w4_single_file", "3", []), ("dcp_w3", "2", ["--shard-dim", "1"]),
                                    ("dcp_w2_single_file", "3", ["--receive", "plain"])):
                expect(f"dcp_load_check {case} M={m_} {' '.join(extra)}",
                       [tool("dcp_load_check.py"), os.path.join(fx, case),
                        os.path.join(fx, case + ".manifest.json"), m_] + extra, 0)
            make_broken_dcp(fx, work)
            expect("dcp_load_check: hole", [tool("dcp_load_check.py"), os.path.join(work, "dcp_hole"),
                   os.path.join(fx, "dcp_w4.manifest.json"), "2"], 1, "chunks cover 36 of 54 elements")
            expect("dcp_load_check: wrong chunk dtype", [tool("dcp_load_check.py"), os.path.join(work, "dcp_dtype"),
                   os.path.join(fx, "dcp_w2.manifest.json"), "2"], 1, "is torch.float64, .metadata says torch.float32")
            expect("dcp_load_check: wrong manifest", [tool("dcp_load_check.py"), os.path.join(fx, "dcp_w4"),
                   os.path.join(fx, "dcp_w3.manifest.json"), "2"], 1, ".metadata size [9, 6] != expected [7, 6]")

        # ------------------------------------------------------------ never loaded
        m = json.load(open(os.path.join(fx, "malicious_os_system.manifest.json")))
        ok = not os.path.exists(m["malicious"]["sentinel"])
        print(f"{'ok  ' if ok else 'FAIL'} malicious sentinel not created")
        if not ok:
            failures.append("sentinel")
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{len(failures)} failure(s)" if failures else "all ok")
    return 1 if failures else 0


def make_broken_dcp(fx, work):
    sys.path.insert(0, HERE)
    import _common as C
    C.install_shim()
    import io
    import torch
    from torch.distributed._shard.checkpoint.metadata import MetadataIndex

    hole = os.path.join(work, "dcp_hole")
    shutil.rmtree(hole, ignore_errors=True)
    shutil.copytree(os.path.join(fx, "dcp_w4"), hole)
    md = pickle.load(open(os.path.join(hole, ".metadata"), "rb"))
    md.state_dict_metadata["model.embed.weight"].chunks.pop()
    pickle.dump(md, open(os.path.join(hole, ".metadata"), "wb"))

    bad = os.path.join(work, "dcp_dtype")
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(os.path.join(fx, "dcp_w2"), bad)
    md = pickle.load(open(os.path.join(bad, ".metadata"), "rb"))
    key = MetadataIndex("model.embed.weight", torch.Size([0, 0]))
    info = md.storage_data[key]
    path = os.path.join(bad, info.relative_path)
    with open(path, "rb") as f:
        f.seek(info.offset)
        t = torch.load(io.BytesIO(f.read(info.length)))
    buf = io.BytesIO()
    torch.save(t.double(), buf)
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    md.storage_data[key] = type(info)(info.relative_path, 0, len(buf.getvalue()))
    pickle.dump(md, open(os.path.join(bad, ".metadata"), "wb"))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
