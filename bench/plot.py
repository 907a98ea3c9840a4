#!/usr/bin/python3
"""Plots and ratio tables from the NBD benchmark harness's results.tsv.

Usage: /usr/bin/python3 bench/plot.py RESULTS_TSV OUTDIR   -> OUTDIR/*.png
       /usr/bin/python3 bench/plot.py RESULTS_TSV --table  -> markdown on stdout
       /usr/bin/python3 bench/plot.py RESULTS_TSV --summary -> like-for-like ratios
       /usr/bin/python3 bench/plot.py RESULTS_TSV --goals   -> the default mode's goals
       /usr/bin/python3 bench/plot.py RESULTS_TSV --convert -> convert, like for like,
                                                               time and server CPU

Needs Debian's python3-matplotlib (only for the PNGs). "custom" is rawdisk
serve --cache writeback, "custom:direct" rawdisk serve --cache none, as set
by bench/run-matrix.sh. The anchors are nbdkit and qemu-nbd in both cache
modes the harness runs; "faster anchor" is the one with the lowest median on
that row (highest for throughput), so rawdisk is held to the best of them.
"""
import csv
import math
import os
import statistics
import sys
from collections import defaultdict

LABEL = {"custom": "rawdisk", "custom:direct": "rawdisk-direct", "custom:wb": "rawdisk-wb",
         "custom:mw": "rawdisk-mw"}
MINE = ["custom", "custom:direct", "custom:wb", "custom:mw"]
ANCHORS = ["nbdkit", "qemu-nbd", "qemu-nbd-direct", "qemu-nbd-uring", "qemu-nbd-unmap",
           "nbd-server"]
ANCHOR_TOOLS = ["qemu-img"]
ORDER = ["nbdkit", "qemu-nbd", "qemu-nbd-direct", "custom", "custom:direct", "custom:wb",
         "custom:mw", "qemu-img", "shell"]
COLOR = {"nbdkit": "#7f7f7f", "qemu-nbd": "#1f77b4", "qemu-nbd-direct": "#aec7e8",
         "custom": "#d62728", "custom:direct": "#ff9896", "custom:wb": "#9467bd",
         "custom:mw": "#2ca02c",
         "qemu-img": "#1f77b4",
         "shell": "#7f7f7f"}
TARGETS = ["tmpfs", "ramfs", "ext4", "xfs", "blk", "blk4k", "blk-nowz", "hostfs"]


def load(path):
    # cell[(script, workload, target)][server] -> {rep: value}; failures kept apart
    cells = defaultdict(lambda: defaultdict(dict))
    fails = defaultdict(lambda: defaultdict(list))
    res = defaultdict(lambda: defaultdict(list))   # rss/cpu per cell and server
    cpu = defaultdict(lambda: defaultdict(dict))   # server CPU s, same shape as cells
    metric_of = {"throughput": "bw_MiBps"}
    with open(path) as f:
        for r in csv.DictReader(f, delimiter="\t"):
            s = r["script"]
            if s not in ("convert", "zero", "throughput", "prealloc") or r["workload"] == "(all)":
                continue
            if r["metric"] != metric_of.get(s, "time_s"):
                continue
            k = (s, r["workload"], r["target"])
            try:
                v = float(r["value"])
            except ValueError:
                v = None
            if r["ok"] == "1" and v is not None:
                cells[k][r["server"]][r["rep"]] = v
                try:
                    res[k][r["server"]].append((float(r["rss_kb"]) / 1024.0, float(r["cpu_s"])))
                    cpu[k][r["server"]][r["rep"]] = float(r["cpu_s"])
                except ValueError:
                    pass
            else:
                fails[k][r["server"]].append(r["note"])
    return cells, fails, res, cpu


def med(d):
    return statistics.median(d.values()) if d else None


def order_key(s):
    return ORDER.index(s) if s in ORDER else 99


def tkey(t):
    return TARGETS.index(t) if t in TARGETS else 99


