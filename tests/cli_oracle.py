#!/usr/bin/python3
"""Batched PyTorch 1.13 checks for the tests/cli-*.cpp end-to-end tests of the statedict tool.

Usage: /usr/bin/python3 tests/cli_oracle.py JOBS.json RESULTS.json

JOBS.json is a list of jobs; RESULTS.json gets one list of problems (strings) per job, in order.
Everything runs in this one process (torch imported once), and the DCP loads of one world size
share one set of gloo processes, so hundreds of checks cost seconds, not minutes. The checks are
those of tests/python/torch_check.py and tests/python/dcp_load_check.py, imported from there.

  {"kind": "torch", "file": F, "manifest": M}
      torch.load(F) equals manifest M (dtype, shape, sha256 of every tensor, every value) and
      every manifest alias shares storage after loading (torch_check.py --check-aliases).
  {"kind": "safetensors", "file": F, "manifest": M}
      torch_check.py's strict safetensors reader; tensors compared with M's tensors except its
      aliases (stored once), values and metadata ignored (safetensors holds neither).
  {"kind": "dcp", "dir": D, "manifest": M, "world_size": W}
      dcp_load_check.py D M W: static checks, then PyTorch's own DCP reader on W gloo processes
      into ShardedTensor receivers chunked on dim 0, compared with M.
  {"kind": "cast", "orig": A, "cast": B, "dtype": "BF16", "rename": {OLD: NEW or null}, "aliases": {N: T}}
      torch.load A (and B, or B read by the strict safetensors reader when it is a .safetensors
      file or a Hugging Face sharded directory):
      every floating tensor of B equals A's .to(dtype) bit for bit, every other tensor and value of
      B equals A's, and B has A's names after "rename" (optional: a name mapped to null is
      dropped). "aliases" (optional, B's names): each pair shares storage in B; in a .safetensors
      B, where ties are stored once, the tied names are absent and values are not compared.
      "keep" (optional, A's names): floating tensors the cast leaves as they are.

M is a path or an inline manifest object. Exit status 0 when every job ran (whatever it found),
2 on bad usage.
"""
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "python"))
import _common as C  # noqa: E402

C.install_shim()

import torch  # noqa: E402

import torch_check  # noqa: E402


def manifest_of(job):
    m = job["manifest"]
    if isinstance(m, str):
        return C.load_manifest(m)
    return m


def safetensors_leaves(path):
    if os.path.isdir(path):  # a Hugging Face directory: every shard its index names, or one file
        index = os.path.join(path, "model.safetensors.index.json")
        if not os.path.exists(index):
            return safetensors_leaves(os.path.join(path, "model.safetensors"))
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        out = {}
        for name in files:
            out.update(safetensors_leaves(os.path.join(path, name)))
        return out
    entries, _, _, start, blob = torch_check.read_safetensors(path, strict=True)
    out = {}
    for name, dt, shape, s, e in entries:
        dtype = C.torch_dtype(dt)
        flat = torch.frombuffer(bytearray(blob[start + s:start + e]), dtype=dtype) if e > s else torch.empty(0, dtype=dtype)
        out[name] = flat.reshape(shape)
    return out


def check_cast(job):
    dtype = C.torch_dtype(job["dtype"])
    rename = job.get("rename", {})
    aliases = job.get("aliases", {})
    keep = {rename.get(n, n) for n in job.get("keep", [])}
    la = {}
    for n, x in torch_check.leaf_map(torch.load(job["orig"], map_location="cpu")).items():
        to = rename.get(n, n)
        if to is not None:
            la[to] = x
    # Values the renaming changes (an optimizer's parameter names in param_groups).
    la.update(job.get("renamed_values", {}))
    problems = []
    if job["cast"].endswith(".safetensors") or os.path.isdir(job["cast"]):
        lb = safetensors_leaves(job["cast"])
        la = {n: x for n, x in la.items() if C.is_tensor(x) and n not in aliases}
    else:
        lb = torch_check.leaf_map(torch.load(job["cast"], map_location="cpu"))
        for a, t in aliases.items():
            if a not in lb or t not in lb:
                problems.append(f"{a}: tied to {t}, but {'/'.join(n for n in (a, t) if n not in lb)} not in the cast file")
            elif not torch_check.shares_storage(lb[a], lb[t]):
                problems.append(f"{a}: tied to {t}, but they do not share storage in the cast file")
    problems += [f"{n}: only in the cast file" for n in lb if n not in la]
    for n, x in la.items():
        if n not in lb:
            problems.append(f"{n}: missing from the cast file")
            continue
        y = lb[n]
        if C.is_tensor(x):
            if not C.is_tensor(y):
                problems.append(f"{n}: not a tensor in the cast file")
                continue
            want = x.detach().to(dtype) if x.is_floating_point() and n not in keep else x.detach()
            if want.dtype != y.dtype or list(want.shape) != list(y.shape):
                problems.append(f"{n}: {y.dtype} {list(y.shape)}, torch gives {want.dtype} {list(want.shape)}")
            elif C.tensor_bytes(want) != C.tensor_bytes(y):
                w, g = want.contiguous().view(-1), y.contiguous().view(-1)
                # NaN bits are not compared: torch 1.13's own f64 -> bf16 cast writes 0xffff for a NaN
                # inside a full vector block and 0x7fc0 in the scalar tail, so they depend on the
                # position and the CPU's vector width.
                same = (w == g) | (torch.isnan(w) & torch.isnan(g)) if w.is_floating_point() else (w == g)
                if bool(same.all()) and w.is_floating_point():
                    bits = w.view(torch.int16) if w.dtype == torch.bfloat16 else w
                    gbits = g.view(torch.int16) if g.dtype == torch.bfloat16 else g
                    if torch.equal(bits[~torch.isnan(w)], gbits[~torch.isnan(w)]):
                        continue
                diff = (~same).nonzero()
                i = int(diff[0]) if len(diff) else -1
                problems.append(f"{n}: values differ from torch's .to({dtype}); first at flat index {i}: "
                                f"original {x.contiguous().view(-1)[i].item()!r}, torch {want.view(-1)[i].item()!r}, "
                                f"file {y.contiguous().view(-1)[i].item()!r}")
        elif not C.values_equal(C.json_value(x), C.json_value(y)):
            problems.append(f"{n}: value {C.json_value(y)!r} != {C.json_value(x)!r}")
    return problems


