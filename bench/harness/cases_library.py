"""The library's cases: B8 (lazy random access) and B9 (compile time). See bench/README.md."""
import os
import re
import resource
import statistics
import subprocess
import tempfile
import time

from . import cache, stcheck
from .runner import Peer

MiB = 1 << 20
GiB = 1 << 30

TARGETS = {
    "B8": "reading the tensor nearest 64 MiB <= 2x cp of its bytes, from ZeRO-3 and from DCP",
    "B9": "a translation unit including <statedict/statedict.hpp> (separate compilation) <= 2.1x the CPU time of "
          "<nlohmann/json.hpp> alone, and <= 400 MB",
}


# ------------------------------------------------------------------------------------------- B8
def _dcp_of(ctx, root):
    """The B1 checkpoint as DCP for 3 ranks with its optimizer state (3 GiB), written once by the
    statedict under test and kept beside it (a stamp of the input's size)."""
    out = root + ".dcp-ws3"
    stamp = out + ".stamp"
    want = str(cache.total_bytes([root]))
    if os.path.isdir(out) and os.path.exists(stamp) and open(stamp).read() == want:
        return out
    subprocess.run(["rm", "-rf", out], check=True)
    ctx.log(f"  writing {os.path.basename(out)} (statedict convert --to dcp --world-size 3 --with-optimizer)")
    subprocess.run([ctx.statedict, "convert", root, out, "--to", "dcp", "--world-size", "3", "--with-optimizer"],
                   check=True, stdout=subprocess.DEVNULL)
    with open(stamp, "w") as f:
        f.write(want)
    return out


def _reference_hash(ref, name):
    return stcheck.manifest(ref)["tensors"].get(name, {}).get("sha256")