def faster_anchor(script, row, anchors=None):
    """(median, name) of the best of `anchors` on this row (all of them by default)."""
    if anchors is None:
        anchors = ANCHOR_TOOLS if script == "prealloc" else ANCHORS
    cand = [(med(row[a]), a) for a in anchors if a in row and row[a]]
    if not cand:
        return None, None
    hib = script == "throughput"
    return (max if hib else min)(cand)


def meets(script, ratio):
    """The goal: times <= 0.9 x anchor, bandwidth >= anchor / 0.9."""
    return ratio >= 1 / 0.9 if script == "throughput" else ratio <= 0.9


def paired(row, a, b):
    rs = [row[a][k] / row[b][k] for k in row[a] if k in row[b] and row[b][k]]
    return statistics.median(rs) if rs else None


def fmt(v):
    if v is None:
        return "-"
    return "%.0f" % v if v >= 100 else "%.1f" % v if v >= 10 else "%.2f" % v if v >= 1 else "%.3f" % v


def mine_in(cells, keys):
    """The rawdisk variants measured on any of these rows, in MINE order."""
    return [m for m in MINE if any(cells[k].get(m) for k in keys)]


def table(cells, fails, res):
    """Per row: rawdisk (both modes) median / faster anchor's median, and paired."""
    scripts = ["convert", "zero", "throughput", "prealloc"]
    for script in scripts:
        keys = sorted((k for k in cells if k[0] == script), key=lambda k: (k[1], tkey(k[2])))
        if not keys:
            continue
        hib = script == "throughput"
        mine = mine_in(cells, keys)
        print("#### %s: rawdisk / faster anchor (%s)\n" % (
            script, "MiB/s, >= 1.11 is the goal" if hib else "seconds, <= 0.90 is the goal"))
        print("| workload | target | faster anchor (median) | " +
              " | ".join("%s median | ratio (paired) | server CPU s: it / anchor | peak RSS MiB: it / anchor"
                         % LABEL.get(m, m) for m in mine) + " |")
        print("|---|---|---|" + "---|---|---|---|" * len(mine))
        for k in keys:
            row = cells[k]
            am, an = faster_anchor(script, row)
            out = ["%s" % k[1], k[2], "%s %s" % (an, fmt(am)) if an else "-"]
            for m in mine:
                if m in row and row[m] and am:
                    mm = med(row[m])
                    p = paired(row, m, an)
                    r = mm / am
                    good = meets(script, r)
                    rss_m = statistics.median(x[0] for x in res[k][m]) if res[k][m] else None
                    rss_a = statistics.median(x[0] for x in res[k][an]) if res[k][an] else None
                    cpu_m = statistics.median(x[1] for x in res[k][m]) if res[k][m] else None
                    cpu_a = statistics.median(x[1] for x in res[k][an]) if res[k][an] else None
                    out += [fmt(mm), "%s%.2f (%s)%s" % ("**" if not good else "", r,
                                                        "%.2f" % p if p else "-",
                                                        "**" if not good else ""),
                            "%s / %s" % (fmt(cpu_m), fmt(cpu_a)),
                            "%s / %s" % (fmt(rss_m), fmt(rss_a))]
                elif fails[k].get(m):
                    out += ["failed: %s" % fails[k][m][0][:40], "", "", ""]
                else:
                    out += ["-", "", "", ""]
            print("| " + " | ".join(out) + " |")
        print()


# Like for like: rawdisk through the page cache against the servers that use
# it too, rawdisk --cache none against qemu-nbd --cache=none.
PAGE_ANCHORS = ["nbdkit", "qemu-nbd"]
DIRECT_ANCHORS = ["qemu-nbd-direct"]
VERSUS = [("custom", PAGE_ANCHORS), ("custom:direct", DIRECT_ANCHORS), ("custom:wb", PAGE_ANCHORS),
          ("custom:mw", PAGE_ANCHORS)]


def versus(script, row, mine, anchors):
    """Median ratio and paired ratio of `mine` against the best of `anchors`."""
    am, an = faster_anchor(script, row, anchors)
    if an is None or not row.get(mine):
        return None
    return med(row[mine]) / am, paired(row, mine, an)