def check_safetensors(job):
    m = manifest_of(job)
    aliases = m.get("aliases", {})
    tensors = {n: t for n, t in m.get("tensors", {}).items() if n not in aliases}
    return torch_check.check_safetensors(job["file"], {"tensors": tensors}, strict=True)


# --------------------------------------------------------------------------- DCP, batched per world size
def dcp_prepare(job, tmp, i):
    """dcp_load_check.main up to the load: static problems, receiver specs, byte keys."""
    import dcp_load_check as L
    from torch.distributed._shard.checkpoint.metadata import TensorStorageMetadata
    manifest = manifest_of(job)
    path = os.path.abspath(job["dir"])
    try:
        md = L.read_metadata(path)
    except Exception as e:
        return None, [f"cannot read {os.path.join(job['dir'], '.metadata')}: {type(e).__name__}: {e}"]
    problems = L.static_checks(path, md, manifest)
    specs, byte_keys = {}, []
    exp = manifest.get("tensors", {})
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            if fqn in exp:
                spec = (exp[fqn]["dtype"], list(exp[fqn]["shape"]))
            else:
                try:
                    spec = (C.dtype_name(m.properties.dtype), list(m.size))
                except ValueError:
                    problems.append(f"{fqn}: unexpected tensor of dtype {m.properties.dtype}")
                    continue
            try:
                C.torch_dtype(spec[0])
            except ValueError:
                problems.append(f"{fqn}: dtype {spec[0]} cannot be received by torch 1.13; not loaded")
                continue
            specs[fqn] = spec
        else:
            byte_keys.append(fqn)
    result_file = os.path.join(tmp, f"result{i}.json")
    with open(result_file + ".manifest", "w") as f:
        json.dump(manifest, f)
    return (path, specs, byte_keys, result_file), problems


def dcp_batch_worker(rank, ws, items):
    import dcp_load_check as L
    for path, specs, byte_keys, result_file in items:
        L.worker(rank, ws, path, specs, byte_keys, "sharded", 0, result_file)


def run_dcp_jobs(jobs, results):
    import _dist as D
    tmp = tempfile.mkdtemp(prefix="statedict_cli_oracle_")
    try:
        by_ws = {}
        for i, job in jobs:
            prepared, problems = dcp_prepare(job, tmp, i)
            results[i] = problems
            if prepared is not None:
                by_ws.setdefault(int(job["world_size"]), []).append((i, prepared))
        for ws, items in sorted(by_ws.items()):
            try:
                D.run(dcp_batch_worker, ws, [p for _, p in items])
            except Exception as e:
                msg = [ln for ln in str(e).strip().splitlines() if ln.strip()]
                for i, _ in items:
                    results[i].append(f"PyTorch DCP load failed (M={ws}): {msg[-1] if msg else type(e).__name__}")
                continue
            for i, p in items:
                try:
                    with open(p[3]) as f:
                        results[i] += json.load(f)
                except OSError as e:
                    results[i].append(f"no result from the DCP load (M={ws}): {e}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv):
    if len(argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        jobs = json.load(f)
    results = [None] * len(jobs)
    dcp_jobs = []
    for i, job in enumerate(jobs):
        kind = job.get("kind")
        try:
            if kind == "torch":
                results[i] = torch_check.check_torch(job["file"], manifest_of(job), check_aliases=True)
            elif kind == "safetensors":
                results[i] = check_safetensors(job)
            elif kind == "cast":
                results[i] = check_cast(job)
            elif kind == "dcp":
                dcp_jobs.append((i, job))
            else:
                results[i] = [f"unknown job kind {kind!r}"]
        except Exception as e:
            results[i] = [f"{kind} check raised {type(e).__name__}: {' '.join(str(e).split())[:400]}"]
    if dcp_jobs:
        run_dcp_jobs(dcp_jobs, results)
    with open(argv[2], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
