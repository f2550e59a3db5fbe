#!/usr/bin/python3
"""Generate DeepSpeed ZeRO-1/2/3 and FSDP/OLMo sharded checkpoint fixtures with their manifests.

    /usr/bin/python3 tests/python/gen_zero_fsdp.py OUTDIR [--only SUBSTRING]...

For every case this writes ``OUTDIR/<case>/`` (the checkpoint, laid out exactly as DeepSpeed or OLMo
writes it), ``OUTDIR/<case>.manifest.json`` (the expected consolidated weights) and
``OUTDIR/<case>.optim.manifest.json`` (the expected consolidated Adam state), then re-reads the files
with the independent consolidators in zero_fsdp/reference_consolidate.py and fails unless they
reproduce both manifests.  See zero_fsdp/README.md for the cases and docs/notes/zero-fsdp-layouts.md
for the format facts and their sources.
"""
import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from zero_fsdp import deepspeed_layout as ds  # noqa: E402
from zero_fsdp import fsdp_layout as fsdp  # noqa: E402
from zero_fsdp import reference_consolidate as ref  # noqa: E402
from zero_fsdp.manifest import compare  # noqa: E402

ZERO_CASES = [
    ds.ZeroCase("zero1_ws1_fp32", 1, 1),
    ds.ZeroCase("zero1_ws4_bf16", 1, 4, dtype="bf16"),
    ds.ZeroCase("zero1_ws3_fp16_elastic", 1, 3, dtype="fp16", elastic=True, enum_by_value=True),
    ds.ZeroCase("zero2_ws2_fp16", 2, 2, dtype="fp16"),
    ds.ZeroCase("zero2_ws3_fp32_roundrobin", 2, 3, round_robin=True, config_as_path=True),
    ds.ZeroCase("zero2_ws8_bf16", 2, 8, dtype="bf16", enum_by_value=True),
    ds.ZeroCase("zero2_ws4_fp16_debloated", 2, 4, dtype="fp16", save_style="debloated"),
    ds.ZeroCase("zero3_ws1_fp32", 3, 1),
    ds.ZeroCase("zero3_ws2_fp16", 3, 2, dtype="fp16"),
    ds.ZeroCase("zero3_ws3_fp32_subgroups", 3, 3, sub_group_size=40, enum_by_value=True),
    ds.ZeroCase("zero3_ws4_bf16_subgroups", 3, 4, dtype="bf16", sub_group_size=30),
    ds.ZeroCase("zero3_ws8_fp32", 3, 8),
]

FSDP_CASES = [
    fsdp.FsdpCase("olmo_fsdp_torch20_ws2", 2, form="torch20"),
    fsdp.FsdpCase("olmo_fsdp_torch20_ws4", 4, form="torch20"),
    fsdp.FsdpCase("olmo_fsdp_torch21_ws3", 3, form="torch21"),
    fsdp.FsdpCase("olmo_fsdp_torch21_ws4", 4, form="torch21"),
    fsdp.FsdpCase("olmo_fsdp_torch21_flat_ws2", 2, form="torch21", use_orig_params=False),
]


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("outdir")
    ap.add_argument("--only", action="append", default=[], help="run only cases whose name contains this")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.outdir, exist_ok=True)
    t0 = time.time()
    index = []

    def selected(name):
        return not args.only or any(s in name for s in args.only)

    for case in ZERO_CASES:
        if not selected(case.name):
            continue
        root = os.path.join(args.outdir, case.name)
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        man, om = ds.write_case(root, case)
        man.write(os.path.join(args.outdir, f"{case.name}.manifest.json"))
        om.write(os.path.join(args.outdir, f"{case.name}.optim.manifest.json"))
        # Self-consistency: the files alone, read back like zero_to_fp32 does, give the manifests.
        got, got_o = ref.zero_manifests(root)
        compare(man.to_json(), got.to_json(), f"{case.name} weights")
        compare(om.to_json(), got_o.to_json(), f"{case.name} optimizer")
        index.append({"case": case.name, "format": man.fmt, "describe": case.describe(),
                      "checkpoint": case.name, "world_size": case.world_size})

    for case in FSDP_CASES:
        if not selected(case.name):
            continue
        root = os.path.join(args.outdir, case.name)
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        man, om, step_dir = fsdp.write_case(root, case)
        man.write(os.path.join(args.outdir, f"{case.name}.manifest.json"))
        if om is not None:
            om.write(os.path.join(args.outdir, f"{case.name}.optim.manifest.json"))
        got, got_o = ref.olmo_manifests(step_dir, with_optim=om is not None)
        compare(man.to_json(), got.to_json(), f"{case.name} weights")
        if om is not None:
            compare(om.to_json(), got_o.to_json(), f"{case.name} optimizer")
        index.append({"case": case.name, "format": man.fmt, "describe": case.describe(),
                      "checkpoint": os.path.relpath(step_dir, args.outdir), "world_size": case.world_size})

    write_json(os.path.join(args.outdir, "zero_fsdp_cases.json"), index)
    print(f"gen_zero_fsdp: {len(index)} cases verified in {time.time() - t0:.1f}s -> {args.outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
