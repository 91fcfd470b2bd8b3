"""Draws the juneau-perf report's plots from report.json (Debian's python3-matplotlib).

usage: plot.py report.json OUTDIR   -- prints the paths of the PNGs it wrote
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

report = json.load(open(sys.argv[1]))
out = sys.argv[2]
written = []

COLORS = {
    "kernel-forward": "#7f7f7f",
    "nft-dnat": "#1f77b4",
    "xdp-dnat": "#2ca02c",
    "afxdp-l2fwd": "#9467bd",
    "juneau": "#d62728",
}

# Throughput bars: median with min..max whiskers.
sc = report["scenarios"]
if sc:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [s["name"] for s in sc]
    med = [s["median_pps"] / 1e3 for s in sc]
    lo = [(s["median_pps"] - s["min_pps"]) / 1e3 for s in sc]
    hi = [(s["max_pps"] - s["median_pps"]) / 1e3 for s in sc]
    bars = ax.bar(names, med, yerr=[lo, hi], capsize=6,
                  color=[COLORS.get(n, "#333333") for n in names])
    for i, s in enumerate(sc):
        # Each run as a dot beside the bar: filled paced, hollow flooded (the bar is
        # the median of the paced windows, of the flooded when none was paced).
        # A round's extra flooded window (its "also") is a dot of its own.
        runs = s.get("runs") or [{"delivered_pps": r} for r in s["runs_pps"]]
        runs = [w for r in runs for w in [r] + r.get("also", [])]
        for r in runs:
            flooded = r.get("rate_pps", 0) == 0 and (r.get("calibration") or r.get("extra"))
            ax.plot([i + 0.3], [r["delivered_pps"] / 1e3], "o", ms=4, alpha=0.7,
                    color="k", fillstyle="none" if flooded else "full")
    for b, m, s in zip(bars, med, sc):
        ax.annotate(f"{m:.0f}k", (b.get_x() + b.get_width() / 2, s["max_pps"] / 1e3),
                    ha="center", va="bottom", xytext=(0, 4), textcoords="offset points",
                    fontweight="bold")
    ax.set_ylabel("delivered kpps at the backend")
    ax.set_title(f"64-byte UDP throughput through the node ({sc[0]['flows']} flows, "
                 f"{len(sc[0]['runs_pps'])} run(s) each)\n"
                 f"bar: median of the paced windows (flooded if none), whiskers: their min..max\n"
                 f"dots: runs (hollow: flooded); {report['date']}", fontsize=9)
    ax.set_ylim(0, max(s["max_pps"] for s in sc) / 1e3 * 1.2 + 1)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    p = os.path.join(out, "throughput.png")
    fig.savefig(p, dpi=110)
    written.append(p)

# Flow scale.
fs = report["flow_scale"]
if fs:
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"{p['flows']:,}" for p in fs]
    vals = [p["median_pps"] / 1e3 for p in fs]
    bars = ax.bar(labels, vals, color=COLORS["juneau"])
    for b, m in zip(bars, vals):
        ax.annotate(f"{m:.0f}k", (b.get_x() + b.get_width() / 2, m), ha="center",
                    va="bottom", xytext=(0, 3), textcoords="offset points")
    ax.set_xlabel("concurrent flows")
    ax.set_ylabel("delivered kpps (median of the paced\nwindows, flooded if none)")
    ax.set_title("juneau throughput against flow count")
    ax.set_ylim(0, max(vals) * 1.2 if max(vals) > 0 else 1)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    p = os.path.join(out, "flow_scale.png")
    fig.savefig(p, dpi=110)
    written.append(p)

# Latency percentile curves: one panel per offered load, one line per scenario.
lat = report["latency"]
if lat:
    loads = sorted({l["load_fraction"] for l in lat})
    fig, axes = plt.subplots(1, len(loads), figsize=(5 * len(loads), 4.2), sharey=True,
                             squeeze=False)
    for ax, load in zip(axes[0], loads):
        # One line per round (rounds of one scenario share its color; labelled once).
        labelled = set()
        for l in [x for x in lat if x["load_fraction"] == load]:
            pts = [(p, us) for p, us in l["curve"] if p < 100.0]
            xs = [1.0 / (1.0 - p / 100.0) for p, _ in pts]
            name = l["scenario"]
            ax.plot(xs, [us for _, us in pts], marker="o", ms=2, lw=1, alpha=0.8,
                    label=None if name in labelled else name,
                    color=COLORS.get(name, "#333333"))
            labelled.add(name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ticks = [2, 10, 100, 1000, 10000]
        ax.set_xticks(ticks)
        ax.set_xticklabels(["50%", "90%", "99%", "99.9%", "99.99%"])
        ax.set_xlim(0.9, 20000)
        ax.set_xlabel("percentile")
        ax.set_title(f"offered load {load * 100:.0f}% of each path's max")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    axes[0][0].set_ylabel("round trip through the VIP (us)")
    fig.tight_layout()
    p = os.path.join(out, "latency.png")
    fig.savefig(p, dpi=110)
    written.append(p)

# Control-plane convergence: CDF of every sample, one line per (event, destination).
conv = report.get("convergence_results")
if conv and conv.get("series"):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"shared memory": "-", "BIRD": "--", "round trip": ":"}
    for s in conv["series"]:
        xs = sorted(s["samples_ms"])
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ls = next((v for k, v in styles.items() if k in s["name"]), "-")
        color = "#d62728" if s["name"].startswith("withdraw") else (
            "#1f77b4" if s["name"].startswith("announce") else "#7f7f7f")
        ax.step(xs, ys, where="post", linestyle=ls, color=color,
                label=f'{s["name"]} (p50 {s["p50_ms"]:.1f} ms)')
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("ms after the EndpointSlice PATCH was sent")
    ax.set_ylabel("fraction of changes")
    ax.set_title(f'control-plane convergence, {conv["repetitions"]} repetitions')
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    p = os.path.join(out, "convergence.png")
    fig.savefig(p, dpi=110)
    written.append(p)

for p in written:
    print(p)
