"""The benchmark cases B1..B11 (see bench/README.md for what each measures and why); B8 and B9 are in
cases_library.py."""
import json
import math
import os
import shutil
import subprocess
import sys

from . import cache, cases_library, quantcheck, stcheck
from .runner import Peer

PY = "/usr/bin/python3"  # Debian's python3 with PyTorch 1.13 (the pyenv python3 on PATH has no torch)
MiB = 1 << 20
GiB = 1 << 30

TARGETS = {
    "B1": "statedict <= 1.15x cp wall and <= 1.1x cp CPU time (user + sys), peak anonymous RSS <= 256 MiB",
    "B2": "statedict <= 1.15x cp wall and <= 1.1x cp CPU time (user + sys)",
    "B3": "statedict <= 50 ms",
    "B4": "statedict <= 1.3x cp wall and <= 1.1x cp CPU time (user + sys)",
    "B5": "flatten + unflatten <= 50 ms",
    "B6": "statedict time linear in size (R^2 >= 0.98) and peak anonymous RSS flat "
          "(max - min <= max(32 MiB, 25% of min)); at the largest size (6 GiB on disk: 2 GiB of parameters) "
          ">= 8x faster than the zero_to_fp32 algorithm",
    "B7": "statedict <= 1.15x cp wall and <= 1.1x cp CPU time (user + sys), peak anonymous RSS <= 256 MiB",
    "B10": "ZeRO-3 of 4,917 parameters at 64, 512 and 1,024 ranks: statedict's peak anonymous RSS <= 256 MiB at "
           "every point, its time growing at most linearly in ranks + tensors (1,024 ranks <= 1.5x the (R + T) "
           "ratio over 64 ranks), >= 20x faster than the zero_to_fp32 algorithm at 512 ranks",
    "B11": "statedict <= 1.3x cp wall, peak anonymous RSS <= 256 MiB",
    "B12": "statedict <= 1.5x cp wall, peak anonymous RSS <= 256 MiB",
    "B13": "statedict <= 1.5x cp wall, peak anonymous RSS <= 256 MiB",
}

# B10: many ranks, few bytes (0.05 GiB of fp32 weights); the description, not the copy, is measured.
B10_GIB, B10_LAYERS, B10_RANKS = 0.15, 546, (64, 512, 1024)
B10_TENSORS = 9 * B10_LAYERS + 3  # gen_zero's LLaMA-like skeleton: 4,917 parameters


def cp_argv(src, dst):
    """cp of the same bytes, then fsync of the copy and its directory (statedict fsyncs its output)."""
    if os.path.isdir(src):
        script = 'cp -r --reflink=never "$1" "$2" && find "$2" -type f -exec sync {} + && sync "$2"'
    else:
        script = 'cp --reflink=never "$1" "$2" && sync "$2" "$(dirname "$2")"'
    return ["sh", "-c", script, "cp-limit", src, dst]


def st_equal(ref):
    def check(peer, _stdout):
        if not peer.output or not os.path.exists(peer.output):
            return "no output file"
        return stcheck.same_tensors(peer.output, ref)
    return check


def inspect_json_matches(ref_st):
    def check(_peer, stdout):
        try:
            with open(stdout) as f:
                got = json.load(f)
        except (OSError, ValueError) as e:
            return f"stdout is not one JSON object: {e}"
        hdr, _ = stcheck.header(ref_st)
        tensors = got.get("tensors", {})
        if set(tensors) != set(hdr):
            return f"{len(tensors)} tensors listed, the file has {len(hdr)}"
        for name, e in hdr.items():
            t = tensors[name]
            if t.get("dtype") != e["dtype"] or list(t.get("shape", [])) != list(e["shape"]):
                return f"{name!r}: {t} vs {e['dtype']}{e['shape']}"
        return None
    return check


