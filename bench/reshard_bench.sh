#!/bin/sh
# Reshard and consolidate a 3 GiB checkpoint with the planner + executor, timed against cp of the
# same bytes in the same run, with peak anonymous RSS.
#
#   bench/reshard_bench.sh BUILD_DIR [MIB]
#
# Builds bench-plan (Release, -DSTATEDICT_BUILD_BENCH=ON) in BUILD_DIR, generates 8-rank checkpoints
# of random F32 data (MIB, default 3072) once per layout in $STATEDICT_RESHARD_DATA
# (default /tmp/statedict-reshard-bench; not committed), then for each case runs one warm-up and
# $STATEDICT_RESHARD_REPS (default 3) timed repetitions, alternating with the baseline
# `cp --reflink=never INPUTS DIR && sync FILES DIR` (statedict fsyncs and renames its outputs, so the
# baseline pays for durability too). Between runs, outputs are removed and the page cache synced
# (untimed); inputs stay cached (warm). Measurement: bench/harness/measure.py (wall time, VmHWM,
# peak RssAnon sampled every 2 ms plus smaps_rollup "Anonymous:"; see bench/README.md).
# Outputs are checked: consolidating the 3-rank result gives the same file as consolidating the
# 8 ranks directly.
set -eu
build=${1:?usage: bench/reshard_bench.sh BUILD_DIR [MIB]}
mib=${2:-3072}
src=$(cd "$(dirname "$0")/.." && pwd)
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DSTATEDICT_BUILD_BENCH=ON >"$build.reshard-configure.log" 2>&1 || {
  cat "$build.reshard-configure.log"
  exit 1
}
cmake --build "$build" --target bench-plan -j "${STATEDICT_JOBS:-2}"
exec python3 - "$src" "$build/bin/bench-plan" "${STATEDICT_RESHARD_DATA:-/tmp/statedict-reshard-bench}" "$mib" \
  "${STATEDICT_RESHARD_REPS:-3}" "${STATEDICT_RESHARD_THREADS:-2}" "${STATEDICT_RESHARD_BUDGET_MIB:-256}" <<'EOF'
import filecmp, json, os, shutil, statistics, subprocess, sys
src, exe, data, mib, reps, threads, budget = sys.argv[1:8]
sys.path.insert(0, os.path.join(src, "bench"))
from harness import measure  # noqa: E402

os.makedirs(data, exist_ok=True)

def gen(layout):
    d = os.path.join(data, f"{layout}-{mib}m-ws8")
    stamp = d + ".stamp.json"
    want = {"mib": mib, "layout": layout, "ranks": 8, "exe_mtime": int(os.path.getmtime(os.path.join(src, "bench", "bench-plan.cpp")))}
    if os.path.exists(stamp) and json.load(open(stamp)) == want:
        return d
    shutil.rmtree(d, ignore_errors=True)
    subprocess.run([exe, "gen", d, "--mib", mib, "--ranks", "8", "--layout", layout], check=True)
    json.dump(want, open(stamp, "w"))
    return d

def clean(path):
    shutil.rmtree(path, ignore_errors=True)
    os.sync()

def files(d):
    return sorted(os.path.join(d, f) for f in os.listdir(d) if not f.startswith("."))

def run_statedict(inp, out, layout, frm, to, extra=()):
    clean(out)
    argv = [exe, "reshard", inp, out, "--mib", mib, "--layout", layout, "--from", str(frm), "--to", str(to),
            "--threads", threads, "--budget-mib", budget, *extra]
    r = measure.run(argv, stdout_path=out + ".json", stderr_path=out + ".err")
    if r.rc != 0:
        sys.exit(f"failed: {' '.join(argv)}\n{r.stderr_tail}")
    r.stats = json.load(open(out + ".json"))
    return r

def run_cp(inp, out):
    clean(out)
    os.makedirs(out)
    ins = files(inp)
    script = ('cp --reflink=never "$@" "$OUT" && cd "$OUT" && sync ' + " ".join(os.path.basename(f) for f in ins) + ' . ')
    r = measure.run(["sh", "-c", script, "cp", *ins], env={**os.environ, "OUT": out})
    if r.rc != 0:
        sys.exit("cp failed")
    return r

