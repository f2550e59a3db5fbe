"""Self-test of the torch2 checkers: each fixture passes its own manifest, and a manifest with
one tensor's sha256 changed, one value changed, or a missing tensor fails with that problem.

Usage: tools/sid-python tests/python/torch2/t2_selftest.py FIXTURES
(FIXTURES: the folder tests/python/torch2/generate_all.sh wrote). Exit 0 when all behave.
"""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _t2 as T  # noqa: E402
import t2_check  # noqa: E402

CASES = [  # (mode, generator folder, case, keyword arguments of the check)
    ("torch", "gen_t2_torch", "training_state", {}),
    ("torch", "gen_t2_torch", "dtypes", {}),
    ("torch", "gen_t2_torch", "tied_views", {"check_aliases": True}),
    ("torch", "gen_t2_objects", "numpy_arrays_p5", {"full": True, "mmap": False}),
    ("dcp", "gen_t2_dcp", "dcp_dtensor_w3", {}),
    ("dcp", "gen_t2_dcp", "dcp_fsdp2_w2", {}),
    ("safetensors", "gen_t2_safetensors", "st_all_dtypes", {}),
    ("safetensors", "gen_t2_safetensors", "hf_llama", {}),
    ("hf", "gen_t2_safetensors", "hf_gpt2", {}),
]


def run(mode, path, manifest, kw):
    fn = {"torch": t2_check.check_torch, "dcp": t2_check.check_dcp,
          "safetensors": t2_check.check_safetensors, "hf": t2_check.check_hf}[mode]
    return fn(path, manifest, **kw)


def broken(manifest, mode):
    """(label, manifest, text the problems must contain)"""
    out = []
    names = list(manifest["tensors"])
    m = copy.deepcopy(manifest)
    m["tensors"][names[0]]["sha256"] = "0" * 64
    out.append(("sha256", m, names[0]))
    m = copy.deepcopy(manifest)
    extra = "no.such.tensor"
    m["tensors"][extra] = {"dtype": "F32", "shape": [1], "sha256": "0" * 64}
    out.append(("missing", m, extra))
    if mode in ("torch", "dcp") and manifest["values"]:
        m = copy.deepcopy(manifest)
        k = next(iter(m["values"]))
        m["values"][k] = {"object": "nothing", "repr": "changed"}
        out.append(("value", m, k))
    if mode == "hf":
        m = copy.deepcopy(manifest)
        m["hf"]["logits_sha256"] = "0" * 64
        out = [("logits", m, "logits differ")]
    return out


def main(argv):
    if len(argv) != 2:
        print("usage: t2_selftest.py FIXTURES", file=sys.stderr)
        return 2
    fixtures, failures = argv[1], 0
    for mode, gen, case, kw in CASES:
        mp = os.path.join(fixtures, gen, case + ".manifest.json")
        manifest = T.C.load_manifest(mp)
        manifest["_file"] = mp
        path = os.path.join(fixtures, gen, manifest["path"])
        problems = run(mode, path, manifest, kw)
        if problems:
            failures += 1
            print(f"FAIL {mode} {case}: its own manifest gives {problems[:3]}")
        for label, m, needle in broken(manifest, mode):
            problems = run(mode, path, m, kw)
            if not any(needle in p for p in problems):
                failures += 1
                print(f"FAIL {mode} {case}: broken manifest ({label}) not caught: {problems[:3]}")
        print(f"ok   {mode} {case}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