def dcp_equal(ctx, ref):
    """Load the DCP output with PyTorch 1.13's own DCP reader on 3 gloo ranks
    (tests/python/dcp_load_check.py) and compare every tensor with the reference's manifest."""
    def check(peer, _stdout):
        man = ref[:-len(".safetensors")] + ".manifest.json"
        if not os.path.exists(man) or os.path.getmtime(man) < os.path.getmtime(ref):
            with open(man + ".tmp", "w") as f:
                json.dump(stcheck.manifest(ref), f)
            os.replace(man + ".tmp", man)
        ctx.log("    checking the DCP output with tests/python/dcp_load_check.py (torch 1.13, 3 gloo ranks)")
        p = subprocess.run([PY, os.path.join(ctx.repo, "tests", "python", "dcp_load_check.py"), peer.output, man, "3"],
                           capture_output=True, text=True, timeout=ctx.args.timeout)
        if p.returncode == 0:
            return None
        lines = (p.stdout + p.stderr).strip().splitlines()
        return f"dcp_load_check exit {p.returncode}: " + " | ".join(lines[-3:])
    return check


def _ratio_verdict(results, limit, cond="warm", anon_cap_mib=None, cpu_limit=None):
    tool = next((r for r in results if r["kind"] == "statedict"), None)
    cp = next((r for r in results if r["kind"] == "limit"), None)
    if tool is None or tool["status"] == "unavailable":
        return "n/a", "statedict: not available in this build" + (f" ({tool['message']})" if tool else "")
    if tool["status"] == "error":
        return "ERROR", f"statedict failed: {tool['message']}"
    if tool["status"] == "wrong":
        return "MISS", f"statedict output is wrong: {tool['message']}"
    if cp is None or cp["status"] != "ok" or not cp["summary"].get(cond):
        return "n/a", "cp reference did not run"
    t, c = tool["summary"][cond], cp["summary"][cond]
    ratio = t["wall_median"] / c["wall_median"]
    ok = ratio <= limit
    detail = f"{ratio:.2f}x cp ({cond}, target <= {limit}x)"
    if cpu_limit is not None:  # CPU time (user + sys of the command): what each copies through the CPU
        if not c.get("cpu_median"):
            ok = False
            detail += "; cp CPU time not measured"
        else:
            cpu_ratio = t["cpu_median"] / c["cpu_median"]
            ok = ok and cpu_ratio <= cpu_limit
            detail += f"; CPU {cpu_ratio:.2f}x cp (target <= {cpu_limit}x)"
    if anon_cap_mib is not None:
        if t["peak_anon_kib"] is None:
            ok = False
            detail += "; peak anon RSS not sampled"
        else:
            anon = t["peak_anon_kib"] / 1024
            ok = ok and anon <= anon_cap_mib
            detail += f"; peak anon RSS {anon:.0f} MiB (target <= {anon_cap_mib} MiB)"
    return ("PASS" if ok else "MISS"), detail


def _abs_verdict(results, limit_s, cond="warm"):
    tool = next((r for r in results if r["kind"] == "statedict"), None)
    if tool is None or tool["status"] == "unavailable":
        return "n/a", "statedict: not available in this build" + (f" ({tool['message']})" if tool else "")
    if tool["status"] == "error":
        return "ERROR", f"statedict failed: {tool['message']}"
    if tool["status"] == "wrong":
        return "MISS", f"statedict output is wrong: {tool['message']}"
    m = tool["summary"][cond]["wall_median"]
    return ("PASS" if m <= limit_s else "MISS"), f"{m * 1000:.1f} ms ({cond}, target <= {limit_s * 1000:.0f} ms)"


def _header_facts(st_path):
    hdr, off = stcheck.header(st_path)
    dtypes = {}
    for e in hdr.values():
        dtypes[e["dtype"]] = dtypes.get(e["dtype"], 0) + 1
    return {"tensors": len(hdr), "dtypes": dtypes, "bytes": os.path.getsize(st_path) - off}


# ------------------------------------------------------------------------------------------- B1
def zero_peers(ctx, case_id, root, ref):
    sd = ctx.statedict
    w = ctx.work
    out = {k: os.path.join(w, f"{case_id}-{k}.safetensors") for k in ("statedict", "classic", "cp")}
    return [
        Peer("statedict", [sd, "convert", root, out["statedict"]], kind="statedict", inputs=[root],
             output=out["statedict"], validate=st_equal(ref), binary=sd),
        Peer("zero_to_fp32 algorithm (torch 1.13)", [PY, os.path.join(ctx.peers, "zero3_classic.py"), root,
                                                      out["classic"]],
             inputs=[root], output=out["classic"], validate=st_equal(ref)),
        Peer("cp of the output bytes", cp_argv(ref, out["cp"]), kind="limit", inputs=[ref], output=out["cp"]),
    ]


