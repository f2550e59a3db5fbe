"""bench/chart.png: one panel per case (median wall time per peer, min-max whiskers, peak anonymous
RSS written on each bar; B1-B4 and B7) and two B6 panels (time and peak anonymous RSS against size)."""
import os
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"statedict": "#1f77b4", "peer": "#ff7f0e", "limit": "#7f7f7f", "context": "#c7c7c7"}


def _mem(kib):
    if kib is None:
        return "?"
    mib = kib / 1024
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib:.0f} MiB"


def _short(name):
    return (name.replace(" (context: fixed cost)", "").replace("zero_to_fp32 algorithm", "zero_to_fp32")
            .replace("cp of the output bytes", "cp (limit)").replace(" + safetensors writer", " + st write"))


def _bars(ax, case, cid):
    rows = []
    for r in case.get("results", []):
        for cond in ("warm", "cold"):
            s = r["summary"].get(cond)
            if s:
                rows.append((textwrap.fill(_short(r["name"]), 24) + f"\n[{cond}]", r["kind"], s, cond))
        if r["status"] == "unavailable":
            rows.append((textwrap.fill(_short(r["name"]), 24) + "\n[n/a]", r["kind"], None, "warm"))
    ax.set_title(f"{cid} {case['title']}\n" + textwrap.fill(f"{case['verdict']}: {case['detail']}", 70,
                                                             max_lines=2), fontsize=8)
    if not rows:
        ax.text(0.5, 0.5, "not available in this build", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    ys = list(range(len(rows)))[::-1]
    top = max((s["wall_max"] for _, _, s, _ in rows if s), default=1.0)
    for y, (label, kind, s, cond) in zip(ys, rows):
        if s is None:
            ax.text(0, y, "  not available in this build", va="center", fontsize=7, color="#555")
            continue
        ax.barh(y, s["wall_median"], color=COLORS.get(kind, "#999"), alpha=1.0 if cond == "warm" else 0.55,
                xerr=[[s["wall_median"] - s["wall_min"]], [s["wall_max"] - s["wall_median"]]],
                error_kw={"elinewidth": 0.8, "capsize": 2})
        ax.text(s["wall_max"] + top * 0.02, y, f"{s['wall_median']:.2f}s, anon {_mem(s['peak_anon_kib'])}",
                va="center", fontsize=6.5)
    ax.set_yticks(ys)
    ax.set_yticklabels([r[0] for r in rows], fontsize=7)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlim(0, top * 1.6)
    ax.set_xlabel("wall time, s (median, min-max)", fontsize=7)
    ax.tick_params(axis="x", labelsize=7)


def _b5(ax, case):
    ax.set_title("B5 flatten + unflatten, 100k leaves\n" + textwrap.fill(f"{case['verdict']}: {case['detail']}", 70,
                                                                        max_lines=2), fontsize=8)
    g = case.get("gbench") or {}
    if not g:
        ax.text(0.5, 0.5, "not available in this build", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    names = list(g)
    ax.barh(range(len(names))[::-1], [g[n]["cpu"] * 1000 for n in names], color=COLORS["statedict"])
    ax.axvline(50, color="red", lw=0.8, ls="--")
    ax.set_yticks(range(len(names))[::-1])
    ax.set_yticklabels(names, fontsize=6)
    ax.set_xlabel("median CPU time, ms (target 50 ms: dashed)", fontsize=7)


def _b6(ax_t, ax_m, case):
    ax_t.set_title("B6 scaling: median wall time\n" + textwrap.fill(f"{case['verdict']}: {case['detail']}", 70,
                                                                   max_lines=2), fontsize=8)
    ax_m.set_title("B6 scaling: peak anonymous RSS", fontsize=8)
    series = case.get("series") or {}
    if not series:
        for ax in (ax_t, ax_m):
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
        return
    kinds = {r["name"]: r["kind"] for p in case["points"] for r in p["results"]}
    for name, pts in series.items():
        xs = [p[0] for p in pts]
        c = COLORS.get(kinds.get(name), "#999")
        ax_t.plot(xs, [p[1] for p in pts], "o-", color=c, label=_short(name))
        ax_m.plot(xs, [p[2] for p in pts], "o-", color=c, label=_short(name))
        f = (case.get("fits") or {}).get(name)
        if f:
            fx = [min(xs), max(xs)]
            fy = [f["intercept_s"] + f["s_per_gib"] * x for x in fx]
            if min(fy) > 0:  # log axis
                ax_t.plot(fx, fy, ":", color=c, lw=0.8)
    for ax, yl in ((ax_t, "median wall time, s (log)"), (ax_m, "peak anonymous RSS, MiB (log)")):
        ax.set_xlabel("checkpoint size, GiB (params + Adam moments)", fontsize=7)
        ax.set_ylabel(yl, fontsize=7)
        ax.tick_params(labelsize=7)
        ax.set_xlim(left=0)
        ax.legend(fontsize=6)
    ax_t.set_yscale("log")  # statedict and cp are 10-40x below the Python peer
    ax_m.set_yscale("log")
    ax_m.axhline(256, color="red", lw=0.8, ls="--")


def draw(doc, path):
    cs = doc["cases"]
    fig, axes = plt.subplots(3, 3, figsize=(18, 15))
    for cid, ax in (("B1", axes[0][0]), ("B2", axes[0][1]), ("B3", axes[0][2]), ("B4", axes[1][0]), ("B7", axes[2][2])):
        if cid in cs:
            _bars(ax, cs[cid], cid)
        else:
            ax.set_axis_off()
    if "B5" in cs:
        _b5(axes[1][1], cs["B5"])
    else:
        axes[1][1].set_axis_off()
    if "B6" in cs:
        _b6(axes[2][0], axes[2][1], cs["B6"])
    else:
        axes[2][0].set_axis_off()
        axes[2][1].set_axis_off()
    m = doc["machine"]
    axes[1][2].set_axis_off()
    lines = ["statedict vs its peers vs cp", m["date"], f"{m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM",
             f"kernel {m['kernel']}", m["virtualization"], m["filesystem"], m["python_peers"], "",
             "bars: median wall time, whiskers min-max;",
             "solid = warm page cache, faded = cold (inputs",
             "evicted with posix_fadvise DONTNEED);",
             "labels: median and peak anonymous RSS.",
             "blue: statedict, orange: Python peers (torch 1.13),",
             "grey: cp of the same bytes + fsync (the limit).",
             "", "details: bench/results.md, bench/README.md"]
    axes[1][2].text(0, 1, "\n".join(textwrap.fill(x, 52) if x else x for x in lines), va="top", fontsize=9,
                    family="monospace")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path + ".tmp.png", dpi=80)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)