def summary(cells):
    """One line per row: each rawdisk mode against its like-for-like anchor,
    and the best rawdisk mode against every anchor; then how many rows meet
    the goal in each column."""
    columns = [(LABEL[m], m, anchors) for m, anchors in VERSUS] + [("some mode", None, ANCHORS)]
    for script in ["convert", "zero", "throughput"]:
        keys = sorted((k for k in cells if k[0] == script), key=lambda k: (k[1], tkey(k[2])))
        if not keys:
            continue
        hib = script == "throughput"
        print("#### %s, like for like (%s; median ratio, paired in brackets; "
              "+ = goal met)\n" % (script, "MiB/s, goal >= 1.11" if hib else "seconds, goal <= 0.90"))
        print("| workload | target | " + " | ".join(
            "%s / %s" % (name, ", ".join(anchors) if mine else "every anchor")
            for name, mine, anchors in columns) + " |")
        print("|---|---|" + "---|" * len(columns))
        seen = {name: 0 for name, _, _ in columns}
        met = dict(seen)
        for k in keys:
            row = cells[k]
            out = [k[1], k[2]]
            for name, mine, anchors in columns:
                if mine is None:
                    vs = [v for v in (versus(script, row, m, anchors) for m in MINE) if v]
                    v = ((max if hib else min)(v[0] for v in vs), None) if vs else None
                else:
                    v = versus(script, row, mine, anchors)
                if v is None:
                    out.append("-")
                    continue
                good = meets(script, v[0])
                seen[name] += 1
                met[name] += good
                out.append("%.2f%s%s" % (v[0], " (%.2f)" % v[1] if v[1] else "",
                                          " +" if good else ""))
            print("| " + " | ".join(out) + " |")
        print("\nGoal met on: %s\n" % ", ".join(
            "%s %d of %d" % (name, met[name], seen[name]) for name in seen if seen[name]))


def one_call(workload, target):
    """Whether one offload call does the whole zero request (a punched hole
    or ZERO_RANGE, BLKZEROOUT or discard on a loop device): such rows are
    judged against the plain syscall on the same storage
    (bench/zero-methods.sh). Not ramfs (zeros are written) nor a no-trim
    zero on tmpfs (punch + fallocate or writing, timed; capabilities.md)."""
    return target != "ramfs" and not (target == "tmpfs" and workload == "zero-nohole")


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def goals(cells):
    """The default mode's goals (docs/benchmarks.md, Goals of the default
    mode): per row, each mode's median [min-max], the fastest of its anchors
    by median and the paired ratio (median over repetitions of mode /
    anchor), judged to two decimals; then per mode the rows that meet the
    row goal and the geometric mean of the paired ratios. The default mode
    is held to every anchor, --cache none to the O_DIRECT ones."""
    direct = DIRECT_ANCHORS + ["qemu-nbd-uring"]
    modes = [("custom", ANCHORS), ("custom:direct", direct)]
    rule = {"convert": "row <= 1.00, geometric mean <= 0.85",
            "throughput": "row >= 1.00, geometric mean >= 1.15",
            "zero": "one offload call: <= 1.1 x the syscall + 2 ms (`L`); others <= 0.90"}
    totals = []
    for script in ["convert", "throughput", "zero"]:
        keys = sorted((k for k in cells if k[0] == script), key=lambda k: (k[1], tkey(k[2])))
        if not keys:
            continue
        hib = script == "throughput"
        print("#### %s (%s)\n" % (script, rule[script]))
        print("| workload | target | " + " | ".join(
            "%s [min-max] | fastest anchor | paired" % LABEL[m] for m, _ in modes) + " |")
        print("|---|---|" + "---|---|---|" * len(modes))
        ratios = {m: [] for m, _ in modes}
        met = {m: [0, 0] for m, _ in modes}
        for k in keys:
            out = [k[1], k[2]]
            for m, anchors in modes:
                row = cells[k]
                am, an = faster_anchor(script, row, anchors)
                if an is None or not row.get(m):
                    out += ["-", "-", "-"]
                    continue
                vals = sorted(row[m].values())
                p = round(paired(row, m, an) or med(row[m]) / am, 2)
                ratios[m].append(p)
                if script == "zero" and one_call(k[1], k[2]):
                    mark = " L"
                else:
                    lim = (1 / 0.9 if hib else 0.9) if script == "zero" else 1.0
                    good = p >= lim if hib else p <= lim
                    met[m][0] += good
                    met[m][1] += 1
                    mark = " +" if good else ""
                out += ["%s [%s-%s]" % (fmt(med(row[m])), fmt(vals[0]), fmt(vals[-1])),
                        "%s %s" % (an, fmt(am)), "%.2f%s" % (p, mark)]
            print("| " + " | ".join(out) + " |")
        print()
        for m, _ in modes:
            if ratios[m]:
                totals.append((script, LABEL[m], met[m], geomean(ratios[m])))
    print("| workload | mode | rows meeting the row goal | geometric mean of the paired ratios |")
    print("|---|---|---|---|")
    for script, label, (good, n), g in totals:
        print("| %s | %s | %d of %d | %.2f |" % (script, label, good, n, g))