def b1(ctx, runner):
    root, ref = ctx.zero(ctx.args.zero_gib)
    peers = zero_peers(ctx, "B1", root, ref)
    results = runner.run("B1", peers, ctx.args.reps, ctx.args.cold_reps, ctx.args.cold_method)
    status, detail = _ratio_verdict(results, 1.15, anon_cap_mib=256, cpu_limit=1.1)
    f = _header_facts(ref)
    return {
        "title": "ZeRO-3 consolidation -> safetensors",
        "input": f"DeepSpeed ZeRO-3 checkpoint, {ctx.args.zero_ranks} ranks, "
                 f"{cache.total_bytes([root]) / GiB:.2f} GiB on disk (fp32 params + exp_avg + exp_avg_sq); "
                 f"output: {f['tensors']} fp32 tensors, {f['bytes'] / GiB:.2f} GiB safetensors",
        "results": results, "verdict": status, "detail": detail, "size_gib": ctx.args.zero_gib,
    }


# ------------------------------------------------------------------------------------------- B2
def b2(ctx, runner):
    pt, st = ctx.pt()
    sd, w = ctx.statedict, ctx.work
    o = {k: os.path.join(w, f"B2-{k}") for k in ("statedict.safetensors", "st.safetensors", "pt.pt",
                                                 "cp.safetensors")}
    peers = [
        Peer("statedict", [sd, "convert", pt, o["statedict.safetensors"]], kind="statedict", inputs=[pt],
             output=o["statedict.safetensors"], validate=st_equal(st), binary=sd),
        Peer("torch.load + safetensors writer", [PY, os.path.join(ctx.peers, "pt_to_safetensors.py"), pt,
                                                 o["st.safetensors"]],
             inputs=[pt], output=o["st.safetensors"], validate=st_equal(st)),
        Peer("torch.load + torch.save", [PY, os.path.join(ctx.peers, "pt_to_safetensors.py"), pt, o["pt.pt"]],
             inputs=[pt], output=o["pt.pt"], cold=False),
        Peer("cp of the output bytes", cp_argv(st, o["cp.safetensors"]), kind="limit", inputs=[st],
             output=o["cp.safetensors"]),
    ]
    results = runner.run("B2", peers, ctx.args.reps, ctx.args.cold_reps, ctx.args.cold_method)
    status, detail = _ratio_verdict(results, 1.15, cpu_limit=1.1)
    f = _header_facts(st)
    return {
        "title": ".pt -> .safetensors",
        "input": f"torch.save file, {os.path.getsize(pt) / GiB:.2f} GiB, {f['tensors']} tensors "
                 f"({', '.join(f'{n} {d}' for d, n in sorted(f['dtypes'].items()))})",
        "results": results, "verdict": status, "detail": detail,
    }


# ------------------------------------------------------------------------------------------- B3
def b3(ctx, runner):
    pt, st = ctx.pt()
    sd = ctx.statedict
    peers = [
        Peer("statedict inspect --json", [sd, "inspect", pt, "--json"], kind="statedict", inputs=[pt],
             stdout=True, validate=inspect_json_matches(st), binary=sd),
        Peer("torch.load", [PY, os.path.join(ctx.peers, "torch_load.py"), pt], inputs=[pt]),
        Peer("torch.load(weights_only=True)", [PY, os.path.join(ctx.peers, "torch_load.py"), pt, "--weights-only"],
             inputs=[pt], cold=False),
        Peer("python3 -c 'import torch' (context: fixed cost)", [PY, "-c", "import torch"], kind="context",
             cold=False),
    ]
    results = runner.run("B3", peers, ctx.args.reps, ctx.args.cold_reps, ctx.args.cold_method)
    status, detail = _abs_verdict(results, 0.050)
    f = _header_facts(st)
    return {
        "title": "inspect a .pt",
        "input": f"the B2 torch.save file, {os.path.getsize(pt) / GiB:.2f} GiB, {f['tensors']} tensors",
        "results": results, "verdict": status, "detail": detail,
    }


