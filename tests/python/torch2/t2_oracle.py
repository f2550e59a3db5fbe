"""Batched torch 2.x checks for the C++ interop tests (tests/interop-torch2.cpp, interop-corpus.cpp).

Usage: tools/sid-python tests/python/torch2/t2_oracle.py JOBS.json RESULTS.json

JOBS.json is a list of jobs; RESULTS.json gets one list of problems (strings) per job, in order.
Everything runs in this one process (torch and transformers imported once). The checks are
t2_check.py's, imported from there:

  {"kind": "torch", "path": F, "manifest": M}          torch.load(F) with the default
      weights_only=True, then with mmap=True, equal to M (t2_check.check_torch)
  {"kind": "globals", "path": F, "allowed": [G, ...]}  every global F's data.pkl names is in the
      list (what torch.save itself wrote for the same content), and torch 2.x's weights_only
      allow-list has each of them
  {"kind": "dcp", "path": D, "manifest": M}            dcp.load(no_dist=True) and
      format_utils.dcp_to_torch_save of D equal to M (t2_check.check_dcp)
  {"kind": "safetensors", "path": P, "manifest": M}    safetensors.safe_open (t2_check)
  {"kind": "hf", "path": D, "manifest": M, "config_from": S}   from_pretrained logits (t2_check)

M is a manifest path or an inline manifest object (its "_file" then says where its fixture is,
for the hf check's config.json). Exit status 0 when every job ran (whatever it found), 2 on bad
usage.
"""
import json
import os
import pickletools
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _t2 as T  # noqa: E402
import t2_check  # noqa: E402


def manifest_of(job):
    m = job["manifest"]
    if isinstance(m, str):
        path = m
        m = T.C.load_manifest(path)
        m["_file"] = path
    return m


def pickle_globals(path):
    """Every module.name a torch.save file's data.pkl names (GLOBAL and STACK_GLOBAL)."""
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        data = z.read(name)
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            found.add(f"{strings[-2]}.{strings[-1]}")
    return found


def check_globals(path, allowed):
    from torch.serialization import get_unsafe_globals_in_checkpoint
    problems = [f"names {g}, which torch.save does not write for this content" for g in sorted(pickle_globals(path) - set(allowed))]
    unsafe = get_unsafe_globals_in_checkpoint(path)
    problems += [f"names {g}, which torch's weights_only allow-list refuses" for g in unsafe]
    return problems


def run(job):
    kind = job["kind"]
    if kind == "globals":
        return check_globals(job["path"], job["allowed"])
    m = manifest_of(job)
    if kind == "torch":
        return t2_check.check_torch(job["path"], m, check_aliases=job.get("check_aliases", False))
    if kind == "dcp":
        return t2_check.check_dcp(job["path"], m)
    if kind == "safetensors":
        return t2_check.check_safetensors(job["path"], m)
    if kind == "hf":
        return t2_check.check_hf(job["path"], m, job.get("config_from"))
    return [f"unknown job kind {kind!r}"]


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        jobs = json.load(f)
    results = []
    for job in jobs:
        try:
            results.append(run(job))
        except Exception as e:  # a checker crash is a problem of that job, not of the batch
            results.append([f"{job.get('kind')} check raised {t2_check.one_line(e)}"])
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
