#!/usr/bin/python3
"""statedict benchmark suite: statedict against its peers and the physical limit (cp), side by side.

    make bench                      # = /usr/bin/python3 bench/run.py
    make bench ARGS="--cases B1,B3 --reps 3"
    /usr/bin/python3 bench/run.py --quick          # small sizes, a couple of minutes, results in bench/data/
    /usr/bin/python3 bench/run.py --report-only    # redraw results.md and chart.png from the last JSON
    /usr/bin/python3 bench/run.py --selftest       # check the memory sampler and the cold-cache method

Builds statedict in Release (build/bench), generates the data into bench/data/ (reused when the
parameters match), runs the cases, writes bench/results.md and bench/chart.png (raw numbers in
bench/data/results.json).  A MISS never fails the command; a wrong output does (exit 1).
Every option can also be given as an environment variable STATEDICT_BENCH_<OPTION> (e.g.
STATEDICT_BENCH_REPS=3).  See bench/README.md.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from harness import cache, cases, machine, measure  # noqa: E402
from harness.runner import CaseRunner  # noqa: E402

PY = cases.PY


def env_default(name, default):
    return os.environ.get("STATEDICT_BENCH_" + name.upper().replace("-", "_"), default)


def floats(s):
    return [float(x) for x in str(s).split(",") if x.strip()]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
    a("--cases", default=env_default("cases", ",".join(cases.ALL)), help="comma-separated subset of B1..B13")
    a("--reps", type=int, default=int(env_default("reps", 5)), help="warm repetitions per peer (default 5)")
    a("--cold-reps", type=int, default=int(env_default("cold_reps", 2)), help="cold repetitions (default 2)")
    a("--scale-reps", type=int, default=int(env_default("scale_reps", 3)), help="repetitions per B6 size (default 3)")
    a("--peer-reps", type=int, default=int(env_default("peer_reps", 2)),
      help="warm repetitions of the Python peers, at most --reps (default 2: one run takes 20-80 s at the default sizes)")
    a("--peer-cold-reps", type=int, default=int(env_default("peer_cold_reps", 1)),
      help="cold repetitions of the Python peers, at most --cold-reps (default 1)")
    a("--cold-method", choices=["fadvise", "drop_caches", "none"], default=env_default("cold_method", "fadvise"))
    a("--pt-gib", type=float, default=float(env_default("pt_gib", 3.0)), help="B2/B3 .pt size (default 3)")
    a("--pt-tensors", type=int, default=int(env_default("pt_tensors", 10000)), help="B2/B3 tensor count")
    a("--zero-gib", type=float, default=float(env_default("zero_gib", 3.0)),
      help="B1/B4/B11 ZeRO-3 size: fp32 params + exp_avg + exp_avg_sq, GiB (default 3)")
    a("--zero-ranks", type=int, default=int(env_default("zero_ranks", 8)))
    a("--scale-gib", type=floats, default=floats(env_default("scale_gib", "0.5,1.5,3,6")),
      help="B6 sizes, GiB on disk (default 0.5,1.5,3,6; 6 GiB holds 2 GiB of parameters)")
    a("--megatron-gib", type=float, default=float(env_default("megatron_gib", 3.0)),
      help="B7 Megatron-LM checkpoint size, bf16 weights, GiB (default 3)")
    a("--megatron-tp", type=int, default=int(env_default("megatron_tp", 4)))
    a("--megatron-pp", type=int, default=int(env_default("megatron_pp", 2)))
    a("--quant-gib", type=float, default=float(env_default("quant_gib", 3.0)),
      help="B12/B13 size of the quantized input, GiB (default 3)")
    a("--data", default=env_default("data", os.path.join(HERE, "data")))
    a("--build-dir", default=env_default("build_dir", os.path.join(REPO, "build", "bench")))
    a("--no-build", action="store_true", default=bool(env_default("no_build", "")))
    a("--statedict", default=env_default("statedict", ""), help="statedict binary (default BUILD_DIR/bin/statedict)")
    a("--interval", type=float, default=float(env_default("interval", 0.002)), help="RSS sampling interval, s")
    a("--timeout", type=float, default=float(env_default("timeout", 900)), help="per-run timeout, s")
    a("--results", default=env_default("results", ""), help="results.md path (default bench/results.md)")
    a("--chart", default=env_default("chart", ""), help="chart path (default bench/chart.png)")
    a("--quick", action="store_true", help="small sizes and few repetitions; writes into bench/data/quick-*")
    a("--report-only", action="store_true", help="rewrite results.md and chart.png from the JSON")
    a("--merge", action="store_true",
      help="run the --cases given and put them into the existing JSON in place of their earlier results "
           "(marked as rerun, with their date and git); the other cases stay as they were")
    a("--selftest", action="store_true", help="check the sampler and the cold-cache method, then exit")
    args = ap.parse_args(argv)
    if args.quick:
        args.pt_gib, args.pt_tensors, args.zero_gib, args.megatron_gib = 0.25, 1000, 0.3, 0.3
        args.quant_gib = 0.3
        args.scale_gib = [0.1, 0.2, 0.3]
        args.reps, args.cold_reps, args.scale_reps = 3, 2, 2
        args.peer_reps, args.peer_cold_reps = min(args.peer_reps, 3), min(args.peer_cold_reps, 2)
    out_prefix = "quick-" if args.quick else ""
    args.results = args.results or (os.path.join(args.data, "quick-results.md") if args.quick
                                    else os.path.join(HERE, "results.md"))
    args.chart = args.chart or (os.path.join(args.data, "quick-chart.png") if args.quick
                                else os.path.join(HERE, "chart.png"))
    args.json = os.path.join(args.data, out_prefix + "results.json")
    args.cases = [c.strip().upper() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in args.cases if c not in cases.ALL]
    if bad:
        ap.error(f"unknown case(s) {bad}; choose from {cases.ALL}")
    return args


class Ctx:
    def __init__(self, args):
        self.args = args
        self.repo = REPO
        self.data = args.data
        self.work = os.path.join(args.data, "work")
        self.peers = os.path.join(HERE, "peers")
        self.bin_dir = os.path.join(args.build_dir, "bin")
        self.statedict = args.statedict or os.path.join(self.bin_dir, "statedict")
        self.t0 = time.perf_counter()
        os.makedirs(self.work, exist_ok=True)

    def clock(self):
        return time.perf_counter() - self.t0

    def log(self, msg):
        print(f"[{self.clock():6.0f}s] {msg}", flush=True)

    def zero(self, gib):
        name = f"zero-{gib:g}g-ws{self.args.zero_ranks}"
        return os.path.join(self.data, name), os.path.join(self.data, name + ".reference.safetensors")

    def megatron(self, gib):
        name = f"megatron-{gib:g}g-tp{self.args.megatron_tp}pp{self.args.megatron_pp}"
        return os.path.join(self.data, name), os.path.join(self.data, name + ".reference.safetensors")

    def quant(self, scheme):
        return os.path.join(self.data, f"{'fp8block' if scheme == 'fp8-block' else 'mxfp4'}-{self.args.quant_gib:g}g")

    def pt_dir(self):
        return os.path.join(self.data, f"pt-{self.args.pt_gib:g}g-{self.args.pt_tensors}")

    def pt(self):
        d = self.pt_dir()
        return os.path.join(d, "model.pt"), os.path.join(d, "model.safetensors")


def build(ctx):
    """Release build of the CLI and the micro-benchmarks.  Never fatal: a failed build only makes the
    statedict rows 'not available in this build'."""
    args = ctx.args
    if args.no_build:
        return "skipped (--no-build)"
    log = args.build_dir.rstrip("/") + ".log"
    os.makedirs(os.path.dirname(log), exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        def sh(argv):
            f.write("$ " + " ".join(argv) + "\n")
            f.flush()
            return subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
        base = ["cmake", "-S", REPO, "-B", args.build_dir, "-DCMAKE_BUILD_TYPE=Release", "-DSTATEDICT_BUILD_TESTS=OFF"]
        msg = "Release, CLI + micro-benchmarks"
        if sh(base + ["-DSTATEDICT_BUILD_BENCH=ON"]) != 0:
            msg = "Release, CLI only (configuring the micro-benchmarks failed, see log)"
            if sh(base + ["-DSTATEDICT_BUILD_BENCH=OFF"]) != 0:
                return f"FAILED to configure, see {os.path.relpath(log, REPO)}"
        # Only what the suite runs: the CLI, B5's micro-benchmark and B8's reader (not the other bench-*.cpp).
        build = ["cmake", "--build", args.build_dir, "-j", str(os.cpu_count() or 2), "--target"]
        if sh(build + ["statedict_cli"]) != 0:
            msg += f"; the CLI FAILED to build, see {os.path.relpath(log, REPO)}"
        for target, case in (("bench-flatten", "B5"), ("bench-read", "B8")):
            if case in args.cases and sh(build + [target]) != 0:
                msg += f"; {target} FAILED to build, see {os.path.relpath(log, REPO)}"
    ctx.log(f"build: {msg} ({time.perf_counter() - t0:.0f}s)")
    return msg


def generate(ctx, selected):
    args = ctx.args
    jobs = []
    if {"B2", "B3"} & selected:
        jobs.append([PY, os.path.join(HERE, "gen", "gen_pt.py"), ctx.pt_dir(),
                     "--gib", str(args.pt_gib), "--tensors", str(args.pt_tensors)])
    sizes = []
    if {"B1", "B4", "B8", "B11"} & selected:
        sizes.append(args.zero_gib)
    if "B6" in selected:
        sizes += [g for g in args.scale_gib if g not in sizes]
    for g in sizes:
        jobs.append([PY, os.path.join(HERE, "gen", "gen_zero.py"), ctx.data, "--gib", f"{g:g}",
                     "--ranks", str(args.zero_ranks)])
    if "B10" in selected:
        for r in cases.B10_RANKS:
            jobs.append([PY, os.path.join(HERE, "gen", "gen_zero.py"), ctx.data, "--gib", f"{cases.B10_GIB:g}",
                         "--layers", str(cases.B10_LAYERS), "--ranks", str(r)])
    if "B7" in selected:
        jobs.append([PY, os.path.join(HERE, "gen", "gen_megatron.py"), ctx.data, "--gib", f"{args.megatron_gib:g}",
                     "--tp", str(args.megatron_tp), "--pp", str(args.megatron_pp)])
    for cid, scheme in (("B12", "fp8-block"), ("B13", "mxfp4")):
        if cid in selected:
            jobs.append([PY, os.path.join(HERE, "gen", "gen_quant.py"), ctx.data, "--scheme", scheme, "--gib", f"{args.quant_gib:g}"])
    t0 = time.perf_counter()
    for j in jobs:
        ctx.log("gen: " + " ".join(os.path.relpath(x, REPO) if x.startswith(REPO) else x for x in j[1:]))
        subprocess.run(j, check=True)
    return time.perf_counter() - t0


def selftest(ctx):
    """What the sampler catches, that file-backed pages are excluded, children counted, and that the
    cold method really evicts.  Prints a small table (quoted in bench/README.md)."""
    work = ctx.work
    print("== memory sampler (interval %.1f ms)" % (ctx.args.interval * 1000))
    for mib, hold_ms in ((256, 100), (256, 20), (256, 5), (64, 2)):
        code = (f"import time; a = bytearray({mib} << 20); time.sleep({hold_ms / 1000}); del a; "
                "b = bytearray(1 << 20); time.sleep(0.05)")
        r = measure.run([PY, "-c", code], interval=ctx.args.interval)
        print(f"  anon {mib:4d} MiB held {hold_ms:3d} ms (plus its page faults): peak anon "
              f"{r.peak_anon_kib / 1024:6.1f} MiB (status {r.peak_anon_status_kib / 1024:.1f}, smaps_rollup "
              f"{r.peak_anon_rollup_kib / 1024:.1f}), VmHWM {r.maxrss_kib / 1024:.1f} MiB, {r.samples} samples")
    big = os.path.join(work, "selftest.bin")
    with open(big, "wb") as f:
        for _ in range(512):
            f.write(os.urandom(1 << 20))
    cache.sync_all()
    code = (f"import mmap; f = open({big!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); "
            "s = sum(m[i] for i in range(0, len(m), 4096))")
    r = measure.run([PY, "-c", code], interval=ctx.args.interval)
    print(f"  512 MiB file mmap'ed and touched: peak anon {r.peak_anon_kib / 1024:.1f} MiB, "
          f"VmHWM {r.maxrss_kib / 1024:.1f} MiB (file pages count in RSS, not in anon); "
          f"ru_maxrss {r.ru_maxrss_kib / 1024:.1f} MiB (includes the harness's own high-water mark)")
    with open(big, "rb") as f:  # raise the harness's own high-water mark, then run a tiny command
        import mmap
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        sum(mm[i] for i in range(0, len(mm), 4096))
        mm.close()
    r = measure.run(["sleep", "0.05"], interval=ctx.args.interval)
    print(f"  'sleep 0.05' after the harness touched 512 MiB itself: VmHWM {r.maxrss_kib / 1024:.1f} MiB, "
          f"ru_maxrss {r.ru_maxrss_kib / 1024:.1f} MiB (why ru_maxrss is not used)")
    r = measure.run(["sh", "-c", f"{PY} -c 'a = bytearray(200 << 20); import time; time.sleep(0.2)'; true"],
                    interval=ctx.args.interval)
    print(f"  child of sh allocating 200 MiB: peak anon {r.peak_anon_kib / 1024:.1f} MiB")
    print("== cold cache (method fadvise)")
    ok, why = cache.drop_caches_possible()
    print(f"  drop_caches possible: {ok} ({why})")
    res0, tot = cache.resident([big])
    frac = cache.make_cold([big])
    r_cold = measure.run(["cat", big], interval=ctx.args.interval)
    r_warm = measure.run(["cat", big], interval=ctx.args.interval)
    print(f"  resident before {res0 / tot:.0%}, after eviction {frac:.0%}; cat 512 MiB cold "
          f"{r_cold.wall:.3f}s ({512 / r_cold.wall:.0f} MiB/s), warm {r_warm.wall:.3f}s ({512 / r_warm.wall:.0f} MiB/s)")
    cache.evict([big])
    dst = os.path.join(work, "selftest.copy")
    walls = {}
    for label, interval in (("sampler off", None), ("sampler on", ctx.args.interval)):
        ws = []
        for _ in range(3):
            if os.path.exists(dst):
                os.remove(dst)
            cache.sync_all()
            if interval is None:
                t0 = time.perf_counter()
                subprocess.run(cases.cp_argv(big, dst), check=True)
                ws.append(time.perf_counter() - t0)
            else:
                ws.append(measure.run(cases.cp_argv(big, dst), interval=interval).wall)
        walls[label] = sorted(ws)[1]
    print(f"  sampler overhead on cp + sync of 512 MiB (median of 3): off {walls['sampler off']:.3f}s, "
          f"on {walls['sampler on']:.3f}s")
    for p in (big, dst):
        if os.path.exists(p):
            os.remove(p)
    return 0


def _terminate(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds through measure.run, which kills the running command


def main(argv=None):
    signal.signal(signal.SIGTERM, _terminate)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from harness import chart, report
    os.makedirs(args.data, exist_ok=True)
    ctx = Ctx(args)
    if args.selftest:
        return selftest(ctx)
    if args.report_only:
        with open(args.json) as f:
            doc = json.load(f)
    else:
        selected = set(args.cases)
        build_msg = build(ctx)
        gen_s = generate(ctx, selected)
        facts = machine.facts(args.data, ctx.statedict)
        ok, why = cache.drop_caches_possible()
        facts["drop_caches"] = f"{'possible' if ok else 'not possible'}: {why}"
        run_t0 = ctx.clock()
        facts["loadavg_start"] = machine.loadavg()
        results = cases.run_all(ctx, CaseRunner(ctx), selected)
        facts["loadavg_end"] = machine.loadavg()
        doc = {
            "machine": facts,
            "config": {k: v for k, v in vars(args).items() if k not in ("report_only", "selftest")},
            "build": build_msg,
            "statedict": ctx.statedict,
            "generate_seconds": gen_s,
            "run_seconds": ctx.clock() - run_t0,
            "total_seconds": ctx.clock(),
            "cases": results,
            "json": os.path.relpath(args.json, REPO),
        }
        if args.merge and os.path.exists(args.json):
            with open(args.json) as f:
                old = json.load(f)
            la = " / ".join(f"{x:.2f}" for x in facts["loadavg_start"])
            for cid, c in results.items():
                c["rerun"] = {"date": facts["date"], "git": facts["git"], "loadavg": la}
            merged = {cid: results.get(cid, old["cases"].get(cid)) for cid in cases.ALL
                      if cid in results or cid in old["cases"]}
            old["cases"] = merged
            doc = old
        with open(args.json + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(args.json + ".tmp", args.json)
    report.write(doc, args.results, os.path.relpath(args.chart, os.path.dirname(os.path.abspath(args.results))))
    chart.draw(doc, args.chart)
    wrong = [f"{cid}: {r['name']}" for cid, c in doc["cases"].items()
             for r in c.get("results", []) + [x for p in c.get("points", []) if not p.get("from_b1")
                                               for x in p["results"]]
             if r.get("status") == "wrong"]
    print(f"results: {os.path.relpath(args.results, REPO)}, chart: {os.path.relpath(args.chart, REPO)}, "
          f"raw: {os.path.relpath(args.json, REPO)}; total {doc['total_seconds'] / 60:.1f} min")
    for cid, c in doc["cases"].items():
        print(f"  {cid} {c['verdict']:5s} {c['detail']}")
    if wrong:
        print("WRONG OUTPUT from: " + "; ".join(wrong))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