# ------------------------------------------------------------------------------------------- B4
def reshard_case(ctx, runner, cid, args, validate, ratio, title, output, cpu_limit=None, anon_cap_mib=None):
    """The B1 checkpoint converted by `statedict convert ROOT OUT ARGS...` into a directory of
    rank files, against `cp` of exactly the bytes statedict wrote (its warm-up output, kept aside)."""
    root, ref = ctx.zero(ctx.args.zero_gib)
    sd, w = ctx.statedict, ctx.work
    out_sd = os.path.join(w, f"{cid}-statedict.out")
    cp_src = os.path.join(w, f"{cid}-cp-source")
    out_cp = os.path.join(w, f"{cid}-cp.out")
    state = {"src": None}
    if os.path.lexists(cp_src):
        shutil.rmtree(cp_src)

    def keep_output(peer):  # cp copies exactly what statedict wrote (same files, same bytes)
        if os.path.isdir(peer.output):
            os.rename(peer.output, cp_src)
            state["src"] = cp_src

    def cp_source():
        return state["src"] or ref

    peers = [
        Peer("statedict", [sd, "convert", root, out_sd] + args, kind="statedict", inputs=[root], output=out_sd,
             binary=sd, after_warmup=keep_output, validate=validate(root, ref)),
        Peer("cp of the output bytes", lambda: cp_argv(cp_source(), out_cp), kind="limit",
             inputs=lambda: [cp_source()], output=out_cp),
    ]
    results = runner.run(cid, peers, ctx.args.reps, ctx.args.cold_reps, ctx.args.cold_method)
    status, detail = _ratio_verdict(results, ratio, cpu_limit=cpu_limit, anon_cap_mib=anon_cap_mib)
    src = cp_source()
    note = (f"cp copies statedict's own warm-up output ({cache.total_bytes([src]) / GiB:.2f} GiB, "
            f"{sum(1 for _ in cache.files_under([src]))} files)" if state["src"] else
            f"statedict did not run: cp copies the consolidated weights ({os.path.getsize(ref) / GiB:.2f} GiB)")
    if state["src"]:
        shutil.rmtree(cp_src, ignore_errors=True)
    return {
        "title": title,
        "input": f"the B1 checkpoint ({ctx.args.zero_ranks}-rank ZeRO-3, {cache.total_bytes([root]) / GiB:.2f} GiB); "
                 f"output: {output}; {note}",
        "results": results, "verdict": status, "detail": detail,
    }


def b4(ctx, runner):
    # --dcp-layout 1.13: the output is checked with torch 1.13's own DCP reader (dcp_equal), which
    # cannot unpickle the 2.x class names statedict writes by default; the data files are the same.
    return reshard_case(ctx, runner, "B4", ["--to", "dcp", "--world-size", "3", "--dcp-layout", "1.13"],
                        lambda root, ref: dcp_equal(ctx, ref), 1.3, "reshard 8 -> 3 ranks (ZeRO-3 -> DCP)",
                        "torch.distributed.checkpoint directory for 3 ranks", cpu_limit=1.1)


# ------------------------------------------------------------------------------------------ B11
def verify_equal(ctx, root):
    """`statedict verify` of the output against its input, optimizer state included."""
    def check(peer, _stdout):
        p = subprocess.run([ctx.statedict, "verify", root, peer.output, "--with-optimizer"], capture_output=True,
                           text=True, timeout=ctx.args.timeout)
        return None if p.returncode == 0 else f"verify exit {p.returncode}: " + " | ".join((p.stdout + p.stderr).strip().splitlines()[-3:])
    return check


def b11(ctx, runner):
    """The B1 checkpoint resharded for 3 ranks in DeepSpeed's own layout (what the engine saves at 3
    ranks, which it loads to resume): every partition and moment re-laid out. DeepSpeed's own route
    (ds_to_universal.py + a universal load) needs DeepSpeed and is measured by hand (bench/README.md)."""
    return reshard_case(ctx, runner, "B11", ["--to", "deepspeed", "--world-size", "3", "--with-optimizer"],
                        lambda root, ref: verify_equal(ctx, root), 1.3,
                        "reshard 8 -> 3 ranks (ZeRO-3 -> DeepSpeed ZeRO-3, with the optimizer state)",
                        "DeepSpeed's rank files for 3 ranks", anon_cap_mib=256)


