#!/usr/bin/python3
"""Check OLMo mapped safetensors, ColossalAI and fairscale FSDP checkpoints against a manifest.

    layout_check.py olmo FILE MANIFEST [--lenient] [--canonical]
    layout_check.py colossalai DIR MANIFEST [--optim OPTIM_MANIFEST]
    layout_check.py fairscale PATH MANIFEST [--optim OPTIM_MANIFEST] [--fairscale-ties]

The reading is done by the reference readers in layouts/ (never by the fixture generators), so a
test can judge files statedict writes in these layouts, and the generators' own fixtures pass.

olmo        decodes every name and pickled value (no global outside a small allow-list is ever
            resolved), rebuilds the nested dict, compares it with the manifest (tensors bit for
            bit, values type-aware) and, when the manifest has `olmo_entries`, the key types of
            every entry and the repr of every pickled value. --lenient: the reference safetensors
            rules only (not our writer's stricter ones). --canonical: also require the bytes OLMo
            + safetensors write (names, pickles, header, data order).
colossalai  DIR holds pytorch_model-meta-dist-*.json files (PR 6181 distributed layout: every
            parameter is rebuilt from its boxes), or a released HybridParallelCheckpointIO index, or
            the modeling/ + optimizer/ folders ColossalChat saves (model; with --optim also the
            optimizer, keyed by parameter name).
fairscale   PATH is a folder with one <stem>-shard{r}.pt family, one of its files, or the stem;
            the weights are consolidated with the ties of every unit (--fairscale-ties: only the
            last unit's, as fairscale does), with --optim also the Adam state keyed by name.

Exit 0 when everything matches; 1 with one line per problem; 2 on bad usage.
"""
import argparse
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import torch_check  # noqa: E402


def check_olmo(args, manifest):
    from layouts import olmo_safetensors as olmo
    return olmo.check(args.target, manifest, strict=not args.lenient, canonical=args.canonical)


def check_colossalai(args, manifest, optim_manifest):
    from layouts import colossalai as colo
    from layouts._raw import flatten
    problems = []
    odir = None
    try:
        if colo.is_dist(args.target):
            got, info = colo.load_dist(args.target)
            want = manifest.get("not_in_metadata")
            if want is not None and sorted(want) != info["not_in_metadata"]:
                problems.append(f"tensors in weight files but not in the metadata: {info['not_in_metadata']}, "
                                f"expected {sorted(want)}")
        elif colo.is_hybrid(args.target):
            mdir, odir = colo.hybrid_dirs(args.target)
            if mdir is None:
                return [f"{args.target}: no model index (pytorch_model.bin.index.json / model.safetensors.index.json)"]
            got = colo.load_hybrid_model(mdir)
        else:
            return [f"{args.target}: neither pytorch_model-meta-dist-*.json nor a ColossalAI index"]
        problems += torch_check.compare_with_manifest(manifest, *flatten(got), label="DIR")
        if optim_manifest is not None:
            if odir is None:
                return problems + [f"{args.target}: no optimizer index next to the model"]
            optim = colo.load_hybrid_optim_by_name(odir, mdir)
            problems += torch_check.compare_with_manifest(optim_manifest, *flatten({"optim": optim}), label="DIR")
    except colo.ColossalFormatError as e:
        problems.append(str(e))
    except torch_check.SafetensorsRuleError as e:
        problems.append(str(e))
    return problems


def check_fairscale(args, manifest, optim_manifest):
    from layouts import fairscale as fs
    from layouts._raw import flatten
    problems = []
    try:
        sds = fs.load_shards(fs.find_shards(args.target))
        got, aliases = fs.consolidate_weights(sds, ties="fairscale" if args.fairscale_ties else "all")
        problems += torch_check.compare_with_manifest(manifest, *flatten(got), label="PATH")
        want_aliases = manifest.get("aliases", {})
        if not args.fairscale_ties and aliases != want_aliases:
            problems.append(f"ties {aliases} != expected {want_aliases}")
        if optim_manifest is not None:
            optim = fs.consolidate_optim(sds)
            problems += torch_check.compare_with_manifest(optim_manifest, *flatten({"optim": optim}), label="PATH")
    except fs.FairscaleFormatError as e:
        problems.append(str(e))
    return problems


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("layout", choices=("olmo", "colossalai", "fairscale"))
    p.add_argument("target", metavar="FILE|DIR|PATH")
    p.add_argument("manifest", metavar="MANIFEST")
    p.add_argument("--optim", metavar="OPTIM_MANIFEST")
    p.add_argument("--lenient", action="store_true")
    p.add_argument("--canonical", action="store_true")
    p.add_argument("--fairscale-ties", action="store_true")
    try:
        args = p.parse_args(argv[1:])
    except SystemExit as e:
        return 2 if e.code else 0
    try:
        manifest = C.load_manifest(args.manifest)
        optim_manifest = C.load_manifest(args.optim) if args.optim else None
    except (OSError, ValueError) as e:
        print(f"cannot read manifest: {e}")
        return 2
    try:
        if args.layout == "olmo":
            problems = check_olmo(args, manifest)
        elif args.layout == "colossalai":
            problems = check_colossalai(args, manifest, optim_manifest)
        else:
            problems = check_fairscale(args, manifest, optim_manifest)
    except (OSError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError) as e:
        problems = [f"cannot read {args.target}: {type(e).__name__}: {e}"]
    for line in problems:
        print(line)
    if problems:
        print(f"FAIL {args.target}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