def b8(ctx, runner):
    binary = os.path.join(ctx.bin_dir, "bench-read")
    base = {"title": "lazy read: the tensor nearest 64 MiB out of a 3 GiB checkpoint", "results": []}
    if not os.path.exists(binary) or not os.path.exists(ctx.statedict):
        return dict(base, verdict="n/a", input="-", detail="bench-read or statedict: not available in this build")
    root, ref = ctx.zero(ctx.args.zero_gib)
    dcp = _dcp_of(ctx, root)
    # The tensor: the one nearest 64 MiB; checked once against the reference before timing.
    # "NAME DTYPE [d0, d1] BYTES bytes; open ... ; sha256 HEX" (the shape has spaces in it)
    out_probe = subprocess.run([binary, root, "--sha256"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"(\d+) bytes;", out_probe)
    if m is None:
        raise RuntimeError(f"bench-read printed {out_probe!r}")
    probe = out_probe.split()
    name, nbytes, sha = probe[0], int(m.group(1)), probe[-1]
    want = _reference_hash(ref, name)
    problems = []
    if sha != want:
        problems.append(f"ZeRO-3: {name} hashes {sha[:12]}, the reference {str(want)[:12]}")
    dsha = subprocess.run([binary, dcp, name, "--sha256"], capture_output=True, text=True, check=True).stdout.split()[-1]
    if dsha != want:
        problems.append(f"DCP: {name} hashes {dsha[:12]}, the reference {str(want)[:12]}")
    w = ctx.work
    src = os.path.join(w, "B8-64MiB.src")
    if not os.path.exists(src) or os.path.getsize(src) != nbytes:
        with open(src, "wb") as f:
            f.write(os.urandom(nbytes))
    out = os.path.join(w, "B8-cp.out")
    peers = [
        Peer("statedict read_tensor, ZeRO-3", [binary, root, name], kind="statedict", inputs=[root], binary=binary),
        Peer("statedict read_tensor, DCP", [binary, dcp, name], kind="statedict", inputs=[dcp], binary=binary),
        Peer("cp of its bytes", ["cp", "--reflink=never", src, out], kind="limit", inputs=[src], output=out),
    ]
    results = runner.run("B8", peers, ctx.args.reps, ctx.args.cold_reps, ctx.args.cold_method)
    by = {r["name"]: r for r in results}
    cp = by["cp of its bytes"]["summary"].get("warm")
    detail, ok = [], not problems
    for label in ("statedict read_tensor, ZeRO-3", "statedict read_tensor, DCP"):
        s = by[label]["summary"].get("warm")
        if by[label]["status"] != "ok" or not s or not cp:
            ok = False
            detail.append(f"{label}: {by[label]['status']} {by[label]['message']}")
            continue
        ratio = s["wall_median"] / cp["wall_median"]
        ok = ok and ratio <= 2.0
        detail.append(f"{label.split(', ')[1]} {s['wall_median'] * 1000:.0f} ms = {ratio:.2f}x cp")
    return dict(base, results=results, verdict="PASS" if ok else "MISS",
                input=f"{name} ({nbytes / MiB:.0f} MiB, F32) from the B1 checkpoint ({cache.total_bytes([root]) / GiB:.2f} GiB, "
                      f"{ctx.args.zero_ranks} ranks) and from the same checkpoint as DCP for 3 ranks with its optimizer "
                      f"state ({cache.total_bytes([dcp]) / GiB:.2f} GiB); cp copies as many bytes within the page cache",
                detail="; ".join(problems + detail) + " (warm, target <= 2x)")


# ------------------------------------------------------------------------------------------- B9
UNITS = [
    ("<nlohmann/json.hpp> alone", "#include <nlohmann/json.hpp>\nint main() { return nlohmann::json::parse(\"1\").get<int>() - 1; }\n", []),
    ("statedict.hpp, separate compilation", "#include <statedict/statedict.hpp>\n"
     "int main(int, char** v) { return static_cast<int>(statedict::open(v[0]).checkpoint.tensors.size()); }\n",
     ["-DSTATEDICT_SEPARATE_COMPILATION"]),
    ("statedict.hpp, header-only", "#include <statedict/statedict.hpp>\n"
     "int main(int, char** v) { return static_cast<int>(statedict::open(v[0]).checkpoint.tensors.size()); }\n", []),
    ("formats/safetensors.hpp, header-only", "#include <statedict/formats/safetensors.hpp>\n"
     "int main(int, char** v) { return static_cast<int>(statedict::safetensors::File::open(v[0]).size()); }\n", []),
    ("io/torch_file.hpp, header-only", "#include <statedict/io/torch_file.hpp>\n"
     "int main(int, char** v) { return static_cast<int>(statedict::torch::load(v[0]).is_dict()); }\n", []),
]


def _compile(ctx, src, flags, out):
    """CPU seconds (user + sys of the compiler's processes), wall seconds, peak RSS in MB."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(["g++", "-std=c++20", "-O0", "-c", "-I", os.path.join(ctx.repo, "include"), *flags, src, "-o", out],
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise RuntimeError(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, after.ru_maxrss / 1000  # ru_maxrss: KiB; the largest child so far


def b9(ctx, _runner):
    reps = max(3, ctx.args.reps)
    base = {"title": "compile time of a translation unit (g++ 12, -O0)",
            "input": "one .cpp per row, compiled with `g++ -std=c++20 -O0 -c`, rows interleaved, "
                     f"{reps} repetitions; CPU = user + sys of the compiler; RSS = its peak"}
    rows = {label: {"cpu": [], "wall": [], "rss": None} for label, _, _ in UNITS}
    with tempfile.TemporaryDirectory() as tmp:
        srcs = []
        for i, (label, code, flags) in enumerate(UNITS):
            path = os.path.join(tmp, f"unit{i}.cpp")
            with open(path, "w") as f:
                f.write(code)
            srcs.append((label, path, flags))
        # The peak RSS of RUSAGE_CHILDREN is a running maximum over every child so far: each row's
        # peak comes from a process of its own (one compile, /usr/bin/time-like).
        for label, path, flags in srcs:
            rows[label]["rss"] = _peak_rss(ctx, path, flags, tmp)
        for _ in range(reps):
            for label, path, flags in srcs:
                cpu, wall, _ = _compile(ctx, path, flags, os.path.join(tmp, "unit.o"))
                rows[label]["cpu"].append(cpu)
                rows[label]["wall"].append(wall)
    table = {k: {"cpu_median": statistics.median(v["cpu"]), "wall_median": statistics.median(v["wall"]),
                 "cpu_runs": v["cpu"], "peak_rss_mb": v["rss"]} for k, v in rows.items()}
    json_cpu = table[UNITS[0][0]]["cpu_median"]
    sep = table[UNITS[1][0]]
    ratio = sep["cpu_median"] / json_cpu
    ok = ratio <= 2.1 and sep["peak_rss_mb"] <= 400
    for v in table.values():
        v["vs_json"] = v["cpu_median"] / json_cpu
    return dict(base, compile=table, results=[], verdict="PASS" if ok else "MISS",
                detail=f"separate compilation: {sep['cpu_median']:.2f} s CPU = {ratio:.2f}x json.hpp "
                       f"({json_cpu:.2f} s), {sep['peak_rss_mb']:.0f} MB (target <= 2.1x, <= 400 MB)")


def _peak_rss(ctx, path, flags, tmp):
    """Peak RSS of one compile in MB, measured in a child Python whose RUSAGE_CHILDREN is fresh."""
    code = ("import resource, subprocess, sys\n"
            "subprocess.run(sys.argv[1:], check=True, capture_output=True)\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    argv = ["g++", "-std=c++20", "-O0", "-c", "-I", os.path.join(ctx.repo, "include"), *flags, path, "-o",
            os.path.join(tmp, "rss.o")]
    p = subprocess.run(["python3", "-c", code, *argv], capture_output=True, text=True, check=True)
    return int(p.stdout.strip()) / 1000