# ------------------------------------------------------------------------------------------ B10
def b10_paths(ctx, ranks):
    name = f"zero-{B10_GIB:g}g-ws{ranks}"
    return os.path.join(ctx.data, name), os.path.join(ctx.data, name + ".reference.safetensors")


def b10(ctx, runner):
    """Consolidation of the same 4,917 parameters saved by 64, 512 and 1,024 ZeRO-3 ranks: every
    rank writes a model-states file listing every parameter, so a reader that keeps what each rank
    file repeats, or a chunk record per (rank, parameter), grows as ranks x tensors."""
    points = []
    for ranks in B10_RANKS:
        root, ref = b10_paths(ctx, ranks)
        ctx.log(f"  {ranks} ranks")
        peers = zero_peers(ctx, f"B10-{ranks}", root, ref)
        peers.insert(1, Peer("statedict inspect", [ctx.statedict, "inspect", root], kind="context", inputs=[root],
                             binary=ctx.statedict, cold=False))
        res = runner.run(f"B10-{ranks}", peers, ctx.args.scale_reps, 0, "none")
        points.append({"ranks": ranks, "results": res})
    base = {"title": "many ranks: ZeRO-3 consolidation at 64, 512 and 1,024 ranks -> safetensors",
            "input": f"DeepSpeed ZeRO-3 checkpoints of the same {B10_TENSORS} parameters (0.05 GiB of fp32 weights) "
                     f"saved by {', '.join(str(r) for r in B10_RANKS)} ranks, warm page cache",
            "points": points}

    def warm(p, kind):
        r = next((r for r in p["results"] if r["kind"] == kind), None)
        if r is None or r["status"] not in ("ok", "wrong") or not r["summary"].get("warm"):
            return None
        return r["summary"]["warm"]
    tool = [warm(p, "statedict") for p in points]
    if any(t is None for t in tool):
        return dict(base, verdict="n/a", detail="statedict: not available in this build or failed")
    ok = True
    parts = []
    anon = [(t["peak_anon_kib"] or 0) / 1024 for t in tool]
    ok = ok and all(a <= 256 for a in anon)
    parts.append("peak anon RSS " + ", ".join(f"{a:.0f}" for a in anon) + " MiB (target <= 256 MiB)")
    grow = tool[-1]["wall_median"] / tool[0]["wall_median"]
    allowed = 1.5 * (B10_RANKS[-1] + B10_TENSORS) / (B10_RANKS[0] + B10_TENSORS)
    ok = ok and grow <= allowed
    parts.append(f"time {tool[0]['wall_median']:.2f} s at {B10_RANKS[0]} ranks, {tool[-1]['wall_median']:.2f} s at "
                 f"{B10_RANKS[-1]}: {grow:.2f}x (target <= {allowed:.2f}x)")
    mid = B10_RANKS.index(512)
    peer = warm(points[mid], "peer")
    if peer:
        speedup = peer["wall_median"] / tool[mid]["wall_median"]
        ok = ok and speedup >= 20
        parts.append(f"at 512 ranks {speedup:.1f}x faster than the zero_to_fp32 algorithm (target >= 20x)")
    else:
        ok = False
        parts.append("no zero_to_fp32 measurement at 512 ranks")
    return dict(base, verdict="PASS" if ok else "MISS", detail="; ".join(parts))