cases = [  # name, dataset layout, --to, extra args
    ("chunk 8->3", "chunk", 3, ()),
    ("chunk 8->1 (consolidate)", "chunk", 1, ()),
    ("zero3 8->3", "zero3", 3, ()),
    ("zero3 8->1 (consolidate)", "zero3", 1, ()),
    ("tp 8->1 (column/row shards, strided)", "tp", 1, ()),
    ("chunk 8->1 to BF16 (cast)", "chunk", 1, ("--dtype", "BF16")),
]
datasets = {l: gen(l) for l in sorted({c[1] for c in cases})}
out = os.path.join(data, "out")
base = os.path.join(data, "cp-out")

# Output check (untimed): 8 -> 3 -> 1 equals 8 -> 1, for every layout.
for layout, d in datasets.items():
    one, three, one_b = out + "-check1", out + "-check3", out + "-check31"
    run_statedict(d, one, layout, 8, 1)
    run_statedict(d, three, layout, 8, 3)
    run_statedict(three, one_b, layout, 3, 1)
    a, b = files(one), files(one_b)
    if [os.path.basename(x) for x in a] != [os.path.basename(x) for x in b] or not all(
            filecmp.cmp(x, y, shallow=False) for x, y in zip(a, b)):
        sys.exit(f"{layout}: consolidating the 3-rank reshard differs from consolidating the 8 ranks")
    for p in (one, three, one_b):
        clean(p)
print("outputs checked: 8->3->1 == 8->1 for " + ", ".join(datasets))

in_bytes = {l: sum(os.path.getsize(f) for f in files(d)) for l, d in datasets.items()}
results = []
for name, layout, to, extra in cases:
    d = datasets[layout]
    run_statedict(d, out, layout, 8, to, extra)  # warm-up
    run_cp(d, base)
    ours, cps = [], []
    for _ in range(int(reps)):
        ours.append(run_statedict(d, out, layout, 8, to, extra))
        cps.append(run_cp(d, base))
    t = statistics.median(r.wall for r in ours)
    c = statistics.median(r.wall for r in cps)
    anon = max(r.peak_anon_kib or 0 for r in ours) / 1024
    hwm = max(r.maxrss_kib or 0 for r in ours) / 1024
    st = ours[-1].stats
    results.append({"case": name, "seconds": t, "cp_seconds": c, "ratio": t / c, "peak_anon_mib": anon,
                    "vmhwm_mib": hwm, "input_bytes": in_bytes[layout], "written": st["bytes"],
                    "plan_s": st["plan_s"], "in_kernel": st["in_kernel"], "from_mapping": st["from_mapping"],
                    "buffer_mib": st["buffer_bytes"] / 2**20, "ops": st["ops"], "runs": [r.wall for r in ours],
                    "cp_runs": [r.wall for r in cps], "background_cores": statistics.median(r.background_cores for r in ours)})
    clean(out)
    clean(base)

print(f"\nbench-plan reshard, {mib} MiB F32 model, 8 input ranks, {threads} threads, budget {budget} MiB, "
      f"median of {reps} warm runs; cp = cp --reflink=never + sync of the same input bytes")
print(f"{'case':40} {'statedict s':>11} {'cp s':>7} {'ratio':>6} {'anon MiB':>9} {'VmHWM MiB':>10} {'plan s':>7} {'in-kernel GiB':>13} {'ops':>7}")
for r in results:
    print(f"{r['case']:40} {r['seconds']:11.2f} {r['cp_seconds']:7.2f} {r['ratio']:6.2f} {r['peak_anon_mib']:9.1f} "
          f"{r['vmhwm_mib']:10.1f} {r['plan_s']:7.3f} {r['in_kernel'] / 2**30:13.2f} {r['ops']:7d}")
json.dump(results, open(os.path.join(data, "reshard-results.json"), "w"), indent=1)
print(f"\nlimits: anonymous RSS <= budget + 32 MiB = {int(budget) + 32} MiB; time <= 1.3x cp; "
      f"results in {os.path.join(data, 'reshard-results.json')}")
EOF
