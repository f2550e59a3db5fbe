"""Run the statedict CLI over every torch2 fixture and check what it says and writes with torch 2.x.

Usage: tools/sid-python tests/python/torch2/cli_report.py STATEDICT FIXTURES WORKDIR [--json OUT]

FIXTURES is the folder generate_all.sh wrote (one subfolder per generator). Per fixture:
  inspect   statedict inspect --json --hash SRC, compared with the manifest
  to_pt     statedict convert SRC WORKDIR/.../<case>.pt, then t2_check torch (weights_only and mmap)
  to_dcp    (DCP fixtures) statedict convert SRC OUT --to dcp --world-size 2, then t2_check dcp
  to_st     (safetensors files) statedict convert SRC OUT.safetensors, then t2_check safetensors
  to_hf     (Hugging Face folders) statedict convert SRC OUT --to safetensors --max-shard-size
            20KB, then t2_check safetensors and t2_check hf (config.json from the fixture)
Prints a Markdown table (fixture, step, result: ok, the CLI's error id and name and message, or
the checker's problems) and exits 0; the table is the report, not a pass/fail verdict.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _t2 as T  # noqa: E402
import t2_check  # noqa: E402
from torch_check import compare_with_manifest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


def error_names():
    """{id: name} from docs/errors.md."""
    names = {}
    try:
        with open(os.path.join(REPO, "docs", "errors.md"), encoding="utf-8") as f:
            for line in f:
                m = re.match(r"\|\s*(\d+)\s*\|\s*`([^`]+)`", line)
                if m:
                    names[m.group(1)] = m.group(2)
    except OSError:
        pass
    return names


ERRORS = error_names()


def cli(statedict, *args):
    p = subprocess.run([statedict, *args], capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def cli_error(rc, err):
    line = next((x for x in err.splitlines() if x.strip()), "").strip()
    m = re.search(r"\[statedict\.(\w+)\.(\d+)\]\s*(.*)", line)
    if m:
        return f"exit {rc}: {m.group(2)} `{ERRORS.get(m.group(2), m.group(1))}`: {m.group(3)}"
    return f"exit {rc}: {line}"


def summarize(problems, limit=3):
    if not problems:
        return "ok"
    head = "; ".join(problems[:limit])
    more = f" (+{len(problems) - limit} more)" if len(problems) > limit else ""
    return f"{len(problems)} problem(s): {head}{more}"


def run_fixture(statedict, gen, manifest_path, work):
    m = T.C.load_manifest(manifest_path)
    m["_file"] = manifest_path
    case = os.path.basename(manifest_path)[:-len(".manifest.json")]
    src = os.path.join(os.path.dirname(manifest_path), m["path"])
    out_dir = os.path.join(work, gen)
    os.makedirs(out_dir, exist_ok=True)
    rows = []

    rc, out, err = cli(statedict, "inspect", "--json", "--hash", src)
    if rc:
        rows.append(("inspect", cli_error(rc, err)))
    else:
        try:
            got = json.loads(out)
            rows.append(("inspect", summarize(compare_with_manifest(m, got.get("tensors", {}), got.get("values", {}),
                                                                    label="inspect"))))
        except ValueError as e:
            rows.append(("inspect", f"inspect --json printed no JSON: {e}"))

    pt = os.path.join(out_dir, case + ".pt")
    rc, out, err = cli(statedict, "convert", src, pt)
    rows.append(("to_pt", cli_error(rc, err) if rc else summarize(t2_check.check_torch(pt, m))))

    fmt = m.get("format")
    if fmt == "dcp":
        d = os.path.join(out_dir, case + "_dcp2")
        shutil.rmtree(d, ignore_errors=True)
        rc, out, err = cli(statedict, "convert", src, d, "--to", "dcp", "--world-size", "2")
        rows.append(("to_dcp", cli_error(rc, err) if rc else summarize(t2_check.check_dcp(d, m))))
    elif fmt == "safetensors":
        st = os.path.join(out_dir, case + ".safetensors")
        rc, out, err = cli(statedict, "convert", src, st)
        rows.append(("to_st", cli_error(rc, err) if rc else summarize(t2_check.check_safetensors(st, m))))
    elif fmt in ("hf_safetensors", "hf_torch"):
        d = os.path.join(out_dir, case + "_hf")
        shutil.rmtree(d, ignore_errors=True)
        rc, out, err = cli(statedict, "convert", src, d, "--to", "safetensors", "--max-shard-size", "20KB")
        if rc:
            rows.append(("to_hf", cli_error(rc, err)))
        else:
            rows.append(("to_hf", summarize(t2_check.check_safetensors(d, m) + t2_check.check_hf(d, m, src))))
    return [(f"{gen}/{case}", step, res) for step, res in rows]


def main(argv):
    args = argv[1:]
    json_out = None
    if "--json" in args:
        i = args.index("--json")
        json_out = args[i + 1]
        del args[i:i + 2]
    if len(args) != 3:
        print("usage: cli_report.py STATEDICT FIXTURES WORKDIR [--json OUT]", file=sys.stderr)
        return 2
    statedict, fixtures, work = args
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    rows = []
    for mp in sorted(glob.glob(os.path.join(fixtures, "*", "*.manifest.json"))):
        gen = os.path.basename(os.path.dirname(mp))
        rows += run_fixture(statedict, gen, mp, work)
    print("| fixture | step | result |")
    print("|---|---|---|")
    for r in rows:
        print("| " + " | ".join(x.replace("|", "\\|") for x in r) + " |")
    ok = sum(1 for r in rows if r[2] == "ok")
    print(f"\n{ok} of {len(rows)} steps ok")
    if json_out:
        with open(json_out, "w") as f:
            json.dump([{"fixture": a, "step": b, "result": c} for a, b, c in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