# -------------------------------------------------------------------------------------- B12, B13
def _dequantize_case(ctx, runner, cid, scheme, check):
    """A quantized Hugging Face folder (bench/gen/gen_quant.py) dequantized to BF16 with
    `convert --dequantize`; cp copies statedict's own warm-up output (the same files and bytes)."""
    root = ctx.quant(scheme)
    sd, w = ctx.statedict, ctx.work
    out_sd = os.path.join(w, f"{cid}-statedict.hf")
    cp_src = os.path.join(w, f"{cid}-cp-source")
    out_cp = os.path.join(w, f"{cid}-cp.out")
    state = {"src": None}
    if os.path.lexists(cp_src):
        shutil.rmtree(cp_src)

    def keep_output(peer):
        if os.path.isdir(peer.output):
            os.rename(peer.output, cp_src)
            state["src"] = cp_src

    def validate(peer, _stdout):
        return check(root, peer.output)

    peers = [
        Peer("statedict", [sd, "convert", root, out_sd, "--to", "hf", "--dequantize", scheme, "--dtype", "BF16"],
             kind="statedict", inputs=[root], output=out_sd, binary=sd, after_warmup=keep_output, validate=validate),
        Peer("cp of the output bytes", lambda: cp_argv(state["src"] or root, out_cp), kind="limit",
             inputs=lambda: [state["src"] or root], output=out_cp),
    ]
    results = runner.run(cid, peers, ctx.args.reps, ctx.args.cold_reps, ctx.args.cold_method)
    status, detail = _ratio_verdict(results, 1.5, anon_cap_mib=256)
    src = state["src"]
    note = (f"cp copies statedict's own warm-up output ({cache.total_bytes([src]) / GiB:.2f} GiB, "
            f"{sum(1 for _ in cache.files_under([src]))} files)" if src else "statedict did not run: cp copies the input")
    if src:
        shutil.rmtree(src, ignore_errors=True)
    return {"root": root, "results": results, "verdict": status, "detail": detail, "note": note}


def b12(ctx, runner):
    """DeepSeek-V3-shaped block-FP8 weights (F8_E4M3 + F32 weight_scale_inv per 128 x 128 block,
    576-row weights with a partial block row) dequantized to BF16: twice the input's bytes."""
    names = [f"model.layers.0.self_attn.{n}.weight" for n in ("kv_a_proj_with_mqa", "q_b_proj")] + ["model.layers.1.mlp.down_proj.weight"]
    r = _dequantize_case(ctx, runner, "B12", "fp8-block", lambda src, out: quantcheck.fp8_block(src, out, names))
    r["title"] = "dequantize block-FP8 -> BF16 (Hugging Face folder, DeepSeek-V3 shapes)"
    r["input"] = (f"{cache.total_bytes([r.pop('root')]) / GiB:.2f} GiB of F8_E4M3 weights with F32 scales in 3 files; "
                  f"output: BF16 Hugging Face folder; {r.pop('note')}; checked: 3 weights bit for bit against numpy")
    return r


def b13(ctx, runner):
    """gpt-oss-shaped MXFP4 experts (U8 blocks [32, N, 90, 16], E8M0 scales) dequantized to BF16
    [32, 2880, N] as transformers lays them out: about four times the input's bytes."""
    names = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    r = _dequantize_case(ctx, runner, "B13", "mxfp4", lambda src, out: quantcheck.mxfp4(src, out, names))
    r["title"] = "dequantize MXFP4 -> BF16 (Hugging Face folder, gpt-oss expert shapes)"
    r["input"] = (f"{cache.total_bytes([r.pop('root')]) / GiB:.2f} GiB of MXFP4 experts; output: BF16 [E, 2880, N] "
                  f"tensors; {r.pop('note')}; checked: one expert of 2 tensors bit for bit against numpy")
    return r


# ------------------------------------------------------------------------------------------- B5
def _gbench_figure(benchmarks):
    """(seconds, rule, {name: {"real": s, "cpu": s}}) for flatten + unflatten.  The figure is the
    median *CPU* time: the benchmark is single-threaded and in-process, so CPU time is its cost, while
    its real time also counts the time other processes held the CPU (on this shared 2-core machine
    real time was 4x the CPU time under load)."""
    med = {}
    for b in benchmarks:
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        name = b.get("run_name") or b["name"]
        scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b.get("time_unit", "ns")]
        if b.get("run_type") == "aggregate" or name not in med:
            med[name] = {"real": b["real_time"] * scale, "cpu": b["cpu_time"] * scale}
    low = {n: n.lower().replace("_", "") for n in med}
    both = [n for n in med if "roundtrip" in low[n] or "flattenunflatten" in low[n]]
    if both:  # one benchmark does flatten then unflatten
        return med[both[0]]["cpu"], f"{both[0]}: flatten then unflatten in one iteration", med
    fl = [n for n in med if "flatten" in low[n] and "unflatten" not in low[n]]
    un = [n for n in med if "unflatten" in low[n]]
    if fl and un:
        return med[fl[0]]["cpu"] + med[un[0]]["cpu"], f"{fl[0]} + {un[0]}", med
    return None, "no flatten/unflatten benchmark found", med


