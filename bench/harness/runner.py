"""Run the peers of one case: a discarded warm-up run each, then `reps` repetitions alternating the
peers (A B C A B C ...) with a warm page cache, then `cold_reps` repetitions with the inputs evicted
before every run.  The Python peers (kind "peer" and "context") take part in the first
`--peer-reps` / `--peer-cold-reps` repetitions only: at the default sizes one of their runs takes
20-80 s here (torch.load of 3 GiB spends most of it faulting in fresh memory), 10-40x statedict's,
so more repetitions would not change a ratio but would take the suite far past 15 minutes.
Outputs are deleted and the page cache synced (untimed) between runs."""
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from . import cache, measure


@dataclass
class Peer:
    name: str
    argv: object  # list, or a callable returning one (resolved just before the warm-up run)
    kind: str = "peer"  # "statedict" | "peer" | "limit" (cp) | "context"
    inputs: object = ()  # paths evicted for the cold condition (or a callable)
    output: Optional[str] = None  # removed before and after every run
    stdout: bool = False  # keep stdout in a file (for validation), else /dev/null
    validate: Optional[Callable] = None  # validate(peer, stdout_path) -> None | "what is wrong"
    binary: Optional[str] = None  # if set and missing: "not available in this build"
    after_warmup: Optional[Callable] = None  # after_warmup(peer): e.g. keep the output as cp's source
    cold: bool = True  # also run in the cold condition (secondary variants are warm only, to save time)
    note: str = ""


@dataclass
class PeerResult:
    name: str
    kind: str
    status: str = "ok"  # ok | unavailable | error | wrong
    message: str = ""
    argv: list = field(default_factory=list)
    runs: dict = field(default_factory=dict)  # condition -> [Run as dict]
    resident_after_evict: list = field(default_factory=list)
    resident_warm: list = field(default_factory=list)  # fraction of the inputs in the page cache before each warm run
    note: str = ""


def _value(x):
    return x() if callable(x) else x


def _remove(path):
    if not path:
        return
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def summarize(runs):
    """median / min / max / quartiles of wall; medians of the memory figures."""
    if not runs:
        return None
    walls = sorted(r["wall"] for r in runs)
    q = statistics.quantiles(walls, n=4) if len(walls) >= 4 else [walls[0], statistics.median(walls), walls[-1]]
    return {
        "n": len(runs),
        "wall_median": statistics.median(walls),
        "wall_min": walls[0],
        "wall_max": walls[-1],
        "wall_q1": q[0],
        "wall_q3": q[2],
        "cpu_median": statistics.median(r.get("cpu", 0.0) for r in runs),
        "background_median": statistics.median(r.get("background_cores", 0.0) for r in runs),
        "background_max": max(r.get("background_cores", 0.0) for r in runs),
        "maxrss_kib": max((r["maxrss_kib"] for r in runs if r["maxrss_kib"] is not None), default=None),
        "peak_anon_kib": max((r["peak_anon_kib"] for r in runs if r["peak_anon_kib"] is not None), default=None),
    }


