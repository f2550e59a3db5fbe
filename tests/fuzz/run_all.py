#!/usr/bin/env python3
"""Runs every libFuzzer target (fuzz-*) of a build for a while, each on a scratch copy of its seed
corpus (tests/fuzz/corpus/<target>/, never modified), and reports per target the number of inputs
executed (libFuzzer's final stat::number_of_executed_units). Exits non-zero when any target
crashes, leaks, runs out of memory or times out, naming the input that did it.

    python3 tests/fuzz/run_all.py --build build/fuzz --seconds 30 --jobs 2 [--targets zip,pickle] [--runs R] [--seed S]

Crash, leak, OOM and timeout inputs are kept in <build>/fuzz-results/<target>/ along with the
target's log; reproduce one with `<build>/bin/fuzz-<target> <file>` (docs/fuzzing.md).
"""
import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")


def find_targets(build):
    found = {}
    for root in (os.path.join(build, "bin"), build):
        if not os.path.isdir(root):
            continue
        for n in sorted(os.listdir(root)):
            p = os.path.join(root, n)
            if n.startswith("fuzz-") and os.path.isfile(p) and os.access(p, os.X_OK):
                found.setdefault(n[len("fuzz-"):], p)
    return found


def corpus_name(target):
    return target.replace("-", "_")


def run_one(target, exe, args, results_root):
    res_dir = os.path.join(results_root, target)
    shutil.rmtree(res_dir, ignore_errors=True)
    os.makedirs(res_dir)
    work = tempfile.mkdtemp(prefix=f"statedict-fuzz-{target}-")
    try:
        corpus = os.path.join(work, "corpus")
        seeds = os.path.join(CORPUS, corpus_name(target))
        if os.path.isdir(seeds):
            shutil.copytree(seeds, corpus)
        else:
            os.makedirs(corpus)
        tmp = os.path.join(work, "tmp")
        os.makedirs(tmp)
        cmd = [exe, f"-max_total_time={args.seconds}", "-print_final_stats=1", f"-rss_limit_mb={args.rss_limit_mb}",
               f"-timeout={args.timeout}", f"-artifact_prefix={res_dir}/", "-close_fd_mask=1"]
        if args.runs is not None:
            cmd.append(f"-runs={args.runs}")
        if args.seed:
            cmd.append(f"-seed={args.seed}")
        dict_file = os.path.join(HERE, "dict", corpus_name(target) + ".dict")
        if os.path.isfile(dict_file):
            cmd.append(f"-dict={dict_file}")
        cmd += args.extra
        cmd.append(corpus)
        env = dict(os.environ, TMPDIR=tmp)
        env.setdefault("ASAN_OPTIONS", "detect_leaks=1")
        env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
        log_path = os.path.join(res_dir, "log.txt")
        t0 = time.time()
        with open(log_path, "wb") as log:
            # Hard stop well after max_total_time (libFuzzer finishes the current input first).
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    timeout=args.seconds + args.timeout * 2 + 120).returncode
            except subprocess.TimeoutExpired:
                rc = "hung"
        elapsed = time.time() - t0
        with open(log_path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
        execs = None
        m = re.findall(r"stat::number_of_executed_units:\s*(\d+)", text)
        if m:
            execs = int(m[-1])
        rss = re.findall(r"stat::peak_rss_mb:\s*(\d+)", text)
        artifacts = [os.path.join(res_dir, n) for n in sorted(os.listdir(res_dir)) if n != "log.txt"]
        ok = rc == 0 and not artifacts
        return dict(target=target, ok=ok, rc=rc, execs=execs, seconds=elapsed, rss=int(rss[-1]) if rss else None,
                    artifacts=artifacts, log=log_path, text=text, corpus_size=len(os.listdir(corpus)))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True, help="build directory holding bin/fuzz-*")
    ap.add_argument("--seconds", type=int, default=30, help="max_total_time per target")
    ap.add_argument("--jobs", type=int, default=1, help="targets run at the same time")
    ap.add_argument("--targets", default="", help="comma-separated names (zip,pickle or fuzz-zip,...); default all")
    ap.add_argument("--runs", type=int, default=None, help="stop each target after this many inputs")
    ap.add_argument("--seed", type=int, default=0,
                    help="libFuzzer -seed for every target: the same seed, corpus and build replay the same inputs "
                         "(up to the count a run reaches in its time); 0 (default): a new random seed per run")
    ap.add_argument("--timeout", type=int, default=25, help="seconds one input may take (libFuzzer -timeout)")
    ap.add_argument("--rss-limit-mb", type=int, default=2048)
    ap.add_argument("--results", default=None, help="where crash inputs and logs go (default <build>/fuzz-results)")
    ap.add_argument("extra", nargs="*", help="further libFuzzer flags (after --)")
    args = ap.parse_args()

    targets = find_targets(args.build)
    if not targets:
        print(f"run_all: no fuzz-* executables in {args.build}/bin or {args.build}", file=sys.stderr)
        return 2
    if args.targets:
        wanted = [t.strip().removeprefix("fuzz-").replace("_", "-") for t in args.targets.split(",") if t.strip()]
        missing = [t for t in wanted if t not in targets]
        if missing:
            print(f"run_all: unknown target(s) {', '.join(missing)}; have {', '.join(targets)}", file=sys.stderr)
            return 2
        targets = {t: targets[t] for t in wanted}
    results_root = os.path.abspath(args.results or os.path.join(args.build, "fuzz-results"))
    os.makedirs(results_root, exist_ok=True)

    seed = f"seed {args.seed}" if args.seed else "random seeds"
    print(f"== fuzzing {len(targets)} target(s), {args.seconds} s each, {args.jobs} at a time, {seed}", flush=True)
    results = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futs = [pool.submit(run_one, t, exe, args, results_root) for t, exe in targets.items()]
        for fut in concurrent.futures.as_completed(futs):
            r = fut.result()
            results.append(r)
            status = "ok" if r["ok"] else f"FAILED (exit {r['rc']})"
            execs = "?" if r["execs"] is None else f"{r['execs']:,}"
            print(f"{r['target']:24s} {status:18s} execs {execs:>14s} in {r['seconds']:6.1f} s"
                  f"  peak rss {r['rss']} MB  corpus {r['corpus_size']}", flush=True)
            if not r["ok"]:
                for a in r["artifacts"]:
                    print(f"    input: {a}")
                lines = r["text"].splitlines()
                start = next((i for i, l in enumerate(lines) if re.search(r"ERROR: |==\d+==|runtime error|round trip", l)),
                             max(0, len(lines) - 40))
                print("    " + "\n    ".join(lines[start:start + 60]))
                print(f"    log: {r['log']}")
    failed = [r for r in results if not r["ok"]]
    total = sum(r["execs"] or 0 for r in results)
    print(f"== {len(results) - len(failed)}/{len(results)} targets passed; {total:,} inputs executed")
    if failed:
        print("== failed: " + ", ".join(sorted(r["target"] for r in failed)))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