def b5(ctx, runner):
    binary = os.path.join(ctx.bin_dir, "bench-flatten")
    base = {"title": "flatten + unflatten, 100k-leaf optimizer tree (in-process, Google Benchmark)",
            "input": f"{os.path.relpath(binary, ctx.repo)} (bench/bench-flatten.cpp)", "results": []}
    if not os.path.exists(binary):
        return dict(base, verdict="n/a", detail="bench-flatten: not available in this build (bench/bench-flatten.cpp "
                                                 "not written yet, or the build failed)")
    argv = [binary, "--benchmark_format=json", f"--benchmark_repetitions={ctx.args.reps}",
            "--benchmark_report_aggregates_only=true"]
    ctx.log("  " + " ".join(argv))
    p = subprocess.run(argv, capture_output=True, text=True, timeout=ctx.args.timeout)
    if p.returncode != 0:
        return dict(base, verdict="ERROR", detail=f"exit {p.returncode}: {p.stderr.strip()[-300:]}")
    data = json.loads(p.stdout)
    total, rule, med = _gbench_figure(data.get("benchmarks", []))
    if total is None:
        return dict(base, verdict="n/a", detail=rule, gbench=med)
    return dict(base, verdict="PASS" if total <= 0.050 else "MISS",
                detail=f"{total * 1000:.1f} ms CPU ({rule}; median of {ctx.args.reps} repetitions; target <= 50 ms)",
                gbench=med, gbench_context=data.get("context", {}))