class CaseRunner:
    def __init__(self, ctx):
        self.ctx = ctx

    def _one(self, peer, res, tag):
        ctx = self.ctx
        _remove(peer.output)
        cache.sync_all()
        stdout_path = os.path.join(ctx.work, f"{tag}.stdout") if peer.stdout else None
        stderr_path = os.path.join(ctx.work, f"{tag}.stderr")
        r = measure.run(res.argv, stdout_path=stdout_path, stderr_path=stderr_path,
                        interval=ctx.args.interval, timeout=ctx.args.timeout)
        return r, stdout_path

    def run(self, case_id, peers, reps, cold_reps, cold_method):
        ctx = self.ctx
        results = []
        # The inputs are evicted once before the warm-ups, so that a warm run finds them as the
        # warm-up runs read them in, not as whatever ran before left them: how a file came into
        # the page cache (large folios from read() or a huge-page mapping, 4 KiB ones from faults
        # or scattered reads) changes what copying out of it costs.
        if getattr(ctx.args, "cold_method", "none") != "none":
            inputs = set()
            for p in peers:
                try:
                    inputs.update(cache.files_under(_value(p.inputs) or []))
                except Exception:  # inputs a peer's warm-up has yet to make (cp of statedict's output)
                    pass
            inputs = sorted(inputs)
            if inputs:
                cache.make_cold(inputs, ctx.args.cold_method)
        for peer in peers:
            res = PeerResult(peer.name, peer.kind, note=peer.note)
            results.append(res)
            if peer.binary and not os.path.exists(peer.binary):
                res.status, res.message = "unavailable", f"{peer.binary} not built"
                continue
            try:
                res.argv = [str(a) for a in _value(peer.argv)]
            except Exception as e:  # e.g. cp's source depends on a peer that did not run
                res.status, res.message = "unavailable", str(e)
                continue
            tag = f"{case_id}-{len(results)}"
            ctx.log(f"  warm-up  {peer.name}: {' '.join(res.argv)}")
            r, out = self._one(peer, res, tag)
            status = measure.classify(r)
            if status != "ok":
                res.status = status
                res.message = f"exit {r.rc}: {r.stderr_tail.splitlines()[-1] if r.stderr_tail else ''}"
                ctx.log(f"    -> {status}: {res.message}")
                _remove(peer.output)
                continue
            res.runs["warm-up"] = [asdict(r)]
            if peer.validate:
                why = peer.validate(peer, out)
                if why:
                    res.status, res.message = "wrong", f"output check failed: {why}"
                    ctx.log(f"    -> WRONG OUTPUT: {why}")
                else:
                    ctx.log("    output checked: equal to the reference")
            if peer.after_warmup:
                peer.after_warmup(peer)
            _remove(peer.output)
            ctx.log(f"    {r.wall:.3f}s, peak RSS {(r.maxrss_kib or 0) / 1024:.0f} MiB, "
                    f"anon {(r.peak_anon_kib or 0) / 1024:.0f} MiB")
        active = [(p, r) for p, r in zip(peers, results) if r.status in ("ok", "wrong")]
        caps = {"warm": getattr(ctx.args, "peer_reps", reps), "cold": getattr(ctx.args, "peer_cold_reps", cold_reps)}
        for cond, n in (("warm", reps), ("cold", cold_reps)):
            if cond == "cold" and (cold_method == "none" or not n):
                continue
            for rep in range(n):
                line = []
                for peer, res in active:
                    if cond == "cold" and not peer.cold:
                        continue
                    if peer.kind in ("peer", "context") and rep >= caps[cond]:
                        continue
                    if cond == "cold":
                        frac = cache.make_cold(list(cache.files_under(_value(peer.inputs))), cold_method)
                        res.resident_after_evict.append(frac)
                    elif _value(peer.inputs):
                        r_in, t_in = cache.resident(list(cache.files_under(_value(peer.inputs))))
                        res.resident_warm.append(r_in / t_in if t_in else 1.0)
                    r, _ = self._one(peer, res, f"{case_id}-{cond}")
                    _remove(peer.output)
                    if r.rc != 0:
                        res.status, res.message = "error", f"exit {r.rc} in {cond} rep {rep}: {r.stderr_tail[-300:]}"
                    res.runs.setdefault(cond, []).append(asdict(r))
                    line.append(f"{peer.name} {r.wall:.2f}s (bg {r.background_cores:.1f})")
                ctx.log(f"  {cond} {rep + 1}/{n}: " + ", ".join(line))
        cache.sync_all()
        out = []
        for res in results:
            d = asdict(res)
            d["summary"] = {c: summarize(v) for c, v in res.runs.items() if c != "warm-up"}
            out.append(d)
        return out


def now():
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")