def plots(cells, fails, outdir, cpu=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(outdir, exist_ok=True)
    jobs = [(s, cells, "") for s in ("convert", "zero", "throughput", "prealloc")]
    if cpu:
        # Server CPU time is far less sensitive to a loaded machine than wall time.
        jobs += [(s, cpu, "-cpu") for s in ("convert", "zero")]
    for script, cells, suffix in jobs:
        keys = [k for k in cells if k[0] == script]
        if not keys:
            continue
        if script == "throughput":
            panels = sorted({k[2] for k in keys}, key=tkey)       # one panel per target
            groups_of = lambda p: sorted({k[1] for k in keys if k[2] == p})
            key_of = lambda p, g: (script, g, p)
        else:
            panels = sorted({k[1] for k in keys})                 # one panel per workload
            groups_of = lambda p: sorted({k[2] for k in keys if k[1] == p}, key=tkey)
            key_of = lambda p, g: (script, p, g)
        servers = sorted({s for k in keys for s in cells[k]}, key=order_key)
        n = len(panels)
        fig, axes = plt.subplots(n, 1, figsize=(11, 3.2 * n), squeeze=False)
        for ax, p in zip(axes[:, 0], panels):
            groups = groups_of(p)
            w = 0.8 / max(1, len(servers))
            for i, s in enumerate(servers):
                xs, ys, lo, hi = [], [], [], []
                for j, g in enumerate(groups):
                    d = cells.get(key_of(p, g), {}).get(s)
                    if not d:
                        if fails.get(key_of(p, g), {}).get(s):
                            ax.text(j - 0.4 + w * (i + 0.5), 0, "x", ha="center", va="bottom",
                                    color=COLOR.get(s, "k"), fontsize=8)
                        continue
                    v = list(d.values())
                    m = statistics.median(v)
                    xs.append(j - 0.4 + w * (i + 0.5))
                    ys.append(m)
                    lo.append(m - min(v))
                    hi.append(max(v) - m)
                ax.bar(xs, ys, w, yerr=[lo, hi], capsize=2, label=LABEL.get(s, s),
                       color=COLOR.get(s))
            ax.set_xticks(range(len(groups)))
            ax.set_xticklabels(groups, fontsize=8)
            ax.set_title("%s: %s" % (script, p), fontsize=10)
            ax.set_ylabel("MiB/s (higher is better)" if script == "throughput"
                          else "server CPU s (lower is better)" if suffix
                          else "seconds (lower is better)", fontsize=8)
            ax.grid(axis="y", alpha=0.3)
        # Handles built by hand: a server with no successful run in the first
        # panel (e.g. nbdkit has no FAST_ZERO) would otherwise get a wrong patch.
        from matplotlib.patches import Patch
        axes[0, 0].legend(handles=[Patch(color=COLOR.get(s, "k"), label=LABEL.get(s, s))
                                   for s in servers], fontsize=8, ncol=len(servers))
        fig.text(0.01, 0.003, "median of repetitions, bars = min..max; x = failed, "
                 "no bar = not runnable (no O_DIRECT on ramfs)",
                 fontsize=7)
        fig.tight_layout(rect=(0, 0.06 / n, 1, 1))
        fig.savefig(os.path.join(outdir, "%s%s.png" % (script, suffix)), dpi=90)
        plt.close(fig)

    # rawdisk's median divided by the faster anchor's, every row, one chart.
    cells = jobs[0][1]
    rows = []
    for k in sorted(cells, key=lambda k: (k[0], k[1], tkey(k[2]))):
        am, an = faster_anchor(k[0], cells[k])
        if not am:
            continue
        for m in mine_in(cells, [k]):
            d = cells[k].get(m)
            if d:
                r = med(d) / am
                if k[0] == "throughput":
                    r = 1 / r        # so that < 1 always means rawdisk is better
                rows.append(("%s %s %s" % (k[1], k[2], LABEL[m]), r))
    if rows:
        fig, ax = plt.subplots(figsize=(8, 0.22 * len(rows) + 1))
        ys = range(len(rows))
        ax.barh(ys, [r for _, r in rows],
                color=["#2ca02c" if r <= 0.9 else "#ff7f0e" if r <= 1.0 else "#d62728"
                       for _, r in rows])
        ax.set_yticks(list(ys))
        ax.set_yticklabels([n for n, _ in rows], fontsize=6)
        ax.invert_yaxis()
        ax.axvline(0.9, color="k", ls="--", lw=0.8)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("rawdisk median / faster anchor median (time; inverse for MiB/s): "
                      "< 0.9 = goal met", fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(outdir, "ratio-to-faster-anchor.png"), dpi=90)
        plt.close(fig)


def convert_like(cells, cpu):
    """Convert rows like for like: rawdisk through the page cache against
    the faster of nbdkit and qemu-nbd (by median), --cache none against
    qemu-nbd-direct; seconds and server CPU as paired ratios (median over
    repetitions), CPU against the leaner anchor's; then the geometric
    means (goals: time 0.85, CPU 0.70)."""
    keys = sorted((k for k in cells if k[0] == "convert"), key=lambda k: (k[1], tkey(k[2])))
    cols = [("custom", PAGE_ANCHORS), ("custom:direct", DIRECT_ANCHORS)]
    print("| workload | target | rawdisk | anchor | time | CPU | -direct | qemu-nbd-direct | time | CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios = defaultdict(list)
    for k in keys:
        row, out = cells[k], [k[1], k[2]]
        for mine, anchors in cols:
            am, an = faster_anchor("convert", row, anchors)
            cm, cn = faster_anchor("convert", cpu[k], anchors)
            if an is None or not row.get(mine):
                out += ["-"] * 4
                continue
            t, c = paired(row, mine, an), paired(cpu[k], mine, cn) if cn else None
            ratios[mine, "time"].append(t)
            if c:
                ratios[mine, "cpu"].append(c)
            v = row[mine].values()
            out += ["%s [%s-%s]" % (fmt(med(row[mine])), fmt(min(v)), fmt(max(v))),
                    ("%s %s" % (an, fmt(am))) if mine == "custom" else fmt(am),
                    "%.2f" % t, "%.2f" % c if c else "-"]
        print("| " + " | ".join(out) + " |")
    print("\nGeometric means: " + "; ".join(
        "%s time %.2f, CPU %.2f" % (LABEL[m], geomean(ratios[m, "time"]), geomean(ratios[m, "cpu"]))
        for m, _ in cols if ratios[m, "time"] and ratios[m, "cpu"]))


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    cells, fails, res, cpu = load(sys.argv[1])
    if sys.argv[2] == "--convert":
        convert_like(cells, cpu)
        return
    if sys.argv[2] == "--summary":
        summary(cells)
        return
    if sys.argv[2] == "--goals":
        goals(cells)
        return
    if sys.argv[2] == "--table":
        table(cells, fails, res)
    else:
        plots(cells, fails, sys.argv[2], cpu)


if __name__ == "__main__":
    main()