# ------------------------------------------------------------------------------------------- B6
def _linfit(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx if sxx else 0.0
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return a, b, (1 - ss_res / ss_tot) if ss_tot else 1.0


def b6(ctx, runner, b1_result=None):
    points = []
    for gib in ctx.args.scale_gib:
        if b1_result is not None and math.isclose(gib, ctx.args.zero_gib):
            ctx.log(f"  {gib:g} GiB: the B1 measurement (same data, same run)")
            points.append({"gib": gib, "results": b1_result["results"], "from_b1": True})
            continue
        root, ref = ctx.zero(gib)
        ctx.log(f"  {gib:g} GiB")
        res = runner.run(f"B6-{gib:g}", zero_peers(ctx, f"B6-{gib:g}", root, ref), ctx.args.scale_reps, 0, "none")
        points.append({"gib": gib, "results": res, "from_b1": False})
    base = {"title": "scaling: B1 at several sizes", "points": points,
            "input": "ZeRO-3 checkpoints of " + ", ".join(f"{p['gib']:g}" for p in points) +
                     f" GiB ({ctx.args.zero_ranks} ranks, same structure, wider tensors), warm page cache"}
    series = {}
    for p in points:
        for r in p["results"]:
            s = r["summary"].get("warm")
            if r["status"] in ("ok", "wrong") and s:
                series.setdefault(r["name"], []).append((p["gib"], s["wall_median"], (s["peak_anon_kib"] or 0) / 1024))
    base["series"] = series
    fits = {}
    for name, pts in series.items():
        if len(pts) >= 2:
            a, b, r2 = _linfit([x for x, _, _ in pts], [y for _, y, _ in pts])
            fits[name] = {"intercept_s": a, "s_per_gib": b, "r2": r2,
                          "anon_min_mib": min(m for _, _, m in pts), "anon_max_mib": max(m for _, _, m in pts)}
    base["fits"] = fits
    tool = next((n for p in points for r in p["results"] if r["kind"] == "statedict" for n in [r["name"]]), None)
    if tool not in fits or len(series.get(tool, [])) < len(points):
        return dict(base, verdict="n/a", detail="statedict: not available in this build")
    f = fits[tool]
    flat = f["anon_max_mib"] - f["anon_min_mib"] <= max(32.0, 0.25 * f["anon_min_mib"])
    ok = f["r2"] >= 0.98 and flat
    detail = (f"time = {f['intercept_s']:.2f} s + {f['s_per_gib']:.2f} s/GiB, R^2 = {f['r2']:.3f}; "
              f"peak anon RSS {f['anon_min_mib']:.0f}..{f['anon_max_mib']:.0f} MiB")
    # Against DeepSpeed's algorithm at the largest size: >= 8x (warm medians of the same run).
    top = max(points, key=lambda p: p["gib"])
    walls = {r["kind"]: r["summary"]["warm"]["wall_median"] for r in top["results"]
             if r["status"] in ("ok", "wrong") and r["summary"].get("warm") and r["kind"] in ("statedict", "peer")}
    if "statedict" in walls and "peer" in walls:
        speedup = walls["peer"] / walls["statedict"]
        ok = ok and speedup >= 8.0
        detail += (f"; at {top['gib']:g} GiB: {walls['statedict']:.2f} s against the zero_to_fp32 algorithm's "
                   f"{walls['peer']:.2f} s = {speedup:.1f}x faster (target >= 8x)")
    else:
        ok = False
        detail += f"; at {top['gib']:g} GiB: no zero_to_fp32 measurement"
    base["speedup_at_largest"] = walls.get("peer", 0) / walls["statedict"] if walls.get("statedict") else None
    return dict(base, verdict="PASS" if ok else "MISS", detail=detail)


# ------------------------------------------------------------------------------------------- B7
def b7(ctx, runner):
    root, ref = ctx.megatron(ctx.args.megatron_gib)
    sd, w = ctx.statedict, ctx.work
    out = {k: os.path.join(w, f"B7-{k}.safetensors") for k in ("statedict", "torch", "cp")}
    peers = [
        Peer("statedict", [sd, "convert", root, out["statedict"]], kind="statedict", inputs=[root],
             output=out["statedict"], validate=st_equal(ref), binary=sd),
        Peer("Megatron loader's merge (torch 1.13)", [PY, os.path.join(ctx.peers, "megatron_merge.py"), root, out["torch"]],
             inputs=[root], output=out["torch"], validate=st_equal(ref)),
        Peer("cp of the output bytes", cp_argv(ref, out["cp"]), kind="limit", inputs=[ref], output=out["cp"]),
    ]
    results = runner.run("B7", peers, ctx.args.reps, ctx.args.cold_reps, ctx.args.cold_method)
    status, detail = _ratio_verdict(results, 1.15, anon_cap_mib=256, cpu_limit=1.1)
    f = _header_facts(ref)
    return {
        "title": "Megatron-LM merge, TP 4 x PP 2 -> safetensors",
        "input": f"Megatron-LM legacy checkpoint, TP {ctx.args.megatron_tp} x PP {ctx.args.megatron_pp} = "
                 f"{ctx.args.megatron_tp * ctx.args.megatron_pp} rank files, {cache.total_bytes([root]) / GiB:.2f} GiB on disk "
                 f"(bf16); output: {f['tensors']} tensors, {f['bytes'] / GiB:.2f} GiB safetensors",
        "results": results, "verdict": status, "detail": detail,
    }


ALL = ["B1", "B2", "B3", "B4", "B5", "B6", "B7", "B8", "B9", "B10", "B11", "B12", "B13"]
TARGETS.update(cases_library.TARGETS)


def run_all(ctx, runner, selected):
    out = {}
    for cid in ALL:
        if cid not in selected:
            continue
        ctx.log(f"== {cid}: {TARGETS[cid]}")
        t0 = ctx.clock()
        if cid == "B6":
            out[cid] = b6(ctx, runner, out.get("B1"))
        else:
            out[cid] = {"B1": b1, "B2": b2, "B3": b3, "B4": b4, "B5": b5, "B7": b7, "B8": cases_library.b8,
                        "B9": cases_library.b9, "B10": b10, "B11": b11, "B12": b12, "B13": b13}[cid](ctx, runner)
        out[cid]["target"] = TARGETS[cid]
        out[cid]["seconds"] = ctx.clock() - t0
        ctx.log(f"   {cid}: {out[cid]['verdict']} -- {out[cid]['detail']}  ({out[cid]['seconds']:.0f}s)")
        sys.stdout.flush()
    return out
